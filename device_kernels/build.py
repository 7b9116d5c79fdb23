"""What the CPU and the GPU builds share: where the sources lie and which kernel file
defines which kernel, the build cache (``$COMMREF_CACHE_DIR``, default
``~/.cache/commref``), the key of a build (build_key: a hash of every source file and
header and of the settings), building a target once across processes (build_once:
concurrent ranks building the same key wait on a file lock and reuse one build),
running a compiler, and the errors of building and launching kernels.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

from . import abi

SOURCE_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = SOURCE_DIR / "include"
KERNEL_DIR = SOURCE_DIR / "kernels"
ENGINE_SOURCE = SOURCE_DIR / "cpu" / "engine.cpp"
ABI_SOURCE = SOURCE_DIR / "cpu" / "abi.cpp"  # the ABI table; CPU build only


class KernelError(RuntimeError):
    """A kernel could not be built or launched (not a communication failure)."""


class CompileError(KernelError):
    """A source did not compile; `log` is the compiler's own message (file, line, error)."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


def kernel_sources() -> list[Path]:
    """The collectives' kernel files (kernels/*.cu), each its own translation unit.
    kernels/device_api/ holds kernels on the device API (MoE dispatch and combine), which
    their users build one at a time (device_api.Kernel), so they are not among these."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def source_files() -> list[Path]:
    """Every file the kernels and the CPU engine are built from."""
    return sorted(INCLUDE_DIR.rglob("*.h")) + cpu_sources()


def cpu_sources() -> list[Path]:
    """The translation units of the CPU library."""
    return [*kernel_sources(), ENGINE_SOURCE, ABI_SOURCE]


_KERNEL_DEFINITION = re.compile(r"^\s*COMMREF_KERNEL\(\s*(\w+)\s*,", re.MULTILINE)


@functools.cache
def reduction_sources() -> list[Path]:
    """The kernel files whose code depends on a reduction specialization's defines
    (gpu_loader.specialization): those that dispatch on (dtype, op) with
    COMMREF_DISPATCH_REDUCTION (reduce.h). The others compile to the same code under
    every specialization."""
    return [f for f in kernel_sources() if "COMMREF_DISPATCH_REDUCTION(" in f.read_text()]


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


def build_key(sources: list[Path], include_dirs: tuple[Path, ...], *settings) -> str:
    """A key of a build: the contents (and names) of every source and of every header
    under `include_dirs`, and the `settings` (compiler and version, flags, defines,
    target). Where the files lie does not count, so checkouts of the same sources share
    builds."""
    h = hashlib.sha256()
    named = [(src.name, src) for src in sources]
    for d in include_dirs:
        named += [
            (str(f.relative_to(d)), f)
            for f in sorted(Path(d).rglob("*"))
            if f.is_file() and f.suffix in (".h", ".hpp", ".cuh")
        ]
    for name, f in named:
        h.update(f"{name}\0{f.stat().st_size}\0".encode())
        h.update(f.read_bytes())
    h.update(repr(settings).encode())
    return h.hexdigest()[:20]


def build_once(target: Path, make) -> Path:
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


def run_compiler(cmd: list[str]) -> subprocess.CompletedProcess:
    """Runs one compiler command line, its output captured (the caller reads returncode)."""
    return subprocess.run(cmd, capture_output=True, text=True)
