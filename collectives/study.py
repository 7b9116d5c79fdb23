"""Ordering study: which put/signal protocols are safe on which GIN transport models.

`commref study` proves, by exhaustive search, whether a receiver following a protocol
can ever read data that has not landed yet, for every transport model of the matrix,
and prints protocol x transport x signal strength -> safe / UNSAFE, each UNSAFE cell with
a shortest counterexample (the delivery order of data segments and signals, and what
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

`commref study --stress` runs the same programs on the real GIN proxy
(collectives/study_stress.py). docs/ordering.md: the matrix, reading a trace, adding a
protocol.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from commref.transports.gin import semantics as sem
from commref.transports.gin.semantics import Event, Plan, Put, Signal, TargetMemory, Transport

SEG_BYTES = 64  # segment size of the data protocols: 2 segments per aligned 128-byte block
LINE_BYTES = 16  # LL line: 8 data bytes + 8 flag bytes
STALE = 0  # what the window holds before the message; no payload byte is STALE
LL_FLAG = bytes([0x5A]) * 8
HEADER_MAGIC = 0xA5
DEFAULT_BOUND = (4, 4)
SHORTEST_CAP = 200_000  # states of the plain BFS that looks for a shortest counterexample


# --------------------------------------------------------------------------- models

@dataclass(frozen=True)
class Model:
    """A column of the matrix: a wire (semantics.Transport) plus how the sender uses
    contexts. split_ctx: contexts are separate ordering domains, and the sender puts its
    signals on a second one (a put's signal becomes a bare signal on context 1 right
    after the put, which stays on context 0; a protocol without signals puts its last
    put on context 1)."""

    name: str
    short: str
    transport: Transport
    split_ctx: bool = False
    strong_always: bool = False
    doc: str = ""


def _unordered(name: str, **kw) -> Transport:
    return Transport(name, ordered=False, **kw)


MODELS: list[Model] = [
    Model("ordered", "ord", sem.ORDERED, doc="per-context FIFO placement, one context"),
    Model("ordered/2ctx", "ord/2ctx", sem.ORDERED, split_ctx=True,
          doc="per-context FIFO; signals (or the last put) on a second context"),
    Model("unordered", "unord", sem.UNORDERED, doc="SRD-like: operations and segments land in any order"),
    Model("unordered+block128", "+b128", _unordered("unordered+block128", placement="block128"),
          doc="unordered, but in order inside each aligned 128-byte block of a put"),
    Model("unordered+duplicates", "+dup", _unordered("unordered+duplicates", duplicates=True),
          doc="unordered, a segment may be placed a second time"),
    Model("unordered+flush_orders", "+flush",
          _unordered("unordered+flush_orders_later_writes", flush_orders_later_writes=True),
          doc="unordered, a flush (local completion) orders the next op after earlier puts (EFA GDA tail write)"),
    Model("unordered/2ctx", "unord/2ctx", sem.UNORDERED, split_ctx=True,
          doc="unordered; signals (or the last put) on a second context"),
]
MODEL_BY_NAME = {m.name: m for m in MODELS}


# --------------------------------------------------------------------------- programs

@dataclass(frozen=True, order=True)
class Shape:
    """A message: `puts` puts of `units` segments each (lines each for the LL protocols)."""

    puts: int
    units: int

    def __str__(self) -> str:
        return f"{self.puts}x{self.units}"


def shapes(bound: tuple[int, int]) -> list[Shape]:
    """Every shape within the bound, smallest (fewest units in all) first."""
    out = [Shape(p, u) for p in range(1, bound[0] + 1) for u in range(1, bound[1] + 1)]
    return sorted(out, key=lambda s: (s.puts * s.units, s.puts, s.units))


def data_bytes(offset: int, n: int) -> bytes:
    """Payload for window bytes [offset, offset+n): never STALE, depends on position."""
    return bytes(1 + (k * 37 + 11) % 251 for k in range(offset, offset + n))


@dataclass
class Program:
    """What the sender posts for one message (ops in posting order, each op's source
    bytes; steps: ("put", i) and ("flush", ctx) in posting order, for a runtime that
    posts the flush itself) and the window the target ends with once everything has
    landed."""

    puts: list[Put]
    payload: list[bytes]
    segment_bytes: int
    window_bytes: int
    steps: list[tuple[str, int]] | None = None
    plan: Plan = field(init=False)
    image: bytes = field(init=False)

    def __post_init__(self):
        if self.steps is None:
            self.steps = [("put", i) for i in range(len(self.puts))]
        self.plan = Plan.of(self.puts, self.segment_bytes)
        img = bytearray([STALE]) * self.window_bytes
        owner = [None] * self.window_bytes
        for i, (p, src) in enumerate(zip(self.puts, self.payload)):
            assert len(src) == p.nbytes and p.offset + p.nbytes <= self.window_bytes
            for k in range(p.offset, p.offset + p.nbytes):
                assert owner[k] is None, f"ops {owner[k]} and {i} both write byte {k}"
                owner[k] = i
            img[p.offset:p.offset + p.nbytes] = src
        self.image = bytes(img)

    def fresh(self) -> TargetMemory:
        return TargetMemory.fresh(self.window_bytes, STALE)

    def describe_op(self, i: int) -> str:
        p = self.puts[i]
        what = f"put [{p.offset},{p.offset + p.nbytes})" if p.nbytes else "bare signal"
        sig = f" + {'strong' if p.signal.strong else 'weak'} signal" if p.signal and p.nbytes else (
            f" ({'strong' if p.signal.strong else 'weak'})" if p.signal else "")
        return f"op{i}: {what}{sig}, ctx {p.ctx}{', after flush' if p.after_flush else ''}"

    def describe_event(self, e: Event, mem: TargetMemory | None = None) -> str:
        if e.is_signal:
            p = self.puts[e.put]
            kind, where = p.signal.target
            s = f"op{e.put} signal ({'strong' if p.signal.strong else 'weak'}, {kind} {where} += {p.signal.value})"
            if mem is not None and kind == "index":
                s += f" -> {mem.signal(where)}"
            return s
        off, n = self.plan.segs[e.put][e.segment]
        return f"op{e.put} seg{e.segment} [{off},{off + n}){' duplicate' if e.copy else ''}"


class _Sender:
    """Builds a program: assigns per-context sequence numbers, marks the op that follows
    a flush on its context (Put.after_flush)."""

    def __init__(self):
        self.puts: list[Put] = []
        self.payload: list[bytes] = []
        self._seq: dict[int, int] = {}
        self._flushed: set[int] = set()
        self.steps: list[tuple[str, int]] = []

    def put(self, ctx: int, offset: int, data: bytes, signal: Signal | None = None) -> None:
        after_flush = ctx in self._flushed
        self._flushed.discard(ctx)
        seq = self._seq.get(ctx, 0)
        self._seq[ctx] = seq + 1
        self.steps.append(("put", len(self.puts)))
        self.puts.append(Put(ctx, seq, offset, len(data), signal, after_flush))
        self.payload.append(bytes(data))

    def signal(self, ctx: int, signal: Signal) -> None:
        self.put(ctx, 0, b"", signal)

    def put_signal(self, offset: int, data: bytes, signal: Signal, split_ctx: bool) -> None:
        """A put carrying `signal`; with split_ctx the signal goes as a bare signal on context 1."""
        if split_ctx:
            self.put(0, offset, data)
            self.signal(1, signal)
        else:
            self.put(0, offset, data, signal)

    def flush(self, ctx: int) -> None:
        self._flushed.add(ctx)
        self.steps.append(("flush", ctx))

    def program(self, segment_bytes: int, window_bytes: int) -> Program:
        return Program(self.puts, self.payload, segment_bytes, window_bytes, self.steps)


# --------------------------------------------------------------------------- protocols

@dataclass(frozen=True)
class Read:
    """What the receiver reads at a state: byte ranges of the window, and why."""

    ranges: tuple[tuple[int, int], ...]
    why: str


def stale_ranges(prog: Program, mem: TargetMemory, read: Read | None) -> list[tuple[int, int]]:
    """The parts of `read` whose bytes are not (yet) the message's: a wrong read if any."""
    if read is None:
        return []
    out = []
    for off, n in read.ranges:
        k, end = off, off + n
        while k < end:
            if mem.window[k] != prog.image[k]:
                j = k
                while j < end and mem.window[j] != prog.image[j]:
                    j += 1
                if out and out[-1][0] + out[-1][1] == k:
                    out[-1] = (out[-1][0], out[-1][1] + j - k)
                else:
                    out.append((k, j - k))
                k = j
            else:
                k += 1
    return out


