"""`commref bench COLLECTIVE`: the sweep on this process's ranks, from its flags to the
table and the results document.

    commref bench all_reduce -b 8 -e 64M -f 2 --np 4

Like the bench programs (programs.py), it offers add_arguments, validate and run; its
parts: the flags (arguments.py, value types in flags.py), the series measured side by
side (series.py), the timed and checked calls (measure.py), the table and the JSON
document (output.py). This module sets up each rank (device, communicators, baseline,
the bound's meter), runs the sweep with rank 0's live output (Report, a progress bar
where a terminal shows it) and tears down.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable

import numpy as np

from commref.collectives.options import resolve_device
from commref.collectives.verify import DTYPES
from commref.device_kernels import cpu_loader
from commref.transports.errors import CommTimeout
from commref.transports.gin import faults
from commref.transports.gin.faults import FaultSpec

from . import plugins, profile
from .arguments import add_arguments, build_parser, check_kept, run_cycles, sweep_sizes, validate
from .baselines import BaselineUnavailable, make_baseline, split_baselines
from .bound import StreamMeter
from .environment import environment
from .measure import Ctx, sweep
from .output import document, footer, format_row, header, table_head, write_json, write_outputs
from .peers import ROUND_ENV
from .series import NotAvailable, communicator_kwargs, series_of, team_series

# The command's surface, as a bench program offers it (add_arguments, validate, run), and
# what commref.cli's launcher and parsers take from it.
__all__ = ["PROGRESS_ENV", "add_arguments", "exit_code", "main", "progress_mode", "run", "run_rank", "validate"]

PROGRESS_ENV = "COMMREF_BENCH_PROGRESS"  # set by the launching process: "bar" or "bar+rows"


class Report:
    """Rank 0's output: the table through `out`, and a rich progress bar on stderr
    when progress_mode() asks for one. Other ranks' Reports print nothing."""

    def __init__(self, active: bool, out: Callable[[str], None], total: int, title: str):
        self.active, self.out, self.total, self.title = active, out, total, title
        self.bar = self.console = None
        mode = progress_mode() if active else None
        if mode:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:  # rich is in the bench extra; the table works without it
                return
            console = Console(stderr=True, force_terminal=True)
            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self.task = self.bar.add_task(title, total=total)
            self.bar.start()
            if mode == "bar+rows":  # both streams reach one terminal: keep rows above the bar
                self.console = console

    def lines(self, lines) -> None:
        if not self.active:
            return
        for line in lines:
            if self.console is not None:
                self.console.print(line, markup=False, highlight=False, soft_wrap=True)
            else:
                self.out(line)

    def rows(self, rows: list[dict]) -> None:
        self.lines(format_row(r) for r in rows)

    def progress(self, done: int, total: int, size: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, description=f"{self.title}: {_human(size)} done")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return str(n)


def progress_mode() -> str | None:
    """'bar' when stderr is a terminal, 'bar+rows' when stdout is one too (rows then go
    through the bar's console so they print above it); None otherwise. Under mpiexec
    the launching process decides (PROGRESS_ENV), since the ranks' streams are pipes."""
    if PROGRESS_ENV in os.environ:
        return os.environ[PROGRESS_ENV] or None
    try:
        if not sys.stderr.isatty():
            return None
        return "bar+rows" if sys.stdout.isatty() else "bar"
    except (AttributeError, ValueError):
        return None


def setup_device(world, device: str):
    """(device, device_id, xp, sync) for this rank: numpy on the CPU; on CUDA, CuPy on
    GPU local_rank % count with a stream of this rank's own. Ranks sharing a GPU get
    NCCL_MULTI_RANK_GPU_ENABLE=1 before NCCL starts."""
    device = resolve_device(device)
    if device != "cuda":
        return device, None, np, (lambda: None)
    import cupy

    from commref.collectives.gpu_stream import use_rank_gpu

    device_id = use_rank_gpu(world)
    if world.local_size > cupy.cuda.runtime.getDeviceCount():
        os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    cupy.cuda.Stream(non_blocking=True).use()
    return device, device_id, cupy, (lambda: cupy.cuda.get_current_stream().synchronize())


def setup_baseline(world, device: str, device_id: int | None, plugin, dtype, op: str | None, kind: str = "auto"):
    """(baseline or None, why not): the baseline `kind` (baselines.BASELINES). Every rank
    agrees, or the baseline would hang."""
    baseline, why = None, None
    try:
        baseline = make_baseline(world, device, device_id, kind)
        baseline.check(plugin.coll, dtype, op)
    except BaselineUnavailable as e:
        baseline, why = None, str(e)
    if not all(world.allgather(baseline is not None, what="bench: baseline available")) and baseline is not None:
        baseline.close()
        baseline, why = None, "not available on every rank"
    return baseline, why


