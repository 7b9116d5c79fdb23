"""The native GIN engine (transports/gin/native.py, native_engine.cpp): the default for
the ordered wire, on network shm and (built against the MPI mpi4py loaded) network mpi.

- choice: plan.GinPlan.start_proxy picks NativeProxy for ordered shm, GinProxy for the
  unordered wire and with an observer; COMMREF_GIN_ENGINE forces one or is refused;
- exactness: the collectives over GIN ordered shm on every backend that runs the ordered
  wire (proxy, rc, gda), ThreadWorld 2 and 3 ranks, and 2 MPI ranks (`commref check`);
- trace: the native engine's trace (post, data, signal, counter, flush, doorbell, get per
  (peer, ctx)) equals the Python proxy's for the same posted sequence (host-posted
  descriptors, and a collective on one channel), record for record;
- conformance: the collectives over GIN ordered on the native engine, every backend
  that runs the ordered wire, ThreadWorld (shm) and 2 MPI ranks (shm and mpi), each
  link's native trace
  replayed against semantics.enabled() by test_gin_conformance.py's replay; a planted
  violation in the native trace path (a signal decoded before its data) is caught; a
  trace that overflowed the engine's buffer is refused;
- refusals: the same messages as proxy.py's _remote_action, with the abort word raised;
- lifecycle: quiesce names what it waited for at its deadline, stop is idempotent, a dead
  engine makes kernels fail instead of hanging.
"""

from __future__ import annotations

import os
import re
import sys
import time

import numpy as np
import pytest

from commref.collectives import check
from commref.collectives.communicator import Communicator
from commref.device_kernels import abi
from commref.transports.errors import CapabilityError
from commref.transports.gin import semantics
from commref.transports.gin.backends import BACKENDS
from commref.transports.world import ThreadWorld

from conftest import clean_env, run_mpi
from test_gin import _run_sweep, many_channels  # noqa: F401 (a fixture)
from test_gin_conformance import Disallowed, collectives_run, replay_trace

WORLD_TIMEOUT = 30.0


@pytest.fixture
def native(monkeypatch):
    """Every communicator of the test must run the native engine (else it fails to start)."""
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "native")


# ---------------------------------------------------------------------------------------
# which engine
# ---------------------------------------------------------------------------------------


def _engine_kind(world, wire, network="shm"):
    comm = Communicator(world, "cpu", timeout=WORLD_TIMEOUT, path="gin", wire=wire, network=network)
    try:
        return type(comm.proxy).__name__
    finally:
        world.barrier(what="kind")
        comm.close()


def test_ordered_shm_runs_native_and_the_rest_python(monkeypatch):
    monkeypatch.delenv("COMMREF_GIN_ENGINE", raising=False)
    assert ThreadWorld.run(2, _engine_kind, "ordered", timeout=WORLD_TIMEOUT) == ["NativeProxy"] * 2
    assert ThreadWorld.run(2, _engine_kind, "unordered", timeout=WORLD_TIMEOUT) == ["GinProxy"] * 2
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "python")
    assert ThreadWorld.run(2, _engine_kind, "ordered", timeout=WORLD_TIMEOUT) == ["GinProxy"] * 2
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "native")
    with pytest.raises(CapabilityError, match="COMMREF_GIN_ENGINE=native: the native GIN engine cannot carry the "
                                              "unordered wire"):
        ThreadWorld.run(2, _engine_kind, "unordered", timeout=WORLD_TIMEOUT)
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "fast")
    with pytest.raises(ValueError, match="COMMREF_GIN_ENGINE must be one of auto, native, python, not 'fast'"):
        ThreadWorld.run(2, _engine_kind, "ordered", timeout=WORLD_TIMEOUT)


def test_observer_or_unordered_wire_is_not_native():
    """(network mpi is native where the engine builds against the loaded MPI: the MPI
    jobs below force COMMREF_GIN_ENGINE=native on it.)"""
    from commref.transports.gin import native
    from commref.transports.gin.observer import Observer

    assert native.supports(semantics.ORDERED, "shm") is None
    assert "observer" in native.supports(semantics.ORDERED, "shm", Observer())
    assert "network 'tcp'" in native.supports(semantics.ORDERED, "tcp")
    assert "unordered" in native.supports(semantics.UNORDERED, "shm")


