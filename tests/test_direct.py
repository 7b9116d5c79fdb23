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

from commref.collectives import catalogue, check, model, tuner, verify
from commref.collectives.communicator import Communicator
from commref.collectives.symmetric import SymmetricArena
from commref.transports.errors import CommMismatch
from commref.transports.nodes import NODES_ENV
from commref.transports.thread_world import ThreadWorld

# A size at which the reference model takes the direct kernels on 2 to 4 ranks (test_model.py).
DIRECT_SIZE = 1 << 16

TIMEOUT = 20.0


def _comm(world, **kw) -> Communicator:
    return Communicator(world, "cpu", timeout=TIMEOUT, **kw)


def _kernel_of(comm, coll, buf) -> str:
    """The kernel of the plan made for the latest new signature of `coll` (call it right
    after the call on `buf`, whose signature must be new: plans are cached)."""
    names = [plan.kernel for plan in comm.planned(coll)]
    assert names, f"no plan of {coll} for a buffer of {buf.size} elements"
    return names[-1]


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_auto_takes_direct_for_symmetric_buffers_only(nranks):
    """At DIRECT_SIZE, where the reference model takes direct (tests/test_model.py)."""

    def body(world):
        comm = _comm(world)
        r, n = world.rank, world.size
        count = DIRECT_SIZE // 4 + 3
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
        per = DIRECT_SIZE // 4 + 5  # elements per rank, "auto" picks direct
        results = {}
        for coll, send_sym, recv_sym in [
            ("allgather", False, True),
            ("allgather", True, False),
            ("reduce_scatter", True, False),
            ("reduce_scatter", False, True),
            ("allreduce", True, False),
            ("alltoall", False, True),
            ("alltoall", True, False),
        ]:
            count = per if coll != "reduce_scatter" else per * n
            x = verify.make_input(coll, np.int32, "sum", 3, r, n, count)
            exp = verify.expected_output(coll, np.int32, "sum", 3, r, n, count)
            send = comm.alloc_symmetric(x.size, x.dtype) if send_sym else np.empty_like(x)
            send[...] = x
            out = comm.alloc_symmetric(exp.size, exp.dtype) if recv_sym else np.zeros_like(exp)
            op = ("sum",) if catalogue.get(coll).reducing else ()
            getattr(comm, coll)(send, out, *op)
            results[(coll, send_sym, recv_sym)] = (
                _kernel_of(comm, coll, send).split("_")[1],
                verify.count_wrong(out, exp),
            )
            comm.clear_plans()  # the next case has the same signature: plan it afresh
        comm.close()
        return results

    for results in ThreadWorld.run(nranks, body, timeout=60):
        assert {case: wrong for case, (_, wrong) in results.items()} == dict.fromkeys(results, 0)
        kernels = {case: kernel for case, (kernel, _) in results.items()}
        assert kernels.pop(("allreduce", True, False)) in ("ring", "tree")  # tree: small, > 2 ranks
        assert kernels == {
            ("allgather", False, True): "direct",
            ("allgather", True, False): "ring",
            ("reduce_scatter", True, False): "direct",
            ("reduce_scatter", False, True): "ring",
            ("alltoall", False, True): "direct",
            ("alltoall", True, False): "ring",
        }


def test_back_to_back_direct_calls_with_changing_counts(many_channels):
    """A rank may start call k+1 while a peer still leaves call k's last barrier; the
    first barrier's call check must not read the next call's count as a mismatch
    (it did, before checks moved to first barriers only)."""

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
        count = DIRECT_SIZE // 4 * 2
        x = verify.make_input("allreduce", np.int32, "sum", 4, r, n, count)
        exp = verify.expected_output("allreduce", np.int32, "sum", 4, r, n, count)
        a, b = comm.alloc_symmetric(count, np.int32), comm.alloc_symmetric(count, np.int32)
        a[...] = x
        comm.allreduce(a, b)
        kernels = [_kernel_of(comm, "allreduce", a)]
        windows = comm.symmetric_windows
        comm.free_symmetric(b)
        comm.clear_plans()
        b2 = np.zeros_like(b)
        comm.allreduce(a, b2)  # a is symmetric, b2 not: the ring
        kernels.append(_kernel_of(comm, "allreduce", a))
        c = comm.alloc_symmetric(count, np.int32)
        comm.clear_plans()
        comm.allreduce(a, c)
        kernels.append(_kernel_of(comm, "allreduce", a))
        with pytest.raises(ValueError, match="free_symmetric needs the same array"):
            comm.free_symmetric(np.zeros(4, np.int32))
        with pytest.raises(ValueError, match="free_symmetric needs the same array"):
            comm.free_symmetric(a if r == 0 else c)
        left = comm.symmetric_windows
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
        n = DIRECT_SIZE // 4 * 2  # large enough for "auto" to pick direct
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


