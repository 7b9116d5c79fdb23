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


# ---------------------------------------------------------------------------------------
# the bound (bench/bound.py): least traffic per collective, and the stream it is divided by
# ---------------------------------------------------------------------------------------


def least_traffic(coll: str, n: int, c: int, in_place: bool, root: int = 0) -> tuple[int, int, int]:
    """(loads, stores, distinct locations) of the whole job, counted element by element
    from what each output element is (independently of catalogue.Traffic): an output
    element needs a store unless, in place, it already lies where its value is (its
    only dependency is the input element at its own location); every input element
    that a stored output depends on is loaded once. Inputs are ("in", rank, i), outputs
    ("out", rank, i); in place an output's location is the input it overlays (NCCL's
    layouts, catalogue.in_place_layout). Each rank sends `c` elements per block."""
    outs: dict[tuple, tuple[tuple, set]] = {}  # output -> (its location, the inputs it depends on)
    for r in range(n):
        if coll == "all_reduce":
            for i in range(c):
                outs[("out", r, i)] = (("in", r, i) if in_place else ("out", r, i), {("in", k, i) for k in range(n)})
        elif coll == "reduce_scatter":
            for i in range(c):
                loc = ("in", r, r * c + i) if in_place else ("out", r, i)
                outs[("out", r, i)] = (loc, {("in", k, r * c + i) for k in range(n)})
        elif coll == "all_gather":
            for j in range(n):
                for i in range(c):
                    loc = ("in", r, i) if in_place and j == r else ("out", r, j * c + i)
                    outs[("out", r, j * c + i)] = (loc, {("in", j, i)})
        elif coll == "broadcast":
            for i in range(c):
                outs[("out", r, i)] = (("in", r, i) if in_place else ("out", r, i), {("in", root, i)})
        elif coll == "reduce":
            if r == root:
                for i in range(c):
                    outs[("out", r, i)] = (("in", r, i) if in_place else ("out", r, i), {("in", k, i) for k in range(n)})
        elif coll == "alltoall":
            for j in range(n):
                for i in range(c):
                    outs[("out", r, j * c + i)] = (("out", r, j * c + i), {("in", j, r * c + i)})
    stored = {o: v for o, v in outs.items() if v[1] != {v[0]}}
    loaded = set().union(*(deps for _, deps in stored.values()))
    return len(loaded), len(stored), len(loaded | {loc for loc, _ in stored.values()})


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("coll", ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "alltoall"])
def test_bound_traffic_is_the_least_any_algorithm_moves(coll: str, n: int) -> None:
    """catalogue.Traffic, times the ranks, is the job's least loads and stores and the
    memory they touch, as an element-by-element count derives them, in and out of place
    (size S = the size column: n blocks of c one-byte elements, or c for the collectives
    whose buffers are not scaled)."""
    p = plugins.get(coll)
    c = 6
    size = c * n if p.spec.scaled else c
    for in_place in p.placements:
        t = p.traffic(n, in_place)
        loads, stores, touched = least_traffic(coll, n, c, in_place)
        assert n * t.loads(size) == pytest.approx(loads), (in_place, t)
        assert n * t.stores(size) == pytest.approx(stores), (in_place, t)
        assert n * t.footprint(size) == pytest.approx(touched), (in_place, t)


def test_bound_traffic_formulas() -> None:
    """The per-rank least bytes docs/performance.md and bench/bound.py state: S = the
    size column, n ranks; (loads, stores) out of place and in place."""
    S = 1200
    expect = {  # n = 3: (loads, stores) out of place, in place
        "all_reduce": ((S, S), (S, S)),
        "reduce_scatter": ((S, S / 3), (S, S / 3)),
        "all_gather": ((S / 3, S), (S / 3, 2 * S / 3)),
        "broadcast": ((S / 3, S), (S / 3, 2 * S / 3)),
        "reduce": ((S, S / 3), (S, S / 3)),
        "alltoall": ((S, S), None),
    }
    for coll, (oop, ip) in expect.items():
        p = plugins.get(coll)
        t = p.traffic(3)
        assert (t.loads(S), t.stores(S)) == pytest.approx(oop), coll
        if ip is not None:
            t = p.traffic(3, in_place=True)
            assert (t.loads(S), t.stores(S)) == pytest.approx(ip), coll
    # The acceptance case, 2 ranks and 16 MiB: bytes per rank, loads + stores.
    per_rank = {(c, ip): plugins.get(c).traffic(2, ip) for c in ("all_reduce", "reduce_scatter", "all_gather")
                for ip in (False, True)}
    assert {k: t.loads(16 * M) + t.stores(16 * M) for k, t in per_rank.items()} == {
        ("all_reduce", False): 32 * M, ("all_reduce", True): 32 * M, ("reduce_scatter", False): 24 * M,
        ("reduce_scatter", True): 24 * M, ("all_gather", False): 24 * M, ("all_gather", True): 16 * M}
    # One rank in place: the result is the input, nothing moves, no bound.
    for coll in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
        t = plugins.get(coll).traffic(1, in_place=True)
        assert not t.moves and t.loads(S) == t.stores(S) == t.footprint(S) == 0


