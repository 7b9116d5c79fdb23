"""Scheduling: the last layer of a call (calls.py), which runs each prepared call on its
path: the hierarchical composition (its children's calls), the CPU engine (the call
kept for repetition: launch_record.RepeatedCall) or the communicator's GPU stream
(gpu_stream.GpuStream), and a group's sends and receives in one launch (p2p.py). One
queue per path and stream, in call order; a single call is a group of one (groups.py).

On the CPU a group of several calls runs as one launch of the engine
(launch_record.FusedLaunch: its collectives' kernels one after the other, then its sends
and receives), unless a member cannot join one: a hierarchical call, a call whose
streamStores the tuner times per call, or a collective whose preparation fails (then
each member launches alone, as on a GPU). A group of AllReduces of one signature may run
as one AllReduce of all their elements instead (packing.py). A fused group whose members
are all kept calls is kept too, keyed by them: the same calls on the same arrays again,
as given, go straight to its launch without being checked again (replay()); a kept call
or group is dropped when the symmetric windows change (forget()).
"""

from __future__ import annotations

import time

import numpy as np

from commref.device_kernels import abi
from commref.transports.errors import CapabilityError

from . import packing, tuner
from .calls import Call
from .launch_record import CallPlan, FusedLaunch, RepeatedCall
from .p2p import P2pCall, P2pLauncher

REPEATED_CALLS = 64  # RepeatedCalls a CPU communicator keeps (the oldest goes first)
REPEATED_GROUPS = 16  # FusedLaunches a CPU communicator keeps (all go when it is full)