def _pushed_calls(world, comm):
    """Every case routes.DirectRouter decides on GIN peers, run on buffers from
    alloc_symmetric: (collective, what, kernel, wrong elements)."""
    r, n = world.rank, world.size
    out = []

    def run(coll, what, count, in_place=False, **kw):
        spec = catalogue.get(coll)
        dtype = np.int32
        x = verify.make_input(coll, dtype, "sum" if spec.reducing else None, 3, r, n, count)
        exp = verify.expected_output(coll, dtype, "sum" if spec.reducing else None, 3, r, n, count)
        scount, rcount = spec.counts(count, n)
        send = comm.alloc_symmetric(scount, dtype)
        recv = send if in_place else comm.alloc_symmetric(rcount, dtype)
        if in_place and spec.scaled == catalogue.RECV:  # allgather in place: this rank's slot of recvbuf
            recv = comm.alloc_symmetric(rcount, dtype)
            send = recv[r * count : (r + 1) * count]
        for _ in range(2):  # twice: the second call's arrivals start from the first's count
            send[...] = x
            spec.call(comm, send, recv, "sum" if spec.reducing else None, 0, **kw)
        out.append((coll, what, _kernel_of(comm, coll, send), verify.count_wrong(recv, exp)))

    big = DIRECT_SIZE // 4 * n  # "auto" takes direct from here, and a multiple of n
    run("allreduce", "even", big)
    run("allreduce", "uneven", big + 1)
    run("allreduce", "in place", big + n, in_place=True)
    run("allgather", "out of place", big + 1)
    run("allgather", "in place", big + 3, in_place=True)
    run("alltoall", "direct", 17, algorithm="direct")
    run("reduce_scatter", "auto", big)
    return out


@pytest.mark.parametrize("nranks", [2, 3])
def test_gin_peers_push_on_symmetric_buffers(nranks):
    """With peers over GIN the direct kernels push (direct.cu): AllReduce out of place
    on counts that split evenly, AllGather, AlltoAll; every other call keeps the ring,
    and asking for direct there says why."""

    def body(world):
        comm = _comm(world, path="gin")
        assert comm.direct_kernels == "push" and comm.gin_direct_refusal is None
        out = _pushed_calls(world, comm)
        x = comm.alloc_symmetric(6 * world.size + 1, np.float32)
        y = comm.alloc_symmetric(6 * world.size + 1, np.float32)
        with pytest.raises(ValueError, match="not a multiple of"):
            comm.allreduce(x, y, algorithm="direct")
        with pytest.raises(ValueError, match="not in place"):
            comm.allreduce(x[:6], x[:6], algorithm="direct")
        with pytest.raises(ValueError, match="reduce_scatter has no direct kernel over GIN"):
            comm.reduce_scatter(x[: world.size], y[:1], algorithm="direct")
        with pytest.raises(ValueError, match="must come from Communicator.alloc_symmetric"):
            comm.allgather(np.zeros(3, np.float32), np.zeros(3 * world.size, np.float32), algorithm="direct")
        comm.close()
        return out

    direct = {c: f"commref_direct_{c}" for c in ("allreduce", "allgather", "alltoall")}
    expect = [
        ("allreduce", "even", direct["allreduce"]),
        ("allreduce", "uneven", "commref_ring_allreduce"),
        ("allreduce", "in place", "commref_ring_allreduce"),
        ("allgather", "out of place", direct["allgather"]),
        ("allgather", "in place", direct["allgather"]),
        ("alltoall", "direct", direct["alltoall"]),
        ("reduce_scatter", "auto", "commref_ring_reduce_scatter"),
    ]
    for out in ThreadWorld.run(nranks, body, timeout=60):  # (at 3 ranks "auto" may take the tree)
        assert [(c, w, k.replace("_tree_", "_ring_")) for c, w, k, _ in out] == expect
        assert [wrong for *_, wrong in out] == [0] * len(expect)


