"""The GPU build and launch: each kernel file that holds kernels of abi.KERNEL_NAMES is
compiled by NVRTC (CuPy's bindings) into a cubin (or PTX where NVRTC does not know the
device's architecture), one module per (file, specialization), cached under
build.cache_dir() by build.build_key (the file, every header, the options, the NVRTC
version); loaded with every kernel in it resolved at once, and launched through the
driver (CudaKernels, one per device and process: cuda_kernels). nvcc_compile_check
builds every kernel file with nvcc, a build check that runs nothing.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from . import abi, build
from .build import INCLUDE_DIR, CompileError, KernelError, gpu_sources, kernel_files

# Kernels of different ranks spin on each other's flags. Lazy module loading (the CUDA
# default since 12.2) may load a kernel while such kernels run and wait for them: load
# eagerly. Only takes effect if set before CUDA is initialised in this process; where it
# was initialised before, load_function() loads each kernel explicitly (cuFuncLoad).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

# Per-thread stack (bytes) set on each device before any commref kernel runs
# (ensure_stack): above the driver's default (1 KiB), the first launch of a kernel with a
# larger frame makes the driver grow local memory, which waits for all earlier work on
# the device, the spinning kernels of ranks that share the GPU included. Every kernel's
# frame fits (tests/test_compile.py checks ptxas' figures against it); a module loaded
# later with a larger one raises the limit at its load (load_function).
STACK_BYTES = 2048
CUDA_ERROR_NOT_SUPPORTED = 801


# The functor that serves each reduction operator (COMMREF_FOR_OP in reduce.h; avg
# reduces with OpSum and divides at the end), and the op codes each functor serves.
_FUNCTOR_OF_OP = {"sum": "OpSum", "prod": "OpProd", "max": "OpMax", "min": "OpMin", "avg": "OpSum"}
OP_FUNCTORS = {
    code: (_FUNCTOR_OF_OP[op], sum(1 << c for o, c in abi.OP_CODES.items() if _FUNCTOR_OF_OP[o] == _FUNCTOR_OF_OP[op]))
    for op, code in abi.OP_CODES.items()
}
# The module for kernels that move data only: the reduction kernels compile to stubs.
DATA_ONLY_DEFINES = (
    "COMMREF_ONLY_T=uint8_t",
    "COMMREF_ONLY_OP=OpSum",
    f"COMMREF_ONLY_DTYPE={abi.DTYPE_CODES['uint8']}",
    "COMMREF_ONLY_OPMASK=0",
)


def specialization(spec: tuple[int, int] | None) -> tuple[str, ...]:
    """Defines of the GPU module that holds the kernels for (dtype code, op code);
    None selects the data-movement module. One (type, functor) instance costs ptxas
    seconds, so the GPU compiles the instances it is asked for, not all forty."""
    if spec is None:
        return DATA_ONLY_DEFINES
    dtype, op = spec
    functor, mask = OP_FUNCTORS[op]
    return (
        f"COMMREF_ONLY_T={abi.CXX_TYPES[dtype]}",
        f"COMMREF_ONLY_OP={functor}",
        f"COMMREF_ONLY_DTYPE={dtype}",
        f"COMMREF_ONLY_OPMASK={mask}",
    )


def all_specializations() -> list[tuple[str, ...]]:
    """Every distinct module defines: data movement, and each dtype with each functor."""
    specs = {specialization(None)}
    for dtype in abi.CXX_TYPES:
        for op in abi.OP_CODES.values():
            specs.add(specialization((dtype, op)))
    return sorted(specs)


# NVRTC options of every GPU module. Denormals are kept and divisions and square roots
# rounded as IEEE 754 says (CuPy's own RawModule cache adds -ftz=true, which would flush
# float32 and bfloat16 denormals and break the bit-exact contract); no multiply-add
# contraction, so results do not depend on what the compiler fuses.
NVRTC_OPTIONS = ("-std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=false")


@functools.cache
def _nvrtc():
    """CuPy's NVRTC bindings, with a library loaded: the one CuPy finds (CUDA_PATH, the
    system, CuPy 14's search), else the one cuda-pathfinder finds (the NVIDIA wheel that
    the cuda12 and cuda13 extras install, which CuPy 13 does not look for)."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:
        raise KernelError("the GPU loader needs CuPy (pip install 'commref[cuda12]' or '[cuda13]')") from e
    try:
        nvrtc.getVersion()
    except RuntimeError as e:
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib

            load_nvidia_dynamic_lib("nvrtc")
            nvrtc.getVersion()
        except Exception as e2:  # noqa: BLE001 - any failure here means: no NVRTC
            raise KernelError(
                f"no NVRTC library: CuPy says {e}; cuda-pathfinder says {e2} "
                f"(pip install nvidia-cuda-nvrtc-cu12 or nvidia-cuda-nvrtc, or set CUDA_PATH)"
            ) from None
    return nvrtc


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


