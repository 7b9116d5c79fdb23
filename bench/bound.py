"""The bound column: the fastest a collective can go on this machine's memory.

    bound time = least bytes loaded and stored / rate at which memory serves them,
    %bound     = 100 * bound time / our time  (= our busbw / bound busbw),

so 100% is "as fast as memory allows", and a row well above 100% (beyond the noise of
a few percent) would mean the bound is wrong. Both halves are per rank and balanced:
the bytes are one rank's even share of the least traffic of the whole job, the rate
is one rank's share of what all ranks stream together.

Bytes (collectives/catalogue.py, ``Traffic``). Whatever the algorithm, every input byte
that some output depends on is loaded at least once, every output byte that does not
already hold its value is stored at least once, and a byte loaded once can be stored
to any number of places. The best algorithm (direct loads and stores over symmetric
buffers, the work split evenly: rank r takes part r of every buffer, S / n bytes)
does exactly that. For n ranks and size S (the size column: the larger buffer), each
rank must at least load L and store W bytes:

=============== ======================= ==========================================
collective      out of place: L / W     in place: L / W
=============== ======================= ==========================================
all_reduce      S / S                   S / S
reduce_scatter  S / (S / n)             S / (S / n)
all_gather      (S / n) / S             (S / n) / ((n - 1) S / n)
broadcast       (S / n) / S             (S / n) / ((n - 1) S / n)
reduce          S / (S / n)             S / (S / n)
alltoall        S / S                   (no in-place form)
=============== ======================= ==========================================

all_reduce: part r of the n inputs (S), reduced, stored to part r of the n outputs
(S); in place the outputs are the inputs, which still change. reduce_scatter and
reduce: part r of the n inputs into one output of S / n (rank r's recvbuf, or part r
of the root's). all_gather and broadcast: rank r's shard (part r of the root's buffer)
loaded once and stored to the n outputs; in place it already lies in one of them.
alltoall: each sendbuf byte loaded once and stored once. With one rank in place
nothing moves (the result is the input): no bound (the columns show "-").

For 2 ranks and 16 MiB: all_reduce 32 MiB per rank, reduce_scatter and all_gather 24
MiB out of place, all_gather 16 MiB in place.

Rate. Measured in the same run, by every rank at once, in two rounds per size: one
before the size's collectives and one after them. In each, a barrier, then each rank
runs a STREAM-like kernel over arrays of its own whose footprint is that of its share
of the call (the distinct bytes it touches: L + W out of place, S for all_reduce in
place), so caches help the kernel as much as they can help the collective. A pass's
time is the slowest rank's, a round's rate is the bytes all ranks loaded and stored /
the median of those times (aggregate), a kernel's rate the faster of its two rounds
(a round that another process slowed down is not what memory allows), and a rank's
share is that / n. Kernels (``commref_stream`` on the CPU engine, with as many blocks
per rank as the host has cores per rank, in the widest vectors the CPU has where the
collectives' loops are compiled for SSE2; each counts its loads and stores, as STREAM
does, not the line reads a cached store costs):

- copy: one array into another (STREAM's copy), 1 load : 1 store;
- add: two arrays into a third (STREAM's add), 2 : 1;
- pattern: the collective's own traffic (``Traffic``): its nin arrays reduced into its
  nout arrays (the first ``shared`` of them the inputs), so a mix of loads and stores
  that copy and add do not cover (all_gather's 1 : n, say) is measured too;

each with cached stores and with non-temporal stores (the collectives use both,
``CollArgs.streamStores``). The bound takes the fastest of these: any of them is a
rate this memory reaches for loads and stores at this footprint, and the highest is
the safest bound. On a GPU (CuPy) the kernels are ``copyto`` and ``add`` only.

What the bound leaves out, all of which only make it looser: the cost of reaching a
peer (another core's cache, another socket, NVLink), synchronization, and the pages
(the scratch arrays are numpy's, with transparent huge pages, where symmetric windows
have 4 KiB pages). At small sizes a pass is mostly its kernel launch, so the bound
there is about a launch per call, not memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from commref.collectives.catalogue import Traffic
from commref.transports.cpu_binding import allowed_cpus

WORD = 4  # the stream kernel's element: a 32-bit word
LINE_WORDS = 16  # arrays are whole 64-byte lines


@dataclass(frozen=True)
class StreamKernel:
    """One STREAM-like kernel: `nin` arrays reduced into `nout` (the first `shared` of
    them the inputs), stores cached or non-temporal (`streamed`)."""

    name: str
    nin: int
    nout: int
    shared: int
    streamed: bool = False

    @property
    def label(self) -> str:
        return f"{self.name}/{'streamed' if self.streamed else 'cached'}"

    @property
    def arrays(self) -> int:
        return self.nin + self.nout - self.shared

    def words(self, footprint: float) -> int:
        """Words per array for a footprint of `footprint` bytes (whole lines, at least one)."""
        return max(LINE_WORDS, int(footprint // (WORD * self.arrays)) // LINE_WORDS * LINE_WORDS)

    def bytes_moved(self, words: int) -> int:
        """Bytes loaded and stored by one pass over arrays of `words` words."""
        return (self.nin + self.nout) * words * WORD


def stream_kernels(traffic: Traffic, streamed: bool = True) -> list[StreamKernel]:
    """The kernels that measure the rate for `traffic`: copy, add and the traffic's own
    pattern (unless it is one of those), each with cached stores and, when `streamed`,
    with non-temporal stores too."""
    shapes = {(1, 1, 0): "copy", (2, 1, 0): "add"}
    shapes.setdefault((traffic.nin, traffic.nout, traffic.shared), "pattern")
    kinds = (False, True) if streamed else (False,)
    return [StreamKernel(name, *shape, s) for shape, name in shapes.items() for s in kinds]


def default_blocks(world) -> int:
    """Blocks per rank of the CPU stream kernel: the CPUs this rank may run on, shared
    with the ranks of its host that may run on the same ones (at least one each), so
    that all ranks together keep every core streaming once (unbound ranks share every
    CPU; ranks bound to their share of them, transports/cpu_binding.py, share none)."""
    mine = (world.host, sorted(allowed_cpus()))
    sharing = sum(other == mine for other in world.allgather(mine, what="stream meter: CPUs"))
    return max(1, len(mine[1]) // sharing)


class StreamMeter:
    """Times the stream kernels on this rank, in step with every other rank of `world`
    (each pass starts after a barrier), over scratch arrays reused across sizes.

    CPU (xp is numpy): ``commref_stream`` on the CPU engine, `blocks` blocks of one
    thread. GPU (xp is CuPy): ``copyto`` and ``add`` on this rank's stream."""

    def __init__(self, world, xp=np, sync: Callable[[], None] | None = None, blocks: int | None = None, kernels=None):
        self.world, self.xp = world, xp
        self.sync = sync or (lambda: None)
        self.cpu = xp is np
        self.blocks = blocks or default_blocks(world)
        self._kernels = kernels
        self._scratch = None
        if self.cpu:
            from commref.device_kernels import abi

            self._args = np.zeros(1, dtype=abi.STREAM_ARGS)
            self._ok = abi.LAUNCH_OK

    @property
    def kernels(self):
        if self._kernels is None:
            from commref.device_kernels import cpu_loader

            self._kernels = cpu_loader.cpu_kernels()
        return self._kernels

    def _buf(self, words: int):
        """A scratch array of at least `words` words, starting on a 64-byte line."""
        buf = self._scratch
        if buf is None or buf.size < words:
            xp = self.xp
            raw = xp.empty(words + LINE_WORDS, dtype=np.uint32)
            off = (-int(raw.data.ptr if not self.cpu else raw.ctypes.data) % 64) // WORD
            buf = raw[off : off + words]
            buf.fill(0x3F3F3F3F)  # touched now: no page faults in the timed passes
            self._scratch = buf
        return buf[:words]

    def pass_fn(self, kernel: StreamKernel, words: int) -> Callable[[], None]:
        """One pass of `kernel` over arrays of `words` words."""
        buf = self._buf(kernel.arrays * words)
        if self.cpu:
            a = self._args
            a[0]["base"], a[0]["words"] = buf.ctypes.data, words
            a[0]["nin"], a[0]["nout"], a[0]["shared"] = kernel.nin, kernel.nout, kernel.shared
            a[0]["streamStores"] = int(kernel.streamed)
            launch, blocks, address, ok = self.kernels.launch, self.blocks, a.ctypes.data, self._ok

            def run() -> None:
                if launch("commref_stream", blocks, 1, a, address=address) != ok:
                    raise RuntimeError("commref_stream failed")

            return run
        arrays = [buf[k * words : (k + 1) * words] for k in range(kernel.arrays)]
        xp = self.xp
        if (kernel.nin, kernel.nout, kernel.shared) == (1, 1, 0):
            return lambda: xp.copyto(arrays[1], arrays[0])
        if (kernel.nin, kernel.nout, kernel.shared) == (2, 1, 0):
            return lambda: xp.add(arrays[0], arrays[1], out=arrays[2])
        raise ValueError(f"the GPU stream has copy and add only, not {kernel}")

    def measure(self, traffic: Traffic, size: int, iters: int, warmup: int = 1) -> dict[str, dict]:
        """Collective: every stream kernel for `traffic` at the footprint of a call of
        `size` bytes, `warmup` untimed passes then `iters` passes, each after a barrier.
        Returns {label: {"bytes": bytes one pass loads and stores on this rank,
        "times": seconds of each pass}}; {} when the call moves nothing."""
        if not traffic.moves:
            return {}
        out = {}
        footprint = traffic.footprint(size)
        for kernel in stream_kernels(traffic, streamed=self.cpu):
            if not self.cpu and kernel.name == "pattern":
                continue
            words = kernel.words(footprint)
            run = self.pass_fn(kernel, words)
            for _ in range(warmup):
                run()
            self.sync()
            times = []
            for _ in range(max(iters, 1)):
                self.world.barrier(what="bench: bound stream")
                t0 = time.perf_counter()
                run()
                self.sync()
                times.append(time.perf_counter() - t0)
            out[kernel.label] = {"bytes": kernel.bytes_moved(words), "times": times}
        return out


