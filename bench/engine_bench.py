"""CPU engine efficiency: the copy kernel against numpy, and the cost of a launch.

    python -m commref.bench.engine_bench [--bytes 64M] [--reps 15] [--blocks N] [--threads 1]
                                         [--launches 2000] [--json out.json]

- copy: commref_copy (device_kernels/kernels/selftest.cu; block b copies its share of
  the bytes, the threads of a block split it) over --bytes, against np.copyto on the
  same buffers in the same run. The two are timed alternately, after a warmup, and
  each reports the median of --reps repetitions as GB/s (10^9 bytes copied per
  second).
- launch: commref_empty launched the way the collectives launch on the CPU -- a
  launch prepared once (CpuKernels.prepared: kernel, args record, grid, block) and run
  by its descriptor, one ctypes argument, the GIL released -- timed one launch at a
  time; median over --launches launches, in microseconds. Measured at grid 1 x block 1
  (a small collective on the CPU: one channel, one thread) and at --blocks x --threads
  (informational).

Targets (the exit status is 1 when one is missed): copy >= 50% of numpy's bandwidth,
and the grid-1 empty launch <= 50 us.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from commref.device_kernels import abi, cpu_loader

from . import programs
from .flags import int_type, parse_size

COPY_TARGET_RATIO = 0.5
LAUNCH_TARGET_US = 50.0


def default_blocks() -> int:
    """As many blocks as the CPU collectives use channels at most (collectives/tuner.py)."""
    return max(1, min(4, os.cpu_count() or 1))


def copy_args(src: int = 0, dst: int = 0, nbytes: int = 0) -> np.ndarray:
    a = np.zeros(1, dtype=abi.COPY_ARGS)
    a[0]["src"], a[0]["dst"], a[0]["bytes"] = src, dst, nbytes
    return a


def bench_copy(kernels: cpu_loader.CpuKernels, nbytes: int, reps: int, warmup: int, blocks: int, threads: int) -> dict:
    src = (np.arange(nbytes, dtype=np.uint64) * 0x9E3779B1 >> 13).astype(np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)  # zeros() then a write: pages are faulted in before timing
    dst.fill(1)
    args = copy_args(src.ctypes.data, dst.ctypes.data, nbytes)

    def ours() -> float:
        t0 = time.perf_counter()
        status = kernels.launch("commref_copy", blocks, threads, args)
        t = time.perf_counter() - t0
        if status != abi.LAUNCH_OK:
            raise RuntimeError(f"commref_copy failed with status {status}")
        return t

    def numpy_copy() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    for _ in range(warmup):
        ours()
        numpy_copy()
    dst.fill(0)
    ours()
    if not np.array_equal(dst, src):
        raise RuntimeError(f"commref_copy copied wrong bytes ({int(np.count_nonzero(dst != src))} differ)")

    t_ours, t_np = [], []
    for i in range(reps):  # alternate, so that both see the same machine conditions
        if i % 2:
            t_np.append(numpy_copy())
            t_ours.append(ours())
        else:
            t_ours.append(ours())
            t_np.append(numpy_copy())
    med_ours, med_np = statistics.median(t_ours), statistics.median(t_np)
    gbps_ours, gbps_np = nbytes / med_ours / 1e9, nbytes / med_np / 1e9
    return {
        "bytes": nbytes,
        "blocks": blocks,
        "threads": threads,
        "reps": reps,
        "warmup": warmup,
        "ours_gbps": gbps_ours,
        "numpy_gbps": gbps_np,
        "ratio": gbps_ours / gbps_np,
        "ours_seconds": t_ours,
        "numpy_seconds": t_np,
    }


def bench_launch(kernels: cpu_loader.CpuKernels, launches: int, grid: int, block: int) -> dict:
    args = copy_args()
    # As the Communicator calls it: prepared once (CallPlan.launch), run by its descriptor.
    prepared = kernels.prepared("commref_empty", grid, block, args.ctypes.data)
    launch = prepared.call
    for _ in range(min(200, launches)):  # warm the worker pool and the fiber stacks
        launch()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(launches):
        t0 = clock()
        status = launch()
        samples.append(clock() - t0)
        if status != abi.LAUNCH_OK:
            raise RuntimeError(f"commref_empty failed with status {status}")
    samples.sort()
    us = [s / 1000 for s in samples]
    return {
        "grid": grid,
        "block": block,
        "launches": launches,
        "median_us": statistics.median(us),
        "p10_us": us[len(us) // 10],
        "p90_us": us[(len(us) * 9) // 10],
        "min_us": us[0],
    }


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--bytes", type=parse_size, default=64 << 20, help="bytes to copy (default 64M)")
    p.add_argument("--reps", type=int_type(1), default=15, help="timed copies of each kind (default 15)")
    p.add_argument("--warmup", type=int_type(0), default=3, help="untimed copies of each kind first (default 3)")
    p.add_argument(
        "--blocks",
        type=int_type(1),
        default=default_blocks(),
        help=f"grid of the copy kernel (default min(4, cores) = {default_blocks()})",
    )
    p.add_argument("--threads", type=int_type(1), default=1, help="threads per block of the copy kernel (default 1)")
    p.add_argument("--launches", type=int_type(1), default=2000, help="timed empty launches (default 2000)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return p


def validate(args) -> None:
    if args.bytes < 1:
        raise ValueError(f"--bytes must be at least 1, got {args.bytes}")


def main(argv: list[str] | None = None) -> int:
    return programs.run_module(sys.modules[__name__], argv)


def run(a) -> int:
    """The copy and launch measurements in this process; 1 when a target is missed."""
    kernels = cpu_loader.cpu_kernels()
    copy = bench_copy(kernels, a.bytes, a.reps, a.warmup, a.blocks, a.threads)
    launch1 = bench_launch(kernels, a.launches, 1, 1)
    launchn = bench_launch(kernels, a.launches, a.blocks, a.threads)

    copy_ok = copy["ratio"] >= COPY_TARGET_RATIO
    launch_ok = launch1["median_us"] <= LAUNCH_TARGET_US
    mib = a.bytes / (1 << 20)
    print(
        f"# commref CPU engine: {os.cpu_count()} cores, {platform.machine()}, python {platform.python_version()}, "
        f"numpy {np.__version__}"
    )
    print(f"# copy: {mib:g} MiB, {a.blocks} block(s) x {a.threads} thread(s), median of {a.reps} (warmup {a.warmup})")
    print(f"{'measure':<34}{'value':>12}  {'target':<16}{'result':<6}")
    print("-" * 70)
    print(f"{'copy commref_copy (GB/s)':<34}{copy['ours_gbps']:>12.2f}")
    print(f"{'copy np.copyto (GB/s)':<34}{copy['numpy_gbps']:>12.2f}")
    print(
        f"{'copy ratio commref / numpy':<34}{copy['ratio']:>12.2f}  {f'>= {COPY_TARGET_RATIO:.2f}':<16}"
        f"{'ok' if copy_ok else 'MISS':<6}"
    )
    print(
        f"{'empty launch 1x1 median (us)':<34}{launch1['median_us']:>12.2f}  {f'<= {LAUNCH_TARGET_US:g}':<16}"
        f"{'ok' if launch_ok else 'MISS':<6}"
    )
    print(f"{'empty launch 1x1 p10 / p90 (us)':<34}{launch1['p10_us']:>5.2f} / {launch1['p90_us']:<6.2f}")
    label = f"empty launch {a.blocks}x{a.threads} median (us)"
    print(f"{label:<34}{launchn['median_us']:>12.2f}  {'(info)':<16}")
    label = f"empty launch {a.blocks}x{a.threads} p10 / p90 (us)"
    print(f"{label:<34}{launchn['p10_us']:>5.2f} / {launchn['p90_us']:<6.2f}")

    result = {
        "machine": {
            "cores": os.cpu_count(),
            "arch": platform.machine(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "library": str(kernels.path),
        },
        "copy": copy,
        "launch": {"grid1_block1": launch1, "configured": launchn},
        "targets": {"copy_ratio_min": COPY_TARGET_RATIO, "launch_us_max": LAUNCH_TARGET_US},
        "pass": {"copy": copy_ok, "launch": launch_ok},
    }
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"# wrote {a.json}", flush=True)
    if not (copy_ok and launch_ok):
        missed = [m for m, ok in (("copy bandwidth", copy_ok), ("launch cost", launch_ok)) if not ok]
        print(f"target missed: {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