class Scheduler:
    """The launches of one communicator `comm`: its launch record, kernels, stream
    stores chooser (CPU), GPU stream, and its end_launch and hierarchy."""

    def __init__(self, comm, planner, host):
        self.comm, self.planner = comm, planner
        self.record, self.kernels, self.threads = comm.launch_record, comm.kernels, comm.threads
        self.gpu_stream, self.stores = comm.gpu_stream, tuner.StoreChooser(comm.options.stream_stores.value)
        self.repeated: dict = {}  # CPU: a call's arguments (buffers by id) -> RepeatedCall, kept
        self.groups: dict = {}  # CPU: a group's members (RepeatedCalls, in order) -> FusedLaunch, kept
        self.replays: dict = {}  # CPU: FusedLaunch.replay_key -> the kept groups of that key that can replay
        self.launches = 0  # launches of this communicator's kernels so far (a fused group: one)
        self.packed = 0  # fused groups whose collectives ran packed into one (packing.py)
        # p2p keeps its operations' buffers, groups and sendrecvs in `repeated` (forget() drops them)
        self.p2p = P2pLauncher(comm, host, self.stores, self.repeated, REPEATED_CALLS)

    def forget(self) -> None:
        """Drops every kept call and group: the next calls are checked and planned afresh."""
        self.repeated.clear()
        self.groups.clear()
        self.replays.clear()

    def replay(self, calls: list) -> bool:
        """Runs a group's calls as given (calls.GIVEN records, p2p.P2pCalls) as the kept
        group that they repeat (FusedLaunch.repeats: the same arguments on unchanged
        arrays, so every check it passed holds), looked up by their first sendbuf
        (FusedLaunch.replay_key); False, running nothing, where they repeat none. A
        failure as launch() raises it."""
        first = calls[0]
        if first.__class__ is not tuple or self.comm.broken:
            return False
        for fused in self.replays.get(id(first[0]), ()):
            if fused.repeats(calls):
                self.run_fused(fused, calls)
                return True
        return False

    def launch(self, calls: list) -> None:
        """Prepares (CallPlanner) and runs recorded calls (calls.Call, p2p.P2pCall, or kept
        RepeatedCalls that matched their arrays): on the CPU several as one FusedLaunch
        (the module docstring), else the collectives one launch each, in order, then every
        send and recv in one launch. A failure is raised with `member` set to the call
        that failed and `member_at` its index in `calls`; the calls after it are not
        launched."""
        if len(calls) > 1 and self.gpu_stream is None:
            fused = self.groups.get(tuple(calls))
            if fused is None:
                fused = self.fuse(calls)
            if fused is not None:
                self.run_fused(fused, calls)
                return
        p2p = [call for call in calls if isinstance(call, P2pCall)]
        for at, call in enumerate(calls):
            if isinstance(call, P2pCall):
                continue
            try:
                if isinstance(call, RepeatedCall):
                    self.run_cpu(call)
                else:
                    self.launch_one(call)
            except Exception as e:
                e.member, e.member_at = call, at
                raise
        if p2p:
            self.launches += 1
            try:
                self.p2p.run(p2p)
            except Exception as e:
                e.member_at = calls.index(e.member) if getattr(e, "member", None) in calls else None
                raise

    def fuse(self, calls: list) -> FusedLaunch | None:
        """The FusedLaunch of a CPU group's `calls`, kept when every member is a kept
        call; None where a member cannot join one, or no collective would (the module
        docstring). A group of collectives alone packs where packing.py says it can and
        the model says it is faster."""
        members, positions, p2p = [], [], []
        for at, call in enumerate(calls):
            if isinstance(call, P2pCall):
                p2p.append(call)
                continue
            if not isinstance(call, RepeatedCall):
                try:
                    plan = self.planner.prepare(call)
                except Exception:
                    return None  # raised again by the member's own launch, after its predecessors'
                if plan.hierarchical:
                    return None
                call = self.keep(call, plan)
            if call.timed:
                return None
            members.append(call)
            positions.append(at)
        if not members:
            return None
        fused = FusedLaunch(
            self.kernels,
            self.record,
            members,
            positions,
            self.threads,
            self.p2p.prepare(p2p) if p2p else None,
            None if p2p else self.pack(members),
        )
        if not p2p and all(member.kept for member in members):
            if len(self.groups) >= REPEATED_GROUPS:
                self.groups.clear()
                self.replays.clear()
            self.groups[tuple(members)] = fused
            if fused.repeats is not None:
                self.replays.setdefault(fused.replay_key, []).append(fused)
        return fused

    def pack(self, members: list) -> packing.Packing | None:
        """The Packing of a group's collectives where they pack (packing.py) and the model
        predicts it faster (CallPlanner.packs); else None."""
        if not packing.same_signature(members):
            return None
        try:
            packed = packing.Packing(self.comm, members, self.planner.prepare, self.keep)
        except (ValueError, CapabilityError):  # the packed call cannot be planned: the members run one by one
            return None
        if packed.call is None or packed.call.timed or not self.planner.packs(members, packed):
            return None
        return packed

    def run_fused(self, fused: FusedLaunch, calls: list) -> None:
        """Runs a FusedLaunch of `calls`; a failure as launch() raises it. A packed one
        whose flag says some rank could not pack runs its members one by one instead
        (packing.py), on every rank alike."""
        status = fused.call()
        self.launches += 1
        if not status:
            packed = fused.packing
            if packed is not None and not packed.packed():
                if packed.unpacked is None:
                    members, positions = fused.members, fused.positions
                    packed.unpacked = FusedLaunch(self.kernels, self.record, members, positions, self.threads)
                self.run_fused(packed.unpacked, calls)
                return
            self.packed += packed is not None
            if self.comm.proxy is not None:  # end_launch has nothing to raise otherwise
                self.comm.end_launch(0)
            return
        at, status = status >> 8, status & 0xFF
        if fused.owners[at] is None:  # the sends and receives
            p2p = [call for call in calls if isinstance(call, P2pCall)]
            try:
                if status == abi.LAUNCH_REFUSED:
                    raise fused.refused(at)()
                self.comm.end_launch(status)
            except Exception as e:
                try:
                    self.p2p.raise_failure(p2p, fused.ops, e)
                except Exception as named:
                    named.member_at = calls.index(named.member)
                    raise
        try:
            self.comm.end_launch(status, fused.refused(at))
        except Exception as e:
            e.member, e.member_at = fused.owners[at], fused.position(at)
            raise

    def launch_one(self, call: Call) -> None:
        plan = self.planner.prepare(call)
        if plan.hierarchical:
            self.run_hierarchical(call)
        elif self.gpu_stream is None:
            self.run_cpu(self.keep(call, plan))
        else:
            if plan.direct:
                self.record.set_symmetric(call.route.sym)
            self.comm.end_launch(self.launch_gpu(plan, call.s.address, call.r.address, call.stream))

    def keep(self, call: Call, plan: CallPlan) -> RepeatedCall:
        """A CPU call as a RepeatedCall, kept for the next call with its arguments unless
        a buffer was not looked at (root_only: the other one stood in for it)."""
        s, r = call.s, call.r
        timed = s.nbytes >= tuner.STORE_CHOOSER_MIN_BYTES and self.stores.mode == "auto"
        in_place = timed and s.overlaps(r)
        streamed = 0 if timed else self.stores.choose(plan.kernel, s.nbytes)[0]  # the same every call
        keep = call.repeat is not None and s.obj is call.sendbuf and r.obj is call.recvbuf
        kept = RepeatedCall(
            call.sendbuf,
            call.recvbuf,
            plan,
            s,
            r,
            call.route.sym,
            streamed,
            timed,
            in_place,
            keep,
            call.signature,
            call.given,
        )
        if kept.kept:
            if len(self.repeated) >= REPEATED_CALLS:
                self.repeated.clear()
            self.repeated[call.repeat] = kept
        return kept

    def run_cpu(self, call: RepeatedCall) -> None:
        """Runs a CPU call (its record fields written unless the record holds them)."""
        record = self.record
        if record.holder is not call:
            call.load(record)
        launch = call.plan.launch
        if call.timed:  # tuner.StoreChooser picks and times streamStores
            streamed, store_key = self.stores.choose(call.plan.kernel, call.nbytes, call.in_place)
            record.set_stream_stores(streamed)
            t0 = time.perf_counter()
            status = launch.call()
            if store_key is not None and not status:
                self.stores.record(store_key, streamed, time.perf_counter() - t0, call.nbytes)
        else:
            status = launch.call()
        self.launches += 1
        comm = self.comm
        if status or comm.proxy is not None:  # end_launch has nothing to raise otherwise
            comm.end_launch(status, launch.refused)

    def launch_gpu(self, plan: CallPlan, send: int, recv: int, stream) -> int:
        """Enqueues the call on the communicator's stream, joined to the caller's
        `stream` (None: CuPy's current stream; a cupy Stream or a CUstream handle)."""
        comm, record = self.comm, self.record
        if comm.failed:  # an earlier kernel failed and nobody synchronized since
            raise comm.failure()
        caller = self.gpu_stream.caller(stream)
        record.set_call(plan, send, recv)
        self.launches += 1
        return self.gpu_stream.enqueue(
            lambda own: self.kernels.launch(
                plan.kernel, plan.nchannels, self.threads, record.args, own, plan.spec, record.address
            ),
            caller,
        )

    def run_hierarchical(self, call: Call) -> None:
        """The call as its hierarchy's calls (hierarchical.Hierarchy); AllReduce's tail
        that does not split over the node's ranks by the flat algorithm."""
        comm, op, stream = self.comm, call.signature.op, call.stream
        h = comm.hierarchy()
        send, recv = call.s.array.reshape(-1), call.r.array.reshape(-1)
        if call.spec.name == "allreduce":
            h.allreduce(
                send,
                recv,
                op,
                stream,
                lambda a, b: comm._collective("allreduce", a, b, op, 0, stream, "auto", None, flat=True),
            )
            return
        xp = np
        if self.gpu_stream is not None:
            import cupy as xp
        if call.spec.name == "reduce_scatter":
            h.reduce_scatter(send, recv, op, stream, xp)
        else:
            h.allgather(send, recv, stream, xp)
