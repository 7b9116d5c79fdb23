"""The device API held to its word: a litmus test per promise (collectives/device_api/
conformance.py's LITMUS, the kernel tests/kernels/litmus.cu) run on every wire of
conformance.WIRES, each cell of its table checked: a forbidden or refined outcome never
observed over every launch and seed, a shown one observed at least once, a refused
program refused with a clear error. Then the table of docs/device-api.md against the
data structure, and the ordering study's verdicts and the runtime's refusals against it.

Each wire is run once per module (two ranks in a ThreadWorld, one DeviceComm per seed:
LAUNCHES launches of every litmus the backend runs, ROUNDS rounds each (UNSEEDED_ROUNDS
where no seed decides anything), then a launch of the
per-context cells alone, CONTEXT_ROUNDS rounds, where they are shown: alone they meet
fewer barriers, so a held context is overtaken more often); the cells read its counts.
test_cells_over_mpi runs three wires again over network="mpi" under mpiexec (this file
is the job's script).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import WORLD_TIMEOUT, user_kernel

from commref import ThreadWorld
from commref.collectives.device_api import DeviceComm, Kernel
from commref.collectives.device_api import conformance as cf
from commref.transports.errors import CapabilityError
from commref.transports.gin import semantics
from commref.transports.gin.engines import ENGINE_ENV
from commref.transports.gin.study.cells import counted_writes_refusal, study_safe

HERE = Path(__file__).resolve().parent
KERNEL = Kernel((HERE / "kernels" / "litmus.cu").read_text(), "litmus", filename="litmus.cu")
# the seeds of the wires where one decides landing orders (the others: one run, more rounds)
SEEDS = {w: (1, 2, 3) for w in ("ordered-indep", "ordered-indep-gda", "unordered", "unordered-python", "unordered-gda")}
LAUNCHES, ROUNDS, UNSEEDED_ROUNDS = 2, 100, 400  # of every litmus, per seed
CONTEXT_ROUNDS = 300
OUTCOMES = {"A": 0, "B": 1}
# What a refused litmus is refused for, posted by every rank alone (so that each fails
# its own launch, with no put left in flight): a strong signal to the next rank.
STRONG_ALONE = Kernel(
    user_kernel("strong_alone", "  comm.signal((comm.rank() + 1) % comm.nranks(), StrongSignalInc(0));\n"),
    "strong_alone",
)


def _options(wire: cf.Wire, seed: int) -> dict:
    return dict(
        window_bytes=cf.WINDOW_BYTES,
        signals=cf.CODES,
        counters=1,
        contexts=2,
        counted_writes=True,
        device="cpu",
        seed=seed,
        **wire.options,
    )


@functools.cache
def observed(name: str) -> tuple[np.ndarray, int]:
    """observed_on(name) with the wire's GIN engine asked for (COMMREF_GIN_ENGINE)."""
    engine = cf.WIRES[name].engine
    before = os.environ.get(ENGINE_ENV)
    if engine:
        os.environ[ENGINE_ENV] = engine
    try:
        return observed_on(name)
    finally:
        if engine and before is None:
            del os.environ[ENGINE_ENV]
        elif engine:
            os.environ[ENGINE_ENV] = before


def _launches(name: str) -> list[tuple[int, int]]:
    """(mask, rounds) of each launch on wire `name`."""
    wire = cf.WIRES[name]
    launches = [(cf.mask(wire), ROUNDS if name in SEEDS else UNSEEDED_ROUNDS)] * LAUNCHES
    if any(t.cls("A", name) == cf.SHOWN for t in cf.LITMUS if t.context_cell):
        launches.append((cf.mask(wire, only_context_cells=True), CONTEXT_ROUNDS))
    return launches


def litmus_run(world, name: str, seed: int, **more):
    """One rank's run of wire `name` with `seed` (`more`: further options, network="mpi"):
    its counts (litmus.cu's) and the communicator's properties."""
    with DeviceComm(world, **_options(cf.WIRES[name], seed), **more) as dc:
        counts = np.zeros(2 * cf.CODES + 1, np.uint64)
        for m, rounds in _launches(name):
            KERNEL.launch(dc, 1, args=(m, rounds, counts))
        return counts, dc.properties()


