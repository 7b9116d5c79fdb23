"""The GIN copy-engine proxy (transports/gin/gpu_proxy.py), without a GPU.

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
- network mpi: the same over wires.MpiWire with DeviceWindow (2 MPI processes: exact,
  traces replayed);
- refusals: what plan_gin refuses on GPUs (the unordered wire), and CudaDriver without
  cuda-python, each in one line.

On a GPU, tests/gpu/gpu_check.sh runs the collectives over this proxy with the real driver.
"""

from __future__ import annotations

import collections
import ctypes
import random
import sys
import time

import pytest

from commref.transports.errors import CapabilityError, CommMismatch, CommTimeout
from commref.transports.gin import plan as gin_plan
from commref.transports.gin.atomics import host_atomics
from commref.transports.gin.gpu_proxy import CudaDriver, GpuProxy
from commref.transports.world import ThreadWorld

from test_gin import _run_sweep, many_channels  # noqa: F401 (a fixture)
from test_gin_conformance import collectives_run, replay_trace

WORLD_TIMEOUT = 60.0


class LateCopies:
    """CudaDriver's interface over host memory, with operations that run late (see the
    module docstring). `signal_stream`: write values on one stream of their own (a planted
    bug: no order after the data)."""

    def __init__(self, seed: int, signal_stream: bool = False):
        self.rng = random.Random(seed)
        self.streams: list[collections.deque] = []
        self.store = host_atomics().store_release_u64
        self.signal_stream = self.stream() if signal_stream else None
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


@pytest.fixture
def gpu_proxy(monkeypatch):
    """Every GIN communicator of the test is carried by a GpuProxy over LateCopies (seeded
    by rank); set `gpu_proxy["driver"]` to another factory to plant a bug."""
    settings = {"driver": lambda rank: LateCopies(seed=1000 + rank), "made": []}

    def start_proxy(self, world, window, layout, observer=None, engine=None, region=None, device="cpu",
                    device_id=0):
        if not self.used:
            return None
        driver = settings["driver"](world.rank)
        proxy = GpuProxy(world, window, layout, region, self.options.queue, self.backend, self.transport,
                         driver=driver)
        settings["made"].append(proxy)
        proxy.start()
        return proxy

    monkeypatch.setattr(gin_plan.GinPlan, "start_proxy", start_proxy)
    return settings


@pytest.mark.parametrize("nranks, backend, protocol, dtypes, ops", [
    (2, "proxy", "strong", ["float32", "int8"], ["sum", "max"]),
    (3, "proxy", "strong", ["bfloat16", "int32"], ["prod", "avg"]),
    (2, "rc", "weak-last", ["float64"], ["sum"]),
    (3, "gda", "signal-per-put", ["float32"], ["min"]),
    (2, "gda", "flush-signal", ["int64"], ["sum"]),
])
def test_collectives_over_the_copy_engine_proxy_are_exact(nranks, backend, protocol, dtypes, ops, gpu_proxy):
    opts = dict(path="gin", backend=backend, wire="ordered", network="shm", gin_protocol=protocol, max_channels=2,
                slot_bytes=256)
    _run_sweep(nranks, opts, dtypes, ops, [0, 1, 7, 3001])
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

    def __init__(self):
        super().__init__(seed=0)
        self.held = True

    def _progress(self) -> None:
        if not self.held:
            super()._progress()

    def release(self) -> None:
        self.held = False


def test_a_counter_waits_for_its_copy():
    """A put's counter says "the source is reusable": the proxy bumps it only once the
    copy has run, and a flush completes only then (the stand-in holds the copy)."""
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
            driver = HeldCopies()
            proxy = GpuProxy(world, window, layout, region, 16, BACKENDS["proxy"], semantics.ORDERED, driver=driver)
            proxy.start()
            writer = QueueWriter(region.queue, QueueRegion.LAYOUT, 16, host_atomics())
            window.local[0:8] = 7
            slots = [writer.fill(abi.GIN_PUT, abi.GIN_HAS_COUNTER, peer=1, dst=64, src=0, nbytes=8, counter=1),
                     writer.fill(abi.GIN_FLUSH)]
            writer.publish(slots)
            time.sleep(0.2)
            seen = (int(region.counters[1]), writer.consumed())  # held: no counter, the flush not done
            driver.release()
            proxy.quiesce(10)
            seen += (int(region.counters[1]), writer.consumed())
            proxy.stop()
            assert proxy.error is None, proxy.error
        world.barrier(what="landed")
        out = bytes(window.local[64:72])
        world.barrier(what="read")
        window.close()
        return seen, out

    (seen, _), (_, landed) = ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)
    assert seen == (0, 1, 1, 2), seen  # the put's slot is consumed at once; the flush and the counter wait
    assert landed == bytes([7] * 8)


def test_gpu_refuses_the_unordered_wire_in_one_line():
    from commref.transports.gin.options import GinOptions

    def body(world):
        with pytest.raises(CapabilityError, match=r"rank \d: GIN on GPUs carries the ordered wire in this version "
                                                  r".* the unordered wire runs on the CPU engine \(device='cpu'\)"):
            gin_plan.plan_gin(world, GinOptions(path="gin", wire="unordered"), "cuda", 1, 4)

    ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)


# ---- network mpi (2 MPI processes; this file is the job's script) ----


@pytest.mark.mpi
def test_copy_engine_proxy_over_network_mpi_is_exact_and_conforms(shm_leak_check):
    """GpuProxy on network mpi (device-to-host, MPI, host-to-device through LateCopies),
    2 MPI processes: the collectives exact, each rank's trace replayed."""
    import os
    import re

    from conftest import clean_env, run_mpi

    proc = run_mpi(2, [os.path.relpath(__file__, os.path.dirname(os.path.dirname(__file__)))], timeout=120,
                   env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = set(re.findall(r"rank (\d) (\S+) (\S+) seed (\d+): conforms \d+ posts, wrong 0, GpuProxy mpi", proc.stdout))
    assert len(lines) == 2 * 3 * 2, out[-4000:]


def _mpi_main() -> None:
    from commref.transports.world import MPIWorld

    world = MPIWorld()

    def start_proxy(self, world, window, layout, observer=None, engine=None, region=None, device="cpu",
                    device_id=0):
        if not self.used:
            return None
        proxy = GpuProxy(world, window, layout, region, self.options.queue, self.backend, self.transport,
                         driver=LateCopies(seed=500 + world.rank), network=self.network,
                         mpi_comm=world.comm.Dup(), mpi_tag=gin_plan.network_tag())
        proxy.start()
        return proxy

    gin_plan.GinPlan.start_proxy = start_proxy
    for backend, protocol in (("proxy", "strong"), ("rc", "weak-last"), ("gda", "flush-signal")):
        for seed, (trace, wrong, _) in zip((1, 2), collectives_run(world, backend, "ordered", protocol, [1, 2],
                                                                    network="mpi")):
            counts = replay_trace(trace, backend, "ordered")
            line = f"rank {world.rank} {backend} {protocol} seed {seed}: conforms {counts['post']} posts, wrong {wrong}, "
            sys.stdout.write(line + "GpuProxy mpi\n")
            sys.stdout.flush()
    world.barrier(what="gpu proxy mpi done")


if __name__ == "__main__":
    _mpi_main()
    sys.exit(0)


def test_cuda_driver_without_cuda_python_is_one_clear_refusal(monkeypatch):
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(CapabilityError, match=r"GIN on GPUs drives the copy engine through cuda-python, which is "
                                              r"not installed"):
        CudaDriver(0)
