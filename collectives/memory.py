"""Where a call's buffers live: fresh arrays of the communicator's kind (numpy on the
CPU, CuPy on a GPU), or buffers taken from a symmetric arena (the direct kernels'
buffers; nccl-tests' -R 2). `commref check` and `commref bench` make their buffers
through these, in the layouts of catalogue.Collective.buffers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .symmetric import SymmetricArena

SENTINEL = 0x5A  # byte pattern of a buffer before a call: a write that never happened shows


def array_module(device: str):
    """numpy for "cpu", CuPy for "cuda"."""
    if device == "cuda":
        import cupy

        return cupy
    return np


class Memory:
    """Fresh arrays of module `xp` (numpy or CuPy)."""

    def __init__(self, xp):
        self.xp = xp

    def asarray(self, x: np.ndarray):
        """Host array x as this memory's kind of array (numpy: x itself)."""
        return x if self.xp is np else self.xp.asarray(x)

    def full_bytes(self, nbytes: int, byte: int):
        return self.xp.full(nbytes, byte, dtype=np.uint8)

    def copy_of(self, x: np.ndarray):
        return x.copy() if self.xp is np else self.xp.asarray(x)

    def sentinel(self, n: int, dtype) -> Any:
        """n elements of `dtype` filled with the SENTINEL byte pattern."""
        dt = np.dtype(dtype)
        return self.full_bytes(n * dt.itemsize, SENTINEL).view(dt)

    def restorer(self, dst, x: np.ndarray) -> Callable[[], None]:
        """A function that copies host input x back into dst."""

        def restore() -> None:
            dst[...] = self.asarray(x)

        return restore

    def to_host(self, a) -> np.ndarray:
        return a if self.xp is np else self.xp.asnumpy(a)


class SymmetricMemory(Memory):
    """Buffers from a symmetric arena of a Communicator (symmetric.SymmetricArena):
    every rank takes the same buffers in the same order, so each lies at the same
    offset on every rank. reset() before each call's buffers; free() at the end
    (collective)."""

    def __init__(self, comm, xp, capacity: int):
        super().__init__(xp)
        self.arena = SymmetricArena(comm, capacity)

    @staticmethod
    def capacity(send: int, recv: int, itemsize: int) -> int:
        """Bytes one call's buffers (catalogue.Collective.buffers: a sendbuf of `send`
        and a recvbuf of `recv` elements at most, each page-aligned) take from the arena."""
        return (send + recv) * itemsize + 2 * SymmetricArena.ALIGN

    def reset(self) -> None:
        self.arena.reset()

    def free(self) -> None:
        self.arena.free()

    def full_bytes(self, nbytes: int, byte: int):
        buf = self.arena.take(nbytes, np.uint8)
        buf.fill(byte)
        return buf

    def copy_of(self, x: np.ndarray):
        buf = self.arena.take(x.size, x.dtype).reshape(x.shape)
        buf[...] = self.asarray(x)
        return buf