@functools.cache
def gpu_target(compute_capability: int) -> tuple[str, str]:
    """(NVRTC's --gpu-architecture option, "cubin" or "ptx") for a device: machine code
    for its architecture where this NVRTC knows it, else PTX of the newest architecture
    NVRTC knows below it, which the driver compiles at load time."""
    supported = [int(a) for a in _nvrtc().getSupportedArchs()]
    if compute_capability in supported:
        return f"--gpu-architecture=sm_{compute_capability}", "cubin"
    older = [a for a in supported if a < compute_capability]
    if not older:
        raise KernelError(
            f"NVRTC {nvrtc_version()} cannot compile for compute capability {compute_capability} "
            f"(it supports {supported})"
        )
    return f"--gpu-architecture=compute_{max(older)}", "ptx"


def nvrtc_options(target: str, defines: tuple[str, ...], include_dir: Path = INCLUDE_DIR) -> tuple[str, ...]:
    return (*NVRTC_OPTIONS, target, f"-I{include_dir}", *(f"-D{d}" for d in defines))


def gpu_image_path(
    path: Path, defines: tuple[str, ...], target: str, kind: str, include_dir: Path = INCLUDE_DIR
) -> Path:
    """Where the cache keeps the image of one kernel file for one specialization and
    target. The key hashes the kernel file, every header under `include_dir`, the
    options and the NVRTC version: editing a header builds anew."""
    options = nvrtc_options(target, defines, Path("include"))
    key = build.build_key([path], (include_dir,), "nvrtc", nvrtc_version(), options)
    arch = target.split("=")[1]
    return build.cache_dir() / "gpu" / f"{path.stem}-{arch}-{key}.{kind}"


