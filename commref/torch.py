"""commref as a torch.distributed backend: ``import commref.torch`` registers "commref".

    import commref.torch  # registers the backend
    torch.distributed.init_process_group("commref")  # env:// as torchrun sets it, or store=...

Importing commref does not import torch; this module does, and registers the backend
named ``BACKEND`` ("commref") for the devices "cpu" and "cuda".

Contracts:

* **Rendezvous.** Ranks come from torch's Store (env://, tcp://, file://, or a store
  passed in), not from MPI: each process group's ranks build a StoreWorld
  (transports/store_world.py) on the store torch hands the backend, and a Communicator
  on it (CPU engine, one host). Its deadline is the group's ``timeout`` (torch's
  default: 30 minutes); ``$COMMREF_TIMEOUT`` does not apply.
* **Sub-groups** (``new_group``): torch creates a sub-group's backend on its member
  ranks only (non-members return before it, on the CPU), so a collective
  ``Communicator.split`` over the parent's ranks cannot be made there: a sub-group gets a
  Communicator of its own, on a StoreWorld over the sub-group's store.
* **Operations.** allreduce (and allreduce_coalesced), allgather, all_gather_single
  (``_allgather_base``, all_gather_into_tensor), reduce_scatter, reduce_scatter_single
  (``_reduce_scatter_base``, reduce_scatter_tensor), broadcast, reduce, gather, scatter,
  alltoall, all_to_all_single (``alltoall_base``; uneven splits through commref's
  alltoallv), send / recv, barrier. Reductions: ReduceOp SUM, PRODUCT, MIN, MAX, AVG
  (integers: the sum truncated toward zero, as NCCL's). Anything else (BAND, BOR, BXOR,
  PREMUL_SUM, recv from any source, a nonzero tag, a list of several tensors per rank for
  one call) raises ValueError naming the call.
* **Tensors.** CPU tensors of the dtypes in ``DTYPES`` (int8, uint8, int32, int64,
  uint32, uint64, float16, bfloat16, float32, float64), strided layout. Contiguous tensors
  are used in place (numpy views of their storage); a non-contiguous one is copied into a
  contiguous buffer and the result copied back. The forms that take lists of tensors
  (allgather, reduce_scatter, gather, scatter, alltoall) go through one contiguous buffer
  of the whole, copied from or to the list. Complex tensors reach the backend as
  real views where torch's wrappers make them (all_reduce SUM/AVG, all_gather_single,
  all_to_all_single); elsewhere, like bool, sparse, other dtypes, and CUDA tensors
  (this version carries CPU tensors only; without a GPU the message says so), they raise
  TypeError naming the call. Nothing is sent before the checks pass.
* **Asynchrony and order.** Every call returns a Work at once; one worker thread per
  process group runs the calls in the order they were made (every rank must make the same
  calls in the same order, as with every backend). ``wait`` raises the call's error;
  ``get_future`` completes with the output tensors. The tensors must stay unchanged until
  the Work completes. Sends and receives are posted, not run: those posted since the last
  flush run as one commref group (NCCL's ncclGroupStart/End) when one of their Works is
  waited on, polled or asked for its future, or when the next collective is posted; so
  batch_isend_irecv and isend/irecv pairs that cross do not deadlock.
* **Failure.** A call that fails in commref (a deadline, a mismatch, an abort) marks the
  world failed: every peer's waits raise CommAborted at once instead of at the deadline.
  So does an exception that ends this process (``sys.excepthook``, chained to the one
  before it) and an exit while calls of this rank are still unfinished (atexit). A clean
  exit without destroy_process_group and with nothing pending leaves the peers alone (they
  may still be finishing calls this rank completed). A process killed outright runs
  neither: its peers end at the group's deadline.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from commref.collectives.communicator import Communicator
from commref.transports.store_world import StoreWorld

__all__ = ["BACKEND", "DTYPES", "ProcessGroupCommref", "WorkCommref", "create_backend"]

BACKEND = "commref"

# torch dtype -> the numpy dtype commref reduces (collectives/verify.py's DTYPES).
DTYPES: dict[torch.dtype, np.dtype] = {
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}

_R = dist.ReduceOp.RedOpType
OPS: dict = {_R.SUM: "sum", _R.PRODUCT: "prod", _R.MIN: "min", _R.MAX: "max", _R.AVG: "avg"}


# ---- tensors ----


class _Buffer:
    """A tensor as commref sees it: `array`, a flat numpy view of contiguous memory
    (the tensor's own, or a contiguous copy whose result `finish` copies back)."""

    __slots__ = ("tensor", "contiguous", "array")

    def __init__(self, tensor: torch.Tensor, call: str, what: str) -> None:
        check_tensor(tensor, call, what)
        self.tensor = tensor
        self.contiguous = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.array = _view(self.contiguous)

    def finish(self) -> None:
        if self.contiguous is not self.tensor:
            with torch.no_grad():
                self.tensor.copy_(self.contiguous)


def _view(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a contiguous CPU tensor's elements (its storage, no copy)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=DTYPES[t.dtype])
    return flat.view(torch.uint8).numpy().view(DTYPES[t.dtype])


def check_tensor(t, call: str, what: str = "tensor") -> None:
    """TypeError naming `call` unless `t` is a strided CPU tensor of a dtype in DTYPES."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"commref: {call}: {what} must be a torch.Tensor, not {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"commref: {call}: {what} is a {t.layout} tensor; commref carries strided (dense) tensors")
    if t.device.type != "cpu":
        gpu = torch.cuda.is_available()
        why = "this version carries CPU tensors only"
        if not gpu:
            why = f"no GPU is present here, and {why}"
        raise TypeError(f"commref: {call}: {what} is on {t.device}; {why}: move it to the CPU")
    if t.dtype not in DTYPES:
        kind = "complex " if t.is_complex() else ""
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise TypeError(f"commref: {call}: {what} has the {kind}dtype {t.dtype}, which commref lacks; it has: {names}")


def _one(tensors, call: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"commref: {call}: one tensor per rank, got {len(tensors)}")
    return tensors[0]


def _same(tensors, like: torch.Tensor, call: str, what: str) -> None:
    for i, t in enumerate(tensors):
        check_tensor(t, call, f"{what}[{i}]")
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise ValueError(
                f"commref: {call}: {what}[{i}] is {t.numel()} x {t.dtype}; every one must be "
                f"{like.numel()} x {like.dtype}, as the input"
            )


def reduce_op(op, call: str) -> str:
    """commref's name of torch's ReduceOp `op`; ValueError naming `call` for the others."""
    kind = getattr(op, "op", op)
    name = OPS.get(kind)
    if name is None:
        raise ValueError(
            f"commref: {call}: ReduceOp {kind.name if hasattr(kind, 'name') else op} is not supported; "
            f"commref reduces with SUM, PRODUCT, MIN, MAX and AVG"
        )
    return name


# ---- works ----


class WorkCommref(dist.Work):
    """One call's completion. `wait` runs pending sends and receives first (module
    docstring), then blocks until the worker finished the call (bounded by the call's own
    deadline in commref) and raises its error; `get_future` completes with the outputs."""

    def __init__(self, pg: ProcessGroupCommref, outputs: list, p2p: bool = False) -> None:
        super().__init__()
        self._pg, self._p2p = weakref.ref(pg), p2p
        self.future: Future = Future()
        self.outputs = outputs
        self.done = threading.Event()
        self.error: BaseException | None = None

    def _flush(self) -> None:
        pg = self._pg()
        if self._p2p and pg is not None:
            pg.flush_p2p()

    def complete(self, error: BaseException | None) -> None:
        self.error = error
        self.done.set()
        if error is None:
            self.future.set_result(self.outputs)
        else:
            self.future.set_exception(error)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._flush()
        seconds = timeout.total_seconds() if timeout else 0
        if not self.done.wait(seconds if seconds > 0 else None):
            raise TimeoutError(f"commref: work not completed within {seconds} s")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        self._flush()
        return self.done.is_set()

    def is_success(self) -> bool:
        return self.done.is_set() and self.error is None

    def exception(self):
        return self.error

    def result(self) -> list:
        self.wait()
        return self.outputs

    def get_future(self) -> Future:
        self._flush()
        return self.future

    def synchronize(self) -> None:
        self.wait()


# ---- the process group ----


class ProcessGroupCommref(dist.ProcessGroup):
    """A torch ProcessGroup whose calls run on a commref Communicator (module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        seconds = timeout.total_seconds() if timeout else None
        seconds = seconds if seconds and seconds > 0 else None
        self.world = StoreWorld(store, rank, size, prefix="commref", timeout=seconds)
        self.comm = Communicator(self.world, device="cpu")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._p2p: list[tuple[str, _Buffer, int, WorkCommref]] = []
        self._lock = threading.Lock()  # posting order: the queue and the pending sends and receives
        self._closed = False
        self._works: weakref.WeakSet = weakref.WeakSet()  # the Works not yet completed, for _exit
        self._worker = threading.Thread(target=self._run, name=f"commref-pg-rank{rank}", daemon=True)
        self._worker.start()
        _live.add(self)

    # -- torch's identity --

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"ProcessGroupCommref(rank={self.rank()}, size={self.size()})"

    # -- the worker --

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            fn, work = task
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the Work's waiter
                self._failed(exc)
                work.complete(exc)
            else:
                work.complete(None)

    def _failed(self, exc: BaseException) -> None:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        self.world.mark_failed(reason)

    def _post(self, fn: Callable[[], None], outputs: list, buffers=()) -> WorkCommref:
        """Queues `fn` (the commref calls), then copies back the non-contiguous
        `buffers`; returns the Work. Runs pending sends and receives first."""
        work = WorkCommref(self, outputs)
        self._works.add(work)

        def task() -> None:
            fn()
            for b in buffers:
                b.finish()

        with self._lock:
            if self._closed:
                raise RuntimeError(f"commref: rank {self.rank()}: the process group was shut down")
            self._flush_locked()
            self._queue.put((task, work))
        return work

    def _post_p2p(self, kind: str, buf: _Buffer, peer: int) -> WorkCommref:
        work = WorkCommref(self, [buf.tensor], p2p=True)
        self._works.add(work)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"commref: rank {self.rank()}: the process group was shut down")
            self._p2p.append((kind, buf, peer, work))
        return work

    def flush_p2p(self) -> None:
        """Runs the sends and receives posted since the last flush, as one group."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if not self._p2p:
            return
        batch, self._p2p = self._p2p, []
        comm = self.comm

        def run() -> None:
            try:
                with comm.group():
                    for kind, buf, peer, _ in batch:
                        if kind == "send":
                            comm.send(buf.array, peer)
                        else:
                            comm.recv(buf.array, peer)
            except BaseException as exc:  # noqa: BLE001 - every Work of the group fails with it
                self._failed(exc)
                for *_, w in batch[1:]:
                    w.complete(exc)
                raise
            for kind, buf, _, _ in batch:
                if kind == "recv":
                    buf.finish()
            for *_, w in batch[1:]:
                w.complete(None)

        self._queue.put((run, batch[0][3]))

    # -- collectives --

    def allreduce(self, tensors, opts=None):
        call = "allreduce"
        t = _one(tensors, call)
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), call)
        b = _Buffer(t, call, "tensor")
        return self._post(lambda: self._allreduce(b.array, op), [t], [b])

    def _allreduce(self, a: np.ndarray, op: str) -> None:
        if a.size:
            self.comm.allreduce(a, a, op)

    def allreduce_coalesced(self, tensors, opts=None):
        call = "allreduce_coalesced"
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), call)
        bufs = [_Buffer(t, call, f"tensors[{i}]") for i, t in enumerate(tensors)]

        def run() -> None:
            for b in bufs:
                self._allreduce(b.array, op)

        return self._post(run, list(tensors), bufs)

    def broadcast(self, tensors, opts=None):
        call = "broadcast"
        t = _one(tensors, call)
        root = self._root(_opt(opts, "rootRank", 0), call)
        b = _Buffer(t, call, "tensor")
        return self._post(lambda: b.array.size and self.comm.broadcast(b.array, b.array, root), [t], [b])

    def reduce(self, tensors, opts=None):
        call = "reduce"
        t = _one(tensors, call)
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), call)
        root = self._root(_opt(opts, "rootRank", 0), call)
        b = _Buffer(t, call, "tensor")
        return self._post(lambda: b.array.size and self.comm.reduce(b.array, b.array, op, root), [t], [b])

    def allgather(self, output_tensors, input_tensors, opts=None):
        call = "allgather"
        t = _one(input_tensors, call)
        outs = _one(output_tensors, call)
        src = _Buffer(t, call, "input")
        if len(outs) != self.size():
            raise ValueError(f"commref: {call}: {len(outs)} output tensors for {self.size()} ranks")
        _same(outs, t, call, "outputs")
        n = t.numel()

        def run() -> None:
            if not n:
                return
            whole = np.empty(n * self.size(), dtype=src.array.dtype)
            self.comm.allgather(src.array, whole)
            for r, o in enumerate(outs):
                _copy_into(o, whole[r * n : (r + 1) * n])

        return self._post(run, [outs])

    def all_gather_single(self, output, input, opts=None):
        call = "all_gather_single"
        src, dst = _Buffer(input, call, "input"), _Buffer(output, call, "output")
        self._sizes(call, input, output, output.numel(), input.numel() * self.size(), "output", "size x input")
        return self._post(lambda: src.array.size and self.comm.allgather(src.array, dst.array), [output], [dst])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """all_gather_single of each (output, input) pair, in one Work (torch's coalescing manager)."""
        return self._coalesced(self.all_gather_single, outputs, inputs, opts, "all_gather_single_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        call = "reduce_scatter"
        t = _one(output_tensors, call)
        ins = _one(input_tensors, call)
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), call)
        dst = _Buffer(t, call, "output")
        if len(ins) != self.size():
            raise ValueError(f"commref: {call}: {len(ins)} input tensors for {self.size()} ranks")
        _same(ins, t, call, "inputs")

        def run() -> None:
            if not dst.array.size:
                return
            whole = np.concatenate([_view(i.contiguous()) for i in ins])
            self.comm.reduce_scatter(whole, dst.array, op)

        return self._post(run, [t], [dst])

    def reduce_scatter_single(self, output, input, opts=None):
        call = "reduce_scatter_single"
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), call)
        src, dst = _Buffer(input, call, "input"), _Buffer(output, call, "output")
        self._sizes(call, input, output, input.numel(), output.numel() * self.size(), "input", "size x output")
        run = lambda: dst.array.size and self.comm.reduce_scatter(src.array, dst.array, op)  # noqa: E731
        return self._post(run, [output], [dst])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """reduce_scatter_single of each (output, input) pair, in one Work."""
        return self._coalesced(self.reduce_scatter_single, outputs, inputs, opts, "reduce_scatter_single_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _coalesced(self, single, outputs, inputs, opts, call: str):
        if len(outputs) != len(inputs):
            raise ValueError(f"commref: {call}: {len(outputs)} outputs for {len(inputs)} inputs")
        works = [single(o, i, opts) for o, i in zip(outputs, inputs)]  # checked and queued in order
        return self._post(lambda: [w.wait() for w in works], list(outputs))

    def gather(self, output_tensors, input_tensors, opts=None):
        call = "gather"
        t = _one(input_tensors, call)
        root = self._root(_opt(opts, "rootRank", 0), call)
        src = _Buffer(t, call, "input")
        outs: list = []
        if self.rank() == root:
            outs = _one(output_tensors, call)
            if len(outs) != self.size():
                raise ValueError(f"commref: {call}: {len(outs)} output tensors for {self.size()} ranks")
            _same(outs, t, call, "outputs")
        n = t.numel()

        def run() -> None:
            if not n:
                return
            whole = np.empty(n * self.size(), dtype=src.array.dtype)  # looked at on the root only
            self.comm.gather(src.array, whole, root)
            for r, o in enumerate(outs):
                _copy_into(o, whole[r * n : (r + 1) * n])

        return self._post(run, [outs])

    def scatter(self, output_tensors, input_tensors, opts=None):
        call = "scatter"
        t = _one(output_tensors, call)
        root = self._root(_opt(opts, "rootRank", 0), call)
        dst = _Buffer(t, call, "output")
        ins: list = []
        if self.rank() == root:
            ins = _one(input_tensors, call)
            if len(ins) != self.size():
                raise ValueError(f"commref: {call}: {len(ins)} input tensors for {self.size()} ranks")
            _same(ins, t, call, "inputs")

        def run() -> None:
            if not dst.array.size:
                return
            if ins:
                whole = np.concatenate([_view(i.contiguous()) for i in ins])
            else:
                whole = np.empty(dst.array.size * self.size(), dtype=dst.array.dtype)
            self.comm.scatter(whole, dst.array, root)

        return self._post(run, [t], [dst])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        call = "alltoall"
        p = self.size()
        if len(output_tensors) != p or len(input_tensors) != p:
            have = f"{len(input_tensors)} inputs and {len(output_tensors)} outputs"
            raise ValueError(f"commref: {call}: {have} for {p} ranks")
        for i, t in enumerate(list(input_tensors) + list(output_tensors)):
            check_tensor(t, call, f"tensors[{i}]")
        dtype = input_tensors[0].dtype
        if any(t.dtype != dtype for t in list(input_tensors) + list(output_tensors)):
            raise ValueError(f"commref: {call}: every input and output must have one dtype")
        scounts = [t.numel() for t in input_tensors]
        rcounts = [t.numel() for t in output_tensors]

        def run() -> None:
            send = np.concatenate([_view(t.contiguous()) for t in input_tensors])
            recv = np.empty(sum(rcounts), dtype=send.dtype)
            if len(set(scounts)) == 1 and len(set(rcounts)) == 1 and scounts[0] == rcounts[0]:
                if send.size:
                    self.comm.alltoall(send, recv)
            else:
                self.comm.alltoallv(send, scounts, _displs(scounts), recv, rcounts, _displs(rcounts))
            for j, o in enumerate(output_tensors):
                off = sum(rcounts[:j])
                _copy_into(o, recv[off : off + rcounts[j]])

        return self._post(run, list(output_tensors))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        call = "all_to_all_single"
        p = self.size()
        src, dst = _Buffer(input, call, "input"), _Buffer(output, call, "output")
        if input.dtype != output.dtype:
            raise ValueError(f"commref: {call}: input is {input.dtype}, output {output.dtype}")
        scounts = _counts(input, input_split_sizes, p, call, "input")
        rcounts = _counts(output, output_split_sizes, p, call, "output")
        even = not input_split_sizes and not output_split_sizes

        def run() -> None:
            if even:
                if src.array.size:
                    self.comm.alltoall(src.array, dst.array)
            else:
                self.comm.alltoallv(src.array, scounts, _displs(scounts), dst.array, rcounts, _displs(rcounts))

        return self._post(run, [output], [dst])

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        return self._post(lambda: self.world.barrier(what="torch barrier"), [])

    # -- sends and receives --

    def send(self, tensors, dstRank: int, tag: int = 0):
        call = "send"
        self._tag(tag, call)
        t = _one(tensors, call)
        return self._post_p2p("send", _Buffer(t, call, "tensor"), self._peer(dstRank, call))

    def recv(self, tensors, srcRank: int, tag: int = 0):
        call = "recv"
        self._tag(tag, call)
        t = _one(tensors, call)
        return self._post_p2p("recv", _Buffer(t, call, "tensor"), self._peer(srcRank, call))

    def recv_anysource(self, tensors, tag: int = 0):
        raise ValueError("commref: recv_anysource: commref receives from a named peer only")

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        self.barrier().wait()

    # -- checks --

    def _root(self, root: int, call: str) -> int:
        if not 0 <= root < self.size():
            raise ValueError(f"commref: {call}: root {root} out of range for {self.size()} ranks")
        return int(root)

    def _peer(self, peer: int, call: str) -> int:
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"commref: {call}: peer {peer} is not another rank of {self.size()}")
        return int(peer)

    @staticmethod
    def _tag(tag: int, call: str) -> None:
        if tag:
            raise ValueError(
                f"commref: {call}: tag {tag}: commref matches sends and receives in posting order and has no tags"
            )

    @staticmethod
    def _sizes(call, input, output, have, want, which, rule) -> None:
        if input.dtype != output.dtype:
            raise ValueError(f"commref: {call}: input is {input.dtype}, output {output.dtype}")
        if have != want:
            raise ValueError(f"commref: {call}: {which} has {have} elements; {rule} is {want}")

    # -- teardown --

    def shutdown(self) -> None:
        """Runs what is queued, then closes the Communicator (collective) and the world."""
        with self._lock:
            if self._closed:
                return
            self._flush_locked()
            self._closed = True
            self._queue.put(None)
        self._worker.join(timeout=self.comm.timeout + 5)
        try:
            self.comm.close()
        finally:
            self.world.free()
            _live.discard(self)

    def abort(self) -> None:
        self.world.mark_failed("the process group was aborted")
        self.comm.abort()

    def _exit(self, reason: str | None) -> None:
        """The process ends without shutdown: with an exception (`reason`) or with calls
        unfinished, the peers' waits fail at once (module docstring, Failure)."""
        if self._closed:
            return
        if reason is None and self._unfinished():
            reason = "it exited with calls unfinished"
        if reason is not None:
            self.world.mark_failed(f"rank {self.rank()}: {reason}")

    def _unfinished(self) -> bool:
        with self._lock:
            return bool(self._p2p) or any(not w.done.is_set() for w in list(self._works))


