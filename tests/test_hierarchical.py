"""The hierarchical algorithm (collectives/hierarchical.py) and the
world split it stands on.

- World.split: members, node identity and deadlines carried over; a failure in the
  parent stops a split's waiters;
- which jobs can run it (node_shape) and the tuner's choice; a job that cannot gets
  one clear error, before any rank starts on the CLI;
- exactness of AllReduce, ReduceScatter and AllGather, every op, in and out of place,
  counts that do not split into the node's ranks (the tail), on both wires and with
  three nodes; avg divides once by the job's ranks;
- symmetric buffers run the intra-node phases as direct kernels;
- `commref check --algorithm hierarchical` under mpiexec, and the bench's team rows.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import clean_env, run_mpi
from helpers import CHECK_MODULE, WORLD_TIMEOUT, assert_check_clean

from commref.collectives import check, model, tuner
from commref.collectives.communicator import Communicator
from commref.collectives.hierarchical import NodeShape, node_shape
from commref.transports.errors import CommAborted
from commref.transports.nodes import NODES_ENV
from commref.transports.thread_world import ThreadWorld

# ---- World.split ----


def _split(world):
    sub = world.split(world.rank % 2, what="test split")
    sub.barrier(what="in the split")
    got = sub.allgather(world.rank, what="split ranks")
    return sub.rank, sub.size, sub.members, got, sub.node == world.node, sub.timeout


def test_split_ranks_members_in_parent_order_and_keeps_node_and_deadline(monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")
    results = ThreadWorld.run(5, _split, timeout=7.0)
    for rank, (sub_rank, size, members, got, same_node, timeout) in enumerate(results):
        assert members == [r for r in range(5) if r % 2 == rank % 2] == got
        assert (sub_rank, size) == (members.index(rank), len(members))
        assert same_node and timeout == 7.0


def test_a_failure_in_the_parent_stops_a_splits_waiters():
    waited = []

    def body(world):
        sub = world.split(0 if world.rank < 2 else 1)
        if world.rank == 0:
            raise RuntimeError("rank 0 fails")
        if world.rank == 1:
            t0 = time.monotonic()
            with pytest.raises(CommAborted):
                sub.barrier(what="waiting for rank 0")  # rank 0 is gone; the deadline is 30 s
            waited.append(time.monotonic() - t0)

    with pytest.raises(RuntimeError, match="rank 0 fails"):
        ThreadWorld.run(3, body, timeout=30.0)
    assert len(waited) == 1 and waited[0] < 1.0


# ---- who can run it, and the tuner ----


def test_node_shape_needs_several_equal_nodes_of_consecutive_ranks():
    assert node_shape([0, 0, 1, 1, 2, 2], 3) == NodeShape(nodes=3, per_node=2, node=1, local=1)
    assert "several nodes" in node_shape([0, 0, 0], 0)
    assert "several ranks on every node" in node_shape([0, 1, 2], 0)
    assert "same number of ranks" in node_shape([0, 0, 0, 1, 1], 0)
    assert "consecutive" in node_shape(["a", "b", "a", "b"], 0)


def test_tuner_takes_hierarchical_where_the_model_says_and_refuses_it_where_it_cannot_run():
    shape = NodeShape(2, 2, 0, 0)
    big, small = 1 << 20, 64
    slow = model.Model.default(model.Paths(gin=True, nodes=2, local_ranks=4, between_hosts=True))
    for size in (small, 1 << 16, big):
        times = {a: slow.time("allreduce", a, "simple", size, 4) for a in ("ring", "tree", "hierarchical")}
        want = min(times, key=times.get)
        assert tuner.plan("allreduce", "auto", size, 4, "cpu", 2, False, shape, True).algorithm == want, size
    assert tuner.plan("allreduce", "auto", big, 4, "cpu", 2, False, shape, True).algorithm == "hierarchical"
    assert tuner.plan("broadcast", "auto", big, 4, "cpu", 2, False, shape, True).algorithm == "ring"
    assert tuner.plan("allreduce", "auto", big, 4, "cpu", 2, False, "why not", True).algorithm == "ring"
    # GIN at memory speed (simulated nodes, no wire model): the flat ring.
    assert tuner.plan("allreduce", "auto", big, 4, "cpu", 2, False, shape, False).algorithm == "ring"
    assert tuner.plan("allreduce", "hierarchical", small, 4, "cpu", 2, False, shape, False).algorithm == "hierarchical"
    with pytest.raises(ValueError, match="cannot run on this communicator: it needs the same number"):
        tuner.plan("allreduce", "hierarchical", big, 5, "cpu", 2, False, node_shape([0, 0, 0, 1, 1], 0))
    with pytest.raises(ValueError, match="implemented for allreduce, allgather, reduce_scatter only, not broadcast"):
        tuner.plan("broadcast", "hierarchical", big, 4, "cpu", 2, False, shape)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["check", "--np", "5", "--nodes", "2", "--path", "auto", "--algorithm", "hierarchical"],
            "commref check: error: --algorithm hierarchical with --np 5 and --nodes 2: it needs the same number of "
            "ranks on every node (ranks per node: [3, 2])",
        ),
        (
            ["check", "--np", "4", "--algorithm", "hierarchical"],
            "commref check: error: --algorithm hierarchical with --np 4 and --nodes 1: it needs ranks on several nodes "
            "(this job is one node)",
        ),
        (
            ["check", "--np", "4", "--nodes", "2", "--path", "lsa"],  # a left-out --path is auto with --nodes
            "commref check: error: --path lsa --nodes 2: LSA needs every rank on one node; use --path auto (LSA "
            "inside a node, GIN between nodes, the default with --nodes), or --path gin",
        ),
    ],
)
def test_cli_refuses_a_job_that_cannot_run_it_before_any_rank_starts(argv, message):
    proc = subprocess.run(
        [sys.executable, "-m", "commref.cli", *argv], capture_output=True, text=True, timeout=60, env=clean_env()
    )
    assert proc.returncode == 2 and proc.stderr.strip() == message, proc.stderr


def test_a_communicator_that_cannot_run_it_says_why(monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")

    def body(world):
        with Communicator(world, "cpu", path="auto", timeout=WORLD_TIMEOUT) as comm:
            x = np.ones(8, np.float32)
            with pytest.raises(
                ValueError,
                match=r"rank \d: algorithm 'hierarchical' cannot run on this "
                r"communicator: it needs the same number of ranks on every node",
            ):
                comm.allreduce(x, x.copy(), algorithm="hierarchical")

    ThreadWorld.run(5, body, timeout=WORLD_TIMEOUT)


# ---- exactness ----


def _sweep(world, opts, dtypes, ops, counts):
    with Communicator(world, "cpu", timeout=WORLD_TIMEOUT, **opts) as comm:
        assert isinstance(comm.node_shape, NodeShape)
        cases = check.cases(
            ["allreduce", "reduce_scatter", "allgather"],
            dtypes,
            ops,
            ["hierarchical"],
            counts,
            world.size,
            5,
            hierarchical=True,
        )
        wrong = check.run_sweep(comm, cases)
        return cases, wrong, [c.nranks for c in (comm.hierarchy().intra, comm.hierarchy().inter)]


@pytest.mark.parametrize(
    "nranks, nodes, opts",
    [
        (4, 2, dict(path="auto", wire="ordered")),
        (4, 2, dict(path="auto", wire="unordered", max_channels=2, slot_bytes=256)),
        (6, 3, dict(path="auto")),
        (6, 2, dict(path="gin", max_channels=2, slot_bytes=512)),
    ],
)
def test_hierarchical_collectives_are_exact(nranks, nodes, opts, monkeypatch):
    monkeypatch.setenv(NODES_ENV, str(nodes))
    counts = [0, 1, 2, 7, 1009]  # 1, 7 and 1009 leave a tail that does not split into the node's ranks
    results = ThreadWorld.run(
        nranks,
        _sweep,
        opts,
        ["float32", "int32", "bfloat16"],
        ["sum", "prod", "min", "avg"],
        counts,
        timeout=WORLD_TIMEOUT * 4,
    )
    cases, wrong, teams = results[0]
    assert teams == [nranks // nodes, nodes]
    assert {c.coll for c in cases} == {"allreduce", "reduce_scatter", "allgather"} and all(
        c.algorithm == "hierarchical" for c in cases
    )
    assert {c.in_place for c in cases} == {False, True} and "avg" in {c.op for c in cases}
    bad = [(c, w) for c, w in zip(cases, wrong) if w]
    assert sum(wrong) == 0, f"{len(bad)} failing cases, first: {bad[:4]}"


def test_avg_on_integers_truncates_once_over_the_whole_job(monkeypatch):
    """Node sums 3 and 1: averaging each node first would give (1 + 0) // 2 = 0; the
    job's average is 4 // 4 = 1."""
    monkeypatch.setenv(NODES_ENV, "2")

    def body(world):
        with Communicator(world, "cpu", path="auto", timeout=WORLD_TIMEOUT) as comm:
            x = np.full(8, [3, 0, 1, 0][world.rank], np.int32)
            y = np.zeros_like(x)
            comm.allreduce(x, y, "avg", algorithm="hierarchical")
            return y.tolist()

    assert ThreadWorld.run(4, body, timeout=WORLD_TIMEOUT) == [[1] * 8] * 4


