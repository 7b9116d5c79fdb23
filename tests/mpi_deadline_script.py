"""A rank that never shows up, under mpiexec; launched by tests/test_deadline.py as

    COMMREF_TIMEOUT=2 mpiexec -n 3 python -m mpi4py tests/mpi_deadline_script.py MODE

Modes:
    kernel  every rank builds the Communicator; rank 2 then never joins the allreduce.
            Ranks 0 and 1 time out inside the kernel (CommTimeout naming the peer they
            waited on); ``python -m mpi4py`` turns that into MPI_Abort.
    setup   rank 2 never builds the Communicator: the others' construction times out
            in the world barrier (CommTimeout naming rank 2).
    ok      every rank joins (sanity check of the script itself): exits 0.

The missing rank sleeps far longer than the test waits, so only the abort ends it.
Each rank prints one line "deadline-script rank R: <outcome>" on stderr.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from commref.collectives.communicator import Communicator  # noqa: E402
from commref.transports.errors import CommTimeout  # noqa: E402
from commref.transports.mpi_world import MPIWorld  # noqa: E402

MISSING = 2
HANG_S = 120.0


def say(world, text: str) -> None:
    print(f"deadline-script rank {world.rank}: {text}", file=sys.stderr, flush=True)


def main(mode: str) -> int:
    world = MPIWorld()
    assert world.size == 3, world.size
    if mode == "setup" and world.rank == MISSING:
        say(world, "not building the communicator")
        time.sleep(HANG_S)
        return 3
    t0 = time.monotonic()
    try:
        comm = Communicator(world, "cpu", algorithm="ring")
    except CommTimeout as e:
        say(world, f"construction raised after {time.monotonic() - t0:.1f} s: {e}")
        raise
    if mode == "kernel" and world.rank == MISSING:
        say(world, "not joining the allreduce")
        time.sleep(HANG_S)
        return 3
    x = np.full(1000, world.rank, np.float32)
    y = np.zeros_like(x)
    t0 = time.monotonic()
    try:
        comm.allreduce(x, y)
    except CommTimeout as e:
        say(world, f"allreduce raised after {time.monotonic() - t0:.1f} s: {e}")
        if world.rank != 0:
            time.sleep(0.5)  # let rank 0, which waits on the missing rank itself, abort the job
        raise
    assert (y == 3).all(), y[:4]
    say(world, "allreduce ok")
    world.barrier(what="done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