def _opt(opts, name: str, default):
    return default if opts is None else getattr(opts, name, default)


def _copy_into(t: torch.Tensor, flat: np.ndarray) -> None:
    with torch.no_grad():
        t.copy_(torch.from_numpy(flat.view(np.uint8).copy()).view(t.dtype).reshape(t.shape))


def _displs(counts: list[int]) -> list[int]:
    return [int(x) for x in np.cumsum([0] + list(counts))[:-1]]


def _counts(t: torch.Tensor, splits, p: int, call: str, what: str) -> list[int]:
    """Elements per peer of all_to_all_single's `what`, from its split sizes (rows of
    dim 0) or, none given, equal blocks."""
    rows = t.shape[0] if t.dim() else 1
    per_row = t.numel() // rows if rows else 0
    if not splits:
        if t.numel() % p:
            raise ValueError(f"commref: {call}: {what} has {t.numel()} elements, not a multiple of {p} ranks")
        return [t.numel() // p] * p
    if len(splits) != p or sum(splits) != rows:
        rule = f"must be {p} values summing to {rows} rows"
        raise ValueError(f"commref: {call}: {what} split sizes {list(splits)} {rule}")
    return [int(s) * per_row for s in splits]


# ---- registration ----

_live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _at_exit() -> None:
    for pg in list(_live):
        pg._exit(None)


_prior_excepthook = sys.excepthook


def _excepthook(kind, value, tb) -> None:
    for pg in list(_live):
        pg._exit(" ".join(f"{kind.__name__}: {value}".split()))
    _prior_excepthook(kind, value, tb)


sys.excepthook = _excepthook


def create_backend(opts, backend_options=None) -> ProcessGroupCommref:
    """torch's creator of the "commref" backend (extended API): one ProcessGroupCommref
    per process group, on the group's store, rank, size and timeout."""
    return ProcessGroupCommref(opts.store, opts.group_rank, opts.group_size, opts.timeout)


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, create_backend, extended_api=True, devices=["cpu", "cuda"])


_register()
