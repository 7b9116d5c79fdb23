"""The performance model (collectives/model.py) and its calibration (calibration.py):
auto's choices are the model's argmin, a planted calibration that flips the model's
ranking flips the tuner, the calibration is cached per host and source key, agreed by
every rank, and the probe keeps its deadline's terms. Nothing here is timed: the
calibrations are planted or the reference one (COMMREF_MODEL=reference, conftest.py)."""

from __future__ import annotations

import json

import pytest

from commref.collectives import calibration, tuner
from commref.collectives.calibration import REFERENCE, Calibration
from commref.collectives.hierarchical import NodeShape
from commref.collectives.model import GIN_SHARED_SWITCHES, Model, Paths
from commref.transports.thread_world import ThreadWorld

# (collective, size, ranks, paths, symmetric, nodes): points across sizes, ranks and paths.
POINTS = [
    ("allreduce", size, ranks, paths, symmetric, None)
    for size in (8, 64, 256, 4096, 32768, 1 << 20, 8 << 20)
    for ranks, paths in (
        (2, Paths(local_ranks=2)),
        (4, Paths(local_ranks=4)),
        (2, Paths(gin=True, local_ranks=2)),
        (4, Paths(gin=True, local_ranks=4)),
        (2, Paths(gin=True, local_ranks=2, wire_rate=1e9, wire_modeled=True)),
    )
    for symmetric in (False, True)
] + [
    (coll, size, 4, Paths(gin=True, nodes=2, local_ranks=4, between_hosts=slow), False, NodeShape(2, 2, 0, 0))
    for coll in ("allreduce", "allgather", "reduce_scatter")
    for size in (64, 1 << 16, 4 << 20)
    for slow in (False, True)
]


def _argmin(m: Model, coll, size, ranks, symmetric, nodes):
    """The model's fastest (algorithm, protocol), by enumerating every choice auto has."""
    spec = tuner.catalogue.get(coll)
    times = {}
    for a in tuner.auto_algorithms(spec, ranks, symmetric, nodes, "auto"):
        for p in tuner.PROTOCOLS if a in tuner.PROTOCOL_ALGORITHMS else ("simple",):
            times[(a, p)] = m.time(coll, a, p, size, ranks)
    return min(times, key=times.get)


@pytest.mark.parametrize("coll,size,ranks,paths,symmetric,nodes", POINTS)
def test_auto_takes_the_models_argmin(coll, size, ranks, paths, symmetric, nodes):
    m = Model(REFERENCE, paths)
    got = tuner.plan(coll, "auto", size, ranks, "cpu", 1, symmetric, nodes, model=m)
    want = _argmin(m, coll, size, ranks, symmetric, nodes)
    assert got.algorithm == want[0]
    if got.algorithm in tuner.PROTOCOL_ALGORITHMS:
        assert got.protocol == want[1]


def test_a_gin_hop_where_ranks_share_a_core_waits_for_the_engines_turns_too():
    """Over GIN each rank's engine is a thread beside its kernel: where ranks share the
    cores (4 on REFERENCE's 2) a hop costs GIN_SHARED_SWITCHES scheduler turns, over LSA
    one, and none where every rank has a core; so 4 GIN ranks take the tree further up."""
    turn = REFERENCE.switch_s
    gin_own, gin_shared = (
        Model(REFERENCE, Paths(gin=True, local_ranks=2)),
        Model(REFERENCE, Paths(gin=True, local_ranks=4)),
    )
    lsa_own, lsa_shared = Model(REFERENCE, Paths(local_ranks=2)), Model(REFERENCE, Paths(local_ranks=4))
    assert gin_shared.hop_s(True) - gin_own.hop_s(True) == pytest.approx(GIN_SHARED_SWITCHES * turn)
    assert lsa_shared.hop_s(False) - lsa_own.hop_s(False) == pytest.approx(turn)
    size = 32768
    tree, ring = (gin_shared.time("allreduce", a, "simple", size, 4) for a in ("tree", "ring"))
    assert tree < ring
    assert tuner.plan("allreduce", "auto", size, 4, "cpu", 1, False, None, model=gin_shared).algorithm == "tree"


