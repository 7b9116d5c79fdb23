"""Collectives over GIN in ThreadWorld, every element checked (commref.collectives.check).

- Sweeps: every collective and algorithm over GIN on backends proxy and rc (and one
  gda), ordered and unordered wires, small slots so that a call takes many pipeline
  steps, 1 and 2 channels, 2, 3 and 4 ranks; LSA and GIN links mixed in one ring.
- Queue backpressure: a tiny descriptor queue with many blocks posting at once.
"""

from __future__ import annotations

import pytest
from helpers import REDUCING, WORLD_TIMEOUT, close_after_barrier, gin_comm, run_gin_sweep

from commref.collectives import check, tuner
from commref.collectives.catalogue import KERNEL_NAMES as COLLECTIVES
from commref.transports.errors import CapabilityError
from commref.transports.thread_world import ThreadWorld

# (nranks, backend, wire, max_channels, dtypes, ops); slot_bytes 256 and segment_bytes 64
# everywhere: a 3001-element call takes up to ~50 steps per channel, a put lands in 5 segments.
SWEEPS = [
    (2, "proxy", "ordered", 1, ["float32", "int8"], ["sum", "max"]),
    (2, "proxy", "unordered", 2, ["bfloat16", "uint64"], ["prod", "avg"]),
    (3, "proxy", "ordered", 2, ["float16", "int32"], ["sum", "min"]),
    (3, "proxy", "unordered", 1, ["float32", "uint8"], ["sum", "avg"]),
    (2, "rc", "ordered", 2, ["float64", "int8"], ["sum", "min"]),
    (3, "rc", "ordered", 1, ["bfloat16", "int64"], ["max", "avg"]),
    (4, "proxy", "unordered", 2, ["float32"], ["sum"]),
]


@pytest.mark.parametrize(
    "nranks, backend, wire, channels, dtypes, ops",
    [pytest.param(*s, id=f"{s[0]}ranks-{s[1]}-{s[2]}-{s[3]}ch") for s in SWEEPS],
)
def test_sweep_over_gin(nranks, backend, wire, channels, dtypes, ops, many_channels):
    counts = [0, 1, 7, 1001, 3001]
    assert tuner.plan("allreduce", "ring", 1001 * 4, nranks, "cpu", channels).nchannels == channels
    opts = dict(
        path="gin",
        backend=backend,
        wire=wire,
        seed=nranks * 10 + channels,
        max_channels=channels,
        slot_bytes=256,
        segment_bytes=64,
    )
    infos = run_gin_sweep(nranks, opts, dtypes, ops, counts)
    everyone_else = [sum(1 << p for p in range(nranks) if p != r) for r in range(nranks)]
    assert [i["peer_mask"] for i in infos] == everyone_else
    assert {i["backend"] for i in infos} == {backend}
    assert {i["network"] for i in infos} == {"shm"}
    assert all(i["ops"] > 0 for i in infos), "the proxies carried nothing"


def test_sweep_gda_weak_counting_protocol(many_channels):
    """gda has weak signals only: collectives run with a signal per put."""
    opts = dict(
        path="gin",
        backend="gda",
        wire="unordered",
        gin_protocol="signal-per-put",
        seed=5,
        max_channels=2,
        slot_bytes=256,
        segment_bytes=64,
    )
    infos = run_gin_sweep(2, opts, ["int32"], ["sum"], [0, 7, 1001, 3001])
    assert {i["backend"] for i in infos} == {"gda"}


def test_auto_path_in_one_process_is_lsa():
    """In ThreadWorld every window is mapped: path='auto' puts every peer on LSA."""
    infos = run_gin_sweep(3, dict(path="auto", max_channels=1, slot_bytes=256), ["float32"], ["sum"], [0, 1001])
    assert [(i["peer_mask"], i["proxy"], i["backend"]) for i in infos] == [(0, False, None)] * 3


@pytest.mark.parametrize("wire", ["ordered", "unordered"])
def test_mixed_lsa_and_gin_links(wire, many_channels):
    """Two 'hosts' {0, 1} and {2, 3}: links inside a host by LSA, across hosts by GIN, in
    the same rings and trees (what path='auto' computes on a two-host MPI job). One
    process maps every window, so the mask that _plan_gin would compute for that job is
    set after construction with path='gin' (which builds the proxy and GIN regions)."""

    def mask(rank):
        host = rank // 2
        return sum(1 << p for p in range(4) if p // 2 != host)

    opts = dict(path="gin", wire=wire, seed=3, max_channels=2, slot_bytes=256, segment_bytes=64)
    infos = run_gin_sweep(4, opts, ["float32"], ["sum", "max"], [1, 1001, 4099], peer_mask=mask)
    assert [i["peer_mask"] for i in infos] == [0b1100, 0b1100, 0b0011, 0b0011]
    assert all(i["ops"] > 0 for i in infos)


def test_rc_refuses_an_unordered_wire():
    def fn(world):
        gin_comm(world, path="gin", backend="rc", wire="unordered")

    with pytest.raises(CapabilityError, match=r"rc lacks the unordered wire \(runs on ordered only\)"):
        ThreadWorld.run(2, fn, timeout=WORLD_TIMEOUT)


# ---------------------------------------------------------------------------------------
# queue backpressure: a tiny descriptor queue, many blocks posting at once
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "queue, protocol, wire",
    [(2, "strong", "unordered"), (3, "signal-per-put", "unordered"), (4, "flush-signal", "ordered")],
)
def test_tiny_queue_many_blocks(queue, protocol, wire, many_channels):
    channels = 6
    count = 12_000  # 48 KB per rank: every channel of every collective is busy
    assert tuner.plan("reduce_scatter", "ring", count * 4, 3, "cpu", channels).nchannels == channels

    def fn(world):
        comm = gin_comm(
            world,
            path="gin",
            gin_protocol=protocol,
            wire=wire,
            seed=queue,
            gin_queue=queue,
            max_channels=channels,
            slot_bytes=512,
            segment_bytes=128,
        )
        case_list = [
            check.Case(coll, "ring", "float32", "sum" if coll in REDUCING else None, count, False, 1, queue * 100 + i)
            for i, coll in enumerate(COLLECTIVES)
        ]
        wrong = check.run_sweep(comm, case_list)
        ops = comm.proxy.stats["ops"]
        close_after_barrier(world, comm)
        return wrong, ops

    results = ThreadWorld.run(3, fn, timeout=WORLD_TIMEOUT)
    assert results[0][0] == [0] * len(COLLECTIVES)
    # Many times the queue's capacity went through it.
    assert all(ops > 100 * queue for _, ops in results)
