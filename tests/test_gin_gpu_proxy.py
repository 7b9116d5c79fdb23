"""The GIN copy-engine proxy (transports/gin/gpu_proxy.py) and its driver calls
(transports/gin/cuda_driver.py), without a GPU.

GpuProxy runs its whole protocol here over the CPU engine's windows, with LateCopies in
place of the CUDA driver: each "stream" is a FIFO whose operations (copies that read
their source when they run, value writes, event markers) run later, a seeded few at a
time whenever the proxy polls, so data, signals and counters land late and in stream
order only, as on a copy engine. On that:

- exactness: every collective, ThreadWorld 2 and 3 ranks, the backends that run the
  ordered wire (proxy, rc, gda) with their protocols;
- conformance: each rank's trace replayed against semantics.enabled()
  (test_gin_conformance.py's replay);
- the stand-in is adversarial: signals written on a stream of their own (not ordered
  after their data) corrupt results; a counter and a flush wait for the copy before
  them (the stand-in holding it);
- every writer of a signal lands: two proxies and the target's own adds on one word,
  reset between rounds; counters bumped on the device where host-native atomics are
  missing; a signal over a P2P link without native atomics refused naming the attribute;
- network mpi: the same over wires.MpiWire with DeviceWindow (2 MPI processes: exact,
  traces replayed; rank 1's device without host-native atomics);
- refusals: what plan_gin refuses on GPUs (the unordered wire), and CudaDriver without
  cuda-python, each in one line.

On a GPU, tests/gpu/gpu_check.sh runs the collectives over this proxy with the real driver.
"""

from __future__ import annotations

import ctypes
import sys
import time

import numpy as np
import pytest
from helpers import WORLD_TIMEOUT, abort_cleared, collectives_run, nvcc_sm90, ordered_shm_gin, run_gin_sweep
from stand_ins import LateCopies

from commref.transports.errors import CapabilityError, CommMismatch, CommTimeout
from commref.transports.gin import engines
from commref.transports.gin import plan as gin_plan
from commref.transports.gin.atomics import host_atomics
from commref.transports.gin.cuda_driver import WORD_ADD_SOURCE, CudaDriver
from commref.transports.gin.gpu_proxy import GpuProxy
from commref.transports.gin.replay import replay_trace
from commref.transports.thread_world import ThreadWorld


@pytest.fixture
def gpu_proxy(monkeypatch):
    """Every GIN communicator of the test is carried by a GpuProxy over LateCopies (seeded
    by rank); set `gpu_proxy["driver"]` to another factory to plant a bug."""
    settings = {"driver": lambda rank: LateCopies(seed=1000 + rank), "made": []}

    def start_proxy(self, world, window, layout, observer=None, engine=None, region=None, device="cpu", device_id=0):
        if not self.used:
            return None
        driver = settings["driver"](world.rank)
        proxy = GpuProxy(world, window, layout, region, self.options.queue, self.backend, self.transport, driver=driver)
        settings["made"].append(proxy)
        proxy.start()
        return proxy

    monkeypatch.setattr(gin_plan.GinPlan, "start_proxy", start_proxy)
    return settings


@pytest.mark.parametrize(
    "nranks, backend, protocol, dtypes, ops",
    [
        (2, "proxy", "strong", ["float32", "int8"], ["sum", "max"]),
        (3, "proxy", "strong", ["bfloat16", "int32"], ["prod", "avg"]),
        (2, "rc", "weak-last", ["float64"], ["sum"]),
        (3, "gda", "signal-per-put", ["float32"], ["min"]),
        (2, "gda", "flush-signal", ["int64"], ["sum"]),
    ],
)
def test_collectives_over_the_copy_engine_proxy_are_exact(nranks, backend, protocol, dtypes, ops, gpu_proxy):
    run_gin_sweep(nranks, ordered_shm_gin(backend, protocol, 2), dtypes, ops, [0, 1, 7, 3001])
    assert gpu_proxy["made"] and all(p.stats["ops"] > 0 and p.error is None for p in gpu_proxy["made"])
    assert all(p.driver.closed for p in gpu_proxy["made"]), "stop() releases the driver"


@pytest.mark.parametrize("backend, protocol", [("proxy", "strong"), ("rc", "strong"), ("gda", "flush-signal")])
def test_copy_engine_proxy_traces_conform(backend, protocol, gpu_proxy):
    runs = ThreadWorld.run(2, collectives_run, backend, "ordered", protocol, [1, 2], timeout=120)
    total: dict = {}
    for rank, per_seed in enumerate(runs):
        for trace, wrong, _ in per_seed:
            assert wrong == 0 and trace, (rank, wrong)
            for key, n in replay_trace(trace, backend, "ordered").items():
                total[key] = total.get(key, 0) + n
    assert total["post"] > 100 and total["signal"] > 20, total


