"""The benchmark suite's command line (bench/arguments, bench/series): nccl-tests'
flags and size sweeps, sizes with suffixes, the series crossed from the GIN options,
registration (-R), and the paths offered side by side.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import QUICK_BENCH, bench_args

from commref.bench import harness, output, series
from commref.bench.arguments import sweep_sizes
from commref.bench.flags import parse_size
from commref.bench.harness import run_rank
from commref.transports.thread_world import ThreadWorld

K, M, G = 1 << 10, 1 << 20, 1 << 30


# ---------------------------------------------------------------------------------------
# flags and sweeps
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,value",
    [
        ("8", 8),
        ("1K", K),
        ("1k", K),
        ("64M", 64 * M),
        ("1G", G),
        ("3g", 3 * G),
        ("64MB", 64 * M),
        ("2KiB", 2 * K),
        ("0", 0),
    ],
)
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
    a = bench_args(
        "allreduce",
        "-b",
        "8",
        "-e",
        "64M",
        "-f",
        "2",
        "-n",
        "7",
        "-w",
        "3",
        "-c",
        "0",
        "-o",
        "max",
        "-d",
        "half",
        "-r",
        "1",
        "-z",
        "1",
        "-t",
        "2",
    )
    assert a.collective == "all_reduce"
    assert (a.minbytes, a.maxbytes, a.stepfactor, a.iters, a.warmup_iters) == (8, 64 * M, 2, 7, 3)
    assert (a.check, a.op, a.datatype, a.root, a.blocking, a.nthreads) == (0, "max", "float16", 1, 1, 2)
    d = bench_args("all_gather")
    assert (d.minbytes, d.maxbytes, d.iters, d.warmup_iters, d.check, d.op, d.datatype) == (
        32 * M,
        32 * M,
        20,
        5,
        1,
        "sum",
        "float32",
    )
    assert d.path is None and d.baseline == "auto" and d.bound
    assert series.paths_of(d) == ["lsa"] and series.paths_of(bench_args("all_gather", "--nodes", "2")) == ["auto"]
    assert bench_args("reduce", "--path", "lsa,gin", "--backend", "proxy,gda").path == ["lsa", "gin"]
    for dt, name in [("float", "float32"), ("bf16", "bfloat16"), ("int32", "int32"), ("double", "float64")]:
        assert bench_args("all_reduce", "-d", dt).datatype == name
    with pytest.raises(SystemExit):
        bench_args("all_reduce", "-d", "complex64")
    with pytest.raises(SystemExit):
        bench_args("all_reduce", "--path", "nvls")


def test_series_cross_gin_options() -> None:
    a = bench_args(
        "all_reduce", "--path", "lsa,gin", "--backend", "proxy,gda", "--wire", "unordered", "--network", "shm"
    )
    assert [s.label for s in series.series_of(a)] == ["lsa", "gin/proxy/unordered/shm", "gin/gda/unordered/shm"]
    assert series.series_of(bench_args("all_reduce", "--path", "gin"))[0].gin_options() == {}
    with pytest.raises(series.NotAvailable, match="--path gin"):
        series.series_of(bench_args("all_reduce", "--backend", "proxy"))


def test_registration_flag() -> None:
    """-R as nccl-tests spells it: 0 plain buffers, 2 symmetric; comma lists measure
    both side by side; 1 (local registration) has no commref counterpart."""
    assert bench_args("all_reduce").local_register == [0]
    a = bench_args("all_reduce", "-R", "0,2", "--path", "lsa,gin")
    assert [s.label for s in series.series_of(a)] == ["lsa", "gin", "lsa/sym", "gin/sym"]
    for bad in ("1", "3", "0,x"):
        with pytest.raises(SystemExit):
            bench_args("all_reduce", "-R", bad)


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

    a = bench_args(coll, "-b", "4K", "-e", "64K", "-f", "16", *QUICK_BENCH, "-R", "0,2")
    from commref.collectives.communicator import Communicator

    launch = Communicator._collective

    def spy(self, *args, **kwargs):
        launch(self, *args, **kwargs)
        kernels.extend(plan.kernel for plan in self.planned())

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Communicator, "_collective", spy)
        docs = ThreadWorld.run(3, run_rank, a, corrupt=corrupt, out=lambda s: None)
    rows = docs[0]["rows"]
    assert [r["series"] for r in rows] == ["lsa", "lsa/sym"] * 2
    for r in rows:
        if coll == "alltoall":
            assert r["in_place"] is None and r["in_place_pct_of_bound"] is None
            assert "     -       -       -     N/A" in output.format_row(r)
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
        def __init__(
            self,
            world,
            device="auto",
            *,
            algorithm="auto",
            max_channels=None,
            slot_bytes=None,
            threads=None,
            device_id=None,
        ):
            raise AssertionError("not constructed")

    monkeypatch.setattr(communicator, "Communicator", LsaOnly)
    for extra in (["--path", "gin"], ["--path", "auto"], ["--path", "gin", "--backend", "rc", "--wire", "ordered"]):
        assert harness.main(["all_reduce", "-b", "8", "-e", "8", *extra]) == 2
        err = capsys.readouterr().err
        assert "not available yet" in err and "--path lsa" in err


def test_lsa_and_gin_side_by_side() -> None:
    a = bench_args(
        "all_reduce",
        "-b",
        "64",
        "-e",
        "64",
        *QUICK_BENCH,
        "--path",
        "lsa,gin",
        "--backend",
        "proxy,rc",
        "--wire",
        "unordered",
    )
    try:
        harness.validate(a)
    except series.NotAvailable:
        pytest.skip("this Communicator has no GIN path yet")
    docs = ThreadWorld.run(2, run_rank, a, out=lambda s: None)
    doc = docs[0]
    assert [r["series"] for r in doc["rows"]] == ["lsa", "gin/proxy/unordered"]
    assert all(r["out_of_place"]["wrong"] == 0 and r["in_place"]["wrong"] == 0 for r in doc["rows"])
    # rc has no unordered wire: skipped with the reason, the others still run.
    assert [s["label"] for s in doc["skipped"]] == ["gin/rc/unordered"] and "unordered" in doc["skipped"][0]["reason"]
