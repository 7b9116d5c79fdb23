"""In-process baselines, timed in commref's own ranks (bench/measure.py: each size's
in a phase of its own, commref quiesced): MPI on the CPU, NCCL on a GPU, and
torch.distributed's gloo on the CPU where torch is installed (--baseline gloo under an
mpiexec started by hand; from commref's launcher gloo is a standalone peer, peers.py).
--baseline's comma list is split_baselines'.

Each baseline has nccl4py's method names and argument order (the same as commref's
Communicator), so a plugin's ``run`` drives either one:

    allreduce(sendbuf, recvbuf, op)      allgather(sendbuf, recvbuf)
    reduce_scatter(sendbuf, recvbuf, op) broadcast(sendbuf, recvbuf, root)
    reduce(sendbuf, recvbuf, op, root)   alltoall(sendbuf, recvbuf)
    gather(sendbuf, recvbuf, root)       scatter(sendbuf, recvbuf, root)
    alltoallv(sendbuf, sendcounts, sdispls, recvbuf, recvcounts, rdispls)
    sendrecv(sendbuf, recvbuf)           hypercube(sendbuf, recvbuf)
    synchronize()

(sendrecv and hypercube are nccl-tests' programs: collectives/p2p_collectives.py says
what they move.) Each baseline has `rank` and `nranks`.

The harness times baselines out of place only (the MPI and NCCL in-place layouts of
reduce_scatter differ). GPU libraries are imported only when a GPU baseline is built.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import socket
from collections.abc import Callable

import numpy as np

from commref.collectives import catalogue, p2p_collectives
from commref.collectives.verify import DTYPE_CODES, OPS, dtype_name


class BaselineUnavailable(RuntimeError):
    """This run cannot measure the baseline (says why); the table shows '-' instead."""


class MPIBaseline:
    """MPI's own collectives through mpi4py on numpy buffers (MPI_Allreduce,
    MPI_Allgather, MPI_Reduce_scatter_block, MPI_Bcast, MPI_Reduce, MPI_Alltoall,
    MPI_Gather, MPI_Scatter, MPI_Alltoallv); sendrecv as one MPI_Sendrecv, hypercube as
    its log2(n) MPI_Sendrecv steps with rank ^ 2^k (after the local copy of its own block).

    Data-movement collectives move bytes (MPI_BYTE), so every dtype works; reductions
    need an MPI datatype for the numpy dtype (bfloat16 has none). MPI has no average:
    'avg' runs as MPI_SUM, which moves and adds the same bytes."""

    kind = "MPI"

    def __init__(self, world):
        from mpi4py import MPI

        self.MPI = MPI
        # MPI has no average: avg runs as SUM (check() notes it).
        self._ops = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}
        if world.kind == "mpi":
            self.comm = world.comm.Dup()
        elif world.size == 1:
            self.comm = MPI.COMM_SELF.Dup()
        else:
            raise BaselineUnavailable("the MPI baseline needs MPI ranks (run with --np N), not rank threads")
        self.rank, self.nranks = self.comm.Get_rank(), self.comm.Get_size()
        version = MPI.Get_library_version().strip().splitlines()[0]
        self.library = version
        self.label = "MPI (" + _short_mpi_name(version) + ")"
        self.notes: list[str] = []

    def check(self, coll: str, dtype, op: str | None) -> None:
        """Raises BaselineUnavailable when MPI cannot run (coll, dtype, op)."""
        if not catalogue.get(coll).reducing:
            return  # moves bytes: any dtype
        from mpi4py.util import dtlib

        try:
            dtlib.from_numpy_dtype(np.dtype(dtype))
        except (TypeError, ValueError, KeyError) as e:
            raise BaselineUnavailable(f"MPI has no datatype for {dtype_name(dtype)} reductions ({e})") from None
        if op == "avg":
            self.notes.append("MPI has no average: avg measured as MPI_SUM")

    def bind_call(self, name: str, *args) -> Callable[[], None]:
        """Collective `name`'s call on `args` (catalogue.Collective.bound's order) with
        its arguments bound: where MPI makes it in one call, that mpi4py method itself,
        so that a timed loop reaches MPI through no frame of this class's (as the
        standalone peer's loop does, bench/standalone.py); else the method below."""
        one = self._one_call(name, *args)
        return functools.partial(*one) if one else functools.partial(getattr(self, name), *args)

    def _one_call(self, name: str, *args) -> tuple | None:
        """(mpi4py method, its arguments) of `name` on `args` where that one call is all
        of it; None where it is more (broadcast's root copy, alltoallv's counts,
        hypercube's steps) or takes keywords (sendrecv)."""
        c, r = self.comm, self.rank
        if name == "allreduce":
            s, d, op = args
            return c.Allreduce, self.MPI.IN_PLACE if s is d else s, d, self._ops[op]
        if name == "reduce_scatter":
            s, d, op = args
            return c.Reduce_scatter_block, s, d, self._ops[op]
        if name == "reduce":
            s, d, op, root = args
            return (
                c.Reduce,
                self.MPI.IN_PLACE if s is d and r == root else s,
                d if r == root else None,
                self._ops[op],
                root,
            )
        if name in ("allgather", "alltoall"):
            s, d = args
            return getattr(c, name.capitalize()), _bytes(s), _bytes(d)
        if name == "gather":
            s, d, root = args
            return c.Gather, _bytes(s), _bytes(d) if r == root else None, root
        if name == "scatter":
            s, d, root = args
            return c.Scatter, _bytes(s) if r == root else None, _bytes(d), root
        return None

    def _call(self, name: str, *args) -> None:
        f, *a = self._one_call(name, *args)
        f(*a)

    def allreduce(self, sendbuf, recvbuf, op="sum") -> None:
        self._call("allreduce", sendbuf, recvbuf, op)

    def allgather(self, sendbuf, recvbuf) -> None:
        self._call("allgather", sendbuf, recvbuf)

    def reduce_scatter(self, sendbuf, recvbuf, op="sum") -> None:
        self._call("reduce_scatter", sendbuf, recvbuf, op)

    def broadcast(self, sendbuf, recvbuf, root: int) -> None:
        if self.rank == root and sendbuf is not recvbuf:
            recvbuf[...] = sendbuf  # MPI_Bcast is in place; NCCL's root copies too
        self.comm.Bcast(_bytes(recvbuf), root)

    def reduce(self, sendbuf, recvbuf, op="sum", root: int = 0) -> None:
        self._call("reduce", sendbuf, recvbuf, op, root)

    def alltoall(self, sendbuf, recvbuf) -> None:
        self._call("alltoall", sendbuf, recvbuf)

    def gather(self, sendbuf, recvbuf, root: int) -> None:
        self._call("gather", sendbuf, recvbuf, root)

    def scatter(self, sendbuf, recvbuf, root: int) -> None:
        self._call("scatter", sendbuf, recvbuf, root)

    def alltoallv(self, sendbuf, sendcounts, sdispls, recvbuf, recvcounts, rdispls) -> None:
        t = sendbuf.itemsize

        def spec(buf, counts, displs):
            return [_bytes(buf), [k * t for k in counts], [d * t for d in displs], self.MPI.BYTE]

        self.comm.Alltoallv(spec(sendbuf, sendcounts, sdispls), spec(recvbuf, recvcounts, rdispls))

    def sendrecv(self, sendbuf, recvbuf) -> None:
        n, r = self.nranks, self.rank
        self.comm.Sendrecv(_bytes(sendbuf), (r + 1) % n, recvbuf=_bytes(recvbuf), source=(r - 1) % n)

    def hypercube(self, sendbuf, recvbuf) -> None:
        for send, peer, recv in _hypercube_steps(self.rank, self.nranks, sendbuf, recvbuf):
            self.comm.Sendrecv(send, peer, recvbuf=recv, source=peer)

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self.comm.Free()


