"""A rank that fails or dies in the middle of a collective ends the whole job promptly.

- ThreadWorld: a rank that raises while its peers are inside a collective's kernels
  (blocked in a CPU-engine wait for that rank's data) makes every other rank raise
  CommAborted within ABORT_LATENCY_S: the exception leaving `with Communicator(...)`
  marks the world failed (World.mark_failed; without it, closing a GIN communicator
  waited for peers stuck in their kernels until the deadline), and the kernels poll
  the world's abort word. Measured from the raise to each bystander's exception, for
  every collective and algorithm, over LSA and GIN; also for a rank whose own kernel
  fails (its deadline).
- Processes: a rank of `commref check --np 3` / `commref bench --np 3` killed with
  SIGKILL in the middle of a collective (tests/kill_hook/sitecustomize.py) ends the job
  with a non-zero status well inside COMMREF_TIMEOUT, no rank process survives, and
  /dev/shm holds no commref or MPICH segment of the job afterwards; the same for a
  rank killed while every window file exists.
- The launcher's own watch (transports/launcher.py), with a stand-in process manager
  that does not end the job itself: a rank that died ends the job, ranks that outlive
  their process manager are killed, a rank that exits normally is no death.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from conftest import REPO, TESTS, clean_env, mpiexec
from helpers import orphan_segments

from commref.collectives import catalogue
from commref.collectives.communicator import Communicator
from commref.transports import launcher
from commref.transports.errors import CommAborted, CommTimeout
from commref.transports.thread_world import ThreadWorld

ABORT_LATENCY_S = 1.0  # the promise: bystanders raise CommAborted within this of the failure
COMM_TIMEOUT_S = 30.0  # the bystanders' own deadline: an abort noticed by deadline would take this long
COUNT = 1 << 20  # elements: more than the FIFOs hold, so no bystander can finish without the failed rank


class Boom(RuntimeError):
    pass


def _buffers(spec: catalogue.Collective, nranks: int, rank: int):
    send_n, recv_n = spec.counts(COUNT // nranks if spec.scaled else COUNT, nranks)
    return np.full(send_n, rank + 1, np.float32), np.zeros(recv_n, np.float32)


def _call(spec: catalogue.Collective, comm: Communicator, send, recv, algorithm: str) -> None:
    spec.call(comm, send, recv, "sum" if spec.reducing else None, 0, algorithm=algorithm)


def _raise_mid_collective(world, coll: str, algorithm: str, path: str, victim: int, outcome: dict):
    """Every rank makes one call of `coll` (setup done, kernels loaded); then the others
    enter a second call and `victim` raises instead. outcome[rank] = (exception or None,
    time.monotonic() when the call ended); outcome["failed_at"]: when the victim raised."""
    spec = catalogue.get(coll)
    with Communicator(world, "cpu", timeout=COMM_TIMEOUT_S, path=path, max_channels=2) as comm:
        send, recv = _buffers(spec, world.size, world.rank)
        _call(spec, comm, send, recv, algorithm)
        world.barrier(what="first call done")
        if world.rank == victim:
            time.sleep(0.3)  # the others are blocked inside the second call's kernels by now
            outcome["failed_at"] = time.monotonic()
            raise Boom(f"rank {victim} fails in the middle of {coll}")
        try:
            _call(spec, comm, send, recv, algorithm)
        except Exception as e:  # noqa: BLE001 - inspected by the test
            outcome[world.rank] = (e, time.monotonic())
            raise
        outcome[world.rank] = (None, time.monotonic())


# (collective, algorithm, path): every kernel; GIN for one ring and the tree. The victim
# is the root of the rooted collectives (rank 0), so that nobody can complete without it.
CASES = [
    ("allreduce", "ring", "lsa"),
    ("allreduce", "tree", "lsa"),
    ("allgather", "ring", "lsa"),
    ("reduce_scatter", "ring", "lsa"),
    ("broadcast", "ring", "lsa"),
    ("reduce", "ring", "lsa"),
    ("alltoall", "ring", "lsa"),
    ("allreduce", "ring", "gin"),
    ("allreduce", "tree", "gin"),
    ("allgather", "ring", "gin"),
]


@pytest.mark.parametrize("coll, algorithm, path", CASES)
def test_rank_raising_mid_collective_aborts_every_other_rank_within_a_second(coll, algorithm, path):
    nranks, victim = 3, 0 if catalogue.get(coll).rooted else 1
    outcome: dict = {}
    t0 = time.monotonic()
    with pytest.raises(Boom):
        ThreadWorld.run(nranks, _raise_mid_collective, coll, algorithm, path, victim, outcome, timeout=COMM_TIMEOUT_S)
    assert time.monotonic() - t0 < COMM_TIMEOUT_S / 2
    for rank in set(range(nranks)) - {victim}:
        exc, ended = outcome[rank]
        latency = ended - outcome["failed_at"]
        assert isinstance(exc, CommAborted), f"rank {rank}: {exc!r} after {latency:.2f} s"
        assert f"rank {rank}:" in str(exc), str(exc)
        assert latency < ABORT_LATENCY_S, f"rank {rank} raised CommAborted {latency:.3f} s after the failure"


def _fail_inside_own_kernel(world, victim: int, late: int, outcome: dict):
    """`victim`'s own kernel fails (its deadline, 0.5 s, passes while `late` has not
    entered the call): the bystander, blocked in its kernel, and the late rank, entering
    after the failure, raise CommAborted."""
    short = world.rank == victim
    with Communicator(world, "cpu", timeout=0.5 if short else COMM_TIMEOUT_S, max_channels=2) as comm:
        x, y = np.ones(COUNT, np.float32), np.zeros(COUNT, np.float32)
        world.barrier(what="communicators ready")
        if world.rank == late:
            time.sleep(1.5)
        try:
            comm.allreduce(x, y, algorithm="ring")
        except Exception as e:  # noqa: BLE001
            outcome[world.rank] = (e, time.monotonic())
            raise
        outcome[world.rank] = (None, time.monotonic())


def test_rank_failing_inside_its_kernel_aborts_the_others():
    outcome: dict = {}
    with pytest.raises(CommTimeout) as info:
        ThreadWorld.run(3, _fail_inside_own_kernel, 1, 2, outcome, timeout=COMM_TIMEOUT_S)
    assert info.value.rank == 1
    failed_at = outcome[1][1]
    bystander, at = outcome[0]
    assert isinstance(bystander, CommAborted), repr(bystander)
    assert at - failed_at < ABORT_LATENCY_S, f"the bystander aborted {at - failed_at:.3f} s after the failure"
    late, late_at = outcome[2]
    assert isinstance(late, CommAborted), repr(late)
    assert late_at - failed_at < 1.5 + ABORT_LATENCY_S


def test_mark_failed_returns_and_ends_every_wait_of_the_group():
    """World.mark_failed raises nothing and returns; the others' waits raise
    CommAborted naming the failed rank and its reason at once."""
    outcome: dict = {}

    def body(world):
        world.barrier(what="setup")
        if world.rank == 1:
            time.sleep(0.1)
            outcome["marked_at"] = time.monotonic()
            world.mark_failed("RuntimeError: injected")
            assert world.aborting
            return "returned"
        try:
            world.barrier(what="never completes")
        except CommAborted as e:
            outcome[world.rank] = (e, time.monotonic())
            raise

    with pytest.raises(CommAborted):
        ThreadWorld.run(3, body, timeout=COMM_TIMEOUT_S)
    for rank in (0, 2):
        exc, at = outcome[rank]
        assert exc.origin_rank == 1 and exc.reason == "RuntimeError: injected", str(exc)
        assert "rank 1 failed: RuntimeError: injected" in str(exc)
        assert at - outcome["marked_at"] < 0.5


# The same under mpiexec: rank 1 raises while ranks 0 and 2 are inside an allreduce.
# Leaving `with Communicator` marks rank 1's world failed, so its close() waits for no
# peer (over GIN it waited in a barrier for peers stuck in their kernels, until
# COMMREF_TIMEOUT), and python -m mpi4py aborts the job.
RAISING_JOB = """
import sys, time
import numpy as np
from commref.collectives.communicator import Communicator
from commref.transports.mpi_world import MPIWorld

