"""Exact-checkable inputs and numpy references for every collective.

Inputs are a function of (seed, rank, index) only, so any rank can recompute every
other rank's input and the expected output without communicating. They are small
integers chosen so that every reduction is exact in every dtype and in any order:

- sum, avg, min, max: integers in [-8, 8] (unsigned: [0, 16]); at most 8 ranks keep
  sums within int8 and exact in float16 and bfloat16;
- prod: values in {-1, 1, 2} (unsigned: {1, 2}); products stay within 2^8 in magnitude
  for up to 8 ranks (exact in every float type; int8/uint8 wrap exactly like numpy);
- allgather and broadcast move data only: integers that use the whole type (integers)
  or its exactly representable range (floats), so a misplaced shard shows;
- gather, scatter, sendrecv and hypercube move data: the same values, each rank's its
  own; alltoallv's are alltoall's, and the part of each recvbuf block its pair does not
  send (catalogue.Collective.pair_count) must still hold the unwritten buffer's bytes;
- alltoall (a personalized exchange, catalogue.BOTH): the same kinds of values, and each
  block names its route: element i of the block rank s sends to rank d is
  tag + nranks**2 * h(seed, s, d * count + i) with tag = s * nranks + d, so every
  element of a block that lands in the wrong place or comes from the wrong rank differs
  from what belongs there (where the type has nranks**2 distinct values; beyond that,
  only the hash tells blocks apart);
- denormal inputs (values="denormal", floating dtypes, sum/avg/min/max): the sum
  inputs times the dtype's smallest subnormal, so results stay exact and subnormal,
  in float32 too for float16 and bfloat16 (their compute type). A build that flushes
  denormals to zero (CuPy's -ftz=true) returns zeros there.

The reference arithmetic follows include/commref/reduce.h: integer sum/prod wrap,
float16/bfloat16 reduce in float32 and round once, avg is sum then one division
(truncating toward zero for integers). Comparison is bitwise, element by element.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from commref.device_kernels import abi

from . import catalogue
from .memory import SENTINEL

# NCCL's ncclDataType_t codes.
DTYPES: dict[str, np.dtype] = {
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int32": np.dtype(np.int32),
    "uint32": np.dtype(np.uint32),
    "int64": np.dtype(np.int64),
    "uint64": np.dtype(np.uint64),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
DTYPE_CODES = abi.DTYPE_CODES
_NAMES = {d: n for n, d in DTYPES.items()}
# NCCL's ncclRedOp_t codes.
OPS = abi.OP_CODES
MAX_EXACT_RANKS = 8


def dtype_name(dtype) -> str:
    dt = np.dtype(dtype)
    name = _NAMES.get(dt)
    if name is not None:
        return name
    raise TypeError(f"unsupported dtype {dt}; supported: {', '.join(DTYPES)}")


def _is_float(dt: np.dtype) -> bool:
    return dt.kind == "f" or dt == DTYPES["bfloat16"]


def _hash(seed: int, rank: int, n: int, salt: int = 0) -> np.ndarray:
    """splitmix64 of (seed, rank, salt, index) for index in [0, n)."""
    base = np.uint64((seed * 0x100000001B3 + rank * 0x9E3779B1 + salt * 0x85EBCA77) & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + base + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


# The exponent of each floating dtype's smallest subnormal (2**e).
SUBNORMAL_EXPONENT = {"float16": -24, "bfloat16": -133, "float32": -149, "float64": -1074}
# The kinds of input: "small" (the exact small integers above) and "denormal".
VALUES = ("small", "denormal")
DENORMAL_OPS = ("sum", "avg", "max", "min")


def has_denormal_case(dtype, op: str | None) -> bool:
    """Whether (dtype, op) has denormal inputs (values="denormal")."""
    return op in DENORMAL_OPS and dtype_name(dtype) in SUBNORMAL_EXPONENT


def input_values(dtype, op: str | None, seed: int, rank: int, n: int, values: str = "small") -> np.ndarray:
    """Rank `rank`'s n input elements. `op` None means a data-movement collective."""
    dt = np.dtype(dtype)
    h = _hash(seed, rank, n)
    if values == "denormal":
        if not has_denormal_case(dt, op):
            raise ValueError(f"no denormal inputs for {dtype_name(dt)} with op {op!r}")
        small = (h % np.uint64(17)).astype(np.int64) - 8
        return np.ldexp(small.astype(np.float64), SUBNORMAL_EXPONENT[dtype_name(dt)]).astype(dt)
    if values != "small":
        raise ValueError(f"unknown input values {values!r}; known: {', '.join(VALUES)}")
    signed = dt.kind == "i" or _is_float(dt)
    if op is None:  # data movement: use the type's range (integers wrap: every bit pattern)
        nvalues, low = _movement_values(dt)
        return _movement_dtype(h if low == 0 else h % np.uint64(nvalues), dt, low)
    if op == "prod":
        if signed:
            return np.array([-1, 1, 2], dtype=np.int64)[(h % np.uint64(3)).astype(np.intp)].astype(dt)
        return (h % np.uint64(2) + np.uint64(1)).astype(dt)
    v = (h % np.uint64(17)).astype(np.int64)
    return (v - 8 if signed else v).astype(dt)


