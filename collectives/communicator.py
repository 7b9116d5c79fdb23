"""Communicator: the collectives of a world's ranks, nccl4py-shaped.

Method names and argument order follow nccl4py: allreduce(sendbuf, recvbuf, op),
allgather(sendbuf, recvbuf), reduce_scatter(sendbuf, recvbuf, op),
broadcast(sendbuf, recvbuf, root), reduce(sendbuf, recvbuf, op, root); in place with
NCCL's layouts (catalogue.py). Buffers are checked before anything is launched
(buffers.py: TypeError / ValueError on the rank that got them). Arguments that must
agree across ranks (collective, algorithm, dtype, op, root, count) travel with every
pipeline step; a rank whose peer called something else fails with CommMismatch
instead of hanging. A failed wait raises CommTimeout naming rank, peer, what was
awaited, expected and seen; afterwards the communicator refuses further calls.
"""

from __future__ import annotations

import time

import numpy as np

from commref.device_kernels import abi, loader
from commref.transports.errors import CapabilityError, CommAborted
from commref.transports.gin.plan import plan_gin
from commref.transports.windows import register_window

from . import catalogue, topology, tuner
from .buffers import BufferChecker
from .launch import CallPlan, HostWords, LaunchRecord, address_of, plan_fields
from .options import CommOptions, resolve_device
from .symmetric import SymmetricWindows
from .verify import DTYPE_CODES, OPS, dtype_name


