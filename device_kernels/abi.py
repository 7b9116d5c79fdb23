"""The ABI shared with the C++ kernels and the CPU engine, defined once in Python.

Kernels take one plain struct by value. The host builds it as a numpy record of the
dtypes below and hands its address to the launch: the CUDA driver copies the bytes
as the kernel's by-value parameter (kernelParams), the CPU engine passes the address.
Every struct, constant and code here has a C++ twin in include/commref/ (args.h, gin.h,
reduce.h); the CPU build exports those as one table (``commref_abi_table()``,
cpu/abi.cpp), abi_table() builds the same table from this module, and
``tests/test_compile.py::test_abi_table_matches_python`` asserts that the two are equal.
A change is one edit here and one in C++.
"""

from __future__ import annotations

import numpy as np

MAX_CHANNELS = 16
DIRECT_MAX_RANKS = 64  # COMMREF_DIRECT_MAX_RANKS
CONN_IN = 4  # inbound FIFOs per channel
CONN_OUT = 4  # outbound links per channel

# Inbound FIFO and outbound link indices (ConnIn / ConnOut in args.h).
IN_RING, IN_TREE_CHILD0, IN_TREE_CHILD1, IN_TREE_PARENT = range(4)
OUT_RING, OUT_TREE_PARENT, OUT_TREE_CHILD0, OUT_TREE_CHILD1 = range(4)

# ErrorRecord.code and .what (ErrorCode / WaitWhat in args.h).
ERR_OK, ERR_TIMEOUT, ERR_MISMATCH, ERR_ABORTED = 0, 1, 2, 3
# The kernel has no instance for the call's (dtype, op) (a GPU module specialised for
# others was launched): seen = dtype | op << 32, expected = the module's dtype | op mask
# << 32 (bit k: op code k), or 2**64 - 1 where every instance was built.
ERR_NO_INSTANCE = 4
# ErrorRecord.code while the thread that claimed the record (a failing kernel thread, or
# Communicator.abort on the host) fills it (COMMREF_RECORD_CLAIMED in wait.h).
RECORD_CLAIMED = 0x80000000
(
    WAIT_RECV_READY,
    WAIT_SEND_CREDIT,
    CALL_MISMATCH,
    COUNT_MISMATCH,
    WAIT_GIN_QUEUE,
    WAIT_GIN_FLUSH,
    WAIT_LSA_BARRIER,
    BUFFER_MISMATCH,
    WAIT_SIGNAL,
    WAIT_COUNTER,
    WAIT_BARRIER,
    BAD_ARGUMENT,
    WAIT_P2P_ACCEPT,
    P2P_RECV_MISMATCH,
    P2P_SEND_REJECTED,
) = range(1, 16)
WAIT_WHAT = {
    WAIT_RECV_READY: "data of the next step (recv ready)",
    WAIT_SEND_CREDIT: "a free FIFO slot (send credit)",
    CALL_MISMATCH: "call descriptor",
    COUNT_MISMATCH: "element count",
    WAIT_GIN_QUEUE: "a free GIN queue slot (the proxy is behind)",
    WAIT_GIN_FLUSH: "the GIN proxy to complete earlier operations (flush)",
    WAIT_LSA_BARRIER: "the LSA barrier of a direct kernel",
    BUFFER_MISMATCH: "symmetric buffer offset",
    WAIT_SIGNAL: "a signal of the device communicator",
    WAIT_COUNTER: "a counter of the device communicator",
    WAIT_BARRIER: "the device communicator's barrier",
    BAD_ARGUMENT: "a device-API argument within its limit",
    WAIT_P2P_ACCEPT: "the receiver to accept a send (its first slot taken)",
    P2P_RECV_MISMATCH: "the sender's dtype and count (p2p)",
    P2P_SEND_REJECTED: "the receiver's dtype and count (p2p)",
}

