"""Benchmark runs (bench/): the JSON document, #wrong on a planted error, the
plot, the bound streams around each size, and the command line (in process in
ThreadWorld, and under mpiexec).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import QUICK_BENCH, bench_args

from commref.bench import harness, output, plugins
from commref.bench.harness import run_rank
from commref.transports.thread_world import ThreadWorld

K, M, G = 1 << 10, 1 << 20, 1 << 30


# ---------------------------------------------------------------------------------------
# runs (ThreadWorld in process: fast)
# ---------------------------------------------------------------------------------------

SMALL = ("-b", "8", "-e", "8K", "-f", "32", "-n", "3", "-w", "1")


def test_json_document_schema(tmp_path) -> None:
    a = bench_args("all_reduce", *SMALL, "-t", "2", "--json", str(tmp_path / "r.json"))
    lines: list[str] = []
    docs = ThreadWorld.run(2, run_rank, a, out=lines.append)
    output.write_outputs(docs[0], a)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["schema"] == output.SCHEMA and doc["collective"] == "all_reduce"
    assert (
        doc["series"]
        == [
            {
                "path": "lsa",
                "backend": None,
                "wire": None,
                "network": None,
                "gin_protocol": None,
                "wire_rate": None,
                "wire_latency": None,
                "wire_paths": None,
                "fault": None,
                "register": 0,
                "stores": None,
                "algorithm": "auto",
                "protocol": "auto",
                "team": "job",
                "label": "lsa",
                "link": "threads",
            }
        ]
        and doc["skipped"] == []
    )
    assert doc["params"]["minbytes"] == 8 and doc["params"]["iters"] == 3
    assert doc["bus_factor"] == pytest.approx(1.0)
    env = doc["environment"]
    for key, typ in [
        ("commref", str),
        ("numpy", str),
        ("mpi4py", str),
        ("python", str),
        ("host", str),
        ("cpu_model", str),
        ("device", str),
        ("nranks", int),
        ("world", str),
        ("link", str),
        ("ranks", list),
    ]:
        assert isinstance(env[key], typ), key
    assert env["nranks"] == 2 and env["device"] == "cpu" and env["link"] == "threads"
    assert "mpi_library" in env
    # Rank threads have no MPI baseline: the document says why.
    assert doc["baseline"] is None and "MPI ranks" in env["baseline_unavailable"]
    assert [r["size"] for r in doc["rows"]] == [8, 256, 8192]
    for r in doc["rows"]:
        assert set(r) >= {
            "series",
            "path",
            "size",
            "count",
            "type",
            "redop",
            "root",
            "out_of_place",
            "in_place",
            "baseline",
            "ratio",
            "bound",
            "pct_of_bound",
            "in_place_pct_of_bound",
        }
        assert (r["type"], r["redop"], r["root"], r["series"], r["path"]) == ("float", "sum", -1, "lsa", "lsa:threads")
        for k in ("out_of_place", "in_place"):
            v = r[k]
            assert set(v) == {"time_us", "algbw", "busbw", "wrong"}
            assert v["time_us"] > 0 and v["wrong"] == 0
            assert v["busbw"] == pytest.approx(v["algbw"] * 1.0)
            assert v["algbw"] == pytest.approx(r["size"] / (v["time_us"] * 1e-6) / 1e9)
        b = r["bound"]
        assert b["busbw"] > 0 and b["in_place_busbw"] > 0
        # allreduce: each rank loads and stores the size; out of place over both buffers, in place over one.
        for key, footprint in (("out_of_place", 2 * r["size"]), ("in_place", r["size"])):
            d = b[key]
            assert (d["load_bytes"], d["store_bytes"], d["footprint_bytes"]) == (r["size"], r["size"], footprint)
            assert set(d["kernels_GBps"]) == {
                f"{k}/{s}" for k in ("copy", "add", "pattern") for s in ("cached", "streamed")
            }
            assert d["GBps"] == max(d["kernels_GBps"].values()) and d["kernels_GBps"][d["kernel"]] == d["GBps"]
            assert d["time_us"] == pytest.approx(2 * r["size"] / (d["GBps"] * 1e3))  # bytes / (GB/s) in us
            assert len(d["rounds_GBps"]) == 2 and max(d["rounds_GBps"]) == pytest.approx(d["GBps"])
        assert (b["time_us"], b["in_place_time_us"]) == (b["out_of_place"]["time_us"], b["in_place"]["time_us"])
        assert r["pct_of_bound"] == pytest.approx(100 * r["out_of_place"]["busbw"] / b["busbw"])
        assert r["pct_of_bound"] == pytest.approx(100 * b["time_us"] / r["out_of_place"]["time_us"])
        assert r["in_place_pct_of_bound"] == pytest.approx(100 * r["in_place"]["busbw"] / b["in_place_busbw"])
    assert doc["summary"]["lsa"]["out_of_bounds"] == 0
    # The printed table: nccl-tests' header, one row per size, its footer.
    assert any("out-of-place" in s and "in-place" in s for s in lines)
    assert sum(1 for s in lines if not s.startswith("#")) == 3
    assert "# Out of bounds values : 0 OK" in lines and any(s.startswith("# Avg bus bandwidth") for s in lines)


def test_bound_streams_before_and_after_each_size() -> None:
    """Per size, every rank streams each placement's footprint once before the size's
    collectives and once after them, and the row's bound comes from those rounds."""
    from commref.bench import bound

    events: list[tuple] = []
    measure, bind = bound.StreamMeter.measure, plugins.Collective.bound

    def spy_measure(self, traffic, size, iters, warmup=1):
        if self.world.rank == 0:
            events.append(("stream", size, traffic == plugins.get("all_gather").traffic(2, in_place=True)))
        return measure(self, traffic, size, iters, warmup)

    def spy_bound(self, comm, b, op, root):
        call = bind(self, comm, b, op, root)

        def recorded():
            if comm.rank == 0 and (not events or events[-1][0] != "call"):
                events.append(("call",))
            call()

        return recorded

    a = bench_args("all_gather", "-b", "8K", "-e", "16K", "-n", "2", "-w", "1", "--no-baseline")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bound.StreamMeter, "measure", spy_measure)
        mp.setattr(plugins.Collective, "bound", spy_bound)
        docs = ThreadWorld.run(2, run_rank, a, out=lambda s: None)
    assert events == [
        ("stream", 8 * K, False),
        ("stream", 8 * K, True),
        ("call",),
        ("stream", 8 * K, False),
        ("stream", 8 * K, True),
        ("stream", 16 * K, False),
        ("stream", 16 * K, True),
        ("call",),
        ("stream", 16 * K, False),
        ("stream", 16 * K, True),
    ]
    for r in docs[0]["rows"]:
        assert all(len(r["bound"][p]["rounds_GBps"]) == 2 for p in ("out_of_place", "in_place"))


