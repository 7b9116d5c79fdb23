"""A lossy link under the GIN wires, and the reliability layer above it (SRD-like).

Where it sits: the delivery scheduler (scheduler.py) decides what lands when, by the
wire model (semantics.enabled(): FIFO on the ordered wire, SRD's disorder on the
unordered one), and hands each landing to the wire in that order. With faults on
(GinOptions.fault, `--fault drop=0.05,dup=0.05,delay=0.05`), ReliableWire stands
between the two:

    scheduler -> ReliableWire: sender half (sequence numbers, retransmission)
                 -> lossy link (seeded drops, duplicates, delays)
                 -> receiver half (duplicate detection, reorder buffer, acks)
                 -> the real wire (ShmWire, MpiWire): the landing happens

- Packets: every landing (a data segment, a signal) is one packet, numbered per
  (peer, context) from 0. Its bytes are copied when it is sent, so the source the
  proxy copied from is never read again.
- The lossy link: each transmission is dropped with probability `drop`; otherwise it
  arrives once, and a second copy arrives too with probability `dup`; each arriving copy
  is late with probability `delay`, by a uniform 0..MAX_DELAY_S, so later packets overtake it.
  The draws come from one stream seeded by (seed, rank): a run's faults are a function
  of its seed and of the sequence of packets.
- Receiver: a copy whose number was delivered before, or is already waiting in the
  reorder buffer, is a duplicate and is dropped (`dup_dropped`): a signal never counts
  twice. The first copy is acknowledged as it arrives (selectively, per packet, as SRD
  does; the ack reaches the sender at once and is not lost) and waits in the buffer
  until every lower number of its link has been delivered; then the buffer lands in
  number order.
- Sender: a packet not acknowledged RETRANSMIT_S after its last transmission is sent
  again (`retransmits`), as often as needed. The proxy's own pace can make that late
  for a packet that was not lost: the receiver then drops the second copy as a
  duplicate, as on a real network.

So what lands is exactly the scheduler's order, per (peer, context): loss, duplication
and delay change when things land, never what or in which order, and everything the
conformance test checks against semantics.py holds with faults on. A strong signal
still covers every earlier put of its link because nothing of the link lands before
the earlier packets have. The receiver's half is simulated in the sender's proxy: the
proxy is the only writer of its links, so the receiver's per-link state (the next
number due, the reorder buffer) lives beside the sender's; on network mpi the real
wire under it is MPI, which is reliable and ordered, and carries the delivered
landings.

Gets and their replies do not go through the lossy link (a get is a round trip the
proxy completes before it consumes the descriptor).

`stats` (merged into the proxy's): packets, dropped, duplicated, delayed,
retransmits, dup_dropped.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from dataclasses import dataclass, field

import numpy as np

from commref.transports.gin.wires import Wire
from commref.transports.option_types import OptionError

STATS = ("packets", "dropped", "duplicated", "delayed", "retransmits", "dup_dropped")
RETRANSMIT_S = 5e-3  # a packet not acknowledged this long after it was sent is sent again
MAX_DELAY_S = 3e-3  # a late copy arrives up to this long after it was sent
FAULT_KINDS = ("drop", "dup", "delay")


@dataclass(frozen=True)
class FaultSpec:
    """Probabilities per transmission (drop) and per arriving copy (dup, delay), in [0, 1)."""

    drop: float = 0.0
    dup: float = 0.0
    delay: float = 0.0

    def __post_init__(self) -> None:
        for kind in FAULT_KINDS:
            p = getattr(self, kind)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
                raise OptionError(f"fault {kind} must be a probability in [0, 1), not {p!r}")
            object.__setattr__(self, kind, float(p))

    @classmethod
    def parse(cls, value) -> FaultSpec:
        """A FaultSpec from "drop=0.05,dup=0.05,delay=0.05" (any subset; "" or "none":
        no faults), a dict of those keys, or a FaultSpec; OptionError in one line."""
        if isinstance(value, FaultSpec):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(FAULT_KINDS))
            if unknown:
                raise OptionError(f"unknown fault {unknown[0]!r}; faults: {', '.join(FAULT_KINDS)}")
            return cls(**value)
        text = str(value).strip().lower()
        if text in ("", "none", "0"):
            return cls()
        fields = {}
        for item in text.split(","):
            key, eq, number = item.partition("=")
            key = key.strip()
            if key not in FAULT_KINDS or not eq:
                raise OptionError(
                    f"fault must look like drop=0.05,dup=0.05,delay=0.05 (any of "
                    f"{', '.join(FAULT_KINDS)}), not {value!r}"
                )
            try:
                fields[key] = float(number)
            except ValueError:
                raise OptionError(f"fault {key} must be a probability in [0, 1), not {number.strip()!r}") from None
        return cls(**fields)

    @property
    def active(self) -> bool:
        return any(getattr(self, k) for k in FAULT_KINDS)

    def __str__(self) -> str:
        return ",".join(f"{k}={getattr(self, k):g}" for k in FAULT_KINDS if getattr(self, k)) or "none"


def totals(stats: list[dict]) -> dict:
    """The lossy link's and the reliability layer's counts, summed over proxies' stats."""
    return {k: sum(s.get(k, 0) for s in stats) for k in STATS}


