"""Starting a command's ranks under mpiexec, and cleaning up after a job that failed.

`relaunch(n, argv)` runs ``mpiexec -n N python -m mpi4py -m commref.cli ARGV`` (one
process per rank; ``python -m mpi4py`` turns an uncaught exception on one rank into
MPI_Abort, so a failing rank ends the job) and returns the job's exit status.

When the job fails (non-zero status, or the launcher is interrupted), the shared-memory
segments the job created and left behind are removed before that status is returned:
commref's window files (transports/windows.py, SHM_PREFIX), MPICH's
``/dev/shm/mpich_shm_*`` and its UCX netmod's ``/dev/shm/ucx_shm_posix_*``, and the
topology file a killed hydra proxy leaves (``/tmp/hydra_hwloc_xmlfile_*``). A file
counts as the job's when a process of the job held it, or when it appeared while the
job ran and no live process maps it or holds it open (checked twice, a moment apart, so
that a segment another job is just creating is left alone); `remove_orphans` is that
rule, and the test suite's shm_leak_check fixture uses it too.

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

The job's processes: mpiexec runs in a session of its own (start_new_session), and its
environment carries JOB_DIR_ENV, which every process of the job inherits: mpiexec, its
proxies (hydra puts them, and the ranks, in sessions of their own), the ranks, announced
or not yet, and what they start. transports/job_reaper.py finds them by that marker and
ends them (stop, then kill, until none is left).

Signals: SIGINT, SIGTERM and SIGHUP to the launcher are passed to mpiexec (its process
group; SIGINT as SIGTERM, PASSED_ON), which passes them to its ranks; whatever of the job still runs `signal_grace_s`
later is killed; then the job's segments are removed and the launcher returns 128 + the
signal's number. When the launcher itself is killed (SIGKILL), three things end the job
without it: mpiexec gets SIGKILL (PR_SET_PDEATHSIG), and hydra's proxies kill their
ranks when mpiexec's connection closes; the reaper (job_reaper.py, started before the job
and holding the read end of a pipe whose write end only the launcher holds) kills
whatever of the job is left and removes its segments and directory; and every rank
polls that its launcher (LAUNCHER_ENV: pid and start time, so a reused pid does not
count) is alive, and exits within LAUNCHER_POLL_S when it is not.

Bounded waits: the job itself is bounded by its ranks' own deadlines (every wait of a
rank has one, COMMREF_TIMEOUT) and, when given, by `timeout`; stopping it past its
timeout waits `grace_s` for mpiexec to end its ranks, a signal `signal_grace_s`; the
cleanup waits at most `settle_s` for exiting ranks to unmap their segments.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import job_reaper
from .job_reaper import end_processes, mapped_files, remove_job_segments
from .windows import SHM_PREFIX

SHM_DIR = job_reaper.SHM_DIR
assert SHM_DIR == os.path.dirname(SHM_PREFIX)
COMMREF_SEGMENTS = os.path.basename(SHM_PREFIX) + "*"
MPICH_SEGMENTS = "mpich_shm_*"
UCX_SEGMENTS = "ucx_shm_posix_*"  # MPICH's UCX netmod's
LIBRARY_LEFTOVERS = (MPICH_SEGMENTS, UCX_SEGMENTS, job_reaper.HYDRA_TOPOLOGY)  # the MPI library's, not commref's
# What a job may leave that is its own: the segments, and hydra's topology files in /tmp.
SEGMENTS = (COMMREF_SEGMENTS, *LIBRARY_LEFTOVERS)
UNDER_MPIEXEC_ENV = "COMMREF_UNDER_MPIEXEC"  # set in the ranks of a relaunched job
JOB_DIR_ENV = "COMMREF_JOB_DIR"  # set in the ranks of a relaunched job: where they announce themselves
LAUNCHER_ENV = "COMMREF_LAUNCHER"  # set in the ranks of a relaunched job: "PID START" of their launcher
LAUNCHER_POLL_S = 0.5  # how often a rank checks that its launcher is alive
JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each ends the whole job
# The signal mpiexec gets for each: Ctrl-C becomes SIGTERM, which ends a rank at once
# wherever it is, where SIGINT's KeyboardInterrupt printed a traceback from every rank
# (hydra passes SIGINT on).
PASSED_ON = {signal.SIGINT: signal.SIGTERM, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGHUP}
PR_SET_PDEATHSIG = 1  # prctl(2)
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
    return job_reaper.shm_segments(patterns)


def remove_orphans(
    before: set[str], patterns: tuple[str, ...] = SEGMENTS, settle_s: float = 3.0, poll_s: float = 0.2
) -> list[str]:
    """job_reaper.remove_orphans over commref's and MPICH's segments by default: removes
    the segments not in `before` that no live process maps in two scans `poll_s` apart,
    waiting up to `settle_s` for those still mapped."""
    return job_reaper.remove_orphans(before, patterns, settle_s, poll_s)


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
    (RankWatch.end): it raises SystemExit(1) with one line, before any MPI call. With
    LAUNCHER_ENV set, a daemon thread checks every LAUNCHER_POLL_S that the launcher is
    alive (watch_launcher); a rank whose launcher is already gone exits the same way."""
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
    launcher = env.get(LAUNCHER_ENV)
    if launcher:
        pid, start = (int(v) for v in launcher.split())
        if not _is(pid, start):
            raise SystemExit(f"commref: rank {rank}: its launcher (pid {pid}) is gone; exiting")
        threading.Thread(
            target=watch_launcher, args=(pid, start, rank), name="commref-launcher-watch", daemon=True
        ).start()


