"""The device API for users' kernels (device.h; collectives/device_api/device_comm.py):
a device communicator, kernels compiled from a user's source and launched on the CPU
engine, over LSA and GIN (ordered and unordered wires, simulated nodes), with the
requirements checked against the backends, failures reported as the collectives
report them, and the fused RMSNorm example (commref/rmsnorm.py) exact."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from conftest import clean_env, run_mpi
from helpers import COUNTED, COUNTERS_GET, EXCHANGE, PREAMBLE, PRIMS_PER_PEER, PRIMS_RING, WORLD_TIMEOUT, nvcc_sm90

import commref
from commref import CapabilityError, CommTimeout, ThreadWorld
from commref.collectives.device_api import CompileError, DeviceComm, Kernel
from commref.device_kernels import build, gpu_loader
from commref.rmsnorm import FusedRMSNorm, reference
from commref.transports.gin import semantics
from commref.transports.gin.study.cells import counted_writes_cell, counted_writes_refusal, study_safe
from commref.transports.nodes import NODES_ENV

# Waits for a signal that nobody sends.
WAIT_FOREVER = (
    PREAMBLE
    + r"""
COMMREF_KERNEL(wait_forever, KernelArgs, args) {
  DeviceComm comm(args);
  comm.waitSignal(0, 1, (comm.rank() + 1) % comm.nranks());
}
"""
)

# Out-of-range device-API arguments, chosen by argument 0.
BAD_CALL = (
    PREAMBLE
    + r"""
