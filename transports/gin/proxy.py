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
- engine.refusal formats what it refuses (the conditions in abi.GIN_REFUSALS' order,
  the texts the native engine's refusals get too);
- atomics.host_atomics() gives the acquire/release operations on queue words, signals
  and counters; an optional observer.Observer hears of every landing and wire message.

A put's source is copied when the proxy takes the descriptor, so the source is reusable
(counter incremented) immediately after; a get lands before the proxy consumes the
descriptor, so flush, which waits for consumption, covers both. An error ends the
proxy and sets the world's abort word, so that kernels waiting on it fail instead of
hanging. It implements engine.GinEngine. Kernels' descriptors name the connection window
only (window id 0: carries_windows is false); the windows given by add_window (the host
windows of one-sided host calls, transports/gin/rma.py) may be named as a put's source
and destination, landed through window addresses (wires.py, "Window addresses").
"""

from __future__ import annotations

import threading
import time

import numpy as np

from commref.device_kernels import abi
from commref.transports.gin import semantics
from commref.transports.gin.atomics import host_atomics
from commref.transports.gin.backends import Backend
from commref.transports.gin.engine import DescriptorChecks, EngineSite, refusal
from commref.transports.gin.faults import FaultSpec, ReliableWire
from commref.transports.gin.queue import QueueReader
from commref.transports.gin.scheduler import IDLE_RELEASE_S, DeliveryScheduler
from commref.transports.gin.wires import TAG, MpiWire, ProxyError, ShmWire, wait_drained, window_address

__all__ = ["GinProxy", "ProxyError", "remote_action"]

DRAIN_BUDGET = 64  # descriptors taken per iteration before the proxy delivers and polls


class GinProxy(DescriptorChecks):
    """Progress thread of one rank; implements engine.GinEngine (tests/test_gin_engine_interface.py
    checks it structurally). start() after the window is registered; quiesce()
    then stop() at close. `network` "shm" or "mpi" (then `mpi_comm`: the proxies' own
    communicator); `observer`: an observer.Observer, or None; `faults`: a lossy link
    under the wire and the reliability layer above it (faults.py), seeded by `seed`;
    `batched`: the kernels ring doorbells (GinArgs.doorbells), so the scheduler serves
    every link at doorbells from its first put; `independent_contexts`: on the ordered
    wire, the scheduler holds contexts back while others overtake (scheduler.py)."""

    def __init__(
        self,
        site: EngineSite,
        seed: int,
        segment_bytes: int,
        mpi_comm=None,
        observer=None,
        mpi_tag: int = TAG,
        faults: FaultSpec | None = None,
        batched: bool = False,
        independent_contexts: bool = False,
    ):
        world, window, layout, capacity, backend, transport, network = site
        self.world, self.rank, self.backend, self.transport = world, world.rank, backend, transport
        self.network, self.segment_bytes, self.seed = network, segment_bytes, seed
        self.window, self.layout, self.capacity = window, layout, capacity
        self.local = window.local
        self.comm = mpi_comm
        self.error: BaseException | None = None
        self.stats = {"ops": 0, "events": 0}
        self._window_bytes = int(window.local.nbytes)  # every rank's connection window is this long
        # network shm: whether each peer's connection window is mapped here
        self._mapped = [bool(a) for a in window.peer_addresses] if network == "shm" else None
        atomics = host_atomics()
        self._atomic_add = atomics.add_u64
        self.counters_base = int(window.address) + int(layout["ginCountersOff"])
        self.queue = QueueReader(self.local, layout, capacity, atomics)
        signals_off = int(layout["ginSignalsOff"])
        if network == "shm":
            self.wire = ShmWire(window, signals_off, atomics)
        elif network == "mpi":
            self.wire = MpiWire(mpi_comm, self.rank, window, signals_off, atomics, world.timeout, observer, tag=mpi_tag)
        else:
            raise ValueError(f"GIN proxy network must be 'shm' or 'mpi', not {network!r}")
        # window id -> window (add_window): shared with the wire, which resolves window addresses
        self._windows: dict = {}
        if network == "shm":
            self.wire.windows = self._windows
        else:
            self.wire.memory.windows, self.wire.memory.rank = self._windows, self.rank
        if faults is not None and faults.active:
            self.wire = ReliableWire(self.wire, faults, seed, self.rank, self.stats)
        self.scheduler = DeliveryScheduler(
            transport,
            backend.strong_always,
            self.wire,
            seed,
            self.rank,
            segment_bytes,
            self.stats,
            observer,
            batched,
            independent_contexts,
        )
        self._stop = threading.Event()
        self._polling = threading.Event()  # cleared by park(): the thread waits on it instead of polling
        self._polling.set()
        self._thread = threading.Thread(target=self._main, name=f"commref-gin-proxy-{self.rank}", daemon=True)

    carries_windows = False  # kernels' descriptors name the connection window only (window id 0)
    carries_host_windows = True  # add_window's windows, for host one-sided calls (rma.py)

    def add_window(self, window_id: int, window) -> None:
        """Window `window_id` (1 ..< abi.GIN_MAX_WINDOWS) for puts' window ids: an object
        with `local` (uint8, this rank's bytes), `address`, `nbytes` and `peer_addresses`
        (each rank's copy mapped here, 0 where not; this rank's own entry set). Call it
        before any descriptor names the id; not while one that names it is in flight."""
        if not 0 < window_id < abi.GIN_MAX_WINDOWS:
            raise ValueError(f"rank {self.rank}: GIN window ids run from 1 to {abi.GIN_MAX_WINDOWS - 1}")
        self._windows[int(window_id)] = window

    def remove_window(self, window_id: int) -> None:
        """Forgets window `window_id` (no descriptor in flight may name it)."""
        self._windows.pop(int(window_id), None)

    def _check(self, window: int, offset: int, nbytes: int, access: str, op: int, peer: int) -> None:
        """DescriptorChecks._check, with add_window's windows known too."""
        if window == 0:
            return super()._check(window, offset, nbytes, access, op, peer)
        w = self._windows.get(window)
        if w is None:
            raise self._refusal("window_unknown", op, peer, access=access, window=window, offset=offset, nbytes=nbytes)
        size = int(w.nbytes)
        if offset > size or nbytes > size - offset:
            raise self._refusal(
                "outside_window", op, peer, access=access, window=window, offset=offset, nbytes=nbytes, size=size
            )

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
            done = (
                (self.queue.next >= claimed and not self.scheduler.pending() and self.wire.drained())
                or self.error is not None
                or not self._thread.is_alive()
            )
            return done, claimed, self.queue.next

        wait_drained(state, f"rank {self.rank}: GIN proxy", timeout)

    def park(self) -> None:
        """The thread stops polling once it finds nothing to do, and blocks until unpark()
        (or stop()), so that it takes no CPU while something else is timed. For a
        quiescent proxy only (quiesce() on every rank first): what is posted meanwhile
        waits for unpark()."""
        self._polling.clear()

    def unpark(self) -> None:
        self._polling.set()

    @property
    def parked(self) -> bool:
        return not self._polling.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._polling.set()
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
                if not self._polling.is_set():
                    self._polling.wait()
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
        """Carries one queue.Descriptor; refuses (engine.refusal, in abi.GIN_REFUSALS'
        order, as the native engine) what it cannot carry."""
        _, op, flags, peer, ctx, dst, src, nbytes, sig, sigval, counter, windows = d
        if op == abi.GIN_FLUSH:
            self.scheduler.flush(ctx)
            return
        if op == abi.GIN_DOORBELL:
            self.scheduler.doorbell(peer, ctx)
            return
        if not 0 <= peer < self.world.size:
            raise self._refusal("peer_outside", op, peer)
        if self._mapped is not None and not self._mapped[peer]:
            raise self._refusal("peer_unmapped", op, peer)
        src_window, dst_window = windows & 0xFFFF, windows >> 16
        if op == abi.GIN_GET:
            if windows:  # gets address the connection window only: add_window's are for puts
                access, window = ("get_destination", dst_window) if dst_window else ("get_source", src_window)
                raise self._refusal("window_unknown", op, peer, access=access, window=window)
            self._check(dst_window, dst, nbytes, "get_destination", op, peer)
            self._check(src_window, src, nbytes, "get_source", op, peer)  # every rank's window is as long
            self.scheduler.release_link(peer, ctx)  # independent contexts: after the context's earlier puts
            self.wire.get(peer, src, dst, nbytes, self.scheduler.deliver)
            self.scheduler.record(peer, ctx, ("get", src, dst, nbytes))
            return
        signal = None
        if flags & abi.GIN_HAS_SIGNAL:
            signal = self._remote_action(peer, flags, sig, sigval)
            kind, where = signal.target
            self._check(
                0, where if kind == "va" else int(self.layout["ginSignalsOff"]) + 8 * where, 8, "signal", op, peer
            )
        if op == abi.GIN_PUT:
            self._check(src_window, src, nbytes, "put_source", op, peer)
            local = self.local if src_window == 0 else self._windows[src_window].local
            payload = local[src : src + nbytes].copy()  # the source is reusable from here on
        elif op == abi.GIN_PUT_VALUE:
            payload = np.frombuffer(nbytes.to_bytes(8, "little"), dtype=np.uint8).copy()
        elif op == abi.GIN_SIGNAL:
            payload = np.zeros(0, np.uint8)
        else:
            raise self._refusal("unknown_op", op, peer)
        if payload.size:
            self._check(dst_window, dst, payload.size, "put_destination", op, peer)
            if dst_window:
                if self._mapped is not None and not int(self._windows[dst_window].peer_addresses[peer]):
                    raise refusal(
                        self.rank,
                        abi.GIN_REFUSALS["window_unmapped"],
                        access=abi.GIN_ACCESSES["put_destination"],
                        owner=peer,
                        window=dst_window,
                    )
                dst = window_address(dst_window, dst)
        seq = self.scheduler.post(peer, ctx, dst, payload, signal)
        if flags & abi.GIN_HAS_COUNTER:  # the source was copied above: reusable now
            self._atomic_add(self.counters_base + 8 * counter, 1)
            self.scheduler.record(peer, ctx, ("counter", seq, counter))

    def _remote_action(self, peer: int, flags: int, sig: int, sigval: int) -> semantics.Signal:
        return remote_action(self.rank, self.backend, peer, flags, sig, sigval)


def remote_action(rank: int, backend: Backend, peer: int, flags: int, sig: int, sigval: int) -> semantics.Signal:
    """The signal a descriptor's flags ask for, as `backend` applies it; ProxyError (one
    line naming rank, peer and backend: engine.refusal's strong_signal, va_signal,
    signal_add, the native engine's texts too) for what the backend cannot do."""
    caps = backend.caps
    strong = bool(flags & abi.GIN_STRONG)
    codes = abi.GIN_REFUSALS
    if strong and not caps.strong_signals:
        raise refusal(rank, codes["strong_signal"], backend=backend.name, peer=peer)
    va = bool(flags & abi.GIN_VA)
    if va and not caps.va_signals:
        raise refusal(rank, codes["va_signal"], backend=backend.name, peer=peer)
    value = sigval if flags & abi.GIN_ADD else 1
    if backend.signals_count_writes:
        if flags & abi.GIN_ADD:
            raise refusal(rank, codes["signal_add"], backend=backend.name, peer=peer)
        value = 1
    return semantics.Signal(strong or backend.strong_always, ("va" if va else "index", sig), value)
