"""A baseline's collective timed as a job of its own: MPI through mpi4py on numpy
buffers, or torch.distributed's gloo on CPU tensors, in processes where commref is not
loaded. `commref bench --baseline mpich,openmpi,gloo` runs it (bench/peers.py); by hand:

    mpiexec -n 2 python -I bench/standalone.py SPEC.json OUT.json

Run it as a file, not as commref.bench.standalone (that would import commref). It
imports the standard library, numpy, mpi4py and, for gloo, torch; nothing beside it.

SPEC (JSON): {"peer": "mpi" | "gloo", "coll": commref's name (allreduce, allgather,
reduce_scatter, broadcast, reduce, alltoall, gather, scatter, sendrecv), "dtype": numpy's
name (bfloat16 too), "op": sum|prod|max|min|avg|null, "root": int, "iters": -n,
"warmup": -w, "agg": -m, "timeout": seconds (gloo's waits), "sizes": [[send, recv,
param], ...] (element counts, bench/plugins.py's Counts)}.

Per size, as commref's bench times a series (bench/measure.py): `warmup` untimed calls,
a barrier of the peer's own, then `iters` iterations, each `agg` calls one after another
timed together on every rank with perf_counter and divided by `agg`. Out of place, with
the in-process baselines' contracts (bench/baselines.py): MPI_Bcast's root copies into
recvbuf first, gloo's in-place collectives copy the input into the output first, and
'avg' runs as SUM (neither library has it). Data movement moves bytes.

OUT (JSON, written by rank 0): {"peer", "label", "library", "nranks", "commref_loaded"
(whether any commref module was imported: false), "notes", "unavailable" (why it could
not run, or null), "sizes": [{"counts": [send, recv, param], "times": every rank's
seconds per iteration (rows: ranks)}]}. Exit status 0 also when unavailable; an
exception ends the job with a traceback (and MPI_Abort under `python -m mpi4py`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial

# Run as a file, this folder would come first on sys.path and its modules (profile.py)
# would shadow the standard library's.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import numpy as np  # noqa: E402

MOVING = ("allgather", "broadcast", "alltoall", "gather", "scatter", "sendrecv")
REDUCING = ("allreduce", "reduce_scatter", "reduce")
COLLECTIVES = REDUCING + MOVING
ROOTED = ("broadcast", "reduce", "gather", "scatter")


class Unavailable(Exception):
    """The peer cannot run this case (says why)."""


def _np_dtype(name: str):
    if name == "bfloat16":
        return None  # numpy has none: data movement moves bytes, MPI cannot reduce it
    return np.dtype(name)


def _itemsize(name: str) -> int:
    return 2 if name == "bfloat16" else np.dtype(name).itemsize


def buffers(send: int, recv: int, dtype: str, reducing: bool) -> tuple[np.ndarray, np.ndarray]:
    """sendbuf (ones) and recvbuf (zeros) of these counts: elements of `dtype` for a
    reduction (bfloat16 as int16, its bits), else bytes. As commref's bench allocates
    them: np.empty (numpy asks for transparent huge pages on large arrays), then filled;
    np.zeros's calloc'd pages get none, and MPICH's 16 MiB AllReduce took 4.1 ms on them
    against 3.0 ms (2 ranks, docs/performance.md)."""
    if reducing:
        dt = np.dtype(np.int16) if dtype == "bfloat16" else np.dtype(dtype)
        one = 0x3F80 if dtype == "bfloat16" else 1  # bfloat16's 1.0
    else:
        dt, one = np.dtype(np.uint8), 1
        k = _itemsize(dtype)
        send, recv = send * k, recv * k
    s, d = np.empty(send, dt), np.empty(recv, dt)
    s.fill(one)
    d.fill(0)
    return s, d


def time_size(call, barrier, iters: int, warmup: int, agg: int) -> list[float]:
    """This rank's seconds per call of `iters` iterations (bench/measure.py's timing)."""
    for _ in range(warmup):
        call()
    barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(agg):
            call()
        times.append((time.perf_counter() - t0) / agg)
    return times


# ---------------------------------------------------------------------------------------
# MPI
# ---------------------------------------------------------------------------------------


class _Peer:
    """What every peer has: the job's MPI world (`comm`: it carries the results to rank 0
    and, for gloo, the store's port), this rank, the spec and the notes."""

    def __init__(self, spec):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.nranks = self.comm.Get_rank(), self.comm.Get_size()
        self.notes: list[str] = []
        self.spec = spec

    def gather(self, obj):
        return self.comm.gather(obj, root=0)

    def bcast(self, obj):
        return self.comm.bcast(obj, root=0)


