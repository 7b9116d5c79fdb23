"""nccl-tests' run-control flags of `commref bench` (bench/arguments.py, measure.py,
output.py, nccl_json.py, harness.py): -a how an iteration's time combines the ranks',
-N cycles of the sweep (0: until a signal), -I per-iteration statistics, -T the deadline
of every wait, -J nccl-tests' own JSON document beside commref's --json. Every bad value
is one line before any rank starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest
from conftest import clean_env, mpiexec, start_commref
from helpers import QUICK_BENCH, bench_args

from commref import cli
from commref.bench import arguments, harness, measure, output
from commref.bench.arguments import ROUNDS, run_cycles
from commref.bench.harness import run_rank
from commref.transports.thread_world import ThreadWorld

TINY = ("-b", "8", "-e", "256", "-f", "32", *QUICK_BENCH)  # 2 sizes, 2 iterations
HEAD = "#       size"  # the first column-head line of a table


def _bench(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main(["bench", *argv])
    got = capsys.readouterr()
    return rc, got.out, got.err


def _rows(lines: list[str]) -> list[str]:
    return [s for s in lines if s and not s.startswith("#")]


# ---------------------------------------------------------------------------------------
# parsing and refusals
# ---------------------------------------------------------------------------------------


def test_defaults_follow_nccl_tests():
    a = bench_args("all_reduce")
    assert (a.average, run_cycles(a), a.iteration_stats, a.timeout, a.nccl_json, a.json) == (1, 1, 0, 0.0, None, None)
    assert run_cycles(bench_args("all_reduce", "--baseline", "mpich")) == ROUNDS  # -N left out: the rounds


def test_each_flag_parses(tmp_path):
    a = bench_args("all_reduce", "-a", "3", "-N", "4", "-I", "1", "-T", "2.5", "-J", str(tmp_path / "n.json"))
    assert (a.average, a.run_cycles, a.iteration_stats, a.timeout) == (3, 4, 1, 2.5)
    assert a.nccl_json == str(tmp_path / "n.json") and a.json is None
    b = bench_args("all_reduce", "--average", "0", "--run_cycles", "0", "--iteration_stats", "0", "--timeout", "0")
    assert (b.average, b.run_cycles, b.iteration_stats, b.timeout) == (0, 0, 0, 0.0)
    c = bench_args("all_reduce", "--json", str(tmp_path / "c.json"), "--nccl-tests-json", str(tmp_path / "n.json"))
    assert (c.json, c.nccl_json) == (str(tmp_path / "c.json"), str(tmp_path / "n.json"))


REFUSALS = [
    (["-a", "4"], "argument -a/--average: invalid choice: 4 (choose from 0, 1, 2, 3)"),
    (["-a", "avg"], "argument -a/--average: invalid int value: 'avg'"),
    (["-N", "-1"], "argument -N/--run_cycles: must be >= 0, got -1"),
    (["-N", "two"], "argument -N/--run_cycles: must be an integer"),
    (["-I", "2"], "argument -I/--iteration_stats: invalid choice: 2 (choose from 0, 1)"),
    (["-T", "-1"], "argument -T/--timeout: must be 0 (the default deadline"),
    (["-T", "inf"], "argument -T/--timeout: must be 0 (the default deadline"),
    (["-T", "nan"], "argument -T/--timeout: must be 0 (the default deadline"),
    (["-T", "1e9"], "up to 86400, got '1e9'"),
    (["-T", "soon"], "argument -T/--timeout: expected seconds (such as 30 or 0.5), got 'soon'"),
    (["-J", "/nonexistent-folder/x.json"], "argument -J/--nccl-tests-json: the folder of '/nonexistent-folder/x.json'"),
    (["-J", "/tmp"], "argument -J/--nccl-tests-json: '/tmp' is not a file name"),
    (["--json", "/nonexistent-folder/x.json"], "argument --json: the folder of"),
    (["-N", "0", "-J", "/tmp/n.json"], "-N 0 runs until interrupted, so -J would never be written; give -N n"),
    (["-N", "0", "--json", "/tmp/c.json", "--plot", "/tmp/p.png"], "so --json and --plot would never be written"),
    (["--json", "/tmp/same.json", "-J", "/tmp/same.json"], "--json and -J name the same file, /tmp/same.json"),
    (["-b", "8", "-e", "1G", "-N", "2000"], "-N 2000 keeps 56000 rows (a row per size and series each cycle), more"),
    (
        ["-b", "8", "-e", "1G", "-n", "10000", "-I", "1", "--np", "2"],
        "-I 1 keeps every rank's time of every iteration: 28 rows x 2 placements x -n 10000 x 2 ranks = 1120000",
    ),
]


@pytest.mark.parametrize("extra, message", REFUSALS, ids=[" ".join(r[0]) for r in REFUSALS])
def test_bad_value_is_one_line_before_any_rank(extra, message, capsys):
    started = time.monotonic()
    rc, out, err = _bench(["all_reduce", *extra], capsys)
    assert rc == 2, err
    assert out == "" and err.count("\n") == 1 and err.startswith("commref bench: error: "), err
    assert message in err, err
    assert time.monotonic() - started < 10  # refused, not run: no rank started (no table either)


def test_every_rank_checks_what_it_keeps_with_its_world():
    """Under an mpiexec started by hand validate cannot know the ranks; each rank checks
    again with its world's size before any call (run_rank), all alike."""
    a = bench_args("all_reduce", "-b", "8", "-e", "1G", "-n", "6000", "-I", "1")
    arguments.check_kept(a, 1)  # 28 rows x 2 placements x 6000 x 1 rank = 336000 times
    with pytest.raises(ValueError, match="x 3 ranks = 1008000 times, more than 1000000"):
        arguments.check_kept(a, 3)
    with pytest.raises(ValueError, match="x 3 ranks = 1008000 times"):
        ThreadWorld.run(3, run_rank, a, out=lambda s: None, timeout=10)


