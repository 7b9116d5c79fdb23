"""The LL all-to-all session (include/commref/lla2a.h) over the LSA team, on the CPU
engine: values sent, broadcast, received and reduced in several epochs per launch and
across launches with no reset, per block and per LSA team (simulated nodes); a slot
nobody fills ends the launch in CommTimeout naming the expected sender, and a member or
slot out of range in ValueError, never a hang. With nvcc, the session's kernel builds
for sm_90 with a multicast address (bcast's multimem.st).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from helpers import WORLD_TIMEOUT, nvcc_sm90

from commref import CommAborted, CommTimeout, ThreadWorld
from commref.collectives.device_api import DeviceComm, Kernel
from commref.transports.nodes import NODES_ENV

EPOCHS = 3

# Per epoch e of launch L (tag = 10 L + e): every member broadcasts the float
# 100 tag + its lsaRank into float slot lsaRank, and sends each member j the uint64
# tag << 32 | its lsaRank << 16 | j into uint64 slot n + its lsaRank (lines 2 (n + r)
# and 2 (n + r) + 1). Block b writes row b of the outputs from its own session.
# Argument 3: 0 runs the exchange; 1 also waits on float slot n - 1 + 1 = n, which no
# member fills (the slot its own uint64 values do not cover: line n); 2 sends to member n.
EXCHANGE = r"""
#include "commref/lla2a.h"
using namespace commref;
COMMREF_KERNEL(lla2a_exchange, KernelArgs, args) {
  DeviceComm comm(args);
  const int n = comm.lsaSize(), me = comm.lsaRank(), b = blockIdx.x;
  LLA2ASession s(lsaMultimem(args), 0, b, 4 * n);
  float* sums = comm.ptr<float>(0) + b * EPOCHS;
  uint64_t* got = comm.ptr<uint64_t>(1) + (uint64_t)b * EPOCHS * n;
  uint64_t* epochs = comm.ptr<uint64_t>(2) + b * EPOCHS;
  const uint64_t bad = comm.u64(3);
  for (int e = 0; e < EPOCHS; e++) {
    const uint64_t tag = comm.launch() * 10 + e;
    if (threadIdx.x == 0) s.bcast<float>(me, (float)(100 * tag + me));
    for (int j = threadIdx.x; j < n; j += blockDim.x) s.send<uint64_t>(j, n + me, tag << 32 | me << 16 | j);
    if (bad == 2 && threadIdx.x == 0) s.send<uint32_t>(n, 0, 1u);
    if (bad == 1 && threadIdx.x == 0) s.recv<float>(n, (me + 1) % n);
    const float sum = s.recvReduce<float, OpSum>(0, n, 1);
    for (int j = threadIdx.x; j < n; j += blockDim.x) got[e * n + j] = s.recv<uint64_t>(n + j, j);
    if (threadIdx.x == 0) sums[e] = sum, epochs[e] = s.epoch();
    s.endEpoch();
  }
}
""".replace("EPOCHS", str(EPOCHS))


def _exchange(world, grid=1, block=1, bad=0, launches=2, **options):
    kernel = Kernel(EXCHANGE, "lla2a_exchange")
    out = []
    with DeviceComm(world, window_bytes=4096, signals=1, device="cpu", **options) as dc:
        n = len(dc.lsa_ranks)
        for _ in range(launches):
            sums = np.zeros(grid * EPOCHS, np.float32)
            got = np.zeros(grid * EPOCHS * n, np.uint64)
            epochs = np.zeros(grid * EPOCHS, np.uint64)
            kernel.launch(dc, grid, block, args=(sums, got, epochs, bad))
            out.append((sums.reshape(grid, EPOCHS), got.reshape(grid, EPOCHS, n), epochs.reshape(grid, EPOCHS)))
        return dc.lsa_ranks, out


def _expect(team, me, launches, grid):
    n = len(team)
    for launch, (sums, got, epochs) in enumerate(launches, 1):
        for b in range(grid):
            for e in range(EPOCHS):
                tag = 10 * launch + e
                assert sums[b, e] == sum(100 * tag + j for j in range(n)), (me, launch, b, e)
                assert got[b, e].tolist() == [tag << 32 | j << 16 | me for j in range(n)], (me, launch, b, e)
            # epochs continue across launches: no reset between uses
            assert epochs[b].tolist() == [EPOCHS * (launch - 1) + e + 1 for e in range(EPOCHS)]


@pytest.mark.parametrize("nranks, grid, block", [(2, 1, 1), (4, 2, 3), (5, 1, 2)])
def test_lla2a_sends_bcasts_and_reduces_every_epoch(nranks, grid, block):
    for rank, (team, launches) in enumerate(ThreadWorld.run(nranks, _exchange, grid, block, timeout=WORLD_TIMEOUT)):
        assert team == list(range(nranks))
        _expect(team, rank, launches, grid)


def test_lla2a_stays_inside_each_lsa_team(monkeypatch):
    monkeypatch.setenv(NODES_ENV, "2")  # teams {0, 1} and {2, 3}
    results = ThreadWorld.run(4, _exchange, 1, 1, 0, 2, path="auto", timeout=WORLD_TIMEOUT)
    for rank, (team, launches) in enumerate(results):
        assert team == ([0, 1] if rank < 2 else [2, 3])
        _expect(team, team.index(rank), launches, 1)


def test_lla2a_slot_nobody_fills_times_out_naming_the_sender():
    """The first rank to time out ends the job: the other sees CommTimeout too, or the
    abort that the first one's failure raised."""

    def body(world):
        with pytest.raises((CommTimeout, CommAborted)) as e:
            _exchange(world, bad=1, launches=1, timeout=0.5)
        return type(e.value).__name__, str(e.value)

    results = ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)
    timeouts = [(rank, text) for rank, (kind, text) in enumerate(results) if kind == "CommTimeout"]
    assert timeouts, results
    for rank, text in timeouts:
        assert text.startswith(f"rank {rank}: timed out after 0.5 s waiting for peer {(rank + 1) % 2}: "), text


def test_lla2a_member_outside_the_team_is_refused():
    def body(world):
        with pytest.raises(ValueError, match=rf"^rank {world.rank}: a device-API call in block 0 was given 2 where "):
            _exchange(world, bad=2, launches=1)

    ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (a compile check, nothing runs)")
def test_lla2a_builds_for_sm90(tmp_path):
    src = tmp_path / "lla2a.cu"
    src.write_text(EXCHANGE.replace("lsaMultimem(args)", "lsaMultimem(args, args.arg[4])"))
    proc = nvcc_sm90(src, tmp_path / "lla2a.ptx", "-ptx", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "multimem.st.relaxed.sys.global.b64 " in (tmp_path / "lla2a.ptx").read_text()
    proc = nvcc_sm90(src, tmp_path / "lla2a.cubin", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
