"""gather, scatter, alltoallv (Communicator methods) and nccl-tests' sendrecv and
hypercube (catalogue compositions), all groups of sends and receives
(collectives/p2p_collectives.py).

- exact on random bytes against numpy at 2, 3 and 4 ranks over LSA and GIN: every
  root, in place where NCCL has a layout, alltoallv with random uneven counts (zeros
  among them) and packed displacements, inside a user's group with other calls;
- bad input: alltoallv counts that disagree between two ranks fail on both with
  CommMismatch before the deadline; hypercube at 3 ranks or inside a group, a root out
  of range, counts that do not fit: ValueError before anything launches;
- `commref check`'s references and cases: the alltoallv layout (nccl-tests'), the group
  cases exact, and a broken composition shows as wrong elements;
- bench: nccl-tests' counts and bandwidth conventions of the five;
- under mpiexec: gather, scatter, alltoallv and send/recv against mpi4py's Gather,
  Scatter, Alltoallv and Send/Recv on random bytes, byte for byte.
"""

from __future__ import annotations

import os
import re
import sys

import numpy as np

from commref import Communicator


def _bytes(seed, *key, n: int) -> np.ndarray:
    """n random bytes (any bit pattern) for (seed, *key)."""
    return np.random.default_rng([seed, *key]).integers(0, 256, n, dtype=np.uint8)


def _random_counts(seed: int, nranks: int, most: int) -> np.ndarray:
    """counts[s, d]: what rank s sends rank d, uneven, about a third of them 0."""
    rng = np.random.default_rng([seed, 99])
    counts = rng.integers(0, most + 1, (nranks, nranks))
    counts[rng.random((nranks, nranks)) < 0.3] = 0
    return counts


def _packed(counts) -> list[int]:
    return [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])]


# ---------------------------------------------------------------------------------------
# the MPI job (this file run under mpiexec): commref against mpi4py, byte for byte
# ---------------------------------------------------------------------------------------


def _mpi_main() -> None:
    from mpi4py import MPI

    from commref.transports.mpi_world import MPIWorld

    world = MPIWorld()
    mpi, n, r = MPI.COMM_WORLD, world.size, world.rank
    with Communicator(world, "cpu", slot_bytes=4096) as comm:
        same = {}
        for c in (0, 1, 5000):
            x = _bytes(1, r, c, n=c)
            for root in range(n):
                mine, theirs = np.zeros(n * c, np.uint8), np.zeros(n * c, np.uint8)
                comm.gather(x, mine, root)
                mpi.Gather(x, theirs if r == root else None, root)
                same[f"gather {c} {root}"] = r != root or mine.tobytes() == theirs.tobytes()
                whole = _bytes(2, r, c, root, n=n * c)
                mine, theirs = np.zeros(c, np.uint8), np.zeros(c, np.uint8)
                comm.scatter(whole, mine, root)
                mpi.Scatter(whole if r == root else None, theirs, root)
                same[f"scatter {c} {root}"] = mine.tobytes() == theirs.tobytes()
            counts = _random_counts(c, n, max(c, 1))
            sc, rc = [int(k) for k in counts[r]], [int(k) for k in counts[:, r]]
            sd, rd = _packed(sc), _packed(rc)
            send = _bytes(3, r, c, n=sum(sc)).view(np.uint8)
            mine, theirs = np.zeros(sum(rc), np.uint8), np.zeros(sum(rc), np.uint8)
            comm.alltoallv(send, sc, sd, mine, rc, rd)
            mpi.Alltoallv([send, sc, sd, MPI.BYTE], [theirs, rc, rd, MPI.BYTE])
            same[f"alltoallv {c}"] = mine.tobytes() == theirs.tobytes()
            # a ring shift: commref's send/recv in a group, mpi4py's Send and Recv in turn
            y = _bytes(4, r, c, n=c)
            mine, theirs = np.zeros(c, np.uint8), np.zeros(c, np.uint8)
            with comm.group():
                comm.send(y, (r + 1) % n)
                comm.recv(mine, (r - 1) % n)
            if r == 0:
                mpi.Send(y, 1)
                mpi.Recv(theirs, n - 1)
            else:
                mpi.Recv(theirs, r - 1)
                mpi.Send(y, (r + 1) % n)
            same[f"send/recv {c}"] = mine.tobytes() == theirs.tobytes()
        differ = sorted(k for k, v in same.items() if not v)
        sys.stdout.write(f"rank {r}: {len(same)} compared, differ: {differ}\n")  # one write: shared stdout
        sys.stdout.flush()


