"""Loads the one kernel source for the device at hand.

- CPU: every kernel file (kernels/*.cu), the CPU execution engine (cpu/engine.cpp)
  and the ABI table (cpu/abi.cpp) are compiled with the host C++ compiler as separate
  translation units into one shared library, called through ctypes.
- GPU: each kernel file that holds kernels of abi.KERNEL_NAMES is compiled by NVRTC
  through ``cupy.RawModule``, one module per (file, specialization), and every kernel
  of a module is loaded as soon as the module is built.

Builds are cached: the CPU library under ``$COMMREF_CACHE_DIR`` (default
``~/.cache/commref``) keyed by a hash of every source file, the compiler, and the
flags (build_library); CuPy keys its own cache by source and options. Concurrent ranks
building the same key wait on a file lock and reuse one build.
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
NVRTC_OPTIONS = ("-std=c++17",)

class KernelError(RuntimeError):
    """A kernel could not be built or launched (not a communication failure)."""


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


def _hash_inputs(cxx: str, sources: list[Path], include_dirs: tuple[Path, ...], flags: tuple[str, ...],
                 defines: tuple[str, ...]) -> str:
    """A key of the build: the contents (and names) of every source and of every header
    under `include_dirs`, the compiler and its version, the flags and the defines. Where
    the files lie does not count, so that checkouts of the same sources share builds."""
    h = hashlib.sha256()
    named = [(src.name, src) for src in sources]
    for d in include_dirs:
        named += [(str(f.relative_to(d)), f) for f in sorted(Path(d).rglob("*"))
                  if f.is_file() and f.suffix in (".h", ".hpp", ".cuh")]
    for name, f in named:
        h.update(f"{name}\0{f.stat().st_size}\0".encode())
        h.update(f.read_bytes())
    h.update(cxx.encode())
    h.update(_compiler_version(cxx).encode())
    h.update(repr((flags, defines)).encode())
    return h.hexdigest()[:20]


def _compile_object(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def build_library(name: str, sources: list[Path], flags: tuple[str, ...] = CPU_FLAGS, defines=(),
                  include_dirs=()) -> Path:
    """Compiles `sources` (C++; `.cu` files too) as separate translation units and links
    them into one shared library `lib<name>-<hash>.so` under cache_dir(), or finds it
    there. The key hashes every source, every header under `include_dirs` (so headers
    the sources include must lie there), the compiler and its version, the flags and
    the defines; ranks building the same key wait on a
    file lock and reuse one build. `flags` apply to compiling and linking (they should
    hold -shared and -fPIC); `defines` are given as "NAME" or "NAME=VALUE"."""
    cxx = host_compiler()
    sources = [Path(s) for s in sources]
    include_dirs = tuple(Path(d) for d in include_dirs)
    flags, defines = tuple(flags), tuple(defines)
    key = _hash_inputs(cxx, sources, include_dirs, flags, defines)
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"lib{name}-{key}.so"
    if lib.exists():
        return lib
    with open(out_dir / f"lib{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        common = [*flags, *(f"-D{d}" for d in defines), *(a for d in include_dirs for a in ("-I", str(d)))]
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f"lib{name}-{key}.") as tmpdir:
            objects = [Path(tmpdir) / f"{i}-{src.stem}.o" for i, src in enumerate(sources)]
            cmds = [[cxx, *common, "-c", "-x", "c++", str(src), "-x", "none", "-o", str(obj)]
                    for src, obj in zip(sources, objects)]
            workers = max(1, min(len(cmds), os.cpu_count() or 1))
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                procs = list(pool.map(_compile_object, cmds))
            for cmd, proc in zip(cmds, procs):
                if proc.returncode != 0:
                    raise KernelError(f"building {name} failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
            tmp = Path(tmpdir) / f"lib{name}.so"
            cmd = [cxx, *flags, *map(str, objects), "-o", str(tmp)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise KernelError(f"linking {name} failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
            os.replace(tmp, lib)
    return lib


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

    def prepare(self, specs) -> None:
        """Nothing to do: the CPU library holds every instance."""

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


_cpu_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _cpu_kernels(defines: tuple[str, ...]) -> CpuKernels:
    return CpuKernels(build_cpu_library(defines=defines))


def cpu_kernels(defines: tuple[str, ...] = ()) -> CpuKernels:
    """The CPU library, built once per process (ThreadWorld ranks share it)."""
    with _cpu_lock:
        return _cpu_kernels(tuple(defines))


def gpu_source(path: Path) -> str:
    """The text NVRTC compiles for one kernel file. It starts with a hash of every
    source file, so that CuPy's cache (keyed by the text and the options) misses when a
    header changes."""
    h = hashlib.sha256()
    for f in source_files():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return f'// commref sources {h.hexdigest()[:20]}\n#line 1 "{path.name}"\n' + path.read_text()


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


class CudaKernels:
    """The kernels compiled by NVRTC for the current CUDA device (through CuPy, which
    caches binaries on disk keyed by source and options). One module per (kernel file,
    specialization), compiled on first use or by prepare(); building a module loads
    every kernel in it."""

    device = "cuda"

    def __init__(self, device_id: int):
        self.device_id = device_id
        self._modules: dict[tuple[Path, tuple[str, ...]], object] = {}
        self._fn: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def module(self, path: Path, defines: tuple[str, ...]):
        with self._lock:
            mod = self._modules.get((path, defines))
            if mod is None:
                import cupy

                options = (*NVRTC_OPTIONS, f"-I{INCLUDE_DIR}", *(f"-D{d}" for d in defines))
                names = [n for n, f in kernel_files().items() if f == path and n in abi.KERNEL_NAMES]
                with cupy.cuda.Device(self.device_id):
                    mod = cupy.RawModule(code=gpu_source(path), options=options)
                    mod.compile()
                    for name in names:  # load every entry point now, not mid-collective
                        mod.get_function(name)
                self._modules[(path, defines)] = mod
            return mod

    def prepare(self, specs) -> None:
        """Compiles and loads the modules for these (dtype code, op code) specs (None:
        data movement), every kernel file each. Call it while no collective kernel runs:
        loading a module can wait for running kernels, which may be waiting for this rank."""
        for spec in specs:
            for path in gpu_sources():
                self.module(path, specialization(spec))

    def launch(self, name: str, grid: int, block: int, args: np.ndarray, stream=None,
               spec: tuple[int, int] | None = None, address: int | None = None) -> int:
        """Enqueues kernel `name` on `stream`; failures surface at synchronization."""
        key = (name, spec)
        fn = self._fn.get(key)
        if fn is None:
            path = kernel_files().get(name)
            if path is None or name not in abi.KERNEL_NAMES:
                raise KernelError(f"no GPU kernel named {name!r} (abi.KERNEL_NAMES)")
            fn = self._fn[key] = self.module(path, specialization(spec)).get_function(name)
        fn((grid,), (block,), (args[0],), stream=stream)
        return abi.LAUNCH_OK


_cuda_lock = threading.Lock()
_cuda_modules: dict[int, CudaKernels] = {}


def cuda_kernels(device_id: int) -> CudaKernels:
    """The module for `device_id`, compiled once per process (ThreadWorld ranks share it)."""
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


if __name__ == "__main__":  # python -m commref.device_kernels.loader: build the CPU library
    print(build_cpu_library())
    sys.exit(0)
