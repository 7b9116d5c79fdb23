"""The GPU host runtime without a GPU: Communicator, windows and host words driven
through a stand-in for CuPy that records every CUDA call, and the pure residency rule.

What these check (issue 12): each communicator launches on a non-blocking stream of its
own, joined to the caller's stream with events in NCCL's order; a legacy-stream caller
is refused when ranks of one process share a GPU; a kernel's error record surfaces at
synchronize() and at the next call; windows are zeroed on a stream that is synchronized
before registration completes; peers without peer access stay unmapped and are refused
with the reason; host words are pinned portable and mapped (the shared abort word once
per process, reference-counted); close() frees a rank's own window only after every
rank has finished; co-resident blocks that cannot fit are refused.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import itertools
import sys
import threading
import time
import types

import numpy as np
import pytest

from commref.collectives import launch, tuner
from commref.collectives.communicator import Communicator
from commref.device_kernels import abi, loader
from commref.transports.errors import CapabilityError, CommTimeout
from commref.transports.world import ThreadWorld


# ---- the pure residency rule ----


def test_residency_refuses_what_cannot_be_co_resident():
    why = tuner.residency_problem("commref_ring_allreduce", ranks=4, channels=8, threads=512, blocks_per_sm=2,
                                  sms=8)
    assert why is not None
    for number in ("4 ranks", "8 channels", "32 blocks", "512 threads", "2 blocks per SM", "8 SMs", "= 16"):
        assert number in why, (number, why)
    assert "\n" not in why


def test_residency_accepts_what_fits():
    assert tuner.residency_problem("k", ranks=4, channels=8, threads=512, blocks_per_sm=2, sms=16) is None  # 32 == 32
    assert tuner.residency_problem("k", ranks=2, channels=8, threads=512, blocks_per_sm=4, sms=132) is None


def test_residency_of_a_lone_rank_needs_only_one_block_per_sm():
    # One rank on its GPU: its blocks never wait for one another, so they need not all fit.
    assert tuner.residency_problem("k", ranks=1, channels=64, threads=1024, blocks_per_sm=1, sms=2) is None
    why = tuner.residency_problem("k", ranks=1, channels=1, threads=2048, blocks_per_sm=0, sms=132)
    assert why is not None and "2048 threads" in why


# ---- a stand-in for CuPy ----


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
                    _host = np.ctypeslib.as_array((ctypes.c_char * max(1, n * self.dtype.itemsize))
                                                  .from_address(ptr)).view(np.uint8)[: n * self.dtype.itemsize]
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
            CUDARuntimeError=CUDARuntimeError, malloc=malloc, free=free, memsetAsync=memsetAsync,
            hostAlloc=hostAlloc, freeHost=freeHost, hostRegister=hostRegister, hostUnregister=hostUnregister,
            deviceCanAccessPeer=deviceCanAccessPeer, deviceEnablePeerAccess=deviceEnablePeerAccess,
            getDevice=lambda: getattr(fake._local, "device", 0), setDevice=setDevice,
            deviceGetPCIBusId=lambda d: f"0000:{d + 1:02x}:00.0",
            deviceGetAttribute=lambda attr, d: 1, cudaDevAttrUnifiedAddressing=41,
            cudaDevAttrCanUseHostPointerForRegisteredMem=91,
            eventRecord=lambda event, stream: fake.note("eventRecord", event, stream),
            streamWaitEvent=lambda stream, event, flags=0: fake.note("streamWaitEvent", stream, event),
            streamQuery=lambda stream: 0,
            streamSynchronize=lambda stream: fake.note("streamSynchronize", stream),
            ipcGetMemHandle=lambda ptr: ptr.to_bytes(8, "little"),
        )
        cuda = types.SimpleNamespace(Device=Device, Stream=Stream, Event=Event, get_current_stream=get_current_stream,
                                     runtime=runtime, MemoryPointer=MemoryPointer, UnownedMemory=UnownedMemory)
        module = types.ModuleType("cupy")
        module.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
        module.cuda, module.ndarray, module.asarray, module.zeros = cuda, ndarray, asarray, zeros
        module.uint8, module.float32 = np.uint8, np.float32
        module.is_available = lambda: True
        module.__version__ = "fake"
        return module


class FakeKernels:
    """loader.CudaKernels' interface; a launch logs itself and can leave an error record."""

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
            record = np.frombuffer((ctypes.c_char * abi.ERROR_RECORD.itemsize).from_address(
                int(args[0]["errorRecord"])), dtype=abi.ERROR_RECORD)
            record["peer"], record["expected"], record["seen"] = 1, 5, 3
            record["code"] = code
        return abi.LAUNCH_OK


