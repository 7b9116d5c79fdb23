"""The soak (bench/soak.py) in miniature: mixed collectives on one
communicator across simulated nodes with a lossy GIN wire, every result exact, then
communicators created and closed in a row, without threads, descriptors or mappings
left behind. The full run (20,000 calls, 200 communicators) and its figures:
docs/reliability.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from commref.bench import soak
from commref.transports.nodes import NODES_ENV


def test_soak_in_miniature_is_exact_and_leaves_nothing_behind(tmp_path):
    # A process of its own: in the suite's process, threads other tests left behind hold
    # malloc arenas, and a communicator's new threads may then open new ones (up to
    # glibc's limit), which would read as mappings a communicator left behind.
    out = tmp_path / "soak.json"
    argv = ["--calls", "120", "--comms", "20", "--max-bytes", "256K", "--threads", "4", "--seed", "3"]
    argv += ["--timeout", "60", "--json", str(out)]
    env = {**os.environ, NODES_ENV: "2"}
    done = subprocess.run(
        [sys.executable, "-m", "commref.bench.soak", *argv], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reports = json.loads(out.read_text())
    r0 = reports[0]
    assert r0["wrong"] == 0 and {"ring", "hierarchical"} <= set(r0["algorithms"])
    assert set(r0["by_collective"]) >= {"allreduce", "allgather", "reduce_scatter", "broadcast", "reduce"}
    assert r0["gin_stats"]["retransmits"] > 0
    assert all(not r["samples"]["comms"] for r in reports[1:])  # one process: rank 0 samples it
    comms = soak.growth(r0["samples"]["comms"])
    for measure in ("threads", "fds"):  # (/dev/shm is the host's: other jobs' entries come and go)
        start, end, _ = comms[measure]
        assert end == start, (measure, comms)
    # Mappings: malloc's heaps come and go with the phase (three arenas' second heaps,
    # 8 mappings, seen present after every third communicator), so the later half of the
    # samples is held to the range of the earlier half, plus one arena (2 mappings). A
    # leak of one mapping per communicator would add 9 or more.
    maps = [s["maps"] for s in r0["samples"]["comms"]]
    half = len(maps) // 2
    assert max(maps[half:]) <= max(maps[:half]) + 2, maps
