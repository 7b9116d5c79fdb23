"""What the self-checks `python -m commref.ep` and `python -m commref.rmsnorm` share: the
flags that say where the ranks' peers are reached, each rank's GPU stream, and running
the ranks as threads or as the MPI job's."""

from __future__ import annotations


def add_peer_arguments(p) -> None:
    """--device, --path, --wire and --network (Communicator's options of those names)."""
    p.add_argument("--device", default="auto")
    p.add_argument("--path", default="lsa", choices=["lsa", "gin", "auto"])
    p.add_argument("--wire", default="ordered", choices=["ordered", "unordered"])
    p.add_argument("--network", default="auto", choices=["auto", "shm", "mpi"])


def use_rank_stream(world):
    """On a GPU rank: this rank's GPU (the one its Communicator picks) and a non-blocking
    stream of its own there, CuPy's current (ranks that share a GPU each need one).
    Returns the cupy module."""
    import cupy

    from commref.collectives.gpu_stream import use_rank_gpu

    use_rank_gpu(world)
    cupy.cuda.Stream(non_blocking=True).use()
    return cupy


def run_ranks(nthreads: int | None, body) -> tuple[list, bool]:
    """body(world) on `nthreads` ranks as threads of this process, or (None) on the MPI
    job's ranks: (every rank's result in rank order, whether this process reports them:
    always with threads, rank 0 under MPI)."""
    from commref.transports.mpi_world import MPIWorld
    from commref.transports.thread_world import ThreadWorld

    if nthreads:
        return ThreadWorld.run(nthreads, body), True
    world = MPIWorld()
    return world.allgather(body(world)), world.rank == 0
