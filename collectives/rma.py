"""Host one-sided calls, nccl4py-shaped (management: validation, windows, descriptors):
register_window(buffer) / deregister_window(window), put_signal(localbuff, peer,
window, offset, signal_index, context), signal(peer, signal_index, context) and
wait_signal(descs) with WaitSignalDesc(op_cnt, peer, signal_index, context).

Everything is checked here, on the calling rank, before anything is posted: a bad
argument raises TypeError or ValueError naming rank and argument; what the communicator
cannot do (no GIN peer, a GPU communicator, an engine without host windows, a backend
without strong signals for put_signal, a peer reached by LSA, not GIN) raises
CapabilityError. transports/gin/rma.py (HostRma) carries the calls on the
communicator's GIN engine, with its semantics; its docstring states the promise a
signal makes and how contexts, windows and signal words are kept apart from the kernels'.

Collective calls (register_window, deregister_window) agree across ranks before they
act: a rank that refuses makes every rank raise, so none is left waiting.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from commref.device_kernels import abi
from commref.transports.errors import CapabilityError
from commref.transports.gin.rma import HostRma, host_window


class WaitSignalDesc(NamedTuple):
    """What wait_signal waits for (nccl4py's WaitSignalDesc, NCCL's ncclWaitSignalDesc_t:
    opCnt, peer, sigIdx, ctx): `op_cnt` more arrivals of `peer`'s signal `signal_index`
    on context `context` than earlier waits consumed."""

    op_cnt: int
    peer: int
    signal_index: int = 0
    context: int = 0


class RegisteredWindow:
    """A window from Communicator.register_window (nccl4py's RegisteredWindowHandle):
    `handle` (its GIN window id, the same on every rank), `nbytes`, `is_valid`. close()
    is deregister_window (collective)."""

    def __init__(self, comm, handle: int, window, buffer):
        self._comm, self.handle, self.window, self.buffer = comm, handle, window, buffer
        self.nbytes = int(window.nbytes)
        self.is_valid = True

    def close(self) -> None:
        """Collective: Communicator.deregister_window(self); idempotent."""
        if self.is_valid:
            self._comm.deregister_window(self)

    def __repr__(self) -> str:
        state = "valid" if self.is_valid else "deregistered"
        return f"RegisteredWindow(handle={self.handle}, nbytes={self.nbytes}, {state})"


def _int(value, what: str, rank: int, low: int, high: int) -> int:
    """`value` as an int in [low, high), else TypeError / ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"rank {rank}: {what} must be an integer, got {value!r}")
    if not low <= int(value) < high:
        raise ValueError(f"rank {rank}: {what} must be in [{low}, {high}), got {value}")
    return int(value)


def _bytes_of(obj, what: str, rank: int, write: bool) -> np.ndarray:
    """A C-contiguous numpy array's bytes (uint8 view)."""
    if not isinstance(obj, np.ndarray):
        kind = type(obj).__module__.split(".")[0]
        if hasattr(obj, "__cuda_array_interface__") or kind == "cupy":
            raise CapabilityError(
                f"rank {rank}: {what} is device memory; host one-sided calls run on the CPU engine (device='cpu')"
            )
        raise TypeError(f"rank {rank}: {what} must be a numpy array, got {type(obj).__name__}")
    if not obj.flags.c_contiguous:
        raise ValueError(f"rank {rank}: {what} must be C-contiguous")
    if write and not obj.flags.writeable:
        raise ValueError(f"rank {rank}: {what} is read-only")
    return obj.reshape(-1).view(np.uint8)


