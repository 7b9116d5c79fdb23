"""Which GPU a rank uses (through the stand-in for CuPy, stand_ins.FakeCuda), and what
the benchmark says about how ranks share a GPU.
"""

from __future__ import annotations

import pytest
from stand_ins import run_threads

from commref.collectives.communicator import Communicator
from commref.transports.thread_world import ThreadWorld

# ---- what the benchmark says it measured ----


def test_bench_names_how_ranks_share_a_gpu():
    from commref.bench.environment import gpu_sharing

    ranks = [{"rank": r, "host": "h", "pid": 10 + r, "pci_bus": "0000:01:00.0", "mps": None} for r in range(2)]
    (line,) = gpu_sharing(ranks)
    assert (
        "2 ranks (0,1) share GPU 0000:01:00.0" in line and "2 processes" in line and "time-sliced without MPS" in line
    )
    under_mps = [dict(r, mps="/tmp/nvidia-mps/control") for r in ranks]
    (line,) = gpu_sharing(under_mps)
    assert "under MPS" in line and "time-sliced" not in line
    threads = [dict(r, pid=10) for r in ranks]
    (line,) = gpu_sharing(threads)
    assert "threads of one process" in line
    apart = [dict(r, pci_bus=f"0000:0{i + 1}:00.0") for i, r in enumerate(ranks)]
    assert gpu_sharing(apart) == []


# ---- which GPU a rank uses ----


def _placed(world, fake, **kw):
    comm = Communicator(world, "cuda", max_channels=1, **kw)
    current = fake.module.cuda.Device().id  # the calling thread's current device afterwards
    comm.close()
    return comm.device_id, current


@pytest.mark.parametrize("nranks, ngpus, want", [(2, 4, [0, 1]), (3, 2, [0, 1, 0]), (4, 1, [0, 0, 0, 0])])
def test_default_gpu_is_local_rank_modulo_gpus_and_made_current(fake, monkeypatch, nranks, ngpus, want):
    """Without device_id each rank takes GPU local_rank % GPUs (as NCCL users set it; all
    ranks on GPU 0 would time-slice one GPU of eight) and makes it current, so the
    buffers it makes next land there; several ranks per GPU where there are fewer GPUs."""
    monkeypatch.setattr(fake.module.cuda.runtime, "getDeviceCount", lambda: ngpus)
    assert run_threads(nranks, _placed, fake) == [(d, d) for d in want]


def test_explicit_device_id_wins_and_leaves_the_current_device(fake, monkeypatch):
    monkeypatch.setattr(fake.module.cuda.runtime, "getDeviceCount", lambda: 4)
    assert run_threads(2, lambda world: _placed(world, fake, device_id=3)) == [(3, 0), (3, 0)]


def test_examples_and_bench_take_the_communicators_gpu(fake, monkeypatch):
    """commref.rmsnorm, commref.ep, the bench and the GPU scripts make their inputs on
    the GPU use_rank_gpu picks, the one their Communicator then takes."""
    import inspect

    from commref import ep, rmsnorm
    from commref.bench import harness
    from commref.collectives.gpu_stream import use_rank_gpu

    monkeypatch.setattr(fake.module.cuda.runtime, "getDeviceCount", lambda: 2)
    assert ThreadWorld.run(3, lambda w: (use_rank_gpu(w), fake.module.cuda.Device().id), timeout=10) == [
        (0, 0),
        (1, 1),
        (0, 0),
    ]
    from commref import _selfcheck

    for fn in (_selfcheck.use_rank_stream, harness.setup_device):
        assert "use_rank_gpu(world)" in inspect.getsource(fn), fn
    for fn in (rmsnorm._main, ep._main):  # the self-checks take their GPU through use_rank_stream
        assert "use_rank_stream(world)" in inspect.getsource(fn), fn