def aggregate_rates(per_rank: list[dict[str, dict]]) -> dict[str, float]:
    """Bytes per second that all ranks together loaded and stored, per kernel, in one
    round (every rank's StreamMeter.measure): the bytes of all ranks over the median
    (over passes) of the slowest rank's time."""
    rates = {}
    for label in per_rank[0] if per_rank else ():
        slowest = np.max(np.asarray([r[label]["times"] for r in per_rank], dtype=float), axis=0)
        t = float(np.median(slowest))
        rates[label] = sum(r[label]["bytes"] for r in per_rank) / t if t > 0 else float("inf")
    return rates


def bound(
    traffic: Traffic, size: int, nranks: int, bus_bytes: float, rounds: list[list[dict[str, dict]]]
) -> dict[str, Any] | None:
    """The bound of one placement of a call of `size` bytes on `nranks` ranks, from the
    stream rounds (each: every rank's StreamMeter.measure): time_us, busbw (GB/s:
    `bus_bytes` over that time), this rank's least loads and stores (load_bytes,
    store_bytes, footprint_bytes), the fastest kernel (kernel) and its rate (GBps: one
    rank's share, loads and stores per second), every kernel's rate (the faster of its
    rounds) and each round's fastest rate. None when the call moves nothing."""
    loads, stores = traffic.loads(size), traffic.stores(size)
    per_round = [aggregate_rates(r) for r in rounds if r and r[0]]
    if loads + stores <= 0 or not per_round:
        return None
    rates = {k: max(r[k] for r in per_round) for k in per_round[0]}
    kernel = max(rates, key=rates.get)
    t = nranks * (loads + stores) / rates[kernel]  # the job's least bytes at the aggregate rate
    return {
        "time_us": t * 1e6,
        "busbw": bus_bytes / t / 1e9 if t > 0 else float("inf"),
        "load_bytes": loads,
        "store_bytes": stores,
        "footprint_bytes": traffic.footprint(size),
        "kernel": kernel,
        "GBps": rates[kernel] / nranks / 1e9,
        "kernels_GBps": {k: r / nranks / 1e9 for k, r in rates.items()},
        "rounds_GBps": [max(r.values()) / nranks / 1e9 for r in per_round],
    }
