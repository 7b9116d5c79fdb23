"""The `commref` command line: every bad value is one line `commref <command>: error: ...`
on stderr and exit status 2, before any rank starts and with nothing left in /dev/shm;
bench takes every GIN protocol the Communicator accepts; the --np launcher removes what
a failed job left in /dev/shm and exits with the job's status."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from commref import cli
from commref.collectives.options import cuda_available
from commref.device_kernels import abi
from commref.transports import launch
from commref.transports.gin.options import Backend, GinProtocol, Network, Path, Wire

from conftest import REPO, clean_env, mpiexec, run_cmd

M = abi.MAX_CHANNELS

# (command line, extra environment, what the error line must say)
PROBES = [
    (["check", "--count", "-5"], {}, "argument --count: must be >= 0, got -5"),
    (["check", "--count", "7", "x"], {}, "argument --count: must be an integer, not 'x'"),
    (["check", "--np", "0"], {}, "argument --np: must be >= 1, got 0"),
    (["check"], {"COMMREF_TIMEOUT": "abc"}, "COMMREF_TIMEOUT='abc' is not a number of seconds"),
    (["check", "--np", "2"], {"COMMREF_TIMEOUT": "-1"}, "COMMREF_TIMEOUT='-1' must be a positive"),
    (["check", "--np", "2", "--threads", "5000"], {}, "argument --threads: threads must be in [1, 1024], got 5000"),
    (["check", "--threads", "0"], {}, "argument --threads: threads must be in [1, 1024], got 0"),
    (["check", "--channels", "0"], {}, f"argument --channels: max_channels must be in [1, {M}], got 0"),
    (["check", "--np", "2", "--channels", str(M + 1)], {},
     f"argument --channels: max_channels must be in [1, {M}], got {M + 1}"),
    (["check", "--slot-bytes", "100"], {}, "argument --slot-bytes: slot_bytes must be >= 64 and a multiple of 64"),
    (["check", "--slot-bytes", "0"], {}, "argument --slot-bytes: slot_bytes must be >= 64"),
    (["check", "--gin-protocol", "weak"], {},
     "argument --gin-protocol: gin_protocol must be one of strong, weak-last, signal-per-put, flush-signal, "
     "not 'weak'"),
    (["check", "--path", "nvls"], {}, "argument --path: path must be one of lsa, gin, auto, not 'nvls'"),
    (["check", "gather"], {}, "argument collective: unknown collective 'gather'; choose from allreduce"),
    (["check", "--dtype", "complex64"], {}, "argument --dtype: invalid choice: 'complex64'"),
    (["check", "--op", "xor"], {}, "argument --op: invalid choice: 'xor'"),
    (["check", "--np", "2", "--bogus"], {}, "unrecognized arguments: --bogus"),
    (["bench", "all_reduce", "--np", "0"], {}, "argument --np: must be >= 1, got 0"),
    (["bench", "all_reduce", "--np", "-3"], {}, "argument --np: must be >= 1, got -3"),
    (["bench", "all_reduce", "-b", "64M", "-e", "8"], {}, "need 0 <= minbytes <= maxbytes, got -b 67108864 -e 8"),
    (["bench", "all_reduce", "-b", "12Q"], {}, "argument -b/--minbytes: invalid size '12Q'"),
    (["bench", "all_reduce", "--np", "2", "--path", "gin", "--gin-protocol", "weak"], {},
     "argument --gin-protocol: gin_protocol must be one of strong, weak-last, signal-per-put, flush-signal, "
     "not 'weak'"),
    (["bench", "all_reduce", "--backend", "ib"], {}, "argument --backend: backend must be one of"),
    (["bench", "gather"], {}, "argument collective: unknown collective 'gather'"),
    (["bench", "all_reduce", "-d", "complex64"], {}, "argument -d/--datatype: unknown dtype 'complex64'"),
    (["bench", "all_reduce", "--np", "2", "--threads", "5000"], {},
     "argument --threads: threads must be in [1, 1024], got 5000"),
    (["bench", "all_reduce", "--channels", str(M + 1)], {}, "argument --channels: max_channels must be in"),
    (["bench", "all_reduce", "--slot-bytes", "100"], {}, "argument --slot-bytes: slot_bytes must be >= 64"),
    (["bench", "all_reduce", "-n", "0"], {}, "argument -n/--iters: must be >= 1, got 0"),
    (["bench", "all_reduce", "--np", "2", "-r", "2"], {}, "-r 2 is not a rank of this run"),
    (["bench", "all_reduce", "--np", "2", "-t", "2"], {}, "-t (rank threads) and --np (MPI ranks) do not combine"),
    (["bench", "all_reduce", "--backend", "proxy"], {}, "choose GIN transports; add --path gin"),
    (["bench", "all_reduce", "--np", "2"], {"COMMREF_TIMEOUT": "abc"}, "COMMREF_TIMEOUT='abc' is not a number"),
    (["check", "--np", "2"], {"COMMREF_CPU_BIND": "cores"}, "COMMREF_CPU_BIND must be one of auto, none, not 'cores'"),
    (["check", "--np", "2"], {"COMMREF_GIN_KERNELS_HELP": "yes"}, "COMMREF_GIN_KERNELS_HELP must be 0 or 1, not 'yes'"),
    (["bench"], {}, "the following arguments are required: collective"),
    (["check", "--np", "2", "--path", "gin", "--backend", "rc", "--wire", "unordered"], {},
     "no GIN backend meets the requirements: rc lacks the unordered wire (runs on ordered only)"),
    (["check", "--np", "2", "--path", "auto", "--backend", "gda"], {},
     "no GIN backend meets the requirements: gda lacks strong signals"),
    (["check", "--np", "2", "--path", "gin", "--wire", "unordered", "--wire-latency", "5us"], {},
     "the wire model (wire_rate, wire_latency) runs in the native GIN engine"),
    (["study", "--np", "3"], {}, "--np must be 2 (a sender and a receiver), got 3"),
    (["study", "--np", "2"], {}, "--np needs --stress"),
    (["study", "--stress", "--np", "0"], {}, "--np must be 2"),
    (["study", "--bound", "4by4"], {}, "--bound wants PxS (e.g. 4x4), not '4by4'"),
    (["study", "--stress", "--np", "2", "--bound", "0x4"], {}, "--bound needs at least 1x1"),
    (["study", "--stress", "--np", "2", "--seeds", "0"], {}, "--seeds and --messages must be at least 1"),
    (["study", "--stress", "--network", "mpi"], {}, "--network mpi needs --np 2"),
    (["study", "--protocol", "nope"], {}, "argument --protocol: invalid choice: 'nope'"),
]


def _orphans(before: set[str], patience_s: float = 5.0) -> set[str]:
    """Segments that appeared since `before` and that no live process maps. A concurrent
    job's live segments are not ours, nor those that vanish within `patience_s` (another
    test's cleanup, as shm_leak_check's)."""
    deadline = time.monotonic() + patience_s
    while True:
        left = (launch.shm_segments() - before) - launch.mapped_files()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.mark.parametrize("argv, env, message", PROBES, ids=[" ".join(p[0]) + "".join(
    f" {k}={v}" for k, v in p[1].items()) for p in PROBES])
def test_bad_value_is_one_line_and_status_2(argv, env, message):
    before = launch.shm_segments()
    proc = run_cmd([sys.executable, "-m", "commref", *argv], timeout=60, env=clean_env(**env))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.endswith("\n") and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"commref {argv[0]}: error: "), proc.stderr
    assert message in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert not _orphans(before)


def test_no_command_is_one_line_too():
    proc = run_cmd([sys.executable, "-m", "commref"], timeout=60, env=clean_env())
    assert proc.returncode == 2
    assert proc.stderr.startswith("commref: error: the following arguments are required")
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""


def test_in_process_main_returns_2(capsys):
    assert cli.main(["check", "--count", "-5"]) == 2
    assert capsys.readouterr().err == "commref check: error: argument --count: must be >= 0, got -5\n"
    assert cli.main(["check", "--help"]) == 0
    assert "--gin-protocol" in capsys.readouterr().out


def test_choices_come_from_the_typed_options():
    """check and bench offer exactly the enums' words; bench's lists take each of them."""
    p = cli.build_parser()
    check = {a.dest: a for a in p.commands["check"]._actions}
    for dest, cls in [("path", Path), ("backend", Backend), ("wire", Wire), ("network", Network),
                      ("gin_protocol", GinProtocol)]:
        assert tuple(check[dest].choices) == cls.words()
        assert p.parse_args(["check", f"--{dest.replace('_', '-')}", cls.words()[-1]]).__dict__[dest] == \
            cls.words()[-1]
    for flag, cls in [("--path", Path), ("--backend", Backend), ("--wire", Wire), ("--network", Network),
                      ("--gin-protocol", GinProtocol)]:
        args = p.parse_args(["bench", "all_reduce", flag, ",".join(cls.words())])
        assert getattr(args, flag[2:].replace("-", "_")) == list(cls.words())


@pytest.mark.parametrize("protocol", GinProtocol.words())
def test_bench_runs_every_gin_protocol(protocol, capsys):
    """`commref bench --path gin --gin-protocol P` for every protocol the Communicator
    accepts (2 ranks as threads; the default, ordered wire)."""
    rc = cli.main(["bench", "all_reduce", "-b", "1K", "-e", "4K", "-n", "2", "-w", "1", "-t", "2", "--path", "gin",
                   "--gin-protocol", protocol, "--no-baseline", "--no-bound"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "# Out of bounds values : 0 OK" in out
    assert f"gin/{protocol}" in out


def test_bench_alltoall_prints_nccl_tests_columns(capsys):
    """`commref bench alltoall`: nccl-tests' columns, busbw = algbw * (n - 1) / n, every
    element checked, and an empty in-place column (alltoall has no in-place form)."""
    n = 3
    rc = cli.main(["bench", "alltoall", "-b", "3K", "-e", "48K", "-f", "4", "-n", "2", "-w", "1", "-t", str(n),
                   "--path", "lsa,gin", "--no-baseline", "--no-bound"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "# Out of bounds values : 0 OK (lsa)" in out and "# Out of bounds values : 0 OK (gin)" in out
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [3072, 3072, 12288, 12288, 49152, 49152]
    for size, count, _type, redop, root, _t, algbw, busbw, wrong, *in_place_and_rest in rows:
        assert int(count) == int(size) // 4 // n and (redop, root, wrong) == ("none", "-1", "0")
        assert float(busbw) == pytest.approx(float(algbw) * (n - 1) / n, abs=0.011)
        assert in_place_and_rest[:4] == ["-", "-", "-", "N/A"]


@pytest.mark.mpi
@pytest.mark.parametrize("extra", [[], ["--nodes", "2", "--path", "auto"]])
def test_check_alltoall_under_np(extra, shm_leak_check):
    """`commref check alltoall --np 4`: ring and direct kernels; on two simulated nodes
    with path auto (LSA inside a node, GIN between them) the ring kernel only."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    proc = run_cmd([sys.executable, "-m", "commref", "check", "alltoall", "--np", "4", *extra], timeout=120,
                   env=clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = 10 * 4 * (1 if extra else 2)  # dtypes x counts x algorithms, out of place only
    assert f"# {cases} cases, counts [0, 1, 7, 1001], out-of-place, 0 on denormal inputs, 0 wrong elements in " \
           f"0 cases" in proc.stdout, proc.stdout[-3000:]
    assert ("alltoall       direct" in proc.stdout) == (not extra)


