"""The native GIN engine (transports/gin/native.py, native_engine/): the default for
the ordered and the unordered wire, on network shm and (built against the MPI mpi4py
loaded) network mpi.

- choice: engines.start_engine (GinPlan.start_proxy) picks NativeProxy for both wires,
  a lossy unordered wire (fault) too, GinProxy for a lossy ordered wire and with an
  observer; COMMREF_GIN_ENGINE forces one or is refused;
- exactness: the collectives over GIN shm on every backend that runs the ordered wire
  (proxy, rc, gda) and on the unordered wire (proxy, gda), ThreadWorld 2 and 3 ranks,
  and 2 MPI ranks (`commref check`).
"""

from __future__ import annotations

import sys

import pytest
from conftest import clean_env, run_mpi
from helpers import CHECK_MODULE, WORLD_TIMEOUT, assert_check_clean, ordered_shm_gin, run_gin_sweep

from commref.collectives.catalogue import KERNEL_NAMES
from commref.collectives.communicator import Communicator
from commref.transports.errors import CapabilityError
from commref.transports.gin import semantics
from commref.transports.thread_world import ThreadWorld

# ---------------------------------------------------------------------------------------
# which engine
# ---------------------------------------------------------------------------------------


def _engine_kind(world, wire, network="shm", **more):
    comm = Communicator(world, "cpu", timeout=WORLD_TIMEOUT, path="gin", wire=wire, network=network, **more)
    try:
        return type(comm.proxy).__name__
    finally:
        world.barrier(what="kind")
        comm.close()


def test_both_wires_run_native_and_a_lossy_ordered_one_python(monkeypatch):
    monkeypatch.delenv("COMMREF_GIN_ENGINE", raising=False)
    assert ThreadWorld.run(2, _engine_kind, "ordered", timeout=WORLD_TIMEOUT) == ["NativeProxy"] * 2
    assert ThreadWorld.run(2, _engine_kind, "unordered", timeout=WORLD_TIMEOUT) == ["NativeProxy"] * 2
    lossy = {"fault": "drop=0.05"}
    assert ThreadWorld.run(2, _engine_kind, "unordered", timeout=WORLD_TIMEOUT, **lossy) == ["NativeProxy"] * 2
    assert ThreadWorld.run(2, _engine_kind, "ordered", timeout=WORLD_TIMEOUT, **lossy) == ["GinProxy"] * 2
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "python")
    assert ThreadWorld.run(2, _engine_kind, "ordered", timeout=WORLD_TIMEOUT) == ["GinProxy"] * 2
    assert ThreadWorld.run(2, _engine_kind, "unordered", timeout=WORLD_TIMEOUT) == ["GinProxy"] * 2
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "native")
    with pytest.raises(
        CapabilityError, match=r"COMMREF_GIN_ENGINE=native: the native GIN engine cannot carry a lossy ordered wire"
    ):
        ThreadWorld.run(2, _engine_kind, "ordered", timeout=WORLD_TIMEOUT, **lossy)
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "fast")
    with pytest.raises(ValueError, match="COMMREF_GIN_ENGINE must be one of auto, native, python, not 'fast'"):
        ThreadWorld.run(2, _engine_kind, "ordered", timeout=WORLD_TIMEOUT)


def test_what_the_native_engine_carries():
    """(network mpi is native where the engine builds against the loaded MPI: the MPI
    jobs below force COMMREF_GIN_ENGINE=native on it.)"""
    from commref.transports.gin import native
    from commref.transports.gin.observer import Observer

    assert native.supports(semantics.ORDERED, "shm") is None
    assert "observer" in native.supports(semantics.ORDERED, "shm", Observer())
    assert "network 'tcp'" in native.supports(semantics.ORDERED, "tcp")
    assert native.supports(semantics.UNORDERED, "shm") is None
    block = semantics.Transport("unordered", ordered=False, placement="block128")
    assert "placement 'block128'" in native.supports(block, "shm")
    assert "segments of 32768 bytes on network mpi" in native.supports(semantics.UNORDERED, "mpi", None, 32768)