COMMREF_KERNEL(bad_call, KernelArgs, args) {
  DeviceComm comm(args);
  const int which = (int)comm.u64(0), peer = (comm.rank() + 1) % comm.nranks();
  if (which == 0) comm.signal(peer, WeakSignalInc(5));            // only 2 signals
  if (which == 1) comm.put(peer, 4096 - 8, 0, 16);          // past the window's end
  if (which == 2) comm.put(peer, 0, 0, 8, NoSignal(), 3);   // no counter 3
  if (which == 3) comm.u64(9);                               // one argument only
  if (which == 4) comm.gin(1).signal(peer, WeakSignalInc(0));         // one context only
}
"""
)


def _run(nranks, body, *args, **kwargs):
    return ThreadWorld.run(nranks, body, *args, timeout=WORLD_TIMEOUT, **kwargs)


PATHS = {
    "lsa": dict(path="lsa"),
    "gin-ordered": dict(path="gin"),
    "gin-unordered": dict(path="gin", wire="unordered", seed=3),
}


def _exchange(world, options):
    kernel = Kernel(EXCHANGE, "exchange")
    with DeviceComm(world, window_bytes=4096, signals=1, device="cpu", **options) as dc:
        for launch in (1, 2, 3):
            out = np.zeros(world.size, np.uint64)
            kernel.launch(dc, 1, args=(out,))
            assert out.tolist() == [1000 * launch + j for j in range(world.size)], (world.rank, out)
        return dc.backend, dc.lsa_ranks


@pytest.mark.parametrize("path", sorted(PATHS))
def test_puts_and_signals_reach_every_peer(path):
    results = _run(3, _exchange, PATHS[path])
    backends = {b for b, _ in results}
    assert backends == ({None} if path == "lsa" else {"rc"} if path == "gin-ordered" else {"proxy"})


@pytest.mark.parametrize("wire", ["ordered", "unordered"])
def test_simulated_nodes_mix_lsa_and_gin(wire, monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")
    results = _run(4, _exchange, dict(path="auto", wire=wire))
    assert [lsa for _, lsa in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]


@pytest.mark.parametrize("path", ["lsa", "gin-unordered"])
def test_counted_writes_deliver_every_chunk(path):
    chunks = 24
    kernel = Kernel(COUNTED, "counted")

    def body(world):
        with DeviceComm(
            world, window_bytes=2 * chunks * 64, signals=2, counted_writes=True, device="cpu", **PATHS[path]
        ) as dc:
            for launch in (1, 2):
                out = np.zeros(chunks * 8, np.uint64)
                kernel.launch(dc, 1, args=(chunks, out))
                sender = (world.rank - 1) % world.size
                want = [launch << 32 | sender << 24 | i for i in range(chunks * 8)]
                assert out.tolist() == want, world.rank

    _run(3, body)


def test_counted_writes_follow_the_ordering_study():
    """The runtime refuses counted writes exactly where the study's counted-writes cell
    is unsafe: on a wire that may place a write twice."""
    for transport in (
        semantics.ORDERED,
        semantics.UNORDERED,
        semantics.Transport("srd-dup", ordered=False, duplicates=True),
    ):
        row, column = counted_writes_cell(transport)
        assert (counted_writes_refusal(transport) is None) == study_safe(row, column)
    refusal = counted_writes_refusal(semantics.Transport("srd-dup", ordered=False, duplicates=True))
    assert refusal is not None and "counted-writes on unordered+duplicates unsafe" in refusal


def test_counters_and_get():
    kernel = Kernel(COUNTERS_GET, "counters_get")

    def body(world):
        with DeviceComm(world, window_bytes=64, counters=1, device="cpu", path="gin", wire="unordered") as dc:
            for _ in range(2):
                out = np.zeros(1, np.uint64)
                kernel.launch(dc, 1, args=(out,))
                assert int(out[0]) == 7000 + (world.rank + 1) % world.size
            assert int(dc.window("uint64", 1, 16)[0]) == 7000 + (world.rank - 1) % world.size

    _run(3, body)


@pytest.mark.parametrize("path", ["lsa", "gin-ordered"])
def test_prims_run_in_a_user_kernel(path):
    kernel = Kernel(PRIMS_RING, "prims_ring")

    def body(world):
        with DeviceComm(world, window_bytes=64, device="cpu", **PATHS[path]) as dc:
            src = np.full(32, world.rank + 1, np.uint8)
            dst = np.zeros(32, np.uint8)
            kernel.launch(dc, 1, args=(src, dst))
            prev = int(dc.comm.launch_record.record["peers"][0]["ringPrev"])
            assert (dst == prev + 1).all()

    _run(3, body)


@pytest.mark.parametrize("path", ["lsa", "gin-unordered"])
def test_a_connection_per_peer_carries_the_flow_primitives(path):
    kernel, nbytes = Kernel(PRIMS_PER_PEER, "prims_per_peer"), 100

    def body(world):
        n = world.size
        with DeviceComm(world, window_bytes=64, device="cpu", max_channels=2, **PATHS[path]) as dc:
            for launch in (1, 2):
                src = np.array(
                    [(world.rank * 16 + j) * launch % 256 for j in range(n) for _ in range(nbytes)], np.uint8
                )
                dst = np.zeros(n * nbytes, np.uint8)
                kernel.launch(dc, 1, args=(src, dst, nbytes))
                for j in range(n):
                    want = 0 if j == world.rank else (j * 16 + world.rank) * launch % 256
                    assert (dst[j * nbytes : (j + 1) * nbytes] == want).all(), (world.rank, j)

    _run(6, body)  # 6 ranks: distances up to 5, channels 0 and 1


def test_a_connection_per_peer_needs_enough_channels():
    kernel = Kernel(PRIMS_PER_PEER, "prims_per_peer")

    def body(world):
        with DeviceComm(world, window_bytes=64, device="cpu", max_channels=1, timeout=5) as dc:
            with pytest.raises(ValueError, match=r"was given 1 where the limit is 1"):
                kernel.launch(dc, 1, args=(np.zeros(6, np.uint8), np.zeros(6, np.uint8), 1))

    _run(6, body)


def test_a_syntax_error_gives_the_compilers_message_with_the_line(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMREF_CACHE_DIR", str(tmp_path))
    source = PREAMBLE + "COMMREF_KERNEL(broken, KernelArgs, args) {\n  DeviceComm comm(args);\n  int x = ;\n}\n"
    with pytest.raises(CompileError) as info:
        Kernel(source, "broken").compile("cpu")
    message = str(info.value)
    assert message.startswith("kernel broken: broken.cu does not compile:")
    assert "broken.cu:5:" in message and "error" in message and "int x = ;" in message  # file, line, the source
    assert str(tmp_path) not in message


def test_the_kernel_must_be_defined():
    with pytest.raises(ValueError, match=r"defines no COMMREF_KERNEL\(missing, KernelArgs"):
        Kernel(EXCHANGE, "missing")


def test_a_wait_nobody_answers_times_out_naming_rank_and_peer():
    kernel = Kernel(WAIT_FOREVER, "wait_forever")

    def body(world):
        with DeviceComm(world, window_bytes=64, signals=1, device="cpu", timeout=0.5) as dc:
            with pytest.raises(CommTimeout) as info:
                kernel.launch(dc, 1)
            peer = (world.rank + 1) % world.size
            assert str(info.value).startswith(
                f"rank {world.rank}: timed out after 0.5 s waiting for peer {peer}: a signal of the device communicator"
            )

    _run(2, body)


@pytest.mark.parametrize("which, limit, seen", [(0, 2, 5), (1, 4096, 4096 + 8), (2, 1, 3), (3, 1, 9), (4, 1, 1)])
def test_device_api_arguments_out_of_range_fail_clearly(which, limit, seen):
    kernel = Kernel(BAD_CALL, "bad_call")

    def body(world):
        with DeviceComm(world, window_bytes=4096, signals=2, counters=1, device="cpu", timeout=5) as dc:
            with pytest.raises(
                ValueError,
                match=rf"^rank {world.rank}: a device-API call in block 0 was given "
                rf"{seen} where the limit is {limit}",
            ):
                kernel.launch(dc, 1, args=(which,))

    _run(2, body)


def test_launch_arguments_are_checked_before_the_launch():
    kernel = Kernel(EXCHANGE, "exchange")

    def body(world):
        with DeviceComm(world, window_bytes=4096, signals=1, device="cpu") as dc:
            with pytest.raises(ValueError, match="at most 16 arguments"):
                kernel.launch(dc, 1, args=tuple(range(17)))
            with pytest.raises(ValueError, match="argument 0: the array is not contiguous"):
                kernel.launch(dc, 1, args=(np.zeros((4, 4))[:, 0],))
            with pytest.raises(TypeError, match="argument 1: str is not an array"):
                kernel.launch(dc, 1, args=(1, "x"))
            with pytest.raises(ValueError, match="grid must be a positive integer"):
                kernel.launch(dc, 0)
            with pytest.raises(ValueError, match="contexts must be an integer from 1 to 4"):
                DeviceComm(world, window_bytes=64, contexts=5)
            with pytest.raises(ValueError, match="exceed the device window"):
                dc.window("uint64", 513)
            assert dc.launches == 0  # nothing was launched

    _run(2, body)


def test_requirements_are_checked_against_the_backends():
    def body(world, options, expect):
        with pytest.raises(CapabilityError, match=expect):
            DeviceComm(world, window_bytes=64, device="cpu", **options)

    _run(2, body, dict(path="gin", backend="gda", signals=1), r"gda lacks strong signals")
    _run(
        2,
        body,
        dict(path="gin", backend="gda", strong_signals=False, signals=1000),
        r"gda lacks \d+ signals\+counters \(at most 512\)",
    )
    _run(
        2, body, dict(path="gin", backend="rc", wire="unordered", strong_signals=False), r"rc lacks the unordered wire"
    )


def test_weak_only_backend_runs_with_weak_signals():
    results = _run(3, _exchange, dict(path="gin", wire="unordered", strong_signals=False))
    assert {b for b, _ in results} == {"gda"}


# ---- the fused RMSNorm example ----

RMSNORM_CASES = {
    "one node": (None, dict(path="lsa")),
    "2x2 nodes ordered strong": ("2", dict(path="auto")),
    "2x2 nodes unordered strong": ("2", dict(path="auto", wire="unordered", seed=5)),
    "2x2 nodes unordered weak": ("2", dict(path="auto", wire="unordered", strong_signals=False, seed=5)),
    "gin unordered weak": (None, dict(path="gin", wire="unordered", strong_signals=False, seed=7)),
}


@pytest.mark.parametrize("case", sorted(RMSNORM_CASES))
def test_fused_rmsnorm_matches_numpy_exactly(case, monkeypatch):
    nodes, options = RMSNORM_CASES[case]
    if nodes:
        monkeypatch.setenv(NODES_ENV, nodes)
    tokens, hidden, n = 11, 48, 4  # 11 tokens: uneven shards
    rng = np.random.default_rng(17)
    # Small integers: every sum and sum of squares is exact, so the result is bit-exact
    # whatever the order the ranks' partials arrive in.
    partials = [rng.integers(-3, 4, size=(tokens, hidden)).astype(np.float32) for _ in range(n)]
    weight = (rng.integers(1, 9, size=hidden) / 4).astype(np.float32)
    want = reference(partials, weight, 1e-6)

    def body(world):
        with FusedRMSNorm(world, tokens=tokens, hidden=hidden, device="cpu", **options) as norm:
            for _ in range(3):
                got = norm(partials[world.rank], weight)
                assert np.array_equal(got, want), (world.rank, float(np.abs(got - want).max()))
        return norm.dc.backend

    backends = _run(n, body)
    assert (backends[0] is None) == (case == "one node")


def test_fused_rmsnorm_reference_is_rmsnorm():
    """The reference the kernel is compared with is RMSNorm of the sum, in float64 terms."""
    rng = np.random.default_rng(2)
    partials = [rng.standard_normal((5, 16)).astype(np.float32) for _ in range(3)]
    weight = rng.standard_normal(16).astype(np.float32)
    v = sum(p.astype(np.float64) for p in partials)
    exact = v / np.sqrt((v * v).mean(axis=1, keepdims=True) + 1e-6) * weight
    np.testing.assert_allclose(reference(partials, weight, 1e-6), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (a compile check, nothing runs)")
def test_the_device_api_and_examples_compile_for_sm90(tmp_path):
    """Every device-API call, the examples and the kernels built on the device API
    (kernels/device_api/: MoE dispatch and combine) compile for the GPU (nvcc, sm_90)."""
    every_call = (
        PREAMBLE
        + r"""
