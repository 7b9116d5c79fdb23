"""GIN options: which peers go over GIN, the backend, the wire model, the network
under it, and how a connection publishes a slot. Validated once, here."""

from __future__ import annotations

from dataclasses import dataclass

from commref.transports.options import Choice, bounded, choice


class Path(Choice):
    """How peers are reached: by load/store (lsa, every rank on one host), through the
    GIN proxy (gin, even on one host), or LSA where mapped and GIN otherwise (auto)."""

    LSA = "lsa"
    GIN = "gin"
    AUTO = "auto"


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
