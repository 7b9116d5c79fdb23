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
import uuid

import pytest
from conftest import REPO, clean_env, mpiexec, run_cmd
from helpers import SMALL_CHECK, check_summary, orphan_segments

from commref import cli
from commref.bench import programs
from commref.collectives.options import cuda_available
from commref.device_kernels import abi
from commref.transports import launcher
from commref.transports.gin.options import Backend, GinProtocol, Network, Path, Wire

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
    (
        ["check", "--np", "2", "--channels", str(M + 1)],
        {},
        f"argument --channels: max_channels must be in [1, {M}], got {M + 1}",
    ),
    (["check", "--slot-bytes", "100"], {}, "argument --slot-bytes: slot_bytes must be >= 64 and a multiple of 64"),
    (["check", "--slot-bytes", "0"], {}, "argument --slot-bytes: slot_bytes must be >= 64"),
    (
        ["check", "--gin-protocol", "weak"],
        {},
        "argument --gin-protocol: gin_protocol must be one of strong, weak-last, signal-per-put, flush-signal, "
        "not 'weak'",
    ),
    (["check", "--path", "nvls"], {}, "argument --path: path must be one of lsa, gin, auto, not 'nvls'"),
    (["check", "alltoallw"], {}, "argument collective: unknown collective 'alltoallw'; choose from allreduce"),
    (["check", "--dtype", "complex64"], {}, "argument --dtype: invalid choice: 'complex64'"),
    (["check", "--op", "xor"], {}, "argument --op: invalid choice: 'xor'"),
    (["check", "--np", "2", "--bogus"], {}, "unrecognized arguments: --bogus"),
    (["bench", "all_reduce", "--np", "0"], {}, "argument --np: must be >= 1, got 0"),
    (["bench", "all_reduce", "--np", "-3"], {}, "argument --np: must be >= 1, got -3"),
    (["bench", "all_reduce", "-b", "64M", "-e", "8"], {}, "need 0 <= minbytes <= maxbytes, got -b 67108864 -e 8"),
    (["bench", "all_reduce", "-b", "12Q"], {}, "argument -b/--minbytes: invalid size '12Q'"),
    (["bench", "all_reduce", "--np", "2", "-m", "0"], {}, "argument -m/--agg_iters: must be in [1, 1024], got 0"),
    (
        ["bench", "all_reduce", "--np", "2", "--path", "gin", "--gin-protocol", "weak"],
        {},
        "argument --gin-protocol: gin_protocol must be one of strong, weak-last, signal-per-put, flush-signal, "
        "not 'weak'",
    ),
    (["bench", "all_reduce", "--backend", "ib"], {}, "argument --backend: backend must be one of"),
    (["bench", "scan"], {}, "argument collective: unknown collective 'scan'"),
    (["bench", "all_reduce", "-d", "complex64"], {}, "argument -d/--datatype: unknown dtype 'complex64'"),
    (
        ["bench", "all_reduce", "--np", "2", "--threads", "5000"],
        {},
        "argument --threads: threads must be in [1, 1024], got 5000",
    ),
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
    (
        ["check", "--np", "2", "--path", "gin", "--backend", "rc", "--wire", "unordered"],
        {},
        "no GIN backend meets the requirements: rc lacks the unordered wire (runs on ordered only)",
    ),
    (
        ["check", "--np", "2", "--path", "auto", "--backend", "gda"],
        {},
        "no GIN backend meets the requirements: gda lacks strong signals",
    ),
    (
        ["check", "--np", "2", "--path", "gin", "--wire", "ordered", "--wire-latency", "5us", "--fault", "dup=0.1"],
        {},
        "the wire model (wire_rate, wire_latency) runs in the native GIN engine and faults on the ordered wire in",
    ),
    (
        ["check", "--np", "4", "--nodes", "2", "--path", "lsa"],
        {},
        "--path lsa --nodes 2: LSA needs every rank on one node; use --path auto",
    ),
    (["bench", "engine", "--np", "2"], {}, "engine runs in one process: it takes no --np"),
    (["bench", "ep", "--topk", "0"], {}, "argument --topk: must be >= 1, got 0"),
    (["bench", "ep", "--np", "2", "--topk", "32"], {}, "--topk 32 exceeds --experts 16"),
    (["bench", "ep", "--path", "nvls"], {}, "argument --path: path must be one of lsa, gin, auto, not 'nvls'"),
    (["bench", "gin_rate", "--bytes", "4"], {}, "--bytes must be at least 8 (two float32 elements), got 4"),
    (["bench", "soak", "--calls", "0"], {}, "argument --calls: must be >= 1, got 0"),
    (["bench", "ep", "--bogus"], {}, "unrecognized arguments: --bogus"),
    (["study", "--np", "3"], {}, "--np must be 2 (a sender and a receiver), got 3"),
    (["study", "--np", "2"], {}, "--np needs --stress"),
    (["study", "--stress", "--np", "0"], {}, "--np must be 2"),
    (["study", "--bound", "4by4"], {}, "--bound wants PxS (e.g. 4x4), not '4by4'"),
    (["study", "--stress", "--np", "2", "--bound", "0x4"], {}, "--bound needs at least 1x1"),
    (["study", "--stress", "--np", "2", "--seeds", "0"], {}, "--seeds and --messages must be at least 1"),
    (["study", "--stress", "--network", "mpi"], {}, "--network mpi needs --np 2"),
    (["study", "--protocol", "nope"], {}, "argument --protocol: invalid choice: 'nope'"),
    (["model", "--nodes", "0"], {}, "argument --nodes: must be in [1, 65536], got 0"),
    (["model", "--nvlink-rate", "fast"], {}, "--nvlink-rate must be a number >= 0 in bytes/s, e.g. 450G"),
    (["model", "--network-rate", "0"], {}, "--network-rate must be above 0 bytes/s, not '0'"),
    (["model", "--pcie-latency=-2us"], {}, "--pcie-latency must be a number >= 0 in seconds"),
    (["model", "sendrecv"], {}, "the model describes all_reduce, all_gather"),
    (["model", "--gpus-per-node", "1"], {}, "the cluster needs at least 2 GPUs"),
    (["model", "-f", "1"], {}, "need a step factor > 1"),
    (["model", "-b", "8K", "-e", "8"], {}, "need 0 <= minbytes <= maxbytes, got -b 8192 -e 8"),
    (["bench", "all_reduce", "-b", "8", "-e", "8"], {"COMMREF_MODEL": "fast"}, "COMMREF_MODEL must be one of"),
]


