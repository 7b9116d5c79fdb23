"""Stand-ins for what a GPU run has and this machine does not, shared by the test modules
(import them from here): device arrays, the GPU proxy's CUDA driver, CuPy (the fixture
`fake` in conftest.py installs it) and the GPU kernels. The helpers that run and judge
jobs are in helpers.py."""

from __future__ import annotations

import collections
import ctypes
import importlib.machinery
import itertools
import random
import threading
import types

import numpy as np

from commref.device_kernels import abi
from commref.transports.gin.atomics import host_atomics
from commref.transports.thread_world import ThreadWorld


class FakeDeviceArray:
    """Looks like device memory to a CPU communicator."""

    def __init__(self, n: int = 8):
        self._host = np.zeros(n, np.float32)
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "<f4",
            "data": (self._host.ctypes.data, False),
            "version": 3,
        }


# ---------------------------------------------------------------------------------------
# a stand-in for the GPU proxy's CUDA driver
# ---------------------------------------------------------------------------------------


class LateCopies:
    """CudaDriver's interface over host memory, with operations that run late: each
    stream's queued operations run a few at a time, in a seeded order, whenever the
    proxy asks whether something is done. `signal_stream`: write and add values on one stream of their own (a
    planted bug: no order after the data). `host_native_atomics` and `peer_atomics` are
    what the device attributes report; `device_adds` logs each word-add kernel's address."""

    def __init__(
        self, seed: int, signal_stream: bool = False, host_native_atomics: bool = True, peer_atomics: bool = True
    ):
        self.rng = random.Random(seed)
        self.streams: list[collections.deque] = []
        atomics = host_atomics()
        self.store, self.add = atomics.store_release_u64, atomics.add_u64
        self.signal_stream = self.stream() if signal_stream else None
        self.host_native_atomics, self.peer_atomics = host_native_atomics, peer_atomics
        self.device_id = 0
        self.device_adds: list[int] = []
        self.closed = False

    def bind(self) -> None:
        pass

    def stream(self):
        q: collections.deque = collections.deque()
        self.streams.append(q)
        return q

    def copy(self, dst: int, src: int, nbytes: int, stream) -> None:
        stream.append(lambda: ctypes.memmove(dst, src, nbytes))  # reads the source when it runs

    def write_value(self, addr: int, value: int, stream) -> None:
        (self.signal_stream if self.signal_stream is not None else stream).append(lambda: self.store(addr, value))

    def add_value(self, addr: int, value: int, stream) -> None:
        self.device_adds.append(addr)
        (self.signal_stream if self.signal_stream is not None else stream).append(lambda: self.add(addr, value))

    def peer_native_atomics(self, addr: int) -> tuple[int, bool]:
        return 1, self.peer_atomics

    def event_after(self, stream):
        ev = [False]
        stream.append(lambda: ev.__setitem__(0, True))
        return ev

    def _progress(self) -> None:
        for q in self.streams:
            for _ in range(min(len(q), self.rng.randint(0, 2))):
                q.popleft()()

    def done(self, ev) -> bool:
        self._progress()
        return ev[0]

    def idle(self, stream) -> bool:
        self._progress()
        return not stream

    def close(self) -> None:
        assert not any(q for q in self.streams if q is not self.signal_stream), "closed with work still queued"
        self.closed = True


# ---------------------------------------------------------------------------------------
# a stand-in for CuPy (the fixture `fake` in conftest.py installs it)
# ---------------------------------------------------------------------------------------


def run_threads(nranks, body, *args):
    """ThreadWorld.run with a 10 s deadline: the fake GPU's ranks."""
    return ThreadWorld.run(nranks, body, *args, timeout=10)


def refused_allreduce(comm, x, refusal: type[Exception], **kw) -> str | None:
    """comm.allreduce(x, x, **kw): the message of the `refusal` it raised, or None when it
    ran; closes `comm` either way."""
    try:
        comm.allreduce(x, x, **kw)
    except refusal as e:
        return str(e)
    finally:
        comm.close()
    return None


