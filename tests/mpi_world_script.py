"""MPIWorld scenarios, launched by tests/test_world.py as

    mpiexec -n 3 python -m mpi4py tests/mpi_world_script.py MODE [TIMEOUT]

Modes:
    basic     allgather / bcast / barrier across all ranks; rank 0 prints "OK basic ...".
    deadline  rank 2 never joins the barrier; the others must time out (CommTimeout
              naming rank 2) and ``python -m mpi4py`` aborts the job.
    abort     rank 1 calls world.abort("injected failure", code=3).
    mismatch  rank 0 calls bcast(root=0), the others bcast(root=1): CommMismatch.
    cpus      rank 0 prints "OK cpus [...]": per rank the CPUs it may run on (allowed_cpus)
              and those of a thread started before the world, of the main thread and of
              one started after.

Any failed check raises; ``python -m mpi4py`` turns an uncaught exception into
MPI_Abort, so the job exits non-zero instead of hanging.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from commref.transports.cpu_binding import allowed_cpus  # noqa: E402
from commref.transports.mpi_world import MPIWorld, world_from_env  # noqa: E402
from commref.transports.world import World  # noqa: E402


def basic(world: World) -> None:
    assert world.kind == "mpi"
    assert world.size >= 2, world.size
    assert 0 <= world.local_rank < world.local_size <= world.size
    assert world.abort_word.shape == (1,) and world.abort_word[0] == 0

    gathered = world.allgather((world.rank, world.host, world.local_rank), what="ids")
    assert [g[0] for g in gathered] == list(range(world.size)), gathered
    assert gathered[world.rank][1] == world.host

    for root in range(world.size):
        value = world.bcast(
            {"root": root, "payload": list(range(root + 3))} if world.rank == root else None,
            root=root,
            what=f"bcast from {root}",
        )
        assert value == {"root": root, "payload": list(range(root + 3))}, value

    for i in range(5):
        world.barrier(what=f"barrier {i}")

    # Ranks that arrive at different times still meet.
    if world.rank == world.size - 1:
        time.sleep(0.2)
    world.barrier(what="late barrier")

    sums = world.allgather(sum(g[0] for g in gathered))
    assert len(set(sums)) == 1
    if world.rank == 0:
        print(
            "OK basic "
            + json.dumps(
                {"size": world.size, "hosts": sorted({g[1] for g in gathered}), "local_ranks": [g[2] for g in gathered]}
            ),
            flush=True,
        )


def deadline(world: World, timeout: float) -> None:
    world.barrier(what="setup")
    if world.rank == 2:
        time.sleep(120)  # never joins; killed by the abort of the others
        return
    world.barrier(what="deadline test", timeout=timeout)
    raise AssertionError("barrier returned although rank 2 never joined")


def abort(world: World) -> None:
    world.barrier(what="setup")
    if world.rank == 1:
        world.abort("injected failure", code=3)
    time.sleep(120)  # killed by rank 1's abort


def mismatch(world: World) -> None:
    world.barrier(what="setup")
    world.bcast("x", root=0 if world.rank == 0 else 1, what="mismatched bcast")
    raise AssertionError("mismatched bcast returned")


def cpus(world: MPIWorld, early: threading.Thread) -> None:
    late = threading.Thread(target=time.sleep, args=(0.5,), daemon=True)
    late.start()
    mine = {
        "cpus": sorted(allowed_cpus()),
        **{
            name: sorted(os.sched_getaffinity(t.native_id or 0))
            for name, t in (("early", early), ("main", threading.main_thread()), ("late", late))
        },
    }
    gathered = world.allgather(mine, what="cpus")
    if world.rank == 0:
        print("OK cpus " + json.dumps(gathered), flush=True)


def main(argv: list[str]) -> None:
    mode = argv[1]
    timeout = float(argv[2]) if len(argv) > 2 else None
    assert MPIWorld.launched_under_mpi()
    early = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    early.start()
    world = world_from_env()
    assert isinstance(world, MPIWorld)
    if mode == "basic":
        basic(world)
    elif mode == "deadline":
        deadline(world, timeout or 1.0)
    elif mode == "abort":
        abort(world)
    elif mode == "mismatch":
        mismatch(world)
    elif mode == "cpus":
        cpus(world, early)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv)
