"""busbw vs size plots from bench results (the harness's JSON documents).

One line per path (out-of-place solid, in-place dashed), one for the baseline and
the bound's (bench/bound.py: the busbw if the call only moved the least bytes at the
rate memory streams; dotted gray out of place, dash-dotted gray in place), on a log2
size axis. Several documents (several runs, e.g. one per path or per machine) can
share one plot:

    python -m commref.bench.plot run1.json run2.json -o busbw.png
"""

from __future__ import annotations

import argparse
import json
import sys


_DOC_STYLES = ["-", "-.", (0, (6, 2)), (0, (1, 1))]  # baseline line style per document


def _human(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:g}{unit if unit != 'B' else ''}"
        n /= 1024
    return str(n)


def plot(docs: list[dict], path: str, title: str | None = None) -> None:
    """Writes a PNG of busbw vs size for every series of every document in `docs`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    many = len(docs) > 1
    drawn_baselines, drawn_bounds = set(), set()
    all_sizes: list[int] = []
    for k, doc in enumerate(docs):
        env = doc.get("environment", {})
        tag = f" [{doc.get('collective')}, {env.get('nranks')} ranks, {env.get('device')}]" if many else ""
        rows = doc["rows"]
        for label in dict.fromkeys(r["series"] for r in rows):
            mine = [r for r in rows if r["series"] == label and r["size"] > 0]
            sizes = [r["size"] for r in mine]
            all_sizes += sizes
            line, = ax.plot(sizes, [r["out_of_place"]["busbw"] for r in mine], marker="o", ms=3,
                            label=f"commref {label} out-of-place{tag}")
            if all(r["in_place"] for r in mine):  # else no in-place form (alltoall)
                ax.plot(sizes, [r["in_place"]["busbw"] for r in mine], ls="--", marker=".", ms=3,
                        color=line.get_color(), label=f"commref {label} in-place{tag}")
        first = [r for r in rows if r["series"] == rows[0]["series"] and r["size"] > 0] if rows else []
        base = doc.get("baseline")
        if base and any(r.get("baseline") for r in first) and (base["label"], tag) not in drawn_baselines:
            drawn_baselines.add((base["label"], tag))
            pts = [(r["size"], r["baseline"]["busbw"]) for r in first if r.get("baseline")]
            ax.plot(*zip(*pts), color="black", marker="s", ms=3, ls=_DOC_STYLES[k % len(_DOC_STYLES)],
                    label=f"{base['label']} (baseline){tag}")
        if any(r.get("bound") for r in first) and tag not in drawn_bounds:
            drawn_bounds.add(tag)
            for key, ls, what in (("busbw", ":", "out-of-place"), ("in_place_busbw", "-.", "in-place")):
                pts = [(r["size"], r["bound"][key]) for r in first if r.get("bound") and r["bound"].get(key)]
                if pts:
                    ax.plot(*zip(*pts), color="gray", ls=ls, lw=2 + k % 2, alpha=1 - 0.3 * (k % 2),
                            label=f"memory bound {what}{tag}")
    ax.set_xscale("log", base=2)
    if all_sizes:
        ax.set_xlim(min(all_sizes) / 1.4, max(all_sizes) * 1.4)
    ax.xaxis.set_major_locator(LogLocator(base=2, numticks=40))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _human(v)))
    ax.tick_params(axis="x", labelrotation=45, labelsize=8)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="major", alpha=0.3)
    if title is None and many:
        title = "commref bench: " + ", ".join(dict.fromkeys(str(d.get("collective")) for d in docs))
    if title is None:
        d = docs[0]
        env, p = d.get("environment", {}), d.get("params", {})
        title = (f"commref {d.get('collective')}: {env.get('nranks')} ranks ({env.get('world')}), "
                 f"{p.get('datatype')}, device {env.get('device')}, "
                 f"{', '.join(p.get('path') or ['lsa'])} over {env.get('link', '?')}")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, format="png")
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
