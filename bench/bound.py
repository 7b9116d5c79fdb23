"""The bound column: the busbw this machine's memory bandwidth allows.

Model. A collective of `size` bytes (the size column) obliges each rank to move at
least some bytes through memory, whatever the algorithm and however the ranks share
memory (LSA peers load and store each other's buffers directly):

- copy bytes: data that must land in this rank's output from elsewhere;
- add bytes: data this rank must combine with its own (one operand's worth).

Each plugin states its share (plugins/*.py ``bound_bytes``), for n ranks:

=============== =================== ===================
collective      copy bytes          add bytes
=============== =================== ===================
all_reduce      (n - 1) / n * size  (n - 1) / n * size
all_gather      (n - 1) / n * size  0
reduce_scatter  0                   (n - 1) / n * size
broadcast       size                0
reduce          (n - 1) / n * size  (n - 1) / n * size
=============== =================== ===================

all_reduce and reduce: reduce this rank's 1/n shard from the n inputs (n - 1 adds of
size / n), then fetch the other n - 1 reduced shards. all_gather: land the other
ranks' n - 1 shards. reduce_scatter: reduce this rank's shard. broadcast: a non-root
rank lands all of the root's bytes.

The time those bytes take is measured in the same run, at the same size, on every
rank at once (so the ranks contend for memory bandwidth as they do in the
collective): ``copyto(dst, src)`` over the copy bytes and ``add(a, b, out=c)`` over
the add bytes, in the benchmark's dtype, numpy on the CPU and CuPy on a GPU. Per
rank the time is the median over the iterations; the bound time is the slowest
rank's copy time plus add time, and

    bound busbw = bus bytes / bound time,  bus bytes = algbw bytes * bus factor,

the busbw a collective would show if it did nothing but the unavoidable memory
traffic at the speed of numpy's own loops. The add is counted once per operand
byte, though it reads two operands and writes one: numpy's add and the kernels'
reduce do the same traffic per element, so the ratio is fair. At small sizes the
bound is the cost of two numpy calls (about a microsecond each), not of memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass
class BoundTimes:
    """One rank's median seconds for the copy and the add of one size."""

    copy_bytes: int
    add_bytes: int
    copy_s: float
    add_s: float


class BoundMeter:
    """Times numpy (or CuPy) copies and adds for the bound column, reusing scratch
    buffers across sizes."""

    def __init__(self, xp=np, dtype=np.float32, sync=None):
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.sync = sync or (lambda: None)
        self._scratch: dict[str, object] = {}

    def _buf(self, key: str, nbytes: int):
        buf = self._scratch.get(key)
        if buf is None or buf.nbytes < nbytes:
            # 0x3F bytes: about 0.75 in every float type (no denormals), touched now.
            buf = self.xp.full(max(nbytes, 64), 0x3F, dtype=np.uint8)
            self._scratch[key] = buf
        return buf[:nbytes]

    def measure(self, copy_bytes: int, add_bytes: int, iters: int, warmup: int = 1) -> BoundTimes:
        """Median seconds of `iters` copies and adds (after `warmup` of each)."""
        xp = self.xp
        src, dst = self._buf("src", copy_bytes), self._buf("dst", copy_bytes)
        n = add_bytes // self.dtype.itemsize
        nb = n * self.dtype.itemsize
        a = self._buf("a", nb).view(self.dtype)
        b = self._buf("b", nb).view(self.dtype)
        c = self._buf("c", nb).view(self.dtype)
        copy_s = self._time(lambda: xp.copyto(dst, src), iters, warmup) if copy_bytes else 0.0
        add_s = self._time(lambda: xp.add(a, b, out=c), iters, warmup) if n else 0.0
        return BoundTimes(copy_bytes, add_bytes, copy_s, add_s)

    def _time(self, fn, iters: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        times = np.empty(max(iters, 1))
        for i in range(len(times)):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times[i] = time.perf_counter() - t0
        return float(np.median(times))


def bound_busbw(bus_bytes: float, per_rank: list[BoundTimes]) -> tuple[float, float]:
    """(bound seconds, bound busbw in GB/s) from every rank's BoundTimes."""
    t = max(bt.copy_s + bt.add_s for bt in per_rank)
    return t, (bus_bytes / t / 1e9 if t > 0 else 0.0)