def test_cli_refuses_a_bad_engine_in_one_line():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "commref.cli", "check", "allreduce", "--count", "7"],
                          env=clean_env(COMMREF_GIN_ENGINE="turbo"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("commref check: error: COMMREF_GIN_ENGINE must be one of auto, native, python, "
                                   "not 'turbo'")


# ---------------------------------------------------------------------------------------
# exactness: every collective over the native engine
# ---------------------------------------------------------------------------------------

# (nranks, backend, gin_protocol, channels, dtypes, ops): every backend that runs the ordered wire
SWEEPS = [
    (2, "proxy", "strong", 1, ["float32", "int8"], ["sum", "max"]),
    (3, "proxy", "strong", 2, ["float16", "int32"], ["sum", "min"]),
    (2, "rc", "strong", 2, ["float64"], ["sum", "avg"]),
    (3, "rc", "strong", 1, ["bfloat16"], ["max"]),
    (2, "gda", "signal-per-put", 2, ["int32"], ["sum"]),
    (3, "gda", "flush-signal", 1, ["float32"], ["sum", "prod"]),
]


@pytest.mark.parametrize("nranks, backend, protocol, channels, dtypes, ops",
                         [pytest.param(*s, id=f"{s[0]}ranks-{s[1]}-{s[2]}-{s[3]}ch") for s in SWEEPS])
def test_sweep_over_native_engine(nranks, backend, protocol, channels, dtypes, ops, many_channels, native):
    opts = dict(path="gin", backend=backend, wire="ordered", network="shm", gin_protocol=protocol,
                max_channels=channels, slot_bytes=256, segment_bytes=64)
    infos = _run_sweep(nranks, opts, dtypes, ops, [0, 1, 7, 1001, 3001])
    assert {i["backend"] for i in infos} == {backend}
    assert all(i["ops"] > 0 for i in infos), "the engines carried nothing"


@pytest.mark.mpi
@pytest.mark.parametrize("network", ["shm", "mpi"])
def test_check_over_native_engine_under_mpiexec(network, shm_leak_check):
    args = ["commref.cli", "check", "--path", "gin", "--network", network, "--wire", "ordered", "--dtype", "float32",
            "int8", "--op", "sum", "max", "--count", "0", "1", "7", "1001", "--slot-bytes", "512"]
    proc = run_mpi(2, args, timeout=90, module=True, env=clean_env(COMMREF_GIN_ENGINE="native"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "# commref check: 2 ranks, device cpu" in proc.stdout
    m = re.search(r"^# (\d+) cases, .* (\d+) wrong elements in (\d+) cases", proc.stdout, re.M)
    assert m, out[-4000:]
    # ..., + alltoall out of place (2 dtypes x 4 counts), + float32 denormal cases, + the
    # direct kernels' (they push over this engine): allreduce out of place x 2 ops x 2 dtypes
    # x 3 counts (rounded down to even: 0, 6, 1000) and float32's denormal ones, allgather
    # x 2 dtypes x 4 counts x 2, alltoall x 2 dtypes x 4 counts
    pushed = 2 * 2 * 3 + 2 * 3 + 2 * 4 * 2 + 2 * 4
    assert int(m.group(1)) == (4 * 2 + 2) * 2 * 4 * 2 + 2 * 4 + 4 * 2 * 1 * 4 + pushed, m.group(0)
    assert (int(m.group(2)), int(m.group(3))) == (0, 0), m.group(0)


# ---------------------------------------------------------------------------------------
# host-posted descriptors: trace, refusals, quiesce, stop
# ---------------------------------------------------------------------------------------

CAP = 8


def _layout():
    from commref.transports.gin.queue import queue_bytes

    lay = np.zeros((), abi.WINDOW_LAYOUT)
    lay["ginQueueOff"] = 4096
    lay["ginSignalsOff"] = 4096 + queue_bytes(CAP)
    lay["ginCountersOff"] = int(lay["ginSignalsOff"]) + 256
    return lay, int(lay["ginCountersOff"]) + 64


def _posted(world, engine: str, backend: str, posts, quiesce=True, timeout=WORLD_TIMEOUT, **proxy_kw):
    """Rank 0 runs a proxy of `engine` ("native" or "python") and posts `posts` (QueueWriter.fill
    keyword sets) to its own queue; every rank returns its window (rank 0 also the proxy's
    trace, stats, error and the abort word)."""
    from commref.transports.gin.atomics import host_atomics
    from commref.transports.gin.native import NativeProxy
    from commref.transports.gin.proxy import GinProxy, ProxyError
    from commref.transports.gin.queue import QueueWriter
    from commref.transports.windows import register_window

    lay, nbytes = _layout()
    window = register_window(world, nbytes, "cpu")
    try:
        local = window.local
        local[:2048] = ((np.arange(2048) * (world.rank + 3)) % 251 + 1).astype(np.uint8)
        world.barrier(what="sources written")
        out = None
        if world.rank == 0:
            cls = NativeProxy if engine == "native" else GinProxy
            proxy = cls(world, window, lay, CAP, BACKENDS[backend], semantics.ORDERED, "shm", 0, 64, **proxy_kw)
            proxy.trace = {}
            proxy.start()
            q = QueueWriter(local, lay, CAP, host_atomics())
            for p in posts:
                slot = q.fill(**p)
                q.publish([slot])
                deadline = time.monotonic() + timeout
                while q.consumed() <= slot and proxy.error is None:  # the queue is small
                    assert time.monotonic() < deadline, f"slot {slot} not consumed ({q.consumed()})"
                    time.sleep(1e-4)
                if proxy.error is not None:
                    break
            if quiesce:
                proxy.quiesce(timeout)
            proxy.stop()
            proxy.stop()  # idempotent
            err = proxy.error
            try:
                trace = proxy.trace
            except ProxyError as e:
                trace = e
            out = {"trace": trace, "stats": proxy.stats, "error": None if err is None else str(err),
                   "abort": int(world.abort_word[0]), "pending": proxy.pending()}
            world.abort_word[0] = 0
        world.barrier(what="landed")
        return out, local.copy()
    finally:
        window.close()


def _mixed_posts():
    put, sig, val, get = abi.GIN_PUT, abi.GIN_SIGNAL, abi.GIN_PUT_VALUE, abi.GIN_GET
    strong = abi.GIN_HAS_SIGNAL | abi.GIN_STRONG
    posts = []
    for i in range(12):
        peer, ctx = 1 + i % 2, i % 3
        if i % 4 == 0:
            posts.append(dict(op=put, flags=strong | abi.GIN_HAS_COUNTER, peer=peer, ctx=ctx, dst=1024 + 64 * i,
                              src=64 * i, nbytes=50 + i, signal=i % 5, counter=i % 3))
        elif i % 4 == 1:
            posts.append(dict(op=put, flags=0, peer=peer, ctx=ctx, dst=1024 + 64 * i, src=64 * i, nbytes=64))
        elif i % 4 == 2:
            posts.append(dict(op=val, flags=strong | abi.GIN_VA | abi.GIN_ADD, peer=peer, ctx=ctx, dst=1024 + 64 * i,
                              nbytes=0x1122334455667700 + i, signal=1900, value=7))
        else:
            posts.append(dict(op=sig, flags=abi.GIN_HAS_SIGNAL | abi.GIN_ADD, peer=peer, ctx=ctx, signal=3, value=5))
        posts.append(dict(op=abi.GIN_DOORBELL, peer=peer, ctx=ctx))
        if i == 6:  # links (1, 0), (2, 0) exist: both record it; (2, 0) posts again after it
            posts.append(dict(op=abi.GIN_FLUSH, ctx=0))
    posts.append(dict(op=get, peer=2, ctx=0, dst=1500, src=100, nbytes=40))
    posts.append(dict(op=abi.GIN_FLUSH, ctx=-1))  # no link of context -1: recorded nowhere
    posts.append(dict(op=abi.GIN_DOORBELL, peer=2, ctx=3))  # a link with a doorbell only
    posts.append(dict(op=abi.GIN_FLUSH, ctx=3))
    return posts


def _expected_posts(posts) -> dict:
    """Per (peer, ctx), the ("post", seq, offset, nbytes, signal) records `posts` make on
    backend proxy (strong and VA signals offered, adds applied)."""
    out, seqs = {}, {}
    for p in posts:
        if p["op"] in (abi.GIN_PUT, abi.GIN_PUT_VALUE, abi.GIN_SIGNAL):
            key = (p["peer"], p["ctx"])
            seq = seqs[key] = seqs.get(key, -1) + 1
            flags = p.get("flags", 0)
            sig = None
            if flags & abi.GIN_HAS_SIGNAL:
                sig = semantics.Signal(bool(flags & abi.GIN_STRONG), ("va" if flags & abi.GIN_VA else "index",
                                       p.get("signal", 0)), p.get("value", 0) if flags & abi.GIN_ADD else 1)
            nbytes = {abi.GIN_PUT: p.get("nbytes", 0), abi.GIN_PUT_VALUE: 8, abi.GIN_SIGNAL: 0}[p["op"]]
            out.setdefault(key, []).append(("post", seq, p.get("dst", 0), nbytes, sig))
    return out


def test_native_trace_and_landings_equal_the_python_proxy():
    posts = _mixed_posts()
    runs = {e: ThreadWorld.run(3, _posted, e, "proxy", posts, timeout=WORLD_TIMEOUT) for e in ("native", "python")}
    (nat, *_), (py, *_) = runs["native"][0], runs["python"][0]
    assert nat["error"] is None and py["error"] is None, (nat["error"], py["error"])
    # Record for record the same, but for where a put's counter sits: the native engine bumps
    # it once the source is copied (before the signal), the Python proxy after the signal.
    def without_counters(trace):
        return {k: [r for r in v if r[0] != "counter"] for k, v in trace.items()}

    assert without_counters(nat["trace"]) == without_counters(py["trace"])
    assert {k: [r for r in v if r[0] == "counter"] for k, v in nat["trace"].items()} == \
        {k: [r for r in v if r[0] == "counter"] for k, v in py["trace"].items()}
    for t in nat["trace"].values():
        for k, r in enumerate(t):
            if r[0] == "counter":
                assert t[k - 1] == ("data", r[1]) and t[k + 1] == ("signal", r[1]), t[k - 1:k + 2]
    assert {k: [r for r in v if r[0] == "post"] for k, v in nat["trace"].items() if k != (2, 3)} \
        == _expected_posts(posts)
    assert sorted(nat["trace"]) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (2, 3)]
    strong = semantics.Signal(True, ("index", 0), 1)
    assert nat["trace"][(1, 0)] == [
        ("post", 0, 1024, 50, strong), ("data", 0), ("counter", 0, 0), ("signal", 0), ("doorbell", 1),
        ("post", 1, 1408, 8, semantics.Signal(True, ("va", 1900), 7)), ("data", 1), ("signal", 1), ("doorbell", 2),
        ("flush",)]
    assert nat["trace"][(2, 0)][-2:] == [("doorbell", 2), ("get", 100, 1500, 40)]
    assert ("flush",) in nat["trace"][(2, 0)] and nat["trace"][(2, 0)].index(("flush",)) < max(
        k for k, r in enumerate(nat["trace"][(2, 0)]) if r[0] == "post")  # a put of ctx 0 after the flush
    assert nat["trace"][(2, 3)] == [("doorbell", 1), ("flush",)]
    counts = replay_trace(nat["trace"], "proxy", "ordered")
    assert counts["post"] == 12 and counts["signal"] == 9 and counts["counter"] == 3 and counts["get"] == 1, counts
    assert replay_trace(py["trace"], "proxy", "ordered") == counts, "the Python proxy's trace must replay alike"
    doorbells = sum(p["op"] == abi.GIN_DOORBELL for p in posts)
    assert nat["stats"] == {"ops": len(posts), "doorbells": doorbells, "events": 12, "by_kernels": 0}  # host-posted
    assert py["stats"] == {"ops": len(posts), "events": 12}  # the Python proxy does not count doorbells
    assert not nat["pending"] and nat["abort"] == 0
    for rank in range(3):  # every window byte alike: data, signals, VA words, counters, the get
        np.testing.assert_array_equal(runs["native"][rank][1], runs["python"][rank][1])
    lay, _ = _layout()
    window1 = runs["native"][1][1]
    sigs = window1[int(lay["ginSignalsOff"]):int(lay["ginSignalsOff"]) + 40].view(np.uint64)
    assert sigs.sum() > 0


def _collective_trace(world):
    comm = Communicator(world, "cpu", timeout=WORLD_TIMEOUT, slot_bytes=1024, max_channels=1, path="gin",
                        wire="ordered", network="shm")
    comm.proxy.trace = {}
    cases = check.cases(["allreduce"], ["float32"], ["sum"], ["ring"], [5000], world.size, 1, in_place=(False,))
    wrong = check.run_sweep(comm, cases)
    proxy, kind = comm.proxy, type(comm.proxy).__name__
    world.barrier(what="done")
    comm.close()
    return kind, wrong, {k: list(v) for k, v in proxy.trace.items()}


def test_collective_trace_equals_the_python_proxy(monkeypatch):
    out = {}
    for engine in ("native", "python"):
        monkeypatch.setenv("COMMREF_GIN_ENGINE", engine)
        out[engine] = ThreadWorld.run(2, _collective_trace, timeout=WORLD_TIMEOUT)
    assert [r[0] for r in out["native"]] == ["NativeProxy"] * 2 and [r[0] for r in out["python"]] == ["GinProxy"] * 2
    assert all(sum(r[1]) == 0 for e in out for r in out[e])
    for rank in range(2):
        nat, py = out["native"][rank][2], out["python"][rank][2]
        assert nat == py
        assert all(len(t) > 10 for t in nat.values())
        assert {r[0] for t in nat.values() for r in t} >= {"post", "data", "signal"}


@pytest.mark.parametrize("backend, post, message", [
    ("gda", dict(op=abi.GIN_SIGNAL, flags=abi.GIN_HAS_SIGNAL | abi.GIN_STRONG, peer=1, ctx=0, signal=0),
     "rank 0: strong signal to peer 1 on backend gda, which offers weak signals only"),
    ("gda", dict(op=abi.GIN_PUT, flags=abi.GIN_HAS_SIGNAL | abi.GIN_VA, peer=1, ctx=0, dst=64, src=0, nbytes=8,
                 signal=1900), "rank 0: VA signal to peer 1 on backend gda"),
    ("gda", dict(op=abi.GIN_SIGNAL, flags=abi.GIN_HAS_SIGNAL | abi.GIN_ADD, peer=1, ctx=0, signal=0, value=3),
     "rank 0: signal add on backend gda, whose signals count completed writes"),
    ("proxy", dict(op=abi.GIN_PUT, peer=7, ctx=0, nbytes=8), "rank 0: GIN operation 1 names peer 7 outside [0, 2)"),
])
def test_refusals_match_the_python_proxy_and_raise_the_abort_word(backend, post, message):
    posts = [dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=1024, src=0, nbytes=16), post,
             dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=1040, src=16, nbytes=16)]
    for engine in ("native", "python"):
        (res, _), (_, window1) = ThreadWorld.run(2, _posted, engine, backend, posts, timeout=WORLD_TIMEOUT)
        assert res["error"] == message, (engine, res["error"])
        assert res["abort"] == 1, engine
        assert engine == "python" or res["stats"]["ops"] == 1  # the refused descriptor ended the engine
        mine = ((np.arange(2048) * 4) % 251 + 1).astype(np.uint8)  # rank 1's own bytes
        np.testing.assert_array_equal(window1[1040:1056], mine[1040:1056])  # nothing after it landed
        assert (window1[1024:1040] != mine[1024:1040]).any()  # what came before it did


