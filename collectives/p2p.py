"""Point-to-point (nccl4py's send and recv): the record of one operation (management),
and the launch that runs every operation of a group on one communicator (scheduling).

An operation moves its buffer's bytes to or from one peer over that peer's p2p link
(kernels/p2p.cu): window channels of their own after the collectives' max_channels
(abi.p2p_channels), the link from rank s to rank r, d = (r - s) mod n, being channel
max_channels + (d - 1) // 4 and link (FIFO) (d - 1) % 4 of it. Each step's slot header
carries the dtype and the element count, which the receiver compares with its own: a
send and its recv that disagree fail on both ranks with CommMismatch naming what each
posted. A send completes once its receiver has taken the first slot, so a send and
its recv must be in flight together: in one group (groups.py), or called in matching
order. All operations of a group on one communicator are one launch, a block per
(peer, direction) that runs that pair's operations in posted order, or one block for
all of a small group's (P2pLauncher.one_block).

Zero copy: over an LSA link, a send whose buffer lies in a window from alloc_symmetric
is read by its receiver straight from that window into the recvbuf (either kind of
buffer), and completes once the receiver has copied it; the caller may then reuse it.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from commref.device_kernels import abi
from commref.transports.errors import CapabilityError, CommMismatch, CommrefError

from . import groups
from .launch_record import CallPlan, plan_fields
from .tuner import STORE_CHOOSER_MIN_BYTES
from .verify import DTYPE_CODES, dtype_name

KERNEL = "commref_p2p"
SEND, RECV = "send", "recv"
ONE_BLOCK_MAX_BYTES = 64 * 1024  # a group's bytes that one block moves (P2pLauncher.one_block)
ONE_BLOCK_MAX_SENDS = 32  # kernels/p2p.cu kMaxPending: one block posts every send before it waits
_KEPT_OP, _KEPT_GROUP = "p2p op", "p2p group"  # the first item of a kept operation's and group's key


@dataclass(eq=False)
class P2pCall:
    """One validated send or recv: `kind`, `peer`, its buffer (buffers.Buffer) and the
    caller's stream."""

    kind: str
    peer: int
    buf: Any
    stream: Any = None

    def describe(self) -> str:
        to = "to" if self.kind == SEND else "from"
        return f"{self.kind} of {self.buf.count} {dtype_name(self.buf.dtype)} {to} rank {self.peer}"


def record(check, device: str, kind: str, buf, peer, stream, check_usable) -> P2pCall:
    """Management: checks a send's or recv's peer and buffer (buffers.BufferChecker
    `check`: the collectives' checks), then the communicator (`check_usable`), before
    anything launches."""
    rank, nranks = check.rank, check.nranks
    if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool) or not 0 <= int(peer) < nranks:
        raise ValueError(f"rank {rank}: {kind} peer must be a rank in [0, {nranks}), got {peer!r}")
    if int(peer) == rank:
        raise ValueError(f"rank {rank}: {kind} peer {rank} is this rank; a send or recv needs another rank")
    b = check.buffer(buf, "sendbuf" if kind == SEND else "recvbuf", write=kind == RECV)
    if device != "cpu":
        raise CapabilityError(f"rank {rank}: send and recv run on the CPU engine (device='cpu') in this version")
    check_usable()
    return P2pCall(kind, int(peer), b, stream)


def link(rank: int, nranks: int, max_channels: int, call: P2pCall) -> tuple[int, int]:
    """(window channel, link index) of the call's link (the module docstring)."""
    d = (call.peer - rank) % nranks if call.kind == SEND else (rank - call.peer) % nranks
    return max_channels + (d - 1) // abi.CONN_OUT, (d - 1) % abi.CONN_OUT


def call_desc(dtype: np.dtype) -> int:
    return abi.pack_call("p2p", "ring", DTYPE_CODES[dtype_name(dtype)], 0, 0, 0)


