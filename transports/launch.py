"""Starting a command's ranks under mpiexec, and cleaning up after a job that failed.

`relaunch(n, argv)` runs ``mpiexec -n N python -m mpi4py -m commref.cli ARGV`` (one
process per rank; ``python -m mpi4py`` turns an uncaught exception on one rank into
MPI_Abort, so a failing rank ends the job) and returns the job's exit status.

When the job fails (non-zero status, or the launcher is interrupted), the shared-memory
segments the job created and left behind are removed before that status is returned:
commref's window files (transports/windows.py, SHM_PREFIX) and MPICH's
``/dev/shm/mpich_shm_*``. A segment counts as the job's when it appeared while the
job ran and no live process maps it (checked twice, a moment apart, so that a segment
another job is just creating is left alone); `remove_orphans` is that rule, and the
test suite's shm_leak_check fixture uses it too.

Rank death: every rank of a relaunched job announces itself in the job's directory
(`announce_rank`, called by the command line on each rank: its pid, MPI rank and start
time) and records that it exited when its interpreter exits (atexit; an uncaught
exception's MPI_Abort included). A rank whose process is gone without that record was
killed (SIGKILL, the OOM killer, a crash). The MPI launcher normally ends the rest of
the job within a fraction of a second (MPICH's hydra does); when the job still runs
`death_grace_s` after such a death, `run_job` ends it: it kills the remaining ranks
(SIGKILL) and stops mpiexec. Whatever way the job ended, a rank process that outlives
it (its process manager died) is killed, so that no rank keeps running, or keeps a
segment mapped, after the launcher returns.

Bounded waits: the job itself is bounded by its ranks' own deadlines (every wait of a
rank has one, COMMREF_TIMEOUT) and, when given, by `timeout`; stopping it (timeout,
Ctrl-C, SIGTERM) waits `grace_s` for mpiexec to end its ranks, then kills it; the
cleanup waits at most `settle_s` for exiting ranks to unmap their segments.
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .windows import SHM_PREFIX

SHM_DIR = os.path.dirname(SHM_PREFIX)
COMMREF_SEGMENTS = os.path.basename(SHM_PREFIX) + "*"
MPICH_SEGMENTS = "mpich_shm_*"
SEGMENTS = (COMMREF_SEGMENTS, MPICH_SEGMENTS)
UNDER_MPIEXEC_ENV = "COMMREF_UNDER_MPIEXEC"  # set in the ranks of a relaunched job
JOB_DIR_ENV = "COMMREF_JOB_DIR"  # set in the ranks of a relaunched job: where they announce themselves
_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")  # a rank's MPI rank, before MPI is initialized


class LaunchError(RuntimeError):
    """The ranks cannot be started (no mpiexec); a one-line message."""


def find_mpiexec() -> str:
    """mpiexec (or mpirun) next to this Python first (the venv's MPICH), then on PATH."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    for name in ("mpiexec", "mpirun"):
        exe = shutil.which(name, path=path)
        if exe:
            return exe
    raise LaunchError("--np needs mpiexec (pip install 'commref[mpich]' or use your MPI's launcher)")


def strip_np(argv: list[str]) -> list[str]:
    """`argv` without `--np N` / `--np=N` (the relaunched ranks must not relaunch)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--np":
            skip = True
            continue
        if a.startswith("--np="):
            continue
        out.append(a)
    return out


def shm_segments(patterns: tuple[str, ...] = SEGMENTS) -> set[str]:
    """The files in /dev/shm whose names match any of `patterns`."""
    return {p for pattern in patterns for p in glob.glob(os.path.join(SHM_DIR, pattern))}


def mapped_files() -> set[str]:
    """The /dev/shm files some live process maps (every /proc/PID/maps this user can read)."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                for line in f:
                    if SHM_DIR + "/" in line:
                        path = line.split(None, 5)[5].strip()
                        mapped.add(path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path)
        except (OSError, IndexError):
            pass
    return mapped


def remove_orphans(before: set[str], patterns: tuple[str, ...] = SEGMENTS, settle_s: float = 3.0,
                   poll_s: float = 0.2) -> list[str]:
    """Removes the segments matching `patterns` that are not in `before` (a shm_segments()
    snapshot taken when the job started) and that no live process maps in two scans
    `poll_s` apart. Segments still mapped are waited for (their processes may be
    exiting) up to `settle_s`, then left alone. Returns the paths removed."""
    removed: list[str] = []
    candidates = shm_segments(patterns) - before
    unmapped_before: set[str] = set()
    deadline = time.monotonic() + settle_s
    scans = 0
    while candidates:
        scans += 1
        unmapped = candidates - mapped_files()
        for path in sorted(unmapped & unmapped_before):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
            except OSError:  # not ours to remove (another user's): leave it
                candidates.discard(path)
        candidates &= shm_segments(patterns)
        unmapped_before = unmapped
        if not candidates or (scans >= 2 and time.monotonic() >= deadline):
            break
        time.sleep(poll_s)
    return removed


# ---------------------------------------------------------------------------------------
# rank death
# ---------------------------------------------------------------------------------------


def _process(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a live process, from
    /proc/PID/stat; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces: fields 3.. follow its ')'
    return fields[0], int(fields[19])


def announce_rank(environ=None) -> None:
    """Rank side, first thing on each rank of a relaunched job (JOB_DIR_ENV set; else
    nothing): writes JOB_DIR/PID.rank (MPI rank, process start time) and registers an
    atexit handler that writes JOB_DIR/PID.exit. atexit handlers run last registered
    first, so the record is written before mpi4py's exit handling (MPI_Finalize, or
    MPI_Abort after an uncaught exception). A process that is gone without that record
    did not reach the interpreter's exit: it was killed.

    A rank that finds the directory gone started after its launcher ended the job
    (RankWatch.end): it raises SystemExit(1) with one line, before any MPI call."""
    env = os.environ if environ is None else environ
    job_dir = env.get(JOB_DIR_ENV)
    me = _process(os.getpid())
    if not job_dir or me is None:
        return
    rank = next((env[k] for k in _RANK_ENV if env.get(k)), "?")
    base = os.path.join(job_dir, str(os.getpid()))
    try:
        with open(base + ".tmp", "w") as f:
            f.write(f"{rank} {me[1]}\n")
        os.replace(base + ".tmp", base + ".rank")  # whole or absent for the watcher
    except FileNotFoundError:
        raise SystemExit(f"commref: rank {rank}: its job has ended (no {job_dir}); exiting") from None

    def exited() -> None:
        try:
            open(base + ".exit", "w").close()
        except OSError:  # the launcher removed the directory: it is gone already
            pass

    atexit.register(exited)


class RankWatch:
    """The ranks of one job, as they announced themselves (announce_rank) in the job's
    directory, a fresh temporary one (not in /dev/shm) removed by close()."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="commref-job-")

    def ranks(self) -> dict[int, tuple[str, int]]:
        """pid -> (MPI rank, start time) of every rank that announced itself."""
        out = {}
        for path in glob.glob(os.path.join(self.dir, "*.rank")):
            try:
                with open(path) as f:
                    rank, start = f.read().split()
                out[int(os.path.basename(path)[: -len(".rank")])] = (rank, int(start))
            except (OSError, ValueError):
                pass
        return out

    @staticmethod
    def _alive(pid: int, start: int) -> bool:
        proc = _process(pid)  # a zombie (Z) or dying (X) process runs no code and maps nothing
        return proc is not None and proc[1] == start and proc[0] not in ("Z", "X")

    def dead(self) -> list[tuple[str, int]]:
        """(MPI rank, pid) of the ranks whose process is gone without an exit record."""
        gone = [(rank, pid) for pid, (rank, start) in self.ranks().items() if not self._alive(pid, start)]
        return [(rank, pid) for rank, pid in gone if not os.path.exists(os.path.join(self.dir, f"{pid}.exit"))]

    def kill_all(self, wait_s: float = 3.0) -> list[int]:
        """SIGKILLs every announced rank still alive; waits up to `wait_s` for them to be
        gone (they are not this process's children: their parent or init reaps them).
        Returns the pids it killed."""
        killed = []
        for pid, (_, start) in self.ranks().items():
            if self._alive(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + wait_s
        ranks = self.ranks()
        while any(self._alive(pid, ranks[pid][1]) for pid in killed) and time.monotonic() < deadline:
            time.sleep(0.02)
        return killed

    def end(self) -> tuple[list[int], bool]:
        """The job is over: renames the directory away (a rank that announces itself
        later finds it gone and exits; one that announced before is in it), kills every
        announced rank still alive (kill_all), and removes the directory. Returns (the
        pids killed, whether ranks had announced themselves and none runs any more)."""
        closed = self.dir + ".closed"
        try:
            os.rename(self.dir, closed)
            self.dir = closed
        except OSError:
            pass
        try:
            killed = self.kill_all()
            ranks = self.ranks()
            return killed, bool(ranks) and not any(self._alive(pid, start) for pid, (_, start) in ranks.items())
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _wait_job(proc: subprocess.Popen, watch: RankWatch, timeout: float | None, death_grace_s: float,
              grace_s: float, poll_s: float) -> int:
    """Waits for mpiexec like proc.wait(timeout) (TimeoutExpired past `timeout`), and ends
    the job itself when a rank died (RankWatch.dead) and the job still runs
    `death_grace_s` later: the remaining ranks are killed, mpiexec is given `grace_s` to
    notice, then stopped. Returns mpiexec's raw return code (negative: a signal), or 1
    where it reported success although a rank died."""
    deadline = None if timeout is None else time.monotonic() + timeout
    died_at, first = None, None
    while True:
        wait = poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic()))
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() >= deadline:
                raise
        if died_at is None:
            dead = watch.dead()
            if dead:
                died_at, first = time.monotonic(), dead[0]
        elif time.monotonic() - died_at >= death_grace_s:
            print(f"commref: rank {first[0]} (pid {first[1]}) died without exiting (killed by a signal?) and the "
                  f"job still ran {death_grace_s:g} s later; ending it", file=sys.stderr, flush=True)
            watch.kill_all()
            try:
                rc = proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _stop(proc, signal.SIGTERM, grace_s)
                rc = proc.returncode if proc.returncode is not None else -signal.SIGKILL
            return rc or 1


class _Terminated(Exception):
    """SIGTERM reached the launcher while its job ran."""


def _stop(proc: subprocess.Popen, how: int, grace_s: float) -> None:
    """Asks mpiexec to end its ranks (signal `how`); kills it after `grace_s`."""
    for sig in (how, signal.SIGKILL):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_job(cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None,
            grace_s: float = 5.0, settle_s: float = 3.0, death_grace_s: float = 1.0, poll_s: float = 0.1) -> int:
    """Runs the job `cmd` (an mpiexec command line) and returns its exit status (128 + N
    when it ended by signal N, 124 after `timeout`, 130 on Ctrl-C, 143 on SIGTERM; when
    a rank died and the launcher ended the job, mpiexec's status or 1). The ranks find
    the job's directory in JOB_DIR_ENV (announce_rank); a rank that died ends the job
    (_wait_job). Afterwards any rank still alive is killed, and when the status is not
    0 the segments the job left are removed (remove_orphans)."""
    before = shm_segments()
    watch = RankWatch()
    env = dict(os.environ if env is None else env, **{JOB_DIR_ENV: watch.dir})
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
    except BaseException:
        watch.end()
        raise
    old_term = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise _Terminated

        old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        try:
            rc = _wait_job(proc, watch, timeout, death_grace_s, grace_s, poll_s)
            rc = 128 - rc if rc < 0 else rc
        except subprocess.TimeoutExpired:
            print(f"commref: the job did not end within {timeout:g} s; stopping it", file=sys.stderr)
            _stop(proc, signal.SIGTERM, grace_s)
            rc = 124
        except KeyboardInterrupt:  # the terminal sent SIGINT to mpiexec as well
            _stop(proc, signal.SIGINT, grace_s)
            rc = 130
        except _Terminated:
            _stop(proc, signal.SIGTERM, grace_s)
            rc = 143
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        outlived, ranks_gone = watch.end()  # ranks whose process manager died: none may outlive the job
        if outlived:
            print(f"commref: killed {len(outlived)} rank process(es) that outlived the job", file=sys.stderr)
    # Every rank of the job is gone: a segment still mapped is another job's, not worth waiting for.
    if rc != 0:
        remove_orphans(before, settle_s=0.0 if ranks_gone else settle_s)
    return rc


def relaunch(nranks: int, argv: list[str], module: str = "commref.cli", env: dict[str, str] | None = None,
             timeout: float | None = None) -> int:
    """Runs ``python -m mpi4py -m MODULE ARGV`` as `nranks` MPI processes and returns
    the job's exit status, after removing what a failed job left in /dev/shm (run_job).
    `env`: variables added to this process's environment for the ranks."""
    cmd = [find_mpiexec(), "-n", str(nranks), sys.executable, "-m", "mpi4py", "-m", module, *argv]
    return run_job(cmd, env=dict(os.environ, **{UNDER_MPIEXEC_ENV: "1"}, **(env or {})), timeout=timeout)