def _checked(name: str, seed: int, mine, counts, props) -> None:
    """What a run of wire `name` must show whatever its outcomes: rank 0 (`mine`) read
    nothing, the backend and engine are the wire's, every litmus ran every round."""
    wire = cf.WIRES[name]
    assert not np.asarray(mine).any()  # rank 0 reads nothing
    assert props.gin_backend == wire.options.get("backend")
    assert props.gin_engine == (wire.engine or _default_engine(wire)), (name, props.gin_engine)
    ran = sum(rounds * bin(m).count("1") for m, rounds in _launches(name))
    assert counts[-1] == ran, f"{name}, seed {seed}: {counts[-1]} litmus runs, not {ran}"


def _summary(total) -> dict:
    at = {f"{t.name}/{o}": 2 * t.code + i for t in cf.LITMUS for o, i in OUTCOMES.items() if o in t.outcomes}
    return {k: int(total[i]) for k, i in at.items() if total[i]}


def observed_on(name: str) -> tuple[np.ndarray, int]:
    """Rank 1's stale reads per outcome (litmus.cu's counts) summed over the seeds of
    wire `name`, and the number of seeds."""
    total = np.zeros(2 * cf.CODES + 1, np.uint64)
    start = time.monotonic()
    for seed in SEEDS.get(name, (1,)):
        (mine, _), (counts, props) = ThreadWorld.run(2, litmus_run, name, seed, timeout=WORLD_TIMEOUT)
        _checked(name, seed, mine, counts, props)
        total += counts
    print(f"{name}: {time.monotonic() - start:.1f} s, stale reads {_summary(total)}")
    return total, len(SEEDS.get(name, (1,)))


def _default_engine(wire: cf.Wire) -> str | None:
    """The engine a wire gets unasked: the native engine for every GIN wire here."""
    return None if wire.options["path"] == "lsa" else "native"


CELLS = [(t.name, o, w) for t in cf.LITMUS for o in sorted(t.outcomes) for w in cf.WIRES if t.cls(o, w) != cf.REFUSED]


@pytest.mark.parametrize("litmus, outcome, wire", CELLS, ids=[f"{t}-{o}-{w}" for t, o, w in CELLS])
def test_cell(litmus, outcome, wire):
    """A forbidden or refined outcome is never observed; a shown one is, at least once."""
    t = cf.BY_NAME[litmus]
    counts, seeds = observed(wire)
    stale = int(counts[2 * t.code + OUTCOMES[outcome]])
    cls = t.cls(outcome, wire)
    if cls == cf.SHOWN:
        assert stale > 0, f"{litmus} {outcome} on {wire}: allowed, yet not observed over {seeds} seed(s)"
    else:
        assert stale == 0, f"{litmus} {outcome} on {wire} is {cls}, yet observed {stale} times: {t.promise}"


REFUSED = sorted({(t.name, w) for t in cf.LITMUS for o in t.outcomes for w in cf.WIRES if t.cls(o, w) == cf.REFUSED})


@pytest.mark.parametrize("litmus, wire", REFUSED, ids=[f"{t}-{w}" for t, w in REFUSED])
def test_refused_cell(litmus, wire):
    """A program the backend cannot run is refused clearly: the communicator that requires
    strong signals is refused at creation (CapabilityError naming them), and the kernel
    that posts one on a weak-only communicator fails its launch (ValueError naming the
    flag), without a hang. The refused program is the strong signal every strong litmus
    posts (STRONG_ALONE, on every rank)."""
    t, w = cf.BY_NAME[litmus], cf.WIRES[wire]
    assert t.strong and not w.strong  # the one refusal the table holds

    def body(world):
        options = _options(w, 1)
        with pytest.raises(CapabilityError, match="strong signals"):
            DeviceComm(world, **{**options, "strong_signals": True})
        with DeviceComm(world, **options, timeout=10) as dc:
            start = time.monotonic()
            with pytest.raises(ValueError, match=rf"^rank {world.rank}: a device-API call in block 0 was given "):
                STRONG_ALONE.launch(dc, 1)
            assert time.monotonic() - start < 10

    ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)


