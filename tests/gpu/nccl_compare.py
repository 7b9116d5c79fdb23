"""Our kernels and NCCL (through nccl4py) side by side on the same inputs.

Run under mpiexec, several ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1):
    mpiexec -n 2 python -m mpi4py tests/gpu/nccl_compare.py
Prints the NCCL version first, then, per case, wrong elements of ours and of NCCL
against the numpy reference and the number of elements where ours and NCCL differ;
exits non-zero on any mismatch. Exits SKIP (77) with one line saying why when nccl4py
is missing or NCCL refuses this job's placement: NCCL before the multi-rank-GPU support
(NCCL_MULTI_RANK_GPU_ENABLE) rejects a second rank on one GPU ("Duplicate GPU detected").
"""

import os
import sys

from commref.collectives import catalogue, verify
from commref.collectives.communicator import Communicator
from commref.collectives.gpu_stream import use_rank_gpu
from commref.transports.mpi_world import MPIWorld

SKIP = 77  # the exit status gpu_check.sh reports as skipped, not failed

# The dtypes and ops whose modules gpu_check.sh builds ahead (avg shares sum's module).
CASES = [
    ("allreduce", "float32", "sum"),
    ("allreduce", "bfloat16", "max"),
    ("allreduce", "int32", "sum"),
    ("allreduce", "float32", "avg"),
    ("reduce_scatter", "float32", "sum"),
    ("reduce_scatter", "int8", "max"),
    ("allgather", "float16", None),
    ("allgather", "uint64", None),
    ("broadcast", "float32", None),
    ("reduce", "float32", "sum"),
    ("alltoall", "float32", None),
    ("alltoall", "int8", None),
]


def nccl_communicator(world, nccl):
    """NCCL's communicator over `world`, or exits SKIP on every rank (they agree) when NCCL
    refuses it, naming the version and the placement."""
    device = use_rank_gpu(world)
    version = nccl.get_version()
    if world.rank == 0:
        print(
            f"nccl4py {nccl.__version__}, NCCL library {version}, "
            f"NCCL_MULTI_RANK_GPU_ENABLE={os.environ.get('NCCL_MULTI_RANK_GPU_ENABLE', 'unset')}",
            flush=True,
        )
    uid = world.bcast(nccl.get_unique_id() if world.rank == 0 else None, what="nccl unique id")
    try:
        ncomm, why = nccl.Communicator.init(world.size, world.rank, uid), None
    except Exception as e:  # noqa: BLE001 - any refusal: reported in one line below
        ncomm, why = None, " ".join(f"{type(e).__name__}: {e}".split())
    refusals = [w for w in world.allgather(why, what="nccl init") if w]
    if refusals:
        gpus = world.allgather(device, what="nccl devices")
        if world.rank == 0:
            print(f"SKIP: NCCL {version} refused {world.size} ranks on GPUs {gpus}: {refusals[0]}")
        sys.exit(SKIP)
    return ncomm


def main():
    import cupy

    world = MPIWorld()
    try:
        import nccl.core as nccl
    except ImportError as e:
        if world.rank == 0:
            print(f"SKIP: nccl4py is not importable ({e}); tests/gpu/fetch_wheels.sh fetches it")
        sys.exit(SKIP)
    ncomm = nccl_communicator(world, nccl)
    comm = Communicator(world, "cuda")
    comm.prepare({comm.kernel_spec(c, d, o) for c, d, o in CASES})
    stream = cupy.cuda.Stream(non_blocking=True)
    ops = {"sum": nccl.SUM, "prod": nccl.PROD, "max": nccl.MAX, "min": nccl.MIN, "avg": nccl.AVG, None: None}
    n, r, failures = world.size, world.rank, 0
    for coll, dname, op in CASES:
        for count in (1, 1001, 1 << 18):
            dt = verify.DTYPES[dname]
            with stream:
                x = cupy.asarray(verify.make_input(coll, dt, op, 7, r, n, count))
            exp = verify.expected_output(coll, dt, op, 7, r, n, count, root=0)
            rc = catalogue.get(coll).counts(count, n)[1]
            outs = []
            for impl in ("commref", "nccl"):
                with stream:
                    out = cupy.zeros(rc, dtype=dt)
                if impl == "commref":
                    c, kw = comm, {"stream": stream}
                else:
                    c, kw = ncomm, {"stream": stream.ptr}
                if coll in ("allreduce", "reduce_scatter"):
                    getattr(c, coll)(x, out, ops[op] if impl == "nccl" else op, **kw)
                elif coll in ("allgather", "alltoall"):
                    getattr(c, coll)(x, out, **kw)
                elif coll == "broadcast":
                    c.broadcast(x, out, 0, **kw)
                else:
                    c.reduce(x, out, ops[op] if impl == "nccl" else op, 0, **kw)
                stream.synchronize()
                outs.append(cupy.asnumpy(out))
            ours, theirs = outs
            if exp is None:
                w_ours = w_nccl = differ = 0
            else:
                w_ours, w_nccl = verify.count_wrong(ours, exp), verify.count_wrong(theirs, exp)
                differ = verify.count_wrong(ours, theirs)
            tot = world.allgather((w_ours, w_nccl, differ), what="compare")
            w = [sum(t[i] for t in tot) for i in range(3)]
            failures += w[0] + w[2]
            if r == 0:
                print(
                    f"{coll:<15}{dname:<9}{str(op):<5}count={count:<8} wrong(commref)={w[0]} "
                    f"wrong(nccl)={w[1]} commref!=nccl={w[2]}"
                )
    comm.close()  # collective: waits, unmaps the peers' CUDA IPC windows, then frees this rank's
    if r == 0:
        print(f"# commref vs NCCL {nccl.get_version()}: {'OK' if failures == 0 else 'MISMATCH'}")
    sys.exit(0 if failures == 0 else 1)


if __name__ == "__main__":
    main()
