"""`commref study`: the ordering study's command (add_arguments(parser), run(args))
and its output: a title and legend, the matrix, counterexample traces, JSON, the
stress table, and (chart.py) the counterexamples drawn as message sequence charts."""

from __future__ import annotations

import argparse
import json
import sys
import time

from commref.transports.gin import semantics as sem
from commref.transports.gin.faults import FaultSpec
from commref.transports.gin.study.explorer import Cell, cell_program, replay, run_matrix
from commref.transports.gin.study.signaling import (
    DEFAULT_BOUND,
    MODEL_BY_NAME,
    MODELS,
    PROTOCOL_BY_NAME,
    LLFlag,
    stale_ranges,
)
from commref.transports.gin.study.stress import NOT_STRESSED, StressCell, run_stress
from commref.transports.mpi_world import MPIWorld
from commref.transports.option_types import OptionError


def trace_lines(cell: Cell) -> list[str]:
    """The counterexample of an unsafe cell: the ops, the delivery order, what was read."""
    proto, _, prog = cell_program(cell)
    unit = "lines" if isinstance(proto, LLFlag) else "segments"
    unit = unit if cell.shape.units > 1 else unit[:-1]
    head = (
        f"{cell.protocol} [{cell.strength or '-'}] on {cell.model}: UNSAFE, message of "
        f"{cell.shape.puts} put{'s' if cell.shape.puts > 1 else ''} x {cell.shape.units} {unit} "
        f"({prog.segment_bytes}-byte segments)"
    )
    out = [head]
    out += ["  posted: " + "; ".join(prog.describe_op(i) for i in range(len(prog.puts)))]
    mem = prog.fresh()
    for k, e in enumerate(cell.events, 1):
        sem.apply(prog.plan, e, prog.payload, mem)
        out.append(f"  {k}. {prog.describe_event(e, mem)}")
    read = proto.receive(prog, mem)
    stale = stale_ranges(prog, mem, read)
    out.append(f"  receiver: {read.why}; reads " + ", ".join(f"[{o},{o + n})" for o, n in read.ranges))
    out.append(
        "  wrong: stale bytes "
        + ", ".join(f"[{o},{o + n})" for o, n in stale)
        + f" (e.g. byte {stale[0][0]} = {mem.window[stale[0][0]]:#04x}, message has "
        f"{prog.image[stale[0][0]]:#04x})"
    )
    return out


def trace_short(cell: Cell) -> str:
    proto, model, prog = cell_program(cell)
    evs = []
    for e in cell.events:
        if e.is_signal:
            evs.append(f"op{e.put}.sig")
        else:
            evs.append(f"op{e.put}.s{e.segment}{'dup' if e.copy else ''}")
    _, read, stale = replay(prog, proto, model, cell.events)
    return f"{cell.shape}: {' '.join(evs)} | {read.why} -> stale " + ",".join(f"[{o},{o + n})" for o, n in stale)


def cell_json(cell: Cell) -> dict:
    d = {
        "protocol": cell.protocol,
        "strength": cell.strength,
        "transport": cell.model,
        "verdict": cell.verdict,
        "states": cell.states,
        "seconds": round(cell.seconds, 4),
        "shapes_checked": cell.shapes_checked,
    }
    if not cell.safe:
        proto, _, prog = cell_program(cell)
        mem = prog.fresh()
        trace = []
        for e in cell.events:
            sem.apply(prog.plan, e, prog.payload, mem)
            item = {"op": e.put, "what": prog.describe_event(e, mem)}
            if e.is_signal:
                item["signal"] = True
            else:
                off, n = prog.plan.segs[e.put][e.segment]
                item.update(segment=e.segment, copy=e.copy, bytes=[off, off + n])
            trace.append(item)
        read = proto.receive(prog, mem)
        d["counterexample"] = {
            "shape": {"puts": cell.shape.puts, "units": cell.shape.units},
            "segment_bytes": prog.segment_bytes,
            "ops": [prog.describe_op(i) for i in range(len(prog.puts))],
            "trace": trace,
            "shortest": cell.shortest,
            "read": {
                "why": read.why,
                "ranges": [[o, o + n] for o, n in read.ranges],
                "stale": [[o, o + n] for o, n in stale_ranges(prog, mem, read)],
            },
        }
    return d


