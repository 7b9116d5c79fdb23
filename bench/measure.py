"""Measuring a sweep: each size's calls of every series timed side by side on every
rank, checked, and brought together into the rows (the results of one size and series).

Timing. Per size and placement (out-of-place, then in-place), every series: `-w`
untimed calls of each, one world barrier, then `-n` rounds in which each series makes
one call, timed on every rank (GPU: each call is followed by a stream synchronize
inside the timed region). The series take turns call by call, so that drift on a
shared host (a neighbour's load, the vCPUs changing placement) hits them alike and
their medians compare side by side. The in-process baseline (out of place) is timed
right after the series of its size, in a phase of its own (`-w` untimed calls, a
barrier, `-n` timed ones) with commref's communicators quiesced (quiesced): no GIN
engine of commref's polls while the baseline's calls are timed. Standalone baselines,
each a job of its own, are peers.py's. Ranks are not
re-synchronized between calls: a collective synchronizes them itself, as in
nccl-tests. At the end of the size one allgather brings every rank's times together;
an iteration's time combines the ranks' times of that iteration as -a says (nccl-tests'
--average: 0 rank 0's, 1 their average, the default, 2 the fastest rank's, 3 the
slowest's), and the time column is the median over the iterations (combine_ranks).

Per-iteration statistics (-I 1, iteration_stats): each iteration's slowest rank's time
(nccl-tests: "i_* uses max over process rows"), its min, max, average, p50, p95, p99,
standard deviation and coefficient of variation, with every iteration's time of every
rank kept beside them.

Aggregation (-m N, nccl-tests' agg_iters): an iteration is N calls in one group (the
runner's group(); the MPI baseline, which has none, makes them one after the other),
and its time divided by N is the time of a call.

Checking (-c 1). The output of the last timed call is compared element by element
with commref.collectives.verify's reference; #wrong is the count summed over ranks. In place,
the input is restored before that last call (and the ranks meet at a barrier, so no
rank's timing includes another's restore). With -m N > 1, as in nccl-tests, the check
is of one more call, untimed, after the timed iterations (an in-place reduction
repeated N times would not give the reference).

Bandwidths are nccl-tests': algbw = bytes / time, busbw = algbw * bus factor (the
plugins define both, see plugins.py). The bound column and %bound (100 = as fast as
this machine's memory allows) are bench/bound.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from commref.collectives import verify

from . import plugins, profile
from .arguments import NCCL_TYPE_NAMES, sweep_sizes
from .bound import StreamMeter
from .bound import bound as placement_bound
from .series import Series, series_link


@dataclass
class Ctx:
    """What one rank needs while it sweeps."""

    world: Any
    args: Any
    plugin: plugins.Collective
    dtype: np.dtype
    device: str
    xp: Any
    corrupt: Callable | None = None  # test hook: corrupt(label, in_place, rank, out) after the last call
    link: str = "?"  # what carries the bytes (describe_link), for the path column
    memory: dict = dataclasses.field(default_factory=dict)  # series label -> plugins.Memory of its buffers

    def memory_of(self, label: str) -> plugins.Memory:
        mem = self.memory.get(label) or self.memory.setdefault(None, plugins.Memory(self.xp))
        if isinstance(mem, plugins.SymmetricMemory):
            mem.reset()
        return mem

    def to_host(self, a) -> np.ndarray:
        return a if self.xp is np else self.xp.asnumpy(a)


@dataclass
class Timed:
    """One variant of a size that time_interleaved times: `call` then `sync` per
    iteration; `before_last` (untimed, then a barrier) runs before the last call."""

    call: Callable[[], None]
    sync: Callable[[], None]
    before_last: Callable[[], None] | None = None


def time_interleaved(world, variants: list[Timed], iters: int, warmup: int) -> list[list[float]]:
    """Seconds of each of `iters` calls of every variant on this rank, the variants taking
    turns call by call (iteration i of each, then i + 1 of each), so that drift on a
    shared host (a neighbour's load, the vCPUs changing placement) hits all of them alike
    and their medians compare side by side. First `warmup` untimed calls of each, then a
    barrier."""
    for v in variants:
        for _ in range(warmup):
            v.call()
            v.sync()
    world.barrier(what="bench: timed calls")
    times: list[list[float]] = [[] for _ in variants]
    for i in range(iters):
        last = i == iters - 1
        if last and any(v.before_last is not None for v in variants):
            for v in variants:
                if v.before_last is not None:
                    v.before_last()
                    v.sync()
            world.barrier(what="bench: checked calls")
        for v, out in zip(variants, times):
            t0 = time.perf_counter()
            v.call()
            v.sync()
            out.append(time.perf_counter() - t0)
    return times


def time_calls(
    world,
    call: Callable[[], None],
    sync: Callable[[], None],
    iters: int,
    warmup: int,
    before_last: Callable[[], None] | None = None,
) -> list[float]:
    """Seconds of each of `iters` calls on this rank (time_interleaved of one variant)."""
    return time_interleaved(world, [Timed(call, sync, before_last)], iters, warmup)[0]


@contextlib.contextmanager
def quiesced(world, comms):
    """Around an in-process baseline's timed calls: nothing of `comms` (commref's
    communicators of this rank) runs meanwhile. Between calls the CPU engine's kernel
    workers already block on a futex; what polls is each communicator's GIN engine (the
    native one spins, yields, then sleeps up to 1 ms at a time; the Python proxy sleeps
    50 us at a time). So every GIN engine is quiesced (everything posted has landed), the
    ranks meet, and each engine is parked (blocked, NativeProxy.park, GinProxy.park)
    until the block ends."""
    proxies = list({id(p): p for p in (getattr(c, "proxy", None) for c in comms) if p is not None}.values())
    for p in proxies:
        p.quiesce(world.timeout)
    world.barrier(what="bench: commref quiesced")
    parked = [p for p in proxies if hasattr(p, "park")]
    for p in parked:
        p.park()
    try:
        yield
    finally:
        for p in parked:
            p.unpark()


def aggregated(runner, call: Callable[[], None], n: int) -> Callable[[], None]:
    """`call` made `n` times as one iteration (-m): in one group of `runner` where it has
    group(), else one after the other; `call` itself for n = 1."""
    if n == 1:
        return call
    group = getattr(runner, "group", None)

    def one_after_another() -> None:
        for _ in range(n):
            call()

    if group is None:
        return one_after_another

    def grouped() -> None:
        with group():
            for _ in range(n):
                call()

    return grouped


def measure(ctx: Ctx, runners: list[tuple[str, Any, tuple]], in_place: bool, baseline: tuple | None = None) -> dict:
    """One rank's times and wrong elements for one placement of one size, every runner
    (label, runner, (input, expected, counts) of its ranks: the job's or a team's) timed
    interleaved with the others, then `baseline` ((runner, input, counts), out of place;
    its times under "baseline") in a phase of its own, the runners quiesced. Other keys:
    the runners' labels."""
    args, plugin, w = ctx.args, ctx.plugin, ctx.world
    op = args.op if plugin.reducing else None
    check, agg = bool(args.check), getattr(args, "agg_iters", 1)
    variants, checks, singles = [], [], []
    for label, runner, (x, expected, counts) in runners:
        rank, n = _team(runner, w)
        b = plugin.buffers(ctx.memory_of(label), x, counts, rank, n, args.root, in_place)
        single = plugin.bound(runner, b, op, args.root)
        restore = b.restore if (check and b.restore) else None
        variants.append(Timed(aggregated(runner, single, agg), runner.synchronize, restore if agg == 1 else None))
        checks.append((label, b, expected))
        singles.append(Timed(single, runner.synchronize, restore))
    times = time_interleaved(w, variants, args.iters, args.warmup_iters)
    if baseline is not None:  # its own phase, commref quiesced (the module docstring)
        base, x, counts = baseline
        bb = plugin.buffers(ctx.memory_of(None), x, counts, w.rank, w.size, args.root, False)
        call = aggregated(base, plugin.bound(base, bb, op, args.root), agg)
        with quiesced(w, [runner for _, runner, _ in runners] if ctx.device == "cpu" else []):
            times.append(time_calls(w, call, base.synchronize, args.iters, args.warmup_iters))
    if agg > 1:
        times = [[t / agg for t in ts] for ts in times]
        if check:  # one more call of each, untimed (the module docstring)
            for v in singles:
                if v.before_last is not None:
                    v.before_last()
                    v.sync()
            w.barrier(what="bench: checked calls")
            for v in singles:
                v.call()
                v.sync()
    out = {}
    for (label, b, expected), t in zip(checks, times):
        wrong = None
        if check:
            if ctx.corrupt is not None:
                ctx.corrupt(label, in_place, w.rank, b.out)
            wrong = 0 if expected is None else verify.count_wrong(ctx.to_host(b.out), expected)
        out[label] = {"times": t, "wrong": wrong}
    if baseline is not None:
        out["baseline"] = times[-1]
    if getattr(args, "profile", False):  # after the checks: the profiled calls change the outputs
        for (label, _, _), v in zip(checks, singles):
            out[label]["profile"] = profile.profile_calls(w, v.call, v.sync, args.iters)
    return out


