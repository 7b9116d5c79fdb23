"""Simulated nodes: COMMREF_HOSTID / COMMREF_NODES (transports/nodes.node_of)
and `--nodes N` on commref check and bench.

- node identity: the override, the split into nodes of consecutive ranks (uneven too),
  bad values refused in one line;
- teams: the LSA team is the node, every rank of the host stays mapped (GIN on network
  shm reaches the other nodes' windows), `path="auto"` puts the other nodes' ranks on
  GIN, `path="lsa"` across nodes is refused;
- exactness: every collective with `path="auto"` on simulated nodes, ThreadWorld (5
  ranks on 2 nodes, both wires; 6 ranks on 3 nodes, where channel 1's ring is not rank
  order) and MPI (`commref check --np 4 --nodes 2`, `--np 5 --nodes 2 --network mpi`);
- topology: each channel's ring crosses each node boundary once,
  successive channels leave and enter a node at different ranks, each tree is spanning
  with one link per pair of nodes it joins; the communicator builds its tables from
  every rank's node;
- the CLI refuses a node count the ranks cannot fill before any rank starts.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest
from conftest import clean_env, run_mpi
from helpers import CHECK_MODULE, WORLD_TIMEOUT, assert_check_clean, run_gin_sweep

from commref.collectives import check, topology
from commref.collectives.catalogue import KERNEL_NAMES as COLLECTIVES
from commref.collectives.communicator import Communicator
from commref.device_kernels import abi
from commref.transports.errors import CapabilityError
from commref.transports.nodes import HOSTID_ENV, NODES_ENV, check_nodes, node_of
from commref.transports.thread_world import ThreadWorld


def test_node_identity_splits_consecutive_ranks_and_honours_the_override():
    assert [node_of("h", r, 5, {NODES_ENV: "2"}) for r in range(5)] == ["h/node0"] * 3 + ["h/node1"] * 2
    assert [node_of("h", r, 6, {NODES_ENV: "3"}) for r in range(6)] == [f"h/node{r // 2}" for r in range(6)]
    assert node_of("h", 3, 4, {}) == "h"
    assert node_of("h", 3, 4, {HOSTID_ENV: "rack7", NODES_ENV: "2"}) == "rack7"  # the override wins
    assert check_nodes("4", 4) == 4
    for bad in ("0", "5", "two", ""):
        with pytest.raises(
            ValueError,
            match=r"^COMMREF_NODES \(--nodes\) must be an integer from 1 to the number "
            r"of ranks \(4\), not ",
        ):
            check_nodes(bad, 4)


def _teams(world, path):
    comm = Communicator(world, "cpu", path=path, timeout=WORLD_TIMEOUT)
    try:
        mapped = [int(a != 0) for a in comm.window.peer_addresses]
        return world.node, comm.peer_mask, comm.network, mapped
    finally:
        comm.close()


def test_auto_path_goes_over_gin_to_other_nodes_and_lsa_inside(monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")
    results = ThreadWorld.run(5, _teams, "auto", timeout=WORLD_TIMEOUT)
    for rank, (node, mask, network, mapped) in enumerate(results):
        others = {3, 4} if rank < 3 else {0, 1, 2}
        assert node.endswith(f"/node{0 if rank < 3 else 1}"), node
        assert {r for r in range(5) if mask >> r & 1} == others, (rank, bin(mask))
        assert network == "shm" and mapped == [1] * 5  # one host: every window mapped, GIN on shm


def test_lsa_path_across_nodes_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")

    def body(world):
        with pytest.raises(
            CapabilityError,
            match=r"rank \d: path 'lsa' needs every peer on this rank's node "
            r"\(\S+/node\d\); ranks \[.*\] are on other nodes: use "
            r"path='auto' or 'gin'",
        ):
            Communicator(world, "cpu", path="lsa", timeout=WORLD_TIMEOUT)

    ThreadWorld.run(4, body, timeout=WORLD_TIMEOUT)


@pytest.mark.parametrize("wire", ["ordered", "unordered"])
def test_collectives_on_simulated_nodes_are_exact(wire, monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")
    run_gin_sweep(
        5,
        dict(path="auto", wire=wire, max_channels=2, slot_bytes=256),
        ["float32", "int8"],
        ["sum", "max"],
        [0, 1, 7, 1009],
    )


# 8 ranks: one node, the splits COMMREF_NODES makes (even and uneven), one rank per
# node, and nodes of ranks that are not consecutive (as COMMREF_HOSTID can make them).
NODE_LAYOUTS = {
    **{f"{k}nodes": [node_of("h", r, 8, {NODES_ENV: str(k)}) for r in range(8)] for k in (1, 2, 3, 4, 8)},
    "scattered": ["a", "b", "a", "c", "b", "a", "c", "b"],
}


def _tree_checks(nodes, parent, children):
    """A spanning tree of the ranks, at most two children each, one link per pair of
    nodes it joins (and none inside a node that has other choices: a chain)."""
    n = len(nodes)
    roots = [r for r in range(n) if parent[r] == -1]
    assert len(roots) == 1 and sorted(parent) == list(range(n))
    for r in range(n):
        assert len(children[r]) <= 2 and all(parent[c] == r for c in children[r])
        seen, x = set(), r
        while parent[x] != -1:
            assert x not in seen
            seen.add(x)
            x = parent[x]
    links = [(nodes[r], nodes[parent[r]]) for r in range(n) if parent[r] >= 0 and nodes[r] != nodes[parent[r]]]
    pairs = [frozenset(p) for p in links]
    assert len(pairs) == len(set(pairs)), f"node pairs joined by more than one link: {links}"
    assert len(pairs) == len(set(nodes)) - 1 if len(set(nodes)) > 1 else not pairs


@pytest.mark.parametrize("layout", sorted(NODE_LAYOUTS))
@pytest.mark.parametrize("nchannels", [1, 4])
def test_rings_cross_each_node_boundary_once_at_rotating_ranks(layout, nchannels):
    nodes = NODE_LAYOUTS[layout]
    n, groups = len(nodes), topology.node_groups(nodes)
    table = topology.ring_ranks(nodes, nchannels)
    peers = [topology.channel_peers(r, nodes, nchannels) for r in range(n)]
    leaving = []  # per channel: node -> the rank whose ringNext is on another node
    for c in range(nchannels):
        ring = [int(x) for x in table[c]]
        assert sorted(ring) == list(range(n)) and ring[0] == 0
        for pos, r in enumerate(ring):  # the records and the table describe the same ring
            assert (peers[r][c]["ringPos"], peers[r][c]["ringPrev"], peers[r][c]["ringNext"]) == (
                pos,
                ring[pos - 1],
                ring[(pos + 1) % n],
            )
        exits = [(ring[p], ring[(p + 1) % n]) for p in range(n) if nodes[ring[p]] != nodes[ring[(p + 1) % n]]]
        assert sorted(nodes[a] for a, _ in exits) == sorted(set(nodes)) if len(groups) > 1 else not exits, exits
        assert sorted(nodes[b] for _, b in exits) == sorted(nodes[a] for a, _ in exits)
        leaving.append({nodes[a]: (a, b) for a, b in exits})
    for c in range(1, nchannels):  # a node of several ranks: left and entered at other ranks than before
        for g in groups:
            if len(g) > 1 and len(groups) > 1:
                node = nodes[g[0]]
                left = [leaving[k][node][0] for k in (c - 1, c)]
                entered = [next(b for _, b in leaving[k].values() if nodes[b] == node) for k in (c - 1, c)]
                assert left[0] != left[1] and entered[0] != entered[1], (layout, c, g, left, entered)
    if layout in ("1nodes", "8nodes"):  # one node, or one rank per node on consecutive ranks: rank order
        assert (table == np.arange(n)).all()


@pytest.mark.parametrize("layout", sorted(NODE_LAYOUTS))
def test_trees_are_spanning_with_one_link_per_node_pair(layout):
    nodes = NODE_LAYOUTS[layout]
    n, groups = len(nodes), topology.node_groups(nodes)
    trees = topology.double_binary_tree(n, groups)
    for parent, children in trees:
        _tree_checks(nodes if len(groups) > 1 else list(range(n)), parent, children)
        if len(groups) > 1:  # inside a node: a chain in rank order
            for g in groups:
                assert [parent[b] for b in g[1:]] == g[:-1]
    # Two trees: rooted at different nodes (one rank per node: different ranks).
    roots = [next(r for r in range(n) if p[r] == -1) for p, _ in trees]
    assert nodes[roots[0]] != nodes[roots[1]] or len(groups) == 1
    # The records follow tree c % 2; a parent's in/out indices name this rank's link.
    peers = [topology.channel_peers(r, nodes, 3) for r in range(n)]
    for c in range(3):
        parent, children = trees[c % 2]
        for r in range(n):
            p = peers[r][c]
            assert p["treeParent"] == parent[r]
            assert [x for x in (p["treeChild0"], p["treeChild1"]) if x >= 0] == children[r]
            if parent[r] >= 0:
                k = children[parent[r]].index(r)
                assert (p["treeInAtParent"], p["treeOutAtParent"]) == (abi.IN_TREE_CHILD0 + k, abi.OUT_TREE_CHILD0 + k)


def _topology_sweep(world, counts):
    comm = Communicator(world, "cpu", path="auto", max_channels=2, slot_bytes=256, timeout=WORLD_TIMEOUT)
    try:
        nodes = [node_of(world.host, r, world.size, {NODES_ENV: "3"}) for r in range(world.size)]
        record = comm.launch_record.record
        table = np.frombuffer((ctypes.c_int32 * (2 * world.size)).from_address(int(record["ringRanks"])), np.int32)
        tables_ok = (table.reshape(2, -1) == topology.ring_ranks(nodes, 2)).all() and record["peers"][
            :2
        ].tobytes() == topology.channel_peers(world.rank, nodes, 2)[:2].tobytes()
        case_list = check.cases(
            list(COLLECTIVES), ["float32", "int32"], ["sum", "max"], [], counts, world.size, 5, direct=False
        )
        wrong = check.run_sweep(comm, case_list)
        return tables_ok, case_list, wrong
    finally:
        world.barrier(what="test done")
        comm.close()


def test_collectives_exact_on_node_rings_that_are_not_rank_order(many_channels, monkeypatch):
    """6 ranks on 3 nodes, 2 channels: channel 1's ring is 0 3 2 5 4 1, so every ring
    kernel (AllReduce, AllGather, ReduceScatter, AlltoAll, Reduce and Broadcast at several roots)
    and the tree over nodes run on a ring whose positions are not the ranks."""
    monkeypatch.setenv(NODES_ENV, "3")
    assert topology.rings(topology.node_groups([0, 0, 1, 1, 2, 2]), 2)[1] == [0, 3, 2, 5, 4, 1]
    counts = [1, 7, 1009]
    results = ThreadWorld.run(6, _topology_sweep, counts, timeout=WORLD_TIMEOUT * 4)
    assert all(ok for ok, _, _ in results), "the communicator's tables differ from topology's"
    case_list, wrong = results[0][1], results[0][2]
    assert {(c.coll, c.algorithm) for c in case_list} >= {
        ("allreduce", "ring"),
        ("allreduce", "tree"),
        ("allgather", "ring"),
        ("reduce_scatter", "ring"),
        ("reduce", "ring"),
        ("broadcast", "ring"),
        ("alltoall", "ring"),
    }
    assert len({c.root for c in case_list if c.coll in ("reduce", "broadcast")}) > 1
    bad = [(c, w) for c, w in zip(case_list, wrong) if w]
    assert all(r[2] == wrong for r in results) and not bad, f"{len(bad)} failing cases, first: {bad[:4]}"


@pytest.mark.mpi
@pytest.mark.parametrize("np_, nodes, extra", [(4, 2, []), (5, 2, ["--network", "mpi"])])
def test_check_on_simulated_nodes_under_mpiexec(np_, nodes, extra, shm_leak_check):
    args = [
        *CHECK_MODULE,
        "--path",
        "auto",
        "--nodes",
        str(nodes),
        *extra,
        "--dtype",
        "float32",
        "int32",
        "--op",
        "sum",
        "min",
        "--count",
        "0",
        "1",
        "7",
        "1009",
    ]
    proc = run_mpi(np_, args, timeout=120, module=True, env=clean_env())
    assert_check_clean(proc)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["check", "--np", "4", "--nodes", "5"],
            "commref check: error: COMMREF_NODES (--nodes) must be an integer from 1 to the number of ranks (4), not 5",
        ),
        (
            ["bench", "all_reduce", "--np", "2", "--nodes", "3"],
            "commref bench: error: COMMREF_NODES (--nodes) must be an integer from 1 to the number of ranks (2), not 3",
        ),
    ],
)
def test_cli_refuses_more_nodes_than_ranks_before_any_rank_starts(argv, message):
    proc = subprocess.run(
        [sys.executable, "-m", "commref.cli", *argv], capture_output=True, text=True, timeout=60, env=clean_env()
    )
    assert proc.returncode == 2 and proc.stderr.strip() == message, proc.stderr