world = MPIWorld()
with Communicator(world, "cpu", path=sys.argv[1], max_channels=2) as comm:
    x = np.ones(1 << 20, np.float32)
    y = np.zeros_like(x)
    comm.allreduce(x, y)
    world.barrier()
    if world.rank == 1:
        time.sleep(0.3)  # the others are inside the next allreduce
        print(f"raised at {time.time()!r}", flush=True)
        raise RuntimeError("rank 1 fails in the middle of an allreduce")
    comm.allreduce(x, y)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("path", ["lsa", "gin"])
def test_mpi_rank_raising_mid_collective_ends_the_job_promptly(tmp_path, capfd, path):
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    script = tmp_path / "raise.py"
    script.write_text(RAISING_JOB)
    rc = launcher.run_job(
        [exe, "-n", "3", sys.executable, "-m", "mpi4py", str(script), path],
        env=clean_env(COMMREF_TIMEOUT=str(COMM_TIMEOUT_S)),
        timeout=4 * COMM_TIMEOUT_S,
    )
    ended = time.time()
    out, err = capfd.readouterr()
    assert rc != 0 and "rank 1 fails in the middle of an allreduce" in err, err[-2000:]
    raised_at = float(out.split("raised at ")[1].split()[0])
    assert ended - raised_at < 5.0, f"the job ended {ended - raised_at:.1f} s after the raise"


