"""The native GIN engine's traces replayed against semantics.enabled():
the collectives over GIN ordered on the native engine, every backend that runs the
ordered wire, ThreadWorld (shm) and 2 MPI ranks (shm and mpi), each link's native trace
replayed by the replay test_gin_conformance.py runs on the Python proxy's traces; a
planted violation in the native trace path (a signal decoded before its data) is
caught; a trace that overflowed the engine's buffer is refused.

Also an MPI job script: under mpiexec, `_mpi_main` runs the conformance sweep on every
rank.
"""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
from conftest import clean_env, run_mpi
from helpers import WORLD_TIMEOUT, collectives_run, mixed_posts, posted, trace_kinds

from commref.transports.gin.replay import Disallowed, replay_trace
from commref.transports.thread_world import ThreadWorld

# ---------------------------------------------------------------------------------------
# conformance: the native engine's traces replayed against semantics.enabled()
# ---------------------------------------------------------------------------------------

# (backend, protocol) for every backend that runs the ordered wire: test_gin_conformance.MATRIX's ordered rows,
# and gda's flush-signal (its flushes are recorded on every link of the context and mark the next put)
ORDERED = [
    ("proxy", "strong"),
    ("rc", "strong"),
    ("rc", "weak-last"),
    ("gda", "signal-per-put"),
    ("gda", "flush-signal"),
]
CONFORMANCE_SEEDS = (1, 2)
# (backend, protocol) on the unordered wire in the mpiexec job (ThreadWorld's rows:
# tests/test_gin_native_unordered.py)
UNORDERED = [("proxy", "strong"), ("gda", "flush-signal")]


def _native_conformance(world, backend, protocol, seeds, network="shm", wire="ordered"):
    """collectives_run on the native engine (COMMREF_GIN_ENGINE=native: a communicator it
    cannot carry fails); per seed (trace, wrong)."""
    return [
        (trace, wrong) for trace, wrong, _ in collectives_run(world, backend, wire, protocol, seeds, network=network)
    ]


@pytest.mark.parametrize(
    "nranks, backend, protocol", [(2, *o) for o in ORDERED] + [(3, "proxy", "strong"), (3, "gda", "flush-signal")]
)
def test_collectives_over_native_engine_conform(nranks, backend, protocol, native):
    """Each rank's native trace, link by link, against semantics.enabled() (the replay
    test_gin_conformance.py runs on the Python proxy's traces): every post, data and
    signal event; every posted put lands."""
    results = ThreadWorld.run(nranks, _native_conformance, backend, protocol, list(CONFORMANCE_SEEDS), timeout=120)
    total, kinds = {}, {}
    for rank, per_seed in enumerate(results):
        for seed, (trace, wrong) in zip(CONFORMANCE_SEEDS, per_seed):
            assert trace, f"rank {rank} seed {seed}: empty trace"
            assert protocol == "weak-last" or wrong == 0, (rank, seed, wrong)
            for key, n in replay_trace(trace, backend, "ordered").items():
                total[key] = total.get(key, 0) + n
            for key, n in trace_kinds(trace).items():
                kinds[key] = kinds.get(key, 0) + n
    assert total["seg"] > 100 and total["signal"] > 20, total
    assert total["post"] == kinds["post"] and total["signal"] == kinds["signal"], (total, kinds)
    assert kinds["data"] > 0 and "doorbell" not in kinds, kinds  # an ordered wire's connections ring none
    assert protocol != "flush-signal" or kinds["flush"] > 0, kinds


def _swap_signal_before_data(records: np.ndarray) -> np.ndarray:
    """The planted bug: each put's signal record moved before its data record (a decode
    that reports, or an engine that makes, the signal land first)."""
    from commref.transports.gin import native as nat

    r = records.copy()
    k = 0
    while k + 1 < len(r):
        a, b = r[k], r[k + 1]
        if (
            a["kind"] == nat.DATA
            and b["kind"] == nat.SIGNAL
            and a["seq"] == b["seq"]
            and (a["peer"], a["ctx"]) == (b["peer"], b["ctx"])
        ):
            r[k], r[k + 1] = b.copy(), a.copy()
            k += 2
        else:
            k += 1
    return r


def test_replay_catches_a_signal_before_its_data_in_the_native_trace(native, monkeypatch):
    """Planted violation in the native trace path: native.decode_trace sees every put's
    signal record before its data record. The replay must fail on every rank and seed
    (on the ordered wire a signal, weak or strong, needs its own data first)."""
    from commref.transports.gin import native as nat

    decode = nat.decode_trace
    monkeypatch.setattr(nat, "decode_trace", lambda records, into: decode(_swap_signal_before_data(records), into))
    results = ThreadWorld.run(2, _native_conformance, "proxy", "strong", [1], timeout=120)
    caught = []
    for per_seed in results:
        for trace, wrong in per_seed:
            assert wrong == 0  # the landings were right; only the record of them is wrong
            with pytest.raises(Disallowed, match=r"\('signal', \d+\)\): signal of put"):
                replay_trace(trace, "proxy", "ordered")
            caught.append(trace)
    assert len(caught) == 2


