"""The device API for users' kernels (include/commref/device.h, collectives/device_api.py):
a device communicator, kernels compiled from a user's source and launched on the CPU
engine, over LSA and GIN (ordered and unordered wires, simulated nodes), with the
requirements checked against the backends, failures reported as the collectives
report them, and the fused RMSNorm example (commref/rmsnorm.py) exact."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from conftest import clean_env, run_mpi

import commref
from commref import CapabilityError, CommTimeout, ThreadWorld
from commref.collectives.device_api import CompileError, DeviceComm, Kernel
from commref.device_kernels import loader
from commref.rmsnorm import FusedRMSNorm, reference
from commref.transports.gin import semantics
from commref.transports.gin.plan import counted_writes_cell, counted_writes_refusal, study_safe
from commref.transports.world import NODES_ENV

WORLD_TIMEOUT = 60

PREAMBLE = '#include "commref/device.h"\n'

# Each rank puts its launch-stamped word to every peer at its own slot (weak signal 0
# per put) and reads the n words once n - 1 have arrived; the barrier keeps a fast rank
# from overwriting a slot in the next launch before its owner read it.
EXCHANGE = PREAMBLE + r'''
COMMREF_KERNEL(exchange, KernelArgs, args) {
  DeviceComm comm(args);
  const int n = comm.nranks(), r = comm.rank();
  uint64_t* mine = comm.local<uint64_t>(0);
  if (threadIdx.x == 0) mine[64 + r] = 1000 * comm.launch() + r;
  __syncthreads();
  for (int k = 1; k < n; k++) comm.put((r + k) % n, r * 8, (64 + r) * 8, 8, weakInc(0));
  comm.waitSignal(0, comm.launch() * (n - 1));
  uint64_t* out = comm.ptr<uint64_t>(0);
  if (threadIdx.x == 0) for (int j = 0; j < n; j++) out[j] = j == r ? mine[64 + r] : mine[j];
  comm.barrier();
}
'''

# Counted writes: `chunks` puts of 64 bytes to the next rank, none with a flag; the
# receiver waits until signal 1 has counted them all, then reads.
COUNTED = PREAMBLE + r'''
COMMREF_KERNEL(counted, KernelArgs, args) {
  DeviceComm comm(args);
  const int n = comm.nranks(), r = comm.rank();
  const uint64_t chunks = comm.u64(0);
  uint64_t* src = comm.local<uint64_t>(chunks * 64);
  for (uint64_t i = threadIdx.x; i < chunks * 8; i += blockDim.x) src[i] = comm.launch() << 32 | (uint64_t)r << 24 | i;
  __syncthreads();
  for (uint64_t c = 0; c < chunks; c++) comm.countedPut((r + 1) % n, c * 64, chunks * 64 + c * 64, 64, 1);
  comm.waitSignal(1, comm.launch() * chunks, (r + n - 1) % n);
  uint64_t* out = comm.ptr<uint64_t>(1);
  const uint64_t* got = comm.local<const uint64_t>(0);
  for (uint64_t i = threadIdx.x; i < chunks * 8; i += blockDim.x) out[i] = got[i];
  comm.barrier();
}
'''

# Local completion and get: a put that names counter 0 (waitCounter), then a get of
# the next rank's stamp, complete after flush.
COUNTERS_GET = PREAMBLE + r'''
COMMREF_KERNEL(counters_get, KernelArgs, args) {
  DeviceComm comm(args);
  const int n = comm.nranks(), r = comm.rank();
  uint64_t* w = comm.local<uint64_t>(0);
  if (threadIdx.x == 0) w[0] = 7000 + r;
  comm.barrier();  // every stamp is written before anyone gets it
  comm.put((r + 1) % n, 16, 0, 8, noSignal(), 0);
  comm.waitCounter(0, comm.launch());
  comm.get((r + 1) % n, 8, 0, 8);
  comm.flush();
  uint64_t* out = comm.ptr<uint64_t>(0);
  if (threadIdx.x == 0) out[0] = w[1];
  comm.barrier();
}
'''

# The collectives' own flow primitives from a user kernel: channel 0's ring, each rank
# sends 32 bytes to the next and receives the previous rank's.
PRIMS_RING = PREAMBLE + r'''
COMMREF_KERNEL(prims_ring, KernelArgs, args) {
  DeviceComm comm(args);
  const uint8_t* src = comm.ptr<const uint8_t>(0);
  uint8_t* dst = comm.ptr<uint8_t>(1);
  Prims<uint8_t, OpSum> p(comm.coll(), 0);
  connectRing(p, comm.coll(), 0);
  p.send(src, 32);
  p.recv(dst, 32);
  p.finish();
}
'''

# A connection per peer: every rank sends a block of `bytes` to every peer through the
# flow primitives and receives one from each (an all-to-all on Prims).
PRIMS_PER_PEER = PREAMBLE + r'''
COMMREF_KERNEL(prims_per_peer, KernelArgs, args) {
  DeviceComm comm(args);
  const uint8_t* src = comm.ptr<const uint8_t>(0);
  uint8_t* dst = comm.ptr<uint8_t>(1);
  const uint64_t bytes = comm.u64(2);
  const int n = comm.nranks(), r = comm.rank();
  for (int k = 1; k < n; k++) {
    const int peer = (r + k) % n;
    Prims<uint8_t, OpSum> tx(comm.coll(), comm.sendChannel(peer));
    comm.connectSend(tx, peer);
    tx.send(src + peer * bytes, bytes);
    tx.finish();
  }
  for (int k = 1; k < n; k++) {
    const int peer = (r + n - k) % n;
    Prims<uint8_t, OpSum> rx(comm.coll(), comm.recvChannel(peer));
    comm.connectRecv(rx, peer);
    rx.recv(dst + peer * bytes, bytes);
    rx.finish();
  }
}
'''

# Waits for a signal that nobody sends.
WAIT_FOREVER = PREAMBLE + r'''
COMMREF_KERNEL(wait_forever, KernelArgs, args) {
  DeviceComm comm(args);
  comm.waitSignal(0, 1, (comm.rank() + 1) % comm.nranks());
}
'''

# Out-of-range device-API arguments, chosen by argument 0.
BAD_CALL = PREAMBLE + r'''
COMMREF_KERNEL(bad_call, KernelArgs, args) {
  DeviceComm comm(args);
  const int which = (int)comm.u64(0), peer = (comm.rank() + 1) % comm.nranks();
  if (which == 0) comm.signal(peer, weakInc(5));            // only 2 signals
  if (which == 1) comm.put(peer, 4096 - 8, 0, 16);          // past the window's end
  if (which == 2) comm.put(peer, 0, 0, 8, noSignal(), 3);   // no counter 3
  if (which == 3) comm.u64(9);                               // one argument only
  if (which == 4) comm.signal(peer, weakInc(0), 1);         // one context only
}
'''


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
        with DeviceComm(world, window_bytes=2 * chunks * 64, signals=2, counted_writes=True, device="cpu",
                        **PATHS[path]) as dc:
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
    for transport in (semantics.ORDERED, semantics.UNORDERED,
                      semantics.Transport("srd-dup", ordered=False, duplicates=True)):
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
            prev = int(dc.comm._record.record["peers"][0]["ringPrev"])
            assert (dst == prev + 1).all()

    _run(3, body)


@pytest.mark.parametrize("path", ["lsa", "gin-unordered"])
def test_a_connection_per_peer_carries_the_flow_primitives(path):
    kernel, nbytes = Kernel(PRIMS_PER_PEER, "prims_per_peer"), 100

    def body(world):
        n = world.size
        with DeviceComm(world, window_bytes=64, device="cpu", max_channels=2, **PATHS[path]) as dc:
            for launch in (1, 2):
                src = np.array([(world.rank * 16 + j) * launch % 256 for j in range(n) for _ in range(nbytes)],
                               np.uint8)
                dst = np.zeros(n * nbytes, np.uint8)
                kernel.launch(dc, 1, args=(src, dst, nbytes))
                for j in range(n):
                    want = 0 if j == world.rank else (j * 16 + world.rank) * launch % 256
                    assert (dst[j * nbytes:(j + 1) * nbytes] == want).all(), (world.rank, j)

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
    assert "broken.cu:4:" in message and "error" in message and "int x = ;" in message  # file, line, the source
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
            assert str(info.value).startswith(f"rank {world.rank}: timed out after 0.5 s waiting for peer {peer}: "
                                              f"a signal of the device communicator")

    _run(2, body)


@pytest.mark.parametrize("which, limit, seen", [(0, 2, 5), (1, 4096, 4096 + 8), (2, 1, 3), (3, 1, 9), (4, 1, 1)])
def test_device_api_arguments_out_of_range_fail_clearly(which, limit, seen):
    kernel = Kernel(BAD_CALL, "bad_call")

    def body(world):
        with DeviceComm(world, window_bytes=4096, signals=2, counters=1, device="cpu", timeout=5) as dc:
            with pytest.raises(ValueError, match=rf"^rank {world.rank}: a device-API call in block 0 was given "
                                                 rf"{seen} where the limit is {limit}"):
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
    _run(2, body, dict(path="gin", backend="gda", strong_signals=False, signals=1000),
         r"gda lacks \d+ signals\+counters \(at most 512\)")
    _run(2, body, dict(path="gin", backend="rc", wire="unordered", strong_signals=False),
         r"rc lacks the unordered wire")


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
    """Every device-API call and the examples compile for the GPU (nvcc, sm_90)."""
    every_call = PREAMBLE + r'''
COMMREF_KERNEL(every_call, KernelArgs, args) {
  DeviceComm comm(args);
  comm.put(1, 0, 8, 8, strongInc(0), 0, 1);
  comm.countedPut(1, 0, 8, 8, 1);
  comm.putValue(1, 0, 8, weakAdd(0, 3));
  comm.signal(1, weakInc(0));
  comm.get(1, 0, 8, 8);
  comm.flush();
  comm.waitSignal(0, 1);
  comm.waitCounter(0, 1);
  comm.barrier();
  comm.lsaBarrier();
  float* p = comm.lsaPtr<float>(1, 0);
  if (p) p[0] = (float)comm.f64(0) + comm.i64(1) + comm.lsaPeer(0) + comm.lsaSize();
  Prims<uint8_t, OpSum> prims(comm.coll(), 0);
  connectRing(prims, comm.coll(), 0);
  prims.finish();
}
'''
    sources = [tmp_path / "every_call.cu", loader.SOURCE_DIR / "examples" / "rmsnorm.cu"]
    sources[0].write_text(every_call)
    sources += sorted(p for p in (loader.SOURCE_DIR / "examples").glob("*.cu") if p not in sources)
    for src in sources:
        proc = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", "-I", str(loader.INCLUDE_DIR),
                               "-o", str(tmp_path / f"{src.stem}.cubin"), str(src)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{src.name}:\n{proc.stderr}"


def test_nvrtc_compiles_the_examples_and_reports_a_syntax_error_with_its_line(tmp_path, monkeypatch):
    """The GPU route of Kernel.compile (NVRTC, as the driver will load it); no GPU needed."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy is not installed (pip install -e '.[gpu-oldest]')")
    monkeypatch.setenv("COMMREF_CACHE_DIR", str(tmp_path))
    from commref.rmsnorm import kernel

    assert loader.build_user_gpu_image(kernel().path, 90).stat().st_size > 0
    broken = Kernel(PREAMBLE + "COMMREF_KERNEL(broken, KernelArgs, args) {\n  int x = ;\n}\n", "broken")
    with pytest.raises(CompileError) as info:
        try:
            loader.build_user_gpu_image(broken.path, 90)
        except CompileError as e:
            raise broken._compile_error(e, broken.path) from None
    assert str(info.value).startswith("kernel broken: broken.cu does not compile:\nbroken.cu(3): error")
    assert "int x = ;" in str(info.value)


def test_the_public_names():
    assert commref.DeviceComm is DeviceComm and commref.Kernel is Kernel and commref.CompileError is CompileError


@pytest.mark.mpi
def test_fused_rmsnorm_under_mpiexec_across_simulated_nodes(shm_leak_check):
    """One rank per process, 2 x 2 simulated nodes: LSA inside a node, GIN over network
    mpi across, on the unordered wire with weak signals (gda)."""
    proc = run_mpi(4, ["commref.rmsnorm", "--path", "auto", "--network", "mpi", "--wire", "unordered", "--weak",
                       "--tokens", "13", "--hidden", "64"], module=True, env=clean_env(COMMREF_NODES="2"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 ranks, path auto, backend gda, 3 launches: 0 wrong elements" in proc.stdout
