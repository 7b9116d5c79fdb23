"""Communicator options: one typed record, checked once on construction.

`Communicator(world, device, **kwargs)` takes the keyword names below (nccl4py-style
flat keywords; the GIN ones map onto GinOptions' fields), or a ready `options=`
CommOptions. `commref check` and `commref bench` build the same record from their
flags before any rank starts, so a bad value gets the same one-line OptionError
everywhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field

from commref.device_kernels import abi
from commref.transports.errors import CapabilityError
from commref.transports.gin.options import GinOptions
from commref.transports.option_types import Choice, OptionError, bounded, choice, seconds

MAX_THREADS = 1024  # threads per block (CUDA's limit; the CPU engine's too)
MAX_RMA_CONTEXTS = 1 << 10  # host one-sided calls' contexts (above transports/gin/rma.HOST_CONTEXT_BASE)
MAX_RMA_SIGNALS = 1 << 16  # signal indices per context of host one-sided calls


class Device(Choice):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class Algorithm(Choice):
    """A collective's algorithm; auto lets the tuner pick (tuner.plan)."""

    AUTO = "auto"
    RING = "ring"
    TREE = "tree"
    DIRECT = "direct"
    NVLS = "nvls"
    HIERARCHICAL = "hierarchical"


class Protocol(Choice):
    """How the ring and tree kernels move a step's data (include/commref/proto.h):
    Simple (data, then a ready flag), LL (8 bytes with their flag per 16-byte line), LL128
    (120 bytes with a flag per 128-byte line); auto lets the tuner pick by size
    (tuner.plan). The direct kernels have none (they use no FIFO)."""

    AUTO = "auto"
    SIMPLE = "simple"
    LL = "ll"
    LL128 = "ll128"


PROTOCOL_ENV = "COMMREF_PROTO"  # the default of CommOptions.protocol, as NCCL_PROTO is NCCL's


def default_protocol() -> Protocol:
    """The protocol COMMREF_PROTO names (any case; unset or empty: auto), validated."""
    value = os.environ.get(PROTOCOL_ENV, "").strip().lower() or Protocol.AUTO.value
    return choice(Protocol, value, PROTOCOL_ENV)


class NvlsVariant(Choice):
    """Which NVLS AllReduce a call of algorithm "nvls" runs (kernels/nvls.cu): one-shot
    (every rank reduces the whole buffer), two-shot (each rank its part, stored to every
    rank); auto by size (nvls.variant)."""

    AUTO = "auto"
    ONE_SHOT = "one_shot"
    TWO_SHOT = "two_shot"


