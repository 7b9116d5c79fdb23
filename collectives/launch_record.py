"""The launch record (CollArgs, args.h) of one communicator, the host words its
kernels write and poll, and the failure they report turned into an exception.

The record is built once; a call rewrites only its per-call fields, through integer
views of the record (field access by name costs microseconds, a noticeable part of a
small collective). A call's signature-dependent part (kernel, channels, the int32
fields, the call descriptor) is planned once per signature (CallPlan). On the CPU a
call that repeats the previous arguments' buffers (RepeatedCall) skips the buffer
checks, the plan lookup and, while the record still holds its fields, the writes. A
group of CPU calls runs as one FusedLaunch, kept while its members repeat.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from commref.device_kernels import abi, cpu_loader
from commref.device_kernels.build import KernelError
from commref.transports.errors import CommAborted, CommMismatch, CommTimeout, format_seconds
from commref.transports.host_memory import CUDA_HOST_PORTABLE_MAPPED, mapped_device_pointer

PACK_KERNEL = "commref_pack"  # a packed group's copies (kernels/pack.cu)
# The int32 fields a call sets, consecutive in CollArgs (checked below).
_INT32_FIELDS = ("root", "dtype", "op", "nchannels", "elemSize", "avgDivisor", "streamStores", "protocol")
_STREAM_STORES = _INT32_FIELDS.index("streamStores")
# How set_call writes: packed into the record's bytes, half the time of numpy item writes.
_HEAD = struct.Struct("<QQQ")  # sendbuf, recvbuf, count (consecutive in CollArgs, checked below)
_U64 = struct.Struct("<Q")
_INT32 = struct.Struct("<i")
_INT32S = struct.Struct(f"<{len(_INT32_FIELDS)}i")  # CallPlan.fields32


# What a refused device-API argument with a reason of its own (abi.BAD_ARGUMENT_REASONS,
# the record's peer field) was refused for (device.h).
_BAD_ARGUMENT_REASONS = {
    abi.BAD_ARGUMENT_REASONS["va_signal"]: "a VA signal needs a device communicator created with "
    "strict_ordering=True (NCCL_WIN_STRICT_ORDERING); the limit is that flag, the value the communicator's flags",
    abi.BAD_ARGUMENT_REASONS["va_offset"]: "a VA signal's word must be 8 aligned bytes inside the device window "
    "(the limit: its bytes; the value: the offset)",
    abi.BAD_ARGUMENT_REASONS["team_rank"]: "a team rank outside its team (the limit: the team's ranks)",
    abi.BAD_ARGUMENT_REASONS["team_shape"]: "the team is not a strided team here (the LSA and rail teams need every "
    "node to hold lsaSize consecutive ranks; a factor must divide its parent's ranks; members within the world)",
    abi.BAD_ARGUMENT_REASONS["sym_ptr"]: "a symmetric pointer used outside the device window (the limit: its bytes; "
    "the value: the element's end) or not aligned to its type",
    abi.BAD_ARGUMENT_REASONS["bits"]: "a rolling compare's width must be 1 to 64 bits",
    abi.BAD_ARGUMENT_REASONS["request_context"]: "a flush request waited on the handle of another context "
    "(the limit: the handle's context; the value: the request's)",
}


@dataclass(frozen=True)
class CallPlan:
    """What a call's signature decides: its kernel, channels, (dtype, op)
    specialization (None: data movement), the int32 fields, the call descriptor and
    the kernel's count."""

    kernel: str
    nchannels: int
    spec: tuple[int, int] | None
    fields32: bytes  # _INT32_FIELDS, packed (plan_fields; streamStores set per call on the CPU)
    desc: int
    count: int  # CollArgs.count (catalogue.Collective.kernel_count)
    direct: bool  # a direct kernel: the symmetric buffer fields are read
    hierarchical: bool = False  # no kernel of this communicator: its hierarchy's calls (hierarchical.py)
    protocol: str = "simple"  # of the kernel's FIFO steps (include/commref/proto.h)
    launch: object = None  # CPU: cpu_loader.PreparedLaunch of the communicator's record
    predicted_s: float | None = None  # the performance model's time of the call (model.py)