# ---------------------------------------------------------------------------------------
# processes: a rank killed with SIGKILL
# ---------------------------------------------------------------------------------------

KILL_HOOK = os.path.join(TESTS, "kill_hook")  # its sitecustomize makes a rank SIGKILL itself
JOB_TIMEOUT_S = 30  # COMMREF_TIMEOUT of the killed jobs: every wait of a survivor has this deadline
PROMPT_S = 5.0  # "well inside COMMREF_TIMEOUT": from the kill to the launcher's exit


def _pid_alive(pid: int) -> bool:
    proc = launcher._process(pid)
    return proc is not None and proc[0] not in ("Z", "X")


def _run_killed(tmp_path, argv: list[str], kill: str) -> dict:
    """Runs `python -m commref ARGV` (a --np 3 job) with the kill hook set to `kill`
    (tests/kill_hook/sitecustomize.py); returns what happened."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    before = launcher.shm_segments()
    env = clean_env(COMMREF_TIMEOUT=str(JOB_TIMEOUT_S), COMMREF_TEST_KILL=kill, COMMREF_TEST_KILL_DIR=str(tmp_path))
    env["PYTHONPATH"] = KILL_HOOK + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "commref", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=4 * JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job did not end within {4 * JOB_TIMEOUT_S} s\n{out[-2000:]}\n{err[-2000:]}")
    ended = time.time()
    killed = tmp_path / "killed"
    assert killed.exists(), f"the rank was never killed (status {proc.returncode})\n{out[-2000:]}\n{err[-2000:]}"
    victim, killed_at = killed.read_text().split()
    ranks = [int(p.read_text()) for p in tmp_path.glob("rank-*.pid")]
    return {
        "status": proc.returncode,
        "seconds": ended - float(killed_at),
        "victim": int(victim),
        "ranks": ranks,
        "alive": [p for p in ranks if _pid_alive(p)],
        "orphans": orphan_segments(before),
        "stdout": out,
        "stderr": err,
    }


# The 5th collective call of rank 2, killed 5 ms into it (inside its kernel; 4 MB per
# call, so its peers are blocked in theirs waiting for its data).
KILLED_JOBS = {
    "check": "check allreduce allgather --np 3 --count 1000000 --dtype float32 int32 --op sum max".split(),
    "bench": ["bench", "all_reduce", "--np", "3", "-b", "4M", "-e", "4M", "-n", "50", "-w", "2", "--no-baseline"],
}


@pytest.mark.mpi
@pytest.mark.parametrize("command", sorted(KILLED_JOBS))
def test_rank_killed_mid_collective_ends_the_job(tmp_path, command):
    r = _run_killed(tmp_path, KILLED_JOBS[command], "2:collective:5:0.005")
    assert r["status"] not in (0, 2), r["stderr"][-2000:]
    assert r["seconds"] < PROMPT_S, f"ended {r['seconds']:.2f} s after the kill (COMMREF_TIMEOUT {JOB_TIMEOUT_S})"
    assert len(r["ranks"]) == 3 and r["victim"] in r["ranks"]
    assert not r["alive"], f"rank processes outlived the job: {r['alive']}"
    assert not r["orphans"], f"left behind in /dev/shm: {sorted(r['orphans'])}"
    assert "wrong elements" not in r["stdout"] and "Avg bus bandwidth" not in r["stdout"]  # it did not complete


@pytest.mark.mpi
def test_rank_killed_while_windows_are_mapped_leaves_no_segment(tmp_path):
    """Killed between creating its window file and unlinking it (every rank's window
    file exists then): the launcher removes the job's files and MPICH's."""
    r = _run_killed(
        tmp_path,
        ["check", "allreduce", "--np", "3", "--count", "7", "--dtype", "float32", "--op", "sum"],
        "1:barrier=windows mapped:1:0",
    )
    assert r["status"] not in (0, 2), r["stderr"][-2000:]
    assert r["seconds"] < PROMPT_S, f"the job ended {r['seconds']:.2f} s after the kill"
    assert not r["alive"], f"rank processes outlived the job: {r['alive']}"
    assert not r["orphans"], f"left behind in /dev/shm: {sorted(r['orphans'])}"


# ---------------------------------------------------------------------------------------
# the launcher's own watch: a process manager that does not end the job
# ---------------------------------------------------------------------------------------

# A stand-in for mpiexec that starts N "ranks" and waits for all of them, but, unlike
# MPICH's hydra, never ends the others when one dies. Modes: kill (rank 1 SIGKILLs
# itself after 0.5 s; the others would sleep 60 s), orphan (once every rank has
# announced itself, the manager exits with status 3, leaving its ranks running),
# early_exit (rank 1 exits normally after 0.3 s, the others 2 s later: no death).
FAKE_MANAGER = """
import glob, os, subprocess, sys, time
n, mode, tag = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rank = '''
import os, signal, sys, time
from commref.transports import launcher
launcher.announce_rank()
me, mode = int(sys.argv[1]), sys.argv[2]
if mode == "kill" and me == 1:
    time.sleep(0.5)
    with open(os.path.join(sys.argv[3], "killed"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "early_exit" and me == 1:
    time.sleep(0.3)
    sys.exit(0)
time.sleep(2.5 if mode == "early_exit" else 60)
'''
procs = [subprocess.Popen([sys.executable, "-c", rank, str(i), mode, tag], env=dict(os.environ, PMI_RANK=str(i)))
         for i in range(n)]
