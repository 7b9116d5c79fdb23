"""GIN backend selection: the capability table, the priority order, the
refusals that name what is missing, bad options, and gda's limit of 512 signals +
counters per device, checked at setup.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WORLD_TIMEOUT, close_after_barrier, gin_comm

from commref.device_kernels import abi
from commref.transports.errors import CapabilityError
from commref.transports.gin.backends import BACKENDS, PRIORITY, Requirements, capability_table, select_backend
from commref.transports.thread_world import ThreadWorld

# ---------------------------------------------------------------------------------------
# backend selection
# ---------------------------------------------------------------------------------------


def test_priority_and_capabilities():
    assert PRIORITY == ("gda", "rc", "proxy")
    rows = {r["backend"]: r for r in capability_table()}
    assert list(rows) == list(PRIORITY)
    assert rows["gda"]["strong_signals"] is False and rows["gda"]["va_signals"] is False
    assert rows["gda"]["max_signals_counters"] == 512 and rows["gda"]["signals_count_writes"] is True
    assert rows["gda"]["local_completion_orders_later_writes"] is True
    assert rows["rc"]["wires"] == ("ordered",) and rows["rc"]["flushes_all_puts_on_any_signal"] is True
    assert BACKENDS["rc"].strong_always and not BACKENDS["proxy"].strong_always
    assert rows["proxy"]["strong_signals"] and rows["proxy"]["va_signals"] and rows["proxy"]["get"]
    assert rows["proxy"]["wires"] == ("ordered", "unordered")


@pytest.mark.parametrize(
    "req, expected",
    [
        (Requirements(), "gda"),
        (Requirements(wire="unordered"), "gda"),
        (Requirements(strong_signals_required=True), "rc"),
        (Requirements(strong_signals_required=True, wire="unordered"), "proxy"),
        (Requirements(va_signals_required=True), "rc"),
        (Requirements(va_signals_required=True, wire="unordered"), "proxy"),
        (Requirements(counters=True, get=True), "gda"),
        (Requirements(signals_counters=512), "gda"),
        (Requirements(signals_counters=513), "rc"),
        (Requirements(signals_counters=513, wire="unordered"), "proxy"),
        (Requirements(flush_orders_later_writes=True, wire="unordered"), "gda"),
    ],
)
def test_select_backend_falls_back_in_priority_order(req, expected):
    assert select_backend(req).name == expected
    assert select_backend(req, expected).name == expected


@pytest.mark.parametrize(
    "req, backend, words",
    [
        (Requirements(strong_signals_required=True), "gda", ["gda lacks strong signals"]),
        (Requirements(va_signals_required=True), "gda", ["gda lacks VA signals"]),
        (Requirements(signals_counters=513), "gda", ["gda lacks 513 signals+counters (at most 512)"]),
        (Requirements(wire="unordered"), "rc", ["rc lacks the unordered wire (runs on ordered only)"]),
        (Requirements(flush_orders_later_writes=True), "proxy", ["proxy lacks local completion ordering later writes"]),
        (
            Requirements(strong_signals_required=True, flush_orders_later_writes=True, wire="unordered"),
            "auto",
            # rc's signals are all strong, which makes flush-then-signal safe: it lacks only the wire.
            [
                "gda lacks strong signals",
                "rc lacks the unordered wire",
                "proxy lacks local completion ordering later writes",
            ],
        ),
    ],
)
def test_select_backend_names_what_is_missing(req, backend, words):
    with pytest.raises(CapabilityError) as e:
        select_backend(req, backend)
    msg = str(e.value)
    assert msg.startswith("no GIN backend meets the requirements: ")
    for w in words:
        assert w in msg, msg


def test_select_backend_unknown_name():
    with pytest.raises(ValueError, match="unknown GIN backend 'ib'"):
        select_backend(Requirements(), "ib")


@pytest.mark.parametrize(
    "opts, match",
    [
        (dict(backend="gda", gin_protocol="strong"), "gda lacks strong signals"),
        (dict(backend="rc", wire="unordered"), "rc lacks the unordered wire"),
    ],
)
def test_communicator_fails_at_setup_naming_the_capability(opts, match):
    def fn(world):
        gin_comm(world, path="gin", max_channels=1, slot_bytes=256, **opts)

    with pytest.raises(CapabilityError, match=match):
        ThreadWorld.run(2, fn, timeout=WORLD_TIMEOUT)


@pytest.mark.parametrize(
    "opts, match",
    [
        (dict(path="nvlink"), "path must be"),
        (dict(wire="fifo"), "wire must be"),
        (dict(network="ib"), "network must be"),
        (dict(gin_protocol="weak"), "gin_protocol must be"),
        (dict(gin_queue=0), "gin_queue must be"),
        (dict(network="mpi"), "network 'mpi' needs an MPI world"),
    ],
)
def test_bad_gin_options(opts, match):
    def fn(world):
        gin_comm(world, **{"path": "gin", **opts})

    with pytest.raises((ValueError, CapabilityError), match=match):
        ThreadWorld.run(2, fn, timeout=WORLD_TIMEOUT)


# ---------------------------------------------------------------------------------------
# gda limit: at most 512 signals + counters per device, checked at setup
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("channels, nsteps", [(1, 4), (3, 2)])
def test_gda_signal_limit(channels, nsteps):
    nsignals = abi.gin_signals(channels + abi.p2p_channels(2), nsteps)[1]  # the window's p2p channels too
    nsignals += 1 * 1 * 2  # the host one-sided calls' words: rma_contexts x rma_signals x ranks (defaults)
    assert nsignals < 512

    def fn(world, counters):
        comm = gin_comm(
            world,
            path="gin",
            backend="gda",
            gin_protocol="signal-per-put",
            max_channels=channels,
            nsteps=nsteps,
            slot_bytes=256,
            gin_counters=counters,
        )
        x = np.arange(300, dtype=np.float32) * (world.rank + 1)
        y = np.empty_like(x)
        comm.allreduce(x, y)
        close_after_barrier(world, comm)
        return comm.backend.name, bool((y == np.arange(300, dtype=np.float32) * 3).all())

    assert ThreadWorld.run(2, fn, 512 - nsignals, timeout=WORLD_TIMEOUT) == [("gda", True)] * 2
    with pytest.raises(CapabilityError, match=r"gda lacks 513 signals\+counters \(at most 512\)"):
        ThreadWorld.run(2, fn, 513 - nsignals, timeout=WORLD_TIMEOUT)
