"""Simulated nodes (issue 14, part 1): COMMREF_HOSTID / COMMREF_NODES (transports/world.node_of)
and `--nodes N` on commref check and bench.

- node identity: the override, the split into nodes of consecutive ranks (uneven too),
  bad values refused in one line;
- teams: the LSA team is the node, every rank of the host stays mapped (GIN on network
  shm reaches the other nodes' windows), `path="auto"` puts the other nodes' ranks on
  GIN, `path="lsa"` across nodes is refused;
- exactness: every collective with `path="auto"` on simulated nodes, ThreadWorld (5
  ranks on 2 nodes, both wires) and MPI (`commref check --np 4 --nodes 2`, `--np 5
  --nodes 2 --network mpi`);
- the CLI refuses a node count the ranks cannot fill before any rank starts.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from commref.collectives.communicator import Communicator
from commref.transports.errors import CapabilityError
from commref.transports.world import HOSTID_ENV, NODES_ENV, ThreadWorld, check_nodes, node_of

from conftest import clean_env, run_mpi
from test_gin import _run_sweep, many_channels  # noqa: F401 (a fixture)

WORLD_TIMEOUT = 60.0


def test_node_identity_splits_consecutive_ranks_and_honours_the_override():
    assert [node_of("h", r, 5, {NODES_ENV: "2"}) for r in range(5)] == ["h/node0"] * 3 + ["h/node1"] * 2
    assert [node_of("h", r, 6, {NODES_ENV: "3"}) for r in range(6)] == [f"h/node{r // 2}" for r in range(6)]
    assert node_of("h", 3, 4, {}) == "h"
    assert node_of("h", 3, 4, {HOSTID_ENV: "rack7", NODES_ENV: "2"}) == "rack7"  # the override wins
    assert check_nodes("4", 4) == 4
    for bad in ("0", "5", "two", ""):
        with pytest.raises(ValueError, match=r"^COMMREF_NODES \(--nodes\) must be an integer from 1 to the number "
                                             r"of ranks \(4\), not "):
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
        with pytest.raises(CapabilityError, match=r"rank \d: path 'lsa' needs every peer on this rank's node "
                                                  r"\(\S+/node\d\); ranks \[.*\] are on other nodes: use "
                                                  r"path='auto' or 'gin'"):
            Communicator(world, "cpu", path="lsa", timeout=WORLD_TIMEOUT)

    ThreadWorld.run(4, body, timeout=WORLD_TIMEOUT)


@pytest.mark.parametrize("wire", ["ordered", "unordered"])
def test_collectives_on_simulated_nodes_are_exact(wire, monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")
    _run_sweep(5, dict(path="auto", wire=wire, max_channels=2, slot_bytes=256), ["float32", "int8"], ["sum", "max"],
               [0, 1, 7, 1009])


@pytest.mark.mpi
@pytest.mark.parametrize("np_, nodes, extra", [(4, 2, []), (5, 2, ["--network", "mpi"])])
def test_check_on_simulated_nodes_under_mpiexec(np_, nodes, extra, shm_leak_check):
    args = ["commref.cli", "check", "--path", "auto", "--nodes", str(nodes), *extra, "--dtype", "float32", "int32",
            "--op", "sum", "min", "--count", "0", "1", "7", "1009"]
    proc = run_mpi(np_, args, timeout=120, module=True, env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    m = re.search(r"^# (\d+) cases, .* (\d+) wrong elements in (\d+) cases", proc.stdout, re.M)
    assert m and int(m.group(1)) > 0 and (int(m.group(2)), int(m.group(3))) == (0, 0), out[-2000:]


@pytest.mark.parametrize("argv, message", [
    (["check", "--np", "4", "--nodes", "5"], "commref check: error: COMMREF_NODES (--nodes) must be an integer "
                                             "from 1 to the number of ranks (4), not 5"),
    (["bench", "all_reduce", "--np", "2", "--nodes", "3"], "commref bench: error: COMMREF_NODES (--nodes) must be "
                                                          "an integer from 1 to the number of ranks (2), not 3"),
])
def test_cli_refuses_more_nodes_than_ranks_before_any_rank_starts(argv, message):
    proc = subprocess.run([sys.executable, "-m", "commref.cli", *argv], capture_output=True, text=True, timeout=60,
                          env=clean_env())
    assert proc.returncode == 2 and proc.stderr.strip() == message, proc.stderr
