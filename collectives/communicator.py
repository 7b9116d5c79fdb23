"""Communicator: the collectives of a world's ranks, nccl4py-shaped.

Method names and argument order follow nccl4py: allreduce(sendbuf, recvbuf, op),
allgather(sendbuf, recvbuf), reduce_scatter(sendbuf, recvbuf, op),
broadcast(sendbuf, recvbuf, root), reduce(sendbuf, recvbuf, op, root),
alltoall(sendbuf, recvbuf); in place with NCCL's layouts (catalogue.py; alltoall has
none). Buffers are checked before anything is launched
(buffers.py: TypeError / ValueError on the rank that got them). Arguments that must
agree across ranks (collective, algorithm, dtype, op, root, count) travel with every
pipeline step; a rank whose peer called something else fails with CommMismatch
instead of hanging. A failed wait raises CommTimeout naming rank, peer, what was
awaited, expected and seen; afterwards the communicator refuses further calls.

On a GPU the calls are asynchronous, as NCCL's: a communicator has a non-blocking
stream of its own, joined to the caller's stream with events (the caller's stream
records an event that the communicator's stream waits for, the kernel runs on the
communicator's stream, which records an event that the caller's stream waits for).
A kernel that fails leaves its ErrorRecord and returns; the host raises the failure
at synchronize() or at the next call. All launches of one communicator go on its one
stream, so calls from several caller streams run one at a time, in call order (they
share the window's step counters and FIFOs).
"""

from __future__ import annotations

import os
import time
import warnings

import numpy as np

from commref.device_kernels import abi, loader
from commref.transports.errors import CapabilityError, CommAborted
from commref.transports.gin.plan import plan_gin
from commref.transports.gin.queue import QueueRegion
from commref.transports.windows import rank_nodes, register_window

from . import catalogue, protocols, topology, tuner
from .buffers import BufferChecker
from .hierarchical import HIERARCHICAL, Hierarchy, NodeShape, node_shape
from .launch import CallPlan, HostWords, LaunchRecord, RepeatedCall, address_of, plan_fields
from .options import CommOptions, resolve_device
from .symmetric import SymmetricWindows, describe_unmapped
from .verify import DTYPE_CODES, OPS, dtype_name

LEGACY_STREAMS = (0, 1)  # CUstream handles of CUDA's legacy default stream (0, CU_STREAM_LEGACY)
CUDA_ERROR_NOT_READY = 600
DEVICE_WINDOW_ALIGN = 4096  # bytes: where a device communicator's window starts in the connection window
REPEATED_CALLS = 64  # RepeatedCalls a CPU communicator keeps (the oldest goes first)