def setup_communicators(world, args, device: str, device_id: int | None, plugin, op: str | None):
    """A Communicator per series: ([(series, comm)], [(series, reason)]). A series whose
    setup this machine cannot meet (CapabilityError: a backend without the asked-for
    wire, say) is skipped with its reason on every rank, so the others still run."""
    from commref.collectives.communicator import Communicator
    from commref.transports.errors import CapabilityError

    runners, skipped = [], []
    for s in series_of(args):
        kw = {k: v for k, v in communicator_kwargs(args, s).items() if v is not None}
        if device_id is not None:
            kw["device_id"] = device_id
        comm, err = None, None
        try:
            comm = Communicator(world, device, **kw)
        except CapabilityError as e:
            err = str(e)
        errors = [e for e in world.allgather(err, what="bench: series setup") if e]
        if errors:
            if comm is not None:
                comm.close()
            skipped.append((s, errors[0]))
            continue
        if hasattr(comm, "prepare"):  # GPU: load the kernel module before any collective runs
            comm.prepare([comm.kernel_spec(plugin.coll, args.datatype, op)])
        runners.append((s, comm))
        if not any(t.team != "job" for t, _ in runners):  # with several nodes: the teams, once
            runners.extend(team_series(s, comm))
    if not runners:
        raise NotAvailable("no configuration can run here: " + "; ".join(f"{s.label}: {why}" for s, why in skipped))
    return runners, skipped


def symmetric_memory(args, plugin, dtype, nranks: int, xp, runners) -> dict:
    """A SymmetricMemory for each -R 2 series, sized for the largest size's send and
    recv buffers (collective: every rank allocates in the same order)."""
    out = {}
    largest = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)[-1]
    c = plugin.counts(largest, dtype.itemsize, nranks)
    capacity = plugins.SymmetricMemory.capacity(c.send, c.recv, dtype.itemsize)
    for s, comm in runners:
        if s.register == 2:
            out[s.label] = plugins.SymmetricMemory(comm, xp, capacity)
    return out


def fault_counts(world, runners) -> dict[str, list[dict]]:
    """Collective: per series with a lossy wire (--fault), every rank's GIN proxy stats."""
    out = {}
    for s, comm in runners:
        if s.fault and FaultSpec.parse(s.fault).active and s.team == "job":
            comm.proxy.quiesce(comm.timeout)  # final counts: everything posted has landed
            out[s.label] = world.allgather(
                dict(getattr(comm.proxy, "stats", None) or {}), what="bench: GIN fault statistics"
            )
    return out


def inprocess_baseline(text: str) -> tuple[str, list[str]]:
    """The in-process baseline of --baseline `text` for this run, and the lines that
    say what becomes of its standalone peers. Standalone peers are run by commref's
    launcher (peers.py), which passes its rounds none of them: those left here are in a
    run under an mpiexec started by hand, which cannot start jobs of its own. There
    gloo, without an in-process baseline beside it, is timed in commref's processes."""
    kind, peers = split_baselines(text)
    lines = []
    if kind == "none" and "gloo" in peers:
        kind, peers = "gloo", tuple(p for p in peers if p != "gloo")
        lines.append(
            "# Baseline note: gloo is timed in commref's processes (under an mpiexec started by hand the bench "
            "starts no job of its own; `commref bench ... --np N` times it as its own job)"
        )
    for p in peers:
        lines.append(
            f"# Baseline {p}: not measured (a job of its own needs commref's launcher: run `commref bench ... "
            "--np N` outside mpiexec)"
        )
    return kind, lines