class LaunchRecord:
    """One CollArgs record and fast writers for its per-call fields."""

    def __init__(self, args: np.ndarray | None = None):
        """`args`: the one-record array to write (a view into a larger array of records:
        FusedLaunch's); None: a new zeroed record of its own."""
        self.args = np.zeros(1, dtype=abi.COLL_ARGS) if args is None else args
        self.record = self.args[0]
        f = abi.COLL_ARGS.fields
        self._u64 = self.args.view(np.uint64)
        self._bytes = memoryview(self.args.view(np.uint8))
        self.address = self._u64.__array_interface__["data"][0]
        self._head, self._desc = f["sendbuf"][1], f["callDesc"][1]
        assert (f["recvbuf"][1], f["count"][1]) == (self._head + 8, self._head + 16)
        self._fields32 = slice(f["root"][1], f["root"][1] + _INT32S.size)
        self._stream_stores = f["root"][1] + 4 * _STREAM_STORES
        assert [f[k][1] for k in _INT32_FIELDS] == [f["root"][1] + 4 * i for i in range(len(_INT32_FIELDS))]
        self._sym = f["symSend"][1] // 8  # symSend and symRecv: 3 words each (SymBuffer)
        assert f["symRecv"][1] == f["symSend"][1] + abi.SYM_BUFFER.itemsize == f["symSend"][1] + 24
        self.holder = None  # the RepeatedCall whose fields the record holds (None: some other call's)

    def set_call(self, plan: CallPlan, send: int, recv: int, stream_stores: int = 0) -> None:
        self.holder = None
        b = self._bytes
        _HEAD.pack_into(b, self._head, send, recv, plan.count)
        _U64.pack_into(b, self._desc, plan.desc)
        b[self._fields32] = plan.fields32
        _INT32.pack_into(b, self._stream_stores, stream_stores)

    def set_symmetric(self, sym: tuple[int, int, int, int, int, int]) -> None:
        """symSend and symRecv: (peer table, offset, GIN window id) of each."""
        self.holder = None
        self._u64[self._sym : self._sym + 6] = sym

    def set_stream_stores(self, stream_stores: int) -> None:
        _INT32.pack_into(self._bytes, self._stream_stores, stream_stores)