def _stuck_queue(world):
    """A claimed slot that is never published: quiesce must give up and say what it saw."""
    from commref.transports.gin.native import NativeProxy
    from commref.transports.gin.proxy import ProxyError
    from commref.transports.gin.atomics import host_atomics
    from commref.transports.gin.queue import QueueWriter
    from commref.transports.windows import register_window

    lay, nbytes = _layout()
    window = register_window(world, nbytes, "cpu")
    try:
        out = None
        if world.rank == 0:
            proxy = NativeProxy(world, window, lay, CAP, BACKENDS["proxy"], semantics.ORDERED, "shm")
            proxy.start()
            q = QueueWriter(window.local, lay, CAP, host_atomics())
            q.publish([q.fill(abi.GIN_PUT, peer=1, ctx=0, dst=1024, src=0, nbytes=8)])
            q.fill(abi.GIN_PUT, peer=1, ctx=0, dst=1024, src=0, nbytes=8)  # claimed, never published
            t0 = time.monotonic()
            with pytest.raises(ProxyError) as e:
                proxy.quiesce(0.3)
            waited = time.monotonic() - t0
            stats_running = proxy.stats
            proxy.stop()
            proxy.stop()
            out = str(e.value), waited, stats_running, proxy.stats, proxy.error
        world.barrier(what="done")
        return out
    finally:
        window.close()


