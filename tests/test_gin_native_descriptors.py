"""The native GIN engine fed host-posted descriptors (transports/gin/native.py,
native_engine/):

- trace: the native engine's trace (post, data, signal, counter, flush, doorbell, get per
  (peer, ctx)) equals the Python proxy's for the same posted sequence (host-posted
  descriptors, and a collective on one channel), record for record;
- refusals: every refusal condition (abi.GIN_REFUSALS: a peer outside the world, a window
  id not given, a range outside its window, a signal the backend cannot apply, an
  unknown op) gives the Python proxy's message, word for word (one table:
  engine.REFUSAL_TEXT), with the abort word raised and nothing after it landed;
- lifecycle: quiesce names what it waited for at its deadline, stop is idempotent, a dead
  engine makes kernels fail instead of hanging;
- network tags, the kernels' help hook, and puts between symmetric windows.
"""

from __future__ import annotations

import time
import types

import numpy as np
import pytest
from helpers import POSTED_CAP, WORLD_TIMEOUT, mixed_posts, posted, posted_layout

from commref.collectives import check
from commref.collectives.communicator import Communicator
from commref.device_kernels import abi
from commref.transports.gin import semantics
from commref.transports.gin.backends import BACKENDS
from commref.transports.gin.replay import replay_trace
from commref.transports.thread_world import ThreadWorld

# ---------------------------------------------------------------------------------------
# host-posted descriptors: trace, refusals, quiesce, stop
# ---------------------------------------------------------------------------------------


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
                sig = semantics.Signal(
                    bool(flags & abi.GIN_STRONG),
                    ("va" if flags & abi.GIN_VA else "index", p.get("signal", 0)),
                    p.get("value", 0) if flags & abi.GIN_ADD else 1,
                )
            nbytes = {abi.GIN_PUT: p.get("nbytes", 0), abi.GIN_PUT_VALUE: 8, abi.GIN_SIGNAL: 0}[p["op"]]
            out.setdefault(key, []).append(("post", seq, p.get("dst", 0), nbytes, sig))
    return out


def test_native_trace_and_landings_equal_the_python_proxy():
    posts = mixed_posts()
    runs = {e: ThreadWorld.run(3, posted, e, "proxy", posts, timeout=WORLD_TIMEOUT) for e in ("native", "python")}
    (nat, *_), (py, *_) = runs["native"][0], runs["python"][0]
    assert nat["error"] is None and py["error"] is None, (nat["error"], py["error"])

    # Record for record the same, but for where a put's counter sits: the native engine bumps
    # it once the source is copied (before the signal), the Python proxy after the signal.
    def without_counters(trace):
        return {k: [r for r in v if r[0] != "counter"] for k, v in trace.items()}

    assert without_counters(nat["trace"]) == without_counters(py["trace"])
    assert {k: [r for r in v if r[0] == "counter"] for k, v in nat["trace"].items()} == {
        k: [r for r in v if r[0] == "counter"] for k, v in py["trace"].items()
    }
    for t in nat["trace"].values():
        for k, r in enumerate(t):
            if r[0] == "counter":
                assert t[k - 1] == ("data", r[1]) and t[k + 1] == ("signal", r[1]), t[k - 1 : k + 2]
    assert {k: [r for r in v if r[0] == "post"] for k, v in nat["trace"].items() if k != (2, 3)} == _expected_posts(
        posts
    )
    assert sorted(nat["trace"]) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (2, 3)]
    strong = semantics.Signal(True, ("index", 0), 1)
    assert nat["trace"][(1, 0)] == [
        ("post", 0, 1024, 50, strong),
        ("data", 0),
        ("counter", 0, 0),
        ("signal", 0),
        ("doorbell", 1),
        ("post", 1, 1408, 8, semantics.Signal(True, ("va", 1900), 7)),
        ("data", 1),
        ("signal", 1),
        ("doorbell", 2),
        ("flush",),
    ]
    assert nat["trace"][(2, 0)][-2:] == [("doorbell", 2), ("get", 100, 1500, 40)]
    assert ("flush",) in nat["trace"][(2, 0)] and nat["trace"][(2, 0)].index(("flush",)) < max(
        k for k, r in enumerate(nat["trace"][(2, 0)]) if r[0] == "post"
    )  # a put of ctx 0 after the flush
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
    lay, _ = posted_layout()
    window1 = runs["native"][1][1]
    sigs = window1[int(lay["ginSignalsOff"]) : int(lay["ginSignalsOff"]) + 40].view(np.uint64)
    assert sigs.sum() > 0


