"""The CPU build: every kernel file (kernels/*.cu), the CPU execution engine
(cpu/engine.cpp) and the ABI table (cpu/abi.cpp) compiled with the host C++ compiler as
separate translation units into one shared library (build_library, cached under
build.cache_dir() by build.build_key: the sources and headers, the compiler and its
version, the flags), loaded through ctypes (CpuKernels, one per process: cpu_kernels).
A repeated launch is a call bound once (CpuKernels.bind): through the commref_pycall
extension (cpu/pycall.cpp, built the same way against this Python's headers) where it
builds, through ctypes where it cannot (no Python.h: `binding` says which).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import threading
from pathlib import Path

import numpy as np

from . import abi, build
from .build import ENGINE_SOURCE, INCLUDE_DIR, SOURCE_DIR, CompileError, KernelError

PYCALL_SOURCE = SOURCE_DIR / "cpu" / "pycall.cpp"

CPU_FLAGS = ("-O3", "-std=c++20", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden", "-fno-strict-aliasing")
# ThreadSanitizer build of the same sources (tests/test_tsan.py).
TSAN_FLAGS = ("-O1", "-g", "-std=c++20", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden", "-fsanitize=thread")


def host_compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise KernelError("no C++ compiler found (set CXX); the CPU engine builds the kernels with it")
    return cxx


@functools.cache
def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout


def build_library(
    name: str,
    sources: list[Path],
    flags: tuple[str, ...] = CPU_FLAGS,
    defines=(),
    include_dirs=(),
    system_headers=(),
    link=(),
) -> Path:
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
    key = build.build_key([*sources, *system_headers], include_dirs, cxx, _compiler_version(cxx), flags, defines, link)
    common = [
        *flags,
        *(f"-D{d}" for d in defines),
        *(a for d in include_dirs for a in ("-I", str(d))),
        *(a for d in dict.fromkeys(h.parent for h in system_headers) for a in ("-isystem", str(d))),
    ]

    def make(lib: Path) -> None:
        objects = [lib.parent / f"{i}-{src.stem}.o" for i, src in enumerate(sources)]
        cmds = [
            [cxx, *common, "-c", "-x", "c++", str(src), "-x", "none", "-o", str(obj)]
            for src, obj in zip(sources, objects)
        ]
        workers = max(1, min(len(cmds), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            procs = list(pool.map(build.run_compiler, cmds))
        for cmd, proc in zip(cmds, procs):
            if proc.returncode != 0:
                raise CompileError(f"building {name} failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}", proc.stderr)
        cmd = [cxx, *flags, *map(str, objects), *link, "-o", str(lib)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelError(f"linking {name} failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")

    return build.build_once(build.cache_dir() / f"lib{name}-{key}.so", make)


def build_user_cpu_library(source: Path, flags: tuple[str, ...] = CPU_FLAGS) -> Path:
    """A user's kernel file (device_api.Kernel), compiled with the CPU engine into a
    library of its own (its own engine: kernels register with the engine they are
    linked with). `flags`: TSAN_FLAGS for the ThreadSanitizer build (tests/test_tsan.py)."""
    return build_library(f"user-{source.stem}", [source, ENGINE_SOURCE], flags, ("COMMREF_CPU",), (INCLUDE_DIR,))


def build_cpu_library(flags: tuple[str, ...] = CPU_FLAGS, defines: tuple[str, ...] = ()) -> Path:
    """Compiles (or finds in the cache) the CPU library (kernels and engine) and returns its path."""
    return build_library("commref", build.cpu_sources(), flags, ("COMMREF_CPU", *defines), (INCLUDE_DIR,))


def pycall():
    """The commref_pycall extension (cpu/pycall.cpp: Bound, Arrays), built against this
    Python's and numpy's headers and loaded once per process; None where it cannot be
    (no Python.h, or a build that fails), or where COMMREF_CPU_BINDING=ctypes asks for
    the fallbacks (ctypes launches, Python's attribute checks)."""
    if os.environ.get("COMMREF_CPU_BINDING", "auto") == "ctypes":
        return None
    return _pycall_module()


@functools.cache
def _pycall_module():
    include = sysconfig.get_paths().get("include")
    header = Path(include) / "Python.h" if include else None
    if header is None or not header.is_file():
        return None
    numpy_header = Path(np.get_include()) / "numpy" / "ndarraytypes.h"
    abi_tag = sysconfig.get_config_var("SOABI") or "unknown"
    try:
        path = build_library(
            "pycall", [PYCALL_SOURCE], CPU_FLAGS, (f"COMMREF_PY_ABI={abi_tag}",), (), (header, numpy_header)
        )
    except (CompileError, KernelError):
        return None
    loader = importlib.machinery.ExtensionFileLoader("commref_pycall", str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("commref_pycall", loader))
    loader.exec_module(module)
    return module


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
        # run_group(descs, n): commref_cpu_launch_group, n LaunchDescs one after the other
        # in one entry; 0, or (i << 8) | the status of member i, the first that failed
        self.run_group = self._lib.commref_cpu_launch_group
        self.run_group.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        self.run_group.restype = ctypes.c_int
        self._entry: dict[str, int] = {}
        # bind(): the commref_pycall extension's Bound, or ctypes where it is missing
        extension = pycall()
        self._bound = None if extension is None else extension.Bound
        self.binding = "ctypes" if extension is None else "extension"

    def profile(self, reset: bool = False) -> dict[str, dict[str, int]] | None:
        """The profile build's counters (commref/profile.h) per phase: events, ns, bytes
        (zeroed after reading when `reset`); None where this is not the profile build."""
        words = (ctypes.c_uint64 * (3 * abi.PROFILE_PHASES))()
        if not self._lib.commref_cpu_profile(words, int(reset)):
            return None
        return {
            phase: dict(zip(("events", "ns", "bytes"), words[3 * k : 3 * k + 3], strict=True))
            for k, phase in PROFILE_PHASES.items()
        }

    def bind(self, group: bool, address: int, n: int = 0):
        """A call bound once: calling it (no arguments) runs
        commref_cpu_launch_prepared(address) (the LaunchDesc at `address`), or, for a
        `group`, commref_cpu_launch_group(address, n) (n LaunchDescs there), and returns
        its status. The caller keeps the descriptors alive while the call is used."""
        fn = self.run_group if group else self.run_prepared
        if self._bound is not None:
            entry = ctypes.cast(fn, ctypes.c_void_p).value
            return self._bound(entry, address, n) if group else self._bound(entry, address)
        if group:
            return functools.partial(fn, ctypes.c_void_p(address), ctypes.c_uint(n))
        return functools.partial(fn, ctypes.c_void_p(address))

    def entry(self, name: str) -> int:
        addr = self._entry.get(name)
        if addr is None:
            try:
                addr = ctypes.cast(getattr(self._lib, name), ctypes.c_void_p).value
            except AttributeError:
                raise KernelError(f"no kernel named {name!r} in {self.path}") from None
            self._entry[name] = addr
        return addr

    def launch(
        self, name: str, grid: int, block: int, args: np.ndarray, stream=None, spec=None, address: int | None = None
    ) -> int:
        """Runs kernel `name` with the one-record array `args` (`spec` is for the GPU
        loader's specialised modules; the CPU library holds every instance). Returns
        abi.LAUNCH_OK, or abi.LAUNCH_FAILED when the kernel aborted (its ErrorRecord
        says why); raises KernelError when the engine refuses the launch. The GIL is
        released meanwhile. `address`, if given, is args' address (saves looking it up
        on hot paths)."""
        status = self._launch(self.entry(name), address or args.ctypes.data, grid, block)
        if status == abi.LAUNCH_REFUSED:
            raise KernelError(f"the CPU engine could not run {name} with grid={grid} block={block}")
        if status == abi.LAUNCH_STUCK:
            raise KernelError(
                f"{name}: the threads of a block wait for each other at barriers that can never complete "
                f"(a warp scope whose other lanes wait at __syncthreads, or the reverse; coop.h)"
            )
        return status

    def prepared(self, name: str, grid: int, block: int, address: int) -> PreparedLaunch:
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
    """One CPU launch described once (abi.LAUNCH_DESC); `status = call()` runs it and
    returns what CpuKernels.launch returns, except that a refusal comes back as
    abi.LAUNCH_REFUSED for the caller to raise (refused()). The record at `address` must
    outlive it."""

    __slots__ = ("name", "grid", "block", "record", "call")

    def __init__(self, kernels: CpuKernels, name: str, grid: int, block: int, address: int):
        self.name, self.grid, self.block = name, grid, block
        self.record = np.zeros(1, dtype=abi.LAUNCH_DESC)
        self.record[0] = (kernels.entry(name), address, grid, block)
        self.call = kernels.bind(False, self.record.ctypes.data)

    def refused(self) -> KernelError:
        return KernelError(f"the CPU engine could not run {self.name} with grid={self.grid} block={self.block}")


_cpu_lock = threading.Lock()


@functools.cache
def _cpu_kernels(defines: tuple[str, ...]) -> CpuKernels:
    return CpuKernels(build_cpu_library(defines=defines))


# Set to 1: cpu_kernels() is the profile build (commref/profile.h; `commref bench --profile`).
PROFILE_ENV = "COMMREF_CPU_PROFILE"
# commref/profile.h's ProfilePhase names, by their codes
PROFILE_PHASES = {
    abi.PROFILE_COPY: "copy",
    abi.PROFILE_REDUCE: "reduce",
    abi.PROFILE_WAIT: "wait",
    abi.PROFILE_HELP: "help",
    abi.PROFILE_KERNEL: "kernel",
}


def profiling() -> bool:
    """Whether this process asks for the profile build (PROFILE_ENV=1)."""
    return os.environ.get(PROFILE_ENV, "0") == "1"


def cpu_kernels(defines: tuple[str, ...] = ()) -> CpuKernels:
    """The CPU library, built once per process (ThreadWorld ranks share it); the profile
    build where PROFILE_ENV asks for it."""
    if profiling() and "COMMREF_PROFILE" not in defines:
        defines = (*defines, "COMMREF_PROFILE")
    with _cpu_lock:
        return _cpu_kernels(tuple(defines))
