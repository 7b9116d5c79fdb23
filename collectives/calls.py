"""Call records and their preparation.

A collective call goes through three layers, as NCCL's enqueue pipeline: management
(the Communicator's methods validate the arguments and record the call: Call),
preparation (CallPlanner: the tuner's plan for the call's signature, turned into what
the launch needs: CallPlan, cached per CallSignature) and scheduling (the Communicator
launches each prepared call on its path). A single call is a group of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from commref.device_kernels import abi
from commref.transports.errors import CapabilityError

from . import catalogue, nvls, tuner
from .calibration import GPU, agreed_calibration
from .hierarchical import HIERARCHICAL, NodeShape
from .launch_record import CallPlan, plan_fields
from .model import Model, Paths
from .routes import Route
from .verify import DTYPE_CODES, OPS, dtype_name


class CallSignature(NamedTuple):
    """What a call's plan depends on (CallPlanner's cache key)."""

    coll: str
    algorithm: str  # as asked ("auto", ...): the call's or the communicator's
    count: int  # NCCL's count
    dtype: np.dtype
    op: Any  # None for data movement
    root: int
    symmetric: bool  # the call's route runs a direct kernel (routes.Route.direct)
    avg_divisor: int | None  # op avg: divide by this instead of nranks (a hierarchical phase)
    flat: bool  # never the hierarchical algorithm
    protocol: str  # as asked: the call's or the communicator's


# A collective call as given inside a group (groups.py): the plain tuple (sendbuf,
# recvbuf, *given), given the arguments' very objects in this order; it is checked when
# the group ends (Communicator._resolve), unless the group repeats a kept one
# (launch_record.FusedLaunch.repeats).
GIVEN = ("coll", "op", "root", "stream", "algorithm", "protocol", "avg_divisor", "flat")


@dataclass(eq=False)
class Call:
    """One validated call (management's record): its collective, buffers (buffers.Buffer:
    `s`, `r`; the caller's arrays `sendbuf`, `recvbuf`), signature, route, the caller's
    `stream`, `repeat`: its key among the CPU's kept calls (RepeatedCall), None where it
    cannot be kept, and `given`: its arguments but its arrays, as given (GIVEN)."""

    spec: catalogue.Collective
    signature: CallSignature
    s: Any
    r: Any
    sendbuf: Any
    recvbuf: Any
    route: Route
    stream: Any = None
    repeat: tuple | None = None
    given: tuple | None = None


def record_call(comm, coll, sendbuf, recvbuf, op, root, stream, algorithm, avg_divisor, flat, protocol) -> Call:
    """Management: checks a call's arguments (the communicator's buffers.BufferChecker)
    and records it with its route (routes.DirectRouter); `algorithm` and `protocol`
    default to the communicator's."""
    spec = catalogue.CATALOGUE[coll]
    check = comm._check
    if spec.rooted:
        root = check.root(root)
    s, r, count = check.call(spec, sendbuf, recvbuf, root)
    comm.check_usable()
    algorithm, protocol = algorithm or comm.algorithm, protocol or comm.protocol
    route = comm._router.route(comm._symmetric, spec, s, r, count, explain=algorithm in ("direct", nvls.NVLS))
    if algorithm == nvls.NVLS:
        why = nvls.refusal(spec.name, dtype_name(s.dtype), op, route, comm.peer_mask, comm._router.refusal)
        if why:
            raise (CapabilityError if comm.peer_mask else ValueError)(f"rank {comm.rank}: {why}")
    direct = route.direct is not None
    sig = CallSignature(coll, algorithm, count, s.dtype, op, root, direct, avg_divisor, flat, protocol)
    return Call(spec, sig, s, r, sendbuf, recvbuf, route, stream)


def kernel_spec(coll: str, dtype: str, op: str | None):
    """Which kernel specialization a call needs (see gpu_loader.specialization)."""
    return (DTYPE_CODES[dtype], OPS[op]) if catalogue.get(coll).reducing else None


def communicator_model(comm, slow_network: bool) -> Model:
    """Collective: the performance model of `comm`'s calls (model.py): rank 0's host
    calibration (calibration.agreed_calibration; on a GPU the assumed one, model.GPU) and
    where `comm`'s peers are (GIN, its wire model, nodes, ranks per host)."""
    gin = comm.options.gin
    shape = comm.node_shape
    paths = Paths(
        gin=bool(comm.peer_mask),
        nodes=shape.nodes if isinstance(shape, NodeShape) else 1,
        wire_rate=float(gin.wire_rate or 0),
        wire_latency=float(gin.wire_latency or 0),
        wire_modeled=bool(gin.wire_modeled),
        local_ranks=comm.world.local_size,
        device=comm.device,
        between_hosts=slow_network and not gin.wire_modeled,
    )
    cal = GPU if comm.device == "cuda" else agreed_calibration(comm.world)
    return Model(cal, paths)


