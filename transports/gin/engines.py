"""The GIN engines: which one carries a communicator's GIN plan, and starting it: the
native engine (native.py), the Python proxy (proxy.py) or, on a GPU, the copy-engine
proxy (gpu_proxy.py); COMMREF_GIN_ENGINE chooses among them. On network mpi each GIN
communicator's engines talk on a communicator and an MPI tag of their own."""

from __future__ import annotations

import itertools
import os

from commref.transports.errors import CapabilityError
from commref.transports.gin.engine import EngineSite

__all__ = [
    "ENGINES",
    "ENGINE_ENV",
    "NETWORK_TAG_BASE",
    "NETWORK_TAG_SPAN",
    "check_gin_engine",
    "gin_engine",
    "network_tag",
    "start_engine",
]

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


# MPI tags of the proxies' messages on network mpi, one per GIN communicator: a
# communicator freed at stop may have its context id reused by a later one, and the old
# one's messages still in flight (a trailing credit) must not match the new proxies.
NETWORK_TAG_BASE, NETWORK_TAG_SPAN = 1024, 30000  # inside the 32767 every MPI allows
_network_tags = itertools.count()


def network_tag() -> int:
    """The tag of the next GIN communicator's proxies on network mpi. Every rank draws
    it while it sets the communicator up, in the same order (the Dup beside it is
    collective), so the ranks agree."""
    return NETWORK_TAG_BASE + next(_network_tags) % NETWORK_TAG_SPAN


def start_engine(
    plan,
    world,
    window,
    layout,
    observer=None,
    engine: str | None = None,
    region=None,
    device: str = "cpu",
    device_id: int = 0,
):
    """Starts this rank's GIN engine for `plan` (a plan.GinPlan) over `window` (None when
    the plan puts no peer over GIN): the native engine (native.NativeProxy) for both
    wires without an observer, a lossy link (fault) under the unordered wire included (on
    network mpi where native.mpi_library() builds on every rank), the Python proxy
    (proxy.GinProxy) otherwise (a lossy ordered wire among them). `engine` (default: the
    COMMREF_GIN_ENGINE environment variable, see gin_engine()) forces one. On a GPU
    (`device` "cuda") the copy-engine proxy (gpu_proxy.GpuProxy) over `region`, the
    rank's queue.QueueRegion. On network mpi the engines get a communicator of their own
    (collective, as Dup is) and network_tag()'s tag."""
    if not plan.used:
        return None
    o = plan.options
    mpi_comm, mpi_tag = None, 0
    if plan.network == "mpi":  # the proxies' own communicator and tag: collective, as Dup is
        mpi_comm, mpi_tag = world.comm.Dup(), network_tag()
    if device == "cuda":
        from commref.transports.gin.gpu_proxy import GpuProxy

        proxy = GpuProxy(
            world,
            window,
            layout,
            region,
            o.queue,
            plan.backend,
            plan.transport,
            device_id,
            network=plan.network,
            mpi_comm=mpi_comm,
            mpi_tag=mpi_tag,
        )
        proxy.start()
        return proxy
    from commref.transports.gin import native

    engine = gin_engine() if engine is None else check_gin_engine(engine)
    why_not = native.supports(plan.transport, plan.network, observer, o.segment_bytes, o.independent_contexts, o.fault)
    if mpi_comm is not None:  # every rank's engine must speak one protocol
        refusals = [w for w in mpi_comm.allgather(why_not if engine != "python" else "python") if w is not None]
        if refusals and why_not is None:
            why_not = f"what another rank's engine speaks ({refusals[0]})"
    if engine == "native" and why_not is not None:
        raise CapabilityError(f"{ENGINE_ENV}=native: the native GIN engine cannot carry {why_not}")
    if o.wire_paths > 1 and (engine == "python" or why_not is not None):
        raise CapabilityError(
            f"multi-path spraying (wire_paths) runs in the native GIN engine, which "
            f"cannot carry {why_not or f'this run ({ENGINE_ENV}=python)'}"
        )
    if o.wire_modeled and (engine == "python" or why_not is not None):
        raise CapabilityError(
            f"the wire model (wire_rate, wire_latency) runs in the native GIN engine, which "
            f"cannot carry {why_not or f'this run ({ENGINE_ENV}=python)'}"
        )
    site = EngineSite(world, window, layout, o.queue, plan.backend, plan.transport, plan.network)
    if engine != "python" and why_not is None:
        proxy = native.NativeProxy(
            site,
            o.seed,
            o.segment_bytes,
            mpi_comm=mpi_comm,
            mpi_tag=mpi_tag,
            wire_rate=o.wire_rate,
            wire_latency=o.wire_latency,
            independent_contexts=o.independent_contexts,
            batched=plan.rings_doorbells,
            fault=o.fault,
            paths=o.wire_paths,
        )
    else:
        from commref.transports.gin.proxy import GinProxy

        proxy = GinProxy(
            site,
            o.seed,
            o.segment_bytes,
            mpi_comm,
            observer,
            mpi_tag=mpi_tag,
            faults=o.fault,
            batched=plan.rings_doorbells,
            independent_contexts=o.independent_contexts,
        )
    proxy.start()
    return proxy