def test_cli_refuses_a_bad_engine_in_one_line():
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "commref.cli", "check", "allreduce", "--count", "7"],
        env=clean_env(COMMREF_GIN_ENGINE="turbo"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "commref check: error: COMMREF_GIN_ENGINE must be one of auto, native, python, not 'turbo'"
    )


# ---------------------------------------------------------------------------------------
# exactness: every collective over the native engine
# ---------------------------------------------------------------------------------------

# (nranks, backend, gin_protocol, channels, dtypes, ops): every backend that runs the ordered wire
SWEEPS = [
    (2, "proxy", "strong", 1, ["float32", "int8"], ["sum", "max"]),
    (3, "proxy", "strong", 2, ["float16", "int32"], ["sum", "min"]),
    (2, "rc", "strong", 2, ["float64"], ["sum", "avg"]),
    (3, "rc", "strong", 1, ["bfloat16"], ["max"]),
    (2, "gda", "signal-per-put", 2, ["int32"], ["sum"]),
    (3, "gda", "flush-signal", 1, ["float32"], ["sum", "prod"]),
]


@pytest.mark.parametrize(
    "nranks, backend, protocol, channels, dtypes, ops",
    [pytest.param(*s, id=f"{s[0]}ranks-{s[1]}-{s[2]}-{s[3]}ch") for s in SWEEPS],
)
def test_sweep_over_native_engine(nranks, backend, protocol, channels, dtypes, ops, many_channels, native):
    infos = run_gin_sweep(
        nranks, ordered_shm_gin(backend, protocol, channels, segment_bytes=64), dtypes, ops, [0, 1, 7, 1001, 3001]
    )
    assert {i["backend"] for i in infos} == {backend}
    assert all(i["ops"] > 0 for i in infos), "the engines carried nothing"


# (nranks, backend, gin_protocol, channels, dtypes, ops) on the unordered wire
UNORDERED_SWEEPS = [
    (2, "proxy", "strong", 2, ["float32", "int8"], ["sum", "max"]),
    (3, "gda", "signal-per-put", 1, ["int32"], ["sum"]),
]


@pytest.mark.parametrize(
    "nranks, backend, protocol, channels, dtypes, ops",
    [pytest.param(*s, id=f"{s[0]}ranks-{s[1]}-{s[2]}-{s[3]}ch") for s in UNORDERED_SWEEPS],
)
def test_sweep_over_native_unordered_wire(nranks, backend, protocol, channels, dtypes, ops, many_channels, native):
    opts = dict(ordered_shm_gin(backend, protocol, channels, segment_bytes=64), wire="unordered", seed=5)
    infos = run_gin_sweep(nranks, opts, dtypes, ops, [0, 1, 7, 1001, 3001])
    assert {i["backend"] for i in infos} == {backend}
    assert all(i["ops"] > 0 for i in infos), "the engines carried nothing"


@pytest.mark.mpi
@pytest.mark.parametrize("network, wire", [("shm", "ordered"), ("mpi", "ordered"), ("mpi", "unordered")])
def test_check_over_native_engine_under_mpiexec(network, wire, shm_leak_check):
    args = [*CHECK_MODULE, *KERNEL_NAMES, "--path", "gin", "--network", network, "--wire", wire]
    args += "--dtype float32 int8 --op sum max --count 0 1 7 1001 --slot-bytes 512".split()
    proc = run_mpi(2, args, timeout=90, module=True, env=clean_env(COMMREF_GIN_ENGINE="native"))
    s = assert_check_clean(proc)
    assert "# commref check: 2 ranks, device cpu" in proc.stdout
    # ..., + alltoall out of place (2 dtypes x 4 counts), + float32 denormal cases, + the
    # direct kernels' (they push over this engine): allreduce out of place x 2 ops x 2 dtypes
    # x 3 counts (rounded down to even: 0, 6, 1000) and float32's denormal ones, allgather
    # x 2 dtypes x 4 counts x 2, alltoall x 2 dtypes x 4 counts
    pushed = 2 * 2 * 3 + 2 * 3 + 2 * 4 * 2 + 2 * 4
    assert s.cases == (4 * 2 + 2) * 2 * 4 * 2 + 2 * 4 + 4 * 2 * 1 * 4 + pushed, s
    assert (s.wrong, s.bad_cases) == (0, 0), s
