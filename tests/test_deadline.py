"""No unbounded wait: a rank that never shows up ends the job with a diagnostic that
names the rank, the peer it waited for, what it waited for, and expected vs seen.

- ThreadWorld: rank 2 never joins the collective (kernel deadline) or never builds the
  Communicator (world barrier deadline).
- mpiexec: the same two scenarios as separate processes (tests/mpi_deadline_script.py),
  where the job must exit non-zero within a bounded time.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
from conftest import TESTS, clean_env, run_mpi

from commref.collectives.communicator import Communicator
from commref.transports.errors import CommAborted, CommTimeout
from commref.transports.thread_world import ThreadWorld

MISSING = 2
COMM_TIMEOUT = 1.0
ABSENT_S = 2.5  # how long the missing rank stays away before returning


def _absent_from_collective(world, propagate: bool, algorithm: str = "ring"):
    """Ranks 0 and 1 call allreduce; rank 2 never does. Returns (exception, seconds from
    the call to the exception) per calling rank, or re-raises (propagate=True)."""
    comm = Communicator(world, "cpu", timeout=COMM_TIMEOUT, max_channels=1)
    if world.rank == MISSING:
        time.sleep(ABSENT_S)
        return None
    x = np.ones(1000, np.float32)
    y = np.zeros_like(x)
    t0 = time.monotonic()
    try:
        comm.allreduce(x, y, algorithm=algorithm)
    except Exception as e:  # noqa: BLE001
        e.elapsed = time.monotonic() - t0  # type: ignore[attr-defined]
        if propagate:
            raise
        return e, e.elapsed
    return None, time.monotonic() - t0


def test_kernel_deadline_names_rank_and_peer():
    # Without propagation nothing raises the abort word, so each caller hits its own
    # deadline: rank 0 waits for its ring predecessor 2, rank 1 for its predecessor 0.
    results = ThreadWorld.run(3, _absent_from_collective, False, timeout=10.0)
    assert results[MISSING] is None
    for rank in (0, 1):
        exc, elapsed = results[rank]
        assert isinstance(exc, CommTimeout), f"rank {rank}: {exc!r}"
        assert COMM_TIMEOUT * 0.9 <= elapsed < 2.5, f"rank {rank}: raised after {elapsed:.2f} s"
        peer = (rank - 1) % 3
        assert (exc.rank, exc.peer) == (rank, peer)
        msg = str(exc)
        assert msg.startswith(f"rank {rank}: timed out after 1.0 s waiting for peer {peer}: "), msg
        assert "data of the next step (recv ready)" in msg and "channel 0" in msg, msg
        m = re.search(r"expected >= (\d+), seen (\d+)", msg)
        assert m and int(m.group(1)) > int(m.group(2)), msg
        assert (exc.expected, exc.seen) == (int(m.group(1)), int(m.group(2)))
    # Rank 0 waits for the absent rank's very first step.
    assert (results[0][0].expected, results[0][0].seen) == (1, 0)


def test_kernel_deadline_propagates_through_thread_world():
    """The first rank to time out raises the abort word: the other caller ends at once,
    ThreadWorld.run re-raises the CommTimeout, and the whole run ends once the absent
    rank returns."""
    t0 = time.monotonic()
    with pytest.raises(CommTimeout) as info:
        ThreadWorld.run(3, _absent_from_collective, True, timeout=10.0)
    total = time.monotonic() - t0
    exc = info.value
    assert exc.elapsed < 2.5, f"raised {exc.elapsed:.2f} s after the call"
    assert exc.rank in (0, 1) and exc.peer == (exc.rank - 1) % 3, str(exc)
    assert f"rank {exc.rank}: timed out" in str(exc) and f"waiting for peer {exc.peer}" in str(exc)
    assert total < ABSENT_S + 2.0, f"run took {total:.1f} s"
    notes = " ".join(getattr(exc, "__notes__", []))
    assert f"rank {exc.rank} failed first" in notes, notes
    assert f"ranks [{MISSING}] completed" in notes, notes


def test_kernel_deadline_tree():
    """Tree allreduce over 3 ranks. Rank 0 (a leaf of tree 0) waits in the call
    handshake for its ring predecessor, the missing rank 2; rank 1 (the root) passed the
    handshake and waits for its child 0's data, which never comes."""
    results = ThreadWorld.run(3, _absent_from_collective, False, "tree", timeout=10.0)
    errs = {r: results[r][0] for r in (0, 1)}
    for r, e in errs.items():
        assert isinstance(e, CommTimeout) and results[r][1] < 2.5, f"rank {r}: {e!r}"
        assert f"rank {r}: timed out" in str(e) and "expected >= " in str(e) and ", seen " in str(e)
    assert errs[0].peer == MISSING, str(errs[0])
    assert errs[1].peer == 0 and "recv ready" in str(errs[1]), str(errs[1])


