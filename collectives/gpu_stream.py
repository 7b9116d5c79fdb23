"""A GPU communicator's stream and events, and where its ranks run.

A communicator has a non-blocking stream of its own, joined to the caller's stream
with events, as NCCL's: the caller's stream records an event that the communicator's
stream waits for, the kernel runs on the communicator's stream, which records an event
that the caller's stream waits for. All launches of one communicator go on its one
stream, so calls from several caller streams run one at a time, in call order (they
share the window's step counters and FIFOs, which two kernels of one communicator must
never drive at once).
"""

from __future__ import annotations

import os
import time
import warnings

import numpy as np

from commref.device_kernels import gpu_loader
from commref.transports.errors import CapabilityError

from . import tuner

LEGACY_STREAMS = (0, 1)  # CUstream handles of CUDA's legacy default stream (0, CU_STREAM_LEGACY)
CUDA_ERROR_NOT_READY = 600


def use_rank_gpu(world, device_id: int | None = None) -> int:
    """The GPU of this rank of `world`, made the calling thread's current device:
    `device_id` when given, else world.local_rank % the number of visible GPUs (what NCCL
    users pass to cudaSetDevice before ncclCommInitRank: one rank per GPU on a node with
    as many GPUs as ranks, several ranks per GPU, as ThreadWorld ranks on one GPU, when
    there are fewer). Arrays and streams the rank makes afterwards land on it."""
    import cupy

    if device_id is None:
        device_id = world.local_rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device_id).use()
    return device_id


def place_on_gpus(world, device_id: int) -> tuple[list, int]:
    """Collective: every rank's (host, pid, PCI bus id), and how many ranks of this
    process run on this rank's GPU (itself included: their blocks must be resident
    together, GpuStream.check_residency; a legacy-stream caller is refused when there are
    several). On rank 0 warns when ranks in different processes share a GPU (they
    time-slice without MPS)."""
    import cupy

    bus = cupy.cuda.runtime.deviceGetPCIBusId(device_id)
    places = world.allgather((world.host, os.getpid(), bus), what="communicator GPUs")
    me = places[world.rank]
    ranks_on_device = sum(1 for p in places if p == me)
    if world.rank == 0:
        by_gpu: dict = {}
        for r, (host, pid, gpu) in enumerate(places):
            by_gpu.setdefault((host, gpu), {}).setdefault(pid, []).append(r)
        for (host, gpu), pids in by_gpu.items():
            if len(pids) > 1:
                ranks = sorted(r for rs in pids.values() for r in rs)
                warnings.warn(
                    f"commref: ranks {ranks} share GPU {gpu} on {host} as {len(pids)} processes: without "
                    f"MPS they time-slice it, so their timings measure the scheduler; with MPS their "
                    f"kernels must all be resident at once",
                    RuntimeWarning,
                    stacklevel=4,
                )
    return places, ranks_on_device


class GpuStream:
    """The stream every launch of one communicator of rank `rank` on GPU `device_id`
    goes on, the two events that join it to a caller's stream, and the waits on them."""

    def __init__(self, rank: int, device_id: int, ranks_on_device: int):
        import cupy

        self.rank, self.device_id, self.ranks_on_device = rank, device_id, ranks_on_device
        self._cupy, self.runtime = cupy, cupy.cuda.runtime
        with cupy.cuda.Device(device_id):
            self._stream = cupy.cuda.Stream(non_blocking=True)  # every launch of this communicator
            self._joined = cupy.cuda.Event(disable_timing=True)  # the caller's work before a launch
            self._done = cupy.cuda.Event(disable_timing=True)  # a launch, for the caller's stream
        self.handle, self.joined_event, self.done_event = (
            int(self._stream.ptr),
            int(self._joined.ptr),
            int(self._done.ptr),
        )
        self._resident: set = set()  # (kernel, spec, channels) whose residency was checked

    def device_table(self, table: np.ndarray):
        """A copy of `table` in device memory, made on this stream, complete on return."""
        with self._cupy.cuda.Device(self.device_id), self._stream:
            copy = self._cupy.asarray(table)
        self._stream.synchronize()
        return copy

    def caller(self, stream) -> int:
        """The CUstream handle of a call's `stream` (None: CuPy's current stream)."""
        return gpu_loader.stream_handle(self._cupy.cuda.get_current_stream() if stream is None else stream)

    def _refuse_legacy_stream(self, caller: int) -> None:
        if caller in LEGACY_STREAMS and self.ranks_on_device > 1:
            raise ValueError(
                f"rank {self.rank}: {self.ranks_on_device} ranks of this process share GPU {self.device_id}, and "
                f"this call's stream is CUDA's legacy default stream, which would make rank {self.rank}'s work wait "
                f"for the other ranks' kernels while they wait for it; pass each rank a stream of its own "
                f"(stream=cupy.cuda.Stream(non_blocking=True)) or make one current "
                f"(cupy.cuda.Stream(non_blocking=True).use())"
            )

    def enqueue(self, launch, caller: int):
        """Runs launch(this CUstream) joined to the `caller` stream (a CUstream handle):
        the caller's earlier work first, the caller's later work after. Returns what
        launch returns."""
        self._refuse_legacy_stream(caller)
        rt, own = self.runtime, self.handle
        if caller != own:
            rt.eventRecord(self.joined_event, caller)
            rt.streamWaitEvent(own, self.joined_event, 0)
        status = launch(own)
        if caller != own:
            rt.eventRecord(self.done_event, own)
            rt.streamWaitEvent(caller, self.done_event, 0)
        return status

    def wait(self, stream: int, deadline: float | None = None) -> bool:
        """Waits for a stream (a CUstream handle); a CUDA error on it raises. Polls
        rather than blocks: a blocking wait that held the GIL would stop the other
        ThreadWorld ranks from launching the kernels this one waits for. False when
        `deadline` (time.monotonic()) passed first."""
        rt = self.runtime
        while rt.streamQuery(stream) == CUDA_ERROR_NOT_READY:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0)
        rt.streamSynchronize(stream)  # done or failed: returns at once, or raises the stream's error
        return True

    def synchronize(self, caller: int, comm) -> None:
        """Waits for this stream, then for `caller` (a CUstream handle), and raises the
        failure a kernel of `comm` (the Communicator) recorded, if any."""
        try:
            self.wait(self.handle)
            if caller != self.handle:
                self.wait(caller)
        except self.runtime.CUDARuntimeError as e:
            if comm.failed:
                raise comm.failure() from e
            raise
        if comm.failed:
            raise comm.failure()

    def check_residency(self, kernels, kernel: str, spec, nchannels: int, threads: int) -> None:
        """Refuses (CapabilityError) a launch whose blocks, with those of the other ranks
        of this process on this GPU, cannot all be resident at once (the rule:
        tuner.residency_problem). Checked once per (kernel, spec, channels)."""
        key = (kernel, spec, nchannels)
        if key in self._resident:
            return
        per_sm = kernels.max_active_blocks(kernel, spec, threads)
        why = tuner.residency_problem(kernel, self.ranks_on_device, nchannels, threads, per_sm, kernels.sm_count)
        if why:
            limit = f" (its limit: {kernels.max_threads(kernel, spec)} threads)" if per_sm == 0 else ""
            raise CapabilityError(f"rank {self.rank}: GPU {self.device_id}: {why}{limit}")
        self._resident.add(key)