class RepeatedCall:
    """A CPU call whose buffers passed every check, kept so that the same call on the
    same arrays again (Communicator._collective) goes straight to the launch.

    It holds the arrays weakly (it keeps none alive) and matches a later call only while
    they are the same live arrays with the shape, strides and dtype they had, and recvbuf
    is still writeable: all that the checks looked at that an array can change in place.
    (Its data cannot move: numpy refuses to resize an array that has weak references,
    and a buffer does not move otherwise while the array lives.) Everything else the
    checks and the plan depend on is the call's arguments, which key it, or the
    communicator's symmetric windows, whose changes drop every kept call. `timed`:
    tuner.StoreChooser times calls of this size, so each call asks it for streamStores
    (`in_place` is the chooser's flag); else `streamed` is the setting it gives every
    call of this size. `kept`: whether it can match later calls (`keep` asked for it, and
    the arrays can be weakly referenced: not an ndarray subclass without __weakref__).
    `given`: the call's arguments but its arrays, the objects as given (calls.GIVEN), and
    `send_id`, its sendbuf's id: by them a group's calls as given repeat a kept group
    (FusedLaunch.repeats, FusedLaunch.replay_key)."""

    __slots__ = (
        "_send",
        "_recv",
        "_shapes",
        "_dtype",
        "matches",
        "kept",
        "plan",
        "send",
        "recv",
        "nbytes",
        "sym",
        "streamed",
        "timed",
        "in_place",
        "signature",
        "given",
        "send_id",
    )

    def __init__(
        self,
        sendbuf,
        recvbuf,
        plan: CallPlan,
        s,
        r,
        sym,
        streamed: int,
        timed: bool,
        in_place: bool,
        keep: bool = True,
        signature=None,
        given=None,
    ):
        self.kept = False
        self.signature = signature  # calls.CallSignature: what describe() names and packing.py compares
        self.given, self.send_id = given, id(sendbuf)
        self.matches = self._never
        if keep:
            extension = cpu_loader.pycall()
            try:
                if extension is not None:  # the same test on the arrays' fields
                    self.matches = extension.Arrays(sendbuf, recvbuf)
                else:
                    self._send, self._recv = weakref.ref(sendbuf), weakref.ref(recvbuf)
                    self._shapes = (sendbuf.shape, sendbuf.strides, recvbuf.shape, recvbuf.strides)
                    self._dtype = s.dtype  # is recvbuf's (the checks compared them)
                    self.matches = self._matches
                self.kept = True
            except TypeError:
                pass
        self.plan, self.send, self.recv, self.nbytes, self.sym = plan, s.address, r.address, s.nbytes, sym
        self.streamed, self.timed, self.in_place = streamed, timed, in_place

    # matches(sendbuf, recvbuf): whether a call with these arrays is this call again,
    # unchanged: commref_pycall.Arrays where the extension loads (cpu_loader.pycall),
    # else _matches; never true for a call that is not kept.

    @staticmethod
    def _never(sendbuf, recvbuf) -> bool:
        return False

    def _matches(self, sendbuf, recvbuf) -> bool:
        dtype = self._dtype
        return (
            self._send() is sendbuf
            and self._recv() is recvbuf
            and (sendbuf.shape, sendbuf.strides, recvbuf.shape, recvbuf.strides) == self._shapes
            and sendbuf.dtype is dtype
            and recvbuf.dtype is dtype
            and recvbuf.flags.writeable
        )

    def describe(self) -> str:
        """The call in words, as a group names a failed member: "allreduce of 8 int32"."""
        sig = self.signature
        return "call" if sig is None else f"{sig.coll} of {sig.count} {sig.dtype}"

    def load(self, record: LaunchRecord) -> None:
        """Writes this call's fields into `record` (the caller skips it while
        record.holder is this call)."""
        record.set_call(self.plan, self.send, self.recv, self.streamed)
        if self.plan.direct:
            record.set_symmetric(self.sym)
        record.holder = self


