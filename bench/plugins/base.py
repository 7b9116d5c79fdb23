"""The plugin contract: what a collective tells the harness.

As in nccl-tests, a plugin answers four questions, and the harness does the rest:

- counts: for a sweep size in bytes, the element counts of sendbuf and recvbuf and
  the count NCCL's call takes (nccl-tests' getCollByteCount);
- bandwidth: the bytes algbw divides by time, and the bus factor that turns algbw
  into busbw (nccl-tests' getBw);
- data: buffers holding exact-checkable inputs (commref.collectives.verify), the expected
  output, and how to restore an in-place input (nccl-tests' initData);
- run: one call on a Communicator, or on anything with nccl4py's method names (the
  baselines) (nccl-tests' runColl).

Bandwidth definitions (nccl-tests' doc/PERFORMANCE.md), for n ranks, element size t
and NCCL's count c:

=============== ======================= ==============
collective      algbw bytes             bus factor
=============== ======================= ==============
all_reduce      c * t                   2 (n - 1) / n
all_gather      c * t * n (recv size)   (n - 1) / n
reduce_scatter  c * t * n (send size)   (n - 1) / n
broadcast       c * t                   1
reduce          c * t                   1
=============== ======================= ==============
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np

from commref.collectives import verify

SENTINEL = 0x5A  # byte pattern of recvbufs before the first call: a missed write shows


@dataclass(frozen=True)
class Counts:
    """Element counts of one sweep size (nccl-tests' getCollByteCount)."""

    send: int
    recv: int
    param: int  # the count NCCL's call takes

    def size_bytes(self, itemsize: int) -> int:
        """The size column: nccl-tests prints max(sendBytes, recvBytes)."""
        return max(self.send, self.recv) * itemsize


@dataclass
class Buffers:
    """One rank's buffers for one (size, in-place or not) measurement.

    `send` and `recv` are what the call gets; `out` is the whole of what the check
    compares (recv, or the full buffer for in-place layouts); `restore()` puts the
    pristine input back (in-place calls overwrite it)."""

    send: Any
    recv: Any
    out: Any
    restore: Callable[[], None] | None = None


class Collective:
    """Base of the plugins. Subclasses set the class attributes and implement
    `bus_factor`, `bound_bytes` and `run`, and `counts` and `buffers` where the send and
    recv layouts differ."""

    name: ClassVar[str]  # nccl-tests name: all_reduce
    coll: ClassVar[str]  # commref / nccl4py name: allreduce
    reducing: ClassVar[bool] = False
    rooted: ClassVar[bool] = False

    # ---- sizes and bandwidth ----

    def counts(self, nbytes: int, itemsize: int, nranks: int) -> Counts:
        count = nbytes // itemsize
        return Counts(count, count, count)

    def algbw_bytes(self, counts: Counts, itemsize: int, nranks: int) -> int:
        return counts.param * itemsize

    def bus_factor(self, nranks: int) -> float:
        raise NotImplementedError

    def bound_bytes(self, size: int, nranks: int, in_place: bool = False) -> tuple[int, int]:
        """(copy bytes, add bytes) one rank must at least move for a call of `size`
        bytes (the size column), out of place or in place; see bench/bound.py."""
        raise NotImplementedError

    # ---- data ----

    def input(self, counts: Counts, dtype, op: str | None, seed: int, rank: int, nranks: int) -> np.ndarray:
        return verify.make_input(self.coll, dtype, op, seed, rank, nranks, counts.param)

    def expected(self, counts: Counts, dtype, op: str | None, seed: int, rank: int, nranks: int,
                 root: int) -> np.ndarray | None:
        """What `out` must hold after the call; None where nothing is checked on this
        rank (reduce on a non-root rank)."""
        return verify.expected_output(self.coll, dtype, op, seed, rank, nranks, counts.param, root)

    def buffers(self, mem: Memory, x, counts: Counts, rank: int, nranks: int, root: int, in_place: bool) -> Buffers:
        """Equal send and recv counts (allreduce, broadcast, reduce): in place, one
        buffer restored from `x` before each checked call; out of place, a copy of `x`
        and a sentinel-filled recvbuf. Collectives with other layouts override this."""
        if in_place:
            buf = device_copy(mem, x)
            return Buffers(buf, buf, buf, restorer(mem, buf, x))
        recv = sentinel(mem, counts.recv, x.dtype)
        return Buffers(device_copy(mem, x), recv, recv)

    # ---- the call ----

    def run(self, comm, b: Buffers, op: str, root: int) -> None:
        raise NotImplementedError


class Memory:
    """Where a plugin's buffers live: fresh numpy (CPU) or CuPy (GPU) arrays. The
    harness hands one to `Collective.buffers` as `mem`."""

    def __init__(self, xp):
        self.xp = xp

    def asarray(self, x: np.ndarray):
        """Host array x as this memory's kind of array (numpy: x itself)."""
        return x if self.xp is np else self.xp.asarray(x)

    def full_bytes(self, nbytes: int, byte: int):
        return self.xp.full(nbytes, byte, dtype=np.uint8)

    def copy_of(self, x: np.ndarray):
        return x.copy() if self.xp is np else self.xp.asarray(x)


class SymmetricMemory(Memory):
    """Buffers from a symmetric arena of a Communicator (nccl-tests' -R 2: buffers
    registered symmetrically; see collectives/symmetric.py). The harness resets it
    before each measurement."""

    def __init__(self, comm, xp, capacity: int):
        from commref.collectives.symmetric import SymmetricArena

        super().__init__(xp)
        self.arena = SymmetricArena(comm, capacity)

    def reset(self) -> None:
        self.arena.reset()

    def full_bytes(self, nbytes: int, byte: int):
        buf = self.arena.take(nbytes, np.uint8)
        buf.fill(byte)
        return buf

    def copy_of(self, x: np.ndarray):
        buf = self.arena.take(x.size, x.dtype).reshape(x.shape)
        buf[...] = self.asarray(x)
        return buf


def sentinel(mem: Memory, n: int, dtype) -> Any:
    """n elements of `dtype` filled with the SENTINEL byte pattern, in `mem`."""
    dt = np.dtype(dtype)
    return mem.full_bytes(n * dt.itemsize, SENTINEL).view(dt)


def device_copy(mem: Memory, x: np.ndarray):
    """A copy of host array x in `mem`."""
    return mem.copy_of(x)


def restorer(mem: Memory, dst, x: np.ndarray) -> Callable[[], None]:
    """A function that copies host input x back into dst."""
    def restore() -> None:
        dst[...] = mem.asarray(x)
    return restore