def test_late_copies_catch_a_signal_not_ordered_after_its_data(gpu_proxy):
    """Signals on a stream of their own may land before their data: a receiver reads a
    slot whose header (or data) is stale, so the sweep fails (a header mismatch, a wait
    that times out) or counts wrong elements."""
    gpu_proxy["driver"] = lambda rank: LateCopies(seed=7 + rank, signal_stream=True)
    try:
        runs = ThreadWorld.run(2, collectives_run, "proxy", "ordered", "strong", [1], 5.0, timeout=120)
    except (CommMismatch, CommTimeout) as e:
        assert "rank" in str(e)
        return
    assert sum(wrong for per_seed in runs for _, wrong, _ in per_seed) > 0


class HeldCopies(LateCopies):
    """LateCopies whose streams run only when release() is called."""

    def __init__(self, **attributes):
        super().__init__(seed=0, **attributes)
        self.held = True

    def _progress(self) -> None:
        if not self.held:
            super()._progress()

    def release(self) -> None:
        self.held = False


@pytest.mark.parametrize("host_native_atomics", [True, False])
def test_a_counter_waits_for_its_copy(host_native_atomics):
    """A put's counter says "the source is reusable": the proxy bumps it only once the
    copy has run, and a flush completes only then (the stand-in holds the copy). Without
    host-native atomics the bump is the word-add kernel on the copy's stream (every writer
    of the counter is then the GPU), so it too runs only after the copy."""
    from commref.device_kernels import abi
    from commref.transports.gin import semantics
    from commref.transports.gin.backends import BACKENDS
    from commref.transports.gin.queue import QueueRegion, QueueWriter
    from commref.transports.windows import register_window

    def body(world):
        layout, nbytes = abi.window_layout(1, 256, 4, 16, 2, world.size)
        window = register_window(world, nbytes, "cpu")
        region = QueueRegion(window, layout, 16, 2)
        seen = None
        if world.rank == 0:
            driver = HeldCopies(host_native_atomics=host_native_atomics)
            proxy = GpuProxy(world, window, layout, region, 16, BACKENDS["proxy"], semantics.ORDERED, driver=driver)
            proxy.start()
            writer = QueueWriter(region.queue, QueueRegion.LAYOUT, 16, host_atomics())
            window.local[0:8] = 7
            slots = [
                writer.fill(abi.GIN_PUT, abi.GIN_HAS_COUNTER, peer=1, dst=64, src=0, nbytes=8, counter=1),
                writer.fill(abi.GIN_FLUSH),
            ]
            writer.publish(slots)
            time.sleep(0.2)
            seen = (int(region.counters[1]), writer.consumed())  # held: no counter, the flush not done
            driver.release()
            proxy.quiesce(10)
            seen += (int(region.counters[1]), writer.consumed())
            proxy.stop()
            assert proxy.error is None, proxy.error
            counter_adds = driver.device_adds.count(region.counters_address + 8)
            assert counter_adds == (0 if host_native_atomics else 1), driver.device_adds
        world.barrier(what="landed")
        out = bytes(window.local[64:72])
        world.barrier(what="read")
        window.close()
        return seen, out

    (seen, _), (_, landed) = ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)
    assert seen == (0, 1, 1, 2), seen  # the put's slot is consumed at once; the flush and the counter wait
    assert landed == bytes([7] * 8)