def test_quiesce_names_expected_and_seen_and_stop_is_idempotent():
    msg, waited, running, stopped, error = ThreadWorld.run(2, _stuck_queue, timeout=WORLD_TIMEOUT)[0]
    assert msg == ("rank 0: native GIN engine did not drain within 0.3 s (expected 2 operations taken, seen 1)")
    assert 0.3 <= waited < 5
    assert running == stopped == {"ops": 1, "doorbells": 0, "events": 1, "by_kernels": 0} and error is None


def _dead_engine(world):
    """Rank 0's engine dies on a bad descriptor before a collective: both ranks' kernels
    must fail (abort word) instead of waiting for data that never comes."""
    from commref.transports.gin.atomics import host_atomics
    from commref.transports.gin.queue import QueueWriter

    comm = Communicator(world, "cpu", timeout=WORLD_TIMEOUT, path="gin", wire="ordered", network="shm")
    assert type(comm.proxy).__name__ == "NativeProxy"
    if world.rank == 0:
        q = QueueWriter(comm.window.local, comm._record.record["layout"], comm.gin.options.queue, host_atomics())
        q.publish([q.fill(abi.GIN_PUT, peer=9, ctx=0, nbytes=8)])
        deadline = time.monotonic() + 10
        while comm.proxy.error is None:
            assert time.monotonic() < deadline, "the engine did not fail"
            time.sleep(1e-3)
    # No barrier from here: the raised abort word fails the world's control plane too.
    t0 = time.monotonic()
    try:
        comm.allreduce(np.ones(1000, np.float32), np.empty(1000, np.float32))
        result = "completed"
    except Exception as e:  # noqa: BLE001 (what failed is the point)
        result = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    try:
        comm.close()
    except Exception:  # noqa: BLE001 (the teardown repeats the failure)
        pass
    return result, elapsed, int(world.abort_word[0])


