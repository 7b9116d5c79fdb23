"""Tests of the benchmark suite (bench/): bandwidth factors, nccl-tests flags and
sweeps, the JSON document, #wrong on a planted error, the plot, and the command line
(in process, and under mpiexec)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from commref.bench import harness, plugins
from commref.bench.harness import build_parser, parse_size, run_rank, sweep_sizes
from commref.transports.world import ThreadWorld

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K, M, G = 1 << 10, 1 << 20, 1 << 30


def args_for(*argv: str):
    return build_parser().parse_args(list(argv))


# ---------------------------------------------------------------------------------------
# bandwidth definitions (nccl-tests' PERFORMANCE.md)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bus_factors_are_nccl_tests(n: int) -> None:
    assert plugins.get("all_reduce").bus_factor(n) == pytest.approx(2 * (n - 1) / n)
    assert plugins.get("all_gather").bus_factor(n) == pytest.approx((n - 1) / n)
    assert plugins.get("reduce_scatter").bus_factor(n) == pytest.approx((n - 1) / n)
    assert plugins.get("broadcast").bus_factor(n) == 1.0
    assert plugins.get("reduce").bus_factor(n) == 1.0
    assert plugins.get("alltoall").bus_factor(n) == pytest.approx((n - 1) / n)


def test_algbw_bytes_and_counts_follow_nccl_tests() -> None:
    t = 4  # float32
    # all_reduce, broadcast, reduce: count = size / t, algbw bytes = count * t.
    for name in ("all_reduce", "broadcast", "reduce"):
        p = plugins.get(name)
        c = p.counts(10, t, 4)
        assert (c.send, c.recv, c.param) == (2, 2, 2)
        assert p.algbw_bytes(c, t, 4) == 8 and c.size_bytes(t) == 8
    # all_gather: per-rank count = size / t / n; size column and algbw bytes = total.
    ag = plugins.get("all_gather").counts(100, t, 3)
    assert (ag.send, ag.recv, ag.param) == (8, 24, 8)
    assert ag.size_bytes(t) == 96 and plugins.get("all_gather").algbw_bytes(ag, t, 3) == 96
    rs = plugins.get("reduce_scatter").counts(100, t, 3)
    assert (rs.send, rs.recv, rs.param) == (24, 8, 8)
    assert rs.size_bytes(t) == 96 and plugins.get("reduce_scatter").algbw_bytes(rs, t, 3) == 96
    # alltoall: both buffers hold n blocks of count = size / t / n (per peer).
    aa = plugins.get("alltoall").counts(100, t, 3)
    assert (aa.send, aa.recv, aa.param) == (24, 24, 8)
    assert aa.size_bytes(t) == 96 and plugins.get("alltoall").algbw_bytes(aa, t, 3) == 96
    # Sizes below typesize * nranks round to zero elements, as in nccl-tests.
    assert plugins.get("all_gather").counts(8, t, 4).size_bytes(t) == 0


def test_collective_names_in_both_spellings() -> None:
    for a, b in [("allreduce", "all_reduce"), ("allgather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
                 ("broadcast", "broadcast"), ("reduce", "reduce"), ("All-Reduce", "all_reduce"),
                 ("alltoall", "alltoall"), ("all_to_all", "alltoall")]:
        assert plugins.get(a).name == b
    with pytest.raises(ValueError, match="unknown collective"):
        plugins.get("gather")


# ---------------------------------------------------------------------------------------
# flags and sweeps
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,value", [("8", 8), ("1K", K), ("1k", K), ("64M", 64 * M), ("1G", G), ("3g", 3 * G),
                                        ("64MB", 64 * M), ("2KiB", 2 * K), ("0", 0)])
def test_parse_size_suffixes(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "M", "1.5M", "-8", "1X", "ten"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(Exception, match="invalid size"):
        parse_size(text)


def test_sweep_like_nccl_tests() -> None:
    sizes = sweep_sizes(8, 64 * M, 2)
    assert sizes[0] == 8 and sizes[-1] == 64 * M and len(sizes) == 24
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert sweep_sizes(8, 64 * M, 4)[-1] == 32 * M  # the next step (128M) passes -e
    assert sweep_sizes(100, 400, 1, 100) == [100, 200, 300, 400]
    assert sweep_sizes(16 * M, 16 * M) == [16 * M]
    with pytest.raises(ValueError):
        sweep_sizes(64, 8)
    with pytest.raises(ValueError):
        sweep_sizes(8, 64, 1, 0)


def test_nccl_tests_flags() -> None:
    a = args_for("allreduce", "-b", "8", "-e", "64M", "-f", "2", "-n", "7", "-w", "3", "-c", "0", "-o", "max",
                 "-d", "half", "-r", "1", "-z", "1", "-t", "2")
    assert a.collective == "all_reduce"
    assert (a.minbytes, a.maxbytes, a.stepfactor, a.iters, a.warmup_iters) == (8, 64 * M, 2, 7, 3)
    assert (a.check, a.op, a.datatype, a.root, a.blocking, a.nthreads) == (0, "max", "float16", 1, 1, 2)
    d = args_for("all_gather")
    assert (d.minbytes, d.maxbytes, d.iters, d.warmup_iters, d.check, d.op, d.datatype) == \
        (32 * M, 32 * M, 20, 5, 1, "sum", "float32")
    assert d.path == ["lsa"] and d.baseline and d.bound
    assert args_for("reduce", "--path", "lsa,gin", "--backend", "proxy,gda").path == ["lsa", "gin"]
    for dt, name in [("float", "float32"), ("bf16", "bfloat16"), ("int32", "int32"), ("double", "float64")]:
        assert args_for("all_reduce", "-d", dt).datatype == name
    with pytest.raises(SystemExit):
        args_for("all_reduce", "-d", "complex64")
    with pytest.raises(SystemExit):
        args_for("all_reduce", "--path", "nvls")


def test_series_cross_gin_options() -> None:
    a = args_for("all_reduce", "--path", "lsa,gin", "--backend", "proxy,gda", "--wire", "unordered",
                 "--network", "shm")
    assert [s.label for s in harness.series_of(a)] == ["lsa", "gin/proxy/unordered/shm", "gin/gda/unordered/shm"]
    assert harness.series_of(args_for("all_reduce", "--path", "gin"))[0].gin_options() == {}
    with pytest.raises(harness.NotAvailable, match="--path gin"):
        harness.series_of(args_for("all_reduce", "--backend", "proxy"))


def test_all_gather_bound_counts_the_own_shard_out_of_place() -> None:
    """Out of place every rank lands all n shards (its own from sendbuf); in place the
    other n - 1 only. The other collectives move the same bytes either way."""
    ag = plugins.get("all_gather")
    assert ag.bound_bytes(1200, 3) == (1200, 0) and ag.bound_bytes(1200, 3, in_place=True) == (800, 0)
    for name in ("all_reduce", "reduce_scatter", "broadcast", "reduce"):
        p = plugins.get(name)
        assert p.bound_bytes(1200, 3) == p.bound_bytes(1200, 3, in_place=True)


def test_registration_flag() -> None:
    """-R as nccl-tests spells it: 0 plain buffers, 2 symmetric; comma lists measure
    both side by side; 1 (local registration) has no commref counterpart."""
    assert args_for("all_reduce").local_register == [0]
    a = args_for("all_reduce", "-R", "0,2", "--path", "lsa,gin")
    assert [s.label for s in harness.series_of(a)] == ["lsa", "gin", "lsa/sym", "gin/sym"]
    for bad in ("1", "3", "0,x"):
        with pytest.raises(SystemExit):
            args_for("all_reduce", "-R", bad)


@pytest.mark.parametrize("coll", ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "alltoall"])
def test_symmetric_series_checks_clean_and_runs_direct_kernels(coll: str) -> None:
    """-R 2 allocates every rank's buffers from one symmetric window at equal offsets,
    so allreduce, allgather, reduce_scatter and alltoall run the direct kernels (a
    planted error still counts: the check reads the symmetric buffers themselves).
    alltoall has no in-place form: its in-place column is empty."""
    kernels: list[str] = []

    def corrupt(label, in_place, rank, out):
        if label == "lsa/sym" and rank == 1 and not in_place:
            out.view(np.uint8)[-1] ^= 0xFF

    a = args_for(coll, "-b", "4K", "-e", "64K", "-f", "16", "-n", "2", "-w", "1", "--no-baseline", "--no-bound",
                 "-R", "0,2")
    from commref.collectives.communicator import Communicator

    launch = Communicator._collective

    def spy(self, *args, **kwargs):
        launch(self, *args, **kwargs)
        kernels.extend(plan.kernel for plan in self._calls.values())

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Communicator, "_collective", spy)
        docs = ThreadWorld.run(3, run_rank, a, corrupt=corrupt, out=lambda s: None)
    rows = docs[0]["rows"]
    assert [r["series"] for r in rows] == ["lsa", "lsa/sym"] * 2
    for r in rows:
        if coll == "alltoall":
            assert r["in_place"] is None and r["in_place_pct_of_bound"] is None
            assert "     -       -       -     N/A" in harness.format_row(r)
        else:
            assert r["in_place"]["wrong"] == 0
        assert r["out_of_place"]["wrong"] == (1 if r["series"] == "lsa/sym" else 0)
    direct = {k for k in kernels if "direct" in k}
    assert bool(direct) == (coll != "broadcast"), direct


def test_paths_the_communicator_lacks_say_not_available_yet(monkeypatch, capsys) -> None:
    """Paths are offered as soon as Communicator takes them; until then the flags fail
    with a clear message before any rank starts."""
    from commref.collectives import communicator

    class LsaOnly:
        def __init__(self, world, device="auto", *, algorithm="auto", max_channels=None, slot_bytes=None,
                     threads=None, device_id=None):
            raise AssertionError("not constructed")

    monkeypatch.setattr(communicator, "Communicator", LsaOnly)
    for extra in (["--path", "gin"], ["--path", "auto"], ["--path", "gin", "--backend", "rc", "--wire", "ordered"]):
        assert harness.main(["all_reduce", "-b", "8", "-e", "8", *extra]) == 2
        err = capsys.readouterr().err
        assert "not available yet" in err and "--path lsa" in err


def test_lsa_and_gin_side_by_side() -> None:
    a = args_for("all_reduce", "-b", "64", "-e", "64", "-n", "2", "-w", "1", "--no-baseline", "--no-bound",
                 "--path", "lsa,gin", "--backend", "proxy,rc", "--wire", "unordered")
    try:
        harness.validate(a)
    except harness.NotAvailable:
        pytest.skip("this Communicator has no GIN path yet")
    docs = ThreadWorld.run(2, run_rank, a, out=lambda s: None)
    doc = docs[0]
    assert [r["series"] for r in doc["rows"]] == ["lsa", "gin/proxy/unordered"]
    assert all(r["out_of_place"]["wrong"] == 0 and r["in_place"]["wrong"] == 0 for r in doc["rows"])
    # rc has no unordered wire: skipped with the reason, the others still run.
    assert [s["label"] for s in doc["skipped"]] == ["gin/rc/unordered"] and "unordered" in doc["skipped"][0]["reason"]


# ---------------------------------------------------------------------------------------
# runs (ThreadWorld in process: fast)
# ---------------------------------------------------------------------------------------

SMALL = ("-b", "8", "-e", "8K", "-f", "32", "-n", "3", "-w", "1")


def test_json_document_schema(tmp_path) -> None:
    a = args_for("all_reduce", *SMALL, "-t", "2", "--json", str(tmp_path / "r.json"))
    lines: list[str] = []
    docs = ThreadWorld.run(2, run_rank, a, out=lines.append)
    harness.write_outputs(docs[0], a)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["schema"] == harness.SCHEMA and doc["collective"] == "all_reduce"
    assert doc["series"] == [{"path": "lsa", "backend": None, "wire": None, "network": None, "gin_protocol": None, "wire_rate": None,
                              "wire_latency": None, "fault": None, "register": 0, "stores": None, "algorithm": "auto", "protocol": "auto", "team": "job", "label": "lsa",
                              "link": "threads"}] and doc["skipped"] == []
    assert doc["params"]["minbytes"] == 8 and doc["params"]["iters"] == 3
    assert doc["bus_factor"] == pytest.approx(1.0)
    env = doc["environment"]
    for key, typ in [("commref", str), ("numpy", str), ("mpi4py", str), ("python", str), ("host", str),
                     ("cpu_model", str), ("device", str), ("nranks", int), ("world", str), ("link", str),
                     ("ranks", list)]:
        assert isinstance(env[key], typ), key
    assert env["nranks"] == 2 and env["device"] == "cpu" and env["link"] == "threads"
    assert "mpi_library" in env
    # Rank threads have no MPI baseline: the document says why.
    assert doc["baseline"] is None and "MPI ranks" in env["baseline_unavailable"]
    assert [r["size"] for r in doc["rows"]] == [8, 256, 8192]
    for r in doc["rows"]:
        assert set(r) >= {"series", "path", "size", "count", "type", "redop", "root", "out_of_place", "in_place",
                          "baseline", "ratio", "bound", "pct_of_bound", "in_place_pct_of_bound"}
        assert (r["type"], r["redop"], r["root"], r["series"], r["path"]) == ("float", "sum", -1, "lsa",
                                                                             "lsa:threads")
        for k in ("out_of_place", "in_place"):
            v = r[k]
            assert set(v) == {"time_us", "algbw", "busbw", "wrong"}
            assert v["time_us"] > 0 and v["wrong"] == 0
            assert v["busbw"] == pytest.approx(v["algbw"] * 1.0)
            assert v["algbw"] == pytest.approx(r["size"] / (v["time_us"] * 1e-6) / 1e9)
        assert r["bound"]["busbw"] > 0 and r["bound"]["copy_bytes"] == r["size"] // 2
        assert r["pct_of_bound"] == pytest.approx(100 * r["out_of_place"]["busbw"] / r["bound"]["busbw"])
        assert r["bound"]["in_place_busbw"] == pytest.approx(r["bound"]["busbw"])  # allreduce: the same bytes
        assert r["in_place_pct_of_bound"] == pytest.approx(100 * r["in_place"]["busbw"] / r["bound"]["in_place_busbw"])
    assert doc["summary"]["lsa"]["out_of_bounds"] == 0
    # The printed table: nccl-tests' header, one row per size, its footer.
    assert any("out-of-place" in s and "in-place" in s for s in lines)
    assert sum(1 for s in lines if not s.startswith("#")) == 3
    assert "# Out of bounds values : 0 OK" in lines and any(s.startswith("# Avg bus bandwidth") for s in lines)


def test_single_rank_with_mpi_baseline() -> None:
    a = args_for("reduce_scatter", "-b", "64", "-e", "64", "-n", "2", "-w", "1")
    doc = run_rank(ThreadWorld.single(), a, out=lambda s: None)
    assert doc["baseline"]["label"].startswith("MPI")
    row = doc["rows"][0]
    assert row["baseline"]["time_us"] > 0 and row["out_of_place"]["wrong"] == 0


@pytest.mark.parametrize("coll", ["all_gather", "reduce_scatter", "broadcast", "reduce"])
def test_each_collective_checks_clean(coll: str) -> None:
    a = args_for(coll, "-b", "96", "-e", "96", "-n", "2", "-w", "0", "-r", "1", "--no-baseline", "--no-bound")
    docs = ThreadWorld.run(3, run_rank, a, out=lambda s: None)
    (row,) = docs[0]["rows"]
    assert row["out_of_place"]["wrong"] == 0 and row["in_place"]["wrong"] == 0
    assert row["root"] == (1 if coll in ("broadcast", "reduce") else -1)
    assert row["bound"] is None and row["baseline"] is None


def test_wrong_counts_a_planted_error() -> None:
    """A hook flips one element of rank 0's out-of-place output and one of rank 1's
    in-place output after the last timed call: #wrong is 1 in each column."""
    def corrupt(label, in_place, rank, out):
        if rank == (1 if in_place else 0):
            out.view(np.uint8)[0] ^= 0xFF

    a = args_for("all_reduce", "-b", "64", "-e", "64", "-n", "2", "-w", "1", "--no-baseline", "--no-bound")
    docs = ThreadWorld.run(2, run_rank, a, corrupt=corrupt, out=lambda s: None)
    (row,) = docs[0]["rows"]
    assert row["out_of_place"]["wrong"] == 1 and row["in_place"]["wrong"] == 1
    assert docs[0]["summary"]["lsa"]["out_of_bounds"] == 2
    assert harness.exit_code(docs[0]) == 1
    assert "FAILED" in harness.footer(docs[0]["rows"])[0]


