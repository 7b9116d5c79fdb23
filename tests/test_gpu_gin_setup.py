"""GIN on the GPU, through the stand-in for CuPy (stand_ins.FakeCuda, conftest's
`fake`): the copy-engine proxy's setup and teardown, and what it refuses.
"""

from __future__ import annotations

import pytest
from stand_ins import run_threads

from commref.collectives.communicator import Communicator
from commref.transports.errors import CapabilityError

# ---- GIN on the GPU: the copy-engine proxy's setup and teardown ----


def _gin_on_gpu(world, fake):
    from commref.transports.gin import cuda_driver

    comm = Communicator(world, "cuda", path="gin", gin_queue=32, gin_counters=2)
    region, proxy = comm.gin_region, comm.proxy
    gin = comm.launch_record.record["gin"]
    seen = (
        type(proxy).__name__,
        int(gin["queue"]) == region.queue_address,
        int(gin["counters"]) == region.counters_address,
        region.counters_address - region.queue_address,
        bool((region.queue == 0).all()),
        isinstance(proxy.driver, cuda_driver.CudaDriver),
    )
    comm.close()
    return seen, region.queue_address, proxy.driver.closed


def test_gin_on_a_gpu_puts_its_queue_in_pinned_mapped_memory_and_frees_it_at_close(fake, monkeypatch):
    """Communicator(device="cuda", path="gin"): the queue and counters in one cudaHostAlloc
    (portable, mapped), zeroed, addressed by CollArgs.gin; a GpuProxy over it; close stops
    the proxy, releases its driver and frees the allocation."""
    from stand_ins import LateCopies

    from commref.transports.gin import cuda_driver
    from commref.transports.gin.queue import queue_bytes
    from commref.transports.host_memory import CUDA_HOST_PORTABLE_MAPPED

    class Driver(LateCopies, cuda_driver.CudaDriver):  # the real driver's type, host memory underneath
        def __init__(self, device_id):
            LateCopies.__init__(self, seed=device_id)

    monkeypatch.setattr(cuda_driver, "CudaDriver", Driver)
    results = run_threads(2, _gin_on_gpu, fake)
    for seen, queue_address, closed in results:
        assert seen == ("GpuProxy", True, True, queue_bytes(32), True, True) and closed, seen
        allocs = [c for c in fake.calls("hostAlloc") if c[1] == queue_address]
        assert allocs and allocs[0][2:] == (queue_bytes(32) + 8 * 2, CUDA_HOST_PORTABLE_MAPPED), allocs
        assert [c for c in fake.calls("freeHost") if c[1] == queue_address], "the queue region was not freed"


@pytest.mark.parametrize(
    "kw, message",
    [(dict(wire="unordered"), "carries the ordered wire"), (dict(network="mpi"), "network 'mpi' needs an MPI world")],
)
def test_gin_on_a_gpu_refuses_what_it_does_not_carry(fake, kw, message):
    def body(world):
        with pytest.raises(CapabilityError, match=message):
            Communicator(world, "cuda", path="gin", **kw)

    run_threads(2, body)
