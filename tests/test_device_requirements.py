"""A device communicator's requirements (DeviceRequirements: ncclDevCommRequirements'
role) and properties (DeviceComm.properties()): each requirement the communicator
cannot meet refused at creation with a message naming it, on every rank, and the
properties of LSA, GIN and mixed communicators as they are."""

from __future__ import annotations

import pytest
from helpers import WORLD_TIMEOUT

from commref import DeviceComm, DeviceProperties, DeviceRequirements, ThreadWorld
from commref.collectives.device_api import requirements
from commref.transports.errors import CapabilityError
from commref.transports.nodes import NODES_ENV

BASE = dict(window_bytes=64, device="cpu")


def _refused(reqs, error, match, ranked=True, **options):
    """Every rank's creation with `reqs` raises `error` matching `match` (after "rank r: "
    where `ranked`: backend selection's own message names no rank)."""

    def body(world):
        with pytest.raises(error, match=(rf"^rank {world.rank}: " if ranked else "^") + match):
            DeviceComm(world, requirements=reqs, **BASE, **options)
        return True

    assert ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT) == [True, True]


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("barriers", 2, r"2 world barriers \(barrier\(\)\) required; the device API offers 1 "),
        ("lsa_barriers", 3, r"3 LSA barriers \(lsaBarrier\(\)\) required; the device API offers 1 "),
        ("rail_barriers", 2, r"2 rail barriers \(railBarrier\(\)\) required; the device API offers 1 "),
        ("hybrid_barriers", 2, r"2 hybrid barriers \(hybridBarrier\(\)\) required; the device API offers 1 "),
    ],
)
def test_what_the_device_api_does_not_offer_is_refused(field, value, match):
    _refused(DeviceRequirements(**{field: value}), CapabilityError, match, path="gin")


@pytest.mark.parametrize("path", ["lsa", "gin"])
def test_what_the_device_api_offers_is_accepted(path):
    """Requirements within what device.h offers (a multimem handle, one barrier of each
    offered kind) make a communicator on every rank."""
    reqs = DeviceRequirements(multimem=True, barriers=1, lsa_barriers=1)

    def body(world):
        dc = DeviceComm(world, requirements=reqs, path=path, **BASE)
        ok = dc.properties().multimem
        dc.close()
        return ok

    assert ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT) == [True, True]


def test_a_queue_deeper_than_the_gin_queue_asked_for_is_refused():
    _refused(
        DeviceRequirements(queue_depth=512),
        CapabilityError,
        r"queue depth 512 required, but gin_queue=300 was asked for",
        path="gin",
        gin_queue=300,
    )


def test_strong_signals_on_a_weak_only_backend_are_refused():
    _refused(
        DeviceRequirements(strong_signals=True),
        CapabilityError,
        r"no GIN backend meets the requirements: gda lacks strong signals$",
        ranked=False,
        path="gin",
        backend="gda",
    )


def test_more_signals_and_counters_than_the_backend_holds_are_refused():
    _refused(
        DeviceRequirements(signals=500, counters=20, strong_signals=False),
        CapabilityError,
        r"no GIN backend meets the requirements: gda lacks \d+ signals\+counters \(at most 512\)$",
        ranked=False,
        path="gin",
        backend="gda",
    )


def test_va_signals_on_a_backend_without_them_are_refused():
    """VA signals (strict ordering, which they imply): a backend without them (gda) is
    refused at backend selection, and one with them (proxy) is not."""
    assert requirements.USER_VA_SIGNALS
    reqs = DeviceRequirements(va_signals=True, strong_signals=False)
    refusal = r"no GIN backend meets the requirements: gda lacks VA signals"
    _refused(reqs, CapabilityError, refusal, False, path="gin", backend="gda")

    def body(world):
        with DeviceComm(world, requirements=reqs, path="gin", backend="proxy", **BASE) as dc:
            return dc.properties().va_signals

    assert ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT) == [True, True]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(contexts=5), r"contexts must be an integer from 1 to 4, not 5"),
        (dict(contexts=0), r"contexts must be an integer from 1 to 4, not 0"),
        (dict(signals=-1), r"signals must be a non-negative integer, not -1"),
        (dict(queue_depth=1.5), r"queue_depth must be a non-negative integer, not 1.5"),
        (dict(multimem=1), r"multimem must be True or False, not 1"),
    ],
)
def test_bad_requirements_are_refused_when_stated(kwargs, match):
    with pytest.raises(ValueError, match=rf"^{match}$"):
        DeviceRequirements(**kwargs)


def test_requirements_and_the_same_keywords_together_are_refused():
    def body(world):
        with pytest.raises(ValueError, match=r"^signals, contexts: state them in requirements, not beside it$"):
            DeviceComm(world, requirements=DeviceRequirements(), signals=2, contexts=2, **BASE)
        with pytest.raises(TypeError, match=r"^requirements must be a DeviceRequirements, not dict$"):
            DeviceComm(world, requirements={"signals": 2}, **BASE)

    ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)


def _properties(nranks, reqs, **options) -> list[DeviceProperties]:
    def body(world):
        with DeviceComm(world, requirements=reqs, **BASE, **options) as dc:
            return dc.properties()

    return ThreadWorld.run(nranks, body, timeout=WORLD_TIMEOUT)


def test_properties_of_an_lsa_communicator():
    reqs = DeviceRequirements(barriers=1, lsa_barriers=1, signals=3, counters=2, contexts=2)
    props = _properties(2, reqs, path="lsa")
    assert [p.rank for p in props] == [0, 1]
    p = props[1]
    assert (p.gin_backend, p.gin_engine, p.wire, p.queue_depth) == (None, None, None, 0)
    assert (p.lsa_rank, p.lsa_size, p.lsa_teams, p.nranks, p.device) == (1, 2, 1, 2, "cpu")
    assert (p.signals, p.counters, p.contexts) == (3, 2, 2)
    assert p.strong_signals and p.counted_writes and p.multimem and not p.va_signals
    assert (p.barriers, p.lsa_barriers, p.rail_barriers, p.hybrid_barriers) == (1, 1, 1, 1)


@pytest.mark.parametrize(
    "options, backend, engine, strong, ordering",
    [
        (dict(wire="ordered", backend="proxy"), "proxy", "native", True, False),
        (dict(wire="unordered", backend="gda"), "gda", "native", False, True),
    ],
)
def test_properties_of_a_gin_communicator(options, backend, engine, strong, ordering):
    reqs = DeviceRequirements(strong_signals=strong, queue_depth=1000, contexts=3)
    p = _properties(2, reqs, path="gin", **options)[0]
    assert (p.gin_backend, p.gin_engine, p.wire) == (backend, engine, options["wire"])
    assert p.strong_signals == strong and p.local_completion_orders_later_writes == ordering
    assert p.counters_supported and p.get_supported and p.multimem
    assert p.queue_depth == 1000 and p.contexts == 3
    assert (p.lsa_size, p.lsa_teams) == (1, 2)  # path gin: every peer over GIN, a team of one each


def test_properties_on_simulated_nodes(monkeypatch):
    """4 ranks on 2 simulated nodes, path auto: LSA teams of 2, 2 of them, GIN between
    (backend auto: rc, the first with strong signals on the ordered wire)."""
    monkeypatch.setenv(NODES_ENV, "2")
    props = _properties(4, DeviceRequirements(), path="auto")
    assert [(p.lsa_rank, p.lsa_size, p.lsa_teams) for p in props] == [(0, 2, 2), (1, 2, 2), (0, 2, 2), (1, 2, 2)]
    assert {p.gin_backend for p in props} == {"rc"} and all(p.strong_signals for p in props)
