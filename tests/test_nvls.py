"""Multimem (include/commref/multimem.h) and the NVLS AllReduce (kernels/nvls.cu,
collectives/nvls.py) on the CPU engine, where multimem is the LSA emulation.

The AllReduce is exact at 2, 3, 5 and 8 ranks in both variants, in and out of place;
calls it cannot run (plain buffers, GIN peers, a (dtype, op) multicast does not
reduce, another collective) are refused with the reason before any launch; the device
API's handle reduces, stores to and meets the LSA team only, and its barrier refuses
words outside the window. With nvcc, a kernel that uses every multicast reduction builds
for sm_90 through ptxas into the multimem instructions, and one asking for a reduction
multicast lacks does not build.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from helpers import PREAMBLE, WORLD_TIMEOUT, nvcc_sm90

from commref import CapabilityError, ThreadWorld
from commref.collectives import check, nvls
from commref.collectives.communicator import Communicator
from commref.collectives.device_api import DeviceComm, Kernel
from commref.device_kernels import abi
from commref.transports.nodes import NODES_ENV


def _sweep(world, variant):
    with Communicator(world, "cpu", timeout=WORLD_TIMEOUT, nvls_variant=variant) as comm:
        cases = check.cases(
            ["allreduce"], ["float32", "bfloat16", "int32"], ["sum", "max", "avg"], ["nvls"], [0, 1, 7, 1001],
            world.size, 5,
        )  # fmt: skip
        wrong = check.run_sweep(comm, cases)
        variants = {abi.unpack_call(p.desc)["variant"] for p in comm.planned("allreduce") if p.count}
        kernels = {p.kernel for p in comm.planned("allreduce")}
        return len(cases), sum(wrong), variants, kernels


@pytest.mark.parametrize("nranks", [2, 3, 5, 8])
@pytest.mark.parametrize("variant", ["one_shot", "two_shot"])
def test_nvls_allreduce_is_exact(nranks, variant):
    """Every element of every case, in and out of place (one-shot in place runs
    two-shot: nvls.cu), on inputs exact in any order; float32 max is not a multicast
    reduction, so its cases are not made (check.cases)."""
    for ncases, wrong, variants, kernels in ThreadWorld.run(nranks, _sweep, variant, timeout=WORLD_TIMEOUT):
        # 8 (dtype, op) pairs x 4 counts x 2 placements; the 5 floating pairs on denormals x 4 counts
        assert ncases == 8 * 4 * 2 + 5 * 4
        assert wrong == 0
        assert variants == {abi.NVLS_VARIANTS[variant]}
        assert kernels == {"commref_nvls_allreduce"}


def test_auto_variant_is_one_shot_for_small_calls_only():
    assert nvls.variant(nvls.ONE_SHOT_MAX_BYTES) == "one_shot"
    assert nvls.variant(nvls.ONE_SHOT_MAX_BYTES + 1) == "two_shot"
    assert nvls.variant(8, "two_shot") == "two_shot"


def _refusals(world):
    out = {}
    with Communicator(world, "cpu", timeout=WORLD_TIMEOUT) as comm:
        send, recv = comm.alloc_symmetric(64, np.float32), comm.alloc_symmetric(64, np.float32)
        send[...] = 1
        plain = np.ones(64, np.float32)
        for name, call in {
            "plain": lambda: comm.allreduce(plain, np.zeros_like(plain), algorithm="nvls"),
            "float32 max": lambda: comm.allreduce(send, recv, "max", algorithm="nvls"),
            "prod": lambda: comm.allreduce(send, recv, "prod", algorithm="nvls"),
            "allgather": lambda: comm.allgather(send[:32], recv, algorithm="nvls"),
        }.items():
            with pytest.raises(ValueError) as e:
                call()
            out[name] = str(e.value)
        comm.allreduce(send, recv, algorithm="nvls")  # the refusals left the communicator usable
        out["sum"] = float(recv[0])
        i8s, i8r = comm.alloc_symmetric(8, np.int8), comm.alloc_symmetric(8, np.int8)
        with pytest.raises(ValueError) as e:
            comm.allreduce(i8s, i8r, algorithm="nvls")
        out["int8"] = str(e.value)
    with Communicator(world, "cpu", timeout=WORLD_TIMEOUT, path="gin") as comm:
        send, recv = comm.alloc_symmetric(64, np.float32), comm.alloc_symmetric(64, np.float32)
        with pytest.raises(CapabilityError) as e:
            comm.allreduce(send, recv, algorithm="nvls")
        out["gin"] = str(e.value)
    return out


def test_nvls_refuses_what_it_cannot_run():
    for rank, out in enumerate(ThreadWorld.run(2, _refusals, timeout=WORLD_TIMEOUT)):
        assert out["plain"].startswith(f"rank {rank}: algorithm 'nvls' needs sendbuf and recvbuf from ")
        assert "Communicator.alloc_symmetric" in out["plain"]
        assert out["float32 max"].startswith(f"rank {rank}: algorithm 'nvls' cannot reduce float32 with op 'max': ")
        assert "min: float16, bfloat16, int32" in out["float32 max"]
        assert "cannot reduce float32 with op 'prod'" in out["prod"]
        assert "cannot reduce int8 with op 'sum'" in out["int8"]
        assert "algorithm 'nvls' is implemented for allreduce only, not allgather" in out["allgather"]
        assert out["gin"].startswith(f"rank {rank}: algorithm 'nvls' runs over LSA only") and "[" in out["gin"]
        assert out["sum"] == 2.0


def test_auto_never_takes_nvls():
    """The tuner's model gives the emulation no edge over the direct kernel (tuner.plan)."""

    def body(world):
        with Communicator(world, "cpu", timeout=WORLD_TIMEOUT) as comm:
            n = 1 << 16
            send, recv = comm.alloc_symmetric(n, np.float32), comm.alloc_symmetric(n, np.float32)
            for count in (8, n):
                comm.allreduce(send[:count], recv[:count])
            return {p.kernel for p in comm.planned("allreduce")}

    for kernels in ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT):
        assert "commref_nvls_allreduce" not in kernels and kernels


