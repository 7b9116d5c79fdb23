"""Buffer validation: every check a call's buffers get before anything is launched.

A bad buffer raises TypeError or ValueError naming this rank, the buffer and the
problem: missing, wrong kind of memory for the communicator's device, another
device, not C-contiguous, an unsupported dtype, read-only where written, misaligned,
sizes that do not fit the collective (catalogue.Collective.counts), or overlapping
buffers outside NCCL's in-place layout.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import numpy as np

from . import catalogue
from .catalogue import BOTH, RECV, SEND
from .verify import DTYPES, dtype_name

_SUPPORTED = frozenset(DTYPES.values())


@dataclass(slots=True)
class Buffer:
    """A validated user buffer: where it is, what it holds."""

    obj: object
    array: object  # obj as a numpy or CuPy array
    address: int
    count: int
    dtype: np.dtype
    nbytes: int
    writeable: bool

    def overlaps(self, other: Buffer) -> bool:
        return self.address < other.address + other.nbytes and other.address < self.address + self.nbytes


class BufferChecker:
    """Validates buffers for one rank's communicator on `device` ("cpu" or "cuda")."""

    def __init__(self, rank: int, nranks: int, device: str, device_id: int | None):
        self.rank, self.nranks, self.device, self.device_id = rank, nranks, device, device_id
        self._addresses: dict = {}  # id(array) -> (weak reference, address, nbytes)

    def buffer(self, obj, name: str, write: bool = False) -> Buffer:
        if obj is None:
            raise TypeError(f"rank {self.rank}: {name} is required")
        if self.device == "cpu":
            if type(obj) is not np.ndarray:
                kind = type(obj).__module__.split(".")[0]
                if hasattr(obj, "__cuda_array_interface__") or kind == "cupy":
                    raise TypeError(
                        f"rank {self.rank}: {name} is device memory ({type(obj).__name__}) "
                        f"but this communicator runs on the CPU"
                    )
                if not isinstance(obj, np.ndarray):
                    raise TypeError(f"rank {self.rank}: {name} must be a numpy array, got {type(obj).__name__}")
            flags = obj.flags
            writeable, contiguous = flags.writeable, flags.c_contiguous
            arr, address = obj, self._host_address(obj, writeable and contiguous)
        else:
            arr, address, writeable = self._device_array(obj, name)
            contiguous = arr.flags.c_contiguous
        if not contiguous:
            raise ValueError(f"rank {self.rank}: {name} must be C-contiguous")
        dt = arr.dtype
        if dt not in _SUPPORTED:
            try:
                dtype_name(dt)
            except TypeError as e:
                raise TypeError(f"rank {self.rank}: {name}: {e}") from None
        if write and not writeable:
            raise ValueError(f"rank {self.rank}: {name} is read-only")
        if address % dt.itemsize and arr.size:
            raise ValueError(f"rank {self.rank}: {name} is not aligned to its element size {dt.itemsize}")
        return Buffer(obj, arr, address, arr.size, dt, arr.nbytes, writeable)

    def root(self, root) -> int:
        """A call's root: an int (numpy's too, not a bool) in [0, nranks); else ValueError."""
        if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= int(root) < self.nranks:
            raise ValueError(f"rank {self.rank}: root must be a rank in [0, {self.nranks}), got {root!r}")
        return int(root)

    def call(self, spec: catalogue.Collective, sendbuf, recvbuf, root: int) -> tuple[Buffer, Buffer, int]:
        """(sendbuf, recvbuf, NCCL count) of one call of `spec`. A buffer only the
        root passes (spec.root_only) is not looked at on other ranks: the other
        buffer stands in for it. (On every call's path: kept lean.)"""
        if spec.rooted and self.rank != root and spec.root_only:
            b = self.buffer(recvbuf, RECV, write=True) if spec.root_only == SEND else self.buffer(sendbuf, SEND)
            return b, b, b.count
        s = self.buffer(sendbuf, SEND)
        r = self.buffer(recvbuf, RECV, write=True)
        if s.dtype != r.dtype:
            raise TypeError(f"rank {self.rank}: sendbuf dtype {s.dtype} differs from recvbuf dtype {r.dtype}")
        scaled, n = spec.scaled, self.nranks
        if scaled is None:
            count, fits = r.count, s.count == r.count
        elif scaled == BOTH:
            count, fits = s.count // n, s.count == r.count and s.count % n == 0
        elif scaled == SEND:
            count, fits = r.count, s.count == r.count * n
        else:
            count, fits = s.count, r.count == s.count * n
        if not fits:
            self._count_error(spec, s, r, count)
        if s.overlaps(r):
            if not spec.in_place_ok:
                raise ValueError(
                    f"rank {self.rank}: {spec.name} buffers overlap, and {spec.name} has no in-place "
                    f"form ({spec.in_place_layout})"
                )
            at = spec.in_place_at(self.rank, count) * s.dtype.itemsize
            if not (r.address == s.address + at if scaled == SEND else s.address == r.address + at):
                raise ValueError(
                    f"rank {self.rank}: {spec.name} buffers overlap but are not in place ({spec.in_place_layout})"
                )
        return s, r, count

    def _count_error(self, spec: catalogue.Collective, s: Buffer, r: Buffer, count: int):
        n = self.nranks
        if spec.scaled == BOTH:
            what = (
                f"sendbuf and recvbuf of nranks * count elements each, the same multiple of nranks = {n}, "
                f"got {s.count} and {r.count}"
            )
        elif spec.scaled == SEND:
            what = f"sendbuf of nranks * recvcount = {n} * {count} = {n * count} elements, got {s.count}"
        elif spec.scaled == RECV:
            what = f"recvbuf of nranks * sendcount = {n} * {count} = {n * count} elements, got {r.count}"
        else:
            what = f"sendbuf and recvbuf of equal count, got {s.count} and {r.count}"
        raise ValueError(f"rank {self.rank}: {spec.name}{' root' if spec.rooted else ''} needs {what}")

    def _host_address(self, arr: np.ndarray, writeable_contiguous: bool = False) -> int:
        """arr's data address. Looking it up costs microseconds, a noticeable part of a
        small collective, so the last few arrays seen are remembered (weakly: the cache
        keeps no array alive; a numpy array's buffer does not move while it lives). A
        writeable contiguous array's comes from its buffer (ctypes), in a third of the
        time __array_interface__ takes."""
        hit = self._addresses.get(id(arr))
        if hit is not None and hit[0]() is arr and hit[2] == arr.nbytes:
            return hit[1]
        address = None
        if writeable_contiguous and arr.nbytes:
            try:
                address = ctypes.addressof(ctypes.c_char.from_buffer(arr))
            except (TypeError, ValueError, BufferError):  # a buffer that will not export so
                pass
        if address is None:
            address = arr.__array_interface__["data"][0]
        if len(self._addresses) >= 16:
            self._addresses.pop(next(iter(self._addresses)))
        try:
            self._addresses[id(arr)] = (weakref.ref(arr), address, arr.nbytes)
        except TypeError:  # an ndarray subclass without weak references: no caching
            pass
        return address

    def _device_array(self, obj, name):
        import cupy

        if isinstance(obj, np.ndarray):
            raise TypeError(
                f"rank {self.rank}: {name} is host memory (numpy) but this communicator runs on cuda:{self.device_id}"
            )
        if isinstance(obj, cupy.ndarray):
            arr = obj
        elif hasattr(obj, "__cuda_array_interface__"):
            arr = cupy.asarray(obj)
        elif hasattr(obj, "__dlpack__"):
            arr = cupy.from_dlpack(obj)
        else:
            raise TypeError(
                f"rank {self.rank}: {name} must be a CuPy array or expose __cuda_array_interface__ "
                f"or __dlpack__, got {type(obj).__name__}"
            )
        if arr.device.id != self.device_id:
            raise ValueError(
                f"rank {self.rank}: {name} is on cuda:{arr.device.id} but this communicator runs on "
                f"cuda:{self.device_id}"
            )
        readonly = (
            bool(getattr(obj, "__cuda_array_interface__", {}).get("data", (0, False))[1])
            if hasattr(obj, "__cuda_array_interface__") and not isinstance(obj, cupy.ndarray)
            else False
        )
        return arr, int(arr.data.ptr), not readonly