class KeptBuffer:
    """A send's or recv's validated buffer (buffers.Buffer), kept so that the same
    operation on the same array again skips the checks: it matches while the array is
    the same live array with the shape, strides and dtype it had (and a recv's is still
    writeable), launch_record.RepeatedCall's contract. It holds the array weakly."""

    __slots__ = ("_ref", "_shape", "_dtype", "buf")

    def __init__(self, obj, buf):
        self._ref, self._shape, self._dtype, self.buf = weakref.ref(obj), (obj.shape, obj.strides), obj.dtype, buf

    def matches(self, obj, write: bool) -> bool:
        return (
            self._ref() is obj
            and (obj.shape, obj.strides) == self._shape
            and obj.dtype is self._dtype
            and (not write or obj.flags.writeable)
        )


@dataclass(eq=False)
class KeptGroup:
    """A group's launch (its operations' table, blocks and plan, the bytes it receives),
    kept for the same operations on the same kept buffers again."""

    bufs: tuple
    ops: np.ndarray
    nblocks: int
    plan: CallPlan
    received: int
    launch: object  # cpu_loader.PreparedLaunch of the communicator's record
    streamed: int | None  # streamStores of every launch, or None: the store chooser's per launch

    def __post_init__(self):
        self.done = self.ops["done"]  # a view: reset before every launch
        self.address = self.ops.ctypes.data


@dataclass(eq=False)
class KeptSequence:
    """A composed call's sends and receives (its `calls`, members 0, 1, ... of its group)
    on arrays whose buffers are kept (`arrays`: KeptBuffer, and whether written), with
    their launch: the same call on the same arrays again runs it at once (P2pLauncher.again)."""

    arrays: tuple
    calls: list
    group: KeptGroup