def _collective_trace(world):
    comm = Communicator(
        world, "cpu", timeout=WORLD_TIMEOUT, slot_bytes=1024, max_channels=1, path="gin", wire="ordered", network="shm"
    )
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


WINDOW_BYTES = posted_layout()[1]  # the connection window's size in posted


# (backend, a descriptor as QueueWriter.fill's keywords, the refusal every engine gives)
REFUSALS = [
    (
        "gda",
        dict(op=abi.GIN_SIGNAL, flags=abi.GIN_HAS_SIGNAL | abi.GIN_STRONG, peer=1, ctx=0, signal=0),
        "rank 0: strong signal to peer 1 on backend gda, which offers weak signals only",
    ),
    (
        "gda",
        dict(
            op=abi.GIN_PUT, flags=abi.GIN_HAS_SIGNAL | abi.GIN_VA, peer=1, ctx=0, dst=64, src=0, nbytes=8, signal=1900
        ),
        "rank 0: VA signal to peer 1 on backend gda",
    ),
    (
        "gda",
        dict(op=abi.GIN_SIGNAL, flags=abi.GIN_HAS_SIGNAL | abi.GIN_ADD, peer=1, ctx=0, signal=0, value=3),
        "rank 0: signal add on backend gda, whose signals count completed writes",
    ),
    ("proxy", dict(op=abi.GIN_PUT, peer=7, ctx=0, nbytes=8), "rank 0: GIN operation 1 names peer 7 outside [0, 2)"),
    ("proxy", dict(op=abi.GIN_GET, peer=-1, ctx=0, nbytes=8), "rank 0: GIN operation 4 names peer -1 outside [0, 2)"),
    (
        "proxy",
        dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=0, src=0, nbytes=8, windows=abi.gin_windows(3, 0)),
        "rank 0: GIN put source (peer 1) names window 3, which this engine was not given",
    ),
    (
        "proxy",
        dict(op=abi.GIN_GET, peer=1, ctx=0, dst=0, src=0, nbytes=8, windows=abi.gin_windows(0, 5)),
        "rank 0: GIN get destination (peer 1) names window 5, which this engine was not given",
    ),
    (
        "proxy",
        dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=WINDOW_BYTES - 4, src=0, nbytes=8),
        f"rank 0: GIN put destination (peer 1) reaches [{WINDOW_BYTES - 4}, {WINDOW_BYTES + 4}), outside the "
        f"{WINDOW_BYTES}-byte connection window",
    ),
    (
        "proxy",
        dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=0, src=WINDOW_BYTES + 1, nbytes=16),
        f"rank 0: GIN put source (peer 1) reaches [{WINDOW_BYTES + 1}, {WINDOW_BYTES + 17}), outside the "
        f"{WINDOW_BYTES}-byte connection window",
    ),
    (
        "proxy",
        dict(op=abi.GIN_GET, peer=1, ctx=0, dst=0, src=WINDOW_BYTES - 8, nbytes=16),
        f"rank 0: GIN get source (peer 1) reaches [{WINDOW_BYTES - 8}, {WINDOW_BYTES + 8}), outside the "
        f"{WINDOW_BYTES}-byte connection window",
    ),
    (
        "proxy",
        dict(op=abi.GIN_SIGNAL, flags=abi.GIN_HAS_SIGNAL | abi.GIN_VA, peer=1, ctx=0, signal=WINDOW_BYTES),
        f"rank 0: GIN signal (peer 1) reaches [{WINDOW_BYTES}, {WINDOW_BYTES + 8}), outside the "
        f"{WINDOW_BYTES}-byte connection window",
    ),
    ("proxy", dict(op=9, peer=1, ctx=0), "rank 0: unknown GIN operation 9"),
]


