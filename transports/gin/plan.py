"""GIN planning: which peers of a communicator go over GIN, on which backend, wire and
network; what the plan's connections can carry (protocols, the direct kernels' pushes);
GinPlan.start_proxy starts the engine that carries them (engines.py).

`plan_gin` is collective (every rank learns its LSA team); it decides per peer
(LSA where the peer's window is mapped and the path allows it, GIN otherwise),
selects the backend by requirements (backends.select_backend), and refuses what this
machine cannot do with a CapabilityError that names what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

from commref.device_kernels import abi
from commref.transports.errors import CapabilityError
from commref.transports.gin import engines, semantics
from commref.transports.gin.backends import Backend, Requirements, select_backend
from commref.transports.gin.options import GinOptions, GinProtocol, Network, Path, Wire
from commref.transports.gin.study.cells import line_cell, study_safe
from commref.transports.windows import host_team, lsa_team

MAX_GIN_RANKS = 64  # GinArgs.peerMask is one 64-bit word


@dataclass(frozen=True)
class GinPlan:
    """The outcome of planning: `peer_mask` has bit r set for each peer over GIN; the
    rest is None when no peer is (`used` is False)."""

    options: GinOptions
    peer_mask: int = 0
    backend: Backend | None = None
    transport: semantics.Transport | None = None
    network: str | None = None

    @property
    def used(self) -> bool:
        return bool(self.peer_mask)

    @property
    def rings_doorbells(self) -> bool:
        """Whether the kernels end each batch of GIN operations with a doorbell
        (GinArgs.doorbells): on an unordered wire, where the landing order is decided at
        doorbells (gin.h)."""
        return self.used and not self.transport.ordered

    def fill_args(self, gin_args, nchannels: int, nsteps: int, region=None) -> None:
        """Fills CollArgs.gin (a GIN_ARGS record) for this plan on a window of `nchannels`
        channels (the collectives' and p2p's); `region`: the rank's queue.QueueRegion
        (None when GIN is not used)."""
        o = self.options
        gin_args["queue"] = region.queue_address if region is not None else 0
        gin_args["counters"] = region.counters_address if region is not None else 0
        gin_args["peerMask"] = self.peer_mask
        gin_args["capacity"] = o.queue if self.used else 0
        gin_args["protocol"] = abi.GIN_PROTOCOLS[o.protocol.value] if self.used else 0
        gin_args["putsPerSlot"] = o.puts_per_slot
        gin_args["checkHeaders"] = int(o.protocol == GinProtocol.STRONG)
        gin_args["creditSignalBase"] = abi.gin_signals(nchannels, nsteps)[0]
        gin_args["doorbells"] = int(self.rings_doorbells)

    def direct_refusal(self, engine) -> str | None:
        """Why the direct kernels cannot push over this plan's GIN connections with the
        started `engine` (direct.cu, "Direct collectives over GIN"), or None when they can:
        their arrival counts need strong VA signals, and their puts windows the engine
        is given (the native engine's window ids)."""
        if not self.used:
            return None
        caps = self.backend.caps
        if not (caps.strong_signals and caps.va_signals):
            return f"backend {self.backend.name} lacks strong VA signals"
        if not getattr(engine, "carries_windows", False):
            return "this GIN engine does not carry symmetric windows (the native engine does)"
        return None

    def protocol_refusal(self, protocol: str, device: str, cpu_support: int) -> str | None:
        """Why this plan's GIN connections cannot carry `protocol` ("simple", "ll",
        "ll128"; include/commref/proto.h), or None when they can (always for simple, and
        when no peer is over GIN). LL and LL128 lines land as the proxy writes them while
        the receiver polls, so they run only where the ordering study proves the cell
        that models this wire safe (line_cell) and the proxy can land lines as that cell
        assumes: on the CPU engine (abi.CPU_ATOMIC_16 for LL's whole lines,
        abi.CPU_STORE_ORDER for the order of LL128's), on network shm."""
        if not self.used or protocol == "simple":
            return None
        name = protocol.upper()
        if device == "cuda":
            return (
                f"{name} over GIN on GPUs: the copy-engine proxy promises neither whole 16-byte lines nor the "
                f"order of a line's bytes (use protocol simple)"
            )
        if self.network == "mpi":
            return (
                f"{name} over GIN on network mpi: MPI may receive a put's bytes straight into the window, in no "
                f"order or grain that a cell of the ordering study models (use network shm or protocol simple)"
            )
        need = abi.CPU_ATOMIC_16 if protocol == "ll" else abi.CPU_STORE_ORDER
        if not cpu_support & need:
            what = (
                "aligned 16-byte stores that are single-copy atomic (x86-64 with AVX)"
                if protocol == "ll"
                else "stores that become visible in program order (x86-64)"
            )
            return f"{name} over GIN: the proxy lands lines with {what}, which this CPU does not guarantee"
        cell = line_cell(protocol, self.transport, self.options.segment_bytes)
        if cell is None:
            return (
                f"{name} over GIN with segment_bytes {self.options.segment_bytes}: the wire may cut a line at a "
                f"byte that no cell of the ordering study models (use a multiple of 8)"
            )
        row, column = cell
        if not study_safe(row, column):
            return (
                f"{name} over GIN on the {self.transport.name} wire (segment_bytes "
                f"{self.options.segment_bytes}): the ordering study finds {row} on {column} unsafe "
                f"(commref study --protocol {row} --transport {column}); use protocol simple"
            )
        return None

    def start_proxy(self, world, window, layout, **options):
        """Starts this rank's GIN engine for this plan: engines.start_engine, whose keywords
        (observer, engine, region, device, device_id) `options` are; None when GIN is not used."""
        return engines.start_engine(self, world, window, layout, **options)


def protocol_refusal_before_start(options: GinOptions, backend: Backend, protocol: str, device: str) -> str | None:
    """What GinPlan.protocol_refusal says of `protocol` for GIN connections with
    `options` on `backend`, from what is known before any rank starts (the device if
    named, an explicit network; the CPU's guarantees are checked by the ranks)."""
    if options.path == Path.LSA:
        return None
    transport = semantics.Transport(
        options.wire.value,
        ordered=options.wire == Wire.ORDERED,
        flush_orders_later_writes=backend.caps.local_completion_orders_later_writes,
    )
    network = None if options.network == Network.AUTO else options.network.value
    plan = GinPlan(options, peer_mask=1, backend=backend, transport=transport, network=network)
    return plan.protocol_refusal(protocol, device, abi.CPU_ATOMIC_16 | abi.CPU_STORE_ORDER)


def requirements(options: GinOptions, signals_counters: int = 0) -> Requirements:
    """What GIN connections with `options` need from a backend (`signals_counters`: how
    many signals and counters the window holds; 0 checks the rest alone, before any rank
    starts)."""
    return Requirements(
        strong_signals_required=options.protocol == GinProtocol.STRONG,
        va_signals_required=options.va_signals,
        wire=options.wire.value,
        flush_orders_later_writes=options.protocol == GinProtocol.FLUSH_SIGNAL,
        signals_counters=signals_counters,
    )


def plan_gin(world, options: GinOptions, device: str, nchannels: int, nsteps: int, device_signals: int = 0) -> GinPlan:
    """Collective: the GIN plan of this rank of `world` (see the module docstring) for a
    window of `nchannels` channels (the collectives' and p2p's); `device_signals`: the
    signal words a device communicator adds to the connections'."""
    rank, nranks = world.rank, world.size
    if nranks > MAX_GIN_RANKS:
        raise CapabilityError(f"GIN connections address at most {MAX_GIN_RANKS} ranks in this version")
    node = set(lsa_team(world))  # collective: every rank asks once, whatever its path
    local = set(host_team(world))
    team = node if options.path != Path.GIN else set()
    others = [r for r in range(nranks) if r != rank]
    elsewhere = [r for r in others if r not in node]
    if options.path == Path.LSA and elsewhere:
        raise CapabilityError(
            f"rank {rank}: path 'lsa' needs every peer on this rank's node ({world.node}); "
            f"ranks {elsewhere} are on other nodes: use path='auto' or 'gin'"
        )
    gin_peers = [] if options.path == Path.LSA else [r for r in others if r not in team]
    if not gin_peers:
        return GinPlan(options)
    network = options.network
    if network == Network.AUTO:
        network = Network.SHM if all(r in local for r in gin_peers) else Network.MPI
    if device == "cuda" and options.wire != Wire.ORDERED:
        raise CapabilityError(
            f"rank {rank}: GIN on GPUs carries the ordered wire in this version (a copy-engine "
            f"stream per peer keeps order); the {options.wire.value} wire runs on the CPU engine "
            f"(device='cpu')"
        )
    if options.fault.active and device == "cuda":
        raise CapabilityError(
            f"rank {rank}: a lossy wire (fault) runs in the GIN engines of the CPU engine "
            f"(device='cpu'), not on a GPU in this version"
        )
    if options.independent_contexts and device == "cuda":
        raise CapabilityError(
            f"rank {rank}: independent contexts (independent_contexts) run in the Python GIN proxy "
            f"of the CPU engine (device='cpu'), not on a GPU in this version"
        )
    if options.wire_modeled and device == "cuda":
        raise CapabilityError(
            f"rank {rank}: the wire model (wire_rate, wire_latency) runs in the native GIN engine "
            f"of the CPU engine (device='cpu'), not on a GPU in this version"
        )
    if network == Network.SHM and not all(r in local for r in gin_peers):
        raise CapabilityError(f"rank {rank}: network 'shm' needs every GIN peer on this host")
    if network == Network.MPI and world.kind != "mpi":
        raise CapabilityError("network 'mpi' needs an MPI world (run under mpiexec)")
    req = requirements(options, abi.gin_signals(nchannels, nsteps)[1] + device_signals + options.counters)
    backend = select_backend(req, options.backend.value)
    transport = semantics.Transport(
        options.wire.value,
        ordered=options.wire == Wire.ORDERED,
        flush_orders_later_writes=backend.caps.local_completion_orders_later_writes,
    )
    return GinPlan(options, sum(1 << r for r in gin_peers), backend, transport, network.value)