def test_stream_kernels_cover_copy_add_and_the_pattern() -> None:
    """The rate is the fastest of STREAM's copy and add and the collective's own
    pattern, each with cached and non-temporal stores; a pattern that is copy or add
    is measured once. Arrays are whole 64-byte lines at the call's footprint."""
    from commref.bench import bound

    t = plugins.get("all_reduce").traffic(2, in_place=True)
    ks = bound.stream_kernels(t)
    assert [k.label for k in ks] == ["copy/cached", "copy/streamed", "add/cached", "add/streamed",
                                     "pattern/cached", "pattern/streamed"]
    assert (ks[-1].nin, ks[-1].nout, ks[-1].shared) == (2, 2, 2)
    assert [k.label for k in bound.stream_kernels(plugins.get("alltoall").traffic(4), streamed=False)] == [
        "copy/cached", "add/cached"]
    footprint = t.footprint(16 * M)
    assert footprint == 16 * M
    for k in ks:
        words = k.words(footprint)
        assert words % 16 == 0 and footprint - 64 * k.arrays < k.arrays * words * 4 <= footprint
        assert k.bytes_moved(words) == (k.nin + k.nout) * words * 4


def test_bound_is_the_least_bytes_at_the_fastest_aggregate_rate() -> None:
    """From every rank's stream passes: a kernel's aggregate rate in a round is the
    bytes of all ranks over the median of the slowest rank's pass times, its rate the
    faster of its rounds; the bound time is the job's least bytes over the fastest
    kernel's rate, and busbw the bus bytes over that."""
    from commref.bench import bound

    per_rank = [  # two ranks, two kernels, three passes each
        {"copy/cached": {"bytes": 100, "times": [1.0, 2.0, 4.0]}, "add/cached": {"bytes": 300, "times": [1.0, 1.0, 1.0]}},
        {"copy/cached": {"bytes": 100, "times": [3.0, 1.0, 1.0]}, "add/cached": {"bytes": 300, "times": [2.0, 3.0, 2.0]}},
    ]
    rates = bound.aggregate_rates(per_rank)
    assert rates == pytest.approx({"copy/cached": 200 / 3.0, "add/cached": 600 / 2.0})  # slowest: [3, 2, 4], [2, 3, 2]
    slower = [{k: {"bytes": v["bytes"], "times": [2 * x for x in v["times"]]} for k, v in r.items()} for r in per_rank]
    t = plugins.get("all_reduce").traffic(2)
    for rounds in ([per_rank], [slower, per_rank], [per_rank, slower]):
        b = bound.bound(t, 1000, 2, bus_bytes=1000.0, rounds=rounds)
        assert b["kernel"] == "add/cached"
        assert b["load_bytes"] == b["store_bytes"] == 1000 and b["footprint_bytes"] == 2000
        assert b["time_us"] == pytest.approx(2 * 2000 / 300.0 * 1e6)
        assert b["busbw"] == pytest.approx(1000.0 / (2 * 2000 / 300.0) / 1e9)
        assert b["GBps"] == pytest.approx(300.0 / 2 / 1e9)
        assert b["kernels_GBps"] == pytest.approx({"copy/cached": 100 / 3.0 / 1e9, "add/cached": 150.0 / 1e9})
    assert b["rounds_GBps"] == pytest.approx([150.0 / 1e9, 75.0 / 1e9])
    assert bound.bound(plugins.get("all_gather").traffic(1, True), 1000, 1, 0.0, [[{}]]) is None


