"""Direct kernels on symmetric buffers (kernels/direct.cu, Communicator.alloc_symmetric).

The verification sweeps (test_collectives_thread.py, test_mpi.py) run the direct
cases of every dtype and op; this file covers what is particular to them: how "auto"
chooses them, back-to-back calls whose first barriers follow the previous call's last
one, and the errors: sizes, offsets or buffer kinds that differ across ranks end in
CommMismatch or ValueError on every rank, never in a hang or a wrong result.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from commref.collectives import catalogue, check, tuner, verify
from commref.collectives.communicator import Communicator
from commref.collectives.symmetric import SymmetricArena
from commref.transports.errors import CommMismatch
from commref.transports.world import ThreadWorld

TIMEOUT = 20.0


def _comm(world, **kw) -> Communicator:
    return Communicator(world, "cpu", timeout=TIMEOUT, **kw)


def _kernel_of(comm, coll, buf) -> str:
    """The kernel of the plan made for the latest new signature of `coll` (call it right
    after the call on `buf`, whose signature must be new: plans are cached)."""
    names = [plan.kernel for key, plan in comm._calls.items() if key[0] == coll]
    assert names, f"no plan of {coll} for a buffer of {buf.size} elements"
    return names[-1]


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_auto_takes_direct_for_symmetric_buffers_only(nranks):
    """From tuner.DIRECT_MIN_BYTES on; below it the ring's few steps are faster."""
    def body(world):
        comm = _comm(world)
        r, n = world.rank, world.size
        count = tuner.DIRECT_MIN_BYTES // 4 + 3
        x = verify.make_input("allreduce", np.float32, "sum", 5, r, n, count)
        exp = verify.expected_output("allreduce", np.float32, "sum", 5, r, n, count)
        sym_in, sym_out = comm.alloc_symmetric(x.size, x.dtype), comm.alloc_symmetric(x.size, x.dtype)
        sym_in[...] = x
        comm.allreduce(sym_in, sym_out)
        direct = _kernel_of(comm, "allreduce", sym_in)
        plain_out = np.zeros(x.size * 2, np.float32)  # another signature: its own plan
        comm.allreduce(np.concatenate([x, x]), plain_out)
        ring = _kernel_of(comm, "allreduce", plain_out)
        comm.close()
        return direct, ring, verify.count_wrong(sym_out, exp), verify.count_wrong(plain_out[: x.size], exp)

    for direct, ring, wrong_sym, wrong_plain in ThreadWorld.run(nranks, body, timeout=60):
        assert direct == "commref_direct_allreduce"
        assert ring in ("commref_ring_allreduce", "commref_tree_allreduce")  # tree: small, > 2 ranks
        assert wrong_sym == 0 and wrong_plain == 0


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_which_buffers_must_be_symmetric(nranks):
    """Only the buffers peers access must be symmetric: allgather and alltoall store
    into peers' recvbufs (any sendbuf), reduce_scatter loads peers' sendbufs (any
    recvbuf), allreduce does both. Each call runs the direct kernel where it can and gives the
    reference's result either way."""
    def body(world):
        comm = _comm(world)
        r, n = world.rank, world.size
        per = tuner.DIRECT_MIN_BYTES // 4 + 5  # elements per rank, "auto" picks direct
        results = {}
        for coll, send_sym, recv_sym in [("allgather", False, True), ("allgather", True, False),
                                         ("reduce_scatter", True, False), ("reduce_scatter", False, True),
                                         ("allreduce", True, False), ("alltoall", False, True),
                                         ("alltoall", True, False)]:
            count = per if coll != "reduce_scatter" else per * n
            x = verify.make_input(coll, np.int32, "sum", 3, r, n, count)
            exp = verify.expected_output(coll, np.int32, "sum", 3, r, n, count)
            send = comm.alloc_symmetric(x.size, x.dtype) if send_sym else np.empty_like(x)
            send[...] = x
            out = comm.alloc_symmetric(exp.size, exp.dtype) if recv_sym else np.zeros_like(exp)
            op = ("sum",) if catalogue.get(coll).reducing else ()
            getattr(comm, coll)(send, out, *op)
            results[(coll, send_sym, recv_sym)] = (_kernel_of(comm, coll, send).split("_")[1],
                                                   verify.count_wrong(out, exp))
            comm._calls.clear()  # the next case has the same signature: plan it afresh
        comm.close()
        return results

    for results in ThreadWorld.run(nranks, body, timeout=60):
        assert {case: wrong for case, (_, wrong) in results.items()} == dict.fromkeys(results, 0)
        kernels = {case: kernel for case, (kernel, _) in results.items()}
        assert kernels.pop(("allreduce", True, False)) in ("ring", "tree")  # tree: small, > 2 ranks
        assert kernels == {("allgather", False, True): "direct", ("allgather", True, False): "ring",
                           ("reduce_scatter", True, False): "direct", ("reduce_scatter", False, True): "ring",
                           ("alltoall", False, True): "direct", ("alltoall", True, False): "ring"}


