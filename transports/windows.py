"""Symmetric windows: one equally sized buffer per rank, registered collectively.

Every rank calls :func:`register_window` with the same size. The result holds this
rank's buffer and, for every rank on its host (ranks whose windows it can map), the
address at which that rank's buffer is mapped *in this process*; the table of those
addresses (0 for ranks elsewhere) is what device code reads. Which of them a rank
reaches by load and store (its LSA team) is the ranks of its node (`world.node`, the
host unless overridden or simulated, see transports/nodes.node_of); the others on the
host stay mapped for GIN on network shm.

How the peers' memory is mapped:
  - CPU, ranks in separate processes: POSIX shared memory under /dev/shm. Each file is
    unlinked as soon as every peer has mapped it (also when mapping fails), so a crash
    later leaves nothing behind.
  - CPU, ranks as threads (ThreadWorld): plain memory, shared by address.
  - GPU, separate processes: CUDA IPC memory handles.
  - GPU, threads of one process: device pointers directly. Between distinct GPUs peer
    access is enabled once per (device, peer device) pair; where the devices cannot
    access each other the table keeps 0 and `unmapped` says why, so the caller can
    refuse with that reason instead of launching a kernel that would fault.

A GPU window is zeroed on a stream of its own that is synchronized before the
registration's barriers, so no peer sees it before it is zero.

Teardown is two steps because a window exported through CUDA IPC must not be freed
while a peer still has it open (undefined behaviour), and a peer's kernel may still
write into it: `close_peers()` drops this rank's mappings of the peers' windows,
`free()` releases this rank's own buffer. A collective owner (the Communicator) waits
for its kernels, calls close_peers() on every rank, barriers, then free().
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import uuid
from dataclasses import dataclass, field

import numpy as np

ALIGN = 4096
# CUDA runtime codes this module tolerates (cudaError_t).
CUDA_PEER_ACCESS_ALREADY_ENABLED = 704
SHM_PREFIX = "/dev/shm/commref-"  # + job-serial-rank: the CPU windows' files (see transports/launcher.py)
_serial = itertools.count()


def host_team(world) -> list[int]:
    """Collective: the ranks whose windows this rank can map: all ranks of a ThreadWorld,
    and the ranks on the same host under MPI."""
    if world.kind == "thread":
        return list(range(world.size))
    hosts = world.allgather(world.host, what="host team hosts")
    return [r for r, h in enumerate(hosts) if h == world.host]


def rank_nodes(world) -> list[tuple[str, str]]:
    """Collective: every rank's node as (world.node, world.host), equal exactly for the
    ranks of one node."""
    return world.allgather((world.node, world.host), what="rank nodes")


def lsa_team(world) -> list[int]:
    """Collective: the ranks this rank reaches by load and store: those of its node
    (world.node), a subset of its host team."""
    nodes = rank_nodes(world)
    return [r for r, n in enumerate(nodes) if n == (world.node, world.host)]


@dataclass
class SymmetricWindow:
    nbytes: int
    device: str  # "cpu" or "cuda"
    local: object  # this rank's buffer: numpy uint8 array, or cupy uint8 array
    address: int  # this rank's buffer address
    peer_addresses: np.ndarray  # uint64[nranks]: each rank's buffer mapped here; 0 if not LSA
    peer_table: object  # peer_addresses where device code can read it
    mapped_ranks: list[int]  # the host team: the ranks whose windows are mapped here
    _keep: list = field(default_factory=list, repr=False)  # mappings that must outlive the window
    _close: list = field(default_factory=list, repr=False)  # frees this rank's own buffer
    _close_peers: list = field(default_factory=list, repr=False)  # unmaps the peers' buffers
    unmapped: dict = field(default_factory=dict)  # LSA rank -> why its window is not mapped here

    def close_peers(self) -> None:
        """Drops this rank's mappings of the peers' windows (CUDA IPC handles). Call it
        once this rank's kernels that use them have completed."""
        _run_all(self._close_peers)

    def free(self) -> None:
        """Releases this rank's own buffer. On a GPU, call it only once every peer has
        closed its mapping of it and no peer kernel can still write into it (a barrier
        after every rank's close_peers())."""
        _run_all(self._close)
        self._keep.clear()

    def close(self) -> None:
        """close_peers() then free(), without waiting for the peers: for a window whose
        peers are known to be done with it (or never mapped it). Idempotent."""
        self.close_peers()
        self.free()