def compile_gpu_image(
    path: Path, defines: tuple[str, ...], target: str, kind: str, include_dir: Path = INCLUDE_DIR
) -> bytes:
    """Compiles one kernel file with NVRTC: a cubin or PTX (NUL-terminated, as the
    driver loads it)."""
    nvrtc = _nvrtc()
    options = nvrtc_options(target, defines, include_dir)
    prog = nvrtc.createProgram(path.read_text(), path.name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(
                f"NVRTC {nvrtc_version()} failed on {path.name} ({e}), options {' '.join(options)}:\n{log[-6000:]}", log
            ) from None
        return nvrtc.getCUBIN(prog) if kind == "cubin" else nvrtc.getPTX(prog).rstrip(b"\0") + b"\0"
    finally:
        nvrtc.destroyProgram(prog)


def build_gpu_image(path: Path, spec, compute_capability: int, include_dir: Path = INCLUDE_DIR) -> Path:
    """The cached image of kernel file `path` for `spec` (see specialization()) and a
    device of `compute_capability` (e.g. 90), compiled if the cache lacks it. Needs NVRTC,
    not a GPU."""
    target, kind = gpu_target(compute_capability)
    defines = specialization(spec)
    return build.build_once(
        gpu_image_path(path, defines, target, kind, include_dir),
        lambda out: out.write_bytes(compile_gpu_image(path, defines, target, kind, include_dir)),
    )


def build_user_gpu_image(path: Path, compute_capability: int) -> Path:
    """The cached image of a user's kernel file (device_api.Kernel) for a device of
    `compute_capability`: compiled by NVRTC with the collectives' options, no
    specialization."""
    target, kind = gpu_target(compute_capability)
    return build.build_once(
        gpu_image_path(path, (), target, kind), lambda out: out.write_bytes(compile_gpu_image(path, (), target, kind))
    )


def _build_gpu_image_args(args) -> str:
    return str(build_gpu_image(*args))


def build_gpu_images(specs, compute_capability: int, workers: int | None = None) -> list[Path]:
    """Builds (or finds) every GPU module of `specs` for `compute_capability`, one
    process per NVRTC compile: what ranks on a fresh machine would otherwise compile
    one by one at their first calls."""
    jobs = [(path, spec, compute_capability) for spec in dict.fromkeys(specs) for path in gpu_sources()]
    workers = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        return [Path(p) for p in pool.map(_build_gpu_image_args, jobs)]


def launch_arguments(function: int, grid: int, block: int, stream: int, param: ctypes.c_void_p) -> tuple:
    """The arguments of CuPy's driver.launchKernel (cuLaunchKernel) for a kernel whose
    one parameter is a struct: kernelParams is an array of one pointer, to the struct's
    bytes, which `param` holds (the caller keeps it alive until the call returns; the
    driver copies the struct at launch). Integers only: no CuPy version converts them
    differently."""
    return (function, grid, 1, 1, block, 1, 1, 0, stream, ctypes.addressof(param), 0)


def stream_handle(stream) -> int:
    """A CUstream handle: a CuPy stream's `ptr`, an integer handle, or 0 (None)."""
    if stream is None:
        return 0
    return int(getattr(stream, "ptr", stream))


@functools.cache
def _libcuda():
    """The CUDA driver library (ctypes), None where it cannot be loaded."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def func_load(function, name: str) -> bool:
    """Loads kernel `function` (a CUfunction: its address, or cuda-python's handle) now,
    cuFuncLoad (driver 12.4 and later), so that no launch loads it while other ranks'
    kernels spin. False where the driver has no cuFuncLoad (it then loads at the first
    launch unless CUDA_MODULE_LOADING=EAGER took effect); raises KernelError where the
    driver fails to load it."""
    lib = _libcuda()
    load = getattr(lib, "cuFuncLoad", None) if lib is not None else None
    if load is None:
        return False
    load.argtypes, load.restype = [ctypes.c_void_p], ctypes.c_int
    status = load(ctypes.c_void_p(int(function)))
    if status == CUDA_ERROR_NOT_SUPPORTED:
        return False
    if status != 0:
        raise KernelError(f"cuFuncLoad({name}) failed with CUresult {status}")
    return True


_stack_lock = threading.Lock()
_stack_bytes: dict[int, int] = {}  # device -> the per-thread stack set there by ensure_stack


def ensure_stack(device_id: int, nbytes: int) -> int:
    """Makes the per-thread stack limit of `device_id` at least `nbytes`
    (cudaLimitStackSize) and returns it. Setting it waits for the device's earlier work,
    so it is done when kernels load, before their launches (CudaKernels sets STACK_BYTES
    before any commref kernel runs); a larger frame raises it once more."""
    from cupy.cuda import runtime

    with _stack_lock:
        have = _stack_bytes.get(device_id)
        if have is not None and have >= nbytes:
            return have
        current = runtime.getDevice()
        runtime.setDevice(device_id)
        try:
            have = int(runtime.deviceGetLimit(runtime.cudaLimitStackSize))
            if have < nbytes:
                runtime.deviceSetLimit(runtime.cudaLimitStackSize, nbytes)
                have = int(runtime.deviceGetLimit(runtime.cudaLimitStackSize))
        finally:
            runtime.setDevice(current)
        _stack_bytes[device_id] = have
        return have


def load_function(module, name: str, device_id: int) -> int:
    """Kernel `name` of a loaded CuPy module on `device_id` (current), resolved and
    loaded now (func_load), with the device's stack limit raised to its frame if it is
    larger (ensure_stack): the CUfunction, for launches that load and resize nothing."""
    from cupy.cuda import driver

    function = int(module.get_function(name).ptr)
    func_load(function, name)
    local = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, function)
    ensure_stack(device_id, int(local))
    return function


class CudaKernels:
    """The kernels of one CUDA device: one module per (kernel file, specialization),
    compiled by NVRTC into the image cache (build_gpu_image) and loaded on first use or
    by prepare(); loading a module resolves and loads every kernel in it (load_function).
    The device's stack limit is STACK_BYTES from construction on. Launches go through the
    driver (launch_arguments)."""

    device = "cuda"

    def __init__(self, device_id: int):
        import cupy
        from cupy.cuda import driver, runtime

        dev = cupy.cuda.Device(device_id)
        self.device_id = device_id
        self.compute_capability = int(dev.compute_capability)
        self.sm_count = int(dev.attributes["MultiProcessorCount"])
        self._driver, self._runtime = driver, runtime
        self._modules: dict[tuple[Path, object], object] = {}
        self._fn: dict[tuple[str, object], int] = {}
        self._lock = threading.Lock()
        self.stack_bytes = ensure_stack(device_id, STACK_BYTES)  # before any of these kernels runs

    def _load(self, path: Path, spec) -> None:
        """Loads the module of (path, spec) and resolves its kernels."""
        with self._lock:
            if (path, spec) in self._modules:
                return
            image = build_gpu_image(path, spec, self.compute_capability).read_bytes()
            import cupy
            from cupy.cuda import function

            with cupy.cuda.Device(self.device_id):
                mod = function.Module()
                mod.load(image)
                for name, where in kernel_files().items():
                    if where == path and name in abi.KERNEL_NAMES:
                        self._fn[(name, spec)] = load_function(mod, name, self.device_id)
            self._modules[(path, spec)] = mod

    def function(self, name: str, spec=None) -> int:
        """The CUfunction of kernel `name` in the module of `spec`, loading it if needed."""
        fn = self._fn.get((name, spec))
        if fn is None:
            path = kernel_files().get(name)
            if path is None or name not in abi.KERNEL_NAMES:
                raise KernelError(f"no GPU kernel named {name!r} (abi.KERNEL_NAMES)")
            self._load(path, spec)
            fn = self._fn[(name, spec)]
        return fn

    def prepare(self, specs) -> None:
        """Compiles and loads the modules for these (dtype code, op code) specs (None:
        data movement), every kernel file each. Call it while no collective kernel runs:
        loading a module can wait for running kernels, which may be waiting for this rank."""
        specs = list(dict.fromkeys(specs))
        missing = [s for s in specs for p in gpu_sources() if (p, s) not in self._modules]
        if len(missing) > 1:
            build_gpu_images(missing, self.compute_capability)
        for spec in specs:
            for path in gpu_sources():
                self._load(path, spec)

    def max_threads(self, name: str, spec=None) -> int:
        """The most threads per block kernel `name` can be launched with (its registers decide)."""
        d = self._driver
        return d.funcGetAttribute(d.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, self.function(name, spec))

    def max_active_blocks(self, name: str, spec, threads: int) -> int:
        """How many blocks of kernel `name` with `threads` threads each fit on one SM at
        once; 0 when the kernel cannot be launched with that many threads."""
        if threads > self.max_threads(name, spec):
            return 0
        return self._driver.occupancyMaxActiveBlocksPerMultiprocessor(self.function(name, spec), threads, 0)

    def launch(
        self,
        name: str,
        grid: int,
        block: int,
        args: np.ndarray,
        stream=None,
        spec: tuple[int, int] | None = None,
        address: int | None = None,
    ) -> int:
        """Enqueues kernel `name` on `stream` (a CuPy stream or a CUstream handle; None:
        the legacy default stream) with the one-record array `args` (`address`: its
        address, if known). A failed kernel writes its ErrorRecord and returns; the
        launch itself raises only for launch errors."""
        fn = self._fn.get((name, spec)) or self.function(name, spec)
        param = ctypes.c_void_p(address or args.ctypes.data)
        current = self._runtime.getDevice()
        if current != self.device_id:
            self._runtime.setDevice(self.device_id)
        try:
            self._driver.launchKernel(*launch_arguments(fn, grid, block, stream_handle(stream), param))
        finally:
            if current != self.device_id:
                self._runtime.setDevice(current)
        return abi.LAUNCH_OK


_cuda_lock = threading.Lock()
_cuda_modules: dict[int, CudaKernels] = {}


def cuda_kernels(device_id: int) -> CudaKernels:
    """The kernels of `device_id`, one instance per process (ThreadWorld ranks share it)."""
    with _cuda_lock:
        mod = _cuda_modules.get(device_id)
        if mod is None:
            mod = _cuda_modules[device_id] = CudaKernels(device_id)
        return mod


def nvcc_compile_check(
    arch: str = "sm_90",
    nvcc: str | None = None,
    defines: tuple[str, ...] = (),
    flags: tuple[str, ...] = (),
    sources: list[Path] | None = None,
    output: str = "cubin",
) -> subprocess.CompletedProcess:
    """Compiles kernel files (`sources`; default every one, kernels/*.cu, each its own
    translation unit) with the defines of one specialization (see specialization()) for
    `arch` with nvcc: a build check, nothing runs. `flags`: more nvcc options (-Xptxas -v
    for each kernel's registers, stack and spills). `output`: "cubin" (through ptxas,
    what the loader builds) or "ptx" (the C++ front end and NVVM only). One nvcc per
    file, in parallel; the result's returncode is the worst of them and its
    stdout/stderr hold every file's, each headed by the file."""
    if output not in ("cubin", "ptx"):
        raise ValueError(f"output must be 'cubin' or 'ptx', not {output!r}")
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise KernelError("nvcc not found")
    with tempfile.TemporaryDirectory() as d:
        cmds = [
            [
                nvcc,
                f"-arch={arch}",
                "-std=c++17",
                f"-{output}",
                *flags,
                "-I",
                str(INCLUDE_DIR),
                *(f"-D{x}" for x in defines),
                "-o",
                os.path.join(d, f"{src.stem}.{output}"),
                str(src),
            ]
            for src in (build.kernel_sources() if sources is None else sources)
        ]
        with concurrent.futures.ThreadPoolExecutor(len(cmds)) as pool:
            procs = list(pool.map(build.run_compiler, cmds))
    return subprocess.CompletedProcess(
        args=cmds,
        returncode=max((p.returncode for p in procs), key=abs),
        stdout="".join(f"== {c[-1]}\n{p.stdout}" for c, p in zip(cmds, procs) if p.stdout),
        stderr="".join(f"== {c[-1]}\n{p.stderr}" for c, p in zip(cmds, procs) if p.stderr),
    )