def test_the_points_cover_every_choice():
    """The points above are not all one answer: auto's choices among them span ring,
    tree, direct and hierarchical, and every protocol."""
    seen = set()
    for coll, size, ranks, paths, symmetric, nodes in POINTS:
        p = tuner.plan(coll, "auto", size, ranks, "cpu", 1, symmetric, nodes, model=Model(REFERENCE, paths))
        seen |= {p.algorithm, p.protocol}
    assert {"ring", "tree", "direct", "hierarchical", "simple", "ll", "ll128"} <= seen


def test_a_planted_calibration_that_flips_the_ranking_flips_the_tuner():
    paths = Paths(local_ranks=2)
    ref, slow_hops = Model(REFERENCE, paths), Model(REFERENCE.replace(hop_s=1e-3, source="planted"), paths)
    # Protocol: at 4 KiB Simple is faster on the reference host; with hops of 1 ms, LL's saving wins.
    times = {p: ref.time("allreduce", "ring", p, 4096, 2) for p in tuner.PROTOCOLS}
    assert min(times, key=times.get) == "simple"
    flipped = {p: slow_hops.time("allreduce", "ring", p, 4096, 2) for p in tuner.PROTOCOLS}
    assert min(flipped, key=flipped.get) == "ll"
    assert tuner.plan("allreduce", "auto", 4096, 2, "cpu", 1, model=ref).protocol == "simple"
    assert tuner.plan("allreduce", "auto", 4096, 2, "cpu", 1, model=slow_hops).protocol == "ll"
    # Algorithm: the ring at 4 KiB on symmetric buffers; with memory 1000x slower the direct
    # kernels, which move half the bytes, win.
    slow_memory = Model(REFERENCE.replace(cached_Bps=REFERENCE.cached_Bps / 1000, source="planted"), paths)
    assert ref.time("allreduce", "ring", "simple", 4096, 2) < ref.time("allreduce", "direct", "simple", 4096, 2)
    assert slow_memory.time("allreduce", "direct", "simple", 4096, 2) < min(
        slow_memory.time("allreduce", "ring", p, 4096, 2) for p in tuner.PROTOCOLS
    )
    assert tuner.plan("allreduce", "auto", 4096, 2, "cpu", 1, True, model=ref).algorithm == "ring"
    assert tuner.plan("allreduce", "auto", 4096, 2, "cpu", 1, True, model=slow_memory).algorithm == "direct"


def test_channels_are_the_models_choice():
    many = Model(REFERENCE.replace(cores=64), Paths(local_ranks=2))
    big = 64 << 20
    times = {ch: many.time("allreduce", "ring", "simple", big, 2, ch) for ch in range(1, 5)}
    assert tuner.plan("allreduce", "ring", big, 2, "cpu", 4, model=many).nchannels == min(times, key=times.get) > 1
    assert tuner.plan("allreduce", "ring", 8, 2, "cpu", 4, model=many).nchannels == 1
    # On 2 cores with 2 ranks a second channel only takes turns: one.
    assert (
        tuner.plan("allreduce", "ring", big, 2, "cpu", 4, model=Model(REFERENCE, Paths(local_ranks=2))).nchannels == 1
    )


def test_explicit_choices_are_kept():
    m = Model(REFERENCE.replace(hop_s=1e-3), Paths(local_ranks=2))
    p = tuner.plan("allreduce", "ring", 4096, 2, "cpu", 1, protocol="simple", model=m)
    assert (p.algorithm, p.protocol) == ("ring", "simple")
    assert tuner.plan("allreduce", "tree", 1 << 20, 4, "cpu", 2, model=m).algorithm == "tree"
    assert tuner.plan("allreduce", "direct", 8, 2, "cpu", 1, True, model=m).algorithm == "direct"


def test_the_wire_model_bounds_the_prediction():
    m = Model(REFERENCE, Paths(gin=True, local_ranks=2, wire_rate=1e9, wire_latency=10e-6, wire_modeled=True))
    size = 8 << 20
    assert m.time("allreduce", "ring", "simple", size, 2) > size / 1e9  # a 2-rank ring sends S per rank
    assert m.time("allreduce", "ring", "simple", 8, 2) > 2 * 10e-6  # two dependent steps


