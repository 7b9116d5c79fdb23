"""Host one-sided calls (nccl4py's register_window, put_signal, signal, wait_signal) over
GIN: on a ThreadWorld and under mpiexec (network mpi), on every backend and wire the
GIN suites run (proxy ordered and unordered, on the native engine and the Python proxy;
rc; gda, which refuses put_signal: weak signals only).

- a put_signal lands and wait_signal sees it, on several contexts and signal indices,
  into every peer;
- the strong-signal promise (the data is in the window once its signal is seen), many
  rounds on the unordered wire with small segments, puts larger than the staging ring
  included (posted in pieces, the signal on the last);
- ping-pong;
- each bad input: a clear error on the calling rank (never a hang): the window too
  small for offset + size, a peer outside the communicator or this rank, an unknown or
  deregistered window, a signal index or context out of range, a weak-signal backend,
  an LSA-only communicator, a wait past its deadline (CommTimeout naming rank, peer,
  signal, expected and seen), a registration across processes on network shm.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from commref import CapabilityError, CommTimeout, Communicator, ThreadWorld, WaitSignalDesc  # noqa: E402

TIMEOUT = 60.0


def _comm(world, backend="proxy", wire="ordered", **opts):
    return Communicator(
        world, "cpu", timeout=opts.pop("timeout", TIMEOUT), path="gin", backend=backend, wire=wire, **opts
    )


def lands(world, backend, wire, network="shm", seed=0, fault=None):
    """Every rank puts a stamped block into every peer's window, on each (context, signal
    index), runs an AllReduce (kernels' GIN traffic on their own contexts in between),
    then waits for every peer's blocks; returns the blocks that arrived wrong (and
    ("allreduce", wrong elements) if the AllReduce was wrong)."""
    more = {} if fault is None else {"fault": fault}
    comm = _comm(
        world, backend, wire, network=network, seed=seed, rma_contexts=2, rma_signals=3, max_channels=1, **more
    )
    n, block = world.size, 300
    slots = [(c, s) for c in range(2) for s in range(3)]
    buf = np.zeros(n * len(slots) * block, np.uint8)
    win = comm.register_window(buf)
    for peer in range(n):
        if peer == world.rank:
            continue
        for k, (c, s) in enumerate(slots):
            src = ((np.arange(block) + 31 * world.rank + k) % 251).astype(np.uint8)
            comm.put_signal(src, peer, win, (world.rank * len(slots) + k) * block, signal_index=s, context=c)
    x = np.arange(1001, dtype=np.float32) * (world.rank + 1)
    y = np.empty_like(x)
    comm.allreduce(x, y)
    expected = np.arange(1001, dtype=np.float32) * (n * (n + 1) // 2)
    comm.wait_signal([WaitSignalDesc(1, p, s, c) for p in range(n) if p != world.rank for c, s in slots])
    wrong = []
    for p in range(n):
        for k in range(len(slots)):
            at = (p * len(slots) + k) * block
            want = np.zeros(block, np.uint8) if p == world.rank else ((np.arange(block) + 31 * p + k) % 251)
            if not (buf[at : at + block] == want).all():
                wrong.append((p, k))
    if not (y == expected).all():
        wrong.append(("allreduce", int((y != expected).sum())))
    world.barrier(what="lands: checked")
    comm.deregister_window(win)
    assert not win.is_valid
    comm.close()
    return wrong


def strong_promise(world, backend, wire, network="shm", seed=0, rounds=200, fault=None):
    """Rank 0 sends `rounds` rounds of three puts (one larger than the staging ring, so
    posted in pieces) to rank 1, each put's signal strong; rank 1 checks every put's data
    as soon as its signal is seen, then acks, so rank 0 overwrites only checked data.
    Returns (rounds checked, failures)."""
    more = {} if fault is None else {"fault": fault}
    comm = _comm(world, backend, wire, network=network, seed=seed, segment_bytes=64, rma_staging=4096, **more)
    sizes = (1000, 64, 9000)  # 9000 > rma_staging: three pieces
    offsets = np.cumsum((0, *sizes))
    buf = np.zeros(int(offsets[-1]), np.uint8)
    win = comm.register_window(buf)
    bad = checked = 0
    for r in range(rounds):
        if world.rank == 0:
            for i, size in enumerate(sizes):
                src = np.full(size, (r * 3 + i) % 255 + 1, np.uint8)
                comm.put_signal(src, 1, win, int(offsets[i]), signal_index=0)
            comm.wait_signal([WaitSignalDesc(1, 1)])  # the ack
        elif world.rank == 1:
            for i, size in enumerate(sizes):
                comm.wait_signal([WaitSignalDesc(1, 0)])
                seen = buf[offsets[i] : offsets[i] + size]
                bad += int((seen != (r * 3 + i) % 255 + 1).sum() != 0)
                checked += 1
            comm.signal(0)
    world.barrier(what="promise: done")
    comm.close()
    return checked, bad


def stream(world, backend, wire, network="shm", puts=24, nbytes=40_000):
    """Rank 0 posts `puts` puts of `nbytes` (over the native engine's 16 KiB inline limit
    on network mpi, so sent from the staging ring itself) back to back through a
    64 KiB staging ring, each into its own block of rank 1's window; rank 1 waits for them
    all and returns the blocks that are wrong (staging reused under a send in flight)."""
    comm = _comm(world, backend, wire, network=network, rma_staging=64 << 10)
    buf = np.zeros(puts * nbytes, np.uint8)
    win = comm.register_window(buf)
    wrong = []
    if world.rank == 0:
        for i in range(puts):
            comm.put_signal(np.full(nbytes, i + 1, np.uint8), 1, win, i * nbytes)
    elif world.rank == 1:
        comm.wait_signal([WaitSignalDesc(puts, 0)])
        wrong = [i for i in range(puts) if not (buf[i * nbytes : (i + 1) * nbytes] == i + 1).all()]
    world.barrier(what="stream: done")
    comm.close()
    return wrong


def ping_pong(world, backend, wire, network="shm", rounds=100, nbytes=4096):
    """Rank 0 and 1 bounce a buffer `rounds` times, each adding one to it; returns the
    final value seen (rounds * 2 when every hop carried the previous one's data) and the
    seconds per one-way hop."""
    import time

    comm = _comm(world, backend, wire, network=network)
    buf = np.zeros(nbytes // 4, np.uint32)
    win = comm.register_window(buf)
    mine = np.zeros_like(buf)
    peer = 1 - world.rank
    world.barrier(what="ping-pong: start")
    t0 = time.perf_counter()
    for i in range(rounds):
        if world.rank == 0:
            mine[:] = buf + 1
            comm.put_signal(mine, peer, win, 0)
            comm.wait_signal([WaitSignalDesc(1, peer)])
        else:
            comm.wait_signal([WaitSignalDesc(1, peer)])
            mine[:] = buf + 1
            comm.put_signal(mine, peer, win, 0)
    per_hop = (time.perf_counter() - t0) / (2 * rounds)
    value = int(buf[0]) if (buf == buf[0]).all() else -1
    world.barrier(what="ping-pong: done")
    comm.close()
    return value, per_hop


def refuses_on_gda(world, wire, network="shm"):
    """gda: put_signal refuses (weak signals only); signal and wait_signal work."""
    comm = _comm(world, "gda", wire, network=network, gin_protocol="signal-per-put")
    buf = np.zeros(64, np.uint8)
    win = comm.register_window(buf)
    try:
        comm.put_signal(np.ones(8, np.uint8), 1 - world.rank, win, 0)
        refused = None
    except CapabilityError as e:
        refused = str(e)
    comm.signal(1 - world.rank)
    comm.wait_signal([WaitSignalDesc(1, 1 - world.rank)])
    world.barrier(what="gda: done")
    comm.close()
    return refused


# ---------------------------------------------------------------------------------------
# under mpiexec: python -m mpi4py tests/test_gin_rma.py MODE WIRE BACKEND
# ---------------------------------------------------------------------------------------

if __name__ == "__main__":
    from commref.transports.mpi_world import MPIWorld

    world = MPIWorld()
    mode, wire, backend = sys.argv[1:4]
    if mode == "lands":
        out = {"wrong": lands(world, backend, wire, network="mpi")}
    elif mode == "promise":
        out = dict(zip(("checked", "bad"), strong_promise(world, backend, wire, network="mpi", rounds=100)))
    elif mode == "stream":
        out = {"wrong": stream(world, backend, wire, network="mpi")}
    elif mode == "ping-pong":
        value, hop = ping_pong(world, backend, wire, network="mpi", rounds=200)
        out = {"value": value, "hop_us": hop * 1e6}
    elif mode == "gda":
        out = {"refused": refuses_on_gda(world, wire, "mpi") if backend == "gda" else None}
    elif mode == "shm":  # processes on network shm: a plain buffer is refused on every rank,
        comm = _comm(world, backend, wire, network="shm")  # one from alloc_symmetric carried
        try:
            comm.register_window(np.zeros(64, np.uint8))
            out = {"refused": None}
        except CapabilityError as e:
            out = {"refused": str(e)}
        buf = comm.alloc_symmetric(5000, "uint8")[1000:]  # an offset inside the window
        win = comm.register_window(buf)
        peer = (world.rank + 1) % world.size
        comm.put_signal(np.full(3000, world.rank + 1, np.uint8), peer, win, 500)
        source = (world.rank - 1) % world.size
        comm.wait_signal([WaitSignalDesc(1, source)])
        out["symmetric_ok"] = bool((buf[500:3500] == source + 1).all() and not buf[:500].any())
        world.barrier(what="shm: checked")
        comm.deregister_window(win)
        comm.close()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    sys.stdout.write("RMA " + json.dumps({"rank": world.rank, **out}) + "\n")
    sys.stdout.flush()
    world.barrier(what="rma job done")
    sys.exit(0)


# ---------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------

import re  # noqa: E402

import pytest  # noqa: E402
from conftest import run_mpi  # noqa: E402

# (backend, wire, engine): the native engine carries the ordered wire, the Python proxy
# the unordered one (and the ordered one when asked, COMMREF_GIN_ENGINE=python).
STRONG = [
    ("proxy", "ordered", "auto"),
    ("proxy", "ordered", "python"),
    ("proxy", "unordered", "auto"),
    ("rc", "ordered", "auto"),
]


@pytest.fixture
def engine(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setenv("COMMREF_GIN_ENGINE", "python")
    else:
        monkeypatch.delenv("COMMREF_GIN_ENGINE", raising=False)
    return request.param


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("backend, wire, engine", STRONG, indirect=["engine"])
def test_put_signal_lands(backend, wire, engine, nranks):
    assert ThreadWorld.run(nranks, lands, backend, wire, timeout=TIMEOUT) == [[]] * nranks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_strong_signal_promise_on_the_unordered_wire(seed):
    results = ThreadWorld.run(2, strong_promise, "proxy", "unordered", "shm", seed, timeout=120)
    assert results[1] == (200 * 3, 0), results


LOSSY = "drop=0.05,dup=0.05,delay=0.05"  # a lossy link under the wire, SRD's reliability layer above


@pytest.mark.parametrize("wire", ["ordered", "unordered"])
def test_put_signal_lands_on_a_lossy_wire(wire):
    assert ThreadWorld.run(3, lands, "proxy", wire, "shm", 4, LOSSY, timeout=TIMEOUT) == [[]] * 3


def test_strong_signal_promise_on_a_lossy_unordered_wire():
    results = ThreadWorld.run(2, strong_promise, "proxy", "unordered", "shm", 5, 100, LOSSY, timeout=120)
    assert results[1] == (100 * 3, 0), results


@pytest.mark.parametrize("backend, wire, engine", STRONG, indirect=["engine"])
def test_staging_ring_reuse(backend, wire, engine):
    assert ThreadWorld.run(2, stream, backend, wire, timeout=TIMEOUT) == [[], []]


@pytest.mark.parametrize("backend, wire, engine", STRONG, indirect=["engine"])
def test_ping_pong(backend, wire, engine):
    results = ThreadWorld.run(2, ping_pong, backend, wire, timeout=TIMEOUT)
    assert [v for v, _ in results] == [200, 199], results


@pytest.mark.parametrize("wire", ["ordered", "unordered"])
def test_gda_refuses_put_signal_and_carries_signals(wire):
    refused = ThreadWorld.run(2, refuses_on_gda, wire, timeout=TIMEOUT)
    assert all(r is not None and "weak signals only" in r and "gda" in r for r in refused), refused


def _bad_inputs(world):
    comm = _comm(world, rma_contexts=2, rma_signals=2, timeout=1.0)
    other = _comm(world)
    peer, me = 1 - world.rank, world.rank
    buf = np.zeros(256, np.uint8)
    win = comm.register_window(buf)
    foreign = other.register_window(np.zeros(256, np.uint8))
    gone = comm.register_window(np.zeros(16, np.uint8))
    comm.deregister_window(gone)
    x = np.ones(64, np.uint8)
    seen = {}

    def expect(name, exc, pattern, fn, *args, **kw):
        try:
            fn(*args, **kw)
        except exc as e:
            assert re.search(pattern, str(e)), (name, str(e))
            assert f"rank {me}" in str(e), (name, str(e))
            seen[name] = type(e).__name__
            return e
        raise AssertionError(f"{name}: no {exc.__name__}")

    expect(
        "too small",
        ValueError,
        r"64 bytes at offset 200 pass the end of the 256-byte",
        comm.put_signal,
        x,
        peer,
        win,
        200,
    )
    expect("offset", ValueError, r"offset must be in", comm.put_signal, x, peer, win, -1)
    expect("peer range", ValueError, r"peer must be in \[0, 2\), got 2", comm.put_signal, x, 2, win, 0)
    expect("peer self", ValueError, r"is this rank", comm.put_signal, x, me, win, 0)
    expect("peer type", TypeError, r"peer must be an integer", comm.signal, "1")
    expect("not a window", TypeError, r"must be a RegisteredWindow", comm.put_signal, x, peer, "win", 0)
    expect("foreign window", ValueError, r"another communicator", comm.put_signal, x, peer, foreign, 0)
    expect("deregistered", ValueError, r"deregistered", comm.put_signal, x, peer, gone, 0)
    expect("deregistered twice", ValueError, r"deregistered", comm.deregister_window, gone)
    expect("signal index", ValueError, r"signal_index must be in \[0, 2\), got 2", comm.put_signal, x, peer, win, 0, 2)
    expect("context", ValueError, r"context must be in \[0, 2\), got 5", comm.signal, peer, 0, 5)
    expect("wait index", ValueError, r"signal_index must be in", comm.wait_signal, [WaitSignalDesc(1, peer, 3)])
    expect("wait peer", ValueError, r"peer must be in", comm.wait_signal, [WaitSignalDesc(1, 7)])
    expect("wait descs", TypeError, r"list of WaitSignalDesc", comm.wait_signal, WaitSignalDesc(1, peer))
    expect("localbuff", TypeError, r"numpy array", comm.put_signal, [1, 2], peer, win, 0)
    expect("read-only window", ValueError, r"read-only", comm.register_window, np.frombuffer(b"12345678", np.uint8))
    # nothing above posted anything: a signal now is the first the peer sees
    comm.signal(peer, 1, 1)
    comm.wait_signal([WaitSignalDesc(1, peer, 1, 1)])
    world.barrier(what="bad inputs: before the timeout")
    e = expect(
        "timeout",
        CommTimeout,
        r"peer \d's signal 0 on context 1 \(expected 2 arrivals, seen 0\)",
        comm.wait_signal,
        [WaitSignalDesc(2, peer, 0, 1)],
    )
    assert (e.rank, e.peer, e.expected, e.seen) == (me, peer, 2, 0)
    expect("after the timeout", Exception, r"unusable", comm.signal, peer)
    world.barrier(what="bad inputs: done")
    other.close()
    comm.close()
    return seen


def test_bad_inputs_raise_clear_errors():
    seen = ThreadWorld.run(2, _bad_inputs, timeout=TIMEOUT)
    assert seen[0] == seen[1] and len(seen[0]) == 18, seen


def test_lsa_only_communicator_refuses():
    def body(world):
        comm = Communicator(world, "cpu", timeout=TIMEOUT, path="lsa")
        try:
            with pytest.raises(CapabilityError, match="no GIN peer"):
                comm.register_window(np.zeros(64, np.uint8))
            with pytest.raises(CapabilityError, match="no GIN peer"):
                comm.signal(1 - world.rank)
        finally:
            comm.close()
        return True

    assert ThreadWorld.run(2, body, timeout=TIMEOUT) == [True, True]


def test_gpu_communicator_refuses():
    from commref.collectives import rma

    class Fake:  # what Rma reads of a GPU communicator, before it builds anything
        device = "cuda"

    assert "CPU engine" in rma.Rma._refusal(type("R", (), {"comm": Fake()})())


# ---- under mpiexec (network mpi: one process per rank) ----


def _mpi(mode, wire, backend, nranks=2, timeout=120):
    script = os.path.relpath(__file__, os.path.dirname(os.path.dirname(__file__)))
    proc = run_mpi(nranks, [script, mode, wire, backend], timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = [json.loads(m) for m in re.findall(r"^RMA (\{.*\})$", proc.stdout, re.M)]
    assert sorted(r["rank"] for r in lines) == list(range(nranks)), out[-4000:]
    return sorted(lines, key=lambda r: r["rank"])


MPI_STRONG = [("proxy", "ordered"), ("proxy", "unordered"), ("rc", "ordered")]


@pytest.mark.mpi
@pytest.mark.parametrize("backend, wire", MPI_STRONG)
def test_mpi_put_signal_lands(backend, wire):
    assert [r["wrong"] for r in _mpi("lands", wire, backend, nranks=3)] == [[]] * 3


@pytest.mark.mpi
def test_mpi_strong_signal_promise_on_the_unordered_wire():
    r = _mpi("promise", "unordered", "proxy")
    assert (r[1]["checked"], r[1]["bad"]) == (300, 0), r


@pytest.mark.mpi
@pytest.mark.parametrize("backend, wire", MPI_STRONG)
def test_mpi_staging_ring_reuse_waits_for_sends(backend, wire):
    assert [r["wrong"] for r in _mpi("stream", wire, backend)] == [[], []]


@pytest.mark.mpi
@pytest.mark.parametrize("backend, wire", MPI_STRONG)
def test_mpi_ping_pong(backend, wire):
    r = _mpi("ping-pong", wire, backend)
    assert [x["value"] for x in r] == [400, 399], r


@pytest.mark.mpi
@pytest.mark.parametrize("wire", ["ordered", "unordered"])
def test_mpi_gda_refuses_put_signal(wire):
    r = _mpi("gda", wire, "gda")
    assert all("weak signals only" in x["refused"] for x in r), r


@pytest.mark.mpi
@pytest.mark.parametrize("wire", ["ordered", "unordered"])
def test_mpi_network_shm_takes_symmetric_buffers_only(wire):
    r = _mpi("shm", wire, "proxy", nranks=3)
    assert all("network='mpi'" in x["refused"] and x["symmetric_ok"] for x in r), r