# ---------------------------------------------------------------------------------------
# -a: how an iteration's time combines the ranks'
# ---------------------------------------------------------------------------------------

# Two ranks' times of three iterations (seconds): each -a gives a different median.
PER_RANK = [[1e-6, 5e-6, 9e-6], [3e-6, 7e-6, 2e-6]]
COMBINED = {  # average -> (each iteration's time, the median) in seconds
    0: ([1e-6, 5e-6, 9e-6], 5e-6),
    1: ([2e-6, 6e-6, 5.5e-6], 5.5e-6),
    2: ([1e-6, 5e-6, 2e-6], 2e-6),
    3: ([3e-6, 7e-6, 9e-6], 7e-6),
}


@pytest.mark.parametrize("average", sorted(COMBINED))
def test_average_combines_the_ranks_of_each_iteration(average):
    per_iter, median = COMBINED[average]
    assert measure.combine_ranks(PER_RANK, average) == pytest.approx(per_iter, rel=1e-12)
    r = measure._result(PER_RANK, 1000, 2.0, [0, 0], average)
    assert r["time_us"] == pytest.approx(median * 1e6, rel=1e-12)
    assert r["algbw"] == pytest.approx(1000 / median / 1e9, rel=1e-12) and r["busbw"] == pytest.approx(2 * r["algbw"])
    assert "per_iter" not in r


def test_average_values_differ_and_bad_one_is_refused():
    assert len({measure._result(PER_RANK, 8, 1.0, None, a)["time_us"] for a in COMBINED}) == 4
    with pytest.raises(ValueError, match="-a takes 0, 1, 2 or 3, got 4"):
        measure.combine_ranks(PER_RANK, 4)


@pytest.mark.parametrize("average, word", [(0, "rank 0"), (1, "average"), (2, "minimum"), (3, "maximum")])
def test_header_names_the_combination(average, word):
    lines = output.timing(bench_args("all_reduce", "-a", str(average), "-n", "7"), 60.0)
    assert lines[0].startswith(f"# Time: an iteration's time is the {word} of the ranks' (-a {average})")
    assert "median over the 7 iterations" in lines[0] and "deadline 60 s ($COMMREF_TIMEOUT, -T)" in lines[0]


# ---------------------------------------------------------------------------------------
# -I: per-iteration statistics
# ---------------------------------------------------------------------------------------


def test_iteration_stats_exact():
    """Five iterations of two ranks: the statistics are of each iteration's slowest rank."""
    rank0 = [1e-6, 2e-6, 8e-6, 4e-6, 5e-6]
    rank1 = [3e-6, 1e-6, 2e-6, 4e-6, 6e-6]
    s = measure.iteration_stats([rank0, rank1])
    slowest = [3.0, 2.0, 8.0, 4.0, 6.0]
    assert s["times_us"] == pytest.approx(slowest)
    assert s["per_process_max_times_us"] == [pytest.approx([1, 2, 8, 4, 5]), pytest.approx([3, 1, 2, 4, 6])]
    avg = 23 / 5
    stdev = np.sqrt(np.mean((np.array(slowest) - avg) ** 2))
    assert (s["min_us"], s["max_us"], s["p50_us"], s["p95_us"], s["p99_us"]) == pytest.approx((2, 8, 4, 8, 8))
    assert s["avg_us"] == pytest.approx(avg) and s["stdev_us"] == pytest.approx(stdev)
    assert s["cv_pct"] == pytest.approx(100 * stdev / avg)
    # 100 iterations 1..100 us: nearest-rank p95 is 95, p99 99, p50 the upper median 51.
    many = measure.iteration_stats([[i * 1e-6 for i in range(100, 0, -1)]])
    assert (many["p50_us"], many["p95_us"], many["p99_us"]) == pytest.approx((51, 95, 99))
    assert measure.iteration_stats([[0.0, 0.0]])["cv_pct"] == 0.0


