"""Ranks on hosts that share only a network (tests/netns_hosts.py: network namespaces
joined by veth, each with its own host name and /dev/shm): `path="auto"` finds LSA
inside a host and GIN over network mpi across hosts from the topology alone, and the
collectives are exact there. Skipped, with the reason, where namespaces cannot be made
(not root, no iproute2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import netns_hosts
import pytest
from conftest import REPO, clean_env, mpiexec, run_cmd
from helpers import check_summary

_UNAVAILABLE = netns_hosts.why_unavailable()  # makes and removes a probe namespace: once
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no namespace hosts here: {_UNAVAILABLE}")


def _leftovers() -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    tag = f"{netns_hosts.PREFIX}{os.getpid()}"
    return [w for w in (netns + links).split() if w.rstrip(":").split("@")[0].startswith(tag)]


def test_hosts_share_no_memory_and_reach_each_other_over_tcp():
    """One rank per host: host names differ, a file in one host's /dev/shm is not in the
    other's, and an MPI allreduce between them (TCP over the veths) is exact."""
    script = (
        "import os, socket, time; from mpi4py import MPI; import numpy as np; c = MPI.COMM_WORLD; "
        "open(f'/dev/shm/commref-netns-{c.rank}', 'w').close(); c.Barrier(); "
        "seen = sorted(f for f in os.listdir('/dev/shm') if f.startswith('commref-netns-')); "
        "a = np.full(1 << 16, c.rank + 1.0); b = np.zeros_like(a); c.Allreduce(a, b); "
        "rows = c.gather(f'{c.rank} {socket.gethostname()} {seen} {bool((b == 3.0).all())}'); "
        "c.rank or print(*rows, sep='\\n', flush=True)"
    )
    with netns_hosts.NetnsHosts(2, 1) as hosts:
        proc = run_cmd([mpiexec(), "-n", "2", sys.executable, "-c", script], timeout=120, env=hosts.env(clean_env()))
        names = hosts.names
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(proc.stdout.split("\n")[:-1])
    assert lines == [
        f"0 {names[0]} ['commref-netns-0'] True",
        f"1 {names[1]} ['commref-netns-1'] True",
    ], proc.stdout
    assert not _leftovers(), f"left behind: {_leftovers()}"


def test_auto_path_finds_lsa_inside_a_host_and_gin_across():
    """`commref check --np 4 --path auto` on 2 hosts x 2 ranks: 0 wrong, 2 nodes found by
    their host names, rank 0's GIN peers the other host's ranks over network mpi (its
    host's other rank over LSA)."""
    args = ["commref.cli", "check", "--np", "4", "--path", "auto", "allreduce", "alltoall", "sendrecv", "group"]
    args += ["--count", "0", "7", "1001", "--dtype", "int32", "float32", "float64"]
    with netns_hosts.NetnsHosts(2, 2) as hosts:
        proc = run_cmd([sys.executable, "-m", *args], timeout=600, env=hosts.env(clean_env()))
        names = hosts.names
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = check_summary(proc.stdout)
    assert summary is not None and summary.wrong == 0 and summary.cases > 0, out
    topology = re.search(r"^# 2 nodes: (.*)$", proc.stdout, re.M)
    assert topology is not None, out
    assert topology.group(1) == (
        f"{names[0]}: ranks [0, 1]; {names[1]}: ranks [2, 3]; GIN peers of rank 0: [2, 3], network mpi"
    ), out
    assert not _leftovers(), f"left behind: {_leftovers()}"


def test_the_tool_refuses_bad_arguments_before_making_anything():
    for argv, message in ((["--hosts", "0", "--", "true"], "hosts must be from 1"), (["--hosts", "2"], "command")):
        proc = subprocess.run(
            [sys.executable, "tests/netns_hosts.py", *argv], capture_output=True, text=True, timeout=60, cwd=REPO
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not _leftovers()
