"""What the ordering study explores: the put/signal protocols (the rows of its matrix:
a sender program plus a receiver check each), the transport models (the columns) and
the message shapes the sender programs post.

A protocol is a small sender program (a list of semantics.Put with signals, flushes
marked on the op after them) for a message of P puts of S segments, plus a receiver
check that says, from what a real receiver observes of the target (signal slots, the
placed-bytes counter, flag and header bytes), which bytes it reads now, if any.
explorer.py searches every delivery order of a program for a read of stale bytes;
stress.py posts the same programs through the real GIN proxy. docs/ordering.md: how to
add a protocol or a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from commref.transports.gin import semantics as sem
from commref.transports.gin.semantics import Event, Plan, Put, Signal, TargetMemory, Transport

SEG_BYTES = 64  # segment size of the data protocols: 2 segments per aligned 128-byte block
LINE_BYTES = 16  # LL line: 8 data bytes + 8 flag bytes
STALE = 0  # what the window holds before the message; no payload byte is STALE
LL_FLAG = bytes([0x5A]) * 8
HEADER_MAGIC = 0xA5
DEFAULT_BOUND = (4, 4)


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
    Model(
        "ordered/2ctx",
        "ord/2ctx",
        sem.ORDERED,
        split_ctx=True,
        doc="per-context FIFO; signals (or the last put) on a second context",
    ),
    Model("unordered", "unord", sem.UNORDERED, doc="SRD-like: operations and segments land in any order"),
    Model(
        "unordered+block128",
        "+b128",
        _unordered("unordered+block128", placement="block128"),
        doc="unordered, but in order inside each aligned 128-byte block of a put",
    ),
    Model(
        "unordered+duplicates",
        "+dup",
        _unordered("unordered+duplicates", duplicates=True),
        doc="unordered, a segment may be placed a second time",
    ),
    Model(
        "unordered+flush_orders",
        "+flush",
        _unordered("unordered+flush_orders_later_writes", flush_orders_later_writes=True),
        doc="unordered, a flush (local completion) orders the next op after earlier puts (EFA GDA tail write)",
    ),
    Model(
        "unordered/2ctx",
        "unord/2ctx",
        sem.UNORDERED,
        split_ctx=True,
        doc="unordered; signals (or the last put) on a second context",
    ),
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
            img[p.offset : p.offset + p.nbytes] = src
        self.image = bytes(img)

    def fresh(self) -> TargetMemory:
        return TargetMemory.fresh(self.window_bytes, STALE)

    def describe_op(self, i: int) -> str:
        p = self.puts[i]
        what = f"put [{p.offset},{p.offset + p.nbytes})" if p.nbytes else "bare signal"
        sig = (
            f" + {'strong' if p.signal.strong else 'weak'} signal"
            if p.signal and p.nbytes
            else (f" ({'strong' if p.signal.strong else 'weak'})" if p.signal else "")
        )
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

    def _program(self, s: _Sender, shape: Shape) -> Program:
        """What `s` posted, over the window that _data_puts' puts fill."""
        return s.program(self.segment_bytes, shape.puts * shape.units * self.segment_bytes)

    def _signalled_puts(self, shape: Shape, strength: str | None, split_ctx: bool, signalled) -> Program:
        """`shape`'s puts on context 0, those whose index `signalled` picks carrying inc 1
        on signal 0 (_Sender.put_signal: with split_ctx a bare signal on context 1)."""
        s = _Sender()
        for i, off, data in self._data_puts(shape):
            if signalled(i):
                s.put_signal(off, data, self._sig(strength), split_ctx)
            else:
                s.put(0, off, data)
        return self._program(s, shape)

    def _bare_puts(self, shape: Shape, split_ctx: bool) -> Program:
        """`shape`'s puts without signals, on context 0; with split_ctx the last on context 1."""
        s = _Sender()
        for i, off, data in self._data_puts(shape):
            s.put(1 if split_ctx and i == shape.puts - 1 else 0, off, data)
        return self._program(s, shape)

    def _whole(self, prog: Program) -> tuple[tuple[int, int], ...]:
        return ((0, prog.window_bytes),)


