"""A CPU call that repeats an earlier one's arguments on the same arrays skips the buffer
checks and the planning (collectives/launch_record.py, RepeatedCall). What it must keep:

- every result exact, whatever the mix of repeated, in-place and new calls (the one
  launch record is rewritten whenever another call used it last);
- what an array can change in place between calls (read-only, dtype, shape) is
  checked again, with the same errors as a first call (its data cannot move: numpy
  refuses to resize an array that has weak references);
- a broken communicator refuses a repeated call too, and ranks that disagree still
  fail with CommMismatch;
- symmetric windows allocated or freed drop what was kept (a buffer may become or
  stop being symmetric), and nothing keeps an array alive.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from commref.collectives import verify
from commref.collectives.communicator import Communicator
from commref.transports.errors import CommAborted, CommMismatch
from commref.transports.thread_world import ThreadWorld

TIMEOUT = 20.0


def _input(rank: int, n: int, count: int, seed: int = 3, dtype=np.float32):
    x = verify.make_input("allreduce", dtype, "sum", seed, rank, n, count)
    return x, verify.expected_output("allreduce", dtype, "sum", seed, rank, n, count)


def test_repeated_calls_stay_exact_and_rewrite_the_record():
    def fn(world):
        r, n = world.rank, world.size
        comm = Communicator(world, "cpu", timeout=TIMEOUT)
        try:
            small, small_exp = _input(r, n, 2)
            big, big_exp = _input(r, n, 20000, seed=5)  # timed by the store chooser
            y_small, y_big = np.empty_like(small), np.empty_like(big)
            wrong = 0
            for i in range(30):
                comm.allreduce(small, y_small, "sum")
                wrong += int((y_small != small_exp).sum())
                if i % 3 == 0:
                    comm.allreduce(big, y_big, "sum")
                    wrong += int((y_big != big_exp).sum())
                if i % 5 == 0:  # in place, on a fresh copy each time
                    z = small.copy()
                    comm.allreduce(z, z, "sum")
                    wrong += int((z != small_exp).sum())
                if i % 7 == 0:  # another op on the same arrays: another RepeatedCall
                    comm.allreduce(small, y_small, "max")
                    wrong += int((y_small != np.max([_input(k, n, 2)[0] for k in range(n)], axis=0)).sum())
            kept = comm.kept_calls
            return wrong, kept
        finally:
            comm.close()

    for wrong, kept in ThreadWorld.run(2, fn, timeout=60):
        assert wrong == 0
        assert kept >= 3


def test_changes_in_place_are_checked_again():
    def fn(world):
        r, n = world.rank, world.size
        comm = Communicator(world, "cpu", timeout=TIMEOUT)
        errors = []
        try:
            x, exp = _input(r, n, 6)
            y = np.empty_like(x)
            comm.allreduce(x, y)
            comm.allreduce(x, y)
            x.shape = (2, 3)  # the same elements: still a valid call
            y.shape = (3, 2)
            y[...] = 0
            comm.allreduce(x, y)
            ok = bool((y.reshape(-1) == exp).all())
            y.flags.writeable = False
            with pytest.raises(ValueError, match="recvbuf is read-only"):
                comm.allreduce(x, y)
            errors.append("read-only")
            y.flags.writeable = True
            x.dtype = np.int32  # the same bytes, another dtype: differs from recvbuf's
            with pytest.raises(TypeError, match="sendbuf dtype int32 differs from recvbuf dtype float32"):
                comm.allreduce(x, y)
            errors.append("dtype")
            x.dtype = np.float32
            y.shape = (6,)
            with pytest.raises(ValueError, match="cannot resize"):  # numpy's refusal: the data cannot move
                y.resize(7, refcheck=False)
            errors.append("resize")
            comm.allreduce(x, y)
            ok = ok and bool((y == exp).all())
            world.barrier(what="checks done")
            return ok, errors
        finally:
            comm.close()

    for ok, errors in ThreadWorld.run(2, fn, timeout=60):
        assert ok
        assert errors == ["read-only", "dtype", "resize"]


def test_kept_calls_hold_no_array_and_a_new_array_is_checked():
    def fn(world):
        r, n = world.rank, world.size
        comm = Communicator(world, "cpu", timeout=TIMEOUT)
        try:
            x, exp = _input(r, n, 4)
            y = np.empty_like(x)
            comm.allreduce(x, y)
            gone = weakref.ref(y)
            del y
            gc.collect()
            alive = gone() is not None
            wrong = 0
            for _ in range(20):  # new arrays, some at the id of a dead one
                y = np.empty_like(x)
                comm.allreduce(x, y)
                wrong += int((y != exp).sum())
            with pytest.raises(ValueError, match="equal count"):
                comm.allreduce(x, np.empty(5, np.float32))
            world.barrier(what="checks done")
            return alive, wrong
        finally:
            comm.close()

    for alive, wrong in ThreadWorld.run(2, fn, timeout=60):
        assert not alive
        assert wrong == 0


def test_ranks_that_disagree_still_mismatch_and_a_broken_communicator_refuses():
    def fn(world):
        r, n = world.rank, world.size
        comm = Communicator(world, "cpu", timeout=TIMEOUT)
        try:
            x, _ = _input(r, n, 4)
            y = np.empty_like(x)
            for _ in range(5):
                comm.allreduce(x, y)
            try:
                if r == 0:
                    comm.allreduce(x, y)  # repeated here, another count on the peer
                else:
                    comm.allreduce(np.ones(3, np.float32), np.empty(3, np.float32))
                first = None
            except CommMismatch as e:
                first = e.field
            try:
                comm.allreduce(x, y)
                second = None
            except CommAborted as e:
                second = type(e).__name__
            return first, second
        finally:
            comm.close()

    results = ThreadWorld.run(2, fn, timeout=60)
    assert [f for f, _ in results] == ["count", "count"]
    assert [s for _, s in results] == ["CommAborted", "CommAborted"]


def test_symmetric_windows_drop_kept_calls():
    def fn(world):
        r, n = world.rank, world.size
        comm = Communicator(world, "cpu", timeout=TIMEOUT)
        try:
            x, exp = _input(r, n, 8)
            y = np.empty_like(x)
            comm.allreduce(x, y)
            kept = comm.kept_calls
            a = comm.alloc_symmetric(8, np.float32)
            after_alloc = comm.kept_calls
            a[...] = x
            comm.allreduce(a, y)
            comm.allreduce(a, y)
            ok = bool((y == exp).all())
            comm.free_symmetric(a)
            return kept, after_alloc, comm.kept_calls, ok
        finally:
            comm.close()

    for kept, after_alloc, after_free, ok in ThreadWorld.run(2, fn, timeout=60):
        assert (kept, after_alloc, after_free, ok) == (1, 0, 0, True)
