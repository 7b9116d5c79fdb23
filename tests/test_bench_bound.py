"""The benchmark's bound (bench/bound.py): the least traffic per collective,
and the stream rate it is divided by.
"""

from __future__ import annotations

import pytest

from commref.bench import plugins
from commref.transports.thread_world import ThreadWorld

K, M, G = 1 << 10, 1 << 20, 1 << 30


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
                    outs[("out", r, i)] = (
                        ("in", r, i) if in_place else ("out", r, i),
                        {("in", k, i) for k in range(n)},
                    )
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
    per_rank = {
        (c, ip): plugins.get(c).traffic(2, ip)
        for c in ("all_reduce", "reduce_scatter", "all_gather")
        for ip in (False, True)
    }
    assert {k: t.loads(16 * M) + t.stores(16 * M) for k, t in per_rank.items()} == {
        ("all_reduce", False): 32 * M,
        ("all_reduce", True): 32 * M,
        ("reduce_scatter", False): 24 * M,
        ("reduce_scatter", True): 24 * M,
        ("all_gather", False): 24 * M,
        ("all_gather", True): 16 * M,
    }
    # One rank in place: the result is the input, nothing moves, no bound.
    for coll in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather", "scatter"):
        t = plugins.get(coll).traffic(1, in_place=True)
        assert not t.moves and t.loads(S) == t.stores(S) == t.footprint(S) == 0


def test_stream_kernels_cover_copy_add_and_the_pattern() -> None:
    """The rate is the fastest of STREAM's copy and add and the collective's own
    pattern, each with cached and non-temporal stores; a pattern that is copy or add
    is measured once. Arrays are whole 64-byte lines at the call's footprint."""
    from commref.bench import bound

    t = plugins.get("all_reduce").traffic(2, in_place=True)
    ks = bound.stream_kernels(t)
    assert [k.label for k in ks] == [
        "copy/cached",
        "copy/streamed",
        "add/cached",
        "add/streamed",
        "pattern/cached",
        "pattern/streamed",
    ]
    assert (ks[-1].nin, ks[-1].nout, ks[-1].shared) == (2, 2, 2)
    assert [k.label for k in bound.stream_kernels(plugins.get("alltoall").traffic(4), streamed=False)] == [
        "copy/cached",
        "add/cached",
    ]
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
        {
            "copy/cached": {"bytes": 100, "times": [1.0, 2.0, 4.0]},
            "add/cached": {"bytes": 300, "times": [1.0, 1.0, 1.0]},
        },
        {
            "copy/cached": {"bytes": 100, "times": [3.0, 1.0, 1.0]},
            "add/cached": {"bytes": 300, "times": [2.0, 3.0, 2.0]},
        },
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
