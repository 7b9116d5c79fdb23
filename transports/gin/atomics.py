"""Host atomics for GIN: 64-bit fetch-add (acq_rel), acquire load and release store on
raw addresses, and the copy that lands a put's bytes where kernels poll them
(include/commref/land.h), from a tiny C++ shim (host_atomics.cpp) built once per cache key by
commref.device_kernels.cpu_loader.build_library and loaded through ctypes once per
process. The proxy uses them on its queue words and to apply signals and counters; the
ordering study's stress uses them for its queue and control words; Communicator.abort
claims the launch's error record with the 32-bit compare-and-swap, as a failing kernel
does.

In a process that runs under ThreadSanitizer (tests/test_tsan.py preloads its runtime)
the shim is built with cpu_loader.TSAN_FLAGS, so that TSan sees the proxy's acquire and
release operations pair with the kernels'.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

from commref.device_kernels import build, cpu_loader

SOURCE = Path(__file__).resolve().with_name("host_atomics.cpp")


@dataclass(frozen=True)
class HostAtomics:
    """The shim's functions, as ctypes callables on integer addresses:
        add_u64(addr, v) -> old value, load_acquire_u64(addr) -> value,
        store_release_u64(addr, v), land(dst, src, nbytes) (landLines: each aligned 16-byte
        line of dst by one store, in ascending order), cas_u32(addr, expected, desired) ->
        nonzero if swapped, store_release_u32(addr, v), wake_sleeper(addr) (a fence, then a
    futex wake of a thread sleeping on the uint32 word at addr if it reads nonzero: how a
    host producer rings the engine, gin.h's COMMREF_GIN_QUEUE_IDLE)."""

    path: Path
    add_u64: object
    load_acquire_u64: object
    store_release_u64: object
    land: object
    cas_u32: object
    store_release_u32: object
    wake_sleeper: object


def _under_tsan() -> bool:
    return hasattr(ctypes.CDLL(None), "__tsan_init")


@functools.cache
def host_atomics() -> HostAtomics:
    """The process's host atomics (built or found in the cache on first use)."""
    flags = cpu_loader.TSAN_FLAGS if _under_tsan() else cpu_loader.CPU_FLAGS
    path = cpu_loader.build_library("commref_gin_atomics", [SOURCE], flags, include_dirs=(build.INCLUDE_DIR,))
    lib = ctypes.CDLL(str(path))
    add = lib.commref_gin_atomic_add_u64
    add.argtypes, add.restype = [ctypes.c_void_p, ctypes.c_uint64], ctypes.c_uint64
    load = lib.commref_gin_load_acquire_u64
    load.argtypes, load.restype = [ctypes.c_void_p], ctypes.c_uint64
    store = lib.commref_gin_store_release_u64
    store.argtypes, store.restype = [ctypes.c_void_p, ctypes.c_uint64], None
    land = lib.commref_gin_land
    land.argtypes, land.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64], None
    cas = lib.commref_gin_cas_u32
    cas.argtypes, cas.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32], ctypes.c_int
    store32 = lib.commref_gin_store_release_u32
    store32.argtypes, store32.restype = [ctypes.c_void_p, ctypes.c_uint32], None
    wake = lib.commref_gin_wake_sleeper
    wake.argtypes, wake.restype = [ctypes.c_void_p], None
    return HostAtomics(path, add, load, store, land, cas, store32, wake)
