"""Policy: FIFO geometry per device, and per call the algorithm, protocol and channel
count, each the performance model's choice (model.py) where left to "auto".

Everything here is a pure function of (collective, bytes, nranks, device, options, the
model), so every rank picks the same plan without talking to the others: the model's
calibration is rank 0's (calibration.agreed_calibration).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from commref.transports.errors import CapabilityError

from . import catalogue, nvls
from .hierarchical import HIERARCHICAL, NodeShape
from .model import Model, Paths
from .routes import needs_symmetric


@dataclass(frozen=True)
class Defaults:
    max_channels: int
    slot_bytes: int
    nsteps: int
    threads: int


# FIFO slot bytes on the CPU when GIN peers are reached over network "mpi": each step is
# a message to the peer's engine, whose fixed cost (matching, rendezvous, a wake of the
# engine) 256 KiB slots do not amortize (0.2-0.4x MPICH's 16 MiB AllReduce with 256 KiB
# slots), while 4 MiB ones leave a 16 MiB call two steps per
# phase to overlap the messages with the reductions. Measured on today's engines, 2 ranks,
# 16 MiB, only the two communicators alive, alternating: 1 MiB slots 5.08-5.67 ms against
# 4 MiB ones' 6.25-6.47 ms in three runs (docs/gin.md, "Slots for network mpi"). NCCL's
# network transport moves large chunks per step for the same reason. The cost: a
# connection's FIFO is nsteps x 1 MiB on each side.
NETWORK_SLOT_BYTES = 1024 * 1024


def defaults(device: str, local_ranks: int = 1, network: str | None = None) -> Defaults:
    """FIFO geometry and channel limit; `network` is the GIN network of the communicator
    (None: no GIN peer). On the CPU a channel is a spinning OS thread: more channels per
    rank than this host's cores per local rank only take turns."""
    if device == "cuda":
        return Defaults(max_channels=8, slot_bytes=512 * 1024, nsteps=8, threads=512)
    # CPU engine: one block is one OS thread and copies run at memcpy speed, so few
    # channels; 256 KiB slots keep a step's data in the cache between the writer and the
    # reader (docs/performance.md, "Measurements the model's structure and reference
    # terms rest on"); network steps are messages.
    cores = max(1, (os.cpu_count() or 1) // max(1, local_ranks))
    slot_bytes = NETWORK_SLOT_BYTES if network == "mpi" else 256 * 1024
    return Defaults(max_channels=max(1, min(4, cores)), slot_bytes=slot_bytes, nsteps=4, threads=1)


@dataclass(frozen=True)
class Plan:
    algorithm: str
    nchannels: int
    protocol: str = "simple"  # of the ring and tree kernels' steps (include/commref/proto.h)
    variant: str | None = None  # algorithm "nvls": nvls.ONE_SHOT or TWO_SHOT


PROTOCOLS = ("simple", "ll", "ll128")
# The algorithms whose kernels run protocols (the direct kernels use no FIFO).
PROTOCOL_ALGORITHMS = ("ring", "tree")


def auto_protocols(refused) -> tuple[str, ...]:
    """The protocols "auto" may take on a communicator that cannot run `refused`
    (collectives/protocols.py); which of them a call takes is the model's (plan)."""
    return tuple(p for p in PROTOCOLS if p not in (refused or {}))


def protocol_refusal(protocol: str, refused) -> str | None:
    """Why `protocol`, asked for by name, cannot run on a communicator some rank of which
    cannot run `refused` (protocol -> why: collectives/protocols.py), or None. Asked of
    the communicator's protocol option when it is built, and of every call's (plan)."""
    why = refused.get(protocol) if refused else None
    return None if why is None else f"protocol {protocol!r} cannot run on this communicator: {why}"


def auto_algorithms(spec, nranks: int, symmetric: bool, nodes, protocol: str) -> tuple[str, ...]:
    """The algorithms "auto" chooses among for a call of `spec`: ring and tree where the
    collective has them; direct where the buffers are symmetric and no line protocol is
    asked for (the direct kernels use no FIFO); hierarchical where the job's NodeShape
    allows it. Algorithm "nvls" runs only where asked for: its multimem handle is the LSA
    emulation in this version, which loads what the direct kernel loads."""
    out = [a for a in ("ring", "tree") if a in spec.algorithms and (a != "tree" or nranks > 2)]
    if symmetric and protocol in ("auto", "simple") and "direct" in spec.algorithms:
        out.insert(0, "direct")  # first: a tie (one rank) goes to zero copy
    if isinstance(nodes, NodeShape) and HIERARCHICAL in spec.algorithms:
        out.append(HIERARCHICAL)
    return tuple(out) or (spec.algorithms[0],)


def plan(
    coll: str,
    algorithm: str,
    nbytes: int,
    nranks: int,
    device: str,
    max_channels: int,
    symmetric: bool = False,
    nodes: NodeShape | str | None = None,
    slow_network: bool = False,
    protocol: str = "auto",
    allowed=PROTOCOLS,
    why_not_direct: str | None = None,
    refused=None,
    nvls_variant: str = "auto",
    model: Model | None = None,
) -> Plan:
    """Algorithm, channel count and protocol for one call: every choice left to "auto"
    is the performance model's argmin (model.Model.best; `model`: the communicator's, by
    default the host calibration's over `nranks` ranks on this host, GIN between nodes
    where `slow_network`). `nbytes` is the size of the full (per-rank, unsplit) buffer the
    collective reduces or gathers; `symmetric` says that the direct kernels can run (the
    call's route: routes.DirectRouter), and `why_not_direct` why not (the ValueError of
    algorithm "direct"; default: routes.needs_symmetric); `nodes` is the job's NodeShape
    where the hierarchical algorithm can run, else why not (hierarchical.node_shape) or
    None. `protocol`: "auto" (the model's, among `allowed`: the protocols the
    communicator can run) or one of PROTOCOLS; one in `refused` (protocol_refusal)
    raises CapabilityError. Protocols are the ring and tree kernels': a call of algorithm
    "direct" runs without one (its plan says simple). A hierarchical plan has no
    channels: its children plan their own calls. Explicit choices are kept; the variant
    of algorithm "nvls" is `nvls_variant` (nvls.variant). A tree runs both trees of the
    double binary tree (at least 2 channels where max_channels allows)."""
    refusal = protocol_refusal(protocol, refused)
    if refusal:
        raise CapabilityError(refusal)
    if protocol != "auto" and protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose from auto, {', '.join(PROTOCOLS)}")
    spec = catalogue.get(coll)
    if algorithm != "auto" and algorithm not in catalogue.ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose from auto, {', '.join(catalogue.ALGORITHMS)}")
    if algorithm != "auto" and algorithm not in spec.algorithms:
        raise ValueError(
            f"algorithm {algorithm!r} is implemented for "
            f"{', '.join(catalogue.with_algorithm(algorithm))} only, not {coll}"
        )
    if algorithm in ("direct", nvls.NVLS) and not symmetric:
        raise ValueError(why_not_direct or needs_symmetric(spec))
    if algorithm == HIERARCHICAL and not isinstance(nodes, NodeShape):
        raise ValueError(
            f"algorithm 'hierarchical' cannot run on this communicator: {nodes or 'it needs ranks on several nodes'}"
        )
    if model is None:
        shape = nodes if isinstance(nodes, NodeShape) else None
        model = Model.default(
            Paths(
                gin=slow_network,
                nodes=shape.nodes if shape else 1,
                local_ranks=nranks,
                device=device,
                between_hosts=slow_network,
            )
        )
    algorithms = auto_algorithms(spec, nranks, symmetric, nodes, protocol) if algorithm == "auto" else (algorithm,)
    protocols = tuple(allowed) if protocol == "auto" else (protocol,)
    algorithm, chosen, nchannels = model.best(
        spec.name, nbytes, nranks, algorithms, protocols or ("simple",), max_channels
    )
    if algorithm == HIERARCHICAL:
        return Plan(HIERARCHICAL, 0, protocol)
    if algorithm == "tree" and max_channels >= 2:
        nchannels = max(2, nchannels)  # both trees of the double binary tree
    variant = nvls.variant(nbytes, nvls_variant) if algorithm == nvls.NVLS else None
    return Plan(algorithm, nchannels, chosen if algorithm in PROTOCOL_ALGORITHMS else "simple", variant)


# ---- streamed stores on the CPU (CollArgs.streamStores, include/commref/move.h) ----

# Below this many bytes a call hardly streams (no thread's share reaches move.h's
# thresholds): it is left on and not timed.
STORE_CHOOSER_MIN_BYTES = 64 * 1024
# The setting not in use is tried again after this many calls of a kind at first; each
# try that confirms the setting in use doubles the wait, up to STORE_TRY_MAX_EVERY. A try
# costs its STORE_TRY_CALLS calls and the STORE_WARM_CALLS after it.
STORE_TRY_EVERY = 32
STORE_TRY_MAX_EVERY = 256
# A call is timed only after this many calls of its kind in a row with its setting: the
# cache state the other setting left takes that long to wear off. On the 2-core host, 16
# MiB AllReduce on symmetric buffers, calls in a row after a change took 3527, 2819,
# 1822, 1476, 1335, 1299 us with cached stores (after streamed ones, which settle at
# about 1850; docs/performance.md, "Streamed stores: how auto chooses").
STORE_WARM_CALLS = 4
# A try of the other setting: this many calls, the try's time the least of the timed ones.
STORE_TRY_CALLS = STORE_WARM_CALLS + 2
# The setting in use is left at once when a call of it is this much slower than the
# other setting's last time (a placement change); less is taken for noise.
STORE_SWITCH_MARGIN = 1.15


@dataclass
class _StoreKind:
    """The chooser's state for one kind of call."""

    seconds_per_byte: list  # [off, on]: the last warm time of each (None: not yet)
    current: int = 1  # the setting in use
    last: int | None = None  # the setting of this kind's previous call (None: no call yet)
    run: int = 0  # calls of this kind in a row with `last`
    trial: int = 0  # calls left in a try of the other setting
    best: float | None = None  # the try's least seconds per byte so far
    wait: int = STORE_TRY_EVERY  # calls between tries
    countdown: int = 0  # calls until the next try


class StoreChooser:
    """Picks CollArgs.streamStores for each CPU call by measuring both settings.

    Whether streaming what another core reads next pays depends on where the cores sit
    (move.h), which a virtual machine may change under the program, and on the call: an
    in-place call rewrites lines it has just read. So for each kind of call (kernel,
    size class, in place or not) the chooser uses the setting with the lower seconds
    per byte and keeps the last time of each. Only warm calls are timed: a call pays for
    the cache state its kind's earlier calls left (streamed stores leave the output out
    of the cache, plain ones in it), for STORE_WARM_CALLS calls after the setting
    changes, and a kind's first calls for first touches. So the other setting is tried
    for STORE_TRY_CALLS calls, the last two timed, right away and then after
    STORE_TRY_EVERY calls, a wait that doubles up to STORE_TRY_MAX_EVERY while tries
    confirm the setting in use, and starts again when one does not. A placement change
    that slows the setting in use shows at its next warm call (its time passes the
    other's by STORE_SWITCH_MARGIN); one that speeds the other up, at the next try.
    Each rank chooses alone (how a rank stores changes no result, only its speed);
    ranks that see the same times try in the same calls. Mode "on" or "off" fixes the
    setting (for measurements and tests)."""

    def __init__(self, mode: str = "auto"):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"stream_stores must be 'auto', 'on' or 'off', not {mode!r}")
        self.mode = mode
        self._kinds: dict[tuple, _StoreKind] = {}

    def choose(self, kernel: str, nbytes: int, in_place: bool = False) -> tuple[int, tuple | None]:
        """(setting, key to record the call's time under, or None: do not time it)."""
        if self.mode != "auto":
            return int(self.mode == "on"), None
        if nbytes < STORE_CHOOSER_MIN_BYTES:
            return 1, None
        key = (kernel, int(nbytes).bit_length(), bool(in_place))
        k = self._kinds.get(key)
        if k is None:
            k = self._kinds[key] = _StoreKind([None, None])
        rates = k.seconds_per_byte
        if not k.trial and rates[k.current] is not None and (rates[1 - k.current] is None or k.countdown <= 0):
            k.trial, k.best = STORE_TRY_CALLS, None  # the other setting was never timed, or its wait is over
        setting = 1 - k.current if k.trial else k.current
        k.run = k.run + 1 if k.last == setting else 1
        k.last = setting
        if k.trial:
            k.trial -= 1
        else:
            k.countdown -= 1
        return setting, (key if k.run > STORE_WARM_CALLS else None)

    def record(self, key: tuple, setting: int, seconds: float, nbytes: int) -> None:
        """The time of a warm call that choose() returned `key` for."""
        k = self._kinds[key]
        rates = k.seconds_per_byte
        rate = seconds / max(1, nbytes)
        if setting != k.current:  # a call of a try
            k.best = rate if k.best is None else min(k.best, rate)
            if k.trial:
                return  # the try goes on
            rates[setting] = k.best
            if rates[setting] < rates[k.current]:  # the try ends: keep the faster
                k.current, k.wait = setting, STORE_TRY_EVERY
            else:
                k.wait = min(2 * k.wait, STORE_TRY_MAX_EVERY)
            k.countdown = k.wait
            return
        rates[setting] = rate
        other = rates[1 - setting]
        if other is not None and rate > other * STORE_SWITCH_MARGIN:  # the setting in use slowed down
            k.current, k.wait, k.countdown = 1 - setting, STORE_TRY_EVERY, STORE_TRY_EVERY