class FusedLaunch:
    """A group's launches on one CPU communicator as one entry of the engine
    (commref_cpu_launch_group): the kernel of each collective `members` (RepeatedCalls,
    in call order), or, given a `packing` of them (packing.Packing), its copies in, its
    one AllReduce and its copies out; then, given `p2p` ((ops table, blocks, kernel
    entry): the group's sends and receives), their one launch; one after the other,
    each collective reading a CollArgs record of its own: the communicator's record
    `template` (its constant fields, as they are now) with the call's per-call fields.
    It holds everything its launch reads but the members' arrays, which the
    RepeatedCalls match before it runs. `positions`: each member's index in the group's
    calls. call() returns 0, or (i << 8) | the status of launch i, the first that failed
    (the later ones did not run); owner(i) is the member that launch i runs (a packing:
    the packing; the sends and receives: None). repeats(records) says whether a group's
    calls as given (groups.py) are this group's members again, each on unchanged arrays
    with the very objects of its other arguments (RepeatedCall.given); None where a
    member was not kept, or there are sends and receives. `replay_key`: the id of its
    first member's sendbuf (Scheduler.replay looks a group up by it)."""

    __slots__ = (
        "members",
        "positions",
        "packing",
        "records",
        "descs",
        "owners",
        "ops",
        "call",
        "repeats",
        "replay_key",
    )

    def __init__(
        self, kernels, template: LaunchRecord, members: list, positions: list, threads: int, p2p=None, packing=None
    ):
        self.members, self.positions, self.packing = members, positions, packing
        calls = members if packing is None else [packing.call]
        n = len(calls) + (p2p is not None)
        self.records = np.zeros(n, dtype=abi.COLL_ARGS)
        self.records[:] = template.args[0]
        descs, self.owners = [], []
        if packing is not None:
            descs.append((kernels.entry(PACK_KERNEL), packing.args_in.ctypes.data, 1, 1))
            self.owners.append(packing)
        for i, call in enumerate(calls):
            record = LaunchRecord(self.records[i : i + 1])
            call.load(record)
            prepared = call.plan.launch.record[0]
            descs.append((prepared["kernel"], record.address, prepared["grid"], prepared["block"]))
            self.owners.append(packing or call)
        if packing is not None:
            descs.append((kernels.entry(PACK_KERNEL), packing.args_out.ctypes.data, 1, 1))
            self.owners.append(packing)
        self.ops = None
        if p2p is not None:
            self.ops, nblocks, plan, entry = p2p
            record = LaunchRecord(self.records[n - 1 : n])
            record.set_call(plan, self.ops.ctypes.data, 0)
            descs.append((entry, record.address, nblocks, threads))
            self.owners.append(None)
        self.descs = np.array(descs, dtype=abi.LAUNCH_DESC)
        self.call = kernels.bind(True, self.descs.ctypes.data, len(descs))
        self.repeats, self.replay_key = None, members[0].send_id
        if p2p is None and all(m.kept and m.given is not None for m in members):
            givens, matchers = [m.given for m in members], [m.matches for m in members]
            extension = cpu_loader.pycall()
            if extension is not None:
                self.repeats = extension.Repeats(givens, matchers)
            else:
                self.repeats = functools.partial(_repeats, givens, matchers)

    def position(self, i: int) -> int:
        """The group index of launch `i`'s member (a packing: its first member's)."""
        owner = self.owners[i]
        return self.positions[0 if owner is self.packing else self.members.index(owner)]

    def refused(self, i: int):
        """The KernelError of launch `i`'s refusal (a function, as end_launch takes it)."""
        d, owner = self.descs[i], self.owners[i]
        if owner is None:
            what = "the group's sends and receives"
        elif owner is self.packing:
            what = f"a packed group's launch {i}"
        else:
            what = owner.plan.kernel
        return lambda: KernelError(f"the CPU engine could not run {what} with grid={d['grid']} block={d['block']}")


def plan_fields(
    root: int, dtype_code: int, op_code: int, nchannels: int, itemsize: int, avg_divisor: int, protocol: str = "simple"
) -> bytes:
    return _INT32S.pack(root, dtype_code, op_code, nchannels, itemsize, avg_divisor, 0, abi.PROTOCOL_CODES[protocol])


# CUDA runtime codes used here (the flags: transports/host_memory.py).
CUDA_HOST_MEMORY_ALREADY_REGISTERED = 712
_PAGE = 4096


