"""GIN under mpiexec: `commref check --path gin`, one process per rank.

Every collective over the GIN proxy with the MPI wire (messages between the ranks'
proxies: the distributed path, here on one host) and the shm wire (the proxy writes
into the peer's mapped window), ordered and unordered, 2, 3 and 5 ranks, a reduced sweep
with small slots (many pipeline steps). Also: the rc backend, and a setup failure that
names the missing capability. No /dev/shm/commref-* file may be left behind.
"""

from __future__ import annotations

import pytest
from conftest import clean_env, run_mpi
from helpers import CHECK_MODULE, SMALL_CHECK, assert_check_clean, many_channels_env, multi_channel_check

from commref.collectives.catalogue import KERNEL_NAMES

pytestmark = pytest.mark.mpi

CHECK = [*CHECK_MODULE, "--path", "gin"]
REDUCED = [
    "--dtype",
    "float32",
    "bfloat16",
    "--op",
    "sum",
    "max",
    "avg",
    "--count",
    "0",
    "1",
    "7",
    "1001",
    "2049",
    "--slot-bytes",
    "512",
]


def _assert_clean(proc, cases: int) -> None:
    s = assert_check_clean(proc)
    assert (s.cases, s.wrong, s.bad_cases) == (cases, 0, 0), s


# (allreduce ring+tree, reduce_scatter, reduce) x 3 ops + (allgather, broadcast); x 2 dtypes x 5 counts x 2,
# alltoall x 2 dtypes x 5 counts out of place (no in-place form), and one case on denormal
# inputs per reducing (collective, algorithm) x op x dtype x count
REDUCED_CASES = (4 * 3 + 2) * 2 * 5 * 2 + 2 * 5 + 4 * 3 * 2 * 5
# Where the direct kernels push over GIN (the native engine: both wires), their
# cases too: allreduce x 3 ops x 2 dtypes x 4 counts (the 5 rounded down to multiples of
# 2, 3 or 5 ranks: 4 distinct each) out of place, and as many on denormal inputs;
# allgather x 2 dtypes x 5 counts x 2; alltoall x 2 dtypes x 5 counts.
PUSHED_CASES = 3 * 2 * 4 * 2 + 2 * 5 * 2 + 2 * 5


@pytest.mark.parametrize("wire", ["ordered", "unordered"])
@pytest.mark.parametrize("network", ["mpi", "shm"])
@pytest.mark.parametrize("nranks", [2, 3, 5])
def test_check_over_gin(nranks, network, wire, shm_leak_check):
    args = [*CHECK_MODULE, *KERNEL_NAMES, "--path", "gin", *REDUCED, "--network", network, "--wire", wire]
    args += ["--seed", str(nranks * 7 + len(network))]
    proc = run_mpi(nranks, args, timeout=90, module=True)
    _assert_clean(proc, REDUCED_CASES + PUSHED_CASES)
    assert f"# commref check: {nranks} ranks, device cpu" in proc.stdout


def test_check_over_gin_rc_two_channels(shm_leak_check, tmp_path):
    """rc (every signal strong, ordered wire) over MPI with the work split across two
    channels (8.4 MB per rank; a planted calibration has the tuner take both)."""
    args = [*CHECK, *multi_channel_check(2, 65536), "--backend", "rc", "--network", "mpi"]
    env = clean_env(**many_channels_env(tmp_path))
    _assert_clean(run_mpi(2, args, timeout=90, module=True, env=env), 4 + 2)  # + 2 on denormal inputs


def test_no_backend_qualifies_fails_at_setup(shm_leak_check):
    args = [
        *CHECK,
        *SMALL_CHECK,
        "--backend",
        "gda",
        "--gin-protocol",
        "strong",
        "--network",
        "mpi",
    ]
    proc = run_mpi(2, args, timeout=60, module=True)
    assert proc.returncode != 0
    assert "no GIN backend meets the requirements: gda lacks strong signals" in proc.stdout + proc.stderr