if __name__ == "__main__":
    _mpi_main()
    sys.exit(0)


# ---------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------


import pytest  # noqa: E402
from conftest import clean_env, run_mpi  # noqa: E402
from helpers import WORLD_TIMEOUT, close_after_barrier, errors_per_rank  # noqa: E402

from commref.bench import plugins  # noqa: E402
from commref.collectives import catalogue, check, group_check, p2p_collectives, verify  # noqa: E402
from commref.collectives.memory import SENTINEL  # noqa: E402
from commref.transports.thread_world import ThreadWorld  # noqa: E402

TRANSPORTS = {
    "lsa": dict(path="lsa"),
    "gin-unordered": dict(path="gin", backend="proxy", wire="unordered"),
}
SLOT = dict(slot_bytes=1024, nsteps=2)
DTYPES = ("float32", "int8", "bfloat16", "float64")


def _comm(world, transport="lsa", **kw) -> Communicator:
    return Communicator(world, "cpu", timeout=kw.pop("timeout", WORLD_TIMEOUT), **TRANSPORTS[transport], **SLOT, **kw)


def _data(seed, dtype, *key, n: int) -> np.ndarray:
    dt = verify.DTYPES[dtype]
    return _bytes(seed, *key, n=n * dt.itemsize).view(dt)