class Protocol:
    """A sender program and a receiver check. Subclasses set name, title, strengths
    (("weak", "strong") when the protocol has signals, else (None,)), segment_bytes,
    monotone (True when landing any event can only make the receiver read more: then the
    explorer takes every event eagerly), and implement program() and receive();
    may_falsify() when not monotone."""

    name = ""
    title = ""
    strengths: tuple = ("weak", "strong")
    segment_bytes = SEG_BYTES
    monotone = True
    doc = ""

    def program(self, shape: Shape, strength: str | None, split_ctx: bool) -> Program:
        raise NotImplementedError

    def receive(self, prog: Program, mem: TargetMemory) -> Read | None:
        """What the receiver reads now (None: its acceptance condition does not hold)."""
        raise NotImplementedError

    def may_falsify(self, prog: Program, event: Event) -> bool:
        """Can landing `event` make the receiver read less (or nothing) where it read
        before? False for every event of a monotone receiver."""
        return not self.monotone

    # helpers
    @staticmethod
    def _sig(strength: str | None) -> Signal:
        return Signal(strong=strength == "strong")

    def _data_puts(self, shape: Shape):
        """(index, offset, bytes) of each put of `shape`: `units` segments each."""
        size = shape.units * self.segment_bytes
        for i in range(shape.puts):
            yield i, i * size, data_bytes(i * size, size)

    def _program(self, s: "_Sender", shape: Shape) -> Program:
        """What `s` posted, over the window that _data_puts' puts fill."""
        return s.program(self.segment_bytes, shape.puts * shape.units * self.segment_bytes)

    def _read_once_signalled(self, prog: Program, mem: TargetMemory) -> Read | None:
        """The receiver of a single-signal protocol: reads the whole message once
        signal 0 has counted one."""
        c = mem.signal(0)
        return Read(self._whole(prog), f"signal[0] = {c} >= 1") if c >= 1 else None

    def _whole(self, prog: Program) -> tuple[tuple[int, int], ...]:
        return ((0, prog.window_bytes),)