def test_every_promise_has_a_forbidden_cell_and_every_freedom_is_shown_somewhere():
    """The suite tries to break every litmus somewhere, and every freedom it names is
    produced by some wire (the adversarial ones)."""
    for t in cf.LITMUS:
        classes = {t.cls(o, w) for o in t.outcomes for w in cf.WIRES}
        assert classes <= set(cf.CLASSES), t.name
        assert cf.FORBIDDEN in classes or cf.SHOWN in classes, t.name
        for o in t.outcomes:
            allowed = [w for w in cf.WIRES if t.cls(o, w) in (cf.SHOWN, cf.REFINED)]
            assert not allowed or any(t.cls(o, w) == cf.SHOWN for w in allowed), (t.name, o)
    per_context = [t for t in cf.LITMUS if t.context_cell]
    assert per_context and all(t.cls("A", "ordered-indep") == cf.SHOWN for t in per_context)
    assert sorted(t.code for t in cf.LITMUS) == list(range(cf.CODES))


def test_litmus_codes_match_the_kernel():
    """conformance.py's codes are litmus.cu's enum, name for name."""
    source = KERNEL.source
    enum = dict(re.findall(r"^\s*k(\w+) = (\d+),?\s*(?://|$)", source, flags=re.MULTILINE))
    assert int(enum.pop("LitmusCodes")) == cf.CODES
    camel = {"".join(p.capitalize() for p in t.name.split("-")): t.code for t in cf.LITMUS}
    assert {k: int(v) for k, v in enum.items()} == camel


def test_the_docs_table_is_the_data_structure():
    doc = (HERE.parent / "docs" / "device-api.md").read_text()
    assert cf.table() in doc, "docs/device-api.md's conformance table differs from conformance.table()"


def test_the_study_agrees_with_the_table():
    """Where the ordering study has a cell for a litmus, its verdict is the table's: safe
    exactly where the stale read of A is forbidden (refused cells aside)."""
    checked = 0
    for t in cf.LITMUS:
        if t.study is None:
            continue
        row, strength, _ = t.study
        for name, w in cf.WIRES.items():
            column, cls = cf.study_column(t, w), t.cls("A", name)
            if column is None or cls == cf.REFUSED:
                continue
            assert study_safe(row, column, strength) == (cls == cf.FORBIDDEN), (t.name, name, row, column, cls)
            checked += 1
    assert checked == 54  # 7 litmus with a study cell x 9 GIN wires, less the 9 refused


def test_the_runtime_refusals_agree_with_the_table_and_the_study():
    """The runtime refuses counted writes exactly where the study finds them unsafe, on
    no wire of the table (their cells are forbidden everywhere, never refused), and on a
    wire that places writes twice; and strong signals are refused on exactly the wires
    whose strong litmus cells are refused."""
    counted = cf.BY_NAME["counted-write"]
    for name, w in cf.WIRES.items():
        transport = None if w.column is None else semantics.Transport(name, ordered=w.column == "ordered")
        assert counted_writes_refusal(transport) is None
        assert counted.cls("A", name) == cf.FORBIDDEN
    twice = semantics.Transport("unordered+duplicates", ordered=False, duplicates=True)
    assert not study_safe("counted-writes", "unordered+duplicates")
    assert "unsafe" in counted_writes_refusal(twice)
    for name, w in cf.WIRES.items():
        strong_cells = {t.cls(o, name) for t in cf.LITMUS if t.strong for o in t.outcomes}
        assert (strong_cells == {cf.REFUSED}) == (not w.strong), name


