"""`commref study --plot FILE`: each counterexample as a message sequence chart (PNG).

One subplot per unsafe cell, titled protocol [strength] x transport. Three lanes, time
running down: the sender posts the message's pieces (each put's data segments, then its
signal; a flush where the program flushes) in posting order; each piece crosses to the
wire and stays there (a bar on the wire lane) until it lands on the receiver, in the
counterexample's landing order (numbered). Pieces that never land in the counterexample
stay on the wire to the end (dotted, "in flight"). On the receiver lane: the wait (a bar
while the receiver's check does not hold), the moment it accepts (why), and the read
with its stale bytes, in red.

matplotlib is an optional extra (commref[bench]); it is imported inside the functions.
"""

from __future__ import annotations

import math

from commref.transports.gin import semantics as sem
from commref.transports.gin.semantics import Event
from commref.transports.gin.study.explorer import Cell, cell_program
from commref.transports.gin.study.signaling import stale_ranges

SENDER, WIRE, RECEIVER = 0.0, 1.5, 3.0
LANDING_GID = "landing"  # gid of every landing arrow (wire -> receiver), one per counterexample event
POST_GID = "post"  # gid of every posting arrow (sender -> wire), one per posted piece
STALE_GID = "stale-read"  # gid of the stale-read mark, one per subplot
WAIT_GID = "wait"  # gid of the receiver's wait bar, one per subplot


