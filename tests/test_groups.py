"""Groups (ncclGroupStart / ncclGroupEnd): comm.group_start / group_end / group() and
commref.group_start / group_end / group(), one thread's group over every communicator.

- nesting counts as NCCL's: only the outermost group_end launches (the data is not
  there before it); group_end without group_start raises;
- a group over two communicators, posted in opposite orders on the two ranks;
- mixed groups: collectives recorded and launched at group_end with sends and receives
  in one group, exact, in either order of posting;
- an exception leaving `with group():` launches nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WORLD_TIMEOUT, close_after_barrier

import commref
from commref import Communicator
from commref.collectives.groups import grouping
from commref.transports.thread_world import ThreadWorld


def _comm(world, **kw) -> Communicator:
    return Communicator(world, "cpu", timeout=WORLD_TIMEOUT, slot_bytes=1024, nsteps=2, **kw)


def test_nested_groups_launch_at_the_outermost_end():
    def body(world):
        comm = _comm(world)
        n, r = world.size, world.rank
        x = np.arange(5000, dtype=np.int64) + 10_000 * r
        y = np.zeros_like(x)
        seen = []
        with commref.group():
            comm.group_start()
            comm.send(x, (r + 1) % n)
            comm.group_end()  # inner: records only
            seen.append(int(y.any()))
            with comm.group():
                comm.recv(y, (r - 1) % n)
            seen.append(int(y.any()))
        seen.append(bool((y == np.arange(5000, dtype=np.int64) + 10_000 * ((r - 1) % n)).all()))
        close_after_barrier(world, comm)
        return seen

    assert ThreadWorld.run(3, body, timeout=WORLD_TIMEOUT) == [[0, 0, True]] * 3


def test_group_end_without_group_start_raises():
    with pytest.raises(RuntimeError, match=r"group_end\(\) without a matching group_start\(\)"):
        commref.group_end()
    commref.group_start()
    commref.group_end()  # an empty group launches nothing
    with pytest.raises(RuntimeError, match="without a matching group_start"):
        Communicator.group_end()


def test_a_group_over_two_communicators_in_opposite_orders():
    """Rank 0 posts on comm a then b, rank 1 on b then a: a group's communicators run
    concurrently, so neither waits for the other."""

    def body(world):
        a, b = _comm(world), _comm(world, path="gin")
        peer = 1 - world.rank
        xs = [np.full(3000, 10 * world.rank + k, np.float32) for k in range(2)]
        ys = [np.zeros(3000, np.float32) for _ in range(2)]
        order = [(a, 0), (b, 1)] if world.rank == 0 else [(b, 1), (a, 0)]
        with commref.group():
            for comm, k in order:
                comm.send(xs[k], peer)
                comm.recv(ys[k], peer)
        close_after_barrier(world, b)
        close_after_barrier(world, a)
        return [float(y[0]) for y in ys] + [bool((y == y[0]).all()) for y in ys]

    assert ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT) == [[10.0, 11.0, True, True], [0.0, 1.0, True, True]]


@pytest.mark.parametrize("path", ["lsa", "gin"])
@pytest.mark.parametrize("p2p_first", [True, False])
def test_mixed_groups_of_collectives_and_p2p(path, p2p_first):
    """allreduce, a ring shift, allgather in one group (the p2p calls first on some
    ranks, last on others), three times on one communicator: every result exact."""

    def body(world):
        comm = _comm(world, path=path)
        n, r = world.size, world.rank
        results = []
        for k in range(3):
            x = np.arange(999, dtype=np.int32) * (r + 1) + k
            s, g = np.zeros_like(x), np.zeros(n * 7, np.float64)
            sent, got = np.arange(4321, dtype=np.uint8) ^ r, np.zeros(4321, np.uint8)

            def p2p():
                comm.recv(got, (r - 1) % n)
                comm.send(sent, (r + 1) % n)

            with comm.group():
                if p2p_first == (r % 2 == 0):
                    p2p()
                comm.allreduce(x, s)
                comm.allgather(np.full(7, r + k, np.float64), g)
                if p2p_first != (r % 2 == 0):
                    p2p()
            want = np.arange(999, dtype=np.int32) * (n * (n + 1) // 2) + n * k
            results.append(
                bool((s == want).all())
                and bool((g == np.repeat(np.arange(n, dtype=np.float64) + k, 7)).all())
                and bool((got == (np.arange(4321, dtype=np.uint8) ^ ((r - 1) % n))).all())
            )
        close_after_barrier(world, comm)
        return results

    assert ThreadWorld.run(3, body, timeout=WORLD_TIMEOUT) == [[True] * 3] * 3


def test_an_exception_in_a_group_launches_nothing():
    def body(world):
        comm = _comm(world)
        y = np.zeros(10, np.int32)
        with pytest.raises(ZeroDivisionError):
            with commref.group():
                comm.send(np.ones(10, np.int32), 1 - world.rank)
                comm.recv(y, 1 - world.rank)
                1 / 0
        # nothing was launched, nothing is left recorded: the next group starts afresh
        z = np.zeros(10, np.int32)
        with comm.group():
            comm.send(np.full(10, world.rank + 5, np.int32), 1 - world.rank)
            comm.recv(z, 1 - world.rank)
        close_after_barrier(world, comm)
        return int(y.sum()), int(z[0]), grouping()

    assert ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT) == [(0, 6, False), (0, 5, False)]


def test_a_collective_that_fails_in_a_group_is_named():
    """Member #1, an allreduce whose count differs between the ranks, fails on both at
    group_end, named; member #0, a matched exchange, arrived."""

    def body(world):
        comm = Communicator(world, "cpu", timeout=3.0)
        peer, y = 1 - world.rank, np.zeros(6, np.uint32)
        try:
            with comm.group():
                comm.send(np.full(6, world.rank + 1, np.uint32), peer)
                comm.allreduce(np.ones(4 + world.rank, np.int32), np.zeros(4 + world.rank, np.int32))
                comm.recv(y, peer)
            message = None
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
        world.barrier(what="test done", timeout=30)
        comm.close()
        return message, int(y[0])

    for rank, (message, got) in enumerate(ThreadWorld.run(2, body, timeout=60)):
        assert message.startswith(f"CommMismatch: group member #1 (allreduce of {4 + rank} int32): rank {rank}:"), (
            message
        )
        assert "count is" in message, message
        assert got == 0  # the communicator's sends and receives launch after its collectives: not reached
