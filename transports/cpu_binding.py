"""Where an MPI rank runs on its host's CPUs: the CPUs it may use (allowed_cpus), its
share of them when the launcher bound none (cpu_share, whole cores from sysfs first),
and the setting that decides whether it takes that share (CpuBinding,
``$COMMREF_CPU_BIND``). MPIWorld applies it at construction."""

from __future__ import annotations

import os

from .option_types import Choice, choice

__all__ = ["CPU_BIND_ENV", "CpuBinding", "allowed_cpus", "bind_process", "core_of", "cpu_share", "default_cpu_binding"]

CPU_BIND_ENV = "COMMREF_CPU_BIND"
"""Environment variable holding how an MPI rank is placed on its host's CPUs (CpuBinding)."""


class CpuBinding(Choice):
    """How an MPIWorld places its process on the host's CPUs (``$COMMREF_CPU_BIND``).

    auto: when every rank of the host may run on the same CPUs (the launcher bound
    nothing, as MPICH's mpiexec by default), each rank takes its share of them
    (cpu_share) for every thread of its process and the threads it starts later (the
    CPU engine's kernel workers, the GIN engine). A rank's kernel and its proxy then
    hand their CPUs to each other instead of the scheduler moving every busy thread of
    the host over every core: at 2 ranks on 2 cores GIN runs were 2-5x slower in one
    of four unbound, and at 4 ranks on 2 cores the multi-node bench (MPI's Allreduce
    too) took 2.5-4x longer (docs/performance.md, "Binding ranks to CPUs"). Launcher
    binding (``mpiexec -bind-to core``, Open MPI's default) is kept as it is.
    none: placement is left to the launcher and the OS.
    """

    AUTO = "auto"
    NONE = "none"


def default_cpu_binding() -> CpuBinding:
    return choice(CpuBinding, os.environ.get(CPU_BIND_ENV, CpuBinding.AUTO.value), CPU_BIND_ENV)


def core_of(cpu: int) -> tuple[int, int]:
    """(package, core) of a CPU from sysfs; (0, cpu) where Linux does not say."""
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
            return int(package.read()), int(core.read())
    except (OSError, ValueError):
        return 0, cpu


def _equal_parts(items: list, local_rank: int, local_size: int) -> list:
    """Local rank `local_rank`'s part of `items`: consecutive equal parts, the remainder
    to the first ranks."""
    base, extra = divmod(len(items), local_size)
    start = local_rank * base + min(local_rank, extra)
    return items[start : start + base + (local_rank < extra)]


def cpu_share(local_rank: int, local_size: int, cpus, core=core_of) -> frozenset[int]:
    """Local rank `local_rank`'s share of `cpus` (shared by `local_size` ranks), as
    ``mpiexec -bind-to core`` places them: whole cores (the hyperthreads of one core,
    `core` gives a CPU's (package, core)) in equal consecutive parts while there are at
    least as many cores as ranks; else the CPUs in equal parts, a core's hyperthreads
    side by side; with fewer CPUs than ranks, one CPU each, round robin."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(cpus):
        cores.setdefault(core(cpu), []).append(cpu)
    groups = [cores[k] for k in sorted(cores)]
    if len(groups) >= local_size:
        return frozenset(cpu for group in _equal_parts(groups, local_rank, local_size) for cpu in group)
    ordered = [cpu for group in groups for cpu in group]
    if len(ordered) >= local_size:
        return frozenset(_equal_parts(ordered, local_rank, local_size))
    return frozenset([ordered[local_rank % len(ordered)]])


def allowed_cpus() -> frozenset[int]:
    """The CPUs the calling thread may run on (every CPU where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def bind_process(cpus: frozenset[int]) -> None:
    """Every thread of this process onto `cpus` (threads started later inherit it);
    nothing where the OS has no per-thread affinity (Linux has)."""
    if not (hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
