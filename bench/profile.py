"""`commref bench --profile`: where a collective's time goes on the CPU engine.

With --profile the ranks load the profile build of the CPU kernels (commref/profile.h,
cpu_loader.PROFILE_ENV), whose threads add up, per phase, the time and bytes of their
data-moving calls (copy, reduce), the time they pause in spin waits (a peer's flag, a
credit, a proxy's landing) and each block's whole run (kernel). After each size's timed
calls, every series makes -n more calls of its own (untimed by the table, one after the
other, not interleaved), bracketed by barriers, the counters read after each; each
rank's median call (by its wall time, so that its phases add up) gives the profile row,
averaged over the ranks:

- time: the wall time of that call;
- kernel: the time a launch's blocks ran (mean over the blocks of a launch; blocks of a
  launch run at once, so this is the launch's span, not their sum);
- copy, reduce, wait, help: the blocks' time in each phase (mean per block), with copy's
  and reduce's rates (the bytes they loaded and stored / their time, per block: one
  core's rate); help is the GIN engine's work done on a waiting kernel's core (taking
  descriptors, landing puts: profile.h); other = kernel - copy - reduce - wait - help
  (flag stores, fences, bookkeeping);
- host: time - kernel (the launch's path on the host: Python, the binding, waking the
  workers);
- moved/least: the bytes the copies and reductions loaded and stored per rank per call,
  over the least a call needs (catalogue.Traffic, the bound's bytes): the algorithm's
  extra traffic (a ring's FIFO slots, say).

The profile build times each outermost copy or reduction call and each pause (two clock
reads each): at small sizes that overhead is a visible part of the profiled time, which
is why the profile has its own calls and never replaces the table's. LL and LL128 pack
their lines outside move.h: their packing counts as other. GPU runs have no profile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

PHASES = ("copy", "reduce", "wait", "help", "kernel")


def available(world) -> str | None:
    """Why this run cannot profile (None: it can): the profile build must be loaded."""
    from commref.device_kernels import cpu_loader

    if not cpu_loader.profiling():
        return f"the ranks did not load the profile build ({cpu_loader.PROFILE_ENV}=1)"
    return None


def profile_calls(world, call: Callable[[], None], sync: Callable[[], None], iters: int) -> dict[str, Any]:
    """This rank's median call of `iters` (one after the other): its wall seconds and
    counters (the call whose time is the median, so that its phases add up). The
    counters are the process's, so each rank of a ThreadWorld would see the others'
    (bench ranks are processes)."""
    from commref.device_kernels import cpu_loader

    kernels = cpu_loader.cpu_kernels()
    world.barrier(what="bench: profiled calls")
    kernels.profile(reset=True)
    calls = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        sync()
        wall = time.perf_counter() - t0
        calls.append((wall, kernels.profile(reset=True)))
    world.barrier(what="bench: profiled calls done")
    wall, counters = sorted(calls, key=lambda c: c[0])[len(calls) // 2]
    return {"wall_s": wall, "counters": counters}


def summarize(per_rank: list[dict[str, Any]], least_bytes: float) -> dict[str, float] | None:
    """One row's profile (the module docstring) from every rank's profile_calls(), per
    call in microseconds (rates in GB/s); None where a rank had no counters."""
    if not per_rank or any(p is None or p["counters"] is None for p in per_rank):
        return None
    n = len(per_rank)
    out: dict[str, float] = {"time_us": sum(p["wall_s"] for p in per_rank) / n * 1e6}
    blocks = sum(p["counters"]["kernel"]["events"] for p in per_rank) / n
    per_block = max(blocks, 1.0)
    for phase in PHASES:
        ns = sum(p["counters"][phase]["ns"] for p in per_rank) / n
        out[f"{phase}_us"] = ns / per_block / 1e3
        moved = sum(p["counters"][phase]["bytes"] for p in per_rank) / n
        if phase in ("copy", "reduce"):
            out[f"{phase}_gbs"] = moved / ns if ns > 0 else 0.0
            out[f"{phase}_bytes"] = moved
    out["blocks"] = blocks
    out["other_us"] = out["kernel_us"] - sum(out[f"{phase}_us"] for phase in ("copy", "reduce", "wait", "help"))
    out["host_us"] = out["time_us"] - out["kernel_us"]
    moved = out["copy_bytes"] + out["reduce_bytes"]
    out["moved_over_least"] = moved / least_bytes if least_bytes > 0 else float("nan")
    return out


HEADER = (
    "#   size  series        time   kernel    host   copy(us)  GB/s  reduce(us)  GB/s   wait(us)   help(us)"
    "  other(us)  moved/least"
)


def lines(rows: list[dict]) -> list[str]:
    """The profile section of the output: a line per row that has a profile."""
    out = []
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        out.append(
            f"{r['size']:>8d}  {r['series'][:10]:<10}{p['time_us']:>8.1f} {p['kernel_us']:>8.1f}"
            f" {p['host_us']:>7.1f} {p['copy_us']:>10.1f} {p['copy_gbs']:>5.1f} {p['reduce_us']:>11.1f}"
            f" {p['reduce_gbs']:>5.1f} {p['wait_us']:>10.1f} {p['help_us']:>10.1f} {p['other_us']:>10.1f}"
            f" {p['moved_over_least']:>12.2f}"
        )
    if not out:
        return []
    return [
        "#",
        "# profile: each rank's median call, mean over ranks; kernel, copy, reduce, wait, other per block of a launch"
        " (us; copy and reduce GB/s per block); host = time - kernel",
        HEADER,
        *out,
    ]