def _signal_writers(world, rounds: int, senders_seen: list):
    """Rank 0's signal word SIGNAL has three writers each round: the GpuProxies of ranks 1
    (K weak increments) and 2 (K adds of 3), over LateCopies, and rank 0 itself (K atomic
    adds of 5 while they run, as LSA peers' fetch_add_release and the target's own
    signals are); after each round rank 0 reads the word and resets it (device.h
    resetSignal: nobody signals it then). Returns what rank 0 read per round."""
    from commref.device_kernels import abi
    from commref.transports.gin import semantics
    from commref.transports.gin.backends import BACKENDS
    from commref.transports.gin.queue import QueueRegion, QueueWriter
    from commref.transports.windows import register_window

    K, SIGNAL, capacity = 40, 3, 64
    layout, nbytes = abi.window_layout(1, 256, 4, capacity, 1, world.size)
    window = register_window(world, nbytes, "cpu")
    region = QueueRegion(window, layout, capacity, 1)
    word = int(layout["ginSignalsOff"]) + 8 * SIGNAL
    atomics = host_atomics()
    proxy = writer = None
    if world.rank > 0:
        proxy = GpuProxy(
            world,
            window,
            layout,
            region,
            capacity,
            BACKENDS["proxy"],
            semantics.ORDERED,
            driver=LateCopies(seed=40 + world.rank),
        )
        proxy.start()
        writer = QueueWriter(region.queue, QueueRegion.LAYOUT, capacity, atomics)
    seen = []
    try:
        for _ in range(rounds):
            world.barrier(what="round starts")
            if world.rank == 0:
                for _ in range(K):
                    atomics.add_u64(int(window.address) + word, 5)
                    time.sleep(0)
            else:
                flags, value = (abi.GIN_HAS_SIGNAL, 0) if world.rank == 1 else (abi.GIN_HAS_SIGNAL | abi.GIN_ADD, 3)
                writer.publish(
                    [writer.fill(abi.GIN_SIGNAL, flags, peer=0, signal=SIGNAL, value=value) for _ in range(K)]
                )
                proxy.quiesce(WORLD_TIMEOUT)
                assert proxy.error is None, proxy.error
            world.barrier(what="round done")
            if world.rank == 0:
                seen.append(int(window.local[word : word + 8].view(np.uint64)[0]))
                window.local[word : word + 8].view(np.uint64)[0] = 0  # resetSignal
            world.barrier(what="reset")
    finally:
        if proxy is not None:
            proxy.stop()
            senders_seen.append(proxy.driver.device_adds.count(window.peer_addresses[0] + word))
        world.barrier(what="stopped")
        window.close()
    return seen


def test_every_writer_of_a_signal_lands_and_a_reset_holds():
    """Several writers of one signal word, and a reset between rounds: every increment of
    every writer lands (the proxies add; a proxy writing its own running total, as one did,
    leaves one sender's total, and ignores the reset)."""
    adds: list = []
    seen, _, _ = ThreadWorld.run(3, _signal_writers, 3, adds, timeout=WORLD_TIMEOUT)
    assert seen == [40 * (1 + 3 + 5)] * 3, seen
    assert adds == [3 * 40, 3 * 40], adds  # each signal one word-add on the target's word


def test_a_signal_over_a_link_without_native_peer_atomics_is_refused_naming_the_attribute():
    """Where this GPU's atomics on the peer's window are not native (P2P over PCIe only),
    the proxy's add would not be atomic with the word's other writers: the first signal to
    that peer fails the proxy (the job aborts) with the attribute's name."""
    from commref.device_kernels import abi
    from commref.transports.gin import semantics
    from commref.transports.gin.backends import BACKENDS
    from commref.transports.gin.queue import QueueRegion, QueueWriter
    from commref.transports.windows import register_window

    def body(world):
        layout, nbytes = abi.window_layout(1, 256, 4, 16, 1, world.size)
        window = register_window(world, nbytes, "cpu")
        region = QueueRegion(window, layout, 16, 1)
        error = None
        cleared = abort_cleared(world)
        if world.rank == 1:
            assert cleared.wait(WORLD_TIMEOUT), "rank 1: rank 0 never cleared the abort word"
        if world.rank == 0:
            driver = LateCopies(seed=3, peer_atomics=False)
            proxy = GpuProxy(world, window, layout, region, 16, BACKENDS["proxy"], semantics.ORDERED, driver=driver)
            try:
                proxy.start()
                writer = QueueWriter(region.queue, QueueRegion.LAYOUT, 16, host_atomics())
                writer.publish([writer.fill(abi.GIN_SIGNAL, abi.GIN_HAS_SIGNAL, peer=1, signal=0)])
                proxy.quiesce(10)
                error, aborted = str(proxy.error), int(world.abort_word[0])
                world.abort_word[0] = 0
            finally:
                cleared.set()
            proxy.stop()
            assert aborted == 1 and not driver.device_adds
        world.barrier(what="checked")
        window.close()
        return error

    error, _ = ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)
    assert error.startswith("rank 0: GIN signals to peer 1 are atomic adds by this GPU"), error
    assert "CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED = 0" in error and "network 'mpi'" in error, error
    assert "\n" not in error


