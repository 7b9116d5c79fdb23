"""Test hook: a rank of an mpiexec job kills itself with SIGKILL at a chosen point.

tests/test_rank_death.py puts this folder first on PYTHONPATH, so every Python process
of the job imports this module at startup (the `commref` launcher too, which it leaves
alone: only processes with PMI_RANK set are ranks). Nothing else uses it.

COMMREF_TEST_KILL = "RANK:POINT:N:DELAY_S", POINT one of
  collective        the N-th call of Communicator._collective on that rank (a collective
                    call: its buffers are checked, then its kernel runs)
  barrier=WHAT      the N-th MPIWorld.barrier(what=WHAT) on that rank
The rank SIGKILLs itself DELAY_S seconds after entering that call, from a timer thread:
a CPU kernel launch releases the GIL, so with a delay the rank dies inside its kernel,
its peers blocked in theirs. Just before the kill it writes "PID TIME" (time.time()) to
$COMMREF_TEST_KILL_DIR/killed. Every rank writes its pid to
$COMMREF_TEST_KILL_DIR/rank-R.pid at startup.
"""

import importlib.abc
import importlib.util
import os
import signal
import sys
import threading
import time

_RANK = os.environ.get("PMI_RANK")
_SPEC = os.environ.get("COMMREF_TEST_KILL")
_DIR = os.environ.get("COMMREF_TEST_KILL_DIR")


def _kill() -> None:
    path = os.path.join(_DIR, "killed")
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {time.time()!r}\n")
    os.replace(path + ".tmp", path)
    os.kill(os.getpid(), signal.SIGKILL)


def _counting(fn, matches, n: int, delay: float):
    calls = [0]

    def wrapper(*args, **kwargs):
        if matches(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                if delay > 0:
                    threading.Timer(delay, _kill).start()
                else:
                    _kill()
        return fn(*args, **kwargs)

    return wrapper


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs patch(module) right after `name` is imported."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _install() -> None:
    with open(os.path.join(_DIR, f"rank-{_RANK}.pid"), "w") as f:
        f.write(f"{os.getpid()}\n")
    if not _SPEC:
        return
    rank, point, n, delay = _SPEC.split(":")
    if rank != _RANK:
        return
    n, delay = int(n), float(delay)
    if point == "collective":

        def patch(module):
            cls = module.Communicator
            cls._collective = _counting(cls._collective, lambda *a, **k: True, n, delay)

        sys.meta_path.insert(0, _PatchOnImport("commref.collectives.communicator", patch))
    elif point.startswith("barrier="):
        what = point[len("barrier=") :]

        def patch(module):
            cls = module.MPIWorld
            cls.barrier = _counting(
                cls.barrier, lambda self, w="barrier", *a, **k: w == what or k.get("what") == what, n, delay
            )

        sys.meta_path.insert(0, _PatchOnImport("commref.transports.mpi_world", patch))
    else:
        raise ValueError(f"COMMREF_TEST_KILL: unknown point {point!r}")


if _RANK is not None and _DIR:
    _install()