class HostWords:
    """The error record the kernels write on failure and the abort word they poll, in
    host memory; on a GPU mapped into every device's address space.

    On a GPU the error record is this communicator's own pinned allocation
    (cudaHostAlloc, portable and mapped: thread ranks on other GPUs reach it too); the
    world's abort word, shared by a ThreadWorld's ranks, is registered once per process
    (portable and mapped) and unregistered when the last communicator using it closes
    (`MappedHostWords`). close() releases both; call it only when no kernel can still
    write them."""

    def __init__(self, abort_word: np.ndarray, device: str, device_id: int = 0):
        self.abort_word = abort_word
        self.aborted = False  # abort() claimed or tried to claim the record
        self._release: list = []
        if device == "cuda":
            import cupy
            from cupy.cuda import runtime

            with cupy.cuda.Device(device_id):
                nbytes = abi.ERROR_RECORD.itemsize
                ptr = runtime.hostAlloc(nbytes, CUDA_HOST_PORTABLE_MAPPED)
                self._release.append(lambda: runtime.freeHost(ptr))
                try:
                    buf = (ctypes.c_char * nbytes).from_address(ptr)
                    self.error = np.frombuffer(buf, dtype=abi.ERROR_RECORD, count=1)
                    self.error[...] = 0  # cudaHostAlloc does not zero
                    self.error_address = mapped_device_pointer(ptr, device_id, registered=False)
                    _abort_words.acquire(abort_word)
                    self._release.append(lambda: _abort_words.release(abort_word))
                    self.abort_address = mapped_device_pointer(abort_word.ctypes.data, device_id, registered=True)
                except BaseException:
                    self.close()
                    raise
        else:
            self.error = np.zeros(1, dtype=abi.ERROR_RECORD)
            self.error_address = self.error.ctypes.data
            self.abort_address = self.abort_word.ctypes.data
        self._words = self.error.view(np.uint32)  # [0]: ErrorRecord.code (a cheap `failed`)
        assert abi.ERROR_RECORD.fields["code"][1] == 0

    def close(self) -> None:
        """Frees the error record and drops this user of the abort word's mapping
        (GPU; idempotent). Afterwards the record reads as empty."""
        if self._release:
            self.error = np.zeros(1, dtype=abi.ERROR_RECORD)  # nothing reads freed memory afterwards
            self._words = self.error.view(np.uint32)
        while self._release:
            self._release.pop()()

    @property
    def failed(self) -> bool:
        return int(self._words[0]) != abi.ERR_OK

    def abort(self, rank: int) -> None:
        """Claims the error record for Communicator.abort as a failing kernel thread
        does (wait.h): every wait of a running launch sees it at its next poll and ends
        it; the host then reads ERR_ABORTED. A failure a kernel recorded first stands.
        Not after close()."""
        from commref.transports.gin.atomics import host_atomics

        self.aborted = True
        atomics, code = host_atomics(), self.error.ctypes.data  # ErrorRecord.code is at offset 0
        if atomics.cas_u32(code, abi.ERR_OK, abi.RECORD_CLAIMED):
            for field, value in dict(what=0, rank=rank, peer=-1, channel=-1, expected=0, seen=0).items():
                self.error[field] = value
            atomics.store_release_u32(code, abi.ERR_ABORTED)

    def failure(self, rank: int, timeout: float) -> Exception:
        """The exception the error record describes."""
        e = self.error[0]
        code, what_code = int(e["code"]), int(e["what"])
        what = abi.WAIT_WHAT.get(what_code, f"wait #{what_code}")
        peer, channel, expected, seen = int(e["peer"]), int(e["channel"]), int(e["expected"]), int(e["seen"])
        if code == abi.ERR_TIMEOUT:
            whom = f"peer {peer}" if peer >= 0 else "any peer"
            return CommTimeout(
                f"rank {rank}: timed out after {format_seconds(timeout)} s waiting for {whom}: {what} "
                f"on channel {channel} (expected >= {expected}, seen {seen})",
                rank=rank,
                peer=peer,
                what=what,
                expected=expected,
                seen=seen,
            )
        if code == abi.ERR_MISMATCH and what_code == abi.BAD_ARGUMENT:
            reason = _BAD_ARGUMENT_REASONS.get(peer)
            why = (
                f": {reason}"
                if reason is not None
                else " (ids, contexts and fence levels below it, offsets + bytes within it, putValue's "
                "destination a multiple of it; a flag word: the device communicator lacks that capability)"
            )
            return ValueError(
                f"rank {rank}: a device-API call in block {channel} was given {seen} where the limit is {expected}{why}"
            )
        if code == abi.ERR_MISMATCH and what_code in (abi.P2P_RECV_MISMATCH, abi.P2P_SEND_REJECTED):
            theirs = f"{expected} {abi.unpack_call(seen)['dtype']}"  # the peer's count and dtype
            kind = "recv" if what_code == abi.P2P_SEND_REJECTED else "send"
            return CommMismatch(
                f"rank {rank}: peer {peer}'s {kind} ({theirs}) does not match this rank's",
                rank=rank,
                peer=peer,
                field="p2p",
                mine=None,
                theirs=theirs,
            )
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
                f"and {theirs!r} there",
                rank=rank,
                peer=peer,
                field=field,
                mine=mine,
                theirs=theirs,
            )
        if code == abi.ERR_ABORTED and self.aborted:
            return CommAborted(
                f"rank {rank}: aborted by Communicator.abort()", rank=rank, origin_rank=rank, reason="aborted"
            )
        if code == abi.ERR_ABORTED:
            return CommAborted(
                f"rank {rank}: collective aborted while waiting for peer {peer} because the job is being torn down",
                rank=rank,
                origin_rank=None,
                reason="abort flag raised",
            )
        if code == abi.ERR_NO_INSTANCE:
            return KernelError(
                f"rank {rank}: the kernel has no instance for {_instance(seen)}; it holds "
                f"{'every instance' if expected == 2**64 - 1 else _instance(expected, mask=True)}"
            )
        return RuntimeError(f"rank {rank}: kernel failed without a diagnostic (record code {code})")


