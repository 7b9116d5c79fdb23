"""Streamed stores on the CPU (CollArgs.streamStores, include/commref/move.h) and the
host's choice between them (tuner.StoreChooser).

Streaming changes how bytes are stored, never which: every collective must give the
same exact results with it on and off, at sizes where each thread's share is large
enough to stream (FIFO slots and GIN staging from 16 KiB, user buffers from 1 MiB).
"""

from __future__ import annotations

import numpy as np
import pytest

from collectives import tuner, verify
from collectives.communicator import Communicator
from collectives.symmetric import SymmetricArena
from transports.world import ThreadWorld

COUNT = 600_001  # 2.4 MB of float32: 1.2 MB per rank's part at 2 ranks, streamed slots


def _run_all(world, stores, path):
    comm = Communicator(world, "cpu", timeout=60, stream_stores=stores, path=path, slot_bytes=64 * 1024)
    r, n = world.rank, world.size
    arena = SymmetricArena(comm, 4 * (COUNT * n * 4 + SymmetricArena.ALIGN)) if path == "lsa" else None
    wrong = {}
    for coll, op in (("allreduce", "avg"), ("reduce_scatter", "sum"), ("allgather", None), ("broadcast", None),
                     ("reduce", "max")):
        dt = np.dtype(np.float32)
        x = verify.make_input(coll, dt, op, 3, r, n, COUNT)
        exp = verify.expected_output(coll, dt, op, 3, r, n, COUNT, 0)
        algos = ["ring"] + (["tree"] if coll == "allreduce" else [])
        algos += ["direct"] if arena is not None and coll in tuner.DIRECT_COLLECTIVES else []
        for algo in algos:
            rc = verify.recv_count(coll, COUNT, n)
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


class _Clock:
    """Feeds the chooser seconds per byte as if the host were in a placement where
    `fast` (0 off, 1 on) is the faster setting."""

    def __init__(self, chooser):
        self.chooser, self.fast, self.used = chooser, 1, []

    def call(self, kernel="k", nbytes=1 << 24):
        setting, key = self.chooser.choose(kernel, nbytes)
        self.used.append(setting)
        if key is not None:
            self.chooser.record(key, setting, (1.0 if setting == self.fast else 3.0) * nbytes * 1e-10, nbytes)
        return setting


def test_chooser_measures_both_then_keeps_the_faster_and_follows_a_change():
    clock = _Clock(tuner.StoreChooser("auto"))
    for _ in range(2 * tuner.STORE_EXPLORE_EVERY):
        clock.call()
    assert clock.used[:3] == [1, 1, 0]  # a first call not timed, then each setting measured once
    steady = clock.used[3:]
    assert steady.count(1) >= len(steady) - 3 and 0 in steady  # on wins, off is still tried now and then
    clock.fast, clock.used = 0, []  # the placement changes
    for _ in range(2 * tuner.STORE_EXPLORE_EVERY):
        clock.call()
    assert clock.used[-tuner.STORE_EXPLORE_EVERY + 1:].count(0) >= tuner.STORE_EXPLORE_EVERY - 2


def test_chooser_fixed_modes_small_calls_and_separate_kinds():
    assert tuner.StoreChooser("on").choose("k", 1 << 24) == (1, None)
    assert tuner.StoreChooser("off").choose("k", 1 << 24) == (0, None)
    auto = tuner.StoreChooser()
    assert auto.choose("k", tuner.STORE_CHOOSER_MIN_BYTES - 1) == (1, None)  # not timed
    keys = set()
    for kind in (("ring", 1 << 20), ("ring", 1 << 24), ("direct", 1 << 20), ("direct", 1 << 20, True)):
        assert auto.choose(*kind) == (1, None)  # a kind's first call is not timed
        keys.add(auto.choose(*kind)[1])
    assert len(keys) == 4 and None not in keys
    with pytest.raises(ValueError, match="stream_stores"):
        tuner.StoreChooser("sometimes")