def _movement_values(dt: np.dtype) -> tuple[int, int]:
    """(number of values, lowest value) of the data-movement inputs of `dt`: every bit
    pattern of an integer type (the lowest as an unsigned pattern: 0), the exactly
    representable integers [-span, span] of a float type."""
    if _is_float(dt):
        span = 256 if dt == DTYPES["bfloat16"] else 2048
        return 2 * span + 1, -span
    return 1 << (8 * dt.itemsize), 0


def exchange_input(dtype, seed: int, rank: int, nranks: int, count: int) -> np.ndarray:
    """Rank `rank`'s sendbuf of an exchange (alltoall): nranks blocks of `count`, block
    d tagged with its route (rank, d) (see the top of this file)."""
    dt = np.dtype(dtype)
    nvalues, low = _movement_values(dt)
    tags = nranks * nranks
    if tags > nvalues:  # more routes than the type has values: the hash alone
        return input_values(dt, None, seed, rank, nranks * count)
    dest = np.arange(nranks * count, dtype=np.uint64) // np.uint64(max(count, 1))
    tag = np.uint64(rank * nranks) + dest
    h = _hash(seed, rank, nranks * count)
    v = tag + np.uint64(tags) * (h % np.uint64(min(nvalues // tags, 2**64 - 1)))  # < nvalues
    return _movement_dtype(v, dt, low)


def _movement_dtype(v: np.ndarray, dt: np.dtype, low: int) -> np.ndarray:
    """Data-movement values v in [0, number of values) as `dt` (see _movement_values)."""
    return v.astype(dt) if low == 0 else (v.astype(np.int64) + low).astype(dt)


def _compute_dtype(dt: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if dt in (DTYPES["float16"], DTYPES["bfloat16"]) else dt


def reduce_reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """Element-wise reduction of the ranks' arrays, as the kernels compute it."""
    dt = inputs[0].dtype
    cdt = _compute_dtype(dt)
    acc = inputs[0].astype(cdt)
    with np.errstate(over="ignore"):
        for x in inputs[1:]:
            x = x.astype(cdt)
            if op in ("sum", "avg"):
                acc = np.add(acc, x, dtype=cdt)
            elif op == "prod":
                acc = np.multiply(acc, x, dtype=cdt)
            elif op == "max":
                acc = np.maximum(acc, x)
            elif op == "min":
                acc = np.minimum(acc, x)
            else:
                raise ValueError(f"unsupported op {op!r}")
        if op == "avg":
            n = len(inputs)
            if cdt.kind in "iu":
                q = np.abs(acc) // cdt.type(n) if cdt.kind == "i" else acc // cdt.type(n)
                acc = (np.sign(acc) * q).astype(cdt) if cdt.kind == "i" else q
            else:
                acc = acc / cdt.type(n)
    return acc.astype(dt)


def make_input(
    coll: str, dtype, op: str | None, seed: int, rank: int, nranks: int, count: int, values: str = "small"
) -> np.ndarray:
    """Rank `rank`'s sendbuf for a call of `coll` with NCCL count `count`."""
    c = catalogue.get(coll)
    if c.scaled == catalogue.BOTH:
        return exchange_input(dtype, seed, rank, nranks, count)
    return input_values(dtype, op if c.reducing else None, seed, rank, c.counts(count, nranks)[0], values)


def expected_output(
    coll: str,
    dtype,
    op: str | None,
    seed: int,
    rank: int,
    nranks: int,
    count: int,
    root: int = 0,
    values: str = "small",
) -> np.ndarray | None:
    """What rank `rank`'s recvbuf must hold; None where the collective leaves it alone
    (the recvbuf of a non-root rank where only the root's counts)."""
    c = catalogue.get(coll)
    if c.root_only == catalogue.RECV and rank != root:
        return None
    ins = [make_input(coll, dtype, op, seed, r, nranks, count, values) for r in range(nranks)]
    if c.reducing:
        out = reduce_reference(ins, op)
        at = c.in_place_at(rank, count) if c.scaled == catalogue.SEND else 0
        return out[at : at + c.counts(count, nranks)[1]]
    if c.scaled == catalogue.RECV:  # every rank's input, in rank order
        return np.concatenate(ins) if ins else np.zeros(0, dtype)
    if c.scaled == catalogue.SEND:  # scatter: block `rank` of the root's input
        return ins[root][rank * count : (rank + 1) * count]
    if c.scaled == catalogue.BOTH:  # block `rank` of every rank's input, in rank order
        blocks = [x[rank * count : (rank + 1) * count] for x in ins]
        if c.pair_count is not None:  # alltoallv: the first pair_count of each, the rest left alone
            blocks = [_left_alone(b, c.pair_count(i, rank, count)) for i, b in enumerate(blocks)]
        return np.concatenate(blocks)
    if c.received_from is not None:  # sendrecv: a neighbour's input
        return ins[c.received_from(rank, nranks)]
    return ins[root if c.rooted else rank]


def _left_alone(block: np.ndarray, written: int) -> np.ndarray:
    """`block` with its elements from `written` on holding the unwritten recvbuf's bytes
    (memory.SENTINEL)."""
    out = block.copy()
    out[written:].view(np.uint8)[...] = SENTINEL
    return out


def count_wrong(got: np.ndarray, expected: np.ndarray) -> int:
    """Number of elements whose bits differ (a length mismatch counts every element)."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return max(got.size, expected.size)
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
    return int(np.count_nonzero(got.view(width) != expected.view(width)))
