"""What a sweep prints and writes: the table in nccl-tests' layout (header, column
heads, a row per size and series, the closing lines) and the results document (JSON,
SCHEMA) with the plot that --json and --plot ask for.

"Avg bus bandwidth" is the mean busbw over every size, out-of-place and in-place, as
nccl-tests prints it; the bound column and %bound (100 = as fast as this machine's
memory allows) are bench/bound.py's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

import numpy as np

from commref.transports.deadlines import TIMEOUT_ENV
from commref.transports.gin import faults

from .arguments import AVERAGES, run_cycles
from .environment import LINKS
from .series import algorithms_of, protocols_of, series_link

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .measure import Ctx

SCHEMA = "commref-bench/2"


def _time_str(us: float) -> str:
    """nccl-tests' precision: fewer decimals as the time grows."""
    if us >= 10000:
        return f"{us:.0f}"
    if us >= 100:
        return f"{us:.1f}"
    return f"{us:.2f}"


def _num(v, fmt="{:.2f}", none="-") -> str:
    return none if v is None else fmt.format(v)


# (name, unit, width) of each column, as format_row lays them out ("  " between).
_FIELDS = [("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8), ("redop", "", 6), ("root", "", 6)]
_BLOCK = [("time", "(us)", 7), ("algbw", "(GB/s)", 6), ("busbw", "(GB/s)", 6), ("#wrong", "", 6)]
_EXTRA = [
    ("time", "(us)", 7),
    ("busbw", "(GB/s)", 7),
    ("ratio", "(x)", 6),
    ("busbw", "(GB/s)", 7),
    ("%bound", "(%)", 6),
    ("%ip", "(%)", 4),
]
# With -I 1, after each placement's block: nccl-tests' per-iteration columns.
_PER_ITER = [("i_min", "(us)", 7), ("i_max", "(us)", 7), ("i_p99", "(us)", 7), ("i_cv%", "(%)", 7)]


def _width(cols) -> int:
    return sum(w + 2 for *_, w in cols)


def _placement_cols(per_iter: bool) -> list:
    return _BLOCK + (_PER_ITER if per_iter else [])


def _head_line(pick: int, per_iter: bool) -> str:
    cols = _FIELDS + _placement_cols(per_iter) * 2 + _EXTRA
    line = "  ".join(f"{c[pick]:>{c[2]}}" for c in cols) + "  " + ("path" if pick == 0 else "")
    return "#" + line[1:]


def table_head(baseline_label: str | None, per_iter: bool = False, model: bool = False) -> list[str]:
    """The column heads; `per_iter` (-I 1): with i_min, i_max, i_p99 and i_cv% after each
    placement's #wrong, as nccl-tests prints them; `model` (--model): the predicted time
    and predicted / measured after the path (model_cells)."""
    placement = "" if not per_iter else " (+ per-iteration)"
    groups = ["", "out-of-place" + placement, "in-place" + placement, baseline_label or "baseline", "bound"]
    widths = [_width(_FIELDS) - 2] + [_width(_placement_cols(per_iter))] * 2
    widths += [_width(_EXTRA[:3]), _width(_EXTRA[3:])]
    line = "".join(f"{g:^{w}}" for g, w in zip(groups, widths))
    heads = ["#" + line[1:].rstrip(), _head_line(0, per_iter), _head_line(1, per_iter).rstrip()]
    if model:
        heads[1] += f"{'model':>18}  {'pred/':>6}"
        heads[2] += f"{'(us)':>24}  {'meas':>6}"
    return heads


def model_cells(r: dict) -> str:
    """--model's cells of a row: the predicted out-of-place time and predicted / measured."""
    if "predicted_us" not in r:
        return ""
    pred, ratio = r["predicted_us"], r.get("predicted_ratio")
    return f"  {_time_str(pred) if pred is not None else '-':>8}  {_num(ratio):>6}"


def _per_iter_cells(result: dict | None) -> str:
    """A placement's i_min, i_max, i_p99 and i_cv% (nothing without -I 1; dashes where the
    collective has no such placement)."""
    stats = result.get("per_iter") if result else None
    if stats is None:
        return "" if result else "".join(f"  {'-':>7}" for _ in _PER_ITER)
    cells = (stats["min_us"], stats["max_us"], stats["p99_us"])
    return "".join(f"  {_time_str(v):>7}" for v in cells) + f"  {stats['cv_pct']:7.2f}"


def format_row(r: dict) -> str:
    o, i = r["out_of_place"], r["in_place"]
    base, bound = r.get("baseline"), r.get("bound")
    wrong = lambda v: "N/A" if v is None else str(v)  # noqa: E731
    per_iter = "per_iter" in o
    in_place = (
        f"  {_time_str(i['time_us']):>7}  {i['algbw']:6.2f}  {i['busbw']:6.2f}  {wrong(i.get('wrong')):>6}"
        if i
        else f"  {'-':>7}  {'-':>6}  {'-':>6}  {'N/A':>6}"
    ) + (_per_iter_cells(i) if per_iter else "")  # no in-place form: dashes
    return (
        f"{r['size']:12d}  {r['count']:12d}  {r['type']:>8}  {r['redop']:>6}  {r['root']:6d}"
        f"  {_time_str(o['time_us']):>7}  {o['algbw']:6.2f}  {o['busbw']:6.2f}  {wrong(o.get('wrong')):>6}"
        + _per_iter_cells(o)
        + in_place
        + f"  {_time_str(base['time_us']) if base else '-':>7}  {_num(base and base['busbw']):>7}"
        f"  {_num(r.get('ratio')):>6}"
        f"  {_num(bound and bound['busbw']):>7}  {_num(r.get('pct_of_bound'), '{:.0f}'):>6}"
        f"  {_num(r.get('in_place_pct_of_bound'), '{:.0f}'):>4}  {r['path']}" + model_cells(r)
    )


def summary(rows: list[dict]) -> dict:
    """Per series: wrong elements over every size and variant (None without -c 1), and
    the mean busbw over every size, out-of-place and in-place (nccl-tests' average)."""
    out = {}
    for label in dict.fromkeys(r["series"] for r in rows):
        cells = [r[k] for r in rows if r["series"] == label for k in ("out_of_place", "in_place") if r[k]]
        wrongs = [c["wrong"] for c in cells]
        out[label] = {
            "out_of_bounds": None if None in wrongs else int(sum(wrongs)),
            "avg_busbw": sum(c["busbw"] for c in cells) / len(cells) if cells else 0.0,
        }
    return out


def footer(rows: list[dict]) -> list[str]:
    """nccl-tests' closing lines, one pair per series."""
    sums = summary(rows)
    lines = []
    for label, s in sums.items():
        tag = f" ({label})" if len(sums) > 1 else ""
        oob = s["out_of_bounds"]
        lines.append(f"# Out of bounds values : {'N/A' if oob is None else oob} {'FAILED' if oob else 'OK'}{tag}")
        lines.append(f"# Avg bus bandwidth    : {s['avg_busbw']:.4g}{tag}")
    lines.append("#")
    return lines


def timing(a, deadline: float) -> list[str]:
    """The header's lines on how the times are taken: -a's combination of the ranks, the
    deadline of every wait (-T), -N's cycles, and -I's per-iteration report."""
    average = getattr(a, "average", 1)
    lines = [
        f"# Time: an iteration's time is the {AVERAGES[average]} of the ranks' (-a {average}), the time column "
        f"the median over the {a.iters} iterations; every wait's deadline {deadline:g} s"
        + (" (-T)" if getattr(a, "timeout", 0) else f" (${TIMEOUT_ENV}, -T)")
    ]
    cycles = run_cycles(a)
    if cycles != 1:
        lines.append(f"# Run cycles: {cycles or 'until interrupted'} (-N), a table each")
    if getattr(a, "iteration_stats", 0):
        lines.append(
            "# Per-Iteration Report: i_* uses max over process rows (each iteration's slowest rank; "
            "i_cv% = 100 x stdev / mean)"
        )
    return lines


def header(ctx: Ctx, env: dict, runners, baseline, link: str, skipped=()) -> list[str]:
    a = ctx.args
    lines = [
        f"# commref bench {ctx.plugin.name}: {env['nranks']} ranks ({env['world']}), device {ctx.device}, "
        f"dtype {a.datatype}, op {a.op if ctx.plugin.reducing else 'none'}",
        f"# nThread {a.nthreads} nGpus {1 if ctx.device == 'cuda' else 0} minBytes {a.minbytes} maxBytes {a.maxbytes} "
        + (f"step: {a.stepfactor}(factor)" if a.stepfactor > 1 else f"step: {a.stepbytes}(bytes)")
        + f" warmup iters: {a.warmup_iters} iters: {a.iters} agg iters: {getattr(a, 'agg_iters', 1)}"
        + f" validation: {a.check} graph: 0"
        + f" blocking: {a.blocking}",
        *timing(a, ctx.world.timeout),
        "#",
        "# Using devices",
    ]
    for r, d in enumerate(env["ranks"]):
        lines.append(
            f"#  Rank {r:2d} Group  0 Pid {d['pid']:6d} on {d['node']:>10} cpus {d['cpus']} device {d['device']}"
        )
    lines.append("#")
    paths = ", ".join(s.label for s, _ in runners)
    lines.append(
        f"# Path: {paths} over {link} ({LINKS.get(link, link)}); algorithm {','.join(algorithms_of(a))}; "
        f"protocol {','.join(protocols_of(a))}; seed {a.seed}"
    )
    teams = {s.team: c for s, c in runners if s.team != "job"}
    if teams:
        lines.append(
            f"# Teams: intra-node = each node's {teams['intra-node'].nranks} ranks at once, inter-node = "
            f"one rank per node ({teams['inter-node'].nranks}), every rail at once; the same bytes per rank, "
            f"busbw with the team's bus factor, no baseline or bound"
        )
    lines.extend(f"# GPU sharing: {line}" for line in env.get("gpu_sharing", ()))
    lines.extend(f"# Skipped {s.label}: {why}" for s, why in skipped)
    if baseline is not None:
        lines.append(
            f"# Baseline: {baseline.label}, in-process, out-of-place, timed after each size's series with commref's "
            "communicators quiesced (measure.py); ratio = our out-of-place busbw / baseline busbw"
        )
        lines.extend(f"# Baseline note: {n}" for n in dict.fromkeys(baseline.notes))
    elif env.get("baseline_unavailable"):
        lines.append(f"# Baseline: none ({env['baseline_unavailable']})")
    lines.append(
        "# Bound: busbw if each rank only loaded and stored the least bytes any algorithm must, at the rate "
        "memory serves loads and stores with every rank streaming at once (the fastest STREAM-like kernel at "
        "the call's footprint, measured before and after each size's calls; bench/bound.py); %bound = our "
        "out-of-place busbw / bound (100 = as fast as memory allows), %ip = our in-place busbw / the in-place "
        "bound"
    )
    lines.append("#")
    return lines


def document(
    plugin, args, env: dict, runners, skipped, baseline, nranks: int, rows: list[dict], gin_faults: dict, elapsed: float
) -> dict:
    """The results document of a sweep (what --json writes, SCHEMA): its parameters,
    environment, series (run and skipped), baseline, rows, GIN fault counts, summary."""
    return {
        "schema": SCHEMA,
        "collective": plugin.name,
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "nccl_json", "plot")}
        | {"run_cycles": run_cycles(args)},
        "environment": env,
        "series": [dataclasses.asdict(s) | {"label": s.label, "link": series_link(c, env["link"])} for s, c in runners],
        "skipped": [dataclasses.asdict(s) | {"label": s.label, "reason": why} for s, why in skipped],
        "baseline": {"label": baseline.label, "library": baseline.library, "notes": sorted(set(baseline.notes))}
        if baseline
        else None,
        "bus_factor": plugin.bus_factor(nranks),
        "rows": rows,
        "gin_faults": {label: faults.totals(stats) for label, stats in gin_faults.items()},
        "summary": summary(rows),
        "elapsed_s": elapsed,
    }


def write_json(doc: dict, path: str) -> None:
    """The results document as JSON in `path`."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=_jsonable)
        f.write("\n")


def write_outputs(doc: dict, args) -> None:
    """Writes the JSON document and the plot that args ask for, one line each naming the file."""
    if args.json:
        write_json(doc, args.json)
        print(f"# wrote {args.json} (results and environment, {SCHEMA})", flush=True)
    if getattr(args, "nccl_json", None):
        from .nccl_json import nccl_tests_document

        with open(args.nccl_json, "w") as f:
            json.dump(nccl_tests_document(doc), f, indent=1, default=_jsonable)
            f.write("\n")
        print(f"# wrote {args.nccl_json} (nccl-tests' JSON document)", flush=True)
    if args.plot:
        from .plot import plot

        plot([doc], args.plot)
        print(f"# wrote {args.plot} (plot)", flush=True)


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)
