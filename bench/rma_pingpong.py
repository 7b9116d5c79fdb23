"""Host one-sided ping-pong latency: put_signal + wait_signal against mpi4py Send/Recv.

    mpiexec -n 2 python -m mpi4py -m commref.bench.rma_pingpong [--bytes 4096] [--iters 2000]
        [--blocks 5] [--backend proxy] [--wire ordered]
    python -m commref.bench.rma_pingpong ...   # without mpiexec: 2 ranks as threads (ThreadWorld)

Rank 0 puts --bytes into rank 1's registered window with put_signal and waits for
rank 1's answer (wait_signal), which rank 1 sends the same way once it has seen the
signal; MPI's ping-pong is Send then Recv of the same bytes on numpy buffers (under
mpiexec only, on a Dup of the world's communicator). Both are timed in --blocks
alternating blocks of --iters round trips after a warm-up block; the figure is the
median over blocks of microseconds per one-way hop (half a round trip). Under mpiexec
the communicator runs on network mpi (a buffer of one process is not mapped by its
peers, so register_window needs it); in ThreadWorld on network shm, both proxies share
one process's GIL. No timed assertion: it measures and prints.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _args(argv=None):
    p = argparse.ArgumentParser(prog="commref.bench.rma_pingpong", description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=4096)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--backend", default="proxy")
    p.add_argument("--wire", default="ordered")
    return p.parse_args(argv)


def _rma_block(comm, win, buf, src, iters: int) -> float:
    from commref.collectives.rma import WaitSignalDesc

    peer = 1 - comm.rank
    wait = [WaitSignalDesc(1, peer)]
    comm.world.barrier(what="rma block")
    t0 = time.perf_counter()
    for _ in range(iters):
        if comm.rank == 0:
            comm.put_signal(src, peer, win, 0)
            comm.wait_signal(wait)
        else:
            comm.wait_signal(wait)
            comm.put_signal(src, peer, win, 0)
    return (time.perf_counter() - t0) / (2 * iters)


def _mpi_block(mpi_comm, rank: int, buf, src, iters: int) -> float:
    peer = 1 - rank
    mpi_comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            mpi_comm.Send(src, dest=peer, tag=5)
            mpi_comm.Recv(buf, source=peer, tag=5)
        else:
            mpi_comm.Recv(buf, source=peer, tag=5)
            mpi_comm.Send(src, dest=peer, tag=5)
    return (time.perf_counter() - t0) / (2 * iters)


def run(world, a) -> dict | None:
    from commref.collectives.communicator import Communicator

    network = "mpi" if world.kind == "mpi" else "shm"
    comm = Communicator(world, "cpu", path="gin", backend=a.backend, wire=a.wire, network=network, max_channels=1)
    buf = np.zeros(a.bytes, np.uint8)
    src = np.full(a.bytes, 1 + world.rank, np.uint8)
    win = comm.register_window(buf)
    mpi_comm = world.comm.Dup() if world.kind == "mpi" else None
    rma, mpi = [], []
    _rma_block(comm, win, buf, src, max(a.iters // 10, 10))  # warm-up
    if mpi_comm is not None:
        _mpi_block(mpi_comm, world.rank, buf, src, max(a.iters // 10, 10))
    for _ in range(a.blocks):
        rma.append(_rma_block(comm, win, buf, src, a.iters))
        if mpi_comm is not None:
            mpi.append(_mpi_block(mpi_comm, world.rank, buf, src, a.iters))
    engine = type(comm.proxy).__name__
    world.barrier(what="rma ping-pong done")
    comm.deregister_window(win)
    comm.close()
    if mpi_comm is not None:
        mpi_comm.Free()
    if world.rank != 0:
        return None
    return {
        "world": world.kind,
        "network": network,
        "engine": engine,
        "backend": a.backend,
        "wire": a.wire,
        "bytes": a.bytes,
        "put_signal_us": statistics.median(rma) * 1e6,
        "mpi_send_recv_us": statistics.median(mpi) * 1e6 if mpi else None,
    }


def main(argv=None) -> int:
    from commref.transports.mpi_world import MPIWorld

    a = _args(argv)
    if MPIWorld.launched_under_mpi():
        world = MPIWorld()
        if world.size != 2:
            raise SystemExit("rma_pingpong runs on 2 ranks (mpiexec -n 2)")
        results = [run(world, a)]
    else:
        from commref.transports.thread_world import ThreadWorld

        results = ThreadWorld.run(2, run, a, timeout=300)
    r = results[0]
    if r is not None:
        mpi = "" if r["mpi_send_recv_us"] is None else f", mpi4py Send/Recv {r['mpi_send_recv_us']:.1f} us"
        print(
            f"rma ping-pong {r['bytes']} B ({r['world']} world, network {r['network']}, {r['engine']}, "
            f"backend {r['backend']}, {r['wire']} wire): put_signal {r['put_signal_us']:.1f} us per hop{mpi}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