class Rma:
    """The host one-sided calls of one Communicator `comm` (built by its first
    register_window, collectively). Holds the HostRma and the registered windows."""

    def __init__(self, comm, collective: bool):
        """`collective`: every rank builds it now (register_window), and a rank that
        cannot makes every rank raise; else this rank alone (signal, wait_signal)."""
        self.comm, self.rank, self.nranks = comm, comm.rank, comm.nranks
        o = comm.options
        self.contexts, self.signals = o.rma_contexts, o.rma_signals
        why = self._refusal()
        refusals = comm.world.allgather(why, what="host one-sided calls: setup") if collective else [why]
        first = next(((r, w) for r, w in enumerate(refusals) if w is not None), None)
        if first is not None:
            r, w = first
            who = f"rank {r}: " if collective else ""
            raise CapabilityError(f"rank {self.rank}: host one-sided calls are not available here: {who}{w}")
        signal_base = abi.gin_signals(comm.window_channels, comm.nsteps)[1] + comm.device_signal_words
        self.host = HostRma(
            comm.world,
            comm.proxy,
            comm.gin_region,
            o.gin.queue,
            comm.window,
            comm.layout,
            comm.backend,
            comm.gin.rings_doorbells,
            signal_base,
            self.contexts,
            self.signals,
            o.rma_staging,
            comm.timeout,
        )
        self.windows: dict[int, RegisteredWindow] = {}

    def _refusal(self) -> str | None:
        """Why this rank cannot carry host one-sided calls, or None."""
        c = self.comm
        if c.device != "cpu":
            return "they run on the CPU engine (device='cpu'); this communicator is on a GPU"
        if not c.gin.used or c.proxy is None:
            return (
                "the communicator has no GIN peer (path 'lsa', or every peer reached by LSA); "
                "one-sided calls ride GIN: use path='gin'"
            )
        if not getattr(c.proxy, "carries_host_windows", False):
            return f"its GIN engine ({type(c.proxy).__name__}) does not carry host windows"
        return None

    # ---- windows ----

    def register(self, buffer) -> RegisteredWindow:
        """Collective: `buffer` (a writeable C-contiguous numpy array, the same size on
        every rank) as a window every rank's put_signal may address."""
        c = self.comm
        local = _bytes_of(buffer, "register_window buffer", self.rank, write=True)
        why, home = None, None
        if c.world.kind != "thread" and c.gin.network == "shm":
            home = self._symmetric_home(local)
            if home is None:
                why = (
                    "network shm across processes lands puts in the peer's memory directly, which a buffer "
                    "of one process is not; use network='mpi', or a buffer from alloc_symmetric"
                )
        refusals = c.world.allgather((why, home and home[1:]), what="register_window")
        first = next(((r, w) for r, (w, _) in enumerate(refusals) if w is not None), None)
        if first is None and home is not None and len({h for _, h in refusals}) != 1:
            first = (
                0,
                f"the buffers lie at different (symmetric window, offset) on the ranks: {[h for _, h in refusals]}",
            )
        if first is not None:
            raise CapabilityError(f"rank {self.rank}: register_window refused: rank {first[0]}: {first[1]}")
        peers = None
        if home is not None:  # each peer's copy is mapped here, at the same offset of its window
            sym, _, offset = home
            peers = np.array([int(a) + offset if int(a) else 0 for a in sym.peer_addresses], dtype=np.uint64)
        window = host_window(c.world, local, c.gin.network, peers)
        handle = self.host.add_window(window)
        ids = c.world.allgather(handle, what="register_window ids")
        if len(set(ids)) != 1:  # every rank registers and deregisters alike
            self.host.remove_window(handle)
            raise ValueError(f"rank {self.rank}: register_window calls differ across ranks (window ids {ids})")
        reg = RegisteredWindow(c, handle, window, buffer)
        self.windows[handle] = reg
        return reg

    def _symmetric_home(self, local: np.ndarray):
        """(window, its index, offset) of the alloc_symmetric window (this communicator's,
        mapped by every peer on this host) that holds all of `local`, or None."""
        sym = self.comm.__dict__.get("_symmetric")
        address, n = int(local.ctypes.data), int(local.nbytes)
        for i, w in enumerate(sym.windows if sym is not None else ()):
            if int(w.address) <= address and address + n <= int(w.address) + int(w.nbytes):
                return w, i, address - int(w.address)
        return None

    def deregister(self, window) -> None:
        """Collective: forgets `window`, after a barrier (no peer's put into it is still
        in flight once every rank has waited for its signals and reached it)."""
        reg = self._window(window, "deregister_window")
        c = self.comm
        ids = c.world.allgather(reg.handle, what="deregister_window ids")
        if len(set(ids)) != 1:
            raise ValueError(f"rank {self.rank}: deregister_window names different windows across ranks ({ids})")
        self.host.quiesce()
        c.world.barrier(what="deregister_window: puts landed", timeout=c.timeout)
        self.host.remove_window(reg.handle)
        reg.is_valid = False
        del self.windows[reg.handle]

    def invalidate(self) -> None:
        """Marks every registered window deregistered (the communicator closes)."""
        for reg in self.windows.values():
            reg.is_valid = False
        self.windows.clear()

    def _window(self, window, what: str) -> RegisteredWindow:
        if not isinstance(window, RegisteredWindow):
            raise TypeError(f"rank {self.rank}: {what}: window must be a RegisteredWindow, got {type(window).__name__}")
        if window._comm is not self.comm:
            raise ValueError(f"rank {self.rank}: {what}: the window was registered on another communicator")
        if not window.is_valid or self.windows.get(window.handle) is not window:
            raise ValueError(f"rank {self.rank}: {what}: window {window.handle} is deregistered")
        return window

    # ---- operations ----

    def _peer(self, peer, what: str) -> int:
        peer = _int(peer, f"{what} peer", self.rank, 0, self.nranks)
        if peer == self.rank:
            raise ValueError(f"rank {self.rank}: {what} peer {peer} is this rank; one-sided calls go to another rank")
        if not (self.comm.peer_mask >> peer) & 1:
            raise CapabilityError(
                f"rank {self.rank}: {what} peer {peer} is reached by LSA, not GIN, on this communicator (path='gin')"
            )
        return peer

    def _slot(self, signal_index, context, what: str) -> tuple[int, int]:
        if self.signals == 0:
            raise CapabilityError(f"rank {self.rank}: {what}: the communicator has no host signals (rma_signals=0)")
        index = _int(signal_index, f"{what} signal_index", self.rank, 0, self.signals)
        ctx = _int(context, f"{what} context", self.rank, 0, self.contexts)
        return index, ctx

    def put_signal(self, localbuff, peer, window, offset, signal_index, context) -> None:
        what = "put_signal"
        data = _bytes_of(localbuff, f"{what} localbuff", self.rank, write=False)
        peer = self._peer(peer, what)
        reg = self._window(window, what)
        offset = _int(offset, f"{what} offset", self.rank, 0, 1 << 47)
        if offset + data.size > reg.nbytes:
            raise ValueError(
                f"rank {self.rank}: {what}: {data.size} bytes at offset {offset} pass the end of the "
                f"{reg.nbytes}-byte window {reg.handle}"
            )
        index, ctx = self._slot(signal_index, context, what)
        if not self.comm.backend.caps.strong_signals:
            raise CapabilityError(
                f"rank {self.rank}: {what}: backend {self.comm.backend.name} offers weak signals only, so a "
                f"signal could be seen before its put's data; put_signal promises the data with the signal "
                f"(use backend proxy or rc)"
            )
        self._run(what, self.host.put_signal, data, peer, reg.handle, offset, index, ctx)

    def signal(self, peer, signal_index, context) -> None:
        what = "signal"
        peer = self._peer(peer, what)
        index, ctx = self._slot(signal_index, context, what)
        self._run(what, self.host.signal, peer, index, ctx)

    def wait_signal(self, descs) -> None:
        what = "wait_signal"
        if isinstance(descs, WaitSignalDesc) or not isinstance(descs, (list, tuple)):
            raise TypeError(f"rank {self.rank}: {what}: descs must be a list of WaitSignalDesc, got {descs!r}")
        waits = []
        for i, d in enumerate(descs):
            if not all(hasattr(d, f) for f in WaitSignalDesc._fields):
                raise TypeError(f"rank {self.rank}: {what}: descs[{i}] must be a WaitSignalDesc, got {d!r}")
            count = _int(d.op_cnt, f"{what} descs[{i}].op_cnt", self.rank, 0, 1 << 62)
            peer = self._peer(d.peer, f"{what} descs[{i}]")
            index, ctx = self._slot(d.signal_index, d.context, f"{what} descs[{i}]")
            waits.append((count, peer, index, ctx))
        self._run(what, self.host.wait, waits, time.monotonic() + self.comm.timeout)

    def _run(self, what: str, fn, *args) -> None:
        """Runs a checked call; a failure (a deadline, the engine, the job) leaves the
        communicator broken, as a failed collective does."""
        self.comm.check_usable(what)
        try:
            fn(*args)
        except Exception as e:
            self.comm.broken = self.comm.broken or f"{type(e).__name__}: {e}"
            raise