class SignalPerPut(Protocol):
    name = "signal-per-put"
    title = "signal per put (counting)"
    doc = "every put carries inc 1 on slot 0; the receiver waits for signal count == number of puts"

    def program(self, shape, strength, split_ctx):
        s = _Sender()
        for _, off, data in self._data_puts(shape):
            s.put_signal(off, data, self._sig(strength), split_ctx)
        return self._program(s, shape)

    def receive(self, prog, mem):
        n = sum(1 for p in prog.puts if p.nbytes)
        c = mem.signal(0)
        return Read(self._whole(prog), f"signal[0] = {c} >= {n} puts") if c >= n else None


class LastPut(Protocol):
    name = "last-put"
    title = "signal on the last put"
    doc = "only the last put carries inc 1; the receiver waits for signal >= 1"

    def program(self, shape, strength, split_ctx):
        s = _Sender()
        for i, off, data in self._data_puts(shape):
            if i == shape.puts - 1:
                s.put_signal(off, data, self._sig(strength), split_ctx)
            else:
                s.put(0, off, data)
        return self._program(s, shape)

    def receive(self, prog, mem):
        return self._read_once_signalled(prog, mem)


class FlushSignal(Protocol):
    name = "flush-signal"
    title = "flush, then signal"
    doc = ("puts without signals, a flush of their context, then a bare signal (the op after the flush: "
           "Put.after_flush); the receiver waits for signal >= 1")

    def program(self, shape, strength, split_ctx):
        s = _Sender()
        for _, off, data in self._data_puts(shape):
            s.put(0, off, data)
        s.flush(0)
        # On another context the flush of context 0 marks nothing: semantics models the
        # flush assumption per context (a put after a flush of its own context).
        s.signal(1 if split_ctx else 0, self._sig(strength))
        return self._program(s, shape)

    def receive(self, prog, mem):
        return self._read_once_signalled(prog, mem)


class CountedWrites(Protocol):
    name = "counted-writes"
    title = "counted writes"
    strengths = (None,)
    doc = ("puts without signals; the receiver waits until the target's placed-bytes counter reaches the "
           "message size (a counter bumped on every placement counts a duplicate again)")

    def program(self, shape, strength, split_ctx):
        s = _Sender()
        for i, off, data in self._data_puts(shape):
            s.put(1 if split_ctx and i == shape.puts - 1 else 0, off, data)
        return self._program(s, shape)

    def receive(self, prog, mem):
        total = prog.window_bytes
        if mem.placed_bytes >= total:
            return Read(self._whole(prog), f"placed bytes = {mem.placed_bytes} >= {total}")
        return None