def test_lsa_and_gin_peers_push_together(monkeypatch):
    """3 ranks on 2 simulated nodes (2 + 1, path auto): rank 0 pushes to rank 1 by
    stores and to rank 2 by GIN puts, in the same kernels."""
    monkeypatch.setenv(NODES_ENV, "2")

    def body(world):
        comm = _comm(world, path="auto")
        lsa_peers = [p for p in range(world.size) if p != world.rank and not comm.peer_mask >> p & 1]
        assert comm.direct_kernels == "push"
        out = _pushed_calls(world, comm)
        comm.close()
        return lsa_peers, out

    results = ThreadWorld.run(3, body, timeout=60)
    assert [peers for peers, _ in results] == [[1], [0], []]
    for _, out in results:
        assert [k for _, _, k, _ in out].count("commref_direct_allreduce") == 1
        assert [wrong for *_, wrong in out] == [0] * len(out)


def test_engines_without_windows_keep_the_ring(monkeypatch):
    """The Python proxy (COMMREF_GIN_ENGINE=python here; a lossy wire's engine) carries
    no windows: no direct kernel over GIN, and asking for one names the engine."""
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "python")

    def body(world):
        comm = _comm(world, path="gin", wire="unordered")
        refusal, kinds = comm.gin_direct_refusal, comm.direct_kernels
        x, y = comm.alloc_symmetric(64, np.float32), comm.alloc_symmetric(64, np.float32)
        with pytest.raises(ValueError, match="does not carry symmetric windows"):
            comm.allreduce(x, y, algorithm="direct")
        comm.close()
        return refusal, kinds

    for refusal, kinds in ThreadWorld.run(2, body, timeout=60):
        assert kinds is None and "does not carry symmetric windows" in refusal


def test_pushed_offsets_that_differ_across_ranks_are_a_mismatch():
    """A GIN put lands at this rank's offsets in the peer's window: the call each rank
    sends first (pushEnter) reports differing offsets instead of misplacing data."""

    def body(world):
        comm = _comm(world, path="gin")
        arena = SymmetricArena(comm, 1 << 16)
        arena.take(world.rank * 16, np.uint8)
        send, out = arena.take(256, np.float32), arena.take(256, np.float32)
        send[...] = 1
        comm.allreduce(send, out, algorithm="direct")

    with pytest.raises(CommMismatch, match="symmetric buffer offset is"):
        ThreadWorld.run(2, body, timeout=30)


def test_check_sweep_lists_direct_cases_only_where_they_can_run():
    colls = ["allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall"]
    with_direct = check.cases(colls, ["float32"], ["sum"], [], [7], 2, 1)
    without = check.cases(colls, ["float32"], ["sum"], [], [7], 2, 1, direct=False)
    assert {c.coll for c in with_direct if c.algorithm == "direct"} == set(catalogue.with_algorithm("direct"))
    assert not any(c.algorithm == "direct" for c in without)


def test_tuner_takes_direct_where_the_model_says_it_is_faster():
    m = model.Model.default(model.Paths(local_ranks=2))
    for size in (8, 4096, DIRECT_SIZE, 1 << 20):
        ring, direct = (m.time("allreduce", a, "simple", size, 2) for a in ("ring", "direct"))
        want = "direct" if direct <= ring else "ring"
        assert tuner.plan("allreduce", "auto", size, 2, "cpu", 1, symmetric=True).algorithm == want, size
    assert tuner.plan("allreduce", "auto", 8, 2, "cpu", 1, symmetric=True).algorithm == "ring"
    assert tuner.plan("allreduce", "auto", DIRECT_SIZE, 2, "cpu", 1, symmetric=True).algorithm == "direct"
    big = DIRECT_SIZE
    assert tuner.plan("allreduce", "auto", big, 2, "cpu", 1, symmetric=False).algorithm == "ring"
    assert tuner.plan("broadcast", "auto", 1 << 20, 2, "cpu", 1, symmetric=True).algorithm == "ring"
    assert tuner.plan("allgather", "direct", 8, 2, "cpu", 1, symmetric=True).algorithm == "direct"
