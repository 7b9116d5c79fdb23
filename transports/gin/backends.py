"""GIN backends: what each offers, and selection by requirements.

A communicator states requirements; selection walks the backends in priority order,
skips those that cannot meet them, and fails with a message naming what is missing
when none can (NCCL's GIN selection; docs/gin.md, Backends).

- proxy: strong and weak, indexed and VA signals, counters, get; on an unordered wire
  strong signals are applied in per-(context, peer) sequence order, weak ones as soon
  as their own data has landed.
- gda (EFA-GDA-like): weak signals only, indexed only; a signal's value is the number
  of completed inbound writes on its endpoint; a get completes only through flush; at
  most 512 signals + counters per device.
- rc (IB-RC-like): an ordered wire; every signal is strong; any signal implies all
  earlier puts to that peer on that context.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from commref.transports.errors import CapabilityError


@dataclass(frozen=True)
class Capabilities:
    strong_signals: bool
    weak_signals: bool
    va_signals: bool
    counters: bool
    get: bool
    flushes_all_puts_on_any_signal: bool
    local_completion_orders_later_writes: bool
    max_signals_counters: int | None  # None: no limit
    wires: tuple[str, ...]  # ordering models it can run on


@dataclass(frozen=True)
class Backend:
    name: str
    caps: Capabilities
    signals_count_writes: bool = False  # gda: a signal counts completed inbound writes

    @property
    def strong_always(self) -> bool:
        return self.caps.flushes_all_puts_on_any_signal


@dataclass(frozen=True)
class Requirements:
    """What a communicator needs from GIN."""

    strong_signals_required: bool = False
    va_signals_required: bool = False
    counters: bool = False
    get: bool = False
    signals_counters: int = 0
    wire: str = "ordered"
    flush_orders_later_writes: bool = False  # flush-then-signal must be safe (gda declares it; rc's
    # signals imply every earlier put anyway)

    def missing(self, b: Backend) -> list[str]:
        c, out = b.caps, []
        if self.strong_signals_required and not c.strong_signals:
            out.append("strong signals")
        if self.va_signals_required and not c.va_signals:
            out.append("VA signals")
        if self.counters and not c.counters:
            out.append("counters")
        if self.get and not c.get:
            out.append("get")
        if self.flush_orders_later_writes and not (
            c.local_completion_orders_later_writes or c.flushes_all_puts_on_any_signal
        ):
            out.append("local completion ordering later writes")
        if c.max_signals_counters is not None and self.signals_counters > c.max_signals_counters:
            out.append(f"{self.signals_counters} signals+counters (at most {c.max_signals_counters})")
        if self.wire not in c.wires:
            out.append(f"the {self.wire} wire (runs on {'/'.join(c.wires)} only)")
        return out


BACKENDS: dict[str, Backend] = {
    "gda": Backend(
        "gda",
        Capabilities(
            strong_signals=False,
            weak_signals=True,
            va_signals=False,
            counters=True,
            get=True,
            flushes_all_puts_on_any_signal=False,
            local_completion_orders_later_writes=True,
            max_signals_counters=512,
            wires=("ordered", "unordered"),
        ),
        signals_count_writes=True,
    ),
    "rc": Backend(
        "rc",
        Capabilities(
            strong_signals=True,
            weak_signals=True,
            va_signals=True,
            counters=True,
            get=True,
            flushes_all_puts_on_any_signal=True,
            local_completion_orders_later_writes=False,
            max_signals_counters=None,
            wires=("ordered",),
        ),
    ),
    "proxy": Backend(
        "proxy",
        Capabilities(
            strong_signals=True,
            weak_signals=True,
            va_signals=True,
            counters=True,
            get=True,
            flushes_all_puts_on_any_signal=False,
            local_completion_orders_later_writes=False,
            max_signals_counters=None,
            wires=("ordered", "unordered"),
        ),
    ),
}
PRIORITY = ("gda", "rc", "proxy")


def select_backend(req: Requirements, backend: str = "auto") -> Backend:
    """The first backend (in PRIORITY order, or just `backend`) that meets `req`."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown GIN backend {backend!r}; choose from auto, {', '.join(BACKENDS)}")
    order = PRIORITY if backend == "auto" else (backend,)
    refusals = []
    for name in order:
        missing = req.missing(BACKENDS[name])
        if not missing:
            return BACKENDS[name]
        refusals.append(f"{name} lacks {', '.join(missing)}")
    raise CapabilityError("no GIN backend meets the requirements: " + "; ".join(refusals))


def capability_table() -> list[dict]:
    """Rows backend x capability, for docs and `commref` output."""
    rows = []
    for name in PRIORITY:
        c = BACKENDS[name].caps
        rows.append(
            {
                "backend": name,
                **{f.name: getattr(c, f.name) for f in fields(c)},
                "signals_count_writes": BACKENDS[name].signals_count_writes,
            }
        )
    return rows