def _absent_from_setup(world):
    if world.rank == MISSING:
        time.sleep(ABSENT_S)
        return None
    t0 = time.monotonic()
    try:
        Communicator(world, "cpu", timeout=30.0)
    except CommTimeout as e:
        return e, time.monotonic() - t0
    return None, time.monotonic() - t0


def test_setup_deadline_names_missing_rank():
    # The world's timeout bounds the host-side setup (the communicator's own timeout
    # option only bounds the kernels' waits).
    results = ThreadWorld.run(3, _absent_from_setup, timeout=COMM_TIMEOUT)
    for rank in (0, 1):
        exc, elapsed = results[rank]
        assert isinstance(exc, CommTimeout), f"rank {rank}: {exc!r}"
        assert elapsed < COMM_TIMEOUT + 1.0
        assert exc.rank == rank and exc.peers == [MISSING], str(exc)
        assert f"rank {rank}: timed out after 1.0 s waiting for peer {MISSING}" in str(exc)
        assert "ranks at the barrier (expected 3, seen 2)" in str(exc)


def test_setup_deadline_propagates_and_aborts_late_rank():
    """When the timeout propagates, the late rank's own setup fails fast (CommAborted)
    instead of waiting for peers that are gone."""
    late: dict[str, BaseException] = {}

    def fn(world):
        if world.rank == MISSING:
            time.sleep(COMM_TIMEOUT + 0.5)
            try:
                Communicator(world, "cpu")
            except BaseException as e:
                late["exc"] = e
                raise
            return None
        Communicator(world, "cpu")

    t0 = time.monotonic()
    with pytest.raises(CommTimeout) as info:
        ThreadWorld.run(3, fn, timeout=COMM_TIMEOUT)
    assert time.monotonic() - t0 < COMM_TIMEOUT + 2.0
    assert info.value.peers == [MISSING]
    assert isinstance(late.get("exc"), CommAborted), late


# ---------------------------------------------------------------------------------------
# under mpiexec: separate processes, MPI_Abort ends the job
# ---------------------------------------------------------------------------------------

SCRIPT = os.path.join(TESTS, "mpi_deadline_script.py")
MPI_TIMEOUT = 2


def _run_script(mode: str) -> tuple[object, float]:
    t0 = time.monotonic()
    proc = run_mpi(3, [SCRIPT, mode], timeout=45, env=clean_env(COMMREF_TIMEOUT=str(MPI_TIMEOUT)))
    return proc, time.monotonic() - t0


@pytest.mark.mpi
def test_mpi_kernel_deadline(shm_leak_check):
    proc, elapsed = _run_script("kernel")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    # Deadline, then MPI_Abort; the absent rank would otherwise sleep for 120 s.
    assert elapsed < MPI_TIMEOUT + 15, f"took {elapsed:.1f} s"
    assert f"rank 0: timed out after {MPI_TIMEOUT:.1f} s waiting for peer {MISSING}" in out, out[-3000:]
    assert "CommTimeout" in out and "expected >= 1, seen 0" in out
    assert "MPI_Abort" in out or "Abort" in out, out[-2000:]


@pytest.mark.mpi
def test_mpi_setup_deadline(shm_leak_check):
    proc, elapsed = _run_script("setup")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert elapsed < MPI_TIMEOUT + 15, f"took {elapsed:.1f} s"
    assert re.search(
        rf"rank [01]: timed out after {MPI_TIMEOUT}\.0 s waiting for peer {MISSING}: "
        r"[a-z ]+: ranks at the barrier \(expected 3, seen 2\)",
        out,
    ), out[-3000:]


@pytest.mark.mpi
def test_mpi_deadline_script_sanity(shm_leak_check):
    proc, _ = _run_script("ok")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stderr.count("allreduce ok") == 3