COMMREF_KERNEL(every_call, KernelArgs, args) {
  DeviceComm comm(args);
  comm.gin(1).put(1, 0, 8, 8, StrongSignalInc(0), 0);
  comm.countedPut(1, 0, 8, 8, 1);
  comm.putValue(1, 0, 8, WeakSignalAdd(0, 3));
  comm.signal(1, WeakSignalInc(0));
  comm.get(1, 0, 8, 8);
  comm.flush();
  comm.waitSignal(0, 1);
  comm.waitCounter(0, 1);
  comm.barrier();
  comm.barrier(GinFenceLevel::Gets, 1);
  comm.barrier(GinFenceLevel::None, GinAllContexts);
  comm.lsaBarrier();
  float* p = comm.lsaPtr<float>(1, 0);
  if (p) p[0] = (float)comm.f64(0) + comm.i64(1) + comm.lsaPeer(0) + comm.lsaSize();
  Prims<uint8_t, OpSum> prims(comm.coll(), 0);
  connectRing(prims, comm.coll(), 0);
  prims.finish();
}
"""
    )
    sources = [tmp_path / "every_call.cu", build.SOURCE_DIR / "examples" / "rmsnorm.cu"]
    sources[0].write_text(every_call)
    sources += sorted(p for p in (build.SOURCE_DIR / "examples").glob("*.cu") if p not in sources)
    sources += sorted((build.KERNEL_DIR / "device_api").glob("*.cu"))
    assert build.KERNEL_DIR / "device_api" / "ep.cu" in sources
    for src in sources:
        proc = nvcc_sm90(src, tmp_path / f"{src.stem}.cubin")
        assert proc.returncode == 0, f"{src.name}:\n{proc.stderr}"


def test_nvrtc_compiles_the_examples_and_reports_a_syntax_error_with_its_line(tmp_path, monkeypatch):
    """The GPU route of Kernel.compile (NVRTC, as the driver will load it); no GPU needed."""
    pytest.importorskip(
        "cupy_backends.cuda.libs.nvrtc", reason="CuPy is not installed (pip install -e '.[gpu-oldest]')"
    )
    monkeypatch.setenv("COMMREF_CACHE_DIR", str(tmp_path))
    from commref.rmsnorm import kernel

    assert gpu_loader.build_user_gpu_image(kernel().path, 90).stat().st_size > 0
    broken = Kernel(PREAMBLE + "COMMREF_KERNEL(broken, KernelArgs, args) {\n  int x = ;\n}\n", "broken")
    with pytest.raises(CompileError) as info:
        try:
            gpu_loader.build_user_gpu_image(broken.path, 90)
        except CompileError as e:
            raise broken._compile_error(e, broken.path) from None
    assert str(info.value).startswith("kernel broken: broken.cu does not compile:\nbroken.cu(4): error")
    assert "int x = ;" in str(info.value)


def test_the_public_names():
    assert commref.DeviceComm is DeviceComm and commref.Kernel is Kernel and commref.CompileError is CompileError


@pytest.mark.mpi
def test_fused_rmsnorm_under_mpiexec_across_simulated_nodes(shm_leak_check):
    """One rank per process, 2 x 2 simulated nodes: LSA inside a node, GIN over network
    mpi across, on the unordered wire with weak signals (gda)."""
    proc = run_mpi(
        4,
        [
            "commref.rmsnorm",
            "--path",
            "auto",
            "--network",
            "mpi",
            "--wire",
            "unordered",
            "--weak",
            "--tokens",
            "13",
            "--hidden",
            "64",
        ],
        module=True,
        env=clean_env(COMMREF_NODES="2"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 ranks, path auto, backend gda, 3 launches: 0 wrong elements" in proc.stdout


# ---- what waitSignal and waitCounter return, and putValue's alignment ----

# Signals 0..7 of this rank hold different values (its own signals, added before); then
# back-to-back waits with no other block-wide call between them, each thread recording
# what every wait returned to it. Every thread must get each wait's own value.
WAIT_RETURNS = (
    PREAMBLE
    + r"""