# CpuProtocolSupport (args.h): what commref_cpu_protocol_support() (cpu/engine.cpp) reports
# of this CPU. ATOMIC_16: aligned 16-byte SSE loads and stores are single-copy atomic
# (x86-64 with AVX; LL relies on it); STORE_ORDER: stores become visible in program order
# (x86-64; GIN lands LL128 lines by it).
CPU_ATOMIC_16, CPU_STORE_ORDER = 1, 2

# ProfilePhase (profile.h): the profile build's counters, in commref_cpu_profile's order.
PROFILE_COPY, PROFILE_REDUCE, PROFILE_WAIT, PROFILE_HELP, PROFILE_KERNEL, PROFILE_PHASES = 0, 1, 2, 3, 4, 5

# What a CPU launch returns (commref_cpu_launch in cpu/engine.cpp).
LAUNCH_STUCK = 3  # CPU: a block's threads wait at barriers that can never complete (coop.h)
LAUNCH_OK, LAUNCH_FAILED, LAUNCH_REFUSED = 0, 1, 2  # failed: the ErrorRecord says why; refused: bad grid

# DataType and RedOp (reduce.h): NCCL's ncclDataType_t and ncclRedOp_t codes, and each
# dtype's C++ element type.
DTYPE_CODES = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
CXX_TYPES = {
    0: "int8_t",
    1: "uint8_t",
    2: "int32_t",
    3: "uint32_t",
    4: "int64_t",
    5: "uint64_t",
    6: "half_t",
    7: "float",
    8: "double",
    9: "bf16_t",
}
OP_CODES = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

# The call descriptor every step carries (CollArgs.callDesc): fields that must agree
# across ranks, packed as (name, shift, bits). Collective and algorithm codes below.
CALL_FIELDS = (
    ("collective", 0, 4),
    ("algorithm", 4, 4),
    ("dtype", 8, 8),
    ("op", 16, 8),
    ("root", 24, 16),
    ("nchannels", 40, 8),
    ("protocol", 48, 4),
    ("variant", 52, 4),  # nvls AllReduce: NVLS_VARIANTS; 0 otherwise
)
COLLECTIVE_CODES = {
    "allreduce": 0,
    "allgather": 1,
    "reduce_scatter": 2,
    "broadcast": 3,
    "reduce": 4,
    "alltoall": 5,
    "p2p": 6,  # a send or recv (kernels/p2p.cu)
}
ALGORITHM_CODES = {"ring": 0, "tree": 1, "direct": 2, "nvls": 3}
# NvlsVariant (kernels/nvls.cu): the call descriptor's variant field of an nvls AllReduce.
NVLS_VARIANTS = {"one_shot": 0, "two_shot": 1}
# Protocol (args.h, include/commref/proto.h): how a FIFO step's data and readiness travel.
PROTOCOL_CODES = {"simple": 0, "ll": 1, "ll128": 2}

# Kernel entry points (COMMREF_KERNEL names in kernels/*.cu): the collectives, which
# take CollArgs, and the CPU engine's own kernels, which take the struct ENGINE_KERNELS
# names: self-test and benchmark (kernels/selftest.cu), a packed group's copies
# (kernels/pack.cu).
KERNEL_NAMES = (
    "commref_ring_allreduce",
    "commref_tree_allreduce",
    "commref_ring_reduce_scatter",
    "commref_ring_allgather",
    "commref_ring_broadcast",
    "commref_ring_reduce",
    "commref_direct_allreduce",
    "commref_direct_reduce_scatter",
    "commref_direct_allgather",
    "commref_ring_alltoall",
    "commref_direct_alltoall",
    "commref_nvls_allreduce",
    "commref_p2p",
)
ENGINE_KERNELS = {
    "commref_copy": "CopyArgs",
    "commref_empty": "CopyArgs",
    "commref_engine_selftest": "CopyArgs",
    "commref_stream": "StreamArgs",
    "commref_pack": "PackArgs",
}
ENGINE_KERNEL_NAMES = tuple(ENGINE_KERNELS)