def test_iteration_stats_columns():
    a = bench_args("all_reduce", *TINY, "-t", "2", "-I", "1")
    lines: list[str] = []
    doc = ThreadWorld.run(2, run_rank, a, out=lines.append)[0]
    heads = [s for s in lines if s.startswith(HEAD)]
    assert len(heads) == 1 and heads[0].split()[1:].count("i_min") == 2
    for name in ("i_min", "i_max", "i_p99", "i_cv%"):
        assert heads[0].split().count(name) == 2, heads[0]
    assert any(s.startswith("# Per-Iteration Report: i_* uses max over process rows") for s in lines)
    plain = bench_args("all_reduce", *TINY, "-t", "2")
    plain_lines: list[str] = []
    ThreadWorld.run(2, run_rank, plain, out=plain_lines.append)
    assert len(_rows(lines)[0].split()) == len(_rows(plain_lines)[0].split()) + 8  # 4 per placement
    for row, text in zip(doc["rows"], _rows(lines)):
        for key in ("out_of_place", "in_place"):
            s = row[key]["per_iter"]
            assert len(s["times_us"]) == 2 and len(s["per_process_max_times_us"]) == 2
            assert s["min_us"] <= s["p99_us"] <= s["max_us"]
        cells = text.split()
        o = row["out_of_place"]["per_iter"]
        assert cells[9:13] == [output._time_str(o["min_us"]), output._time_str(o["max_us"]),
                               output._time_str(o["p99_us"]), f"{o['cv_pct']:.2f}"]  # fmt: skip


# ---------------------------------------------------------------------------------------
# -N: cycles
# ---------------------------------------------------------------------------------------


def test_two_cycles_print_two_tables():
    a = bench_args("all_reduce", *TINY, "-t", "2", "-N", "2")
    lines: list[str] = []
    doc = ThreadWorld.run(2, run_rank, a, out=lines.append)[0]
    assert [s for s in lines if s.startswith("# Cycle")] == ["# Cycle 1 of 2", "# Cycle 2 of 2"]
    assert sum(s.startswith(HEAD) for s in lines) == 2
    assert any(s == "# Run cycles: 2 (-N), a table each" for s in lines)
    second = lines.index("# Cycle 2 of 2")
    assert len(_rows(lines[:second])) == 2 and len(_rows(lines[second:])) == 2
    assert [(r["cycle"], r["size"]) for r in doc["rows"]] == [(1, 8), (1, 256), (2, 8), (2, 256)]
    assert sum(s.startswith("# Avg bus bandwidth") for s in lines) == 1  # one footer, over both cycles


def test_one_cycle_prints_as_before():
    lines: list[str] = []
    doc = run_rank(ThreadWorld.single(), bench_args("all_reduce", *TINY), out=lines.append)
    assert not any(s.startswith(("# Cycle", "# Run cycles")) for s in lines)
    assert {r["cycle"] for r in doc["rows"]} == {1}


def _until_cycle(proc: subprocess.Popen, cycle: int) -> list[str]:
    """stdout lines of `proc` up to and including '# Cycle `cycle`...' (fails past 60 s)."""
    lines, deadline = [], time.monotonic() + 60
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith(f"# Cycle {cycle} "):
            return lines
        assert time.monotonic() < deadline, "\n".join(lines[-20:])
    pytest.fail(f"the run ended before cycle {cycle}:\n" + "\n".join(lines[-20:]) + "\n" + proc.stderr.read())


def _gone(pids: list[int], patience_s: float = 5.0) -> bool:
    end = time.monotonic() + patience_s
    while time.monotonic() < end:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


UNTIL_STOPPED = ["all_reduce", "-b", "8", "-e", "8", *QUICK_BENCH, "-N", "0"]


@pytest.mark.parametrize("sig, rc", [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)])
def test_until_interrupted_stops_on_a_signal_in_process(sig, rc, shm_leak_check):
    proc = start_commref(["bench", *UNTIL_STOPPED, "-t", "2"], clean_env())
    try:
        lines = _until_cycle(proc, 3)
        assert "# Run cycles: until interrupted (-N), a table each" in lines
        assert "# Cycle 2 (until interrupted)" in lines
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == rc
        if sig == signal.SIGINT:
            assert proc.stderr.read() == "commref bench: interrupted\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.mpi