COMMREF_KERNEL(wait_returns, KernelArgs, args) {
  DeviceComm comm(args);
  const int r = comm.rank();
  uint64_t* out = comm.ptr<uint64_t>(0);
  for (uint32_t id = 0; id < 8; id++) comm.signal(r, WeakSignalAdd(id, 100 * (id + 1)));
  for (uint32_t id = 0; id < 8; id++) out[id * blockDim.x + threadIdx.x] = comm.waitSignal(id, comm.launch());
  // counter 0: one put per launch, counter 1: three
  for (int k = 0; k < 4; k++) comm.put((r + 1) % comm.nranks(), 0, 8, 8, NoSignal(), k == 0 ? 0 : 1);
  out[8 * blockDim.x + threadIdx.x] = comm.waitCounter(0, comm.launch());
  out[9 * blockDim.x + threadIdx.x] = comm.waitCounter(1, 3 * comm.launch());
  comm.barrier();
}
"""
)


@pytest.mark.parametrize("path", ["lsa", "gin-ordered"])
def test_every_thread_gets_each_waits_own_value(path):
    """waitSignal and waitCounter return one value to the whole block. Back to back, with
    nothing block-wide between them, thread 0's next wait must not overwrite the value a
    slower thread of the block has yet to read (each wait here returns a different one)."""
    kernel, threads = Kernel(WAIT_RETURNS, "wait_returns"), 64

    def body(world):
        with DeviceComm(world, window_bytes=64, signals=8, counters=2, device="cpu", **PATHS[path]) as dc:
            for launch in (1, 2):
                out = np.zeros((10, threads), np.uint64)
                kernel.launch(dc, 1, threads, args=(out,))
                want = [100 * (i + 1) * launch for i in range(8)] + [launch, 3 * launch]
                wrong = [(i, t, int(out[i, t])) for i in range(10) for t in range(threads) if out[i, t] != want[i]]
                assert not wrong, (world.rank, launch, wrong[:8], len(wrong))

    _run(2, body)


# putValue of a launch-stamped word to the next rank at offset argument 0, then a barrier.
PUT_VALUE_AT = (
    PREAMBLE
    + r"""
