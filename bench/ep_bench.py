"""MoE dispatch and combine (commref.ep; --mode ht: high-throughput, DeepEP's normal
mode, against the same exchange built on mpi4py's Alltoallv in the same run; --mode ll:
low-latency, commref alone).

    mpiexec -n 4 python -m mpi4py -m commref.bench.ep_bench [--tokens 8,64,512] [--hidden 256,2048]
        [--topk 4] [--experts 16] [-n 30] [-w 5] [--path auto] [--wire ordered] [--protocol auto]
        [--mode ht] [--json F]
    python -m commref.bench.ep_bench -t 4 ...  # 4 ranks as threads (ThreadWorld): commref alone, no MPI baseline

Per (tokens, hidden): one Buffer sized for it, DeepEP-style inputs (collectives/device_api/ep_check.py:
bfloat16 tokens, top-k of random scores with a few -1 entries), one layout shared by
both implementations. Both are checked first with the same exact checks
(ep_check.check_ht_dispatch / check_ht_combine). Then they are timed as a MoE layer uses
them, a dispatch then a combine of its result: -w untimed pairs of each, a world
barrier, -n iterations in which every rank times each implementation's dispatch and
combine, the implementations in turn (which goes first rotates every iteration, so that
a change of this shared machine's load reaches both alike), each step after an untimed
world barrier; an iteration's time is the slowest rank's, the figure is the median over
iterations, in microseconds.

The baseline moves the same bytes from the same arrays to the same arrays: dispatch
packs one row per (token, destination) like commref's ([source token | x | top-k
indices local to the destination, -1 elsewhere | weights, 0 elsewhere]), exchanges the
count matrix (Allgather, so every rank has the prefix matrix commref returns), sends
the rows with one Alltoallv and unpacks them; combine sends each received row (with
its weights) back with one Alltoallv and sums each token's copies in float32. "bytes"
is the mean over ranks of the token bytes one dispatch sends (hidden x dtype size per
(token, destination), the rank's own copies included); "mpi/commref" > 1 means commref
is faster.

--mode ll times low_latency_dispatch and low_latency_combine of a Buffer made with
low_latency_mode=True the same way, checked first with ep_check.check_ll_dispatch and
check_ll_combine; "bytes" counts hidden x dtype size per (token, expert) it sends. It
has no baseline: its packed per-expert layout is not what one Alltoallv of rows gives.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

from commref.collectives.device_api import ep_buffer, ep_check
from commref.transports.gin.options import Path, Wire
from commref.transports.mpi_world import MPIWorld
from commref.transports.thread_world import ThreadWorld

from . import programs
from .flags import add_option, add_timeout_and_threads, int_type, validate_timeout


def _sizes(text: str) -> list[int]:
    """A comma-separated list of positive integers."""
    values = [int_type(1)(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


class MpiExchange:
    """commref.ep's high-throughput dispatch and combine on mpi4py (Allgather, Alltoallv, numpy)."""

    def __init__(self, comm, hidden: int, topk: int, num_experts: int, dtype):
        self.comm, self.n = comm, comm.Get_size()
        self.hidden, self.topk, self.per, self.dtype = hidden, topk, num_experts // self.n, np.dtype(dtype)
        xbytes = hidden * self.dtype.itemsize
        xpad = (xbytes + 7) // 8 * 8
        self.xbytes = xbytes
        self.row = np.dtype([("src", "<i8"), ("x", "u1", (xpad,)), ("idx", "<i4", (topk,)), ("w", "<f4", (topk,))])
        wpad = (4 * topk + 7) // 8 * 2
        self.back = np.dtype([("slot", "<i8"), ("x", "u1", (xpad,)), ("w", "<f4", (wpad,))])

    def _alltoallv(self, send, send_counts, recv, recv_counts, itemsize):
        from mpi4py import MPI

        self.comm.Alltoallv(
            [send.view(np.uint8), send_counts * itemsize, MPI.BYTE],
            [recv.view(np.uint8), recv_counts * itemsize, MPI.BYTE],
        )

    def dispatch(self, x, topk_idx, topk_weights, layout):
        n, per = self.n, self.per
        counts = np.ascontiguousarray(layout.num_tokens_per_rank, np.int32)
        matrix = np.empty((n, n), np.int32)
        self.comm.Allgather(counts, matrix)
        dest, tok = np.nonzero(layout.is_token_in_rank.T)  # by destination, tokens ascending
        send = np.empty(len(tok), self.row)
        send["src"] = tok
        send["x"][:, : self.xbytes] = x.view(np.uint8).reshape(len(x), self.xbytes)[tok]
        topk = topk_idx[tok]
        local = topk - (dest * per)[:, None]
        mine = (topk >= 0) & (local >= 0) & (local < per)
        send["idx"] = np.where(mine, local, -1)
        send["w"] = np.where(mine, topk_weights[tok], 0)
        recv_counts = np.ascontiguousarray(matrix[:, self.comm.Get_rank()])
        recv = np.empty(int(recv_counts.sum()), self.row)
        self._alltoallv(send, counts, recv, recv_counts, self.row.itemsize)
        recv_x = np.ascontiguousarray(recv["x"][:, : self.xbytes]).view(self.dtype)
        recv_topk = recv["idx"].astype(np.int64)
        per_expert = np.bincount(recv_topk[recv_topk >= 0], minlength=per)
        handle = SimpleNamespace(
            rank_prefix_matrix=np.cumsum(matrix, axis=0),
            recv_src_idx=recv["src"].astype(np.int32),
            num_recv=len(recv),
            counts=counts,
            recv_counts=recv_counts,
            dest=dest,
            tok=tok,
            num_tokens=len(x),
        )
        return recv_x, recv_topk, recv["w"].copy(), [int(v) for v in per_expert], handle

    def combine(self, y, handle, topk_weights):
        send = np.empty(handle.num_recv, self.back)
        send["slot"] = handle.recv_src_idx
        send["x"][:, : self.xbytes] = y.view(np.uint8).reshape(len(y), self.xbytes)
        send["w"][:, : self.topk] = topk_weights
        back = np.empty(len(handle.tok), self.back)
        self._alltoallv(send, handle.recv_counts, back, handle.counts, self.back.itemsize)
        out = np.zeros((handle.num_tokens, self.hidden), np.float32)
        out_w = np.zeros((handle.num_tokens, self.topk), np.float32)
        bx = np.ascontiguousarray(back["x"][:, : self.xbytes]).view(self.dtype).astype(np.float32)
        start = 0
        for c in handle.counts:  # each destination's copies: distinct tokens, in order
            rows = slice(start, start + c)
            out[handle.tok[rows]] += bx[rows]
            out_w[handle.tok[rows]] += back["w"][rows, : self.topk]
            start += c
        return out.astype(self.dtype), out_w