def _is(pid: int, start: int) -> bool:
    """Whether process `pid` runs and is the one that started at `start` (clock ticks)."""
    proc = _process(pid)
    return proc is not None and proc[1] == start and proc[0] not in ("Z", "X")


def watch_launcher(pid: int, start: int, rank: str, poll_s: float = LAUNCHER_POLL_S) -> None:
    """Rank side (a daemon thread): returns only by ending this process, once its launcher
    (`pid` that started at `start`) is gone. It prints one line, unlinks the job's
    segments this rank maps (commref's and MPICH's: a rank maps only its own job's), and
    kills its process group when it leads one (hydra makes each rank a session leader:
    the group is the rank and what it started, compilers included), else itself."""
    while _is(pid, start):
        time.sleep(poll_s)
    print(f"commref: rank {rank}: its launcher (pid {pid}) is gone; exiting", file=sys.stderr, flush=True)
    remove_job_segments(mapped_files([os.getpid()]), set(), SEGMENTS)
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


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


def _wait_job(
    proc: subprocess.Popen,
    watch: RankWatch,
    marker: str,
    timeout: float | None,
    death_grace_s: float,
    grace_s: float,
    poll_s: float,
) -> int:
    """Waits for mpiexec like proc.wait(timeout) (TimeoutExpired past `timeout`), and ends
    the job itself when a rank died (RankWatch.dead) and the job still runs
    `death_grace_s` later: the remaining ranks are killed, mpiexec is given `grace_s` to
    notice, then stopped (_end). Returns mpiexec's raw return code (negative: a signal), or 1
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
            print(
                f"commref: rank {first[0]} (pid {first[1]}) died without exiting (killed by a signal?) and the "
                f"job still ran {death_grace_s:g} s later; ending it",
                file=sys.stderr,
                flush=True,
            )
            watch.kill_all()
            try:
                rc = proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _end(proc, marker, signal.SIGTERM, grace_s)
                rc = proc.returncode if proc.returncode is not None else -signal.SIGKILL
            return rc or 1


class _Signalled(Exception):
    """One of JOB_SIGNALS reached the launcher while its job ran."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _end(proc: subprocess.Popen, marker: str, how: int, grace_s: float) -> list[int]:
    """Ends the job: signal `how` to mpiexec's process group (mpiexec passes it to its
    ranks), `grace_s` for the job to end, then every process of the job still there
    (`marker`, job_reaper.end_processes) killed. Returns the pids killed."""
    try:
        os.killpg(proc.pid, how)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    killed, _ = end_processes(marker)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:  # not ours to reap any more: end_processes killed it
        pass
    return killed


