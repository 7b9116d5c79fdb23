"""Collectives on the CPU engine with N ranks as threads (ThreadWorld), N = 1..8.

Each world runs a reduced verification sweep (commref.collectives.check) over every collective
and algorithm, five dtypes, every op, in-place and out-of-place, with a FIFO geometry
small enough that pipelining wraps the slots many times. The tuner only uses several
channels from 4 MiB per channel on the CPU, so the sweeps lower that threshold (in this
process) to exercise the multi-channel split on small counts.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import GEOMETRIES, WORLD_TIMEOUT

from commref.collectives import check, tuner, verify
from commref.collectives.catalogue import KERNEL_NAMES as COLLECTIVES
from commref.collectives.communicator import Communicator
from commref.collectives.verify import OPS
from commref.device_kernels import abi
from commref.device_kernels.abi import window_layout
from commref.transports.thread_world import ThreadWorld

DTYPES = ["float32", "bfloat16", "int8", "uint64", "float16"]


def _odd_count(nranks: int, channels: int) -> int:
    """A count that does not divide evenly by ranks * channels (nor by either)."""
    c = nranks * channels * 37 + 5
    while c % (nranks * channels) == 0 or (nranks > 1 and c % nranks == 0) or c % channels == 0:
        c += 1
    return c


def _sweep(world, geometry, counts):
    threads, channels, slot, nsteps = geometry
    comm = Communicator(
        world, "cpu", max_channels=channels, slot_bytes=slot, nsteps=nsteps, threads=threads, timeout=WORLD_TIMEOUT
    )
    case_list = check.cases(list(COLLECTIVES), DTYPES, list(OPS), [], counts, world.size, seed=7)
    wrong = check.run_sweep(comm, case_list)
    return case_list, wrong


def _sweep_params():
    """Every world size once, alternating the geometries, plus the other geometry for
    two sizes (the sweeps of 6..8 ranks dominate the run time on two cores)."""
    names = list(GEOMETRIES)
    params = [(n, names[n % 2]) for n in range(1, 9)] + [(3, names[0]), (4, names[1])]
    return [pytest.param(n, GEOMETRIES[g], id=f"{n}ranks-{g}") for n, g in sorted(params)]


@pytest.mark.parametrize("nranks, geometry", _sweep_params())
def test_sweep(nranks, geometry, many_channels):
    counts = [0, 1, 7, 1001, _odd_count(nranks, geometry[1])]
    # The larger counts really are split across every channel.
    assert tuner.plan("allgather", "ring", 1001, nranks, "cpu", geometry[1]).nchannels == geometry[1]
    results = ThreadWorld.run(nranks, _sweep, geometry, counts, timeout=WORLD_TIMEOUT)
    case_list, wrong = results[0]
    assert all(r[1] == wrong for r in results), "ranks disagree on the per-case totals"
    # Every collective x algorithm x dtype x op x count x placement was run: reducing
    # (collective, algorithm) pairs are allreduce ring, tree and direct, reduce_scatter
    # ring and direct, reduce ring; moving ones allgather ring and direct, broadcast ring;
    # and allreduce nvls for the pairs it reduces.
    assert {(c.coll, c.algorithm) for c in case_list} >= {
        ("allreduce", "direct"),
        ("reduce_scatter", "direct"),
        ("allgather", "direct"),
        ("alltoall", "direct"),
        ("allreduce", "nvls"),
    }
    # alltoall ring and direct: out of place only (no in-place form).
    reducing, moving, out_of_place_only = 6, 3, 2
    floats = [d for d in DTYPES if d in verify.SUBNORMAL_EXPONENT]
    denormal = reducing * len(verify.DENORMAL_OPS) * len(floats) * len(counts)
    # allreduce nvls: the 14 (dtype, op) pairs NVLink multicast reduces here (float32 sum
    # avg; bfloat16, uint64, float16 sum avg min max), and 10 of them on denormal inputs
    # (the floating ones but none of int8's or uint64's)
    nvls, nvls_denormal = 14 * len(counts) * 2, 10 * len(counts)
    assert len(case_list) == (
        ((reducing * len(OPS) + moving) * 2 + out_of_place_only) * len(DTYPES) * len(counts)
        + denormal
        + nvls
        + nvls_denormal
    )
    assert sum(c.values == "denormal" for c in case_list) == denormal + nvls_denormal
    assert sum(c.algorithm == "nvls" for c in case_list) == nvls + nvls_denormal
    bad = [(c, w) for c, w in zip(case_list, wrong) if w]
    assert sum(wrong) == 0, f"{len(bad)} failing cases, first: {bad[:5]}"


# ---------------------------------------------------------------------------------------
# the checker itself must see errors
# ---------------------------------------------------------------------------------------


class _CorruptingComm:
    """Wraps a Communicator; allreduce flips the bits of one output element on one rank."""

    def __init__(self, comm, bad_rank: int, index: int = 3):
        self._comm, self._bad_rank, self._index = comm, bad_rank, index

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def allreduce(self, sendbuf, recvbuf, op="sum", **kw):
        self._comm.allreduce(sendbuf, recvbuf, op, **kw)
        if self._comm.rank == self._bad_rank:
            recvbuf.view(np.uint8)[self._index * recvbuf.itemsize] ^= 0xFF


class _MisroutingComm:
    """Wraps a Communicator; alltoall on one rank swaps two blocks of recvbuf, as a
    kernel that stores a block at the wrong slot would."""

    def __init__(self, comm, bad_rank: int):
        self._comm, self._bad_rank = comm, bad_rank

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def alltoall(self, sendbuf, recvbuf, **kw):
        self._comm.alltoall(sendbuf, recvbuf, **kw)
        if self._comm.rank == self._bad_rank:
            blocks = recvbuf.reshape(self._comm.nranks, -1)
            blocks[[0, 1]] = blocks[[1, 0]]


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_run_case_sees_a_misplaced_alltoall_block(algorithm):
    """Every element of two swapped blocks counts wrong, on the rank whose recvbuf they
    are in; the other ranks' results are exact."""
    count = 10

    def fn(world):
        comm = _MisroutingComm(Communicator(world, "cpu", timeout=WORLD_TIMEOUT), bad_rank=1)
        case = check.Case("alltoall", algorithm, "int8", None, count, False, 0, 9)
        return check.run_sweep(comm, [case])

    assert ThreadWorld.run(3, fn, timeout=WORLD_TIMEOUT) == [[2 * count]] * 3