def test_single_rank_with_mpi_baseline() -> None:
    a = bench_args("reduce_scatter", "-b", "64", "-e", "64", "-n", "2", "-w", "1")
    doc = run_rank(ThreadWorld.single(), a, out=lambda s: None)
    assert doc["baseline"]["label"].startswith("MPI")
    row = doc["rows"][0]
    assert row["baseline"]["time_us"] > 0 and row["out_of_place"]["wrong"] == 0


@pytest.mark.parametrize("coll", ["all_gather", "reduce_scatter", "broadcast", "reduce"])
def test_each_collective_checks_clean(coll: str) -> None:
    a = bench_args(coll, "-b", "96", "-e", "96", "-n", "2", "-w", "0", "-r", "1", "--no-baseline", "--no-bound")
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

    a = bench_args("all_reduce", "-b", "64", "-e", "64", *QUICK_BENCH)
    docs = ThreadWorld.run(2, run_rank, a, corrupt=corrupt, out=lambda s: None)
    (row,) = docs[0]["rows"]
    assert row["out_of_place"]["wrong"] == 1 and row["in_place"]["wrong"] == 1
    assert docs[0]["summary"]["lsa"]["out_of_bounds"] == 2
    assert harness.exit_code(docs[0]) == 1
    assert "FAILED" in output.footer(docs[0]["rows"])[0]


def test_no_check_reports_na() -> None:
    a = bench_args("all_gather", "-b", "64", "-e", "64", "-n", "1", "-w", "0", "-c", "0", "--no-baseline")
    lines: list[str] = []
    doc = run_rank(ThreadWorld.single(), a, out=lines.append)
    assert doc["rows"][0]["out_of_place"]["wrong"] is None
    assert "N/A" in next(s for s in lines if not s.startswith("#"))
    assert harness.exit_code(doc) == 0


def _plotted_doc(tmp_path):
    """A reduce_scatter sweep on 2 rank threads, plain and symmetric buffers, from 8 B (LL)
    to 32 KiB (simple; the direct kernel on symmetric buffers), written with --plot."""
    a = bench_args(
        "reduce_scatter",
        "-b",
        "8",
        "-e",
        "32K",
        "-f",
        "16",
        "-n",
        "2",
        "-w",
        "0",
        "-t",
        "2",
        "-R",
        "0,2",
        "--plot",
        str(tmp_path / "p.png"),
    )
    docs = ThreadWorld.run(2, run_rank, a, out=lambda s: None)
    output.write_outputs(docs[0], a)
    return json.loads(json.dumps(docs[0], default=output._jsonable))


