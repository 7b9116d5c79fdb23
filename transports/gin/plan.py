"""GIN planning: which peers of a communicator go over GIN, on which backend, wire and
network, and the proxy that carries them.

`plan_gin` is collective (every rank learns its LSA team); it decides per peer
(LSA where the peer's window is mapped and the path allows it, GIN otherwise),
selects the backend by requirements (backends.select_backend), and refuses what this
machine cannot do with a CapabilityError that names what is missing.
"""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass

from commref.device_kernels import abi
from commref.transports.errors import CapabilityError
from commref.transports.gin import semantics
from commref.transports.gin.backends import Backend, Requirements, select_backend
from commref.transports.gin.options import GinOptions, GinProtocol, Network, Path, Wire
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

    def fill_args(self, gin_args, max_channels: int, nsteps: int, region=None) -> None:
        """Fills CollArgs.gin (a GIN_ARGS record) for this plan; `region`: the rank's
        queue.QueueRegion (None when GIN is not used)."""
        o = self.options
        gin_args["queue"] = region.queue_address if region is not None else 0
        gin_args["counters"] = region.counters_address if region is not None else 0
        gin_args["peerMask"] = self.peer_mask
        gin_args["capacity"] = o.queue if self.used else 0
        gin_args["protocol"] = abi.GIN_PROTOCOLS[o.protocol.value] if self.used else 0
        gin_args["putsPerSlot"] = o.puts_per_slot
        gin_args["checkHeaders"] = int(o.protocol == GinProtocol.STRONG)
        gin_args["creditSignalBase"] = abi.gin_signals(max_channels, nsteps)[0]
        gin_args["doorbells"] = int(self.used and not self.transport.ordered)

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
            return "this GIN engine does not carry symmetric windows (the native engine does: ordered wire, no fault)"
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
            return (f"{name} over GIN on GPUs: the copy-engine proxy promises neither whole 16-byte lines nor the "
                    f"order of a line's bytes (use protocol simple)")
        if self.network == "mpi":
            return (f"{name} over GIN on network mpi: MPI may receive a put's bytes straight into the window, in no "
                    f"order or grain that a cell of the ordering study models (use network shm or protocol simple)")
        need = abi.CPU_ATOMIC_16 if protocol == "ll" else abi.CPU_STORE_ORDER
        if not cpu_support & need:
            what = ("aligned 16-byte stores that are single-copy atomic (x86-64 with AVX)" if protocol == "ll"
                    else "stores that become visible in program order (x86-64)")
            return f"{name} over GIN: the proxy lands lines with {what}, which this CPU does not guarantee"
        cell = line_cell(protocol, self.transport, self.options.segment_bytes)
        if cell is None:
            return (f"{name} over GIN with segment_bytes {self.options.segment_bytes}: the wire may cut a line at a "
                    f"byte that no cell of the ordering study models (use a multiple of 8)")
        row, column = cell
        if not study_safe(row, column):
            return (f"{name} over GIN on the {self.transport.name} wire (segment_bytes "
                    f"{self.options.segment_bytes}): the ordering study finds {row} on {column} unsafe "
                    f"(commref study --protocol {row} --transport {column}); use protocol simple")
        return None

    def start_proxy(self, world, window, layout, observer=None, engine: str | None = None, region=None,
                    device: str = "cpu", device_id: int = 0):
        """Starts this rank's GIN proxy over `window` (None when GIN is not used): the
        native engine (native.NativeProxy) for the ordered wire without an observer (on
        network mpi where native.mpi_library() builds on every rank), the Python proxy
        (proxy.GinProxy) otherwise. `engine` (default: the COMMREF_GIN_ENGINE environment
        variable, see gin_engine()) forces one. On a GPU (`device` "cuda") the copy-engine
        proxy (gpu_proxy.GpuProxy) over `region`, the rank's queue.QueueRegion."""
        if not self.used:
            return None
        o = self.options
        mpi_comm, mpi_tag = None, 0
        if self.network == "mpi":  # the proxies' own communicator and tag: collective, as Dup is
            mpi_comm, mpi_tag = world.comm.Dup(), network_tag()
        if device == "cuda":
            from commref.transports.gin.gpu_proxy import GpuProxy

            proxy = GpuProxy(world, window, layout, region, o.queue, self.backend, self.transport, device_id,
                             network=self.network, mpi_comm=mpi_comm, mpi_tag=mpi_tag)
            proxy.start()
            return proxy
        from commref.transports.gin import native

        engine = gin_engine() if engine is None else check_gin_engine(engine)
        why_not = native.supports(self.transport, self.network, observer)
        if why_not is None and o.fault.active:
            why_not = "a lossy wire (fault), which the Python proxy carries"
        if mpi_comm is not None:  # every rank's engine must speak one protocol
            refusals = [w for w in mpi_comm.allgather(why_not if engine != "python" else "python") if w is not None]
            if refusals and why_not is None:
                why_not = f"what another rank's engine speaks ({refusals[0]})"
        if engine == "native" and why_not is not None:
            raise CapabilityError(f"{ENGINE_ENV}=native: the native GIN engine cannot carry {why_not}")
        if o.wire_modeled and (engine == "python" or why_not is not None):
            raise CapabilityError(f"the wire model (wire_rate, wire_latency) runs in the native GIN engine, which "
                                  f"cannot carry {why_not or f'this run ({ENGINE_ENV}=python)'}")
        if engine != "python" and why_not is None:
            proxy = native.NativeProxy(world, window, layout, o.queue, self.backend, self.transport, self.network,
                                       mpi_comm=mpi_comm, mpi_tag=mpi_tag, wire_rate=o.wire_rate,
                                       wire_latency=o.wire_latency)
        else:
            from commref.transports.gin.proxy import GinProxy

            proxy = GinProxy(world, window, layout, o.queue, self.backend, self.transport, self.network, o.seed,
                             o.segment_bytes, mpi_comm, observer, mpi_tag=mpi_tag, faults=o.fault)
        proxy.start()
        return proxy