class Communicator:
    """Collectives among the ranks of `world` on `device` ("auto", "cpu" or "cuda").

    Options (collectives/options.py, CommOptions; as keywords or `options=`):
    `algorithm` ("auto", "ring", "tree", "direct"), `max_channels` (blocks per launch;
    also sizes the window), `slot_bytes` and `nsteps` (FIFO geometry), `threads` per
    block, `timeout` seconds for every wait (default: world.timeout), `device_id`,
    `stream_stores` ("auto", "on", "off": on the CPU, whether what another core reads
    next is stored past the cache; auto measures both, tuner.StoreChooser).

    Paths (transports/gin/options.py, GinOptions): `path="lsa"` (every peer by
    load/store; all ranks on one host), "gin" (every peer through the GIN proxy) or
    "auto" (LSA where the peer's window is mapped, GIN otherwise); for GIN `backend`,
    `wire`, `network`, `seed` of the unordered wire, `gin_protocol` (only "strong" is
    safe everywhere), `puts_per_slot`, `gin_queue`, `gin_counters`, `segment_bytes`.

    Symmetric buffers: arrays from `alloc_symmetric` can be loaded from and stored to
    by every peer, so collectives with a direct kernel (kernels/direct.cu) run it on
    them when every rank passes symmetric buffers where peers access them
    (catalogue.Collective.peer_accessed) and every peer is over LSA: each byte is read
    once where its owner left it and stored where it must land, instead of being
    copied twice through a FIFO.
    """

    def __init__(self, world, device: str = "auto", *, options: CommOptions | None = None, **kwargs):
        if options is None:
            options = CommOptions.from_kwargs(device=device, **kwargs)
        elif kwargs or device != "auto":
            options = options.replace(**kwargs, **({"device": device} if device != "auto" else {}))
        self.world, self.options = world, options
        o = options
        self.rank, self.nranks = world.rank, world.size
        self.device = resolve_device(o.device)
        self.algorithm = o.algorithm.value
        defaults = tuner.defaults(self.device, world.local_size)
        self.max_channels = o.max_channels or defaults.max_channels
        self.slot_bytes = o.slot_bytes or defaults.slot_bytes
        self.nsteps = o.nsteps or defaults.nsteps
        self.threads = o.threads or defaults.threads
        self.timeout = o.timeout or world.timeout
        self._broken: str | None = None
        self._stores = tuner.StoreChooser(o.stream_stores.value)
        if self.device == "cuda":
            import cupy

            self.device_id = cupy.cuda.Device().id if o.device_id is None else o.device_id
            self.kernels = loader.cuda_kernels(self.device_id)
        else:
            self.device_id = None
            self.kernels = loader.cpu_kernels()
        self._check = BufferChecker(self.rank, self.nranks, self.device, self.device_id)

        self.gin = plan_gin(world, o.gin, self.device, self.max_channels, self.nsteps)
        self.peer_mask, self.path = self.gin.peer_mask, o.gin.path.value
        self.backend, self.transport, self.network = self.gin.backend, self.gin.transport, self.gin.network
        layout, nbytes = abi.window_layout(self.max_channels, self.slot_bytes, self.nsteps,
                                           o.gin.queue if self.gin.used else 0, o.gin.counters, self.nranks)
        self.window = register_window(world, nbytes, self.device, self.device_id or 0)
        missing = [r for r in range(self.nranks) if self.window.peer_addresses[r] == 0 and
                   not (self.peer_mask >> r) & 1]
        if missing:
            self.window.close()
            raise CapabilityError(
                f"rank {self.rank}: ranks {missing} cannot map this rank's window (not in its LSA team "
                f"{self.window.lsa_ranks}); the LSA path needs every rank on one host (use path='auto' or 'gin')")
        self.proxy = self.gin.start_proxy(world, self.window, layout)
        self._host = HostWords(world.abort_word, self.device)
        self._record = LaunchRecord()
        a = self._record.record
        a["peerWindows"] = address_of(self.window.peer_table)
        a["errorRecord"] = self._host.error_address
        a["abortFlag"] = self._host.abort_address
        a["timeoutNs"] = int(self.timeout * 1e9)
        a["layout"] = layout
        a["rank"], a["nranks"] = self.rank, self.nranks
        self.gin.fill_args(a["gin"], self.max_channels, self.nsteps)
        a["peers"] = topology.channel_peers(self.rank, self.nranks, self.max_channels)
        self._symmetric = SymmetricWindows(world, self.device, self.device_id or 0, self.window)
        self._direct_possible = not self.peer_mask and self.nranks <= abi.DIRECT_MAX_RANKS
        self._calls: dict = {}  # call signature -> CallPlan
        world.barrier(what="communicator ready")

    # ---- collectives (nccl4py names and argument order) ----

    def allreduce(self, sendbuf, recvbuf, op="sum", *, stream=None, algorithm: str | None = None) -> None:
        self._collective("allreduce", sendbuf, recvbuf, op, 0, stream, algorithm)

    def reduce_scatter(self, sendbuf, recvbuf, op="sum", *, stream=None, algorithm: str | None = None) -> None:
        self._collective("reduce_scatter", sendbuf, recvbuf, op, 0, stream, algorithm)

    def allgather(self, sendbuf, recvbuf, *, stream=None, algorithm: str | None = None) -> None:
        self._collective("allgather", sendbuf, recvbuf, None, 0, stream, algorithm)

    def broadcast(self, sendbuf, recvbuf, root: int, *, stream=None, algorithm: str | None = None) -> None:
        self._collective("broadcast", sendbuf, recvbuf, None, root, stream, algorithm)

    def reduce(self, sendbuf, recvbuf, op="sum", root: int = 0, *, stream=None,
               algorithm: str | None = None) -> None:
        self._collective("reduce", sendbuf, recvbuf, op, root, stream, algorithm)

    # ---- symmetric memory ----

    def alloc_symmetric(self, count: int, dtype="float32"):
        """Collective: a zeroed array of `count` elements of `dtype` in a new symmetric
        window (NCCL's ncclMemAlloc + ncclCommWindowRegister with
        NCCL_WIN_COLL_SYMMETRIC): every rank must call it with the same size, in the
        same order, and every peer maps it. numpy on the CPU, CuPy on a GPU; peers map
        it until free_symmetric() or close()."""
        return self._symmetric.alloc(count, dtype)

    def free_symmetric(self, array) -> None:
        """Collective: releases a window from alloc_symmetric (NCCL's
        ncclCommWindowDeregister + ncclMemFree). Every rank must free the same window
        (the n-th allocation on every rank), after every collective on it has completed;
        a mismatch raises ValueError on every rank. Peers no longer map it, so the
        array no longer counts as symmetric. On the CPU the array stays valid memory
        for as long as it is referenced; on a GPU the memory is freed and the array must
        not be used again."""
        address = self._check.buffer(array, "array").address
        self.synchronize()
        self._symmetric.free(address)

    # ---- launch ----

    def _collective(self, coll: str, sendbuf, recvbuf, op, root, stream, algorithm) -> None:
        spec = catalogue.CATALOGUE[coll]
        if spec.rooted:
            root = self._check.root(root)
        s, r, count = self._check.call(spec, sendbuf, recvbuf, root)
        if self._broken:
            raise CommAborted(f"rank {self.rank}: communicator unusable after an earlier failure: {self._broken}",
                              rank=self.rank, origin_rank=None, reason=self._broken)
        sym = None
        if self._symmetric.windows and self._direct_possible and "direct" in spec.kernels:
            sym = self._symmetric.direct(spec, s, r)
        key = (coll, algorithm or self.algorithm, count, s.dtype, op, root, sym is not None)
        plan = self._calls.get(key)
        if plan is None:
            plan = self._calls[key] = self._plan_call(spec, key[1], s.dtype, count, op, root, sym is not None)
        record = self._record
        if plan.direct:
            record.set_symmetric(sym)
        if self.device == "cpu":
            big = s.nbytes >= tuner.STORE_CHOOSER_MIN_BYTES  # small calls skip the placement test
            streamed, store_key = self._stores.choose(plan.kernel, s.nbytes, big and s.overlaps(r))
            record.set_call(plan, s.address, r.address, streamed)
            t0 = time.perf_counter()
            status = self.kernels.launch(plan.kernel, plan.nchannels, self.threads, record.args, stream, plan.spec,
                                         record.address)
            if store_key is not None and not status:
                self._stores.record(store_key, streamed, time.perf_counter() - t0, s.nbytes)
        else:
            record.set_call(plan, s.address, r.address)
            status = self.kernels.launch(plan.kernel, plan.nchannels, self.threads, record.args, stream, plan.spec,
                                         record.address)
        if self.proxy is not None and self.proxy.error is not None:
            self._broken = f"GIN proxy failed: {self.proxy.error}"
            raise self.proxy.error
        if status:
            raise self._failure()

    def _plan_call(self, spec: catalogue.Collective, algorithm: str, dtype: np.dtype, count: int, op, root: int,
                   symmetric: bool) -> CallPlan:
        """Everything about a call that depends only on its signature (cached per signature)."""
        dname = dtype_name(dtype)
        if not spec.reducing:
            op_code = OPS["sum"]  # data movement: no reduction
        elif not isinstance(op, str) or op not in OPS:
            raise ValueError(f"rank {self.rank}: unsupported op {op!r} for {spec.name}; supported: {', '.join(OPS)}")
        else:
            op_code = OPS[op]
        nbytes = max(spec.counts(count, self.nranks)) * dtype.itemsize
        try:
            plan = tuner.plan(spec.name, algorithm, nbytes, self.nranks, self.device, self.max_channels, symmetric)
        except ValueError as e:
            raise ValueError(f"rank {self.rank}: {e}") from None
        fields32 = plan_fields(root, DTYPE_CODES[dname], op_code, plan.nchannels, dtype.itemsize)
        desc = abi.pack_call(spec.name, plan.algorithm, DTYPE_CODES[dname], op_code, root, plan.nchannels)
        return CallPlan(spec.kernels[plan.algorithm], plan.nchannels, self.kernel_spec(spec.name, dname, op),
                        fields32, desc, spec.kernel_count(count, dtype.itemsize), plan.algorithm == "direct")

    @staticmethod
    def kernel_spec(coll: str, dtype: str, op: str | None):
        """Which kernel specialization a call needs (see loader.specialization)."""
        return (DTYPE_CODES[dtype], OPS[op]) if catalogue.get(coll).reducing else None

    def prepare(self, specs) -> None:
        """Collective: builds and loads the kernels for these specs on every rank, then
        waits for all ranks. On a GPU, do this before a sweep over new dtypes and ops:
        loading a module while collective kernels run could wait on them."""
        self.kernels.prepare(specs)
        self.world.barrier(what="kernels prepared")

    def synchronize(self, stream=None) -> None:
        """GPU: waits for `stream` and turns a kernel failure into its diagnostic."""
        if self.device != "cuda":
            return
        import cupy

        s = stream or cupy.cuda.get_current_stream()
        try:
            # Poll rather than block: a blocking wait that holds the GIL would stop the
            # other ThreadWorld ranks from launching the kernels this one waits for.
            while not s.done:
                time.sleep(0)
            s.synchronize()
        except cupy.cuda.runtime.CUDARuntimeError as e:
            if self._host.failed:
                raise self._failure() from e
            raise

    def _failure(self) -> Exception:
        exc = self._host.failure(self.rank, self.timeout)
        self._broken = str(exc)
        return exc

    def close(self) -> None:
        """Collective when GIN is in use: every rank's proxy delivers what its kernels
        posted before any proxy stops."""
        if getattr(self, "proxy", None) is not None:
            self.proxy.quiesce(self.timeout)
            self.world.barrier(what="GIN proxies drained")
            self.proxy.stop()
            self.proxy = None
        if getattr(self, "_symmetric", None) is not None:
            self._symmetric.close()
        self.window.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

