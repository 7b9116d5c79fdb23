"""The launch ABI (include/commref/args.h) as numpy structured dtypes.

Kernels take one plain struct by value. The host builds it as a numpy record of the
dtype below and hands its bytes to the kernel: CuPy passes a structured scalar by
value, the CPU engine passes its address. ``tests/test_abi.py`` checks every size and
offset against the CPU build's ``commref_abi_values()``.
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
WAIT_WHAT = {
    1: "data of the next step (recv ready)",
    2: "a free FIFO slot (send credit)",
    3: "call descriptor",
    4: "element count",
    5: "a free GIN queue slot (the proxy is behind)",
    6: "the GIN proxy to complete earlier operations (flush)",
    7: "the LSA barrier of a direct kernel",
    8: "symmetric buffer offset",
}

# GinProtocol (args.h): how a GIN connection publishes a slot.
GIN_PROTOCOLS = {"strong": 0, "weak-last": 1, "signal-per-put": 2, "flush-signal": 3}
# GinOp and GinFlags (gin.h).
GIN_PUT, GIN_PUT_VALUE, GIN_SIGNAL, GIN_GET, GIN_FLUSH, GIN_DOORBELL = 1, 2, 3, 4, 5, 6
GIN_HAS_SIGNAL, GIN_STRONG, GIN_VA, GIN_ADD, GIN_HAS_COUNTER = 1, 2, 4, 8, 16

SLOT_HEADER = 64  # bytes before each FIFO slot's data: call descriptor and count


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
        ("pad", "<i4"),
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
    [("peerMask", "<u8"), ("capacity", "<u4"), ("protocol", "<u4"), ("putsPerSlot", "<u4"), ("checkHeaders", "<u4"),
     ("creditSignalBase", "<u4"), ("pad", "<u4")],
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
        ("pad", "<u4"),
    ],
    align=True,
)

SYM_BUFFER = np.dtype([("peerTable", "<u8"), ("offset", "<u8")], align=True)

COLL_ARGS = np.dtype(
    [
        ("sendbuf", "<u8"),
        ("recvbuf", "<u8"),
        ("count", "<u8"),
        ("peerWindows", "<u8"),
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
        ("streamStores", "<i4"),
        ("gin", GIN_ARGS),
        ("symSend", SYM_BUFFER),
        ("symRecv", SYM_BUFFER),
        ("peers", CHANNEL_PEERS, (MAX_CHANNELS,)),
    ],
    align=True,
)

COPY_ARGS = np.dtype([("src", "<u8"), ("dst", "<u8"), ("bytes", "<u8")], align=True)

STRUCTS = {
    "CollArgs": COLL_ARGS,
    "ChannelPeers": CHANNEL_PEERS,
    "WindowLayout": WINDOW_LAYOUT,
    "ErrorRecord": ERROR_RECORD,
    "CopyArgs": COPY_ARGS,
    "GinArgs": GIN_ARGS,
    "GinDescriptor": GIN_DESCRIPTOR,
    "SymBuffer": SYM_BUFFER,
}