class Communicator:
    """Collectives among the ranks of `world` on `device` ("auto", "cpu" or "cuda").

    Options (collectives/options.py, CommOptions; as keywords or `options=`):
    `algorithm` ("auto", "ring", "tree", "direct", "hierarchical"), `max_channels` (blocks per launch;
    also sizes the window), `slot_bytes` and `nsteps` (FIFO geometry), `threads` per
    block, `timeout` seconds for every wait (default: world.timeout), `device_id`,
    `stream_stores` ("auto", "on", "off": on the CPU, whether what another core reads
    next is stored past the cache; auto measures both, tuner.StoreChooser), `protocol`
    ("auto", "simple", "ll", "ll128": how ring and tree steps move their data,
    include/commref/proto.h; default COMMREF_PROTO, else auto: the tuner picks by size
    among the protocols every rank can run, collectives/protocols.py). Each collective
    also takes `algorithm=` and `protocol=` per call.

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

    Several nodes (hierarchical.py): with N nodes of L consecutive ranks each (L >= 2),
    AllReduce, ReduceScatter and AllGather also run "hierarchical": inside each node
    over LSA, across nodes over GIN, on two child communicators that the first such
    call (or alloc_symmetric) builds collectively. alloc_symmetric then allocates in
    the node's windows, so the intra-node phases run direct kernels on its arrays.
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
        self.protocol = o.protocol.value  # of the ring and tree steps (tuner.plan; protocols.py)
        defaults = tuner.defaults(self.device, world.local_size)
        self.max_channels = o.max_channels or defaults.max_channels
        self.nsteps = o.nsteps or defaults.nsteps
        self.threads = o.threads or defaults.threads
        self.timeout = o.timeout or world.timeout
        self._broken: str | None = None
        self._closed = False
        self._stores = tuner.StoreChooser(o.stream_stores.value)
        self._ranks_on_device = 1  # ranks of this process on this rank's GPU (itself included)
        if self.device == "cuda":
            import cupy

            self.device_id = cupy.cuda.Device().id if o.device_id is None else o.device_id
            self.kernels = loader.cuda_kernels(self.device_id)
            self._cupy, self._runtime = cupy, cupy.cuda.runtime
            with cupy.cuda.Device(self.device_id):
                self._stream = cupy.cuda.Stream(non_blocking=True)  # every launch of this communicator
                self._joined = cupy.cuda.Event(disable_timing=True)  # the caller's work before a launch
                self._done = cupy.cuda.Event(disable_timing=True)  # a launch, for the caller's stream
            self._stream_ptr, self._joined_ptr, self._done_ptr = (
                int(self._stream.ptr), int(self._joined.ptr), int(self._done.ptr))
            self._resident: set = set()  # (kernel, spec, channels) whose residency was checked
            self._place_on_gpus()
        else:
            self.device_id = None
            self.kernels = loader.cpu_kernels()
        self._check = BufferChecker(self.rank, self.nranks, self.device, self.device_id)

        # A device communicator (device_api.DeviceComm) adds its signals and the barriers' words.
        device_signals = (o.device_signals + abi.devcomm_reserved_signals(self.nranks)) if o.device_window else 0
        self.gin = plan_gin(world, o.gin, self.device, self.max_channels, self.nsteps, device_signals)
        self.protocol_refusals = self._protocol_refusals()  # collective
        self.peer_mask, self.path = self.gin.peer_mask, o.gin.path.value
        self.backend, self.transport, self.network = self.gin.backend, self.gin.transport, self.gin.network
        self.slot_bytes = o.slot_bytes or tuner.defaults(self.device, world.local_size, self.network).slot_bytes
        layout, nbytes = abi.window_layout(self.max_channels, self.slot_bytes, self.nsteps,
                                           o.gin.queue if self.gin.used else 0, o.gin.counters, self.nranks,
                                           device_signals)
        self.layout = layout
        # The device window (DevComm.windowOff): after the connections' regions, page aligned.
        self.device_window_offset = -(-nbytes // DEVICE_WINDOW_ALIGN) * DEVICE_WINDOW_ALIGN
        if o.device_window:
            nbytes = self.device_window_offset + o.device_window
        self.window = register_window(world, nbytes, self.device, self.device_id or 0)
        self._refuse_unmapped()
        self._gin_region = QueueRegion(self.window, layout, o.gin.queue, o.gin.counters, self.device,
                                       self.device_id or 0) if self.gin.used else None
        self.proxy = self.gin.start_proxy(world, self.window, layout, region=self._gin_region, device=self.device,
                                          device_id=self.device_id or 0)
        self._host = HostWords(world.abort_word, self.device, self.device_id or 0)
        self._record = LaunchRecord()
        a = self._record.record
        a["peerWindows"] = address_of(self.window.peer_table)
        a["errorRecord"] = self._host.error_address
        a["abortFlag"] = self._host.abort_address
        a["timeoutNs"] = int(self.timeout * 1e9)
        a["layout"] = layout
        a["rank"], a["nranks"] = self.rank, self.nranks
        self.gin.fill_args(a["gin"], self.max_channels, self.nsteps, self._gin_region)
        nodes = rank_nodes(world)  # collective: every rank builds the same rings and trees
        a["peers"] = topology.channel_peers(self.rank, nodes, self.max_channels)
        self.node_shape = node_shape(nodes, self.rank)  # NodeShape, or why "hierarchical" cannot run
        # GIN slower than memory: a network between hosts, or the wire model (tuner.plan).
        self._slow_network = self.gin.used and (o.gin.wire_modeled or len({h for _, h in nodes}) > 1)
        self._hierarchy: Hierarchy | None = None  # built by the first call that needs it
        self._ring_ranks = self._device_table(topology.ring_ranks(nodes, self.max_channels))
        a["ringRanks"] = address_of(self._ring_ranks)
        # Direct kernels: over LSA they load and store; with GIN peers they push, where the
        # engine is given the symmetric windows (GinPlan.direct_refusal).
        self.gin_direct_refusal = self.gin.direct_refusal(self.proxy)
        gin_direct = self.gin.used and self.gin_direct_refusal is None
        self._symmetric = SymmetricWindows(world, self.device, self.device_id or 0, self.window,
                                           gin_engine=self.proxy if gin_direct else None)
        self._direct_possible = self.nranks <= abi.DIRECT_MAX_RANKS and (not self.peer_mask or gin_direct)
        self._calls: dict = {}  # call signature -> CallPlan
        self._repeated: dict = {}  # CPU: a call's arguments (buffers by id) -> RepeatedCall, kept
        world.barrier(what="communicator ready")

    def _device_table(self, table: np.ndarray):
        """`table` where this communicator's kernels read it: itself on the CPU, a copy in
        device memory on a GPU (made on the communicator's stream, complete on return)."""
        if self.device != "cuda":
            return table
        with self._cupy.cuda.Device(self.device_id), self._stream:
            copy = self._cupy.asarray(table)
        self._stream.synchronize()
        return copy

    def _place_on_gpus(self) -> None:
        """Collective (GPU): where every rank runs. Counts the ranks of this process on
        this rank's GPU (their blocks must be resident together: _check_residency; a
        legacy-stream caller is refused when there are several), and on rank 0 warns
        when ranks in different processes share a GPU (they time-slice without MPS)."""
        bus = self._runtime.deviceGetPCIBusId(self.device_id)
        places = self._places = self.world.allgather((self.world.host, os.getpid(), bus), what="communicator GPUs")
        me = places[self.rank]
        self._ranks_on_device = sum(1 for p in places if p == me)
        if self.rank != 0:
            return
        by_gpu: dict = {}
        for r, (host, pid, gpu) in enumerate(places):
            by_gpu.setdefault((host, gpu), {}).setdefault(pid, []).append(r)
        for (host, gpu), pids in by_gpu.items():
            if len(pids) > 1:
                ranks = sorted(r for rs in pids.values() for r in rs)
                warnings.warn(f"commref: ranks {ranks} share GPU {gpu} on {host} as {len(pids)} processes: without "
                              f"MPS they time-slice it, so their timings measure the scheduler; with MPS their "
                              f"kernels must all be resident at once", RuntimeWarning, stacklevel=3)

    def _protocol_refusals(self) -> dict[str, str]:
        """Collective: protocol -> why some rank cannot run it (collectives/protocols.py),
        the same on every rank. Refuses (CapabilityError) an explicit protocol option
        that is among them, before anything is allocated."""
        support = 0
        if self.device == "cpu":
            support = self.kernels.protocol_support
            mine = protocols.cpu_refusals(support)
        else:
            reach = self.world.allgather(protocols.nvlink_reach(self._places[self.rank][2]), what="GPU NVLinks")
            mine = protocols.gpu_refusals(self.rank, self._places, reach)
        for p in protocols.PROTOCOLS:
            why = self.gin.protocol_refusal(p, self.device, support)
            if why and p not in mine:
                mine[p] = why
        refusals = protocols.merge(self.world.allgather(mine, what="communicator protocols"))
        if self.protocol in refusals:
            raise CapabilityError(f"rank {self.rank}: protocol {self.protocol!r} cannot run on this communicator: "
                                  f"{refusals[self.protocol]}")
        return refusals

    def _refuse_unmapped(self) -> None:
        """Collective: every rank refuses (CapabilityError) when any rank could not map
        the window of a peer it reaches over LSA, or on a GPU over GIN on network shm (the
        copy-engine proxy reaches those peers by CUDA IPC), naming why (not on one host, no
        peer access between two GPUs, CUDA IPC failed)."""
        win = self.window
        gin_mapped = self.device == "cuda" and self.network == "shm"
        needed = [r for r in range(self.nranks) if gin_mapped or not (self.peer_mask >> r) & 1]
        missing = {r: win.unmapped.get(r, f"not on its host (its host team: {win.mapped_ranks})") for r in needed
                   if win.peer_addresses[r] == 0}
        everyone = self.world.allgather(missing, what="window mappings")
        if not any(everyone):
            return
        win.close_peers()
        try:
            self.world.barrier(what="unusable window unmapped")
            win.free()
        except Exception:  # a peer failed as well: keep the memory rather than free it under a peer
            pass
        if gin_mapped and self.peer_mask:
            raise CapabilityError(f"rank {self.rank}: {describe_unmapped(self.rank, everyone)}; GIN on GPUs reaches "
                                  f"its peers' windows by CUDA IPC (ranks on one host with peer access)")
        raise CapabilityError(f"rank {self.rank}: {describe_unmapped(self.rank, everyone)}; the LSA path needs "
                              f"every peer's window mapped "
                              f"(ranks on one host and, on GPUs, peer access; use path='auto' or 'gin')")

    # ---- collectives (nccl4py names and argument order) ----

    def allreduce(self, sendbuf, recvbuf, op="sum", *, stream=None, algorithm: str | None = None,
                  protocol: str | None = None) -> None:
        self._collective("allreduce", sendbuf, recvbuf, op, 0, stream, algorithm, protocol=protocol)

    def reduce_scatter(self, sendbuf, recvbuf, op="sum", *, stream=None, algorithm: str | None = None,
                       protocol: str | None = None) -> None:
        self._collective("reduce_scatter", sendbuf, recvbuf, op, 0, stream, algorithm, protocol=protocol)

    def allgather(self, sendbuf, recvbuf, *, stream=None, algorithm: str | None = None,
                  protocol: str | None = None) -> None:
        self._collective("allgather", sendbuf, recvbuf, None, 0, stream, algorithm, protocol=protocol)

    def broadcast(self, sendbuf, recvbuf, root: int, *, stream=None, algorithm: str | None = None,
                  protocol: str | None = None) -> None:
        self._collective("broadcast", sendbuf, recvbuf, None, root, stream, algorithm, protocol=protocol)

    def reduce(self, sendbuf, recvbuf, op="sum", root: int = 0, *, stream=None,
               algorithm: str | None = None, protocol: str | None = None) -> None:
        self._collective("reduce", sendbuf, recvbuf, op, root, stream, algorithm, protocol=protocol)

    def alltoall(self, sendbuf, recvbuf, *, stream=None, algorithm: str | None = None,
                 protocol: str | None = None) -> None:
        """NCCL's ncclAlltoAll: sendbuf and recvbuf hold nranks * count elements each
        (count: elements per peer, sendbuf.size // nranks); block j of sendbuf lands in
        block `rank` of rank j's recvbuf. Out of place only: NCCL defines no in-place
        alltoall, so overlapping buffers raise ValueError. Algorithms: "ring" (plain
        buffers, forwarded along the ring over LSA or GIN), "direct" (recvbufs from
        alloc_symmetric and every peer over LSA: each block stored once into its peer's
        recvbuf)."""
        self._collective("alltoall", sendbuf, recvbuf, None, 0, stream, algorithm, protocol=protocol)

    # ---- symmetric memory ----

    def alloc_symmetric(self, count: int, dtype="float32"):
        """Collective: a zeroed array of `count` elements of `dtype` in a new symmetric
        window (NCCL's ncclMemAlloc + ncclCommWindowRegister with
        NCCL_WIN_COLL_SYMMETRIC): every rank must call it with the same size, in the
        same order, and every peer maps it. numpy on the CPU, CuPy on a GPU; peers map
        it until free_symmetric() or close(). On a communicator of several nodes that can
        run "hierarchical", the array lives in the intra-node child's windows: every
        rank of this rank's node maps it (no peer on another node could)."""
        self._repeated.clear()  # whether a buffer is symmetric may change
        if isinstance(self.node_shape, NodeShape):
            return self.hierarchy().intra.alloc_symmetric(count, dtype)
        return self._symmetric.alloc(count, dtype)

    def free_symmetric(self, array) -> None:
        """Collective: releases a window from alloc_symmetric (NCCL's
        ncclCommWindowDeregister + ncclMemFree). Every rank must free the same window
        (the n-th allocation on every rank), after every collective on it has completed;
        a mismatch raises ValueError on every rank. Peers no longer map it, so the
        array no longer counts as symmetric. On the CPU the array stays valid memory
        for as long as it is referenced; on a GPU the memory is freed and the array must
        not be used again."""
        self._repeated.clear()
        if self._hierarchy is not None:
            self._hierarchy.intra.free_symmetric(array)
            return
        address = self._check.buffer(array, "array").address
        self.synchronize()
        self._symmetric.free(address)

    # ---- launch ----

    def _collective(self, coll: str, sendbuf, recvbuf, op, root, stream, algorithm,
                    avg_divisor: int | None = None, flat: bool = False, protocol: str | None = None) -> None:
        """One call. `avg_divisor` (op avg): divide by this instead of nranks (a
        hierarchical phase divides by the whole job's ranks); `flat`: never the
        hierarchical algorithm (its own tail); `protocol`: of the ring and tree steps
        (None: the communicator's; a hierarchical call's phases use the communicator's).

        On the CPU a call with the arguments and arrays of an earlier one, unchanged
        (RepeatedCall), skips the checks and the planning it passed then."""
        repeat = (coll, id(sendbuf), id(recvbuf), op, root, root.__class__, algorithm, protocol, avg_divisor, flat)
        try:
            again = self._repeated.get(repeat)
        except TypeError:  # an unhashable argument: the checks below say what is wrong with it
            again = repeat = None
        if again is not None and not self._broken and again.matches(sendbuf, recvbuf):
            self._launch_cpu(again)
            return
        spec = catalogue.CATALOGUE[coll]
        if spec.rooted:
            root = self._check.root(root)
        s, r, count = self._check.call(spec, sendbuf, recvbuf, root)
        if self._broken:
            raise CommAborted(f"rank {self.rank}: communicator unusable: {self._broken}",
                              rank=self.rank, origin_rank=None, reason=self._broken)
        sym = None
        if self._symmetric.windows and self._direct_possible and "direct" in spec.kernels:
            sym = self._direct_buffers(spec, s, r, count)
        if sym is None and self.peer_mask and (algorithm or self.algorithm) == "direct" and "direct" in spec.kernels:
            raise ValueError(f"rank {self.rank}: algorithm 'direct' with peers over GIN: "
                             f"{self._why_not_pushed(spec, s, r, count)}")
        key = (coll, algorithm or self.algorithm, count, s.dtype, op, root, sym is not None, avg_divisor, flat,
               protocol or self.protocol)
        plan = self._calls.get(key)
        if plan is None:
            plan = self._calls[key] = self._plan_call(spec, key[1], s.dtype, count, op, root, sym is not None,
                                                      avg_divisor, flat, key[-1])
        if plan.hierarchical:
            self._run_hierarchical(spec, s, r, op, stream)
            return
        if self.device == "cpu":
            timed = s.nbytes >= tuner.STORE_CHOOSER_MIN_BYTES and self._stores.mode == "auto"
            in_place = timed and s.overlaps(r)
            streamed = 0 if timed else self._stores.choose(plan.kernel, s.nbytes)[0]  # the same every call
            # Kept for the next call with these arguments, unless a buffer was not looked at
            # (root_only: the other one stood in for it).
            keep = repeat is not None and s.obj is sendbuf and r.obj is recvbuf
            call = RepeatedCall(sendbuf, recvbuf, plan, s, r, sym, streamed, timed, in_place, keep)
            if call.kept:
                if len(self._repeated) >= REPEATED_CALLS:
                    self._repeated.clear()
                self._repeated[repeat] = call
            self._launch_cpu(call)
            return
        if plan.direct:
            self._record.set_symmetric(sym)
        self.end_launch(self._launch_gpu(plan, s.address, r.address, stream))

    def _direct_buffers(self, spec, s, r, count: int):
        """symSend and symRecv for the direct kernel of `spec`, or None where it cannot
        run this call: some buffer it reaches on peers is not in a symmetric window; with
        GIN peers, also a collective without a pushing kernel (catalogue gin_windows), or
        an AllReduce in place or whose count does not split evenly over the ranks."""
        if not self.peer_mask:
            return self._symmetric.direct(spec, s, r)
        if self._push_refusal(spec, s, r, count) is not None:
            return None
        return self._symmetric.direct(spec, s, r, spec.gin_windows)

    def _push_refusal(self, spec, s, r, count: int) -> str | None:
        """Why the direct kernel of `spec` cannot push this call over GIN whatever its
        buffers (None: it can where they lie in windows the engine carries)."""
        if self.gin_direct_refusal is not None:
            return self.gin_direct_refusal
        if self.nranks > abi.DIRECT_MAX_RANKS:
            return f"{self.nranks} ranks (direct kernels reach at most {abi.DIRECT_MAX_RANKS})"
        if spec.gin_windows is None:
            return f"{spec.name} has no direct kernel over GIN (it would stage every peer's block: use the ring)"
        if spec.gin_direct_even_out_of_place and count % self.nranks:
            return f"{spec.name} pushes equal blocks: count {count} is not a multiple of {self.nranks} ranks"
        if spec.gin_direct_even_out_of_place and s.overlaps(r):
            return f"{spec.name} stages peers' blocks in its recvbuf: not in place"
        return None

    def _why_not_pushed(self, spec, s, r, count: int) -> str:
        """Why _direct_buffers found no direct kernel for this call with GIN peers."""
        return self._push_refusal(spec, s, r, count) or (
            f"{' and '.join(spec.gin_windows)} must come from Communicator.alloc_symmetric (the GIN engine puts "
            f"from and into those windows)")

    def _launch_cpu(self, call: RepeatedCall) -> None:
        """Runs a CPU call (its record fields written unless the record holds them)."""
        if self._record.holder is not call:
            call.load(self._record)
        launch = call.plan.launch
        if call.timed:  # tuner.StoreChooser picks and times streamStores
            streamed, store_key = self._stores.choose(call.plan.kernel, call.nbytes, call.in_place)
            self._record.set_stream_stores(streamed)
            t0 = time.perf_counter()
            status = launch.run(launch.desc)
            if store_key is not None and not status:
                self._stores.record(store_key, streamed, time.perf_counter() - t0, call.nbytes)
        else:
            status = launch.run(launch.desc)
        self.end_launch(status, launch.refused)

    def end_launch(self, status: int, refused=None) -> None:
        """After a launch of this communicator's (a collective's, or a user's kernel,
        device_api.Kernel): raises the GIN proxy's failure, else the kernel's (`status`
        nonzero), else, for abi.LAUNCH_REFUSED, refused() when given."""
        if self.proxy is not None and self.proxy.error is not None:
            self._broken = f"an earlier call failed: GIN proxy failed: {self.proxy.error}"
            raise self.proxy.error
        if status:
            if status == abi.LAUNCH_REFUSED and refused is not None:
                raise refused()
            raise self._failure()

    @property
    def direct_kernels(self) -> str | None:
        """How this communicator's direct kernels run on buffers from alloc_symmetric:
        "lsa" (every peer over LSA: loads and stores), "push" (GIN peers: pushes, for
        the calls catalogue.Collective.gin_windows describes), or None (none run: too
        many ranks, a GIN engine that cannot carry windows, or several nodes whose
        symmetric buffers live in the intra-node child)."""
        if not self._direct_possible or isinstance(self.node_shape, NodeShape):
            return None
        return "push" if self.peer_mask else "lsa"

    def planned(self, coll: str, count: int, symmetric: bool) -> list[CallPlan]:
        """The plans of the calls of `coll` with `count` elements made so far, on
        buffers that ran the direct kernels' checks as symmetric or not (for reports)."""
        return [plan for key, plan in self._calls.items()
                if key[0] == coll and key[2] == count and key[6] == symmetric]

    def hierarchy(self) -> Hierarchy:
        """Collective on first use: the intra- and inter-node child communicators (split
        worlds; this communicator's options, the algorithm left to their tuners)."""
        if self._hierarchy is None:
            shape = self.node_shape
            options = self.options.replace(algorithm="auto", max_channels=self.max_channels, threads=self.threads,
                                           timeout=self.timeout, device_id=self.device_id)
            intra = inter = None
            try:
                intra = Communicator(self.world.split(shape.node, what="hierarchical: the node's ranks"),
                                     options=options)
                inter = Communicator(self.world.split(shape.local, what="hierarchical: one rank per node"),
                                     options=options)
            except BaseException:
                for child in (inter, intra):
                    if child is not None:
                        child.close()
                raise
            self._hierarchy = Hierarchy(shape, intra, inter, self.nranks)
        return self._hierarchy

    def _run_hierarchical(self, spec: catalogue.Collective, s, r, op, stream) -> None:
        h = self.hierarchy()
        send, recv = s.array.reshape(-1), r.array.reshape(-1)
        xp = np if self.device == "cpu" else self._cupy
        if spec.name == "allreduce":
            h.allreduce(send, recv, op, stream,
                        lambda a, b: self._collective("allreduce", a, b, op, 0, stream, "auto", flat=True))
        elif spec.name == "reduce_scatter":
            h.reduce_scatter(send, recv, op, stream, xp)
        else:
            h.allgather(send, recv, stream, xp)

    def _launch_gpu(self, plan: CallPlan, send: int, recv: int, stream) -> int:
        """Enqueues the call on the communicator's stream, joined to the caller's
        `stream` (None: CuPy's current stream; a cupy Stream or a CUstream handle).

        Every launch goes on the one communicator stream, so launches from several
        caller streams run one after another, in call order: they share the window's
        step counters and FIFOs, which two kernels of one communicator must never
        drive at once."""
        if self._host.failed:  # an earlier kernel failed and nobody synchronized since
            raise self._failure()
        caller = self._caller_stream(stream)
        self._record.set_call(plan, send, recv)
        return self.enqueue(lambda own: self.kernels.launch(plan.kernel, plan.nchannels, self.threads,
                                                            self._record.args, own, plan.spec, self._record.address),
                            caller)

    def _refuse_legacy_stream(self, caller: int) -> None:
        if caller in LEGACY_STREAMS and self._ranks_on_device > 1:
            raise ValueError(
                f"rank {self.rank}: {self._ranks_on_device} ranks of this process share GPU {self.device_id}, and "
                f"this call's stream is CUDA's legacy default stream, which would make rank {self.rank}'s work wait "
                f"for the other ranks' kernels while they wait for it; pass each rank a stream of its own "
                f"(stream=cupy.cuda.Stream(non_blocking=True)) or make one current "
                f"(cupy.cuda.Stream(non_blocking=True).use())")

    def enqueue(self, launch, caller: int):
        """GPU: runs launch(the communicator's CUstream) joined to the `caller` stream
        (a CUstream handle): the caller's earlier work first, the caller's later work
        after. Returns what launch returns. Users' kernels (device_api.Kernel) go
        through it as well, so they never overlap this communicator's collectives."""
        self._refuse_legacy_stream(caller)
        rt, own = self._runtime, self._stream_ptr
        if caller != own:
            rt.eventRecord(self._joined_ptr, caller)
            rt.streamWaitEvent(own, self._joined_ptr, 0)
        status = launch(own)
        if caller != own:
            rt.eventRecord(self._done_ptr, own)
            rt.streamWaitEvent(caller, self._done_ptr, 0)
        return status

    def _check_residency(self, kernel: str, spec, nchannels: int) -> None:
        """GPU: refuses (CapabilityError) a launch whose blocks, with those of the other
        ranks of this process on this GPU, cannot all be resident at once (the rule:
        tuner.residency_problem). Checked once per (kernel, spec, channels)."""
        key = (kernel, spec, nchannels)
        if key in self._resident:
            return
        per_sm = self.kernels.max_active_blocks(kernel, spec, self.threads)
        why = tuner.residency_problem(kernel, self._ranks_on_device, nchannels, self.threads, per_sm,
                                      self.kernels.sm_count)
        if why:
            limit = f" (its limit: {self.kernels.max_threads(kernel, spec)} threads)" if per_sm == 0 else ""
            raise CapabilityError(f"rank {self.rank}: GPU {self.device_id}: {why}{limit}")
        self._resident.add(key)

    def _plan_call(self, spec: catalogue.Collective, algorithm: str, dtype: np.dtype, count: int, op, root: int,
                   symmetric: bool, avg_divisor: int | None = None, flat: bool = False,
                   protocol: str = "auto") -> CallPlan:
        """Everything about a call that depends only on its signature (cached per signature)."""
        dname = dtype_name(dtype)
        if not spec.reducing:
            op_code = OPS["sum"]  # data movement: no reduction
        elif not isinstance(op, str) or op not in OPS:
            raise ValueError(f"rank {self.rank}: unsupported op {op!r} for {spec.name}; supported: {', '.join(OPS)}")
        else:
            op_code = OPS[op]
        nbytes = max(spec.counts(count, self.nranks)) * dtype.itemsize
        shape = None if flat else self.node_shape
        try:
            if protocol in self.protocol_refusals:
                raise CapabilityError(f"rank {self.rank}: protocol {protocol!r} cannot run on this communicator: "
                                      f"{self.protocol_refusals[protocol]}")
            plan = tuner.plan(spec.name, algorithm, nbytes, self.nranks, self.device, self.max_channels, symmetric,
                              shape, self._slow_network, protocol,
                              tuner.auto_protocols(self.protocol_refusals, bool(self.peer_mask)))
        except ValueError as e:
            raise ValueError(f"rank {self.rank}: {e}") from None
        if plan.algorithm == HIERARCHICAL:
            return CallPlan(HIERARCHICAL, 0, None, None, 0, count, False, hierarchical=True)
        divisor = (avg_divisor or self.nranks) if op == "avg" else 0
        fields32 = plan_fields(root, DTYPE_CODES[dname], op_code, plan.nchannels, dtype.itemsize, divisor,
                               plan.protocol)
        desc = abi.pack_call(spec.name, plan.algorithm, DTYPE_CODES[dname], op_code, root, plan.nchannels,
                             plan.protocol)
        kernel, kspec = spec.kernels[plan.algorithm], self.kernel_spec(spec.name, dname, op)
        launch = None
        if self.device == "cuda":
            self._check_residency(kernel, kspec, plan.nchannels)
        else:  # described once: a launch then costs ctypes one argument (loader.PreparedLaunch)
            launch = self.kernels.prepared(kernel, plan.nchannels, self.threads, self._record.address)
        return CallPlan(kernel, plan.nchannels, kspec, fields32, desc, spec.kernel_count(count, dtype.itemsize),
                        plan.algorithm == "direct", protocol=plan.protocol, launch=launch)

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
        """GPU: waits for this communicator's kernels and for `stream` (None: CuPy's
        current stream), then raises the failure a kernel recorded, if any."""
        if self.device != "cuda":
            return
        caller = self._caller_stream(stream)
        try:
            self._wait(self._stream_ptr)
            if caller != self._stream_ptr:
                self._wait(caller)
        except self._runtime.CUDARuntimeError as e:
            if self._host.failed:
                raise self._failure() from e
            raise
        if self._host.failed:
            raise self._failure()

    def _caller_stream(self, stream) -> int:
        """The CUstream handle of a call's `stream` (None: CuPy's current stream)."""
        return loader.stream_handle(self._cupy.cuda.get_current_stream() if stream is None else stream)

    def _wait(self, stream: int, deadline: float | None = None) -> bool:
        """Waits for a stream (a CUstream handle); a CUDA error on it raises. Polls
        rather than blocks: a blocking wait that held the GIL would stop the other
        ThreadWorld ranks from launching the kernels this one waits for. False when
        `deadline` (time.monotonic()) passed first."""
        rt = self._runtime
        while rt.streamQuery(stream) == CUDA_ERROR_NOT_READY:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0)
        rt.streamSynchronize(stream)  # done or failed: returns at once, or raises the stream's error
        return True

    def _failure(self) -> Exception:
        exc = self._host.failure(self.rank, self.timeout)
        self._broken = f"an earlier call failed: {exc}"
        return exc

    def close(self) -> None:
        """Collective: releases the communicator's windows and host words; idempotent.

        The order keeps every peer safe: this rank's kernels are waited for (GPU), the
        GIN proxies deliver what their kernels posted before any proxy stops, every rank
        reaches a barrier (no kernel of the communicator runs any more), each rank closes
        its mappings of the peers' windows (CUDA IPC handles; also those of
        alloc_symmetric's windows), a second barrier, and only then each rank frees its
        own memory, which no peer maps or writes any longer.

        After a failure close still returns: the barriers have deadlines
        (the communicator's timeout) and a ThreadWorld whose rank failed ends them at
        once. Memory a peer might still use (a barrier failed, or this rank's kernels
        did not finish within twice the timeout) is left allocated, not freed under a
        peer. Raises the first teardown error (a barrier, the proxy) unless the
        communicator had already failed."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        gpu, errors = self.device == "cuda", []
        hierarchy = getattr(self, "_hierarchy", None)
        if hierarchy is not None:  # its children first: collective, like the rest of close
            try:
                hierarchy.close()
            except Exception as e:
                errors.append(e)
        kernels_done = self._wait_quietly(errors) if gpu else True
        proxy = getattr(self, "proxy", None)
        if proxy is not None:
            try:
                proxy.quiesce(self.timeout)
                self.world.barrier(what="GIN proxies drained")
            except Exception as e:
                errors.append(e)
            finally:
                proxy.stop()
                self.proxy = None
        region = getattr(self, "_gin_region", None)
        if region is not None and kernels_done:  # no kernel posts, no proxy reads any more
            region.close()
        symmetric, window = getattr(self, "_symmetric", None), getattr(self, "window", None)
        if not gpu:  # launches are synchronous and peers keep their mappings alive themselves
            if symmetric is not None:
                symmetric.close()
            if window is not None:
                window.close()
        else:
            peers_done = self._barrier_quietly("communicator closing: kernels done", errors)
            if kernels_done:  # our kernels no longer read the peers' windows
                if symmetric is not None:
                    symmetric.close_peers()
                if window is not None:
                    window.close_peers()
            if peers_done:  # else some peer is gone or failed: nothing will be freed, no second wait
                peers_done = self._barrier_quietly("communicator closing: peer windows unmapped", errors)
            if kernels_done and peers_done:
                if symmetric is not None:
                    symmetric.free_all()
                if window is not None:
                    window.free()
                host = getattr(self, "_host", None)
                try:
                    if host is not None:
                        host.close()
                except Exception as e:
                    errors.append(e)
        broken, self._broken = self._broken, self._broken or "it was closed"
        if errors and not broken:
            raise errors[0]

    def _wait_quietly(self, errors: list) -> bool:
        """close(): waits (bounded) for this rank's kernels; False if they still run."""
        try:
            return self._wait(self._stream_ptr, time.monotonic() + 2 * self.timeout + 1)
        except Exception as e:  # a CUDA error: nothing of ours runs any more
            errors.append(e)
            return True

    def _barrier_quietly(self, what: str, errors: list) -> bool:
        try:
            self.world.barrier(what=what, timeout=self.timeout)
            return True
        except Exception as e:
            errors.append(e)
            return False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Closes the communicator. An exception leaving the block means this rank
        abandons its sequence of collectives while peers may be blocked in one, waiting
        for it: it first marks the world failed (World.mark_failed raises the abort word:
        the peers of a ThreadWorld raise CommAborted at once, and close() waits for no
        peer), so the job ends now instead of at a deadline. The job is over then: catch
        errors inside the block to go on using the world."""
        if exc_type is not None and not getattr(self, "_closed", True):
            reason = f"{exc_type.__name__}: {exc}" if str(exc) else exc_type.__name__
            self.world.mark_failed(" ".join(reason.split()))
        try:
            self.close()
        except Exception:
            if exc_type is None:
                raise  # else the exception in flight is the one to see