def test_until_interrupted_under_np_leaves_nothing(shm_leak_check):
    """-N 0 --np 2: SIGTERM to commref ends the job (128 + 15) and no rank outlives it."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    proc = start_commref(["bench", *UNTIL_STOPPED, "--np", "2"], clean_env(), new_session=True)
    try:
        lines = _until_cycle(proc, 2)
        pids = [int(m.group(1)) for s in lines if (m := re.match(r"#  Rank +\d+ Group +0 Pid +(\d+)", s))]
        assert len(pids) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert _gone(pids), f"ranks {pids} outlived the job"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---------------------------------------------------------------------------------------
# -T: the deadline of every wait
# ---------------------------------------------------------------------------------------


def test_timeout_is_every_wait_deadline():
    a = bench_args("all_reduce", *TINY, "-t", "2", "-T", "7")
    lines: list[str] = []

    def deadline(world, args, out):
        from commref.collectives.communicator import Communicator

        comm = Communicator(world, "cpu")
        try:
            return world.timeout, comm.timeout
        finally:
            comm.close()

    assert ThreadWorld.run(2, deadline, a, lines.append, timeout=7.0) == [(7.0, 7.0)] * 2
    run_rank(ThreadWorld.single(timeout=7.0), bench_args("all_reduce", *TINY, "-T", "7"), out=lines.append)
    assert any("every wait's deadline 7 s (-T)" in s for s in lines)


def test_a_stuck_rank_fails_clearly_past_the_timeout(capsys):
    """Rank 1 stalls for 3 s after its last out-of-place call of the first size; with -T 1
    rank 0's next wait on it (inside the in-place call) passes its deadline: status 124
    and one line naming -T, the rank and the wait; no footer."""

    def stall(label, in_place, rank, out):
        if rank == 1 and not in_place:
            time.sleep(3)

    a = bench_args("all_reduce", *TINY, "-t", "2", "-T", "1")
    assert harness.run(a, corrupt=stall) == harness.TIMED_OUT
    got = capsys.readouterr()
    assert got.err.count("\n") == 1, got.err
    assert got.err.startswith("commref bench: error: a wait passed its deadline, -T 1: rank 0: timed out after 1")
    assert "waiting for peer 1: " in got.err
    assert "# Avg bus bandwidth" not in got.out


def test_timeout_message_names_the_default_deadline_without_t():
    from commref.transports.errors import CommTimeout

    e = CommTimeout.after(60, rank=0, peer=1, what="bench: timed calls", expected=2, seen=1)
    line = harness.timed_out(bench_args("all_reduce"), e)
    assert line.startswith("a wait passed its deadline, $COMMREF_TIMEOUT ") and "(-T sets it)" in line
    assert line.endswith("rank 0: timed out after 60.0 s waiting for peer 1: bench: timed calls (expected 2, seen 1)")


# ---------------------------------------------------------------------------------------
# -J: nccl-tests' JSON document
# ---------------------------------------------------------------------------------------

PLACEMENTS = ("out_of_place", "in_place")
PER_ITER_KEYS = {
    "skipped_iterations",
    "min_us",
    "max_us",
    "avg_us",
    "p50_us",
    "p95_us",
    "p99_us",
    "stdev_us",
    "cv_pct",
    "times_us",
    "per_process_max_times_us",
}


def read_nccl_tests_json(path) -> list[str]:
    """What a reader of nccl-tests' files takes from one (the keys its analysis tool
    reads: version, config's iterations, aggregated_iterations and devices' hostnames,
    each result's size and, per placement, avg/min/max/p99/cv and the times), checking
    its consistency rule: times_us[i] is the maximum over the processes of
    per_process_max_times_us[p][i], within 0.001. Returns a line per result with
    per-iteration data; AssertionError on a missing key or a broken rule."""
    data = json.loads(open(path).read())
    config = data["config"]
    lines = [
        f"version {data['version']}, iterations {config['iterations']}, aggregated "
        f"{config['aggregated_iterations']}, hosts {sorted({d['hostname'] for d in config['devices']})}"
    ]
    for r in data["results"]:
        for key in PLACEMENTS:
            per_iter = r.get(f"{key}_per_iter")
            if per_iter is None:
                continue
            times, rows = per_iter["times_us"], per_iter["per_process_max_times_us"]
            assert len(times) == config["iterations"] * config["aggregated_iterations"]
            for i, t in enumerate(times):
                assert abs(t - max(row[i] for row in rows)) <= 0.001, (r["size"], key, i)
            assert per_iter["min_us"] <= per_iter["avg_us"] <= per_iter["max_us"]
            assert per_iter["min_us"] <= per_iter["p99_us"] <= per_iter["max_us"]
            lines.append(
                f"{r['size']:>8} {key:<12} avg {per_iter['avg_us']:.2f} min {per_iter['min_us']:.2f} max "
                f"{per_iter['max_us']:.2f} p99 {per_iter['p99_us']:.2f} us cv {per_iter['cv_pct']:.1f}% "
                f"({len(rows)} processes, consistent)"
            )
    return lines


def _check_layout(data: dict, commref_doc: dict, per_iter: bool) -> None:
    assert set(data) >= {"version", "config", "results", "out_of_bounds", "average_bus_bandwidth", "errors"}
    assert "env" not in data  # nccl-tests writes every variable; commref leaves them out
    c = data["config"]
    assert (c["iterations"], c["aggregated_iterations"], c["warmup_iters"]) == (2, 1, 1)
    assert (c["minimum_bytes"], c["maximum_bytes"], c["step_factor"]) == (8, 256, 32)
    assert c["per_iter_timing"] == ("true" if per_iter else "false")
    assert [d["rank"] for d in c["devices"]] == [0, 1] and all(d["hostname"] for d in c["devices"])
    assert len(data["results"]) == len(commref_doc["rows"]) == 2
    for r, row in zip(data["results"], commref_doc["rows"]):
        assert (r["size"], r["count"], r["type"], r["redop"], r["root"]) == (row["size"], row["count"], "float", "sum",
                                                                              "    -1")  # fmt: skip
        for key in PLACEMENTS:
            assert set(r[key]) == {"time", "alg_bw", "bus_bw", "nwrong"}
            assert r[key]["time"] == row[key]["time_us"] and r[key]["bus_bw"] == row[key]["busbw"]
            assert r[key]["nwrong"] == 0.0
            if per_iter:
                assert set(r[f"{key}_per_iter"]) == PER_ITER_KEYS
                assert r[f"{key}_per_iter"]["skipped_iterations"] == 0
                assert len(r[f"{key}_per_iter"]["per_process_max_times_us"]) == 2
            else:
                assert f"{key}_per_iter" not in r
        assert list(r)[:7] == ["size", "count", "type", "redop", "root", "out_of_place"] + (
            ["out_of_place_per_iter"] if per_iter else ["in_place"]
        )
    assert data["out_of_bounds"] == {"count": 0, "okay": "true"}


@pytest.mark.parametrize("per_iter", [False, True], ids=["plain", "-I 1"])
def test_nccl_tests_json_beside_commref_json(per_iter, tmp_path, capsys):
    nccl, mine = tmp_path / "nccl.json", tmp_path / "commref.json"
    argv = ["all_reduce", *TINY, "-t", "2", "-J", str(nccl), "--json", str(mine)] + (["-I", "1"] if per_iter else [])
    rc, out, _ = _bench(argv, capsys)
    assert rc == 0
    assert f"# wrote {nccl} (nccl-tests' JSON document)" in out.splitlines()
    assert f"# wrote {mine} (results and environment, {output.SCHEMA})" in out.splitlines()
    commref_doc = json.loads(mine.read_text())
    assert commref_doc["schema"] == output.SCHEMA and "nccl_json" not in commref_doc["params"]
    data = json.loads(nccl.read_text())
    _check_layout(data, commref_doc, per_iter)
    lines = read_nccl_tests_json(nccl)
    assert lines[0].startswith("version 2, iterations 2, aggregated 1, hosts ")
    assert len(lines) == (1 + 2 * 2 if per_iter else 1)


def test_the_reader_catches_an_inconsistent_file(tmp_path, capsys):
    path = tmp_path / "n.json"
    assert _bench(["all_reduce", *TINY, "-t", "2", "-I", "1", "-J", str(path)], capsys)[0] == 0
    data = json.loads(path.read_text())
    data["results"][0]["in_place_per_iter"]["times_us"][1] += 1.0
    path.write_text(json.dumps(data))
    with pytest.raises(AssertionError):
        read_nccl_tests_json(path)


def test_plot_draws_the_last_cycle():
    from commref.bench.plot import last_cycle

    rows = [{"size": 8, "cycle": 1}, {"size": 8, "cycle": 2}, {"size": 256, "cycle": 2}]
    assert last_cycle(rows) == rows[1:]
    assert last_cycle([{"size": 8}]) == [{"size": 8}]  # a document from before -N