def test_the_calibration_is_cached_per_host_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("COMMREF_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(calibration.MODEL_ENV, "probe")
    monkeypatch.setattr(calibration, "_memo", {})
    probes = []
    planted = REFERENCE.replace(cached_Bps=1e9, source="probe")
    monkeypatch.setattr(calibration, "probe", lambda *a, **k: probes.append(1) or planted)
    first = calibration.host_calibration()
    assert probes == [1] and first.cached_Bps == 1e9
    (path,) = (tmp_path / "model").glob("*.json")
    assert calibration.source_key() in path.name
    assert json.loads(path.read_text())["cached_Bps"] == 1e9
    calibration._memo.clear()
    again = calibration.host_calibration()
    assert probes == [1] and again.source == "cache" and again.cached_Bps == 1e9
    # Another source key (a new build or version): probed again.
    calibration._memo.clear()
    monkeypatch.setattr(calibration, "source_key", lambda: "another")
    calibration.host_calibration()
    assert probes == [1, 1]


def test_a_probe_that_shared_its_core_is_used_but_not_cached(monkeypatch, tmp_path):
    """A probe whose Python ran with half its core (thread CPU time over wall time: a
    planted clock) reports that share; host_calibration uses such a calibration but
    writes no cache, so the next process probes again."""
    import time

    with monkeypatch.context() as m:
        m.setattr(time, "thread_time", lambda: time.perf_counter() / 2)
        shared = calibration.probe(deadline_s=0.05)
    assert shared.cpu_share < calibration.CONTENDED_SHARE, shared.cpu_share
    assert calibration.probe(deadline_s=0.05).cpu_share > 0  # the real clocks: a share in (0, 1]

    monkeypatch.setenv("COMMREF_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(calibration.MODEL_ENV, "probe")
    monkeypatch.setattr(calibration, "_memo", {})
    probes = []
    planted = REFERENCE.replace(cached_Bps=1e9, cpu_share=0.5, source="probe")
    monkeypatch.setattr(calibration, "probe", lambda *a, **k: probes.append(1) or planted)
    assert calibration.host_calibration().cached_Bps == 1e9
    assert not list((tmp_path / "model").glob("*.json"))
    calibration._memo.clear()
    calibration.host_calibration()
    assert probes == [1, 1]


def test_reference_file_and_bad_values_of_commref_model(monkeypatch, tmp_path):
    monkeypatch.setenv(calibration.MODEL_ENV, "reference")
    assert calibration.host_calibration() is REFERENCE
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps(REFERENCE.replace(cached_Bps=3e9).to_json()))
    monkeypatch.setenv(calibration.MODEL_ENV, str(planted))
    got = calibration.host_calibration()
    assert (got.cached_Bps, got.source) == (3e9, "file")
    (tmp_path / "bad.json").write_text("[1, 2]")
    monkeypatch.setenv(calibration.MODEL_ENV, str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="not a calibration's JSON"):
        calibration.host_calibration()
    monkeypatch.setenv(calibration.MODEL_ENV, "fast")
    with pytest.raises(ValueError, match="COMMREF_MODEL must be one of probe, reference or a calibration's .json"):
        calibration.host_calibration()


def test_every_rank_takes_rank_zeros_calibration(monkeypatch):
    mine = REFERENCE.replace(cached_Bps=7e9, source="planted")
    monkeypatch.setattr(calibration, "host_calibration", lambda: mine)
    got = ThreadWorld.run(3, calibration.agreed_calibration, timeout=10.0)
    assert got == [mine] * 3


def test_the_probe_keeps_reference_terms_past_its_deadline():
    cal = calibration.probe(deadline_s=0.0)  # one batch of the first term, nothing after
    assert cal.source == "probe" and cal.py_unit_s > 0
    assert (cal.cached_Bps, cal.dram_Bps, cal.hop_s) == (REFERENCE.cached_Bps, REFERENCE.dram_Bps, REFERENCE.hop_s)


def test_the_effective_cache_is_where_the_copy_rate_halves():
    """effective_llc: the first footprint, doubling from 2 x CACHED_FOOTPRINT, whose rate
    is below half the in-cache one (planted rates: a host whose sysfs names 480 MiB of
    cache while the copy slows from 4 MiB on), capped at the named cache; the named cache
    when the rate never halves, or with no in-cache rate, or past the deadline."""
    import time

    KiB, MiB = 1 << 10, 1 << 20
    asked = []

    def rate(footprint):
        asked.append(footprint)
        return 80e9 if footprint <= 2 * MiB else 36e9

    later = time.perf_counter() + 60
    assert calibration.effective_llc(rate, 75e9, 480 * MiB, later) == 4 * MiB
    assert asked == [512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB]
    assert calibration.effective_llc(lambda f: 70e9, 75e9, 32 * MiB, later) == 32 * MiB
    assert calibration.effective_llc(rate, None, 32 * MiB, later) == 32 * MiB
    asked.clear()
    assert calibration.effective_llc(rate, 75e9, 480 * MiB, time.perf_counter() - 1) == 480 * MiB and not asked


def test_the_probe_measures_beyond_the_cache_it_found():
    """Given time, the probe measures both copy rates and an effective cache between the
    first footprint it tries and the cache sysfs names."""
    cal = calibration.probe(deadline_s=5.0)
    assert 2 * calibration.CACHED_FOOTPRINT <= cal.llc_bytes <= calibration.llc_bytes()
    assert cal.dram_Bps != REFERENCE.dram_Bps and cal.cached_Bps != REFERENCE.cached_Bps


def test_a_calibration_round_trips_through_json():
    cal = REFERENCE.replace(host="h", key="k", source="probe")
    assert Calibration.from_json(json.loads(json.dumps(cal.to_json()))) == cal


def test_the_reference_model_takes_direct_at_the_size_test_direct_uses():
    from test_direct import DIRECT_SIZE

    for ranks in (2, 3, 4):
        m = Model(REFERENCE, Paths(local_ranks=ranks))
        assert tuner.plan("allreduce", "auto", DIRECT_SIZE, ranks, "cpu", 1, True, model=m).algorithm == "direct"
        per = (DIRECT_SIZE // 4 + 5) * 4 * ranks  # test_which_buffers_must_be_symmetric's sizes
        for coll in ("allgather", "reduce_scatter", "alltoall"):
            assert tuner.plan(coll, "auto", per, ranks, "cpu", 1, True, model=m).algorithm == "direct", coll


def test_bench_model_prints_the_prediction_beside_the_measured_time():
    from commref.bench.arguments import build_parser
    from commref.bench.harness import run_rank

    a = build_parser().parse_args(
        ["all_reduce", "-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-w", "1", "--model"]
        + ["--no-baseline", "--no-bound"]
    )
    lines: list[str] = []
    doc = ThreadWorld.run(2, run_rank, a, out=lines.append, timeout=60.0)[0]
    assert [r["size"] for r in doc["rows"]] == [8, 64, 512, 4096]
    for r in doc["rows"]:
        assert r["predicted_us"] > 0
        assert r["predicted_ratio"] == pytest.approx(r["predicted_us"] / r["out_of_place"]["time_us"])
    assert any("pred/" in line for line in lines)
    row = next(line for line in lines if line.lstrip().startswith("4096 "))
    assert row.split()[-1] == f"{doc['rows'][-1]['predicted_ratio']:.2f}"


def test_the_described_cluster_is_the_models():
    from commref.bench import cluster_model
    from commref.cli import build_parser

    args = build_parser().parse_args(["model", "-b", "1M", "-e", "8G", "-f", "8"])
    rows = cluster_model.rows(args)
    m, n = cluster_model.cluster_model(args)
    for r in rows:  # each row is the tuner's choice on that model
        p = tuner.plan("allreduce", "auto", r["size"], n, "cuda", 1, model=m)
        assert (r["algorithm"], r["protocol"]) == (p.algorithm, p.protocol)
    # A ring's busbw cannot pass the link's rate, and at 8 GiB it is near it.
    assert 0.9 * 450 < max(r["busbw"] for r in rows) <= 450
    assert cluster_model.published(args)  # the cited 8x H100 NVLink figure
    two = build_parser().parse_args(["model", "--nodes", "2", "-b", "1G", "-e", "1G"])
    assert cluster_model.rows(two)[0]["busbw"] < max(r["busbw"] for r in rows)  # the network is slower
