"""Streamed stores on the CPU (CollArgs.streamStores, include/commref/move.h) and the
host's choice between them (tuner.StoreChooser).

Streaming changes how bytes are stored, never which: every collective must give the
same exact results with it on and off, at sizes where each thread's share is large
enough to stream (FIFO slots and GIN staging from 16 KiB, user buffers from 1 MiB).
"""

from __future__ import annotations

import numpy as np
import pytest

from commref.collectives import catalogue, tuner, verify
from commref.collectives.communicator import Communicator
from commref.collectives.symmetric import SymmetricArena
from commref.transports.thread_world import ThreadWorld

COUNT = 600_001  # 2.4 MB of float32: 1.2 MB per rank's part at 2 ranks, streamed slots


def _run_all(world, stores, path):
    comm = Communicator(world, "cpu", timeout=60, stream_stores=stores, path=path, slot_bytes=64 * 1024)
    r, n = world.rank, world.size
    arena = SymmetricArena(comm, 4 * (COUNT * n * 4 + SymmetricArena.ALIGN)) if path == "lsa" else None
    wrong = {}
    for coll, op in (
        ("allreduce", "avg"),
        ("reduce_scatter", "sum"),
        ("allgather", None),
        ("broadcast", None),
        ("reduce", "max"),
    ):
        dt = np.dtype(np.float32)
        x = verify.make_input(coll, dt, op, 3, r, n, COUNT)
        exp = verify.expected_output(coll, dt, op, 3, r, n, COUNT, 0)
        algos = ["ring"] + (["tree"] if coll == "allreduce" else [])
        algos += ["direct"] if arena is not None and coll in catalogue.with_algorithm("direct") else []
        for algo in algos:
            rc = catalogue.get(coll).counts(COUNT, n)[1]
            if algo == "direct":
                arena.reset()
                send, out = arena.take(x.size, dt), arena.take(rc, dt)
                send[...] = x
            else:
                send, out = x.copy(), np.zeros(rc, dt)
            if coll in ("broadcast", "reduce"):
                getattr(comm, coll)(send, out, *([op] if op else []), 0)
            else:
                getattr(comm, coll)(send, out, *([op] if op else []), algorithm=algo)
            wrong[f"{coll}/{algo}"] = 0 if exp is None else verify.count_wrong(out, exp)
    comm.close()
    return wrong


@pytest.mark.parametrize("stores", ["on", "off"])
@pytest.mark.parametrize("nranks, path", [(2, "lsa"), (3, "lsa"), (2, "gin")])
def test_every_collective_is_exact_with_and_without_streamed_stores(stores, nranks, path):
    for per_rank in ThreadWorld.run(nranks, _run_all, stores, path, timeout=120):
        assert per_rank and not any(per_rank.values()), per_rank


# Large enough that the ring's receive steps stream into the recvbuf as well
# (COMMREF_RECEIVED_STREAM_MIN_BYTES, 4 MiB received per thread): 8.8 MB of float32.
RECEIVED_COUNT = 2_200_001


