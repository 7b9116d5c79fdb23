"""commref.torch, the torch.distributed backend "commref": DDP against gloo, every
operation against gloo at 2, 3 and 4 ranks (tests/torch_ranks_script.py, one job per size,
ranks as processes with torchrun's env:// rendezvous), a dying rank, ranks in different
calls, and the one-process
parts (zero-copy views, the refusals). Skipped where torch is not installed: the torch
extra (pip install -e ".[torch]") brings it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import TESTS

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra: pip install -e '.[torch]')")
ct = pytest.importorskip("commref.torch")

SCRIPT = os.path.join(TESTS, "torch_ranks_script.py")
JOB_DEADLINE_S = 240  # one job of every check, on a loaded 2-core machine
DDP_TOLERANCE = 1e-6  # float32 sums in another order, over 50 steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    scenario: str, n: int, tmp_path, deadline_s: float = JOB_DEADLINE_S, failing=(), file_store: bool = False
) -> list[dict | None]:
    """Runs `n` ranks of `scenario` as processes (env:// rendezvous on a free port, or a
    FileStore passed to init_process_group where `file_store`) and
    returns each rank's findings (None where a rank wrote none). Every rank is killed at
    the deadline, which fails the test with their output; so does a traceback from a rank
    not in `failing`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(n), OMP_NUM_THREADS="1")
    env.pop("COMMREF_TEST_FILESTORE", None)
    if file_store:
        env["COMMREF_TEST_FILESTORE"] = str(tmp_path / "filestore")
    procs, logs = [], []
    for r in range(n):
        log = open(tmp_path / f"out{r}.txt", "w+b")  # noqa: SIM115 - closed below
        logs.append(log)
        rank_env = dict(env, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n))
        procs.append(
            subprocess.Popen([sys.executable, SCRIPT, scenario, str(tmp_path)], env=rank_env, stdout=log, stderr=log)
        )
    end = time.monotonic() + deadline_s
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        late = [r for r, p in enumerate(procs) if p.poll() is None]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read().decode(errors="replace")[-3000:])
        log.close()
    assert not late, f"ranks {late} still ran at the {deadline_s} s deadline:\n" + "\n".join(outputs)
    found = []
    for r in range(n):
        path = tmp_path / f"rank{r}.json"
        found.append(json.loads(path.read_text()) if path.exists() else None)
    for r, f in enumerate(found):
        assert f is None or r in failing or "traceback" not in f, f"rank {r} failed:\n{f['traceback']}\n{outputs[r]}"
    return found


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ddp_and_every_operation_against_gloo(n, tmp_path):
    """2 and 4 ranks meet through env:// (a TCPStore), 3 through a FileStore passed in."""
    found = run_ranks("all", n, tmp_path, file_store=n == 3)
    assert all(f is not None for f in found), found
    for r, f in enumerate(found):
        assert f["backend"] == "commref"
        assert not f["failures"], f"rank {r}: {len(f['failures'])} of {f['checks']} checks failed:\n" + "\n".join(
            f["failures"]
        )
        assert f["checks"] > 250, f"rank {r} ran only {f['checks']} checks"
        assert f["ddp_ranks_agree"], f"rank {r}: the ranks' DDP parameters differ"
        # Two ranks add in the same order on both backends; more may not.
        if n == 2:
            assert f["ddp_bit_equal"], f"rank {r}: DDP differs from gloo by {f['ddp_max_abs_diff']}"
        assert f["ddp_max_abs_diff"] <= DDP_TOLERANCE, f"rank {r}: DDP differs from gloo by {f['ddp_max_abs_diff']}"


def test_a_dying_rank_ends_its_peers_call(tmp_path):
    """Rank 1 raises after init (the exception ends its process); rank 0's allreduce, which
    waits for it, fails with CommAborted at once instead of at the 60 s deadline."""
    found = run_ranks("death", 2, tmp_path, deadline_s=120, failing=(1,))
    assert found[0] is not None
    assert found[0]["error"] == "CommAborted", found[0]
    assert found[0]["after_s"] < 20, found[0]
    assert "rank 1 fails on purpose" in found[1]["traceback"]


# ---- one process ----


@pytest.mark.parametrize("dtype", list(ct.DTYPES))
def test_contiguous_tensors_are_viewed_not_copied(dtype):
    t = torch.zeros((3, 5), dtype=dtype)
    a = ct._view(t)
    assert a.ctypes.data == t.data_ptr() and a.size == 15 and a.dtype == ct.DTYPES[dtype]
    a[7] = a.dtype.type(3)
    assert int(t.flatten()[7].to(torch.int64)) == 3


def test_non_contiguous_tensors_go_through_a_copy_and_back():
    t = torch.zeros((4, 6)).t()
    b = ct._Buffer(t, "allreduce", "tensor")
    assert b.contiguous is not t and b.array.ctypes.data != t.data_ptr()
    b.array[:] = np.arange(24, dtype=np.float32)
    b.finish()
    assert torch.equal(t, torch.arange(24, dtype=torch.float32).reshape(6, 4))


@pytest.mark.parametrize(
    "tensor, words",
    [
        (lambda: torch.ones(2, dtype=torch.bool), ["bool", "lacks"]),
        (lambda: torch.ones(2, dtype=torch.complex128), ["complex", "lacks"]),
        (lambda: torch.ones(2, dtype=torch.int16), ["int16"]),
        (lambda: torch.eye(2).to_sparse(), ["sparse"]),
        (lambda: torch.ones(2, device="meta"), ["meta", "CPU"]),
        (lambda: [1, 2], ["torch.Tensor"]),
    ],
)
def test_unsupported_tensors_name_the_call(tensor, words):
    with pytest.raises(TypeError) as e:
        ct.check_tensor(tensor(), "all_gather_single", "input")
    assert "all_gather_single" in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_reduce_ops():
    R = torch.distributed.ReduceOp
    assert [ct.reduce_op(op, "allreduce") for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG)] == [
        "sum",
        "prod",
        "min",
        "max",
        "avg",
    ]
    for op in (R.BAND, R.BOR, R.BXOR):
        with pytest.raises(ValueError, match="reduce_scatter"):
            ct.reduce_op(op, "reduce_scatter")


def test_the_backend_is_registered_for_cpu_and_cuda():
    assert "COMMREF" in torch.distributed.Backend._plugins
    assert torch.distributed.Backend.default_device_backend_map.get("cpu") != "commref"  # gloo stays the default
    assert torch.distributed.Backend.backend_capability["commref"] == ["cpu", "cuda"]


def test_ranks_in_different_calls_both_fail_at_once(tmp_path):
    """Rank 0 all-reduces while rank 1 broadcasts: commref's CommMismatch on both, naming
    both calls, within seconds."""
    found = run_ranks("mismatch", 2, tmp_path, deadline_s=120)
    for f in found:
        assert f is not None and f["error"] == "CommMismatch", found
        assert "allreduce" in f["message"] and "broadcast" in f["message"], f
        assert f["after_s"] < 20, f