class Headers(Protocol):
    name = "headers"
    title = "in-band headers + counting signal"
    monotone = False
    doc = ("every put starts with an 8-byte header (valid = magic byte) and carries inc 1; the receiver "
           "reads the puts whose header is valid when signal count >= valid headers (DeepEP-style)")

    def program(self, shape, strength, split_ctx):
        s = _Sender()
        for i, off, data in self._data_puts(shape):
            size = len(data)
            header = bytes([HEADER_MAGIC, i + 1, size & 0xFF or 1, (size >> 8) + 1, 0x11, 0x22, 0x33, 0x44])
            s.put_signal(off, header + data[8:], self._sig(strength), split_ctx)
        return self._program(s, shape)

    def _slots(self, prog):
        return [(p.offset, p.nbytes) for p in prog.puts if p.nbytes]

    def receive(self, prog, mem):
        valid = [(off, n) for off, n in self._slots(prog) if mem.window[off] == HEADER_MAGIC]
        c = mem.signal(0)
        if valid and c >= len(valid):
            return Read(tuple(valid), f"signal[0] = {c} >= {len(valid)} valid headers")
        return None

    def may_falsify(self, prog, event):
        # A newly valid header raises the count the signals must reach.
        return not event.is_signal and event.segment == 0 and event.copy == 0


class LLFlag(Protocol):
    name = "ll-flag"
    title = "LL flag per line (16-byte line lands whole)"
    strengths = (None,)
    segment_bytes = LINE_BYTES
    doc = ("each 16-byte line = 8 data bytes + 8 flag bytes; the receiver reads the data of every line "
           "whose flag is set. Atomicity assumption: a 16-byte aligned line is one segment and lands whole")

    def program(self, shape, strength, split_ctx):
        s = _Sender()
        size = shape.units * LINE_BYTES
        for i in range(shape.puts):
            off = i * size
            lines = b"".join(data_bytes(off + k * LINE_BYTES, 8) + LL_FLAG for k in range(shape.units))
            s.put(1 if split_ctx and i == shape.puts - 1 else 0, off, lines)
        return s.program(self.segment_bytes, shape.puts * size)

    def receive(self, prog, mem):
        lines = range(0, prog.window_bytes, LINE_BYTES)
        ok = [o for o in lines if mem.window[o + 8:o + 16] == LL_FLAG]
        if ok:
            return Read(tuple((o, 8) for o in ok), f"{len(ok)} of {len(lines)} line flags set")
        return None


class LLFlagTorn(LLFlag):
    name = "ll-flag-8B"
    title = "LL flag per line, 8-byte placement (a line may tear)"
    segment_bytes = 8
    doc = "as ll-flag, but the wire places 8-byte segments: a line's data and flag are two segments"


class PollLastByte(Protocol):
    name = "poll-last-byte"
    title = "poll the last byte of the payload"
    strengths = (None,)
    doc = "puts without signals; the receiver polls the payload's last byte and reads all once it changes"

    def program(self, shape, strength, split_ctx):
        s = _Sender()
        for i, off, data in self._data_puts(shape):
            s.put(1 if split_ctx and i == shape.puts - 1 else 0, off, data)
        return self._program(s, shape)

    def receive(self, prog, mem):
        last = prog.window_bytes - 1
        if mem.window[last] != STALE:
            return Read(self._whole(prog), f"last byte [{last}] = {mem.window[last]:#04x}")
        return None


PROTOCOLS: list[Protocol] = [SignalPerPut(), LastPut(), FlushSignal(), CountedWrites(), Headers(), LLFlag(),
                             LLFlagTorn(), PollLastByte()]
PROTOCOL_BY_NAME = {p.name: p for p in PROTOCOLS}


# --------------------------------------------------------------------------- search

@dataclass
class Stats:
    states: int = 0


def _wrong(prog: Program, proto: Protocol, mem: TargetMemory) -> bool:
    return bool(stale_ranges(prog, mem, proto.receive(prog, mem)))


def _search_victim(prog: Program, proto: Protocol, model: Model, victim: Event, stats: Stats) -> list[Event] | None:
    """Reduced BFS of the system where `victim` never lands (see the module docstring)."""
    plan, tr, sa = prog.plan, model.transport, model.strong_always
    mem0 = prog.fresh()
    if _wrong(prog, proto, mem0):
        return []
    start: frozenset = frozenset()
    seen = {start}
    queue = deque([(start, mem0)])
    while queue:
        landed, mem = queue.popleft()
        stats.states += 1
        en = [e for e in sem.enabled(tr, plan, landed, sa) if e != victim]
        if not en:
            continue
        eager = [e for e in en if not proto.may_falsify(prog, e)]
        # A persistent singleton set at a time: every eager event in turn (each stays
        # enabled and eager after the others land), then look again.
        for steps in ([eager] if eager else [[e] for e in en]):
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


