"""The GPU loader without a GPU: its build cache, its NVRTC options and its driver
launch arguments, against the oldest CuPy commref supports (the gpu-oldest extra:
CuPy 13.0 and an NVRTC, installed by the README's test command).

- The image cache is keyed by every source file and header: editing a header builds
  anew (CuPy's own cache keyed the text of a file of #include lines, and reloaded a
  stale cubin).
- The modules keep denormals: no flush-to-zero instruction in the PTX (CuPy's cached
  RawModule compiles with -ftz=true, which flushes float32 and bfloat16 denormals).
- The launch passes integers only to CuPy's driver.launchKernel: kernelParams points at
  one pointer, to the CollArgs record (a numpy structured scalar, what CuPy's
  RawKernel call was given before, is refused by CuPy 13).
- CudaKernels with a stand-in for CuPy's device, module and driver: prepare() loads one
  module per (kernel file, specialization) and resolves every kernel at once.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from commref.device_kernels import abi, build, gpu_loader

FLOAT32_SUM = (abi.DTYPE_CODES["float32"], abi.OP_CODES["sum"])
BFLOAT16_SUM = (abi.DTYPE_CODES["bfloat16"], abi.OP_CODES["sum"])


@pytest.fixture(scope="module")
def nvrtc():
    """NVRTC through CuPy's bindings, as the loader finds it."""
    pytest.importorskip(
        "cupy_backends.cuda.libs.nvrtc", reason="CuPy is not installed (pip install -e '.[gpu-oldest]')"
    )
    try:
        return gpu_loader._nvrtc()
    except build.KernelError as e:
        pytest.skip(f"no NVRTC: {e}")


def copy_sources(dest: Path) -> tuple[Path, Path]:
    """A copy of the kernel sources: (kernels folder, include folder)."""
    shutil.copytree(build.INCLUDE_DIR, dest / "include")
    shutil.copytree(build.KERNEL_DIR, dest / "kernels")
    return dest / "kernels", dest / "include"


def test_image_key_follows_every_header(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_loader, "nvrtc_version", lambda: (12, 9))
    kernels, include = copy_sources(tmp_path / "a")
    target, defines = "--gpu-architecture=sm_90", gpu_loader.specialization(FLOAT32_SUM)

    def key(path=kernels / "ring.cu", defines=defines, target=target, include=include) -> str:
        return gpu_loader.gpu_image_path(path, defines, target, "cubin", include).name

    first = key()
    assert key() == first
    other_kernels, other_include = copy_sources(tmp_path / "b")
    assert key(other_kernels / "ring.cu", include=other_include) == first, "the key depends on where the files lie"
    header = include / "commref" / "wait.h"
    text = header.read_text()
    header.write_text(text + "\n// an edit\n")
    assert key() != first, "editing a header the kernel includes leaves the image key unchanged"
    header.write_text(text)
    assert key() == first
    unused = include / "commref" / "gin.h"  # tree.cu includes it only through flow.h; every header counts
    unused.write_text(unused.read_text() + " ")
    assert key() != first
    unused.write_text(unused.read_text()[:-1])
    assert key(defines=gpu_loader.specialization(BFLOAT16_SUM)) != first
    assert key(target="--gpu-architecture=sm_100") != first
    monkeypatch.setattr(gpu_loader, "nvrtc_version", lambda: (13, 0))
    assert key() != first


def test_image_cache_builds_once_and_anew_after_a_header_edit(nvrtc, tmp_path, monkeypatch):
    monkeypatch.setenv("COMMREF_CACHE_DIR", str(tmp_path / "cache"))
    kernels, include = copy_sources(tmp_path / "src")
    compiled = []
    compile_gpu_image = gpu_loader.compile_gpu_image

    def counting(*args, **kwargs):
        compiled.append(args[0].name)
        return compile_gpu_image(*args, **kwargs)

    monkeypatch.setattr(gpu_loader, "compile_gpu_image", counting)
    source = kernels / "selftest.cu"
    first = gpu_loader.build_gpu_image(source, None, 90, include)
    assert compiled == ["selftest.cu"] and first.read_bytes()[:4] == b"\x7fELF", "not an sm_90 cubin"
    assert gpu_loader.build_gpu_image(source, None, 90, include) == first and len(compiled) == 1, "the cache missed"
    port = include / "commref" / "port.h"
    port.write_text(port.read_text() + "\n// an edit\n")
    second = gpu_loader.build_gpu_image(source, None, 90, include)
    assert second != first and len(compiled) == 2, "a header edit reused the old image"
    print(f"NVRTC {gpu_loader.nvrtc_version()}: {first.name}, then {second.name}")