@pytest.mark.parametrize("backend, post, message", REFUSALS)
def test_refusals_match_the_python_proxy_and_raise_the_abort_word(backend, post, message):
    posts = [
        dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=1024, src=0, nbytes=16),
        post,
        dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=1040, src=16, nbytes=16),
    ]
    for engine in ("native", "python"):
        (res, _), (_, window1) = ThreadWorld.run(2, posted, engine, backend, posts, timeout=WORLD_TIMEOUT)
        assert res["error"] == message, (engine, res["error"])
        assert res["abort"] == 1, engine
        assert engine == "python" or res["stats"]["ops"] == 1  # the refused descriptor ended the engine
        mine = ((np.arange(2048) * 4) % 251 + 1).astype(np.uint8)  # rank 1's own bytes
        np.testing.assert_array_equal(window1[1040:1056], mine[1040:1056])  # nothing after it landed
        assert (window1[1024:1040] != mine[1024:1040]).any()  # what came before it did


@pytest.mark.parametrize("backend, post, message", REFUSALS)
def test_the_gpu_proxy_refuses_in_the_same_words(backend, post, message):
    """The copy-engine proxy (transports/gin/gpu_proxy.py) checks a descriptor with the
    same table (engine.DescriptorChecks), so it refuses what the other two engines refuse,
    in their words, before it moves a byte. Here with rank 0's view of a 2-rank job on
    network shm: every peer mapped, a stand-in driver that must not be asked to copy."""
    from commref.transports.gin.gpu_proxy import GpuProxy
    from commref.transports.gin.queue import Descriptor
    from commref.transports.gin.wires import ProxyError

    class NoCopies:
        def __getattr__(self, name):
            raise AssertionError(f"the refused descriptor reached the driver ({name})")

    proxy = GpuProxy.__new__(GpuProxy)  # the state _execute reads, without a queue or a GPU
    lay, _ = posted_layout()
    proxy.world, proxy.rank, proxy.backend = types.SimpleNamespace(size=2), 0, BACKENDS[backend]
    proxy._window_bytes, proxy._signals_off = WINDOW_BYTES, int(lay["ginSignalsOff"])
    proxy._links, proxy._streams, proxy._peer_base, proxy.wire = {}, {1: object()}, [1 << 20, 2 << 20], None
    proxy.driver, proxy._base = NoCopies(), 1 << 20
    fields = {"dst": "dstOffset", "src": "srcOffset", "nbytes": "bytes", "value": "signalValue"}
    d = Descriptor(
        **dict(dict.fromkeys(Descriptor._fields, 0), seq=1, **{fields.get(k, k): v for k, v in post.items()})
    )
    with pytest.raises(ProxyError) as e:
        proxy._execute(d)
    assert str(e.value) == message


def _stuck_queue(world):
    """A claimed slot that is never published: quiesce must give up and say what it saw."""
    from commref.transports.gin.atomics import host_atomics
    from commref.transports.gin.engine import EngineSite
    from commref.transports.gin.native import NativeProxy
    from commref.transports.gin.proxy import ProxyError
    from commref.transports.gin.queue import QueueWriter
    from commref.transports.windows import register_window

    lay, nbytes = posted_layout()
    window = register_window(world, nbytes, "cpu")
    try:
        out = None
        if world.rank == 0:
            proxy = NativeProxy(EngineSite(world, window, lay, POSTED_CAP, BACKENDS["proxy"], semantics.ORDERED, "shm"))
            proxy.start()
            q = QueueWriter(window.local, lay, POSTED_CAP, host_atomics())
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
        q = QueueWriter(comm.window.local, comm.launch_record.record["layout"], comm.gin.options.queue, host_atomics())
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


def test_each_gin_communicator_on_network_mpi_has_its_own_tag():
    """A freed communicator's context id may be reused; its messages still in flight must
    not match a later communicator's engines (engines.network_tag, docs/gin.md "Network mpi")."""
    from commref.transports.gin import engines

    tags = [engines.network_tag() for _ in range(5)]
    assert len(set(tags)) == 5
    assert all(
        engines.NETWORK_TAG_BASE <= t < engines.NETWORK_TAG_BASE + engines.NETWORK_TAG_SPAN <= 32767 for t in tags
    )


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


def _small_calls(world):
    """500 8-byte AllReduces over GIN (shm, ordered): (exact, the engine's stats)."""
    with Communicator(world, "cpu", path="gin", wire="ordered", network="shm") as comm:
        x = np.array([1.0, 2.0], np.float32) * (world.rank + 1)
        y = np.empty_like(x)
        before = comm.proxy.stats
        for _ in range(500):
            comm.allreduce(x, y)
        world.barrier(what="calls done")
        after = comm.proxy.stats
        exact = bool((y == np.array([1.0, 2.0], np.float32) * sum(range(1, world.size + 1))).all())
        return exact, {k: after[k] - before[k] for k in ("ops", "by_kernels")}