def signal_words(options, nranks: int) -> int:
    """Signal words the host one-sided calls take after the device API's: one per
    (context, signal index, peer), where GIN may carry them (not on path 'lsa')."""
    return options.rma_contexts * options.rma_signals * nranks if options.gin.path.value != "lsa" else 0


# ---- the Communicator's methods (Communicator binds them; `comm` is its self) ----


def register_window(comm, buffer) -> RegisteredWindow:
    """Collective (nccl4py's register_window): `buffer`, a writeable C-contiguous numpy
    array of the same size on every rank, as a window that peers' put_signal writes
    into; returns its handle. Needs a CPU communicator with GIN peers (path='gin')
    and, across processes, network='mpi' or a buffer from alloc_symmetric:
    CapabilityError on every rank otherwise."""
    comm.check_usable("register_window")
    if comm.rma is None:
        comm.rma = Rma(comm, collective=True)
    return comm.rma.register(buffer)


def deregister_window(comm, window) -> None:
    """Collective: releases a window from register_window once every rank reaches it
    (a barrier): wait for the signals of every put into it first."""
    comm.check_usable("deregister_window")
    if comm.rma is None:
        raise ValueError(f"rank {comm.rank}: deregister_window: no window was registered on this communicator")
    comm.rma.deregister(window)


