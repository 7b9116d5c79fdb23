"""Symmetric windows: one equally sized buffer per rank, registered collectively.

Every rank calls :func:`register_window` with the same size. The result holds this
rank's buffer and, for every rank of its LSA team (ranks whose windows it can load
and store), the address at which that rank's buffer is mapped *in this process*; the
table of those addresses (0 for ranks outside the team) is what device code reads.

How the peers' memory is mapped:
  - CPU, ranks in separate processes: POSIX shared memory under /dev/shm. Each file is
    unlinked as soon as every peer has mapped it (also when mapping fails), so a crash
    later leaves nothing behind.
  - CPU, ranks as threads (ThreadWorld): plain memory, shared by address.
  - GPU, separate processes: CUDA IPC memory handles.
  - GPU, threads of one process: device pointers directly (peer access is enabled
    between distinct GPUs).
"""

from __future__ import annotations

import itertools
import mmap
import os
import uuid
from dataclasses import dataclass, field

import numpy as np

ALIGN = 4096
SHM_PREFIX = "/dev/shm/commref-"  # + job-serial-rank: the CPU windows' files (see transports/launch.py)
_serial = itertools.count()


def lsa_team(world) -> list[int]:
    """The ranks whose windows this rank can map: all ranks of a ThreadWorld, and the
    ranks on the same host under MPI."""
    if world.kind == "thread":
        return list(range(world.size))
    hosts = world.allgather(world.host, what="lsa team hosts")
    return [r for r, h in enumerate(hosts) if h == world.host]


@dataclass
class SymmetricWindow:
    nbytes: int
    device: str  # "cpu" or "cuda"
    local: object  # this rank's buffer: numpy uint8 array, or cupy uint8 array
    address: int  # this rank's buffer address
    peer_addresses: np.ndarray  # uint64[nranks]: each rank's buffer mapped here; 0 if not LSA
    peer_table: object  # peer_addresses where device code can read it
    lsa_ranks: list[int]
    _keep: list = field(default_factory=list, repr=False)  # mappings that must outlive the window
    _close: list = field(default_factory=list, repr=False)

    def close(self) -> None:
        for fn in self._close:
            try:
                fn()
            except Exception:  # closing is best effort; the process may be exiting
                pass
        self._close.clear()
        self._keep.clear()


def _aligned_zeros(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + nbytes]


def register_window(world, nbytes: int, device: str = "cpu", device_id: int = 0) -> SymmetricWindow:
    """Collective: allocates this rank's window of `nbytes` (zeroed) and maps the LSA
    team's windows. Every rank must pass the same nbytes; a mismatch raises ValueError
    on every rank."""
    sizes = world.allgather(int(nbytes), what="window size")
    if len(set(sizes)) != 1:
        raise ValueError(f"rank {world.rank}: symmetric window sizes differ across ranks: {sizes}")
    team = lsa_team(world)
    if device == "cpu":
        if world.kind == "thread":
            return _register_cpu_threads(world, nbytes, team)
        return _register_cpu_shm(world, nbytes, team)
    if device == "cuda":
        return _register_cuda(world, nbytes, team, device_id)
    raise ValueError(f"unknown device {device!r}")


def _register_cpu_threads(world, nbytes, team) -> SymmetricWindow:
    local = _aligned_zeros(nbytes)
    arrays = world.allgather(local, what="window buffers")
    addrs = np.array([a.ctypes.data for a in arrays], dtype=np.uint64)
    return SymmetricWindow(nbytes, "cpu", local, local.ctypes.data, addrs, addrs, team, _keep=list(arrays))


def _register_cpu_shm(world, nbytes, team) -> SymmetricWindow:
    job = world.bcast(uuid.uuid4().hex[:12] if world.rank == 0 else None, what="window name")
    serial = next(_serial)

    def path(r: int) -> str:
        return f"{SHM_PREFIX}{job}-{serial}-{r}"

    mine = path(world.rank)
    fd = os.open(mine, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    keep = []
    addrs = np.zeros(world.size, dtype=np.uint64)
    try:
        try:
            os.ftruncate(fd, nbytes)
            local_map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        local = np.frombuffer(local_map, dtype=np.uint8)
        keep.append(local_map)
        world.barrier(what="windows created")
        for r in team:
            if r == world.rank:
                addrs[r] = local.ctypes.data
                continue
            pfd = os.open(path(r), os.O_RDWR)
            try:
                m = mmap.mmap(pfd, nbytes)
            finally:
                os.close(pfd)
            keep.append(m)
            addrs[r] = np.frombuffer(m, dtype=np.uint8).ctypes.data
        world.barrier(what="windows mapped")
    finally:
        os.unlink(mine)
    return SymmetricWindow(nbytes, "cpu", local, local.ctypes.data, addrs, addrs, team, _keep=keep)


def _register_cuda(world, nbytes, team, device_id) -> SymmetricWindow:
    import cupy
    from cupy.cuda import runtime

    with cupy.cuda.Device(device_id):
        ptr = runtime.malloc(nbytes)
        runtime.memset(ptr, 0, nbytes)
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner=None, device_id=device_id)
        local = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        closers = [lambda: runtime.free(ptr)]
        addrs = np.zeros(world.size, dtype=np.uint64)
        if world.kind == "thread":
            infos = world.allgather((ptr, device_id), what="window pointers")
            for r in team:
                peer_ptr, peer_dev = infos[r]
                if peer_dev != device_id and runtime.deviceCanAccessPeer(device_id, peer_dev):
                    try:
                        runtime.deviceEnablePeerAccess(peer_dev)
                    except runtime.CUDARuntimeError:
                        pass  # already enabled
                addrs[r] = peer_ptr
        else:
            handle = runtime.ipcGetMemHandle(ptr)
            handles = world.allgather(handle, what="window IPC handles")
            for r in team:
                if r == world.rank:
                    addrs[r] = ptr
                    continue
                peer_ptr = runtime.ipcOpenMemHandle(handles[r], 1)  # cudaIpcMemLazyEnablePeerAccess
                closers.append(lambda p=peer_ptr: runtime.ipcCloseMemHandle(p))
                addrs[r] = peer_ptr
            world.barrier(what="windows mapped")
        table = cupy.asarray(addrs)
    return SymmetricWindow(nbytes, "cuda", local, ptr, addrs, table, team, _keep=[mem], _close=closers)