def test_kernels_take_what_they_publish_by_the_end_of_their_block():
    """Where kernels help, the engine's thread sleeps and kernels do not ring it: each
    takes what it published at its next help or as its block ends (gin.h, the idle word).
    A call's last descriptor (its credit signal) is posted with no wait after it, so only
    the block's end takes it: the kernels took all but a stray few of the calls' descriptors
    (the thread, waking on its timer, may take one first), where the thread taking those
    last ones would leave them a quarter short."""
    for exact, taken in ThreadWorld.run(2, _small_calls, timeout=WORLD_TIMEOUT):
        assert exact
        assert taken["ops"] >= 4 * 500 and taken["by_kernels"] >= 0.97 * taken["ops"], taken


def test_an_unknown_window_fails_either_engine_with_one_message():
    """A descriptor may name only windows its engine was given (gin.h, "Windows"); the
    Python proxy is given none but the connection window, so it refuses any other id with
    the native engine's words."""
    posts = [
        dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=1024, src=0, nbytes=16),
        dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=0, src=0, nbytes=8, windows=abi.gin_windows(3, 0)),
        dict(op=abi.GIN_PUT, peer=1, ctx=0, dst=1040, src=16, nbytes=16),
    ]
    for engine in ("native", "python"):
        (res, _), (_, window1) = ThreadWorld.run(2, posted, engine, "proxy", posts, timeout=WORLD_TIMEOUT)
        assert res["error"] == "rank 0: GIN put source (peer 1) names window 3, which this engine was not given", (
            engine,
            res["error"],
        )
        assert res["abort"] == 1, engine
        mine = ((np.arange(2048) * 4) % 251 + 1).astype(np.uint8)
        np.testing.assert_array_equal(window1[1040:1056], mine[1040:1056])  # nothing after it landed


def test_every_refusal_code_has_one_text_and_the_engine_formats_it():
    """engine.REFUSAL_TEXT covers abi.GIN_REFUSALS exactly (the C++ codes equal those:
    test_compile.py's ABI table), and refusal() fills in what a native record carries."""
    from commref.transports.gin import engine

    assert set(engine.REFUSAL_TEXT) == set(abi.GIN_REFUSALS.values())
    e = engine.refusal(
        2, abi.GIN_REFUSALS["window_unmapped"], access=abi.GIN_ACCESSES["get_request"], op=4, peer=1, owner=3, window=7
    )
    assert str(e) == "rank 2: GIN get request: rank 3's window 7 is not mapped here"
    e = engine.refusal(
        0,
        abi.GIN_REFUSALS["outside_window"],
        access=abi.GIN_ACCESSES["landing"],
        peer=1,
        window=2,
        offset=2**64 - 8,
        bytes=16,
        size=4096,
    )
    assert str(e) == f"rank 0: GIN landing (peer 1) reaches [{2**64 - 8}, 8), outside the 4096-byte window 2"
    assert str(engine.refusal(0, 99)) == "rank 0: the GIN engine refused a descriptor with unknown refusal code 99"


def _window_puts(world):
    """Rank 0's native engine is given a symmetric window as id 1: a put from its copy
    into rank 1's lands there; one past its end fails naming the window."""
    from commref.transports.gin.atomics import host_atomics
    from commref.transports.gin.engine import EngineSite
    from commref.transports.gin.native import NativeProxy
    from commref.transports.gin.queue import QueueWriter
    from commref.transports.windows import register_window

    lay, nbytes = posted_layout()
    window = register_window(world, nbytes, "cpu")
    sym = register_window(world, 4096, "cpu")
    proxy = None
    try:
        sym.local[:] = world.rank + 1
        world.barrier(what="filled")
        if world.rank == 0:
            proxy = NativeProxy(EngineSite(world, window, lay, POSTED_CAP, BACKENDS["proxy"], semantics.ORDERED, "shm"))
            proxy.add_window(1, sym)
            proxy.start()
            q = QueueWriter(window.local, lay, POSTED_CAP, host_atomics())
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
