"""GIN delivery semantics, defined once.

The runtime proxy's delivery scheduler (transports/gin/scheduler.py) and the ordering
study's explorer (transports/gin/study/explorer.py) both ask the same question — given
what a source rank posted to one target and what has landed there so far, which pieces
may land next? — and both get the answer from :func:`enabled`. The runtime picks one enabled event (the
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

Also here, for the ordering explorer (transports/gin/study/) and anyone who models a
target: TargetMemory (a byte-level model of the target window, signal slots and a
counted-writes byte counter), apply() (lands one event on it) and first_disallowed()
(checks a delivery order against enabled()). They add no rule: enabled() alone says
what may land.
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
    # Local completion (flush) orders later writes (the assumption EFA GDA's tail write
    # makes). Modelled per context: the put posted right after a flush lands only after
    # every earlier put of its context has landed.
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
    def of(cls, puts: list[Put], segment_bytes: int) -> Plan:
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
        if (
            transport.flush_orders_later_writes
            and p.after_flush
            and not all(_data_landed(plan, j, landed) for j in earlier)
        ):
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
                if not all(
                    Event(j, -1) in landed
                    for j in earlier
                    if plan.puts[j].signal is not None and (plan.puts[j].signal.strong or strong_always)
                ):
                    continue
            out.append(Event(i, -1))
    return out


# --- Additions for the ordering explorer (transports/gin/study/); enabled() is unchanged. ---

SIGNAL_MASK = (1 << 64) - 1


@dataclass
class TargetMemory:
    """Byte-level model of what one source's events have done to one target.

    - window: the target window's bytes (whatever was there before, "stale", until a
      data segment writes them);
    - signals: value of each indexed signal slot, keyed ("index", i); 64-bit,
      wrapping. A VA signal adds to the little-endian 64-bit word at its window
      offset instead;
    - placed_bytes: counted-writes bookkeeping: bytes placed by data segments, a
      duplicate placement counted again (what a counter that the target NIC bumps on
      every placed write reads; it is not a count of distinct bytes);
    - landed: the events applied so far, in order.
    """

    window: bytearray
    signals: dict = field(default_factory=dict)
    placed_bytes: int = 0
    landed: list = field(default_factory=list)

    @classmethod
    def fresh(cls, nbytes: int, fill: int = 0) -> TargetMemory:
        return cls(bytearray([fill]) * nbytes)

    def copy(self) -> TargetMemory:
        return TargetMemory(bytearray(self.window), dict(self.signals), self.placed_bytes, list(self.landed))

    def signal(self, slot: int = 0) -> int:
        return self.signals.get(("index", slot), 0)


def apply(plan: Plan, event: Event, payload, mem: TargetMemory) -> None:
    """Lands `event` on `mem`: a data segment (original or duplicate) copies its bytes
    of put `event.put`'s source data `payload[event.put]` (bytes-like, put.nbytes long)
    into the window and adds its size to placed_bytes; a signal adds its value to its
    slot (indexed) or to its 64-bit word (VA). Does not check that the event is
    enabled (see first_disallowed)."""
    p = plan.puts[event.put]
    if event.is_signal:
        sig = p.signal
        kind, where = sig.target
        if kind == "index":
            key = ("index", where)
            mem.signals[key] = (mem.signals.get(key, 0) + sig.value) & SIGNAL_MASK
        elif kind == "va":
            old = int.from_bytes(mem.window[where : where + 8], "little")
            mem.window[where : where + 8] = ((old + sig.value) & SIGNAL_MASK).to_bytes(8, "little")
        else:
            raise ValueError(f"signal target kind must be 'index' or 'va', not {kind!r}")
    else:
        off, n = plan.segs[event.put][event.segment]
        src = payload[event.put]
        mem.window[off : off + n] = src[off - p.offset : off - p.offset + n]
        mem.placed_bytes += n
    mem.landed.append(event)


def first_disallowed(transport: Transport, plan: Plan, order, strong_always: bool = False) -> int | None:
    """Index of the first event of the delivery order `order` that enabled() does not
    allow at its point (or that repeats an event), None if the whole order is allowed."""
    landed: set = set()
    for k, e in enumerate(order):
        if e in landed or e not in enabled(transport, plan, landed, strong_always):
            return k
        landed.add(e)
    return None
