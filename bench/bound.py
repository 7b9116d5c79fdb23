"""The bound column: the busbw this machine's memory bandwidth allows.

Model. A collective of `size` bytes (the size column) obliges each rank to move at
least some bytes through memory, whatever the algorithm and however the ranks share
memory (LSA peers load and store each other's buffers directly):

- copy bytes: data that must land in this rank's output from elsewhere;
- add bytes: data this rank must combine with its own (one operand's worth).

Each plugin states its share (plugins/*.py ``bound_bytes``), for n ranks:

=============== ======================= ===================
collective      copy bytes              add bytes
=============== ======================= ===================
all_reduce      (n - 1) / n * size      (n - 1) / n * size
all_gather      size; in place          0
                (n - 1) / n * size
reduce_scatter  0                       (n - 1) / n * size
broadcast       size                    0
reduce          (n - 1) / n * size      (n - 1) / n * size
=============== ======================= ===================

all_reduce and reduce: reduce this rank's 1/n shard from the n inputs (n - 1 adds of
size / n), then fetch the other n - 1 reduced shards. all_gather: land the other
ranks' n - 1 shards and, out of place, copy this rank's own shard into recvbuf (in
place it is already there). reduce_scatter: reduce this rank's shard. broadcast: a
non-root rank lands all of the root's bytes. Only all_gather differs between the
placements: the table's bound and %bound are out of place, and the %ip column
compares the in-place busbw with the in-place bound.

The speed of those bytes is measured in the same run, at the same size, on every
rank at once (so the ranks contend for memory bandwidth as they do in the
collective): ``copyto(dst, src)`` and ``add(a, b, out=c)`` over arrays of the full
`size` bytes, in the benchmark's dtype, numpy on the CPU and CuPy on a GPU. Full-size
arrays keep the measurement's footprint that of the collective's own buffers: a
share-sized array would stay in cache where the collective's buffers do not, and the
bound would then be a cache bandwidth. Per rank each time is the median over the
iterations, scaled from `size` to the rank's share; the bound time is the slowest
rank's copy time plus add time, and

    bound busbw = bus bytes / bound time,  bus bytes = algbw bytes * bus factor,

the busbw a collective would show if it did nothing but the unavoidable memory
traffic at the speed of numpy's own loops. The add is counted once per operand
byte, though it reads two operands and writes one: numpy's add and the kernels'
reduce do the same traffic per element, so the ratio is fair. At small sizes the
bound is the cost of numpy calls (about a microsecond each), not of memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass
class BoundTimes:
    """One rank's median seconds for a copy and an add over `measured_bytes`, and the
    share of each that the collective must move."""

    copy_bytes: int
    add_bytes: int
    measured_bytes: int
    copy_s: float
    add_s: float

    def seconds(self) -> float:
        """Seconds for this rank's share: the measured times scaled to its bytes."""
        if self.measured_bytes <= 0:
            return 0.0
        return (self.copy_bytes * self.copy_s + self.add_bytes * self.add_s) / self.measured_bytes


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

    def measure(self, size: int, copy_bytes: int, add_bytes: int, iters: int, warmup: int = 1) -> BoundTimes:
        """Median seconds of `iters` copies and adds over `size` bytes (after `warmup`
        of each); only those the share needs (copy_bytes, add_bytes > 0) are timed."""
        xp = self.xp
        n = size // self.dtype.itemsize
        nb = n * self.dtype.itemsize
        copy_s = add_s = 0.0
        if copy_bytes and nb:
            src, dst = self._buf("src", nb), self._buf("dst", nb)
            copy_s = self._time(lambda: xp.copyto(dst, src), iters, warmup)
        if add_bytes and nb:
            a, b, c = (self._buf(k, nb).view(self.dtype) for k in "abc")
            add_s = self._time(lambda: xp.add(a, b, out=c), iters, warmup)
        return BoundTimes(copy_bytes, add_bytes, nb, copy_s, add_s)

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
    t = max(bt.seconds() for bt in per_rank)
    return t, (bus_bytes / t / 1e9 if t > 0 else 0.0)
