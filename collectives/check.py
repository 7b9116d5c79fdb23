"""The verification sweep behind `commref check`: run collectives on exact-checkable
inputs and count wrong elements against the numpy references, per case."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from . import verify
from .symmetric import SymmetricArena
from .tuner import DIRECT_COLLECTIVES
from .verify import DTYPES, OPS, REDUCING

DEFAULT_COUNTS = (0, 1, 7, 1001)
SENTINEL = 0x5A  # byte pattern of buffers a collective must not touch


def algorithms_for(coll: str, direct: bool = True) -> tuple[str, ...]:
    """The algorithms implemented for `coll`; with `direct`, the direct kernels too
    (their cases run on symmetric buffers)."""
    algos = ("ring", "tree") if coll == "allreduce" else ("ring",)
    return algos + ("direct",) if direct and coll in DIRECT_COLLECTIVES else algos


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


def cases(collectives, dtypes, ops, algorithms, counts, nranks: int, seed: int, in_place=(False, True),
          direct: bool = True):
    """Every case of the sweep, in a fixed order (all ranks enumerate the same list).
    `direct`: include the direct kernels (a communicator whose peers are all LSA)."""
    out = []
    for coll in collectives:
        for algo in algorithms_for(coll, direct):
            if algorithms and algo not in algorithms:
                continue
            for di, dtype in enumerate(dtypes):
                for oi, op in enumerate(ops if coll in REDUCING else [None]):
                    for count in counts:
                        for ip in in_place:
                            root = (count + di + oi) % nranks
                            s = seed * 1_000_003 + len(out)
                            out.append(Case(coll, algo, dtype, op, count, ip, root, s))
    return out


def run_case(comm, case: Case, stream=None, arena: SymmetricArena | None = None) -> int:
    """Runs one case on this rank; returns the number of wrong elements here. Buffers
    live where the communicator runs (numpy on the CPU, CuPy on a GPU); a direct
    case's buffers come from `arena` (symmetric memory, reset here)."""
    n, r = comm.nranks, comm.rank
    dt = DTYPES[case.dtype]
    xp = _array_module(comm)
    host = verify.make_input(case.coll, dt, case.op, case.seed, r, n, case.count)
    expected = verify.expected_output(case.coll, dt, case.op, case.seed, r, n, case.count, case.root)
    if case.algorithm == "direct":
        if arena is None:
            raise ValueError("direct cases need a SymmetricArena (run_sweep makes one)")
        arena.reset()

        def sentinel(count):
            buf = arena.take(count, dt)
            buf.view(np.uint8).fill(SENTINEL)
            return buf

        def copy(a):
            buf = arena.take(a.size, dt)
            buf[...] = a
            return buf
    else:
        def sentinel(count):
            return xp.full(count * dt.itemsize, SENTINEL, dtype=np.uint8).view(dt)

        def copy(a):
            return a.copy()
    x = copy(xp.asarray(host))
    rc = verify.recv_count(case.coll, case.count, n)
    c = case.count
    kw = {"algorithm": case.algorithm, "stream": stream}
    if case.coll == "allreduce":
        if case.in_place:
            out = copy(x)
            comm.allreduce(out, out, case.op, **kw)
        else:
            out = sentinel(rc)
            comm.allreduce(x, out, case.op, **kw)
    elif case.coll == "reduce_scatter":
        if case.in_place:
            buf = copy(x)
            out = buf[r * c : (r + 1) * c]
            comm.reduce_scatter(buf, out, case.op, **kw)
        else:
            out = sentinel(rc)
            comm.reduce_scatter(x, out, case.op, **kw)
    elif case.coll == "allgather":
        out = sentinel(rc)
        if case.in_place:
            out[r * c : (r + 1) * c] = x
            comm.allgather(out[r * c : (r + 1) * c], out, **kw)
        else:
            comm.allgather(x, out, **kw)
    elif case.coll == "broadcast":
        out = sentinel(rc)
        if r == case.root and case.in_place:
            out[:] = x
            comm.broadcast(out, out, case.root, **kw)
        else:
            comm.broadcast(x, out, case.root, **kw)
    elif case.coll == "reduce":
        if case.in_place and r == case.root:
            out = copy(x)
            comm.reduce(out, out, case.op, case.root, **kw)
        else:
            out = sentinel(rc)
            comm.reduce(x, out, case.op, case.root, **kw)
        if expected is None:  # a non-root recvbuf must be left alone
            expected = np.full(rc * dt.itemsize, SENTINEL, dtype=np.uint8).view(dt)
    else:
        raise ValueError(case.coll)
    if xp is not np:
        comm.synchronize(stream)
        out = xp.asnumpy(out)
    return verify.count_wrong(out, expected)


def _array_module(comm):
    if getattr(comm, "device", "cpu") == "cuda":
        import cupy

        return cupy
    return np


def _direct_bytes(case: Case, nranks: int) -> int:
    """Symmetric bytes run_case takes for a direct case: at most three buffers of the
    larger of the send and recv counts, each page-aligned."""
    itemsize = DTYPES[case.dtype].itemsize
    largest = max(case.count, verify.recv_count(case.coll, case.count, nranks), case.count * nranks)
    return 3 * (largest * itemsize + SymmetricArena.ALIGN)


def run_sweep(comm, case_list, progress=None, stream=None) -> list[int]:
    """Runs the cases in order on every rank; returns wrong elements per case, summed
    over ranks (one allgather at the end)."""
    comm.prepare({comm.kernel_spec(c.coll, c.dtype, c.op) for c in case_list})
    direct = [c for c in case_list if c.algorithm == "direct"]
    arena = SymmetricArena(comm, max(_direct_bytes(c, comm.nranks) for c in direct)) if direct else None
    wrong = []
    for i, case in enumerate(case_list):
        with stream if stream is not None else contextlib.nullcontext():
            wrong.append(run_case(comm, case, stream, arena))
        if progress:
            progress(i + 1, len(case_list))
    if arena is not None:
        arena.free()
    per_rank = comm.world.allgather(wrong, what="check results")
    return [int(sum(w[i] for w in per_rank)) for i in range(len(case_list))]


def summary_rows(case_list, wrong):
    """Rows (collective, algorithm, dtype, {op: (cases, wrong elements)})."""
    table: dict = {}
    for case, w in zip(case_list, wrong):
        key = (case.coll, case.algorithm, case.dtype)
        cell = table.setdefault(key, {}).setdefault(case.op or "copy", [0, 0])
        cell[0] += 1
        cell[1] += w
    return [(k[0], k[1], k[2], v) for k, v in table.items()]


def format_table(rows, nranks: int, device: str) -> str:
    cols = list(OPS) + ["copy"]
    head = f"{'collective':<15}{'algo':<8}{'dtype':<10}" + "".join(f"{c:>9}" for c in cols)
    lines = [f"# commref check: {nranks} ranks, device {device}; wrong elements per collective x dtype x op",
             head, "-" * len(head)]
    for coll, algo, dtype, cells in rows:
        vals = "".join(f"{(str(cells[c][1]) if c in cells else '-'):>9}" for c in cols)
        lines.append(f"{coll:<15}{algo:<8}{dtype:<10}{vals}")
    return "\n".join(lines)
