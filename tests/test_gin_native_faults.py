"""The native engine's lossy link and reliability layer (transports/gin/native_engine/lossy.h)
under its unordered wire.

- which engine serves a lossy wire: the native one on the unordered wire, the Python
  proxy on the ordered one (and COMMREF_GIN_ENGINE=native refuses that in one line);
- conformance: the collectives over the native unordered wire with faults, 2 and 3
  ranks (network shm), each link's trace replayed against semantics.enabled(), exact,
  with drops, duplicates, delays, retransmissions and dropped duplicates counted;
- a planted bug (native.PLANT_NO_DEDUP: a duplicate of a delivered packet lands again)
  breaks collectives that are exact without it;
- a packet the link always drops fails the engine at its retry budget with a message
  naming rank, peer, context and what was expected, well inside the deadline;
- under mpiexec: `commref check` with `--fault` on the unordered wire, networks shm and
  mpi, 0 wrong, on the native engine; and each rank's trace replayed on both networks.
"""

from __future__ import annotations

import os
import re
import sys
import time

import pytest
from conftest import clean_env, run_mpi
from helpers import CHECK_MODULE, WORLD_TIMEOUT, assert_check_clean, fault_counts, traced_sweep

from commref import Communicator
from commref.transports.errors import CapabilityError, CommrefError
from commref.transports.gin import faults
from commref.transports.gin import native as nat
from commref.transports.gin.native import NativeProxy
from commref.transports.gin.proxy import GinProxy
from commref.transports.gin.replay import replay_trace
from commref.transports.gin.wires import ProxyError
from commref.transports.thread_world import ThreadWorld

FAULTS = "drop=0.05,dup=0.05,delay=0.05"


def _engine_of(world, **opts):
    with Communicator(world, "cpu", path="gin", timeout=WORLD_TIMEOUT, **opts) as comm:
        return type(comm.proxy)


def test_a_lossy_unordered_wire_runs_native_and_an_ordered_one_python(monkeypatch):
    monkeypatch.delenv("COMMREF_GIN_ENGINE", raising=False)
    assert ThreadWorld.run(2, _engine_of, wire="unordered", fault=FAULTS)[0] is NativeProxy
    assert ThreadWorld.run(2, _engine_of, wire="ordered", backend="rc", fault=FAULTS)[0] is GinProxy
    monkeypatch.setenv("COMMREF_GIN_ENGINE", "native")

    def body(world):
        with pytest.raises(CapabilityError, match=r"cannot carry a lossy ordered wire \(fault"):
            Communicator(world, "cpu", path="gin", wire="ordered", fault=FAULTS, timeout=WORLD_TIMEOUT)

    ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)


def _traced_faulty_sweep(world, seed, timeout, fault, backend, protocol, count=3001, slot_bytes=1024, network="shm"):
    """The collectives but alltoall (float32 sum, out of place) over the native unordered
    wire with `fault` on `network`, traced: (trace, wrong elements here, the engine's stats)."""
    proxies = []

    def native_only(comm):
        assert isinstance(comm.proxy, NativeProxy)
        proxies.append(comm.proxy)

    trace, wrong, _ = traced_sweep(
        world,
        seed,
        timeout,
        count,
        slot_bytes,
        256,
        collectives=["allreduce", "allgather", "reduce_scatter", "broadcast", "reduce"],
        on_comm=native_only,
        network=network,
        wire="unordered",
        backend=backend,
        gin_protocol=protocol,
        fault=fault,
    )
    return trace, wrong, proxies[0].stats


@pytest.mark.parametrize(
    "nranks, backend, protocol", [(2, "proxy", "strong"), (3, "proxy", "strong"), (2, "gda", "signal-per-put")]
)
def test_native_lossy_wire_conforms_and_is_exact(nranks, backend, protocol, native):
    results = ThreadWorld.run(nranks, _traced_faulty_sweep, 5, 30.0, FAULTS, backend, protocol, timeout=120)
    total = faults.totals([stats for _, _, stats in results])
    replayed: dict = {}
    for trace, wrong, _ in results:
        assert wrong == 0, wrong
        for key, n in replay_trace(trace, backend, "unordered", 256).items():
            replayed[key] = replayed.get(key, 0) + n
    assert replayed["seg"] > 100 and replayed["signal"] > 20, replayed
    assert total["packets"] >= replayed["seg"] + replayed["signal"] - replayed.get("dup", 0), (total, replayed)
    assert total["dropped"] > 0 and total["retransmits"] >= total["dropped"], total
    assert total["duplicated"] > 0 and total["dup_dropped"] >= total["duplicated"] and total["delayed"] > 0, total