def test_no_check_reports_na() -> None:
    a = args_for("all_gather", "-b", "64", "-e", "64", "-n", "1", "-w", "0", "-c", "0", "--no-baseline")
    lines: list[str] = []
    doc = run_rank(ThreadWorld.single(), a, out=lines.append)
    assert doc["rows"][0]["out_of_place"]["wrong"] is None
    assert "N/A" in next(s for s in lines if not s.startswith("#"))
    assert harness.exit_code(doc) == 0


def test_plot_renders(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="plots need the bench extra (pip install 'commref[bench]')")
    a = args_for("all_gather", "-b", "8", "-e", "64K", "-f", "4", "-n", "2", "-w", "0", "-t", "2",
                 "--plot", str(tmp_path / "p.png"))
    docs = ThreadWorld.run(2, run_rank, a, out=lambda s: None)
    harness.write_outputs(docs[0], a)
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    from commref.bench import plot

    (tmp_path / "p.json").write_text(json.dumps(docs[0], default=harness._jsonable))
    assert plot.main([str(tmp_path / "p.json"), str(tmp_path / "p.json"), "-o", str(tmp_path / "q.png")]) == 0
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"


def test_progress_mode_follows_the_launcher(monkeypatch) -> None:
    monkeypatch.setenv(harness.PROGRESS_ENV, "bar")
    assert harness.progress_mode() == "bar"
    monkeypatch.setenv(harness.PROGRESS_ENV, "")
    assert harness.progress_mode() is None
    monkeypatch.delenv(harness.PROGRESS_ENV)
    assert harness.progress_mode() is None  # pytest's stderr is not a terminal


