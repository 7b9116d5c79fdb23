"""Standalone baselines (bench/peers.py, bench/standalone.py) and the in-process
baseline's quiesced phase (bench/measure.py, quiesced): --baseline's comma list and its
refusals, a peer's job at a tiny size (its rows laid out as commref's, no commref in its
processes), the line and the dashes of a peer that cannot run, a failing or late job
named, the closing table and the JSON document's peer columns, commref's Python GIN
proxy parked while the in-process baseline's calls are timed, and those calls bound
straight to MPI's methods, as the standalone peer's are."""

from __future__ import annotations

import os
import sys


def _parked_main() -> None:
    """Under mpiexec: the sweep of one 8-byte size on GIN and an MPI baseline that
    records, at each of its calls, whether every GIN engine of commref's was parked, and
    the CPU time (ns, /proc's schedstat) of every thread of this process but the main one."""
    import threading

    from commref.bench import harness
    from commref.bench.arguments import build_parser
    from commref.bench.baselines import MPIBaseline
    from commref.transports.mpi_world import MPIWorld

    comms, seen, kinds = [], [], set()
    main = threading.get_native_id()
    setup = harness.setup_communicators

    def capture(*a, **k):
        runners, skipped = setup(*a, **k)
        comms.extend(c for _, c in runners)
        return runners, skipped

    def others_ns() -> int:
        total = 0
        for tid in os.listdir("/proc/self/task"):
            if int(tid) != main:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
        return total

    class Watched(MPIBaseline):
        def bind_call(self, name, *args):  # the timed loop's call: observed, then MPI's
            call = super().bind_call(name, *args)

            def watched():
                proxies = [c.proxy for c in comms]
                kinds.update(type(p).__name__ for p in proxies)
                seen.append((all(p.parked for p in proxies), others_ns()))
                call()

            return watched

    harness.setup_communicators = capture
    harness.make_baseline = lambda world, device, device_id, kind: Watched(world)
    argv = ["all_reduce", "-b", "8", "-e", "8", "-n", "400", "-w", "5", "--path", "gin", "--baseline", "mpi"]
    world = MPIWorld(timeout=60)
    harness.run_rank(world, build_parser().parse_args([*argv, "--no-bound"]), out=lambda line: None)
    sys.stdout.write(
        f"rank {world.rank}: proxies {sorted(kinds)} calls {len(seen)} parked {all(p for p, _ in seen)} "
        f"cpu_us {(seen[-1][1] - seen[0][1]) / 1e3:.0f}\n"
    )
    sys.stdout.flush()


