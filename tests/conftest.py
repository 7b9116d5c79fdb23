"""Shared fixtures and helpers for the commref test suite.

- ``mpiexec()``: the MPI launcher next to this Python (the venv's MPICH), else on PATH.
- ``run_mpi(n, args, timeout)``: ``mpiexec -n N python -m mpi4py <script | -m module> ...``
  with captured output and a bounded timeout (``python -m mpi4py`` turns an uncaught
  exception on one rank into MPI_Abort, so a failing rank ends the job).
- ``shm_leak_check``: fixture asserting that no ``/dev/shm/commref-*`` file is left behind
  (and removing what MPICH leaves there when a test aborts a job on purpose).
- ``start_commref(args, env)``: ``python -m commref ARGS`` with piped output and SIGINT at
  its default, for the tests that signal a job.
- ``clean_env()``: the environment without MPI launcher variables (so a child process does
  not think it already runs under mpiexec), with ``COMMREF_TIMEOUT`` set.
- ``native``: fixture forcing the native GIN engine (COMMREF_GIN_ENGINE=native).
- ``fake``: fixture putting the stand-in for CuPy (stand_ins.FakeCuda) in place of cupy.
- ``libraries_built``: session fixture (every test) building the CPU kernels, the native
  GIN engine and the host atomics first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from stand_ins import FakeCuda, FakeKernels

from commref.collectives import launch_record
from commref.device_kernels import gpu_loader
from commref.transports import launcher
from commref.transports.mpi_world import _MPI_LAUNCHER_VARS

# The tuner's choices in tests are the reference calibration's (collectives/calibration.py),
# the same on every host, so a test that needs a size "auto" runs a given way finds it
# there (tests/test_model.py probes and plants calibrations of its own).
os.environ.setdefault("COMMREF_MODEL", "reference")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")

# Deadline of every wait in child jobs: small, so that a bug ends a job in seconds.
CHILD_TIMEOUT_S = "20"

# What an MPI launcher sets (as MPIWorld recognises it), and the --np launcher's mark.
_LAUNCHER_VARS = (*_MPI_LAUNCHER_VARS, "COMMREF_UNDER_MPIEXEC")


def mpiexec() -> str | None:
    """mpiexec (or mpirun) next to sys.executable first, then on PATH; None if absent."""
    for path in (os.path.dirname(sys.executable), None):
        for name in ("mpiexec", "mpirun"):
            exe = shutil.which(name, path=path)
            if exe:
                return exe
    return None


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith(("HYDRA_", "PMI_", "PMIX_"))
    }
    env.setdefault("COMMREF_TIMEOUT", CHILD_TIMEOUT_S)
    # The children import the repository's packages from its root.
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _default_sigint() -> None:
    """A Popen preexec_fn: the child starts with SIGINT and SIGQUIT at their defaults, as a
    job started from a terminal does. A shell's background job (nohup, `&` without job
    control) inherits both ignored, and commref keeps what it inherits ignored, so a test
    that sends SIGINT must not depend on how the suite itself was started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def start_commref(args: list[str], env: dict[str, str], new_session: bool = False) -> subprocess.Popen:
    """`python -m commref ARGS` from the repository root, stdout and stderr piped as text,
    started with SIGINT at its default (_default_sigint) for a test that signals it;
    `new_session`: in a session of its own, as a terminal's job."""
    return subprocess.Popen(
        [sys.executable, "-m", "commref", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
        preexec_fn=_default_sigint,
    )


def run_mpi(
    n: int, args: list[str], timeout: float = 60, env: dict[str, str] | None = None, module: bool = False
) -> subprocess.CompletedProcess:
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
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=clean_env() if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not end within {timeout} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def shm_files(pattern: str = launcher.COMMREF_SEGMENTS) -> set[str]:
    return launcher.shm_segments((pattern,))


@pytest.fixture
def shm_leak_check():
    """Fails the test if it leaves /dev/shm/commref-* files behind. Files that appear
    and vanish within a moment (another job running concurrently) are not leaks.

    MPICH leaves its own segments (/dev/shm/mpich_shm_*, its UCX netmod's
    ucx_shm_posix_*) and a killed hydra proxy its topology file
    (/tmp/hydra_hwloc_xmlfile_*) behind when a job is aborted, as the deadline, abort and
    setup-failure tests do on purpose: about 3 MB each, which would pile up run after
    run. Those that appeared during the test and that no live process maps or holds open
    are removed (transports/launcher.py's remove_orphans, the rule the --np launcher
    applies after a failed job)."""
    before = launcher.shm_segments()
    yield
    launcher.remove_orphans(before, patterns=launcher.LIBRARY_LEFTOVERS)
    new = shm_files() - before
    if new:
        time.sleep(1.0)
        new &= shm_files()
    assert not new, f"left behind in /dev/shm: {sorted(new)}"


@pytest.fixture
def many_channels(monkeypatch):
    """Lets the CPU tuner split even small calls across channels: a calibration whose
    channels start for nothing on a host of many cores (the model then takes them all)."""
    from commref.collectives import calibration

    monkeypatch.setattr(calibration, "REFERENCE", calibration.REFERENCE.replace(channel_s=0.0, cores=1024))


@pytest.fixture
def native(monkeypatch):
    """Every communicator of the test must run the native engine (else it fails to start)."""
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "native")


@pytest.fixture(scope="session", autouse=True)
def libraries_built():
    """The CPU kernel library, the native GIN engine and the host atomics built (or found
    in the cache) once before any test, so that no test's deadline includes a first
    build (a minute and more on a loaded 2-core host)."""
    from commref.device_kernels import cpu_loader
    from commref.transports.gin import native
    from commref.transports.gin.atomics import host_atomics

    cpu_loader.cpu_kernels()
    native.native_library()
    host_atomics()


@pytest.fixture
def fake(monkeypatch):
    """The stand-in for CuPy (stand_ins.FakeCuda) in place of cupy, and its kernels
    (stand_ins.FakeKernels) in place of the CUDA kernel library; a fresh machine for
    each test, so the process's record of the device pairs with peer access enabled
    (windows._peer_enabled) starts empty too."""
    from commref.transports import windows

    f = FakeCuda()
    monkeypatch.setitem(sys.modules, "cupy", f.module)
    monkeypatch.setitem(sys.modules, "cupy.cuda", f.module.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.runtime", f.module.cuda.runtime)
    monkeypatch.setattr(gpu_loader, "cuda_kernels", lambda device_id: FakeKernels(f))
    monkeypatch.setattr(launch_record, "_abort_words", launch_record.MappedHostWords())
    monkeypatch.setattr(windows, "_peer_enabled", set())
    return f