@pytest.fixture
def fake(monkeypatch):
    f = FakeCuda()
    monkeypatch.setitem(sys.modules, "cupy", f.module)
    monkeypatch.setitem(sys.modules, "cupy.cuda", f.module.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.runtime", f.module.cuda.runtime)
    monkeypatch.setattr(loader, "cuda_kernels", lambda device_id: FakeKernels(f))
    monkeypatch.setattr(launch, "_abort_words", launch.MappedHostWords())
    return f


def _run(nranks, body, *args):
    return ThreadWorld.run(nranks, body, *args, timeout=10)


# ---- streams ----


def _allreduce_on_own_stream(world, fake):
    cupy = fake.module
    comm = Communicator(world, "cuda", max_channels=2)
    caller = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(1024, np.float32)
    comm.allreduce(x, x, stream=caller)
    comm.synchronize(caller)
    comm.close()
    with pytest.raises(Exception, match="unusable: it was closed"):  # its memory is gone
        comm.allreduce(x, x, stream=caller)
    return caller.ptr, comm._stream_ptr, comm._joined_ptr, comm._done_ptr


def test_launch_joins_the_callers_stream_in_nccls_order(fake):
    results = _run(2, _allreduce_on_own_stream, fake)
    own_streams = {r[1] for r in results}
    assert len(own_streams) == 2, "each communicator needs a stream of its own"
    for rank, (caller, own, joined, done) in enumerate(results):
        assert (own, True) in [c[1:] for c in fake.calls("streamCreate")], "the communicator's stream is non-blocking"
        thread = f"commref-rank-{rank}"
        seq = [e[1:] for e in fake.log if e[0] == thread and e[1] in ("eventRecord", "streamWaitEvent", "launch")]
        assert seq[0] == ("eventRecord", joined, caller), seq  # the caller's work so far
        assert seq[1] == ("streamWaitEvent", own, joined), seq  # ... comes first on our stream
        assert seq[2][0] == "launch" and seq[2][2] == own, seq  # the kernel on our stream
        assert seq[3] == ("eventRecord", done, own), seq
        assert seq[4] == ("streamWaitEvent", caller, done), seq  # the caller's later work waits for it


def _null_stream_call(world, fake):
    cupy = fake.module
    comm = Communicator(world, "cuda", max_channels=2)
    x = cupy.zeros(64, np.float32)
    try:
        comm.allreduce(x, x)  # stream=None: the current stream, the legacy default one here
    except ValueError as e:
        return str(e)
    finally:
        comm.close()
    return None


def test_legacy_stream_refused_when_thread_ranks_share_a_gpu(fake):
    messages = _run(2, _null_stream_call, fake)
    for rank, msg in enumerate(messages):
        assert msg is not None, "a legacy-stream call with two ranks on one GPU must be refused"
        assert f"rank {rank}" in msg and "GPU 0" in msg and "legacy default stream" in msg
        assert "cupy.cuda.Stream(non_blocking=True)" in msg
    assert not fake.calls("launch"), "refused before anything was launched"


def test_legacy_stream_allowed_for_a_lone_rank(fake):
    assert _run(1, _null_stream_call, fake) == [None]
    (launch_call,) = fake.calls("launch")
    assert launch_call[2] != 0, "the kernel goes on the communicator's stream"


def _failing_kernel(world, fake):
    cupy = fake.module
    comm = Communicator(world, "cuda", max_channels=1)
    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(64, np.float32)
    fake.fail_next_launch_with = abi.ERR_TIMEOUT
    comm.allreduce(x, x, stream=stream)  # asynchronous: returns before the failure is seen
    with pytest.raises(CommTimeout, match="peer 1"):
        comm.synchronize(stream)
    with pytest.raises(Exception, match="unusable: an earlier call failed: rank 0: timed out"):
        comm.allreduce(x, x, stream=stream)
    comm.close()
    return len(fake.calls("launch"))


def test_kernel_failure_surfaces_at_synchronize(fake):
    assert _run(1, _failing_kernel, fake) == [1]


# ---- windows, peers, host words ----


def _construct(world, fake, device_of_rank):
    comm = Communicator(world, "cuda", max_channels=1, device_id=device_of_rank(world.rank))
    comm.close()
    return True


def test_window_zeroed_on_a_stream_synchronized_before_use(fake):
    _run(2, _construct, fake, lambda r: 0)
    memsets = fake.calls("memsetAsync")
    assert len(memsets) == 2
    for _, ptr, value, nbytes, stream in memsets:
        assert value == 0 and stream != 0, "zeroed on a stream of its own, not the legacy default stream"
        log = [e[1:] for e in fake.log]
        after = log[log.index(("memsetAsync", ptr, value, nbytes, stream)):]
        assert ("streamSynchronize", stream) in after


def test_no_peer_access_leaves_the_peer_unmapped_and_is_refused(fake):
    fake.can_access_peer = lambda a, b: False
    with pytest.raises(CapabilityError, match="no peer access between device 0 and device 1"):
        _run(2, _construct, fake, lambda r: r)
    assert not fake.calls("deviceEnablePeerAccess")


def test_peer_access_enabled_once_per_pair(fake, monkeypatch):
    from commref.transports import windows

    monkeypatch.setattr(windows, "_peer_enabled", set())
    _run(2, _construct, fake, lambda r: r)
    _run(2, _construct, fake, lambda r: r)
    enabled = [c[1:] for c in fake.calls("deviceEnablePeerAccess")]
    assert sorted(enabled) == [(0, 1), (1, 0)]


def test_host_words_pinned_and_abort_word_registered_once(fake):
    abort = np.zeros(1, np.uint64)
    words = [launch.HostWords(abort, "cuda", d) for d in (0, 1, 0)]
    allocs = fake.calls("hostAlloc")
    assert len(allocs) == 3 and all(flags == 1 | 2 for _, _, _, flags in allocs), "portable and mapped"
    assert all(not w.failed for w in words), "the error record starts zeroed"
    (reg,) = fake.calls("hostRegister")
    assert reg[3] == 1 | 2 and reg[1] <= abort.ctypes.data < reg[1] + reg[2]
    words[0].close()
    words[1].close()
    assert not fake.calls("hostUnregister"), "still in use"
    words[2].close()
    words[2].close()  # idempotent
    assert fake.calls("hostUnregister") == [("hostUnregister", reg[1])]
    assert len(fake.calls("freeHost")) == 3


def test_abort_word_registered_elsewhere_is_used_not_unregistered(fake):
    abort = np.zeros(1, np.uint64)
    start = abort.ctypes.data // 4096 * 4096
    fake.registered[start] = 4096  # someone else pinned that page
    w = launch.HostWords(abort, "cuda", 0)
    w.close()
    assert not fake.calls("hostUnregister")


def test_host_register_errors_other_than_already_registered_raise(fake, monkeypatch):
    runtime = fake.module.cuda.runtime

    def refuse(ptr, nbytes, flags):
        raise runtime.CUDARuntimeError(2)  # cudaErrorMemoryAllocation

    monkeypatch.setattr(runtime, "hostRegister", refuse)
    with pytest.raises(runtime.CUDARuntimeError):
        launch.HostWords(np.zeros(1, np.uint64), "cuda", 0)
    assert len(fake.calls("freeHost")) == 1, "the error record allocated before is released"


# ---- teardown ----


def _close_late(world, fake):
    comm = Communicator(world, "cuda", max_channels=1)
    if world.rank == 1:
        time.sleep(0.3)  # still "running": rank 0 must not free its window meanwhile
        fake.note("rank 1 done")
    comm.close()
    comm.close()  # idempotent
    return comm.window.address


def test_close_frees_own_window_after_every_rank_is_done(fake):
    addresses = _run(2, _close_late, fake)
    log = [e[1:] for e in fake.log]
    done = log.index(("rank 1 done",))
    frees = [i for i, e in enumerate(log) if e[0] == "free" and e[1] in addresses]
    assert len(frees) == 2 and min(frees) > done, "a window was freed while a peer still ran"


def _residency(world, fake):
    cupy = fake.module
    comm = Communicator(world, "cuda", max_channels=4)
    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(4 << 20, np.float32)  # large enough for 4 channels
    try:
        comm.allreduce(x, x, stream=stream)
    except CapabilityError as e:
        return str(e)
    finally:
        comm.close()
    return None


def test_thread_ranks_whose_blocks_cannot_be_co_resident_are_refused(fake):
    fake.blocks_per_sm, fake.sm_count = 1, 6
    messages = _run(2, _residency, fake)  # 2 ranks x 4 channels = 8 blocks > 1 x 6
    assert all(m is not None and "8 blocks" in m and "6 SMs" in m for m in messages), messages
    assert not fake.calls("launch")


def test_threads_above_the_kernels_limit_are_refused(fake):
    fake.blocks_per_sm = 0  # what the occupancy query answers above the kernel's max threads per block
    messages = _run(1, _residency, fake)
    assert "cannot run 512 threads per block" in messages[0] and "its limit: 512 threads" in messages[0], messages
    assert not fake.calls("launch")


def test_co_resident_blocks_that_fit_are_launched(fake):
    fake.blocks_per_sm, fake.sm_count = 1, 8
    assert _run(2, _residency, fake) == [None, None]
    assert len(fake.calls("launch")) == 2


# ---- what the benchmark says it measured ----


def test_bench_names_how_ranks_share_a_gpu():
    from commref.bench.environment import gpu_sharing

    ranks = [{"rank": r, "host": "h", "pid": 10 + r, "pci_bus": "0000:01:00.0", "mps": None} for r in range(2)]
    (line,) = gpu_sharing(ranks)
    assert "2 ranks (0,1) share GPU 0000:01:00.0" in line and "2 processes" in line and "time-sliced without MPS" in line
    under_mps = [dict(r, mps="/tmp/nvidia-mps/control") for r in ranks]
    (line,) = gpu_sharing(under_mps)
    assert "under MPS" in line and "time-sliced" not in line
    threads = [dict(r, pid=10) for r in ranks]
    (line,) = gpu_sharing(threads)
    assert "threads of one process" in line
    apart = [dict(r, pci_bus=f"0000:0{i + 1}:00.0") for i, r in enumerate(ranks)]
    assert gpu_sharing(apart) == []


def test_close_after_a_peer_failed_returns_and_frees_nothing_a_peer_may_use(fake):
    seen = {}

    def body(world):
        comm = Communicator(world, "cuda", max_channels=1)
        if world.rank == 1:
            raise RuntimeError("rank 1 fails")
        time.sleep(0.1)  # rank 1 has failed by now
        t0 = time.monotonic()
        try:
            comm.close()
        except Exception as e:  # the job is aborting: close says so, after doing what is safe
            seen["error"] = type(e).__name__
        seen["seconds"] = time.monotonic() - t0
        seen["window"] = comm.window.address
        comm.close()  # a second close does nothing

    with pytest.raises(RuntimeError, match="rank 1 fails"):
        _run(2, body)
    assert seen["error"] == "CommAborted" and seen["seconds"] < 5
    assert ("free", seen["window"]) not in fake.calls("free"), "freed while a failed peer may still map it"


# ---- GIN on the GPU: the copy-engine proxy's setup and teardown ----


def _gin_on_gpu(world, fake):
    from commref.transports.gin import gpu_proxy

    comm = Communicator(world, "cuda", path="gin", gin_queue=32, gin_counters=2)
    region, proxy = comm._gin_region, comm.proxy
    gin = comm._record.record["gin"]
    seen = (type(proxy).__name__, int(gin["queue"]) == region.queue_address,
            int(gin["counters"]) == region.counters_address, region.counters_address - region.queue_address,
            bool((region.queue == 0).all()), isinstance(proxy.driver, gpu_proxy.CudaDriver))
    comm.close()
    return seen, region.queue_address, proxy.driver.closed


def test_gin_on_a_gpu_puts_its_queue_in_pinned_mapped_memory_and_frees_it_at_close(fake, monkeypatch):
    """Communicator(device="cuda", path="gin"): the queue and counters in one cudaHostAlloc
    (portable, mapped), zeroed, addressed by CollArgs.gin; a GpuProxy over it; close stops
    the proxy, releases its driver and frees the allocation."""
    from commref.transports.gin import gpu_proxy
    from commref.transports.gin.queue import queue_bytes
    from commref.transports.host_memory import CUDA_HOST_PORTABLE_MAPPED
    from test_gin_gpu_proxy import LateCopies

    class Driver(LateCopies, gpu_proxy.CudaDriver):  # the real driver's type, host memory underneath
        def __init__(self, device_id):
            LateCopies.__init__(self, seed=device_id)

    monkeypatch.setattr(gpu_proxy, "CudaDriver", Driver)
    results = _run(2, _gin_on_gpu, fake)
    for seen, queue_address, closed in results:
        assert seen == ("GpuProxy", True, True, queue_bytes(32), True, True) and closed, seen
        allocs = [c for c in fake.calls("hostAlloc") if c[1] == queue_address]
        assert allocs and allocs[0][2:] == (queue_bytes(32) + 8 * 2, CUDA_HOST_PORTABLE_MAPPED), allocs
        assert [c for c in fake.calls("freeHost") if c[1] == queue_address], "the queue region was not freed"


@pytest.mark.parametrize("kw, message", [(dict(wire="unordered"), "carries the ordered wire"),
                                         (dict(network="mpi"), "network 'mpi' needs an MPI world")])
def test_gin_on_a_gpu_refuses_what_it_does_not_carry(fake, kw, message):
    def body(world):
        with pytest.raises(CapabilityError, match=message):
            Communicator(world, "cuda", path="gin", **kw)

    _run(2, body)