def _bound_main() -> None:
    """Under mpiexec: each collective's timed call on the in-process MPI baseline
    (catalogue.Collective.bound), which MPI makes in one call, is that mpi4py method
    itself with its arguments bound, and gives MPI's result; prints one line per rank."""
    import numpy as np

    from commref.bench.baselines import MPIBaseline
    from commref.collectives import catalogue
    from commref.transports.mpi_world import MPIWorld

    world = MPIWorld(timeout=60)
    base = MPIBaseline(world)
    n, r, root = world.size, world.rank, 1
    x = np.arange(4 * n, dtype=np.float32) + 10 * r
    every = [np.arange(4 * n, dtype=np.float32) + 10 * k for k in range(n)]
    total = sum(every)
    cases = {  # name: (sendbuf, recvbuf, what recvbuf holds after)
        "allreduce": (x, np.empty_like(x), total),
        "reduce_scatter": (x, np.empty(4, np.float32), total[4 * r : 4 * r + 4]),
        "reduce": (x, np.empty_like(x), total if r == root else None),
        "allgather": (x[:4], np.empty(4 * n, np.float32), np.concatenate([e[:4] for e in every])),
        "alltoall": (x, np.empty_like(x), np.concatenate([e[4 * r : 4 * r + 4] for e in every])),
    }
    bad = []
    for name, (send, recv, expected) in cases.items():
        recv.fill(-1)
        call = catalogue.get(name).bound(base, send, recv, "sum", root)
        if getattr(getattr(call, "func", None), "__self__", None) is not base.comm:
            bad.append(f"{name}: bound to {call!r}, not the MPI communicator's method")
        call()
        if expected is not None and not np.array_equal(recv, expected):
            bad.append(f"{name}: {recv} != {expected}")
    base.close()
    sys.stdout.write(f"rank {r}: bound {len(cases)} bad {bad}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["bound"]:
        _bound_main()
    else:
        _parked_main()
    sys.exit(0)


# ---------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------

import json  # noqa: E402
import stat  # noqa: E402

import pytest  # noqa: E402
from conftest import clean_env, run_cmd, run_mpi  # noqa: E402
from helpers import bench_args  # noqa: E402

from commref import cli  # noqa: E402
from commref.bench import peers  # noqa: E402
from commref.bench.baselines import split_baselines  # noqa: E402

TINY = ("all_reduce", "-b", "8", "-e", "1K", "-f", "128", "-n", "2", "-w", "1")


def test_baseline_lists_parse():
    assert split_baselines("auto") == ("auto", ())
    assert split_baselines("mpich,openmpi,gloo") == ("none", ("mpich", "openmpi", "gloo"))
    assert split_baselines("MPI, mpich,mpich") == ("mpi", ("mpich",))
    assert bench_args("all_reduce", "--baseline", "gloo,mpi").baseline == "mpi,gloo"
    assert bench_args("all_reduce", "--no-baseline").baseline == "none"
    for bad in ("ucc", "mpi,nccl", "none,mpich", "", "mpich,,x"):
        with pytest.raises(ValueError):
            split_baselines(bad)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--baseline", "mpich,ucc"], "argument --baseline: unknown baseline 'ucc'"),
        (["--baseline", "auto,mpi"], "at most one in-process baseline, got auto, mpi"),
        (["--baseline", "none,gloo"], "--baseline none measures no baseline"),
        (["--baseline", "mpich", "-N", "0"], "standalone baselines run in rounds: -N 0"),
        (["--baseline", "gloo", "-t", "2"], "standalone baselines run one rank per process"),
    ],
)
def test_bad_baselines_fail_in_one_line_before_any_rank(flags, message):
    proc = run_cmd([sys.executable, "-m", "commref", "bench", *TINY, "--np", "2", *flags], timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout  # no round, no rank


@pytest.mark.parametrize("name", ["mpich", "gloo"])
def test_a_standalone_job_at_a_tiny_size(name, tmp_path):
    peer = peers.find_peer(name)
    if peer.why_not:
        pytest.skip(peer.why_not)
    args = bench_args(*TINY, "-d", "float32")
    said = []
    rows = peers.run_peer(peer, args, 2, str(tmp_path), 120, said.append)
    assert rows is not None, said
    assert [(r["size"], r["count"]) for r in rows] == [(8, 2), (1024, 256)]  # commref's size and count columns
    assert all(r["time_us"] > 0 and r["busbw"] >= 0 for r in rows), rows
    assert set(rows[0]) == {"size", "count", "time_us", "algbw", "busbw"}
    with open(tmp_path / f"{name}.out.json") as f:
        out = json.load(f)
    assert out["commref_loaded"] is False and out["nranks"] == 2
    assert all(len(s["times"]) == 2 and len(s["times"][0]) == 2 for s in out["sizes"])  # every rank's -n times
    assert peer.label.startswith("MPICH" if name == "mpich" else "gloo (torch ")


def _fake_openmpi(tmp_path, script: str) -> dict[str, str]:
    """$COMMREF_OPENMPI_PYTHON naming a python with an `mpirun` beside it that runs `script`."""
    for exe, body in (("python", "exit 0"), ("mpirun", script)):
        path = tmp_path / exe
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return {peers.OPENMPI_PYTHON_ENV: str(tmp_path / "python")}


def test_a_failing_or_late_job_is_named(tmp_path):
    args = bench_args(*TINY)
    said = []
    peer = peers.find_peer("openmpi", _fake_openmpi(tmp_path, "echo 'no such fabric' >&2; exit 3"))
    assert peer.why_not is None
    assert peers.run_peer(peer, args, 2, str(tmp_path), 30, said.append) is None
    assert said == ["# Baseline openmpi: failed: its job exited with status 3: no such fabric"], said
    late = peers.find_peer("openmpi", _fake_openmpi(tmp_path, "echo $$ > " + str(tmp_path / "pid") + "; exec sleep 60"))
    assert peers.run_peer(late, args, 2, str(tmp_path), 1, said.append) is None
    assert said[-1] == "# Baseline openmpi: failed: its job did not finish within 1 s", said
    pid = int((tmp_path / "pid").read_text())
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] in "ZX"


def test_missing_peers_are_one_line_each():
    env = {peers.OPENMPI_PYTHON_ENV: ""}
    assert "is not set" in peers.find_peer("openmpi", env).why_not
    missing = {peers.OPENMPI_PYTHON_ENV: "/nonexistent/python"}
    assert "is not an executable" in peers.find_peer("openmpi", missing).why_not


