"""Communicator: the user-facing collectives over LSA connections.

A Communicator is built collectively from a world (commref.transports.world) and a device.
It owns the connection window (FIFOs, flags, step counters: layout in
include/commref/args.h), the per-channel ring and tree tables, and the kernels.
Method names and argument order follow nccl4py: allreduce(sendbuf, recvbuf, op),
allgather(sendbuf, recvbuf), reduce_scatter(sendbuf, recvbuf, op),
broadcast(sendbuf, recvbuf, root), reduce(sendbuf, recvbuf, op, root).

Input checks happen before anything is launched and raise ValueError/TypeError on the
rank that got the bad input. Arguments that must agree across ranks (collective,
algorithm, dtype, op, root, count) travel with every pipeline step; a rank that sees a
different call from its peer fails with CommMismatch instead of hanging.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import numpy as np

from commref.device_kernels import abi, loader
from commref.transports.errors import CapabilityError, CommAborted, CommMismatch, CommTimeout, format_seconds
from commref.transports.windows import register_window

from . import topology, tuner
from .verify import COLLECTIVES, DTYPE_CODES, DTYPES, OPS, REDUCING, dtype_name

DTYPE_OF = {d: n for n, d in DTYPES.items()}
_DIRECT_KERNELS = frozenset(name for (coll, algo), name in loader.KERNELS.items() if algo == "direct")
ALGORITHMS = tuple(abi.ALGORITHM_CODES)


@dataclass
class Buffer:
    """A validated user buffer: where it is, what it holds."""

    obj: object
    address: int
    count: int
    dtype: np.dtype
    nbytes: int
    writeable: bool

    def overlaps(self, other: "Buffer") -> bool:
        return self.address < other.address + other.nbytes and other.address < self.address + self.nbytes


class Communicator:
    """Collectives among the ranks of `world` on `device` ("auto", "cpu" or "cuda").

    Options: `algorithm` default ("auto", "ring", "tree", "direct"); `max_channels` (blocks per
    launch, also sizes the window); `slot_bytes` and `nsteps` (FIFO geometry);
    `threads` per block; `timeout` seconds for every wait (default: world.timeout).

    Paths: `path="lsa"` (every peer by load/store; all ranks on one host), `"gin"`
    (every peer through the GIN proxy, even on one host) or `"auto"` (LSA where the
    peer's window is mapped, GIN otherwise, per peer). GIN options: `backend` ("auto",
    "proxy", "rc", "gda"), `wire` ordering model ("ordered", "unordered"), `network`
    ("auto", "shm", "mpi"), `seed` of the unordered wire, `gin_protocol` ("strong",
    "weak-last", "signal-per-put", "flush-signal"; only "strong" is safe everywhere),
    `puts_per_slot`, `gin_queue` descriptors, `gin_counters`, `segment_bytes`.
    `stream_stores` ("auto", "on", "off"): on the CPU, whether what another core reads
    next is stored past the cache; "auto" measures both (tuner.StoreChooser).

    Symmetric buffers: arrays from `alloc_symmetric` (NCCL's ncclMemAlloc plus a
    symmetric window registration) can be loaded from and stored to by every peer, so
    allreduce, reduce_scatter and allgather on them run direct kernels
    (kernels/direct.cu) that read each byte once where its owner left it and store it
    where it must land, instead of copying it twice through a FIFO. "auto" takes them
    when every rank passes symmetric buffers on the LSA path (allgather: recvbuf only;
    the other two: what peers access, see _direct_buffers).
    """

    def __init__(self, world, device: str = "auto", *, algorithm: str = "auto", max_channels: int | None = None,
                 slot_bytes: int | None = None, nsteps: int | None = None, threads: int | None = None,
                 timeout: float | None = None, device_id: int | None = None, path: str = "lsa",
                 backend: str = "auto", wire: str = "ordered", network: str = "auto", seed: int = 0,
                 gin_protocol: str = "strong", puts_per_slot: int = 4, gin_queue: int = 256,
                 gin_counters: int = 0, segment_bytes: int = 4096, stream_stores: str = "auto"):
        self.world = world
        self.rank, self.nranks = world.rank, world.size
        self.device = _resolve_device(device)
        if algorithm not in ("auto", *ALGORITHMS):
            raise ValueError(f"algorithm must be 'auto', 'ring', 'tree' or 'direct', not {algorithm!r}")
        self.algorithm = algorithm
        defaults = tuner.defaults(self.device, world.local_size)
        self.max_channels = int(max_channels or defaults.max_channels)
        self.slot_bytes = int(slot_bytes or defaults.slot_bytes)
        self.nsteps = int(nsteps or defaults.nsteps)
        self.threads = int(threads or defaults.threads)
        if not 1 <= self.max_channels <= abi.MAX_CHANNELS:
            raise ValueError(f"max_channels must be in [1, {abi.MAX_CHANNELS}], got {self.max_channels}")
        if self.slot_bytes < 64 or self.slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {self.slot_bytes}")
        if self.nsteps < 2:
            raise ValueError(f"nsteps must be >= 2 (a ring step holds its inbound slot while it waits for an "
                             f"outbound one), got {self.nsteps}")
        if not 1 <= self.threads <= 1024:
            raise ValueError(f"threads must be in [1, 1024], got {self.threads}")
        self.timeout = float(timeout if timeout is not None else world.timeout)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._broken: str | None = None
        self._stores = tuner.StoreChooser(stream_stores)

        if self.device == "cuda":
            import cupy

            self.device_id = cupy.cuda.Device().id if device_id is None else int(device_id)
            self.kernels = loader.cuda_kernels(self.device_id)
        else:
            self.device_id = None
            self.kernels = loader.cpu_kernels()

        gin = self._plan_gin(world, path, backend, wire, network, gin_protocol, puts_per_slot, gin_queue,
                             gin_counters, segment_bytes)
        layout, nbytes = abi.window_layout(self.max_channels, self.slot_bytes, self.nsteps,
                                       gin_queue if gin else 0, gin_counters, self.nranks)
        self.window = register_window(world, nbytes, self.device, self.device_id or 0)
        missing = [r for r in range(self.nranks) if self.window.peer_addresses[r] == 0 and
                   not (self.peer_mask >> r) & 1]
        if missing:
            self.window.close()
            raise CapabilityError(
                f"rank {self.rank}: ranks {missing} cannot map this rank's window (not in its LSA team "
                f"{self.window.lsa_ranks}); the LSA path needs every rank on one host (use path='auto' or 'gin')")
        self.proxy = None
        if gin:
            from commref.transports.gin.proxy import GinProxy

            mpi_comm = world.comm.Dup() if self.network == "mpi" else None
            self.proxy = GinProxy(world, self.window, layout, gin_queue, self.backend, self.transport, self.network,
                                  seed, segment_bytes, self.kernels._lib, mpi_comm)
            self.proxy.start()
        self._error, self._abort = self._host_words()
        self._args = np.zeros(1, dtype=abi.COLL_ARGS)
        a = self._args[0]
        a["peerWindows"] = _address(self.window.peer_table)
        a["errorRecord"] = self._error_address
        a["abortFlag"] = self._abort_address
        a["timeoutNs"] = int(self.timeout * 1e9)
        a["layout"] = layout
        a["rank"], a["nranks"] = self.rank, self.nranks
        g = a["gin"]
        g["peerMask"] = self.peer_mask
        g["capacity"] = gin_queue if gin else 0
        g["protocol"] = abi.GIN_PROTOCOLS[gin_protocol] if gin else 0
        g["putsPerSlot"] = puts_per_slot
        g["checkHeaders"] = int(gin_protocol == "strong")
        g["creditSignalBase"] = abi.gin_signals(self.max_channels, self.nsteps)[0]
        a["peers"] = topology.channel_peers(self.rank, self.nranks, self.max_channels)
        f = abi.COLL_ARGS.fields
        self._args_u64 = self._args.view(np.uint64)
        self._args_i32 = self._args.view(np.int32)
        self._args_address = self._args_u64.__array_interface__["data"][0]
        self._off_send, self._off_recv = f["sendbuf"][1] // 8, f["recvbuf"][1] // 8
        self._off_count, self._off_desc = f["count"][1] // 8, f["callDesc"][1] // 8
        self._off_i32 = f["root"][1] // 4
        assert [f[k][1] for k in ("root", "dtype", "op", "nchannels", "elemSize", "streamStores")] == \
            [f["root"][1] + 4 * i for i in range(6)]
        self._off_sym = f["symSend"][1] // 8  # symSend.peerTable, .offset, symRecv.peerTable, .offset
        self._symmetric: list = []  # windows from alloc_symmetric
        self._sym_cache: dict = {}  # (collective, buffer addresses and sizes) -> _direct_buffers()
        self._calls: dict = {}
        self._addresses: dict = {}
        world.barrier(what="communicator ready")

    def _plan_gin(self, world, path, backend, wire, network, protocol, puts_per_slot, queue, counters,
                  segment_bytes) -> bool:
        """Decides which peers go over GIN (self.peer_mask) and selects the backend.
        Returns whether GIN is used at all."""
        from commref.transports.gin import semantics
        from commref.transports.gin.backends import Requirements, select_backend
        from commref.transports.windows import lsa_team

        if path not in ("lsa", "gin", "auto"):
            raise ValueError(f"path must be 'lsa', 'gin' or 'auto', not {path!r}")
        if wire not in ("ordered", "unordered"):
            raise ValueError(f"wire must be 'ordered' or 'unordered', not {wire!r}")
        if network not in ("auto", "shm", "mpi"):
            raise ValueError(f"network must be 'auto', 'shm' or 'mpi', not {network!r}")
        if protocol not in abi.GIN_PROTOCOLS:
            raise ValueError(f"gin_protocol must be one of {', '.join(abi.GIN_PROTOCOLS)}, not {protocol!r}")
        if puts_per_slot < 1 or queue < 1:
            raise ValueError("puts_per_slot and gin_queue must be >= 1")
        if self.nranks > 64:
            raise CapabilityError("GIN connections address at most 64 ranks in this version")
        local = set(lsa_team(world))  # collective: every rank asks once, whatever its path
        team = local if path != "gin" else set()
        others = [r for r in range(self.nranks) if r != self.rank]
        gin_peers = [] if path == "lsa" else [r for r in others if r not in team]
        self.peer_mask = sum(1 << r for r in gin_peers)
        self.path = path
        if not gin_peers:
            self.backend, self.transport, self.network = None, None, None
            return False
        if self.device == "cuda":
            raise CapabilityError("GIN connections run on the CPU engine in this version (device='cpu')")
        if network == "auto":
            network = "shm" if all(r in local for r in gin_peers) else "mpi"
        if network == "shm" and not all(r in local for r in gin_peers):
            raise CapabilityError(f"rank {self.rank}: network 'shm' needs every GIN peer on this host")
        if network == "mpi" and world.kind != "mpi":
            raise CapabilityError("network 'mpi' needs an MPI world (run under mpiexec)")
        self.network = network
        req = Requirements(strong_signals_required=protocol == "strong", wire=wire,
                           flush_orders_later_writes=protocol == "flush-signal",
                           signals_counters=abi.gin_signals(self.max_channels, self.nsteps)[1] + counters)
        self.backend = select_backend(req, backend)
        self.transport = semantics.Transport(
            wire, ordered=wire == "ordered",
            flush_orders_later_writes=self.backend.caps.local_completion_orders_later_writes)
        self.gin_protocol = protocol
        return True

    # ---- host-visible words the kernels write (error record) and poll (abort flag) ----

    def _host_words(self):
        error = np.zeros(1, dtype=abi.ERROR_RECORD)
        abort = self.world.abort_word
        if self.device == "cuda":
            from cupy.cuda import runtime

            for arr in (error, abort):
                try:
                    runtime.hostRegister(arr.ctypes.data, arr.nbytes, 2)  # cudaHostRegisterMapped
                except runtime.CUDARuntimeError:
                    pass  # already registered (the world's abort word is shared)
            self._error_address = _device_pointer_of_host(error.ctypes.data)
            self._abort_address = _device_pointer_of_host(abort.ctypes.data)
        else:
            self._error_address = error.ctypes.data
            self._abort_address = abort.ctypes.data
        return error, abort

    # ---- symmetric memory ----

    def alloc_symmetric(self, count: int, dtype="float32"):
        """Collective: a zeroed array of `count` elements of `dtype` in a new symmetric
        window (NCCL's ncclMemAlloc + ncclCommWindowRegister with
        NCCL_WIN_COLL_SYMMETRIC): every rank must call it with the same size, in the
        same order, and every peer maps it. numpy on the CPU, CuPy on a GPU; peers map
        it until free_symmetric() or close().

        Collectives whose sendbuf and recvbuf are such arrays, at the same offsets on
        every rank, can run the direct kernels."""
        dt = np.dtype(dtype)
        if not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"rank {self.rank}: count must be a non-negative integer, got {count!r}")
        nbytes = int(count) * dt.itemsize
        win = register_window(self.world, max(nbytes, 64), self.device, self.device_id or 0)
        unmapped = [r for r in range(self.nranks) if self.window.peer_addresses[r] and not win.peer_addresses[r]]
        if unmapped:
            win.close()
            raise CapabilityError(f"rank {self.rank}: ranks {unmapped} could not map a symmetric window")
        self._symmetric.append(win)
        self._sym_cache.clear()
        return win.local[:nbytes].view(dt)

    def free_symmetric(self, array) -> None:
        """Collective: releases a window from alloc_symmetric (NCCL's
        ncclCommWindowDeregister + ncclMemFree). Every rank must free the same window
        (the n-th allocation on every rank), after every collective on it has completed;
        a mismatch raises ValueError on every rank. Peers no longer map it, so the
        array no longer counts as symmetric. On the CPU the array stays valid memory
        for as long as it is referenced; on a GPU the memory is freed and the array must
        not be used again."""
        address = self._buffer(array, "array").address
        mine = next((i for i, w in enumerate(self._symmetric) if w.address == address), None)
        self.synchronize()
        every = self.world.allgather(mine, what="free_symmetric")
        if mine is None or len(set(every)) != 1:
            raise ValueError(f"rank {self.rank}: free_symmetric needs the same array from alloc_symmetric on every "
                             f"rank; allocation indices by rank (None: not such an array): {every}")
        self._symmetric.pop(mine).close()
        self._sym_cache.clear()

    def _symmetric_of(self, b: Buffer):
        """(peer table address, offset) of a buffer inside a symmetric window, or None."""
        for win in self._symmetric:
            if win.address <= b.address and b.address + b.nbytes <= win.address + win.nbytes:
                return _address(win.peer_table), b.address - win.address
        return None

    # ---- collectives (nccl4py names and argument order) ----

    def allreduce(self, sendbuf, recvbuf, op="sum", *, stream=None, algorithm: str | None = None) -> None:
        s, r = self._buffer(sendbuf, "sendbuf"), self._buffer(recvbuf, "recvbuf", write=True)
        self._same_dtype(s, r)
        if s.count != r.count:
            raise ValueError(f"rank {self.rank}: allreduce needs sendbuf and recvbuf of equal count, "
                             f"got {s.count} and {r.count}")
        self._in_place_or_disjoint(s, r, s.address == r.address, "allreduce")
        self._launch("allreduce", algorithm, s, r, s.count, op, 0, stream)

    def reduce_scatter(self, sendbuf, recvbuf, op="sum", *, stream=None, algorithm: str | None = None) -> None:
        s, r = self._buffer(sendbuf, "sendbuf"), self._buffer(recvbuf, "recvbuf", write=True)
        self._same_dtype(s, r)
        if s.count != r.count * self.nranks:
            raise ValueError(f"rank {self.rank}: reduce_scatter needs sendbuf of nranks * recvcount = "
                             f"{self.nranks} * {r.count} = {self.nranks * r.count} elements, got {s.count}")
        self._in_place_or_disjoint(s, r, r.address == s.address + self.rank * r.nbytes, "reduce_scatter",
                                   "recvbuf == sendbuf + rank * recvcount")
        self._launch("reduce_scatter", algorithm, s, r, r.count, op, 0, stream)

    def allgather(self, sendbuf, recvbuf, *, stream=None, algorithm: str | None = None) -> None:
        s, r = self._buffer(sendbuf, "sendbuf"), self._buffer(recvbuf, "recvbuf", write=True)
        self._same_dtype(s, r)
        if r.count != s.count * self.nranks:
            raise ValueError(f"rank {self.rank}: allgather needs recvbuf of nranks * sendcount = "
                             f"{self.nranks} * {s.count} = {self.nranks * s.count} elements, got {r.count}")
        self._in_place_or_disjoint(s, r, s.address == r.address + self.rank * s.nbytes, "allgather",
                                   "sendbuf == recvbuf + rank * sendcount")
        self._launch("allgather", algorithm, s, r, s.nbytes, None, 0, stream)

    def broadcast(self, sendbuf, recvbuf, root: int, *, stream=None, algorithm: str | None = None) -> None:
        root = self._root(root)
        r = self._buffer(recvbuf, "recvbuf", write=True)
        s = r
        if self.rank == root:
            s = self._buffer(sendbuf, "sendbuf")
            self._same_dtype(s, r)
            if s.count != r.count:
                raise ValueError(f"rank {self.rank}: broadcast root needs sendbuf and recvbuf of equal count, "
                                 f"got {s.count} and {r.count}")
            self._in_place_or_disjoint(s, r, s.address == r.address, "broadcast")
        self._launch("broadcast", algorithm, s, r, r.nbytes, None, root, stream)

    def reduce(self, sendbuf, recvbuf, op="sum", root: int = 0, *, stream=None,
               algorithm: str | None = None) -> None:
        root = self._root(root)
        s = self._buffer(sendbuf, "sendbuf")
        r = s
        if self.rank == root:
            r = self._buffer(recvbuf, "recvbuf", write=True)
            self._same_dtype(s, r)
            if s.count != r.count:
                raise ValueError(f"rank {self.rank}: reduce root needs sendbuf and recvbuf of equal count, "
                                 f"got {s.count} and {r.count}")
            self._in_place_or_disjoint(s, r, s.address == r.address, "reduce")
        self._launch("reduce", algorithm, s, r, s.count, op, root, stream)

    # ---- launch ----

    def _launch(self, coll, algorithm, s: Buffer, r: Buffer, count, op, root, stream):
        if self._broken:
            raise CommAborted(f"rank {self.rank}: communicator unusable after an earlier failure: {self._broken}",
                              rank=self.rank, origin_rank=None, reason=self._broken)
        sym = None
        if self._symmetric:
            where = (coll, s.address, s.nbytes, r.address, r.nbytes)
            sym = self._sym_cache.get(where, False)
            if sym is False:
                if len(self._sym_cache) >= 64:
                    self._sym_cache.clear()
                sym = self._sym_cache[where] = self._direct_buffers(coll, s, r)
        key = (coll, algorithm or self.algorithm, s.nbytes, s.dtype, op, root, sym is not None)
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = self._plan_call(coll, key[1], s, op, root, sym is not None)
        name, nchannels, spec, fields32, desc = call
        if sym is not None and name in _DIRECT_KERNELS:
            self._args_u64[self._off_sym : self._off_sym + 4] = sym
        # The record's per-call fields, through integer views (field access by name
        # costs microseconds; see _plan_call for the layout).
        self._args_u64[self._off_send] = s.address
        self._args_u64[self._off_recv] = r.address
        self._args_u64[self._off_count] = count
        self._args_u64[self._off_desc] = desc
        self._args_i32[self._off_i32 : self._off_i32 + 6] = fields32
        if self.device == "cpu":
            big = s.nbytes >= tuner.STORE_CHOOSER_MIN_BYTES  # small calls skip the placement test
            streamed, key = self._stores.choose(name, s.nbytes, big and s.overlaps(r))
            self._args_i32[self._off_i32 + 5] = streamed
            t0 = time.perf_counter()
            status = self.kernels.launch(name, nchannels, self.threads, self._args, stream, spec, self._args_address)
            if key is not None and not status:
                self._stores.record(key, streamed, time.perf_counter() - t0, s.nbytes)
        else:
            status = self.kernels.launch(name, nchannels, self.threads, self._args, stream, spec, self._args_address)
        if self.proxy is not None and self.proxy.error is not None:
            self._broken = f"GIN proxy failed: {self.proxy.error}"
            raise self.proxy.error
        if status:
            raise self._failure()

    def _direct_buffers(self, coll, s: Buffer, r: Buffer):
        """symSend and symRecv (table, offset, table, offset) when a direct kernel can
        run this call (every peer over LSA, few enough ranks, and symmetric buffers
        where peers access them), else None. Peers access: allreduce, both buffers
        (they load sendbuf, store recvbuf); reduce_scatter, sendbuf (loads);
        allgather, recvbuf (stores; sendbuf may be any buffer). A buffer no peer
        accesses is described by the one they do, so that the first barrier compares
        only offsets that must agree."""
        if coll not in tuner.DIRECT_COLLECTIVES or self.peer_mask or self.nranks > abi.DIRECT_MAX_RANKS:
            return None
        shared = {"allreduce": (s, r), "reduce_scatter": (s,), "allgather": (r,)}[coll]
        described = [self._symmetric_of(b) for b in shared]
        if None in described:
            return None
        return (*described[0], *described[-1])

    def _plan_call(self, coll, algorithm, s: Buffer, op, root, symmetric: bool = False):
        """Everything about a call that depends only on its signature (cached per
        signature): kernel, channels, specialization, the int32 fields (root, dtype,
        op, nchannels, elemSize, streamStores) and the call descriptor."""
        dname = dtype_name(s.dtype)
        if coll in ("allgather", "broadcast"):
            op_code = OPS["sum"]  # data movement: no reduction
        elif not isinstance(op, str) or op not in OPS:
            raise ValueError(f"rank {self.rank}: unsupported op {op!r} for {coll}; supported: {', '.join(OPS)}")
        else:
            op_code = OPS[op]
        try:
            plan = tuner.plan(coll, algorithm, s.nbytes if coll != "allgather" else s.nbytes * self.nranks,
                              self.nranks, self.device, self.max_channels, symmetric)
        except ValueError as e:
            raise ValueError(f"rank {self.rank}: {e}") from None
        name = loader.KERNELS[(coll, plan.algorithm)]
        fields32 = np.array([root, DTYPE_CODES[dname], op_code, plan.nchannels, s.dtype.itemsize, 0], np.int32)
        desc = abi.pack_call(coll, plan.algorithm, DTYPE_CODES[dname], op_code, root, plan.nchannels)
        spec = self.kernel_spec(coll, dname, op) if coll in REDUCING else None
        return name, plan.nchannels, spec, fields32, desc

    @staticmethod
    def kernel_spec(coll: str, dtype: str, op: str | None):
        """Which kernel specialization a call needs (see loader.specialization)."""
        return (DTYPE_CODES[dtype], OPS[op]) if coll in REDUCING else None

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
            if int(self._error[0]["code"]) != abi.ERR_OK:
                raise self._failure() from e
            raise

    def _failure(self) -> Exception:
        e = self._error[0]
        code, what = int(e["code"]), abi.WAIT_WHAT.get(int(e["what"]), f"wait #{int(e['what'])}")
        peer, channel, expected, seen = int(e["peer"]), int(e["channel"]), int(e["expected"]), int(e["seen"])
        if code == abi.ERR_TIMEOUT:
            exc = CommTimeout(
                f"rank {self.rank}: timed out after {format_seconds(self.timeout)} s waiting for peer {peer}: {what} "
                f"on channel {channel} (expected >= {expected}, seen {seen})",
                rank=self.rank, peer=peer, what=what, expected=expected, seen=seen)
        elif code == abi.ERR_MISMATCH:
            if int(e["what"]) == 4:
                field, mine, theirs = "count", expected, seen
            elif int(e["what"]) == 8:
                field, mine, theirs = "symmetric buffer offset", expected, seen
            else:
                m, t = abi.unpack_call(expected), abi.unpack_call(seen)
                diffs = [k for k in m if m[k] != t[k]] or ["call"]
                field = diffs[0]
                mine, theirs = m[field] if field in m else expected, t[field] if field in t else seen
            exc = CommMismatch(
                f"rank {self.rank}: collective call differs from peer {peer}'s: {field} is {mine!r} here "
                f"and {theirs!r} there", rank=self.rank, peer=peer, field=field, mine=mine, theirs=theirs)
        elif code == abi.ERR_ABORTED:
            exc = CommAborted(f"rank {self.rank}: collective aborted while waiting for peer {peer} "
                              f"because the job is being torn down", rank=self.rank, origin_rank=None,
                              reason="abort flag raised")
        else:
            exc = RuntimeError(f"rank {self.rank}: kernel failed without a diagnostic (record code {code})")
        self._broken = str(exc)
        return exc

    # ---- validation ----

    def _root(self, root) -> int:
        if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < self.nranks:
            raise ValueError(f"rank {self.rank}: root must be a rank in [0, {self.nranks}), got {root!r}")
        return int(root)

    def _same_dtype(self, s: Buffer, r: Buffer) -> None:
        if s.dtype != r.dtype:
            raise TypeError(f"rank {self.rank}: sendbuf dtype {s.dtype} differs from recvbuf dtype {r.dtype}")

    def _in_place_or_disjoint(self, s: Buffer, r: Buffer, in_place: bool, coll: str,
                              layout: str = "sendbuf == recvbuf") -> None:
        """Buffers may share memory only in NCCL's in-place layout for `coll`."""
        if s.overlaps(r) and not in_place:
            raise ValueError(f"rank {self.rank}: {coll} buffers overlap but are not in place ({layout})")

    def _buffer(self, obj, name: str, write: bool = False) -> Buffer:
        if obj is None:
            raise TypeError(f"rank {self.rank}: {name} is required")
        if self.device == "cpu":
            if type(obj) is not np.ndarray:
                kind = type(obj).__module__.split(".")[0]
                if hasattr(obj, "__cuda_array_interface__") or kind == "cupy":
                    raise TypeError(f"rank {self.rank}: {name} is device memory ({type(obj).__name__}) "
                                    f"but this communicator runs on the CPU")
                if not isinstance(obj, np.ndarray):
                    raise TypeError(f"rank {self.rank}: {name} must be a numpy array, got {type(obj).__name__}")
            arr = obj
            address = self._host_address(arr)
            writeable = arr.flags.writeable
        else:
            arr, address, writeable = self._device_array(obj, name)
        if not arr.flags.c_contiguous:
            raise ValueError(f"rank {self.rank}: {name} must be C-contiguous")
        dt = arr.dtype
        if dt not in DTYPE_OF:
            try:
                dtype_name(dt)
            except TypeError as e:
                raise TypeError(f"rank {self.rank}: {name}: {e}") from None
        if write and not writeable:
            raise ValueError(f"rank {self.rank}: {name} is read-only")
        if address % dt.itemsize and arr.size:
            raise ValueError(f"rank {self.rank}: {name} is not aligned to its element size {dt.itemsize}")
        return Buffer(obj, address, arr.size, dt, arr.nbytes, writeable)

    def _host_address(self, arr: np.ndarray) -> int:
        """arr's data address. Looking it up costs microseconds, a noticeable part of a
        small collective, so the last few arrays seen are remembered (weakly: the cache
        keeps no array alive; a numpy array's buffer does not move while it lives)."""
        hit = self._addresses.get(id(arr))
        if hit is not None and hit[0]() is arr and hit[2] == arr.nbytes:
            return hit[1]
        address = arr.__array_interface__["data"][0]
        if len(self._addresses) >= 16:
            self._addresses.pop(next(iter(self._addresses)))
        try:
            self._addresses[id(arr)] = (weakref.ref(arr), address, arr.nbytes)
        except TypeError:  # an ndarray subclass without weak references: no caching
            pass
        return address

    def _device_array(self, obj, name):
        import cupy

        if isinstance(obj, np.ndarray):
            raise TypeError(f"rank {self.rank}: {name} is host memory (numpy) but this communicator runs on "
                            f"cuda:{self.device_id}")
        if isinstance(obj, cupy.ndarray):
            arr = obj
        elif hasattr(obj, "__cuda_array_interface__"):
            arr = cupy.asarray(obj)
        elif hasattr(obj, "__dlpack__"):
            arr = cupy.from_dlpack(obj)
        else:
            raise TypeError(f"rank {self.rank}: {name} must be a CuPy array or expose __cuda_array_interface__ "
                            f"or __dlpack__, got {type(obj).__name__}")
        if arr.device.id != self.device_id:
            raise ValueError(f"rank {self.rank}: {name} is on cuda:{arr.device.id} but this communicator runs on "
                             f"cuda:{self.device_id}")
        readonly = bool(getattr(obj, "__cuda_array_interface__", {}).get("data", (0, False))[1]) \
            if hasattr(obj, "__cuda_array_interface__") and not isinstance(obj, cupy.ndarray) else False
        return arr, int(arr.data.ptr), not readonly

    def close(self) -> None:
        """Collective when GIN is in use: every rank's proxy delivers what its kernels
        posted before any proxy stops."""
        if getattr(self, "proxy", None) is not None:
            self.proxy.quiesce(self.timeout)
            self.world.barrier(what="GIN proxies drained")
            self.proxy.stop()
            self.proxy = None
        for win in getattr(self, "_symmetric", ()):
            win.close()
        self.window.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _device_pointer_of_host(ptr: int) -> int:
    """The device address of registered host memory (cudaHostGetDevicePointer); with
    unified addressing and host-pointer support it is the host address itself."""
    try:
        from cuda.bindings import runtime as cudart

        err, dptr = cudart.cudaHostGetDevicePointer(ptr, 0)
        if int(err) == 0:
            return int(dptr)
    except ImportError:
        pass
    return ptr


def _address(table) -> int:
    if isinstance(table, np.ndarray):
        return table.ctypes.data
    return int(table.data.ptr)


def _resolve_device(device: str) -> str:
    if device == "auto":
        try:
            import cupy

            return "cuda" if cupy.is_available() else "cpu"
        except ImportError:
            return "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', not {device!r}")
    if device == "cuda":
        try:
            import cupy
        except ImportError as e:
            raise CapabilityError("device='cuda' needs CuPy (pip install 'commref[cuda12]' or '[cuda13]')") from e
        if not cupy.is_available():
            raise CapabilityError("device='cuda' but no CUDA device is available")
    return device
