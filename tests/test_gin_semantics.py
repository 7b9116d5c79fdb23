"""semantics.enabled (unit tests): which events of a plan may land next on
each transport (ordered, unordered, duplicates, block128, flush ordering).
"""

from __future__ import annotations

import pytest

from commref.transports.gin import semantics
from commref.transports.gin.semantics import Event, Plan, Put, Signal, Transport, enabled

# ---------------------------------------------------------------------------------------
# semantics.enabled: what may land next
# ---------------------------------------------------------------------------------------


def _land_all(transport, plan, strong_always=False, pick=lambda choices: choices[0]):
    landed, order = set(), []
    while True:
        choices = enabled(transport, plan, landed, strong_always)
        if not choices:
            return order
        e = pick(choices)
        landed.add(e)
        order.append(e)


def _plan(*puts, segment_bytes=64):
    return Plan.of(list(puts), segment_bytes)


def test_segments_cut_at_destination_multiples():
    assert semantics.segments(Put(0, 0, 100, 200), 64) == [(100, 28), (128, 64), (192, 64), (256, 44)]
    assert semantics.segments(Put(0, 0, 0, 0), 64) == []
    assert semantics.segments(Put(0, 0, 0, 128), 128) == [(0, 128)]


def test_ordered_is_fifo_per_context():
    w = Signal(strong=False)
    plan = _plan(Put(0, 0, 0, 128, w), Put(0, 1, 128, 64), Put(0, 2, 0, 0, w))
    landed: set = set()
    order = []
    while True:
        choices = enabled(semantics.ORDERED, plan, landed)
        if not choices:
            break
        assert len(choices) == 1, choices  # one context: only the head may land
        landed.add(choices[0])
        order.append(choices[0])
    assert order == [Event(0, 0), Event(0, 1), Event(0, -1), Event(1, 0), Event(2, -1)]


def test_ordered_contexts_are_independent():
    plan = _plan(Put(0, 0, 0, 64), Put(1, 0, 64, 64), Put(0, 1, 128, 64))
    assert enabled(semantics.ORDERED, plan, set()) == [Event(0, 0), Event(1, 0)]
    assert enabled(semantics.ORDERED, plan, {Event(1, 0)}) == [Event(0, 0)]
    assert enabled(semantics.ORDERED, plan, {Event(0, 0)}) == [Event(1, 0), Event(2, 0)]


def test_unordered_weak_signal_needs_only_its_own_data():
    plan = _plan(Put(0, 0, 0, 128), Put(0, 1, 128, 64, Signal(strong=False)))
    first = enabled(semantics.UNORDERED, plan, set())
    assert first == [Event(0, 0), Event(0, 1), Event(1, 0)]  # every segment, any order
    # The weak signal may land while the earlier put is still in flight.
    assert Event(1, -1) in enabled(semantics.UNORDERED, plan, {Event(1, 0)})
    # ... and not before its own data.
    assert Event(1, -1) not in enabled(semantics.UNORDERED, plan, {Event(0, 0), Event(0, 1)})


def test_unordered_strong_signal_waits_for_every_earlier_put():
    plan = _plan(Put(0, 0, 0, 128), Put(1, 0, 512, 64), Put(0, 1, 128, 64, Signal(strong=True)))
    assert Event(2, -1) not in enabled(semantics.UNORDERED, plan, {Event(2, 0)})
    assert Event(2, -1) not in enabled(semantics.UNORDERED, plan, {Event(2, 0), Event(0, 0)})
    # Another context's put does not hold it back.
    assert Event(2, -1) in enabled(semantics.UNORDERED, plan, {Event(2, 0), Event(0, 0), Event(0, 1)})


def test_unordered_strong_signals_apply_in_sequence_order():
    s = Signal(strong=True)
    plan = _plan(Put(0, 0, 0, 64, s), Put(0, 1, 64, 64, s))
    data = {Event(0, 0), Event(1, 0)}
    assert enabled(semantics.UNORDERED, plan, data) == [Event(0, -1)]
    assert enabled(semantics.UNORDERED, plan, data | {Event(0, -1)}) == [Event(1, -1)]
    # A weak signal does not wait for an earlier strong one.
    plan = _plan(Put(0, 0, 0, 64, s), Put(0, 1, 64, 64, Signal(strong=False)))
    assert enabled(semantics.UNORDERED, plan, data) == [Event(0, -1), Event(1, -1)]