def test_the_rounds_print_and_write_every_peers_columns(tmp_path):
    out = tmp_path / "r.json"
    env = clean_env()
    env.pop(peers.OPENMPI_PYTHON_ENV, None)
    argv = [*TINY, "--np", "2", "--no-bound", "--baseline", "mpi,mpich,openmpi", "-N", "2", "--json", str(out)]
    proc = run_cmd([sys.executable, "-m", "commref", "bench", *argv], timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("# Baseline openmpi: not measured ($COMMREF_OPENMPI_PYTHON") for line in lines) == 1
    assert [line for line in lines if line.startswith("# Round ")] == [
        f"# Round {k} of 2: {who}" for k in (1, 2) for who in ("commref", "mpich")
    ]
    heads = [i for i, line in enumerate(lines) if line.startswith("#") and "best peer" in line]
    assert heads, proc.stdout
    group = lines[heads[-1]]
    assert "commref" in group and "in-process" in group and "MPICH" in group and "openmpi" in group
    rows = [line.split() for line in lines[heads[-1] + 3 :] if line.strip() and not line.startswith("#")]
    assert [r[0] for r in rows] == ["8", "1024"], proc.stdout
    for r in rows:  # commref 2, in-process 3, mpich 3, openmpi 3 (dashes), best 2, series
        assert r[4] != "-" and r[6] != "-" and r[9] != "-" and r[12:15] == ["-", "-", "-"], r
        assert r[15] == "mpich" and r[-1] == "lsa", r
    doc = json.loads(out.read_text())
    sa = doc["standalone"]
    assert sa["rounds"] == 2 and [p["name"] for p in sa["peers"]] == ["mpich", "openmpi"]
    assert sa["peers"][1]["unavailable"] and sa["peers"][0]["library"].startswith("MPICH")
    row = sa["rows"][0]
    assert row["peers"]["openmpi"] is None and len(row["peers"]["mpich"]["rounds_us"]) == 2
    assert row["ratio"]["mpich"] > 0 and row["best_peer"] == "mpich" and row["inprocess"]["time_us"] > 0
    assert sorted({r["cycle"] for r in doc["rows"]}) == [1, 2] and doc["params"]["baseline"] == "mpi,mpich,openmpi"


def test_peers_under_an_mpiexec_started_by_hand_say_so():
    argv = ["commref", "bench", *TINY, "--no-bound", "--baseline", "mpich,gloo"]
    proc = run_mpi(2, argv, timeout=240, module=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# Baseline mpich: not measured (a job of its own needs commref's launcher" in proc.stdout
    assert "# Baseline note: gloo is timed in commref's processes" in proc.stdout
    assert "# Baseline: gloo (torch " in proc.stdout


@pytest.mark.parametrize("engine, proxy", [("python", "GinProxy"), ("native", "NativeProxy")])
def test_commref_is_parked_while_the_in_process_baseline_is_timed(engine, proxy):
    proc = run_mpi(2, [__file__], timeout=240, env=clean_env(COMMREF_GIN_ENGINE=engine))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, proc.stdout + proc.stderr
    for line in lines:
        words = line.split()
        assert words[2:4] == ["proxies", f"['{proxy}']"] and words[5] == "405" and words[7] == "True", line
        # Parked, the engine's thread blocks; polling, it took 1-3 ms of these 405 calls.
        assert int(words[9]) < 500, line


def test_the_in_process_baselines_calls_are_mpis_own_methods():
    # A frame of the baseline's class per call cost 0.7-1.1 us of an 8-byte AllReduce's
    # 5-6 us here: the standalone peer's loop calls mpi4py's method directly.
    proc = run_mpi(2, [__file__, "bound"], timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0: bound 5 bad []", "rank 1: bound 5 bad []"], proc.stdout + proc.stderr


def test_the_cli_routes_standalone_baselines_to_the_rounds(monkeypatch):
    calls = []
    monkeypatch.setattr(peers, "run_rounds", lambda args, argv, n, env=None: calls.append((argv, n)) or 0)
    assert cli.main(["bench", *TINY, "--baseline", "mpich", "--np", "2"]) == 0
    assert calls == [(["bench", *TINY, "--baseline", "mpich", "--np", "2"], 2)]


def test_an_interrupted_bench_leaves_no_peer_process(tmp_path):
    import signal
    import time

    from conftest import start_commref

    pidfile = tmp_path / "pid"
    env = clean_env(**_fake_openmpi(tmp_path, f"echo $$ > {pidfile}; exec sleep 60"))
    argv = ["bench", *TINY, "--np", "2", "--no-bound", "--baseline", "openmpi", "-N", "1"]
    proc = start_commref(argv, env)
    try:
        seen = []
        for line in proc.stdout:  # the bench prints each round's start as it begins
            seen.append(line)
            if line.startswith("# Round 1 of 1: openmpi"):
                break
        deadline = time.monotonic() + 30
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pidfile.exists(), "".join(seen)
        pid = int(pidfile.read_text())
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, "".join(seen) + rest + err
    gone = not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] in "ZX"
    assert gone, f"the peer's process {pid} outlived the bench"