@pytest.mark.parametrize("spec", [FLOAT32_SUM, BFLOAT16_SUM], ids=["float32", "bfloat16"])
def test_modules_keep_denormals(nvrtc, spec):
    """The loader's options produce IEEE float adds (add.rn.f32), never the
    flush-to-zero form; the same source with CuPy's -ftz=true shows the difference."""
    path, defines = build.KERNEL_DIR / "tree.cu", gpu_loader.specialization(spec)
    ptx = gpu_loader.compile_gpu_image(path, defines, "--gpu-architecture=compute_90", "ptx").decode()
    adds = set(re.findall(r"\badd(?:\.\w+)*\.f32\b", ptx))
    assert "add.rn.f32" in adds and not any(".ftz" in a for a in adds), adds
    assert ".ftz." not in ptx


def test_ftz_would_show(nvrtc, monkeypatch):
    """The check above can fail: with -ftz=true the adds become add.rn.ftz.f32."""
    monkeypatch.setattr(gpu_loader, "NVRTC_OPTIONS", (*gpu_loader.NVRTC_OPTIONS, "-ftz=true"))
    ptx = gpu_loader.compile_gpu_image(
        build.KERNEL_DIR / "tree.cu", gpu_loader.specialization(FLOAT32_SUM), "--gpu-architecture=compute_90", "ptx"
    ).decode()
    assert "add.rn.ftz.f32" in ptx


def test_launch_arguments_pass_cupys_driver_api():
    """On the installed CuPy (the oldest supported in CI), launchKernel takes the
    arguments as they are: without a driver it fails loading libcuda, with one it would
    reject the made-up function handle, never with a TypeError. The argument CuPy's
    RawKernel call got before (the record as a numpy structured scalar) is refused."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install -e '.[gpu-oldest]')")
    from cupy.cuda import driver

    record = np.zeros(1, dtype=abi.COLL_ARGS)
    param = ctypes.c_void_p(record.ctypes.data)
    args = gpu_loader.launch_arguments(0x1234, 3, 512, 0, param)
    assert all(type(a) is int for a in args), args
    assert args[:9] == (0x1234, 3, 1, 1, 512, 1, 1, 0, 0)
    kernel_params = ctypes.cast(args[9], ctypes.POINTER(ctypes.c_void_p))
    assert kernel_params[0] == record.ctypes.data, "kernelParams[0] must point at the record's bytes"
    with pytest.raises(Exception) as passed:
        driver.launchKernel(*args)
    assert not isinstance(passed.value, TypeError), passed.value
    with pytest.raises(TypeError):
        driver.launchKernel(*args[:9], record[0], 0)
    print(f"CuPy {cupy.__version__}: launchKernel took the arguments and said: {str(passed.value)[:100]}")


def test_stream_handle():
    assert gpu_loader.stream_handle(None) == 0
    assert gpu_loader.stream_handle(7) == 7
    assert gpu_loader.stream_handle(types.SimpleNamespace(ptr=0xBEEF)) == 0xBEEF


# ---- CudaKernels with a stand-in for CuPy ----


class FakeCuda:
    """CuPy's device, module, driver and runtime as CudaKernels uses them, recording calls."""

    def __init__(self, monkeypatch, tmp_path, local_bytes=lambda name: 1488):
        self.loaded, self.launched, self.current = [], [], 0
        self.events: list[tuple] = []  # ("setLimit", device, bytes), ("funcLoad", fn), ("launch", device) in order
        self.limit = {}  # device -> stack limit (bytes)
        self.names: dict[int, str] = {}  # CUfunction -> kernel name
        fake = self

        class Device:
            def __init__(self, device_id=None):
                self.id = device_id
                self.compute_capability = "90"
                self.attributes = {"MultiProcessorCount": 132}

            def __enter__(self):
                self.saved, fake.current = fake.current, self.id
                return self

            def __exit__(self, *exc):
                fake.current = self.saved

        class Module:
            def load(self, image):
                self.image = image
                fake.loaded.append(image)

            def get_function(self, name):
                assert f"COMMREF_KERNEL({name},".encode() in self.image, f"{name} is not in this module"
                ptr = hash((name, self.image)) & 0xFFFFFFFF
                fake.names[ptr] = name
                return types.SimpleNamespace(ptr=ptr)

        def launch_kernel(*args):
            assert all(type(a) is int for a in args), args
            fake.launched.append((fake.current, args))
            fake.events.append(("launch", fake.current))

        def func_get_attribute(attr, fn):
            return 640 if attr == 0 else local_bytes(fake.names[fn])  # max threads; local bytes

        self.driver = types.SimpleNamespace(
            launchKernel=launch_kernel,
            CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK=0,
            CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES=4,
            funcGetAttribute=func_get_attribute,
            occupancyMaxActiveBlocksPerMultiprocessor=lambda fn, threads, smem: 2048 // threads,
        )

        def set_device(d):
            fake.current = d

        def set_limit(what, nbytes):
            assert what == 0
            fake.limit[fake.current] = nbytes
            fake.events.append(("setLimit", fake.current, nbytes))

        self.runtime = types.SimpleNamespace(
            getDevice=lambda: fake.current,
            setDevice=set_device,
            cudaLimitStackSize=0,
            deviceGetLimit=lambda what: fake.limit.get(fake.current, 1024),
            deviceSetLimit=set_limit,
        )

        def cu_func_load(fn):
            fake.events.append(("funcLoad", fn.value))
            return 0

        self.libcuda = types.SimpleNamespace(cuFuncLoad=cu_func_load)
        monkeypatch.setattr(gpu_loader, "_libcuda", lambda: fake.libcuda)
        monkeypatch.setattr(gpu_loader, "_stack_bytes", {})
        cuda = types.SimpleNamespace(
            Device=Device, driver=self.driver, runtime=self.runtime, function=types.SimpleNamespace(Module=Module)
        )
        cupy = types.ModuleType("cupy")
        cupy.cuda = cuda
        cupy_cuda = types.ModuleType("cupy.cuda")
        for k, v in vars(cuda).items():
            setattr(cupy_cuda, k, v)
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        monkeypatch.setitem(sys.modules, "cupy.cuda", cupy_cuda)

        def image(path, spec, cc, include_dir=build.INCLUDE_DIR):  # the source stands in for the cubin
            out = tmp_path / f"{path.stem}-{spec}.img"
            out.write_bytes(path.read_bytes() + f"// {spec}".encode())
            return out

        monkeypatch.setattr(gpu_loader, "build_gpu_image", image)
        monkeypatch.setattr(gpu_loader, "build_gpu_images", lambda specs, cc, workers=None: [])