class StreamStores(Choice):
    """CPU: whether what another core reads next is stored past the cache (move.h);
    auto measures both per kind of call (tuner.StoreChooser)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass(frozen=True)
class CommOptions:
    """Everything a Communicator can be told. None: the device's default (tuner.defaults)
    or, for the timeout, the world's."""

    device: Device = Device.AUTO
    algorithm: Algorithm = Algorithm.AUTO
    max_channels: int | None = None  # blocks per launch; also sizes the window
    slot_bytes: int | None = None  # FIFO slot data bytes
    nsteps: int | None = None  # FIFO slots per connection
    threads: int | None = None  # per block
    timeout: float | None = None  # seconds, every wait
    device_id: int | None = None  # CUDA device (default: local_rank % GPUs, communicator.use_rank_gpu)
    stream_stores: StreamStores = StreamStores.AUTO
    protocol: Protocol | None = None  # None: COMMREF_PROTO, else auto
    nvls_variant: NvlsVariant = NvlsVariant.AUTO  # algorithm "nvls": one_shot, two_shot or by size
    # The device communicator's requirements (device_api.DeviceComm): bytes of each rank's
    # device window, signals beyond the connections' own (counters: gin_counters), and its
    # GIN contexts (each has barrier words of its own).
    device_window: int = 0
    device_signals: int = 0
    device_contexts: int = 1
    # Host one-sided calls (rma.py: put_signal, signal, wait_signal) over GIN: their
    # contexts, signal indices per context (each a word per source rank in the window),
    # and the bytes of the staging ring their puts' data is copied into.
    rma_contexts: int = 1
    rma_signals: int = 1
    rma_staging: int = 1 << 20
    gin: GinOptions = field(default_factory=GinOptions)

    def __post_init__(self) -> None:
        fix = object.__setattr__
        fix(self, "device", choice(Device, self.device, "device"))
        fix(self, "algorithm", choice(Algorithm, self.algorithm, "algorithm"))
        fix(self, "stream_stores", choice(StreamStores, self.stream_stores, "stream_stores"))
        fix(self, "nvls_variant", choice(NvlsVariant, self.nvls_variant, "nvls_variant"))
        fix(
            self,
            "protocol",
            default_protocol() if self.protocol is None else choice(Protocol, self.protocol, "protocol"),
        )
        if self.max_channels is not None:
            fix(self, "max_channels", bounded(self.max_channels, "max_channels", 1, abi.MAX_CHANNELS))
        if self.slot_bytes is not None:
            fix(self, "slot_bytes", bounded(self.slot_bytes, "slot_bytes", 64, multiple=64))
        if self.nsteps is not None:
            # A ring step holds its inbound slot while it waits for an outbound one.
            fix(self, "nsteps", bounded(self.nsteps, "nsteps", 2))
        if self.threads is not None:
            fix(self, "threads", bounded(self.threads, "threads", 1, MAX_THREADS))
        if self.timeout is not None:
            fix(self, "timeout", seconds(self.timeout))
        if self.device_id is not None:
            fix(self, "device_id", bounded(self.device_id, "device_id", 0))
        fix(self, "device_window", bounded(self.device_window, "device_window", 0, multiple=8))
        fix(self, "device_signals", bounded(self.device_signals, "device_signals", 0))
        fix(self, "rma_contexts", bounded(self.rma_contexts, "rma_contexts", 1, MAX_RMA_CONTEXTS))
        fix(self, "rma_signals", bounded(self.rma_signals, "rma_signals", 0, MAX_RMA_SIGNALS))
        fix(self, "rma_staging", bounded(self.rma_staging, "rma_staging", 64, 1 << 40, multiple=64))
        fix(self, "device_contexts", bounded(self.device_contexts, "device_contexts", 1, abi.DEVCOMM_MAX_CONTEXTS))
        if not isinstance(self.gin, GinOptions):
            raise OptionError(f"gin must be a GinOptions, not {type(self.gin).__name__}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> CommOptions:
        """The record for Communicator's flat keywords (see KEYWORDS); None leaves a
        field at its default. An unknown keyword raises TypeError."""
        unknown = sorted(set(kwargs) - set(KEYWORDS))
        if unknown:
            raise TypeError(f"unknown Communicator option {unknown[0]!r}; options: {', '.join(KEYWORDS)}")
        mine, gin = {}, {}
        for key, value in kwargs.items():
            if value is None:
                continue
            where, name = KEYWORDS[key]
            (gin if where == "gin" else mine)[name] = value
        return cls(**mine, gin=GinOptions(**gin))

    def replace(self, **kwargs) -> CommOptions:
        """A copy with these flat keywords changed."""
        flat = {k: getattr(self.gin if w == "gin" else self, n) for k, (w, n) in KEYWORDS.items()}
        return CommOptions.from_kwargs(**(flat | kwargs))


# Communicator keyword -> (record, field).
KEYWORDS: dict[str, tuple[str, str]] = {
    **{f.name: ("comm", f.name) for f in dataclasses.fields(CommOptions) if f.name != "gin"},
    "path": ("gin", "path"),
    "backend": ("gin", "backend"),
    "wire": ("gin", "wire"),
    "network": ("gin", "network"),
    "seed": ("gin", "seed"),
    "gin_protocol": ("gin", "protocol"),
    "puts_per_slot": ("gin", "puts_per_slot"),
    "gin_queue": ("gin", "queue"),
    "gin_counters": ("gin", "counters"),
    "segment_bytes": ("gin", "segment_bytes"),
    "wire_rate": ("gin", "wire_rate"),
    "wire_latency": ("gin", "wire_latency"),
    "wire_paths": ("gin", "wire_paths"),
    "fault": ("gin", "fault"),
    "independent_contexts": ("gin", "independent_contexts"),
    "gin_va_signals": ("gin", "va_signals"),
}


def cuda_available() -> bool:
    """Whether CuPy is installed and sees a CUDA device. False without a driver too
    (CuPy 13.0's is_available() raises there instead of answering)."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:  # noqa: BLE001 - cudaErrorInsufficientDriver and kin: no usable device
        return False


def resolve_device(device) -> str:
    """ "cpu" or "cuda" for a Device choice: auto is cuda where CuPy sees a GPU. Raises
    CapabilityError when cuda is asked for and cannot be had."""
    device = choice(Device, device, "device")
    if device == Device.AUTO:
        return "cuda" if cuda_available() else "cpu"
    if device == Device.CUDA:
        if importlib.util.find_spec("cupy") is None:
            raise CapabilityError("device='cuda' needs CuPy (pip install 'commref[cuda12]' or '[cuda13]')")
        if not cuda_available():
            raise CapabilityError("device='cuda' but no CUDA device is available")
    return device.value