@pytest.mark.mpi
def test_bench_every_gin_protocol_under_np(shm_leak_check):
    """The same through the --np launcher: 2 MPI processes, every protocol side by side."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    words = GinProtocol.words()
    proc = run_cmd([sys.executable, "-m", "commref", "bench", "all_reduce", "--np", "2", "-b", "1K", "-e", "4K",
                    "-n", "2", "-w", "1", "--path", "gin", "--gin-protocol", ",".join(words), "--no-baseline",
                    "--no-bound"], timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for p in words:
        assert f"# Out of bounds values : 0 OK (gin/{p})" in proc.stdout, proc.stdout[-3000:]


# ---------------------------------------------------------------------------------------
# the launcher
# ---------------------------------------------------------------------------------------


def test_strip_np():
    assert launch.strip_np(["check", "--np", "2", "--count", "5", "--np=3", "x"]) == ["check", "--count", "5", "x"]


def test_remove_orphans_takes_only_new_unmapped_segments():
    tag = uuid.uuid4().hex[:8]
    old, new, held = (os.path.join(launch.SHM_DIR, f"commref-clitest-{tag}-{n}") for n in ("old", "new", "held"))
    open(old, "wb").close()
    before = launch.shm_segments()
    open(new, "wb").close()
    with open(held, "wb") as f:
        f.truncate(4096)
    with open(held, "r+b") as f:
        m = mmap.mmap(f.fileno(), 4096)
    try:
        removed = launch.remove_orphans(before, patterns=(f"commref-clitest-{tag}-*",), settle_s=0.5, poll_s=0.1)
        assert removed == [new]
        assert os.path.exists(old) and os.path.exists(held) and not os.path.exists(new)
    finally:
        m.close()
        for p in (old, new, held):
            if os.path.exists(p):
                os.unlink(p)


FAILING_JOB = """
    import os, sys
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    path = os.path.join({shm_dir!r}, "commref-clitest-{tag}-%d" % rank)
    open(path, "wb").close()  # a window file that a crash left behind
    MPI.COMM_WORLD.Barrier()  # MPICH has set up its shared memory
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    MPI.COMM_WORLD.Barrier()
"""


@pytest.mark.mpi
def test_launcher_cleans_up_after_a_failed_job(tmp_path, capfd):
    """A job whose rank fails (MPI_Abort through python -m mpi4py) leaves its window
    files and MPICH's segments; run_job removes them and returns the job's status."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    tag = uuid.uuid4().hex[:8]
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent(FAILING_JOB.format(shm_dir=launch.SHM_DIR, tag=tag)))
    before = launch.shm_segments()
    rc = launch.run_job([exe, "-n", "2", sys.executable, "-m", "mpi4py", str(script)], env=clean_env(),
                        timeout=60)
    assert rc != 0
    assert "rank 1 fails on purpose" in capfd.readouterr().err
    assert not [p for p in launch.shm_segments() if f"clitest-{tag}" in p]
    assert not _orphans(before, patience_s=0)  # MPICH's segments of the job are gone at once


