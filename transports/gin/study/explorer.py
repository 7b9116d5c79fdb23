"""The ordering study's explorer: which put/signal protocols are safe on which GIN
transport models.

`commref study` (report.py) proves, by exhaustive search, whether a receiver following
a protocol can ever read data that has not landed yet, for every transport model of the
matrix, and prints protocol x transport x signal strength -> safe / UNSAFE, each UNSAFE
cell with a shortest counterexample (the delivery order of data segments and signals, and what
the receiver read).

What is searched. A protocol is a small sender program (a list of semantics.Put with
signals, flushes marked on the op after them) for a message of P puts of S segments,
plus a receiver check. The wire may land the program's events (data segments, their
duplicates, signals) in exactly the orders that transports/gin/semantics.enabled()
allows -- the function the runtime proxy also lands by, so there is no second copy of
the rules here. Each state of the search is the set of landed events (a frozenset, the
canonical form for deduplication); its target memory is the byte-level model
semantics.TargetMemory after applying those events. At every reachable state the
receiver looks at what it observes (signal slots, the placed-bytes counter, flag and
header bytes) and says which bytes it reads now, if any; the state is a *wrong read*
when one of those bytes still holds its old (stale) value. A cell is safe when no
message shape within the bound (1..P puts of 1..S segments) reaches a wrong read.

Assumptions (stated once, used everywhere):
- a data segment lands atomically: one event writes all its bytes (the wire's unit of
  placement; semantics.segments cuts at multiples of the segment size, so a 16-byte
  aligned LL line never straddles two 16-byte segments);
- the receiver evaluates its check and reads in one step between two landings (an
  atomic snapshot of the target);
- one message into a window that held other bytes before (stale = 0; every payload
  byte is non-zero so that a stale byte is visible); buffer reuse across messages and
  stale duplicates from an earlier message are out of scope;
- the placed-bytes counter counts every placement, a duplicate placement again
  (semantics.TargetMemory.placed_bytes).

How the search is kept small (see docs/ordering.md for the argument):
1. Victims. A wrong read reads some byte of some data segment v that has not landed.
   So the search runs once per data segment v on the system where v never lands
   (nothing else changes: no event needs v to be absent), and looks for a state whose
   read touches stale bytes.
2. Partial-order reduction (persistent singleton sets). Landing an event never disables
   another (every condition of enabled() is "these events have landed"), and landed
   sets commute, so all events are independent. An event that cannot make the receiver
   read less -- not observed by the receiver at all (a data segment of a signal
   protocol), or observed by a receiver whose reads only grow (Protocol.monotone) -- is
   taken alone, eagerly, as a persistent set: if a wrong read is reachable before it,
   one is reachable after it. Only events that can shrink the receiver's read (the
   headers of the in-band-headers protocol: a new valid header raises the count the
   signal count must reach) are branched on. For a monotone receiver the search per
   victim is a single chain.
3. Shortest counterexample. Shapes are tried smallest first; on the first unsafe shape a
   plain breadth-first search (no reduction, all interleavings, state cap
   SHORTEST_CAP) returns a shortest delivery order to a wrong read; if the cap is hit,
   the reduced search's trace is trimmed to one from which no event can be dropped.
`search(..., por=False)` is the plain exhaustive search; the tests check that it and the
reduced search agree on every cell for small shapes.

The protocols and models are in signaling.py; `commref study --stress` runs the same
programs on the real GIN proxy (stress.py). docs/ordering.md: the matrix, reading a
trace, adding a protocol.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from commref.transports.gin import semantics as sem
from commref.transports.gin.semantics import Event, TargetMemory
from commref.transports.gin.study.signaling import (
    DEFAULT_BOUND,
    MODEL_BY_NAME,
    MODELS,
    PROTOCOL_BY_NAME,
    PROTOCOLS,
    Model,
    Program,
    Protocol,
    Shape,
    shapes,
    stale_ranges,
)

SHORTEST_CAP = 200_000  # states of the plain BFS that looks for a shortest counterexample


@dataclass
class Stats:
    states: int = 0


def _wrong(prog: Program, proto: Protocol, mem: TargetMemory) -> bool:
    return bool(stale_ranges(prog, mem, proto.receive(prog, mem)))


def _bfs_start(prog: Program, proto: Protocol) -> tuple[set, deque] | None:
    """A BFS's seen set and queue holding its first state (nothing landed, fresh memory);
    None when the receiver already reads wrong there."""
    mem0 = prog.fresh()
    if _wrong(prog, proto, mem0):
        return None
    start: frozenset = frozenset()
    return {start}, deque([(start, mem0)])


def _search_victim(prog: Program, proto: Protocol, model: Model, victim: Event, stats: Stats) -> list[Event] | None:
    """Reduced BFS of the system where `victim` never lands (see the module docstring)."""
    plan, tr, sa = prog.plan, model.transport, model.strong_always
    first = _bfs_start(prog, proto)
    if first is None:
        return []
    seen, queue = first
    while queue:
        landed, mem = queue.popleft()
        stats.states += 1
        en = [e for e in sem.enabled(tr, plan, landed, sa) if e != victim]
        if not en:
            continue
        eager = [e for e in en if not proto.may_falsify(prog, e)]
        # A persistent singleton set at a time: every eager event in turn (each stays
        # enabled and eager after the others land), then look again.
        for steps in [eager] if eager else [[e] for e in en]:
            m = mem.copy()
            for e in steps:
                sem.apply(plan, e, prog.payload, m)
                if _wrong(prog, proto, m):
                    return m.landed
            nxt = landed.union(steps)
            if nxt not in seen:
                seen.add(nxt)
                queue.append((nxt, m))
    return None


def _search_reduced(prog: Program, proto: Protocol, model: Model, stats: Stats) -> list[Event] | None:
    for i, segs in enumerate(prog.plan.segs):
        for s in range(len(segs)):
            found = _search_victim(prog, proto, model, Event(i, s), stats)
            if found is not None:
                return found
    return None


def _search_plain(
    prog: Program, proto: Protocol, model: Model, stats: Stats, max_states: int | None = None
) -> tuple[list[Event] | None, bool]:
    """Plain BFS over every reachable set of landed events: a shortest delivery order
    to a wrong read, or None; and whether the search completed within max_states."""
    plan, tr, sa = prog.plan, model.transport, model.strong_always
    first = _bfs_start(prog, proto)
    if first is None:
        return [], True
    seen, queue = first
    while queue:
        landed, mem = queue.popleft()
        stats.states += 1
        if max_states is not None and stats.states > max_states:
            return None, False
        for e in sem.enabled(tr, plan, landed, sa):
            nxt = landed | {e}
            if nxt in seen:
                continue
            seen.add(nxt)
            m = mem.copy()
            sem.apply(plan, e, prog.payload, m)
            if _wrong(prog, proto, m):
                return m.landed, True
            queue.append((nxt, m))
    return None, True


def replay(prog: Program, proto: Protocol, model: Model, events: list[Event]):
    """Applies `events` in order to a fresh target memory, checking that each one is
    allowed by semantics.enabled() at its point. Returns (memory, read, stale ranges);
    raises ValueError if the order is not allowed."""
    k = sem.first_disallowed(model.transport, prog.plan, events, model.strong_always)
    if k is not None:
        raise ValueError(f"event {k} ({prog.describe_event(events[k])}) may not land there")
    mem = prog.fresh()
    for e in events:
        sem.apply(prog.plan, e, prog.payload, mem)
    read = proto.receive(prog, mem)
    return mem, read, stale_ranges(prog, mem, read)


def _trim(prog: Program, proto: Protocol, model: Model, events: list[Event]) -> list[Event]:
    """Drops events while the order stays allowed and still ends in a wrong read."""

    def bad(evs):
        try:
            return bool(replay(prog, proto, model, evs)[2])
        except ValueError:
            return False

    events = list(events)
    changed = True
    while changed:
        changed = False
        for k in range(len(events)):
            cand = events[:k] + events[k + 1 :]
            if bad(cand):
                events, changed = cand, True
                break
    return events


def search(
    prog: Program, proto: Protocol, model: Model, por: bool = True, stats: Stats | None = None
) -> list[Event] | None:
    """A delivery order of `prog` on `model` that ends in a wrong read, or None if there
    is none (exhaustive). por=False: plain BFS without reductions."""
    stats = stats if stats is not None else Stats()
    if por:
        return _search_reduced(prog, proto, model, stats)
    return _search_plain(prog, proto, model, stats)[0]


@dataclass
class Cell:
    protocol: str
    strength: str | None
    model: str
    safe: bool
    shape: Shape | None = None  # of the counterexample
    events: list[Event] | None = None
    shortest: bool = False  # events is a shortest counterexample for its shape
    states: int = 0
    seconds: float = 0.0
    shapes_checked: int = 0

    @property
    def verdict(self) -> str:
        return "safe" if self.safe else "unsafe"

    def key(self) -> tuple:
        return (self.protocol, self.strength or "-", self.model)


def run_cell(
    proto: Protocol, strength: str | None, model: Model, bound: tuple[int, int] = DEFAULT_BOUND, por: bool = True
) -> Cell:
    t0 = time.perf_counter()
    stats = Stats()
    checked = 0
    for shape in shapes(bound):
        prog = proto.program(shape, strength, model.split_ctx)
        checked += 1
        found = search(prog, proto, model, por, stats)
        if found is None:
            continue
        short = _search_plain(prog, proto, model, Stats(), SHORTEST_CAP)[0] if por else found
        events = short if short is not None else _trim(prog, proto, model, found)
        return Cell(
            proto.name,
            strength,
            model.name,
            False,
            shape,
            list(events),
            short is not None,
            stats.states,
            time.perf_counter() - t0,
            checked,
        )
    return Cell(
        proto.name,
        strength,
        model.name,
        True,
        states=stats.states,
        seconds=time.perf_counter() - t0,
        shapes_checked=checked,
    )


def run_matrix(protocols=None, models=None, strengths=None, bound=DEFAULT_BOUND, por=True) -> list[Cell]:
    out = []
    for proto in protocols or PROTOCOLS:
        for strength in proto.strengths:
            if strengths and strength is not None and strength not in strengths:
                continue
            for model in models or MODELS:
                out.append(run_cell(proto, strength, model, bound, por))
    return out


def cell_program(cell: Cell) -> tuple[Protocol, Model, Program]:
    proto, model = PROTOCOL_BY_NAME[cell.protocol], MODEL_BY_NAME[cell.model]
    return proto, model, proto.program(cell.shape, cell.strength, model.split_ctx)
