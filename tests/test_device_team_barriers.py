"""The rail and hybrid barriers (device.h: railBarrier, hybridBarrier, block-wide and in
a warp scope) held to their contracts: tests/kernels/team_barriers.cu has every rank put
to every peer, meet at the barrier and read every peer's word, counting the stale reads
of the puts the barrier promises to make visible (none allowed) apart from the others
(a put to a rank outside the poster's rail, a put past a fence of level None: the
unordered wire shows them stale). On LSA and GIN, the ordered and unordered wires, at 2
and 4 ranks and on 2 simulated nodes; then each refusal, and the resetSignal race."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import WORLD_TIMEOUT, nvcc_sm90, user_kernel

from commref import CapabilityError, DeviceRequirements, ThreadWorld
from commref.collectives.device_api import DeviceComm, Kernel
from commref.collectives.device_api import conformance as cf
from commref.transports.gin.engines import ENGINE_ENV
from commref.transports.nodes import NODES_ENV

HERE = Path(__file__).resolve().parent
SOURCE = (HERE / "kernels" / "team_barriers.cu").read_text()
KERNEL = Kernel(SOURCE, "team_barriers", filename="team_barriers.cu")
ROUNDS = 150
# Rounds of a cell that must show a stale read: 300 missed the hybrid barrier's cross-rail
# put on 2x2 nodes in 2 of 8 runs (1500: none in 10 runs of every such cell).
SHOWN_ROUNDS = 1500
LAYOUTS = {
    "lsa-2": (2, None, dict(path="lsa")),
    "gin-2": (2, None, dict(path="gin")),
    "gin-4": (4, None, dict(path="gin")),
    "nodes-2x2": (4, "2", dict(path="auto")),
}
WIRES = {"ordered": dict(wire="ordered"), "unordered": dict(wire="unordered", seed=7)}


def _stale(layout, wire, kind, fence, fenced, monkeypatch, rounds=ROUNDS):
    n, nodes, options = LAYOUTS[layout]
    if nodes:
        monkeypatch.setenv(NODES_ENV, nodes)
    options = {**options, **({} if options["path"] == "lsa" else WIRES[wire])}

    def body(world):
        with DeviceComm(world, window_bytes=64, contexts=2, device="cpu", **options) as dc:
            stale = np.zeros(2, np.int64)
            for _ in range(2):
                KERNEL.launch(dc, 1, block=32 if kind >= 2 else None, args=(kind, rounds, fence, fenced, stale))
            return stale.tolist()

    out = ThreadWorld.run(n, body, timeout=WORLD_TIMEOUT)
    print(f"{layout} {wire} kind {kind} fence {fence}/{fenced}: stale (covered, not covered) {out}")
    return out


CASES = [(layout, wire) for layout in LAYOUTS for wire in WIRES if not (layout.startswith("lsa") and wire != "ordered")]
COLUMNS = {f"{layout}-{wire}" if not layout.startswith("lsa") else layout: (layout, wire) for layout, wire in CASES}
# Every row of docs/device-api.md's team-barrier table (conformance.TEAM_BARRIERS) in
# every column, and each cell where an uncovered stale read is shown.
ROWS = {b.name: b for b in cf.TEAM_BARRIERS}
SHOWN = [(b.name, c) for b in cf.TEAM_BARRIERS for c in b.shown]


def test_the_columns_are_the_tables():
    assert tuple(COLUMNS) == cf.TEAM_BARRIER_COLUMNS
    assert all(c in COLUMNS for _, c in SHOWN)


@pytest.mark.parametrize("column", list(COLUMNS))
@pytest.mark.parametrize("row", list(ROWS))
def test_what_the_barrier_promises_is_never_stale(row, column, monkeypatch):
    b = ROWS[row]
    assert b.cls("covered", column) == cf.FORBIDDEN
    out = _stale(*COLUMNS[column], b.kind, b.fence, b.fenced, monkeypatch)
    assert [covered for covered, _ in out] == [0] * len(out), out


@pytest.mark.parametrize("row, column", SHOWN, ids=[f"{r}-{c}" for r, c in SHOWN])
def test_what_it_leaves_out_is_shown_stale(row, column, monkeypatch):
    """Past a fence of level None, on a context it does not fence, or (hybrid on 2x2
    nodes) a GIN put to a rank outside the poster's rail: some read is stale."""
    b = ROWS[row]
    out = _stale(*COLUMNS[column], b.kind, b.fence, b.fenced, monkeypatch, rounds=SHOWN_ROUNDS)
    assert [covered for covered, _ in out] == [0] * len(out), out
    assert sum(other for _, other in out) > 0, out


