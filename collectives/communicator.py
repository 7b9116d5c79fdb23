"""Communicator: the collectives, sends and receives of a world's ranks, nccl4py-shaped.

Method names and argument order follow nccl4py (allreduce(sendbuf, recvbuf, op), ...,
alltoallv(sendbuf, sendcounts, sdispls, recvbuf, recvcounts, rdispls), send(sendbuf,
peer), recv(recvbuf, peer)); in place with NCCL's layouts (catalogue.py); groups
(groups.py); split(color, key) makes a child communicator (ncclCommSplit). Buffers are
checked before anything is launched (buffers.py: TypeError or ValueError on the rank
that got them). What must agree across ranks (collective, algorithm, dtype, op, root,
count) travels with every pipeline step: a rank whose peer called something else fails
with CommMismatch instead of hanging. A failed wait raises CommTimeout naming rank,
peer, what was awaited, expected and seen; afterwards the communicator refuses calls.

On a GPU calls are asynchronous, as NCCL's: launches go on the communicator's stream,
joined to the caller's by events (gpu_stream.py); a kernel's failure is raised at
synchronize() or the next call.

A call goes through three layers, as NCCL's enqueue pipeline: management (the methods
validate and record it: calls.record_call, p2p.P2pLauncher.record; groups.py holds a group's records),
preparation (calls.CallPlanner) and scheduling (schedule.Scheduler: each call on its
path, a group's sends and receives in one launch). A single call is a group of one; on
the CPU a call that repeats an earlier one on the same arrays (launch_record.RepeatedCall)
goes straight to its launch, and a group is one launch where its paths allow (schedule.py),
kept while its members repeat.
"""

from __future__ import annotations

import inspect

import numpy as np

from commref.device_kernels import abi, cpu_loader, gpu_loader
from commref.transports.errors import CommAborted
from commref.transports.gin.plan import plan_gin

from . import groups, p2p, p2p_collectives, rma, setup, tuner
from .buffers import BufferChecker
from .calls import GIVEN, CallPlanner, kernel_spec, record_call
from .gpu_stream import GpuStream, place_on_gpus, use_rank_gpu
from .hierarchical import Hierarchy, NodeShape
from .launch_record import RepeatedCall
from .options import CommOptions, resolve_device
from .routes import DirectRouter
from .schedule import Scheduler
from .symmetric import SymmetricWindows