def matrix_lines(cells, models, text, widths: list[int]) -> list[str]:
    """The rows of a protocol x model table: a header of model names, then one line per
    (protocol, strength) in first-seen order with text(cell) per model (cell is None
    where there is none). Shared by the explorer's and the stress run's tables."""
    rows = []
    for c in cells:
        r = (c.protocol, c.strength or "-")
        if r not in rows:
            rows.append(r)
    by = {c.key(): c for c in cells}
    w0 = max(len(f"{p} [{s}]") for p, s in rows) + 2
    lines = ["".ljust(w0) + "".join(m.short.ljust(w) for m, w in zip(models, widths)).rstrip()]
    for p, s in rows:
        line = f"{p} [{s}]".ljust(w0)
        for m, w in zip(models, widths):
            line += text(by.get((p, s, m.name))).ljust(w)
        lines.append(line.rstrip())
    return lines


EXPLORER_MARKS = [
    (
        "safe",
        "no message within the bound, in any delivery order the column's transport allows, lets the "
        "receiver read a stale byte",
    ),
    ("UNSAFE", "some delivery order does: its shortest counterexample is listed below the table"),
]
STRESS_MARKS = [
    ("S k/n, U k/n", "the explorer's verdict (safe, unsafe), then k of n messages on the proxy read stale data"),
    ("n/a", "not run on the proxy (" + "; ".join(f"{p}: {why}" for p, why in NOT_STRESSED.items()) + ")"),
    ("!!", "the proxy disagrees with the explorer (a safe cell corrupted, or an order the model forbids)"),
]


def legend_lines(cells, marks: list[tuple[str, str]]) -> list[str]:
    """What the rows, the columns and the cell marks of a table of `cells` mean: one
    line each (rows: the protocols present; columns: the models present)."""
    protos = [PROTOCOL_BY_NAME[n] for n in dict.fromkeys(c.protocol for c in cells)]
    models = [m for m in MODELS if any(c.model == m.name for c in cells)]
    strengths = {c.strength for c in cells}
    w = max([len(p.name) for p in protos] + [len(m.short) for m in models] + [len(k) for k, _ in marks] + [15]) + 2
    out = ["Rows: protocol [signal strength]; a protocol is a sender program and a receiver check:"]
    out += [f"  {p.name:<{w}}{p.doc}" for p in protos]
    out.append("Columns: transport models (how the wire may land a message's segments and signals):")
    out += [f"  {m.short:<{w}}{m.name}: {m.doc}" for m in models]
    out.append("Marks:")
    if strengths & {"weak", "strong"}:
        out.append(
            f"  {'[weak] [strong]':<{w}}the protocol's signals: a weak one implies only its own put landed, "
            "a strong one every earlier put of its context too"
        )
    if None in strengths:
        out.append(f"  {'[-]':<{w}}the protocol sends no signal (the receiver polls data, flags or a counter)")
    out += [f"  {k:<{w}}{v}" for k, v in marks]
    return out


def title_line(bound: tuple[int, int]) -> str:
    return (
        f"commref study: can a receiver following each protocol (rows) read stale data on each transport "
        f"model (columns)? Every delivery order of every message up to {bound[0]} puts x {bound[1]} segments "
        f"searched."
    )


def format_matrix(cells: list[Cell]) -> str:
    models = [m for m in MODELS if any(c.model == m.name for c in cells)]
    widths = [max(len(m.short), 6) + 2 for m in models]
    lines = matrix_lines(cells, models, lambda c: "-" if c is None else ("safe" if c.safe else "UNSAFE"), widths)
    return "\n".join(lines)


