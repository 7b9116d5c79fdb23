"""The soak (bench/soak.py, issue 16 part 3) in miniature: mixed collectives on one
communicator across simulated nodes with a lossy GIN wire, every result exact, then
communicators created and closed in a row, without threads, descriptors or mappings
left behind. The full run (20,000 calls, 200 communicators) and its figures:
docs/reliability.md."""

from __future__ import annotations

from commref.bench import soak
from commref.transports.world import NODES_ENV, ThreadWorld


def test_soak_in_miniature_is_exact_and_leaves_nothing_behind(monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")
    args = soak.main.__globals__["argparse"].Namespace(calls=120, comms=20, max_bytes=256 * 1024,
                                                        fault="drop=0.05,dup=0.05,delay=0.05", seed=3, timeout=60.0)
    reports = ThreadWorld.run(4, soak.run_rank, args, timeout=120)
    r0 = reports[0]
    assert r0["wrong"] == 0 and {"ring", "hierarchical"} <= set(r0["algorithms"])
    assert set(r0["by_collective"]) >= {"allreduce", "allgather", "reduce_scatter", "broadcast", "reduce"}
    assert r0["gin_stats"]["retransmits"] > 0
    assert all(not r["samples"]["comms"] for r in reports[1:])  # one process: rank 0 samples it
    comms = soak.growth(r0["samples"]["comms"])
    for measure in ("threads", "fds"):  # (/dev/shm is the host's: other jobs' entries come and go)
        start, end, _ = comms[measure]
        assert end == start, (measure, comms)
    # Mappings: malloc may add an arena for a thread it had not served before (seen: +2 in
    # one run of the suite); a leak would add one or more per communicator, 15 between
    # the first sample (after 5) and the last.
    start, end, _ = comms["maps"]
    assert end - start <= 3, comms