class P2pLauncher:
    """The p2p launches of one communicator `comm` (its rank, ranks, max_channels,
    kernels, threads, launch record and end_launch); `host`: its launch_record.HostWords,
    whose error record names a failed operation's peer and what it saw; `stores`: its
    tuner.StoreChooser, which picks streamStores (zero-copy receives) by the bytes a
    launch receives. `kept`: the dict where the communicator keeps repeated calls (one
    that changes the symmetric windows clears it), at most `limit` entries: operations'
    buffers (KeptBuffer) and groups' launches (KeptGroup) go there too."""

    def __init__(self, comm, host, stores, kept: dict, limit: int):
        self.comm, self.host, self.stores, self.kept, self.limit = comm, host, stores, kept, limit

    def record(self, kind: str, buf, peer, stream) -> P2pCall:
        """record() with the communicator's checks, skipped for an operation on a kept buffer."""
        c, kept = self.comm, self.kept
        try:
            key = (_KEPT_OP, kind, id(buf), peer, peer.__class__)
            k = kept.get(key)
        except TypeError:  # an unhashable peer: record() says what is wrong with it
            key = k = None
        if k is not None and k.matches(buf, kind == RECV):
            c.check_usable()
            return P2pCall(kind, peer, k.buf, stream)
        call = record(c._check, c.device, kind, buf, peer, stream, c.check_usable)
        if key is not None and type(buf) is np.ndarray:
            self._keep(key, KeptBuffer(buf, call.buf))
        return call

    def _keep(self, key, value) -> None:
        if len(self.kept) >= self.limit:
            self.kept.clear()
        self.kept[key] = value

    def prepared(self, calls: list[P2pCall]) -> KeptGroup:
        """The group's launch: kept, or made (and kept where its buffers are)."""
        key = (_KEPT_GROUP, *[(call.kind, call.peer, id(call.buf)) for call in calls])
        g = self.kept.get(key)
        if g is not None and all(a is call.buf for a, call in zip(g.bufs, calls)):
            g.done.fill(0)
            return g
        ops, nblocks = self.table(calls)
        plan = CallPlan(KERNEL, nblocks, None, plan_fields(0, 0, 0, nblocks, 1, 0), 0, len(calls), False)
        received = sum(call.buf.nbytes for call in calls if call.kind == RECV)
        c, stores = self.comm, self.stores
        launch = c.kernels.prepared(KERNEL, nblocks, c.threads, c.launch_record.address)
        streamed = (
            stores.choose(KERNEL, received)[0] if received < STORE_CHOOSER_MIN_BYTES or stores.mode != "auto" else None
        )
        g = KeptGroup(tuple(call.buf for call in calls), ops, nblocks, plan, received, launch, streamed)
        self._keep(key, g)
        return g

    def again(self, key, arrays) -> bool:
        """Runs the composed call kept under `key` (KeptSequence, from keep_sequence) if
        `arrays` are its arrays, unchanged, and returns True; else False (nothing ran).
        Outside a group only (the caller checks). A failure is raised as a group's is
        (groups.name_member)."""
        k = self.kept.get(key)
        if k is None:
            return False
        for (kb, write), a in zip(k.arrays, arrays):
            if not kb.matches(a, write):
                return False
        self.comm.check_usable()
        k.group.done.fill(0)
        try:
            self.launch(k.group, k.calls)
        except BaseException as e:
            groups.name_member(e)
            raise
        return True

    def keep_sequence(self, key, ops: list[tuple[str, object, int]]) -> None:
        """Keeps the composed call that has just run `ops` ((kind, array, peer) in
        posted order, a group of its own) under `key`, if every operation's buffer was kept."""
        kept = [self.kept.get((_KEPT_OP, kind, id(a), peer, int)) for kind, a, peer in ops]
        if None in kept:
            return
        calls = [P2pCall(kind, peer, kb.buf) for (kind, _, peer), kb in zip(ops, kept)]
        arrays = tuple((kb, kind == RECV) for (kind, _, _), kb in zip(ops, kept))
        self._keep(key, KeptSequence(arrays, calls, self.prepared(calls)))

    def table(self, calls: list[P2pCall]) -> tuple[np.ndarray, int]:
        """The operations (abi.P2P_OP) in posted order and the number of blocks. Over an
        LSA link a send whose buffer lies in a symmetric window goes zero copy, and every
        recv can take one (abi.P2P_OP's zero-copy fields)."""
        c = self.comm
        sym = c._symmetric
        ops = np.zeros(len(calls), dtype=abi.P2P_OP)
        blocks: dict[tuple[int, str], int] = {}
        for i, call in enumerate(calls):
            op = ops[i]
            op["buf"], op["count"], op["bytes"] = call.buf.address, call.buf.count, call.buf.nbytes
            op["callDesc"] = call_desc(call.buf.dtype)
            op["peer"], op["send"] = call.peer, call.kind == SEND
            op["channel"], op["conn"] = link(c.rank, c.nranks, c.max_channels, call)
            op["block"] = blocks.setdefault((call.peer, call.kind), len(blocks))
            if sym.windows and not c.peer_mask >> call.peer & 1:  # an LSA link
                if call.kind == RECV:
                    op["symWindows"] = sym.table_address
                elif (where := sym.of(call.buf)) is not None:
                    op["symOffset"], op["symWindow"] = where[1], where[2]
        if len(blocks) > 1 and self.one_block(ops):
            ops["block"] = 0
            return ops, 1
        return ops, len(blocks)

    def one_block(self, ops: np.ndarray) -> bool:
        """Whether a group's operations run in one block (kernels/p2p.cu): every send of
        one step (zero copy, or bytes that fit a slot), ONE_BLOCK_MAX_SENDS sends at most,
        at most nsteps operations per (peer, direction), and besides the largest receive
        at most ONE_BLOCK_MAX_BYTES to move. The launch then wakes no engine thread for work that one thread does as
        fast (a zero-copy sendrecv: post, copy, done); a block per pair would wait on
        more threads than this host may have cores for."""
        layout = self.comm.layout
        send = ops["send"] == 1
        fifo_sends = ops["bytes"][send & (ops["symWindow"] == 0)]
        if fifo_sends.size and int(fifo_sends.max()) > int(layout["slotBytes"]):
            return False
        received = ops["bytes"][~send]
        rest = int(fifo_sends.sum()) + int(received.sum()) - (int(received.max()) if received.size else 0)
        return (
            rest <= ONE_BLOCK_MAX_BYTES
            and int(send.sum()) <= ONE_BLOCK_MAX_SENDS
            and int(np.bincount(ops["block"]).max()) <= int(layout["nsteps"])
        )

    def prepare(self, calls: list[P2pCall]) -> tuple[np.ndarray, int, CallPlan, int]:
        """The launch of `calls` as a fused group's part (schedule.Scheduler.fuse): (ops
        table, blocks, plan, kernel entry), prepared() as run()'s (one table: zero copy
        and one block alike)."""
        g = self.prepared(calls)
        return g.ops, g.nblocks, g.plan, self.comm.kernels.entry(KERNEL)

    def run(self, calls: list[P2pCall]) -> None:
        """Runs `calls` in one launch. A failure is raised with `member` set to the
        call that failed (the first of its (peer, direction) not done) and `member_at`
        its index in `calls`."""
        self.launch(self.prepared(calls), calls)

    def launch(self, g: KeptGroup, calls: list[P2pCall]) -> None:
        """Launches the group `g` of `calls` (its done words reset); run() says how it fails."""
        c, ops, launch, streamed = self.comm, g.ops, g.launch, g.streamed
        store_key = None
        if streamed is None:
            streamed, store_key = self.stores.choose(KERNEL, g.received)
        c.launch_record.set_call(g.plan, g.address, 0, streamed)
        try:
            if store_key is None:
                status = launch.call()
            else:
                t0 = time.perf_counter()
                status = launch.call()
                if not status:
                    self.stores.record(store_key, streamed, time.perf_counter() - t0, g.received)
            c.end_launch(status, launch.refused)
        except CommrefError as e:
            self.raise_failure(calls, ops, e)

    def raise_failure(self, calls: list[P2pCall], ops: np.ndarray, e: Exception):
        """Raises the failure `e` of the launch of `calls` (table `ops`) as run() does."""
        failed = self.failed(calls, ops)
        exc = self.mismatch(failed) or e
        exc.member, exc.member_at = failed, calls.index(failed)
        raise exc from (None if exc is e else e)

    def failed(self, calls: list[P2pCall], ops: np.ndarray) -> P2pCall:
        """The call the error record names: the first not done of its peer and
        direction (by what was awaited), else the first not done."""
        e = self.host.error[0]
        what, peer = int(e["what"]), int(e["peer"])
        kind = {
            abi.WAIT_RECV_READY: RECV,
            abi.P2P_RECV_MISMATCH: RECV,
            abi.WAIT_SEND_CREDIT: SEND,
            abi.WAIT_P2P_ACCEPT: SEND,
            abi.P2P_SEND_REJECTED: SEND,
        }.get(what)
        pending = [call for call, op in zip(calls, ops) if not op["done"]] or calls
        named = [call for call in pending if call.peer == peer and kind in (None, call.kind)]
        return (named or pending)[0]

    def mismatch(self, call: P2pCall) -> CommMismatch | None:
        """The CommMismatch of a send and recv that disagree, naming what each rank
        posted (the error record holds the peer's count and descriptor), or None."""
        e = self.host.error[0]
        if int(e["code"]) != abi.ERR_MISMATCH or int(e["what"]) not in (abi.P2P_RECV_MISMATCH, abi.P2P_SEND_REJECTED):
            return None
        rank, peer = self.comm.rank, int(e["peer"])
        theirs_count, fields = int(e["expected"]), abi.unpack_call(int(e["seen"]))
        theirs_dtype = fields["dtype"] if fields["collective"] == "p2p" else f"a {fields['collective']} step"
        other = RECV if call.kind == SEND else SEND
        mine_dtype = dtype_name(call.buf.dtype)
        field = "dtype" if theirs_dtype != mine_dtype else "count"
        mine, theirs = (mine_dtype, theirs_dtype) if field == "dtype" else (call.buf.count, theirs_count)
        return CommMismatch(
            f"rank {rank}: {call.describe()} does not match rank {peer}'s {other} of {theirs_count} "
            f"{theirs_dtype}: {field} is {mine!r} here and {theirs!r} there",
            rank=rank,
            peer=peer,
            field=field,
            mine=mine,
            theirs=theirs,
        )
