"""Packing: a CPU group whose collectives are AllReduces of one signature but their
counts (the same dtype, op, algorithm and protocol asked, the same kind of buffers) can
run as one AllReduce of all their elements over staging buffers, as NCCL tunes a group's
operations together. One launch of the CPU engine then copies each member's input into
the packed send buffer (kernels/pack.cu), runs the one AllReduce, and copies each
member's part of the result to its output: one exchange instead of one per member. The
performance model decides whether that is faster (calls.CallPlanner.packs).

Every rank must make the same choice, or their collectives would not match; the choice
depends only on what every rank of a correct program agrees on (the group's calls, the
model), with one exception. On a rank where a member reads what an earlier member
writes (its sendbuf overlaps an earlier member's recvbuf), the packed AllReduce would
read that input before it is written. So the packed call carries one more element, the
flag: such a rank contributes "cannot", every other rank "can", and the reduction tells
every rank alike. Where it says "cannot", no rank copies the packed result out, and
every rank runs the group's members one after the other instead (Packing.fallback).
Members that only write what another writes, or read what a later one writes, pack as
they run one after the other: every input is read before any output is written, and the
outputs are written in call order.
"""

from __future__ import annotations

import numpy as np

from commref.device_kernels import abi

from .calls import record_call

PACKED_COLLECTIVES = ("allreduce",)
# The flag element's contribution per op: (can, cannot); every rank's "can" reduces to
# "can", any rank's "cannot" to something else (avg: the divisor, so the average counts
# the ranks that cannot; prod: 2, whose powers are never 1, even wrapped in 8 bits).
_FLAG = {"sum": (0, 1), "max": (0, 1), "min": (1, 0), "prod": (1, 2)}


def same_signature(members: list) -> bool:
    """Whether a group's collectives (RepeatedCalls) are at least two AllReduces whose
    signatures differ only in their counts."""
    if len(members) < 2:
        return False
    first = members[0].signature
    if first.coll not in PACKED_COLLECTIVES:
        return False
    return all(m.signature._replace(count=first.count) == first for m in members[1:])


def reads_an_earlier_output(members: list) -> bool:
    """Whether a member's sendbuf overlaps the recvbuf of a member before it (here)."""
    for j, later in enumerate(members):
        for earlier in members[:j]:
            if later.send < earlier.recv + earlier.nbytes and earlier.recv < later.send + later.nbytes:
                return True
    return False


class Packing:
    """The packed launch of a group's `members` (RepeatedCalls, same_signature) on one
    communicator: the staging buffers (`count` elements each, then the flag), the copy
    tables in and out, and `call`, the packed AllReduce as a RepeatedCall (built by
    `keep` from its Call and plan; None where the planner refuses one)."""

    def __init__(self, comm, members: list, prepare, keep):
        sig = members[0].signature
        self.members = members
        self.count = sum(m.signature.count for m in members)
        dtype = sig.dtype
        self.send = np.zeros(self.count + 1, dtype)
        self.recv = np.zeros(self.count + 1, dtype)
        divisor = sig.avg_divisor or comm.nranks
        can, cannot = (0, divisor) if sig.op == "avg" else _FLAG[sig.op]
        self.send[-1] = cannot if reads_an_earlier_output(members) else can
        self.can = np.array(can, dtype).tobytes()
        self._flag = memoryview(self.recv[-1:].view(np.uint8))  # the result's flag element, its bytes
        asked = (sig.algorithm, sig.avg_divisor, sig.flat, sig.protocol)
        call = record_call(comm, "allreduce", self.send, self.recv, sig.op, 0, None, *asked)
        self.plan = prepare(call)
        self.call = None if self.plan.hierarchical else keep(call, self.plan)
        itemsize, at = dtype.itemsize, 0
        self.copies_in = np.zeros(len(members), abi.COPY_ARGS)
        self.copies_out = np.zeros(len(members), abi.COPY_ARGS)
        for i, m in enumerate(members):
            stage = at * itemsize
            self.copies_in[i] = (m.send, self.send.ctypes.data + stage, m.nbytes)
            self.copies_out[i] = (self.recv.ctypes.data + stage, m.recv, m.nbytes)
            at += m.signature.count
        flag = self.recv.ctypes.data + self.count * itemsize
        self.args_in = np.zeros(1, abi.PACK_ARGS)
        self.args_in[0] = (self.copies_in.ctypes.data, len(members), 0, 0, 0)
        self.args_out = np.zeros(1, abi.PACK_ARGS)
        clear = int.from_bytes(self.can, "little")
        self.args_out[0] = (self.copies_out.ctypes.data, len(members), itemsize, flag, clear)
        self.unpacked = None  # the members' FusedLaunch one by one (Scheduler.run_fused makes it when first needed)

    @property
    def nbytes(self) -> int:
        return self.count * self.send.dtype.itemsize

    def packed(self) -> bool:
        """After the launch: whether every rank could pack (the flag), so that the
        outputs hold the result."""
        return self._flag == self.can

    def describe(self) -> str:
        """The packed members in words (as a group names a failed member)."""
        sig = self.members[0].signature
        return f"{len(self.members)} {sig.coll}s of {self.count} {sig.dtype} in all, packed into one"