def test_a_strong_signal_carried_weak_is_caught(monkeypatch):
    """The suite can fail: a proxy that carries every strong signal as weak (the planted
    bug of test_gin_conformance, where the proxy decodes descriptors) makes the forbidden
    stale reads of the strong litmus show on the unordered wire."""
    from commref.device_kernels import abi
    from commref.transports.gin.proxy import GinProxy

    original = GinProxy._execute

    def weak(self, d):
        if d.flags & abi.GIN_HAS_SIGNAL and d.flags & abi.GIN_STRONG:
            d = d._replace(flags=d.flags & ~abi.GIN_STRONG)
        original(self, d)

    monkeypatch.setattr(GinProxy, "_execute", weak)
    monkeypatch.setenv(ENGINE_ENV, "python")  # the proxy decodes there; the native engine has PLANT
    strong = [cf.BY_NAME["strong-covers-earlier"], cf.BY_NAME["strong-signal-alone"]]

    def body(world):
        with DeviceComm(world, **_options(cf.WIRES["unordered-python"], 1)) as dc:
            counts = np.zeros(2 * cf.CODES + 1, np.uint64)
            KERNEL.launch(dc, 1, args=(sum(1 << t.code for t in strong), ROUNDS, counts))
            return counts

    counts = ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)[1]
    stale = {t.name: int(counts[2 * t.code]) for t in strong}
    print(f"strong signals carried weak, unordered wire: stale reads of A {stale} in {ROUNDS} rounds")
    assert all(stale.values()), stale


# Over MPI (network="mpi", 2 processes; this file is the job's script): the wires whose
# links the MPI network carries, with their seeds, their cells as in the table.
MPI_WIRES = {"ordered": (1,), "unordered-python": (1, 2), "unordered-gda": (1, 2)}


def _mpi_main() -> None:
    from commref import MPIWorld

    world = MPIWorld()
    for name, seeds in MPI_WIRES.items():
        counts = np.zeros(2 * cf.CODES + 1, np.uint64)
        os.environ.pop(ENGINE_ENV, None)
        if cf.WIRES[name].engine:
            os.environ[ENGINE_ENV] = cf.WIRES[name].engine
        for seed in seeds:
            more, props = litmus_run(world, name, seed, network="mpi", timeout=WORLD_TIMEOUT)
            counts += more
        line = dict(wire=name, rank=world.rank, counts=counts.tolist(), backend=props.gin_backend)
        sys.stdout.write("LITMUS " + json.dumps({**line, "engine": props.gin_engine}) + "\n")
        sys.stdout.flush()
    world.barrier(what="litmus over MPI done")


def test_cells_over_mpi():
    """The litmus over the MPI network (2 processes under mpiexec): every forbidden or
    refined cell unseen, every shown one seen, on each wire of MPI_WIRES."""
    from conftest import clean_env, run_mpi

    proc = run_mpi(2, [os.path.relpath(__file__, HERE.parent)], timeout=180, env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    runs = [json.loads(line[len("LITMUS ") :]) for line in proc.stdout.splitlines() if line.startswith("LITMUS ")]
    assert sorted((r["wire"], r["rank"]) for r in runs) == sorted((w, r) for w in MPI_WIRES for r in (0, 1)), out
    by = {(r["wire"], r["rank"]): r for r in runs}
    for name in MPI_WIRES:
        counts = np.array(by[name, 1]["counts"], np.uint64)
        props = cf.WIRES[name]
        assert by[name, 1]["backend"] == props.options.get("backend")
        assert not any(by[name, 0]["counts"]), by[name, 0]  # rank 0 reads nothing
        ran = len(MPI_WIRES[name]) * sum(rounds * bin(m).count("1") for m, rounds in _launches(name))
        assert counts[-1] == ran, (name, int(counts[-1]), ran)
        print(f"{name} over MPI ({by[name, 1]['engine']} engine): stale reads {_summary(counts)}")
        for t in cf.LITMUS:
            for o in t.outcomes:
                cls, stale = t.cls(o, name), int(counts[2 * t.code + OUTCOMES[o]])
                if cls == cf.SHOWN:
                    assert stale > 0, f"{t.name} {o} over MPI on {name}: allowed, yet not observed"
                elif cls != cf.REFUSED:
                    assert stale == 0, f"{t.name} {o} over MPI on {name} is {cls}, yet observed {stale} times"


if __name__ == "__main__":
    _mpi_main()