def test_plot_is_log_scaled_names_every_series_and_marks_kernel_switches(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="plots need the bench extra (pip install 'commref[bench]')")
    import matplotlib.pyplot as plt

    from commref.bench import plot

    doc = _plotted_doc(tmp_path)
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    labels = [s["label"] for s in doc["series"]]
    assert labels == ["lsa", "lsa/sym"]
    # Every row says which kernel ran; the sweep crosses at least one switch (LL at 8 B, simple at 32 KiB).
    assert all(r["kernel"] for r in doc["rows"])
    switches = sum(len(plot._segments([r for r in doc["rows"] if r["series"] == s])) - 1 for s in labels)
    assert switches >= 2
    fig = plot.figure([doc])
    try:
        bw, tm, ks = fig.axes
        assert (bw.get_xscale(), bw.get_yscale(), tm.get_yscale()) == ("log", "log", "log")
        assert bw.get_title().splitlines()[1] == "lsa, lsa/sym vs memory bound"
        assert "reduce_scatter, 2 ranks" in bw.get_title()
        legend = [t.get_text() for t in bw.get_legend().get_texts()]
        assert legend == [
            "commref lsa out-of-place",
            "commref lsa in-place",
            "commref lsa/sym out-of-place",
            "commref lsa/sym in-place",
            "memory bound out-of-place",
            "memory bound in-place",
        ]
        assert len([c for c in bw.collections if c.get_gid() == plot.SWITCH_GID]) == switches
        assert [t.get_text() for t in ks.get_yticklabels()] == ["lsa/sym", "lsa"]  # one kernel strip per series
        kernels = {r["kernel"].replace("_reduce_scatter", "") for r in doc["rows"]}
        assert {t.get_text() for t in ks.texts} == kernels
    finally:
        plt.close(fig)
    # A baseline is labelled in the legend and named in the title.
    for r in doc["rows"]:
        r["baseline"] = dict(r["out_of_place"])
    doc["baseline"] = {"label": "MPI (planted)"}
    fig = plot.figure([doc])
    try:
        bw = fig.axes[0]
        assert bw.get_title().splitlines()[1] == "lsa, lsa/sym vs MPI (planted) baseline and memory bound"
        assert "MPI (planted) (baseline, out-of-place)" in [t.get_text() for t in bw.get_legend().get_texts()]
    finally:
        plt.close(fig)
    (tmp_path / "p.json").write_text(json.dumps(doc))
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
        cli.build_parser().parse_args(["check", "alltoallw"])
    assert "unknown collective 'alltoallw'; choose from allreduce, allgather" in capsys.readouterr().err
    # A collective named twice is checked once.
    assert cli.main(["check", "broadcast", "broadcast", "--dtype", "int8", "--count", "5"]) == 0
    out = capsys.readouterr().out
    assert (
        "# 1 row, 2 cases (counts [5], in-place and out-of-place; 0 on denormal inputs): no wrong elements in 2 "
        "cases" in out
    ), out


@pytest.mark.mpi
def test_bench_under_mpiexec(tmp_path) -> None:
    exe = shutil.which("commref", path=os.path.dirname(sys.executable))
    if (
        exe is None
        or shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        is None
    ):
        pytest.skip("needs the commref script and mpiexec")
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [
            exe,
            "bench",
            "all_reduce",
            "-b",
            "8",
            "-e",
            "64K",
            "-f",
            "64",
            "-n",
            "3",
            "-w",
            "1",
            "--np",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != harness.PROGRESS_ENV},
    )
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

    args = argparse.Namespace(
        small_iters=40,
        bytes=64 << 10,
        iters=2,
        warmup=1,
        latency_blocks=2,
        latency_iters=20,
        pipe_bytes=64 << 10,
        pipe_slot_bytes=1024,
        pipe_steps=16,
        pipe_iters=2,
    )
    out = ThreadWorld.run(2, gin_rate.measure, args, timeout=60)[0]
    for wire, r in [*out["rate"].items(), *(("pipelined " + w, r) for w, r in out["pipelined"].items())]:
        assert r["correct"] and r["engine"] in ("native", "python"), (wire, r)
        assert r["us_per_collective"] == pytest.approx(1e6 / r["collectives_per_s"])
        for ops_per_s, us in zip(r["ops_per_s_per_proxy"], r["us_per_op_per_proxy"]):
            assert us == pytest.approx(1e6 / ops_per_s)
    for r in (out["rate"]["ordered"], out["pipelined"]["ordered"]):  # the ordered wire rings no doorbells
        assert all(0 < g == o for g, o in zip(r["gin_ops_per_s_per_proxy"], r["ops_per_s_per_proxy"])), r
    lat = out["latency"]
    assert lat["gin_over_lsa"] == pytest.approx(lat["gin_us"] / lat["lsa_us"]) and lat["lsa_us"] > 0
    assert out["busbw"]["correct"] and set(out["busbw"]) >= {"lsa", "gin"} and "mpi" not in out["busbw"]
    text = gin_rate.report(out)
    assert "us per collective" in text and "us per descriptor per proxy" in text and "gin/lsa" in text
