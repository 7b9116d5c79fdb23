"""GIN on GPUs: the copy-engine proxy (GpuProxy), one host thread per rank.

The kernels post descriptors exactly as on the CPU engine (gin.h); what changes is where
the words live and what moves the bytes:

| word | where | written by | order |
| --- | --- | --- | --- |
| queue, claimed, consumed | pinned host memory mapped into the device (queue.QueueRegion) | kernels; the proxy (consumed) | as on the CPU (gin.h): seq released last, consumed released after the descriptor is done |
| counters | the same pinned allocation, after the queue | the proxy (host atomic add, release) | once the put's copy has completed (an event after it on the peer's stream) |
| data | the peer's window, device memory mapped here by CUDA IPC (`window.peer_addresses`) | the copy engine: cuMemcpyAsync on the peer's stream | in stream order |
| signals | the target's window (`ginSignalsOff`, or a VA offset) | cuStreamWriteValue64 on the peer's stream | after every earlier copy and write of that stream (the write carries a system-scope fence) |

One non-blocking stream per peer (they never wait for the spinning kernels on the
legacy stream), so every (peer, ctx) link is FIFO: the ordered wire. A signal is
written after its data in stream order, which makes it strong (every earlier put to
that peer, of any context, is visible first) as well as weak. Signals are written, not
added: the proxy keeps a shadow of each signal word it writes at a peer and writes
shadow + value (as MSCCL++'s proxy does for CUDA IPC peers). That needs the proxy to be
the word's only writer; in the collectives every ready and credit signal belongs to one
connection (one sender), and no kernel resets a signal. A device-API user who signals
one word from several ranks needs the CPU engine's proxies (or a network backend), not
this one.

- putValue: cuStreamWriteValue64 of the 8 bytes at the destination, on the peer's stream.
- get: cuMemcpyAsync from the peer's window into this rank's, and the get's slot is
  consumed once it has completed (so a flush covers it).
- flush: waits until every stream's work has completed (the sources of earlier puts are
  reusable, earlier gets have landed), then the slot is consumed.
- doorbell: nothing more (the ordered wire lands in posted order).
- Refusals: proxy.remote_action's (a strong signal on a weak-only backend, ...), a peer
  outside the world or not mapped here, a range outside the window. The error is kept
  (`error`), the world's abort word raised, and the thread ends, so kernels fail.

Network mpi (peers on other hosts): the proxies exchange wires.MpiWire's messages on
their own communicator, and the window is reached through DeviceWindow. A put's source
is copied device-to-host (the proxy waits for the copy: the source is then reusable and
the counter bumped) and sent; the receiving proxy copies the data host-to-device on the
sender's stream and then writes the signal after it on that stream, from its own shadow
of the word: on this network the target's proxy is the only writer of its signals (as
aws-ofi-nccl's receiver applies EFA signals), so several senders may share one. A get
is a request and a reply copied host-to-device, settled before its slot is consumed. MPI
keeps one source's messages in order, and one stream per source keeps their landings in
order: the wire stays ordered.

The driver calls go through `driver` (CudaDriver: cuda-python's cuda.bindings.driver);
tests hand in a stand-in that runs the same protocol over host memory with copies that
land late (tests/test_gin_gpu_proxy.py). GPU kernels cannot ring the engine (gin.h's
idle word), so the thread polls: it yields for a while after work and then sleeps 20 us
at a time.

With `trace = {}` the proxy records, per (peer, ctx), the ordered-wire events of the
Python scheduler's format (see native.decode_trace) as it issues them: post, data,
signal, counter (when its copy completed), flush, doorbell, get.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from commref.device_kernels import abi
from commref.transports.errors import CapabilityError
from commref.transports.gin import semantics
from commref.transports.gin.atomics import host_atomics
from commref.transports.gin.backends import Backend
from commref.transports.gin.proxy import remote_action
from commref.transports.gin.queue import QueueReader, QueueRegion
from commref.transports.gin.wires import TAG, MpiWire, ProxyError, wait_drained

__all__ = ["GpuProxy", "CudaDriver"]

DRAIN_BUDGET = 64
MASK64 = (1 << 64) - 1


def _flag(member) -> int:
    """A cuda-python enum member as the unsigned int a Flags parameter takes."""
    return int(getattr(member, "value", member))


class CudaDriver:
    """The driver calls of the copy-engine proxy, through cuda-python (cuda.bindings.driver,
    or cuda.cuda before 12.6). Every call checks its CUresult and raises ProxyError
    naming the call; construction refuses (CapabilityError) without cuda-python or
    without 64-bit stream memory operations."""

    def __init__(self, device_id: int):
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            try:
                from cuda import cuda as cu  # cuda-python before 12.6
            except ImportError:
                raise CapabilityError("GIN on GPUs drives the copy engine through cuda-python, which is not "
                                      "installed (pip install 'commref[cuda12]' or 'commref[cuda13]')") from None
        self.cu = cu
        self._ok = cu.CUresult.CUDA_SUCCESS
        self._not_ready = cu.CUresult.CUDA_ERROR_NOT_READY
        self._call(cu.cuInit, "cuInit", 0)
        self.dev = self._call(cu.cuDeviceGet, "cuDeviceGet", device_id)
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
        if not self._call(cu.cuDeviceGetAttribute, "cuDeviceGetAttribute", attr, self.dev):
            raise CapabilityError(f"GIN on device {device_id}: signals are written with cuStreamWriteValue64, "
                                  f"and the device does not offer 64-bit stream memory operations")
        self.ctx = self._call(cu.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", self.dev)
        self._streams: list = []
        self._events: list = []  # every event made, for close()
        self._free_events: list = []

    def _call(self, fn, what: str, *args):
        err, *out = fn(*args)
        if err != self._ok:
            raise ProxyError(f"GIN copy-engine proxy: {what} failed: {err}")
        return out[0] if len(out) == 1 else (tuple(out) or None)

    def bind(self) -> None:
        """Makes the device's primary context current in the calling thread (the proxy's)."""
        self._call(self.cu.cuCtxSetCurrent, "cuCtxSetCurrent", self.ctx)

    def stream(self):
        s = self._call(self.cu.cuStreamCreate, "cuStreamCreate", _flag(self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self._streams.append(s)
        return s

    def copy(self, dst: int, src: int, nbytes: int, stream) -> None:
        self._call(self.cu.cuMemcpyAsync, "cuMemcpyAsync", dst, src, nbytes, stream)

    def write_value(self, addr: int, value: int, stream) -> None:
        self._call(self.cu.cuStreamWriteValue64, "cuStreamWriteValue64", stream, addr, value, 0)

    def event_after(self, stream):
        """An event recorded after everything issued to `stream` so far."""
        if self._free_events:
            ev = self._free_events.pop()
        else:
            ev = self._call(self.cu.cuEventCreate, "cuEventCreate", _flag(self.cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
            self._events.append(ev)
        self._call(self.cu.cuEventRecord, "cuEventRecord", ev, stream)
        return ev

    def done(self, ev) -> bool:
        """Whether the work before `ev` has completed (the event is reused once it has)."""
        err, = self.cu.cuEventQuery(ev)
        if err == self._ok:
            self._free_events.append(ev)
            return True
        if err == self._not_ready:
            return False
        raise ProxyError(f"GIN copy-engine proxy: cuEventQuery failed: {err}")

    def idle(self, stream) -> bool:
        """Whether everything issued to `stream` has completed."""
        err, = self.cu.cuStreamQuery(stream)
        if err == self._ok:
            return True
        if err == self._not_ready:
            return False
        raise ProxyError(f"GIN copy-engine proxy: cuStreamQuery failed: {err}")

    def close(self) -> None:
        """Destroys the streams and events and releases the context (the proxy's thread has ended)."""
        cu = self.cu
        for ev in self._events:
            cu.cuEventDestroy(ev)
        for s in self._streams:
            cu.cuStreamDestroy(s)
        self._events, self._free_events, self._streams = [], [], []
        if self.ctx is not None:
            cu.cuDevicePrimaryCtxRelease(self.dev)
            self.ctx = None


class DeviceWindow:
    """wires.MpiWire's memory (see wires.HostMemory) for a window on a GPU, through the
    copy-engine proxy's driver and streams: data from peer p is copied host-to-device on
    p's stream (its host buffer kept until the copy has run), a signal from p written
    after it on that stream from this rank's shadow of the word (the receiving proxy is
    its only writer on network mpi), a read copied device-to-host and waited for."""

    READ_STREAM = -1  # the key of the stream reads go on

    def __init__(self, proxy: "GpuProxy"):
        self.proxy = proxy
        self._shadow: dict = {}  # offset of one of this rank's signal words -> the value last written
        self.held: collections.deque = collections.deque()  # (event, host buffer) until the copy ran

    def write(self, src: int, offset: int, data: np.ndarray) -> None:
        p = self.proxy
        p._check_range("landing", src, offset, data.size)
        if data.size:
            stream = p._stream(src)
            p.driver.copy(p._base + offset, data.ctypes.data, data.size, stream)
            self.held.append((p.driver.event_after(stream), data))

    def read(self, offset: int, size: int) -> np.ndarray:
        p = self.proxy
        p._check_range("read", p.rank, offset, size)
        out = np.empty(size, np.uint8)
        if size:
            stream = p._stream(self.READ_STREAM)
            p.driver.copy(out.ctypes.data, p._base + offset, size, stream)
            ev = p.driver.event_after(stream)
            p._wait(lambda: p.driver.done(ev), f"copying {size} bytes of this rank's window to the host")
        return out

    def add_signal(self, src: int, offset: int, value: int) -> None:
        p = self.proxy
        p._check_range("signal", src, offset, 8)
        value = self._shadow[offset] = (self._shadow.get(offset, 0) + value) & MASK64
        p.driver.write_value(p._base + offset, value, p._stream(src))  # after src's data: stream order

    def settle(self, src: int) -> None:
        p = self.proxy
        stream = p._stream(src)
        p._wait(lambda: p.driver.idle(stream), f"landing what peer {src} sent")

    def reap(self) -> int:
        """Drops the host buffers whose copies have run, oldest first; how many."""
        n = 0
        while self.held and self.proxy.driver.done(self.held[0][0]):
            self.held.popleft()
            n += 1
        return n


class GpuProxy:
    """The copy-engine proxy of one rank (see the module docstring): start(), quiesce(),
    stop(), error, stats, pending(), trace, as GinProxy. `layout`: the window's
    WindowLayout (its ginSignalsOff); `region`: the rank's queue.QueueRegion; `window`:
    its symmetric window, with the GIN peers' windows mapped on network "shm"; network
    "mpi": `mpi_comm`, the proxies' own communicator, and `mpi_tag`, their tag
    (plan.network_tag()); `driver`: a CudaDriver (made here when None)."""

    def __init__(self, world, window, layout, region: QueueRegion, capacity: int, backend: Backend,
                 transport: semantics.Transport, device_id: int = 0, driver=None, network: str = "shm",
                 mpi_comm=None, mpi_tag: int = TAG):
        if not transport.ordered:
            raise CapabilityError(f"rank {world.rank}: the GIN copy-engine proxy carries the ordered wire only")
        self.world, self.rank, self.backend, self.transport = world, world.rank, backend, transport
        self.window, self.region, self.capacity = window, region, capacity
        self.driver = driver if driver is not None else CudaDriver(device_id)
        atomics = host_atomics()
        self._add = atomics.add_u64
        self.queue = QueueReader(region.queue, QueueRegion.LAYOUT, capacity, atomics)
        self._counters_base = int(region.counters.ctypes.data)
        self._base = int(window.address)
        self._peer_base = [int(a) for a in window.peer_addresses]
        self._window_bytes = int(window.local.nbytes)
        self._signals_off = int(layout["ginSignalsOff"])
        self.network = network
        self.memory = self.wire = None
        if network == "mpi":
            if mpi_comm is None:
                raise ValueError(f"rank {world.rank}: the GIN copy-engine proxy on network 'mpi' needs the "
                                 f"proxies' communicator")
            self.memory = DeviceWindow(self)
            self.wire = MpiWire(mpi_comm, self.rank, window, self._signals_off, atomics, world.timeout,
                                memory=self.memory, tag=mpi_tag)
        elif network != "shm":
            raise ValueError(f"GIN copy-engine proxy network must be 'shm' or 'mpi', not {network!r}")
        self._streams: dict = {}  # peer -> its stream (made in the thread)
        self._shadow: dict = {}  # peer's window offset of a signal word -> the value last written there
        self._counters: collections.deque = collections.deque()  # (event, counter, peer, ctx, seq), oldest first
        self._links: dict = {}  # (peer, ctx) -> [puts posted, doorbells rung]
        self._in_flight = False  # the thread saw unfinished copies or counters (quiesce's view)
        self.error: BaseException | None = None
        self.stats = {"ops": 0, "events": 0}
        self.trace: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"commref-gin-gpu-proxy-{self.rank}", daemon=True)
        self._stopped = False

    # ---- lifecycle ----

    def start(self) -> None:
        self._thread.start()

    def pending(self, peer: int | None = None) -> bool:
        """Whether issued work has not completed (copies, or counters not yet bumped)."""
        return self._in_flight

    def quiesce(self, timeout: float) -> None:
        """Waits until every operation posted so far has been taken and has completed."""
        def state():
            claimed = self.queue.claimed()
            done = (self.queue.next >= claimed and not self._in_flight) or self.error is not None \
                or not self._thread.is_alive()
            return done, claimed, self.queue.next

        wait_drained(state, f"rank {self.rank}: GIN copy-engine proxy", timeout)

    def stop(self) -> None:
        """Stops and joins the thread (idempotent), waits (bounded) for what its streams
        still hold (network mpi: a peer's last messages may land after this rank's
        quiesce), then releases the driver's streams (and, network mpi, frees the
        proxies' communicator). Streams that do not drain by the deadline are left as
        they are (an error), never destroyed under a copy."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.world.timeout)
        if self._thread.is_alive():
            self.error = self.error or ProxyError(f"rank {self.rank}: the GIN copy-engine proxy's thread did not "
                                                  f"end within {self.world.timeout} s")
            return  # its streams stay: the thread may still use them
        self.driver.bind()  # the device's primary context, current here too (CuPy's own)
        deadline = time.monotonic() + self.world.timeout
        while not self._streams_idle():
            if time.monotonic() > deadline:
                self.error = self.error or ProxyError(f"rank {self.rank}: the GIN copy-engine proxy's streams did "
                                                      f"not drain within {self.world.timeout} s of its stop")
                return
            time.sleep(0)
        if self.memory is not None:
            self.memory.reap()
        self.driver.close()
        if self.wire is not None:  # the proxies' own communicator, a Dup made for this proxy
            self.wire.comm.Free()

    # ---- the thread ----

    def _main(self) -> None:
        idle = 0
        try:
            self.driver.bind()
            while not self._stop.is_set():
                took = self._drain(DRAIN_BUDGET)
                moved = self._progress()
                if took or moved:
                    idle = 0
                    continue
                self._in_flight = not self._quiet()
                idle += 1
                time.sleep(0 if idle < 2000 else 20e-6)
        except BaseException as e:  # the kernels must not wait forever on a dead proxy
            self.error = e if isinstance(e, ProxyError) else ProxyError(f"rank {self.rank}: GIN copy-engine proxy: "
                                                                       f"{type(e).__name__}: {e}")
            self.world.abort_word[0] = 1

    def _drain(self, budget: int) -> int:
        took = 0
        while took < budget:
            d = self.queue.take()
            if d is None:
                break
            self._in_flight = True
            self._execute(d)
            self.queue.done()
            took += 1
        self.stats["ops"] += took
        return took

    def _record(self, peer: int, ctx: int, rec: tuple) -> None:
        if self.trace is not None:
            self.trace.setdefault((peer, ctx), []).append(rec)

    def _stream(self, peer: int):
        s = self._streams.get(peer)
        if s is None:
            s = self._streams[peer] = self.driver.stream()
        return s

    def _check_range(self, what: str, peer: int, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self._window_bytes:
            raise ProxyError(f"rank {self.rank}: GIN {what} (peer {peer}) reaches [{offset}, {offset + nbytes}), "
                             f"outside the {self._window_bytes}-byte window")

    def _progress(self) -> int:
        """Counters of completed copies bumped and, on network mpi, messages received,
        sends finished and landed buffers dropped; how many."""
        n = self._reap()
        if self.wire is not None:
            n += self.wire.progress() + self.memory.reap()
        return n

    def _streams_idle(self) -> bool:
        return all(self.driver.idle(s) for s in self._streams.values())

    def _quiet(self) -> bool:
        """Nothing issued is unfinished: no counter pending, every stream drained, and on
        network mpi every send complete and every landed buffer dropped."""
        return not self._counters and self._streams_idle() and (
            self.wire is None or (self.wire.drained() and not self.memory.held))

    def _wait(self, ready, what: str) -> None:
        """Polls ready() until true, making progress meanwhile (_progress: a peer may wait
        on this rank); ProxyError at the deadline."""
        deadline = time.monotonic() + self.world.timeout
        while not ready():
            self._progress()
            if self.world.abort_word[0]:
                raise ProxyError(f"rank {self.rank}: GIN copy-engine proxy: the job aborted while {what}")
            if time.monotonic() > deadline:
                raise ProxyError(f"rank {self.rank}: GIN copy-engine proxy: {what} did not complete within "
                                 f"{self.world.timeout} s")
            time.sleep(0)

    def _bump(self, counter: int, peer: int, ctx: int, seq: int) -> None:
        self._add(self._counters_base + 8 * counter, 1)
        self._record(peer, ctx, ("counter", seq, counter))

    def _reap(self) -> int:
        """Bumps the counters of puts whose copies completed, oldest first; how many."""
        n = 0
        while self._counters and self.driver.done(self._counters[0][0]):
            _, counter, peer, ctx, seq = self._counters.popleft()
            self._bump(counter, peer, ctx, seq)
            n += 1
        return n

    def _execute(self, d) -> None:
        _, op, flags, peer, ctx, dst, src, nbytes, sig, sigval, counter, windows = d
        if windows:
            raise ProxyError(f"rank {self.rank}: GIN operation {op} names windows {windows:#x}: registered "
                             f"windows (gin.h) are carried by the native engine only")
        if op == abi.GIN_FLUSH:
            self._wait(self._quiet, f"flushing context {ctx} (every copy, send and counter before it)")
            for link in [k for k in self._links if k[1] == ctx]:
                self._record(*link, ("flush",))
            return
        link = self._links.setdefault((peer, ctx), [0, 0])
        if op == abi.GIN_DOORBELL:
            link[1] += 1
            self._record(peer, ctx, ("doorbell", link[1]))
            return
        if not 0 <= peer < self.world.size:
            raise ProxyError(f"rank {self.rank}: GIN operation {op} names peer {peer} outside [0, {self.world.size})")
        if self.wire is not None:
            self._execute_mpi(op, flags, peer, ctx, dst, src, nbytes, sig, sigval, counter, link)
            return
        base = self._peer_base[peer]
        if not base:
            raise ProxyError(f"rank {self.rank}: GIN peer {peer}'s window is not mapped here (the copy-engine proxy "
                             f"reaches peers by CUDA IPC)")
        stream = self._stream(peer)
        if op == abi.GIN_GET:
            self._check_range("get source", peer, src, nbytes)
            self._check_range("get destination", peer, dst, nbytes)
            self.driver.copy(self._base + dst, base + src, nbytes, stream)
            ev = self.driver.event_after(stream)
            self._wait(lambda: self.driver.done(ev), f"getting {nbytes} bytes from peer {peer}")
            self._record(peer, ctx, ("get", src, dst, nbytes))
            return
        signal = remote_action(self.rank, self.backend, peer, flags, sig, sigval) \
            if flags & abi.GIN_HAS_SIGNAL else None
        if op == abi.GIN_PUT:
            self._check_range("put source", peer, src, nbytes)
            self._check_range("put destination", peer, dst, nbytes)
            if nbytes:
                self.driver.copy(base + dst, self._base + src, nbytes, stream)
            size = nbytes
        elif op == abi.GIN_PUT_VALUE:
            self._check_range("put destination", peer, dst, 8)
            self.driver.write_value(base + dst, nbytes & MASK64, stream)
            size = 8
        elif op == abi.GIN_SIGNAL:
            size = 0
        else:
            raise ProxyError(f"rank {self.rank}: unknown GIN operation {op}")
        seq = link[0]
        link[0] += 1
        self._record(peer, ctx, ("post", seq, dst, size, signal))
        if size:
            self._record(peer, ctx, ("data", seq))
        if op == abi.GIN_PUT and flags & abi.GIN_HAS_COUNTER:  # bumped once the copy has completed
            self._counters.append((self.driver.event_after(stream), counter, peer, ctx, seq))
        if signal is not None:
            kind, where = signal.target
            offset = where if kind == "va" else self._signals_off + 8 * where
            self._check_range("signal", peer, offset, 8)
            key = (peer, offset)
            value = self._shadow[key] = (self._shadow.get(key, 0) + signal.value) & MASK64
            self.driver.write_value(base + offset, value, stream)  # after the data: stream order
            self._record(peer, ctx, ("signal", seq))
        self.stats["events"] += 1

    def _execute_mpi(self, op, flags, peer, ctx, dst, src, nbytes, sig, sigval, counter, link) -> None:
        """A descriptor on network mpi (see the module docstring)."""
        if op == abi.GIN_GET:
            self._check_range("get destination", peer, dst, nbytes)
            self.wire.get(peer, src, dst, nbytes, self._reap)
            self._record(peer, ctx, ("get", src, dst, nbytes))
            return
        signal = remote_action(self.rank, self.backend, peer, flags, sig, sigval) \
            if flags & abi.GIN_HAS_SIGNAL else None
        if op == abi.GIN_PUT:
            data = self.memory.read(src, nbytes)  # waited for: the source is reusable from here on
        elif op == abi.GIN_PUT_VALUE:
            data = np.frombuffer((nbytes & MASK64).to_bytes(8, "little"), np.uint8).copy()
        elif op == abi.GIN_SIGNAL:
            data = np.zeros(0, np.uint8)
        else:
            raise ProxyError(f"rank {self.rank}: unknown GIN operation {op}")
        seq = link[0]
        link[0] += 1
        self._record(peer, ctx, ("post", seq, dst, data.size, signal))
        if data.size:
            self.wire.land_data(peer, dst, data)
            self._record(peer, ctx, ("data", seq))
        if op == abi.GIN_PUT and flags & abi.GIN_HAS_COUNTER:
            self._bump(counter, peer, ctx, seq)
        if signal is not None:
            self.wire.signal(peer, signal)  # MPI keeps it behind the data
            self._record(peer, ctx, ("signal", seq))
        self.stats["events"] += 1
