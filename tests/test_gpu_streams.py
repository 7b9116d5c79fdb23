"""The communicator's CUDA streams, through the stand-in for CuPy that records every
CUDA call (stand_ins.FakeCuda, conftest's `fake`): each communicator launches on a
non-blocking stream of its own, joined to the caller's stream with events in NCCL's
order; a legacy-stream caller is refused when ranks of one process share a GPU; a
kernel's error record surfaces at synchronize() and at the next call.
"""

from __future__ import annotations

import numpy as np
import pytest
from stand_ins import refused_allreduce, run_threads

from commref.collectives.communicator import Communicator
from commref.device_kernels import abi
from commref.transports.errors import CommTimeout

# ---- streams ----


def _allreduce_on_own_stream(world, fake):
    cupy = fake.module
    comm = Communicator(world, "cuda", max_channels=2)
    caller = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(1024, np.float32)
    comm.allreduce(x, x, stream=caller)
    comm.synchronize(caller)
    comm.close()
    with pytest.raises(Exception, match="unusable: it was closed"):  # its memory is gone
        comm.allreduce(x, x, stream=caller)
    return caller.ptr, comm.gpu_stream.handle, comm.gpu_stream.joined_event, comm.gpu_stream.done_event


def test_launch_joins_the_callers_stream_in_nccls_order(fake):
    results = run_threads(2, _allreduce_on_own_stream, fake)
    own_streams = {r[1] for r in results}
    assert len(own_streams) == 2, "each communicator needs a stream of its own"
    for rank, (caller, own, joined, done) in enumerate(results):
        assert (own, True) in [c[1:] for c in fake.calls("streamCreate")], "the communicator's stream is non-blocking"
        thread = f"commref-rank-{rank}"
        seq = [e[1:] for e in fake.log if e[0] == thread and e[1] in ("eventRecord", "streamWaitEvent", "launch")]
        assert seq[0] == ("eventRecord", joined, caller), seq  # the caller's work so far
        assert seq[1] == ("streamWaitEvent", own, joined), seq  # ... comes first on our stream
        assert seq[2][0] == "launch" and seq[2][2] == own, seq  # the kernel on our stream
        assert seq[3] == ("eventRecord", done, own), seq
        assert seq[4] == ("streamWaitEvent", caller, done), seq  # the caller's later work waits for it


def _null_stream_call(world, fake):
    cupy = fake.module
    comm = Communicator(world, "cuda", max_channels=2)
    x = cupy.zeros(64, np.float32)
    return refused_allreduce(comm, x, ValueError)  # stream=None: the current stream, the legacy default one here


def test_legacy_stream_refused_when_thread_ranks_share_a_gpu(fake):
    messages = run_threads(2, _null_stream_call, fake)
    for rank, msg in enumerate(messages):
        assert msg is not None, "a legacy-stream call with two ranks on one GPU must be refused"
        assert f"rank {rank}" in msg and "GPU 0" in msg and "legacy default stream" in msg
        assert "cupy.cuda.Stream(non_blocking=True)" in msg
    assert not fake.calls("launch"), "refused before anything was launched"


def test_legacy_stream_allowed_for_a_lone_rank(fake):
    assert run_threads(1, _null_stream_call, fake) == [None]
    (launch_call,) = fake.calls("launch")
    assert launch_call[2] != 0, "the kernel goes on the communicator's stream"


def _failing_kernel(world, fake):
    cupy = fake.module
    comm = Communicator(world, "cuda", max_channels=1)
    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(64, np.float32)
    fake.fail_next_launch_with = abi.ERR_TIMEOUT
    comm.allreduce(x, x, stream=stream)  # asynchronous: returns before the failure is seen
    with pytest.raises(CommTimeout, match="peer 1"):
        comm.synchronize(stream)
    with pytest.raises(Exception, match="unusable: an earlier call failed: rank 0: timed out"):
        comm.allreduce(x, x, stream=stream)
    comm.close()
    return len(fake.calls("launch"))


def test_kernel_failure_surfaces_at_synchronize(fake):
    assert run_threads(1, _failing_kernel, fake) == [1]
