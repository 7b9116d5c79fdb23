"""Host one-sided calls over GIN: the transport side of nccl4py's register_window,
put_signal, signal and wait_signal (collectives/rma.py checks their arguments).

They ride the communicator's own GIN engine, with the kernels' semantics and backend:
a HostRma posts descriptors to the engine's queue beside the kernels
(queue.HostProducer), on contexts of their own and into windows of their own, so that
nothing a kernel posts shares an ordering domain, a signal word or a window with them.

- Contexts: host context c is GIN context HOST_CONTEXT_BASE + c; kernels use contexts
  below HOST_CONTEXT_BASE, so no host call is ordered with, or by, a kernel's.
- Windows: host windows (HostWindow: a registered user buffer, and each rank's staging
  ring) have GIN window ids from HOST_WINDOW_BASE (the staging ring's is STAGING_WINDOW);
  symmetric windows (collectives/symmetric.py) take ids from 1 and stay below it.
- Signals: `contexts` x `signals` x nranks words of the connection window's signal
  region from `signal_base`: the word of (context c, index s, source rank r) is
  signal_base + (c * signals + s) * nranks + r, so a wait names the peer it waits for
  (nccl4py's WaitSignalDesc.peer) and counts that peer's arrivals alone.
- Data: put_signal copies the caller's bytes into the staging ring (STAGING_WINDOW,
  `staging` bytes, this rank's only) and posts a put from there to the peer's copy of
  the window with a strong signal (inc by 1) on the put. Before the ring's bytes are
  written again, a flush (GIN_FLUSH on the host context) is posted and waited for until
  consumed: a flush makes every earlier put's source reusable on every engine (the
  native engine on network mpi sends a put over 16 KiB from its source after it has
  consumed the put, and completes those sends at a flush). A put longer than
  the ring is posted as several puts, the signal on the last: a strong signal covers
  every earlier put of its (context, peer).
- The promise, where the backend has strong signals: once wait_signal has seen a
  put_signal's signal, that put's data, and every earlier put_signal's of that peer on
  that context, is visible in the window. A backend with weak signals only (gda) cannot
  make it, and put_signal refuses there (CapabilityError); signal() alone is allowed on
  every backend (it carries no data; on gda it is weak and covers no put).
- Doorbells: where the kernels ring them (an unordered wire, GinPlan.rings_doorbells),
  every host call ends with a doorbell of its (peer, context), so that the engine lands
  it now, as adversarially as the wire allows.
- Waits: every wait (ring space, staging space, signals) has the deadline it is given
  and ends early when the job fails (the world's abort word) or the engine fails (its
  error is raised); a timeout raises CommTimeout naming rank, peer, what, expected and
  seen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from commref.device_kernels import abi
from commref.transports.errors import CapabilityError, CommAborted, CommTimeout
from commref.transports.gin.atomics import host_atomics
from commref.transports.gin.queue import HostProducer, QueueRegion

HOST_CONTEXT_BASE = 1 << 20  # host context c is GIN context HOST_CONTEXT_BASE + c
HOST_WINDOW_BASE = abi.GIN_MAX_WINDOWS // 2  # host windows' GIN ids: [HOST_WINDOW_BASE, GIN_MAX_WINDOWS)
STAGING_WINDOW = HOST_WINDOW_BASE  # each rank's staging ring
POLL_S = 20e-6  # a wait's sleep between polls once it has spun a while
SPINS = 2000  # polls before a wait starts sleeping


@dataclass
class HostWindow:
    """A window the engine carries for host calls (GinWindowEngine.add_window's shape):
    this rank's bytes (`local`, uint8), `address`, `nbytes`, and `peer_addresses`
    (uint64[nranks]: each rank's copy mapped here, 0 where not; this rank's own set)."""

    nbytes: int
    local: np.ndarray
    address: int
    peer_addresses: np.ndarray
    keep: object = None  # what must outlive the window (the peers' arrays on a ThreadWorld)


def host_window(world, local: np.ndarray, network: str, peers: np.ndarray | None = None) -> HostWindow:
    """Collective: `local` (uint8, C-contiguous) as a window of every rank. On network shm
    every rank's copy is mapped here: a ThreadWorld's (one process), or `peers` (each
    rank's copy mapped here: a buffer in a window every peer maps); on network mpi each
    rank knows its own copy only (a peer's put lands through its engine). Every rank must
    pass the same size: ValueError on every rank otherwise."""
    nbytes = int(local.nbytes)
    address = int(local.ctypes.data) if nbytes else 0
    if peers is not None:
        sizes = world.allgather(nbytes, what="host window sizes")
        keep = None
    elif world.kind == "thread" and network == "shm":
        arrays = world.allgather(local, what="host window buffers")
        sizes = [int(a.nbytes) for a in arrays]
        peers = np.array([a.ctypes.data for a in arrays], dtype=np.uint64)
        keep = arrays
    else:
        sizes = world.allgather(nbytes, what="host window sizes")
        peers = np.zeros(world.size, dtype=np.uint64)
        peers[world.rank] = address
        keep = None
    if len(set(sizes)) != 1:
        raise ValueError(f"rank {world.rank}: register_window needs the same size on every rank, got {sizes} bytes")
    return HostWindow(nbytes, local, address, peers, keep)


class HostRma:
    """One rank's host one-sided calls on its communicator's GIN engine (the module
    docstring says how). `engine`: the started engine (carries_host_windows); `region`:
    its queue.QueueRegion, `capacity` descriptors; `window`, `layout`: the connection
    window and its layout (signal words at ginSignalsOff); `doorbells`: ring a doorbell
    after every call (GinPlan.rings_doorbells); `timeout`: every wait's deadline."""

    def __init__(
        self,
        world,
        engine,
        region,
        capacity: int,
        window,
        layout,
        backend,
        doorbells: bool,
        signal_base: int,
        contexts: int,
        signals: int,
        staging: int,
        timeout: float,
    ):
        self.world, self.rank, self.nranks = world, world.rank, world.size
        self.engine, self.backend, self.doorbells, self.timeout = engine, backend, doorbells, timeout
        self.contexts, self.signals, self.signal_base = contexts, signals, signal_base
        atomics = host_atomics()
        self._load = atomics.load_acquire_u64
        self.producer = HostProducer(region.queue, QueueRegion.LAYOUT, capacity, atomics, timeout, world.abort_word)
        self._signals_addr = int(window.address) + int(layout["ginSignalsOff"])
        self._seen = np.zeros(contexts * signals * self.nranks, dtype=np.uint64)  # arrivals consumed per word
        ring = np.zeros(staging, dtype=np.uint8)
        peers = np.zeros(self.nranks, dtype=np.uint64)
        peers[self.rank] = ring.ctypes.data
        self.staging = HostWindow(staging, ring, int(ring.ctypes.data), peers)
        self._head = 0  # the staging ring's next free byte
        self._staged: list[tuple[int, int, int]] = []  # (queue slot, start, end) since the last flush
        self.windows: dict[int, HostWindow] = {}
        engine.add_window(STAGING_WINDOW, self.staging)

    # ---- windows ----

    def add_window(self, window: HostWindow) -> int:
        """Gives the engine `window` under the smallest free host id (the same on every rank
        when every rank adds and removes alike); returns the id."""
        wid = next((i for i in range(STAGING_WINDOW + 1, abi.GIN_MAX_WINDOWS) if i not in self.windows), None)
        if wid is None:
            raise CapabilityError(
                f"rank {self.rank}: at most {abi.GIN_MAX_WINDOWS - STAGING_WINDOW - 1} host windows at once"
            )
        self.engine.add_window(wid, window)
        self.windows[wid] = window
        return wid

    def remove_window(self, wid: int) -> None:
        """Forgets window `wid`, once every descriptor this rank posted has been consumed
        (none in flight names it); peers' puts into it must have been waited for."""
        self._wait_consumed(self.producer.claimed() - 1, "every host put consumed before deregister_window")
        self.engine.remove_window(wid)
        self.windows.pop(wid, None)

    # ---- operations ----

    def signal_word(self, ctx: int, index: int, source: int) -> int:
        """The connection window's signal word of (host context, index, source rank)."""
        return self.signal_base + (ctx * self.signals + index) * self.nranks + source

    def put_signal(self, data: np.ndarray, peer: int, wid: int, offset: int, index: int, ctx: int) -> None:
        """`data` (uint8) to byte `offset` of `peer`'s copy of window `wid`, then a strong
        signal on (ctx, index) from this rank. Arguments are checked by the caller."""
        n = int(data.size)
        gctx, word = HOST_CONTEXT_BASE + ctx, self.signal_word(ctx, index, self.rank)
        flags = abi.GIN_HAS_SIGNAL | abi.GIN_STRONG
        windows = abi.gin_windows(STAGING_WINDOW, wid)
        if n == 0:
            self._post(abi.GIN_SIGNAL, flags, peer, gctx, signal=word)
        chunk = self.staging.nbytes
        for start in range(0, n, chunk):
            piece = data[start : start + chunk]
            at = self._stage(piece.size)
            self.staging.local[at : at + piece.size] = piece
            last = start + chunk >= n
            slot = self._post(
                abi.GIN_PUT,
                flags if last else 0,
                peer,
                gctx,
                dst=offset + start,
                src=at,
                nbytes=int(piece.size),
                signal=word if last else 0,
                windows=windows,
            )
            self._staged.append((slot, at, at + int(piece.size)))
        self._ring(peer, gctx)

    def signal(self, peer: int, index: int, ctx: int) -> None:
        """A signal alone on (ctx, index) from this rank to `peer`: strong where the backend
        has strong signals (it covers this rank's earlier puts to `peer` on ctx), else weak."""
        flags = abi.GIN_HAS_SIGNAL | (abi.GIN_STRONG if self.backend.caps.strong_signals else 0)
        gctx = HOST_CONTEXT_BASE + ctx
        self._post(abi.GIN_SIGNAL, flags, peer, gctx, signal=self.signal_word(ctx, index, self.rank))
        self._ring(peer, gctx)

    def wait(self, waits: list[tuple[int, int, int, int]], deadline: float) -> None:
        """Waits until each (op count, peer, index, ctx) has seen op count more arrivals
        than were consumed before, then consumes them. Arrivals are counted with
        wrap-around (64-bit). CommTimeout at `deadline` (time.monotonic) naming the
        first unsatisfied wait; CommAborted when the job or the engine fails first."""
        need: dict[int, tuple[int, int, int, int]] = {}  # word - signal_base -> (count, peer, index, ctx)
        for count, peer, index, ctx in waits:
            word = self.signal_word(ctx, index, peer) - self.signal_base
            have = need.get(word, (0, peer, index, ctx))[0]
            need[word] = (have + count, peer, index, ctx)
        pending = dict(need)
        spins = 0
        while pending:
            for word, (count, _, _, _) in list(pending.items()):
                target = (int(self._seen[word]) + count) & ((1 << 64) - 1)
                value = int(self._load(self._signals_addr + 8 * (self.signal_base + word)))
                if (value - target) & ((1 << 64) - 1) < 1 << 63:
                    del pending[word]
            if not pending:
                break
            self.producer.wake()  # an engine asleep would take a peer's message late (network mpi)
            self._check_alive()
            if time.monotonic() > deadline:
                word, (count, peer, index, ctx) = next(iter(pending.items()))
                value = int(self._load(self._signals_addr + 8 * (self.signal_base + word)))
                seen = (value - int(self._seen[word])) & ((1 << 64) - 1)
                raise CommTimeout(
                    f"rank {self.rank}: wait_signal timed out after {self.timeout} s waiting for peer {peer}'s "
                    f"signal {index} on context {ctx} (expected {count} arrivals, seen {seen})",
                    rank=self.rank,
                    peer=peer,
                    what=f"signal {index} on context {ctx}",
                    expected=count,
                    seen=seen,
                )
            spins += 1
            time.sleep(0 if spins < SPINS else POLL_S)
        for word, (count, _, _, _) in need.items():
            self._seen[word] = (int(self._seen[word]) + count) & ((1 << 64) - 1)

    def quiesce(self) -> None:
        """Waits until the engine has consumed every descriptor posted so far."""
        self._wait_consumed(self.producer.claimed() - 1, "every host put consumed")

    # ---- the queue and the staging ring ----

    def _post(self, op: int, flags: int, peer: int, ctx: int, **fields) -> int:
        self._check_alive()
        try:
            return self.producer.post(op, flags, peer, ctx, **fields)
        except RuntimeError as e:
            raise CommTimeout(
                f"rank {self.rank}: a host GIN call to peer {peer} found no queue slot: {e}",
                rank=self.rank,
                peer=peer,
                what="a GIN queue slot",
            ) from e

    def _ring(self, peer: int, ctx: int) -> None:
        if self.doorbells:
            self._post(abi.GIN_DOORBELL, 0, peer, ctx)

    def _stage(self, nbytes: int) -> int:
        """Where `nbytes` (at most the ring's size) may be written in the staging ring: the
        next free bytes, or the ring's start when they do not fit before its end, once
        every earlier put that reads them has its source reusable (a flush consumed)."""
        at = self._head if self._head + nbytes <= self.staging.nbytes else 0
        end = at + nbytes
        if any(s < end and at < e for _, s, e in self._staged):
            flush = self._post(abi.GIN_FLUSH, 0, -1, HOST_CONTEXT_BASE)
            self._wait_consumed(flush, "staging ring space (a flush)")
            self._staged.clear()  # every put before the flush has a reusable source
        self._head = end
        return at

    def _wait_consumed(self, slot: int, what: str) -> None:
        """Waits until the engine has consumed queue slot `slot` (and every earlier one)."""
        if slot < 0 or self.producer.consumed() > slot:
            return
        deadline = time.monotonic() + self.timeout
        spins = 0
        while self.producer.consumed() <= slot:
            self.producer.wake()
            self._check_alive()
            if time.monotonic() > deadline:
                raise CommTimeout(
                    f"rank {self.rank}: {what}: the GIN engine did not consume slot {slot} within {self.timeout} s "
                    f"(expected {slot + 1} consumed, seen {self.producer.consumed()})",
                    rank=self.rank,
                    what=what,
                    expected=slot + 1,
                    seen=self.producer.consumed(),
                )
            spins += 1
            time.sleep(0 if spins < SPINS else POLL_S)

    def _check_alive(self) -> None:
        error = self.engine.error
        if error is not None:
            raise CommAborted(
                f"rank {self.rank}: the GIN engine failed: {error}",
                rank=self.rank,
                origin_rank=self.rank,
                reason=str(error),
            ) from error
        if self.world.abort_word[0]:
            raise CommAborted(
                f"rank {self.rank}: the job failed (abort word set) during a host GIN call",
                rank=self.rank,
                origin_rank=None,
                reason="the job failed",
            )
