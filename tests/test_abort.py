"""Communicator.abort (ncclCommAbort): from another thread it ends the rank's running
call within a second with CommAborted, on every path and wire; later calls are refused;
close() afterwards returns at once and frees everything; under mpiexec the job ends
cleanly with nothing left in /dev/shm.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

from commref import CommAborted, Communicator

ABORT_AFTER_S = 0.3


def _blocked_then_aborted(world, options):
    """Every rank but the last enters an AllReduce that cannot complete (the last rank
    never calls it); a watchdog thread of each aborts its communicator. Returns, per
    rank, (seconds from abort to the raise, the raise, the refusal of a later call,
    seconds close() took), or None for the rank that stayed out."""
    comm = Communicator(world, "cpu", timeout=30, **options)
    x = np.ones(1 << 15, np.float32)
    y = np.empty_like(x)
    comm.allreduce(x, y)  # connections made and used once
    if world.rank == world.size - 1:
        comm.close()
        return None
    aborted_at: list[float] = []

    def watchdog():
        time.sleep(ABORT_AFTER_S)
        aborted_at.append(time.monotonic())
        comm.abort()

    thread = threading.Thread(target=watchdog)
    thread.start()
    try:
        comm.allreduce(x, y)
        raised = None
    except CommAborted as e:
        raised = e
    waited = time.monotonic() - aborted_at[0]
    thread.join()
    try:
        comm.allreduce(x, y)
        refused = None
    except CommAborted as e:
        refused = e
    t0 = time.monotonic()
    comm.close()
    return waited, raised, refused, time.monotonic() - t0


# ---------------------------------------------------------------------------------------
# the MPI job (this file run under mpiexec)
# ---------------------------------------------------------------------------------------

if __name__ == "__main__":
    from commref.transports.mpi_world import MPIWorld

    world = MPIWorld()
    result = _blocked_then_aborted(world, dict(path=sys.argv[1]))
    if result is not None:
        waited, raised, refused, closing = result
        line = f"rank {world.rank}: raised {raised} after {waited:.3f} s; refused {refused}; closed in {closing:.3f} s"
        sys.stdout.write(line + "\n")  # one write: the ranks' lines share mpiexec's stdout
        sys.stdout.flush()
    world.barrier(what="abort job done")
    sys.exit(0)


# ---------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------

import os  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402
from conftest import clean_env, run_mpi  # noqa: E402

from commref.transports.thread_world import ThreadWorld  # noqa: E402


@pytest.mark.parametrize(
    "options",
    [dict(path="lsa"), dict(path="gin", wire="ordered"), dict(path="gin", wire="unordered")],
    ids=["lsa", "gin-ordered", "gin-unordered"],
)
def test_abort_from_another_thread_ends_the_running_call_within_a_second(options):
    results = ThreadWorld.run(3, _blocked_then_aborted, options, timeout=60)
    assert results[2] is None
    for rank, (waited, raised, refused, closing) in enumerate(results[:2]):
        assert raised is not None and "aborted by Communicator.abort()" in str(raised), (rank, raised)
        assert waited < 1.0, (rank, waited)
        assert refused is not None and "unusable" in str(refused) and "aborted" in str(refused), refused
        assert closing < 2.0, (rank, closing)


def test_a_call_after_abort_is_refused_at_once_and_close_is_clean():
    def body(world):
        with Communicator(world, "cpu", timeout=30, path="gin") as comm:
            comm.abort()
            comm.abort()  # idempotent
            t0 = time.monotonic()
            with pytest.raises(CommAborted, match="unusable: it was aborted"):
                comm.allreduce(np.ones(4, np.float32), np.empty(4, np.float32))
            return time.monotonic() - t0

    assert all(t < 0.5 for t in ThreadWorld.run(2, body, timeout=60))


@pytest.mark.mpi
@pytest.mark.parametrize("path", ["lsa", "gin"])
def test_abort_under_mpiexec_ends_the_call_and_leaves_nothing(path, shm_leak_check):
    script = os.path.relpath(__file__, os.path.dirname(os.path.dirname(__file__)))
    proc = run_mpi(3, [script, path], timeout=120, env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    said = re.findall(
        r"rank (\d): raised rank \1: aborted by Communicator.abort\(\) after ([0-9.]+) s; refused rank", out
    )
    assert sorted(r for r, _ in said) == ["0", "1"], out[-4000:]
    assert all(float(waited) < 1.0 for _, waited in said), said