def test_dead_engine_raises_the_abort_word_so_kernels_fail(native):
    results = ThreadWorld.run(2, _dead_engine, timeout=WORLD_TIMEOUT)
    for rank, (result, elapsed, abort) in enumerate(results):
        assert result != "completed", rank
        assert elapsed < WORLD_TIMEOUT / 2, (rank, elapsed, result)
        assert abort == 1
    assert "names peer 9 outside [0, 2)" in results[0][0]


# ---------------------------------------------------------------------------------------
# conformance: the native engine's traces replayed against semantics.enabled()
# ---------------------------------------------------------------------------------------

# (backend, protocol) for every backend that runs the ordered wire: test_gin_conformance.MATRIX's ordered rows,
# and gda's flush-signal (its flushes are recorded on every link of the context and mark the next put)
ORDERED = [("proxy", "strong"), ("rc", "strong"), ("rc", "weak-last"), ("gda", "signal-per-put"),
           ("gda", "flush-signal")]
CONFORMANCE_SEEDS = (1, 2)


def _native_conformance(world, backend, protocol, seeds, network="shm"):
    """collectives_run on the native engine (COMMREF_GIN_ENGINE=native: a communicator it
    cannot carry fails); per seed (trace, wrong)."""
    return [(trace, wrong) for trace, wrong, _ in collectives_run(world, backend, "ordered", protocol, seeds,
                                                                  network=network)]