class _SingleSignal(Protocol):
    """A protocol whose sender raises signal 0 once: the receiver reads the whole message
    once signal 0 has counted one."""

    def receive(self, prog, mem):
        c = mem.signal(0)
        return Read(self._whole(prog), f"signal[0] = {c} >= 1") if c >= 1 else None


class SignalPerPut(Protocol):
    name = "signal-per-put"
    title = "signal per put (counting)"
    doc = "every put carries inc 1 on slot 0; the receiver waits for signal count == number of puts"

    def program(self, shape, strength, split_ctx):
        return self._signalled_puts(shape, strength, split_ctx, lambda i: True)

    def receive(self, prog, mem):
        n = sum(1 for p in prog.puts if p.nbytes)
        c = mem.signal(0)
        return Read(self._whole(prog), f"signal[0] = {c} >= {n} puts") if c >= n else None


class LastPut(_SingleSignal):
    name = "last-put"
    title = "signal on the last put"
    doc = "only the last put carries inc 1; the receiver waits for signal >= 1"

    def program(self, shape, strength, split_ctx):
        return self._signalled_puts(shape, strength, split_ctx, lambda i: i == shape.puts - 1)


class FlushSignal(_SingleSignal):
    name = "flush-signal"
    title = "flush, then signal"
    doc = (
        "puts without signals, a flush of their context, then a bare signal (the op after the flush: "
        "Put.after_flush); the receiver waits for signal >= 1"
    )

    def program(self, shape, strength, split_ctx):
        s = _Sender()
        for _, off, data in self._data_puts(shape):
            s.put(0, off, data)
        s.flush(0)
        # On another context the flush of context 0 marks nothing: semantics models the
        # flush assumption per context (a put after a flush of its own context).
        s.signal(1 if split_ctx else 0, self._sig(strength))
        return self._program(s, shape)


class CountedWrites(Protocol):
    name = "counted-writes"
    title = "counted writes"
    strengths = (None,)
    doc = (
        "puts without signals; the receiver waits until the target's placed-bytes counter reaches the "
        "message size (a counter bumped on every placement counts a duplicate again)"
    )

    def program(self, shape, strength, split_ctx):
        return self._bare_puts(shape, split_ctx)

    def receive(self, prog, mem):
        total = prog.window_bytes
        if mem.placed_bytes >= total:
            return Read(self._whole(prog), f"placed bytes = {mem.placed_bytes} >= {total}")
        return None


class Headers(Protocol):
    name = "headers"
    title = "in-band headers + counting signal"
    monotone = False
    doc = (
        "every put starts with an 8-byte header (valid = magic byte) and carries inc 1; the receiver "
        "reads the puts whose header is valid when signal count >= valid headers (DeepEP-style)"
    )

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
    doc = (
        "each 16-byte line = 8 data bytes + 8 flag bytes; the receiver reads the data of every line "
        "whose flag is set. Atomicity assumption: a 16-byte aligned line is one segment and lands whole"
    )

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
        ok = [o for o in lines if mem.window[o + 8 : o + 16] == LL_FLAG]
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
        return self._bare_puts(shape, split_ctx)

    def receive(self, prog, mem):
        last = prog.window_bytes - 1
        if mem.window[last] != STALE:
            return Read(self._whole(prog), f"last byte [{last}] = {mem.window[last]:#04x}")
        return None


PROTOCOLS: list[Protocol] = [
    SignalPerPut(),
    LastPut(),
    FlushSignal(),
    CountedWrites(),
    Headers(),
    LLFlag(),
    LLFlagTorn(),
    PollLastByte(),
]
PROTOCOL_BY_NAME = {p.name: p for p in PROTOCOLS}