def test_cli_dispatches_bench(capsys) -> None:
    from commref import cli

    assert cli.main(["bench", "broadcast", "-b", "1K", "-e", "1K", "-n", "2", "-w", "0", "--no-baseline"]) == 0
    out = capsys.readouterr().out
    assert "# Out of bounds values : 0 OK" in out and "lsa:threads" in out
    assert "bench" in cli.build_parser().format_help()


def test_check_takes_nccl4py_or_nccl_tests_names(capsys) -> None:
    from commref import cli

    args = cli.build_parser().parse_args(["check", "all_gather", "Reduce_Scatter", "allreduce"])
    assert args.collectives == ["allgather", "reduce_scatter", "allreduce"]
    assert cli.build_parser().parse_args(["check"]).collectives == []
    assert cli.build_parser().parse_args(["check", "all_to_all"]).collectives == ["alltoall"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["check", "gather"])
    assert "unknown collective 'gather'; choose from allreduce, allgather" in capsys.readouterr().err
    # A collective named twice is checked once.
    assert cli.main(["check", "broadcast", "broadcast", "--dtype", "int8", "--count", "5"]) == 0
    assert "# 2 cases, counts [5]" in capsys.readouterr().out


@pytest.mark.mpi
def test_bench_under_mpiexec(tmp_path) -> None:
    exe = shutil.which("commref", path=os.path.dirname(sys.executable))
    if exe is None or shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep +
                                   os.environ.get("PATH", "")) is None:
        pytest.skip("needs the commref script and mpiexec")
    out = tmp_path / "r.json"
    proc = subprocess.run([exe, "bench", "all_reduce", "-b", "8", "-e", "64K", "-f", "64", "-n", "3", "-w", "1",
                           "--np", "2", "--json", str(out)], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != harness.PROGRESS_ENV})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["environment"]["nranks"] == 2 and doc["environment"]["link"] == "shm"
    assert doc["baseline"]["label"].startswith("MPI")
    assert [r["size"] for r in doc["rows"]] == [8, 512, 32768]
    assert all(r["ratio"] is not None and r["out_of_place"]["wrong"] == 0 for r in doc["rows"])
    assert "# Out of bounds values : 0 OK" in proc.stdout


