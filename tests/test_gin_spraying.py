"""Multi-path spraying on the native unordered wire (GinOptions.wire_paths;
native_engine/unordered.h, "Multi-path spraying"): each set of landings sent packet by
packet over seeded paths of their own latency and rate, landed in arrival order among
the events the model allows.

- conformance: the collectives over 4 paths, every trace replayed against
  semantics.enabled(), exact (strong), with holds and segments as without paths;
- the paths order the landings: the same seed lands every put that was not held the
  same way twice, and other than one path does; where the paths serialize (the wire
  model's rate), a put's far-apart segments keep their order while neighbours overtake,
  where one path's uniform draw keeps half at every distance;
- refusals: the ordered wire (one path per queue pair), the Python engine, and a count
  out of range, each one line before any rank starts where the CLI says it.
"""

from __future__ import annotations

import pytest
from helpers import WORLD_TIMEOUT, collectives_run, trace_kinds, traced_sweep

from commref import Communicator, cli
from commref.transports.errors import CapabilityError
from commref.transports.gin.replay import replay_trace
from commref.transports.thread_world import ThreadWorld

SEEDS = (3, 4)


def _segment_orders(trace: dict) -> dict:
    """Per (link, put) that was never held, the order its segments' originals landed in
    (held puts land when they are released, which depends on the engine's polls)."""
    out: dict = {}
    for link, records in trace.items():
        held = {r[1] for r in records if r[0] == "hold"}
        for r in records:
            if r[0] == "seg" and r[3] == 0 and r[1] not in held:
                out.setdefault((link, r[1]), []).append(r[2])
    return {k: v for k, v in out.items() if len(v) > 1}


def _in_order(results, d: int) -> float:
    """Over every put cut in segments, on every rank: the fraction of its segment pairs
    (k, k + d) whose originals landed in that order."""
    kept = pairs = 0
    for trace, _, _ in results:
        for records in trace.values():
            at = {(r[1], r[2]): i for i, r in enumerate(records) if r[0] == "seg" and r[3] == 0}
            for (seq, k), i in at.items():
                j = at.get((seq, k + d))
                if j is not None:
                    pairs += 1
                    kept += i < j
    assert pairs > 100, (d, pairs)
    return kept / pairs


def _run(paths: int, seeds=SEEDS):
    return ThreadWorld.run(
        2, collectives_run, "proxy", "unordered", "strong", list(seeds), timeout=120, wire_paths=paths
    )


def test_sprayed_collectives_conform_and_are_exact(native):
    total, kinds, wrong = {}, {}, 0
    for rank, per_seed in enumerate(_run(4)):
        for seed, (trace, w, _) in zip(SEEDS, per_seed):
            assert trace, f"rank {rank} seed {seed}: empty trace"
            wrong += w
            for key, n in replay_trace(trace, "proxy", "unordered").items():
                total[key] = total.get(key, 0) + n
            for key, n in trace_kinds(trace).items():
                kinds[key] = kinds.get(key, 0) + n
    assert wrong == 0, wrong
    assert total["seg"] > 100 and total["signal"] > 20, total
    assert total["hold"] > 10 and total["release"] == total["hold"], total


def test_the_paths_order_the_landings(native):
    one, sprayed, again = _run(1, [5]), _run(4, [5]), _run(4, [5])
    for rank in range(2):
        (t1, _, _), (t4, _, _), (t4b, _, _) = one[rank][0], sprayed[rank][0], again[rank][0]
        o1, o4, o4b = _segment_orders(t1), _segment_orders(t4), _segment_orders(t4b)
        common = o4.keys() & o4b.keys()
        assert len(common) > 20, (len(o4), len(o4b))
        assert all(o4[k] == o4b[k] for k in common), f"rank {rank}: the same seed landed differently"
        assert any(o4[k] != o1[k] for k in o4.keys() & o1.keys()), f"rank {rank}: 4 paths landed as one does"


def test_far_segments_keep_their_order_where_the_paths_serialize(native):
    """Puts of 4 KiB cut in 256-byte segments over 4 paths of 0.25 GB/s each (the wire
    model's 1 GB/s) and 1-1.75 us: a segment waits behind the ones sent before it on its
    path, so segments 12 apart almost always land in order while neighbours, on other
    paths, often do not; one path's uniform draw keeps half at every distance."""

    def run(**kw):
        return ThreadWorld.run(
            2, traced_sweep, 5, 60.0, 3001, 4096, 256, backend="proxy", wire="unordered", timeout=120, **kw
        )

    uniform, sprayed = run(), run(wire_paths=4, wire_rate="1G", wire_latency="1us")
    assert all(0.35 < _in_order(uniform, d) < 0.65 for d in (1, 12))
    near, far = _in_order(sprayed, 1), _in_order(sprayed, 12)
    assert near < 0.8 and far > 0.85, (near, far)
    assert sum(w for _, w, _ in sprayed) == 0


def test_wire_paths_are_refused_where_there_is_one_path(monkeypatch, capsys):
    assert cli.main(["check", "--path", "gin", "--wire-paths", "4", "--np", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "wire_paths is an option of the unordered wire" in err, err
    assert cli.main(["check", "--path", "gin", "--wire", "unordered", "--wire-paths", "65", "--np", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "wire_paths must be in [1, 64], got 65" in err, err
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "python")

    def body(world):
        with pytest.raises(CapabilityError, match=r"multi-path spraying \(wire_paths\) runs in the native GIN engine"):
            Communicator(world, "cpu", path="gin", wire="unordered", wire_paths=2, timeout=WORLD_TIMEOUT)

    ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)