def test_cuda_kernels_load_every_kernel_eagerly(monkeypatch, tmp_path):
    """prepare() loads one module per (kernel file, specialization) and resolves every
    kernel of abi.KERNEL_NAMES in it, so a later launch loads nothing; launches pass
    integers, switch to the kernels' device and back; occupancy answers 0 above the
    kernel's thread limit."""
    fake = FakeCuda(monkeypatch, tmp_path)
    kernels = gpu_loader.CudaKernels(1)
    assert kernels.sm_count == 132 and kernels.compute_capability == 90
    specs = [None, FLOAT32_SUM]
    kernels.prepare(specs)
    assert len(fake.loaded) == len(specs) * len(build.gpu_sources())
    for spec in specs:
        for name in abi.KERNEL_NAMES:
            assert (name, spec) in kernels._fn, (name, spec)
    record = np.zeros(1, dtype=abi.COLL_ARGS)
    for name in abi.KERNEL_NAMES:
        assert (
            kernels.launch(name, 2, 512, record, stream=types.SimpleNamespace(ptr=77), spec=FLOAT32_SUM)
            == abi.LAUNCH_OK
        )
    assert len(fake.loaded) == len(specs) * len(build.gpu_sources()), "a launch after prepare() loaded a module"
    assert {dev for dev, _ in fake.launched} == {1} and fake.current == 0, "launch must run on the kernels' device"
    assert all(a[1] == 2 and a[4] == 512 and a[8] == 77 for _, a in fake.launched)
    with pytest.raises(build.KernelError, match="no GPU kernel"):
        kernels.launch("commref_copy", 1, 1, record)
    assert kernels.max_active_blocks(abi.KERNEL_NAMES[0], None, 512) == 4
    assert kernels.max_active_blocks(abi.KERNEL_NAMES[0], None, 1024) == 0, "above max_threads the kernel cannot run"


def test_cuda_kernels_are_shared_by_thread_ranks(monkeypatch, tmp_path):
    FakeCuda(monkeypatch, tmp_path)
    monkeypatch.setattr(gpu_loader, "_cuda_modules", {})
    got = []
    threads = [threading.Thread(target=lambda: got.append(gpu_loader.cuda_kernels(0))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(k) for k in got}) == 1