def test_back_to_back_direct_calls_with_changing_counts(monkeypatch):
    """A rank may start call k+1 while a peer still leaves call k's last barrier; the
    first barrier's call check must not read the next call's count as a mismatch
    (it did, before checks moved to first barriers only)."""
    monkeypatch.setattr(tuner, "BYTES_PER_CHANNEL", 256)  # several channels

    def body(world):
        comm = _comm(world, max_channels=3)
        arena = SymmetricArena(comm, 1 << 20)
        r, n = world.rank, world.size
        wrong = 0
        for it in range(60):
            count = (7, 1001, 64)[it % 3]
            coll = ("allreduce", "reduce_scatter", "allgather")[it % 3]
            arena.reset()
            dt = np.dtype(np.uint8 if coll == "allgather" else np.int32)
            op = None if coll == "allgather" else "sum"
            x = verify.make_input(coll, dt, op, it, r, n, count)
            send = arena.take(x.size, dt)
            send[...] = x
            out = arena.take(catalogue.get(coll).counts(count, n)[1], dt)
            getattr(comm, coll)(send, out, *([op] if op else []), algorithm="direct")
            wrong += verify.count_wrong(out, verify.expected_output(coll, dt, op, it, r, n, count))
        comm.close()
        return wrong

    assert ThreadWorld.run(4, body, timeout=60) == [0] * 4


def test_direct_on_plain_buffers_is_a_clear_error():
    def body(world):
        comm = _comm(world)
        x = np.ones(16, np.float32)
        with pytest.raises(ValueError, match="alloc_symmetric"):
            comm.allreduce(x, np.zeros_like(x), algorithm="direct")
        with pytest.raises(ValueError, match="direct.*not broadcast"):
            comm.broadcast(x, np.zeros_like(x), 0, algorithm="direct")
        comm.close()

    ThreadWorld.run(2, body, timeout=30)


def test_free_symmetric_releases_the_window():
    """After free_symmetric the array is plain memory to the communicator (the ring
    runs on it) and later windows work; freeing an array that is not a window, or
    different windows on different ranks, is a ValueError on every rank."""
    def body(world):
        comm = _comm(world)
        r, n = world.rank, world.size
        count = tuner.DIRECT_MIN_BYTES // 4 * 2
        x = verify.make_input("allreduce", np.int32, "sum", 4, r, n, count)
        exp = verify.expected_output("allreduce", np.int32, "sum", 4, r, n, count)
        a, b = comm.alloc_symmetric(count, np.int32), comm.alloc_symmetric(count, np.int32)
        a[...] = x
        comm.allreduce(a, b)
        kernels = [_kernel_of(comm, "allreduce", a)]
        windows = len(comm._symmetric)
        comm.free_symmetric(b)
        comm._calls.clear()
        b2 = np.zeros_like(b)
        comm.allreduce(a, b2)  # a is symmetric, b2 not: the ring
        kernels.append(_kernel_of(comm, "allreduce", a))
        c = comm.alloc_symmetric(count, np.int32)
        comm._calls.clear()
        comm.allreduce(a, c)
        kernels.append(_kernel_of(comm, "allreduce", a))
        with pytest.raises(ValueError, match="free_symmetric needs the same array"):
            comm.free_symmetric(np.zeros(4, np.int32))
        with pytest.raises(ValueError, match="free_symmetric needs the same array"):
            comm.free_symmetric(a if r == 0 else c)
        left = len(comm._symmetric)
        comm.close()
        return kernels, windows, left, [verify.count_wrong(out, exp) for out in (b, b2, c)]

    for kernels, windows, left, wrong in ThreadWorld.run(3, body, timeout=60):
        assert kernels[0] == kernels[2] == "commref_direct_allreduce"
        assert kernels[1] in ("commref_ring_allreduce", "commref_tree_allreduce")  # tree: small, 3 ranks
        assert (windows, left) == (2, 2) and wrong == [0, 0, 0]


