"""The LL and LL128 protocols beside Simple (include/commref/proto.h).

- Sweeps: every ring and tree collective in each protocol on ThreadWorld ranks, with FIFO
  geometries small enough that a call takes many steps and wraps the slots, over LSA and
  over GIN (ordered wire: the native engine; unordered: the Python proxy).
- Ranks that disagree on the protocol fail with CommMismatch (the call descriptor
  carries it), over LSA and GIN; a missing peer ends an LL wait at its deadline with
  rank, peer, expected and seen.
- What each protocol relies on: the CPU engine refuses LL without single-copy atomic
  16-byte accesses; GIN accepts a protocol exactly where the ordering study proves the
  cell that models the wire safe (the explorer is run here for those cells); GPUs
  refuse LL128 where NVLink is not established.
- Options: COMMREF_PROTO, the tuner's choice by size, direct kernels have no protocol.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import GEOMETRIES, QUICK_BENCH, WORLD_TIMEOUT, bench_args, check_summary

from commref.collectives import calibration, check, model, protocols, tuner
from commref.collectives.catalogue import KERNEL_NAMES as COLLECTIVES
from commref.collectives.communicator import Communicator
from commref.collectives.options import CommOptions
from commref.device_kernels import abi, cpu_loader
from commref.transports.errors import CapabilityError, CommMismatch, CommTimeout
from commref.transports.gin import semantics
from commref.transports.gin.atomics import host_atomics
from commref.transports.gin.backends import BACKENDS
from commref.transports.gin.options import GinOptions
from commref.transports.gin.plan import GinPlan
from commref.transports.gin.study import explorer
from commref.transports.gin.study import signaling as study
from commref.transports.gin.study.cells import line_cell
from commref.transports.option_types import OptionError
from commref.transports.thread_world import ThreadWorld

LINE_PROTOCOLS = ("ll", "ll128")
DTYPES = ["float32", "bfloat16", "int8", "uint64"]
OPS = ["sum", "prod", "max", "avg"]
# GEOMETRIES' slots of 128 and 256 bytes make LL slots of 64 data bytes and LL128 slots
# of 960, so 1001 and more elements take many steps and wrap the slots.


def _sweep(world, protocol, geometry, counts, colls=tuple(COLLECTIVES), dtypes=tuple(DTYPES), **options):
    threads, channels, slot, nsteps = geometry
    with Communicator(
        world,
        "cpu",
        max_channels=channels,
        slot_bytes=slot,
        nsteps=nsteps,
        threads=threads,
        timeout=WORLD_TIMEOUT,
        **options,
    ) as comm:
        case_list = check.cases(
            list(colls),
            list(dtypes),
            OPS,
            [],
            counts,
            world.size,
            seed=11,
            protocols=[protocol],
            direct=not comm.peer_mask,
        )
        return case_list, check.run_sweep(comm, case_list)


def _assert_exact(results, protocol):
    case_list, wrong = results[0]
    assert all(r[1] == wrong for r in results), "ranks disagree on the per-case totals"
    ran = {(c.coll, c.algorithm) for c in case_list if c.protocol == protocol}
    assert ran >= {
        ("allreduce", "ring"),
        ("allreduce", "tree"),
        ("allgather", "ring"),
        ("reduce_scatter", "ring"),
        ("broadcast", "ring"),
        ("reduce", "ring"),
        ("alltoall", "ring"),
    }, ran
    bad = [(c, w) for c, w in zip(case_list, wrong) if w]
    assert sum(wrong) == 0, f"{len(bad)} failing cases, first: {bad[:5]}"


@pytest.mark.parametrize("protocol", LINE_PROTOCOLS)
@pytest.mark.parametrize(
    "nranks, geometry",
    [
        (1, "1thread-3ch-slot128-2steps"),
        (2, "4fibers-2ch-slot256-4steps"),
        (3, "4fibers-2ch-slot256-4steps"),
        (5, "1thread-3ch-slot128-2steps"),
    ],
)
def test_sweep(protocol, nranks, geometry, many_channels):
    counts = [0, 1, 7, 1001, 3 * 1024 + 5]
    results = ThreadWorld.run(nranks, _sweep, protocol, GEOMETRIES[geometry], counts, timeout=WORLD_TIMEOUT)
    _assert_exact(results, protocol)


@pytest.mark.parametrize("protocol", LINE_PROTOCOLS)
@pytest.mark.parametrize("wire, nranks", [("ordered", 2), ("unordered", 3)])
def test_sweep_over_gin(protocol, wire, nranks):
    """Every peer over GIN (network shm): the proxy lands the staged lines (landLines)
    while the receiver polls them."""
    results = ThreadWorld.run(
        nranks,
        _sweep,
        protocol,
        (1, 2, 256, 4),
        [0, 7, 1001, 5000],
        ("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "alltoall"),
        ("float32", "int8"),
        path="gin",
        wire=wire,
        timeout=WORLD_TIMEOUT,
    )
    _assert_exact(results, protocol)


# ---------------------------------------------------------------------------------------
# disagreement and deadlines
# ---------------------------------------------------------------------------------------


def _mixed(world, protocols_by_rank, algorithm, **options):
    with Communicator(world, "cpu", timeout=5.0, max_channels=1, **options) as comm:
        x = np.ones(300, np.float32)
        y = np.zeros_like(x)
        try:
            comm.allreduce(x, y, algorithm=algorithm, protocol=protocols_by_rank[world.rank])
        except CommMismatch as e:
            return e
        return None


@pytest.mark.parametrize("path", ["lsa", "gin"])
@pytest.mark.parametrize("pair", [("ll", "simple"), ("simple", "ll128"), ("ll", "ll128")])
def test_ranks_that_disagree_on_the_protocol_fail_with_comm_mismatch(pair, path):
    results = ThreadWorld.run(2, _mixed, pair, "ring", path=path, timeout=10.0)
    for rank, e in enumerate(results):
        assert isinstance(e, CommMismatch), f"rank {rank}: {e!r}"
        mine, theirs = pair[rank], pair[1 - rank]
        assert f"protocol is '{mine}' here and '{theirs}' there" in str(e), str(e)


def _absent(world, protocol):
    comm = Communicator(world, "cpu", timeout=1.0, max_channels=1)
    if world.rank == 1:
        return None
    x = np.ones(1000, np.float32)
    try:
        comm.allreduce(x, np.zeros_like(x), algorithm="ring", protocol=protocol)
    except CommTimeout as e:
        return e
    return None


@pytest.mark.parametrize("protocol", LINE_PROTOCOLS)
def test_a_missing_peer_ends_a_line_wait_at_its_deadline(protocol):
    """Rank 0's thread 0 polls rank 1's header lines, which never come: the deadline ends
    the wait with rank, peer, what and the flag expected vs seen."""
    results = ThreadWorld.run(2, _absent, protocol, timeout=10.0)
    e = results[0]
    assert isinstance(e, CommTimeout), repr(e)
    assert (e.rank, e.peer) == (0, 1) and "data of the next step (recv ready)" in str(e), str(e)
    assert (e.expected, e.seen) == (1, 0), str(e)  # the first step's flag; the slot never written


# ---------------------------------------------------------------------------------------
# what each protocol relies on
# ---------------------------------------------------------------------------------------


def test_this_cpu_reports_what_it_guarantees():
    import platform

    support = cpu_loader.cpu_kernels().protocol_support
    if platform.machine() == "x86_64":
        flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
        assert support & abi.CPU_STORE_ORDER
        assert bool(support & abi.CPU_ATOMIC_16) == ("avx" in flags), (support, "avx" in flags)
    assert protocols.cpu_refusals(abi.CPU_ATOMIC_16 | abi.CPU_STORE_ORDER) == {}
    assert "does not enumerate AVX" in protocols.cpu_refusals(abi.CPU_STORE_ORDER, "x86_64")["ll"]
    assert "aarch64" in protocols.cpu_refusals(0, "aarch64")["ll"]


def _without_avx(world):
    with Communicator(world, "cpu", timeout=5.0) as comm:
        x = np.ones(16, np.float32)
        comm.allreduce(x, np.zeros_like(x), algorithm="ring")  # auto's protocol, as planned
        picked = comm.planned("allreduce", x.size)[-1]
        try:
            comm.allreduce(x, np.zeros_like(x), protocol="ll")
        except CapabilityError as e:
            return picked.protocol, str(e)
    return picked.protocol, None


def test_a_cpu_without_atomic_16_byte_accesses_refuses_ll(monkeypatch):
    monkeypatch.setattr(cpu_loader.CpuKernels, "protocol_support", property(lambda self: abi.CPU_STORE_ORDER))
    # Hops so slow that the model has auto take LL (it saves part of each) for this call.
    monkeypatch.setattr(calibration, "REFERENCE", calibration.REFERENCE.replace(hop_s=1e-3))
    with pytest.raises(CapabilityError, match="protocol 'll' cannot run on this communicator: rank 0: LL needs"):
        ThreadWorld.run(2, lambda w: Communicator(w, "cpu", protocol="ll"), timeout=10.0)
    for picked, error in ThreadWorld.run(2, _without_avx, timeout=10.0):
        assert picked != "ll"
        assert error and "single-copy atomic" in error and "AVX" in error, error


# The cell of the ordering study that models each (protocol, wire, segment bytes), worked
# out by hand from how the proxies land a segment (landLines: 16-byte lines whole, in
# ascending order; docs/ordering.md, "What GIN carries: LL and LL128 over the runtime's wires").
WIRES = {
    "ordered": semantics.ORDERED,
    "unordered": semantics.UNORDERED,
    "unordered, flush orders": semantics.Transport("unordered", ordered=False, flush_orders_later_writes=True),
}
EXPECTED_CELLS = {
    ("ll", "ordered", 4096): ("ll-flag", "ordered"),
    ("ll", "ordered", 8): ("ll-flag-8B", "ordered"),
    ("ll128", "ordered", 24): ("ll-flag-8B", "ordered"),
    ("ll", "unordered", 4096): ("ll-flag", "unordered+block128"),
    ("ll128", "unordered", 4096): ("ll-flag-8B", "unordered+block128"),
    ("ll", "unordered", 64): ("ll-flag", "unordered"),
    ("ll128", "unordered", 64): ("ll-flag-8B", "unordered"),
    ("ll", "unordered", 24): ("ll-flag-8B", "unordered"),
    ("ll", "unordered", 8): ("ll-flag-8B", "unordered"),
    ("ll128", "unordered, flush orders", 64): ("ll-flag-8B", "unordered+flush_orders"),
    ("ll", "unordered, flush orders", 16): ("ll-flag", "unordered+flush_orders"),
    ("ll128", "unordered, flush orders", 256): ("ll-flag-8B", "unordered+block128"),
    ("ll", "unordered", 100): None,  # a line may be cut at any byte: no cell
    ("ll128", "ordered", 12): None,
}


@pytest.mark.parametrize("protocol, wire, segment_bytes", list(EXPECTED_CELLS))
def test_gin_accepts_a_protocol_where_the_study_proves_its_cell_safe(protocol, wire, segment_bytes):
    cell = EXPECTED_CELLS[protocol, wire, segment_bytes]
    assert line_cell(protocol, WIRES[wire], segment_bytes) == cell
    plan = GinPlan(
        GinOptions(path="gin", segment_bytes=segment_bytes),
        peer_mask=2,
        backend=BACKENDS["proxy"],
        transport=WIRES[wire],
        network="shm",
    )
    why = plan.protocol_refusal(protocol, "cpu", abi.CPU_ATOMIC_16 | abi.CPU_STORE_ORDER)
    if cell is None:
        assert why and "no cell of the ordering study" in why, why
        return
    row, column = cell
    verdict = explorer.run_cell(study.PROTOCOL_BY_NAME[row], None, study.MODEL_BY_NAME[column])
    assert (why is None) == verdict.safe, (cell, verdict.verdict, why)
    if why:
        assert f"the ordering study finds {row} on {column} unsafe" in why, why


def test_the_study_cells_the_runtime_relies_on_have_both_verdicts():
    """Without it the test above could pass on a table of accepted cells only."""
    verdicts = {}
    for cell in filter(None, EXPECTED_CELLS.values()):
        verdicts[cell] = explorer.run_cell(study.PROTOCOL_BY_NAME[cell[0]], None, study.MODEL_BY_NAME[cell[1]]).safe
    assert verdicts[("ll-flag", "unordered")] and verdicts[("ll-flag-8B", "unordered+block128")]
    assert not verdicts[("ll-flag-8B", "unordered")] and not verdicts[("ll-flag-8B", "unordered+flush_orders")]


def test_gin_refuses_where_no_cell_applies():
    plan = GinPlan(
        GinOptions(path="gin"), peer_mask=2, backend=BACKENDS["proxy"], transport=semantics.ORDERED, network="shm"
    )
    everything = abi.CPU_ATOMIC_16 | abi.CPU_STORE_ORDER
    assert plan.protocol_refusal("simple", "cuda", 0) is None
    assert "copy-engine proxy" in plan.protocol_refusal("ll", "cuda", everything)
    assert "single-copy atomic" in plan.protocol_refusal("ll", "cpu", abi.CPU_STORE_ORDER)
    assert plan.protocol_refusal("ll128", "cpu", abi.CPU_STORE_ORDER) is None
    assert "program order" in plan.protocol_refusal("ll128", "cpu", abi.CPU_ATOMIC_16)
    mpi = dataclasses.replace(plan, network="mpi")
    assert "network mpi" in mpi.protocol_refusal("ll", "cpu", everything)
    assert GinPlan(GinOptions()).protocol_refusal("ll128", "cuda", 0) is None  # no GIN peer


def _refused_over_gin(world, protocol):
    try:
        Communicator(world, "cpu", path="gin", wire="unordered", segment_bytes=64, protocol=protocol, timeout=5.0)
    except CapabilityError as e:
        return str(e)
    return None


def _per_call_over_gin(world):
    with Communicator(world, "cpu", path="gin", wire="unordered", segment_bytes=64, timeout=5.0) as comm:
        x = np.arange(2000, dtype=np.float32)
        y = np.zeros_like(x)
        with pytest.raises(CapabilityError, match="ll-flag-8B on unordered unsafe"):
            comm.allreduce(x, y, protocol="ll128")
        assert not y.any()  # refused before anything was launched
        comm.allreduce(x, y, protocol="ll")  # the cell LL needs is safe on this wire
        assert np.array_equal(y, x * world.size)
        return sorted(comm.protocol_refusals)


def test_a_refused_protocol_fails_before_anything_runs():
    """Unordered wire, 64-byte segments: LL lines land whole (ll-flag: safe), LL128 lines
    in units that may land flag first (ll-flag-8B on unordered: unsafe)."""
    for why in ThreadWorld.run(2, _refused_over_gin, "ll128", timeout=10.0):
        assert why and "LL128 over GIN on the unordered wire" in why, why
    assert ThreadWorld.run(2, _refused_over_gin, "ll", timeout=10.0) == [None, None]
    assert ThreadWorld.run(2, _per_call_over_gin, timeout=20.0) == [["ll128"], ["ll128"]]


def test_commref_check_refuses_a_gin_protocol_in_one_line(capsys):
    from commref import cli

    assert cli.main(["check", "allreduce", "--path", "gin", "--network", "mpi", "--protocol", "ll"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("commref check: error: LL over GIN on network mpi") and "\n" not in err, err


class _FakeNvml:
    """NVML as pynvml presents it, for GPUs with the given active NVLinks."""

    NVML_NVLINK_MAX_LINKS = 4
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 1

    class NVMLError(Exception):
        pass

    def __init__(self, links):  # bus -> [(remote bus, remote kind)]
        self.links = links

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        return bus

    def nvmlDeviceGetNvLinkState(self, handle, link):
        return link < len(self.links.get(handle, []))

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, handle, link):
        return type("Pci", (), {"busId": self.links[handle][link][0].encode()})

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link):
        return self.links[handle][link][1]


def test_gpus_refuse_ll128_where_nvlink_is_not_established():
    gpu, switch = 0, 1
    nvml = _FakeNvml(
        {
            "0000:01:00.0": [("00000000:02:00.0", gpu)],
            "0000:02:00.0": [("00000000:01:00.0", gpu)],
            "0000:03:00.0": [("00000000:a0:00.0", switch)],
            "0000:04:00.0": [("00000000:a1:00.0", switch)],
        }
    )
    reach = {bus: protocols.nvlink_reach(bus, nvml) for bus in nvml.links}
    pair = [("h", 1, "0000:01:00.0"), ("h", 2, "0000:02:00.0")]
    assert protocols.gpu_refusals(0, pair, [reach[b] for _, _, b in pair]) == {}
    switched = [("h", 1, "0000:03:00.0"), ("h", 2, "0000:04:00.0")]
    assert protocols.gpu_refusals(1, switched, [reach[b] for _, _, b in switched]) == {}
    apart = [("h", 1, "0000:01:00.0"), ("h", 2, "0000:03:00.0")]
    assert "no NVLink between" in protocols.gpu_refusals(0, apart, [reach[b] for _, _, b in apart])["ll128"]
    shared = [("h", 1, "0000:01:00.0"), ("h", 1, "0000:01:00.0")]
    assert "shares this GPU" in protocols.gpu_refusals(1, shared, [reach["0000:01:00.0"]] * 2)["ll128"]
    hosts = [("a", 1, "0000:01:00.0"), ("b", 2, "0000:02:00.0")]
    assert "another host" in protocols.gpu_refusals(0, hosts, [reach["0000:01:00.0"]] * 2)["ll128"]
    unknown = "NVML (pip install nvidia-ml-py) is not available"
    assert unknown in protocols.gpu_refusals(0, pair, [unknown, unknown])["ll128"]
    assert protocols.merge([{}, {"ll128": "why"}]) == {"ll128": "rank 1: why"}


def test_landing_copies_every_byte_at_any_alignment():
    land = host_atomics().land
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 300, dtype=np.uint8)
    for at in (0, 1, 8, 15, 16, 17):
        for n in (0, 1, 15, 16, 17, 31, 64, 200):
            dst = np.zeros(300, np.uint8)
            land(dst.ctypes.data + at, src.ctypes.data + 3, n)
            want = np.zeros(300, np.uint8)
            want[at : at + n] = src[3 : 3 + n]
            assert np.array_equal(dst, want), (at, n)


# ---------------------------------------------------------------------------------------
# options and the tuner
# ---------------------------------------------------------------------------------------


def test_commref_proto_is_the_default(monkeypatch):
    monkeypatch.delenv("COMMREF_PROTO", raising=False)
    assert CommOptions().protocol == "auto"
    monkeypatch.setenv("COMMREF_PROTO", "LL128")
    assert CommOptions().protocol == "ll128"
    assert CommOptions(protocol="simple").protocol == "simple"  # the option wins over the environment
    assert CommOptions().replace(max_channels=2).protocol == "ll128"
    monkeypatch.setenv("COMMREF_PROTO", "ll256")
    with pytest.raises(OptionError, match="COMMREF_PROTO must be one of auto, simple, ll, ll128, not 'll256'"):
        CommOptions()
    with pytest.raises(OptionError, match="protocol must be one of"):
        CommOptions(protocol="fast")


def test_the_tuner_picks_the_protocol_the_model_says_is_fastest():
    m = model.Model.default(model.Paths(local_ranks=2))
    for n in (8, 64, 128, 256, 4096, 1 << 20):
        times = {p: m.time("allreduce", "ring", p, n, 2) for p in tuner.PROTOCOLS}
        assert tuner.plan("allreduce", "ring", n, 2, "cpu", 4).protocol == min(times, key=times.get), n
    pick = {n: tuner.plan("allreduce", "ring", n, 2, "cpu", 4).protocol for n in (8, 128, 65536)}
    assert pick == {8: "ll", 128: "ll128", 65536: "simple"}
    assert tuner.plan("allreduce", "ring", 8, 2, "cpu", 4, allowed=("simple", "ll128")).protocol == "ll128"
    assert tuner.plan("allreduce", "ring", 8, 2, "cuda", 4).protocol == "simple"  # no edge on GPUs: not measured
    assert tuner.auto_protocols({"ll": "why"}) == ("simple", "ll128")
    gin = model.Model.default(model.Paths(gin=True, local_ranks=2))  # a line step posts two descriptors
    assert tuner.plan("allreduce", "ring", 8, 2, "cpu", 4, model=gin).protocol == "simple"
    assert tuner.plan("allreduce", "ring", 1 << 20, 2, "cpu", 4, protocol="ll").protocol == "ll"
    # Symmetric buffers: auto takes direct (no protocol) unless a line protocol is asked for.
    assert tuner.plan("allreduce", "auto", 1 << 20, 2, "cpu", 4, symmetric=True) == tuner.Plan("direct", 1, "simple")
    assert tuner.plan("allreduce", "auto", 1 << 20, 2, "cpu", 4, symmetric=True, protocol="ll128").algorithm == "ring"
    # A direct call has no protocol: COMMREF_PROTO=ll does not stop it.
    assert tuner.plan("allreduce", "direct", 64, 2, "cpu", 4, symmetric=True, protocol="ll").protocol == "simple"
    with pytest.raises(ValueError, match="unknown protocol"):
        tuner.plan("allreduce", "ring", 64, 2, "cpu", 4, protocol="ll64")


def test_check_cases_per_protocol():
    base = check.cases(["allreduce", "allgather"], ["float32"], ["sum"], [], [7], 2, 1)
    per = check.cases(["allreduce", "allgather"], ["float32"], ["sum"], [], [7], 2, 1, protocols=["simple", "ll"])
    line = [c for c in base if c.algorithm in tuner.PROTOCOL_ALGORITHMS]
    assert len(per) == len(base) + len(line)
    assert {c.label for c in per} == {"ring/simple", "ring/ll", "tree/simple", "tree/ll", "direct", "nvls"}
    assert all(c.protocol is None for c in base)


def test_bench_measures_protocols_side_by_side():
    from commref.bench.harness import run_rank

    a = bench_args("all_reduce", "-b", "8", "-e", "4K", "-f", "32", *QUICK_BENCH, "--protocol", "simple,ll,ll128")
    doc = ThreadWorld.run(2, run_rank, a, out=lambda s: None, timeout=WORLD_TIMEOUT)[0]
    labels = [r["series"] for r in doc["rows"]]
    assert labels == ["lsa/simple", "lsa/ll", "lsa/ll128"] * 2, labels  # 8 B and 256 B
    assert all(r["out_of_place"]["wrong"] == 0 and r["in_place"]["wrong"] == 0 for r in doc["rows"])
    assert [s["protocol"] for s in doc["series"]] == ["simple", "ll", "ll128"]


def test_commref_check_runs_the_cases_once_per_protocol(capsys):
    from commref import cli

    assert (
        cli.main(["check", "allreduce", "--dtype", "int8", "--op", "sum", "--count", "7", "--protocol", "ll", "ll128"])
        == 0
    )
    out = capsys.readouterr().out
    for label in ("ring/ll ", "ring/ll128", "tree/ll ", "tree/ll128", "direct"):
        assert f"allreduce      {label}" in out, out
    summary = check_summary(out)
    assert summary and (summary.rows, summary.cases, summary.wrong) == (5, 10, 0), out