def test_the_docs_team_barrier_table_is_the_data_structure():
    doc = (HERE.parent / "docs" / "device-api.md").read_text()
    assert cf.team_barrier_table() in doc, "docs/device-api.md's team-barrier table differs from conformance's"


# Round i: every rank putValues its stamp of the round to every peer's word 16 + 8 r on
# context i % 2, then a barrier fencing context 0 (`kind` 0: the world barrier, 1: the
# rail barrier, 2: the hybrid barrier in a warp scope); in the rounds on context 0, every
# rank reads the word of every peer; then barrier() (every context). The put of round
# i - 1, on context 1, came before that barrier(): it must not land over round i's.
# Arguments: kind, rounds, the counts (int64[2]: [0] the reads in rounds on context 0
# that are not the round's value, [1] the reads).
OVERWRITE = user_kernel(
    "overwrite",
    r"""  const uint64_t kind = comm.u64(0), rounds = comm.u64(1);
  int64_t* stale = comm.ptr<int64_t>(2);
  const int n = comm.nranks(), r = comm.rank();
  for (uint64_t i = 0; i < rounds; i++) {
    const uint64_t stamp = comm.launch() << 40 | (i + 1) << 8 | (uint64_t)r;
    for (int k = 1; k < n; k++) comm.gin((int)(i % 2)).putValue(CoopWarp(), (r + k) % n, 16 + 8 * r, stamp);
    if (kind == 0) comm.barrier(CoopWarp(), GinFenceLevel::Puts, 0);
    if (kind == 1) comm.railBarrier(CoopWarp(), GinFenceLevel::Puts, 0);
    if (kind == 2) comm.hybridBarrier(CoopWarp(), GinFenceLevel::Puts, 0);
    __syncthreads();
    if (threadIdx.x == 0 && i % 2 == 0)
      for (int j = 0; j < n; j++) {
        if (j == r) continue;
        stale[1]++;
        if (load_relaxed(comm.local<uint64_t>(16 + 8 * j)) != (comm.launch() << 40 | (i + 1) << 8 | (uint64_t)j))
          stale[0]++;
      }
    comm.barrier();
  }
""",
)