def test_symmetric_sizes_must_agree():
    def body(world):
        comm = _comm(world)
        with pytest.raises(ValueError, match="sizes differ"):
            comm.alloc_symmetric(100 + world.rank, np.float32)
        comm.close()

    ThreadWorld.run(3, body, timeout=30)


@pytest.mark.parametrize("nranks", [2, 3])
def test_symmetric_on_some_ranks_only_is_a_mismatch(nranks):
    """Rank 0 passes plain numpy buffers, so "auto" runs the ring kernel there and the
    direct kernel elsewhere: the job must end promptly with CommMismatch naming the
    algorithm (the direct kernel's ring handshake meets the ring kernel's first
    step), not with a timeout."""
    def body(world):
        comm = _comm(world)
        n = tuner.DIRECT_MIN_BYTES // 4 * 2  # large enough for "auto" to pick direct
        sym_in, sym_out = comm.alloc_symmetric(n, np.float32), comm.alloc_symmetric(n, np.float32)
        if world.rank == 0:
            sym_in, sym_out = np.ones(n, np.float32), np.zeros(n, np.float32)
        comm.allreduce(sym_in, sym_out)

    t0 = time.monotonic()
    with pytest.raises(CommMismatch, match="algorithm is '(direct|ring|tree)' here and '(ring|tree|direct)' there"):
        ThreadWorld.run(nranks, body, timeout=30)
    assert time.monotonic() - t0 < TIMEOUT / 2


def test_offsets_that_differ_across_ranks_are_a_mismatch():
    """Symmetric buffers at different offsets on two ranks would make each read the
    wrong part of its peer's window: the first barrier reports it instead."""
    def body(world):
        comm = _comm(world)
        arena = SymmetricArena(comm, 1 << 16)
        arena.take(world.rank * 16, np.uint8)  # rank 1's buffers start a page later
        send, out = arena.take(256, np.float32), arena.take(256, np.float32)
        send[...] = 1
        comm.allreduce(send, out, algorithm="direct")

    with pytest.raises(CommMismatch, match="symmetric buffer offset is"):
        ThreadWorld.run(2, body, timeout=30)


def test_gin_peers_run_the_ring_kernel_on_symmetric_buffers():
    """The direct kernels load from peers' windows: with GIN peers "auto" keeps the
    ring kernels, and asking for direct is a clear error."""
    def body(world):
        comm = _comm(world, path="gin")
        r, n = world.rank, world.size
        count = tuner.DIRECT_MIN_BYTES // 4 * 2  # large enough for "auto" to pick direct on LSA
        x = verify.make_input("allreduce", np.int32, "sum", 9, r, n, count)
        send, out = comm.alloc_symmetric(x.size, x.dtype), comm.alloc_symmetric(x.size, x.dtype)
        send[...] = x
        comm.allreduce(send, out)
        kernel = _kernel_of(comm, "allreduce", send)
        with pytest.raises(ValueError, match="every peer over LSA"):
            comm.allreduce(send, out, algorithm="direct")
        comm.close()
        return kernel, verify.count_wrong(out, verify.expected_output("allreduce", np.int32, "sum", 9, r, n, count))

    assert ThreadWorld.run(2, body, timeout=60) == [("commref_ring_allreduce", 0)] * 2


def test_check_sweep_lists_direct_cases_only_where_they_can_run():
    colls = ["allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall"]
    with_direct = check.cases(colls, ["float32"], ["sum"], [], [7], 2, 1)
    without = check.cases(colls, ["float32"], ["sum"], [], [7], 2, 1, direct=False)
    assert {c.coll for c in with_direct if c.algorithm == "direct"} == set(catalogue.with_algorithm("direct"))
    assert not any(c.algorithm == "direct" for c in without)


def test_tuner_takes_direct_from_its_threshold():
    big, small = tuner.DIRECT_MIN_BYTES, tuner.DIRECT_MIN_BYTES - 4
    assert tuner.plan("allreduce", "auto", big, 2, "cpu", 1, symmetric=True).algorithm == "direct"
    assert tuner.plan("allreduce", "auto", small, 2, "cpu", 1, symmetric=True).algorithm == "ring"
    assert tuner.plan("allreduce", "auto", big, 2, "cpu", 1, symmetric=False).algorithm == "ring"
    assert tuner.plan("broadcast", "auto", 1 << 20, 2, "cpu", 1, symmetric=True).algorithm == "ring"
    assert tuner.plan("allgather", "direct", 8, 2, "cpu", 1, symmetric=True).algorithm == "direct"
