"""The delivery scheduler: what the proxy has taken from its queue and not yet landed,
and the order in which it lands, by semantics.enabled() (the one definition).

State per link, one link per (peer, context): the puts posted there (semantics.Put
with per-link sequence numbers), their payloads and segments, the events landed so
far, whether a flush of the context came since the link's last put, and (doorbell
mode) the puts held back.

- ordered wire: each (peer, context) is FIFO, so a put and its signal land as soon as
  they are posted (the only enabled event is always the head): every context of a peer
  then lands in the order the proxy takes it, a legal refinement of per-context FIFO;
- ordered wire, independent contexts (GinOptions.independent_contexts): contexts are
  separate ordering domains, as queue pairs on InfiniBand RC are, and the scheduler is
  an adversary across them while each (peer, context) stays FIFO. When an op is posted
  on a link that holds nothing, and its peer has been posted on another context before,
  a stream of its own (seed, rank, peer, context, seq) decides: with probability
  CONTEXT_HOLD_PROBABILITY the link is held: the op's first k of its segments land (k
  drawn from 0 ..< its segments; 0 for a bare signal), the rest of it, and every later
  op of the link, wait in the link's FIFO. A held link is released, its FIFO landing in
  posted order (the held op's remaining segments, then each op whole), when
  1. expired: 1..CONTEXT_HOLD_OPS (drawn with the hold) later ops to the same peer on
     other contexts have landed past it (each right after the op that expires it lands);
  2. forced: a get on the link (it reads after the context's earlier puts);
  3. idle: the proxy's queue stayed empty for IDLE_RELEASE_S (release_held(): the
     sender may wait on a held op, with nothing more to post), the liveness rule of the
     unordered wire's held puts; the held links land one after another, in an order
     drawn from the scheduler's idle stream (seed, rank). A flush does not release a hold (it promises that
     sources are reusable, not remote visibility; sources are copied when taken).
  No sleep decides an order: which ops are held, where a held op is cut and how many
  ops overtake it are functions of the seed and the posted sequence (each op's draw is
  its own), up to the idle releases, which depend on timing: a link released idle is
  free to be held again at its next op, where it would otherwise still hold.
- unordered wire, links whose kernels ring doorbells (every commref communicator's:
  `batched`): the link is served at its doorbells from its first put, and it is as
  adversarial as SRD across them; nothing lands between a put and its doorbell. At
  doorbell d of a link, with a random stream of its own (seed, rank, peer, context, d):
  1. each put posted since the previous doorbell is held back with probability
     HOLD_PROBABILITY, for 1..HOLD_DOORBELLS later doorbells of the link (its bound);
     a held put lands nothing (neither segments nor signal) until it is released;
  2. a held put is released (forced) when its bound expires, or when a later put of
     its link that is not held needs it: a strong signal (enabled() requires every
     earlier put's data and strong signal first) or, where the backend promises that
     local completion orders later writes, a put posted after a flush. Releasing a
     strong (or after-flush) held put releases every earlier held put too. A put that
     would be forced at its own doorbell is not held;
  3. the forced held puts land first, in sequence order, each put's events in an order
     drawn from that put's own random stream (seed, rank, peer, context, seq); then
     the doorbell's batch (the puts posted since the previous doorbell that are not
     held) lands, in an order drawn from the doorbell's stream among the events
     enabled() allows.
  Liveness: the sender of a held put may post nothing more on its link (it often
  waits for a credit that depends on this very put's signal), so the proxy calls
  release_held() when its queue has stayed empty for IDLE_RELEASE_S: every held put
  lands then, in sequence order, each in its own pre-drawn order (as when forced).
- unordered wire, links of a scheduler that is not `batched` (the ordering study's
  stress, tests driving a proxy by hand): events land at random whenever deliver()
  runs, from the scheduler's one stream, some held back so that later ones can
  overtake, until the link's first doorbell, which switches it to the above.

Every landing is an event enabled() allows at that point (tests/test_gin_conformance.py
replays the trace against semantics.py).

Reproducible (a function of the seed and the posted sequence of the link only, run
after run, on either network): which puts a doorbell holds and for how many
doorbells; the order of each doorbell's batch; the order of each held put's own
events; and the fact that a held put lands no later than the doorbell that forces it.
Timing-dependent: whether a held put lands at an idle release (the proxy found its
queue empty for IDLE_RELEASE_S, which depends on how fast the kernels post) or at
the doorbell that forces it, i.e. where its block of events sits among the link's
later batches; the interleaving of different links; and what a receiver reads, which
depends on when it looks. Links served by deliver() (not `batched`, before their first
doorbell) are not reproducible.

The trace (`trace`, a dict, when set) records per (peer, ctx), in the order they
happen: ("post", seq, offset, nbytes, signal), ("flush",), ("doorbell", d),
("hold", seq, until_doorbell), ("release", seq, "expired"|"forced"|"idle") (independent
contexts: ("hold", seq, ops) for each op that waits in a held link's FIFO, ops: how many
more landings of other contexts release it),
("seg", seq, segment, copy) (a segment placed; copy 1: a duplicate), ("data", seq)
(ordered wire: a put's whole data in one piece), ("signal", seq) (a signal applied);
the proxy adds ("counter", seq, index) (a counter bumped) and ("get", src, dst,
nbytes) (a get landed).

The wire (wires.py) carries each landing; an observer (observer.py) hears of each.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np

from commref.transports.gin import semantics

HOLD_PROBABILITY = 0.25  # of each put posted on a doorbell link (unordered wire)
HOLD_DOORBELLS = 4  # a held put is released at the latest this many doorbells of its link later
IDLE_RELEASE_S = 1e-3  # the proxy releases every held put once its queue has stayed empty this long
CONTEXT_HOLD_PROBABILITY = 0.25  # of each op posted on a link that holds nothing (independent contexts)
CONTEXT_HOLD_OPS = 4  # a held link is released at the latest this many landings of other contexts later


@dataclass
class Link:
    """What this rank posted to one (peer, context) and has not fully landed yet."""

    name: str  # "seed:rank:peer:ctx", the root of the link's random streams
    rng: random.Random  # the scheduler's stream (deliver())
    puts: list = field(default_factory=list)  # semantics.Put
    payloads: list = field(default_factory=list)  # np.uint8 arrays
    segs: list = field(default_factory=list)
    landed: set = field(default_factory=set)
    next_seq: int = 0
    after_flush: bool = False  # a flush of the context came since the last put here
    batched: bool = False  # served at doorbells from the first put (else from the first doorbell)
    doorbells: int = 0  # rung so far
    held: dict = field(default_factory=dict)  # put seq -> the doorbell by which it is released
    batch_start: int = 0  # the first put posted since the previous doorbell
    # Independent contexts (ordered wire): the link's held FIFO, one [seq, offset,
    # payload, signal, segments landed] per op, and how many more landings of the peer's
    # other contexts release it.
    queued: list = field(default_factory=list)
    hold_for: int = 0

    @property
    def at_doorbells(self) -> bool:
        """Whether the link lands only at doorbells (else deliver() lands it at random)."""
        return self.batched or self.doorbells > 0


class DeliveryScheduler:
    """`stats["events"]` counts what landed; `trace`, when set to a dict, records per
    (peer, ctx) what was posted and each landing (module docstring). `batched`: the
    kernels ring a doorbell after every batch they post (GinArgs.doorbells), so every
    link is served at doorbells from its first put. `independent_contexts` (ordered wire
    only; ignored on the unordered one, whose links are independent anyway): the
    cross-context adversary of the module docstring."""

    def __init__(
        self,
        transport: semantics.Transport,
        strong_always: bool,
        wire,
        seed: int,
        rank: int,
        segment_bytes: int,
        stats: dict,
        observer=None,
        batched: bool = False,
        independent_contexts: bool = False,
    ):
        self.transport, self.strong_always, self.wire = transport, strong_always, wire
        self.batched = batched
        self.independent = independent_contexts and transport.ordered
        self._idle_rng = random.Random(f"{seed}:{rank}:idle")  # the order of held links at an idle release
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
            link = self.links[(peer, ctx)] = Link(
                f"{self.seed}:{self.rank}:{peer}:{ctx}", self.rng, batched=self.batched
            )
            link.after_flush = ctx in self._flushed_ctx
        return link

    def pending(self, peer: int | None = None) -> bool:
        """Whether anything posted (to `peer`, or to any peer) has not fully landed."""
        return any(link.puts or link.queued for (p, _), link in list(self.links.items()) if peer is None or p == peer)

    def held(self) -> bool:
        """Whether some put is held back (doorbell mode, unordered wire; a held link,
        independent contexts)."""
        return any(link.held or link.queued for link in list(self.links.values()))

    def record(self, peer: int, ctx: int, entry: tuple) -> None:
        if self.trace is not None:
            self.trace.setdefault((peer, ctx), []).append(entry)

    # ---- what the proxy takes from its queue ----

    def flush(self, ctx: int) -> None:
        """A flush of `ctx`: marks the next put of the context on every link (the
        flush_orders_later_writes rule of semantics)."""
        for (peer, c), link in self.links.items():
            if c == ctx:
                link.after_flush = True
                self.record(peer, c, ("flush",))
        self._flushed_ctx.add(ctx)

    def post(self, peer: int, ctx: int, offset: int, payload: np.ndarray, signal: semantics.Signal | None) -> int:
        """A put of `payload` to window offset `offset` of `peer` on `ctx` (a bare signal:
        no bytes), with its remote action; returns its sequence number on the link."""
        link = self.link(peer, ctx)
        seq = link.next_seq
        link.next_seq = seq + 1
        self._flushed_ctx.discard(ctx)
        after_flush, link.after_flush = link.after_flush, False
        if self.trace is not None:
            self.record(peer, ctx, ("post", seq, offset, int(payload.size), signal))
        if self.transport.ordered:  # FIFO: the only enabled event is always the head
            if self.independent:
                self._post_independent(peer, ctx, link, [seq, offset, payload, signal, 0])
            else:
                self._land_ordered(peer, ctx, [seq, offset, payload, signal, 0])
            return seq
        put = semantics.Put(ctx, seq, offset, int(payload.size), signal, after_flush)
        link.puts.append(put)
        link.payloads.append(payload)
        link.segs.append(semantics.segments(put, self.segment_bytes))
        return seq

    def doorbell(self, peer: int, ctx: int) -> int:
        """Serves doorbell d of (peer, ctx) at its place in the posted sequence (not
        whenever the proxy next iterates): holds some of the puts posted since the
        previous doorbell, lands the held puts this doorbell forces, then the rest of
        the batch (module docstring). Switches the link to doorbell mode."""
        link = self.link(peer, ctx)
        link.doorbells += 1
        d = link.doorbells
        self.record(peer, ctx, ("doorbell", d))
        if not link.puts:
            link.batch_start = link.next_seq
            return 0
        rng = random.Random(f"{link.name}:d{d}")
        held = link.held
        batch = [p.seq for p in link.puts if p.seq >= link.batch_start]  # posted since the previous doorbell
        link.batch_start = link.next_seq
        started = {link.puts[e.put].seq for e in link.landed}  # not batched: deliver() may have begun
        hold = {}
        for seq in batch:  # one draw per put, whatever is pending: the holds depend on the posted sequence only
            if rng.random() < HOLD_PROBABILITY:
                until = d + rng.randint(1, HOLD_DOORBELLS)
                if seq not in started:
                    hold[seq] = until
        # What is released now: expired holds, and whatever a put that lands now needs first.
        released = {seq for seq, until in held.items() if until <= d}
        by_seq = {p.seq: p for p in link.puts}
        while True:
            landing = [s for s in batch if s not in hold] + sorted(released)
            needs = max((s for s in landing if self._forcing(by_seq[s])), default=-1)
            more = {s for s in held if s < needs} - released
            newly = {s for s in hold if s < needs}
            if not more and not newly:
                break
            released |= more
            for s in newly:  # forced at its own doorbell: not held after all
                del hold[s]
        for seq, until in hold.items():
            self.record(peer, ctx, ("hold", seq, until))
        landed = 0
        for seq in sorted(released):
            self.record(peer, ctx, ("release", seq, "expired" if held.pop(seq) <= d else "forced"))
            landed += self._land_put(peer, link, seq)
        held.update(hold)
        now = {s for s in batch if s not in hold}
        landed += self._deliver_link(peer, link, rng, lambda i: link.puts[i].seq in now)
        self._prune(link)
        return landed

    def release_held(self) -> int:
        """Lands every held put (the proxy's queue stayed empty: the sender may be waiting
        on one of them), per link in sequence order, each in its own pre-drawn order; and
        every held link's FIFO (independent contexts)."""
        landed = 0
        queued = [(key, link) for key, link in list(self.links.items()) if link.queued]
        self._idle_rng.shuffle(queued)  # which held context lands first is the adversary's too
        for (peer, ctx), link in queued:
            landed += self._release(peer, ctx, link, "idle")
        for (peer, ctx), link in list(self.links.items()):
            if link.held:
                for seq in sorted(link.held):
                    self.record(peer, ctx, ("release", seq, "idle"))
                    landed += self._land_put(peer, link, seq)
                link.held.clear()
                self._prune(link)
        return landed

    # ---- the ordered wire ----

    def _land_ordered(self, peer: int, ctx: int, op: list, until: int | None = None) -> None:
        """Lands op [seq, offset, payload, signal, segments landed] from its first
        segment not landed: the whole data in one piece (("data", seq)) when none has,
        else segment by segment (("seg", ...)), then its signal. `until`: land only the
        segments before it (no signal), for a hold that cuts the op."""
        seq, offset, payload, signal, first = op
        wire, obs, traced = self.wire, self.observer, self.trace is not None
        if payload.size and first == 0 and until is None:
            wire.land_data(peer, offset, payload, ctx)
            if obs is not None:
                obs.landed(peer, ctx, seq, None, 0)
            if traced:
                self.record(peer, ctx, ("data", seq))
        elif payload.size:
            segs = semantics.segments(semantics.Put(ctx, seq, offset, int(payload.size)), self.segment_bytes)
            for k in range(first, len(segs) if until is None else until):
                off, n = segs[k]
                wire.land_data(peer, off, payload[off - offset : off - offset + n], ctx)
                if obs is not None:
                    obs.landed(peer, ctx, seq, k, 0)
                self.record(peer, ctx, ("seg", seq, k, 0))
            op[4] = len(segs) if until is None else until
        if until is not None:
            return
        if signal is not None:
            wire.signal(peer, signal, ctx)
            if obs is not None:
                obs.landed(peer, ctx, seq, -1, 0)
            if traced:
                self.record(peer, ctx, ("signal", seq))
        self.stats["events"] += 1

    def _post_independent(self, peer: int, ctx: int, link: Link, op: list) -> None:
        """Independent contexts: queues `op` behind a held link, holds the link at it,
        or lands it and counts it against the holds of the peer's other contexts
        (module docstring)."""
        seq = op[0]
        if link.queued:
            link.queued.append(op)
            self.record(peer, ctx, ("hold", seq, link.hold_for))
            return
        if any(p == peer and c != ctx for p, c in self.links):
            rng = random.Random(f"{link.name}:o{seq}")
            if rng.random() < CONTEXT_HOLD_PROBABILITY:
                nseg = len(semantics.segments(semantics.Put(ctx, seq, op[1], int(op[2].size)), self.segment_bytes))
                cut = rng.randrange(nseg) if nseg else 0  # segments that land before the hold
                link.hold_for = rng.randint(1, CONTEXT_HOLD_OPS)
                self.record(peer, ctx, ("hold", seq, link.hold_for))
                if cut:
                    self._land_ordered(peer, ctx, op, until=cut)
                link.queued.append(op)
                return
        self._land_ordered(peer, ctx, op)
        for (p, c), other in list(self.links.items()):
            if p == peer and c != ctx and other.queued:
                other.hold_for -= 1
                if other.hold_for <= 0:
                    self._release(p, c, other, "expired")

    def _release(self, peer: int, ctx: int, link: Link, why: str) -> int:
        """Lands a held link's FIFO in posted order; returns the ops landed."""
        n = 0
        while link.queued:  # each op leaves the FIFO once landed: pending() sees it until then
            op = link.queued[0]
            self.record(peer, ctx, ("release", op[0], why))
            self._land_ordered(peer, ctx, op)
            del link.queued[0]
            n += 1
        return n

    def release_link(self, peer: int, ctx: int) -> int:
        """Lands what link (peer, ctx) holds (a get on it reads after its earlier puts)."""
        link = self.links.get((peer, ctx))
        return self._release(peer, ctx, link, "forced") if link is not None and link.queued else 0

    def _forcing(self, put: semantics.Put) -> bool:
        """Whether landing `put` needs every earlier put of its link landed first."""
        if put.signal is not None and (put.signal.strong or self.strong_always):
            return True
        return self.transport.flush_orders_later_writes and put.after_flush

    # ---- landing ----

    def deliver(self) -> int:
        """Lands some pending events of links not served at doorbells; returns how many."""
        landed = 0
        for (peer, _), link in self.links.items():
            if link.puts and not link.at_doorbells:
                landed += self._deliver_link(peer, link, self.rng, None)
                self._prune(link)
        return landed

    def _land_put(self, peer: int, link: Link, seq: int) -> int:
        """Lands what is left of put `seq` (a held one), in an order drawn from its own stream."""
        i = next(k for k, p in enumerate(link.puts) if p.seq == seq)
        n = self._deliver_link(peer, link, random.Random(f"{link.name}:p{seq}"), lambda k: k == i)
        if not (semantics.Event(i, -1) in link.landed or link.puts[i].signal is None) or not all(
            semantics.Event(i, s) in link.landed for s in range(len(link.segs[i]))
        ):
            raise RuntimeError(
                f"rank {self.rank}: held put {seq} to peer {peer} could not land "
                f"(an earlier put of its link is still pending)"
            )
        return n

    def _deliver_link(self, peer: int, link: Link, rng: random.Random, only) -> int:
        """Lands enabled events of the puts `only(index)` accepts (all when None) until
        none is enabled (at doorbells) or at random (deliver())."""
        landed = 0
        plan = semantics.Plan(link.puts, link.segs)
        while True:
            choices = semantics.enabled(self.transport, plan, link.landed, self.strong_always)
            if only is not None:
                choices = [e for e in choices if only(e.put)]
            if not choices:
                break
            ev = rng.choice(choices)
            self._land(peer, link, ev)
            link.landed.add(ev)
            landed += 1
            if link.at_doorbells:
                if ev.is_signal:
                    time.sleep(0)  # let a receiver in this process see the state right after a signal
            elif self.rng.random() < 0.5:
                break
        self.stats["events"] += landed
        return landed

    def _land(self, peer: int, link: Link, ev: semantics.Event) -> None:
        put = link.puts[ev.put]
        if self.trace is not None:
            self.record(peer, put.ctx, ("signal", put.seq) if ev.is_signal else ("seg", put.seq, ev.segment, ev.copy))
        if ev.is_signal:
            self.wire.signal(peer, put.signal, put.ctx)
        else:
            off, n = link.segs[ev.put][ev.segment]
            rel = off - put.offset
            self.wire.land_data(peer, off, link.payloads[ev.put][rel : rel + n], put.ctx)
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