def protocol_refusal_before_start(options: GinOptions, backend: Backend, protocol: str, device: str) -> str | None:
    """What GinPlan.protocol_refusal says of `protocol` for GIN connections with
    `options` on `backend`, from what is known before any rank starts (the device if
    named, an explicit network; the CPU's guarantees are checked by the ranks)."""
    if options.path == Path.LSA:
        return None
    transport = semantics.Transport(options.wire.value, ordered=options.wire == Wire.ORDERED,
                                    flush_orders_later_writes=backend.caps.local_completion_orders_later_writes)
    network = None if options.network == Network.AUTO else options.network.value
    plan = GinPlan(options, peer_mask=1, backend=backend, transport=transport, network=network)
    return plan.protocol_refusal(protocol, device, abi.CPU_ATOMIC_16 | abi.CPU_STORE_ORDER)


def line_cell(protocol: str, transport: semantics.Transport, segment_bytes: int) -> tuple[str, str] | None:
    """The cell of the ordering study (docs/ordering.md: protocol row, model column) that
    models `protocol`'s lines ("ll" or "ll128") landing on a wire of `transport` that
    places `segment_bytes` at a time, or None where no cell models the landing.

    The proxies land each segment with landLines (include/commref/proto.h): every
    aligned 16-byte line by one store, in ascending address order. Segments are cut at
    multiples of segment_bytes of the destination (semantics.segments). So:
      - row: an LL line lands whole when segment_bytes is a multiple of 16 (ll-flag), as
        two 8-byte halves when only a multiple of 8 (ll-flag-8B); an LL128 line's data
        and flag are separate 8-byte units either way (ll-flag-8B: safe only where the
        units of a line land in order);
      - column: ordered is the ordered wire; on the unordered one, segments that are whole
        128-byte blocks (segment_bytes a multiple of 128) land each aligned block of a
        put in order (unordered+block128); otherwise unordered, or unordered+flush_orders
        where a flush orders later writes (what is safe without that is safe with it).
    The runtime wires place no duplicates (the lossy layer drops them)."""
    if segment_bytes % 8:
        return None
    row = "ll-flag" if protocol == "ll" and segment_bytes % 16 == 0 else "ll-flag-8B"
    if transport.ordered:
        column = "ordered"
    elif transport.duplicates:
        column = "unordered+duplicates"
    elif transport.placement == "block128" or segment_bytes % semantics.BLOCK_BYTES == 0:
        column = "unordered+block128"
    elif transport.flush_orders_later_writes:
        column = "unordered+flush_orders"
    else:
        column = "unordered"
    return row, column


@functools.lru_cache(maxsize=None)
def study_safe(row: str, column: str, strength: str | None = None) -> bool:
    """The ordering study's verdict on a cell (the explorer's exhaustive search, at the
    study's default bound; a few milliseconds, once per process). `strength`: "weak"
    or "strong" for the rows with signals (None: weak), None for the others."""
    from commref.transports.gin.study import explorer, protocols

    return explorer.run_cell(protocols.PROTOCOL_BY_NAME[row], strength, protocols.MODEL_BY_NAME[column]).safe


# MPI tags of the proxies' messages on network mpi, one per GIN communicator: a
# communicator freed at stop may have its context id reused by a later one, and the old
# one's messages still in flight (a trailing credit) must not match the new proxies.
NETWORK_TAG_BASE, NETWORK_TAG_SPAN = 1024, 30000  # inside the 32767 every MPI allows
_network_tags = itertools.count()


def wire_column(transport: semantics.Transport) -> str:
    """The column of the ordering study that models a wire of `transport` for messages
    on one context (whole puts, whatever their segment size)."""
    if transport.ordered:
        return "ordered"
    if transport.duplicates:
        return "unordered+duplicates"
    if transport.placement == "block128":
        return "unordered+block128"
    if transport.flush_orders_later_writes:
        return "unordered+flush_orders"
    return "unordered"