def _search_plain(prog: Program, proto: Protocol, model: Model, stats: Stats,
                  max_states: int | None = None) -> tuple[list[Event] | None, bool]:
    """Plain BFS over every reachable set of landed events: a shortest delivery order
    to a wrong read, or None; and whether the search completed within max_states."""
    plan, tr, sa = prog.plan, model.transport, model.strong_always
    mem0 = prog.fresh()
    if _wrong(prog, proto, mem0):
        return [], True
    start: frozenset = frozenset()
    seen = {start}
    queue = deque([(start, mem0)])
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
            cand = events[:k] + events[k + 1:]
            if bad(cand):
                events, changed = cand, True
                break
    return events


def search(prog: Program, proto: Protocol, model: Model, por: bool = True,
           stats: Stats | None = None) -> list[Event] | None:
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


def run_cell(proto: Protocol, strength: str | None, model: Model, bound: tuple[int, int] = DEFAULT_BOUND,
             por: bool = True) -> Cell:
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
        return Cell(proto.name, strength, model.name, False, shape, list(events), short is not None,
                    stats.states, time.perf_counter() - t0, checked)
    return Cell(proto.name, strength, model.name, True, states=stats.states, seconds=time.perf_counter() - t0,
                shapes_checked=checked)


def run_matrix(protocols=None, models=None, strengths=None, bound=DEFAULT_BOUND, por=True) -> list[Cell]:
    out = []
    for proto in protocols or PROTOCOLS:
        for strength in proto.strengths:
            if strengths and strength is not None and strength not in strengths:
                continue
            for model in models or MODELS:
                out.append(run_cell(proto, strength, model, bound, por))
    return out


# --------------------------------------------------------------------------- output

def cell_program(cell: Cell) -> tuple[Protocol, Model, Program]:
    proto, model = PROTOCOL_BY_NAME[cell.protocol], MODEL_BY_NAME[cell.model]
    return proto, model, proto.program(cell.shape, cell.strength, model.split_ctx)


def trace_lines(cell: Cell) -> list[str]:
    """The counterexample of an unsafe cell: the ops, the delivery order, what was read."""
    proto, _, prog = cell_program(cell)
    unit = "lines" if isinstance(proto, LLFlag) else "segments"
    unit = unit if cell.shape.units > 1 else unit[:-1]
    head = (f"{cell.protocol} [{cell.strength or '-'}] on {cell.model}: UNSAFE, message of "
            f"{cell.shape.puts} put{'s' if cell.shape.puts > 1 else ''} x {cell.shape.units} {unit} "
            f"({prog.segment_bytes}-byte segments)")
    out = [head]
    out += ["  posted: " + "; ".join(prog.describe_op(i) for i in range(len(prog.puts)))]
    mem = prog.fresh()
    for k, e in enumerate(cell.events, 1):
        sem.apply(prog.plan, e, prog.payload, mem)
        out.append(f"  {k}. {prog.describe_event(e, mem)}")
    read = proto.receive(prog, mem)
    stale = stale_ranges(prog, mem, read)
    out.append(f"  receiver: {read.why}; reads " + ", ".join(f"[{o},{o + n})" for o, n in read.ranges))
    out.append("  wrong: stale bytes " + ", ".join(f"[{o},{o + n})" for o, n in stale)
               + f" (e.g. byte {stale[0][0]} = {mem.window[stale[0][0]]:#04x}, message has "
               f"{prog.image[stale[0][0]]:#04x})")
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
    return (f"{cell.shape}: {' '.join(evs)} | {read.why} -> stale "
            + ",".join(f"[{o},{o + n})" for o, n in stale))


def cell_json(cell: Cell) -> dict:
    d = {"protocol": cell.protocol, "strength": cell.strength, "transport": cell.model, "verdict": cell.verdict,
         "states": cell.states, "seconds": round(cell.seconds, 4), "shapes_checked": cell.shapes_checked}
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
            "read": {"why": read.why, "ranges": [[o, o + n] for o, n in read.ranges],
                     "stale": [[o, o + n] for o, n in stale_ranges(prog, mem, read)]},
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