def _die_with(parent: int):
    """A preexec_fn: the child gets SIGKILL when the thread that started it (the
    launcher's) ends, and kills itself at once when `parent` is already gone."""
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def start_reaper(marker: str, job_dir: str, before: set[str]) -> subprocess.Popen:
    """The job's reaper (job_reaper.py): ends the job and removes what it left when this
    process dies before it has said `done` (stop_reaper)."""
    reaper = subprocess.Popen(
        [sys.executable, "-I", "-S", job_reaper.__file__],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    config = {
        "marker": marker,
        "job_dir": job_dir,
        "before": sorted(before),
        "patterns": list(SEGMENTS),
        "launcher": os.getpid(),
    }
    reaper.stdin.write(json.dumps(config).encode() + b"\n")
    reaper.stdin.flush()
    return reaper


def stop_reaper(reaper: subprocess.Popen) -> None:
    """The launcher has cleaned up: the reaper exits without touching anything."""
    try:
        reaper.stdin.write(b"done")
        reaper.stdin.close()
    except OSError:  # it died: nothing to tell it
        pass
    try:
        reaper.wait(timeout=5)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def run_job(
    cmd: list[str],
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    grace_s: float = 5.0,
    settle_s: float = 3.0,
    death_grace_s: float = 1.0,
    poll_s: float = 0.1,
    signal_grace_s: float = 1.0,
    stderr=None,
) -> int:
    """Runs the job `cmd` (an mpiexec command line) and returns its exit status (128 + N
    when it ended by signal N, 124 after `timeout`, 130, 143 or 129 when SIGINT, SIGTERM
    or SIGHUP reached the launcher; when a rank died and the launcher ended the job,
    mpiexec's status or 1). mpiexec runs in a session of its own and dies with this
    process (PR_SET_PDEATHSIG); the ranks find the job's directory in JOB_DIR_ENV
    (announce_rank) and the launcher in LAUNCHER_ENV; a rank that died ends the job
    (_wait_job). A signal in JOB_SIGNALS ends the whole job (_end; handlers are installed
    when this runs in the main thread, else Ctrl-C's KeyboardInterrupt does the same).
    Afterwards every process of the job still alive is killed, and when the status is
    not 0 the segments the job left are removed. A reaper process does the same if this
    process is killed (start_reaper). `stderr`: where the job's stderr goes (a file;
    None: this process's)."""
    before = shm_segments()
    watch = RankWatch()
    marker = f"{JOB_DIR_ENV}={watch.dir}"
    env = dict(
        os.environ if env is None else env,
        **{JOB_DIR_ENV: watch.dir, LAUNCHER_ENV: f"{os.getpid()} {_process(os.getpid())[1]}"},
    )
    reaper = start_reaper(marker, watch.dir, before)
    try:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=_die_with(os.getpid()),  # noqa: PLW1509 - the child runs two syscalls
        )
    except BaseException:
        watch.end()
        stop_reaper(reaper)
        raise
    old_handlers = {}
    ending = []  # a signal arrived: later ones while the job is ended are ignored

    def on_signal(signum, frame):
        if not ending:
            ending.append(signum)
            raise _Signalled(signum)

    if threading.current_thread() is threading.main_thread():  # a signal ignored here (nohup) stays ignored
        old_handlers = {
            sig: signal.signal(sig, on_signal) for sig in JOB_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN
        }
    killed: list[int] = []
    rc = 1  # an exception of the launcher's own
    try:
        try:
            rc = _wait_job(proc, watch, marker, timeout, death_grace_s, grace_s, poll_s)
            rc = 128 - rc if rc < 0 else rc
        except subprocess.TimeoutExpired:
            ending.append(signal.SIGTERM)
            print(f"commref: the job did not end within {timeout:g} s; stopping it", file=sys.stderr)
            killed = _end(proc, marker, signal.SIGTERM, grace_s)
            rc = 124
        except _Signalled as e:
            print(f"commref: {e.args[0]}: ending the job", file=sys.stderr, flush=True)
            killed = _end(proc, marker, PASSED_ON[e.signum], signal_grace_s)
            rc = 128 + e.signum
        except KeyboardInterrupt:  # SIGINT where no handler could be installed (not the main thread)
            ending.append(signal.SIGINT)
            killed = _end(proc, marker, PASSED_ON[signal.SIGINT], signal_grace_s)
            rc = 130
    finally:
        ending.append(0)
        try:
            outlived, ranks_gone = watch.end()  # ranks whose process manager died: none may outlive the job
            if outlived:
                print(f"commref: killed {len(outlived)} rank process(es) that outlived the job", file=sys.stderr)
            rest, segments = end_processes(marker)  # its proxies, ranks that had not announced themselves
            if rest:
                print(
                    f"commref: killed {len(rest)} more process(es) of the job (its process manager's, or "
                    f"ranks that had not announced themselves)",
                    file=sys.stderr,
                )
            # Every process of the job is gone: a segment still mapped is another job's, not worth waiting for.
            if rc != 0 or rest or killed:
                remove_job_segments(segments, before, SEGMENTS)
                remove_orphans(before, settle_s=0.0 if ranks_gone or killed or rest else settle_s)
        finally:
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            stop_reaper(reaper)
    return rc


def relaunch(
    nranks: int,
    argv: list[str],
    module: str = "commref.cli",
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> int:
    """Runs ``python -m mpi4py -m MODULE ARGV`` as `nranks` MPI processes and returns
    the job's exit status, after removing what a failed job left in /dev/shm (run_job).
    `env`: variables added to this process's environment for the ranks."""
    cmd = [find_mpiexec(), "-n", str(nranks), sys.executable, "-m", "mpi4py", "-m", module, *argv]
    return run_job(cmd, env=dict(os.environ, **{UNDER_MPIEXEC_ENV: "1"}, **(env or {})), timeout=timeout)
