"""The GIN proxy's parts: the descriptor queue's reader and writer, the
observer, and the host atomics.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WORLD_TIMEOUT

from commref.device_kernels import abi
from commref.transports.gin import semantics
from commref.transports.gin.backends import BACKENDS
from commref.transports.thread_world import ThreadWorld

# ---------------------------------------------------------------------------------------
# the proxy's parts: queue reader and writer, observer, host atomics
# ---------------------------------------------------------------------------------------


def test_queue_writer_and_reader_agree_on_the_abi_layout():
    from commref.transports.gin.atomics import host_atomics
    from commref.transports.gin.queue import Descriptor, QueueReader, QueueWriter, queue_bytes

    cap = 4
    lay = np.zeros((), abi.WINDOW_LAYOUT)
    lay["ginQueueOff"] = 128
    local = np.zeros(128 + queue_bytes(cap) + 64, np.uint8)
    atomics = host_atomics()
    w, r = QueueWriter(local, lay, cap, atomics), QueueReader(local, lay, cap, atomics)
    assert r.take() is None
    slots = [
        w.fill(abi.GIN_PUT, abi.GIN_HAS_SIGNAL | abi.GIN_STRONG, 1, 2, 640, 64, 200, 3, 1),
        w.fill(abi.GIN_FLUSH, ctx=-1),
    ]
    assert slots == [0, 1] and r.take() is None  # filled, not yet published
    header = local[128 + cap * abi.GIN_DESCRIPTOR.itemsize :].view(np.uint64)
    assert header[abi.GIN_QUEUE_CLAIMED // 8] == 2 == r.claimed()
    w.publish(slots)
    d = r.take()
    assert d == Descriptor(1, abi.GIN_PUT, abi.GIN_HAS_SIGNAL | abi.GIN_STRONG, 1, 2, 640, 64, 200, 3, 1, 0, 0)
    assert r.take() == d and r.consumed() == 0  # taken, not consumed until done()
    r.done()
    assert r.consumed() == 1 == header[abi.GIN_QUEUE_CONSUMED // 8] and w.consumed() == 1
    assert r.take()[:5] == (2, abi.GIN_FLUSH, 0, -1, -1)  # peer and ctx are signed
    r.done()
    for _ in range(cap):  # the ring wraps onto the entries the reader has consumed
        w.publish([w.fill(abi.GIN_SIGNAL, peer=0)])
    with pytest.raises(RuntimeError, match="GIN queue full"):
        w.fill(abi.GIN_SIGNAL)


def _observed_proxy(world, wire: str):
    """Rank 0 posts three puts of 200 bytes (64-byte segments) to rank 1, the last with a
    strong signal and every one with a counter, then a doorbell; the proxy's observer and
    trace see the same landings."""
    from commref.transports.gin.atomics import host_atomics
    from commref.transports.gin.engine import EngineSite
    from commref.transports.gin.observer import Observer
    from commref.transports.gin.proxy import GinProxy
    from commref.transports.gin.queue import QueueWriter, queue_bytes
    from commref.transports.windows import register_window

    class Recorder(Observer):
        def __init__(self):
            self.landings = []

        def landed(self, peer, ctx, seq, segment, copy):
            self.landings.append((peer, ctx, seq, segment, copy))

    cap = 8
    lay = np.zeros((), abi.WINDOW_LAYOUT)
    lay["ginQueueOff"] = 1024
    lay["ginSignalsOff"] = 1024 + queue_bytes(cap)
    lay["ginCountersOff"] = int(lay["ginSignalsOff"]) + 64
    window = register_window(world, int(lay["ginCountersOff"]) + 64, "cpu")
    try:
        local = window.local
        if world.rank == 0:
            local[:600] = (np.arange(600) % 251 + 1).astype(np.uint8)
        world.barrier(what="sources written")
        out = None
        if world.rank == 0:
            rec = Recorder()
            transport = semantics.ORDERED if wire == "ordered" else semantics.UNORDERED
            proxy = GinProxy(
                EngineSite(world, window, lay, cap, BACKENDS["proxy"], transport, "shm"), 3, 64, observer=rec
            )
            proxy.trace = {}
            proxy.start()
            q = QueueWriter(local, lay, cap, host_atomics())
            flags = abi.GIN_HAS_COUNTER
            slots = [
                q.fill(
                    abi.GIN_PUT,
                    flags | (abi.GIN_HAS_SIGNAL | abi.GIN_STRONG if i == 2 else 0),
                    1,
                    0,
                    200 * i,
                    200 * i,
                    200,
                    0,
                    1,
                    5,
                )
                for i in range(3)
            ]
            slots.append(q.fill(abi.GIN_DOORBELL, peer=1, ctx=0))
            q.publish(slots)
            proxy.quiesce(WORLD_TIMEOUT)
            proxy.stop()
            assert proxy.error is None, proxy.error
            counter = int(local[int(lay["ginCountersOff"]) + 40 : int(lay["ginCountersOff"]) + 48].view(np.uint64)[0])
            out = rec.landings, proxy.trace, proxy.stats, counter, proxy.pending()
        world.barrier(what="landed")
        if world.rank == 1:
            sig = int(local[int(lay["ginSignalsOff"]) : int(lay["ginSignalsOff"]) + 8].view(np.uint64)[0])
            out = sig, bool((local[:600] == (np.arange(600) % 251 + 1)).all())
        world.barrier(what="checked")
        return out
    finally:
        window.close()


@pytest.mark.parametrize("wire", ["ordered", "unordered"])
def test_observer_sees_every_landing(wire):
    (landings, trace, stats, counter, pending), (signal, data_ok) = ThreadWorld.run(
        2, _observed_proxy, wire, timeout=WORLD_TIMEOUT
    )
    assert signal == 1 and data_ok and counter == 3 and not pending
    assert stats["ops"] == 4
    strong = semantics.Signal(True, ("index", 0), 1)
    assert [r for r in trace[(1, 0)] if r[0] == "post"] == [
        ("post", i, 200 * i, 200, strong if i == 2 else None) for i in range(3)
    ]
    assert [r for r in trace[(1, 0)] if r[0] == "counter"] == [("counter", i, 5) for i in range(3)]
    landed = [
        (r[1], None if r[0] == "data" else -1 if r[0] == "signal" else r[2], 0 if len(r) < 4 else r[3])
        for r in trace[(1, 0)]
        if r[0] in ("data", "seg", "signal")
    ]
    assert landed == [(seq, seg, copy) for _, _, seq, seg, copy in landings]
    if wire == "ordered":  # a put's data in one piece, then its signal
        assert landings == [(1, 0, 0, None, 0), (1, 0, 1, None, 0), (1, 0, 2, None, 0), (1, 0, 2, -1, 0)]
    else:  # 4 segments per put ([0,64) [64,128) [128,192) [192,200) of the first), in the trace's order
        assert sorted(landings) == sorted([(1, 0, s, g, 0) for s in range(3) for g in range(4)] + [(1, 0, 2, -1, 0)])
        assert landings[-1] == (1, 0, 2, -1, 0)  # strong: after the data of its put and of every earlier one
        assert stats["events"] == 13


def test_host_atomics_are_not_the_kernel_engine():
    """The proxy's acquire/release/fetch-add come from the transport's own shim, not
    from the CPU kernel library (which no longer exports them)."""
    import ctypes

    from commref.device_kernels import cpu_loader
    from commref.transports.gin.atomics import host_atomics

    a = host_atomics()
    assert a is host_atomics() and "commref_gin_atomics" in a.path.name
    x = np.zeros(2, np.uint64)
    assert a.add_u64(x.ctypes.data, 5) == 0 and a.add_u64(x.ctypes.data, 2) == 5
    a.store_release_u64(x.ctypes.data + 8, 9)
    assert a.load_acquire_u64(x.ctypes.data) == 7 and x[1] == 9
    lib = ctypes.CDLL(str(cpu_loader.cpu_kernels().path))
    assert not hasattr(lib, "commref_atomic_add_u64")