def combine_ranks(times_per_rank: list[list[float]], average: int = 1) -> np.ndarray:
    """Each iteration's time from every rank's times of it (rows: ranks, in rank order),
    as -a `average` says: 0 rank 0's, 1 the ranks' average, 2 the minimum, 3 the maximum."""
    t = np.asarray(times_per_rank, dtype=float)
    combine = {0: lambda a: a[0], 1: lambda a: a.mean(axis=0), 2: lambda a: a.min(axis=0), 3: lambda a: a.max(axis=0)}
    if average not in combine:
        raise ValueError(f"-a takes 0, 1, 2 or 3, got {average!r}")
    return combine[average](t)


def _nearest_rank(ordered: np.ndarray, percent: int) -> float:
    """The `percent` percentile of sorted `ordered` by the nearest-rank rule (the smallest
    value with at least `percent`% of the values at or below it)."""
    n = len(ordered)
    return float(ordered[min(n - 1, max(0, -(-n * percent // 100) - 1))])


def iteration_stats(times_per_rank: list[list[float]]) -> dict:
    """nccl-tests' per-iteration report of one placement, in microseconds: the statistics
    of each iteration's slowest rank's time (times_us), population standard deviation,
    cv_pct = 100 * stdev / avg (0 where avg is 0), p50 the upper median, p95 and p99 by
    the nearest rank; per_process_max_times_us: every rank's own times (rows: ranks), so
    times_us[i] is the maximum over the rows of column i."""
    per_rank = np.asarray(times_per_rank, dtype=float) * 1e6
    slowest = per_rank.max(axis=0)
    ordered = np.sort(slowest)
    avg = float(slowest.mean())
    stdev = float(np.sqrt(np.mean((slowest - avg) ** 2)))
    return {
        "min_us": float(ordered[0]),
        "max_us": float(ordered[-1]),
        "avg_us": avg,
        "p50_us": float(ordered[len(ordered) // 2]),
        "p95_us": _nearest_rank(ordered, 95),
        "p99_us": _nearest_rank(ordered, 99),
        "stdev_us": stdev,
        "cv_pct": 100 * stdev / avg if avg > 0 else 0.0,
        "times_us": slowest.tolist(),
        "per_process_max_times_us": per_rank.tolist(),
    }


def _result(
    times_per_rank: list[list[float]],
    nbytes: int,
    factor: float,
    wrong_per_rank=None,
    average: int = 1,
    per_iter: bool = False,
) -> dict:
    """One placement's time (the median over iterations of combine_ranks), bandwidths,
    wrong elements (summed over ranks, None where a rank did not check) and, with
    `per_iter`, its iteration_stats under "per_iter"."""
    t = float(np.median(combine_ranks(times_per_rank, average)))
    algbw = nbytes / t / 1e9 if t > 0 else 0.0
    out: dict[str, Any] = {"time_us": t * 1e6, "algbw": algbw, "busbw": algbw * factor}
    if wrong_per_rank is not None:
        out["wrong"] = None if any(v is None for v in wrong_per_rank) else int(sum(wrong_per_rank))
    if per_iter:
        out["per_iter"] = iteration_stats(times_per_rank)
    return out


def size_bound(plugin, size: int, nranks: int, bus_bytes: float, every: list[dict]) -> dict:
    """The bound column of one size from every rank's stream rounds ("stream|0",
    "stream|1": a list of rounds on each rank): busbw and time_us out of place,
    in_place_busbw and in_place_time_us (None where the collective has no in-place
    form, or the call moves nothing), and each placement's details (bench/bound.py:
    bound())."""
    out: dict[str, Any] = {}
    for in_place in (False, True):
        key = f"stream|{int(in_place)}"
        b = None
        if in_place in plugin.placements and all(key in r for r in every):
            rounds = [[r[key][k] for r in every] for k in range(len(every[0][key]))]
            b = placement_bound(plugin.traffic(nranks, in_place), size, nranks, bus_bytes, rounds)
        out["in_place" if in_place else "out_of_place"] = b
    oop, ip = out["out_of_place"], out["in_place"]
    return {
        "busbw": oop and oop["busbw"],
        "time_us": oop and oop["time_us"],
        "in_place_busbw": ip and ip["busbw"],
        "in_place_time_us": ip and ip["time_us"],
        **out,
    }


def _pct(result: dict | None, bound_us: float | None) -> float | None:
    """100 * the bound's time / ours (= our busbw / the bound's busbw, also where the bus
    factor is 0); None without both."""
    if not result or bound_us is None or result["time_us"] <= 0:
        return None
    return 100 * bound_us / result["time_us"]


def _kernels_of(comm, coll: str, count: int) -> str | None:
    """What a series ran at one size (plots mark where it changes): the kernel and
    protocol of each of comm's calls of `coll` on `count` elements so far, " + "-joined
    (ring_allreduce/ll, direct_allreduce/simple, hierarchical); None from a runner that
    does not say (no Communicator.planned)."""
    planned = getattr(comm, "planned", None)
    if planned is None:
        return None
    plans = planned(coll, count, False) + planned(coll, count, True)
    names = dict.fromkeys(
        "hierarchical" if p.hierarchical else f"{p.kernel.removeprefix('commref_')}/{p.protocol}" for p in plans
    )
    return " + ".join(names) or None


def _predicted_us(comm, coll: str, count: int) -> float | None:
    """The performance model's time (us) of comm's first out-of-place call of `coll` on
    `count` elements (CallPlan.predicted_s); None where the runner has no model."""
    planned = getattr(comm, "planned", None)
    plans = (planned(coll, count, False) + planned(coll, count, True)) if planned else []
    times = [p.predicted_s for p in plans if p.predicted_s is not None]
    return times[0] * 1e6 if times else None


def _team(runner, world) -> tuple[int, int]:
    """(rank, ranks) of the ranks a runner calls among: a communicator's own (a team's
    child communicator has fewer), else the world's (baselines)."""
    return getattr(runner, "rank", world.rank), getattr(runner, "nranks", world.size)


def sweep(
    ctx: Ctx,
    runners: list[tuple[Series, Any]],
    baseline,
    meter: StreamMeter | None,
    emit: Callable[[list[dict]], None] | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    cycle: int = 1,
) -> list[dict]:
    """Runs the sweep on this rank; returns the rows (every rank gets them), each naming
    its `cycle` (-N: the sweep's turn, from 1). `emit` gets each size's rows as they
    complete (rank 0 prints them)."""
    args, plugin, w = ctx.args, ctx.plugin, ctx.world
    n, itemsize = w.size, ctx.dtype.itemsize
    op = args.op if plugin.reducing else None
    sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    factor = plugin.bus_factor(n)
    average, per_iter = getattr(args, "average", 1), bool(getattr(args, "iteration_stats", 0))
    rows: list[dict] = []
    for k, size in enumerate(sizes):
        counts = plugin.counts(size, itemsize, n)
        nbytes = plugin.algbw_bytes(counts, itemsize, n)
        size_col = counts.size_bytes(itemsize)
        x = plugin.input(counts, ctx.dtype, op, args.seed, w.rank, n)
        expected = plugin.expected(counts, ctx.dtype, op, args.seed, w.rank, n, args.root) if args.check else None
        mine: dict[str, Any] = {}
        stream = {}  # placement -> the bound's stream rounds on this rank, before and after the collectives
        if meter is not None:
            stream = {ip: [meter.measure(plugin.traffic(n, ip), size_col, args.iters)] for ip in plugin.placements}
        data = {(w.rank, n): (counts, x, expected)}  # a team's own counts, input and expected output
        timed = []
        for s, comm in runners:
            team = _team(comm, w)
            if team not in data:
                tc = plugin.counts(size, itemsize, team[1])
                data[team] = (
                    tc,
                    plugin.input(tc, ctx.dtype, op, args.seed, *team),
                    plugin.expected(tc, ctx.dtype, op, args.seed, *team, args.root) if args.check else None,
                )
            tc, tx, texp = data[team]
            timed.append((s.label, comm, (tx, texp, tc)))
        for in_place in plugin.placements:  # every series (and the baseline, out of place) side by side
            got = measure(
                ctx, timed, in_place, (baseline, x, counts) if baseline is not None and not in_place else None
            )
            if "baseline" in got:
                mine["baseline"] = got.pop("baseline")
            for label, result in got.items():
                mine[f"{label}|{int(in_place)}"] = result
        for in_place, rounds in stream.items():  # every rank streams at once, at each placement's footprint
            rounds.append(meter.measure(plugin.traffic(n, in_place), size_col, args.iters))
            mine[f"stream|{int(in_place)}"] = rounds
        every = w.allgather(mine, what="bench: results of one size")

        base = None
        if baseline is not None:
            base = _result([r["baseline"] for r in every], nbytes, factor, average=average)
        bound = None
        if meter is not None:
            bound = size_bound(plugin, size_col, n, nbytes * factor, every)
        size_rows = []
        for s, comm in runners:
            res = {"in_place": None}  # stays None where the collective has no in-place form
            tn = _team(comm, w)[1]
            tc = data[(comm.rank, tn)][0] if s.team != "job" else counts
            t_factor, t_bytes = plugin.bus_factor(tn), plugin.algbw_bytes(tc, itemsize, tn)
            for in_place in plugin.placements:
                key = f"{s.label}|{int(in_place)}"
                res["in_place" if in_place else "out_of_place"] = _result(
                    [r[key]["times"] for r in every],
                    t_bytes,
                    t_factor,
                    [r[key]["wrong"] for r in every],
                    average,
                    per_iter,
                )
            oop = res["out_of_place"]
            profiled = [r[f"{s.label}|0"].get("profile") for r in every]
            if any(profiled):
                traffic = plugin.traffic(tn, False)
                least = traffic.loads(tc.size_bytes(itemsize)) + traffic.stores(tc.size_bytes(itemsize))
                res["profile"] = profile.summarize(profiled, least)
            if s.team != "job":  # the job's baseline and bound do not compare with a team's
                base_s, bound_s = None, None
            else:
                base_s, bound_s = base, bound
            size_rows.append(
                {
                    "series": s.label,
                    "cycle": cycle,
                    "path": f"{s.label}:{series_link(comm, ctx.link)}",
                    "size": tc.size_bytes(itemsize),
                    "count": tc.param,
                    "kernel": _kernels_of(comm, plugin.coll, tc.param),
                    "type": NCCL_TYPE_NAMES[args.datatype],
                    "redop": args.op if plugin.reducing else "none",
                    "root": args.root if plugin.rooted else -1,
                    "out_of_place": oop,
                    "in_place": res["in_place"],
                    "baseline": base_s,
                    "ratio": (oop["busbw"] / base_s["busbw"]) if base_s and base_s["busbw"] > 0 else None,
                    "bound": bound_s,
                    "pct_of_bound": _pct(oop, bound_s and bound_s["time_us"]),
                    "in_place_pct_of_bound": _pct(res["in_place"], bound_s and bound_s["in_place_time_us"]),
                    **({"profile": res["profile"]} if "profile" in res else {}),
                }
            )
            if getattr(args, "model", False):  # --model: the prediction beside the measured time
                pred = _predicted_us(comm, plugin.coll, tc.param)
                size_rows[-1]["predicted_us"] = pred
                size_rows[-1]["predicted_ratio"] = pred / oop["time_us"] if pred and oop["time_us"] > 0 else None
        rows.extend(size_rows)
        if emit is not None:
            emit(size_rows)
        if progress is not None:
            progress(k + 1, len(sizes), size_col)
    return rows