def _timed(world, impls: list[list], warmup: int, iters: int) -> list[list[float]]:
    """Per implementation of `impls` (each a list of steps: dispatch, combine), per step,
    the median over iterations of the slowest rank's time of the step, microseconds. An
    iteration runs every implementation's steps in order, the implementations in turn, the
    first one rotating every iteration, so that a change of the machine's load reaches
    them alike; a world barrier (untimed) before each step, so that no step's time holds
    the ranks' skew from the one before."""
    for _ in range(warmup):
        for steps in impls:
            for step in steps:
                step()
    world.barrier(what="bench ep: before timing")
    # every step starts together: MPI's own barrier where there is one (the world's polls
    # with a backoff, so its ranks leave it some microseconds apart)
    barrier = world.comm.Barrier if world.kind == "mpi" else lambda: world.barrier(what="bench ep: a step")
    times = [[[] for _ in steps] for steps in impls]
    for i in range(iters):
        for k in range(len(impls)):
            j = (i + k) % len(impls)
            for s, step in enumerate(impls[j]):
                barrier()
                t0 = time.perf_counter()
                step()
                times[j][s].append(time.perf_counter() - t0)
    every = world.allgather(times, what="bench ep: times")
    return [
        [statistics.median(max(col) for col in zip(*(r[j][s] for r in every))) * 1e6 for s in range(len(steps))]
        for j, steps in enumerate(impls)
    ]


def _ll_steps(world, args, buf, x, topk, w) -> tuple[list, list[str], int]:
    """Low-latency mode: the timed steps (dispatch, combine), the checks' problems, and
    the token bytes one dispatch sends."""
    all_topk = world.allgather(topk, what="bench ep: topk")
    ll = buf.low_latency_dispatch(x, topk)
    wrong = ep_check.check_ll_dispatch(world.rank, world.size, args.experts, buf.max_tokens, all_topk, ll)
    wrong += ep_check.check_ll_combine(
        world.rank, x, topk, w, buf.low_latency_combine(ll.packed_recv_x, topk, w, ll.handle)
    )
    out = {}

    def dispatch():
        out["ll"] = buf.low_latency_dispatch(x, topk)

    def combine():
        buf.low_latency_combine(out["ll"].packed_recv_x, topk, w, out["ll"].handle)

    return [dispatch, combine], wrong, int((topk >= 0).sum()) * x.shape[1] * buf.dtype.itemsize