@pytest.mark.parametrize(
    "argv, env, message", PROBES, ids=[" ".join(p[0]) + "".join(f" {k}={v}" for k, v in p[1].items()) for p in PROBES]
)
def test_bad_value_is_one_line_and_status_2(argv, env, message):
    before = launcher.shm_segments()
    proc = run_cmd([sys.executable, "-m", "commref", *argv], timeout=60, env=clean_env(**env))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.endswith("\n") and proc.stderr.count("\n") == 1, proc.stderr
    program = cli.bench_program(argv)
    command = f"bench {program.name}" if program else argv[0]
    assert proc.stderr.startswith(f"commref {command}: error: "), proc.stderr
    assert message in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert not orphan_segments(before)


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
    for dest, cls in [
        ("path", Path),
        ("backend", Backend),
        ("wire", Wire),
        ("network", Network),
        ("gin_protocol", GinProtocol),
    ]:
        assert tuple(check[dest].choices) == cls.words()
        assert p.parse_args(["check", f"--{dest.replace('_', '-')}", cls.words()[-1]]).__dict__[dest] == cls.words()[-1]
    for flag, cls in [
        ("--path", Path),
        ("--backend", Backend),
        ("--wire", Wire),
        ("--network", Network),
        ("--gin-protocol", GinProtocol),
    ]:
        args = p.parse_args(["bench", "all_reduce", flag, ",".join(cls.words())])
        assert getattr(args, flag[2:].replace("-", "_")) == list(cls.words())