def _kinds(trace: dict) -> dict:
    out: dict = {}
    for records in trace.values():
        for r in records:
            out[r[0]] = out.get(r[0], 0) + 1
    return out


@pytest.mark.parametrize("nranks, backend, protocol", [(2, *o) for o in ORDERED] + [(3, "proxy", "strong"),
                                                                                     (3, "gda", "flush-signal")])
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
            for key, n in _kinds(trace).items():
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
        if a["kind"] == nat.DATA and b["kind"] == nat.SIGNAL and a["seq"] == b["seq"] and (
                a["peer"], a["ctx"]) == (b["peer"], b["ctx"]):
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
    posts = _mixed_posts()
    nat = ThreadWorld.run(3, _posted, "native", "proxy", posts, timeout=WORLD_TIMEOUT)[0][0]
    trace = nat["trace"]
    replay_trace(trace, "proxy", "ordered")
    link = trace[(1, 0)]
    assert [r[:2] for r in link[:8]] == [("post", 0), ("data", 0), ("counter", 0), ("signal", 0), ("doorbell", 1),
                                         ("post", 1), ("data", 1), ("signal", 1)]
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
    posts = _mixed_posts()
    res, _ = ThreadWorld.run(3, _posted, "native", "proxy", posts, timeout=WORLD_TIMEOUT, trace_capacity=10)[0]
    err = res["trace"]
    assert res["error"] is None and res["stats"] == {"ops": len(posts), "doorbells": 13, "events": 12,
                                                                            "by_kernels": 0}
    assert re.fullmatch(r"rank 0: the native GIN engine's trace overflowed: \d+ records not kept \(capacity 10 "
                        r"records between reads of NativeProxy.trace; .*\)", str(err)), err