if mode == "orphan":
    deadline = time.monotonic() + 30
    while len(glob.glob(os.path.join(os.environ["COMMREF_JOB_DIR"], "*.rank"))) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
sys.exit(max(abs(p.wait()) for p in procs))
"""


def _fake_job(tmp_path, mode: str, capfd) -> tuple[int, float, str]:
    """(status, seconds from the start, or from the kill in mode kill, to the end, stderr)."""
    script = tmp_path / "manager.py"
    script.write_text(FAKE_MANAGER)
    t0 = time.time()
    rc = launcher.run_job(
        [sys.executable, str(script), "3", mode, str(tmp_path)], env=clean_env(), timeout=60, grace_s=2
    )
    ended = time.time()
    if mode == "kill":
        t0 = float((tmp_path / "killed").read_text())
    return rc, ended - t0, capfd.readouterr().err


def _survivors(tmp_path) -> list[int]:
    """Processes still running a fake rank of this test's job (its tmp_path in argv)."""
    mine = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"launcher.announce_rank()" in cmd and str(tmp_path).encode() in cmd and _pid_alive(int(pid)):
            mine.append(int(pid))
    return mine


def test_launcher_ends_a_job_whose_process_manager_ignores_a_dead_rank(tmp_path, capfd):
    rc, seconds, err = _fake_job(tmp_path, "kill", capfd)
    assert rc != 0
    # the watch's grace is 1 s; without the watch the job would run 60 s
    assert seconds < 1.0 + 3.0, f"ended {seconds:.1f} s after the kill"
    assert "rank 1 (pid " in err and "died without exiting" in err, err
    assert not _survivors(tmp_path)


def test_launcher_kills_ranks_that_outlive_their_process_manager(tmp_path, capfd):
    rc, seconds, err = _fake_job(tmp_path, "orphan", capfd)
    assert rc == 3 and seconds < 10.0, (rc, seconds)
    assert "killed 3 rank process(es) that outlived the job" in err, err
    assert not _survivors(tmp_path)


def test_a_rank_that_exits_early_is_not_a_death(tmp_path, capfd):
    rc, seconds, err = _fake_job(tmp_path, "early_exit", capfd)
    assert rc == 0, err
    assert seconds >= 2.5 and "died" not in err and "outlived" not in err, (seconds, err)


def test_job_directory_is_removed(tmp_path, capfd):
    seen = set(os.listdir(tempfile.gettempdir()))
    _fake_job(tmp_path, "early_exit", capfd)
    assert not [d for d in set(os.listdir(tempfile.gettempdir())) - seen if d.startswith("commref-job-")]


def test_a_rank_starting_after_its_job_ended_exits(tmp_path):
    gone = tmp_path / "commref-job-ended"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from commref.transports import launcher; launcher.announce_rank(); print('still running')",
        ],
        env=clean_env(COMMREF_JOB_DIR=str(gone), PMI_RANK="2"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "still running" not in proc.stdout
    assert proc.stderr.strip() == f"commref: rank 2: its job has ended (no {gone}); exiting"