@pytest.mark.parametrize("engine", ["native", "python"])
@pytest.mark.parametrize("kind", [0, 1, 2], ids=["world", "rail", "hybrid"])
def test_a_put_before_a_fenced_barrier_never_lands_over_one_after_it(kind, engine, monkeypatch):
    """A rank's putValue on context 1 before barrier() (every context fenced), and its
    putValue to the same word on context 0 after it: after a barrier fencing context 0,
    every peer reads the later value (the first barrier orders the earlier put before
    everything after it, on every rank), on the unordered wire, where contexts overtake
    each other."""
    monkeypatch.setenv(ENGINE_ENV, engine)
    kernel = Kernel(OVERWRITE, "overwrite")
    rounds = 300 if engine == "native" else 100

    def body(world):
        with DeviceComm(world, window_bytes=64, contexts=2, device="cpu", path="gin", wire="unordered", seed=7) as dc:
            stale = np.zeros(2, np.int64)
            for _ in range(2):
                kernel.launch(dc, 1, block=32, args=(kind, rounds, stale))
            return stale.tolist()

    out = ThreadWorld.run(4, body, timeout=WORLD_TIMEOUT)
    print(f"kind {kind} on the {engine} engine: (stale, reads) per rank {out}")
    assert out == [[0, 2 * (rounds // 2) * 3]] * 4, out


def test_a_rail_barrier_on_scattered_nodes_fails_the_launch(monkeypatch):
    """5 ranks on 2 nodes (3 + 2): no strided rail; the launch fails with the team
    refusal on every rank, before anything is posted (no deadline reached)."""
    monkeypatch.setenv(NODES_ENV, "2")
    kernel = Kernel(user_kernel("rail_only", "  comm.railBarrier();\n  comm.hybridBarrier();\n"), "rail_only")

    def body(world):
        with DeviceComm(world, window_bytes=64, device="cpu", path="auto", timeout=10) as dc:
            assert not dc.strided_teams and dc.properties().rail_barriers == 0
            with pytest.raises(ValueError, match=rf"^rank {world.rank}: .*the team is not a strided team here"):
                kernel.launch(dc, 1)
        return True

    assert ThreadWorld.run(5, body, timeout=WORLD_TIMEOUT) == [True] * 5


@pytest.mark.parametrize("field", ["rail_barriers", "hybrid_barriers"])
def test_rail_and_hybrid_requirements_on_scattered_nodes_are_refused(field, monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")

    def body(world):
        reqs = DeviceRequirements(**{field: 1})
        with pytest.raises(CapabilityError, match=rf"^rank {world.rank}: 1 {field.split('_')[0]} barriers? required"):
            DeviceComm(world, window_bytes=64, device="cpu", path="auto", requirements=reqs)
        return True

    assert ThreadWorld.run(5, body, timeout=WORLD_TIMEOUT) == [True] * 5


def test_rail_and_hybrid_requirements_on_even_nodes_are_met(monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")

    def body(world):
        reqs = DeviceRequirements(barriers=1, lsa_barriers=1, rail_barriers=1, hybrid_barriers=1)
        with DeviceComm(world, window_bytes=64, device="cpu", path="auto", requirements=reqs) as dc:
            p = dc.properties()
            return p.barriers, p.lsa_barriers, p.rail_barriers, p.hybrid_barriers

    assert ThreadWorld.run(4, body, timeout=WORLD_TIMEOUT) == [(1, 1, 1, 1)] * 4


# Rank 0 sends 400 signals alone (weak) to rank 1 in batches; rank 1 reads the signal
# until the first has landed, resets it while the others may still land, and after a barrier() (every signal has landed)
# reads it. Arguments: the results (uint64[3] of rank 1: the count the wait saw, the
# value after the barrier, the count of reads that went backwards while no reset ran).
RESET_RACE = user_kernel(
    "reset_race",
    r"""  const uint64_t sent = 400;
  uint64_t* out = comm.ptr<uint64_t>(0);
  if (comm.rank() == 0)
    for (uint64_t i = 0; i < sent; i++) {
      comm.signal(1, WeakSignalInc(0));
      if (i % 16 == 15) comm.flush();  // rings the doorbells: the signals are in flight
    }
  if (comm.rank() == 1) {
    uint64_t last = 0, backwards = 0;
    for (uint64_t v = 0; v < 1; last = v) {
      v = comm.readSignal(0);
      if (v < last) backwards++;
    }
    const uint64_t seen = comm.waitSignal(0, 1, 0);
    comm.resetSignal(0);
    if (threadIdx.x == 0) out[0] = seen, out[2] = backwards;
  }
  comm.barrier();
  if (comm.rank() == 1 && threadIdx.x == 0) out[1] = comm.readSignal(0);
  comm.barrier();
""",
)


@pytest.mark.parametrize("path", ["lsa", "gin-ordered", "gin-unordered"])
def test_a_reset_racing_increments_erases_those_before_it(path):
    """The documented outcome (device.h's resetSignal): the value after the race counts
    only increments that landed after the reset, at most those not yet seen when it ran,
    and never a torn value; reads racing increments never go backwards."""
    options = {"lsa": dict(path="lsa"), "gin-ordered": dict(path="gin")}.get(
        path, dict(path="gin", wire="unordered", seed=3)
    )
    kernel = Kernel(RESET_RACE, "reset_race")

    def body(world):
        with DeviceComm(world, window_bytes=64, signals=1, device="cpu", **options) as dc:
            out = np.zeros(3, np.uint64)
            kernel.launch(dc, 1, args=(out,))
            return out.tolist()

    seen, after, backwards = ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)[1]
    print(f"{path}: the wait saw {seen}, after the reset and the barrier {after} of 400")
    assert 1 <= seen <= 400 and backwards == 0
    assert after <= 400 - seen  # the increments before the reset are gone


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs nvcc (a compile check)")
def test_team_barrier_kernels_build_for_sm90(tmp_path):
    for name, src in (("team_barriers", SOURCE), ("reset_race", RESET_RACE)):
        path = tmp_path / f"{name}.cu"
        path.write_text(src)
        proc = nvcc_sm90(path, tmp_path / f"{name}.cubin", timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
