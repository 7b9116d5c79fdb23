"""The GIN wire model (GinOptions.wire_rate, wire_latency; native_engine/wire.h, "Wire model"):
each rank's wire sends its descriptors in queue order at wire_rate bytes/s, and each
takes effect wire_latency after it is sent.

- options: numbers and words ("12.5G", "5us"), bad values refused in one line, before
  any rank starts on the CLI;
- the model's lower bounds, which no schedule can beat: a collective over a rate-limited
  wire takes at least the bytes this rank sends over the rate, and one whose steps
  depend on each other's landings at least that many latencies, on both wires (and with
  independent contexts); results stay exact;
- refusals where the native engine does not carry the run (COMMREF_GIN_ENGINE=python);
- `commref check --np 2 --path gin --wire-rate ... --wire-latency ...` exact under mpiexec.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import clean_env, run_mpi
from helpers import CHECK_MODULE, assert_check_clean

from commref.collectives.communicator import Communicator
from commref.collectives.options import CommOptions
from commref.transports.errors import CapabilityError
from commref.transports.gin.options import GinOptions
from commref.transports.option_types import OptionError
from commref.transports.thread_world import ThreadWorld


def test_wire_model_options_read_numbers_and_units():
    assert GinOptions(wire_rate="12.5G").wire_rate == 12.5e9
    assert GinOptions(wire_rate="100MB/s").wire_rate == 1e8
    assert GinOptions(wire_rate=2e9).wire_rate == 2e9
    assert GinOptions(wire_latency="5us").wire_latency == pytest.approx(5e-6)
    assert GinOptions(wire_latency="2 ms").wire_latency == pytest.approx(2e-3)
    assert GinOptions(wire_latency=0.25).wire_latency == 0.25
    assert not GinOptions().wire_modeled and GinOptions(wire_latency="1ns").wire_modeled
    assert CommOptions.from_kwargs(wire_rate="1g", wire_latency="3us").gin.wire_rate == 1e9
    for bad in ("fast", "5x", "-1", -1.0, float("inf"), "1us"):
        with pytest.raises(OptionError, match=r"^wire_rate must be a number >= 0 in bytes/s"):
            GinOptions(wire_rate=bad)
    with pytest.raises(OptionError, match=r"^wire_latency must be a number >= 0 in seconds"):
        GinOptions(wire_latency="1G")
    assert GinOptions(wire="unordered", wire_latency="5us").wire_modeled
    assert GinOptions(independent_contexts=True, wire_rate="1G").wire_modeled


def _timed_allreduce(world, nbytes: int, model: dict, wire: str = "ordered", **more):
    """One AllReduce of `nbytes` float32 over GIN (shm, `wire`) after a warm-up call:
    (seconds, exact)."""
    with Communicator(world, "cpu", path="gin", wire=wire, network="shm", **model, **more) as comm:
        x = np.arange(nbytes // 4, dtype=np.float32) % 251 * (world.rank + 1)
        y = np.empty_like(x)
        comm.allreduce(x, y)
        world.barrier(what="timed call")
        t0 = time.perf_counter()
        comm.allreduce(x, y)
        seconds = time.perf_counter() - t0
        expected = np.arange(nbytes // 4, dtype=np.float32) % 251 * sum(range(1, world.size + 1))
        return seconds, bool((y == expected).all())


WIRES = [("ordered", {}), ("unordered", {}), ("ordered", {"independent_contexts": True, "max_channels": 2})]
WIRE_IDS = ["ordered", "unordered", "independent-contexts"]


@pytest.mark.parametrize("wire, more", WIRES, ids=WIRE_IDS)
def test_a_rate_limited_wire_takes_at_least_the_bytes_over_the_rate(wire, more):
    """2 ranks, 1 MiB: a ring AllReduce sends 2(n-1)/n of the buffer from each rank (plus
    slot headers), so at 50 MB/s no call can end before ~21 ms."""
    rate, nbytes = 50e6, 1 << 20
    for seconds, exact in ThreadWorld.run(2, _timed_allreduce, nbytes, {"wire_rate": rate}, wire, timeout=60, **more):
        assert exact
        assert seconds >= nbytes / rate, seconds


@pytest.mark.parametrize("wire, more", WIRES, ids=WIRE_IDS)
def test_wire_latency_delays_every_dependent_landing(wire, more):
    """2 ranks, 8 bytes: the ring's all-gather step waits for the reduce-scatter step's
    landing, so a call takes at least two latencies."""
    latency = 5e-3
    for seconds, exact in ThreadWorld.run(2, _timed_allreduce, 8, {"wire_latency": latency}, wire, timeout=60, **more):
        assert exact
        assert seconds >= 2 * latency, seconds


def test_the_python_engine_does_not_carry_the_model(monkeypatch):
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "python")

    def body(world):
        with pytest.raises(CapabilityError, match=r"the wire model \(wire_rate, wire_latency\) runs in the native"):
            Communicator(world, "cpu", path="gin", network="shm", wire_rate="1G")

    ThreadWorld.run(2, body, timeout=60)


@pytest.mark.mpi
def test_check_with_the_wire_model_under_mpiexec(shm_leak_check):
    args = [*CHECK_MODULE, *"allreduce allgather reduce_scatter --path gin --wire-rate 2G --wire-latency 20us".split()]
    args += "--dtype float32 int32 --op sum max --count 0 1 7 1009".split()
    proc = run_mpi(2, args, timeout=120, module=True, env=clean_env())
    assert_check_clean(proc)
    assert "# GIN wire model: 2 GB/s per rank's wire, 20 us latency" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [
                "check",
                "--np",
                "2",
                "--path",
                "gin",
                "--wire",
                "ordered",
                "--wire-latency",
                "5us",
                "--fault",
                "drop=0.1",
            ],
            "commref check: error: the wire model (wire_rate, wire_latency) runs in the native GIN engine and faults "
            "on the ordered wire in the Python proxy: choose one (or the unordered wire, where the native engine "
            "carries both)",
        ),
        (
            ["bench", "all_reduce", "--np", "2", "--path", "gin", "--wire-rate", "fast"],
            "commref bench: error: argument --wire-rate: wire_rate must be a number >= 0 in bytes/s, e.g. 12.5G, "
            "not 'fast' (comma-separated for several)",
        ),
    ],
)
def test_cli_refuses_a_bad_wire_model_before_any_rank_starts(argv, message):
    proc = subprocess.run(
        [sys.executable, "-m", "commref.cli", *argv], capture_output=True, text=True, timeout=60, env=clean_env()
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == message, proc.stderr
