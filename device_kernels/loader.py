"""Loads the one kernel source for the device at hand.

- CPU: every kernel file (kernels/*.cu), the CPU execution engine (cpu/engine.cpp)
  and the ABI table (cpu/abi.cpp) are compiled with the host C++ compiler as separate
  translation units into one shared library, called through ctypes.
- GPU: each kernel file that holds kernels of abi.KERNEL_NAMES is compiled by NVRTC
  (CuPy's bindings) into a cubin, one module per (file, specialization), loaded with
  every kernel in it resolved at once, and launched through the driver.

Builds are cached under ``$COMMREF_CACHE_DIR`` (default ``~/.cache/commref``), keyed
by a hash of every source file and header, the compiler and its version, and the
flags (build_key): the CPU library, and each GPU image. Concurrent ranks building the
same key wait on a file lock and reuse one build.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from . import abi


# Kernels of different ranks spin on each other's flags. Lazy module loading (the CUDA
# default since 12.2) may load a kernel while such kernels run and wait for them: load
# eagerly. Only takes effect if set before CUDA is initialised in this process.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

SOURCE_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = SOURCE_DIR / "include"
KERNEL_DIR = SOURCE_DIR / "kernels"
ENGINE_SOURCE = SOURCE_DIR / "cpu" / "engine.cpp"
ABI_SOURCE = SOURCE_DIR / "cpu" / "abi.cpp"  # the ABI table; CPU build only

CPU_FLAGS = ("-O3", "-std=c++20", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden", "-fno-strict-aliasing")
# ThreadSanitizer build of the same sources (tests/test_tsan.py).
TSAN_FLAGS = ("-O1", "-g", "-std=c++20", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden", "-fsanitize=thread")


class KernelError(RuntimeError):
    """A kernel could not be built or launched (not a communication failure)."""


class CompileError(KernelError):
    """A source did not compile; `log` is the compiler's own message (file, line, error)."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


def kernel_sources() -> list[Path]:
    """The kernel files, each its own translation unit."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def source_files() -> list[Path]:
    """Every file the kernels and the CPU engine are built from."""
    return sorted(INCLUDE_DIR.rglob("*.h")) + cpu_sources()


def cpu_sources() -> list[Path]:
    """The translation units of the CPU library."""
    return [*kernel_sources(), ENGINE_SOURCE, ABI_SOURCE]


_KERNEL_DEFINITION = re.compile(r"^\s*COMMREF_KERNEL\(\s*(\w+)\s*,", re.MULTILINE)


@functools.lru_cache(maxsize=None)
def kernel_files() -> dict[str, Path]:
    """The kernel file that defines each kernel (its COMMREF_KERNEL line)."""
    where: dict[str, Path] = {}
    for f in kernel_sources():
        for name in _KERNEL_DEFINITION.findall(f.read_text()):
            if name in where:
                raise KernelError(f"kernel {name} is defined in both {where[name]} and {f}")
            where[name] = f
    return where


def gpu_sources() -> list[Path]:
    """The kernel files the GPU loads: those that define kernels of abi.KERNEL_NAMES."""
    where = kernel_files()
    missing = [n for n in abi.KERNEL_NAMES if n not in where]
    if missing:
        raise KernelError(f"no kernel file defines {missing} (abi.KERNEL_NAMES)")
    return sorted({where[n] for n in abi.KERNEL_NAMES})


def cache_dir() -> Path:
    return Path(os.environ.get("COMMREF_CACHE_DIR", Path.home() / ".cache" / "commref"))


def host_compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise KernelError("no C++ compiler found (set CXX); the CPU engine builds the kernels with it")
    return cxx


@functools.lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout


def build_key(sources: list[Path], include_dirs: tuple[Path, ...], *settings) -> str:
    """A key of a build: the contents (and names) of every source and of every header
    under `include_dirs`, and the `settings` (compiler and version, flags, defines,
    target). Where the files lie does not count, so checkouts of the same sources share
    builds."""
    h = hashlib.sha256()
    named = [(src.name, src) for src in sources]
    for d in include_dirs:
        named += [(str(f.relative_to(d)), f) for f in sorted(Path(d).rglob("*"))
                  if f.is_file() and f.suffix in (".h", ".hpp", ".cuh")]
    for name, f in named:
        h.update(f"{name}\0{f.stat().st_size}\0".encode())
        h.update(f.read_bytes())
    h.update(repr(settings).encode())
    return h.hexdigest()[:20]


def _build_once(target: Path, make) -> Path:
    """`target`, built by make(path in a private temporary folder) unless it exists.
    Processes building the same target wait on a file lock and reuse one build; the
    target appears whole (a rename) or not at all."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=target.name + ".") as tmpdir:
            tmp = Path(tmpdir) / target.name
            make(tmp)
            os.replace(tmp, target)
    return target


