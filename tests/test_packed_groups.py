"""Packed groups (collectives/packing.py): a CPU group of AllReduces of one signature
runs as one AllReduce of all their elements.

- packed and exact for every op (its flag element included: int8 prod, avg), members of
  different counts (0 among them), new and kept groups, one launch each;
- a member that reads an earlier member's output on one rank only: every rank runs the
  members one by one (the flag), with the results of calls made one after the other;
  on 8 ranks that all read one, the int8 prod and sum flags still say so;
- the model decides (CallPlanner.packs); a group with sends and receives is not packed;
- a packed group against a peer that posted other calls fails on both ranks within the
  deadline, the packed members named.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers import WORLD_TIMEOUT, close_after_barrier

from commref import Communicator
from commref.collectives import calls, model, verify
from commref.transports.thread_world import ThreadWorld

COUNTS = (1, 5, 0, 3, 7)


def _comm(world) -> Communicator:
    return Communicator(world, "cpu", timeout=WORLD_TIMEOUT, slot_bytes=1024, nsteps=2)


def _inputs(rank: int, dtype, op: str):
    rng = np.random.default_rng(100 + rank)
    hi = 3 if op == "prod" else 50
    return [rng.integers(1, hi, c).astype(dtype) for c in COUNTS]


def _reduce(values, op: str, dtype):
    with np.errstate(over="ignore"):
        if op == "avg":
            return (np.sum(values, axis=0, dtype=np.float64) / len(values)).astype(dtype)
        fold = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
        return fold.reduce(np.stack(values), axis=0).astype(dtype)


CASES = [("sum", "float32"), ("prod", "int8"), ("max", "int32"), ("min", "float64"), ("avg", "float32")]


@pytest.mark.parametrize("op, dtype", [*CASES, ("sum", "bfloat16")])
def test_allreduces_of_one_signature_run_packed_and_exact(op, dtype):
    dt = verify.DTYPES[dtype]
    n = 3

    def body(world):
        comm = _comm(world)
        xs = _inputs(world.rank, dt, op)
        outs = [np.zeros_like(x) for x in xs]
        seen = []
        for _ in range(3):  # a new group, then the kept one
            before, packed = comm.launches, comm.packed_groups
            for out in outs:
                out[...] = 0
            with comm.group():
                for x, out in zip(xs, outs):
                    comm.allreduce(x, out, op)
            seen.append((comm.launches - before, comm.packed_groups - packed, [o.copy() for o in outs]))
        close_after_barrier(world, comm)
        return seen

    results = ThreadWorld.run(n, body, timeout=WORLD_TIMEOUT)
    inputs = [_inputs(r, dt, op) for r in range(n)]
    for seen in results:
        for launches, packed, outs in seen:
            assert (launches, packed) == (1, 1)
            for i, got in enumerate(outs):
                want = _reduce([inputs[r][i] for r in range(n)], op, dt)
                rtol = 1e-2 if op == "avg" else 0
                np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol)


def test_a_member_reading_an_earlier_output_on_one_rank_makes_every_rank_run_them_one_by_one():
    """Rank 0's second member reads its first member's output; rank 1's reads an array
    of its own. Both run the calls one after the other (packed: 0, two launches: the
    packed one, whose flag said no, and the members')."""

    def body(world):
        comm = _comm(world)
        r = world.rank
        a, b, c = np.full(4, r + 1, np.int64), np.zeros(4, np.int64), np.zeros(4, np.int64)
        d = np.full(4, 10 * (r + 1), np.int64)
        seen = []
        for _ in range(2):
            b[...] = 0
            before = comm.launches
            with comm.group():
                comm.allreduce(a, b)
                comm.allreduce(b if r == 0 else d, c)
            seen.append((comm.launches - before, comm.packed_groups, b.copy(), c.copy()))
        close_after_barrier(world, comm)
        return seen

    for seen in ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT):
        for launches, packed, b, c in seen:
            assert (launches, packed) == (2, 0)
            np.testing.assert_array_equal(b, np.full(4, 3))  # 1 + 2
            np.testing.assert_array_equal(c, np.full(4, 3 + 20))  # rank 0's b, then rank 1's d


