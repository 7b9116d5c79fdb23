"""Co-residency on a GPU without one: the pure residency rule (tuner.residency_problem),
and, through the stand-in for CuPy (stand_ins.FakeCuda, conftest's `fake`), thread ranks'
collectives and users' kernels (device_api.Kernel) whose blocks cannot all be resident
are refused before anything is launched; those that fit are launched.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from stand_ins import refused_allreduce, run_threads

from commref.collectives import tuner
from commref.collectives.communicator import Communicator
from commref.transports.errors import CapabilityError

# ---- the pure residency rule ----


def test_residency_refuses_what_cannot_be_co_resident():
    why = tuner.residency_problem("commref_ring_allreduce", ranks=4, channels=8, threads=512, blocks_per_sm=2, sms=8)
    assert why is not None
    for number in ("4 ranks", "8 channels", "32 blocks", "512 threads", "2 blocks per SM", "8 SMs", "= 16"):
        assert number in why, (number, why)
    assert "\n" not in why


def test_residency_accepts_what_fits():
    assert tuner.residency_problem("k", ranks=4, channels=8, threads=512, blocks_per_sm=2, sms=16) is None  # 32 == 32
    assert tuner.residency_problem("k", ranks=2, channels=8, threads=512, blocks_per_sm=4, sms=132) is None


def test_residency_of_a_lone_rank_needs_only_one_block_per_sm():
    # One rank on its GPU: its blocks never wait for one another, so they need not all fit.
    assert tuner.residency_problem("k", ranks=1, channels=64, threads=1024, blocks_per_sm=1, sms=2) is None
    why = tuner.residency_problem("k", ranks=1, channels=1, threads=2048, blocks_per_sm=0, sms=132)
    assert why is not None and "2048 threads" in why


def _residency(world, fake):
    cupy = fake.module
    comm = Communicator(world, "cuda", max_channels=4)
    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(4 << 20, np.float32)  # large enough for 4 channels
    return refused_allreduce(comm, x, CapabilityError, stream=stream)


def test_thread_ranks_whose_blocks_cannot_be_co_resident_are_refused(fake):
    fake.blocks_per_sm, fake.sm_count = 1, 6
    messages = run_threads(2, _residency, fake)  # 2 ranks x 4 channels = 8 blocks > 1 x 6
    assert all(m is not None and "8 blocks" in m and "6 SMs" in m for m in messages), messages
    assert not fake.calls("launch")


def test_threads_above_the_kernels_limit_are_refused(fake):
    fake.blocks_per_sm = 0  # what the occupancy query answers above the kernel's max threads per block
    messages = run_threads(1, _residency, fake)
    assert "cannot run 512 threads per block" in messages[0] and "its limit: 512 threads" in messages[0], messages
    assert not fake.calls("launch")


def test_co_resident_blocks_that_fit_are_launched(fake):
    fake.blocks_per_sm, fake.sm_count = 1, 8
    assert run_threads(2, _residency, fake) == [None, None]
    assert len(fake.calls("launch")) == 2


# ---- users' kernels (device_api.Kernel) and co-residency ----


def _user_kernel_launch(world, fake, grid, block):
    from commref.collectives.device_api import DeviceComm, Kernel

    source = (
        '#include "commref/device.h"\nusing namespace commref;\nCOMMREF_KERNEL(spin_together, KernelArgs, args) {}\n'
    )
    kernel = Kernel(source, "spin_together")
    stream = fake.module.cuda.Stream(non_blocking=True)
    with DeviceComm(world, window_bytes=64, device="cuda") as dc:
        try:
            kernel.launch(dc, grid, block, stream=stream)
        except CapabilityError as e:
            return str(e), dc.launches
        return None, dc.launches


@pytest.fixture
def user_kernels(fake, monkeypatch):
    """Kernel.compile gives a CUfunction handle without NVRTC; the driver's occupancy
    query answers fake.blocks_per_sm (0 above 256 threads, the kernel's limit), and its
    launches are logged."""
    from commref.collectives.device_api import Kernel

    monkeypatch.setattr(Kernel, "compile", lambda self, device="cpu", device_id=0: 0xF00)
    driver = types.SimpleNamespace(
        CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK=0,
        funcGetAttribute=lambda attr, fn: 256,
        occupancyMaxActiveBlocksPerMultiprocessor=lambda fn, threads, smem: fake.blocks_per_sm,
        launchKernel=lambda fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra: fake.note(
            "launchKernel", fn, gx, bx, stream
        ),
    )
    monkeypatch.setattr(fake.module.cuda, "driver", driver, raising=False)
    monkeypatch.setitem(sys.modules, "cupy.cuda.driver", driver)
    return fake


def test_a_users_kernel_whose_blocks_cannot_be_co_resident_is_refused(user_kernels):
    """Two ranks of this process on one GPU, each launching 4 blocks of a user's kernel
    that fits 1 block per SM on 6 SMs: 8 blocks cannot all be resident, so blocks waiting
    on each other would spin until the deadline; refused before anything is launched."""
    fake = user_kernels
    fake.blocks_per_sm, fake.sm_count = 1, 6
    results = run_threads(2, _user_kernel_launch, fake, 4, 128)
    for rank, (message, launches) in enumerate(results):
        assert message is not None and message.startswith(
            f"rank {rank}: GPU 0: 2 ranks of this process share "
            f"this GPU: 2 ranks x 4 blocks (grid) = 8 blocks of 128 "
            f"threads"
        ), message
        assert "kernel spin_together fits 1 blocks per SM x 6 SMs = 6" in message and "\n" not in message, message
        assert launches == 0, "a refused launch is not counted"
    assert not fake.calls("launchKernel")


def test_a_users_kernel_that_fits_is_launched(user_kernels):
    fake = user_kernels
    fake.blocks_per_sm, fake.sm_count = 1, 6
    assert run_threads(2, _user_kernel_launch, fake, 3, 128) == [(None, 1), (None, 1)]  # 2 x 3 = 6 blocks fit
    assert [c[2:4] for c in fake.calls("launchKernel")] == [(3, 128), (3, 128)]


def test_a_users_kernel_above_its_thread_limit_is_refused(user_kernels):
    ((message, launches),) = run_threads(1, _user_kernel_launch, user_kernels, 1, 512)
    assert "kernel spin_together cannot run 512 threads per block" in message and "its limit: 256 threads" in message
    assert launches == 0 and not user_kernels.calls("launchKernel")
