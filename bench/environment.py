"""The environment a benchmark ran in: versions, hosts, devices, and what carries the
bytes between ranks (the path column's link). Recorded in the JSON document and
summarized in the table's header."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import sys

import numpy as np

from commref.transports.cpu_binding import allowed_cpus


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_list(cpus) -> str:
    """CPU ids as the kernel's list format: "0-3,8"."""
    ordered, runs = sorted(cpus), []
    for c in ordered:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def device_name(device: str, device_id: int | None) -> str:
    if device == "cuda":
        try:
            import cupy

            props = cupy.cuda.runtime.getDeviceProperties(device_id or 0)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            bus = cupy.cuda.runtime.deviceGetPCIBusId(device_id or 0)
            return f"cuda:{device_id or 0} [{bus}] {name}"
        except Exception as e:  # informational only
            return f"cuda:{device_id or 0} ({e})"
    return f"cpu [CPU engine] {cpu_model()}"


LINKS = {
    "shm": "POSIX shared memory between processes",
    "threads": "one process's memory, ranks as threads",
    "same-GPU": "ranks share one GPU",
    "NVLink": "GPU peer memory over NVLink",
    "PCIe": "GPU peer memory over PCIe",
    "network": "ranks on several hosts",
    "peer": "GPU peer memory",
}


def describe_link(world, device: str, device_id: int | None, ranks: list[dict]) -> str:
    """What carries the bytes between ranks (a key of LINKS): on the CPU 'shm'
    (processes) or 'threads'; on GPUs 'same-GPU', 'NVLink' (NVML reports an active
    link), 'PCIe' or 'network' (ranks on several hosts)."""
    hosts = {r["host"] for r in ranks}
    if len(hosts) > 1:
        return "network"
    if device != "cuda":
        return "shm" if world.kind == "mpi" else "threads"
    buses = {r.get("pci_bus") for r in ranks}
    if len(buses) == 1:
        return "same-GPU"
    try:  # NVML: any active NVLink on this GPU
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByPciBusId(ranks[world.rank]["pci_bus"])
        for link in range(18):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link):
                    return "NVLink"
            except pynvml.NVMLError:
                break
        return "PCIe"
    except Exception:
        return "peer"


MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"


def mps_control_pipe() -> str | None:
    """The MPS control daemon's pipe when one seems to run for this user's clients
    ($CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps, holding a `control` pipe), else None."""
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT
    control = os.path.join(pipe_dir, "control")
    return control if os.path.exists(control) else None


def gpu_sharing(ranks: list[dict]) -> list[str]:
    """What was measured where several ranks use one GPU, one line per such GPU: ranks
    as threads of one process run their kernels concurrently (every rank's blocks must
    be resident at once, which the Communicator checks); ranks in separate processes
    are time-sliced by the driver unless MPS runs, so their timings measure the
    scheduler as much as the collective."""
    groups: dict = {}
    for r in ranks:
        if r.get("pci_bus"):
            groups.setdefault((r["host"], r["pci_bus"]), []).append(r)
    lines = []
    for (host, bus), rs in groups.items():
        if len(rs) < 2:
            continue
        ids = ",".join(str(r["rank"]) for r in rs)
        pids = {r["pid"] for r in rs}
        if len(pids) == 1:
            lines.append(
                f"{len(rs)} ranks ({ids}) share GPU {bus} on {host} as threads of one process: "
                f"concurrent kernels, each rank's blocks on part of the SMs"
            )
        elif all(r.get("mps") for r in rs):
            lines.append(
                f"{len(rs)} ranks ({ids}) share GPU {bus} on {host} as {len(pids)} processes under MPS "
                f"(control pipe {rs[0]['mps']}): concurrent kernels, each rank's blocks on part of the SMs"
            )
        else:
            lines.append(
                f"{len(rs)} ranks ({ids}) share GPU {bus} on {host} as {len(pids)} processes: "
                f"time-sliced without MPS, so the times measure the GPU's scheduler as much as the collective"
            )
    return lines


def environment(world, device: str, device_id: int | None, baseline, baseline_error: str | None) -> dict:
    """Versions, hosts and devices of the run (one allgather over the ranks of `world`)."""
    w = world
    mine = {
        "rank": w.rank,
        "host": socket.gethostname(),
        "node": w.node,
        "pid": os.getpid(),
        "cpus": cpu_list(allowed_cpus()),
        "device": device_name(device, device_id),
        "device_id": device_id,  # None on the CPU
    }
    if device == "cuda":
        try:
            import cupy

            mine["pci_bus"] = cupy.cuda.runtime.deviceGetPCIBusId(device_id or 0)
        except Exception:
            mine["pci_bus"] = None
        mine["mps"] = mps_control_pipe()
    ranks = w.allgather(mine, what="bench: environment")
    mpi_lib = None
    try:
        if "mpi4py.MPI" in sys.modules or w.kind == "mpi" or baseline is not None:
            from mpi4py import MPI

            mpi_lib = MPI.Get_library_version().strip().splitlines()[0]
    except Exception:
        pass
    env = {
        "commref": _version("commref"),
        "numpy": np.__version__,
        "mpi4py": _version("mpi4py"),
        "mpi_library": mpi_lib,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "hosts": sorted({r["host"] for r in ranks}),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": device,
        "device_name": mine["device"],
        "nranks": w.size,
        "world": "MPI processes" if w.kind == "mpi" else "rank threads",
        "ranks": ranks,
        "baseline": baseline.library if baseline is not None else None,
        "baseline_unavailable": baseline_error,
    }
    if device == "cuda":
        env["cupy"] = _version("cupy-cuda12x") or _version("cupy-cuda13x") or _version("cupy")
        env["nccl4py"] = _version("nccl4py")
    env["link"] = describe_link(w, device, device_id, ranks)
    env["gpu_sharing"] = gpu_sharing(ranks) if device == "cuda" else []
    return env