def test_multicast_support_makes_no_driver_call_on_the_cpu_engine():
    assert "CPU engine" in nvls.multicast_support("cpu")


# The device API's handle over the LSA team: every member writes its stamp, the team
# meets at the multimem barrier, then ldReduce sums and maxes them, member 0's st lands
# in every member's copy, and the last barrier keeps the next launch's writes after
# every member's reads. Argument 1: where the barrier's words go (0: their place).
MULTIMEM = (
    PREAMBLE
    + r"""
COMMREF_KERNEL(multimem_team, KernelArgs, args) {
  DeviceComm comm(args);
  Multimem m = lsaMultimem(args);
  const uint64_t bar = comm.u64(1) ? comm.u64(1) : 2048, L = comm.launch();
  float* f = comm.local<float>(0);
  int32_t* k = comm.local<int32_t>(512);
  for (int i = threadIdx.x; i < 64; i += blockDim.x) {
    f[i] = (float)((comm.rank() + 1) * (i + 1) + L);
    k[i] = (int32_t)(comm.rank() * 100 - i);
  }
  m.barrier(bar);
  float* sums = comm.ptr<float>(0);
  int32_t* maxes = comm.ptr<int32_t>(2);
  for (int i = threadIdx.x; i < 64; i += blockDim.x) {
    sums[i] = m.ldReduce<float, OpSum>(i * 4);
    maxes[i] = m.ldReduce<int32_t, OpMax>(512 + i * 4);
  }
  m.barrier(bar);
  if (m.member == 0 && threadIdx.x == 0) m.st<uint64_t>(1024, 1000 * L + comm.rank());
  m.barrier(bar);
  uint64_t* got = comm.ptr<uint64_t>(3);
  if (threadIdx.x == 0) got[0] = *comm.local<uint64_t>(1024), got[1] = (uint64_t)m.size;
  m.barrier(bar);
}
"""
)


def _team(world, bad_bar=0):
    kernel = Kernel(MULTIMEM, "multimem_team")
    out = []
    with DeviceComm(world, window_bytes=4096, signals=1, device="cpu", path="auto") as dc:
        for launch in (1, 2):
            sums, maxes, got = np.zeros(64, np.float32), np.zeros(64, np.int32), np.zeros(2, np.uint64)
            kernel.launch(dc, 1, args=(sums, bad_bar, maxes, got))
            out.append((sums, maxes, got, dc.lsa_ranks))
    return out