def _instance(word: int, mask: bool = False) -> str:
    """ERR_NO_INSTANCE's words: dtype | op << 32, or dtype | op mask << 32."""
    dtypes = {v: k for k, v in abi.DTYPE_CODES.items()}
    ops = {v: k for k, v in abi.OP_CODES.items()}
    dtype, op = word & 0xFFFFFFFF, word >> 32
    op_names = [ops.get(k, f"#{k}") for k in range(32) if op >> k & 1] if mask else [ops.get(op, f"op #{op}")]
    return f"dtype {dtypes.get(dtype, f'#{dtype}')} with {', '.join(op_names) or 'no op'}"


class MappedHostWords:
    """Host memory registered (portable, mapped) once per process however many users
    it has: registered by the first acquire(), unregistered by the last release().
    Keyed by page, so that words sharing a page share one registration. A range that
    something else registered already (cudaErrorHostMemoryAlreadyRegistered) is used as
    it is and never unregistered here; any other error is raised."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pages: dict[tuple[int, int], list] = {}  # (start, end) -> [users, registered here]

    @staticmethod
    def _range(arr: np.ndarray) -> tuple[int, int]:
        start = arr.ctypes.data // _PAGE * _PAGE
        return start, -(-(arr.ctypes.data + arr.nbytes) // _PAGE) * _PAGE

    def acquire(self, arr: np.ndarray) -> None:
        from cupy.cuda import runtime

        key = self._range(arr)
        with self._lock:
            entry = self._pages.get(key)
            if entry is not None:
                entry[0] += 1
                return
            try:
                runtime.hostRegister(key[0], key[1] - key[0], CUDA_HOST_PORTABLE_MAPPED)
                ours = True
            except runtime.CUDARuntimeError as e:
                if getattr(e, "status", None) != CUDA_HOST_MEMORY_ALREADY_REGISTERED:
                    raise
                ours = False
            self._pages[key] = [1, ours]

    def release(self, arr: np.ndarray) -> None:
        from cupy.cuda import runtime

        key = self._range(arr)
        with self._lock:
            entry = self._pages.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._pages[key]
                if entry[1]:
                    runtime.hostUnregister(key[0])

    def users(self, arr: np.ndarray) -> int:
        entry = self._pages.get(self._range(arr))
        return entry[0] if entry else 0


_abort_words = MappedHostWords()


def address_of(table) -> int:
    """The data address of a numpy or CuPy array."""
    if isinstance(table, np.ndarray):
        return table.ctypes.data
    return int(table.data.ptr)


def _repeats(givens: list, matchers: list, records: list) -> bool:
    """FusedLaunch.repeats where the extension does not load (commref_pycall.Repeats)."""
    if records.__class__ is not list or len(records) != len(givens):
        return False
    for record, given, matches in zip(records, givens, matchers):
        if record.__class__ is not tuple or len(record) != len(given) + 2:
            return False
        if any(a is not b for a, b in zip(record[2:], given)) or not matches(record[0], record[1]):
            return False
    return True