@pytest.mark.mpi
def test_launcher_stops_a_job_past_its_timeout(tmp_path):
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    script = tmp_path / "hang.py"
    script.write_text("import time\nfrom mpi4py import MPI\ntime.sleep(60)\n")
    rc = launch.run_job([exe, "-n", "2", sys.executable, "-m", "mpi4py", str(script)], env=clean_env(), timeout=3,
                        grace_s=5)
    assert rc == 124


@pytest.mark.mpi
def test_failed_np_job_exits_with_its_status_and_leaves_nothing():
    """`commref bench --np 2 --device cuda` without a GPU (or without CuPy): every rank
    fails after MPI has set up its shared memory; the launcher cleans up and exits with
    the job's status."""
    if cuda_available():
        pytest.skip("a CUDA device is available: the job would not fail")
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    before = launch.shm_segments()
    proc = run_cmd([sys.executable, "-m", "commref", "bench", "all_reduce", "--np", "2", "--device", "cuda", "-b", "1K",
                    "-e", "1K", "-n", "1", "-w", "0"], timeout=60, env=clean_env())
    assert proc.returncode not in (0, 2), proc.stderr[-2000:]
    assert "device='cuda' needs CuPy" in proc.stderr or "device='cuda' but no CUDA device" in proc.stderr, \
        proc.stderr[-2000:]
    assert not _orphans(before, patience_s=0)


def test_a_checkout_runs_without_an_install(tmp_path):
    """With the checkout on PYTHONPATH and no install (python -S: no site, so no
    editable finder; the dependencies from site-packages as a plain path), the commref
    command runs: commref/__init__.py finds the layer folders beside it (what
    tests/gpu/gpu_check.sh relies on)."""
    import numpy

    site_packages = os.path.dirname(os.path.dirname(numpy.__file__))
    env = clean_env(PYTHONPATH=os.pathsep.join([REPO, site_packages]))
    proc = subprocess.run([sys.executable, "-S", "-m", "commref", "check", "allreduce", "--dtype", "float32", "--op",
                           "sum", "--count", "7"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "0 wrong elements" in proc.stdout