def put_signal(comm, localbuff, peer: int, window, offset: int, signal_index: int = 0, context: int = 0) -> None:
    """nccl4py's put_signal: localbuff's bytes to byte `offset` of `peer`'s copy of
    `window`, then adds 1 to `peer`'s signal `signal_index` from this rank on host
    context `context` (in [0, rma_signals) and [0, rma_contexts)). The signal is
    strong: once wait_signal sees it, this put's data and every earlier put_signal's
    from this rank to `peer` on `context` are in the window. localbuff is reusable on
    return. A backend with weak signals only (gda) cannot promise that: CapabilityError
    (docs/gin.md, "Host one-sided calls")."""
    _state(comm, "put_signal").put_signal(localbuff, peer, window, offset, signal_index, context)


def signal(comm, peer: int, signal_index: int = 0, context: int = 0) -> None:
    """nccl4py's signal: adds 1 to `peer`'s signal `signal_index` from this rank on
    `context`, strong where the backend has strong signals (it then covers this rank's
    earlier put_signal's to `peer` on `context`), weak on gda."""
    _state(comm, "signal").signal(peer, signal_index, context)


def wait_signal(comm, descs) -> None:
    """nccl4py's wait_signal: waits until each WaitSignalDesc(op_cnt, peer,
    signal_index, context) of the list `descs` has seen op_cnt more arrivals than
    earlier waits consumed, then consumes them. A wait past the communicator's timeout
    raises CommTimeout naming rank, peer, signal, context, expected and seen, and
    leaves the communicator broken."""
    _state(comm, "wait_signal").wait_signal(descs)


def _state(comm, what: str) -> Rma:
    comm.check_usable(what)
    if comm.rma is None:  # this rank's part alone: signals need no window
        comm.rma = Rma(comm, collective=False)
    return comm.rma