def _compile_object(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def build_library(name: str, sources: list[Path], flags: tuple[str, ...] = CPU_FLAGS, defines=(),
                  include_dirs=(), system_headers=(), link=()) -> Path:
    """Compiles `sources` (C++; `.cu` files too) as separate translation units and links
    them into one shared library `lib<name>-<key>.so` under cache_dir(), or finds it
    there. The key (build_key) hashes every source, every header under `include_dirs`
    (so headers the sources include must lie there), the compiler and its version, the
    flags, the defines and the link inputs. `flags` apply to compiling and linking (they
    should hold -shared and -fPIC); `defines` are given as "NAME" or "NAME=VALUE".
    `system_headers`: headers of other packages the sources include (an MPI's mpi.h):
    their folders are searched, their contents count in the key. `link`: linker inputs
    after the objects (a library's path, -Wl,-rpath,...)."""
    cxx = host_compiler()
    sources = [Path(s) for s in sources]
    include_dirs = tuple(Path(d) for d in include_dirs)
    system_headers = tuple(Path(h) for h in system_headers)
    flags, defines, link = tuple(flags), tuple(defines), tuple(link)
    key = build_key([*sources, *system_headers], include_dirs, cxx, _compiler_version(cxx), flags, defines, link)
    common = [*flags, *(f"-D{d}" for d in defines), *(a for d in include_dirs for a in ("-I", str(d))),
              *(a for d in dict.fromkeys(h.parent for h in system_headers) for a in ("-isystem", str(d)))]

    def make(lib: Path) -> None:
        objects = [lib.parent / f"{i}-{src.stem}.o" for i, src in enumerate(sources)]
        cmds = [[cxx, *common, "-c", "-x", "c++", str(src), "-x", "none", "-o", str(obj)]
                for src, obj in zip(sources, objects)]
        workers = max(1, min(len(cmds), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            procs = list(pool.map(_compile_object, cmds))
        for cmd, proc in zip(cmds, procs):
            if proc.returncode != 0:
                raise CompileError(f"building {name} failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}", proc.stderr)
        cmd = [cxx, *flags, *map(str, objects), *link, "-o", str(lib)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelError(f"linking {name} failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")

    return _build_once(cache_dir() / f"lib{name}-{key}.so", make)


def build_user_cpu_library(source: Path) -> Path:
    """A user's kernel file (device_api.Kernel), compiled with the CPU engine into a
    library of its own (its own engine: kernels register with the engine they are
    linked with)."""
    return build_library(f"user-{source.stem}", [source, ENGINE_SOURCE], CPU_FLAGS, ("COMMREF_CPU",), (INCLUDE_DIR,))


def build_cpu_library(flags: tuple[str, ...] = CPU_FLAGS, defines: tuple[str, ...] = ()) -> Path:
    """Compiles (or finds in the cache) the CPU library (kernels and engine) and returns its path."""
    return build_library("commref", cpu_sources(), flags, ("COMMREF_CPU", *defines), (INCLUDE_DIR,))


class CpuKernels:
    """The kernels compiled for the CPU engine; launch() blocks until the grid ends."""

    device = "cpu"

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._launch = self._lib.commref_cpu_launch
        self._launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        self._launch.restype = ctypes.c_int
        # run_prepared(desc): commref_cpu_launch_prepared, the launch a LaunchDesc describes
        self.run_prepared = self._lib.commref_cpu_launch_prepared
        self.run_prepared.argtypes = [ctypes.c_void_p]
        self.run_prepared.restype = ctypes.c_int
        self._entry: dict[str, int] = {}

    def entry(self, name: str) -> int:
        addr = self._entry.get(name)
        if addr is None:
            try:
                addr = ctypes.cast(getattr(self._lib, name), ctypes.c_void_p).value
            except AttributeError:
                raise KernelError(f"no kernel named {name!r} in {self.path}") from None
            self._entry[name] = addr
        return addr

    def launch(self, name: str, grid: int, block: int, args: np.ndarray, stream=None, spec=None,
               address: int | None = None) -> int:
        """Runs kernel `name` with the one-record array `args` (`spec` is for the GPU
        loader's specialised modules; the CPU library holds every instance). Returns
        abi.LAUNCH_OK, or abi.LAUNCH_FAILED when the kernel aborted (its ErrorRecord
        says why); raises KernelError when the engine refuses the launch. The GIL is
        released meanwhile. `address`, if given, is args' address (saves looking it up
        on hot paths)."""
        status = self._launch(self.entry(name), address or args.ctypes.data, grid, block)
        if status == abi.LAUNCH_REFUSED:
            raise KernelError(f"the CPU engine could not run {name} with grid={grid} block={block}")
        return status

    def prepared(self, name: str, grid: int, block: int, address: int) -> "PreparedLaunch":
        """Launch `name` with the argument record at `address`, described once (abi.LAUNCH_DESC)
        so that repeating it costs one argument's conversion: PreparedLaunch.run()."""
        return PreparedLaunch(self, name, grid, block, address)

    def prepare(self, specs) -> None:
        """Nothing to do: the CPU library holds every instance."""

    @functools.cached_property
    def protocol_support(self) -> int:
        """abi.CPU_ATOMIC_16 | abi.CPU_STORE_ORDER as this CPU guarantees them
        (commref_cpu_protocol_support(), cpu/engine.cpp: cpuid at run time)."""
        fn = self._lib.commref_cpu_protocol_support
        fn.restype = ctypes.c_uint32
        return int(fn())

    def abi_table(self) -> dict[str, int | str]:
        """The ABI as this build's headers define it (commref_abi_table(), cpu/abi.cpp):
        the table that abi.abi_table() builds from the Python side."""
        fn = self._lib.commref_abi_table
        fn.restype = ctypes.c_char_p
        table: dict[str, int | str] = {}
        for line in fn().decode().splitlines():
            name, kind, value = line.split("\t", 2)
            if name in table:
                raise KernelError(f"the ABI table of {self.path} lists {name!r} twice")
            table[name] = int(value) if kind == "i" else value
        return table


class PreparedLaunch:
    """One CPU launch described once (abi.LAUNCH_DESC); `status = run(desc)` runs it and
    returns what CpuKernels.launch returns, except that a refusal comes back as
    abi.LAUNCH_REFUSED for the caller to raise (refused()). The record at `address` must
    outlive it."""

    __slots__ = ("name", "grid", "block", "record", "desc", "run")

    def __init__(self, kernels: CpuKernels, name: str, grid: int, block: int, address: int):
        self.name, self.grid, self.block = name, grid, block
        self.record = np.zeros(1, dtype=abi.LAUNCH_DESC)
        self.record[0] = (kernels.entry(name), address, grid, block)
        self.desc = ctypes.c_void_p(self.record.ctypes.data)
        self.run = kernels.run_prepared

    def refused(self) -> KernelError:
        return KernelError(f"the CPU engine could not run {self.name} with grid={self.grid} block={self.block}")


_cpu_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _cpu_kernels(defines: tuple[str, ...]) -> CpuKernels:
    return CpuKernels(build_cpu_library(defines=defines))


def cpu_kernels(defines: tuple[str, ...] = ()) -> CpuKernels:
    """The CPU library, built once per process (ThreadWorld ranks share it)."""
    with _cpu_lock:
        return _cpu_kernels(tuple(defines))


# The functor that serves each reduction operator (COMMREF_FOR_OP in reduce.h; avg
# reduces with OpSum and divides at the end), and the op codes each functor serves.
_FUNCTOR_OF_OP = {"sum": "OpSum", "prod": "OpProd", "max": "OpMax", "min": "OpMin", "avg": "OpSum"}
OP_FUNCTORS = {
    code: (_FUNCTOR_OF_OP[op], sum(1 << c for o, c in abi.OP_CODES.items() if _FUNCTOR_OF_OP[o] == _FUNCTOR_OF_OP[op]))
    for op, code in abi.OP_CODES.items()
}
# The module for kernels that move data only: the reduction kernels compile to stubs.
DATA_ONLY_DEFINES = ("COMMREF_ONLY_T=uint8_t", "COMMREF_ONLY_OP=OpSum", f"COMMREF_ONLY_DTYPE={abi.DTYPE_CODES['uint8']}",
                     "COMMREF_ONLY_OPMASK=0")


def specialization(spec: tuple[int, int] | None) -> tuple[str, ...]:
    """Defines of the GPU module that holds the kernels for (dtype code, op code);
    None selects the data-movement module. One (type, functor) instance costs ptxas
    seconds, so the GPU compiles the instances it is asked for, not all forty."""
    if spec is None:
        return DATA_ONLY_DEFINES
    dtype, op = spec
    functor, mask = OP_FUNCTORS[op]
    return (f"COMMREF_ONLY_T={abi.CXX_TYPES[dtype]}", f"COMMREF_ONLY_OP={functor}", f"COMMREF_ONLY_DTYPE={dtype}",
            f"COMMREF_ONLY_OPMASK={mask}")


def all_specializations() -> list[tuple[str, ...]]:
    """Every distinct module defines: data movement, and each dtype with each functor."""
    specs = {specialization(None)}
    for dtype in abi.CXX_TYPES:
        for op in abi.OP_CODES.values():
            specs.add(specialization((dtype, op)))
    return sorted(specs)


# ---- GPU: NVRTC (through CuPy), images cached on disk, launched through the driver ----

# NVRTC options of every GPU module. Denormals are kept and divisions and square roots
# rounded as IEEE 754 says (CuPy's own RawModule cache adds -ftz=true, which would flush
# float32 and bfloat16 denormals and break the bit-exact contract); no multiply-add
# contraction, so results do not depend on what the compiler fuses.
NVRTC_OPTIONS = ("-std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=false")


@functools.lru_cache(maxsize=None)
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
            raise KernelError(f"no NVRTC library: CuPy says {e}; cuda-pathfinder says {e2} "
                              f"(pip install nvidia-cuda-nvrtc-cu12 or nvidia-cuda-nvrtc, or set CUDA_PATH)") from None
    return nvrtc


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


@functools.lru_cache(maxsize=None)
def gpu_target(compute_capability: int) -> tuple[str, str]:
    """(NVRTC's --gpu-architecture option, "cubin" or "ptx") for a device: machine code
    for its architecture where this NVRTC knows it, else PTX of the newest architecture
    NVRTC knows below it, which the driver compiles at load time."""
    supported = [int(a) for a in _nvrtc().getSupportedArchs()]
    if compute_capability in supported:
        return f"--gpu-architecture=sm_{compute_capability}", "cubin"
    older = [a for a in supported if a < compute_capability]
    if not older:
        raise KernelError(f"NVRTC {nvrtc_version()} cannot compile for compute capability {compute_capability} "
                          f"(it supports {supported})")
    return f"--gpu-architecture=compute_{max(older)}", "ptx"


def nvrtc_options(target: str, defines: tuple[str, ...], include_dir: Path = INCLUDE_DIR) -> tuple[str, ...]:
    return (*NVRTC_OPTIONS, target, f"-I{include_dir}", *(f"-D{d}" for d in defines))


def gpu_image_path(path: Path, defines: tuple[str, ...], target: str, kind: str,
                   include_dir: Path = INCLUDE_DIR) -> Path:
    """Where the cache keeps the image of one kernel file for one specialization and
    target. The key hashes the kernel file, every header under `include_dir`, the
    options and the NVRTC version: editing a header builds anew."""
    key = build_key([path], (include_dir,), "nvrtc", nvrtc_version(), nvrtc_options(target, defines, Path("include")))
    arch = target.split("=")[1]
    return cache_dir() / "gpu" / f"{path.stem}-{arch}-{key}.{kind}"


def compile_gpu_image(path: Path, defines: tuple[str, ...], target: str, kind: str,
                      include_dir: Path = INCLUDE_DIR) -> bytes:
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
            raise CompileError(f"NVRTC {nvrtc_version()} failed on {path.name} ({e}), options "
                               f"{' '.join(options)}:\n{log[-6000:]}", log) from None
        return nvrtc.getCUBIN(prog) if kind == "cubin" else nvrtc.getPTX(prog).rstrip(b"\0") + b"\0"
    finally:
        nvrtc.destroyProgram(prog)


def build_gpu_image(path: Path, spec, compute_capability: int, include_dir: Path = INCLUDE_DIR) -> Path:
    """The cached image of kernel file `path` for `spec` (see specialization()) and a
    device of `compute_capability` (e.g. 90), compiled if the cache lacks it. Needs NVRTC,
    not a GPU."""
    target, kind = gpu_target(compute_capability)
    defines = specialization(spec)
    return _build_once(gpu_image_path(path, defines, target, kind, include_dir),
                       lambda out: out.write_bytes(compile_gpu_image(path, defines, target, kind, include_dir)))


def build_user_gpu_image(path: Path, compute_capability: int) -> Path:
    """The cached image of a user's kernel file (device_api.Kernel) for a device of
    `compute_capability`: compiled by NVRTC with the collectives' options, no
    specialization."""
    target, kind = gpu_target(compute_capability)
    return _build_once(gpu_image_path(path, (), target, kind),
                       lambda out: out.write_bytes(compile_gpu_image(path, (), target, kind)))


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


class CudaKernels:
    """The kernels of one CUDA device: one module per (kernel file, specialization),
    compiled by NVRTC into the image cache (build_gpu_image) and loaded on first use or
    by prepare(); loading a module resolves every kernel in it. Launches go through the
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
                        self._fn[(name, spec)] = int(mod.get_function(name).ptr)
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

    def launch(self, name: str, grid: int, block: int, args: np.ndarray, stream=None,
               spec: tuple[int, int] | None = None, address: int | None = None) -> int:
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


def nvcc_compile_check(arch: str = "sm_90", nvcc: str | None = None,
                       defines: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Compiles every kernel file (kernels/*.cu, each its own translation unit) with
    the defines of one specialization (see specialization()) for `arch` with nvcc: a
    build check, nothing runs. One nvcc per file, in parallel; the result's returncode
    is the worst of them and its stdout/stderr hold every file's, each headed by the file."""
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise KernelError("nvcc not found")
    with tempfile.TemporaryDirectory() as d:
        cmds = [[nvcc, f"-arch={arch}", "-std=c++17", "-cubin", "-I", str(INCLUDE_DIR), *(f"-D{x}" for x in defines),
                 "-o", os.path.join(d, f"{src.stem}.cubin"), str(src)] for src in kernel_sources()]
        with concurrent.futures.ThreadPoolExecutor(len(cmds)) as pool:
            procs = list(pool.map(_compile_object, cmds))
    return subprocess.CompletedProcess(
        args=cmds, returncode=max((p.returncode for p in procs), key=abs),
        stdout="".join(f"== {c[-1]}\n{p.stdout}" for c, p in zip(cmds, procs) if p.stdout),
        stderr="".join(f"== {c[-1]}\n{p.stderr}" for c, p in zip(cmds, procs) if p.stderr))


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m commref.device_kernels.loader",
                                description="Builds the CPU library, or with --gpu the GPU images, into the cache.")
    p.add_argument("--gpu", type=int, metavar="CC", help="compute capability to build GPU images for (e.g. 90)")
    p.add_argument("--dtype", nargs="*", default=[], choices=sorted(abi.DTYPE_CODES), help="reduction dtypes")
    p.add_argument("--op", nargs="*", default=["sum", "prod", "max", "min"], choices=sorted(abi.OP_CODES))
    args = p.parse_args(argv)
    if args.gpu is None:
        print(build_cpu_library())
        return 0
    specs = [None, *((abi.DTYPE_CODES[d], abi.OP_CODES[o]) for d in args.dtype for o in args.op)]
    specs = list({specialization(s): s for s in specs}.values())  # avg shares sum's module
    for path in build_gpu_images(specs, args.gpu):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