@pytest.mark.mpi
def test_collectives_over_native_engine_conform_under_mpiexec(shm_leak_check):
    """2 MPI processes, networks shm and mpi, the ordered backends, 1 seed each: this file
    is the job's script; each rank replays its own trace."""
    proc = run_mpi(2, [os.path.relpath(__file__, os.path.dirname(os.path.dirname(__file__))), "1"], timeout=120,
                   env=clean_env(COMMREF_GIN_ENGINE="native"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "DISALLOWED" not in proc.stdout, proc.stdout[-4000:]
    lines = set(re.findall(r"rank (\d) (\S+) ordered (\S+) network (\S+) seed (\d+): conforms [^\n]*? "
                           r"wrong 0 engine (native|auto|python)", proc.stdout))
    assert len(lines) == 2 * len(ORDERED) * 2, out[-4000:]
    assert {m[5] for m in lines} == {"native"} and {m[3] for m in lines} == {"shm", "mpi"}, lines


def _mpi_main(seeds: list[int]) -> None:
    """Run under mpiexec with COMMREF_GIN_ENGINE=native (a communicator the native engine
    cannot carry fails at setup, so every trace below is the native engine's)."""
    from commref.transports.world import MPIWorld

    world = MPIWorld()
    engine = os.environ.get("COMMREF_GIN_ENGINE", "auto")
    for (backend, protocol), network in ((o, n) for o in ORDERED for n in ("shm", "mpi")):
        for seed, (trace, wrong) in zip(seeds, _native_conformance(world, backend, protocol, seeds, network)):
            where = f"rank {world.rank} {backend} ordered {protocol} network {network} seed {seed}"
            try:
                counts = replay_trace(trace, backend, "ordered")
                line = (f"{where}: conforms {counts['post']} posts {counts['seg']} segments {counts['signal']} "
                        f"signals wrong {wrong} engine {engine}")
            except Disallowed as e:
                line = f"{where}: DISALLOWED {e}"
            sys.stdout.write(line + "\n")  # one write: the two ranks' lines share mpiexec's stdout
            sys.stdout.flush()
    world.barrier(what="native conformance done")


if __name__ == "__main__":
    _mpi_main([int(s) for s in sys.argv[1:]] or list(CONFORMANCE_SEEDS))
    sys.exit(0)


def test_each_gin_communicator_on_network_mpi_has_its_own_tag():
    """A freed communicator's context id may be reused; its messages still in flight must
    not match a later communicator's engines (plan.network_tag, docs/gin.md "Network mpi")."""
    from commref.transports.gin import plan

    tags = [plan.network_tag() for _ in range(5)]
    assert len(set(tags)) == 5
    assert all(plan.NETWORK_TAG_BASE <= t < plan.NETWORK_TAG_BASE + plan.NETWORK_TAG_SPAN <= 32767 for t in tags)


def _kernels_help(world):
    """1 MiB AllReduces over GIN (shm, ordered) in 1 KiB slots: (exact, the engine's stats)."""
    with Communicator(world, "cpu", path="gin", wire="ordered", network="shm", slot_bytes=1024, nsteps=16) as comm:
        assert type(comm.proxy).__name__ == "NativeProxy"
        x = np.arange(1 << 18, dtype=np.float32) % 97 * (world.rank + 1)
        y = np.empty_like(x)
        for _ in range(3):
            comm.allreduce(x, y)
        exact = bool((y == np.arange(1 << 18, dtype=np.float32) % 97 * sum(range(1, world.size + 1))).all())
        world.barrier(what="calls done")
        return exact, comm.proxy.stats


def test_kernels_take_descriptors_through_the_help_hook(monkeypatch):
    """On network shm a CPU kernel takes descriptors itself between its posts and waits
    (gin.h, "Help"): some of the engine's operations were taken by kernels, and the
    results are exact; with COMMREF_GIN_KERNELS_HELP=0 the engine's thread takes them all."""
    from commref.transports.gin import native as nat

    for exact, stats in ThreadWorld.run(2, _kernels_help, timeout=WORLD_TIMEOUT):
        assert exact
        assert 0 < stats["by_kernels"] <= stats["ops"], stats
    monkeypatch.setenv(nat.KERNELS_HELP_ENV, "0")
    for exact, stats in ThreadWorld.run(2, _kernels_help, timeout=WORLD_TIMEOUT):
        assert exact
        assert stats["by_kernels"] == 0 and stats["ops"] > 0, stats
    monkeypatch.setenv(nat.KERNELS_HELP_ENV, "yes")
    with pytest.raises(ValueError, match=r"^COMMREF_GIN_KERNELS_HELP must be 0 or 1, not 'yes'$"):
        nat.kernels_help_enabled()


def test_an_unknown_window_fails_the_native_engine_and_the_other_proxies_refuse_windows():
    """A descriptor may name only windows its engine was given (gin.h, "Windows"); the
    Python proxy carries the connection window alone and says so."""
    posts = [dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=1024, src=0, nbytes=16),
             dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=0, src=0, nbytes=8, windows=abi.gin_windows(3, 0)),
             dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=1040, src=16, nbytes=16)]
    for engine, message in (
            ("native", "rank 0: GIN put source (peer 1) names window 3, which this engine was not given"),
            ("python", "rank 0: GIN operation 1 names windows 0x3: registered windows (gin.h) are carried by the "
                       "native engine only")):
        (res, _), (_, window1) = ThreadWorld.run(2, _posted, engine, "proxy", posts, timeout=WORLD_TIMEOUT)
        assert res["error"] == message, (engine, res["error"])
        assert res["abort"] == 1, engine
        mine = ((np.arange(2048) * 4) % 251 + 1).astype(np.uint8)
        np.testing.assert_array_equal(window1[1040:1056], mine[1040:1056])  # nothing after it landed


