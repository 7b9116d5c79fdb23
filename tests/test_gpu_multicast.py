"""NVLink multicast on a GPU: the multimem handle's PTX path (include/commref/multimem.h
with `mc` set; tests/kernels/multicast.cu) over a real CUDA multicast object bound to one
GPU's memory (cuMulticastCreate, cuMulticastAddDevice, cuMemCreate, cuMulticastBindMem,
cuMemMap of both the memory and the multicast handle). A team of one GPU: each
multimem.ld_reduce reduces one copy and each multimem.st lands in it, so the check is
that the PTX runs on the mapping and moves every value. Skipped, with the device's
answer, where it reports no multicast (nvls.multicast_support). The collectives'
algorithm "nvls" runs its LSA emulation on every device (tests/test_nvls.py).

tests/gpu/gpu_check.sh runs it in its "GPU tests" step (pytest -m gpu -rs: a skip
prints its reason). Without a GPU, the kernel's build for sm_90 is checked: its PTX holds
the multimem instructions of all three types.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from commref.collectives import nvls

KERNEL = Path(__file__).resolve().parent / "kernels" / "multicast.cu"
N = 4096  # elements per region of the kernel (its comment)


class Driver:
    """cuda.bindings.driver calls that raise on any CUresult but success."""

    def __init__(self):
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            from cuda import cuda as cu  # cuda-python before 12.6
        self.cu = cu

    def __call__(self, name: str, *args):
        out = getattr(self.cu, name)(*args)
        if out[0] != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{name} failed: {out[0]}")
        return out[1] if len(out) == 2 else out[1:] or None


def _device_location(cu, prop_or_desc) -> None:
    prop_or_desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop_or_desc.location.id = 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (a compile check, nothing runs)")
def test_the_kernel_builds_for_sm90_with_the_multimem_instructions(tmp_path):
    from helpers import nvcc_sm90

    proc = nvcc_sm90(KERNEL, tmp_path / "multicast.ptx", output="-ptx", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ptx = (tmp_path / "multicast.ptx").read_text()
    for instruction in ("multimem.ld_reduce.relaxed.sys.global.add.f32", ".max.s32", ".add.acc::f32.bf16x2"):
        assert instruction in ptx, instruction
    assert ptx.count("multimem.st.") >= 2, ptx.count("multimem.st.")


@pytest.mark.gpu
def test_multimem_ptx_over_a_multicast_object_on_one_gpu():
    why = nvls.multicast_support("cuda")
    if why:
        pytest.skip(f"NVLink multicast: {why}")
    from commref.device_kernels import gpu_loader

    d = Driver()
    cu = d.cu
    d("cuInit", 0)
    dev = d("cuDeviceGet", 0)
    ctx = d("cuDevicePrimaryCtxRetain", dev)
    d("cuCtxSetCurrent", ctx)
    major = d("cuDeviceGetAttribute", cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    minor = d("cuDeviceGetAttribute", cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)

    mc_prop = cu.CUmulticastObjectProp()
    mc_prop.numDevices = 1
    mc_prop.handleTypes = 0  # one process: nothing exported
    mem_prop = cu.CUmemAllocationProp()
    mem_prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    _device_location(cu, mem_prop)
    recommended = cu.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED
    recommended_mem = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    granularity = max(
        d("cuMulticastGetGranularity", mc_prop, recommended),
        d("cuMemGetAllocationGranularity", mem_prop, recommended_mem),
    )
    size = -(-20 * N // granularity) * granularity
    mc_prop.size = size
    access = cu.CUmemAccessDesc()
    _device_location(cu, access)
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    mc = mem = uc = mcva = module = bound = None
    mapped = []
    try:
        mc = d("cuMulticastCreate", mc_prop)
        d("cuMulticastAddDevice", mc, dev)
        mem = d("cuMemCreate", size, mem_prop, 0)
        d("cuMulticastBindMem", mc, 0, mem, 0, size, 0)
        bound = True
        uc = d("cuMemAddressReserve", size, granularity, 0, 0)
        mcva = d("cuMemAddressReserve", size, granularity, 0, 0)
        for va, handle in ((uc, mem), (mcva, mc)):
            d("cuMemMap", va, size, 0, handle, 0)
            mapped.append(va)
            d("cuMemSetAccess", va, size, [access], 1)

        rng = np.random.default_rng(7)
        floats = rng.integers(-1000, 1000, N).astype(np.float32) / 4
        ints = rng.integers(-(2**30), 2**30, N).astype(np.int32)
        halves = (rng.integers(-200, 200, N) / 2).astype(ml_dtypes.bfloat16)
        image = np.zeros(20 * N, np.uint8)
        image[: 4 * N] = floats.view(np.uint8)
        image[8 * N : 12 * N] = ints.view(np.uint8)
        image[16 * N : 18 * N] = halves.view(np.uint8)
        d("cuMemcpyHtoD", uc, image.ctypes.data, image.nbytes)

        cubin = np.frombuffer(gpu_loader.build_user_gpu_image(KERNEL, 10 * major + minor).read_bytes(), np.uint8)
        module = d("cuModuleLoadData", cubin.ctypes.data)
        kernel = d("cuModuleGetFunction", module, b"commref_multicast_check")
        params = np.array([int(uc), int(mcva), N], np.uint64)
        addresses = np.array([params.ctypes.data + 8 * i for i in range(3)], np.uint64)
        d("cuLaunchKernel", kernel, 16, 1, 1, 256, 1, 1, 0, 0, addresses.ctypes.data, 0)
        d("cuCtxSynchronize")
        out = np.zeros_like(image)
        d("cuMemcpyDtoH", out.ctypes.data, uc, out.nbytes)
    finally:  # what was made, undone in reverse
        for name, *args in (
            ("cuModuleUnload", module),
            *(("cuMemUnmap", va, size) for va in reversed(mapped)),
            ("cuMemAddressFree", mcva, size),
            ("cuMemAddressFree", uc, size),
            ("cuMulticastUnbind", mc if bound else None, dev, 0, size),
            ("cuMemRelease", mem),
            ("cuMemRelease", mc),
            ("cuDevicePrimaryCtxRelease", dev),
        ):
            if all(a is not None for a in args):
                getattr(cu, name)(*args)

    np.testing.assert_array_equal(out[4 * N : 8 * N].view(np.float32), floats + 1)
    np.testing.assert_array_equal(out[12 * N : 16 * N].view(np.int32), ints * 2)
    np.testing.assert_array_equal(out[18 * N : 20 * N].view(ml_dtypes.bfloat16), halves)