def run_rank(world, args) -> list[dict]:
    mpi = world.kind == "mpi" and args.mode == "ht"
    rows = []
    for tokens in args.tokens:
        for hidden in args.hidden:
            opts = dict(path=args.path, wire=args.wire, protocol=args.protocol, timeout=args.timeout)
            with ep_buffer.Buffer(
                world,
                num_experts=args.experts,
                hidden=hidden,
                max_tokens_per_rank=tokens,
                num_topk=args.topk,
                device="cpu",
                low_latency_mode=args.mode == "ll",
                **opts,
            ) as buf:
                x, topk, w = ep_check.make_inputs(
                    world.rank, world.size, tokens, hidden, args.experts, args.topk, seed=args.seed
                )
                row = {"tokens": tokens, "hidden": hidden, "path": args.path, "protocol": buf.protocol}
                if args.mode == "ll":
                    steps, wrong, row["bytes"] = _ll_steps(world, args, buf, x, topk, w)
                    row["commref_dispatch_us"], row["commref_combine_us"] = _timed(
                        world, [steps], args.warmup, args.iters
                    )[0]
                    rows.append(dict(row, wrong=wrong))
                    continue
                layout = buf.get_dispatch_layout(topk)
                all_topk = world.allgather(topk, what="bench ep: topk")
                all_w = world.allgather(w, what="bench ep: weights")
                res = buf.dispatch(x, topk, w, layout)
                wrong = ep_check.check_ht_dispatch(world.rank, world.size, args.experts, all_topk, all_w, res)
                cx, cw = buf.combine(res.recv_x, res.handle, res.recv_topk_weights)
                wrong += ep_check.check_ht_combine(world.rank, world.size, args.experts, x, topk, w, cx, cw)
                row["bytes"] = int(np.asarray(layout.num_tokens_per_rank).sum()) * hidden * buf.dtype.itemsize
                out = {}

                def ours():
                    out["ours"] = buf.dispatch(x, topk, w, layout)

                impls = [
                    [ours, lambda: buf.combine(out["ours"].recv_x, out["ours"].handle, out["ours"].recv_topk_weights)]
                ]
                if mpi:
                    base = MpiExchange(world.comm, hidden, args.topk, args.experts, buf.dtype)
                    bres = base.dispatch(x, topk, w, layout)
                    wrong += [
                        "mpi: " + p
                        for p in ep_check.check_ht_dispatch(world.rank, world.size, args.experts, all_topk, all_w, bres)
                    ]
                    bx, bw = base.combine(bres[0], bres[4], bres[2])
                    wrong += [
                        "mpi: " + p
                        for p in ep_check.check_ht_combine(world.rank, world.size, args.experts, x, topk, w, bx, bw)
                    ]

                    def theirs():
                        out["mpi"] = base.dispatch(x, topk, w, layout)

                    impls.append([theirs, lambda: base.combine(out["mpi"][0], out["mpi"][4], out["mpi"][2])])
                times = _timed(world, impls, args.warmup, args.iters)
                row["commref_dispatch_us"], row["commref_combine_us"] = times[0]
                if mpi:
                    row["mpi_dispatch_us"], row["mpi_combine_us"] = times[1]
                row["wrong"] = wrong
            rows.append(row)
    every = world.allgather(rows, what="bench ep: rows")
    return [
        dict(
            row,
            bytes=int(statistics.mean(r[i]["bytes"] for r in every)),
            wrong=sum(len(r[i]["wrong"]) for r in every),
            first_wrong=next((r[i]["wrong"][0] for r in every if r[i]["wrong"]), None),
        )
        for i, row in enumerate(rows)
    ]


def _size(b: int) -> str:
    for unit, k in (("M", 1 << 20), ("K", 1 << 10)):
        if b >= k:
            return f"{b / k:.1f}{unit}"
    return f"{b}B"