def test_gin_rate_reports_rates_and_latencies():
    """bench/gin_rate.py in ThreadWorld (small sizes): correct results, the engine named,
    and the latency figures consistent with the rates they come from."""
    from commref.bench import gin_rate

    args = argparse.Namespace(small_iters=40, bytes=64 << 10, iters=2, warmup=1, latency_blocks=2, latency_iters=20,
                              pipe_bytes=64 << 10, pipe_slot_bytes=1024, pipe_steps=16, pipe_iters=2)
    out = ThreadWorld.run(2, gin_rate.measure, args, timeout=60)[0]
    for wire, r in {**out["rate"], "pipelined": out["pipelined"]}.items():
        assert r["correct"] and r["engine"] in ("native", "python"), (wire, r)
        assert r["us_per_collective"] == pytest.approx(1e6 / r["collectives_per_s"])
        for ops_per_s, us in zip(r["ops_per_s_per_proxy"], r["us_per_op_per_proxy"]):
            assert us == pytest.approx(1e6 / ops_per_s)
    for r in (out["rate"]["ordered"], out["pipelined"]):  # the native engine counts doorbells: none rung here
        assert all(0 < g == o for g, o in zip(r["gin_ops_per_s_per_proxy"], r["ops_per_s_per_proxy"])), r
    lat = out["latency"]
    assert lat["gin_over_lsa"] == pytest.approx(lat["gin_us"] / lat["lsa_us"]) and lat["lsa_us"] > 0
    assert out["busbw"]["correct"] and set(out["busbw"]) >= {"lsa", "gin"} and "mpi" not in out["busbw"]
    text = gin_rate.report(out)
    assert "us per collective" in text and "us per descriptor per proxy" in text and "gin/lsa" in text
