"""GPU tests: the same kernel source through CuPy. Skipped without a CUDA device."""

import numpy as np
import pytest

from commref.collectives import check
from commref.collectives.catalogue import KERNEL_NAMES as COLLECTIVES
from commref.collectives.communicator import Communicator
from commref.collectives.options import cuda_available
from commref.transports.thread_world import ThreadWorld

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu
if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)


def _sweep(world, dtypes, counts):
    comm = Communicator(world, "cuda", max_channels=2)
    cases = check.cases(list(COLLECTIVES), dtypes, ["sum", "avg", "max"], [], counts, world.size, 3)
    stream = cupy.cuda.Stream(non_blocking=True)
    return sum(check.run_sweep(comm, cases, stream=stream))


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_collectives_threadworld_one_gpu(nranks):
    wrong = ThreadWorld.run(nranks, _sweep, ["float32", "float16", "uint8"], [0, 1, 7, 1001, 70001], timeout=60)
    assert wrong[0] == 0


def test_host_buffer_rejected_on_cuda_communicator():
    def body(world):
        comm = Communicator(world, "cuda")
        x = np.zeros(4, np.float32)
        with pytest.raises(TypeError, match="host memory"):
            comm.allreduce(x, cupy.zeros(4, cupy.float32))
        return True

    assert ThreadWorld.run(1, body)[0]


def test_wait_deadline_on_gpu():
    """Rank 1 never launches: rank 0's kernel gives up after its deadline, records the
    diagnostic naming the peer and returns (no trap), so the CUDA context stays usable."""
    r = ThreadWorld.run(2, _deadline_body, timeout=30)
    message, after = r[0]
    assert "timed out" in message and "peer 1" in message, message
    assert after == 4.0, "the CUDA context is unusable after a kernel failure"


def _deadline_body(world):
    from commref.transports.errors import CommTimeout

    comm = Communicator(world, "cuda", timeout=1.0)
    if world.rank == 1:
        return "skipped"
    comm.kernels.prepare([comm.kernel_spec("allreduce", "float32", "sum")])
    x = cupy.ones(1024, cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)  # ranks of one process on one GPU: a stream each
    try:
        comm.allreduce(x, x, stream=stream)
        comm.synchronize(stream)
        message = "no timeout"
    except CommTimeout as e:
        message = str(e)
    return message, float(cupy.ones(4, cupy.float32).sum())
