"""What a device communicator is asked for and what it has: `DeviceRequirements`
(ncclDevCommRequirements' role, given to DeviceComm(requirements=...)) and
`DeviceProperties` (what DeviceComm.properties() reports: ncclCommQueryProperties' and
ncclDevComm's fields that apply).

A requirement the communicator cannot meet is refused when it is made: a count of
barriers beyond what the device API offers, multimem, VA signals on a backend without
them or in a version whose device.h has none for users' kernels, a queue depth above
the gin_queue that was asked for (ValueError / CapabilityError, with the number and
the limit); strong signals, signals + counters, contexts and counted writes are
refused by DeviceComm as its keywords are (backend selection skips the backends that
lack them, and fails naming what each lacks).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from commref.device_kernels import abi
from commref.transports.errors import CapabilityError

# What device.h offers users' kernels in this version: one world barrier (barrier(fence,
# ctx): LSA peers by stores and GIN peers by signals), one LSA barrier (lsaBarrier()),
# one rail barrier (railBarrier(fence, ctx): the rail team over GIN) and one hybrid
# barrier (hybridBarrier(fence, ctx): LSA x rail), each taken part in by one block (or
# scope) of every rank; the rail and hybrid ones only where the teams are strided;
# indexed signals, VA signals with strict ordering; a multimem handle over the LSA team
# (multimem.h: LSA loads and stores in rank order, no NVLink multicast object bound in
# this version).
WORLD_BARRIERS, LSA_BARRIERS, RAIL_BARRIERS, HYBRID_BARRIERS = 1, 1, 1, 1
USER_VA_SIGNALS = True
MULTIMEM = True


def _count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, not {value!r}")
    return value


@dataclass(frozen=True)
class DeviceRequirements:
    """What a kernel needs of its device communicator (NCCL's ncclDevCommRequirements):

    - barriers, lsa_barriers, rail_barriers, hybrid_barriers: barrier sessions used at
      once, per kind (world: barrier(); LSA team: lsaBarrier(); rail: railBarrier(), the
      ranks of one local index; hybrid: hybridBarrier(), LSA x rail);
    - signals, counters: signal and counter ids 0 .. n-1;
    - contexts: GIN contexts 0 .. n-1 (1 to abi.DEVCOMM_MAX_CONTEXTS);
    - strong_signals, va_signals, counted_writes: required GIN abilities;
    - multimem: a multimem (NVLS) handle over the LSA team;
    - queue_depth: GIN descriptors the kernel may have in flight (0: the default queue)."""

    barriers: int = 0
    lsa_barriers: int = 0
    rail_barriers: int = 0
    hybrid_barriers: int = 0
    signals: int = 0
    counters: int = 0
    contexts: int = 1
    strong_signals: bool = True
    va_signals: bool = False
    counted_writes: bool = False
    multimem: bool = False
    queue_depth: int = 0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be True or False, not {value!r}")
            else:
                _count(value, f.name)
        if not 1 <= self.contexts <= abi.DEVCOMM_MAX_CONTEXTS:
            raise ValueError(f"contexts must be an integer from 1 to {abi.DEVCOMM_MAX_CONTEXTS}, not {self.contexts!r}")

    def refusal_before(self, options: dict) -> str | None:
        """Why no communicator with Communicator `options` can meet these
        requirements, from the requirements alone (every rank alike, before any starts)."""
        for what, asked, offered in (
            ("world barriers (barrier())", self.barriers, WORLD_BARRIERS),
            ("LSA barriers (lsaBarrier())", self.lsa_barriers, LSA_BARRIERS),
            ("rail barriers (railBarrier())", self.rail_barriers, RAIL_BARRIERS),
            ("hybrid barriers (hybridBarrier())", self.hybrid_barriers, HYBRID_BARRIERS),
        ):
            if asked > offered:
                return (
                    f"{asked} {what} required; the device API offers {offered} in this version "
                    f"(one block of each rank takes part in a barrier)"
                )
        if self.multimem and not MULTIMEM:
            return "multimem (NVLS) required; the device communicator offers none in this version (CPU engine or GPU)"
        if self.va_signals and not USER_VA_SIGNALS:
            return "VA signals required; device.h gives users' kernels indexed signals only in this version"
        queue = options.get("gin_queue")
        if queue is not None and self.queue_depth > queue:
            return f"queue depth {self.queue_depth} required, but gin_queue={queue} was asked for"
        return None

    def refusal_teams(self, strided: bool) -> str | None:
        """Why a communicator whose teams are (not) `strided` cannot meet them: the rail
        and hybrid barriers need every node to hold lsaSize consecutive ranks."""
        for kind, asked in (("rail", self.rail_barriers), ("hybrid", self.hybrid_barriers)):
            if asked and not strided:
                return (
                    f"{asked} {kind} barriers required; the nodes do not each hold lsaSize consecutive "
                    f"ranks, so the communicator has no rail team"
                )
        return None

    def refusal_after(self, backend) -> str | None:
        """Why the communicator made, with GIN backend `backend` (None: every peer over
        LSA), cannot meet them."""
        if backend is not None and self.va_signals and not backend.caps.va_signals:
            return f"VA signals required; the {backend.name} backend has none"
        return None


@dataclass(frozen=True)
class DeviceProperties:
    """What a device communicator has (DeviceComm.properties()).

    gin_backend: the GIN backend's name (None: every peer over LSA); gin_engine: the
    progress engine carrying it ("native" or "python"; None without GIN); wire: the GIN
    wire model (None without GIN); strong_signals, va_signals, counters_supported,
    get_supported: the backend's abilities (over LSA alone every signal is strong);
    local_completion_orders_later_writes: the backend declares it (gda);
    multimem: a multimem handle is offered; lsa_rank, lsa_size: this rank's LSA team;
    lsa_teams: how many LSA teams the world has; contexts, signals, counters: what the
    communicator was made with; barriers, lsa_barriers, rail_barriers, hybrid_barriers:
    what the device API offers this communicator (rail and hybrid: 0 where its teams are
    not strided); queue_depth: descriptors in this rank's GIN queue (0 without GIN)."""

    rank: int
    nranks: int
    device: str
    gin_backend: str | None
    gin_engine: str | None
    wire: str | None
    strong_signals: bool
    va_signals: bool
    counters_supported: bool
    get_supported: bool
    local_completion_orders_later_writes: bool
    counted_writes: bool
    multimem: bool
    lsa_rank: int
    lsa_size: int
    lsa_teams: int
    contexts: int
    signals: int
    counters: int
    barriers: int
    lsa_barriers: int
    rail_barriers: int
    hybrid_barriers: int
    queue_depth: int


def refuse(rank: int, why: str | None, error=CapabilityError) -> None:
    if why:
        raise error(f"rank {rank}: {why}")


__all__ = ["DeviceProperties", "DeviceRequirements"]
