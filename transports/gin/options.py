"""GIN options: which peers go over GIN, the backend, the wire model, the network
under it, and how a connection publishes a slot. Validated once, here."""

from __future__ import annotations

import os
from dataclasses import dataclass

from commref.transports.gin.faults import FaultSpec
from commref.transports.nodes import NODES_ENV
from commref.transports.option_types import (
    RATE_UNITS,
    TIME_UNITS,
    Choice,
    OptionError,
    bounded,
    choice,
    flag,
    quantity,
)


class Path(Choice):
    """How peers are reached: by load/store (lsa, every rank on one host), through the
    GIN proxy (gin, even on one host), or LSA where mapped and GIN otherwise (auto)."""

    LSA = "lsa"
    GIN = "gin"
    AUTO = "auto"


def default_path(nodes=None) -> Path:
    """The path a command line takes when --path is left out: auto (LSA inside a node,
    GIN between nodes) on a job of several nodes, else lsa. `nodes`: the --nodes value;
    None: COMMREF_NODES, else one node. A value that is no count is one node here and
    refused, with its own message, where the node count is checked."""
    if nodes is None:
        nodes = os.environ.get(NODES_ENV)
    try:
        several = int(str(nodes).strip()) > 1
    except ValueError:
        several = False
    return Path.AUTO if several else Path.LSA


class Backend(Choice):
    """A GIN backend (backends.py), or the first that meets the requirements."""

    AUTO = "auto"
    PROXY = "proxy"
    RC = "rc"
    GDA = "gda"


class Wire(Choice):
    """The wire's ordering model (semantics.py): per-(context, peer) FIFO, or SRD-like."""

    ORDERED = "ordered"
    UNORDERED = "unordered"


class Network(Choice):
    """What carries GIN traffic: shared memory on one host, MPI messages, or shm when
    every GIN peer shares this host and MPI otherwise (auto)."""

    AUTO = "auto"
    SHM = "shm"
    MPI = "mpi"


class GinProtocol(Choice):
    """How a GIN connection publishes a FIFO slot (GinProtocol in args.h). Only strong
    is safe on every wire; the others exist to be studied (docs/ordering.md)."""

    STRONG = "strong"
    WEAK_LAST = "weak-last"
    SIGNAL_PER_PUT = "signal-per-put"
    FLUSH_SIGNAL = "flush-signal"


MAX_WIRE_PATHS = 64  # GinOptions.wire_paths' bound


@dataclass(frozen=True)
class GinOptions:
    """GIN options of a communicator. Strings are accepted for the choices and turned
    into their Enum members; every field is checked on construction (OptionError)."""

    path: Path = Path.LSA
    backend: Backend = Backend.AUTO
    wire: Wire = Wire.ORDERED
    network: Network = Network.AUTO
    protocol: GinProtocol = GinProtocol.STRONG
    seed: int = 0  # of the unordered wire's landing orders
    puts_per_slot: int = 4  # puts per FIFO slot: the weak protocols', and the most a large strong slot is split into
    queue: int = 256  # descriptors in a rank's GIN queue
    counters: int = 0  # GIN counters beyond the connections' own
    segment_bytes: int = 4096  # the unordered wire's unit of placement
    # The wire model (native engine): each rank's wire sends at this many bytes/s (0:
    # as fast as the network under it) and an operation takes effect this many seconds
    # after it is sent. Numbers, or words such as "12.5G" (bytes/s) and "5us".
    wire_rate: float = 0.0
    wire_latency: float = 0.0
    # The unordered wire's packets sprayed over this many paths, as SRD's (native engine,
    # unordered.h "Multi-path spraying": each path its latency and share of the rate, from
    # the wire model where it is set); 1: no spraying.
    wire_paths: int = 1
    # A lossy link under the wire, with SRD's reliability layer above it (faults.py): drop,
    # duplicate and delay probabilities, seeded by `seed`; "drop=0.05,dup=0.05,delay=0.05".
    fault: FaultSpec = FaultSpec()
    # The ordered wire's contexts as independent ordering domains (separate queue pairs):
    # each (peer, context) stays FIFO, but the proxy holds a context's traffic back,
    # seeded by `seed`, while later operations of other contexts to that peer overtake it
    # (scheduler.py, "Independent contexts"). Off: every context of a peer lands in the
    # order the proxy takes it (a legal refinement, and the fast path: the native engine).
    independent_contexts: bool = False
    # The backend must offer VA signals (a device communicator created with strict
    # ordering, whose kernels signal 64-bit words at window offsets).
    va_signals: bool = False

    def __post_init__(self) -> None:
        fix = object.__setattr__
        fix(self, "path", choice(Path, self.path, "path"))
        fix(self, "backend", choice(Backend, self.backend, "backend"))
        fix(self, "wire", choice(Wire, self.wire, "wire"))
        fix(self, "network", choice(Network, self.network, "network"))
        fix(self, "protocol", choice(GinProtocol, self.protocol, "gin_protocol"))
        fix(self, "seed", bounded(self.seed, "seed"))
        fix(self, "puts_per_slot", bounded(self.puts_per_slot, "puts_per_slot", 1))
        fix(self, "queue", bounded(self.queue, "gin_queue", 1))
        fix(self, "counters", bounded(self.counters, "gin_counters", 0))
        fix(self, "segment_bytes", bounded(self.segment_bytes, "segment_bytes", 1))
        fix(self, "wire_rate", quantity(self.wire_rate, "wire_rate", RATE_UNITS, "bytes/s, e.g. 12.5G"))
        fix(self, "wire_latency", quantity(self.wire_latency, "wire_latency", TIME_UNITS, "seconds, e.g. 5us"))
        fix(self, "wire_paths", bounded(self.wire_paths, "wire_paths", 1, MAX_WIRE_PATHS))
        fix(self, "fault", FaultSpec.parse(self.fault))
        fix(self, "independent_contexts", flag(self.independent_contexts, "independent_contexts"))
        fix(self, "va_signals", flag(self.va_signals, "gin_va_signals"))
        if self.independent_contexts and self.wire != Wire.ORDERED:
            raise OptionError(
                f"independent_contexts is an option of the ordered wire; on the {self.wire.value} wire "
                f"contexts are independent already"
            )
        if self.wire_paths > 1 and self.wire != Wire.UNORDERED:
            raise OptionError(
                f"wire_paths is an option of the unordered wire (SRD sprays packets over paths); the "
                f"{self.wire.value} wire is one path per queue pair, as InfiniBand RC's"
            )
        if self.wire_modeled and self.fault.active and self.wire != Wire.UNORDERED:
            raise OptionError(
                "the wire model (wire_rate, wire_latency) runs in the native GIN engine and faults on the "
                "ordered wire in the Python proxy: choose one (or the unordered wire, where the native "
                "engine carries both)"
            )

    @property
    def wire_modeled(self) -> bool:
        """Whether the wire model slows the wire down (wire_rate or wire_latency set)."""
        return self.wire_rate > 0 or self.wire_latency > 0