def test_every_gpu_module_builds_with_the_loaders_nvrtc(nvrtc, tmp_path, monkeypatch):
    """build_gpu_images (what gpu_check.sh runs before any rank starts): every kernel
    file, for the data-movement module and a reduction module, through the loader's own
    NVRTC options, in worker processes, into the cache."""
    monkeypatch.setenv("COMMREF_CACHE_DIR", str(tmp_path))
    images = gpu_loader.build_gpu_images([None, FLOAT32_SUM], 90)
    assert len(images) == 2 * len(build.gpu_sources()) == len(set(images))
    for image in images:
        assert image.parent == tmp_path / "gpu" and image.read_bytes()[:4] == b"\x7fELF", image
    assert gpu_loader.build_gpu_images([None, FLOAT32_SUM], 90) == images, "a second build did not find the cache"


def test_stack_limit_is_set_before_any_launch_and_every_kernel_is_loaded_at_load(monkeypatch, tmp_path):
    """The device's stack limit is STACK_BYTES from CudaKernels' construction, before any
    kernel loads or runs, and set once: no launch makes the driver grow local memory
    (which waits for the spinning kernels of ranks sharing the GPU). Every kernel is
    loaded when its module loads (cuFuncLoad), not at its first launch."""
    fake = FakeCuda(monkeypatch, tmp_path)
    kernels = gpu_loader.CudaKernels(1)
    assert fake.events == [("setLimit", 1, gpu_loader.STACK_BYTES)] and fake.current == 0
    assert kernels.stack_bytes == gpu_loader.STACK_BYTES > 1488, "the largest frame (direct_allreduce) must fit"
    kernels.prepare([None, FLOAT32_SUM])
    record = np.zeros(1, dtype=abi.COLL_ARGS)
    for name in abi.KERNEL_NAMES:
        kernels.launch(name, 1, 32, record, spec=FLOAT32_SUM)
    loads = [e[1] for e in fake.events if e[0] == "funcLoad"]
    assert sorted(loads) == sorted(kernels._fn.values()) and len(loads) == 2 * len(abi.KERNEL_NAMES), loads
    first_launch = [e[0] for e in fake.events].index("launch")
    assert all(e[0] == "launch" for e in fake.events[first_launch:]), "a kernel loaded after the launches began"
    assert [e for e in fake.events if e[0] == "setLimit"] == [("setLimit", 1, gpu_loader.STACK_BYTES)]
    gpu_loader.CudaKernels(1)  # another instance on that device: the limit is already there
    assert len([e for e in fake.events if e[0] == "setLimit"]) == 1


def test_a_frame_above_the_limit_raises_it_when_its_module_loads(monkeypatch, tmp_path):
    big = abi.KERNEL_NAMES[0]
    fake = FakeCuda(monkeypatch, tmp_path, local_bytes=lambda name: 4096 if name == big else 512)
    kernels = gpu_loader.CudaKernels(0)
    kernels.function(big)
    assert [e for e in fake.events if e[0] == "setLimit"] == [
        ("setLimit", 0, gpu_loader.STACK_BYTES),
        ("setLimit", 0, 4096),
    ]
    record = np.zeros(1, dtype=abi.COLL_ARGS)
    kernels.launch(big, 1, 32, record)
    assert fake.events[-1] == ("launch", 0) and fake.limit[0] == 4096


@pytest.mark.parametrize(
    "driver, expect",
    [("none", False), ("old", False), ("unsupported", False), ("loads", True), ("fails", "KernelError")],
)
def test_func_load_falls_back_where_the_driver_lacks_it(monkeypatch, driver, expect):
    """cuFuncLoad exists from driver 12.4: without the library or the symbol, or where the
    driver answers CUDA_ERROR_NOT_SUPPORTED, the kernel loads at its first launch as
    before (False); any other failure is a KernelError naming the kernel."""
    libs = {
        "none": None,
        "old": types.SimpleNamespace(),
        "unsupported": types.SimpleNamespace(cuFuncLoad=lambda fn: gpu_loader.CUDA_ERROR_NOT_SUPPORTED),
        "loads": types.SimpleNamespace(cuFuncLoad=lambda fn: 0),
        "fails": types.SimpleNamespace(cuFuncLoad=lambda fn: 200),
    }
    monkeypatch.setattr(gpu_loader, "_libcuda", lambda: libs[driver])
    if expect == "KernelError":
        with pytest.raises(build.KernelError, match=r"cuFuncLoad\(k\) failed with CUresult 200"):
            gpu_loader.func_load(0x1234, "k")
    else:
        assert gpu_loader.func_load(0x1234, "k") is expect