class MPIPeer(_Peer):
    def __init__(self, spec):
        super().__init__(spec)
        MPI = self.MPI
        self.library = " ".join(MPI.Get_library_version().replace("\0", " ").split())
        self.label = "MPI"
        ops = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}
        self.op = ops.get(spec.get("op") or "sum")
        if spec.get("op") == "avg":
            self.notes.append("MPI has no average: avg measured as MPI_SUM")
        if spec["coll"] in REDUCING:
            from mpi4py.util import dtlib

            try:
                dtlib.from_numpy_dtype(_np_dtype(spec["dtype"]))
            except (TypeError, ValueError, KeyError):
                raise Unavailable(f"MPI has no datatype for {spec['dtype']} reductions") from None

    def barrier(self) -> None:
        self.comm.Barrier()

    def call(self, send: int, recv: int, param: int):
        """One call of the spec's collective on fresh buffers of these counts: the MPI method with
        its arguments bound (functools.partial, as commref's own timed call), no frame between."""
        spec, comm, r, n = self.spec, self.comm, self.rank, self.nranks
        coll, root = spec["coll"], spec.get("root") or 0
        s, d = buffers(send, recv, spec["dtype"], coll in REDUCING)
        op = self.op
        if coll == "allreduce":
            return partial(comm.Allreduce, s, d, op)
        if coll == "reduce_scatter":
            return partial(comm.Reduce_scatter_block, s, d, op)
        if coll == "reduce":
            return partial(comm.Reduce, s, d if r == root else None, op, root)
        if coll == "allgather":
            return partial(comm.Allgather, s, d)
        if coll == "alltoall":
            return partial(comm.Alltoall, s, d)
        if coll == "gather":
            return partial(comm.Gather, s, d if r == root else None, root)
        if coll == "scatter":
            return partial(comm.Scatter, s if r == root else None, d, root)
        if coll == "sendrecv":
            return partial(comm.Sendrecv, s, (r + 1) % n, recvbuf=d, source=(r - 1) % n)

        def broadcast():
            if r == root:
                d[...] = s
            comm.Bcast(d, root)

        return broadcast

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------
# gloo
# ---------------------------------------------------------------------------------------


