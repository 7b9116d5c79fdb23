"""`commref check` under mpiexec: one process per rank, windows in POSIX shared memory.

Reduced sweeps with 2, 3 and 4 ranks, the full default sweep with 4 ranks (about 3 s
here), a multi-channel run (a planted calibration has the tuner take every channel), and the
`--np` relaunch path. No /dev/shm/commref-* file may be left behind.
"""

from __future__ import annotations

import re
import sys

import pytest
from conftest import clean_env, mpiexec, run_cmd, run_mpi
from helpers import CHECK_MODULE, assert_check_clean, check_summary, many_channels_env, multi_channel_check

pytestmark = pytest.mark.mpi

CHECK = CHECK_MODULE
REDUCED = "--dtype float32 bfloat16 int8 uint64 --op sum prod avg max --count 0 1 7 1001 4099".split()


def _assert_clean(proc, min_cases: int = 1) -> int:
    s = assert_check_clean(proc)
    assert s.cases >= min_cases
    return s.cases


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_check_reduced(nranks, shm_leak_check):
    # 1 KiB slots: the 1001 and 4099 counts still wrap the 4-slot FIFOs, and 4 spinning
    # processes on 2 cores stay fast (256-byte slots take 10-20 s there).
    proc = run_mpi(nranks, [*CHECK, *REDUCED, "--slot-bytes", "1024"], timeout=90, module=True)
    cases = _assert_clean(proc)
    # (allreduce ring+tree+direct, reduce_scatter ring+direct, reduce) x 4 ops
    # + (allgather ring+direct, broadcast); x 4 dtypes x 5 counts x 2; alltoall ring+direct
    # x 4 dtypes x 5 counts out of place; and on denormal inputs the 6 reducing pairs x
    # 3 ops (not prod) x 2 floating dtypes x 5 counts; per dtype and count, the collectives
    # of sends and receives (gather and scatter in and out of place, alltoallv and sendrecv
    # out of place, hypercube allgather both ways on powers of two) and one group case;
    # allreduce nvls for the 8 (dtype, op) pairs multicast reduces (float32 sum avg,
    # bfloat16 and uint64 sum avg max) x 5 counts x 2, and 5 of them on denormals x 5 counts
    composed = 2 + 2 + 1 + 1 + (2 if nranks & (nranks - 1) == 0 else 0) + 1
    nvls = 8 * 5 * 2 + 5 * 5
    assert cases == (6 * 4 + 3) * 4 * 5 * 2 + 2 * 4 * 5 + 6 * 3 * 2 * 5 + composed * 4 * 5 + nvls
    assert f"# commref check: {nranks} ranks, device cpu" in proc.stdout


def test_check_full_default_sweep(shm_leak_check):
    proc = run_mpi(4, CHECK, timeout=120, module=True)
    cases = _assert_clean(proc)
    # 10 dtypes x (6 reducing (collective, algorithm) x 5 ops + 3 moving) x 4 counts x 2 placements,
    # alltoall ring+direct x 10 dtypes x 4 counts out of place, and on denormal inputs 6
    # reducing pairs x 4 ops (not prod) x 4 floating dtypes x 4 counts; the collectives of
    # sends and receives (9 cases per dtype and count at 4 ranks, as above) and the group cases;
    # allreduce nvls: 28 (dtype, op) pairs (sum and avg over 8 dtypes, min and max over 6)
    # x 4 counts x 2, and 12 of them on denormal inputs (float16 and bfloat16 x 4 ops,
    # float32 and float64 x sum and avg) x 4 counts
    nvls = 28 * 4 * 2 + 12 * 4
    assert cases == 10 * (6 * 5 + 3) * 4 * 2 + 2 * 10 * 4 + 6 * 4 * 4 * 4 + 9 * 10 * 4 + nvls
    assert re.search(r"^allreduce +ring +bfloat16 denormal ", proc.stdout, re.M)
    for coll in ("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "alltoall"):
        assert coll in proc.stdout
    for coll in ("gather", "scatter", "alltoallv", "sendrecv", "hypercube", "group"):
        assert re.search(rf"^{coll} ", proc.stdout, re.M), coll
    assert re.search(r"^allgather +direct +uint8 ", proc.stdout, re.M)
    assert re.search(r"^alltoall +direct +bfloat16 ", proc.stdout, re.M)
    summary = check_summary(proc.stdout)
    assert summary.what.startswith(
        "counts [0, 1, 7, 1001], in-place and out-of-place, alltoall, alltoallv, sendrecv, group out-of-place only;"
    )


def test_check_multi_channel(shm_leak_check, tmp_path):
    """8.4 MB per rank on three channels of shared-memory FIFOs."""
    args = [*CHECK, *multi_channel_check(3, 4096)]
    _assert_clean(run_mpi(2, args, timeout=120, module=True, env=clean_env(**many_channels_env(tmp_path))), min_cases=4)


def test_check_threads_per_block(shm_leak_check):
    args = [
        *CHECK,
        "allreduce",
        "allgather",
        "--dtype",
        "float16",
        "uint64",
        "--op",
        "sum",
        "min",
        "--count",
        "1",
        "999",
        "--threads",
        "8",
        "--slot-bytes",
        "128",
    ]
    _assert_clean(run_mpi(3, args, timeout=90, module=True))


def test_check_relaunch_np(shm_leak_check):
    """`commref check --np 2` outside MPI relaunches itself under mpiexec."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    cmd = [
        sys.executable,
        "-m",
        "commref.cli",
        "check",
        "--np",
        "2",
        "reduce",
        "broadcast",
        "--dtype",
        "int8",
        "float32",
        "--op",
        "sum",
        "max",
        "--count",
        "0",
        "5",
        "300",
    ]
    proc = run_cmd(cmd, timeout=90, env=clean_env())
    _assert_clean(proc)
    assert "# commref check: 2 ranks, device cpu" in proc.stdout
    # Printed once (by rank 0 of the relaunched job), not once per rank.
    assert proc.stdout.count("# commref check:") == 1


def test_check_single_process_no_mpi():
    """Without --np and outside MPI: a one-rank ThreadWorld."""
    cmd = [
        sys.executable,
        "-m",
        "commref.cli",
        "check",
        "allreduce",
        "--dtype",
        "float32",
        "--op",
        "avg",
        "--count",
        "3",
    ]
    proc = run_cmd(cmd, timeout=60, env=clean_env())
    _assert_clean(proc)
    assert "# commref check: 1 ranks, device cpu" in proc.stdout