# GinProtocol (args.h): how a GIN connection publishes a slot.
GIN_PROTOCOLS = {"strong": 0, "weak-last": 1, "signal-per-put": 2, "flush-signal": 3}
# GinOp and GinFlags (gin.h).
GIN_PUT, GIN_PUT_VALUE, GIN_SIGNAL, GIN_GET, GIN_FLUSH, GIN_DOORBELL = 1, 2, 3, 4, 5, 6
GIN_HAS_SIGNAL, GIN_STRONG, GIN_VA, GIN_ADD, GIN_HAS_COUNTER, GIN_BULK = 1, 2, 4, 8, 16, 32

SLOT_HEADER = 64  # bytes before each FIFO slot's data: call descriptor and count
FLAG_STRIDE = 64  # bytes between flag words: two writers never share a cache line
# LL and LL128 slots (proto.h): an LL slot is LL_HEADER bytes of header lines, then an
# LL_LINE-byte line per 8 data bytes; an LL128 slot is a header line, then an
# LL128_LINE-byte line per LL128_LINE_DATA data bytes.
LL_LINE, LL_HEADER, LL128_LINE, LL128_LINE_DATA = 16, 32, 128, 120
# After the GIN queue's descriptors: the claimed counter, a cache line later the consumed
# counter, a line later the engine's idle word (uint32, a futex: gin.h).
GIN_QUEUE_CLAIMED, GIN_QUEUE_CONSUMED, GIN_QUEUE_IDLE, GIN_QUEUE_HEADER = 0, 64, 128, 192
GIN_MAX_WINDOWS = 1024  # COMMREF_GIN_MAX_WINDOWS: window ids of GinDescriptor.windows (gin.h)
# Why a GIN engine refuses a descriptor (GinRefusalCode, gin.h), the conditions in the
# order every engine tests them: peer_outside (a peer outside [0, nranks)),
# peer_unmapped (network shm: the peer's connection window is not mapped here),
# window_unknown (an access names a window id the engine was not given),
# outside_window (an access reaches past its window's end), window_unmapped (a rank's
# copy of a window is not mapped here), strong_signal (a strong signal on a weak-only
# backend), va_signal (a VA signal without VA signals), signal_add (an add where
# signals count completed writes), unknown_op. The native engine reports a code and its
# numbers (GIN_REFUSAL); transports/gin/engine.py holds the one text of each.
GIN_REFUSALS = {
    "peer_outside": 1,
    "peer_unmapped": 2,
    "window_unknown": 3,
    "outside_window": 4,
    "window_unmapped": 5,
    "strong_signal": 6,
    "va_signal": 7,
    "signal_add": 8,
    "unknown_op": 9,
}
# Which access of a descriptor a refusal names (GinAccess, gin.h); landing and
# get_request are the MPI network's, checked at the target.
GIN_ACCESSES = {
    "put_source": 1,
    "put_destination": 2,
    "get_source": 3,
    "get_destination": 4,
    "signal": 5,
    "landing": 6,
    "get_request": 7,
}


def gin_windows(src: int, dst: int) -> int:
    """GinDescriptor.windows: a put's or get's source and destination window ids (gin.h)."""
    return src | dst << 16


GIN_QUEUE_HELP_FN, GIN_QUEUE_HELP_CTX, GIN_QUEUE_HELP_END = 136, 144, 152  # the help and end hooks (gin.h)


