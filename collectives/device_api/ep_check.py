"""Checks of commref.ep's dispatch and combine, as DeepEP's tests make them
(tests/test_intranode.py, tests/test_low_latency.py), exact instead of to a tolerance.

Inputs (make_inputs): every token of rank r holds r - 128 (an integer, exact in
bfloat16; never 0, so a row the wire never wrote shows), except its last `index_columns`
columns, which hold its index modulo 256 (exact too); top-k experts drawn from random
scores, some entries masked to -1; top-k weights multiples of 1/16 in (0, 1], so that a
combine's float32 sums are exact and round once to the dtype, as the reference does.

The checks take every rank's topk_idx and weights (a world allgather) and compute what
each rank must receive, row by row: which source, which token, its top-k indices and
weights, its place in the flat buffer (the prefix matrix) or in the expert's slots.
Each returns a list of problems (empty: correct); the first few name the row.
"""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

VALUE_OFFSET = 128  # rank r's tokens hold r - 128, as DeepEP's low-latency test
MAX_PROBLEMS = 8


def index_columns(hidden: int) -> int:
    """How many last columns carry the token index (DeepEP: 128)."""
    return max(1, min(128, hidden // 4))


def make_inputs(
    rank: int,
    nranks: int,
    num_tokens: int,
    hidden: int,
    num_experts: int,
    num_topk: int,
    seed: int = 0,
    dtype: str = "bfloat16",
):
    """(x [tokens, hidden], topk_idx int64 [tokens, topk], topk_weights float32) of `rank`."""
    rng = np.random.default_rng([seed, rank, 0xE9])
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = np.full((num_tokens, hidden), rank - VALUE_OFFSET, np.float32)
    x[:, hidden - index_columns(hidden) :] = (np.arange(num_tokens) % 256)[:, None]
    scores = rng.random((num_tokens, num_experts))
    topk = np.argsort(-scores, axis=1, kind="stable")[:, :num_topk].astype(np.int64)
    for _ in range(max(1, num_tokens // 4)):  # DeepEP masks a few random entries
        if num_tokens:
            topk[rng.integers(num_tokens), rng.integers(num_topk)] = -1
    if num_tokens > 2:
        topk[num_tokens // 2] = -1  # a token that goes nowhere
    weights = (rng.integers(1, 17, (num_tokens, num_topk)) / 16).astype(np.float32)
    return x.astype(dt), topk, weights


def _f32(a) -> np.ndarray:
    a = np.asarray(_host(a))
    if a.dtype == np.uint16:  # bfloat16 bits (CuPy)
        a = a.view(ml_dtypes.bfloat16)
    return a.astype(np.float32)


def _host(a):
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else a


def _rounded(v: np.ndarray, dtype) -> np.ndarray:
    """float32 values rounded once to `dtype` and back (what the kernels store)."""
    dt = np.dtype(ml_dtypes.bfloat16) if np.dtype(dtype) == np.uint16 else np.dtype(dtype)
    return v.astype(dt).astype(np.float32)


def _expected_rows(values: np.ndarray, source: int, tokens: np.ndarray, ncol: int) -> np.ndarray:
    """What the rows of `source`'s `tokens` hold: source - 128, the token index (mod
    256) in the last ncol columns."""
    want = np.full(values.shape, source - VALUE_OFFSET, np.float32)
    want[:, values.shape[1] - ncol :] = (tokens % 256)[:, None]
    return want


def _row_problem(got: np.ndarray, want: np.ndarray) -> str:
    """The first wrong element of a row."""
    j = int(np.nonzero(got != want)[0][0])
    return f"column {j} holds {got[j]:g}, not {want[j]:g}"


class _Problems(list):
    def add(self, msg: str) -> None:
        if len(self) < MAX_PROBLEMS:
            self.append(msg)
        elif len(self) == MAX_PROBLEMS:
            self.append("...")


def check_layout(rank: int, nranks: int, num_experts: int, topk_idx: np.ndarray, layout) -> list[str]:
    p = _Problems()
    per = num_experts // nranks
    in_rank = np.zeros((topk_idx.shape[0], nranks), bool)
    for t, k in zip(*np.nonzero(topk_idx >= 0)):
        in_rank[t, topk_idx[t, k] // per] = True
    want_expert = np.bincount(topk_idx[topk_idx >= 0], minlength=num_experts)
    if not np.array_equal(_host(layout.is_token_in_rank), in_rank):
        p.add(f"rank {rank}: is_token_in_rank differs")
    if not np.array_equal(_host(layout.num_tokens_per_rank), in_rank.sum(axis=0)):
        p.add(f"rank {rank}: num_tokens_per_rank {_host(layout.num_tokens_per_rank)} != {in_rank.sum(axis=0)}")
    if not np.array_equal(_host(layout.num_tokens_per_expert), want_expert):
        p.add(f"rank {rank}: num_tokens_per_expert differs")
    return p


def _sent_tokens(topk: np.ndarray, dest: int, per: int) -> np.ndarray:
    """The tokens of one source that select an expert of `dest`, ascending."""
    return np.nonzero(((topk >= 0) & (topk // per == dest)).any(axis=1))[0]


def check_ht_dispatch(rank: int, nranks: int, num_experts: int, all_topk: list, all_weights: list, result) -> list[str]:
    """A high-throughput dispatch's result on `rank` against every rank's inputs."""
    p = _Problems()
    per = num_experts // nranks
    recv_x, recv_topk, recv_w, per_expert, handle = result
    x = _f32(recv_x)
    recv_topk, recv_w = _host(recv_topk), _host(recv_w)
    src_idx, prefix = _host(handle.recv_src_idx), _host(handle.rank_prefix_matrix)
    counts = np.array([[len(_sent_tokens(t, d, per)) for d in range(nranks)] for t in all_topk])
    if not np.array_equal(prefix, np.cumsum(counts, axis=0)):
        p.add(f"rank {rank}: rank_prefix_matrix {prefix.tolist()} != {np.cumsum(counts, axis=0).tolist()}")
    if handle.num_recv != counts[:, rank].sum():
        p.add(f"rank {rank}: received {handle.num_recv} tokens, not {counts[:, rank].sum()}")
        return p
    ncol = index_columns(x.shape[1])
    start = 0
    for s in range(nranks):
        tokens = _sent_tokens(all_topk[s], rank, per)
        seg = slice(start, start + len(tokens))
        start += len(tokens)
        if not np.array_equal(src_idx[seg], tokens):
            p.add(
                f"rank {rank}: rows {seg.start}..{seg.stop - 1} from rank {s}: source tokens "
                f"{src_idx[seg].tolist()} != {tokens.tolist()}"
            )
        want = _expected_rows(x[seg], s, tokens, ncol)
        for i in np.nonzero((x[seg] != want).any(axis=1))[0]:
            p.add(
                f"rank {rank}: row {seg.start + i} (rank {s}'s token {tokens[i]}): {_row_problem(x[seg][i], want[i])}"
            )
        topk = all_topk[s][tokens]
        mine = (topk >= rank * per) & (topk < (rank + 1) * per)
        want_idx = np.where(mine, topk - rank * per, -1)
        want_w = np.where(mine, all_weights[s][tokens], 0).astype(np.float32)
        for i in np.nonzero((recv_topk[seg] != want_idx).any(axis=1) | (recv_w[seg] != want_w).any(axis=1))[0]:
            p.add(
                f"rank {rank}: row {seg.start + i}: top-k {recv_topk[seg][i].tolist()} / "
                f"{recv_w[seg][i].tolist()} != {want_idx[i].tolist()} / {want_w[i].tolist()}"
            )
    want_expert = [int(sum(((t >= 0) & (t == rank * per + e)).sum() for t in all_topk)) for e in range(per)]
    if list(per_expert) != want_expert:
        p.add(f"rank {rank}: tokens per local expert {list(per_expert)} != {want_expert}")
    return p


def check_ht_combine(
    rank: int,
    nranks: int,
    num_experts: int,
    x,
    topk_idx: np.ndarray,
    topk_weights: np.ndarray,
    combined_x,
    combined_w=None,
) -> list[str]:
    """Combine of the received rows unchanged: each token times the number of ranks it
    reached (rounded once to the dtype); the weights' copies sum to the weights."""
    p = _Problems()
    per = num_experts // nranks
    reached = np.array([len({int(e) // per for e in row if e >= 0}) for row in topk_idx], np.float32)
    want = _rounded(_f32(x) * reached[:, None], _host(combined_x).dtype)
    got = _f32(combined_x)
    for t in np.nonzero((got != want).any(axis=1))[0]:
        p.add(f"rank {rank}: combined token {t} (reached {int(reached[t])} ranks): {_row_problem(got[t], want[t])}")
    if combined_w is not None:
        want_w = np.where(topk_idx >= 0, topk_weights, 0).astype(np.float32)
        for t in np.nonzero((_host(combined_w) != want_w).any(axis=1))[0]:
            p.add(
                f"rank {rank}: combined top-k weights of token {t}: {_host(combined_w)[t].tolist()} != "
                f"{want_w[t].tolist()}"
            )
    return p


def check_ll_dispatch(rank: int, nranks: int, num_experts: int, max_tokens: int, all_topk: list, result) -> list[str]:
    """A low-latency dispatch's result on `rank`: per local expert, the rows of each
    source's tokens that chose it, packed by source rank, tokens ascending."""
    p = _Problems()
    per = num_experts // nranks
    packed, count, handle = result
    x = _f32(packed)
    count, info, topk_slot = _host(count), _host(handle.recv_src_info), _host(handle.recv_src_topk)
    ranges = _host(handle.recv_layout_range)
    ncol = index_columns(x.shape[2])
    for e in range(per):
        expert = rank * per + e
        begin = 0
        for s in range(nranks):
            tokens, slots = np.nonzero(all_topk[s] == expert)
            want_range = begin << 32 | len(tokens)
            if ranges[e, s] != want_range:
                p.add(
                    f"rank {rank}: expert {e}, source {s}: layout range {ranges[e, s] >> 32}+"
                    f"{ranges[e, s] & 0xFFFFFFFF} != {begin}+{len(tokens)}"
                )
            seg = slice(begin, begin + len(tokens))
            if not (np.array_equal(info[e, seg], tokens) and np.array_equal(topk_slot[e, seg], slots)):
                p.add(f"rank {rank}: expert {e}, source {s}: tokens {info[e, seg].tolist()} != {tokens.tolist()}")
            want = _expected_rows(x[e, seg], s, tokens, ncol)
            for i in np.nonzero((x[e, seg] != want).any(axis=1))[0]:
                p.add(
                    f"rank {rank}: expert {e} row {begin + i} (rank {s}'s token {tokens[i]}): "
                    f"{_row_problem(x[e, seg][i], want[i])}"
                )
            begin += len(tokens)
        if count[e] != begin:
            p.add(f"rank {rank}: expert {e}: count {count[e]} != {begin}")
    return p


def check_ll_combine(rank: int, x, topk_idx: np.ndarray, topk_weights: np.ndarray, combined_x) -> list[str]:
    """Combine of the received rows unchanged: each token times the sum of its weights
    over the experts it chose (float32, exact here; rounded once to the dtype)."""
    p = _Problems()
    wsum = np.where(topk_idx >= 0, topk_weights, 0).sum(axis=1, dtype=np.float32)
    want = _rounded(_f32(x) * wsum[:, None], _host(combined_x).dtype)
    got = _f32(combined_x)
    for t in np.nonzero((got != want).any(axis=1))[0]:
        p.add(f"rank {rank}: combined token {t}: {_row_problem(got[t], want[t])}")
    return p


def digest(*arrays) -> str:
    """A hash of the arrays' bytes (DeepEP's hash_tensor): equal runs, equal digests."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(_host(a))
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.view(np.uint8).tobytes() if a.size else b"")
    return h.hexdigest()[:16]


def ll_received(result) -> list:
    """The valid rows of a low-latency dispatch (per expert, the first count rows), for digest()."""
    packed, count, handle = result
    count = _host(count)
    return [a[e, : count[e]] for e in range(len(count)) for a in (packed, handle.recv_src_info, handle.recv_src_topk)]


def checked_round(
    buf, inputs, all_topk: list, all_weights: list, device_inputs=None, combine_twice: bool = False
) -> tuple[list[str], str]:
    """One round as DeepEP's tests run it on `buf` (a commref.ep Buffer in low-latency
    mode): the layout, high-throughput dispatch and combine, low-latency dispatch and
    combine, each checked. `inputs`: this rank's (x, topk_idx, topk_weights) from
    make_inputs, on the host; `device_inputs`: the same where the buffer's kernels read
    them (default: `inputs`). With `combine_twice`, each mode combines again on the same
    handles afterwards (DeepEP's tuning loops), checked too. Returns the problems and a
    digest of what was received and combined the first time."""
    r, n, E, T = buf.rank, buf.nranks, buf.num_experts, buf.max_tokens
    x, topk, w = inputs
    dx, dtopk, dw = inputs if device_inputs is None else device_inputs
    layout = buf.get_dispatch_layout(dtopk)
    problems = check_layout(r, n, E, topk, layout)
    res = buf.dispatch(dx, dtopk, dw, layout)
    problems += check_ht_dispatch(r, n, E, all_topk, all_weights, res)
    cx, cw = buf.combine(res.recv_x, res.handle, res.recv_topk_weights)
    problems += check_ht_combine(r, n, E, x, topk, w, cx, cw)
    ll = buf.low_latency_dispatch(dx, dtopk)
    problems += check_ll_dispatch(r, n, E, T, all_topk, ll)
    out = buf.low_latency_combine(ll.packed_recv_x, dtopk, dw, ll.handle)
    problems += check_ll_combine(r, x, topk, w, out)
    if combine_twice:
        again = buf.low_latency_combine(ll.packed_recv_x, dtopk, dw, ll.handle)
        problems += check_ll_combine(r, x, topk, w, again)
        cx2, cw2 = buf.combine(res.recv_x, res.handle, res.recv_topk_weights)
        problems += check_ht_combine(r, n, E, x, topk, w, cx2, cw2)
    received = digest(
        res.recv_x, res.recv_topk_idx, res.recv_topk_weights, res.handle.recv_src_idx, cx, cw, *ll_received(ll), out
    )
    return problems, received


__all__ = [
    "make_inputs",
    "index_columns",
    "check_layout",
    "check_ht_dispatch",
    "check_ht_combine",
    "check_ll_dispatch",
    "check_ll_combine",
    "checked_round",
    "digest",
    "ll_received",
]
