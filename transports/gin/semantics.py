"""GIN delivery semantics, defined once.

The runtime wire (transports/gin/proxy.py) and the ordering explorer
(collectives/study.py) both ask the same question — given what a source rank posted
to one target and what has landed there so far, which pieces may land next? — and
both get the answer from :func:`enabled`. The runtime picks one enabled event (the
FIFO head on an ordered wire, a seeded random choice on an unordered one); the
explorer tries every one.

Vocabulary (NCCL's GIN contract, 2.30+):
- A *context* is an ordering domain; every (context, source, target) is independent.
- A *put* moves bytes into the target's window and may carry a *remote action*: a
  signal that is strong (once visible, this put and every earlier put from this source
  to this target on the same context are visible) or weak (only its own put is).
- A bare signal is a put of zero bytes with a signal.
- A put's bytes land as *segments*; a signal lands as one event after its conditions.

Transport axes: ordered vs unordered delivery between operations; segment placement
within a put (any order, or in order inside each aligned 128-byte block); duplicate
placement of a segment; and whether a local completion (flush) orders later writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BLOCK_BYTES = 128


@dataclass(frozen=True)
class Transport:
    """How a wire places operations at the target."""

    name: str
    ordered: bool  # per (context, source, target) FIFO placement of every event
    placement: str = "any"  # "any" | "block128": in order within each aligned 128-byte block
    duplicates: bool = False  # a data segment may be placed a second time (SRD retransmit)
    # Local completion (flush) of a put orders every later write to the same target after
    # it (the assumption EFA GDA's tail write makes).
    flush_orders_later_writes: bool = False

    def __post_init__(self):
        if self.placement not in ("any", "block128"):
            raise ValueError(f"placement must be 'any' or 'block128', not {self.placement!r}")


ORDERED = Transport("ordered", ordered=True)
UNORDERED = Transport("unordered", ordered=False)


@dataclass(frozen=True)
class Signal:
    """A remote action: strong or weak, inc (value 1) or add, on a signal slot
    ("index", i) or on a 64-bit word at a window offset ("va", offset)."""

    strong: bool
    target: tuple[str, int] = ("index", 0)
    value: int = 1


@dataclass(frozen=True)
class Put:
    """One posted operation from a source to one target, as the wire sees it."""

    ctx: int
    seq: int  # position among this source's operations to this target on ctx (0, 1, ...)
    offset: int  # destination offset in the target's window
    nbytes: int  # 0 for a bare signal
    signal: Signal | None = None
    after_flush: bool = False  # a flush completed on ctx between the previous op and this one


@dataclass(frozen=True, order=True)
class Event:
    """A piece that lands: segment `segment` of put `put` (copy 1 is a duplicate), or
    the put's signal (segment == -1)."""

    put: int
    segment: int
    copy: int = 0

    @property
    def is_signal(self) -> bool:
        return self.segment < 0


def segments(put: Put, segment_bytes: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of each segment of a put: cut at multiples of segment_bytes of
    the destination address, so segments never straddle a 128-byte block when
    segment_bytes divides 128."""
    out, off, end = [], put.offset, put.offset + put.nbytes
    while off < end:
        nxt = min(end, (off // segment_bytes + 1) * segment_bytes)
        out.append((off, nxt - off))
        off = nxt
    return out


@dataclass
class Plan:
    """The events each posted put will produce (fixed at post time)."""

    puts: list[Put]
    segs: list[list[tuple[int, int]]] = field(default_factory=list)

    @classmethod
    def of(cls, puts: list[Put], segment_bytes: int) -> "Plan":
        return cls(list(puts), [segments(p, segment_bytes) for p in puts])

    def all_events(self, transport: Transport) -> list[Event]:
        out = []
        for i, p in enumerate(self.puts):
            for s in range(len(self.segs[i])):
                out.append(Event(i, s))
                if transport.duplicates:
                    out.append(Event(i, s, 1))
            if p.signal is not None:
                out.append(Event(i, -1))
        return out


def _data_landed(plan: Plan, i: int, landed) -> bool:
    return all(Event(i, s) in landed for s in range(len(plan.segs[i])))


def _put_landed(plan: Plan, i: int, landed) -> bool:
    p = plan.puts[i]
    return _data_landed(plan, i, landed) and (p.signal is None or Event(i, -1) in landed)


def _earlier(plan: Plan, i: int) -> list[int]:
    p = plan.puts[i]
    return [j for j, q in enumerate(plan.puts) if q.ctx == p.ctx and q.seq < p.seq]


def enabled(transport: Transport, plan: Plan, landed, strong_always: bool = False) -> list[Event]:
    """Events that may land next, in a fixed order.

    - ordered transport: the events of a context land in posting order (segments of a
      put in address order, then its signal);
    - unordered: segments land in any order (in order within a 128-byte block under
      "block128"), a duplicate only after its original; a weak signal once its own
      put's data has landed; a strong signal once the data of its put and of every
      earlier put on its context has landed and every earlier strong signal of the
      context has been applied (per-context sequence order, as aws-ofi-nccl does);
    - flush_orders_later_writes: a put posted after a flush lands only after every
      earlier put of its context has landed;
    - strong_always: every signal is strong (IB RC: any signal implies all earlier puts).
    """
    out = []
    for i, p in enumerate(plan.puts):
        earlier = _earlier(plan, i)
        if transport.ordered and not all(_put_landed(plan, j, landed) for j in earlier):
            continue
        if transport.flush_orders_later_writes and p.after_flush and not all(
                _data_landed(plan, j, landed) for j in earlier):
            continue
        nseg = len(plan.segs[i])
        for s in range(nseg):
            e = Event(i, s)
            if e not in landed:
                if transport.ordered and s > 0 and Event(i, s - 1) not in landed:
                    continue
                if transport.placement == "block128" and s > 0:
                    prev_off, _ = plan.segs[i][s - 1]
                    off, _ = plan.segs[i][s]
                    if prev_off // BLOCK_BYTES == off // BLOCK_BYTES and Event(i, s - 1) not in landed:
                        continue
                out.append(e)
            elif transport.duplicates and Event(i, s, 1) not in landed:
                out.append(Event(i, s, 1))
        if p.signal is not None and Event(i, -1) not in landed and _data_landed(plan, i, landed):
            strong = p.signal.strong or strong_always
            if strong:
                if not all(_data_landed(plan, j, landed) for j in earlier):
                    continue
                if not all(Event(j, -1) in landed for j in earlier
                           if plan.puts[j].signal is not None and (plan.puts[j].signal.strong or strong_always)):
                    continue
            out.append(Event(i, -1))
    return out