@pytest.mark.parametrize("op", ["prod", "sum", "min"])
def test_every_rank_reading_an_earlier_output_falls_back_on_eight_ranks(op):
    """In place twice on every rank of 8, int8: the flag's reduction (prod: 2^8 wraps to 0
    in int8) still says cannot, and the results are those of two calls in a row."""
    n = 8

    def body(world):
        comm = _comm(world)
        x = np.full(3, 1 if op != "sum" else world.rank % 2, np.int8)
        if op == "min":
            x[...] = world.rank + 1
        with comm.group():
            comm.allreduce(x, x, op)
            comm.allreduce(x, x, op)
        out = (x.copy(), comm.packed_groups)
        close_after_barrier(world, comm)
        return out

    want = {"prod": 1, "sum": 4 * n, "min": 1}[op]  # sum: 4 odd ranks give 4, then 8 x 4
    for x, packed in ThreadWorld.run(n, body, timeout=WORLD_TIMEOUT):
        assert packed == 0
        np.testing.assert_array_equal(x, np.full(3, want, np.int8))


def test_the_model_decides_and_sends_keep_a_group_unpacked(monkeypatch):
    """With the model's copies made dear (Model.pack_s), CallPlanner.packs says no and the
    members run one after the other in one launch; a group with a send and a receive is
    not packed either."""
    asked = []
    real = calls.CallPlanner.packs

    def spy(self, members, packed):
        asked.append(real(self, members, packed))
        return asked[-1]

    monkeypatch.setattr(calls.CallPlanner, "packs", spy)
    monkeypatch.setattr(model.Model, "pack_s", lambda self, nbytes: 1.0)

    def body(world):
        comm = _comm(world)
        r, peer = world.rank, 1 - world.rank
        x, y, z = np.ones(4, np.int32), np.zeros(4, np.int32), np.zeros(4, np.int32)
        got = np.zeros(2, np.int32)
        with comm.group():
            comm.allreduce(x, y)
            comm.allreduce(x, z)
        with comm.group():
            comm.allreduce(x, y)
            comm.allreduce(x, z)
            comm.send(np.full(2, r, np.int32), peer)
            comm.recv(got, peer)
        out = (comm.packed_groups, int(y.sum()), int(z.sum()), got.copy())
        close_after_barrier(world, comm)
        return out

    for r, (packed, y, z, got) in enumerate(ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)):
        assert (packed, y, z) == (0, 8, 8)
        np.testing.assert_array_equal(got, np.full(2, 1 - r))
    assert asked and not any(asked), asked  # asked once per rank, for the group without sends


def test_a_packed_group_against_other_calls_fails_on_both_ranks_naming_them():
    """Rank 0's two AllReduces pack; rank 1's second has another op, so its group does not:
    both ranks raise CommMismatch at group_end within the deadline, rank 0 naming its
    packed members, rank 1 its first member."""
    timeout = 3.0

    def body(world):
        comm = Communicator(world, "cpu", timeout=timeout)
        r = world.rank
        x, y, z = np.ones(4, np.int32), np.zeros(4, np.int32), np.zeros(4, np.int32)
        t0 = time.monotonic()
        try:
            with comm.group():
                comm.allreduce(x, y)
                comm.allreduce(x, z, "sum" if r == 0 else "max")
            message = None
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
        took = time.monotonic() - t0
        world.barrier(what="test done", timeout=30)
        comm.close()
        return message, took

    (m0, t0), (m1, t1) = ThreadWorld.run(2, body, timeout=60)
    assert m0.startswith("CommMismatch: group member #0 (2 allreduces of 8 int32 in all, packed into one): rank 0:"), m0
    assert m1.startswith("CommMismatch: group member #0 (allreduce of 4 int32): rank 1:"), m1
    assert max(t0, t1) < 2 * timeout, (t0, t1)
