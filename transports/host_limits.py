"""What this host can hold: `--np N` is checked against it before any rank starts.

A job of N ranks on one host costs, per rank, its private memory, its share of
/dev/shm (its windows and FIFOs, and MPICH's shared segment) and its tasks (threads:
RLIMIT_NPROC counts every thread of the user). The caller estimates that per-rank
`Footprint` from the options (commref/cli.py, bench/harness.py); `check_ranks` compares
N times it with the host (`HostCapacity`: allowed CPUs, RLIMIT_NPROC and the tasks the
user already runs, MemAvailable, /dev/shm free space) and raises `HostLimitError` with
one line naming the figure and the limit.

Limits, in the order they are checked (the ones --oversubscribe cannot lift first):
  - memory: N x (private + shm bytes) within MEMORY_SHARE of MemAvailable (tmpfs pages
    are memory too); the rest is left to the other jobs on the host;
  - /dev/shm: N x shm bytes within MEMORY_SHARE of its free space;
  - tasks: the user's tasks now + N x tasks per rank + the process manager's within
    RLIMIT_NPROC (skipped when unlimited);
  - CPUs: N within RANKS_PER_CPU x the CPUs this process may run on
    (os.sched_getaffinity); `oversubscribe` (--oversubscribe, as mpiexec spells it) lifts
    this one only.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

RANKS_PER_CPU = 8  # ranks spin in their waits: beyond this many per CPU they mostly take turns
MEMORY_SHARE = 0.8  # of MemAvailable (and of /dev/shm's free space) one job may plan to use
MANAGER_TASKS = 4  # mpiexec and its proxy (hydra: one each per host, a thread or two)
MIB = 1 << 20
# A rank process (python -m mpi4py with numpy, MPICH and commref's CPU kernels loaded),
# before its buffers: measured RssAnon 46-48 MiB (VmRSS 89-92 MiB, of which the shared
# libraries' pages are shared between the ranks), rounded up for page tables and the
# allocator's arenas.
RANK_MEMORY = 64 * MIB
# MPICH's /dev/shm/mpich_shm_* segment of a job on one host grows with its ranks:
# measured 2.0 MiB for 2 ranks, 8.1 MiB for 8.
MPICH_SHM_PER_RANK = MIB + MIB // 8
RANK_TASKS = 2  # a rank's threads besides its CPU blocks and GIN proxy: the interpreter's, MPI's


class HostLimitError(ValueError):
    """--np N does not fit this host; a one-line message."""


@dataclass(frozen=True)
class Footprint:
    """What one rank costs the host."""

    memory_bytes: int  # private (anonymous) memory at its peak
    shm_bytes: int  # /dev/shm: its windows and FIFOs, and its share of MPICH's segment
    tasks: int  # threads: the interpreter's, the engine's, the proxy's


@dataclass(frozen=True)
class HostCapacity:
    cpus: int  # CPUs this process may run on
    nproc_limit: int | None  # RLIMIT_NPROC (soft); None: unlimited
    tasks_in_use: int  # tasks (threads) of this user now
    mem_available: int  # bytes, /proc/meminfo MemAvailable
    shm_free: int  # bytes free in /dev/shm

    @classmethod
    def of_this_host(cls, shm_dir: str = "/dev/shm") -> HostCapacity:
        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        return cls(
            cpus=len(os.sched_getaffinity(0)),
            nproc_limit=None if soft == resource.RLIM_INFINITY else int(soft),
            tasks_in_use=user_tasks() if soft != resource.RLIM_INFINITY else 0,
            mem_available=mem_available(),
            shm_free=shm_free(shm_dir),
        )


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (MemFree where the kernel lacks it)."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024
    return fields.get("MemAvailable", fields.get("MemFree", 0))


def shm_free(shm_dir: str = "/dev/shm") -> int:
    """Bytes an unprivileged user may still write to `shm_dir`."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def user_tasks(uid: int | None = None) -> int:
    """Threads of every process of `uid` (this user by default): what RLIMIT_NPROC counts."""
    uid = os.getuid() if uid is None else uid
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            if int(status["Uid"].split()[0]) == uid:
                total += int(status["Threads"])
        except (OSError, KeyError, ValueError):
            pass  # gone meanwhile
    return total


def _size(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", MIB)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def check_ranks(nranks: int, rank: Footprint, oversubscribe: bool = False, host: HostCapacity | None = None) -> None:
    """Raises HostLimitError (one line, starting "--np N: ") when `nranks` ranks of
    footprint `rank` do not fit `host` (this host now by default)."""
    host = HostCapacity.of_this_host() if host is None else host
    n = nranks
    memory = n * (rank.memory_bytes + rank.shm_bytes)
    if memory > MEMORY_SHARE * host.mem_available:
        raise HostLimitError(
            f"--np {n}: the job needs about {_size(memory)} of memory ({n} ranks x "
            f"{_size(rank.memory_bytes + rank.shm_bytes)}), more than {MEMORY_SHARE:.0%} of the "
            f"{_size(host.mem_available)} this host has available (MemAvailable)"
        )
    shm = n * rank.shm_bytes
    if shm > MEMORY_SHARE * host.shm_free:
        raise HostLimitError(
            f"--np {n}: the job needs about {_size(shm)} in /dev/shm ({n} ranks x {_size(rank.shm_bytes)} of "
            f"windows and FIFOs), more than {MEMORY_SHARE:.0%} of its {_size(host.shm_free)} free"
        )
    if host.nproc_limit is not None:
        tasks = n * rank.tasks + MANAGER_TASKS
        if host.tasks_in_use + tasks > host.nproc_limit:
            raise HostLimitError(
                f"--np {n}: the job needs about {tasks} tasks ({n} ranks x {rank.tasks} threads), and this user "
                f"runs {host.tasks_in_use} of its {host.nproc_limit} (RLIMIT_NPROC, ulimit -u)"
            )
    if not oversubscribe and n > RANKS_PER_CPU * host.cpus:
        raise HostLimitError(
            f"--np {n}: {n} ranks on {host.cpus} allowed CPU(s) is more than {RANKS_PER_CPU} per CPU "
            f"(at most {RANKS_PER_CPU * host.cpus}; --oversubscribe lifts this limit)"
        )
