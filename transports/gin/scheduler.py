"""The delivery scheduler: what the proxy has taken from its queue and not yet landed,
and the order in which it lands, by semantics.enabled() (the one definition).

State per link, one link per (peer, context): the puts posted there (semantics.Put
with per-link sequence numbers), their payloads and segments, the events landed so
far, and whether a flush of the context came since the link's last put.

- ordered wire: each (peer, context) is FIFO, so a put and its signal land as soon as
  they are posted (the only enabled event is always the head);
- unordered wire: events stay pending until the scheduler picks among the enabled ones
  with a seeded random generator. A link whose kernels ring doorbells (every commref
  connection) is served at its doorbells only: all that is pending lands, in an order
  drawn from the link's own random stream, so the order depends only on the seed and
  the posted sequence. Other links (raw device API use) land at random whenever
  deliver() runs, some events held back so that later ones can overtake.

The wire (wires.py) carries each landing; an observer (observer.py) hears of each.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np

from commref.transports.gin import semantics


@dataclass
class Link:
    """What this rank posted to one (peer, context) and has not fully landed yet."""

    rng: random.Random  # the link's own stream (doorbell mode)
    puts: list = field(default_factory=list)  # semantics.Put
    payloads: list = field(default_factory=list)  # np.uint8 arrays
    segs: list = field(default_factory=list)
    landed: set = field(default_factory=set)
    next_seq: int = 0
    after_flush: bool = False  # a flush of the context came since the last put here
    doorbells: int = 0  # rung so far; > 0 switches the link to doorbell mode


class DeliveryScheduler:
    """`stats["events"]` counts what landed; `trace`, when set to a dict, records per
    (peer, ctx) each landing: (put seq, segment, copy) on an unordered wire, (put seq,
    "put" or "put+signal") on an ordered one."""

    def __init__(self, transport: semantics.Transport, strong_always: bool, wire, seed: int, rank: int,
                 segment_bytes: int, stats: dict, observer=None):
        self.transport, self.strong_always, self.wire = transport, strong_always, wire
        self.seed, self.rank, self.segment_bytes = seed, rank, segment_bytes
        self.rng = random.Random(seed * 1_000_003 + rank)
        self.links: dict[tuple[int, int], Link] = {}  # (peer, ctx) -> what is pending there
        self.stats = stats
        self.observer = observer
        self.trace: dict | None = None
        self._flushed_ctx: set[int] = set()  # flushed since the last put on the context

    def link(self, peer: int, ctx: int) -> Link:
        link = self.links.get((peer, ctx))
        if link is None:
            link = self.links[(peer, ctx)] = Link(random.Random(f"{self.seed}:{self.rank}:{peer}:{ctx}"))
            link.after_flush = ctx in self._flushed_ctx
        return link

    def pending(self, peer: int | None = None) -> bool:
        """Whether anything posted (to `peer`, or to any peer) has not fully landed."""
        return any(link.puts for (p, _), link in list(self.links.items()) if peer is None or p == peer)

    # ---- what the proxy takes from its queue ----

    def flush(self, ctx: int) -> None:
        """A flush of `ctx`: marks the next put of the context on every link (the
        flush_orders_later_writes rule of semantics)."""
        for (_, c), link in self.links.items():
            if c == ctx:
                link.after_flush = True
        self._flushed_ctx.add(ctx)

    def post(self, peer: int, ctx: int, offset: int, payload: np.ndarray, signal: semantics.Signal | None) -> None:
        """A put of `payload` to window offset `offset` of `peer` on `ctx` (a bare signal:
        no bytes), with its remote action."""
        link = self.link(peer, ctx)
        seq = link.next_seq
        link.next_seq = seq + 1
        self._flushed_ctx.discard(ctx)
        after_flush, link.after_flush = link.after_flush, False
        if self.transport.ordered:  # FIFO: the only enabled event is always the head
            wire, obs = self.wire, self.observer
            if payload.size:
                wire.land_data(peer, offset, payload)
                if obs is not None:
                    obs.landed(peer, ctx, seq, None, 0)
            if signal is not None:
                wire.signal(peer, signal)
                if obs is not None:
                    obs.landed(peer, ctx, seq, -1, 0)
            if self.trace is not None:
                self.trace.setdefault((peer, ctx), []).append((seq, "put+signal" if signal else "put"))
            self.stats["events"] += 1
            return
        put = semantics.Put(ctx, seq, offset, int(payload.size), signal, after_flush)
        link.puts.append(put)
        link.payloads.append(payload)
        link.segs.append(semantics.segments(put, self.segment_bytes))

    def doorbell(self, peer: int, ctx: int) -> int:
        """Lands everything pending on (peer, ctx), at the doorbell's place in the posted
        sequence (not whenever the proxy next iterates): that is what makes the landing
        order reproducible. Switches the link to doorbell mode."""
        link = self.link(peer, ctx)
        link.doorbells += 1
        return self._deliver_link(peer, link)

    # ---- landing ----

    def deliver(self) -> int:
        """Lands some pending events of links without doorbells; returns how many."""
        landed = 0
        for (peer, _), link in self.links.items():
            if link.puts and not link.doorbells:
                landed += self._deliver_link(peer, link)
        return landed

    def _deliver_link(self, peer: int, link: Link) -> int:
        landed = 0
        plan = semantics.Plan(link.puts, link.segs)
        while True:
            choices = semantics.enabled(self.transport, plan, link.landed, self.strong_always)
            if not choices:
                break
            ev = (link.rng if link.doorbells else self.rng).choice(choices)
            self._land(peer, link, ev)
            link.landed.add(ev)
            landed += 1
            if link.doorbells:
                if ev.is_signal:
                    time.sleep(0)  # let a receiver in this process see the state right after a signal
            elif self.rng.random() < 0.5:
                break
        self._prune(link)
        self.stats["events"] += landed
        return landed

    def _land(self, peer: int, link: Link, ev: semantics.Event) -> None:
        put = link.puts[ev.put]
        if self.trace is not None:
            self.trace.setdefault((peer, put.ctx), []).append((put.seq, ev.segment, ev.copy))
        if ev.is_signal:
            self.wire.signal(peer, put.signal)
        else:
            off, n = link.segs[ev.put][ev.segment]
            rel = off - put.offset
            self.wire.land_data(peer, off, link.payloads[ev.put][rel:rel + n])
        if self.observer is not None:
            self.observer.landed(peer, put.ctx, put.seq, ev.segment, ev.copy)

    def _prune(self, link: Link) -> None:
        """Drops the fully landed prefix (originals and signals; a duplicate not placed by
        then simply never happens)."""
        k = 0
        while k < len(link.puts):
            done = all(semantics.Event(k, s) in link.landed for s in range(len(link.segs[k])))
            if link.puts[k].signal is not None:
                done = done and semantics.Event(k, -1) in link.landed
            if not done:
                break
            k += 1
        if k:
            del link.puts[:k], link.payloads[:k], link.segs[:k]
            link.landed = {semantics.Event(e.put - k, e.segment, e.copy) for e in link.landed if e.put >= k}