class NCCLBaseline:
    """NCCL through nccl4py (``nccl.core.Communicator``) on CuPy buffers, or through
    CuPy's own NCCL bindings (``cupy.cuda.nccl``) where nccl4py is not installed.

    Ranks that share one GPU need NCCL_MULTI_RANK_GPU_ENABLE=1 (the harness sets it
    before NCCL initializes). Calls go on CuPy's current stream; ``synchronize`` waits
    for it."""

    kind = "NCCL"

    def __init__(self, world, device_id: int):
        import cupy

        self.cupy = cupy
        self.rank, self.nranks = world.rank, world.size
        self.notes: list[str] = []
        try:
            import nccl.core as nccl4py
        except ImportError:
            nccl4py = None
        if nccl4py is not None:
            self._api, self._nccl = "nccl4py", nccl4py
        else:
            from cupy.cuda import nccl as cupy_nccl

            self._api, self._nccl = "cupy.cuda.nccl", cupy_nccl
        uid = _shared_unique_id(world, self._nccl.get_unique_id)
        with cupy.cuda.Device(device_id):
            if nccl4py is not None:
                self._comm = nccl4py.Communicator.init(world.size, world.rank, uid)
            else:
                self._comm = self._nccl.NcclCommunicator(world.size, uid, world.rank)
        version = _nccl_version(self._nccl)
        self.library = f"NCCL {version} via {self._api}"
        self.label = f"NCCL {version}"

    def check(self, coll: str, dtype, op: str | None) -> None:
        dtype_name(dtype)

    # nccl4py takes arrays; CuPy's bindings take pointers, counts and NCCL's enum codes
    # (which commref's verify.DTYPE_CODES and OPS mirror).
    def _op(self, op: str):
        if self._api == "nccl4py":
            return getattr(self._nccl, op.upper())  # nccl.core.SUM, PROD, MAX, MIN, AVG
        return OPS[op]

    def _stream(self) -> int:
        return self.cupy.cuda.get_current_stream().ptr

    def allreduce(self, sendbuf, recvbuf, op="sum") -> None:
        if self._api == "nccl4py":
            self._comm.allreduce(sendbuf, recvbuf, self._op(op), stream=self._stream())
        else:
            self._comm.allReduce(
                sendbuf.data.ptr, recvbuf.data.ptr, recvbuf.size, _code(recvbuf), self._op(op), self._stream()
            )

    def allgather(self, sendbuf, recvbuf) -> None:
        if self._api == "nccl4py":
            self._comm.allgather(sendbuf, recvbuf, stream=self._stream())
        else:
            self._comm.allGather(sendbuf.data.ptr, recvbuf.data.ptr, sendbuf.size, _code(sendbuf), self._stream())

    def reduce_scatter(self, sendbuf, recvbuf, op="sum") -> None:
        if self._api == "nccl4py":
            self._comm.reduce_scatter(sendbuf, recvbuf, self._op(op), stream=self._stream())
        else:
            self._comm.reduceScatter(
                sendbuf.data.ptr, recvbuf.data.ptr, recvbuf.size, _code(recvbuf), self._op(op), self._stream()
            )

    def broadcast(self, sendbuf, recvbuf, root: int) -> None:
        if self._api == "nccl4py":
            self._comm.broadcast(sendbuf, recvbuf, root, stream=self._stream())
        else:
            self._comm.broadcast(sendbuf.data.ptr, recvbuf.data.ptr, recvbuf.size, _code(recvbuf), root, self._stream())

    def reduce(self, sendbuf, recvbuf, op="sum", root: int = 0) -> None:
        if self._api == "nccl4py":
            self._comm.reduce(sendbuf, recvbuf, self._op(op), root, stream=self._stream())
        else:
            self._comm.reduce(
                sendbuf.data.ptr, recvbuf.data.ptr, sendbuf.size, _code(sendbuf), self._op(op), root, self._stream()
            )

    def alltoall(self, sendbuf, recvbuf) -> None:
        if self._api == "nccl4py":
            self._comm.alltoall(sendbuf, recvbuf, stream=self._stream())
            return
        # CuPy's bindings have no ncclAlltoAll: a send and a receive per peer in one
        # group, as nccl-tests' alltoall calls it.
        count, code, stream = sendbuf.size // self.nranks, _code(sendbuf), self._stream()
        step = count * sendbuf.itemsize
        self._nccl.groupStart()
        try:
            for peer in range(self.nranks):
                self._comm.send(sendbuf.data.ptr + peer * step, count, code, peer, stream)
                self._comm.recv(recvbuf.data.ptr + peer * step, count, code, peer, stream)
        finally:
            self._nccl.groupEnd()

    # Sends and receives (the collectives composed of them: p2p_collectives.py).
    def send(self, sendbuf, peer: int, stream=None) -> None:
        if self._api == "nccl4py":
            self._comm.send(sendbuf, peer, stream=self._stream())
        else:
            self._comm.send(sendbuf.data.ptr, sendbuf.size, _code(sendbuf), peer, self._stream())

    def recv(self, recvbuf, peer: int, stream=None) -> None:
        if self._api == "nccl4py":
            self._comm.recv(recvbuf, peer, stream=self._stream())
        else:
            self._comm.recv(recvbuf.data.ptr, recvbuf.size, _code(recvbuf), peer, self._stream())

    @contextlib.contextmanager
    def group(self):
        """ncclGroupStart / ncclGroupEnd around the block."""
        start, end = (
            (self._nccl.group_start, self._nccl.group_end)
            if self._api == "nccl4py"
            else (self._nccl.groupStart, self._nccl.groupEnd)
        )
        start()
        try:
            yield
        finally:
            end()

    # ncclGather / ncclScatter where nccl4py has them, else sends and receives in a group.
    def gather(self, sendbuf, recvbuf, root: int) -> None:
        if self._api == "nccl4py" and hasattr(self._comm, "gather"):
            self._comm.gather(sendbuf, recvbuf, root, stream=self._stream())
        else:
            p2p_collectives.gather(self, sendbuf, recvbuf, root)

    def scatter(self, sendbuf, recvbuf, root: int) -> None:
        if self._api == "nccl4py" and hasattr(self._comm, "scatter"):
            self._comm.scatter(sendbuf, recvbuf, root, stream=self._stream())
        else:
            p2p_collectives.scatter(self, sendbuf, recvbuf, root)

    def alltoallv(self, sendbuf, sendcounts, sdispls, recvbuf, recvcounts, rdispls) -> None:
        p2p_collectives.alltoallv(self, sendbuf, sendcounts, sdispls, recvbuf, recvcounts, rdispls)

    def sendrecv(self, sendbuf, recvbuf) -> None:
        p2p_collectives.sendrecv(self, sendbuf, recvbuf)

    def hypercube(self, sendbuf, recvbuf) -> None:
        p2p_collectives.hypercube(self, sendbuf, recvbuf)

    def synchronize(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()

    def close(self) -> None:
        destroy = getattr(self._comm, "destroy", None)
        if destroy:
            destroy()


class GlooBaseline:
    """torch.distributed's gloo backend (CPU tensors over loopback TCP), as a
    PyTorch user reaches collectives without NCCL. Its own process group, rendezvous
    through a TCPStore on rank 0's host; numpy buffers as tensors without copies
    (bfloat16 through an int16 view). gloo's collectives are in place or take tensor
    lists, so out-of-place calls copy the input into the output first, as a torch
    program does; alltoallv, sendrecv and hypercube are send/recv pairs; gloo has no average:
    'avg' runs as SUM, which moves and adds the same bytes."""

    kind = "gloo"
    REDUCING_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")

    def __init__(self, world):
        try:
            import torch
            import torch.distributed as dist
        except ImportError as e:
            raise BaselineUnavailable(f"the gloo baseline needs torch (pip install commref[torch]): {e}") from None
        if world.size > 1 and world.kind != "mpi":
            raise BaselineUnavailable(
                "the gloo baseline needs one rank per process (run with --np N), not rank threads"
            )
        self.torch, self.dist = torch, dist
        self.rank, self.nranks = world.rank, world.size
        self.notes: list[str] = []
        host, port, err = None, None, None
        if world.rank == 0:
            try:
                host = socket.gethostname()
                store = dist.TCPStore(
                    host, 0, world.size, is_master=True, timeout=_timedelta(world.timeout), wait_for_workers=False
                )
                port = store.port
            except Exception as e:  # noqa: BLE001 - reported to every rank
                err = f"{type(e).__name__}: {e}"
        host, port, err = world.bcast((host, port, err), what="bench: gloo store address")
        if err:
            raise BaselineUnavailable(f"gloo baseline: no store on rank 0 ({err})")
        if world.rank != 0:
            store = dist.TCPStore(host, port, world.size, is_master=False, timeout=_timedelta(world.timeout))
        self._store = store
        self.group = dist.distributed_c10d.ProcessGroupGloo(
            dist.PrefixStore("commref-bench", store), self.rank, self.nranks, _timedelta(world.timeout)
        )
        self.library = f"torch {torch.__version__} gloo"
        self.label = f"gloo (torch {torch.__version__.split('+')[0]})"
        self._ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT}
        self._ops.update(max=dist.ReduceOp.MAX, min=dist.ReduceOp.MIN)

    def check(self, coll: str, dtype, op: str | None) -> None:
        if catalogue.get(coll).reducing and dtype_name(dtype) not in self.REDUCING_DTYPES:
            raise BaselineUnavailable(f"gloo has no {dtype_name(dtype)} reductions")
        if op == "avg":
            self.notes.append("gloo has no average: avg measured as SUM")

    def _t(self, a, moving: bool = False):
        """`a` as a tensor on the same memory (bytes for data movement)."""
        if moving:
            return self.torch.from_numpy(_bytes(a.reshape(-1)))
        if dtype_name(a.dtype) == "bfloat16":
            return self.torch.from_numpy(a.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(a)

    def _wait(self, work) -> None:
        work.wait()

    def _copy_in(self, sendbuf, recvbuf) -> None:
        if sendbuf is not recvbuf:
            recvbuf[...] = sendbuf

    def allreduce(self, sendbuf, recvbuf, op="sum") -> None:
        self._copy_in(sendbuf, recvbuf)
        o = self.dist.AllreduceOptions()
        o.reduceOp = self._ops[op]
        self._wait(self.group.allreduce([self._t(recvbuf)], o))

    def allgather(self, sendbuf, recvbuf) -> None:
        self._wait(self.group._allgather_base(self._t(recvbuf, True), self._t(sendbuf, True)))

    def reduce_scatter(self, sendbuf, recvbuf, op="sum") -> None:
        o = self.dist.ReduceScatterOptions()
        o.reduceOp = self._ops[op]
        self._wait(self.group._reduce_scatter_base(self._t(recvbuf), self._t(sendbuf), o))

    def broadcast(self, sendbuf, recvbuf, root: int) -> None:
        if self.rank == root:
            self._copy_in(sendbuf, recvbuf)
        o = self.dist.BroadcastOptions()
        o.rootRank = root
        self._wait(self.group.broadcast([self._t(recvbuf, True)], o))

    def reduce(self, sendbuf, recvbuf, op="sum", root: int = 0) -> None:
        buf = recvbuf if self.rank == root else sendbuf.copy()
        if self.rank == root:
            self._copy_in(sendbuf, recvbuf)
        o = self.dist.ReduceOptions()
        o.reduceOp, o.rootRank = self._ops[op], root
        self._wait(self.group.reduce([self._t(buf)], o))

    def alltoall(self, sendbuf, recvbuf) -> None:
        out, inp = self._t(recvbuf, True), self._t(sendbuf, True)
        self._wait(self.group.alltoall_base(out, inp, [], [], self.dist.AllToAllOptions()))

    def _blocks(self, buf):
        t = self._t(buf, True)
        return list(t.chunk(self.nranks)) if t.numel() else [t] * self.nranks

    def gather(self, sendbuf, recvbuf, root: int) -> None:
        o = self.dist.GatherOptions()
        o.rootRank = root
        outs = [self._blocks(recvbuf)] if self.rank == root else []
        self._wait(self.group.gather(outs, [self._t(sendbuf, True)], o))

    def scatter(self, sendbuf, recvbuf, root: int) -> None:
        o = self.dist.ScatterOptions()
        o.rootRank = root
        ins = [self._blocks(sendbuf)] if self.rank == root else []
        self._wait(self.group.scatter([self._t(recvbuf, True)], ins, o))

    def alltoallv(self, sendbuf, sendcounts, sdispls, recvbuf, recvcounts, rdispls) -> None:
        s, out, r = sendbuf.reshape(-1), recvbuf.reshape(-1), self.rank
        out[rdispls[r] : rdispls[r] + recvcounts[r]] = s[sdispls[r] : sdispls[r] + sendcounts[r]]
        works = []
        for j in range(self.nranks):
            if j != r:
                send = self._t(s[sdispls[j] : sdispls[j] + sendcounts[j]], True)
                works.append(self.group.send([send], j, 0))
                works.append(self.group.recv([self._t(out[rdispls[j] : rdispls[j] + recvcounts[j]], True)], j, 0))
        for w in works:
            w.wait()

    def _exchange(self, send, dst: int, recv, src: int) -> None:
        works = [self.group.send([send], dst, 0), self.group.recv([recv], src, 0)]
        for w in works:
            w.wait()

    def sendrecv(self, sendbuf, recvbuf) -> None:
        n, r = self.nranks, self.rank
        self._exchange(self._t(sendbuf, True), (r + 1) % n, self._t(recvbuf, True), (r - 1) % n)

    def hypercube(self, sendbuf, recvbuf) -> None:
        for send, peer, recv in _hypercube_steps(self.rank, self.nranks, sendbuf, recvbuf):
            self._exchange(self.torch.from_numpy(send), peer, self.torch.from_numpy(recv), peer)

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self.group = None
        self._store = None


def _hypercube_steps(rank: int, nranks: int, sendbuf, recvbuf):
    """nccl-tests' hypercube allgather as a baseline runs it: after the local copy of
    this rank's block (out of place), log2(nranks) steps, each yielding (the bytes to send,
    the peer rank ^ 2^k, where its bytes land) in recvbuf; the caller exchanges them."""
    out = _bytes(recvbuf.reshape(-1))
    b = sendbuf.size * sendbuf.itemsize
    if recvbuf.size and not np.shares_memory(sendbuf, recvbuf):
        out[rank * b : (rank + 1) * b] = _bytes(sendbuf.reshape(-1))
    mask = 1
    while mask < nranks:
        mine = rank & ~(mask - 1)
        theirs = mine ^ mask
        yield out[mine * b : (mine + mask) * b], rank ^ mask, out[theirs * b : (theirs + mask) * b]
        mask <<= 1


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


BASELINES = ("auto", "mpi", "nccl", "gloo", "none")  # make_baseline's kinds: auto is MPI on the CPU, NCCL on a GPU
INPROCESS = ("auto", "mpi", "nccl")  # --baseline's in-process baselines (gloo is a standalone peer there)
PEERS = ("mpich", "openmpi", "gloo")  # --baseline's standalone peers, each timed as a job of its own (peers.py)


def split_baselines(text: str) -> tuple[str, tuple[str, ...]]:
    """--baseline's comma list as (the in-process baseline, or "none"; the standalone
    peers in the order given). ValueError names what is wrong: an unknown name, two
    in-process baselines, or none beside anything else."""
    names = list(dict.fromkeys(w.strip().lower() for w in str(text).split(",")))
    unknown = [w for w in names if w not in (*INPROCESS, *PEERS, "none")]
    if unknown or not names:
        raise ValueError(
            f"unknown baseline {', '.join(map(repr, unknown or ['']))}; give a comma list of at most one of "
            f"{', '.join(INPROCESS)} (in-process) and any of {', '.join(PEERS)} (standalone jobs), or none"
        )
    if "none" in names and len(names) > 1:
        raise ValueError("--baseline none measures no baseline: it takes no other name beside it")
    inprocess = [w for w in names if w in INPROCESS]
    if len(inprocess) > 1:
        raise ValueError(f"at most one in-process baseline, got {', '.join(inprocess)}")
    return (inprocess[0] if inprocess else "none"), tuple(w for w in names if w in PEERS)


def make_baseline(world, device: str, device_id: int | None, kind: str = "auto"):
    """The baseline `kind` (BASELINES; "auto": MPI on "cpu", NCCL on "cuda"). Raises
    BaselineUnavailable (with the reason) when it cannot be built."""
    kind = {"auto": "nccl" if device == "cuda" else "mpi"}.get(kind, kind)
    name = {"mpi": "MPI", "nccl": "NCCL", "gloo": "gloo"}[kind]
    if (kind == "nccl") != (device == "cuda"):
        raise BaselineUnavailable(f"the {name} baseline runs on {'a GPU' if kind == 'nccl' else 'the CPU'} only")
    try:
        if kind == "nccl":
            return NCCLBaseline(world, device_id or 0)
        return GlooBaseline(world) if kind == "gloo" else MPIBaseline(world)
    except BaselineUnavailable:
        raise
    except ImportError as e:
        raise BaselineUnavailable(f"{name} baseline: {e}") from e
    except Exception as e:  # NCCL or gloo setup failed (no library, unsupported setup): run without it
        if kind == "mpi":
            raise
        raise BaselineUnavailable(f"{name} baseline: {type(e).__name__}: {e}") from e


def _shared_unique_id(world, get_unique_id):
    """Rank 0's NCCL unique id on every rank. A failure on rank 0 (or an id that cannot
    be pickled for MPI) reaches every rank as BaselineUnavailable, so no rank is left
    waiting in the exchange."""
    uid, err = None, None
    if world.rank == 0:
        try:
            uid = get_unique_id()
            pickle.dumps(uid)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            uid, err = None, f"{type(e).__name__}: {e}"
    uid, err = world.bcast((uid, err), what="bench: NCCL unique id")
    if err:
        raise BaselineUnavailable(f"NCCL baseline: no unique id from rank 0 ({err})")
    return uid


def _bytes(a):
    """A byte view of array `a` (numpy or cupy), for data-movement calls."""
    return a.view(np.uint8)


def _code(a) -> int:
    return DTYPE_CODES[dtype_name(a.dtype)]


def _short_mpi_name(version: str) -> str:
    words = version.replace(",", " ").split()
    for i, w in enumerate(words):
        if w.upper() in ("MPICH", "OPEN", "MVAPICH", "MVAPICH2", "INTEL(R)") and i + 1 < len(words):
            if w.upper() == "MPICH" and words[i + 1].lower() == "version:" and i + 2 < len(words):
                return f"MPICH {words[i + 2]}"
            return " ".join(words[i : i + 3]) if w.upper() == "OPEN" else f"{w} {words[i + 1]}"
    return words[0] if words else "MPI"


def _nccl_version(mod) -> str:
    """libnccl's version: nccl4py's get_version() is a VersionInfo; CuPy's is an int."""
    try:
        v = mod.get_version()
    except Exception:  # noqa: BLE001 - the version is informational only
        return "?"
    lib = getattr(v, "libnccl", None)
    if lib is not None:
        return str(getattr(lib, "version", lib))
    if isinstance(v, int):
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"
    return str(v)
