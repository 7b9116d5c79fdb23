"""The GIN proxy: one progress thread per rank that drains its kernels' descriptor
queue (include/commref/gin.h) and carries each operation over a wire.

It ties the parts together:
- queue.QueueReader takes the published descriptors in order and decodes them
  (queue.Descriptor);
- this module turns each into what the wire must do (a put with its remote action, a
  flush, a doorbell, a get), checking it against the backend's capabilities;
- scheduler.DeliveryScheduler decides what lands when (semantics.enabled(): FIFO on an
  ordered wire, a seeded choice on an unordered one, where a put may be held back past
  later doorbells; when the queue stays empty for scheduler.IDLE_RELEASE_S the proxy
  releases every held put, so a sender waiting on one is never stuck);
- a wire (wires.ShmWire or wires.MpiWire) carries each landing to the target;
- atomics.host_atomics() gives the acquire/release operations on queue words, signals
  and counters; an optional observer.Observer hears of every landing and wire message.

A put's source is copied when the proxy takes the descriptor, so the source is reusable
(counter incremented) immediately after; a get lands before the proxy consumes the
descriptor, so flush, which waits for consumption, covers both. An error ends the
proxy and sets the world's abort word, so that kernels waiting on it fail instead of
hanging.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from commref.device_kernels import abi
from commref.transports.gin import semantics
from commref.transports.gin.atomics import host_atomics
from commref.transports.gin.backends import Backend
from commref.transports.gin.faults import FaultSpec, ReliableWire
from commref.transports.gin.queue import QueueReader
from commref.transports.gin.scheduler import IDLE_RELEASE_S, DeliveryScheduler
from commref.transports.gin.wires import TAG, MpiWire, ProxyError, ShmWire, wait_drained

__all__ = ["GinProxy", "ProxyError", "remote_action"]

DRAIN_BUDGET = 64  # descriptors taken per iteration before the proxy delivers and polls


class GinProxy:
    """Progress thread of one rank. start() after the window is registered; quiesce()
    then stop() at close. `network` "shm" or "mpi" (then `mpi_comm`: the proxies' own
    communicator); `observer`: an observer.Observer, or None; `faults`: a lossy link
    under the wire and the reliability layer above it (faults.py), seeded by `seed`."""

    def __init__(self, world, window, layout: np.ndarray, capacity: int, backend: Backend,
                 transport: semantics.Transport, network: str, seed: int, segment_bytes: int,
                 mpi_comm=None, observer=None, mpi_tag: int = TAG, faults: FaultSpec | None = None):
        self.world, self.rank, self.backend, self.transport = world, world.rank, backend, transport
        self.network, self.segment_bytes, self.seed = network, segment_bytes, seed
        self.window, self.layout, self.capacity = window, layout, capacity
        self.local = window.local
        self.comm = mpi_comm
        self.error: BaseException | None = None
        self.stats = {"ops": 0, "events": 0}
        atomics = host_atomics()
        self._atomic_add = atomics.add_u64
        self.counters_base = int(window.address) + int(layout["ginCountersOff"])
        self.queue = QueueReader(self.local, layout, capacity, atomics)
        signals_off = int(layout["ginSignalsOff"])
        if network == "shm":
            self.wire = ShmWire(window, signals_off, atomics)
        elif network == "mpi":
            self.wire = MpiWire(mpi_comm, self.rank, window, signals_off, atomics, world.timeout, observer,
                                tag=mpi_tag)
        else:
            raise ValueError(f"GIN proxy network must be 'shm' or 'mpi', not {network!r}")
        if faults is not None and faults.active:
            self.wire = ReliableWire(self.wire, faults, seed, self.rank, self.stats)
        self.scheduler = DeliveryScheduler(transport, backend.strong_always, self.wire, seed, self.rank,
                                           segment_bytes, self.stats, observer)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"commref-gin-proxy-{self.rank}", daemon=True)

    @property
    def trace(self) -> dict | None:
        """Set to {} to record per (peer, ctx) what was posted and every event the link
        made happen: segments, signals, counters, gets (scheduler module docstring)."""
        return self.scheduler.trace

    @trace.setter
    def trace(self, value: dict | None) -> None:
        self.scheduler.trace = value

    def pending(self, peer: int | None = None) -> bool:
        """Whether anything taken from the queue (for `peer`, or any) has not landed yet."""
        return self.scheduler.pending(peer) or self.wire.in_flight(peer)

    # ---- lifecycle ----

    def start(self) -> None:
        self._thread.start()

    def quiesce(self, timeout: float) -> None:
        """Waits until every operation posted so far has been taken from the queue and
        landed (MPI: sent). Call before stop() so that peers get this rank's last
        data and credits."""
        def state():
            claimed = self.queue.claimed()
            done = (self.queue.next >= claimed and not self.scheduler.pending() and self.wire.drained()) \
                or self.error is not None or not self._thread.is_alive()
            return done, claimed, self.queue.next

        wait_drained(state, f"rank {self.rank}: GIN proxy", timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _main(self) -> None:
        idle = 0
        drain, deliver, progress = self._drain, self.scheduler.deliver, self.wire.progress
        scheduler, monotonic = self.scheduler, time.monotonic
        last_take = monotonic()
        try:
            while not self._stop.is_set():
                took = drain(DRAIN_BUDGET)
                landed = deliver() + progress()
                if took:
                    last_take = monotonic()
                elif monotonic() - last_take > IDLE_RELEASE_S and scheduler.held():
                    # The queue stayed empty: a sender may be waiting for a held put's signal.
                    landed += scheduler.release_held()
                if took or landed:
                    idle = 0
                    continue
                idle += 1
                time.sleep(0 if idle < 200 else 50e-6)
        except BaseException as e:  # the kernels must not wait forever on a dead proxy
            self.error = e
            self.world.abort_word[0] = 1

    # ---- the queue ----

    def _drain(self, budget: int) -> int:
        took = 0
        take, done, execute = self.queue.take, self.queue.done, self._execute
        while took < budget:
            d = take()
            if d is None:
                break
            execute(d)
            done()
            took += 1
        self.stats["ops"] += took
        return took

    def _execute(self, d) -> None:
        """Carries one queue.Descriptor."""
        _, op, flags, peer, ctx, dst, src, nbytes, sig, sigval, counter, windows = d
        if windows:
            raise ProxyError(f"rank {self.rank}: GIN operation {op} names windows {windows:#x}: registered "
                             f"windows (gin.h) are carried by the native engine only")
        if op == abi.GIN_FLUSH:
            self.scheduler.flush(ctx)
            return
        if op == abi.GIN_DOORBELL:
            self.scheduler.doorbell(peer, ctx)
            return
        if not 0 <= peer < self.world.size:
            raise ProxyError(f"rank {self.rank}: GIN operation {op} names peer {peer} outside [0, {self.world.size})")
        if op == abi.GIN_GET:
            self.wire.get(peer, src, dst, nbytes, self.scheduler.deliver)
            self.scheduler.record(peer, ctx, ("get", src, dst, nbytes))
            return
        signal = None
        if flags & abi.GIN_HAS_SIGNAL:
            signal = self._remote_action(peer, flags, sig, sigval)
        if op == abi.GIN_PUT:
            payload = self.local[src:src + nbytes].copy()  # the source is reusable from here on
        elif op == abi.GIN_PUT_VALUE:
            payload = np.frombuffer(nbytes.to_bytes(8, "little"), dtype=np.uint8).copy()
        elif op == abi.GIN_SIGNAL:
            payload = np.zeros(0, np.uint8)
        else:
            raise ProxyError(f"rank {self.rank}: unknown GIN operation {op}")
        seq = self.scheduler.post(peer, ctx, dst, payload, signal)
        if flags & abi.GIN_HAS_COUNTER:  # the source was copied above: reusable now
            self._atomic_add(self.counters_base + 8 * counter, 1)
            self.scheduler.record(peer, ctx, ("counter", seq, counter))

    def _remote_action(self, peer: int, flags: int, sig: int, sigval: int) -> semantics.Signal:
        return remote_action(self.rank, self.backend, peer, flags, sig, sigval)


def remote_action(rank: int, backend: Backend, peer: int, flags: int, sig: int, sigval: int) -> semantics.Signal:
    """The signal a descriptor's flags ask for, as `backend` applies it; ProxyError (one
    line naming rank, peer and backend) for what the backend cannot do. Every Python-side
    proxy refuses through here (native_engine.cpp mirrors the messages)."""
    caps = backend.caps
    strong = bool(flags & abi.GIN_STRONG)
    if strong and not caps.strong_signals:
        raise ProxyError(f"rank {rank}: strong signal to peer {peer} on backend "
                         f"{backend.name}, which offers weak signals only")
    va = bool(flags & abi.GIN_VA)
    if va and not caps.va_signals:
        raise ProxyError(f"rank {rank}: VA signal to peer {peer} on backend {backend.name}")
    value = sigval if flags & abi.GIN_ADD else 1
    if backend.signals_count_writes:
        if flags & abi.GIN_ADD:
            raise ProxyError(f"rank {rank}: signal add on backend {backend.name}, whose signals "
                             f"count completed writes")
        value = 1
    return semantics.Signal(strong or backend.strong_always, ("va" if va else "index", sig), value)
