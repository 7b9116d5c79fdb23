"""GIN wires: how the proxy's landings reach the target rank's window.

Every wire offers the same small interface (Wire): land data at a window offset of a
peer, apply a signal there, get bytes from a peer, make progress (receive and land what
peers sent, finish sends), and say whether anything it sent is still in flight. What
lands when is not the wire's business: the delivery scheduler (scheduler.py) decides,
the wire carries each landing as it is told, in that order.

- ShmWire (network "shm"): the peer's window is mapped here (same host); data is
  copied into it, signals are atomic adds (release: the data landed before is visible
  first).
- MpiWire (network "mpi"): one MPI message per landing to the peer's proxy, which lands
  it in its own window (across processes and nodes: the distributed path). A message is
  a header of 6 uint64 (kind, offset, size, is_va, signal, value) and the data bytes.
  Where it lands is the wire's `memory`: HostMemory (a window in host memory) for the
  CPU engine's proxies; the copy-engine proxy hands in its own for a window on a GPU.

Window addresses: a landing's `offset` is window_address(window id, offset) (the
offset alone for the connection window, id 0). ShmWire and HostMemory resolve an id
other than 0 in their `windows` (id -> a window with `address` and `peer_addresses`:
what GinProxy.add_window was given, the host windows of transports/gin/rma.py); an MPI
landing carries the address unchanged and the target resolves it in its own.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from commref.transports.gin import semantics

# MPI wire message kinds (the first header word).
MSG_DATA, MSG_SIGNAL, MSG_GET_REQ, MSG_GET_RESP = 1, 2, 3, 4
HEADER_WORDS = 6
HEADER_BYTES = 8 * HEADER_WORDS
TAG = 7171  # MpiWire's default tag; a GIN communicator's own comes from engines.network_tag()
WINDOW_SHIFT = 48  # a window address: window id << WINDOW_SHIFT | offset (offsets below 2**48)
OFFSET_MASK = (1 << WINDOW_SHIFT) - 1


def window_address(window: int, offset: int) -> int:
    """Where a landing goes: `offset` in window `window` (0: the connection window)."""
    return window << WINDOW_SHIFT | offset


def window_base(windows: dict, window: int, rank: int, connection_base: int) -> int:
    """The address here of rank `rank`'s copy of window `window` (`connection_base` for
    0); ProxyError when the window is unknown or that copy is not mapped here."""
    if window == 0:
        return connection_base
    w = windows.get(window)
    base = 0 if w is None else int(w.peer_addresses[rank])
    if not base:
        raise ProxyError(f"GIN landing names rank {rank}'s window {window}, which is not mapped here")
    return base


class ProxyError(RuntimeError):
    """The proxy or its wire met an operation it cannot carry, or a wait passed its
    deadline (names rank, peer, operation; proxy.py exports it too)."""


def wait_drained(state, who: str, timeout: float) -> None:
    """A proxy's quiesce: polls state() -> (done, operations claimed, operations taken)
    every 50 us until done; at the deadline raises ProxyError naming `who` (rank and
    proxy), expected and seen."""
    deadline = time.monotonic() + timeout
    while True:
        done, claimed, taken = state()
        if done:
            return
        if time.monotonic() > deadline:
            raise ProxyError(
                f"{who} did not drain within {timeout} s (expected {claimed} operations taken, seen {taken})"
            )
        time.sleep(50e-6)


class Wire:
    """The interface every wire implements (see the module docstring)."""

    name = ""

    def land_data(self, peer: int, offset: int, data: np.ndarray, ctx: int = 0) -> None:
        """Writes `data` (uint8) at window offset `offset` of rank `peer` (`ctx`: the
        context it was posted on, for a wire that keeps state per (peer, context):
        faults.ReliableWire; ShmWire and MpiWire need not look at it)."""
        raise NotImplementedError

    def signal(self, peer: int, sig: semantics.Signal, ctx: int = 0) -> None:
        """Applies `sig` at rank `peer`: adds sig.value to signal slot i (("index", i)) or
        to the 64-bit word at window offset o (("va", o)), after everything landed before."""
        raise NotImplementedError

    def get(self, peer: int, src: int, dst: int, nbytes: int, idle) -> None:
        """Copies `nbytes` from window offset `src` of rank `peer` to offset `dst` of this
        rank's window before returning; calls idle() while it waits (if it waits)."""
        raise NotImplementedError

    def progress(self) -> int:
        """Receives and lands what peers sent, finishes sends; returns messages handled."""
        return 0

    def drained(self) -> bool:
        """Nothing this wire sent is still in flight."""
        return True

    def in_flight(self, peer: int | None = None) -> bool:
        """Whether a landing handed to this wire for `peer` (or any peer) has not landed
        yet (faults.ReliableWire holds them; the others land before they return)."""
        return False


class ShmWire(Wire):
    name = "shm"

    def __init__(self, window, signals_off: int, atomics):
        self.base = int(window.address)
        self.peer_base = [int(a) for a in window.peer_addresses]  # 0 where not mapped
        self.signals_off = signals_off
        self._add = atomics.add_u64
        self._land = atomics.land  # line by line, in order: kernels may poll LL lines (commref/land.h)
        self._keep = window  # the mappings must outlive the wire
        self.windows: dict = {}  # window id -> window (the module docstring, "Window addresses")

    def land_data(self, peer: int, offset: int, data: np.ndarray, ctx: int = 0) -> None:
        if data.size:
            if offset >> WINDOW_SHIFT:
                base = window_base(self.windows, offset >> WINDOW_SHIFT, peer, 0)
                self._land(base + (offset & OFFSET_MASK), data.ctypes.data, data.size)
                return
            self._land(self.peer_base[peer] + offset, data.ctypes.data, data.size)

    def signal(self, peer: int, sig: semantics.Signal, ctx: int = 0) -> None:
        kind, where = sig.target
        self._add(self.peer_base[peer] + (where if kind == "va" else self.signals_off + 8 * where), sig.value)

    def get(self, peer: int, src: int, dst: int, nbytes: int, idle) -> None:
        ctypes.memmove(self.base + dst, self.peer_base[peer] + src, nbytes)