class Communicator:
    """Collectives among the ranks of `world` on `device` ("auto", "cpu" or "cuda").

    Options: CommOptions (options.py; GIN's: transports/gin/options.py), as keywords or
    `options=`: algorithm, protocol, channels, FIFO geometry, threads, timeout (default:
    world.timeout), GPU (default: use_rank_gpu), path (lsa, gin or auto) with its GIN
    backend, wire and network; collectives take `algorithm=` and `protocol=` per call.

    Symmetric buffers (alloc_symmetric: every peer reaches them): collectives with a
    direct kernel (kernels/direct.cu) run it there, each byte read once where its owner
    left it and stored where it must land (routes.py says when).

    Several nodes (hierarchical.py): with N nodes of L >= 2 consecutive ranks each,
    AllReduce, ReduceScatter and AllGather also run "hierarchical": inside each node over
    LSA, across nodes over GIN, on two child communicators that the first such call (or
    alloc_symmetric) builds collectively; alloc_symmetric then allocates in the node's
    windows, where the intra-node phases run direct kernels.
    """

    def __init__(self, world, device: str = "auto", *, options: CommOptions | None = None, **kwargs):
        if options is None:
            options = CommOptions.from_kwargs(device=device, **kwargs)
        elif kwargs or device != "auto":
            options = options.replace(**kwargs, **({"device": device} if device != "auto" else {}))
        o = self.options = options
        self.world, self.rank, self.nranks = world, world.rank, world.size
        self.device = resolve_device(o.device)
        self.algorithm, self.protocol = o.algorithm.value, o.protocol.value  # protocol: tuner.plan
        d = tuner.defaults(self.device, world.local_size)
        self.max_channels, self.nsteps = o.max_channels or d.max_channels, o.nsteps or d.nsteps
        self.threads = o.threads or d.threads
        self.window_channels = self.max_channels + abi.p2p_channels(self.nranks)  # p2p's after them (p2p.py)
        self.timeout = o.timeout or world.timeout
        self.broken: str | None = None  # why the communicator refuses further calls (a failure, close)
        self._closed, places = False, None
        self.owns_world = False  # a child of split(): close() frees its world too
        self.gpu_stream: GpuStream | None = None  # every launch's stream on a GPU (None: the CPU engine)
        if self.device == "cuda":
            # An explicit device_id leaves the caller's current device alone; the default
            # (use_rank_gpu) makes this rank's GPU current, so its buffers land there.
            self.device_id = use_rank_gpu(world) if o.device_id is None else o.device_id
            self.kernels = gpu_loader.cuda_kernels(self.device_id)
            places, on_device = place_on_gpus(world, self.device_id)  # collective
            self.gpu_stream = GpuStream(self.rank, self.device_id, on_device)
        else:
            self.device_id = None
            self.kernels = cpu_loader.cpu_kernels()
        self._check = BufferChecker(self.rank, self.nranks, self.device, self.device_id)

        self.device_signal_words, device_signals = setup.signal_words(o, self.nranks)
        self.rma: rma.Rma | None = None  # the host one-sided calls' state (rma.py), from their first use
        self.gin = plan_gin(world, o.gin, self.device, self.window_channels, self.nsteps, device_signals)
        self.protocol_refusals = setup.protocol_refusals(
            world, self.device, self.kernels, places, self.gin, self.protocol
        )
        self.peer_mask, self.path = self.gin.peer_mask, o.gin.path.value
        self.backend, self.transport, self.network = self.gin.backend, self.gin.transport, self.gin.network
        self.slot_bytes = o.slot_bytes or tuner.defaults(self.device, world.local_size, self.network).slot_bytes
        c = setup.connect(self, device_signals)  # collective
        self.layout, self.device_window_offset, self.window = c.layout, c.device_window_offset, c.window
        self.gin_region, self.proxy, self._host, self._ring_ranks = c.region, c.proxy, c.host, c.ring_ranks  # kept
        self.launch_record, self.node_shape = c.record, c.node_shape  # the CollArgs every launch reads
        self._hierarchy: Hierarchy | None = None  # built by the first call that needs it
        # Direct kernels over LSA load and store; with GIN peers they push (routes.py).
        self.gin_direct_refusal = self.gin.direct_refusal(self.proxy)
        self._router = DirectRouter(
            self.nranks, self.peer_mask, self.gin_direct_refusal, isinstance(self.node_shape, NodeShape)
        )
        engine = self.proxy if self._router.engine_carries_windows else None  # it carries the symmetric windows
        self._symmetric = SymmetricWindows(world, self.device, self.device_id or 0, self.window, gin_engine=engine)
        self._planner = CallPlanner(self, c.slow_network, self.gpu_stream)  # preparation
        self._scheduler = Scheduler(self, self._planner, c.host)  # scheduling
        if self.gpu_stream is None:
            record_in_c(self)
        world.barrier(what="communicator ready")

    # ---- what device_api and the tests use ----

    def device_table(self, table: np.ndarray):
        """`table` where the kernels read it: itself on the CPU, a device copy on a GPU (GpuStream)."""
        return table if self.gpu_stream is None else self.gpu_stream.device_table(table)

    @property
    def failed(self) -> bool:
        """Whether a kernel of this communicator recorded a failure not raised yet."""
        return self._host.failed

    def failure(self) -> Exception:
        """The exception a kernel's failure record describes; the communicator is unusable after it."""
        exc = self._host.failure(self.rank, self.timeout)
        self.broken = f"an earlier call failed: {exc}"
        return exc

    def end_launch(self, status: int, refused=None) -> None:
        """After a launch of this communicator's (a collective's, or a user's kernel,
        device_api.Kernel): raises the GIN proxy's failure, else the kernel's (`status`
        nonzero), else, for abi.LAUNCH_REFUSED, refused() when given."""
        if self.proxy is not None and self.proxy.error is not None:
            self.broken = f"an earlier call failed: GIN proxy failed: {self.proxy.error}"
            raise self.proxy.error
        if status:
            if status == abi.LAUNCH_REFUSED and refused is not None:
                raise refused()
            raise self.failure()

    @property
    def direct_kernels(self) -> str | None:
        """How this communicator's direct kernels run on buffers from alloc_symmetric:
        "lsa" (loads and stores), "push" (over GIN) or None (none run: routes.py)."""
        return self._router.kind

    def planned(self, coll: str | None = None, count: int | None = None, symmetric: bool | None = None):
        """The CallPlans made so far, oldest first, of the calls of `coll` with `count`
        elements on buffers routed to a direct kernel or not (None: any; for reports)."""
        return self._planner.planned(coll, count, symmetric)

    def clear_plans(self) -> None:
        """Drops every plan and kept call: the next calls are planned afresh."""
        self._planner.plans.clear()
        self._scheduler.forget()

    kept_calls = property(lambda self: len(self._scheduler.repeated), doc="CPU calls kept (RepeatedCall)")
    kept_groups = property(lambda self: len(self._scheduler.groups), doc="CPU groups kept (FusedLaunch)")
    launches = property(lambda self: self._scheduler.launches, doc="kernel launches so far (a fused group: 1)")
    packed_groups = property(lambda self: self._scheduler.packed, doc="CPU groups run packed into one (packing.py)")
    symmetric_windows = property(lambda self: len(self._symmetric), doc="windows from alloc_symmetric held")

    # ---- collectives (nccl4py names and argument order) ----

    def allreduce(self, sendbuf, recvbuf, op="sum", *, stream=None, algorithm=None, protocol=None) -> None:
        self._collective("allreduce", sendbuf, recvbuf, op, 0, stream, algorithm, protocol)

    def reduce_scatter(self, sendbuf, recvbuf, op="sum", *, stream=None, algorithm=None, protocol=None) -> None:
        self._collective("reduce_scatter", sendbuf, recvbuf, op, 0, stream, algorithm, protocol)

    def allgather(self, sendbuf, recvbuf, *, stream=None, algorithm=None, protocol=None) -> None:
        self._collective("allgather", sendbuf, recvbuf, None, 0, stream, algorithm, protocol)

    def broadcast(self, sendbuf, recvbuf, root: int, *, stream=None, algorithm=None, protocol=None) -> None:
        self._collective("broadcast", sendbuf, recvbuf, None, root, stream, algorithm, protocol)

    def reduce(self, sendbuf, recvbuf, op="sum", root: int = 0, *, stream=None, algorithm=None, protocol=None) -> None:
        self._collective("reduce", sendbuf, recvbuf, op, root, stream, algorithm, protocol)

    def alltoall(self, sendbuf, recvbuf, *, stream=None, algorithm=None, protocol=None) -> None:
        """ncclAlltoAll: sendbuf and recvbuf hold nranks * count elements each; block j of
        sendbuf lands in block `rank` of rank j's recvbuf. Out of place only (NCCL has no
        in-place alltoall: overlapping buffers raise ValueError). Algorithms: "ring" (plain
        buffers, forwarded along the ring), "direct" (recvbufs from alloc_symmetric, every
        peer over LSA: each block stored once into its peer's recvbuf)."""
        self._collective("alltoall", sendbuf, recvbuf, None, 0, stream, algorithm, protocol)

    # ---- composed of sends and receives (nccl4py names and argument order; contracts: p2p_collectives.py) ----

    gather, scatter, alltoallv = p2p_collectives.gather, p2p_collectives.scatter, p2p_collectives.alltoallv

    # ---- point-to-point and groups (nccl4py names and argument order: p2p.py, groups.py) ----

    def send(self, sendbuf, peer: int, *, stream=None) -> None:
        """ncclSend: sendbuf's bytes to `peer`, whose recv must post the same dtype and
        count. Completes once the peer's recv has taken it: post both in one group."""
        self._p2p(p2p.SEND, sendbuf, peer, stream)

    def recv(self, recvbuf, peer: int, *, stream=None) -> None:
        """ncclRecv: fills recvbuf from `peer`'s send of the same dtype and count."""
        self._p2p(p2p.RECV, recvbuf, peer, stream)

    def _p2p(self, kind, buf, peer, stream) -> None:
        groups.submit(self._scheduler, self._scheduler.p2p.record(kind, buf, peer, stream))

    group_start, group_end, group = (staticmethod(f) for f in (groups.group_start, groups.group_end, groups.group))

    # ---- symmetric memory ----

    def alloc_symmetric(self, count: int, dtype="float32"):
        """Collective: a zeroed array of `count` elements of `dtype` in a new symmetric
        window (ncclMemAlloc + ncclCommWindowRegister, NCCL_WIN_COLL_SYMMETRIC): every
        rank calls it with the same size, in the same order; numpy on the CPU, CuPy on a
        GPU; peers map it until free_symmetric() or close(). On several nodes that can run
        "hierarchical", it lives in the intra-node child's windows: the node's ranks map it."""
        self._scheduler.forget()  # whether a buffer is symmetric may change
        if isinstance(self.node_shape, NodeShape):
            return self.hierarchy().intra.alloc_symmetric(count, dtype)
        return self._symmetric.alloc(count, dtype)

    def free_symmetric(self, array) -> None:
        """Collective: releases a window from alloc_symmetric (NCCL's
        ncclCommWindowDeregister + ncclMemFree). Every rank must free the same window
        (the n-th allocation on every rank), after every collective on it has completed;
        a mismatch raises ValueError on every rank. The array no longer counts as
        symmetric; on a GPU its memory is freed (on the CPU it lives while referenced)."""
        self._scheduler.forget()
        if self._hierarchy is not None:
            self._hierarchy.intra.free_symmetric(array)
            return
        address = self._check.buffer(array, "array").address
        self.synchronize()
        self._symmetric.free(address)

    # ---- host one-sided calls (nccl4py names and argument order; contracts: rma.py) ----

    register_window, deregister_window = rma.register_window, rma.deregister_window
    put_signal, signal, wait_signal = rma.put_signal, rma.signal, rma.wait_signal

    # ---- management, preparation, scheduling ----

    def _collective(self, coll, sendbuf, recvbuf, op, root, stream, algorithm, protocol, avg_divisor=None, flat=False):
        """One call. `avg_divisor` (op avg): divide by this, not nranks (a hierarchical
        phase divides by the job's ranks); `flat`: never hierarchical (its own tail);
        `protocol`: of the ring and tree steps (None: the communicator's). In a group it is
        recorded as given (calls.GIVEN) and checked when the group ends; on the CPU engine
        the collective methods record it in C instead (record_in_c), this record's copy."""
        group = groups.state.open
        if group is not None:  # a member of this thread's group (groups.py), recorded as given
            group.calls.append((sendbuf, recvbuf, coll, op, root, stream, algorithm, protocol, avg_divisor, flat))
            group.schedulers.append(self._scheduler)
            return
        member = self._resolve(sendbuf, recvbuf, coll, op, root, stream, algorithm, protocol, avg_divisor, flat)
        if member.__class__ is RepeatedCall:
            self._scheduler.run_cpu(member)
        else:
            self._scheduler.launch([member])

    def _resolve(self, sendbuf, recvbuf, coll, op, root, stream, algorithm, protocol, avg_divisor, flat):
        """Management: the kept call (RepeatedCall) that these arguments (calls.GIVEN's
        order after the arrays) repeat on unchanged arrays, or the checked Call of them."""
        # The kept call's key (a dict key only, never read by position: a plain tuple is the cheapest).
        repeat = (coll, id(sendbuf), id(recvbuf), op, root, root.__class__, algorithm, protocol, avg_divisor, flat)
        try:
            again = self._scheduler.repeated.get(repeat)
        except TypeError:  # an unhashable argument: the checks below say what is wrong with it
            again = repeat = None
        if again is not None and not self.broken and again.matches(sendbuf, recvbuf):
            return again
        call = record_call(self, coll, sendbuf, recvbuf, op, root, stream, algorithm, avg_divisor, flat, protocol)
        call.repeat, call.given = repeat, (coll, op, root, stream, algorithm, protocol, avg_divisor, flat)
        return call

    def check_usable(self, what: str = "communicator") -> None:
        """Raises CommAborted when a failure (or abort) has left this communicator broken."""
        if self.broken:
            message = f"rank {self.rank}: {what} unusable: {self.broken}"
            raise CommAborted(message, rank=self.rank, origin_rank=None, reason=self.broken)

    def split(self, color: int, key: int | None = None, **options) -> Communicator | None:
        """Collective (ncclCommSplit, setup.split): a child of the ranks passing the same
        `color` (int >= 0; SPLIT_NOCOLOR: none, None returned), ranked by `key` (default:
        rank; ties by rank), with this communicator's options, `options` replacing some."""
        self.check_usable()
        return setup.split(self, color, key, options, Communicator)

    def hierarchy(self) -> Hierarchy:
        """Collective on first use: the intra- and inter-node child communicators (split
        worlds; this communicator's options, the algorithm left to their tuners)."""
        if self._hierarchy is None:
            self._hierarchy = setup.hierarchy(self, Communicator)
        return self._hierarchy

    # ---- kernels, completion, teardown ----

    kernel_spec = staticmethod(kernel_spec)

    def prepare(self, specs) -> None:
        """Collective: builds and loads the kernels for these specs on every rank, then
        waits for all ranks. On a GPU, do this before a sweep over new dtypes and ops:
        loading a module while collective kernels run could wait on them."""
        self.kernels.prepare(specs)
        self.world.barrier(what="kernels prepared")

    def synchronize(self, stream=None) -> None:
        """GPU: waits for this communicator's kernels and for `stream` (None: CuPy's
        current stream), then raises the failure a kernel recorded, if any."""
        if self.gpu_stream is not None:
            self.gpu_stream.synchronize(self.gpu_stream.caller(stream), self)

    def abort(self) -> None:
        """ncclCommAbort, from any thread: this rank's running launch ends at its waits'
        next polls, raising CommAborted, as every later call does. Local, as NCCL's: a peer
        waiting on this rank ends at its deadline unless it aborts too (launch_record)."""
        self.broken = self.broken or "it was aborted (Communicator.abort)"
        if not self._closed:
            self._host.abort(self.rank)

    def close(self) -> None:
        """Collective: releases the communicator's windows and host words; idempotent.
        In the order that keeps every peer safe, and with deadlines, so that it returns
        after a failure too (setup.release says how). Raises the first teardown error
        (a barrier, the proxy) unless the communicator had already failed."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for name in RECORDED:  # the methods answer from now on; no Recorder holds this communicator
            self.__dict__.pop(name, None)
        if getattr(self, "rma", None) is not None:  # the engine that carried them stops below
            self.rma.invalidate()
        errors = setup.release(self)
        if self.owns_world:
            self.world.free()
        self.proxy = None
        broken, self.broken = self.broken, self.broken or "it was closed"
        if errors and not broken:
            raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Closes the communicator. An exception leaving the block abandons this rank's
        sequence of collectives while peers may wait in one: the world is marked failed
        first (World.mark_failed: a ThreadWorld's peers raise CommAborted at once, and
        close() waits for no peer), so the job ends now, not at a deadline."""
        if exc_type is not None and not getattr(self, "_closed", True):
            reason = f"{exc_type.__name__}: {exc}" if str(exc) else exc_type.__name__
            self.world.mark_failed(" ".join(reason.split()))
        try:
            self.close()
        except Exception:
            if exc_type is None:
                raise  # else the exception in flight is the one to see