def run_rank(world, args, corrupt: Callable | None = None, out: Callable[[str], None] = print) -> dict:
    """The whole benchmark on one rank of `world`; returns the results document (the
    JSON file's content) on every rank. Rank 0 prints the table through `out`.
    `corrupt(label, in_place, rank, out)` is a test hook run after each last call."""
    check_kept(args, world.size)  # the ranks known now: every rank refuses alike, before any call
    if getattr(args, "profile", False):  # before the first communicator loads the CPU kernels
        os.environ[cpu_loader.PROFILE_ENV] = "1"
    plugin = plugins.get(args.collective)
    dtype = DTYPES[args.datatype]
    op = args.op if plugin.reducing else None
    device, device_id, xp, sync = setup_device(world, args.device)
    if getattr(args, "profile", False) and device != "cpu":
        raise ValueError("--profile profiles the CPU engine's kernels; this run is on a GPU (give --device cpu)")
    ctx = Ctx(world, args, plugin, dtype, device, xp, corrupt)
    runners, skipped = setup_communicators(world, args, device, device_id, plugin, op)
    ctx.memory = symmetric_memory(args, plugin, dtype, world.size, xp, runners)
    kind, peer_lines = inprocess_baseline(args.baseline)
    baseline, baseline_error = (
        setup_baseline(world, device, device_id, plugin, dtype, op, kind)
        if kind != "none"
        else (None, "standalone peers only, after this job" if os.environ.get(ROUND_ENV) else "--baseline none")
    )
    meter = StreamMeter(world, xp, sync) if args.bound else None
    env = environment(world, device, device_id, baseline, baseline_error)
    ctx.link = env["link"]
    sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    cycles = run_cycles(args)

    report = Report(world.rank == 0, out, len(sizes) * cycles or None, plugin.name)
    t0 = time.perf_counter()
    try:
        report.lines(header(ctx, env, runners, baseline, env["link"], skipped))
        report.lines(peer_lines)
        rows: list[dict] = []
        for cycle in itertools.count(1) if cycles == 0 else range(1, cycles + 1):
            if cycles != 1:
                report.lines([f"# Cycle {cycle}" + (f" of {cycles}" if cycles else " (until interrupted)")])
            report.lines(
                table_head(
                    baseline.label if baseline else None,
                    bool(getattr(args, "iteration_stats", 0)),
                    bool(getattr(args, "model", False)),
                )
            )
            done = (cycle - 1) * len(sizes)
            got = sweep(
                ctx,
                runners,
                baseline,
                meter,
                report.rows,
                lambda k, total, size, done=done: report.progress(done + k, total, size),
                cycle,
            )
            if cycles == 0:  # until interrupted: only the current cycle's rows are kept
                rows.clear()
            rows.extend(got)
        gin_faults = fault_counts(world, runners)
        report.lines(f"# GIN faults ({label}): {faults.summary(stats)}" for label, stats in gin_faults.items())
        report.lines(footer(rows))
        report.lines(profile.lines(rows))
    finally:
        report.close()
    elapsed = time.perf_counter() - t0
    doc = document(plugin, args, env, runners, skipped, baseline, world.size, rows, gin_faults, elapsed)
    for _, comm in runners:
        comm.close()
    if baseline is not None:
        baseline.close()
    world.barrier(what="bench: done")
    return doc


def exit_code(doc: dict) -> int:
    bad = [s["out_of_bounds"] for s in doc["summary"].values() if s["out_of_bounds"]]
    return 1 if bad else 0


def run(args, corrupt: Callable | None = None) -> int:
    """The benchmark on the ranks of this process, for validated `args`: the MPI world
    this process was started in (mpiexec), else -t ranks as threads (one by default).
    Returns the exit status: 1 when an element was wrong, TIMED_OUT when a wait passed
    its deadline (-T, else $COMMREF_TIMEOUT; one line on stderr says which wait),
    INTERRUPTED on Ctrl-C in this process. Starts no job: with --np, commref.cli
    relaunches under mpiexec and the ranks call this. `corrupt`: run_rank's test hook."""
    from commref.transports.mpi_world import MPIWorld
    from commref.transports.thread_world import ThreadWorld

    def out(line: str) -> None:
        print(line, flush=True)

    timeout = getattr(args, "timeout", 0) or None  # 0: the default deadline
    try:
        if MPIWorld.launched_under_mpi():
            world = MPIWorld(timeout=timeout)
            doc = run_rank(world, args, corrupt, out=out)
            if world.rank == 0 and os.environ.get(ROUND_ENV):  # a round of peers.run_rounds: its document only
                write_json(doc, os.environ[ROUND_ENV])
            elif world.rank == 0:
                write_outputs(doc, args)
            return exit_code(doc)
        if args.nthreads > 1:
            doc = ThreadWorld.run(args.nthreads, run_rank, args, corrupt, out=out, timeout=timeout)[0]
        else:
            doc = run_rank(ThreadWorld.single(timeout=timeout), args, corrupt, out=out)
    except CommTimeout as e:
        print(f"commref bench: error: {timed_out(args, e)}", file=sys.stderr, flush=True)
        return TIMED_OUT
    except KeyboardInterrupt:  # -N 0's way to end, in this process (under --np the launcher's)
        print("commref bench: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
    write_outputs(doc, args)
    return exit_code(doc)


TIMED_OUT = 124  # like timeout(1) and the launcher's job past its timeout
INTERRUPTED = 130  # 128 + SIGINT


def timed_out(args, e: CommTimeout) -> str:
    """The one line of a run whose wait passed its deadline: the deadline, where it came
    from, and the wait (CommTimeout's own message)."""
    from commref.transports.deadlines import TIMEOUT_ENV, default_timeout

    if getattr(args, "timeout", 0):
        source = f"-T {args.timeout:g}"
    else:
        source = f"${TIMEOUT_ENV} {default_timeout():g} s (-T sets it)"
    return f"a wait passed its deadline, {source}: {' '.join(str(e).split())}"


def main(argv: list[str] | None = None) -> int:
    """`commref bench ...` in this process (argv without the leading 'bench'): parse,
    validate, run. --np N > 1 needs the `commref bench` command (commref.cli), which
    relaunches under mpiexec."""
    from commref.transports.mpi_world import MPIWorld

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        validate(args)
        if args.np and args.np > 1 and not MPIWorld.launched_under_mpi():
            raise ValueError(f"--np {args.np} starts MPI ranks: run `commref bench ... --np {args.np}`")
    except ValueError as e:  # NotAvailable and OptionError included
        print(f"commref bench: error: {e}", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
