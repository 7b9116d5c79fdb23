"""Observer: hooks a tool passes to the GIN proxy (GinProxy(..., observer=...)) to see
what it does without reaching into it. The ordering study's stress paces the proxy and
logs its delivery orders through one.

Every method is called on the proxy's thread, right after the fact, and may block
briefly (to pace the proxy); an exception ends the proxy like any other error. The
defaults do nothing: override what you need.
"""

from __future__ import annotations


class Observer:
    def landed(self, peer: int, ctx: int, seq: int, segment: int | None, copy: int) -> None:
        """An event of put `seq` (per-(peer, ctx) sequence number, from 0) has landed at
        `peer` on context `ctx` (network mpi: has been sent to the peer's proxy):
        data segment `segment` (semantics.segments order; copy 1: a duplicate placement),
        or its signal (segment -1). On an ordered wire a put's data lands in one piece:
        segment None (and not at all for a bare signal)."""

    def sent(self, peer: int, kind: int, nbytes: int) -> None:
        """A wire message of `kind` (wires.MSG_*) and `nbytes` bytes went to `peer`."""

    def received(self, peer: int, kind: int, nbytes: int) -> None:
        """A wire message from `peer` has been received and carried out (landed)."""