class FakeCuda:
    """Enough of CuPy's API for Communicator, windows and host words. Device memory is
    host memory; every CUDA call of interest is appended to `log` as a tuple."""

    def __init__(self, can_access_peer=lambda a, b: True, blocks_per_sm=4, sm_count=132):
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.memory: dict[int, object] = {}  # address -> the buffer behind it
        self.registered: dict[int, int] = {}  # hostRegister'ed start -> size
        self.can_access_peer = can_access_peer
        self.blocks_per_sm, self.sm_count = blocks_per_sm, sm_count
        self.fail_next_launch_with = None  # an abi.ERR_* code the next kernel leaves in its record
        self._handles = itertools.count(0x1000)
        self._local = threading.local()
        self.module = self._module()

    def note(self, *entry):
        with self.lock:
            self.log.append((threading.current_thread().name, *entry))

    def calls(self, name, thread=None):
        return [e[1:] for e in self.log if e[1] == name and (thread is None or e[0] == thread)]

    def _alloc(self, nbytes):
        buf = (ctypes.c_char * max(1, nbytes))()
        addr = ctypes.addressof(buf)
        self.memory[addr] = buf
        return addr

    def _module(self):
        fake = self

        class CUDARuntimeError(RuntimeError):
            def __init__(self, status):
                self.status = status
                super().__init__(f"cudaError {status}")

        class Device:
            def __init__(self, device_id=None):
                self.id = getattr(fake._local, "device", 0) if device_id is None else device_id

            def __enter__(self):
                self._prev = getattr(fake._local, "device", 0)
                fake._local.device = self.id
                return self

            def __exit__(self, *exc):
                fake._local.device = self._prev
                return False

            def use(self):
                fake._local.device = self.id

        class Stream:
            def __init__(self, null=False, non_blocking=False, ptr=None):
                self.ptr = 0 if null else (ptr if ptr is not None else next(fake._handles))
                self.non_blocking = non_blocking
                fake.note("streamCreate", self.ptr, non_blocking)

            @property
            def done(self):
                return True

            def synchronize(self):
                fake.note("streamSynchronize", self.ptr)

            def use(self):
                fake._local.stream = self
                return self

            def __enter__(self):
                self._prev = getattr(fake._local, "stream", None)
                fake._local.stream = self
                return self

            def __exit__(self, *exc):
                fake._local.stream = self._prev
                return False

        Stream.null = Stream(null=True)

        class Event:
            def __init__(self, block=False, disable_timing=False, interprocess=False):
                self.ptr = next(fake._handles)
                fake.note("eventCreate", self.ptr, disable_timing)

        def get_current_stream(device_id=-1):
            return getattr(fake._local, "stream", None) or Stream.null

        class Flags:
            c_contiguous = True

        class Pointer:
            def __init__(self, ptr):
                self.ptr = ptr

        class ndarray:
            def __init__(self, shape, dtype=np.uint8, memptr=None, _host=None):
                n = int(np.prod(shape))
                self.dtype = np.dtype(dtype)
                if _host is None:
                    ptr = memptr.ptr if memptr is not None else fake._alloc(n * self.dtype.itemsize)
                    _host = np.ctypeslib.as_array(
                        (ctypes.c_char * max(1, n * self.dtype.itemsize)).from_address(ptr)
                    ).view(np.uint8)[: n * self.dtype.itemsize]
                    _host = _host.view(self.dtype)
                self._host = _host
                self.size, self.nbytes = _host.size, _host.nbytes
                self.data = Pointer(_host.__array_interface__["data"][0])
                self.device = Device(getattr(fake._local, "device", 0))
                self.flags = Flags()

            def __getitem__(self, index):
                return ndarray(None, self.dtype, _host=self._host[index])

            def view(self, dtype):
                return ndarray(None, dtype, _host=self._host.view(dtype))

        def asarray(a):
            a = np.ascontiguousarray(a)
            out = ndarray(a.shape, a.dtype)
            out._host[...] = a.reshape(-1) if a.ndim else a
            return out

        def zeros(n, dtype):
            out = ndarray((n,), dtype)
            out._host[...] = 0
            return out

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.ptr = mem.ptr + offset

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id=0):
                self.ptr, self.size = ptr, size

        def malloc(nbytes):
            ptr = fake._alloc(nbytes)
            fake.note("malloc", ptr, nbytes)
            return ptr

        def free(ptr):
            fake.note("free", ptr)
            fake.memory.pop(ptr)

        def memsetAsync(ptr, value, nbytes, stream):
            fake.note("memsetAsync", ptr, value, nbytes, stream)
            ctypes.memset(ptr, value, nbytes)

        def hostAlloc(nbytes, flags):
            ptr = fake._alloc(nbytes)
            ctypes.memset(ptr, 0xAB, nbytes)  # cudaHostAlloc does not zero
            fake.note("hostAlloc", ptr, nbytes, flags)
            return ptr

        def freeHost(ptr):
            fake.note("freeHost", ptr)
            fake.memory.pop(ptr)

        def hostRegister(ptr, nbytes, flags):
            fake.note("hostRegister", ptr, nbytes, flags)
            for start, size in fake.registered.items():
                if start < ptr + nbytes and ptr < start + size:
                    raise CUDARuntimeError(712)
            fake.registered[ptr] = nbytes

        def hostUnregister(ptr):
            fake.note("hostUnregister", ptr)
            del fake.registered[ptr]

        def deviceCanAccessPeer(a, b):
            return int(fake.can_access_peer(a, b))

        def deviceEnablePeerAccess(peer):
            fake.note("deviceEnablePeerAccess", fake._local.__dict__.get("device", 0), peer)

        def setDevice(d):
            fake._local.device = d

        runtime = types.SimpleNamespace(
            CUDARuntimeError=CUDARuntimeError,
            malloc=malloc,
            free=free,
            memsetAsync=memsetAsync,
            hostAlloc=hostAlloc,
            freeHost=freeHost,
            hostRegister=hostRegister,
            hostUnregister=hostUnregister,
            deviceCanAccessPeer=deviceCanAccessPeer,
            deviceEnablePeerAccess=deviceEnablePeerAccess,
            getDevice=lambda: getattr(fake._local, "device", 0),
            setDevice=setDevice,
            getDeviceCount=lambda: 1,
            deviceGetPCIBusId=lambda d: f"0000:{d + 1:02x}:00.0",
            deviceGetAttribute=lambda attr, d: 1,
            cudaDevAttrUnifiedAddressing=41,
            cudaDevAttrCanUseHostPointerForRegisteredMem=91,
            eventRecord=lambda event, stream: fake.note("eventRecord", event, stream),
            streamWaitEvent=lambda stream, event, flags=0: fake.note("streamWaitEvent", stream, event),
            streamQuery=lambda stream: 0,
            streamSynchronize=lambda stream: fake.note("streamSynchronize", stream),
            ipcGetMemHandle=lambda ptr: ptr.to_bytes(8, "little"),
        )
        cuda = types.SimpleNamespace(
            Device=Device,
            Stream=Stream,
            Event=Event,
            get_current_stream=get_current_stream,
            runtime=runtime,
            MemoryPointer=MemoryPointer,
            UnownedMemory=UnownedMemory,
        )
        module = types.ModuleType("cupy")
        module.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
        module.cuda, module.ndarray, module.asarray, module.zeros = cuda, ndarray, asarray, zeros
        module.uint8, module.float32 = np.uint8, np.float32
        module.is_available = lambda: True
        module.__version__ = "fake"
        return module


class FakeKernels:
    """gpu_loader.CudaKernels' interface; a launch logs itself and can leave an error record."""

    device = "cuda"

    def __init__(self, fake: FakeCuda):
        self.fake, self.sm_count = fake, fake.sm_count

    def max_active_blocks(self, name, spec, threads):
        return self.fake.blocks_per_sm

    def max_threads(self, name, spec=None):
        return 512

    def prepare(self, specs):
        pass

    def launch(self, name, grid, block, args, stream=None, spec=None, address=None):
        ptr = stream if isinstance(stream, int) else stream.ptr
        self.fake.note("launch", name, ptr, grid)
        code = self.fake.fail_next_launch_with
        if code is not None:
            self.fake.fail_next_launch_with = None
            record = np.frombuffer(
                (ctypes.c_char * abi.ERROR_RECORD.itemsize).from_address(int(args[0]["errorRecord"])),
                dtype=abi.ERROR_RECORD,
            )
            record["peer"], record["expected"], record["seen"] = 1, 5, 3
            record["code"] = code
        return abi.LAUNCH_OK
