"""Soak: many mixed collectives on one communicator, then many communicators in a row,
with what a process holds measured at the start and at the end.

    COMMREF_NODES=2 mpiexec -n 4 python -m mpi4py -m commref.bench.soak [--calls 20000] [--comms 200]
        [--max-bytes 4M] [--fault drop=0.05,dup=0.05,delay=0.05] [--seed 1] [--json soak.json]
    python -m commref.bench.soak -t 4 ...   # 4 ranks as threads (ThreadWorld)

Phase 1, one communicator (path "auto": LSA inside a node, GIN across nodes on the
unordered wire with the lossy link and its reliability layer, `--fault`): `--calls`
calls drawn from a seeded stream, each a collective of the catalogue that has kernels
(catalogue.KERNEL_NAMES) with an algorithm it implements here (ring, tree, hierarchical
where the job has several nodes of several ranks; direct only where every peer is LSA),
a dtype, an op, a count whose largest buffer is 0 to `--max-bytes` bytes (log-uniform,
so most calls are small and some are large), in place or not, a root; hierarchical calls
use symmetric buffers every other time (their intra-node phases then run direct
kernels). Every result is checked exactly (collectives.check.run_case). Phase 2:
`--comms` communicators created, used for one AllReduce and closed.

Measured per rank (Linux /proc): resident memory (VmRSS), threads, open file
descriptors and memory mappings; and the host's /dev/shm entries; each after a
barrier (no rank works while it is taken) and a full garbage collection; in a
ThreadWorld, whose ranks share the process, by rank 0 alone. Samples: after a
warm-up (the first 2 % of the calls, at least 50; the first 5 communicators), every
tenth of the phase, and at the end. The report gives per rank the start, the end and
the largest growth between them; a JSON file keeps every sample.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import time

import numpy as np

from commref.collectives import catalogue, check
from commref.collectives.communicator import Communicator
from commref.collectives.hierarchical import NodeShape
from commref.collectives.memory import Memory, SymmetricMemory
from commref.collectives.verify import DTYPES, OPS
from commref.transports.mpi_world import MPIWorld
from commref.transports.thread_world import ThreadWorld

from . import programs
from .flags import add_option, add_timeout_and_threads, int_type, parse_size, validate_timeout

MEASURES = ("rss_kib", "threads", "fds", "maps", "shm_entries")


def sample() -> dict:
    """What this process holds now, after a full garbage collection (what is left then
    is held, not merely not yet collected)."""
    gc.collect()
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return {
        "rss_kib": int(status["VmRSS"][0]),
        "threads": int(status["Threads"][0]),
        "fds": len(os.listdir("/proc/self/fd")),
        "maps": maps,
        "shm_entries": len(os.listdir("/dev/shm")),
    }


def _sample(world, samples: list, after: int) -> None:
    """Collective: a sample of this process between two barriers, so that no rank works
    meanwhile. In a ThreadWorld the ranks share the process: rank 0 alone samples it."""
    world.barrier(what="soak: before a sample")
    if world.kind != "thread" or world.rank == 0:
        samples.append({"after": after, **sample()})
    world.barrier(what="soak: after a sample")


def draw_cases(
    rng: random.Random, calls: int, nranks: int, max_bytes: int, hierarchical: bool, direct: bool
) -> list[check.Case]:
    """The seeded stream of calls (every rank draws the same)."""
    out = []
    names = list(catalogue.KERNEL_NAMES)
    dtypes = list(DTYPES)
    for i in range(calls):
        coll = rng.choice(names)
        spec = catalogue.get(coll)
        algo = rng.choice(check.algorithms_for(coll, direct, hierarchical))
        dtype = rng.choice(dtypes)
        op = rng.choice(list(OPS)) if spec.reducing else None
        nbytes = 0 if rng.random() < 0.02 else int(math.exp(rng.uniform(0, math.log(max_bytes))))
        scale = nranks if spec.scaled else 1
        count = nbytes // DTYPES[dtype].itemsize // scale
        in_place = rng.random() < 0.5 and "alltoall" not in coll
        out.append(check.Case(coll, algo, dtype, op, count, in_place, rng.randrange(nranks), 1_000_003 * i + 7))
    return out


def _samples_at(total: int, warm: int) -> set[int]:
    return {warm} | {warm + (total - warm) * k // 10 for k in range(1, 11)}


def run_rank(world, args) -> dict:
    opts = dict(path="auto", wire="unordered", fault=args.fault, seed=args.seed, timeout=args.timeout)
    report: dict = {
        "calls": args.calls,
        "comms": args.comms,
        "max_bytes": args.max_bytes,
        "fault": args.fault,
        "nranks": world.size,
        "samples": {"calls": [], "comms": []},
    }
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    with Communicator(world, "cpu", **opts) as comm:
        hierarchical = isinstance(comm.node_shape, NodeShape)
        direct = not comm.peer_mask
        cases = draw_cases(rng, args.calls, world.size, args.max_bytes, hierarchical, direct)
        comm.prepare({comm.kernel_spec(c.coll, c.dtype, c.op) for c in cases})
        plain = Memory(np)
        capacity = max(
            SymmetricMemory.capacity(*catalogue.get(c.coll).counts(c.count, world.size), DTYPES[c.dtype].itemsize)
            for c in cases
        )
        symmetric = SymmetricMemory(comm, np, capacity) if (hierarchical or direct) else None
        warm = min(args.calls, max(50, args.calls // 50))
        at = _samples_at(args.calls, warm)
        wrong, by_coll = 0, {}
        for i, case in enumerate(cases):
            use_sym = symmetric is not None and (
                case.algorithm == "direct" or (case.algorithm == "hierarchical" and i % 2 == 0)
            )
            w = check.run_case(comm, case, memory=symmetric if use_sym else plain)
            wrong += w
            by_coll[case.coll] = by_coll.get(case.coll, 0) + 1
            if i + 1 in at:
                _sample(world, report["samples"]["calls"], i + 1)
        if symmetric is not None:
            symmetric.free()
        world.barrier(what="soak: calls done")
        report["wrong"] = int(sum(world.allgather(wrong, what="soak: wrong elements")))
        report["by_collective"] = by_coll
        report["algorithms"] = sorted({c.algorithm for c in cases})
        stats = dict(getattr(comm.proxy, "stats", None) or {})
    report["gin_stats"] = stats
    report["calls_seconds"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    warm = min(args.comms, 5)
    at = _samples_at(args.comms, warm)
    x = np.arange(1024, dtype=np.float32)
    for k in range(args.comms):
        with Communicator(world, "cpu", **opts) as comm:
            y = np.empty_like(x)
            comm.allreduce(x, y)
            if not np.array_equal(y, x * world.size):
                raise AssertionError(f"rank {world.rank}: communicator {k}: AllReduce wrong")
        if k + 1 in at:
            _sample(world, report["samples"]["comms"], k + 1)
    report["comms_seconds"] = time.perf_counter() - t1
    return report


def growth(samples: list[dict]) -> dict:
    """Per measure: (start, end, largest value minus start) over the samples."""
    first, last = samples[0], samples[-1]
    return {m: (first[m], last[m], max(s[m] for s in samples) - first[m]) for m in MEASURES}


def format_report(reports: list[dict]) -> str:
    r0 = reports[0]
    lines = [
        f"# commref soak: {r0['nranks']} ranks, {r0['calls']} calls on one communicator "
        f"({r0['calls_seconds']:.0f} s, {r0['wrong']} wrong elements; algorithms {', '.join(r0['algorithms'])}; "
        f"fault {r0['fault']}), then {r0['comms']} communicators ({r0['comms_seconds']:.0f} s)",
        f"# calls per collective (rank 0): {r0['by_collective']}",
        f"# GIN proxy of rank 0: {r0['gin_stats']}",
        "# phase      rank  measure        start        end  max growth",
    ]
    for phase in ("calls", "comms"):
        for rank, r in enumerate(reports):
            if not r["samples"][phase]:  # a ThreadWorld's ranks but the first: one process, sampled by rank 0
                continue
            for m, (start, end, grow) in growth(r["samples"][phase]).items():
                lines.append(f"  {phase:<9}{rank:>5}  {m:<12}{start:>10}{end:>11}{grow:>12}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--calls", type=int_type(1), default=20000, help="calls on one communicator (default 20000)")
    p.add_argument("--comms", type=int_type(1), default=200, help="communicators created and closed (default 200)")
    p.add_argument(
        "--max-bytes", type=parse_size, default=parse_size("4M"), help="largest buffer of a call (default 4M)"
    )
    add_option(
        p,
        "--fault",
        "drop=0.05,dup=0.05,delay=0.05",
        "the lossy link under the GIN wire (default drop=0.05,dup=0.05,delay=0.05)",
    )
    add_option(p, "--seed", 1, "seed of the calls and the wire (default 1)")
    add_timeout_and_threads(p, 1)
    p.add_argument("--json", metavar="FILE", default=None, help="also write every sample as JSON")
    return p


def validate(args) -> None:
    validate_timeout(args)


def footprint(args, nranks: int):
    """One rank's cost (programs.py): the phase's communicator and the next one being made,
    over buffers of up to --max-bytes (a collective's send and receive buffers and the
    symmetric ones of hierarchical calls)."""
    from .footprint import program_footprint

    return program_footprint(3 * args.max_bytes, 2, nranks)


def run(args) -> int:
    """The soak on this process's ranks (the MPI world under mpiexec, else --threads
    threads); rank 0 prints the report."""
    if MPIWorld.launched_under_mpi():
        world = MPIWorld()
        mine = run_rank(world, args)
        reports = world.allgather(mine, what="soak: reports")
        if world.rank != 0:
            return 0 if reports[0]["wrong"] == 0 else 1
    else:
        reports = ThreadWorld.run(args.threads, run_rank, args, timeout=args.timeout)
    print(format_report(reports), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
        print(f"# wrote {args.json}", flush=True)
    return 0 if reports[0]["wrong"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    return programs.run_module(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