COMMREF_KERNEL(put_value_at, KernelArgs, args) {
  DeviceComm comm(args);
  comm.putValue((comm.rank() + 1) % comm.nranks(), comm.u64(0), 0xC0FFEE00ull + comm.launch());
  comm.barrier();
}
"""
)


@pytest.mark.parametrize("path", ["lsa", "gin-ordered", "gin-unordered"])
def test_an_unaligned_put_value_fails_clearly(path):
    """putValue writes 8 bytes: a destination that is not a multiple of 8 fails the launch
    with the range errors' message (on a GPU the store would be a misaligned-address
    error that ends the CUDA context of every rank in the process), before anything is
    stored or posted; an aligned one lands."""
    kernel = Kernel(PUT_VALUE_AT, "put_value_at")

    def body(world):
        with DeviceComm(world, window_bytes=64, device="cpu", timeout=5, **PATHS[path]) as dc:
            kernel.launch(dc, 1, args=(16,))
            assert int(dc.window("uint64", 1, 16)[0]) == 0xC0FFEE01
        with DeviceComm(world, window_bytes=64, device="cpu", timeout=5, **PATHS[path]) as dc:
            with pytest.raises(
                ValueError,
                match=rf"^rank {world.rank}: a device-API call in block 0 was given 20 "
                rf"where the limit is 8 \(.*putValue's destination a multiple of "
                rf"it",
            ):
                kernel.launch(dc, 1, args=(20,))
            assert not dc.window("uint8").any(), "nothing was stored"

    _run(2, body)


def test_the_cpu_engine_refuses_a_grid_whose_blocks_cannot_all_run_at_once():
    """The CPU analogue of the GPU's co-residency check (tests/test_gpu_residency.py): the
    engine runs every block of a launch at once on a thread of its own, or refuses it."""
    from commref.collectives.device_api import KernelError

    kernel = Kernel(WAIT_FOREVER, "wait_forever")

    def body(world):
        with DeviceComm(world, window_bytes=64, signals=1, device="cpu", timeout=5) as dc:
            with pytest.raises(KernelError, match=r"the CPU engine could not run wait_forever with grid=5000"):
                kernel.launch(dc, 5000)

    _run(2, body)