def test_gpu_refuses_the_unordered_wire_and_independent_contexts_in_one_line():
    from commref.transports.gin.options import GinOptions

    def body(world):
        with pytest.raises(
            CapabilityError,
            match=r"rank \d: GIN on GPUs carries the ordered wire in this version "
            r".* the unordered wire runs on the CPU engine \(device='cpu'\)",
        ):
            gin_plan.plan_gin(world, GinOptions(path="gin", wire="unordered"), "cuda", 1, 4)
        with pytest.raises(
            CapabilityError,
            match=r"^rank \d: independent contexts \(independent_contexts\) run in the Python GIN proxy "
            r"of the CPU engine \(device='cpu'\), not on a GPU in this version$",
        ):
            gin_plan.plan_gin(world, GinOptions(path="gin", independent_contexts=True), "cuda", 1, 4)

    ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)


# ---- network mpi (2 MPI processes; this file is the job's script) ----


@pytest.mark.mpi
def test_copy_engine_proxy_over_network_mpi_is_exact_and_conforms(shm_leak_check):
    """GpuProxy on network mpi (device-to-host, MPI, host-to-device through LateCopies),
    2 MPI processes: the collectives exact, each rank's trace replayed."""
    import os
    import re

    from conftest import clean_env, run_mpi

    proc = run_mpi(
        2, [os.path.relpath(__file__, os.path.dirname(os.path.dirname(__file__)))], timeout=120, env=clean_env()
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = set(re.findall(r"rank (\d) (\S+) (\S+) seed (\d+): conforms \d+ posts, wrong 0, GpuProxy mpi", proc.stdout))
    assert len(lines) == 2 * 3 * 2, out[-4000:]


def _mpi_main() -> None:
    from commref.transports.mpi_world import MPIWorld

    world = MPIWorld()

    def start_proxy(self, world, window, layout, observer=None, engine=None, region=None, device="cpu", device_id=0):
        if not self.used:
            return None
        proxy = GpuProxy(
            world,
            window,
            layout,
            region,
            self.options.queue,
            self.backend,
            self.transport,
            driver=LateCopies(seed=500 + world.rank, host_native_atomics=world.rank == 0),
            network=self.network,
            mpi_comm=world.comm.Dup(),
            mpi_tag=engines.network_tag(),
        )
        proxy.start()
        return proxy

    gin_plan.GinPlan.start_proxy = start_proxy
    for backend, protocol in (("proxy", "strong"), ("rc", "weak-last"), ("gda", "flush-signal")):
        for seed, (trace, wrong, _) in zip(
            (1, 2), collectives_run(world, backend, "ordered", protocol, [1, 2], network="mpi")
        ):
            counts = replay_trace(trace, backend, "ordered")
            line = (
                f"rank {world.rank} {backend} {protocol} seed {seed}: conforms {counts['post']} posts, wrong {wrong}, "
            )
            sys.stdout.write(line + "GpuProxy mpi\n")
            sys.stdout.flush()
    world.barrier(what="gpu proxy mpi done")


if __name__ == "__main__":
    _mpi_main()
    sys.exit(0)


def test_cuda_driver_without_cuda_python_is_one_clear_refusal(monkeypatch):
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(
        CapabilityError,
        match=r"GIN on GPUs drives the copy engine through cuda-python, which is "
        r"not installed",
    ):
        CudaDriver(0)


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs nvcc (a compile check, nothing runs)")
def test_the_word_add_kernel_compiles_for_sm90(tmp_path):
    """The proxy's word-add kernel (signals and device-side counter bumps) builds for the
    GPU as the loader builds it (its include path), here with nvcc for sm_90."""
    from commref.transports.gin import cuda_driver

    src = tmp_path / "gin_word_add.cu"
    src.write_text(cuda_driver.WORD_ADD_SOURCE)
    proc = nvcc_sm90(src, tmp_path / "gin_word_add.cubin", timeout=300)
    assert proc.returncode == 0, proc.stderr
    ptx = tmp_path / "gin_word_add.ptx"
    proc = nvcc_sm90(src, ptx, "-ptx", timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = ptx.read_text()  # the add is one system-scope 64-bit atomic with release, after a system fence
    assert f".entry {cuda_driver.WORD_ADD_KERNEL}(" in text and "atom.release.sys.global.add.u64" in text, text
    assert "fence.sc.sys" in text or "membar.sys" in text, text


class FakeDriverModule:
    """cuda.bindings.driver as CudaDriver calls it: each call returns (CUresult, ...) and is
    logged; `attributes` answers cuDeviceGetAttribute, `p2p` cuDeviceGetP2PAttribute,
    `ordinal` cuPointerGetAttribute(DEVICE_ORDINAL)."""

    def __init__(self, host_native=0, p2p=0, ordinal=1):
        import enum

        self.log: list = []
        self.CUresult = enum.IntEnum("CUresult", {"CUDA_SUCCESS": 0, "CUDA_ERROR_NOT_READY": 600})
        names = [
            "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
            "CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED",
            "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",
            "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",
        ]
        self.CUdevice_attribute = enum.IntEnum("CUdevice_attribute", names)
        self.CUdevice_P2PAttribute = enum.IntEnum("P2P", ["CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED"])
        self.CUpointer_attribute = enum.IntEnum("Ptr", ["CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL"])
        self.attributes = dict(zip(names, [1, host_native, 9, 0]))
        self.p2p, self.ordinal = p2p, ordinal
        ok = self.CUresult.CUDA_SUCCESS
        for name, result in {
            "cuInit": (ok,),
            "cuDeviceGet": None,
            "cuDevicePrimaryCtxRetain": (ok, "ctx"),
            "cuCtxGetCurrent": (ok, None),
            "cuCtxSetCurrent": (ok,),
            "cuModuleLoadData": (ok, "mod"),
            "cuModuleGetFunction": (ok, "fn"),
            "cuModuleUnload": (ok,),
            "cuDevicePrimaryCtxRelease": (ok,),
        }.items():
            setattr(self, name, self._logged(name, result))

    def _logged(self, name, result):
        def call(*args):
            self.log.append((name, *args))
            return result if result is not None else (self.CUresult.CUDA_SUCCESS, ("dev", args[0]))

        return call

    def cuDeviceGetAttribute(self, attr, dev):
        return self.CUresult.CUDA_SUCCESS, self.attributes[attr.name]

    def cuPointerGetAttribute(self, attr, addr):
        return self.CUresult.CUDA_SUCCESS, self.ordinal

    def cuDeviceGetP2PAttribute(self, attr, src, dst):
        self.log.append(("cuDeviceGetP2PAttribute", src, dst))
        return self.CUresult.CUDA_SUCCESS, self.p2p

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        words = (ctypes.c_uint64 * 2).from_address(params)  # kernelParams: the parameters' addresses
        self.log.append(
            (
                "cuLaunchKernel",
                fn,
                (gx, gy, gz, bx, by, bz),
                stream,
                ctypes.c_uint64.from_address(words[0]).value,
                ctypes.c_uint64.from_address(words[1]).value,
            )
        )
        return (self.CUresult.CUDA_SUCCESS,)


def test_cuda_driver_launches_the_word_add_kernel_and_asks_the_atomics_attributes(monkeypatch, tmp_path):
    """CudaDriver over a stand-in of cuda-python's driver module: it asks for host-native
    atomics, loads the word-add kernel (built by the loader; cuFuncLoad at once), launches it with one
    thread and its two parameters (address, value) as cuLaunchKernel's kernelParams, and
    asks the P2P attribute once per peer device."""
    import types

    from commref.device_kernels import gpu_loader

    fake = FakeDriverModule(host_native=0, p2p=0, ordinal=1)
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = fake
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake)
    built = []
    image = tmp_path / "image.cubin"
    image.write_bytes(b"\x7fELF-not-really")

    def build(path, cc):
        built.append((path.read_text(), cc))
        return image

    monkeypatch.setattr(gpu_loader, "build_user_gpu_image", build)
    monkeypatch.setattr(gpu_loader, "func_load", lambda function, name: fake.log.append(("cuFuncLoad", function, name)))
    driver = CudaDriver(0)
    assert built == [(WORD_ADD_SOURCE, 90)]
    assert ("cuFuncLoad", "fn", "commref_gin_word_add") in fake.log, "loaded at construction, not at a launch"
    assert driver.host_native_atomics is False
    driver.add_value(0x7000_0000_0010, 5, "stream-a")
    driver.add_value(0x7000_0000_0018, (1 << 64) + 3, "stream-b")
    launches = [e[1:] for e in fake.log if e[0] == "cuLaunchKernel"]
    assert launches == [
        ("fn", (1, 1, 1, 1, 1, 1), "stream-a", 0x7000_0000_0010, 5),
        ("fn", (1, 1, 1, 1, 1, 1), "stream-b", 0x7000_0000_0018, 3),
    ], launches
    assert driver.peer_native_atomics(0x1000) == (1, False)
    assert driver.peer_native_atomics(0x2000) == (1, False)
    assert len([e for e in fake.log if e[0] == "cuDeviceGetP2PAttribute"]) == 1, "asked once per peer device"
    fake.ordinal = 0
    assert driver.peer_native_atomics(0x3000) == (0, True), "this device's own memory"
    driver.close()
    assert ("cuModuleUnload", "mod") in fake.log