def test_strong_always_makes_a_weak_signal_strong():
    plan = _plan(Put(0, 0, 0, 64), Put(0, 1, 64, 64, Signal(strong=False)))
    assert Event(1, -1) in enabled(semantics.UNORDERED, plan, {Event(1, 0)})
    assert Event(1, -1) not in enabled(semantics.UNORDERED, plan, {Event(1, 0)}, strong_always=True)
    assert Event(1, -1) in enabled(semantics.UNORDERED, plan, {Event(0, 0), Event(1, 0)}, strong_always=True)


def test_weak_last_can_signal_before_earlier_segments_but_strong_cannot():
    """The ring's weak-last slot: 4 puts, a weak signal on the last. Some delivery
    orders apply the signal while a segment of an earlier put is missing; with a strong
    signal, none do."""

    def slot(strong):
        return _plan(*[Put(0, i, 64 * i, 64, Signal(strong) if i == 3 else None) for i in range(4)])

    def early_signal_orders(plan):
        """Whether some order lands the signal before every segment: depth-first."""

        def go(landed):
            for e in enabled(semantics.UNORDERED, plan, landed):
                if e.is_signal and len(landed) < 4:
                    return True
                if go(landed | {e}):
                    return True
            return False

        return go(frozenset())

    assert early_signal_orders(slot(strong=False))
    assert not early_signal_orders(slot(strong=True))


def test_duplicates_follow_their_original_once():
    t = Transport("srd", ordered=False, duplicates=True)
    plan = _plan(Put(0, 0, 0, 128))
    assert enabled(t, plan, set()) == [Event(0, 0), Event(0, 1)]
    assert enabled(t, plan, {Event(0, 0)}) == [Event(0, 0, 1), Event(0, 1)]
    assert enabled(t, plan, {Event(0, 0), Event(0, 0, 1)}) == [Event(0, 1)]
    assert len(plan.all_events(t)) == 4
    order = _land_all(t, plan, pick=lambda c: c[-1])
    assert sorted(order) == sorted(plan.all_events(t))


def test_block128_orders_segments_within_a_block():
    t = Transport("b128", ordered=False, placement="block128")
    plan = _plan(Put(0, 0, 64, 256), segment_bytes=64)  # blocks of the segments: 0, 1, 1, 2
    assert plan.segs[0] == [(64, 64), (128, 64), (192, 64), (256, 64)]
    assert enabled(t, plan, set()) == [Event(0, 0), Event(0, 1), Event(0, 3)]
    assert enabled(t, plan, {Event(0, 1)}) == [Event(0, 0), Event(0, 2), Event(0, 3)]
    with pytest.raises(ValueError, match="placement"):
        Transport("bad", ordered=False, placement="words")


def test_flush_orders_later_writes_only_where_declared():
    plan = _plan(Put(0, 0, 0, 128), Put(0, 1, 0, 0, Signal(strong=False), after_flush=True))
    # Without the assumption a weak bare signal after a flush may overtake the puts.
    assert Event(1, -1) in enabled(semantics.UNORDERED, plan, set())
    gda_like = Transport("gda", ordered=False, flush_orders_later_writes=True)
    assert enabled(gda_like, plan, set()) == [Event(0, 0), Event(0, 1)]
    assert enabled(gda_like, plan, {Event(0, 0)}) == [Event(0, 1)]
    assert enabled(gda_like, plan, {Event(0, 0), Event(0, 1)}) == [Event(1, -1)]
    # A put before the flush on another context is not waited for.
    plan = _plan(Put(1, 0, 0, 128), Put(0, 0, 0, 0, Signal(strong=False), after_flush=True))
    assert Event(1, -1) in enabled(gda_like, plan, set())


def test_every_event_lands_exactly_once_under_every_transport():
    import random

    rng = random.Random(4)
    plan = _plan(
        Put(0, 0, 0, 200, Signal(False)),
        Put(1, 0, 256, 100, Signal(True)),
        Put(0, 1, 512, 130),
        Put(0, 2, 0, 0, Signal(True), after_flush=True),
        Put(1, 1, 700, 64, Signal(False)),
    )
    for t in (semantics.ORDERED, semantics.UNORDERED, Transport("d", False, "block128", True, True)):
        for strong_always in (False, True):
            for _ in range(20):
                order = _land_all(t, plan, strong_always, pick=rng.choice)
                originals = [e for e in order if e.copy == 0]
                assert sorted(originals) == sorted(e for e in plan.all_events(t) if e.copy == 0)
                assert len(order) == len(set(order))