# The collective methods that record_in_c makes commref_pycall.Recorders, each named for
# its collective (the name it passes Communicator._collective).
RECORDED = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall")


def record_in_c(comm: Communicator) -> None:
    """Where the commref_pycall extension loads: ``with group():`` becomes its GroupScope
    (groups.use_scope: for every communicator of the process from then on), and each
    RECORDED method of `comm` a Recorder, which records a call in this thread's group
    (groups.state) as the method does (Communicator._collective: calls.GIVEN's record, the
    method's defaults filled in) at a fraction of its cost; the method answers every other
    call. The record is read off the method's signature: positional parameters after the
    two buffers and keyword-only ones fill the GIVEN fields they name, the rest is what
    every method passes (op None, root 0, avg_divisor None, flat False)."""
    extension = cpu_loader.pycall()
    if extension is None:
        return
    if not isinstance(groups.group(), extension.GroupScope):  # with group(): the same in C
        groups.use_scope(extension.GroupScope(groups.state, groups.launch))
    fields = ("sendbuf", "recvbuf", *GIVEN)
    for name in RECORDED:
        method = getattr(comm, name)
        base = dict(zip(fields, (None, None, name, None, 0, None, None, None, None, False)))
        positional, required, keywords = [], 0, {}
        for p in list(inspect.signature(method).parameters.values())[2:]:
            if p.default is not p.empty:
                base[p.name] = p.default
            if p.kind is p.POSITIONAL_OR_KEYWORD:
                positional.append(fields.index(p.name))
                required += p.default is p.empty
            keywords[p.name] = fields.index(p.name)
        record = tuple(base.values())
        setattr(
            comm,
            name,
            extension.Recorder(method, groups.state, comm._scheduler, record, (*positional,), required, keywords),
        )
