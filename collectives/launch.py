"""The launch record (CollArgs, args.h) of one communicator, the host words its
kernels write and poll, and the failure they report turned into an exception.

The record is built once; a call rewrites only its per-call fields, through integer
views of the record (field access by name costs microseconds, a noticeable part of a
small collective). A call's signature-dependent part (kernel, channels, the int32
fields, the call descriptor) is planned once per signature (CallPlan).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from commref.device_kernels import abi
from commref.transports.errors import CommAborted, CommMismatch, CommTimeout, format_seconds

# The int32 fields a call sets, consecutive in CollArgs (checked below).
_INT32_FIELDS = ("root", "dtype", "op", "nchannels", "elemSize", "streamStores")


@dataclass(frozen=True)
class CallPlan:
    """What a call's signature decides: its kernel, channels, (dtype, op)
    specialization (None: data movement), the int32 fields, the call descriptor and
    the kernel's count."""

    kernel: str
    nchannels: int
    spec: tuple[int, int] | None
    fields32: np.ndarray  # _INT32_FIELDS, streamStores last (set per call on the CPU)
    desc: int
    count: int  # CollArgs.count (catalogue.Collective.kernel_count)
    direct: bool  # a direct kernel: the symmetric buffer fields are read


class LaunchRecord:
    """One CollArgs record and fast writers for its per-call fields."""

    def __init__(self):
        self.args = np.zeros(1, dtype=abi.COLL_ARGS)
        self.record = self.args[0]
        f = abi.COLL_ARGS.fields
        self._u64 = self.args.view(np.uint64)
        self._i32 = self.args.view(np.int32)
        self.address = self._u64.__array_interface__["data"][0]
        self._send, self._recv = f["sendbuf"][1] // 8, f["recvbuf"][1] // 8
        self._count, self._desc = f["count"][1] // 8, f["callDesc"][1] // 8
        self._fields32 = f["root"][1] // 4
        assert [f[k][1] for k in _INT32_FIELDS] == [f["root"][1] + 4 * i for i in range(len(_INT32_FIELDS))]
        self._sym = f["symSend"][1] // 8  # symSend.peerTable, .offset, symRecv.peerTable, .offset

    def set_call(self, plan: CallPlan, send: int, recv: int, stream_stores: int = 0) -> None:
        u64, i32, at = self._u64, self._i32, self._fields32
        u64[self._send] = send
        u64[self._recv] = recv
        u64[self._count] = plan.count
        u64[self._desc] = plan.desc
        i32[at : at + len(_INT32_FIELDS)] = plan.fields32
        i32[at + len(_INT32_FIELDS) - 1] = stream_stores

    def set_symmetric(self, sym: tuple[int, int, int, int]) -> None:
        """symSend and symRecv: (peer table, offset, peer table, offset)."""
        self._u64[self._sym : self._sym + 4] = sym


def plan_fields(root: int, dtype_code: int, op_code: int, nchannels: int, itemsize: int) -> np.ndarray:
    return np.array([root, dtype_code, op_code, nchannels, itemsize, 0], np.int32)


class HostWords:
    """The error record the kernels write on failure and the abort word they poll, in
    host memory; on a GPU registered so the device can reach them."""

    def __init__(self, abort_word: np.ndarray, device: str):
        self.error = np.zeros(1, dtype=abi.ERROR_RECORD)
        self.abort = abort_word
        if device == "cuda":
            from cupy.cuda import runtime

            for arr in (self.error, self.abort):
                try:
                    runtime.hostRegister(arr.ctypes.data, arr.nbytes, 2)  # cudaHostRegisterMapped
                except runtime.CUDARuntimeError:
                    pass  # already registered (the world's abort word is shared)
            self.error_address = _device_pointer_of_host(self.error.ctypes.data)
            self.abort_address = _device_pointer_of_host(self.abort.ctypes.data)
        else:
            self.error_address = self.error.ctypes.data
            self.abort_address = self.abort.ctypes.data

    @property
    def failed(self) -> bool:
        return int(self.error[0]["code"]) != abi.ERR_OK

    def failure(self, rank: int, timeout: float) -> Exception:
        """The exception the error record describes."""
        e = self.error[0]
        code, what_code = int(e["code"]), int(e["what"])
        what = abi.WAIT_WHAT.get(what_code, f"wait #{what_code}")
        peer, channel, expected, seen = int(e["peer"]), int(e["channel"]), int(e["expected"]), int(e["seen"])
        if code == abi.ERR_TIMEOUT:
            return CommTimeout(
                f"rank {rank}: timed out after {format_seconds(timeout)} s waiting for peer {peer}: {what} "
                f"on channel {channel} (expected >= {expected}, seen {seen})",
                rank=rank, peer=peer, what=what, expected=expected, seen=seen)
        if code == abi.ERR_MISMATCH:
            if what_code == abi.COUNT_MISMATCH:
                field, mine, theirs = "count", expected, seen
            elif what_code == abi.BUFFER_MISMATCH:
                field, mine, theirs = "symmetric buffer offset", expected, seen
            else:
                m, t = abi.unpack_call(expected), abi.unpack_call(seen)
                field = next((k for k in m if m[k] != t[k]), None)
                mine, theirs = (m[field], t[field]) if field else (expected, seen)
                field = field or "call"
            return CommMismatch(
                f"rank {rank}: collective call differs from peer {peer}'s: {field} is {mine!r} here "
                f"and {theirs!r} there", rank=rank, peer=peer, field=field, mine=mine, theirs=theirs)
        if code == abi.ERR_ABORTED:
            return CommAborted(f"rank {rank}: collective aborted while waiting for peer {peer} "
                               f"because the job is being torn down", rank=rank, origin_rank=None,
                               reason="abort flag raised")
        return RuntimeError(f"rank {rank}: kernel failed without a diagnostic (record code {code})")


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


def address_of(table) -> int:
    """The data address of a numpy or CuPy array."""
    if isinstance(table, np.ndarray):
        return table.ctypes.data
    return int(table.data.ptr)
