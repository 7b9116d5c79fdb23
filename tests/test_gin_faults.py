"""A lossy link under the GIN wires and the reliability layer above it
(transports/gin/faults.py).

- the fault spec: parsed from the CLI's words, bad values refused in one line, and
  refused where it cannot run (the native engine, beside the wire model);
- the layer alone, over a recording wire: under heavy loss, duplication and delay each
  link's landings reach the wire exactly once each, in the order sent, and the counts
  add up (every drop retransmitted, every duplicate dropped);
- the collectives over GIN with faults on, both wires: exact, with retransmissions and
  dropped duplicates counted; the conformance replay of the scheduler's trace holds
  and the wire's log shows that is the order things landed in;
- a planted bug (duplicates let through) corrupts, so the duplicate detection matters;
- the ordering study's stress with faults agrees with the exhaustive matrix;
- `commref check` with `--fault` under mpiexec prints the counts, 0 wrong.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import clean_env, run_mpi
from helpers import CHECK_MODULE, WORLD_TIMEOUT, assert_check_clean, fault_counts, traced_sweep

from commref.collectives import check
from commref.collectives.communicator import Communicator
from commref.transports.errors import CapabilityError, CommAborted, CommMismatch, CommTimeout
from commref.transports.gin import faults
from commref.transports.gin.faults import FaultSpec, ReliableWire
from commref.transports.gin.options import GinOptions
from commref.transports.gin.replay import replay_trace
from commref.transports.gin.wires import Wire
from commref.transports.option_types import OptionError
from commref.transports.thread_world import ThreadWorld

FAULTS = "drop=0.05,dup=0.05,delay=0.05"


def test_fault_spec_parses_the_cli_words_and_refuses_bad_ones():
    assert FaultSpec.parse(FAULTS) == FaultSpec(0.05, 0.05, 0.05)
    assert FaultSpec.parse("dup=0.2") == FaultSpec(dup=0.2) and str(FaultSpec(dup=0.2)) == "dup=0.2"
    assert not FaultSpec.parse("none").active and str(FaultSpec()) == "none"
    for bad, message in [
        ("drop=1", "fault drop must be a probability in [0, 1), not 1.0"),
        ("drip=0.1", "fault must look like drop=0.05,dup=0.05,delay=0.05"),
        ("delay=soon", "fault delay must be a probability in [0, 1), not 'soon'"),
    ]:
        with pytest.raises(OptionError, match=re.escape(message)):
            FaultSpec.parse(bad)
    with pytest.raises(OptionError, match="faults on the ordered wire in the Python proxy: choose one"):
        GinOptions(fault=FAULTS, wire="ordered", wire_rate="1G")
    assert GinOptions(fault=FAULTS, wire="unordered", wire_rate="1G").wire_modeled  # both native there


class Recording(Wire):
    """A wire that records each landing."""

    name = "recording"

    def __init__(self):
        self.landed = []

    def land_data(self, peer, offset, data, ctx=0):
        self.landed.append(((peer, ctx), ("data", offset, bytes(data))))

    def signal(self, peer, sig, ctx=0):
        self.landed.append(((peer, ctx), ("signal", sig)))


def test_every_packet_lands_once_in_order_under_heavy_faults():
    inner, stats = Recording(), {}
    wire = ReliableWire(inner, FaultSpec(drop=0.3, dup=0.3, delay=0.3), seed=3, rank=0, stats=stats)
    wire.log = []
    sent: dict = {}
    for i in range(400):
        peer, ctx = 1 + i % 2, i % 3
        if i % 4 == 3:
            wire.signal(peer, ("sig", i), ctx)
            sent.setdefault((peer, ctx), []).append(("signal", ("sig", i)))
        else:
            data = np.full(16, i % 251, np.uint8)
            wire.land_data(peer, 64 * i, data, ctx)
            data[:] = 0  # the layer copied it when it was sent
            sent.setdefault((peer, ctx), []).append(("data", 64 * i, bytes(np.full(16, i % 251, np.uint8))))
    deadline = time.monotonic() + 10
    while (wire.in_flight() or wire.arriving) and time.monotonic() < deadline:
        wire.progress()
        time.sleep(1e-4)
    assert wire.drained() and not wire.arriving
    for link, packets in sent.items():  # per (peer, context): the order sent, once each
        assert [x for k, x in inner.landed if k == link] == packets, link
    assert len(inner.landed) == 400
    by_link: dict = {}
    for peer, ctx, seq in wire.log:
        by_link.setdefault((peer, ctx), []).append(seq)
    assert all(seqs == list(range(len(seqs))) for seqs in by_link.values()) and len(wire.log) == 400
    assert stats["packets"] == 400 and stats["dropped"] > 50 and stats["duplicated"] > 50 and stats["delayed"] > 50
    assert stats["retransmits"] >= stats["dropped"] and stats["dup_dropped"] >= stats["duplicated"]


def _sweep(world, opts, dtypes, ops, counts):
    with Communicator(world, "cpu", path="gin", **{"timeout": WORLD_TIMEOUT, **opts}) as comm:
        cases = check.cases(
            ["allreduce", "allgather", "reduce_scatter", "broadcast"],
            dtypes,
            ops,
            [],
            counts,
            world.size,
            11,
            direct=False,
        )
        wrong = check.run_sweep(comm, cases)
        return len(cases), sum(wrong), dict(comm.proxy.stats)


@pytest.mark.parametrize(
    "opts",
    [
        dict(wire="unordered", backend="proxy"),
        dict(wire="ordered", backend="rc"),
        dict(wire="unordered", backend="gda", gin_protocol="signal-per-put", max_channels=2, slot_bytes=512),
    ],
)
def test_collectives_over_a_lossy_wire_are_exact(opts):
    results = ThreadWorld.run(
        3,
        _sweep,
        dict(opts, fault=FAULTS, seed=11),
        ["float32", "int8"],
        ["sum", "max"],
        [0, 1, 7, 3001],
        timeout=WORLD_TIMEOUT * 3,
    )
    ncases, wrong, _ = results[0]
    total = {k: sum(r[2][k] for r in results) for k in faults.STATS}
    assert ncases > 50 and wrong == 0, (opts, wrong)
    assert total["retransmits"] > 0 and total["dup_dropped"] > 0 and total["delayed"] > 0, total


def test_conformance_holds_with_faults_and_the_wire_lands_in_the_scheduled_order(monkeypatch):
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "python")
    logs: dict = {}  # rank -> its wire's landing log
    original = ReliableWire.__init__

    def logged(self, *a, **k):
        original(self, *a, **k)
        self.log = logs.setdefault(self.rank, [])

    monkeypatch.setattr(ReliableWire, "__init__", logged)
    results = ThreadWorld.run(
        2, lambda world: traced_sweep(world, 3, 30.0, backend="proxy", wire="unordered", fault=FAULTS), timeout=120
    )
    for rank, (trace, wrong, _) in enumerate(results):
        counts = replay_trace(trace, "proxy", "unordered")
        assert wrong == 0 and counts["seg"] > 100 and counts["signal"] > 20, counts
        by_link: dict = {}
        for peer, ctx, seq in logs[rank]:
            by_link.setdefault((peer, ctx), []).append(seq)
        # Every packet once, in the order the scheduler sent it: the landed order is the traced one.
        assert by_link and all(s == list(range(len(s))) for s in by_link.values())
        scheduled = sum(1 for records in trace.values() for r in records if r[0] in ("seg", "signal"))
        assert len(logs[rank]) == scheduled


def test_letting_duplicates_through_corrupts(monkeypatch):
    """The planted bug: the receiver's duplicate detection removed, so a duplicated
    signal counts twice; a step then reads a slot whose data has not landed."""
    original = ReliableWire._arrive

    def no_dedup(self, peer, ctx, seq, packet):
        link = self.links[(peer, ctx)]
        if seq < link.next_due:  # a duplicate of a delivered packet: land it again
            kind, *rest = packet
            (self.inner.land_data if kind == "data" else self.inner.signal)(peer, *rest, ctx)
            return 1
        return original(self, peer, ctx, seq, packet)

    monkeypatch.setattr(ReliableWire, "_arrive", no_dedup)
    try:
        results = ThreadWorld.run(
            3, _sweep, dict(wire="ordered", fault="dup=0.3", timeout=5.0), ["int32"], ["sum"], [3001], timeout=30
        )
        failed = sum(r[1] for r in results) > 0
    except (CommMismatch, CommTimeout, CommAborted) as e:  # a double-counted credit or ready signal
        failed = e
    assert failed


def test_study_stress_with_faults_agrees_with_the_matrix():
    from commref.transports.gin.study import signaling as pr
    from commref.transports.gin.study.stress import run_stress

    cells = run_stress(
        [pr.PROTOCOL_BY_NAME[n] for n in ("last-put", "ll-flag-8B")],
        None,
        None,
        (2, 2),
        seeds=2,
        messages=2,
        faults=FaultSpec.parse(FAULTS),
    )
    assert cells and all(c.agrees for c in cells), [c.key() for c in cells if not c.agrees]
    assert sum(c.orders_checked for c in cells) > 0 and sum(c.orders_disallowed for c in cells) == 0
    assert any(c.corrupted for c in cells if c.verdict == "unsafe")


def test_the_native_engine_refuses_a_lossy_ordered_wire(monkeypatch):
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "native")

    def body(world):
        with pytest.raises(CapabilityError, match=r"the native GIN engine cannot carry a lossy ordered wire \(fault"):
            Communicator(world, "cpu", path="gin", wire="ordered", fault=FAULTS, timeout=WORLD_TIMEOUT)

    ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)


def test_cli_refuses_a_bad_fault_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "commref.cli", "check", "--np", "2", "--path", "gin", "--fault", "drop=1.5"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "commref check: error: argument --fault: fault drop must be a probability in [0, 1), not 1.5"
    ), proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("wire", [["--wire", "unordered"], ["--wire", "ordered", "--backend", "rc"]])
def test_check_with_faults_under_mpiexec(wire, shm_leak_check):
    args = [
        *CHECK_MODULE,
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "--path",
        "gin",
        *wire,
        "--fault",
        FAULTS,
        "--seed",
        "11",
        "--dtype",
        "float32",
        "int8",
        "--count",
        "0",
        "1",
        "7",
        "3001",
    ]
    proc = run_mpi(3, args, timeout=180, module=True, env=clean_env())
    assert_check_clean(proc)
    spec, (packets, dropped, duplicated, delayed, retransmitted, dup_dropped) = fault_counts(proc.stdout)
    assert spec == "drop=0.05,dup=0.05,delay=0.05, seed 11", spec
    assert packets > 1000 and retransmitted >= dropped > 0 and dup_dropped >= duplicated > 0 and delayed > 0
