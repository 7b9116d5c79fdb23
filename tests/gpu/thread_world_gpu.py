"""N ranks as threads of one process on one GPU: the verification sweep over CUDA,
each rank on its own non-blocking stream; `--path gin` over the copy-engine GIN proxy.

    python tests/gpu/thread_world_gpu.py --np 4
    python tests/gpu/thread_world_gpu.py --np 2 --path gin --backend gda --gin-protocol signal-per-put
    COMMREF_NODES=2 python tests/gpu/thread_world_gpu.py --np 4 --path auto --algorithm ring hierarchical
Exits non-zero if any element is wrong. With simulated nodes (COMMREF_NODES) of several
ranks each, the sweep includes the hierarchical algorithm.
"""

import argparse
import sys
import time

from commref.collectives import check
from commref.collectives.catalogue import KERNEL_NAMES as COLLECTIVES
from commref.collectives.communicator import Communicator
from commref.collectives.gpu_stream import use_rank_gpu
from commref.collectives.hierarchical import NodeShape
from commref.transports.thread_world import ThreadWorld


def body(world, args):
    import cupy

    with cupy.cuda.Device(use_rank_gpu(world)):
        # Each rank on a non-blocking stream of its own, current for everything it does:
        # on CUDA's legacy default stream one rank's work would wait for the other ranks'
        # spinning kernels (the Communicator refuses that stream when ranks share a GPU).
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.use()
        gin = dict(path=args.path, backend=args.backend, gin_protocol=args.gin_protocol) if args.path != "lsa" else {}
        comm = Communicator(world, "cuda", max_channels=args.channels, **gin)
        try:
            cases = check.cases(
                list(COLLECTIVES),
                args.dtype,
                args.op,
                args.algorithm,
                args.count,
                world.size,
                1,
                direct=False,
                hierarchical=isinstance(comm.node_shape, NodeShape),
            )
            return cases, check.run_sweep(comm, cases, stream=stream)
        finally:
            comm.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--channels", type=int, default=2)
    p.add_argument("--count", type=int, nargs="+", default=[0, 1, 7, 1001, 100003])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16", "int8", "float64"])
    p.add_argument("--op", nargs="+", default=["sum", "prod", "max", "min", "avg"])
    p.add_argument("--path", choices=["lsa", "gin", "auto"], default="lsa")
    p.add_argument("--algorithm", nargs="+", default=[], help="default: every one the communicator can run")
    p.add_argument("--backend", default="proxy")
    p.add_argument("--gin-protocol", default="strong")
    args = p.parse_args()
    t0 = time.time()
    results = ThreadWorld.run(args.np, body, args)  # every wait's deadline: $COMMREF_TIMEOUT
    cases, wrong = results[0]
    print(check.format_table(check.summary_rows(cases, wrong), args.np, f"cuda (ThreadWorld, one GPU, {args.path})"))
    print(f"# {len(cases)} cases, {sum(wrong)} wrong elements, {time.time() - t0:.1f} s")
    sys.exit(0 if sum(wrong) == 0 else 1)


if __name__ == "__main__":
    main()
