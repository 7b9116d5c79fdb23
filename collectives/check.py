"""The verification sweep behind `commref check`: run collectives on exact-checkable
inputs and count wrong elements against the numpy references, per case; and the group
cases (group_check.py: collectives, composed collectives and sends/receives mixed in
one group)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from . import catalogue, group_check, nvls, p2p_collectives, tuner, verify
from .memory import Memory, SymmetricMemory, array_module
from .p2p_collectives import P2P
from .verify import DTYPES, OPS

DEFAULT_COUNTS = (0, 1, 7, 1001)


# The algorithms whose calls take buffers from alloc_symmetric (run_sweep's SymmetricMemory).
SYMMETRIC = ("direct", nvls.NVLS)


def algorithms_for(coll: str, direct: bool = True, hierarchical: bool = False, lsa: bool = False) -> tuple[str, ...]:
    """The algorithms implemented for `coll`; without `direct`, not the direct kernels
    (Communicator.direct_kernels says where they run); without
    `hierarchical`, not the hierarchical algorithm (it needs several nodes of
    several ranks each); without `lsa` (the direct kernels run over LSA), not "nvls"."""
    return tuple(
        a
        for a in catalogue.get(coll).algorithms
        if (direct or a != "direct") and (hierarchical or a != "hierarchical") and (lsa or a != nvls.NVLS)
    )


@dataclass(frozen=True)
class Case:
    coll: str
    algorithm: str
    dtype: str
    op: str | None  # None for data movement
    count: int
    in_place: bool
    root: int
    seed: int
    values: str = "small"  # verify.VALUES: "small" integers, or "denormal"
    protocol: str | None = None  # of the ring and tree steps (None: the communicator's)

    @property
    def label(self) -> str:
        """The algorithm, and the protocol where the case names one (ring/ll)."""
        return f"{self.algorithm}/{self.protocol}" if self.protocol else self.algorithm


def cases(
    collectives,
    dtypes,
    ops,
    algorithms,
    counts,
    nranks: int,
    seed: int,
    in_place=(False, True),
    direct: bool = True,
    denormals: bool = True,
    hierarchical: bool = False,
    protocols=(),
    pushed: bool = False,
    device: str = "cpu",
):
    """Every case of the sweep, in a fixed order (all ranks enumerate the same list).
    `direct`: include the direct kernels (Communicator.direct_kernels); `pushed`: they
    push over GIN, so only the calls that can (catalogue.Collective.gin_windows, and
    gin_direct_even_out_of_place: out of place, each count rounded down to a multiple of
    nranks);
    `hierarchical`: include the hierarchical algorithm (several nodes of several ranks).
    `denormals`: after the cases of each count, one out of place on denormal inputs
    where the dtype and op have them (verify.has_denormal_case). A collective without an
    in-place form (catalogue.Collective.in_place_ok) runs out of place only.
    `protocols`: the cases of the ring and tree algorithms once per protocol (the other
    algorithms' once, with none); empty: once, in the communicator's protocol. A
    collective that refuses `nranks` or `device` has none (skipped() says why). The
    "nvls" AllReduce runs where the direct kernels run over LSA (`direct`, not `pushed`),
    for the (dtype, op) pairs NVLink multicast reduces (nvls.supported)."""
    out = []
    for coll in collectives:
        spec = catalogue.get(coll)
        if _refusal(spec, nranks, device):
            continue  # skipped(): the reason is reported
        placements = [ip for ip in in_place if not ip or spec.in_place_ok]
        for algo, protocol in [
            (a, p)
            for a in algorithms_for(coll, direct, hierarchical, direct and not pushed)
            for p in (protocols if protocols and a in tuner.PROTOCOL_ALGORITHMS else [None])
        ]:
            if algorithms and algo not in algorithms:
                continue
            pushing = pushed and algo == "direct"
            if pushing and spec.gin_windows is None:
                continue
            even = pushing and spec.gin_direct_even_out_of_place
            for di, dtype in enumerate(dtypes):
                for oi, op in enumerate(ops if spec.reducing else [None]):
                    if algo == nvls.NVLS and not nvls.supported(dtype, op):
                        continue
                    for count in dict.fromkeys(c - c % nranks for c in counts) if even else counts:
                        root = (count + di + oi) % nranks
                        runs = [(ip, "small") for ip in (placements if not even else [False])]
                        if denormals and verify.has_denormal_case(DTYPES[dtype], op):
                            runs.append((False, "denormal"))
                        for ip, values in runs:
                            seed_of = seed * 1_000_003 + len(out)
                            out.append(Case(coll, algo, dtype, op, count, ip, root, seed_of, values, protocol))
    return out


def _refusal(spec: catalogue.Collective, nranks: int, device: str) -> str | None:
    """Why `spec` cannot run on `nranks` ranks on `device` (hypercube: powers of two; the
    collectives of sends and receives: the CPU engine), or None."""
    if P2P in spec.composed and p2p_collectives.device_refusal(device):
        return p2p_collectives.device_refusal(device)
    return spec.rank_refusal(nranks) if spec.rank_refusal is not None else None


def skipped(collectives, nranks: int, device: str = "cpu") -> list[str]:
    """Why some of `collectives` have no cases (group_check.GROUP: the group cases)."""
    out = []
    for c in collectives:
        why = (
            p2p_collectives.device_refusal(device)
            if c == group_check.GROUP
            else _refusal(catalogue.get(c), nranks, device)
        )
        if why:
            out.append(f"{c} skipped: {why}")
    return out


def run_case(comm, case: Case, stream=None, memory: Memory | None = None) -> int:
    """Runs one case on this rank; returns the number of wrong elements here. Buffers
    come from `memory` (a direct case's from a SymmetricMemory, reset here); where the
    collective must leave this rank's recvbuf alone, it must still hold what it held."""
    n, r = comm.nranks, comm.rank
    if isinstance(case, group_check.GroupCase):
        return group_check.run(comm, case, memory or Memory(array_module(comm.device)))
    spec = catalogue.get(case.coll)
    dt = DTYPES[case.dtype]
    if memory is None:
        if case.algorithm in SYMMETRIC:
            raise ValueError(f"{case.algorithm} cases need a SymmetricMemory (run_sweep makes one)")
        memory = Memory(array_module(comm.device))
    if isinstance(memory, SymmetricMemory):
        memory.reset()
    x = verify.make_input(case.coll, dt, case.op, case.seed, r, n, case.count, case.values)
    expected = verify.expected_output(case.coll, dt, case.op, case.seed, r, n, case.count, case.root, case.values)
    b = spec.buffers(memory, x, case.count, r, n, case.in_place)
    before = memory.to_host(b.out).copy() if expected is None else None
    protocol = {"protocol": case.protocol} if case.protocol else {}
    spec.call(comm, b.send, b.recv, case.op, case.root, algorithm=case.algorithm, stream=stream, **protocol)
    if memory.xp is not np:
        comm.synchronize(stream)
    return verify.count_wrong(memory.to_host(b.out), before if expected is None else expected)


def _direct_bytes(case: Case, nranks: int) -> int:
    """Symmetric bytes run_case takes for a direct case."""
    return SymmetricMemory.capacity(*catalogue.get(case.coll).counts(case.count, nranks), DTYPES[case.dtype].itemsize)


def run_sweep(comm, case_list, progress=None, stream=None) -> list[int]:
    """Runs the cases in order on every rank; returns wrong elements per case, summed
    over ranks (one allgather at the end)."""
    comm.prepare(
        {
            spec
            for c in case_list
            for spec in (
                c.kernel_specs(comm)
                if isinstance(c, group_check.GroupCase)
                else [comm.kernel_spec(c.coll, c.dtype, c.op)]
            )
        }
    )
    direct = [c for c in case_list if c.algorithm in SYMMETRIC]
    plain = Memory(array_module(comm.device))
    symmetric = SymmetricMemory(comm, plain.xp, max(_direct_bytes(c, comm.nranks) for c in direct)) if direct else None
    wrong = []
    for i, case in enumerate(case_list):
        with stream if stream is not None else contextlib.nullcontext():
            wrong.append(run_case(comm, case, stream, symmetric if case.algorithm in SYMMETRIC else plain))
        if progress:
            progress(i + 1, len(case_list))
    if symmetric is not None:
        symmetric.free()
    per_rank = comm.world.allgather(wrong, what="check results")
    return [int(sum(w[i] for w in per_rank)) for i in range(len(case_list))]


def summary_rows(case_list, wrong):
    """Rows (collective, algorithm or algorithm/protocol, dtype, {op: (cases, wrong elements)})."""
    table: dict = {}
    for case, w in zip(case_list, wrong):
        key = (case.coll, case.label, case.dtype if case.values == "small" else f"{case.dtype} {case.values}")
        cell = table.setdefault(key, {}).setdefault(case.op or "copy", [0, 0])
        cell[0] += 1
        cell[1] += w
    return [(k[0], k[1], k[2], v) for k, v in table.items()]


def format_table(rows, nranks: int, device: str) -> str:
    cols = list(OPS) + ["copy"]
    width = max([8] + [len(algo) + 1 for _, algo, _, _ in rows])
    head = f"{'collective':<15}{'algo':<{width}}{'dtype':<18}" + "".join(f"{c:>9}" for c in cols)
    lines = [
        f"# commref check: {nranks} ranks, device {device}; wrong elements per collective x dtype x op",
        head,
        "-" * len(head),
    ]
    for coll, algo, dtype, cells in rows:
        vals = "".join(f"{(str(cells[c][1]) if c in cells else '-'):>9}" for c in cols)
        lines.append(f"{coll:<15}{algo:<{width}}{dtype:<18}{vals}")
    return "\n".join(lines)
