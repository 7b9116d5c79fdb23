"""The native GIN engine (transports/gin/native.py, native_engine.cpp): the default for
the ordered wire on network shm.

- choice: plan.GinPlan.start_proxy picks NativeProxy for ordered shm, GinProxy for the
  unordered wire and with an observer; COMMREF_GIN_ENGINE forces one or is refused;
- exactness: the collectives over GIN ordered shm on every backend that runs the ordered
  wire (proxy, rc, gda), ThreadWorld 2 and 3 ranks, and 2 MPI ranks (`commref check`);
- trace: the native engine's landing trace equals the Python proxy's for the same posted
  sequence (host-posted descriptors, and a collective on one channel);
- refusals: the same messages as proxy.py's _remote_action, with the abort word raised;
- lifecycle: quiesce names what it waited for at its deadline, stop is idempotent, a dead
  engine makes kernels fail instead of hanging.
"""

from __future__ import annotations

import re
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


def test_observer_or_mpi_network_is_not_native():
    from commref.transports.gin import native
    from commref.transports.gin.observer import Observer

    assert native.supports(semantics.ORDERED, "shm") is None
    assert "observer" in native.supports(semantics.ORDERED, "shm", Observer())
    assert "network 'mpi'" in native.supports(semantics.ORDERED, "mpi")
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
def test_check_over_native_engine_under_mpiexec(shm_leak_check):
    args = ["commref.cli", "check", "--path", "gin", "--network", "shm", "--wire", "ordered", "--dtype", "float32",
            "int8", "--op", "sum", "max", "--count", "0", "1", "7", "1001", "--slot-bytes", "512"]
    proc = run_mpi(2, args, timeout=90, module=True, env=clean_env(COMMREF_GIN_ENGINE="native"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "# commref check: 2 ranks, device cpu" in proc.stdout
    m = re.search(r"^# (\d+) cases, .* (\d+) wrong elements in (\d+) cases", proc.stdout, re.M)
    assert m, out[-4000:]
    assert int(m.group(1)) == (4 * 2 + 2) * 2 * 4 * 2 + 4 * 2 * 1 * 4, m.group(0)  # ..., + float32 denormal cases
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


def _posted(world, engine: str, backend: str, posts, quiesce=True, timeout=WORLD_TIMEOUT):
    """Rank 0 runs a proxy of `engine` ("native" or "python") and posts `posts` (QueueWriter.fill
    keyword sets) to its own queue; every rank returns its window (rank 0 also the proxy's
    trace, stats, error and the abort word)."""
    from commref.transports.gin.atomics import host_atomics
    from commref.transports.gin.native import NativeProxy
    from commref.transports.gin.proxy import GinProxy
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
            proxy = cls(world, window, lay, CAP, BACKENDS[backend], semantics.ORDERED, "shm", 0, 64)
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
            out = {"trace": proxy.trace, "stats": proxy.stats, "error": None if err is None else str(err),
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
    posts.append(dict(op=get, peer=2, ctx=0, dst=1500, src=100, nbytes=40))
    posts.append(dict(op=abi.GIN_FLUSH, ctx=-1))
    return posts


def ordered_view(trace: dict) -> dict:
    """The Python proxy's trace in the native engine's format, per (peer, ctx) a list of
    (seq, "put") or (seq, "put+signal"). The native format is the Python proxy's
    ordered-wire trace as scheduler.DeliveryScheduler.post recorded it; a session is
    reworking scheduler.py's trace (events ("post", seq, offset, nbytes, signal),
    ("data", seq), ("signal", seq), ...), and both are read here. Integrating the native
    engine with a changed format is left to whoever lands that change."""
    out = {}
    for key, events in trace.items():
        view = []
        for ev in events:
            if len(ev) == 2 and isinstance(ev[0], int) and ev[1] in ("put", "put+signal"):
                view.append(tuple(ev))
            elif ev and ev[0] == "post":
                view.append((ev[1], "put+signal" if ev[4] is not None else "put"))
            elif not (ev and isinstance(ev[0], str)):
                raise AssertionError(f"unknown Python proxy trace entry {ev!r}: integrate the native trace format")
        out[key] = view
    return out


def _expected_trace(posts) -> dict:
    out, seqs = {}, {}
    for p in posts:
        if p["op"] in (abi.GIN_PUT, abi.GIN_PUT_VALUE, abi.GIN_SIGNAL):
            key = (p["peer"], p["ctx"])
            seq = seqs[key] = seqs.get(key, -1) + 1
            out.setdefault(key, []).append((seq, "put+signal" if p.get("flags", 0) & abi.GIN_HAS_SIGNAL else "put"))
    return out


def test_native_trace_and_landings_equal_the_python_proxy():
    posts = _mixed_posts()
    runs = {e: ThreadWorld.run(3, _posted, e, "proxy", posts, timeout=WORLD_TIMEOUT) for e in ("native", "python")}
    (nat, *_), (py, *_) = runs["native"][0], runs["python"][0]
    assert nat["error"] is None and py["error"] is None, (nat["error"], py["error"])
    assert nat["trace"] == _expected_trace(posts) == ordered_view(py["trace"])
    assert sorted(nat["trace"]) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert nat["trace"][(1, 0)] == [(0, "put+signal"), (1, "put+signal")]
    assert nat["stats"] == py["stats"] == {"ops": len(posts), "events": 12}
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
        assert nat == ordered_view(py)
        assert all(len(t) > 10 for t in nat.values())


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
    assert running == stopped == {"ops": 1, "events": 1} and error is None


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
