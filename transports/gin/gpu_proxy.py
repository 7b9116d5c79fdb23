"""GIN on GPUs: the copy-engine proxy (GpuProxy), one host thread per rank.

The kernels post descriptors exactly as on the CPU engine (gin.h); what changes is where
the words live and what moves the bytes:

- queue, claimed, consumed: in pinned host memory mapped into the device
  (queue.QueueRegion); written by the kernels and the proxy (consumed); ordered as on
  the CPU (gin.h): seq released last, consumed released after the descriptor is done.
- counters: in the same pinned allocation, after the queue; bumped by the proxy with a
  host atomic add, or by the word-add kernel (below) where the device lacks host-native
  atomics; once the put's copy has completed (an event after it on the peer's stream,
  or the kernel after it).
- data: into the peer's window, device memory mapped here by CUDA IPC
  (`window.peer_addresses`); moved by the copy engine (cuMemcpyAsync on the peer's
  stream); in stream order.
- signals: into the target's window (`ginSignalsOff`, or a VA offset); added by the
  word-add kernel on the peer's stream, after every earlier copy and kernel of that
  stream.

One non-blocking stream per peer (they never wait for the spinning kernels on the
legacy stream), so every (peer, ctx) link is FIFO: the ordered wire. A signal lands
after its data in stream order, which makes it strong (every earlier put to that peer,
of any context, is visible first) as well as weak.

Signals and device-side counter bumps are adds, never writes of a running total: a
one-thread kernel (cuda_driver.WORD_ADD_SOURCE, compiled by the GPU loader's NVRTC route
and launched with cuLaunchKernel) does a system-scope atomic add with release on the
word. So a word may have any number of writers (several GIN senders, LSA peers' atomic
adds, the target's own signals) and every increment lands; resetSignal sets the word
that later adds start from. The kernel needs room for one one-thread block on some SM
while the kernels spin: a launch that fills every SM's block slots delays signals until
a slot frees, which the waits' deadline reports (CUDA 13.1's stream atomic reductions,
cuStreamBatchMemOp's CU_STREAM_MEM_OP_ATOMIC_REDUCTION, would need no SM; not used here
yet). Atomics are atomic with each other only where the agents share an atomic domain,
so the proxy queries the device:
- CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED: where it is 0 (PCIe without host
  atomics), host atomics on the mapped counters would not be atomic with the kernels'
  (device.h bumps a counter over LSA), so the proxy bumps counters with the word-add
  kernel on this device instead: every writer of a counter is then this GPU;
- CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED between this device and a peer's
  (found by cuPointerGetAttribute of the peer's mapped window): where it is 0 (P2P over
  PCIe only), the add on the peer's signal word would not be atomic, and the proxy
  refuses the first signal to that peer with a ProxyError naming the attribute (network
  "mpi" has the target's proxy add on its own device instead).

- putValue: cuStreamWriteValue64 of the 8 bytes at the destination (8-byte aligned, as
  device.h requires), on the peer's stream.
- get: cuMemcpyAsync from the peer's window into this rank's, and the get's slot is
  consumed once it has completed (so a flush covers it).
- flush: waits until every stream's work has completed (the sources of earlier puts are
  reusable, earlier gets have landed), then the slot is consumed.
- doorbell: nothing more (the ordered wire lands in posted order).
- Refusals: proxy.remote_action's (a strong signal on a weak-only backend, ...), a peer
  outside the world or not mapped here, a range outside the window, an unaligned
  putValue, a signal to a peer without native P2P atomics (above). The error is kept
  (`error`), the world's abort word raised, and the thread ends, so kernels fail.

Network mpi (peers on other hosts): the proxies exchange wires.MpiWire's messages on
their own communicator, and the window is reached through DeviceWindow. A put's source
is copied device-to-host (the proxy waits for the copy: the source is then reusable and
the counter bumped) and sent; the receiving proxy copies the data host-to-device on the
sender's stream and then adds the signal after it on that stream with the word-add
kernel on its own device (as aws-ofi-nccl's receiver applies EFA signals). A get
is a request and a reply copied host-to-device, settled before its slot is consumed. MPI
keeps one source's messages in order, and one stream per source keeps their landings in
order: the wire stays ordered.

The driver calls go through `driver` (cuda_driver.CudaDriver: cuda-python's
cuda.bindings.driver); tests hand in a stand-in that runs the same protocol over host
memory with copies that land late (tests/test_gin_gpu_proxy.py). GPU kernels cannot ring
the engine (gin.h's idle word), so the thread polls: it yields for a while after work
and then sleeps 20 us at a time.

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
from commref.transports.gin import cuda_driver, semantics
from commref.transports.gin.atomics import host_atomics
from commref.transports.gin.backends import Backend
from commref.transports.gin.cuda_driver import MASK64
from commref.transports.gin.engine import DescriptorChecks
from commref.transports.gin.proxy import remote_action
from commref.transports.gin.queue import QueueReader, QueueRegion
from commref.transports.gin.wires import TAG, MpiWire, ProxyError, wait_drained

__all__ = ["GpuProxy"]

DRAIN_BUDGET = 64


class DeviceWindow:
    """wires.MpiWire's memory (see wires.HostMemory) for a window on a GPU, through the
    copy-engine proxy's driver and streams: data from peer p is copied host-to-device on
    p's stream (its host buffer kept until the copy has run), a signal from p added after
    it on that stream by the word-add kernel on this device, a read copied device-to-host
    and waited for."""

    READ_STREAM = -1  # the key of the stream reads go on

    def __init__(self, proxy: GpuProxy):
        self.proxy = proxy
        self.held: collections.deque = collections.deque()  # (event, host buffer) until the copy ran

    def write(self, src: int, offset: int, data: np.ndarray) -> None:
        p = self.proxy
        p._check(0, offset, data.size, "landing", 0, src)  # a put from src lands here
        if data.size:
            stream = p._stream(src)
            p.driver.copy(p._base + offset, data.ctypes.data, data.size, stream)
            self.held.append((p.driver.event_after(stream), data))

    def read(self, offset: int, size: int) -> np.ndarray:
        p = self.proxy
        p._check(0, offset, size, "get_request", 0, p.rank)  # a put source (checked before) or a get request
        out = np.empty(size, np.uint8)
        if size:
            stream = p._stream(self.READ_STREAM)
            p.driver.copy(out.ctypes.data, p._base + offset, size, stream)
            ev = p.driver.event_after(stream)
            p._wait(lambda: p.driver.done(ev), f"copying {size} bytes of this rank's window to the host")
        return out

    def add_signal(self, src: int, offset: int, value: int) -> None:
        p = self.proxy
        p._check(0, offset, 8, "signal", 0, src)
        p.driver.add_value(p._base + offset, value, p._stream(src))  # after src's data: stream order

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


class GpuProxy(DescriptorChecks):
    """The copy-engine proxy of one rank (see the module docstring): start(), quiesce(),
    stop(), error, stats, pending(), trace, as GinProxy. `layout`: the window's
    WindowLayout (its ginSignalsOff); `region`: the rank's queue.QueueRegion; `window`:
    its symmetric window, with the GIN peers' windows mapped on network "shm"; network
    "mpi": `mpi_comm`, the proxies' own communicator, and `mpi_tag`, their tag
    (engines.network_tag()); `driver`: a cuda_driver.CudaDriver (made here when None)."""

    carries_windows = False  # registered windows (gin.h) are the native engine's (GinWindowEngine)

    def __init__(
        self,
        world,
        window,
        layout,
        region: QueueRegion,
        capacity: int,
        backend: Backend,
        transport: semantics.Transport,
        device_id: int = 0,
        driver=None,
        network: str = "shm",
        mpi_comm=None,
        mpi_tag: int = TAG,
    ):
        if not transport.ordered:
            raise CapabilityError(f"rank {world.rank}: the GIN copy-engine proxy carries the ordered wire only")
        self.world, self.rank, self.backend, self.transport = world, world.rank, backend, transport
        self.window, self.region, self.capacity = window, region, capacity
        self.driver = driver if driver is not None else cuda_driver.CudaDriver(device_id)
        atomics = host_atomics()
        self._add = atomics.add_u64
        self.queue = QueueReader(region.queue, QueueRegion.LAYOUT, capacity, atomics)
        self._counters_base = int(region.counters.ctypes.data)  # the host's view of the counters
        self._counters_device = int(region.counters_address)  # ... and the device's
        # Without host-native atomics the host's adds are not atomic with the kernels' (device.h
        # bumps counters over LSA): counters are then bumped on the device, by the word-add kernel.
        self._device_counters = not self.driver.host_native_atomics
        self._peer_atomics: dict = {}  # peer -> None, or why the word-add kernel cannot add at its window
        self._base = int(window.address)
        self._peer_base = [int(a) for a in window.peer_addresses]
        self._window_bytes = int(window.local.nbytes)
        self._signals_off = int(layout["ginSignalsOff"])
        self.network = network
        self.memory = self.wire = None
        if network == "mpi":
            if mpi_comm is None:
                raise ValueError(
                    f"rank {world.rank}: the GIN copy-engine proxy on network 'mpi' needs the proxies' communicator"
                )
            self.memory = DeviceWindow(self)
            self.wire = MpiWire(
                mpi_comm, self.rank, window, self._signals_off, atomics, world.timeout, memory=self.memory, tag=mpi_tag
            )
        elif network != "shm":
            raise ValueError(f"GIN copy-engine proxy network must be 'shm' or 'mpi', not {network!r}")
        self._streams: dict = {}  # peer -> its stream (made in the thread)
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
            done = (
                (self.queue.next >= claimed and not self._in_flight)
                or self.error is not None
                or not self._thread.is_alive()
            )
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
            self.error = self.error or ProxyError(
                f"rank {self.rank}: the GIN copy-engine proxy's thread did not end within {self.world.timeout} s"
            )
            return  # its streams stay: the thread may still use them
        self.driver.bind()  # the device's primary context, current here too (CuPy's own)
        deadline = time.monotonic() + self.world.timeout
        while not self._streams_idle():
            if time.monotonic() > deadline:
                self.error = self.error or ProxyError(
                    f"rank {self.rank}: the GIN copy-engine proxy's streams did "
                    f"not drain within {self.world.timeout} s of its stop"
                )
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
            self.error = (
                e
                if isinstance(e, ProxyError)
                else ProxyError(f"rank {self.rank}: GIN copy-engine proxy: {type(e).__name__}: {e}")
            )
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
        return (
            not self._counters
            and self._streams_idle()
            and (self.wire is None or (self.wire.drained() and not self.memory.held))
        )

    def _wait(self, ready, what: str) -> None:
        """Polls ready() until true, making progress meanwhile (_progress: a peer may wait
        on this rank); ProxyError at the deadline."""
        deadline = time.monotonic() + self.world.timeout
        while not ready():
            self._progress()
            if self.world.abort_word[0]:
                raise ProxyError(f"rank {self.rank}: GIN copy-engine proxy: the job aborted while {what}")
            if time.monotonic() > deadline:
                raise ProxyError(
                    f"rank {self.rank}: GIN copy-engine proxy: {what} did not complete within {self.world.timeout} s"
                )
            time.sleep(0)

    def _bump(self, counter: int, peer: int, ctx: int, seq: int, stream=None) -> None:
        """Counter `counter` plus one: a host atomic add, or, on a device without host-native
        atomics, the word-add kernel on `stream` (after what it holds; None: it already ran
        on the stream the put's copy was on)."""
        if not self._device_counters:
            self._add(self._counters_base + 8 * counter, 1)
        elif stream is not None:
            self.driver.add_value(self._counters_device + 8 * counter, 1, stream)
        self._record(peer, ctx, ("counter", seq, counter))

    def _reap(self) -> int:
        """Bumps the counters of puts whose copies completed, oldest first; how many."""
        n = 0
        while self._counters and self.driver.done(self._counters[0][0]):
            _, counter, peer, ctx, seq = self._counters.popleft()
            self._bump(counter, peer, ctx, seq)
            n += 1
        return n

    def _peer_atomics_refusal(self, peer: int, base: int) -> str | None:
        """Why the word-add kernel on this device cannot add atomically at peer's window
        (the P2P link has no native atomics), or None; asked once per peer."""
        if peer not in self._peer_atomics:
            why = None
            ordinal, native = self.driver.peer_native_atomics(base)
            if not native:
                why = (
                    f"rank {self.rank}: GIN signals to peer {peer} are atomic adds by this GPU "
                    f"({self.driver.device_id}) on peer {peer}'s window, on GPU {ordinal}, and the link between "
                    f"them has no native atomics (CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED = 0), so "
                    f"several writers of a signal would lose increments; use network 'mpi' (the target's proxy "
                    f"adds on its own GPU)"
                )
            self._peer_atomics[peer] = why
        return self._peer_atomics[peer]

    def _execute(self, d) -> None:
        _, op, flags, peer, ctx, dst, src, nbytes, sig, sigval, counter, windows = d
        src_window, dst_window = windows & 0xFFFF, windows >> 16  # only window 0 is carried (_check)
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
            raise self._refusal("peer_outside", op, peer)
        if self.wire is not None:
            self._execute_mpi(op, flags, peer, ctx, dst, src, nbytes, sig, sigval, counter, link, windows)
            return
        base = self._peer_base[peer]
        if not base:
            raise self._refusal("peer_unmapped", op, peer)
        stream = self._stream(peer)
        if op == abi.GIN_GET:
            self._check(dst_window, dst, nbytes, "get_destination", op, peer)
            self._check(src_window, src, nbytes, "get_source", op, peer)
            self.driver.copy(self._base + dst, base + src, nbytes, stream)
            ev = self.driver.event_after(stream)
            self._wait(lambda: self.driver.done(ev), f"getting {nbytes} bytes from peer {peer}")
            self._record(peer, ctx, ("get", src, dst, nbytes))
            return
        signal, signal_offset = self._signal_of(op, flags, peer, sig, sigval)
        if op == abi.GIN_PUT:
            self._check(src_window, src, nbytes, "put_source", op, peer)
            if nbytes:
                self._check(dst_window, dst, nbytes, "put_destination", op, peer)
                self.driver.copy(base + dst, self._base + src, nbytes, stream)
            size = nbytes
        elif op == abi.GIN_PUT_VALUE:
            self._check(dst_window, dst, 8, "put_destination", op, peer)
            if dst % 8:
                raise ProxyError(
                    f"rank {self.rank}: GIN putValue to peer {peer} at offset {dst}, not a multiple "
                    f"of 8 (an unaligned 8-byte write)"
                )
            self.driver.write_value(base + dst, nbytes & MASK64, stream)
            size = 8
        elif op == abi.GIN_SIGNAL:
            size = 0
        else:
            raise self._refusal("unknown_op", op, peer)
        seq = link[0]
        link[0] += 1
        self._record(peer, ctx, ("post", seq, dst, size, signal))
        if size:
            self._record(peer, ctx, ("data", seq))
        if op == abi.GIN_PUT and flags & abi.GIN_HAS_COUNTER:  # bumped once the copy has completed
            if self._device_counters:  # the kernel runs after the copy: stream order
                self.driver.add_value(self._counters_device + 8 * counter, 1, stream)
            self._counters.append((self.driver.event_after(stream), counter, peer, ctx, seq))
        if signal is not None:
            why = self._peer_atomics_refusal(peer, base)
            if why:
                raise ProxyError(why)
            self.driver.add_value(base + signal_offset, signal.value, stream)  # after the data: stream order
            self._record(peer, ctx, ("signal", seq))
        self.stats["events"] += 1

    def _signal_of(self, op: int, flags: int, peer: int, sig: int, sigval: int):
        """(the descriptor's signal as the backend applies it, its offset in the peer's
        window), refused (engine.refusal) where the backend or the window cannot take it;
        (None, 0) without one."""
        if not flags & abi.GIN_HAS_SIGNAL:
            return None, 0
        signal = remote_action(self.rank, self.backend, peer, flags, sig, sigval)
        kind, where = signal.target
        offset = where if kind == "va" else self._signals_off + 8 * where
        self._check(0, offset, 8, "signal", op, peer)
        return signal, offset

    def _execute_mpi(self, op, flags, peer, ctx, dst, src, nbytes, sig, sigval, counter, link, windows) -> None:
        """A descriptor on network mpi (see the module docstring)."""
        src_window, dst_window = windows & 0xFFFF, windows >> 16
        if op == abi.GIN_GET:
            self._check(dst_window, dst, nbytes, "get_destination", op, peer)
            self._check(src_window, src, nbytes, "get_source", op, peer)  # every rank's window is as long
            self.wire.get(peer, src, dst, nbytes, self._reap)
            self._record(peer, ctx, ("get", src, dst, nbytes))
            return
        signal, _ = self._signal_of(op, flags, peer, sig, sigval)
        if op == abi.GIN_PUT:
            self._check(src_window, src, nbytes, "put_source", op, peer)
            data = self.memory.read(src, nbytes)  # waited for: the source is reusable from here on
        elif op == abi.GIN_PUT_VALUE:
            data = np.frombuffer((nbytes & MASK64).to_bytes(8, "little"), np.uint8).copy()
        elif op == abi.GIN_SIGNAL:
            data = np.zeros(0, np.uint8)
        else:
            raise self._refusal("unknown_op", op, peer)
        seq = link[0]
        link[0] += 1
        self._record(peer, ctx, ("post", seq, dst, data.size, signal))
        if data.size:
            self.wire.land_data(peer, dst, data)
            self._record(peer, ctx, ("data", seq))
        if op == abi.GIN_PUT and flags & abi.GIN_HAS_COUNTER:  # the source was read: reusable now
            self._bump(counter, peer, ctx, seq, self._stream(DeviceWindow.READ_STREAM))
        if signal is not None:
            self.wire.signal(peer, signal)  # MPI keeps it behind the data
            self._record(peer, ctx, ("signal", seq))
        self.stats["events"] += 1
