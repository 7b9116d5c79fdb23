"""The device API held to its word: each promise of docs/device-api.md (and of NCCL's
device contract that commref mirrors) as a litmus test, its outcomes, and the class of
each outcome on each wire. The one source of truth that tests/test_device_conformance.py
iterates (running tests/kernels/litmus.cu, whose codes these are), that the table of
docs/device-api.md is checked against, and that the ordering study's verdicts and the
runtime's refusals are compared with.

A litmus: rank 0 (the sender) posts a small program, rank 1 (the receiver) waits where
the program lets it and reads word A (and word B); an outcome is a read of a stale word.
Its class on a wire (WIRES, the runs of the suite):

- FORBIDDEN: the contract (with that wire's model) promises it never happens: never
  observed, over every launch and seed;
- SHOWN: the contract allows it and this wire is adversarial enough to produce it: the
  suite must observe it at least once (else the wire is less adversarial than the
  contract, and a study on it proves less than it claims);
- REFINED: the contract allows it, but this wire's own model orders it (the ordered
  wire with serialized contexts lands every context of a peer in the order the proxy
  takes it; over LSA a put or a get is stores or loads, complete when it returns):
  never observed on it;
- REFUSED: the backend cannot run the program (a strong signal on the weak-only gda):
  the runtime refuses it with a clear error, which the suite checks instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FORBIDDEN, SHOWN, REFINED, REFUSED = "forbidden", "shown", "refined", "refused"
CLASSES = (FORBIDDEN, SHOWN, REFINED, REFUSED)
CODES = 15  # litmus.cu kLitmusCodes
WINDOW_BYTES = 256 * CODES  # litmus.cu: 256 bytes per litmus


@dataclass(frozen=True)
class Wire:
    """A run of the suite: DeviceComm options (device="cpu", 2 ranks), and the column of
    the ordering study that models it for one context and for two (Model.split_ctx)."""

    name: str
    options: dict
    column: str | None  # the study's column (None: LSA, which the study does not model)
    column_2ctx: str | None
    doc: str
    engine: str | None = None  # the GIN engine asked for (COMMREF_GIN_ENGINE); None: the default

    @property
    def strong(self) -> bool:
        return self.options.get("strong_signals", True)


WIRES: dict[str, Wire] = {
    w.name: w
    for w in (
        Wire("lsa", dict(path="lsa"), None, None, "LSA: loads and stores"),
        Wire(
            "ordered",
            dict(path="gin", wire="ordered", backend="proxy"),
            "ordered",
            "ordered/2ctx",
            "ordered wire, proxy backend, native engine (a peer's contexts serialized)",
        ),
        Wire(
            "ordered-python",
            dict(path="gin", wire="ordered", backend="proxy"),
            "ordered",
            "ordered/2ctx",
            "ordered wire, proxy backend, the Python proxy (COMMREF_GIN_ENGINE=python)",
            engine="python",
        ),
        Wire(
            "ordered-rc",
            dict(path="gin", wire="ordered", backend="rc"),
            "ordered",
            "ordered/2ctx",
            "ordered wire, rc backend (every signal strong), native engine",
        ),
        Wire(
            "ordered-gda",
            dict(path="gin", wire="ordered", backend="gda", strong_signals=False),
            "ordered",
            "ordered/2ctx",
            "ordered wire, gda backend (weak only), native engine",
        ),
        Wire(
            "ordered-indep",
            dict(path="gin", wire="ordered", backend="proxy", independent_contexts=True),
            "ordered",
            "ordered/2ctx",
            "ordered wire with independent contexts (GinOptions.independent_contexts), proxy backend, native engine",
        ),
        Wire(
            "ordered-indep-gda",
            dict(path="gin", wire="ordered", backend="gda", strong_signals=False, independent_contexts=True),
            "ordered",
            "ordered/2ctx",
            "ordered wire with independent contexts, gda backend (a barrier's fence: a flush, then a weak signal)",
        ),
        Wire(
            "unordered",
            dict(path="gin", wire="unordered", backend="proxy"),
            "unordered",
            "unordered/2ctx",
            "unordered wire, proxy backend, native engine",
        ),
        Wire(
            "unordered-python",
            dict(path="gin", wire="unordered", backend="proxy"),
            "unordered",
            "unordered/2ctx",
            "unordered wire, proxy backend, the Python proxy (COMMREF_GIN_ENGINE=python)",
            engine="python",
        ),
        Wire(
            "unordered-gda",
            dict(path="gin", wire="unordered", backend="gda", strong_signals=False),
            "unordered+flush_orders",
            "unordered/2ctx",
            "unordered wire, gda backend (weak only; local completion orders later writes), the Python proxy",
            engine="python",
        ),
    )
}
UNORDERED = ("unordered", "unordered-python", "unordered-gda")


@dataclass(frozen=True)
class Litmus:
    """One promise: its program (litmus.cu code `code`), what it promises, and per
    outcome ("A": word A read stale, "B": word B) the class on each wire. `study`:
    (row, strength, two contexts) of the ordering study's cell that models the stale
    read of A, or None where the study has no row for it."""

    name: str
    code: int
    program: str
    promise: str
    outcomes: dict = field(default_factory=dict)  # "A" | "B" -> {wire name: class}
    study: tuple | None = None
    strong: bool = False  # the program posts a strong signal
    context_cell: bool = False  # a per-context cell (the independent-contexts run's own launch)

    def cls(self, outcome: str, wire: str) -> str:
        return self.outcomes[outcome][wire]


def _row(default: str, **per_wire: str) -> dict:
    """A class per wire: `default`, except those named (dashes as underscores)."""
    out = {w: default for w in WIRES}
    for k, v in per_wire.items():
        out[k.replace("_", "-")] = v
    if "unordered" in per_wire and "unordered_python" not in per_wire:
        out["unordered-python"] = out["unordered"]
    return out


_GIN_STRONG_ONLY = dict(ordered_gda=REFUSED, ordered_indep_gda=REFUSED, unordered_gda=REFUSED)
_UNORDERED_SHOWN = dict(unordered=SHOWN, unordered_gda=SHOWN)


LITMUS: tuple[Litmus, ...] = (
    Litmus(
        "strong-covers-earlier",
        0,
        "put A; put B with StrongSignalInc; the receiver waits for the signal, reads A, B",
        "a strong signal, once visible, makes every earlier put of this rank to that peer on its context visible",
        {"A": _row(FORBIDDEN, **_GIN_STRONG_ONLY), "B": _row(FORBIDDEN, **_GIN_STRONG_ONLY)},
        ("last-put", "strong", False),
        strong=True,
    ),
    Litmus(
        "weak-own-only",
        1,
        "put A; put B with WeakSignalInc; wait; read A, B",
        "a weak signal makes only its own put visible: an unsignalled earlier put may still be in flight",
        {"A": _row(FORBIDDEN, **_UNORDERED_SHOWN), "B": _row(FORBIDDEN)},
        ("last-put", "weak", False),
    ),
    Litmus(
        "strong-signal-alone",
        2,
        "put A; signal(StrongSignalInc) alone; wait; read A",
        "a signal alone (a put of zero bytes) that is strong covers the earlier puts of its context",
        {"A": _row(FORBIDDEN, **_GIN_STRONG_ONLY)},
        ("last-put", "strong", False),
        strong=True,
    ),
    Litmus(
        "weak-signal-alone",
        3,
        "put A; signal(WeakSignalInc) alone; wait; read A",
        "a weak signal alone covers nothing but itself",
        {"A": _row(FORBIDDEN, **_UNORDERED_SHOWN)},
        ("last-put", "weak", False),
    ),
    Litmus(
        "flush-then-flag",
        4,
        "put A; flush; put B with WeakSignalInc; wait; read A, B",
        "flush is local completion only (sources reusable), except where the backend declares that "
        "local completion orders later writes (gda)",
        {"A": _row(FORBIDDEN, unordered=SHOWN), "B": _row(FORBIDDEN)},
        ("flush-signal", "weak", False),
    ),
    Litmus(
        "counter-then-flag",
        5,
        "put A counting counter 0; waitCounter; put B with WeakSignalInc; wait; read A, B",
        "a counter is local completion only; gda's declaration is modelled for flush (semantics.py), "
        "not for a counter, so a flag after a counter may overtake on gda too; the native engine "
        "counts a put once it has landed, so there the flag cannot overtake (refined)",
        {
            "A": _row(FORBIDDEN, **{**_UNORDERED_SHOWN, "unordered": REFINED, "unordered_python": SHOWN}),
            "B": _row(FORBIDDEN),
        },
    ),
    Litmus(
        "get-after-flush",
        6,
        "the receiver gets A from the sender; flush; reads A",
        "a get has landed after flush() of its context",
        {"A": _row(FORBIDDEN)},
    ),
    Litmus(
        "get-before-flush",
        7,
        "the receiver gets A; reads A before flush",
        "a get is not promised to have landed before flush()",
        {"A": _row(SHOWN, lsa=REFINED)},
    ),
    Litmus(
        "counted-write",
        8,
        "countedPut A; the receiver waits for the count, reads A",
        "a counted write counts its arrival only once its data is there",
        {"A": _row(FORBIDDEN)},
        ("counted-writes", None, False),
    ),
    Litmus(
        "other-context",
        9,
        "put A on context 1; put B on context 0 with StrongSignalInc; wait; read A, B",
        "contexts are independent: a strong signal covers only its own context's puts",
        {
            "A": _row(REFINED, lsa=FORBIDDEN, ordered_indep=SHOWN, unordered=SHOWN, **_GIN_STRONG_ONLY),
            "B": _row(FORBIDDEN, **_GIN_STRONG_ONLY),
        },
        ("last-put", "strong", True),
        strong=True,
        context_cell=True,
    ),
    Litmus(
        "barrier-fenced",
        10,
        "put A on context 1; both barrier(Puts, 1); read A",
        "a barrier fencing puts on a context makes a peer's earlier puts there visible",
        {"A": _row(FORBIDDEN)},
    ),
    Litmus(
        "barrier-unfenced",
        11,
        "put A on context 1; both barrier(Puts, 0); read A",
        "a barrier fences only the contexts it names",
        {"A": _row(REFINED, lsa=FORBIDDEN, ordered_indep=SHOWN, ordered_indep_gda=SHOWN, **_UNORDERED_SHOWN)},
        context_cell=True,
    ),
    Litmus(
        "barrier-none",
        12,
        "put A; both barrier(None, GinAllContexts); read A",
        "a barrier of fence level None only meets",
        {"A": _row(REFINED, lsa=FORBIDDEN, **_UNORDERED_SHOWN)},
    ),
    Litmus(
        "barrier-default",
        13,
        "put A on context 1; both barrier(); read A",
        "barrier() fences puts on every context",
        {"A": _row(FORBIDDEN)},
    ),
    Litmus(
        "barrier-gets",
        14,
        "the receiver gets A on context 1; both barrier(Gets, GinAllContexts); read A",
        "a barrier fencing gets: the receiver's earlier gets have landed",
        {"A": _row(FORBIDDEN)},
    ),
)
BY_NAME = {t.name: t for t in LITMUS}


def mask(wire: Wire, only_context_cells: bool = False) -> int:
    """The litmus codes a run on `wire` launches (litmus.cu's mask argument): every one
    the backend can run, or only the per-context cells."""
    return sum(
        1 << t.code for t in LITMUS if (wire.strong or not t.strong) and (t.context_cell or not only_context_cells)
    )


def study_column(t: Litmus, wire: Wire) -> str | None:
    """The ordering study's column that models `t` on `wire`."""
    return wire.column_2ctx if t.study and t.study[2] else wire.column


def table() -> str:
    """docs/device-api.md's table (Markdown): a litmus per row, a wire per column, each
    cell the class of outcome A (and B, after a slash, where it is read)."""
    names = list(WIRES)
    lines = [
        "| litmus (outcome: A / B read stale) | " + " | ".join(names) + " |",
        "| --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for t in LITMUS:
        cells = [" / ".join(t.outcomes[o][w] for o in sorted(t.outcomes)) for w in names]
        lines.append(f"| `{t.name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the rail and hybrid barriers ----
#
# tests/test_device_team_barriers.py runs tests/kernels/team_barriers.cu (every rank puts
# to every peer, a team barrier, every rank reads every peer's word) in each column
# below: a layout (ranks, simulated nodes, path) and a wire. A read is covered when the
# barrier promises that put visible (rail: a member's put on a fenced context at fence
# Puts or Gets; hybrid: every LSA peer's, and a rail member's as the rail barrier's) and
# uncovered otherwise. A covered stale read is FORBIDDEN in every cell; an uncovered one
# is SHOWN where the suite must observe it (the freedom it leaves), ALLOWED elsewhere
# (the contract allows it; this run need not produce it).
ALLOWED = "allowed"
TEAM_BARRIER_COLUMNS = (
    "lsa-2",
    "gin-2-ordered",
    "gin-2-unordered",
    "gin-4-ordered",
    "gin-4-unordered",
    "nodes-2x2-ordered",
    "nodes-2x2-unordered",
)


@dataclass(frozen=True)
class TeamBarrier:
    """One row: the call team_barriers.cu makes (`kind`: its code, 0 rail, 1 hybrid, 2
    hybrid in a warp scope with putValue, 3 rail in a warp scope; `fence` a
    GinFenceLevel, `fenced` a context or -1 for GinAllContexts), what it promises, and
    the columns where its uncovered stale reads are SHOWN."""

    name: str
    call: str
    kind: int
    fence: int
    fenced: int
    promise: str
    shown: tuple = ()

    def cls(self, outcome: str, column: str) -> str:
        """ "covered" or "uncovered" stale reads in `column`."""
        if outcome == "covered":
            return FORBIDDEN
        return SHOWN if column in self.shown else ALLOWED


_PUTS_TEXT = "every put a member posted to this rank before its barrier on a fenced context is visible"
TEAM_BARRIERS: tuple[TeamBarrier, ...] = (
    TeamBarrier("rail-puts", "railBarrier(Puts, GinAllContexts)", 0, 1, -1, f"among the rail: {_PUTS_TEXT}"),
    TeamBarrier(
        "rail-gets",
        "railBarrier(Gets, GinAllContexts)",
        0,
        2,
        -1,
        f"among the rail: {_PUTS_TEXT}, and this rank's gets there have landed",
    ),
    TeamBarrier("rail-none", "railBarrier(None, GinAllContexts)", 0, 0, -1, "only meets", shown=("gin-4-unordered",)),
    TeamBarrier(
        "rail-warp-ctx0",
        "railBarrier(CoopWarp(), Puts, 0), puts in a warp scope",
        3,
        1,
        0,
        f"among the rail: {_PUTS_TEXT}; puts on context 1 are not covered",
        shown=("gin-4-unordered",),
    ),
    TeamBarrier(
        "hybrid-puts",
        "hybridBarrier(Puts, GinAllContexts)",
        1,
        1,
        -1,
        "every LSA peer's store or put is visible, and every GIN put of a rail member on a fenced context; "
        "a GIN put from outside the rail is not covered",
        shown=("nodes-2x2-unordered",),
    ),
    TeamBarrier(
        "hybrid-puts-ctx1",
        "hybridBarrier(Puts, 1)",
        1,
        1,
        1,
        "as hybrid-puts, for context 1 only",
        shown=("gin-4-unordered",),
    ),
    TeamBarrier(
        "hybrid-none",
        "hybridBarrier(None, GinAllContexts)",
        1,
        0,
        -1,
        "only meets (and the LSA peers' stores are visible)",
        shown=("gin-4-unordered",),
    ),
    TeamBarrier(
        "hybrid-warp",
        "hybridBarrier(CoopWarp(), Puts, GinAllContexts), putValue in a warp scope",
        2,
        1,
        -1,
        "as hybrid-puts",
    ),
    TeamBarrier(
        "hybrid-warp-ctx0",
        "hybridBarrier(CoopWarp(), Puts, 0), putValue in a warp scope",
        2,
        1,
        0,
        "as hybrid-puts, for context 0 only",
        shown=("gin-4-unordered",),
    ),
)


def team_barrier_table() -> str:
    """docs/device-api.md's table of the rail and hybrid barriers (Markdown): a row per
    call, a column per layout and wire, each cell the class of a covered stale read and
    of an uncovered one."""
    lines = [
        "| barrier (stale read: covered / uncovered) | " + " | ".join(TEAM_BARRIER_COLUMNS) + " |",
        "| --- | " + " | ".join("---" for _ in TEAM_BARRIER_COLUMNS) + " |",
    ]
    for b in TEAM_BARRIERS:
        cells = [f"{b.cls('covered', c)} / {b.cls('uncovered', c)}" for c in TEAM_BARRIER_COLUMNS]
        lines.append(f"| `{b.name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "ALLOWED",
    "CLASSES",
    "LITMUS",
    "TEAM_BARRIERS",
    "TEAM_BARRIER_COLUMNS",
    "WIRES",
    "Litmus",
    "TeamBarrier",
    "Wire",
    "mask",
    "study_column",
    "table",
    "team_barrier_table",
]