def format_stress(cells: list[StressCell], seeds: int, messages: int, bound, legend: bool = True) -> str:
    """The stress table: a title line, the legend (rows and columns too when `legend`,
    else its marks only: the explorer's table above explained them), per cell the
    explorer's verdict and corrupted/messages, then a summary."""
    models = [m for m in MODELS if any(c.model == m.name for c in cells)]
    where = (
        ("2 MPI processes" if cells and cells[0].world == "mpi" else "ThreadWorld")
        + ", "
        + (cells[0].network if cells else "shm")
        + " wire"
    )
    title = (
        f"Corrupted messages per cell on the GIN proxy ({where}; {seeds} seeds x {messages} "
        f"messages of {bound[0]}x{bound[1]} each)"
    )

    def text(c) -> str:
        if c is None:
            return "-"
        if c.skipped:
            return "n/a"
        return f"{c.verdict[0].upper()} {c.corrupted}/{c.messages}" + ("" if c.agrees else " !!")

    explained = legend_lines(cells, STRESS_MARKS)
    if not legend:
        explained = explained[explained.index("Marks:") :]
        explained = [explained[0]] + [ln for ln in explained[1:] if not ln.lstrip().startswith("[")]
    lines = [title] + explained + [""] + matrix_lines(cells, models, text, [13] * len(models))
    bad = [c for c in cells if not c.agrees]
    unseen = [c for c in cells if not c.skipped and c.verdict == "unsafe" and c.corrupted == 0]
    orders = sum(c.orders_checked for c in cells)
    lines.append("")
    lines.append(
        f"# {orders} delivery orders of the proxy checked against semantics.enabled(): "
        f"{sum(c.orders_disallowed for c in cells)} not allowed"
    )
    for c in cells:
        if c.skipped:
            lines.append(f"# {c.protocol}: not stressed ({c.skipped})")
            break
    if unseen:
        lines.append(
            "# unsafe but not observed: " + ", ".join(f"{c.protocol} [{c.strength or '-'}] @ {c.model}" for c in unseen)
        )
    lines.append(
        "# disagreements (a safe cell corrupted, or an order the model forbids): "
        + (", ".join(f"{c.key()}: {c.example}" for c in bad) if bad else "none")
    )
    return "\n".join(lines)


def stress_json(c: StressCell) -> dict:
    """One stress cell for `commref study --stress --json`."""
    return {
        "protocol": c.protocol,
        "strength": c.strength,
        "transport": c.model,
        "verdict": c.verdict,
        "skipped": c.skipped,
        "messages": c.messages,
        "corrupted": c.corrupted,
        "polls": c.polls,
        "wrong_polls": c.wrong_polls,
        "orders_checked": c.orders_checked,
        "orders_disallowed": c.orders_disallowed,
        "agrees": c.agrees,
        "example": c.example,
        "world": c.world,
        "network": c.network,
        "seconds": round(c.seconds, 3),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--protocol", nargs="+", choices=list(PROTOCOL_BY_NAME), default=None, help="protocols (default: all)"
    )
    p.add_argument(
        "--transport", nargs="+", choices=list(MODEL_BY_NAME), default=None, help="transport models (default: all)"
    )
    p.add_argument(
        "--strength", nargs="+", choices=["weak", "strong"], default=None, help="signal strengths (default: both)"
    )
    p.add_argument(
        "--bound",
        default=f"{DEFAULT_BOUND[0]}x{DEFAULT_BOUND[1]}",
        metavar="PxS",
        help="largest message: P puts of S segments (lines for LL); every smaller shape is checked too "
        "(default %(default)s)",
    )
    p.add_argument("--no-por", action="store_true", help="plain exhaustive search, no reductions (slow)")
    p.add_argument("--traces", action="store_true", help="print every counterexample in full")
    p.add_argument("--json", action="store_true", help="JSON output")
    p.add_argument(
        "--stress",
        action="store_true",
        help="run every selected cell on the real GIN proxy (2 ranks: threads, or 2 MPI processes "
        "with --np 2 or under mpiexec) across seeds and print corrupted messages per cell "
        "(messages of the bound's largest shape) instead of the explorer's matrix (--explore: both; "
        "--json carries both)",
    )
    p.add_argument(
        "--explore",
        action="store_true",
        help="with --stress: print the explorer's matrix and counterexamples before the stress table",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        default=None,
        help="write the counterexamples as message sequence charts to FILE (PNG, one chart per unsafe "
        "cell; needs matplotlib)",
    )
    p.add_argument("--seeds", type=int, default=10, help="proxy seeds per cell for --stress (default %(default)s)")
    p.add_argument("--messages", type=int, default=5, help="messages per seed for --stress (default %(default)s)")
    p.add_argument(
        "--fault",
        default="none",
        type=_fault,
        help="with --stress: a lossy link under the proxy's wire, with retransmission above it, e.g. "
        "drop=0.05,dup=0.05,delay=0.05 (seeded by each cell's seed)",
    )


def _fault(text: str) -> FaultSpec:
    try:
        return FaultSpec.parse(text)
    except OptionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_bound(text: str) -> tuple[int, int]:
    try:
        a, b = text.lower().split("x")
        bound = (int(a), int(b))
    except ValueError:
        raise SystemExit(f"commref study: --bound wants PxS (e.g. 4x4), not {text!r}") from None
    if min(bound) < 1:
        raise SystemExit("commref study: --bound needs at least 1x1")
    return bound


