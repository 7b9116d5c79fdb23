"""Users' own kernels: a device communicator (NCCL's ncclDevComm) and kernels written
against commref's device API (include/commref/device.h), compiled and launched from
Python with the same source on a GPU (NVRTC, the driver) and on the CPU engine.

    dc = DeviceComm(world, window_bytes=1 << 20, signals=8)
    kernel = Kernel(source, "my_kernel")
    kernel.launch(dc, grid=1, args=(x, y, n))

A DeviceComm is a communicator of its own (its windows, GIN proxy, error record and
deadline) created with the requirements the kernel states: the device window's bytes,
signals, counters, strong signals, counted writes. They are checked against the GIN
backend as the collectives' are (backends.Requirements): a backend that cannot meet
them is skipped, and when none can, creation fails with a CapabilityError naming what
is missing. Every rank creates it (collective) and launches the same kernels in the
same order. Its collectives (`dc.comm`) and its users' kernels run one at a time.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import struct
import threading
import zlib
from pathlib import Path

import numpy as np

from commref.device_kernels import abi, build, cpu_loader, gpu_loader
from commref.device_kernels.build import CompileError, KernelError
from commref.transports.errors import CapabilityError
from commref.transports.gin.native import NativeProxy
from commref.transports.gin.options import GinOptions
from commref.transports.gin.study.cells import counted_writes_refusal

from .. import tuner
from ..communicator import Communicator
from ..launch_record import address_of
from . import requirements as req


class _EndsOwned:
    """close() and the with-statement end what the object owns (_owned()), as that one's
    own do."""

    def _owned(self):
        raise NotImplementedError

    def close(self) -> None:
        self._owned().close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._owned().__exit__(*exc)


class DeviceComm(_EndsOwned):
    """A device communicator over the ranks of `world`.

    Requirements: `window_bytes` (each rank's device window, a multiple of 8),
    `signals` (ids 0..signals-1), `counters` (ids 0..counters-1), `contexts` (GIN
    contexts 0..contexts-1, each its own ordering domain; at most 4), `strong_signals`
    (True: GIN links must offer strong signals; False: weak ones suffice, so the gda
    backend qualifies, and the connections publish with weak signals, gin_protocol
    "signal-per-put", unless told otherwise), `counted_writes` (device.h countedPut over
    GIN: refused where the ordering study finds counted writes unsafe on the wire),
    `strict_ordering` (NCCL_WIN_STRICT_ORDERING: VA signals in kernels; the GIN backend
    must offer VA signals, so gda is skipped). Other keywords are Communicator options
    (path, backend, wire, network, device_id: by default this rank's GPU,
    world.local_rank % the visible GPUs, communicator.use_rank_gpu).
    `requirements` (requirements.DeviceRequirements) states them as one object instead,
    with barrier counts, VA signals (strict ordering), multimem and queue depth besides
    (the keywords above are then left out); what cannot be met is refused at creation.
    properties() says what the communicator has."""

    def __init__(
        self,
        world,
        *,
        window_bytes: int,
        signals: int = 0,
        counters: int = 0,
        contexts: int = 1,
        strong_signals: bool = True,
        counted_writes: bool = False,
        strict_ordering: bool = False,
        device: str = "auto",
        requirements: req.DeviceRequirements | None = None,
        **options,
    ):
        self.requirements = requirements
        if requirements is not None:
            stated = dict(signals=signals, counters=counters, contexts=contexts, strong_signals=strong_signals)
            stated["counted_writes"] = counted_writes
            given = [k for k, v in stated.items() if v != req.DeviceRequirements.__dataclass_fields__[k].default]
            if given:
                raise ValueError(f"{', '.join(given)}: state them in requirements, not beside it")
            if not isinstance(requirements, req.DeviceRequirements):
                raise TypeError(f"requirements must be a DeviceRequirements, not {type(requirements).__name__}")
            signals, counters, contexts = requirements.signals, requirements.counters, requirements.contexts
            strong_signals, counted_writes = requirements.strong_signals, requirements.counted_writes
            strict_ordering = strict_ordering or requirements.va_signals
            req.refuse(world.rank, requirements.refusal_before(options))
            if requirements.queue_depth:
                options.setdefault("gin_queue", max(requirements.queue_depth, GinOptions.queue))
        if isinstance(window_bytes, bool) or not isinstance(window_bytes, int) or window_bytes < 8 or window_bytes % 8:
            raise ValueError(f"window_bytes must be a positive multiple of 8, not {window_bytes!r}")
        if isinstance(contexts, bool) or not isinstance(contexts, int) or not 1 <= contexts <= abi.DEVCOMM_MAX_CONTEXTS:
            raise ValueError(f"contexts must be an integer from 1 to {abi.DEVCOMM_MAX_CONTEXTS}, not {contexts!r}")
        self.contexts = contexts
        if not isinstance(strict_ordering, bool):
            raise ValueError(f"strict_ordering must be True or False, not {strict_ordering!r}")
        if strict_ordering:
            options["gin_va_signals"] = True
        if not strong_signals:
            options.setdefault("gin_protocol", "signal-per-put")
        elif options.get("gin_protocol", "strong") != "strong":
            raise ValueError(
                "strong_signals=True needs the connections' gin_protocol 'strong' (the requirement "
                "that makes backend selection insist on strong signals)"
            )
        self.comm = Communicator(
            world,
            device,
            device_window=window_bytes,
            device_signals=signals,
            device_contexts=contexts,
            gin_counters=counters,
            **options,
        )
        try:
            self._setup(window_bytes, signals, counters, strong_signals, counted_writes)
            if requirements is not None:
                req.refuse(self.rank, requirements.refusal_after(self.comm.backend))
            # collective, as creation is: every rank's LSA team, for properties()
            self._lsa_teams = len(set(world.allgather(tuple(self.lsa_ranks), "device communicator LSA teams")))
            self.strict_ordering = strict_ordering
            self.strided_teams = self._strided_teams(world)
            if requirements is not None:
                req.refuse(self.rank, requirements.refusal_teams(self.strided_teams))
            flags = (abi.DEVCOMM_STRICT_ORDERING if strict_ordering else 0) | (
                abi.DEVCOMM_STRIDED_TEAMS if self.strided_teams else 0
            )
            self.args[0]["comm"]["flags"] |= flags
            self.record_bytes = self.args.tobytes()
        except BaseException:
            self.comm.close()
            raise

    def _setup(self, window_bytes, signals, counters, strong_signals, counted_writes) -> None:
        comm = self.comm
        self.rank, self.nranks, self.device = comm.rank, comm.nranks, comm.device
        self.window_bytes, self.signals, self.counters = window_bytes, signals, counters
        backend = comm.backend
        # strong_signals=True kept gin_protocol "strong", which made backend selection insist on them
        self.strong_signals = backend is None or backend.caps.strong_signals
        refusal = counted_writes_refusal(comm.gin.transport if comm.gin.used else None)
        self.counted_writes = refusal is None
        if counted_writes and refusal:
            raise CapabilityError(f"rank {self.rank}: {refusal}")
        self.lsa_ranks = [r for r in range(self.nranks) if not (comm.peer_mask >> r) & 1]
        self._lsa_table = comm.device_table(np.array(self.lsa_ranks, np.int32))
        self.args = np.zeros(1, dtype=abi.KERNEL_ARGS)
        d = self.args[0]["comm"]
        d["coll"] = comm.launch_record.record
        coll = d["coll"]
        coll["nchannels"], coll["elemSize"] = comm.max_channels, 1
        coll["protocol"] = abi.PROTOCOL_CODES["simple"]
        d["windowOff"], d["windowBytes"] = comm.device_window_offset, window_bytes
        d["counters"] = (
            int(coll["gin"]["counters"]) if comm.gin.used else comm.window.address + int(comm.layout["ginCountersOff"])
        )
        d["lsaRanks"] = address_of(self._lsa_table)
        d["signalBase"] = abi.gin_signals(comm.window_channels, comm.nsteps)[1]
        d["nsignals"], d["ncounters"] = signals, counters
        d["flags"] = (abi.DEVCOMM_STRONG_SIGNALS if self.strong_signals else 0) | (
            abi.DEVCOMM_COUNTED_WRITES if self.counted_writes else 0
        )
        d["lsaRank"], d["lsaSize"] = self.lsa_ranks.index(self.rank), len(self.lsa_ranks)
        d["ncontexts"] = self.contexts
        self.record_bytes = self.args.tobytes()  # each launch copies it and writes its own fields (Kernel.launch)
        self.launches = 0
        self._lock = threading.Lock()

    def _strided_teams(self, world) -> bool:
        """Collective: whether every node holds lsaSize consecutive ranks, the same number on
        each, so that the LSA and rail teams are strided teams (device.h, team.h)."""
        lsa = self.lsa_ranks
        mine = (lsa == list(range(lsa[0], lsa[0] + len(lsa))), lsa[0], len(lsa))
        every = world.allgather(mine, "device communicator teams")
        size = mine[2]
        return all(ok and first % size == 0 and n == size for ok, first, n in every)

    @property
    def backend(self) -> str | None:
        """The GIN backend's name, None when every peer is over LSA."""
        return self.comm.backend.name if self.comm.backend is not None else None

    def properties(self) -> req.DeviceProperties:
        """What this communicator has (requirements.DeviceProperties): its GIN backend,
        engine and wire, their abilities, multimem, its LSA team and the number of LSA
        teams, its contexts, signals, counters, barriers and queue depth."""
        comm, backend = self.comm, self.comm.backend
        caps = backend.caps if backend is not None else None
        used = comm.gin.used
        return req.DeviceProperties(
            rank=self.rank,
            nranks=self.nranks,
            device=self.device,
            gin_backend=backend.name if backend is not None else None,
            gin_engine=("native" if isinstance(comm.proxy, NativeProxy) else "python") if used else None,
            wire=comm.gin.options.wire.value if used else None,
            strong_signals=self.strong_signals,
            va_signals=self.strict_ordering and (caps is None or caps.va_signals),
            counters_supported=caps is None or caps.counters,
            get_supported=caps is None or caps.get,
            local_completion_orders_later_writes=caps is not None and caps.local_completion_orders_later_writes,
            counted_writes=self.counted_writes,
            multimem=req.MULTIMEM,
            lsa_rank=self.lsa_ranks.index(self.rank),
            lsa_size=len(self.lsa_ranks),
            lsa_teams=self._lsa_teams,
            contexts=self.contexts,
            signals=self.signals,
            counters=self.counters,
            barriers=req.WORLD_BARRIERS,
            lsa_barriers=req.LSA_BARRIERS,
            rail_barriers=req.RAIL_BARRIERS if self.strided_teams else 0,
            hybrid_barriers=req.HYBRID_BARRIERS if self.strided_teams else 0,
            queue_depth=comm.gin.options.queue if used else 0,
        )

    def window(self, dtype="uint8", count: int | None = None, offset: int = 0):
        """This rank's device window (or `count` elements of `dtype` from byte `offset`)
        as a numpy array (CPU) or a CuPy array (GPU), for filling inputs and reading
        results between launches."""
        dtype = np.dtype(dtype)
        if offset < 0 or offset % dtype.itemsize:
            raise ValueError(f"offset {offset} must be >= 0 and a multiple of {dtype.name}'s {dtype.itemsize} bytes")
        count = (self.window_bytes - offset) // dtype.itemsize if count is None else count
        if count < 0 or offset + count * dtype.itemsize > self.window_bytes:
            raise ValueError(
                f"{count} {dtype.name} at offset {offset} exceed the device window ({self.window_bytes} bytes)"
            )
        start = self.comm.device_window_offset + offset
        return self.comm.window.local[start : start + count * dtype.itemsize].view(dtype)

    def synchronize(self, stream=None) -> None:
        """GPU: waits for this communicator's kernels, raising a kernel's failure."""
        self.comm.synchronize(stream)

    def _owned(self) -> Communicator:
        return self.comm


class UsesDeviceComm(_EndsOwned):
    """What owns a device communicator `dc` (the handles built on it: rmsnorm.FusedRMSNorm,
    ep_buffer.Buffer): close() and the with-statement end it as DeviceComm's own do."""

    dc: DeviceComm

    def _owned(self) -> DeviceComm:
        return self.dc


_KERNEL_NAME = re.compile(r"^[A-Za-z_]\w*$")
# Where a launch writes into its copy of the KernelArgs record (byte offsets).
_COMM_AT = abi.KERNEL_ARGS.fields["comm"][1]
_LAUNCH_AT = _COMM_AT + abi.DEV_COMM.fields["launch"][1]
_CALL_DESC_AT = _COMM_AT + abi.DEV_COMM.fields["coll"][1] + abi.COLL_ARGS.fields["callDesc"][1]
_ARG_AT, _NARGS_AT = abi.KERNEL_ARGS.fields["arg"][1], abi.KERNEL_ARGS.fields["nargs"][1]
_SIGNED_64 = (-(1 << 63), (1 << 64) - 1)


class Kernel:
    """A user's kernel: `source` (CUDA C++ that includes "commref/device.h") defining
    `COMMREF_KERNEL(name, KernelArgs, args)`. Compiled on first launch per device (or by
    compile()), cached by source hash; a compile error raises CompileError with the
    compiler's message, which names `filename` and the line."""

    def __init__(self, source: str, name: str, filename: str | None = None):
        if not _KERNEL_NAME.match(name):
            raise ValueError(f"kernel name {name!r} is not a C identifier")
        if not re.search(rf"COMMREF_KERNEL\(\s*{name}\s*,\s*(?:commref::)?KernelArgs\s*,", source):
            raise ValueError(f"the source defines no COMMREF_KERNEL({name}, KernelArgs, ...)")
        self.source, self.name = source, name
        self.filename = filename or f"{name}.cu"
        if os.sep in self.filename or not self.filename.endswith(".cu"):
            raise ValueError(f"filename {self.filename!r} must be a bare name ending in .cu")
        self.call_desc = zlib.crc32(name.encode()) << 32 | 0xF  # collective field 15: a user kernel (Prims headers)
        self._lock = threading.Lock()
        self._cpu = None
        self._gpu: dict[int, int] = {}  # device id -> CUfunction
        self._occupancy: dict[
            tuple[int, int], tuple[int, int]
        ] = {}  # (device id, block) -> (blocks per SM, max threads)
        self._modules: list = []

    @property
    def path(self) -> Path:
        """The source as the compilers see it: cache_dir()/user/<hash>/<filename>."""
        digest = hashlib.sha256(self.source.encode()).hexdigest()[:16]
        path = build.cache_dir() / "user" / digest / self.filename
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(self.source)
            os.replace(tmp, path)
        return path

    def _compile_error(self, e: CompileError, path: Path) -> CompileError:
        log = e.log.replace(str(path.parent) + os.sep, "")
        return CompileError(f"kernel {self.name}: {self.filename} does not compile:\n{log.rstrip()}", log)

    def compile(self, device: str = "cpu", device_id: int = 0):
        """Builds the kernel for `device` ("cpu", or "cuda" on `device_id`)."""
        built = self._cpu if device == "cpu" else self._gpu.get(device_id)
        if built is not None:  # every launch asks: no hashing of the source, no file system
            return built
        with self._lock:
            path = self.path
            try:
                if device == "cpu":
                    if self._cpu is None:
                        self._cpu = cpu_loader.CpuKernels(cpu_loader.build_user_cpu_library(path))
                        self._cpu.entry(self.name)
                    return self._cpu
                if device_id not in self._gpu:
                    import cupy
                    from cupy.cuda import function

                    with cupy.cuda.Device(device_id):
                        cc = int(cupy.cuda.Device(device_id).compute_capability)
                        module = function.Module()
                        module.load(gpu_loader.build_user_gpu_image(path, cc).read_bytes())
                        self._gpu[device_id] = gpu_loader.load_function(module, self.name, device_id)
                        self._modules.append(module)
                return self._gpu[device_id]
            except CompileError as e:
                raise self._compile_error(e, path) from None

    def launch(self, dc: DeviceComm, grid: int = 1, block: int | None = None, args=(), stream=None) -> None:
        """Runs the kernel on every rank's device communicator `dc` (each rank launches;
        collective in the sense that the kernel's signals and barriers meet the peers').
        `args`: up to abi.KERNEL_MAX_ARGS arrays (passed as device addresses; on the
        device of `dc`, contiguous), integers and floats (as 64-bit words). On the CPU it
        returns when the kernel ends; on a GPU it is enqueued on `stream` (None: CuPy's
        current one) and a failure is raised at dc.synchronize() or the next launch."""
        comm = dc.comm
        comm.check_usable("device communicator")
        block = comm.threads if block is None else block
        for what, v in (("grid", grid), ("block", block)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{what} must be a positive integer, not {v!r}")
        words = [self._word(i, a, dc) for i, a in enumerate(args)]
        if len(words) > abi.KERNEL_MAX_ARGS:
            raise ValueError(f"a kernel takes at most {abi.KERNEL_MAX_ARGS} arguments, got {len(words)}")
        built = self.compile(comm.device, comm.device_id or 0)  # before counting a launch that cannot happen
        if comm.device != "cpu":  # the CPU engine runs every block of a launch at once, or refuses it
            self._check_residency(comm, built, grid, block)
        with dc._lock:
            dc.launches += 1
            # the driver copies it at launch; the CPU reads it until the kernel ends (copied as
            # bytes: a structured copy goes field by field, 5x slower)
            record = ctypes.create_string_buffer(dc.record_bytes, len(dc.record_bytes))
            struct.pack_into("<Q", record, _LAUNCH_AT, dc.launches)
            struct.pack_into("<Q", record, _CALL_DESC_AT, self.call_desc)
            struct.pack_into(f"<{len(words)}Q", record, _ARG_AT, *words)
            struct.pack_into("<I", record, _NARGS_AT, len(words))
            if comm.device == "cpu":
                status = built.launch(self.name, grid, block, None, address=ctypes.addressof(record))
            else:
                if comm.failed:
                    raise comm.failure()
                from cupy.cuda import driver

                fn = built
                param = ctypes.c_void_p(ctypes.addressof(record))  # the driver copies the record at launch
                # On the communicator's own stream, joined to the caller's (GpuStream.enqueue),
                # so that a user's kernel never overlaps the collectives.
                status = comm.gpu_stream.enqueue(
                    lambda own: driver.launchKernel(*gpu_loader.launch_arguments(fn, grid, block, own, param)) or 0,
                    comm.gpu_stream.caller(stream),
                )
        # on the CPU also a failure recorded outside a wait (the kernel returned without leaving)
        comm.end_launch(status or int(comm.device == "cpu" and comm.failed))

    def _check_residency(self, comm, fn: int, grid: int, block: int) -> None:
        """GPU: refuses (CapabilityError) a launch whose blocks, with those of the other
        ranks of this process on this GPU, cannot all be resident at once: blocks that wait
        for one another (a peer's, through signals and barriers) would spin until the
        deadline. The collectives' rule (tuner.residency_problem) with this kernel's own
        occupancy (cuOccupancyMaxActiveBlocksPerMultiprocessor for `block` threads)."""
        key = (comm.device_id, block)
        occupancy = self._occupancy.get(key)
        if occupancy is None:
            from cupy.cuda import driver

            limit = int(driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn))
            per_sm = 0 if block > limit else int(driver.occupancyMaxActiveBlocksPerMultiprocessor(fn, block, 0))
            occupancy = self._occupancy[key] = (per_sm, limit)
        per_sm, limit = occupancy
        why = tuner.residency_problem(
            f"kernel {self.name}",
            comm.gpu_stream.ranks_on_device,
            grid,
            block,
            per_sm,
            comm.kernels.sm_count,
            unit="blocks (grid)",
            knob="blocks (grid)",
        )
        if why:
            raise CapabilityError(
                f"rank {comm.rank}: GPU {comm.device_id}: {why}"
                + (f" (its limit: {limit} threads)" if per_sm == 0 else "")
            )

    def _word(self, i: int, value, dc: DeviceComm) -> int:
        """Launch argument `i` as a 64-bit word."""
        if type(value) is np.ndarray and dc.device == "cpu" and value.flags.c_contiguous:  # the common case first
            return value.ctypes.data
        if isinstance(value, (bool, np.bool_)):
            return int(value)
        if isinstance(value, (int, np.integer)):
            v = int(value)
            if not _SIGNED_64[0] <= v <= _SIGNED_64[1]:
                raise ValueError(f"argument {i}: {v} does not fit 64 bits")
            return v & (2**64 - 1)
        if isinstance(value, (float, np.floating)):
            return struct.unpack("<Q", struct.pack("<d", float(value)))[0]
        if isinstance(value, np.ndarray):
            if dc.device != "cpu":
                raise ValueError(
                    f"argument {i}: a numpy array for a kernel on GPU {dc.comm.device_id}; pass a "
                    f"CuPy array on that device"
                )
            if not value.flags.c_contiguous:
                raise ValueError(f"argument {i}: the array is not contiguous")
            return value.ctypes.data
        if hasattr(value, "__cuda_array_interface__"):
            if dc.device != "cuda":
                raise ValueError(f"argument {i}: a GPU array for a kernel on the CPU engine")
            dev = getattr(getattr(value, "device", None), "id", dc.comm.device_id)
            if dev != dc.comm.device_id:
                raise ValueError(f"argument {i}: the array is on GPU {dev}, the kernel runs on GPU {dc.comm.device_id}")
            if not value.flags.c_contiguous:
                raise ValueError(f"argument {i}: the array is not contiguous")
            return int(value.data.ptr)
        raise TypeError(f"argument {i}: {type(value).__name__} is not an array, an integer or a float")


__all__ = ["DeviceComm", "Kernel", "UsesDeviceComm", "CompileError", "KernelError"]