# ---- residency of co-located ranks on one GPU ----


def residency_problem(
    kernel: str,
    ranks: int,
    channels: int,
    threads: int,
    blocks_per_sm: int,
    sms: int,
    unit: str = "channels",
    knob: str = "max_channels",
) -> str | None:
    """Why `ranks` ranks of one process on one GPU cannot each run `kernel` with
    `channels` blocks of `threads` threads at once, or None when they can. `unit` names
    a rank's blocks in the message and `knob` what sets their number (a user's kernel:
    "blocks", "grid").

    The rule: every block of a rank's launch spins on the same channel of its peers. When
    peers are ranks of this process on this device, their launches run concurrently on
    their own streams, so all ranks x channels blocks must be resident at once: a
    resident block waiting for a peer's block that cannot be scheduled until it exits
    waits until its deadline. That needs blocks_per_sm x sms >= ranks x channels
    (blocks_per_sm: cuOccupancyMaxActiveBlocksPerMultiprocessor for `threads`).
    A single rank on its device needs no such room: the blocks of one launch never wait
    for one another, only for the same channel on peers elsewhere, so a block that is
    not resident yet starts when an earlier one has finished. Either way a kernel must
    fit at least one block of `threads` threads (blocks_per_sm > 0). Blocks of other
    kernels on the device (the user's, other communicators') are not counted."""
    if blocks_per_sm <= 0:
        return f"{kernel} cannot run {threads} threads per block on this GPU (0 blocks fit an SM); use fewer threads"
    if ranks <= 1:
        return None
    need, room = ranks * channels, blocks_per_sm * sms
    if room >= need:
        return None
    return (
        f"{ranks} ranks of this process share this GPU: {ranks} ranks x {channels} {unit} = {need} blocks of "
        f"{threads} threads must be resident at once, but {kernel} fits {blocks_per_sm} blocks per SM x {sms} "
        f"SMs = {room}; use fewer {knob} or threads, or fewer ranks per GPU"
    )