def format_table(rows: list[dict], nranks: int, kind: str, args, load: tuple) -> str:
    mode = (
        "high-throughput dispatch/combine vs mpi4py Alltoallv" if args.mode == "ht" else "low-latency dispatch/combine"
    )
    lines = [
        f"# commref.ep {mode}: {nranks} ranks ({kind}), "
        f"path {args.path}, wire {args.wire}, protocol {rows[0]['protocol'] if rows else args.protocol}, "
        f"topk {args.topk}, experts {args.experts}, bfloat16; median of {args.iters} (slowest rank), us",
        f"# load average {load[0]:.2f} at the start, {load[1]:.2f} at the end (2 cores here is 2.0 busy)",
        f"{'tokens':>7} {'hidden':>7} {'bytes':>8} | {'dispatch':>9} {'mpi':>9} {'mpi/cr':>7} | "
        f"{'combine':>9} {'mpi':>9} {'mpi/cr':>7} | wrong",
    ]
    for r in rows:

        def cell(key):
            return f"{r[key]:9.1f}" if key in r else f"{'n/a':>9}"

        def ratio(a, b):
            return f"{r[b] / r[a]:7.2f}" if b in r else f"{'n/a':>7}"

        lines.append(
            f"{r['tokens']:>7} {r['hidden']:>7} {_size(r['bytes']):>8} | {cell('commref_dispatch_us')} "
            f"{cell('mpi_dispatch_us')} {ratio('commref_dispatch_us', 'mpi_dispatch_us')} | "
            f"{cell('commref_combine_us')} {cell('mpi_combine_us')} "
            f"{ratio('commref_combine_us', 'mpi_combine_us')} | {r['wrong']}"
        )
    for r in rows:
        if r["first_wrong"]:
            lines.append(f"# WRONG ({r['tokens']} x {r['hidden']}): {r['first_wrong']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--tokens", type=_sizes, default=_sizes("8,64,512"), help="tokens per rank, comma-separated (default 8,64,512)"
    )
    p.add_argument(
        "--hidden",
        type=_sizes,
        default=_sizes("256,2048"),
        help="hidden size (bfloat16 elements per token), comma-separated (default 256,2048)",
    )
    p.add_argument("--topk", type=int_type(1), default=4, help="experts per token (default 4)")
    p.add_argument(
        "--experts", type=int_type(1), default=16, help="experts in all, a multiple of the ranks (default 16)"
    )
    p.add_argument("-n", "--iters", type=int_type(1), default=30, help="timed iterations (default 30)")
    p.add_argument("-w", "--warmup", type=int_type(0), default=5, help="untimed iterations first (default 5)")
    add_option(
        p,
        "--path",
        "auto",
        "peers by load/store (lsa), through GIN (gin), or LSA where mapped (auto, the default)",
        choices=Path,
    )
    add_option(p, "--wire", "ordered", "GIN wire ordering model (default ordered)", choices=Wire)
    p.add_argument(
        "--protocol",
        default="auto",
        choices=["auto", *ep_buffer.PROTOCOLS],
        help="how GIN dispatches publish a token (default auto)",
    )
    p.add_argument(
        "--mode",
        default="ht",
        choices=["ht", "ll"],
        help="high-throughput dispatch and combine beside the MPI baseline (ht, the default), or low-latency (ll)",
    )
    p.add_argument("--seed", type=int_type(0), default=1, help="seed of the inputs (default 1)")
    add_timeout_and_threads(p, 4)
    p.add_argument("--json", metavar="FILE", default=None, help="also write the rows as JSON")
    return p


def validate(args) -> None:
    if args.topk > args.experts:
        raise ValueError(f"--topk {args.topk} exceeds --experts {args.experts}")
    validate_timeout(args)


def footprint(args, nranks: int):
    """One rank's cost (programs.py): the largest ep_buffer.Buffer (dispatch receives up to every
    rank's tokens, combine sends them back) and the baseline's copies, one communicator."""
    from .footprint import program_footprint

    token_bytes = max(args.tokens) * max(args.hidden) * 2  # bfloat16
    return program_footprint(4 * nranks * token_bytes, 1, nranks)


def run(args) -> int:
    """The benchmark on this process's ranks: the MPI world under mpiexec (rank 0
    prints), else --threads ranks as threads."""
    load0 = os.getloadavg()[0]
    if MPIWorld.launched_under_mpi():
        world = MPIWorld(timeout=args.timeout)
        rows, nranks, kind = run_rank(world, args), world.size, "MPI processes"
        if world.rank != 0:
            return 0 if all(r["wrong"] == 0 for r in rows) else 1
    else:
        rows = ThreadWorld.run(args.threads, run_rank, args, timeout=args.timeout * 10)[0]
        nranks, kind = args.threads, "ThreadWorld"
    print(format_table(rows, nranks, kind, args, (load0, os.getloadavg()[0])), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nranks": nranks, "world": kind, "args": vars(args), "rows": rows}, f, indent=1)
        print(f"# wrote {args.json}", flush=True)
    return 0 if all(r["wrong"] == 0 for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    return programs.run_module(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