def _exact_everywhere(world, transport: str, seed: int) -> list:
    """Every call on random data, against numpy; returns what arrived wrong."""
    comm = _comm(world, transport)
    n, r = world.size, world.rank
    wrong = []
    for dtype in DTYPES:
        for c in (0, 1, 777, 3001):
            ins = [_data(seed, dtype, s, c, n=c) for s in range(n)]  # every rank's count-element input
            whole = [_data(seed + 1, dtype, s, c, n=n * c) for s in range(n)]  # every rank's n * count
            for root in range(n):
                out = np.zeros(n * c, ins[0].dtype)
                comm.gather(ins[r], out, root)
                if r == root and out.tobytes() != np.concatenate(ins).tobytes():
                    wrong.append(("gather", dtype, c, root))
                got = np.zeros(c, ins[0].dtype)
                comm.scatter(whole[r], got, root)
                if got.tobytes() != whole[root][r * c : (r + 1) * c].tobytes():
                    wrong.append(("scatter", dtype, c, root))
                # in place: gather's sendbuf is block `rank` of its recvbuf, scatter's recvbuf of its sendbuf
                buf = np.zeros(n * c, ins[0].dtype)
                buf[r * c : (r + 1) * c] = ins[r]
                comm.gather(buf[r * c : (r + 1) * c], buf, root)
                if r == root and buf.tobytes() != np.concatenate(ins).tobytes():
                    wrong.append(("gather in place", dtype, c, root))
                buf = whole[r].copy()
                comm.scatter(buf, buf[r * c : (r + 1) * c], root)
                if buf[r * c : (r + 1) * c].tobytes() != whole[root][r * c : (r + 1) * c].tobytes():
                    wrong.append(("scatter in place", dtype, c, root))
            counts = _random_counts(seed + c, n, max(c, 1))
            sc, rc = [int(k) for k in counts[r]], [int(k) for k in counts[:, r]]
            send = _data(seed + 2, dtype, r, c, n=sum(sc))
            out = np.zeros(sum(rc) + 3, send.dtype)  # 3 elements past the last block stay alone
            comm.alltoallv(send, sc, _packed(sc), out, rc, _packed(rc))
            parts = []
            for s in range(n):
                theirs = [int(k) for k in counts[s]]
                at = _packed(theirs)[r]
                parts.append(_data(seed + 2, dtype, s, c, n=sum(theirs))[at : at + theirs[r]])
            if out.tobytes() != np.concatenate([*parts, np.zeros(3, send.dtype)]).tobytes():
                wrong.append(("alltoallv", dtype, c))
            got = np.zeros(c, ins[0].dtype)
            catalogue.get("sendrecv").call(comm, ins[r], got, None, 0)
            if got.tobytes() != ins[(r - 1) % n].tobytes():
                wrong.append(("sendrecv", dtype, c))
            if n & (n - 1) == 0:
                out = np.zeros(n * c, ins[0].dtype)
                catalogue.get("hypercube").call(comm, ins[r], out, None, 0)
                if out.tobytes() != np.concatenate(ins).tobytes():
                    wrong.append(("hypercube", dtype, c))
    # In a user's group with a collective and a plain exchange, posted in a rank's own order.
    x = _data(seed, "int32", r, n=500)
    gathered, shifted, summed = np.zeros(n * 500, np.int32), np.zeros(500, np.int32), np.zeros(8, np.int64)
    with comm.group():
        if r % 2:
            comm.recv(shifted, (r - 1) % n)
            comm.gather(x, gathered, n - 1)
            comm.allreduce(np.full(8, r + 1, np.int64), summed)
            comm.send(x, (r + 1) % n)
        else:
            comm.allreduce(np.full(8, r + 1, np.int64), summed)
            comm.send(x, (r + 1) % n)
            comm.gather(x, gathered, n - 1)
            comm.recv(shifted, (r - 1) % n)
    everyone = [_data(seed, "int32", s, n=500) for s in range(n)]
    if r == n - 1 and gathered.tobytes() != np.concatenate(everyone).tobytes():
        wrong.append("gather in a group")
    if shifted.tobytes() != everyone[(r - 1) % n].tobytes() or not (summed == n * (n + 1) // 2).all():
        wrong.append("shift or allreduce in a group")
    close_after_barrier(world, comm)
    return wrong


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_exact_over_lsa(nranks):
    assert ThreadWorld.run(nranks, _exact_everywhere, "lsa", 5, timeout=WORLD_TIMEOUT) == [[]] * nranks


def test_exact_over_gin_on_the_unordered_wire():
    assert ThreadWorld.run(4, _exact_everywhere, "gin-unordered", 6, timeout=WORLD_TIMEOUT) == [[]] * 4


def _errors(nranks, body, **kw):
    """Each rank's (exception type name, message, seconds) of body(world, comm), or None."""
    return errors_per_rank(nranks, lambda world: _comm(world, **kw), body)


DEADLINE = 5.0


def test_alltoallv_counts_that_disagree_fail_on_both_ranks_before_the_deadline():
    """Rank 1 expects 6 elements from rank 2, which sends it 5; rank 0's pairs agree."""

    def body(world, comm):
        r, n = world.rank, world.size
        counts = np.full((n, n), 5)
        sc, rc = [int(k) for k in counts[r]], [int(k) for k in counts[:, r]]
        if r == 1:
            rc[2] = 6
        out = np.zeros(sum(rc), np.float32)
        comm.alltoallv(np.ones(sum(sc), np.float32), sc, _packed(sc), out, rc, _packed(rc))

    res = _errors(3, body, timeout=DEADLINE)
    (t1, m1, s1), (t2, m2, s2) = res[1], res[2]
    assert t1 == t2 == "CommMismatch", res
    assert "rank 1: recv of 6 float32 from rank 2 does not match rank 2's send of 5 float32" in m1, m1
    assert "rank 2: send of 5 float32 to rank 1 does not match rank 1's recv of 6 float32" in m2, m2
    assert s1 < DEADLINE and s2 < DEADLINE, (s1, s2)
    # rank 0, whose pairs agree, ends too (its peers' launches failed), naming what it awaited
    assert res[0] is None or res[0][2] < 3 * DEADLINE, res[0]


def test_zero_against_a_nonzero_count_is_a_mismatch_too():
    def body(world, comm):
        # rank 1 sends rank 0 four elements; rank 0 expects none
        sc, rc = ([0, 0], [0, 0]) if world.rank == 0 else ([4, 0], [0, 0])
        out = np.zeros(4, np.int32)
        comm.alltoallv(np.ones(4, np.int32), sc, [0, 0], out, rc, [0, 0])

    res = _errors(2, body, timeout=DEADLINE)
    assert [t for t, _, _ in res] == ["CommMismatch", "CommMismatch"], res
    assert "count is 0 here and 4 there" in res[0][1], res[0][1]


def test_hypercube_refuses_three_ranks_and_groups():
    def three(world, comm):
        catalogue.get("hypercube").call(comm, np.ones(4, np.int8), np.zeros(12, np.int8), None, 0)

    res = _errors(3, three)
    assert all(t == "ValueError" and s < 1 for t, _, s in res), res
    assert all("needs a power-of-two number of ranks, not 3" in m for _, m, _ in res), res

    def grouped(world, comm):
        with comm.group():
            catalogue.get("hypercube").call(comm, np.ones(4, np.int8), np.zeros(8, np.int8), None, 0)

    res = _errors(2, grouped)
    assert all(t == "ValueError" and "cannot run inside a group" in m for t, m, _ in res), res


def test_bad_roots_and_sizes_are_value_errors_before_anything_runs():
    def body(world, comm):
        n, r = world.size, world.rank
        seen = []
        for root in (-1, n, True, 1.0, None):
            for call in (comm.gather, comm.scatter):
                with pytest.raises(ValueError, match=re.escape(f"rank {r}: root must be a rank in [0, {n}), got")):
                    call(np.ones(3, np.int32), np.zeros(3 * n, np.int32), root)
                seen.append(call.__name__)
        with pytest.raises(ValueError, match=r"gather root needs recvbuf of nranks \* sendcount = 2 \* 3 = 6"):
            comm.gather(np.ones(3, np.int32), np.zeros(5, np.int32), r)
        with pytest.raises(ValueError, match=r"need 2 entries each, got 1 and 2"):
            comm.alltoallv(np.ones(4, np.int32), [4], [0, 0], np.zeros(4, np.int32), [2, 2], [0, 2])
        with pytest.raises(ValueError, match=r"sendcounts\[1\] = 3 at displacement 2 runs past the 4 elements"):
            comm.alltoallv(np.ones(4, np.int32), [1, 3], [0, 2], np.zeros(4, np.int32), [1, 3], [0, 1])
        with pytest.raises(ValueError, match=r"runs algorithm 'p2p' only, not 'ring'"):
            comm.scatter(np.ones(6, np.int32), np.zeros(3, np.int32), 0, algorithm="ring")
        with pytest.raises(TypeError, match="sendbuf dtype int32 differs from recvbuf dtype float32"):
            comm.alltoallv(np.ones(4, np.int32), [2, 2], [0, 2], np.zeros(4, np.float32), [2, 2], [0, 2])
        world.barrier(what="checked")
        # still usable: nothing launched
        out = np.zeros(2 * 3, np.int32)
        comm.gather(np.full(3, r, np.int32), out, 0)
        return len(seen), out.tolist() if r == 0 else None

    def rank(world):
        comm = _comm(world)
        try:
            return body(world, comm)
        finally:
            close_after_barrier(world, comm)

    assert ThreadWorld.run(2, rank, timeout=WORLD_TIMEOUT) == [(10, [0, 0, 0, 1, 1, 1]), (10, None)]


# ---------------------------------------------------------------------------------------
# commref check's references and cases
# ---------------------------------------------------------------------------------------


def test_the_alltoallv_layout_is_nccl_tests():
    """Rank s sends rank d (count - 1 - s - d) mod count of its block of count: uneven,
    symmetric, zeros at small counts; recvcounts are the senders' sendcounts."""
    assert [[p2p_collectives.pair_count(s, d, 7) for d in range(5)] for s in range(5)] == [
        [6, 5, 4, 3, 2],
        [5, 4, 3, 2, 1],
        [4, 3, 2, 1, 0],
        [3, 2, 1, 0, 6],
        [2, 1, 0, 6, 5],
    ]
    assert {p2p_collectives.pair_count(s, d, 1) for s in range(3) for d in range(3)} == {0}
    assert p2p_collectives.pair_count(0, 0, 0) == 0
    sends, sd, recvs, rd = p2p_collectives.alltoallv_layout(1, 3, 10)
    assert (sends, sd, recvs, rd) == ((8, 7, 6), (0, 10, 20), (8, 7, 6), (0, 10, 20))
    # verify's expected recvbuf: each block's first pair_count elements, the rest unwritten
    n, c, r = 3, 10, 2
    ins = [verify.make_input("alltoallv", np.int32, None, 4, s, n, c) for s in range(n)]
    want = verify.expected_output("alltoallv", np.int32, None, 4, r, n, c)
    for s in range(n):
        k = p2p_collectives.pair_count(s, r, c)
        block = want[s * c : (s + 1) * c]
        assert block[:k].tobytes() == ins[s][r * c : r * c + k].tobytes()
        assert set(block[k:].view(np.uint8).tolist()) <= {SENTINEL} and len(block[k:]) == c - k


def test_check_references_of_scatter_sendrecv_and_hypercube():
    n, c = 4, 5
    ins = {name: [verify.make_input(name, np.int8, None, 9, s, n, c) for s in range(n)] for name in catalogue.NAMES}
    for r in range(n):
        scatter = verify.expected_output("scatter", np.int8, None, 9, r, n, c, root=2)
        assert scatter.tobytes() == ins["scatter"][2][r * c : (r + 1) * c].tobytes()
        shift = verify.expected_output("sendrecv", np.int8, None, 9, r, n, c)
        assert shift.tobytes() == ins["sendrecv"][(r - 1) % n].tobytes()
        cube = verify.expected_output("hypercube", np.int8, None, 9, r, n, c)
        assert cube.tobytes() == np.concatenate(ins["hypercube"]).tobytes()
    assert verify.expected_output("gather", np.int8, None, 9, 1, n, c, root=0) is None  # left alone there


def test_check_skips_what_cannot_run_and_says_why():
    """hypercube at other than powers of two; on a GPU, every collective of sends and
    receives and the group cases (send and recv run on the CPU engine)."""
    colls = ["gather", "hypercube", "allreduce", "group"]
    kept = check.cases(colls[:3], ["int8"], ["sum"], [], [1], 3, 1)
    assert {c.coll for c in kept} == {"gather", "allreduce"}
    assert check.skipped(colls, 3) == [
        "hypercube skipped: hypercube exchanges with rank ^ 2^k, so it needs a power-of-two number of ranks, not 3"
    ]
    assert {c.coll for c in check.cases(colls[:3], ["int8"], ["sum"], [], [1], 4, 1, device="cuda")} == {"allreduce"}
    assert [s.split(":")[0] for s in check.skipped(colls, 4, "cuda")] == [
        "gather skipped",
        "hypercube skipped",
        "group skipped",
    ]
    assert "sends and receives run on the CPU engine" in check.skipped(colls, 4, "cuda")[0]


def _check_sweep(world):
    comm = _comm(world)
    colls = catalogue.with_algorithm("p2p")
    case_list = check.cases(colls, ["int32", "bfloat16"], [], [], [0, 7, 300], world.size, 3)
    case_list += group_check.cases(["int32", "float16"], [1, 300], 3)
    wrong = check.run_sweep(comm, case_list)
    close_after_barrier(world, comm)
    return case_list, wrong, check.skipped(colls, world.size)


def test_check_cases_are_exact_and_a_broken_composition_shows(monkeypatch):
    case_list, wrong, skipped = ThreadWorld.run(3, _check_sweep, timeout=WORLD_TIMEOUT)[0]
    assert sum(wrong) == 0 and len(wrong) == len(case_list)
    assert {c.coll for c in case_list} == {"gather", "scatter", "alltoallv", "sendrecv", "group"}
    assert skipped == [
        "hypercube skipped: hypercube exchanges with rank ^ 2^k, so it needs a power-of-two number of ranks, not 3"
    ]
    rows = check.summary_rows(case_list, wrong)
    assert sum(cells["copy"][0] for *_, cells in rows) == len(case_list)  # every case in some row
    kinds = {k for c in case_list if c.coll == "group" for k, _, _ in c.members(3)}
    assert "exchange" in kinds and kinds & {"gather", "scatter", "alltoallv", "sendrecv"} and kinds - {"exchange"}
    # the rank's own block not copied: every case with such a block shows it
    monkeypatch.setattr(p2p_collectives, "_copy", lambda dst, src: None)
    case_list, wrong, _ = ThreadWorld.run(3, _check_sweep, timeout=WORLD_TIMEOUT)[0]
    bad = {c.coll for c, w in zip(case_list, wrong) if w}
    assert {"gather", "scatter", "alltoallv"} <= bad, list(zip(case_list, wrong))


def test_check_takes_the_five_and_group_by_name_and_counts_them(capsys):
    from commref import cli

    parse = cli.build_parser().parse_args
    assert parse(["check", "Gather", "alltoallv", "group", "send_recv"]).collectives == [
        "gather",
        "alltoallv",
        "group",
        "sendrecv",
    ]
    assert cli.main(["check", "hypercube", "group", "--dtype", "int8", "--count", "3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^hypercube\s+p2p\s+int8\s.*\s0$", out, re.M), out
    assert re.search(r"^group\s+mixed\s+int8\s.*\s0$", out, re.M), out
    # hypercube in and out of place, one group case
    assert "# 2 rows, 3 cases (counts [3], in-place and out-of-place, group out-of-place only" in out, out
    # nothing but hypercube at 3 ranks: refused in one line before any rank starts
    assert cli.main(["check", "hypercube", "--np", "3"]) == 2
    assert "commref check: error: nothing to check at --np 3: hypercube exchanges with rank ^ 2^k" in (
        capsys.readouterr().err
    )


# ---------------------------------------------------------------------------------------
# bench: nccl-tests' conventions
# ---------------------------------------------------------------------------------------


def test_bench_counts_and_bandwidth_follow_nccl_tests():
    t, n, size = 4, 4, 1000  # float, 4 ranks, a 1000-byte sweep size
    expect = {  # name: (send, recv, param, algbw bytes, bus factor)
        "gather": (62, 248, 62, 992, 3 / 4),
        "scatter": (248, 62, 62, 992, 3 / 4),
        "alltoallv": (248, 248, 62, 992, 3 / 4),
        "sendrecv": (250, 250, 250, 1000, 1.0),
        "hypercube": (60, 240, 60, 60 * t * 3, 1.0),  # base = (250 // (4 * 4)) * 4
    }
    for name, (send, recv, param, algbw, factor) in expect.items():
        p = plugins.get(name)
        counts = p.counts(size, t, n)
        assert (counts.send, counts.recv, counts.param) == (send, recv, param), name
        assert p.algbw_bytes(counts, t, n) == algbw and p.bus_factor(n) == pytest.approx(factor), name
    assert plugins.get("alltoallv").placements == plugins.get("sendrecv").placements == (False,)
    assert plugins.get("gather").placements == (False, True)


def _least(coll: str, n: int, c: int, in_place: bool) -> tuple[int, int, int]:
    """(loads, stores, distinct locations) of the job, element by element: an output
    element lying where its value already is (in place) needs nothing; every other is
    stored once, from its one input element, loaded once. Root 0; blocks of c."""
    outs = {}  # output -> (its location, its input)
    for r in range(n):
        for i in range(c):
            if coll == "gather" and r == 0:
                for j in range(n):
                    loc = ("in", 0, i) if in_place and j == 0 else ("out", 0, j * c + i)
                    outs[("out", 0, j * c + i)] = (loc, ("in", j, i))
            elif coll == "scatter":
                loc = ("in", 0, i) if in_place and r == 0 else ("out", r, i)
                outs[("out", r, i)] = (loc, ("in", 0, r * c + i))
            elif coll == "sendrecv":
                outs[("out", r, i)] = (("out", r, i), ("in", (r - 1) % n, i))
            elif coll == "hypercube":
                for j in range(n):
                    loc = ("in", r, i) if in_place and j == r else ("out", r, j * c + i)
                    outs[("out", r, j * c + i)] = (loc, ("in", j, i))
    stored = {o: v for o, v in outs.items() if v[0] != v[1]}
    loaded = {src for _, src in stored.values()}
    return len(loaded), len(stored), len(loaded | {loc for loc, _ in stored.values()})


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("coll", ["gather", "scatter", "sendrecv", "hypercube"])
def test_bound_traffic_is_the_least_any_algorithm_moves(coll, n):
    """catalogue.Traffic times the ranks is the job's least loads, stores and memory
    touched (alltoallv's counts whole blocks: more than its pairs move)."""
    p, c = plugins.get(coll), 6
    size = c * n if p.spec.scaled else c
    for in_place in p.placements:
        t = p.traffic(n, in_place)
        loads, stores, touched = _least(coll, n, c, in_place)
        assert n * t.loads(size) == pytest.approx(loads), (in_place, t)
        assert n * t.stores(size) == pytest.approx(stores), (in_place, t)
        assert n * t.footprint(size) == pytest.approx(touched), (in_place, t)


# ---------------------------------------------------------------------------------------
# under mpiexec: against mpi4py
# ---------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_under_mpiexec_same_bytes_as_mpi4py(shm_leak_check):
    root = os.path.dirname(os.path.dirname(__file__))
    proc = run_mpi(3, [os.path.relpath(__file__, root)], timeout=180, env=clean_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    said = set(re.findall(r"rank \d: \d+ compared, differ: \[.*\]", proc.stdout))
    assert said == {f"rank {r}: 24 compared, differ: []" for r in range(3)}, (proc.stdout + proc.stderr)[-4000:]