def _prints() -> bool:
    """Whether this process writes the output files: rank 0 under mpiexec, else always."""
    if not MPIWorld.launched_under_mpi():
        return True
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank() == 0


def check_plot(path: str | None) -> None:
    """--plot's checks before anything runs: matplotlib importable, the folder there."""
    if path is None:
        return
    import importlib.util
    import os

    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("commref study --plot: needs matplotlib (pip install 'commref[bench]')")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SystemExit(f"commref study --plot: no folder {folder} to write {path} in")


def _plot(cells: list[Cell], path: str, bound: tuple[int, int]) -> str:
    """Draws the counterexamples of `cells` to `path`; returns the line that says so."""
    from commref.transports.gin.study import chart

    if all(c.safe for c in cells):
        return f"# --plot: no counterexample to draw (every selected cell is safe); {path} not written"
    n = chart.write(
        cells,
        path,
        f"commref study: {sum(not c.safe for c in cells)} counterexamples (protocol "
        f"[signal strength] x transport; bound {bound[0]}x{bound[1]}), time runs down",
    )
    return f"# --plot: {n} counterexample{'s' if n > 1 else ''} drawn to {path}"


def run(args) -> int:
    bound = parse_bound(args.bound)
    plot = getattr(args, "plot", None)
    check_plot(plot)
    protocols = [PROTOCOL_BY_NAME[n] for n in args.protocol] if args.protocol else None
    models = [MODEL_BY_NAME[n] for n in args.transport] if args.transport else None
    t0 = time.perf_counter()
    cells = run_matrix(protocols, models, args.strength, bound, por=not args.no_por)
    elapsed = time.perf_counter() - t0
    stress = None
    if args.stress:
        if args.seeds < 1 or args.messages < 1:
            raise SystemExit("commref study: --seeds and --messages must be at least 1")
        t1 = time.perf_counter()
        stress = run_stress(
            protocols,
            models,
            args.strength,
            bound,
            args.seeds,
            args.messages,
            {c.key(): c.verdict for c in cells},
            network=getattr(args, "network", None),
            faults=getattr(args, "fault", None),
        )
        stress_seconds = time.perf_counter() - t1
    plotted = _plot(cells, plot, bound) if plot and _prints() else None
    if args.json:
        if plotted:
            print(plotted, file=sys.stderr)
        out = {
            "bound": {"puts": bound[0], "units": bound[1]},
            "seconds": round(elapsed, 3),
            "cells": [cell_json(c) for c in cells],
        }
        if stress is not None:
            out["stress"] = {
                "seeds": args.seeds,
                "messages": args.messages,
                "seconds": round(stress_seconds, 3),
                "cells": [stress_json(c) for c in stress],
            }
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0 if stress is None or all(c.agrees for c in stress) else 1
    explore = stress is None or getattr(args, "explore", False)
    if explore:
        print(title_line(bound))
        print("\n".join(legend_lines(cells, EXPLORER_MARKS)))
        print()
        print(format_matrix(cells))
        unsafe = [c for c in cells if not c.safe]
        full = args.traces or len(unsafe) <= 3
        if unsafe and not full:
            print(
                "\nCounterexamples (shortest for the smallest unsafe message; opK.sN = segment N of op K, "
                "opK.sig = its signal; --traces for the full form):"
            )
        for c in unsafe:
            if full:
                print("\n" + "\n".join(trace_lines(c)))
            else:
                print(f"  {c.protocol} [{c.strength or '-'}] @ {c.model} {trace_short(c)}")
        print(
            f"\n# {len(cells)} cells, {len(unsafe)} unsafe, bound {bound[0]}x{bound[1]}, "
            f"{sum(c.states for c in cells)} states, {elapsed:.1f} s"
        )
    if plotted:
        print(plotted)
    if stress is not None:
        print(("\n" if explore else "") + format_stress(stress, args.seeds, args.messages, bound, legend=not explore))
        fault = getattr(args, "fault", None)
        print(
            f"# stress: {stress_seconds:.1f} s"
            + (f"; lossy link under the wire: {fault}" if fault and fault.active else "")
        )
        return 0 if all(c.agrees for c in stress) else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="commref study")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
