"""Shared fixtures and helpers for the commref test suite.

- ``mpiexec()``: the MPI launcher next to this Python (the venv's MPICH), else on PATH.
- ``run_mpi(n, args, timeout)``: ``mpiexec -n N python -m mpi4py <script | -m module> ...``
  with captured output and a bounded timeout (``python -m mpi4py`` turns an uncaught
  exception on one rank into MPI_Abort, so a failing rank ends the job).
- ``shm_leak_check``: fixture asserting that no ``/dev/shm/commref-*`` file is left behind
  (and removing what MPICH leaves there when a test aborts a job on purpose).
- ``clean_env()``: the environment without MPI launcher variables (so a child process does
  not think it already runs under mpiexec), with ``COMMREF_TIMEOUT`` set.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from commref.transports import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")

# Deadline of every wait in child jobs: small, so that a bug ends a job in seconds.
CHILD_TIMEOUT_S = "20"

_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                  "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_RANK", "COMMREF_UNDER_MPIEXEC")


def mpiexec() -> str | None:
    """mpiexec (or mpirun) next to sys.executable first, then on PATH; None if absent."""
    for path in (os.path.dirname(sys.executable), None):
        for name in ("mpiexec", "mpirun"):
            exe = shutil.which(name, path=path)
            if exe:
                return exe
    return None


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith(("HYDRA_", "PMI_", "PMIX_"))}
    env.setdefault("COMMREF_TIMEOUT", CHILD_TIMEOUT_S)
    # The children import the repository's packages from its root.
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def run_mpi(n: int, args: list[str], timeout: float = 60, env: dict[str, str] | None = None,
            module: bool = False) -> subprocess.CompletedProcess:
    """Runs ``mpiexec -n n python -m mpi4py ARGS`` from the repository root.

    ARGS is ``[script, *script_args]``, or with ``module=True`` ``[module, *args]``
    (launched as ``-m module``). Output is captured as text. A job still running after
    ``timeout`` seconds is killed and the test fails with what it printed so far.
    """
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    cmd = [exe, "-n", str(n), sys.executable, "-m", "mpi4py"]
    cmd += ["-m", *args] if module else list(args)
    return run_cmd(cmd, timeout=timeout, env=env)


def run_cmd(cmd: list[str], timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs `cmd` in its own process group; on timeout kills that group (mpiexec and
    the ranks it started) and fails the test with the output so far."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env() if env is None else env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not end within {timeout} s\nstdout:\n{out[-3000:]}\n"
                    f"stderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def shm_files(pattern: str = launch.COMMREF_SEGMENTS) -> set[str]:
    return launch.shm_segments((pattern,))


@pytest.fixture
def shm_leak_check():
    """Fails the test if it leaves /dev/shm/commref-* files behind. Files that appear
    and vanish within a moment (another job running concurrently) are not leaks.

    MPICH leaves its own segments (/dev/shm/mpich_shm_*) behind when a job is aborted,
    as the deadline, abort and setup-failure tests do on purpose: about 3 MB each, which
    would pile up run after run. Those that appeared during the test and that no live
    process maps are removed (transports/launch.py's remove_orphans, the rule the --np
    launcher applies after a failed job)."""
    before = launch.shm_segments()
    yield
    launch.remove_orphans(before, patterns=(launch.MPICH_SEGMENTS,))
    new = shm_files() - before
    if new:
        time.sleep(1.0)
        new &= shm_files()
    assert not new, f"left behind in /dev/shm: {sorted(new)}"