def summary(stats: list[dict]) -> str:
    """totals() in words."""
    t = totals(stats)
    return (
        f"{t['packets']} packets: {t['dropped']} dropped, {t['duplicated']} duplicated, {t['delayed']} delayed; "
        f"{t['retransmits']} retransmitted, {t['dup_dropped']} duplicates dropped"
    )


@dataclass
class _Link:
    """One (peer, context): the sender's and the receiver's state."""

    next_seq: int = 0  # the sender's next packet number
    unacked: dict = field(default_factory=dict)  # seq -> [packet, last sent]
    next_due: int = 0  # the receiver's next number to deliver
    waiting: dict = field(default_factory=dict)  # the receiver's reorder buffer: seq -> packet


class ReliableWire(Wire):
    """`inner` (a wire) behind a lossy link and a reliability layer (module docstring)."""

    def __init__(self, inner: Wire, faults: FaultSpec, seed: int, rank: int, stats: dict):
        self.inner, self.faults, self.rank = inner, faults, rank
        self.name = inner.name
        self.rng = random.Random(f"faults:{seed}:{rank}")
        self.links: dict[tuple[int, int], _Link] = {}
        self.arriving: list = []  # heap of (arrival time, tiebreak, peer, ctx, seq, packet)
        self._tiebreak = itertools.count()
        self.stats = stats
        self.log: list | None = None  # set to a list: (peer, ctx, seq) of each packet as it lands
        for key in STATS:
            stats.setdefault(key, 0)

    # ---- the scheduler's side: what must land, in this order ----

    def land_data(self, peer: int, offset: int, data: np.ndarray, ctx: int = 0) -> None:
        self._send(peer, ctx, ("data", offset, np.array(data, dtype=np.uint8, copy=True)))

    def signal(self, peer: int, sig, ctx: int = 0) -> None:
        self._send(peer, ctx, ("signal", sig))

    def get(self, peer: int, src: int, dst: int, nbytes: int, idle) -> None:
        self.inner.get(peer, src, dst, nbytes, idle)

    def progress(self) -> int:
        now = time.monotonic()
        handled = self.inner.progress() + self._arrivals(now)
        for (peer, ctx), link in self.links.items():
            for seq, entry in link.unacked.items():
                if now - entry[1] > RETRANSMIT_S:
                    self.stats["retransmits"] += 1
                    entry[1] = now
                    self._transmit(peer, ctx, seq, entry[0], now)
        return handled

    def in_flight(self, peer: int | None = None) -> bool:
        return any(link.unacked or link.waiting for (p, _), link in self.links.items() if peer is None or p == peer)

    def drained(self) -> bool:
        """Every packet sent has landed (a duplicate still in flight would be dropped)."""
        return not any(link.unacked or link.waiting for link in self.links.values()) and self.inner.drained()

    # ---- sender ----

    def _send(self, peer: int, ctx: int, packet: tuple) -> None:
        link = self.links.get((peer, ctx))
        if link is None:
            link = self.links[(peer, ctx)] = _Link()
        seq = link.next_seq
        link.next_seq += 1
        now = time.monotonic()
        link.unacked[seq] = [packet, now]
        self.stats["packets"] += 1
        self._transmit(peer, ctx, seq, packet, now)
        self._arrivals(now)  # what arrives now lands now: without faults, the wire's own order and timing

    def _transmit(self, peer: int, ctx: int, seq: int, packet: tuple, now: float) -> None:
        """One transmission over the lossy link: dropped, or one or two copies arriving."""
        f, rng = self.faults, self.rng
        if rng.random() < f.drop:
            self.stats["dropped"] += 1
            return
        copies = 1
        if rng.random() < f.dup:
            self.stats["duplicated"] += 1
            copies = 2
        for _ in range(copies):
            at = now
            if rng.random() < f.delay:
                self.stats["delayed"] += 1
                at += rng.uniform(0, MAX_DELAY_S)
            heapq.heappush(self.arriving, (at, next(self._tiebreak), peer, ctx, seq, packet))

    # ---- receiver ----

    def _arrivals(self, now: float) -> int:
        """Every copy due by `now` arrives; returns the packets landed."""
        landed = 0
        while self.arriving and self.arriving[0][0] <= now:
            _, _, peer, ctx, seq, packet = heapq.heappop(self.arriving)
            landed += self._arrive(peer, ctx, seq, packet)
        return landed

    def _arrive(self, peer: int, ctx: int, seq: int, packet: tuple) -> int:
        """One arriving copy: dropped as a duplicate, or buffered and every packet now in
        order delivered (landed on the inner wire) and acknowledged."""
        link = self.links[(peer, ctx)]
        if seq < link.next_due or seq in link.waiting:
            self.stats["dup_dropped"] += 1
            return 0
        link.waiting[seq] = packet
        link.unacked.pop(seq, None)  # the ack
        delivered = 0
        while link.next_due in link.waiting:
            kind, *rest = link.waiting.pop(link.next_due)
            if self.log is not None:
                self.log.append((peer, ctx, link.next_due))
            if kind == "data":
                self.inner.land_data(peer, rest[0], rest[1], ctx)
            else:
                self.inner.signal(peer, rest[0], ctx)
            link.next_due += 1
            delivered += 1
        return delivered
