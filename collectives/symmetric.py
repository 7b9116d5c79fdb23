"""A bump allocator over one symmetric window, for code that needs many symmetric
buffers in turn (the verification sweep, the benchmark's -R 2).

Every rank makes the same take() calls in the same order, so each buffer sits at the
same offset on every rank, which is what the direct kernels need (and check at their
first barrier). reset() makes the whole window available again; buffers taken
before it must no longer be used.
"""

from __future__ import annotations

import numpy as np


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
            raise MemoryError(f"symmetric arena of {self.window.nbytes} bytes: {nbytes} more bytes at offset {at} "
                              f"do not fit")
        self.used = at + nbytes
        return self.window[at : at + nbytes].view(dt)