class GlooPeer(_Peer):
    """torch.distributed's gloo over loopback TCP; MPI carries only the store's port."""

    DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")

    def __init__(self, spec):
        import datetime

        super().__init__(spec)
        MPI, comm = self.MPI, self.comm
        error = None
        try:
            import torch
            import torch.distributed as dist
        except ImportError as e:
            error = f"torch is not installed here ({e})"
        if comm.allreduce(error is not None, op=MPI.LOR):
            raise Unavailable(error or "torch is missing on another rank")
        self.torch, self.dist = torch, dist
        torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1 for several processes per host
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        timeout = datetime.timedelta(seconds=float(spec.get("timeout") or 60))
        port = None
        if self.rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, self.nranks, is_master=True, timeout=timeout, wait_for_workers=False)
            port = store.port
        port = comm.bcast(port, root=0)
        if self.rank != 0:
            store = dist.TCPStore("127.0.0.1", port, self.nranks, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.nranks, timeout=timeout)
        self._store = store
        self.library = f"torch {torch.__version__} gloo"
        self.label = f"gloo (torch {torch.__version__.split('+')[0]})"
        ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT}
        ops.update(max=dist.ReduceOp.MAX, min=dist.ReduceOp.MIN)
        self.op = ops[spec.get("op") or "sum"]
        if spec.get("op") == "avg":
            self.notes.append("gloo has no average: avg measured as SUM")
        if spec["coll"] in REDUCING and spec["dtype"] not in self.DTYPES:
            raise Unavailable(f"gloo has no {spec['dtype']} reductions")

    def barrier(self) -> None:
        self.dist.barrier()

    def call(self, send: int, recv: int, param: int):
        torch, dist, spec, r, n = self.torch, self.dist, self.spec, self.rank, self.nranks
        coll, root, op = spec["coll"], spec.get("root") or 0, self.op
        s, d = (torch.from_numpy(a) for a in buffers(send, recv, spec["dtype"], coll in REDUCING))
        if coll in REDUCING and spec["dtype"] == "bfloat16":
            s, d = s.view(torch.bfloat16), d.view(torch.bfloat16)
        if coll == "allreduce":

            def allreduce():
                d.copy_(s)
                dist.all_reduce(d, op)

            return allreduce
        if coll == "reduce_scatter":
            return lambda: dist.reduce_scatter_tensor(d, s, op)
        if coll == "reduce":

            def reduce():
                buf = d if r == root else s.clone()
                if r == root:
                    d.copy_(s)
                dist.reduce(buf, root, op)

            return reduce
        if coll == "allgather":
            return lambda: dist.all_gather_into_tensor(d, s)
        if coll == "alltoall":
            return lambda: dist.all_to_all_single(d, s)
        if coll == "gather":
            blocks = list(d.chunk(n)) if r == root and d.numel() else None
            return lambda: dist.gather(s, blocks if r == root else None, dst=root)
        if coll == "scatter":
            blocks = list(s.chunk(n)) if r == root and s.numel() else None
            return lambda: dist.scatter(d, blocks if r == root else None, src=root)
        if coll == "sendrecv":

            def sendrecv():
                works = [dist.isend(s, (r + 1) % n), dist.irecv(d, (r - 1) % n)]
                for w in works:
                    w.wait()

            return sendrecv

        def broadcast():
            if r == root:
                d.copy_(s)
            dist.broadcast(d, root)

        return broadcast

    def close(self) -> None:
        self.dist.destroy_process_group()


PEERS = {"mpi": MPIPeer, "gloo": GlooPeer}


def run(spec: dict) -> dict | None:
    """Times every size of `spec` on this job's ranks; the OUT document on rank 0."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    out = {"peer": spec["peer"], "nranks": MPI.COMM_WORLD.Get_size(), "notes": [], "sizes": []}
    out.update(label=spec["peer"], library=None, unavailable=None)
    if spec["coll"] not in COLLECTIVES:
        out["unavailable"] = f"the standalone baseline has no {spec['coll']}"
        return out if rank == 0 else None
    peer = None
    try:
        peer = PEERS[spec["peer"]](spec)
    except Unavailable as e:
        out["unavailable"] = str(e)
    if peer is not None:
        out.update(label=peer.label, library=peer.library)
        for send, recv, param in spec["sizes"]:
            call = peer.call(send, recv, param)
            mine = time_size(call, peer.barrier, spec["iters"], spec["warmup"], spec.get("agg") or 1)
            times = peer.gather(mine)
            if rank == 0:
                out["sizes"].append({"counts": [send, recv, param], "times": times})
        out["notes"] = peer.notes
        peer.close()
    out["commref_loaded"] = any(m == "commref" or m.startswith("commref.") for m in sys.modules)
    return out if rank == 0 else None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: standalone.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    out = run(spec)
    if out is not None:
        with open(argv[1] + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(argv[1] + ".tmp", argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
