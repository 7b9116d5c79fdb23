"""The --np launcher cannot hurt the host.

- Host limits (transports/host_limits.py): --np N beyond what this host can hold (memory,
  /dev/shm, RLIMIT_NPROC, ranks per CPU) is one line and exit status 2 within 2 s, with no
  process started; --oversubscribe lifts the CPU limit only; 16 ranks on 2 CPUs pass.
- Signals (transports/launcher.py): SIGTERM, SIGINT and SIGHUP to `commref check --np 8`
  end the whole job, and so does SIGKILL of the launcher itself; 5 s after the signal no
  process of the job (the launcher, mpiexec, hydra's proxy, the ranks, the reaper) and no
  file of the job is left (its /dev/shm segments, commref's and MPICH's, and the topology
  file hydra's proxy holds in /tmp). The job's processes are told apart from other
  jobs' (other engineers run the same programs on this host) by a marker in their
  environment, COMMREF_TEST_JOB, which the launcher passes on to everything it starts.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import REPO, clean_env, mpiexec, start_commref
from helpers import orphan_segments

from commref import cli
from commref.transports import host_limits, job_reaper, launcher
from commref.transports.host_limits import Footprint, HostCapacity, HostLimitError

MIB, GIB = 1 << 20, 1 << 30
HOST = HostCapacity(cpus=2, nproc_limit=1000, tasks_in_use=100, mem_available=20 * GIB, shm_free=10 * GIB)
RANK = Footprint(memory_bytes=100 * MIB, shm_bytes=10 * MIB, tasks=3)


def test_sixteen_ranks_fit_two_cpus_and_seventeen_do_not():
    host_limits.check_ranks(16, RANK, host=HOST)
    with pytest.raises(HostLimitError) as e:
        host_limits.check_ranks(17, RANK, host=HOST)
    assert str(e.value) == (
        "--np 17: 17 ranks on 2 allowed CPU(s) is more than 8 per CPU (at most 16; --oversubscribe lifts this limit)"
    )
    host_limits.check_ranks(17, RANK, oversubscribe=True, host=HOST)


@pytest.mark.parametrize(
    "nranks, rank, host, message",
    [
        (
            200,
            RANK,
            HOST,
            "--np 200: the job needs about 21.5 GiB of memory (200 ranks x 110.0 MiB), more than 80% "
            "of the 20.0 GiB this host has available (MemAvailable)",
        ),
        (
            100,
            Footprint(MIB, 100 * MIB, 3),
            HOST,
            "--np 100: the job needs about 9.8 GiB in /dev/shm (100 ranks x "
            "100.0 MiB of windows and FIFOs), more than 80% of its 10.0 GiB free",
        ),
        (
            300,
            Footprint(MIB, MIB, 3),
            HOST,
            "--np 300: the job needs about 904 tasks (300 ranks x 3 threads), and this "
            "user runs 100 of its 1000 (RLIMIT_NPROC, ulimit -u)",
        ),
    ],
)
def test_memory_shm_and_process_limits_hold_even_when_oversubscribed(nranks, rank, host, message):
    with pytest.raises(HostLimitError) as e:
        host_limits.check_ranks(nranks, rank, oversubscribe=True, host=host)
    assert str(e.value) == message


def test_unlimited_nproc_is_not_a_limit():
    host = HostCapacity(cpus=64, nproc_limit=None, tasks_in_use=0, mem_available=1 << 50, shm_free=1 << 50)
    host_limits.check_ranks(500, RANK, host=host)


def test_this_hosts_capacity_is_read():
    host = HostCapacity.of_this_host()
    assert host.cpus == len(os.sched_getaffinity(0)) >= 1
    assert host.mem_available > 0 and host.shm_free > 0
    assert host.nproc_limit is None or host.tasks_in_use >= 1  # this process's own threads at least


def test_footprint_grows_with_the_ranks_buffers_and_windows():
    """The estimate follows what the ranks allocate: allgather's recvbuf is count x ranks,
    bench's buffers follow -e, every bench series has its own window, -R 2 puts the
    buffers in /dev/shm."""
    p = cli.build_parser()
    small = cli.check_footprint(p.parse_args(["check", "allgather", "--count", "1000"]), 4)
    large = cli.check_footprint(p.parse_args(["check", "allgather", "--count", "1000000"]), 4)
    assert large.memory_bytes - small.memory_bytes == cli.CHECK_BUFFER_FACTOR * (1000000 - 1000) * 5 * 8
    one = cli.FOOTPRINTS["bench"](p.parse_args(["bench", "all_reduce", "-e", "64M"]), 2)
    two = cli.FOOTPRINTS["bench"](p.parse_args(["bench", "all_reduce", "-e", "64M", "--path", "lsa,gin"]), 2)
    registered = cli.FOOTPRINTS["bench"](p.parse_args(["bench", "all_reduce", "-e", "64M", "-R", "2"]), 2)
    assert one.memory_bytes >= 4 * 128 * MIB and two.shm_bytes > one.shm_bytes and two.tasks > one.tasks
    assert registered.shm_bytes >= one.shm_bytes + 128 * MIB


def test_sixteen_ranks_pass_validation_on_this_host():
    """--np 16 is not refused here (2 CPUs: 8 per CPU); the job itself is not started
    (the suite runs at most 8 ranks)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("fewer than 2 CPUs allowed")
    cli.validate(cli.build_parser().parse_args(["check", "--np", "16"]))
    cli.validate(cli.build_parser().parse_args(["bench", "all_reduce", "--np", "16", "-b", "8", "-e", "1M"]))


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "--np", "99999"],
        ["bench", "all_reduce", "--np", "5000"],
        ["check", "--np", "99999", "--oversubscribe"],
        ["bench", "ep", "--np", "5000"],
        ["study", "--stress", "--np", "2", "--bound", "1x1"],
    ],
)
def test_a_job_the_host_cannot_hold_is_one_line_within_two_seconds(argv):
    tag = uuid.uuid4().hex
    before = launcher.shm_segments()

    def one_task_allowed():  # 2 ranks always fit this host's memory and CPUs: refuse them by RLIMIT_NPROC
        resource.setrlimit(resource.RLIMIT_NPROC, (1, resource.getrlimit(resource.RLIMIT_NPROC)[1]))

    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "commref", *argv],
        cwd=REPO,
        env=clean_env(COMMREF_TEST_JOB=tag),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=one_task_allowed if argv[0] == "study" else None,
    )
    seconds = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == "", proc.stderr
    command = " ".join(argv[:2]) if argv[:2] == ["bench", "ep"] else argv[0]
    assert proc.stderr.startswith(f"commref {command}: error: --np {argv[argv.index('--np') + 1]}: "), proc.stderr
    # Refused before any process starts: an interpreter's start and the check (about 1 s
    # here; docs/reliability.md has the figures), far from the minutes a started job takes.
    assert seconds < 10.0, f"{seconds:.2f} s"
    assert not job_reaper.job_processes(f"COMMREF_TEST_JOB={tag}")
    assert not orphan_segments(before, patience_s=0)