def p2p_channels(nranks: int) -> int:
    """Window channels that point-to-point needs after the collectives' (kernels/p2p.cu):
    a link per peer, CONN_OUT of them per channel."""
    return -(-(nranks - 1) // CONN_OUT) if nranks > 1 else 0


def gin_signals(nchannels: int, nsteps: int) -> tuple[int, int]:
    """(credit signal base, total signals) of a GIN window: a ready signal per slot of
    every inbound FIFO, then a credit signal per outbound link (connection.h)."""
    base = nchannels * CONN_IN * nsteps
    return base, base + nchannels * CONN_OUT


WINDOW_LAYOUT = np.dtype(
    [
        ("fifoOff", "<u8"),
        ("readyOff", "<u8"),
        ("creditOff", "<u8"),
        ("stateOff", "<u8"),
        ("stagingOff", "<u8"),
        ("ginQueueOff", "<u8"),
        ("ginSignalsOff", "<u8"),
        ("ginCountersOff", "<u8"),
        ("syncOff", "<u8"),
        ("slotBytes", "<u8"),
        ("nsteps", "<u4"),
        ("flagStride", "<u4"),
        ("llFifoOff", "<u8"),
        ("llStagingOff", "<u8"),
        ("ll128FifoOff", "<u8"),
        ("ll128StagingOff", "<u8"),
        ("llSlotBytes", "<u8"),
        ("ll128SlotBytes", "<u8"),
    ],
    align=True,
)

CHANNEL_PEERS = np.dtype(
    [
        ("ringPrev", "<i4"),
        ("ringNext", "<i4"),
        ("treeParent", "<i4"),
        ("treeChild0", "<i4"),
        ("treeChild1", "<i4"),
        ("treeInAtParent", "<i4"),
        ("treeOutAtParent", "<i4"),
        ("ringPos", "<i4"),
    ],
    align=True,
)

ERROR_RECORD = np.dtype(
    [
        ("code", "<u4"),
        ("what", "<u4"),
        ("rank", "<i4"),
        ("peer", "<i4"),
        ("channel", "<i4"),
        ("pad", "<i4"),
        ("expected", "<u8"),
        ("seen", "<u8"),
    ],
    align=True,
)

GIN_ARGS = np.dtype(
    [
        ("peerMask", "<u8"),
        ("capacity", "<u4"),
        ("protocol", "<u4"),
        ("putsPerSlot", "<u4"),
        ("checkHeaders", "<u4"),
        ("creditSignalBase", "<u4"),
        ("doorbells", "<u4"),
        ("queue", "<u8"),
        ("counters", "<u8"),
    ],
    align=True,
)

GIN_DESCRIPTOR = np.dtype(
    [
        ("seq", "<u8"),
        ("op", "<u4"),
        ("flags", "<u4"),
        ("peer", "<i4"),
        ("ctx", "<i4"),
        ("dstOffset", "<u8"),
        ("srcOffset", "<u8"),
        ("bytes", "<u8"),
        ("signal", "<u8"),
        ("signalValue", "<u8"),
        ("counter", "<u4"),
        ("windows", "<u4"),
    ],
    align=True,
)

SYM_BUFFER = np.dtype([("peerTable", "<u8"), ("offset", "<u8"), ("ginWindow", "<u4"), ("pad", "<u4")], align=True)

COLL_ARGS = np.dtype(
    [
        ("sendbuf", "<u8"),
        ("recvbuf", "<u8"),
        ("count", "<u8"),
        ("peerWindows", "<u8"),
        ("ringRanks", "<u8"),
        ("errorRecord", "<u8"),
        ("abortFlag", "<u8"),
        ("callDesc", "<u8"),
        ("timeoutNs", "<i8"),
        ("layout", WINDOW_LAYOUT),
        ("rank", "<i4"),
        ("nranks", "<i4"),
        ("root", "<i4"),
        ("dtype", "<i4"),
        ("op", "<i4"),
        ("nchannels", "<i4"),
        ("elemSize", "<i4"),
        ("avgDivisor", "<i4"),
        ("streamStores", "<i4"),
        ("protocol", "<i4"),
        ("gin", GIN_ARGS),
        ("symSend", SYM_BUFFER),
        ("symRecv", SYM_BUFFER),
        ("peers", CHANNEL_PEERS, (MAX_CHANNELS,)),
    ],
    align=True,
)

# One operation of commref_p2p (P2pOp in args.h; collectives/p2p.py fills them).
P2P_OP = np.dtype(
    [
        ("buf", "<u8"),
        ("count", "<u8"),
        ("callDesc", "<u8"),
        ("bytes", "<u8"),
        ("symOffset", "<u8"),
        ("symWindows", "<u8"),
        ("peer", "<i4"),
        ("send", "<i4"),
        ("channel", "<i4"),
        ("conn", "<i4"),
        ("block", "<i4"),
        ("done", "<u4"),
        ("symWindow", "<u4"),
        ("pad", "<u4"),
    ],
    align=True,
)

COPY_ARGS = np.dtype([("src", "<u8"), ("dst", "<u8"), ("bytes", "<u8")], align=True)
# commref_pack's arguments: a table of `n` COPY_ARGS, and the flag that skips them (args.h).
PACK_ARGS = np.dtype(
    [("copies", "<u8"), ("n", "<u4"), ("flagBytes", "<u4"), ("flag", "<u8"), ("clear", "<u8")], align=True
)
# commref_stream's arguments (bench/bound.py): nin input and nout output arrays of `words`
# 32-bit words from `base`, the first `shared` outputs being the first inputs.
STREAM_ARGS = np.dtype(
    [("base", "<u8"), ("words", "<u8"), ("nin", "<i4"), ("nout", "<i4"), ("shared", "<i4"), ("streamStores", "<i4")],
    align=True,
)
# One prepared CPU launch (commref_cpu_launch_prepared, cpu/engine.cpp).
LAUNCH_DESC = np.dtype([("kernel", "<u8"), ("args", "<u8"), ("grid", "<u4"), ("block", "<u4")], align=True)

# The device communicator of users' kernels, and what they take (args.h).
KERNEL_MAX_ARGS = 16
DEVCOMM_MAX_CONTEXTS = 4  # GIN contexts a device communicator offers at most (device.h)
DEVCOMM_STRONG_SIGNALS, DEVCOMM_COUNTED_WRITES = 1, 2  # DevCommFlags
DEVCOMM_STRICT_ORDERING, DEVCOMM_STRIDED_TEAMS = 4, 8  # DevCommFlags
# BadArgumentReason (args.h): ErrorRecord.peer of a kBadArgument failure with a message of its own
BAD_ARGUMENT_REASONS = {
    "va_signal": 1,
    "va_offset": 2,
    "team_rank": 3,
    "team_shape": 4,
    "sym_ptr": 5,
    "bits": 6,
    "request_context": 7,
}
DEV_COMM = np.dtype(
    [
        ("coll", COLL_ARGS),
        ("windowOff", "<u8"),
        ("windowBytes", "<u8"),
        ("counters", "<u8"),
        ("lsaRanks", "<u8"),
        ("launch", "<u8"),
        ("signalBase", "<u4"),
        ("nsignals", "<u4"),
        ("ncounters", "<u4"),
        ("flags", "<u4"),
        ("lsaRank", "<i4"),
        ("lsaSize", "<i4"),
        ("ncontexts", "<u4"),
        ("pad", "<u4"),
    ],
    align=True,
)


# A refusal (GinRefusal, gin.h): its code and access (above), the descriptor's op and
# peer, the rank whose window copy is not mapped (window_unmapped), the window id, and
# the range [offset, offset + bytes) of a window of `size` bytes (outside_window).
GIN_REFUSAL = np.dtype(
    [
        ("code", "<u4"),
        ("access", "<u4"),
        ("op", "<u4"),
        ("peer", "<i4"),
        ("owner", "<i4"),
        ("window", "<u4"),
        ("offset", "<u8"),
        ("bytes", "<u8"),
        ("size", "<u8"),
    ],
    align=True,
)


def devcomm_reserved_signals(nranks: int, contexts: int = 1) -> int:
    """The barriers' signal words after a device communicator's own (device.h,
    impl/barrier__funcs.h): a word per peer in each word set (the world barrier's fence
    on each of its `contexts`, the world barrier without fence, the LSA barrier, the
    rail barrier's fence on each context, the rail barrier without fence), and an epoch
    per set."""
    return (2 * contexts + 3) * (nranks + 1)


KERNEL_ARGS = np.dtype(
    [("comm", DEV_COMM), ("arg", "<u8", (KERNEL_MAX_ARGS,)), ("nargs", "<u4"), ("pad", "<u4")], align=True
)

STRUCTS = {
    "CollArgs": COLL_ARGS,
    "ChannelPeers": CHANNEL_PEERS,
    "WindowLayout": WINDOW_LAYOUT,
    "ErrorRecord": ERROR_RECORD,
    "CopyArgs": COPY_ARGS,
    "LaunchDesc": LAUNCH_DESC,
    "StreamArgs": STREAM_ARGS,
    "PackArgs": PACK_ARGS,
    "GinArgs": GIN_ARGS,
    "GinDescriptor": GIN_DESCRIPTOR,
    "GinRefusal": GIN_REFUSAL,
    "SymBuffer": SYM_BUFFER,
    "DevComm": DEV_COMM,
    "KernelArgs": KERNEL_ARGS,
    "P2pOp": P2P_OP,
}


def _align(x: int, a: int = 64) -> int:
    return (x + a - 1) // a * a


def line_slot_bytes(slot_bytes: int) -> tuple[int, int]:
    """The data bytes of an LL and of an LL128 slot beside Simple slots of `slot_bytes`:
    a sixteenth (a multiple of 64, at least 64) and a quarter (a multiple of 8 lines'
    data, LL128_LINE_DATA * 8, at least one such)."""
    block = LL128_LINE_DATA * 8
    return max(64, slot_bytes // 16 // 64 * 64), max(block, slot_bytes // 4 // block * block)


def slot_strides(slot_bytes: int, ll_slot_bytes: int, ll128_slot_bytes: int) -> tuple[int, int, int]:
    """Bytes between two slots of the Simple, LL and LL128 regions (protoSlotStride, lsa.h)."""
    return (
        slot_bytes + SLOT_HEADER,
        LL_HEADER + ll_slot_bytes // 8 * LL_LINE,
        LL128_LINE + ll128_slot_bytes // LL128_LINE_DATA * LL128_LINE,
    )


def window_layout(
    nchannels: int,
    slot_bytes: int,
    nsteps: int,
    gin_capacity: int = 0,
    gin_counters: int = 0,
    nranks: int = 1,
    device_signals: int = 0,
) -> tuple[np.ndarray, int]:
    """The connection window's layout (WindowLayout: the regions args.h describes) for
    up to `nchannels` channels and `nranks` ranks, and its size in bytes. The GIN
    regions are empty when gin_capacity is 0. LL and LL128 slots: line_slot_bytes.
    `device_signals`: signal words of a device communicator (DevComm) after the
    connections' own, GIN or not."""
    lay = np.zeros((), dtype=WINDOW_LAYOUT)
    nin, nout = nchannels * CONN_IN, nchannels * CONN_OUT
    ll_bytes, ll128_bytes = line_slot_bytes(slot_bytes)
    stride, ll_stride, ll128_stride = slot_strides(slot_bytes, ll_bytes, ll128_bytes)
    off = 0

    def region(name: str, nbytes: int) -> None:
        nonlocal off
        if name.startswith("ll128"):  # LL128 lines are aligned 128-byte blocks (proto.h)
            off = _align(off, LL128_LINE)
        lay[name] = off
        off = _align(off + nbytes)

    region("fifoOff", nin * nsteps * stride)
    region("llFifoOff", nin * nsteps * ll_stride)
    region("ll128FifoOff", nin * nsteps * ll128_stride)
    region("readyOff", nin * FLAG_STRIDE)
    region("creditOff", nout * FLAG_STRIDE)
    region("stateOff", nchannels * (CONN_IN + CONN_OUT) * 8)
    region("stagingOff", nout * nsteps * stride if gin_capacity else 0)
    region("llStagingOff", nout * nsteps * ll_stride if gin_capacity else 0)
    region("ll128StagingOff", nout * nsteps * ll128_stride if gin_capacity else 0)
    region("ginQueueOff", gin_capacity * GIN_DESCRIPTOR.itemsize + (GIN_QUEUE_HEADER if gin_capacity else 0))
    region(
        "ginSignalsOff",
        (gin_signals(nchannels, nsteps)[1] + device_signals) * 8 if gin_capacity or device_signals else 0,
    )
    region("ginCountersOff", gin_counters * 8)
    region("syncOff", nchannels * (nranks + 1) * FLAG_STRIDE)
    lay["slotBytes"] = slot_bytes
    lay["llSlotBytes"], lay["ll128SlotBytes"] = ll_bytes, ll128_bytes
    lay["nsteps"] = nsteps
    lay["flagStride"] = FLAG_STRIDE
    return lay, off


def pack_call(
    coll: str,
    algorithm: str,
    dtype_code: int,
    op_code: int,
    root: int,
    nchannels: int,
    protocol: str = "simple",
    variant: str | None = None,
) -> int:
    """The call descriptor (CALL_FIELDS) of one call; `variant`: an nvls call's
    (NVLS_VARIANTS), None for the others."""
    values = (
        COLLECTIVE_CODES[coll],
        ALGORITHM_CODES[algorithm],
        dtype_code,
        op_code,
        root,
        nchannels,
        PROTOCOL_CODES[protocol],
        0 if variant is None else NVLS_VARIANTS[variant],
    )
    desc = 0
    for (_, shift, bits), v in zip(CALL_FIELDS, values):
        desc |= (v & ((1 << bits) - 1)) << shift
    return desc


def unpack_call(desc: int) -> dict:
    """The fields of a call descriptor by name, codes turned back into names where known."""
    names = {
        "collective": COLLECTIVE_CODES,
        "algorithm": ALGORITHM_CODES,
        "dtype": DTYPE_CODES,
        "op": OP_CODES,
        "protocol": PROTOCOL_CODES,
    }
    out = {}
    for name, shift, bits in CALL_FIELDS:
        v = (desc >> shift) & ((1 << bits) - 1)
        inverse = {code: n for n, code in names.get(name, {}).items()}
        out[name] = inverse.get(v, v)
    return out


# Module names that are Python-side only (no C++ twin): descriptions for messages.
PYTHON_ONLY = frozenset({"WAIT_WHAT", "PYTHON_ONLY"})


def abi_table() -> dict[str, int | str]:
    """This module's ABI as the table the CPU build exports (cpu/abi.cpp names the
    entries). Built from the definitions themselves: every public upper-case name of
    the module is in it (a struct through STRUCTS, its fields from the dtype), except
    PYTHON_ONLY, so nothing can be added here without a C++ twin."""
    table: dict[str, int | str] = {}
    for name, dt in STRUCTS.items():
        table[f"sizeof({name})"] = dt.itemsize
        table[f"alignof({name})"] = dt.alignment
        for field, (sub, offset, *_) in dt.fields.items():
            table[f"offsetof({name}, {field})"] = offset
            table[f"sizeof({name}::{field})"] = sub.itemsize
            table[f"kind({name}::{field})"] = sub.kind if sub.kind in "iu" else "V"
    structs = {id(dt) for dt in STRUCTS.values()}
    for name, value in globals().items():
        if not name.isupper() or name.startswith("_") or name in PYTHON_ONLY or name == "STRUCTS":
            continue
        if isinstance(value, np.dtype):
            if id(value) not in structs:
                raise TypeError(f"abi.{name} is a dtype missing from abi.STRUCTS")
        elif isinstance(value, int) and not isinstance(value, bool):
            table[name] = value
        elif name == "CALL_FIELDS":
            for field, shift, bits in value:
                table[f"CALL_FIELDS.{field}.shift"] = shift
                table[f"CALL_FIELDS.{field}.bits"] = bits
        elif name == "KERNEL_NAMES":
            for kernel in value:
                table[f"kernel({kernel})"] = "CollArgs"
        elif name == "ENGINE_KERNELS":
            for kernel, args in value.items():
                table[f"kernel({kernel})"] = args
        elif name == "ENGINE_KERNEL_NAMES":
            continue  # ENGINE_KERNELS' names
        elif isinstance(value, dict) and all(isinstance(v, (int, str)) for v in value.values()):
            for key, v in value.items():
                table[f"{name}.{key}"] = v
        else:
            raise TypeError(f"abi.{name}: abi_table() does not know how to compare it with C++")
    return table
