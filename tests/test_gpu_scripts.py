"""The GPU check scripts (tests/gpu/), without a GPU: they parse, the dry run fits
its budget and has every step, the wheels fetched are only what the GPU image lacks,
and nccl_compare skips in one line where NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from stand_ins import run_threads

# ---- the GPU check script, without a GPU ----

GPU_DIR = Path(__file__).resolve().parent / "gpu"
IMAGE_PACKAGES = ("cuda-bindings", "cuda-core", "cuda-pathfinder", "cupy", "mpi4py", "numpy", "nvidia-nccl")


@pytest.mark.parametrize("script", ["gpu_check.sh", "fetch_wheels.sh"])
def test_gpu_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(GPU_DIR / script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_gpu_check_dry_run_fits_its_budget_and_has_every_step():
    """GPU_CHECK_DRY_RUN=1 lists every step with its deadline and runs nothing. The
    deadlines, the install's and the two probes' add up to the worst case it prints, under 360 s (the
    GPU machine's 15 minutes include its start and a rerun); COMMREF_TIMEOUT is below every
    step's deadline, so a hang ends in commref's diagnostic; the steps cover the protocol
    sweep, the device-API operations, the failure paths, 8 ranks on one GPU and the
    sanitizers, after the versions."""
    env = {k: v for k, v in os.environ.items() if k != "COMMREF_TIMEOUT"}
    proc = subprocess.run(
        ["bash", str(GPU_DIR / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "GPU_CHECK_DRY_RUN": "1"},
        cwd=GPU_DIR.parent.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = re.findall(r"^=== (.+?) \[(\d+) s\]: (.*)$", proc.stdout, re.MULTILINE)
    names = [name for name, _, _ in steps]
    deadlines = [int(d) for _, d, _ in steps]
    install, probe = map(
        int, re.search(r"^INSTALL_S=(\d+) PROBE_S=(\d+)", (GPU_DIR / "gpu_check.sh").read_text(), re.MULTILINE).groups()
    )
    worst, timeout = map(int, re.search(r"worst case (\d+) s .*COMMREF_TIMEOUT (\d+) s; dry run", proc.stdout).groups())
    assert worst == sum(deadlines) + install + 2 * probe and worst < 360, (worst, deadlines, install, probe)
    assert timeout < min(deadlines), (timeout, min(deadlines))
    assert names[0].startswith("versions: driver, CUDA, CuPy, NCCL, MPI")
    commands = {name: cmd for name, _, cmd in steps}
    wanted = {
        "protocols simple and LL": "--protocol simple ll",
        "device API: every operation": "device_api_gpu.py",
        "failure paths: mismatch, abort, proxy error, residency": "failures_gpu.py",
        "8 ranks as threads on one GPU": "--np 8",
        "compute-sanitizer memcheck": "memcheck",
        "compute-sanitizer racecheck": "racecheck",
        "commref vs NCCL": "nccl_compare.py",
    }
    for prefix, word in wanted.items():
        found = [cmd for name, cmd in commands.items() if name.startswith(prefix)]
        assert found and word in found[0], (prefix, found)
    assert "=== ok" not in proc.stdout and "=== FAIL" not in proc.stdout, "the dry run ran a step"


def test_fetch_wheels_fetches_only_what_the_gpu_image_lacks():
    """The image's CUDA 13 packages (cuda-bindings, cuda-core, cuda-pathfinder, CuPy 14,
    NCCL, mpi4py) must not travel: installed into /tmp/site, first on PYTHONPATH, a
    CUDA 12 cuda-bindings shadowed the bindings cuda-core, nccl4py and CuPy 14 load.
    gpu_check.sh also leaves such wheels uninstalled if a stale .whl holds them."""
    text = (GPU_DIR / "fetch_wheels.sh").read_text()
    (download,) = [line for line in text.splitlines() if line.strip().startswith('"${platforms[@]}"')]
    fetched = download.split("-d .whl", 1)[1].split()
    assert fetched == ["mpich", "nccl4py"], fetched
    assert not any(p in download for p in IMAGE_PACKAGES), download
    check = (GPU_DIR / "gpu_check.sh").read_text()
    assert "grep -v -E '/(cuda_bindings|cuda_core|cuda_pathfinder|cupy" in check and "--upgrade" not in check


def test_nccl_compare_skips_in_one_line_where_nccl_refuses_two_ranks_on_one_gpu(fake, capsys):
    """NCCL before its multi-rank-GPU support rejects a second rank on one GPU: every rank
    exits SKIP (they agree), and rank 0's one line names the NCCL version and the refusal,
    after the version line."""
    sys.path.insert(0, str(GPU_DIR))
    try:
        import nccl_compare
    finally:
        sys.path.remove(str(GPU_DIR))

    class Communicator:
        @staticmethod
        def init(nranks, rank, uid):
            raise RuntimeError("ncclInvalidUsage: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000")

    nccl = types.SimpleNamespace(
        __version__="0.6.0", get_version=lambda: 22703, get_unique_id=lambda: b"id", Communicator=Communicator
    )

    def body(world):
        try:
            nccl_compare.nccl_communicator(world, nccl)
        except SystemExit as e:
            return e.code
        return None

    assert run_threads(2, body) == [nccl_compare.SKIP, nccl_compare.SKIP]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("nccl4py 0.6.0, NCCL library 22703"), lines
    (skip,) = [line for line in lines if line.startswith("SKIP")]
    assert "NCCL 22703 refused 2 ranks on GPUs [0, 0]" in skip and "Duplicate GPU detected" in skip, skip