def test_multimem_reduces_stores_and_meets_the_lsa_team_only(monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")  # LSA teams {0, 1, 2} and {3, 4}
    results = ThreadWorld.run(5, _team, timeout=WORLD_TIMEOUT)
    i = np.arange(64)
    for rank, launches in enumerate(results):
        for launch, (sums, maxes, got, team) in enumerate(launches, 1):
            assert team == ([0, 1, 2] if rank < 3 else [3, 4])
            expected = sum((t + 1) * (i + 1) + launch for t in team)
            assert sums.tolist() == expected.astype(np.float32).tolist(), (rank, launch)
            assert maxes.tolist() == (max(team) * 100 - i).tolist(), (rank, launch)
            assert got.tolist() == [1000 * launch + team[0], len(team)], (rank, launch)


def test_multimem_barrier_refuses_words_outside_the_window():
    def body(world):
        with pytest.raises(ValueError, match=rf"^rank {world.rank}: a device-API call in block 0 was given 4160 "):
            _team(world, bad_bar=4096 - 64)  # 2 members' words: 128 bytes from 4032

    ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)


def test_emulated_reduction_order_is_rank_order():
    """float32 sums whose value depends on the order: (1e8 + 1) - 1e8 ... members 0, 1, 2
    in order give 0 (1e8 + 1 rounds to 1e8), which no other order gives for every
    element; every rank reads the same bits."""
    src = (
        PREAMBLE
        + r"""
COMMREF_KERNEL(order, KernelArgs, args) {
  DeviceComm comm(args);
  Multimem m = lsaMultimem(args);
  const float mine[3] = {1e8f, 1.0f, -1e8f};
  if (threadIdx.x == 0) *comm.local<float>(0) = mine[comm.rank()];
  m.barrier(1024);
  if (threadIdx.x == 0) *comm.ptr<float>(0) = m.ldReduce<float, OpSum>(0);
  m.barrier(1024);
}
"""
    )

    def body(world):
        out = np.full(1, 7.0, np.float32)
        with DeviceComm(world, window_bytes=4096, signals=1, device="cpu") as dc:
            Kernel(src, "order").launch(dc, 1, args=(out,))
        return float(out[0])

    folded = np.float32(np.float32(np.float32(1e8) + np.float32(1.0)) + np.float32(-1e8))
    assert ThreadWorld.run(3, body, timeout=WORLD_TIMEOUT) == [float(folded)] * 3
    assert float(folded) == 0.0  # members in another order: 1.0


# Every (T, Op) of multimemSupported, with the multicast address a launch argument (so the
# PTX path is not folded away), and the multimem barrier.
EVERY_PAIR = (
    PREAMBLE
    + r"""
template <typename T, typename Op>
__device__ void one(const Multimem& m, uint64_t off) { m.st<T>(off, m.ldReduce<T, Op>(off)); }
COMMREF_KERNEL(every_pair, KernelArgs, args) {
  Multimem m = lsaMultimem(args, args.arg[0]);
  one<float, OpSum>(m, 0); one<double, OpSum>(m, 8);
  one<half_t, OpSum>(m, 16); one<bf16_t, OpSum>(m, 20); one<half_t, OpMin>(m, 16); one<bf16_t, OpMax>(m, 20);
  one<int32_t, OpSum>(m, 24); one<uint32_t, OpMin>(m, 24); one<int64_t, OpMax>(m, 32); one<uint64_t, OpSum>(m, 32);
  m.barrier(64);
}
"""
)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (a compile check, nothing runs)")
def test_multimem_ptx_builds_for_sm90(tmp_path):
    src = tmp_path / "every_pair.cu"
    src.write_text(EVERY_PAIR)
    proc = nvcc_sm90(src, tmp_path / "every_pair.cubin", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = nvcc_sm90(src, tmp_path / "every_pair.ptx", "-ptx", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ptx = (tmp_path / "every_pair.ptx").read_text()
    for op in ("add.f32", "add.f64", "add.acc::f32.f16x2", "add.acc::f32.bf16x2", "min.f16x2", "max.bf16x2"):
        assert f"multimem.ld_reduce.relaxed.sys.global.{op} " in ptx, op
    for op in ("add.u32", "min.u32", "max.s64", "add.u64"):
        assert f"multimem.ld_reduce.relaxed.sys.global.{op} " in ptx, op
    assert "multimem.st.relaxed.sys.global.b32 " in ptx and "multimem.st.relaxed.sys.global.b64 " in ptx
    assert "multimem.st.release.sys.global.b64 " in ptx  # the barrier's word
    bad = tmp_path / "float_max.cu"
    bad.write_text(EVERY_PAIR.replace("one<float, OpSum>(m, 0);", "one<float, OpMax>(m, 0);"))
    proc = nvcc_sm90(bad, tmp_path / "float_max.ptx", "-ptx", timeout=300)
    assert proc.returncode != 0 and "NVLink multicast does not reduce this type" in proc.stderr, proc.stderr[-2000:]