def _header(kind: int, offset: int = 0, size: int = 0, is_va: int = 0, signal: int = 0, value: int = 0):
    return np.array([kind, offset, size, is_va, signal, value], np.uint64)


class HostMemory:
    """What an MpiWire does with this rank's window when the window is in host memory:
    write received data, read what a peer's get asks for, add to a signal word (release:
    after the data written before it), and settle (nothing: writes are done on return)."""

    def __init__(self, window, atomics):
        self.local = window.local
        self.base = int(window.address)
        self._add = atomics.add_u64
        self._land = atomics.land  # line by line, in order: kernels may poll LL lines (commref/land.h)
        self.windows: dict = {}  # window id -> window (the module docstring, "Window addresses")
        self.rank = -1  # this rank, where `windows` holds windows (set with them)

    def write(self, src: int, offset: int, data: np.ndarray) -> None:
        if offset >> WINDOW_SHIFT:
            base = window_base(self.windows, offset >> WINDOW_SHIFT, self.rank, 0)
            self._land(base + (offset & OFFSET_MASK), data.ctypes.data, data.size)
            return
        self._land(self.base + offset, data.ctypes.data, data.size)

    def read(self, offset: int, size: int) -> np.ndarray:
        return self.local[offset : offset + size].copy()

    def add_signal(self, src: int, offset: int, value: int) -> None:
        self._add(self.base + offset, value)

    def settle(self, src: int) -> None:
        pass


class MpiWire(Wire):
    """`comm`: the proxies' own communicator (a Dup of the world's), `timeout`: how long
    a get waits for its reply; `observer`: told of every message sent and received;
    `memory`: where received data and signals land (default HostMemory(window)); `tag`:
    the tag of every message (the communicator's own: a freed communicator's context id
    may be reused, and its messages still in flight must not match a later wire)."""

    name = "mpi"

    def __init__(
        self,
        comm,
        rank: int,
        window,
        signals_off: int,
        atomics,
        timeout: float,
        observer=None,
        memory=None,
        tag: int = TAG,
    ):
        from mpi4py import MPI

        self.comm, self.rank, self.timeout, self.observer, self.tag = comm, rank, timeout, observer, tag
        self.memory = memory if memory is not None else HostMemory(window, atomics)
        self.signals_off = signals_off
        self._mpi = MPI
        self._status = MPI.Status()
        self._pending: list = []  # (request, message) of unfinished sends
        self._get_reply: dict = {}

    def land_data(self, peer: int, offset: int, data: np.ndarray, ctx: int = 0) -> None:
        if data.size:
            self._send(peer, _header(MSG_DATA, offset, data.size), data)

    def signal(self, peer: int, sig: semantics.Signal, ctx: int = 0) -> None:
        kind, where = sig.target
        self._send(peer, _header(MSG_SIGNAL, is_va=int(kind == "va"), signal=where, value=sig.value))

    def _apply_signal(self, src: int, is_va: bool, where: int, value: int) -> None:
        self.memory.add_signal(src, where if is_va else self.signals_off + 8 * where, value)

    def _send(self, peer: int, header: np.ndarray, data: np.ndarray | None = None) -> None:
        msg = header.view(np.uint8) if data is None else np.concatenate([header.view(np.uint8), data])
        self._pending.append((self.comm.Isend(msg, dest=peer, tag=self.tag), msg))
        if self.observer is not None:
            self.observer.sent(peer, int(header[0]), msg.size)

    def _reap(self) -> None:
        if self._pending:
            self._pending = [(r, m) for r, m in self._pending if not r.Test()]

    def _receive(self) -> int:
        MPI, status, n = self._mpi, self._status, 0
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=self.tag, status=status):
            buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            src = status.Get_source()
            self.comm.Recv(buf, source=src, tag=self.tag)
            h = buf[:HEADER_BYTES].view(np.uint64)
            kind = int(h[0])
            if kind == MSG_DATA:
                self.memory.write(src, int(h[1]), buf[HEADER_BYTES : HEADER_BYTES + int(h[2])])
            elif kind == MSG_SIGNAL:
                self._apply_signal(src, bool(h[3]), int(h[4]), int(h[5]))
            elif kind == MSG_GET_REQ:
                off, size = int(h[1]), int(h[2])
                self._send(src, _header(MSG_GET_RESP, 0, size), self.memory.read(off, size))
            elif kind == MSG_GET_RESP:
                self._get_reply[src] = buf[HEADER_BYTES:].copy()
            n += 1
            if self.observer is not None:
                self.observer.received(src, kind, buf.size)
        return n

    def progress(self) -> int:
        n = self._receive()
        self._reap()
        return n

    def drained(self) -> bool:
        return not self._pending

    def get(self, peer: int, src: int, dst: int, nbytes: int, idle) -> None:
        self._send(peer, _header(MSG_GET_REQ, src, nbytes))
        deadline = time.monotonic() + self.timeout
        while peer not in self._get_reply:
            self.progress()
            idle()
            if time.monotonic() > deadline:
                raise ProxyError(
                    f"rank {self.rank}: GIN get from peer {peer} got no reply within "
                    f"{self.timeout} s (expected {nbytes} bytes, seen none)"
                )
            time.sleep(0)
        self.memory.write(peer, dst, self._get_reply.pop(peer)[:nbytes])
        self.memory.settle(peer)