def _window_puts(world):
    """Rank 0's native engine is given a symmetric window as id 1: a put from its copy
    into rank 1's lands there; one past its end fails naming the window."""
    from commref.transports.gin.atomics import host_atomics
    from commref.transports.gin.native import NativeProxy
    from commref.transports.gin.queue import QueueWriter
    from commref.transports.windows import register_window

    lay, nbytes = _layout()
    window = register_window(world, nbytes, "cpu")
    sym = register_window(world, 4096, "cpu")
    proxy = None
    try:
        sym.local[:] = world.rank + 1
        world.barrier(what="filled")
        if world.rank == 0:
            proxy = NativeProxy(world, window, lay, CAP, BACKENDS["proxy"], semantics.ORDERED, "shm")
            proxy.add_window(1, sym)
            proxy.start()
            q = QueueWriter(window.local, lay, CAP, host_atomics())
            q.publish([q.fill(abi.GIN_PUT, peer=1, ctx=0, dst=100, src=0, nbytes=64, windows=abi.gin_windows(1, 1))])
            proxy.quiesce(WORLD_TIMEOUT)
        world.barrier(what="landed")
        landed = sym.local.copy()
        if proxy is None:
            return None, landed  # rank 1 meets no barrier while rank 0's engine fails (it raises the abort word)
        q.publish([q.fill(abi.GIN_PUT, peer=1, ctx=0, dst=4090, src=0, nbytes=8, windows=abi.gin_windows(1, 1))])
        deadline = time.monotonic() + WORLD_TIMEOUT
        while proxy.error is None:
            assert time.monotonic() < deadline, "the engine took a put past the window's end"
            time.sleep(1e-4)
        proxy.stop()
        world.abort_word[0] = 0
        return str(proxy.error), landed
    finally:
        if proxy is not None:
            proxy.stop()
        sym.close()
        window.close()


def test_puts_between_symmetric_windows_land_in_the_peers_copy_and_stay_inside_it():
    (error, _), (_, peer) = ThreadWorld.run(2, _window_puts, timeout=WORLD_TIMEOUT)
    assert (peer[100:164] == 1).all() and (peer[:100] == 2).all() and (peer[164:] == 2).all()
    assert error == "rank 0: GIN put destination (peer 1) reaches [4090, 4098), outside the 4096-byte window 1"