def test_a_corrupted_native_trace_fails_the_replay():
    """The same host-posted sequence as the comparison above, its native trace corrupted
    three ways: a data record dropped (its put never lands), a post dropped (events of a
    put never posted), a later put (data and strong signal) landed before an earlier one."""
    posts = mixed_posts()
    nat = ThreadWorld.run(3, posted, "native", "proxy", posts, timeout=WORLD_TIMEOUT)[0][0]
    trace = nat["trace"]
    replay_trace(trace, "proxy", "ordered")
    link = trace[(1, 0)]
    assert [r[:2] for r in link[:8]] == [
        ("post", 0),
        ("data", 0),
        ("counter", 0),
        ("signal", 0),
        ("doorbell", 1),
        ("post", 1),
        ("data", 1),
        ("signal", 1),
    ]
    bad = {
        "data dropped": [r for r in link if r != ("data", 1)],
        "post dropped": link[1:],
        "put 1 before put 0": link[:1] + link[5:8] + link[1:5] + link[8:],
    }
    for name, records in bad.items():
        with pytest.raises(Disallowed):
            replay_trace({**trace, (1, 0): records}, "proxy", "ordered")
        assert name


def test_an_overflowed_native_trace_is_refused():
    """More records than the engine's buffer holds between reads: the trace is refused with
    the count lost, never returned with holes; the landings themselves are unaffected."""
    posts = mixed_posts()
    res, _ = ThreadWorld.run(3, posted, "native", "proxy", posts, timeout=WORLD_TIMEOUT, trace_capacity=10)[0]
    err = res["trace"]
    assert res["error"] is None and res["stats"] == {"ops": len(posts), "doorbells": 13, "events": 12, "by_kernels": 0}
    assert re.fullmatch(
        r"rank 0: the native GIN engine's trace overflowed: \d+ records not kept \(capacity 10 "
        r"records between reads of NativeProxy.trace; .*\)",
        str(err),
    ), err


@pytest.mark.mpi
def test_collectives_over_native_engine_conform_under_mpiexec(shm_leak_check):
    """2 MPI processes, networks shm and mpi, the ordered backends and two unordered rows,
    1 seed each: this file is the job's script; each rank replays its own trace."""
    proc = run_mpi(
        2,
        [os.path.relpath(__file__, os.path.dirname(os.path.dirname(__file__))), "1"],
        timeout=120,
        env=clean_env(COMMREF_GIN_ENGINE="native"),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "DISALLOWED" not in proc.stdout, proc.stdout[-4000:]
    lines = set(
        re.findall(
            r"rank (\d) (\S+) ((?:un)?ordered) (\S+) network (\S+) seed (\d+): conforms [^\n]*? "
            r"wrong 0 engine (native|auto|python)",
            proc.stdout,
        )
    )
    assert len(lines) == 2 * (len(ORDERED) + len(UNORDERED)) * 2, out[-4000:]
    assert sum(m[2] == "unordered" for m in lines) == 2 * len(UNORDERED) * 2, lines
    assert {m[6] for m in lines} == {"native"} and {m[4] for m in lines} == {"shm", "mpi"}, lines


def _mpi_main(seeds: list[int]) -> None:
    """Run under mpiexec with COMMREF_GIN_ENGINE=native (a communicator the native engine
    cannot carry fails at setup, so every trace below is the native engine's)."""
    from commref.transports.mpi_world import MPIWorld

    world = MPIWorld()
    engine = os.environ.get("COMMREF_GIN_ENGINE", "auto")
    rows = [(o, "ordered") for o in ORDERED] + [(u, "unordered") for u in UNORDERED]
    for ((backend, protocol), wire), network in ((r, n) for r in rows for n in ("shm", "mpi")):
        for seed, (trace, wrong) in zip(seeds, _native_conformance(world, backend, protocol, seeds, network, wire)):
            where = f"rank {world.rank} {backend} {wire} {protocol} network {network} seed {seed}"
            try:
                counts = replay_trace(trace, backend, wire)
                line = (
                    f"{where}: conforms {counts['post']} posts {counts['seg']} segments {counts['signal']} "
                    f"signals wrong {wrong} engine {engine}"
                )
            except Disallowed as e:
                line = f"{where}: DISALLOWED {e}"
            sys.stdout.write(line + "\n")  # one write: the two ranks' lines share mpiexec's stdout
            sys.stdout.flush()
    world.barrier(what="native conformance done")


if __name__ == "__main__":
    _mpi_main([int(s) for s in sys.argv[1:]] or list(CONFORMANCE_SEEDS))
    sys.exit(0)