def _outcome(seed, timeout, fault):
    """None when 2 ranks' collectives are exact; else what broke."""
    try:
        results = ThreadWorld.run(
            2, _traced_faulty_sweep, seed, timeout, fault, "proxy", "strong", 3001, 1024, timeout=30
        )
    except CommrefError as e:
        return type(e).__name__
    return "wrong elements" if sum(w for _, w, _ in results) else None


def test_planted_duplicate_landing_breaks_the_collectives(native, monkeypatch):
    """Without duplicate suppression a duplicated signal counts twice (a credit or a ready
    signal ahead of its data): at least half the seeds fail, all exact without the plant."""
    failed = {}
    for seed in range(4):
        monkeypatch.setattr(nat, "PLANT", 0)
        assert _outcome(seed, 30.0, "dup=0.2") is None, seed
        monkeypatch.setattr(nat, "PLANT", nat.PLANT_NO_DEDUP)
        kind = _outcome(seed, 1.0, "dup=0.2")
        if kind is not None:
            failed[seed] = kind
    assert len(failed) >= 2, f"the planted duplicate landing broke only seeds {failed}"


def test_an_undeliverable_packet_fails_naming_rank_peer_and_what_was_expected(native, monkeypatch):
    """drop=0.99: some packet is dropped at every one of its FAULT_TRANSMISSIONS
    transmissions (probability 0.99**64 per packet); the engine fails at its retry
    budget, long before the 30 s deadline, saying which packet of which link."""
    t0 = time.monotonic()
    with pytest.raises(ProxyError) as caught:
        ThreadWorld.run(2, _traced_faulty_sweep, 1, 30.0, "drop=0.99", "proxy", "strong", timeout=60)
    assert time.monotonic() - t0 < 20
    text = str(caught.value)
    assert re.search(
        r"rank \d: lossy GIN wire: packet \d+ to peer \d on context \d+ is undeliverable \(expected its "
        r"acknowledgement, seen none after 64 transmissions",
        text,
    ), text


@pytest.mark.mpi
@pytest.mark.parametrize("np_, network", [(2, "shm"), (3, "shm"), (2, "mpi")])
def test_check_with_faults_on_the_native_engine_under_mpiexec(np_, network, shm_leak_check):
    args = [
        *CHECK_MODULE,
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "--path",
        "gin",
        "--wire",
        "unordered",
        "--network",
        network,
        "--fault",
        FAULTS,
        "--seed",
        "11",
        "--dtype",
        "float32",
        "--count",
        "0",
        "7",
        "3001",
    ]
    proc = run_mpi(np_, args, timeout=180, module=True, env=clean_env(COMMREF_GIN_ENGINE="native"))
    assert_check_clean(proc)
    _, (packets, dropped, duplicated, delayed, retransmitted, dup_dropped) = fault_counts(proc.stdout)
    assert packets > 500 and retransmitted >= dropped > 0 and dup_dropped >= duplicated > 0 and delayed > 0


@pytest.mark.mpi
def test_native_lossy_wire_conforms_under_mpiexec(shm_leak_check):
    """2 MPI processes, networks shm and mpi: this file is the job's script; each rank
    replays its own trace of the collectives over the lossy unordered wire."""
    script = os.path.relpath(__file__, os.path.dirname(os.path.dirname(__file__)))
    proc = run_mpi(2, [script], timeout=120, env=clean_env(COMMREF_GIN_ENGINE="native"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = re.findall(r"rank (\d) network (\S+): conforms, (\d+) segments, wrong 0, (\d+) retransmitted", proc.stdout)
    assert len(lines) == 4 and {m[1] for m in lines} == {"shm", "mpi"}, proc.stdout[-4000:]
    assert all(int(m[2]) > 100 and int(m[3]) > 0 for m in lines), lines


def _mpi_main() -> None:
    from commref.transports.mpi_world import MPIWorld

    world = MPIWorld()
    for network in ("shm", "mpi"):
        trace, wrong, stats = _traced_faulty_sweep(world, 3, 30.0, FAULTS, "proxy", "strong", network=network)
        counts = replay_trace(trace, "proxy", "unordered", 256)  # raises Disallowed: the job fails
        print(
            f"rank {world.rank} network {network}: conforms, {counts['seg']} segments, wrong {wrong}, "
            f"{stats['retransmits']} retransmitted",
            flush=True,
        )


if __name__ == "__main__":
    _mpi_main()
    sys.exit(0)