def _run_ring_receives(world, stores, path):
    comm = Communicator(world, "cpu", timeout=60, stream_stores=stores, path=path)
    r, n = world.rank, world.size
    dt = np.dtype(np.float32)
    wrong = {}
    for coll, op, count in (
        ("allreduce", "sum", RECEIVED_COUNT),
        ("allgather", None, RECEIVED_COUNT // n),
        ("broadcast", None, RECEIVED_COUNT),
    ):
        x = verify.make_input(coll, dt, op, 5, r, n, count)
        exp = verify.expected_output(coll, dt, op, 5, r, n, count, 0)
        rc = catalogue.get(coll).counts(count, n)[1]
        out = np.zeros(rc, dt)
        args = ([op] if op else []) + ([0] if coll == "broadcast" else [])
        getattr(comm, coll)(x, out, *args, algorithm="ring")
        wrong[coll] = verify.count_wrong(out, exp)
        # In place: all_reduce's receive steps land on lines it has read (not streamed),
        # all_gather's on other ranks' slots (streamed).
        if coll == "allreduce":
            buf = x.copy()
            comm.allreduce(buf, buf, op, algorithm="ring")
            wrong["allreduce in place"] = verify.count_wrong(buf, exp)
        elif coll == "allgather":
            buf = np.zeros(rc, dt)
            buf[r * count : (r + 1) * count] = x
            comm.allgather(buf[r * count : (r + 1) * count], buf, algorithm="ring")
            wrong["allgather in place"] = verify.count_wrong(buf, exp)
    comm.close()
    return wrong


@pytest.mark.parametrize("stores", ["on", "off"])
@pytest.mark.parametrize("nranks, path", [(2, "lsa"), (3, "lsa"), (2, "gin")])
def test_ring_receive_steps_streamed_into_a_large_recvbuf_are_exact(stores, nranks, path):
    """Receive steps (recv, recvCopySend) stream their stores into the recvbuf from
    4 MiB received per thread (Prims::streamReceived); 3 ranks take recvCopySend."""
    for per_rank in ThreadWorld.run(nranks, _run_ring_receives, stores, path, timeout=120):
        assert set(per_rank) == {
            "allreduce",
            "allreduce in place",
            "allgather",
            "allgather in place",
            "broadcast",
        } and not any(per_rank.values()), per_rank


class _Clock:
    """Feeds the chooser seconds per byte as if the host were in a placement where the
    settings (0 off, 1 on) take `seconds[setting]` per 1e10 bytes once warm, and
    `cold[setting][j]` on the j-th call in a row of the setting (the cache state the
    other setting left, wearing off)."""

    def __init__(self, chooser, seconds, cold=None):
        self.chooser, self.seconds, self.cold = chooser, seconds, cold or {0: [], 1: []}
        self.used, self.timed, self.last, self.run = [], [], None, 0

    def call(self, kernel="k", nbytes=1 << 24):
        setting, key = self.chooser.choose(kernel, nbytes)
        self.run = self.run + 1 if setting == self.last else 0
        self.last = setting
        self.used.append(setting)
        self.timed.append(key is not None)
        ramp = self.cold[setting]
        seconds = ramp[self.run] if self.run < len(ramp) else self.seconds[setting]
        if key is not None:
            self.chooser.record(key, setting, seconds * nbytes * 1e-10, nbytes)
        return setting


WARM, TRY = tuner.STORE_WARM_CALLS, tuner.STORE_TRY_CALLS


def test_chooser_measures_both_then_keeps_the_faster_and_follows_a_change():
    clock = _Clock(tuner.StoreChooser("auto"), {0: 2.0, 1: 1.0})
    for _ in range(800):
        clock.call()
    # On: WARM calls not timed, then one timed; a try of off: WARM calls to warm up, two timed.
    first = WARM + 1 + TRY
    assert clock.used[:first] == [1] * (WARM + 1) + [0] * TRY
    assert clock.timed[:first] == [False] * WARM + [True] + [False] * WARM + [True, True]
    steady = "".join(map(str, clock.used[first:]))
    starts = [i for i in range(len(steady)) if steady.startswith("1" + "0" * TRY + "1", i)]
    # On wins, and off is tried again, less often while it keeps losing: the calls of on
    # between tries double from STORE_TRY_EVERY up to STORE_TRY_MAX_EVERY.
    assert steady.count("0") == TRY * len(starts) and len(starts) >= 2, clock.used
    gaps = [b - a - TRY for a, b in zip([-TRY - 1] + starts, starts)]
    want = [min(tuner.STORE_TRY_EVERY << (k + 1), tuner.STORE_TRY_MAX_EVERY) for k in range(len(gaps))]
    assert gaps == want, (gaps, want)
    # Not timed: each try's first WARM calls, and the first WARM calls back on after each try.
    assert clock.timed[first:].count(False) == 2 * WARM * len(starts) + WARM
    # The placement changes and on slows down past off's last time: the next call of on
    # shows it, and off stays, with its wait between tries back at the start.
    clock.seconds, clock.used = {0: 1.0, 1: 3.0}, []
    for _ in range(tuner.STORE_TRY_EVERY + 20):
        clock.call()
    assert clock.used[:1] == [1] and clock.used[1 : 1 + tuner.STORE_TRY_EVERY] == [0] * tuner.STORE_TRY_EVERY
    assert clock.used[1 + tuner.STORE_TRY_EVERY : 1 + tuner.STORE_TRY_EVERY + TRY] == [1] * TRY, clock.used
    # The placement changes back and on speeds up: found at on's next try.
    clock.seconds, clock.used = {0: 2.0, 1: 1.0}, []
    for _ in range(2 * tuner.STORE_TRY_EVERY + 20):
        clock.call()
    assert clock.used[-20:].count(0) <= 2 * WARM, clock.used  # on, but for tries of off


def test_chooser_waits_out_the_other_settings_cache_state():
    """A setting that is faster only once the other's cache state has worn off (cached
    stores after streamed ones, 16 MiB AllReduce on the 2-core host: slower than streamed
    for three calls, then 30% faster) is found, and kept: the calls back on it after a
    try of the other are not taken for a slowdown."""
    cold = {0: [3.5, 2.8, 1.8, 1.5], 1: [2.6, 2.5, 2.0, 1.9]}
    clock = _Clock(tuner.StoreChooser("auto"), {0: 1.3, 1: 1.85}, cold)
    for _ in range(400):
        clock.call()
    steady = clock.used[WARM + 1 + TRY :]
    runs = [len(r) for r in "".join(map(str, steady)).split("0") if r]
    assert runs and set(runs) == {TRY} and len(runs) <= 5, clock.used  # on only in its tries, less often
    assert steady[-100:].count(1) <= TRY, clock.used


def test_chooser_leaves_a_setting_only_when_clearly_slower():
    """Noise smaller than STORE_SWITCH_MARGIN does not make the chooser switch."""
    chooser = tuner.StoreChooser()
    rates = {1: 1.0, 0: 1.1}
    used = []
    for i in range(100):
        setting, key = chooser.choose("k", 1 << 24)
        used.append(setting)
        if key is not None:
            jitter = 1.1 if (i % 3 == 0 and setting == 1) else 1.0  # on now and then 10% slower
            chooser.record(key, setting, rates[setting] * jitter, 1)
    assert used[WARM + 1 :].count(0) <= 2 * TRY, used  # only its tries: the first, and one after 2 x STORE_TRY_EVERY


def test_chooser_fixed_modes_small_calls_and_separate_kinds():
    assert tuner.StoreChooser("on").choose("k", 1 << 24) == (1, None)
    assert tuner.StoreChooser("off").choose("k", 1 << 24) == (0, None)
    auto = tuner.StoreChooser()
    assert auto.choose("k", tuner.STORE_CHOOSER_MIN_BYTES - 1) == (1, None)  # not timed
    keys = set()
    for kind in (("ring", 1 << 20), ("ring", 1 << 24), ("direct", 1 << 20), ("direct", 1 << 20, True)):
        for _ in range(WARM):
            assert auto.choose(*kind) == (1, None)  # a kind's first calls are not timed
        keys.add(auto.choose(*kind)[1])
    assert len(keys) == 4 and None not in keys
    with pytest.raises(ValueError, match="stream_stores"):
        tuner.StoreChooser("sometimes")