@pytest.mark.parametrize("dtype", list(verify.DTYPES))
@pytest.mark.parametrize("nranks", [2, 3, 8])
def test_alltoall_blocks_name_their_route(dtype, nranks):
    """A block that lands in another slot, or that another rank sent, differs in every
    element from what belongs there, even one element long: each value's residue
    modulo nranks**2 is the block's (source, destination) pair."""
    for count in (1, 5):
        got = [verify.expected_output("alltoall", dtype, None, 4, d, nranks, count) for d in range(nranks)]
        for d in range(nranks):
            blocks = got[d].reshape(nranks, count)
            assert verify.count_wrong(blocks[[1, 0, *range(2, nranks)]].ravel(), got[d]) == 2 * count
            # Block 0 replaced by the block rank 0 sent to another rank (a wrong destination).
            wrong_dest = got[(d + 1) % nranks].reshape(nranks, count)[0]
            assert verify.count_wrong(np.concatenate([wrong_dest, blocks[1:].ravel()]), got[d]) == count
        send = verify.make_input("alltoall", dtype, None, 4, 1, nranks, count).reshape(nranks, count)
        assert all(verify.count_wrong(send[d], got[d].reshape(nranks, count)[1]) == 0 for d in range(nranks))


@pytest.mark.parametrize("nranks", [1, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_run_case_detects_a_planted_error(nranks, in_place):
    def fn(world):
        comm = _CorruptingComm(Communicator(world, "cpu", timeout=WORLD_TIMEOUT), bad_rank=world.size - 1)
        bad = check.Case("allreduce", "ring", "float32", "sum", 10, in_place, 0, 5)
        good = check.Case("allgather", "ring", "float32", None, 10, in_place, 0, 6)
        mine = check.run_case(comm, bad)
        return mine, check.run_sweep(comm, [bad, good])

    results = ThreadWorld.run(nranks, fn, timeout=WORLD_TIMEOUT)
    assert [r[0] for r in results] == [0] * (nranks - 1) + [1]
    assert all(r[1] == [1, 0] for r in results)


def test_count_wrong_sees_every_kind_of_difference():
    x = verify.input_values(verify.DTYPES["float32"], "sum", 1, 0, 8)
    assert verify.count_wrong(x, x.copy()) == 0
    y = x.copy()
    y[[1, 6]] += 1
    assert verify.count_wrong(y, x) == 2
    assert verify.count_wrong(x[:7], x) == 8  # a length mismatch counts every element
    neg_zero = np.array([0.0], np.float32), np.array([-0.0], np.float32)
    assert verify.count_wrong(*neg_zero) == 1  # bitwise, not ==


# ---------------------------------------------------------------------------------------
# repeated calls on one communicator: the step counters persist across launches
# ---------------------------------------------------------------------------------------


def _link_steps(window_bytes: np.ndarray, channels: int, slot: int, nsteps: int, nranks: int) -> np.ndarray:
    """The persistent step counters of one rank's window: [channel, in0..in3, out0..out3]
    of the collectives' channels (the window's p2p channels follow them)."""
    layout, _ = window_layout(channels + abi.p2p_channels(nranks), slot, nsteps)
    off = int(layout["stateOff"])
    n = channels * (abi.CONN_IN + abi.CONN_OUT)
    return window_bytes[off : off + 8 * n].view(np.uint64).reshape(channels, abi.CONN_IN + abi.CONN_OUT).copy()


@pytest.mark.parametrize("nranks", [2, 5])
def test_repeated_interleaved_calls(nranks, many_channels):
    channels, slot, nsteps = 3, 128, 2
    rounds = 3
    plan: list = []  # (collective, algorithm, dtype, op, count)
    for k in range(rounds):
        plan += [
            ("allreduce", "ring", "float32", "sum", 1001 + k),
            ("allgather", "ring", "int8", None, 33 * k),
            ("allreduce", "tree", "bfloat16", "max", 257),
            ("reduce_scatter", "ring", "uint64", "prod", 65 + k),
            ("broadcast", "ring", "float16", None, 500),
            ("reduce", "ring", "int8", "avg", 77),
            ("allreduce", "tree", "uint64", "min", 0),
            ("allreduce", "ring", "float16", "avg", 3),
        ]

    def fn(world):
        comm = Communicator(
            world, "cpu", max_channels=channels, slot_bytes=slot, nsteps=nsteps, threads=2, timeout=WORLD_TIMEOUT
        )
        wrong, snapshots = [], []
        for i, (coll, algo, dtype, op, count) in enumerate(plan):
            root = i % world.size
            case = check.Case(coll, algo, dtype, op, count, i % 2 == 1, root, 100 + i)
            wrong.append(check.run_case(comm, case))
            if i % (len(plan) // rounds) == 0:  # first call of each round
                snapshots.append(_link_steps(comm.window.local, channels, slot, nsteps, world.size))
        world.barrier(what="steps settled")
        snapshots.append(_link_steps(comm.window.local, channels, slot, nsteps, world.size))
        return wrong, snapshots

    results = ThreadWorld.run(nranks, fn, timeout=WORLD_TIMEOUT)
    for r, (wrong, _) in enumerate(results):
        assert sum(wrong) == 0, f"rank {r}: wrong elements per call {wrong}"
    finals = [res[1][-1] for res in results]
    # The counters grew over the rounds (they persist; a reset would show as a drop).
    for r, (_, snaps) in enumerate(results):
        total = [int(s.sum()) for s in snaps]
        assert total == sorted(total) and total[-1] > total[0], f"rank {r}: {total}"
    # Every ring link: what the sender posted equals what the receiver consumed.
    for r in range(nranks):
        nxt = (r + 1) % nranks
        sent = finals[r][:, abi.CONN_IN + abi.OUT_RING]
        received = finals[nxt][:, abi.IN_RING]
        assert (sent == received).all(), f"ring link {r}->{nxt}: sent {sent}, received {received}"
        assert sent[0] > 0
    # Tree links: every parent/child pair agrees too, in both directions.
    from commref.collectives import topology

    peers = [topology.channel_peers(r, [0] * nranks, channels) for r in range(nranks)]
    for r in range(nranks):
        for c in range(channels):
            parent = int(peers[r][c]["treeParent"])
            if parent < 0:
                continue
            up_sent = finals[r][c, abi.CONN_IN + abi.OUT_TREE_PARENT]
            up_recv = finals[parent][c, int(peers[r][c]["treeInAtParent"])]
            down_sent = finals[parent][c, abi.CONN_IN + int(peers[r][c]["treeOutAtParent"])]
            down_recv = finals[r][c, abi.IN_TREE_PARENT]
            assert up_sent == up_recv and down_sent == down_recv, (r, c, parent)


def test_many_small_calls_reuse_the_fifo(many_channels):
    """Far more launches than FIFO slots on a 2-step FIFO: each call resumes at the step
    the previous one stopped at."""

    def fn(world):
        comm = Communicator(world, "cpu", max_channels=2, slot_bytes=64, nsteps=2, timeout=WORLD_TIMEOUT)
        out = []
        for i in range(40):
            x = np.full(3 + 7 * (i % 5), world.rank + i, dtype=np.int32)
            y = np.empty_like(x)
            comm.allreduce(x, y, "sum", algorithm="tree" if i % 3 == 0 else "ring")
            out.append(bool((y == sum(r + i for r in range(world.size))).all()))
        return out

    for r, ok in enumerate(ThreadWorld.run(3, fn, timeout=WORLD_TIMEOUT)):
        assert all(ok), f"rank {r}: {ok}"


def test_single_slot_fifo_is_rejected():
    """A ring step holds its inbound slot while it waits for an outbound one, so a
    one-slot FIFO would deadlock: construction refuses it."""

    def fn(world):
        with pytest.raises(ValueError, match="nsteps must be >= 2"):
            Communicator(world, "cpu", max_channels=1, slot_bytes=64, nsteps=1, timeout=1.0)
        return True

    assert all(ThreadWorld.run(2, fn, timeout=5.0))


@pytest.mark.parametrize("dtype", sorted(verify.SUBNORMAL_EXPONENT))
@pytest.mark.parametrize("op", verify.DENORMAL_OPS)
def test_denormal_cases_catch_flush_to_zero(dtype, op):
    """The denormal inputs give exact, nonzero, subnormal results (in the compute type
    too for float16 and bfloat16): a build that flushes denormals to zero returns zeros
    and the check counts each of them wrong."""
    nranks, count = 4, 1000
    ins = [verify.make_input("allreduce", dtype, op, 5, r, nranks, count, "denormal") for r in range(nranks)]
    expected = verify.expected_output("allreduce", dtype, op, 5, 0, nranks, count, values="denormal")
    wide = expected.astype(np.float64)
    smallest_normal = float(ml_dtypes.finfo(verify.DTYPES[dtype]).smallest_normal)
    nonzero = wide[wide != 0]
    assert nonzero.size > count // 2 and np.all(np.abs(nonzero) < smallest_normal), "results are not subnormal"
    if dtype in ("bfloat16", "float32"):  # computed in float32: subnormal there as well
        assert np.all(np.abs(nonzero) < float(np.finfo(np.float32).smallest_normal))
    if op == "sum":
        assert np.array_equal(sum(x.astype(np.float64) for x in ins), wide), "the sum is not exact"
    flushed = np.where(np.abs(wide) < smallest_normal, np.copysign(0.0, wide), wide).astype(expected.dtype)
    assert verify.count_wrong(flushed, expected) == nonzero.size
