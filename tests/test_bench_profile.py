"""`commref bench --profile` (bench/profile.py over commref/profile.h's counters): the
phases of a call add up within its kernel time, the bytes moved are what the kernels
move (exactly, for two kernels whose traffic is known), the default build counts
nothing, and the runs that cannot be profiled are refused before any rank starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import bench_args

from commref.bench import harness
from commref.bench.arguments import validate
from commref.device_kernels import cpu_loader

M = 1 << 20


def test_the_default_build_has_no_profile(monkeypatch):
    monkeypatch.delenv(cpu_loader.PROFILE_ENV, raising=False)
    assert cpu_loader.cpu_kernels().profile() is None


@pytest.mark.parametrize(
    "argv,message",
    [
        (("-t", "2"), r"^--profile needs each rank in a process of its own \(--np N\)"),
        (("--device", "cuda"), r"^--profile profiles the CPU engine's kernels; a GPU run has no profile"),
    ],
)
def test_runs_that_cannot_be_profiled_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        validate(bench_args("all_reduce", "--profile", *argv))


def _profiled_row(tmp_path, *argv: str) -> tuple[dict, str]:
    exe = shutil.which("commref", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("needs the commref script")
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [exe, "bench", "all_reduce", "-b", "1M", "-e", "1M", "-n", "3", "-w", "1", "--np", "2"]
        + ["--no-baseline", "--no-bound", "--profile", "--json", str(out), *argv],
        capture_output=True,
        text=True,
        timeout=240,
        env={k: v for k, v in os.environ.items() if k != harness.PROGRESS_ENV},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads(out.read_text())["rows"]
    return row, proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize(
    "argv,moved",
    [
        # the direct kernel on symmetric buffers: rank r reduces part r of both inputs
        # into part r of both outputs, the least any algorithm moves
        (("-R", "2", "--algorithm", "direct"), 1.0),
        # the ring on 2 ranks: half the input copied into the peer's FIFO (S bytes loaded
        # and stored), the received half reduced with the own one into the recvbuf and
        # the peer's FIFO (2 S), the half received back copied out (S): 4 S against the
        # least 2 S
        (("-R", "0", "--algorithm", "ring"), 2.0),
    ],
)
def test_profile_phases_add_up_and_bytes_are_the_kernels(tmp_path, argv, moved):
    row, stdout = _profiled_row(tmp_path, *argv)
    p = row["profile"]
    assert row["out_of_place"]["wrong"] == 0
    assert p["blocks"] >= 1 and p["kernel_us"] > 0 and p["reduce_us"] > 0
    assert p["moved_over_least"] == pytest.approx(moved, rel=1e-9)
    phases = p["copy_us"] + p["reduce_us"] + p["wait_us"] + p["help_us"]
    assert phases <= p["kernel_us"] * (1 + 1e-9), p  # nested calls count once, inside their block
    assert p["kernel_us"] <= p["time_us"], p
    assert "# profile: each rank's median call" in stdout and f"{M:>8d}  lsa" in stdout