def _run_all(fns: list) -> None:
    for fn in fns:
        try:
            fn()
        except Exception:  # closing is best effort; the process may be exiting
            pass
    fns.clear()


def _aligned_zeros(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + nbytes]


def register_window(world, nbytes: int, device: str = "cpu", device_id: int = 0) -> SymmetricWindow:
    """Collective: allocates this rank's window of `nbytes` (zeroed) and maps the windows
    of its host team. Every rank must pass the same nbytes; a mismatch raises ValueError
    on every rank."""
    sizes = world.allgather(int(nbytes), what="window size")
    if len(set(sizes)) != 1:
        raise ValueError(f"rank {world.rank}: symmetric window sizes differ across ranks: {sizes}")
    team = host_team(world)
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


_peer_lock = threading.Lock()
_peer_enabled: set[tuple[int, int]] = set()  # (device, peer device) pairs with peer access on


def enable_peer_access(device_id: int, peer_id: int) -> str | None:
    """Makes `peer_id`'s memory accessible from `device_id` (once per pair and process);
    returns None, or why it cannot be (no peer access between the two devices)."""
    if device_id == peer_id:
        return None
    from cupy.cuda import runtime

    with _peer_lock:
        if (device_id, peer_id) in _peer_enabled:
            return None
        if not runtime.deviceCanAccessPeer(device_id, peer_id):
            return f"no peer access between device {device_id} and device {peer_id}"
        prev = runtime.getDevice()
        runtime.setDevice(device_id)
        try:
            runtime.deviceEnablePeerAccess(peer_id)
        except runtime.CUDARuntimeError as e:
            if getattr(e, "status", None) != CUDA_PEER_ACCESS_ALREADY_ENABLED:
                raise
        finally:
            runtime.setDevice(prev)
        _peer_enabled.add((device_id, peer_id))
    return None


def _register_cuda(world, nbytes, team, device_id) -> SymmetricWindow:
    import cupy
    from cupy.cuda import runtime

    with cupy.cuda.Device(device_id):
        ptr = runtime.malloc(nbytes)
        closers = [lambda: runtime.free(ptr)]
        peer_closers: list = []
        try:
            # cudaMemset is asynchronous: zero on a stream of our own (not the legacy
            # null stream, which would wait for other ranks' kernels on this device)
            # and wait for it before any peer can see the window.
            stream = cupy.cuda.Stream(non_blocking=True)
            runtime.memsetAsync(ptr, 0, nbytes, stream.ptr)
            stream.synchronize()
        except BaseException:
            runtime.free(ptr)
            raise
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner=None, device_id=device_id)
        local = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        addrs = np.zeros(world.size, dtype=np.uint64)
        unmapped: dict[int, str] = {}
        if world.kind == "thread":
            infos = world.allgather((ptr, device_id), what="window pointers")
            for r in team:
                peer_ptr, peer_dev = infos[r]
                why = enable_peer_access(device_id, peer_dev)
                if why is None:
                    addrs[r] = peer_ptr
                else:
                    unmapped[r] = why  # 0 in the table: the owner refuses with this reason
        else:
            handle = runtime.ipcGetMemHandle(ptr)
            handles = world.allgather((handle, runtime.deviceGetPCIBusId(device_id)), what="window IPC handles")
            for r in team:
                if r == world.rank:
                    addrs[r] = ptr
                    continue
                try:
                    peer_ptr = runtime.ipcOpenMemHandle(handles[r][0], 1)  # cudaIpcMemLazyEnablePeerAccess
                except runtime.CUDARuntimeError as e:
                    # Still reach the barrier below; the owner refuses with this reason.
                    unmapped[r] = f"cannot open rank {r}'s window (GPU {handles[r][1]}) through CUDA IPC: {e}"
                    continue
                peer_closers.append(lambda p=peer_ptr: runtime.ipcCloseMemHandle(p))
                addrs[r] = peer_ptr
            world.barrier(what="windows mapped")
        with stream:
            table = cupy.asarray(addrs)
        stream.synchronize()
    return SymmetricWindow(
        nbytes,
        "cuda",
        local,
        ptr,
        addrs,
        table,
        team,
        _keep=[mem],
        _close=closers,
        _close_peers=peer_closers,
        unmapped=unmapped,
    )