def counted_writes_cell(transport: semantics.Transport) -> tuple[str, str]:
    """The cell of the ordering study that models counted writes (device.h countedPut)
    on a wire of `transport`: the counted-writes row, the wire's column."""
    return "counted-writes", wire_column(transport)


def counted_writes_refusal(transport: semantics.Transport | None) -> str | None:
    """Why counted writes cannot run over GIN links of `transport` (None: no GIN link,
    or the ordering study finds them safe there)."""
    if transport is None:
        return None
    row, column = counted_writes_cell(transport)
    if study_safe(row, column):
        return None
    return (f"counted writes over GIN on the {transport.name} wire: the ordering study finds {row} on {column} "
            f"unsafe (commref study --protocol {row} --transport {column})")


def network_tag() -> int:
    """The tag of the next GIN communicator's proxies on network mpi. Every rank draws
    it while it sets the communicator up, in the same order (the Dup beside it is
    collective), so the ranks agree."""
    return NETWORK_TAG_BASE + next(_network_tags) % NETWORK_TAG_SPAN


ENGINE_ENV = "COMMREF_GIN_ENGINE"
ENGINES = ("auto", "native", "python")


def check_gin_engine(value: str) -> str:
    """`value` if it names an engine (auto: native where it applies; native: required;
    python: the Python proxy always); else ValueError with one line."""
    if value not in ENGINES:
        raise ValueError(f"{ENGINE_ENV} must be one of {', '.join(ENGINES)}, not {value!r}")
    return value


def gin_engine() -> str:
    """The GIN engine COMMREF_GIN_ENGINE asks for (unset or empty: auto), validated."""
    return check_gin_engine(os.environ.get(ENGINE_ENV, "").strip() or "auto")


def requirements(options: GinOptions, signals_counters: int = 0) -> Requirements:
    """What GIN connections with `options` need from a backend (`signals_counters`: how
    many signals and counters the window holds; 0 checks the rest alone, before any rank
    starts)."""
    return Requirements(strong_signals_required=options.protocol == GinProtocol.STRONG, wire=options.wire.value,
                        flush_orders_later_writes=options.protocol == GinProtocol.FLUSH_SIGNAL,
                        signals_counters=signals_counters)


def plan_gin(world, options: GinOptions, device: str, max_channels: int, nsteps: int,
             device_signals: int = 0) -> GinPlan:
    """Collective: the GIN plan of this rank of `world` (see the module docstring);
    `device_signals`: the signal words a device communicator adds to the connections'."""
    rank, nranks = world.rank, world.size
    if nranks > MAX_GIN_RANKS:
        raise CapabilityError(f"GIN connections address at most {MAX_GIN_RANKS} ranks in this version")
    node = set(lsa_team(world))  # collective: every rank asks once, whatever its path
    local = set(host_team(world))
    team = node if options.path != Path.GIN else set()
    others = [r for r in range(nranks) if r != rank]
    elsewhere = [r for r in others if r not in node]
    if options.path == Path.LSA and elsewhere:
        raise CapabilityError(f"rank {rank}: path 'lsa' needs every peer on this rank's node ({world.node}); "
                              f"ranks {elsewhere} are on other nodes: use path='auto' or 'gin'")
    gin_peers = [] if options.path == Path.LSA else [r for r in others if r not in team]
    if not gin_peers:
        return GinPlan(options)
    network = options.network
    if network == Network.AUTO:
        network = Network.SHM if all(r in local for r in gin_peers) else Network.MPI
    if device == "cuda" and options.wire != Wire.ORDERED:
        raise CapabilityError(f"rank {rank}: GIN on GPUs carries the ordered wire in this version (a copy-engine "
                              f"stream per peer keeps order); the {options.wire.value} wire runs on the CPU engine "
                              f"(device='cpu')")
    if options.fault.active and device == "cuda":
        raise CapabilityError(f"rank {rank}: a lossy wire (fault) runs in the Python GIN proxy of the CPU engine "
                              f"(device='cpu'), not on a GPU in this version")
    if options.wire_modeled and device == "cuda":
        raise CapabilityError(f"rank {rank}: the wire model (wire_rate, wire_latency) runs in the native GIN engine "
                              f"of the CPU engine (device='cpu'), not on a GPU in this version")
    if network == Network.SHM and not all(r in local for r in gin_peers):
        raise CapabilityError(f"rank {rank}: network 'shm' needs every GIN peer on this host")
    if network == Network.MPI and world.kind != "mpi":
        raise CapabilityError("network 'mpi' needs an MPI world (run under mpiexec)")
    req = requirements(options, abi.gin_signals(max_channels, nsteps)[1] + device_signals + options.counters)
    backend = select_backend(req, options.backend.value)
    transport = semantics.Transport(
        options.wire.value, ordered=options.wire == Wire.ORDERED,
        flush_orders_later_writes=backend.caps.local_completion_orders_later_writes)
    return GinPlan(options, sum(1 << r for r in gin_peers), backend, transport, network.value)