# ---------------------------------------------------------------------------------------
# signals end the whole job
# ---------------------------------------------------------------------------------------

NRANKS = 8
# About a minute of work on 8 ranks of this host: still running whenever the signal comes.
JOB = ["check", "allreduce", "--np", str(NRANKS), "--count", "3000001", "--dtype", "float32", "--op", "sum"]
START_S = 180  # for 8 ranks to start on 2 shared CPUs
GONE_S = 5.0  # the promise: from the signal to nothing of the job left


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _job(marker: str) -> dict[int, str]:
    """pid -> command line of every live process of the job."""
    return {pid: _cmdline(pid) for pid in job_reaper.job_processes(marker)}


def _ranks(procs: dict[int, str]) -> list[int]:
    """The ranks among `procs` (mpiexec's own command line names theirs too)."""
    return [
        pid
        for pid, cmd in procs.items()
        if "-m mpi4py -m commref.cli" in cmd and "python" in os.path.basename(cmd.split()[0])
    ]


def _wait_for(what: str, ready, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the job ended (status {proc.returncode}) before {what}\n{out[-2000:]}\n{err[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.1)


def _everything_gone(marker: str, job_segments: set[str], before: set[str], start: float) -> tuple[float, dict, set]:
    """Waits up to GONE_S from `start` for the job's processes and segments to be gone;
    returns (seconds it took, the processes left, the segments left)."""
    while True:
        left = _job(marker)
        segments = {p for p in job_segments if os.path.exists(p)} | orphan_segments(before, patience_s=0)
        now = time.monotonic()
        if (not left and not segments) or now - start > GONE_S:
            return now - start, left, segments
        time.sleep(0.05)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "how, when",
    [
        ("TERM", "running"),
        ("INT", "running"),
        ("HUP", "running"),
        ("KILL", "running"),
        ("TERM", "starting"),
        ("KILL", "starting"),
    ],
)
def test_a_signal_ends_the_whole_job(how, when):
    """`commref check --np 8`: the signal to the launcher (`running`: once every rank has
    announced itself and mapped MPICH's segment; `starting`: as soon as hydra's proxy
    runs, while it starts ranks that have not announced themselves). SIGKILL is the
    launcher killed: mpiexec dies with it, the reaper and the ranks' own watch end the
    rest."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    tag = uuid.uuid4().hex
    marker = f"COMMREF_TEST_JOB={tag}"
    before = launcher.shm_segments()
    proc = start_commref(JOB, clean_env(COMMREF_TEST_JOB=tag), new_session=True)
    try:
        if when == "running":

            def ready():
                ranks = _ranks(_job(marker))
                return len(ranks) == NRANKS and any("mpich_shm_" in p for p in job_reaper.mapped_files(ranks))
        else:

            def ready():
                return any("hydra_pmi_proxy" in cmd for cmd in _job(marker).values())

        _wait_for(f"{when} job of {NRANKS} ranks", ready, proc, START_S)
        procs = _job(marker)
        job_segments = (job_reaper.held_files(list(procs)) & launcher.shm_segments()) - before
        assert when == "starting" or job_segments, "the running job maps no segment"
        start = time.monotonic()
        os.kill(proc.pid, getattr(signal, f"SIG{how}"))
        seconds, left, segments = _everything_gone(marker, job_segments, before, start)
        assert not left, f"{len(left)} process(es) of the job {seconds:.1f} s after SIG{how}: {left}"
        assert not segments, f"left {seconds:.1f} s after SIG{how}: {sorted(segments)}"
        _, err = proc.communicate(timeout=30)  # its pipes' other ends are gone with the job
        print(
            f"SIG{how} ({when}, {len(procs)} processes, {len(job_segments)} segments): everything gone in "
            f"{seconds:.2f} s"
        )
        if how == "KILL":
            assert proc.returncode == -signal.SIGKILL
        else:
            assert proc.returncode == 128 + getattr(signal, f"SIG{how}"), err[-2000:]
            assert f"commref: SIG{how}: ending the job" in err, err[-2000:]
            assert "Traceback" not in err, err[-3000:]  # SIGINT reaches the ranks as SIGTERM: no KeyboardInterrupt
    finally:
        job_reaper.end_processes(marker)  # a failed test leaves nothing running either
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.mpi
def test_timeout_ends_the_whole_job():
    """`timeout -s TERM 10 commref check --np 8 ...` (as a batch system's time limit):
    5 s after `timeout` has given up, nothing of the job is left."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    tag = uuid.uuid4().hex
    marker = f"COMMREF_TEST_JOB={tag}"
    before = launcher.shm_segments()
    try:
        proc = subprocess.run(
            ["timeout", "-s", "TERM", "10", sys.executable, "-m", "commref", *JOB],
            cwd=REPO,
            env=clean_env(COMMREF_TEST_JOB=tag),
            capture_output=True,
            text=True,
            timeout=60,
        )
        start = time.monotonic()
        assert proc.returncode == 124 or proc.returncode == 143, proc.stderr[-2000:]  # 124: timeout's own
        seconds, left, segments = _everything_gone(marker, set(), before, start)
        assert not left, f"{len(left)} process(es) of the job {seconds:.1f} s after the timeout: {left}"
        assert not segments, f"left in /dev/shm: {sorted(segments)}"
        assert "commref: SIGTERM: ending the job" in proc.stderr, proc.stderr[-2000:]
    finally:
        job_reaper.end_processes(marker)


def test_a_rank_exits_when_its_launcher_is_gone(tmp_path):
    """The ranks' own watch (launcher.watch_launcher), alone: a rank whose launcher (here a
    stand-in process, `sleep`) ends exits within LAUNCHER_POLL_S plus a little, with one
    line; one whose launcher is gone before it announces itself exits at once."""
    stand_in = subprocess.Popen(["sleep", "60"])
    identity = f"{stand_in.pid} {launcher._process(stand_in.pid)[1]}"
    env = clean_env(COMMREF_JOB_DIR=str(tmp_path), COMMREF_LAUNCHER=identity, PMI_RANK="3")
    rank = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from commref.transports import launcher; launcher.announce_rank(); print('announced', flush=True); "
            "import time; time.sleep(60)",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert rank.stdout.readline() == "announced\n"  # the launcher ends only once the rank watches it
    stand_in.kill()
    stand_in.wait()
    gone_at = time.monotonic()
    _, err = rank.communicate(timeout=30)
    seconds = time.monotonic() - gone_at
    assert rank.returncode == -signal.SIGKILL, err
    assert err == f"commref: rank 3: its launcher (pid {stand_in.pid}) is gone; exiting\n"
    assert seconds < launcher.LAUNCHER_POLL_S + 1.0, f"{seconds:.2f} s"
    late = subprocess.run(
        [
            sys.executable,
            "-c",
            "from commref.transports import launcher; launcher.announce_rank(); print('still running')",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert late.returncode == 1 and late.stdout == ""
    assert late.stderr == f"commref: rank 3: its launcher (pid {stand_in.pid}) is gone; exiting\n"
