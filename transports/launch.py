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

Bounded waits: the job itself is bounded by its ranks' own deadlines (every wait of a
rank has one, COMMREF_TIMEOUT) and, when given, by `timeout`; stopping it (timeout,
Ctrl-C, SIGTERM) waits `grace_s` for mpiexec to end its ranks, then kills it; the
cleanup waits at most `settle_s` for exiting ranks to unmap their segments.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from .windows import SHM_PREFIX

SHM_DIR = os.path.dirname(SHM_PREFIX)
COMMREF_SEGMENTS = os.path.basename(SHM_PREFIX) + "*"
MPICH_SEGMENTS = "mpich_shm_*"
SEGMENTS = (COMMREF_SEGMENTS, MPICH_SEGMENTS)
UNDER_MPIEXEC_ENV = "COMMREF_UNDER_MPIEXEC"  # set in the ranks of a relaunched job


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
            grace_s: float = 5.0, settle_s: float = 3.0) -> int:
    """Runs the job `cmd` (an mpiexec command line) and returns its exit status (128 + N
    when it ended by signal N, 124 after `timeout`, 130 on Ctrl-C, 143 on SIGTERM). When
    that status is not 0, removes the segments the job left (remove_orphans) first."""
    before = shm_segments()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
    old_term = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise _Terminated

        old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        try:
            rc = proc.wait(timeout=timeout)
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
    if rc != 0:
        remove_orphans(before, settle_s=settle_s)
    return rc


def relaunch(nranks: int, argv: list[str], module: str = "commref.cli", env: dict[str, str] | None = None,
             timeout: float | None = None) -> int:
    """Runs ``python -m mpi4py -m MODULE ARGV`` as `nranks` MPI processes and returns
    the job's exit status, after removing what a failed job left in /dev/shm (run_job).
    `env`: variables added to this process's environment for the ranks."""
    cmd = [find_mpiexec(), "-n", str(nranks), sys.executable, "-m", "mpi4py", "-m", module, *argv]
    return run_job(cmd, env=dict(os.environ, **{UNDER_MPIEXEC_ENV: "1"}, **(env or {})), timeout=timeout)