def test_stream_passes_run_on_every_rank_at_once() -> None:
    """The rate is measured with every rank streaming at once: each timed pass starts
    after a barrier, and pass i of every rank is in flight together (a pass that waits,
    inside itself, for every rank to be in its own pass i would time out otherwise).
    The arrays are the call's footprint."""
    import threading

    from commref.bench import bound

    n, iters = 3, 4
    lock, cond = threading.Lock(), threading.Condition(threading.Lock())
    entered: dict[tuple, int] = {}
    log: list[tuple] = []
    seen_words: list[tuple] = []

    class Spy(bound.StreamMeter):
        def pass_fn(self, kernel, words):
            run = super().pass_fn(kernel, words)
            seen_words.append((kernel.arrays, words))
            count = {"i": 0}
            rank = self.world.rank

            def together():
                key = (kernel.label, count["i"])
                count["i"] += 1
                with cond:
                    entered[key] = entered.get(key, 0) + 1
                    cond.notify_all()
                    ok = cond.wait_for(lambda: entered[key] >= n, timeout=10)
                with lock:
                    log.append((rank, key, ok))
                run()
            return together

    class Barriers:
        """The world, with its barriers logged."""
        def __init__(self, world):
            self.w = world

        def __getattr__(self, name):
            return getattr(self.w, name)

        def barrier(self, what="barrier", timeout=None):
            with lock:
                log.append((self.w.rank, "barrier", what))
            self.w.barrier(what=what, timeout=timeout)

    def rank_main(world):
        t = plugins.get("all_gather").traffic(n)
        return Spy(Barriers(world), blocks=1).measure(t, 96 * K, iters, warmup=0)

    results = ThreadWorld.run(n, rank_main)
    labels = [k.label for k in bound.stream_kernels(plugins.get("all_gather").traffic(n))]
    for r in results:
        assert list(r) == labels and all(len(v["times"]) == iters for v in r.values())
    passes = [e for e in log if e[1] != "barrier"]
    assert len(passes) == n * len(labels) * iters and all(ok for *_, ok in passes), "a pass ran without the others"
    for rank in range(n):  # every timed pass of every rank right after a barrier
        mine = [e for e in log if e[0] == rank]
        for k, e in enumerate(mine):
            if e[1] != "barrier":
                assert k > 0 and mine[k - 1][1:] == ("barrier", "bench: bound stream")
    footprint = plugins.get("all_gather").traffic(n).footprint(96 * K)  # 32 KiB + 96 KiB
    assert all(footprint - 64 * a < a * w * 4 <= footprint for a, w in seen_words)


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
        b = r["bound"]
        assert b["busbw"] > 0 and b["in_place_busbw"] > 0
        # allreduce: each rank loads and stores the size; out of place over both buffers, in place over one.
        for key, footprint in (("out_of_place", 2 * r["size"]), ("in_place", r["size"])):
            d = b[key]
            assert (d["load_bytes"], d["store_bytes"], d["footprint_bytes"]) == (r["size"], r["size"], footprint)
            assert set(d["kernels_GBps"]) == {f"{k}/{s}" for k in ("copy", "add", "pattern") for s in ("cached", "streamed")}
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
    measure, run = bound.StreamMeter.measure, plugins.Collective.run

    def spy_measure(self, traffic, size, iters, warmup=1):
        if self.world.rank == 0:
            events.append(("stream", size, traffic == plugins.get("all_gather").traffic(2, in_place=True)))
        return measure(self, traffic, size, iters, warmup)

    def spy_run(self, comm, b, op, root):
        if comm.rank == 0 and (not events or events[-1][0] != "call"):
            events.append(("call",))
        return run(self, comm, b, op, root)

    a = args_for("all_gather", "-b", "8K", "-e", "16K", "-n", "2", "-w", "1", "--no-baseline")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bound.StreamMeter, "measure", spy_measure)
        mp.setattr(plugins.Collective, "run", spy_run)
        docs = ThreadWorld.run(2, run_rank, a, out=lambda s: None)
    assert events == [("stream", 8 * K, False), ("stream", 8 * K, True), ("call",), ("stream", 8 * K, False),
                      ("stream", 8 * K, True), ("stream", 16 * K, False), ("stream", 16 * K, True), ("call",),
                      ("stream", 16 * K, False), ("stream", 16 * K, True)]
    for r in docs[0]["rows"]:
        assert all(len(r["bound"][p]["rounds_GBps"]) == 2 for p in ("out_of_place", "in_place"))


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
