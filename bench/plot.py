"""Plots of bench results (the harness's JSON documents): bus bandwidth and time vs size.

Three panels over one log2 size axis:

- bus bandwidth (GB/s, log axis, so that small messages do not flatten onto zero): one
  line per series (out-of-place solid, in-place dashed, one color per series), the
  baseline (MPI on CPU, NCCL on GPU; black) and the memory bound (bench/bound.py: the
  busbw if the call only moved the least bytes at the rate memory streams; gray, dotted
  out of place, dash-dotted in place), each labelled;
- time per call (us, log-log), the same lines: where small messages live;
- the kernel each series ran at each size (the rows' "kernel": kernel/protocol, e.g.
  ring_allreduce/ll, direct_allreduce/simple), one strip per series. Where it changes
  along the size axis, a vertical line in the series' color crosses the panels above and
  a marker on the busbw line names the new kernel.

With -N cycles, the last cycle's rows are drawn. The title names every series plotted.
Several documents (several runs, e.g. one per path or per machine) can share one plot:

    python -m commref.bench.plot run1.json run2.json -o busbw.png

matplotlib is an optional extra (commref[bench]); it is imported inside the functions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

_DOC_STYLES = ["-", "-.", (0, (6, 2)), (0, (1, 1))]  # baseline line style per document
SWITCH_GID = "kernel-switch"  # gid of each marker on a busbw line where the series' kernel changes


def _human(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:g}{unit if unit != 'B' else ''}"
        n /= 1024
    return str(n)


def _positive(pts):
    """The points a log axis can show (a 0 GB/s or a missing value cannot)."""
    return [(x, y) for x, y in pts if y is not None and y > 0]


def last_cycle(rows: list[dict]) -> list[dict]:
    """The rows of a document's last cycle (-N runs the sweep several times; documents
    from before -N have no "cycle" and one sweep)."""
    last = max((r.get("cycle", 1) for r in rows), default=1)
    return [r for r in rows if r.get("cycle", 1) == last]


def _segments(rows) -> list[tuple[int, int, str]]:
    """(first size, last size, kernel) of each run of equal kernels along the sizes."""
    out: list[list] = []
    for r in rows:
        k = r.get("kernel") or "?"
        if out and out[-1][2] == k:
            out[-1][1] = r["size"]
        else:
            out.append([r["size"], r["size"], k])
    return [tuple(s) for s in out]


def _short_kernel(name: str, coll: str | None) -> str:
    """ring_allreduce/ll -> ring/ll for the collective all_reduce (the title names it)."""
    if coll:
        name = name.replace(f"_{coll.replace('_', '')}", "").replace(f"_{coll}", "")
    return name


def _default_title(docs: list[dict], series: list[str], extras: list[str]) -> str:
    what = ", ".join(series)
    tail = (" vs " + " and ".join(extras)) if extras else ""
    if len(docs) > 1:
        colls = ", ".join(dict.fromkeys(str(d.get("collective")) for d in docs))
        return f"commref bench {colls}: {what}{tail}"
    d = docs[0]
    env, p = d.get("environment", {}), d.get("params", {})
    return (
        f"commref {d.get('collective')}, {env.get('nranks')} ranks ({env.get('world')}), {p.get('datatype')}, "
        f"device {env.get('device')}, over {env.get('link', '?')}:\n{what}{tail}"
    )


def figure(docs: list[dict], title: str | None = None):
    """The matplotlib figure of every series of every document in `docs` (see the module
    docstring); its first axes' title names every series, baseline and bound drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    many = len(docs) > 1
    nseries = sum(len(dict.fromkeys(r["series"] for r in d["rows"])) for d in docs)
    fig, (bw, tm, ks) = plt.subplots(
        3,
        1,
        sharex=True,
        figsize=(14, 10.5 + 0.3 * nseries),
        dpi=110,
        gridspec_kw={"height_ratios": [3.2, 2.4, 0.5 + 0.35 * nseries]},
    )
    drawn_baselines, drawn_bounds = set(), set()
    all_sizes: list[int] = []
    series_names: list[str] = []  # as the title names them
    extras: list[str] = []  # baselines and bounds, as the title names them
    strips: list[tuple[str, str, list]] = []  # (label, color, segments) for the kernel panel
    color_k = 0
    switches: dict[tuple[int, str], list] = {}  # (size, new kernel) -> (series, color, busbw) switching there
    for k, doc in enumerate(docs):
        env = doc.get("environment", {})
        tag = f" [{doc.get('collective')}, {env.get('nranks')} ranks, {env.get('device')}]" if many else ""
        coll = doc.get("collective") or ""
        rows = last_cycle(doc["rows"])
        for label in dict.fromkeys(r["series"] for r in rows):
            mine = sorted((r for r in rows if r["series"] == label and r["size"] > 0), key=lambda r: r["size"])
            if not mine:
                continue
            color = f"C{color_k % 10}"
            color_k += 1
            series_names.append(f"{label}{tag}")
            sizes = [r["size"] for r in mine]
            all_sizes += sizes
            in_place = all(r["in_place"] for r in mine)  # else no in-place form (alltoall)
            for ax, key in ((bw, "busbw"), (tm, "time_us")):
                pts = _positive((r["size"], r["out_of_place"][key]) for r in mine)
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, color=color, label=f"commref {label} out-of-place{tag}")
                if in_place:
                    pts = _positive((r["size"], r["in_place"][key]) for r in mine)
                    if pts:
                        ax.plot(
                            *zip(*pts), ls="--", marker=".", ms=3, color=color, label=f"commref {label} in-place{tag}"
                        )
            segs = _segments(mine)
            strips.append((f"{label}{tag}", color, segs))
            if any(r.get("kernel") for r in mine):
                by_size = {r["size"]: r for r in mine}
                for j, (first, _, kern) in enumerate(segs[1:], 1):
                    prev_last = segs[j - 1][1]
                    at = math.sqrt(prev_last * first)  # between the last size of one kernel and the first of the next
                    for ax in (bw, tm, ks):
                        ax.axvline(at, color=color, ls=":", lw=1.2, alpha=0.8)
                    y = by_size[first]["out_of_place"]["busbw"]
                    if y and y > 0:
                        m = bw.scatter([first], [y], marker="*", s=110, color=color, edgecolor="k", lw=0.5, zorder=5)
                        m.set_gid(SWITCH_GID)
                        switches.setdefault((first, _short_kernel(kern, coll)), []).append((label + tag, color, y))
        first = [r for r in rows if r["series"] == rows[0]["series"] and r["size"] > 0] if rows else []
        first.sort(key=lambda r: r["size"])
        base = doc.get("baseline")
        if base and any(r.get("baseline") for r in first) and (base["label"], tag) not in drawn_baselines:
            drawn_baselines.add((base["label"], tag))
            extras.append(f"{base['label']} baseline{tag}")
            for ax, key in ((bw, "busbw"), (tm, "time_us")):
                pts = _positive((r["size"], r["baseline"][key]) for r in first if r.get("baseline"))
                if pts:
                    ax.plot(
                        *zip(*pts),
                        color="black",
                        marker="s",
                        ms=3,
                        ls=_DOC_STYLES[k % len(_DOC_STYLES)],
                        label=f"{base['label']} (baseline, out-of-place){tag}",
                    )
        if any(r.get("bound") for r in first) and tag not in drawn_bounds:
            drawn_bounds.add(tag)
            extras.append(f"memory bound{tag}")
            for ax, keys in ((bw, ("busbw", "in_place_busbw")), (tm, ("time_us", "in_place_time_us"))):
                for key, ls, what in zip(keys, (":", "-."), ("out-of-place", "in-place")):
                    pts = _positive((r["size"], r["bound"].get(key)) for r in first if r.get("bound"))
                    if pts:
                        ax.plot(
                            *zip(*pts),
                            color="gray",
                            ls=ls,
                            lw=2 + k % 2,
                            alpha=1 - 0.3 * (k % 2),
                            label=f"memory bound {what}{tag}",
                        )

    # One label per switch, naming every series that switches to that kernel at that size.
    for (size, kern), who in switches.items():
        color = who[0][1] if len(who) == 1 else "black"
        bw.annotate(
            f"{', '.join(w[0] for w in who)}: {kern}",
            (size, min(w[2] for w in who)),
            xytext=(7, -16),
            textcoords="offset points",
            fontsize=7,
            color=color,
            zorder=6,
            bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8),
            arrowprops=dict(arrowstyle="-", color=color, lw=0.6),
        )

    # The kernel panel: one strip per series, a box per run of sizes on one kernel.
    for j, (label, color, segs) in enumerate(strips):
        y = len(strips) - 1 - j
        for i, (first, last, kern) in enumerate(segs):
            # A box from halfway (on the log axis) after the previous run's last size to
            # halfway before the next run's first.
            lo = math.sqrt(segs[i - 1][1] * first) if i else first / 1.4
            hi = math.sqrt(last * segs[i + 1][0]) if i + 1 < len(segs) else last * 1.4
            ks.fill_between([lo, hi], y - 0.38, y + 0.38, color=color, alpha=0.12 + 0.14 * (i % 2), lw=0)
            ks.text(
                math.sqrt(lo * hi),
                y,
                _short_kernel(kern, docs[0].get("collective")) if not many else kern,
                ha="center",
                va="center",
                fontsize=7,
            )
    ks.set_yticks(range(len(strips)), [s[0] for s in reversed(strips)], fontsize=8)
    ks.set_ylim(-0.6, len(strips) - 0.4)
    ks.set_ylabel("kernel/protocol", fontsize=8)

    for ax in (bw, tm):
        ax.set_yscale("log")
        ax.grid(True, which="major", alpha=0.3)
        ax.grid(True, which="minor", alpha=0.08)
    bw.set_xscale("log", base=2)
    if all_sizes:
        bw.set_xlim(min(all_sizes) / 1.5, max(all_sizes) * 1.5)
    ks.xaxis.set_major_locator(LogLocator(base=2, numticks=40))
    ks.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _human(v)))
    ks.tick_params(axis="x", labelrotation=45, labelsize=8)
    ks.set_xlabel("size (bytes)")
    bw.set_ylabel("bus bandwidth (GB/s, log)")
    tm.set_ylabel("time per call (us, log)")
    if title is None:
        title = _default_title(docs, series_names, extras)
    bw.set_title(title, fontsize=10)
    bw.legend(
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0,
        title="out-of-place solid, in-place dashed",
        title_fontsize=7,
    )
    fig.tight_layout()
    return fig


def plot(docs: list[dict], path: str, title: str | None = None) -> None:
    """Writes figure(docs, title) to `path` as PNG."""
    import matplotlib.pyplot as plt

    fig = figure(docs, title)
    try:
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commref.bench.plot", description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", help="results written by commref bench --json")
    p.add_argument("-o", "--output", required=True, help="PNG file to write")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    docs = []
    for name in a.json:
        with open(name) as f:
            docs.append(json.load(f))
    plot(docs, a.output, a.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