def format_matrix(cells: list[Cell]) -> str:
    models = [m for m in MODELS if any(c.model == m.name for c in cells)]
    widths = [max(len(m.short), 6) + 2 for m in models]
    lines = matrix_lines(cells, models, lambda c: "-" if c is None else ("safe" if c.safe else "UNSAFE"), widths)
    lines.append("")
    lines += [f"  {m.short:<11} {m.name}: {m.doc}" for m in models]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--protocol", nargs="+", choices=list(PROTOCOL_BY_NAME), default=None,
                   help="protocols (default: all)")
    p.add_argument("--transport", nargs="+", choices=list(MODEL_BY_NAME), default=None,
                   help="transport models (default: all)")
    p.add_argument("--strength", nargs="+", choices=["weak", "strong"], default=None,
                   help="signal strengths (default: both)")
    p.add_argument("--bound", default=f"{DEFAULT_BOUND[0]}x{DEFAULT_BOUND[1]}", metavar="PxS",
                   help="largest message: P puts of S segments (lines for LL); every smaller shape is checked too "
                        "(default %(default)s)")
    p.add_argument("--no-por", action="store_true", help="plain exhaustive search, no reductions (slow)")
    p.add_argument("--traces", action="store_true", help="print every counterexample in full")
    p.add_argument("--json", action="store_true", help="JSON output")
    p.add_argument("--stress", action="store_true",
                   help="also run every selected cell on the real GIN proxy (2 ranks: threads, or 2 MPI processes with --np 2 "
                        "or under mpiexec) across seeds and "
                        "report corrupted messages per cell (messages of the bound's largest shape)")
    p.add_argument("--seeds", type=int, default=10, help="proxy seeds per cell for --stress (default %(default)s)")
    p.add_argument("--messages", type=int, default=5, help="messages per seed for --stress (default %(default)s)")


def parse_bound(text: str) -> tuple[int, int]:
    try:
        a, b = text.lower().split("x")
        bound = (int(a), int(b))
    except ValueError:
        raise SystemExit(f"commref study: --bound wants PxS (e.g. 4x4), not {text!r}") from None
    if min(bound) < 1:
        raise SystemExit("commref study: --bound needs at least 1x1")
    return bound


def run(args) -> int:
    bound = parse_bound(args.bound)
    protocols = [PROTOCOL_BY_NAME[n] for n in args.protocol] if args.protocol else None
    models = [MODEL_BY_NAME[n] for n in args.transport] if args.transport else None
    t0 = time.perf_counter()
    cells = run_matrix(protocols, models, args.strength, bound, por=not args.no_por)
    elapsed = time.perf_counter() - t0
    stress = None
    if args.stress:
        from . import study_stress

        if args.seeds < 1 or args.messages < 1:
            raise SystemExit("commref study: --seeds and --messages must be at least 1")
        t1 = time.perf_counter()
        stress = study_stress.run_stress(protocols, models, args.strength, bound, args.seeds, args.messages,
                                         {c.key(): c.verdict for c in cells},
                                         network=getattr(args, "network", None))
        stress_seconds = time.perf_counter() - t1
    if args.json:
        out = {"bound": {"puts": bound[0], "units": bound[1]}, "seconds": round(elapsed, 3),
               "cells": [cell_json(c) for c in cells]}
        if stress is not None:
            out["stress"] = {"seeds": args.seeds, "messages": args.messages, "seconds": round(stress_seconds, 3),
                             "cells": [study_stress.stress_json(c) for c in stress]}
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0 if stress is None or all(c.agrees for c in stress) else 1
    print(format_matrix(cells))
    unsafe = [c for c in cells if not c.safe]
    full = args.traces or len(unsafe) <= 3
    if unsafe and not full:
        print("\nCounterexamples (shortest for the smallest unsafe message; opK.sN = segment N of op K, "
              "opK.sig = its signal; --traces for the full form):")
    for c in unsafe:
        if full:
            print("\n" + "\n".join(trace_lines(c)))
        else:
            print(f"  {c.protocol} [{c.strength or '-'}] @ {c.model} {trace_short(c)}")
    print(f"\n# {len(cells)} cells, {len(unsafe)} unsafe, bound {bound[0]}x{bound[1]}, "
          f"{sum(c.states for c in cells)} states, {elapsed:.1f} s")
    if stress is not None:
        print("\n" + study_stress.format_stress(stress, args.seeds, args.messages, bound))
        print(f"# stress: {stress_seconds:.1f} s")
        return 0 if all(c.agrees for c in stress) else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="commref study")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
