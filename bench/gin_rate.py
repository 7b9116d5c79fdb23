"""GIN proxy rate and GIN-vs-LSA bandwidth, 2 ranks (or the MPI job's ranks).

    mpiexec -n 2 python -m mpi4py -m commref.bench.gin_rate [--small-iters 3000] [--bytes 16M] [--iters 10]
    python -m commref.bench.gin_rate ...    # without mpiexec: 2 ranks as threads (ThreadWorld)

- rate: AllReduce of 2 float32 elements (8 bytes) over path="gin", backend "proxy" on
  the shm wire (the proxy writes into the peer's mapped window), strong signals, for
  each wire ordering. Each proxy's `stats["ops"]` (descriptors it took from its
  queue: a put with its signal, or a bare credit signal) is counted over a timed loop
  of --small-iters collectives; reported per proxy (ops/s), as ops per collective, as
  collectives/s, and as latencies: microseconds per collective and per proxy operation
  (the loop is latency-bound: one collective waits for the previous one). The report
  names the engine that carried each (native: the C++
  engine, transports/gin/native.py, which the ordered shm wire gets by default;
  python: the Python proxy; COMMREF_GIN_ENGINE=python forces it for comparison).
- busbw: AllReduce of --bytes (float32) over path="lsa" and over path="gin" (shm wire,
  ordered, strong), built from the same world in the same run and timed alternately:
  per iteration the slowest rank's time after a barrier; the median of --iters
  iterations after --warmup; busbw = 2(n-1)/n * bytes / time (nccl-tests' AllReduce
  factor), in GB/s (10^9 B/s).

In ThreadWorld the two proxies are Python threads of one process and share its GIL
with each other and with the ranks' launch paths; under mpiexec each rank is its own
process, which is what a deployment looks like. Say which one a figure comes from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from commref.collectives.communicator import Communicator
from commref.transports.world import MPIWorld, ThreadWorld

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1] if s and s[-1] in _UNITS else ""
    return int(s[: len(s) - len(unit)]) * _UNITS[unit]


def _small_rate(world, wire: str, iters: int) -> dict:
    comm = Communicator(world, "cpu", path="gin", backend="proxy", network="shm", wire=wire, seed=1)
    x = np.array([1.0, 2.0], np.float32) * (world.rank + 1)
    y = np.empty_like(x)
    for _ in range(100):  # warmup
        comm.allreduce(x, y)
    world.barrier(what="rate start")
    engine = _engine(comm)
    ops0 = comm.proxy.stats["ops"]
    t0 = time.perf_counter()
    for _ in range(iters):
        comm.allreduce(x, y)
    elapsed = time.perf_counter() - t0
    # Taken so far: the last call's trailing credit signal may still be in the queue.
    ops = comm.proxy.stats["ops"] - ops0
    expected = np.array([1.0, 2.0], np.float32) * sum(range(1, world.size + 1))
    ok = bool((y == expected).all())
    world.barrier(what="rate end")
    comm.close()
    return {"ops": ops, "seconds": elapsed, "ok": ok, "engine": engine}


def _engine(comm) -> str:
    """Which GIN engine carries `comm`: "native" (native.NativeProxy) or "python" (proxy.GinProxy)."""
    return "native" if type(comm.proxy).__name__ == "NativeProxy" else "python"


def _time_allreduce(world, comm, x, y) -> float:
    world.barrier(what="iteration start")
    t0 = time.perf_counter()
    comm.allreduce(x, y)
    return time.perf_counter() - t0


def _busbw(world, nbytes: int, iters: int, warmup: int) -> dict:
    count = nbytes // 4
    comms = {"lsa": Communicator(world, "cpu", path="lsa"),
             "gin": Communicator(world, "cpu", path="gin", backend="proxy", network="shm", wire="ordered")}
    x = (np.arange(count, dtype=np.float32) % 1024) * (world.rank + 1)
    y = np.empty_like(x)
    times: dict = {k: [] for k in comms}
    for i in range(warmup + iters):
        for name, comm in comms.items():  # alternately, so drift hits both alike
            t = _time_allreduce(world, comm, x, y)
            if i >= warmup:
                times[name].append(t)
    expected = (np.arange(count, dtype=np.float32) % 1024) * sum(range(1, world.size + 1))
    ok = bool((y == expected).all())
    geometry = {k: {"channels_max": c.max_channels, "slot_bytes": c.slot_bytes, "nsteps": c.nsteps}
                for k, c in comms.items()}
    engine = _engine(comms["gin"])
    world.barrier(what="busbw end")
    for c in comms.values():
        c.close()
    return {"times": times, "ok": ok, "geometry": geometry, "engine": engine}


def measure(world, args) -> dict | None:
    rates = {wire: _small_rate(world, wire, args.small_iters) for wire in ("ordered", "unordered")}
    bw = _busbw(world, args.bytes, args.iters, args.warmup)
    gathered = world.allgather((rates, bw), what="gin_rate results")
    if world.rank != 0:
        return None
    n = world.size
    out = {"world": world.kind, "nranks": n, "rate": {}, "busbw": {}}
    for wire in ("ordered", "unordered"):
        per = [g[0][wire] for g in gathered]
        seconds = max(p["seconds"] for p in per)
        ops = [p["ops"] for p in per]
        out["rate"][wire] = {
            "collectives_per_s": args.small_iters / seconds,
            "ops_per_collective_per_proxy": [o / args.small_iters for o in ops],
            "ops_per_s_per_proxy": [o / seconds for o in ops],
            "ops_per_s_all_proxies": sum(ops) / seconds,
            # the loop is latency-bound: one collective, and one proxy operation of it, take this long
            "us_per_collective": seconds / args.small_iters * 1e6,
            "us_per_op_per_proxy": [seconds / o * 1e6 if o else None for o in ops],
            "correct": all(p["ok"] for p in per),
            "engine": per[0]["engine"],
        }
    factor = 2 * (n - 1) / n
    for name in ("lsa", "gin"):
        # per iteration the slowest rank, then the median over iterations
        per_iter = [max(g[1]["times"][name][i] for g in gathered) for i in range(args.iters)]
        med = statistics.median(per_iter)
        out["busbw"][name] = {"median_s": med, "algbw_GBps": args.bytes / med / 1e9,
                              "busbw_GBps": factor * args.bytes / med / 1e9,
                              "geometry": gathered[0][1]["geometry"][name]}
    out["busbw"]["bytes"] = args.bytes
    out["busbw"]["gin_engine"] = gathered[0][1]["engine"]
    out["busbw"]["correct"] = all(g[1]["ok"] for g in gathered)
    return out


def report(out: dict) -> str:
    lines = [f"# commref GIN rate: {out['nranks']} ranks, {out['world']} world, CPU engine, backend proxy, shm wire"]
    for wire, r in out["rate"].items():
        ops = ", ".join(f"{v:,.0f}" for v in r["ops_per_s_per_proxy"])
        per = ", ".join(f"{v:.1f}" for v in r["ops_per_collective_per_proxy"])
        lines.append(f"8-byte AllReduce, {wire:>9} wire, {r['engine']} engine: {r['collectives_per_s']:,.0f} collectives/s; "
                     f"proxy ops/s per rank [{ops}] (all proxies {r['ops_per_s_all_proxies']:,.0f}); "
                     f"ops per collective per proxy [{per}]; {r['us_per_collective']:.1f} us per collective, "
                     f"us per op per proxy [{', '.join(f'{v:.2f}' for v in r['us_per_op_per_proxy'] if v)}]; "
                     f"correct={r['correct']}")
    b = out["busbw"]
    lines.append(f"{b['bytes'] / 2**20:g} MiB AllReduce (median, slowest rank per iteration), gin on the "
                 f"{b['gin_engine']} engine, correct={b['correct']}:")
    for name in ("lsa", "gin"):
        r = b[name]
        lines.append(f"  {name}: {r['median_s'] * 1e3:8.2f} ms  algbw {r['algbw_GBps']:6.2f} GB/s  "
                     f"busbw {r['busbw_GBps']:6.2f} GB/s  {r['geometry']}")
    lines.append(f"  gin/lsa busbw: {b['gin']['busbw_GBps'] / b['lsa']['busbw_GBps']:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small-iters", type=int, default=3000, help="8-byte AllReduces per wire in the rate loop")
    p.add_argument("--bytes", type=parse_bytes, default=16 << 20, help="AllReduce size for busbw (default 16M)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nranks", type=int, default=2, help="ranks as threads when not under mpiexec")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if MPIWorld.launched_under_mpi():
        out = measure(MPIWorld(), args)
    else:
        out = ThreadWorld.run(args.nranks, measure, args)[0]
    if out is None:
        return 0
    print(report(out), flush=True)
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    ok = out["busbw"]["correct"] and all(r["correct"] for r in out["rate"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