@pytest.mark.parametrize("protocol", GinProtocol.words())
def test_bench_runs_every_gin_protocol(protocol, capsys):
    """`commref bench --path gin --gin-protocol P` for every protocol the Communicator
    accepts (2 ranks as threads; the default, ordered wire)."""
    rc = cli.main(
        [
            "bench",
            "all_reduce",
            "-b",
            "1K",
            "-e",
            "4K",
            "-n",
            "2",
            "-w",
            "1",
            "-t",
            "2",
            "--path",
            "gin",
            "--gin-protocol",
            protocol,
            "--no-baseline",
            "--no-bound",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "# Out of bounds values : 0 OK" in out
    assert f"gin/{protocol}" in out


def test_bench_alltoall_prints_nccl_tests_columns(capsys):
    """`commref bench alltoall`: nccl-tests' columns, busbw = algbw * (n - 1) / n, every
    element checked, and an empty in-place column (alltoall has no in-place form)."""
    n = 3
    rc = cli.main(
        [
            "bench",
            "alltoall",
            "-b",
            "3K",
            "-e",
            "48K",
            "-f",
            "4",
            "-n",
            "2",
            "-w",
            "1",
            "-t",
            str(n),
            "--path",
            "lsa,gin",
            "--no-baseline",
            "--no-bound",
        ]
    )
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
    proc = run_cmd(
        [sys.executable, "-m", "commref", "check", "alltoall", "--np", "4", *extra], timeout=120, env=clean_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = 10 * 4 * (1 if extra else 2)  # dtypes x counts x algorithms, out of place only
    summary = check_summary(proc.stdout)
    assert summary and (summary.cases, summary.wrong) == (cases, 0), proc.stdout[-3000:]
    assert summary.what == "counts [0, 1, 7, 1001], out-of-place; 0 on denormal inputs", summary
    assert ("alltoall       direct" in proc.stdout) == (not extra)


@pytest.mark.mpi
def test_bench_every_gin_protocol_under_np(shm_leak_check):
    """The same through the --np launcher: 2 MPI processes, every protocol side by side."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    words = GinProtocol.words()
    proc = run_cmd(
        [
            sys.executable,
            "-m",
            "commref",
            "bench",
            "all_reduce",
            "--np",
            "2",
            "-b",
            "1K",
            "-e",
            "4K",
            "-n",
            "2",
            "-w",
            "1",
            "--path",
            "gin",
            "--gin-protocol",
            ",".join(words),
            "--no-baseline",
            "--no-bound",
        ],
        timeout=120,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for p in words:
        assert f"# Out of bounds values : 0 OK (gin/{p})" in proc.stdout, proc.stdout[-3000:]


# ---------------------------------------------------------------------------------------
# the launcher
# ---------------------------------------------------------------------------------------


def test_strip_np():
    assert launcher.strip_np(["check", "--np", "2", "--count", "5", "--np=3", "x"]) == ["check", "--count", "5", "x"]


def test_remove_orphans_takes_only_new_unmapped_segments():
    tag = uuid.uuid4().hex[:8]
    old, new, held = (os.path.join(launcher.SHM_DIR, f"commref-clitest-{tag}-{n}") for n in ("old", "new", "held"))
    open(old, "wb").close()
    before = launcher.shm_segments()
    open(new, "wb").close()
    with open(held, "wb") as f:
        f.truncate(4096)
    with open(held, "r+b") as f:
        m = mmap.mmap(f.fileno(), 4096)
    try:
        removed = launcher.remove_orphans(before, patterns=(f"commref-clitest-{tag}-*",), settle_s=0.5, poll_s=0.1)
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
    script.write_text(textwrap.dedent(FAILING_JOB.format(shm_dir=launcher.SHM_DIR, tag=tag)))
    before = launcher.shm_segments()
    rc = launcher.run_job([exe, "-n", "2", sys.executable, "-m", "mpi4py", str(script)], env=clean_env(), timeout=60)
    assert rc != 0
    assert "rank 1 fails on purpose" in capfd.readouterr().err
    assert not [p for p in launcher.shm_segments() if f"clitest-{tag}" in p]
    assert not orphan_segments(before, patience_s=0)  # MPICH's segments of the job are gone at once


@pytest.mark.mpi
def test_launcher_stops_a_job_past_its_timeout(tmp_path):
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    script = tmp_path / "hang.py"
    script.write_text("import time\nfrom mpi4py import MPI\ntime.sleep(60)\n")
    rc = launcher.run_job(
        [exe, "-n", "2", sys.executable, "-m", "mpi4py", str(script)], env=clean_env(), timeout=3, grace_s=5
    )
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
    before = launcher.shm_segments()
    proc = run_cmd(
        [
            sys.executable,
            "-m",
            "commref",
            "bench",
            "all_reduce",
            "--np",
            "2",
            "--device",
            "cuda",
            "-b",
            "1K",
            "-e",
            "1K",
            "-n",
            "1",
            "-w",
            "0",
        ],
        timeout=60,
        env=clean_env(),
    )
    assert proc.returncode not in (0, 2), proc.stderr[-2000:]
    assert "device='cuda' needs CuPy" in proc.stderr or "device='cuda' but no CUDA device" in proc.stderr, proc.stderr[
        -2000:
    ]
    assert not orphan_segments(before, patience_s=0)


def test_a_checkout_runs_without_an_install(tmp_path):
    """With the checkout on PYTHONPATH and no install (python -S: no site, so no
    editable finder; the dependencies from site-packages as a plain path), the commref
    command runs: commref/__init__.py finds the layer folders beside it (what
    tests/gpu/gpu_check.sh relies on)."""
    import numpy

    site_packages = os.path.dirname(os.path.dirname(numpy.__file__))
    env = clean_env(PYTHONPATH=os.pathsep.join([REPO, site_packages]))
    proc = subprocess.run(
        [
            sys.executable,
            "-S",
            "-m",
            "commref",
            "check",
            *SMALL_CHECK,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = check_summary(proc.stdout)
    assert summary and summary.cases > 0 and summary.wrong == 0, proc.stdout[-2000:]


def test_check_summary_counts_what_the_table_shows():
    """The line under check's table counts its rows and the cases they hold, and names
    the wrong elements, the cases and the rows they are in (a case per wrong cell here)."""
    from commref import cli
    from commref.collectives import check

    case_list = check.cases(["allreduce", "alltoall"], ["float32"], ["avg"], [], [7], 2, 1)
    rows = check.summary_rows(case_list, [0] * len(case_list))
    clean = cli.check_summary(rows, case_list, [0] * len(case_list), ["allreduce", "alltoall"], [7], 0.04)
    parsed = check_summary(clean)
    assert parsed == (len(rows), len(case_list), 0, 0, parsed.what), clean
    assert (
        clean.startswith(
            f"# {len(rows)} rows, {len(case_list)} cases (counts [7], in-place and out-of-place, "
            "alltoall out-of-place only; "
        )
        and f"no wrong elements in {len(case_list)} cases" in clean
    )
    assert len(rows) < len(case_list)  # a row holds several cases: both are counted
    wrong = [0] * len(case_list)
    wrong[0], wrong[-1] = 3, 1
    bad_rows = check.summary_rows(case_list, wrong)
    text = cli.check_summary(bad_rows, case_list, wrong, ["allreduce", "alltoall"], [7], 0.04)
    assert f": 4 wrong elements in 2 of {len(case_list)} cases, 2 of {len(rows)} rows, 0.0 s" in text, text
    assert check_summary(text)[1:4] == (len(case_list), 4, 2)


@pytest.mark.parametrize("program", programs.NAMES)
def test_every_bench_program_has_its_help(program, capsys):
    """`commref bench NAME --help` prints NAME's own flags (and --np) and exits 0."""
    assert cli.main(["bench", program, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: commref bench {program} "), out[:200]
    assert "--np" in out and "--json" in out, out
    assert programs.get(program).summary.split()[0] in out


def test_bench_names_its_programs_beside_the_collectives(capsys):
    assert cli.main(["bench", "-h"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in programs.NAMES), out
    assert cli.main(["bench", "scan"]) == 2
    assert "or a bench program: ep, gin_rate, soak, engine" in capsys.readouterr().err


def test_bench_prints_a_line_per_file_it_wrote(tmp_path, capsys):
    json_path = tmp_path / "r.json"
    assert (
        cli.main(
            [
                "bench",
                "all_reduce",
                "-b",
                "8",
                "-e",
                "8",
                "-n",
                "1",
                "-w",
                "0",
                "--no-baseline",
                "--no-bound",
                "--json",
                str(json_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"# wrote {json_path} (results and environment, commref-bench/2)" in out.splitlines(), out[-500:]
    assert json_path.exists()


@pytest.mark.mpi
def test_bench_ep_runs_under_np(shm_leak_check):
    """`commref bench ep --np 4`: MoE dispatch and combine on 4 MPI ranks beside the
    mpi4py baseline, every row exact."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    proc = run_cmd(
        [
            sys.executable,
            "-m",
            "commref",
            "bench",
            "ep",
            "--np",
            "4",
            "--tokens",
            "8",
            "--hidden",
            "64",
            "-n",
            "2",
            "-w",
            "1",
        ],
        timeout=120,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 ranks (MPI processes)" in proc.stdout, proc.stdout
    row = [line for line in proc.stdout.splitlines() if line.split()[:2] == ["8", "64"]]
    assert len(row) == 1 and row[0].split()[-1] == "0", proc.stdout  # the wrong column


@pytest.mark.mpi
def test_nodes_alone_takes_path_auto(shm_leak_check):
    """`commref check --np 3 --nodes 2`, no --path: LSA inside a node, GIN between the
    two, every case exact."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    proc = run_cmd(
        [
            sys.executable,
            "-m",
            "commref",
            "check",
            "--np",
            "3",
            "--nodes",
            "2",
            "--dtype",
            "float32",
            "int8",
            "--count",
            "0",
            "7",
            "1001",
        ],
        timeout=180,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = check_summary(proc.stdout)
    assert summary and summary.cases > 0 and (summary.wrong, summary.bad_cases) == (0, 0), proc.stdout[-2000:]
    assert "# 2 nodes: " in proc.stdout and "ranks [0, 1]" in proc.stdout and "GIN peers of rank 0: [2]" in proc.stdout