def test_symmetric_buffers_run_the_intra_node_phases_direct(monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")

    def body(world):
        with Communicator(world, "cpu", path="auto", timeout=WORLD_TIMEOUT) as comm:
            n = 64 * 1024
            send, recv = comm.alloc_symmetric(n, "float32"), comm.alloc_symmetric(n, "float32")
            send[...] = np.arange(n, dtype=np.float32) + world.rank
            comm.allreduce(send, recv, algorithm="hierarchical")
            ok = bool(np.array_equal(recv, 4 * np.arange(n, dtype=np.float32) + 6))
            intra = comm.hierarchy().intra
            direct = sorted({p.kernel for p in intra.planned() if p.direct})
            comm.free_symmetric(send)
            comm.free_symmetric(recv)
            return ok, direct

    for ok, direct in ThreadWorld.run(4, body, timeout=WORLD_TIMEOUT):
        assert ok and direct == ["commref_direct_allgather", "commref_direct_reduce_scatter"]


@pytest.mark.mpi
def test_check_hierarchical_under_mpiexec(shm_leak_check):
    args = [
        *CHECK_MODULE,
        "--path",
        "auto",
        "--nodes",
        "2",
        "--algorithm",
        "hierarchical",
        "--network",
        "mpi",
        "--dtype",
        "float32",
        "int64",
        "--op",
        "sum",
        "avg",
        "--count",
        "0",
        "1",
        "7",
        "1009",
    ]
    proc = run_mpi(6, args, timeout=180, module=True, env=clean_env())
    assert_check_clean(proc)
    assert re.search(r"^allreduce\s+hierarchical\s+float32", proc.stdout, re.M), proc.stdout[-2000:]


def test_bench_reports_team_rows_and_both_algorithms_side_by_side(monkeypatch):
    from commref.bench.arguments import build_parser
    from commref.bench.harness import run_rank

    monkeypatch.setenv(NODES_ENV, "2")
    a = build_parser().parse_args(
        [
            "all_reduce",
            "-b",
            "256K",
            "-e",
            "256K",
            "-n",
            "2",
            "-w",
            "1",
            "-t",
            "4",
            "--nodes",
            "2",
            "--path",
            "auto",
            "--algorithm",
            "ring,hierarchical",
            "--no-bound",
        ]
    )
    doc = ThreadWorld.run(4, run_rank, a, out=lambda s: None, timeout=WORLD_TIMEOUT)[0]
    rows = {r["series"]: r for r in doc["rows"]}
    assert list(rows) == ["auto/ring", "intra-node/auto", "inter-node/auto", "auto/hierarchical"]
    assert all(r[k]["wrong"] == 0 for r in rows.values() for k in ("out_of_place", "in_place"))
    for label in ("intra-node/auto", "inter-node/auto"):  # two ranks per team: bus factor 2 (2 - 1) / 2 = 1
        o = rows[label]["out_of_place"]
        assert o["busbw"] == pytest.approx(o["algbw"]) and rows[label]["baseline"] is None
    o = rows["auto/hierarchical"]["out_of_place"]
    assert o["busbw"] == pytest.approx(o["algbw"] * 1.5)  # the job's four ranks: 2 (4 - 1) / 4
