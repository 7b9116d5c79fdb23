"""Communicator.split (ncclCommSplit): children of the ranks that pass one color,
ranked by key, with windows and a proxy of their own.

- membership and order: by key, ties by rank; SPLIT_NOCOLOR gives None; the child's
  collectives exact against numpy on its members' data, interleaved with the parent's;
- a child takes the parent's options with overrides (a child over GIN under an LSA
  parent), and a split of a split;
- bad colors and keys fail on every rank, naming the rank, with no rank left waiting;
- under mpiexec: children over GIN on network mpi, exact, nothing left in /dev/shm.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from commref import SPLIT_NOCOLOR, Communicator

# ---------------------------------------------------------------------------------------
# the MPI job (this file run under mpiexec): two children of two ranks, over GIN
# ---------------------------------------------------------------------------------------


def _mpi_main() -> None:
    from commref.transports.mpi_world import MPIWorld

    world = MPIWorld()
    with Communicator(world, "cpu", path="lsa") as comm:
        child = comm.split(world.rank // 2, key=-world.rank, path="gin", network="mpi")
        with child:
            members = sorted((r for r in range(world.size) if r // 2 == world.rank // 2), reverse=True)
            x = np.arange(1000, dtype=np.float64) * (world.rank + 1)
            y = np.empty_like(x)
            child.allreduce(x, y)
            exact = np.array_equal(y, np.arange(1000, dtype=np.float64) * sum(r + 1 for r in members))
            print(f"rank {world.rank}: child rank {child.rank} of {child.nranks} path {child.path} exact {exact}")
        z = np.empty(4, np.int64)
        comm.allreduce(np.full(4, world.rank, np.int64), z)  # the parent outlives its child
        print(f"rank {world.rank}: parent after child {int(z[0])}")


if __name__ == "__main__":
    _mpi_main()
    sys.exit(0)


# ---------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------

import pytest  # noqa: E402
from conftest import clean_env, run_mpi  # noqa: E402
from helpers import WORLD_TIMEOUT  # noqa: E402

from commref.transports.thread_world import ThreadWorld  # noqa: E402


def _split_job(world, colors, keys, counts):
    """Each rank splits by colors[rank], keys[rank]; per count, an AllReduce on its child
    (none without a color) of data seeded by the parent rank, then one on the parent;
    an AllGather of the parent ranks on the child; one AllReduce on the parent after
    the child is closed."""
    with Communicator(world, "cpu", timeout=WORLD_TIMEOUT) as comm:
        child = comm.split(colors[world.rank], key=keys[world.rank])
        sums, out = [], None
        for count in counts:
            x = _data(world.rank, count)
            if child is not None:
                y = np.empty_like(x)
                child.allreduce(x, y)
                sums.append(y)
            z = np.empty_like(x)
            comm.allreduce(x, z)  # the parent's collectives interleave with the child's
            sums.append(z)
        if child is not None:
            with child:
                order = np.empty(child.nranks, np.int64)
                child.allgather(np.array([world.rank], np.int64), order)
                out = (child.rank, child.nranks, order.tolist(), child.world.members)
        after = np.empty(3, np.int64)
        comm.allreduce(np.full(3, world.rank, np.int64), after)
        return out, sums, int(after[0])


def _data(rank: int, count: int) -> np.ndarray:
    return np.random.default_rng(rank * 100 + count).integers(-50, 50, count).astype(np.int32)


def test_split_ranks_by_key_leaves_no_color_out_and_its_collectives_are_exact():
    n, counts = 5, [1, 7, 3001]
    colors = [0, 1, 0, SPLIT_NOCOLOR, 1]
    keys = [5, 0, -1, 0, 0]  # color 0: rank 2 (key -1) before rank 0; color 1: a tie, by rank
    results = ThreadWorld.run(n, _split_job, colors, keys, counts, timeout=WORLD_TIMEOUT)
    groups = {0: [2, 0], 1: [1, 4]}
    everyone = [sum(_data(r, c) for r in range(n)) for c in counts]
    for rank, (out, sums, after) in enumerate(results):
        assert after == sum(range(n))
        if colors[rank] == SPLIT_NOCOLOR:
            assert out is None and all(np.array_equal(a, b) for a, b in zip(sums, everyone))
            continue
        group = groups[colors[rank]]
        assert out == (group.index(rank), len(group), group, group)
        for i, count in enumerate(counts):
            assert np.array_equal(sums[2 * i], sum(_data(r, count) for r in group)), (rank, count)
            assert np.array_equal(sums[2 * i + 1], everyone[i]), (rank, count)


def _override_and_nest(world):
    with Communicator(world, "cpu", path="lsa", timeout=WORLD_TIMEOUT) as comm:
        with comm.split(0, path="gin", wire="unordered") as child:  # every rank: one child over GIN
            with child.split(child.rank % 2) as grandchild:
                x = np.arange(64, dtype=np.float32) + world.rank
                y = np.empty_like(x)
                grandchild.allreduce(x, y)
                members = [child.world.members[m] for m in grandchild.world.members]
                return comm.peer_mask, child.peer_mask != 0, child.path, grandchild.path, members, y


def test_a_child_takes_the_parents_options_with_overrides_and_splits_again():
    results = ThreadWorld.run(4, _override_and_nest, timeout=WORLD_TIMEOUT)
    for rank, (parent_mask, child_gin, child_path, grand_path, members, y) in enumerate(results):
        assert parent_mask == 0 and child_gin and child_path == grand_path == "gin"
        assert members == [r for r in range(4) if r % 2 == rank % 2]
        assert np.array_equal(y, sum(np.arange(64, dtype=np.float32) + r for r in members))


@pytest.mark.parametrize(
    "color, key, said",
    [
        (-5, None, "rank 1 passed color -5"),
        ("red", None, "rank 1 passed color 'red'"),
        (0, 1.5, "rank 1 passed color 0, key 1.5"),
    ],
)
def test_a_bad_color_or_key_fails_every_rank_naming_the_rank(color, key, said):
    def body(world):
        with Communicator(world, "cpu", timeout=WORLD_TIMEOUT) as comm:
            with pytest.raises(ValueError, match="a color is an int >= 0") as err:
                comm.split(color if world.rank == 1 else 0, key=key if world.rank == 1 else None)
            x = np.empty(2, np.int32)
            comm.allreduce(np.ones(2, np.int32), x)  # nobody was left inside the split
            return str(err.value), int(x[0])

    for rank, (message, total) in enumerate(ThreadWorld.run(3, body, timeout=WORLD_TIMEOUT)):
        assert message.startswith(f"rank {rank}: Communicator.split") and said in message, message
        assert total == 3


@pytest.mark.mpi
def test_split_under_mpiexec_children_over_gin_are_exact_and_leave_nothing(shm_leak_check):
    script = os.path.relpath(__file__, os.path.dirname(os.path.dirname(__file__)))
    proc = run_mpi(4, [script], timeout=120, env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in range(4):
        group = sorted((r for r in range(4) if r // 2 == rank // 2), reverse=True)
        assert f"rank {rank}: child rank {group.index(rank)} of 2 path gin exact True" in proc.stdout, out[-4000:]
        assert f"rank {rank}: parent after child 6" in proc.stdout, out[-4000:]