class CallPlanner:
    """Preparation for one communicator (`comm`: its rank, ranks, device, channels,
    threads, kernels, node shape, launch record and protocol refusals): the CallPlan of
    every call signature, planned once."""

    def __init__(self, comm, slow_network: bool, gpu_stream=None):
        self.comm, self.slow_network, self.gpu_stream = comm, slow_network, gpu_stream
        self.allowed = tuner.auto_protocols(comm.protocol_refusals)
        self.model = communicator_model(comm, slow_network)  # collective: rank 0's calibration
        self.plans: dict[CallSignature, CallPlan] = {}

    def prepare(self, call: Call) -> CallPlan:
        plan = self.plans.get(call.signature)
        if plan is None:
            plan = self.plans[call.signature] = self.plan(call.spec, call.signature, call.route.refusal)
        return plan

    def packs(self, members: list, packed) -> bool:
        """Whether a group's collectives (RepeatedCalls) run faster packed into one
        (`packed`: packing.Packing): the model's kernel times of the members, each call's
        Python side left out (every member pays it either way), against the packed
        call's and its copies in and out."""
        call_s = self.model.call_s
        alone = sum(m.plan.predicted_s - call_s for m in members)
        return packed.plan.predicted_s - call_s + self.model.pack_s(packed.nbytes) < alone

    def planned(self, coll: str | None = None, count: int | None = None, symmetric: bool | None = None):
        """The plans made so far, in the order they were made, of the calls of `coll`
        with `count` elements on buffers routed to a direct kernel or not (None: any)."""
        return [
            plan
            for sig, plan in self.plans.items()
            if (coll is None or sig.coll == coll)
            and (count is None or sig.count == count)
            and (symmetric is None or sig.symmetric == symmetric)
        ]

    def plan(self, spec: catalogue.Collective, sig: CallSignature, why_not_direct: str | None = None) -> CallPlan:
        """Everything about a call that depends only on its signature."""
        c = self.comm
        dtype, op = sig.dtype, sig.op
        dname = dtype_name(dtype)
        if not spec.reducing:
            op_code = OPS["sum"]  # data movement: no reduction
        elif not isinstance(op, str) or op not in OPS:
            raise ValueError(f"rank {c.rank}: unsupported op {op!r} for {spec.name}; supported: {', '.join(OPS)}")
        else:
            op_code = OPS[op]
        nbytes = max(spec.counts(sig.count, c.nranks)) * dtype.itemsize
        try:
            plan = tuner.plan(
                spec.name,
                sig.algorithm,
                nbytes,
                c.nranks,
                c.device,
                c.max_channels,
                sig.symmetric,
                None if sig.flat else c.node_shape,
                self.slow_network,
                sig.protocol,
                self.allowed,
                why_not_direct,
                c.protocol_refusals,
                c.options.nvls_variant.value,
                self.model,
            )
        except (ValueError, CapabilityError) as e:
            raise type(e)(f"rank {c.rank}: {e}") from None
        predicted = self.model.time(spec.name, plan.algorithm, plan.protocol, nbytes, c.nranks, max(1, plan.nchannels))
        if plan.algorithm == HIERARCHICAL:
            return CallPlan(HIERARCHICAL, 0, None, None, 0, sig.count, False, hierarchical=True, predicted_s=predicted)
        divisor = (sig.avg_divisor or c.nranks) if op == "avg" else 0
        fields32 = plan_fields(
            sig.root, DTYPE_CODES[dname], op_code, plan.nchannels, dtype.itemsize, divisor, plan.protocol
        )
        codes = (DTYPE_CODES[dname], op_code, sig.root, plan.nchannels)
        desc = abi.pack_call(spec.name, plan.algorithm, *codes, plan.protocol, plan.variant)
        kernel, kspec = spec.kernels[plan.algorithm], kernel_spec(spec.name, dname, op)
        launch = None
        if self.gpu_stream is not None:
            self.gpu_stream.check_residency(c.kernels, kernel, kspec, plan.nchannels, c.threads)
        else:  # described once: a launch then costs ctypes one argument (cpu_loader.PreparedLaunch)
            launch = c.kernels.prepared(kernel, plan.nchannels, c.threads, c.launch_record.address)
        return CallPlan(
            kernel,
            plan.nchannels,
            kspec,
            fields32,
            desc,
            spec.kernel_count(sig.count, dtype.itemsize),
            plan.algorithm in ("direct", nvls.NVLS),
            protocol=plan.protocol,
            launch=launch,
            predicted_s=predicted,
        )