def _need_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("commref study --plot: needs matplotlib (pip install 'commref[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _piece(prog, e: Event) -> str:
    """A piece's short name: op1.s0 [64,128), op1.sig (weak), op0.s1 dup."""
    if e.is_signal:
        p = prog.puts[e.put]
        return f"op{e.put}.sig ({'strong' if p.signal.strong else 'weak'})"
    off, n = prog.plan.segs[e.put][e.segment]
    return f"op{e.put}.s{e.segment}{' dup' if e.copy else ''} [{off},{off + n})"


def _ranges(rs) -> str:
    return ", ".join(f"[{o},{o + n})" for o, n in rs)


def draw_cell(ax, cell: Cell) -> None:
    """One counterexample as a message sequence chart on `ax`."""
    proto, _, prog = cell_program(cell)
    colors = [f"C{k % 10}" for k in range(len(prog.puts))]

    # Posting order: the program's steps, each put's data segments then its signal.
    posted: list[tuple[float, Event | None, str]] = []  # (time, piece, flush label)
    t = 0.0
    for kind, x in prog.steps:
        if kind == "flush":
            posted.append((t, None, f"flush ctx {x}"))
            t += 1
            continue
        for s in range(len(prog.plan.segs[x])):
            posted.append((t, Event(x, s), ""))
            t += 1
        if prog.puts[x].signal is not None:
            posted.append((t, Event(x, -1), ""))
            t += 1
    # Each piece has its own track on the wire lane, so that pieces in flight together stay apart.
    pieces = [e for _, e, _ in posted if e is not None]
    step = min(0.09, 0.5 / max(1, len(pieces)))
    track = {e: WIRE + (j - (len(pieces) - 1) / 2) * step for j, e in enumerate(pieces)}
    first_land = t + 0.5

    # Landing order: replay the counterexample, noting when the receiver first accepts.
    mem = prog.fresh()
    land_time: dict[Event, float] = {}
    accept_at, read = None, proto.receive(prog, mem)
    if read is not None:
        accept_at = first_land - 0.5
    labels = []
    for k, e in enumerate(cell.events):
        sem.apply(prog.plan, e, prog.payload, mem)
        tl = first_land + k
        land_time[e] = tl
        labels.append(prog.describe_event(e, mem))
        now = proto.receive(prog, mem)
        if now is not None and accept_at is None:
            accept_at = tl
        read = now
    end = first_land + len(cell.events) + 0.4
    stale = stale_ranges(prog, mem, read)

    # Lanes.
    top = -0.9
    for x, name in ((SENDER, "sender"), (WIRE, "wire"), (RECEIVER, "receiver")):
        ax.plot([x, x], [top + 0.3, end + 0.6], color="0.6", lw=1, zorder=0)
        ax.text(x, top, name, ha="center", va="bottom", fontsize=7, weight="bold")

    # Posting arrows and the time each piece spends on the wire.
    for tp, e, flush in posted:
        if e is None:
            ax.text(SENDER - 0.05, tp, flush, ha="right", va="center", fontsize=6, style="italic")
            ax.plot([SENDER - 0.04, SENDER + 0.04], [tp, tp], color="k", lw=2)
            continue
        c, ls = colors[e.put], ("--" if e.is_signal else "-")
        xw = track[e]
        a = ax.annotate(
            "",
            xy=(xw, tp + 0.45),
            xytext=(SENDER, tp),
            arrowprops=dict(arrowstyle="->", color=c, ls=ls, lw=1.6 if e.is_signal else 1.1),
        )
        a.set_gid(POST_GID)
        ctx = prog.puts[e.put].ctx
        ax.text(
            SENDER - 0.05,
            tp,
            _piece(prog, e) + (f" ctx {ctx}" if ctx else ""),
            ha="right",
            va="center",
            fontsize=6,
            color=c,
        )
        landed = [le for le in land_time if (le.put, le.segment) == (e.put, e.segment)]
        last = max((land_time[le] for le in landed), default=None)
        if last is None:  # never lands in the counterexample: in flight to the end
            ax.plot([xw, xw], [tp + 0.45, end], color=c, lw=2.5, alpha=0.6, ls=":")
            ax.text(
                WIRE - 0.3,
                end,
                f"{_piece(prog, e)} never lands",
                ha="right",
                va="center",
                fontsize=6,
                color=c,
                style="italic",
            )
        else:
            ax.plot([xw, xw], [tp + 0.45, last - 0.45], color=c, lw=2.5, alpha=0.45, solid_capstyle="butt")

    # Landing arrows, numbered in landing order.
    for k, (e, label) in enumerate(zip(cell.events, labels), 1):
        tl = land_time[e]
        c = colors[e.put]
        ls = "--" if e.is_signal else (":" if e.copy else "-")
        a = ax.annotate(
            "",
            xy=(RECEIVER, tl),
            xytext=(track[Event(e.put, e.segment)], tl - 0.45),
            arrowprops=dict(arrowstyle="->", color=c, ls=ls, lw=1.6 if e.is_signal else 1.1),
        )
        a.set_gid(LANDING_GID)
        ax.text(RECEIVER + 0.05, tl, f"{k}. {label}", ha="left", va="center", fontsize=6, color=c)

    # The receiver: waits while its check fails, accepts, reads stale bytes.
    accept_at = first_land - 0.5 if accept_at is None else accept_at
    bar = ax.add_patch(_rect((RECEIVER - 0.035, 0), 0.07, accept_at, color="orange", alpha=0.35))
    bar.set_gid(WAIT_GID)
    ax.text(
        RECEIVER + 0.06,
        max(accept_at, 0.5) / 2,
        "waits",
        ha="left",
        va="center",
        fontsize=6,
        color="darkorange",
        rotation=90,
    )
    why = read.why if read is not None else "?"
    ax.scatter([RECEIVER], [accept_at], marker="D", s=22, color="darkorange", zorder=5)
    ax.text(
        RECEIVER + 0.05,
        accept_at + 0.38,
        f"accepts: {why}",
        ha="left",
        va="center",
        fontsize=6,
        color="darkorange",
        weight="bold",
    )
    mark = ax.scatter([RECEIVER], [end], marker="X", s=60, color="red", zorder=5)
    mark.set_gid(STALE_GID)
    at = stale[0][0] if stale else None
    detail = f" (byte {at} = {mem.window[at]:#04x}, message has {prog.image[at]:#04x})" if at is not None else ""
    ax.text(
        RECEIVER + 0.05,
        end + 0.05,
        f"reads {_ranges(read.ranges) if read else '-'}\nSTALE {_ranges(stale)}" + detail,
        ha="left",
        va="top",
        fontsize=6,
        color="red",
        weight="bold",
    )

    ax.set_xlim(-1.7, 5.3)
    ax.set_ylim(end + 1.3, top - 0.9)
    ax.set_axis_off()
    shape = f"{cell.shape.puts} put{'s' if cell.shape.puts > 1 else ''} x {cell.shape.units}"
    ax.set_title(
        f"{cell.protocol} [{cell.strength or '-'}] x {cell.model}\nmessage {shape}, {prog.segment_bytes}-byte segments",
        fontsize=8,
    )


def _rect(xy, w, h, **kw):
    from matplotlib.patches import Rectangle

    return Rectangle(xy, w, h, **kw)


def figure(cells: list[Cell], title: str | None = None, ncols: int = 4):
    """The figure: one message sequence chart per unsafe cell of `cells` (in order), in
    a grid of up to `ncols` columns. Raises ValueError when no cell is unsafe."""
    plt = _need_matplotlib()
    from matplotlib.lines import Line2D

    unsafe = [c for c in cells if not c.safe]
    if not unsafe:
        raise ValueError("no counterexample to draw: every selected cell is safe")
    ncols = max(1, min(ncols, len(unsafe)))
    nrows = math.ceil(len(unsafe) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.6 * ncols, 4.2 * nrows + 0.9), dpi=110, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, cell in zip(flat, unsafe):
        draw_cell(ax, cell)
    for ax in flat[len(unsafe) :]:
        fig.delaxes(ax)
    fig.suptitle(
        title
        or f"commref study: {len(unsafe)} counterexample{'s' if len(unsafe) > 1 else ''} "
        "(protocol [signal strength] x transport), time runs down",
        fontsize=12,
        y=1 - 0.2 / fig.get_figheight(),
        va="top",
    )
    handles = [
        Line2D([], [], color="k", lw=1.1, label="data segment (posted, then landing)"),
        Line2D([], [], color="k", lw=1.6, ls="--", label="signal"),
        Line2D([], [], color="k", lw=1.1, ls=":", label="duplicate placement"),
        Line2D([], [], color="0.5", lw=3, alpha=0.5, label="on the wire (dotted: never lands here)"),
        Line2D([], [], color="orange", lw=5, alpha=0.5, label="receiver waits (its check fails)"),
        Line2D([], [], color="red", marker="X", ls="", label="stale read"),
    ]
    fig.legend(
        handles=handles,
        loc="upper center",
        ncol=6,
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 1 - 0.5 / fig.get_figheight()),
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.85 / fig.get_figheight()))
    return fig


def write(cells: list[Cell], path: str, title: str | None = None) -> int:
    """Writes figure(cells) to `path` as PNG; returns the number of charts drawn."""
    plt = _need_matplotlib()
    fig = figure(cells, title)
    n = sum(1 for c in cells if not c.safe)
    try:
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return n
