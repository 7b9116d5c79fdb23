"""Which FIFO protocols (include/commref/proto.h) a communicator can run, and why not.

Simple runs everywhere. LL and LL128 rely on guarantees of the machine (proto.h says
which); each rank finds what it cannot run (refusals), and the communicator gathers the
ranks' answers, so that all of them agree: a protocol asked for explicitly that some rank
cannot run is refused on every rank with that rank's reason, and "auto" never picks it.
"""

from __future__ import annotations

import platform

from commref.device_kernels import abi

PROTOCOLS = ("simple", "ll", "ll128")


def cpu_refusals(support: int, machine: str | None = None) -> dict[str, str]:
    """What the CPU engine cannot run on a CPU with `support` (abi.CPU_ATOMIC_16 |
    abi.CPU_STORE_ORDER, from cpuid at run time: cpu_loader.CpuKernels.protocol_support). LL
    writes and reads a line with one 16-byte access each and needs it single-copy atomic;
    LL128 orders its flags after its data with release and acquire, which holds on every
    CPU (proto.h)."""
    if support & abi.CPU_ATOMIC_16:
        return {}
    machine = machine or platform.machine()
    why = (
        "this x86-64 CPU does not enumerate AVX"
        if machine in ("x86_64", "AMD64")
        else f"commref relies on that on x86-64 only, and this CPU is {machine}"
    )
    return {
        "ll": f"LL needs aligned 16-byte loads and stores that are single-copy atomic (x86-64 CPUs with AVX "
        f"guarantee it: Intel SDM vol. 3A, AMD APM vol. 2); {why}"
    }


def _bus(bus_id) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function) of a PCI bus id such as "0000:3b:00.0" or NVML's
    "00000000:3B:00.0" (bytes too); None if it is not one."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    try:
        domain, bus, rest = text.strip().split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except ValueError:
        return None


def nvlink_reach(bus_id: str, nvml=None) -> tuple[set, bool] | str:
    """(PCI buses of the GPUs this GPU has an active NVLink to, whether one of its active
    links goes to an NVSwitch) from NVML, or why NVML cannot tell. `nvml`: the pynvml
    module (default: imported here)."""
    try:
        if nvml is None:
            import pynvml as nvml
    except ImportError:
        return "NVML (pip install nvidia-ml-py) is not available to confirm NVLink between the ranks' GPUs"
    try:
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        gpus, switch = set(), False
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if not nvml.nvmlDeviceGetNvLinkState(handle, link):
                    continue
                remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo_v2(handle, link).busId
                kind = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            except nvml.NVMLError:
                continue
            if kind == getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 1):
                switch = True
            elif _bus(remote) is not None:
                gpus.add(_bus(remote))
        return gpus, switch
    except Exception as e:  # noqa: BLE001 - any NVML failure: NVLink not confirmed
        return f"NVML could not tell this GPU's NVLinks ({e})"


def gpu_refusals(rank: int, places: list[tuple[str, int, str]], reach: list) -> dict[str, str]:
    """What rank `rank` cannot run on GPUs. `places`: every rank's (host, pid, PCI bus
    id); `reach`: every rank's nvlink_reach() answer. LL128 needs a warp's 128-byte store
    seen whole by the peer that polls it, which commref takes as established where NVLink
    carries it: every peer on another GPU of this host, joined to this rank's by an
    active NVLink, or both with NVLinks to an NVSwitch (proto.h)."""
    mine = reach[rank]
    host, _, bus = places[rank]
    for peer, (peer_host, _, peer_bus) in enumerate(places):
        if peer == rank:
            continue
        if peer_host != host:
            why = f"rank {peer} is on another host ({peer_host})"
        elif _bus(peer_bus) == _bus(bus):
            why = f"rank {peer} shares this GPU ({bus}), so no NVLink carries the lines"
        elif isinstance(mine, str):
            why = mine
        elif isinstance(reach[peer], str):
            why = f"rank {peer}: {reach[peer]}"
        elif _bus(peer_bus) in mine[0] or (mine[1] and reach[peer][1]):
            continue
        else:
            why = f"NVML reports no NVLink between this GPU ({bus}) and rank {peer}'s ({peer_bus})"
        return {"ll128": f"LL128 on GPUs relies on NVLink carrying a warp's 128-byte store whole; {why}"}
    return {}


def merge(rank_refusals: list[dict[str, str]]) -> dict[str, str]:
    """Every rank's refusals as one: protocol -> the first refusing rank's reason."""
    out: dict[str, str] = {}
    for r, refusals in enumerate(rank_refusals):
        for protocol, why in refusals.items():
            out.setdefault(protocol, f"rank {r}: {why}")
    return out
