"""A bump allocator over one symmetric window, for code that needs many symmetric
buffers in turn (the verification sweep, the benchmark's -R 2).

Every rank makes the same take() calls in the same order, so each buffer sits at the
same offset on every rank, which is what the direct kernels need (and check at their
first barrier). reset() makes the whole window available again; buffers taken
before it must no longer be used.
"""

from __future__ import annotations

import numpy as np

from commref.device_kernels import abi

from .launch_record import address_of


def describe_unmapped(rank: int, everyone: list[dict]) -> str:
    """One line from every rank's {peer: why its window is not mapped}: this rank's
    reasons (or the first rank's that has some), then which other ranks have any."""
    first = rank if everyone[rank] else next(r for r, m in enumerate(everyone) if m)
    by_why: dict[str, list[int]] = {}
    for peer, why in everyone[first].items():
        by_why.setdefault(why, []).append(peer)
    text = "; ".join(
        f"rank {first} cannot map the window of rank{'s' if len(ps) > 1 else ''} {', '.join(map(str, ps))}: {why}"
        for why, ps in by_why.items()
    )
    others = [r for r, m in enumerate(everyone) if m and r != first]
    return text + (f" (ranks {others} cannot map some peers' windows either)" if others else "")


class SymmetricArena:
    ALIGN = 4096

    def __init__(self, comm, nbytes: int):
        """Collective: one window of `nbytes` from comm.alloc_symmetric."""
        self.comm = comm
        self.window = comm.alloc_symmetric(int(nbytes), np.uint8)
        self.used = 0

    def free(self) -> None:
        """Collective: releases the window (Communicator.free_symmetric); buffers taken
        from it no longer count as symmetric."""
        self.comm.free_symmetric(self.window)

    def reset(self) -> None:
        self.used = 0

    def take(self, count: int, dtype):
        """`count` elements of `dtype`, page-aligned, uninitialized."""
        dt = np.dtype(dtype)
        nbytes = int(count) * dt.itemsize
        at = -(-self.used // self.ALIGN) * self.ALIGN
        if at + nbytes > self.window.nbytes:
            raise MemoryError(
                f"symmetric arena of {self.window.nbytes} bytes: {nbytes} more bytes at offset {at} do not fit"
            )
        self.used = at + nbytes
        return self.window[at : at + nbytes].view(dt)


class SymmetricWindows:
    """A communicator's windows from alloc_symmetric (NCCL's ncclMemAlloc plus a
    symmetric window registration), and where a call's buffers lie in them.

    Each window also has a GIN id (SymBuffer.ginWindow, gin.h "Windows"): the smallest
    id from 1 not in use, so the same on every rank (ranks allocate and free alike).
    `gin_engine`, where the communicator's GIN engine carries window ids (NativeProxy),
    is given every window under its id; else the ids stay unused."""

    CACHE_CALLS = 64  # call shapes whose lookup is remembered

    def __init__(self, world, device: str, device_id: int, connection_window, gin_engine=None):
        self.world, self.rank, self.device, self.device_id = world, world.rank, device, device_id
        self._connection = connection_window
        self._engine = gin_engine
        self.windows: list = []
        self._ids: list[int] = []  # windows[i]'s GIN id
        # Per GIN id: the peer table's address and the window's bytes (0, 0: none), what a
        # zero-copy recv reads (P2pOp.symWindows, kernels/p2p.cu).
        self.table = np.zeros((abi.GIN_MAX_WINDOWS, 2), dtype=np.uint64)
        self.table_address = self.table.ctypes.data
        self._cache: dict = {}  # (collective, buffer addresses and sizes) -> direct()

    @property
    def gin_carried(self) -> bool:
        """Whether GIN puts can address these windows (the engine was given them)."""
        return self._engine is not None

    def __len__(self) -> int:
        return len(self.windows)

    def alloc(self, count, dtype):
        """Collective: a zeroed array of `count` elements in a new window every LSA peer
        maps; CapabilityError on every rank when some rank could not map a peer's."""
        from commref.transports.errors import CapabilityError
        from commref.transports.windows import register_window

        dt = np.dtype(dtype)
        if not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"rank {self.rank}: count must be a non-negative integer, got {count!r}")
        nbytes = int(count) * dt.itemsize
        win = register_window(self.world, max(nbytes, 64), self.device, self.device_id)
        peers = self._connection.peer_addresses
        unmapped = {
            r: win.unmapped.get(r, "not mapped")
            for r in range(self.world.size)
            if peers[r] and not win.peer_addresses[r]
        }
        everyone = self.world.allgather(unmapped, what="symmetric window mappings")
        if any(everyone):
            self._release(win)
            raise CapabilityError(
                f"rank {self.rank}: a symmetric window could not be mapped: {describe_unmapped(self.rank, everyone)}"
            )
        gin_id = next(i for i in range(1, len(self._ids) + 2) if i not in self._ids)
        if gin_id >= abi.GIN_MAX_WINDOWS:
            self._release(win)
            raise CapabilityError(f"rank {self.rank}: at most {abi.GIN_MAX_WINDOWS - 1} symmetric windows at once")
        if self._engine is not None:
            self._engine.add_window(gin_id, win)
        self.windows.append(win)
        self._ids.append(gin_id)
        self.table[gin_id] = address_of(win.peer_table), win.nbytes
        self._cache.clear()
        return win.local[:nbytes].view(dt)

    def free(self, address: int) -> None:
        """Collective: releases the window at `address`; every rank must free the same
        (the n-th allocation on every rank), else ValueError on every rank. The caller
        has waited for every kernel of this rank that uses it (Communicator.free_symmetric
        synchronizes)."""
        mine = next((i for i, w in enumerate(self.windows) if w.address == address), None)
        every = self.world.allgather(mine, what="free_symmetric")  # also: every rank's kernels are done
        if mine is None or len(set(every)) != 1:
            raise ValueError(
                f"rank {self.rank}: free_symmetric needs the same array from alloc_symmetric on every "
                f"rank; allocation indices by rank (None: not such an array): {every}"
            )
        self._cache.clear()
        gin_id = self._ids.pop(mine)
        self.table[gin_id] = 0
        if self._engine is not None:
            self._engine.remove_window(gin_id)
        self._release(self.windows.pop(mine))

    def _release(self, win) -> None:
        """Collective: unmaps the peers' buffers of `win`, and once every rank has (a
        barrier), frees this rank's own, which CUDA IPC requires. If the barrier fails,
        the buffer stays allocated rather than freed under a peer."""
        win.close_peers()
        self.world.barrier(what="symmetric window unmapped")
        win.free()

    def of(self, b) -> tuple[int, int, int] | None:
        """(peer table address, offset, GIN id) of a buffer inside a window, or None."""
        for win, gin_id in zip(self.windows, self._ids):
            if win.address <= b.address and b.address + b.nbytes <= win.address + win.nbytes:
                return address_of(win.peer_table), b.address - win.address, gin_id
        return None

    def direct(self, spec, s, r, accessed=None) -> tuple[int, int, int, int, int, int] | None:
        """symSend and symRecv (table, offset, GIN id of each) when every buffer the
        direct kernel of `spec` accesses on peers (or the names in `accessed`) lies in a
        window, else None. A buffer no peer accesses is described by one they do, so
        that the first barrier compares only offsets that must agree."""
        accessed = spec.peer_accessed if accessed is None else accessed
        where = (spec.name, s.address, s.nbytes, r.address, r.nbytes, accessed)
        hit = self._cache.get(where, False)
        if hit is not False:
            return hit
        if len(self._cache) >= self.CACHE_CALLS:
            self._cache.clear()
        by_name = {"sendbuf": s, "recvbuf": r}
        described = [self.of(by_name[name]) for name in accessed]
        sym = None if not described or None in described else (*described[0], *described[-1])
        self._cache[where] = sym
        return sym

    def close_peers(self) -> None:
        """Drops this rank's mappings of the peers' buffers of every window (see
        Communicator.close for the order)."""
        for win in self.windows:
            win.close_peers()

    def free_all(self) -> None:
        """Frees this rank's buffers of every window, once every peer has unmapped them."""
        for win in self.windows:
            win.free()
        self.windows.clear()
        self._ids.clear()
        self.table[:] = 0
        self._cache.clear()

    def close(self) -> None:
        """close_peers() then free(), without waiting for the peers (CPU windows, whose
        memory stays valid for as long as a peer maps it)."""
        self.close_peers()
        self.free_all()
