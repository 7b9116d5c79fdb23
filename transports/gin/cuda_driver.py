"""The driver calls of GIN's copy-engine proxy (gpu_proxy.GpuProxy), through cuda-python:
CudaDriver (contexts, non-blocking streams, copies, 64-bit stream writes, events, the
device's and its P2P links' atomics attributes) and the word-add kernel it launches
(WORD_ADD_SOURCE: a one-thread kernel that adds to a 64-bit signal or counter word, a
system-scope atomic with release, in stream order), compiled by the GPU loader's NVRTC
route (gpu_loader.build_user_gpu_image) from word_add_source().
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numpy as np

from commref.device_kernels import build, gpu_loader
from commref.transports.errors import CapabilityError
from commref.transports.gin.wires import ProxyError

__all__ = ["CudaDriver"]

MASK64 = (1 << 64) - 1

WORD_ADD_KERNEL = "commref_gin_word_add"
# The proxy's one-thread kernel: an add to a signal or counter word, in stream order
# (it starts once every earlier copy and kernel of its stream has completed), with a
# system-scope fence and release (atomics.h), atomic with every other device-side add.
WORD_ADD_SOURCE = r"""// The GIN copy-engine proxy's word add (transports/gin/cuda_driver.py).
#include "commref/atomics.h"
extern "C" __global__ void commref_gin_word_add(uint64_t* word, uint64_t value) {
  commref::fetch_add_release(word, value);  // launched with one thread
}
"""


def word_add_source() -> Path:
    """WORD_ADD_SOURCE as a file the GPU loader compiles: cache_dir()/gin/<hash>/gin_word_add.cu."""
    digest = hashlib.sha256(WORD_ADD_SOURCE.encode()).hexdigest()[:16]
    path = build.cache_dir() / "gin" / digest / "gin_word_add.cu"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(WORD_ADD_SOURCE)
        os.replace(tmp, path)
    return path


def _flag(member) -> int:
    """A cuda-python enum member as the unsigned int a Flags parameter takes."""
    return int(getattr(member, "value", member))


class CudaDriver:
    """The driver calls of the copy-engine proxy, through cuda-python (cuda.bindings.driver,
    or cuda.cuda before 12.6). Every call checks its CUresult and raises ProxyError
    naming the call; construction refuses (CapabilityError) without cuda-python or
    without 64-bit stream memory operations."""

    def __init__(self, device_id: int):
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            try:
                from cuda import cuda as cu  # cuda-python before 12.6
            except ImportError:
                raise CapabilityError(
                    "GIN on GPUs drives the copy engine through cuda-python, which is not "
                    "installed (pip install 'commref[cuda12]' or 'commref[cuda13]')"
                ) from None
        self.cu = cu
        self._ok = cu.CUresult.CUDA_SUCCESS
        self._not_ready = cu.CUresult.CUDA_ERROR_NOT_READY
        self._call(cu.cuInit, "cuInit", 0)
        self.dev = self._call(cu.cuDeviceGet, "cuDeviceGet", device_id)
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
        if not self._call(cu.cuDeviceGetAttribute, "cuDeviceGetAttribute", attr, self.dev):
            raise CapabilityError(
                f"GIN on device {device_id}: putValue is written with cuStreamWriteValue64, "
                f"and the device does not offer 64-bit stream memory operations"
            )
        self.device_id = device_id
        self.host_native_atomics = bool(self._attribute("CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED"))
        cc = 10 * self._attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR") + self._attribute(
            "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"
        )
        image = gpu_loader.build_user_gpu_image(word_add_source(), cc).read_bytes()
        self.ctx = self._call(cu.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", self.dev)
        self._streams: list = []
        self._events: list = []  # every event made, for close()
        self._free_events: list = []
        previous = self._call(cu.cuCtxGetCurrent, "cuCtxGetCurrent")
        self.bind()
        try:
            held = np.frombuffer(image, np.uint8)  # by address: every cuda-python version takes one
            self._module = self._call(cu.cuModuleLoadData, "cuModuleLoadData", held.ctypes.data)
            self._word_add = self._call(
                cu.cuModuleGetFunction, "cuModuleGetFunction", self._module, WORD_ADD_KERNEL.encode()
            )
            # Loaded now, not at its first launch in the proxy thread, where the collectives'
            # kernels spin waiting for the very signal it would deliver (lazy loading).
            gpu_loader.func_load(self._word_add, WORD_ADD_KERNEL)
        finally:
            if previous is not None and int(previous):
                self._call(cu.cuCtxSetCurrent, "cuCtxSetCurrent", previous)
        # the word-add kernel's parameters: two words, and the array of their addresses that
        # cuLaunchKernel reads (it copies the values at the call, so one pair serves every launch)
        self._params = np.zeros(2, np.uint64)
        self._param_addresses = np.array([self._params.ctypes.data, self._params.ctypes.data + 8], np.uint64)
        self._p2p_atomics: dict = {}  # peer device ordinal -> native atomics between it and this device

    def _attribute(self, name: str) -> int:
        return int(
            self._call(
                self.cu.cuDeviceGetAttribute,
                f"cuDeviceGetAttribute({name})",
                getattr(self.cu.CUdevice_attribute, name),
                self.dev,
            )
        )

    def _call(self, fn, what: str, *args):
        err, *out = fn(*args)
        if err != self._ok:
            raise ProxyError(f"GIN copy-engine proxy: {what} failed: {err}")
        return out[0] if len(out) == 1 else (tuple(out) or None)

    def bind(self) -> None:
        """Makes the device's primary context current in the calling thread (the proxy's)."""
        self._call(self.cu.cuCtxSetCurrent, "cuCtxSetCurrent", self.ctx)

    def stream(self):
        s = self._call(self.cu.cuStreamCreate, "cuStreamCreate", _flag(self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self._streams.append(s)
        return s

    def copy(self, dst: int, src: int, nbytes: int, stream) -> None:
        self._call(self.cu.cuMemcpyAsync, "cuMemcpyAsync", dst, src, nbytes, stream)

    def write_value(self, addr: int, value: int, stream) -> None:
        self._call(self.cu.cuStreamWriteValue64, "cuStreamWriteValue64", stream, addr, value, 0)

    def add_value(self, addr: int, value: int, stream) -> None:
        """Adds `value` to the 64-bit word at device address `addr` after everything issued
        to `stream` so far (the word-add kernel: a system-scope atomic with release)."""
        self._params[0], self._params[1] = addr, value & MASK64
        self._call(
            self.cu.cuLaunchKernel,
            "cuLaunchKernel(commref_gin_word_add)",
            self._word_add,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            stream,
            self._param_addresses.ctypes.data,
            0,
        )

    def peer_native_atomics(self, addr: int) -> tuple[int, bool]:
        """(the device ordinal of the memory at `addr`, whether this device's atomics on it
        are native: the same device, or CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)."""
        cu = self.cu
        ordinal = int(
            self._call(
                cu.cuPointerGetAttribute,
                "cuPointerGetAttribute(DEVICE_ORDINAL)",
                cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        )
        if ordinal == self.device_id:
            return ordinal, True
        native = self._p2p_atomics.get(ordinal)
        if native is None:
            peer = self._call(cu.cuDeviceGet, "cuDeviceGet", ordinal)
            attr = cu.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
            native = self._p2p_atomics[ordinal] = bool(
                self._call(
                    cu.cuDeviceGetP2PAttribute, "cuDeviceGetP2PAttribute(NATIVE_ATOMIC_SUPPORTED)", attr, self.dev, peer
                )
            )
        return ordinal, native

    def event_after(self, stream):
        """An event recorded after everything issued to `stream` so far."""
        if self._free_events:
            ev = self._free_events.pop()
        else:
            ev = self._call(
                self.cu.cuEventCreate, "cuEventCreate", _flag(self.cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            )
            self._events.append(ev)
        self._call(self.cu.cuEventRecord, "cuEventRecord", ev, stream)
        return ev

    def done(self, ev) -> bool:
        """Whether the work before `ev` has completed (the event is reused once it has)."""
        (err,) = self.cu.cuEventQuery(ev)
        if err == self._ok:
            self._free_events.append(ev)
            return True
        if err == self._not_ready:
            return False
        raise ProxyError(f"GIN copy-engine proxy: cuEventQuery failed: {err}")

    def idle(self, stream) -> bool:
        """Whether everything issued to `stream` has completed."""
        (err,) = self.cu.cuStreamQuery(stream)
        if err == self._ok:
            return True
        if err == self._not_ready:
            return False
        raise ProxyError(f"GIN copy-engine proxy: cuStreamQuery failed: {err}")

    def close(self) -> None:
        """Destroys the streams and events and releases the context (the proxy's thread has ended)."""
        cu = self.cu
        for ev in self._events:
            cu.cuEventDestroy(ev)
        for s in self._streams:
            cu.cuStreamDestroy(s)
        self._events, self._free_events, self._streams = [], [], []
        if self._module is not None:
            cu.cuModuleUnload(self._module)
            self._module = None
        if self.ctx is not None:
            cu.cuDevicePrimaryCtxRelease(self.dev)
            self.ctx = None
