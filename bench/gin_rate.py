"""GIN proxy rate, GIN-vs-LSA latency and GIN-vs-LSA (and vs MPI) bandwidth, 2 ranks
(or the MPI job's ranks).

    mpiexec -n 2 python -m mpi4py -m commref.bench.gin_rate [--small-iters 3000] [--bytes 16M] [--iters 10]
    python -m commref.bench.gin_rate ...    # without mpiexec: 2 ranks as threads (ThreadWorld)

- rate: AllReduce of 2 float32 elements (8 bytes) over path="gin", backend "proxy" on
  the shm wire (the proxy writes into the peer's mapped window), strong signals, for
  each wire ordering. Each proxy's `stats["ops"]` (descriptors it took from its queue:
  a put with its signal, a bare credit signal, a doorbell) is counted over a timed loop
  of --small-iters collectives; reported per proxy (descriptors/s, and GIN operations/s:
  the descriptors less the doorbells, where the engine counts them), as descriptors per
  collective, as collectives/s, and as latencies: microseconds per collective and per
  descriptor (the loop is latency-bound: one collective waits for the previous one).
  The report names the engine that carried each (native: the C++ engine,
  transports/gin/native.py, which the ordered wire gets by default; python: the Python
  proxy; COMMREF_GIN_ENGINE=python forces it for comparison).
- latency: the same 8-byte AllReduce over path="lsa" and over GIN (ordered shm wire,
  strong), timed in --latency-blocks alternating blocks of --latency-iters calls each;
  per path the median over blocks of microseconds per call, and their ratio.
- pipelined rate: AllReduce of --pipe-bytes over GIN (shm, strong, each wire ordering) with FIFO
  slots of --pipe-slot-bytes (default 1 KiB messages) and --pipe-steps slots in flight
  per link (default 64), so the proxy is fed without waiting for each operation's round
  trip (the message-rate view of the proxy, as osu_mbw_mr's window: descriptors/s and
  GIN operations/s per proxy, as above).
- busbw: AllReduce of --bytes (float32) over path="lsa", over path="gin" (shm wire,
  ordered, strong) and, under mpiexec, over path="gin" with network "mpi" (the engines
  exchange messages on their own communicator) and MPI's own Allreduce on the same
  numpy buffers (the MPI baseline), built from the same world in the same run and timed
  alternately: per iteration the slowest rank's time after a barrier; the median of
  --iters iterations after --warmup; busbw = 2(n-1)/n * bytes / time (nccl-tests'
  AllReduce factor), in GB/s (10^9 B/s). Each communicator twice: plain numpy buffers,
  and buffers from its alloc_symmetric (NCCL's zero-copy path: the direct kernels, which
  over GIN put straight from window to window); MPI on numpy buffers.

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

from commref.bench.environment import cpu_list
from commref.collectives.communicator import Communicator
from commref.transports.cpu_binding import allowed_cpus
from commref.transports.mpi_world import MPIWorld
from commref.transports.thread_world import ThreadWorld

from . import programs
from .flags import int_type, option_type, parse_size

WIRES = ("ordered", "unordered")


def _gin(world, **kw):
    return Communicator(
        world,
        "cpu",
        path="gin",
        backend="proxy",
        wire=kw.pop("wire", "ordered"),
        network=kw.pop("network", "shm"),
        seed=1,
        **kw,
    )


def _counted(comm) -> tuple[int, int | None]:
    """(descriptors taken, of them doorbells: None where the engine does not count them)."""
    st = comm.proxy.stats
    return st["ops"], st.get("doorbells")


def _rate_of(world, comm, call, iters: int) -> dict:
    """Times `iters` calls of call() on `comm` after a barrier; the descriptors its proxy took."""
    world.barrier(what="rate start")
    ops0, bells0 = _counted(comm)
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    elapsed = time.perf_counter() - t0
    # Taken so far: the last call's trailing credit signal may still be in the queue.
    ops1, bells1 = _counted(comm)
    world.barrier(what="rate end")
    return {
        "ops": ops1 - ops0,
        "doorbells": None if bells0 is None else bells1 - bells0,
        "seconds": elapsed,
        "engine": _engine(comm),
    }


def _small_rate(world, wire: str, iters: int) -> dict:
    comm = _gin(world, wire=wire)
    x = np.array([1.0, 2.0], np.float32) * (world.rank + 1)
    y = np.empty_like(x)
    for _ in range(100):  # warmup
        comm.allreduce(x, y)
    out = _rate_of(world, comm, lambda: comm.allreduce(x, y), iters)
    expected = np.array([1.0, 2.0], np.float32) * sum(range(1, world.size + 1))
    out["ok"] = bool((y == expected).all())
    comm.close()
    return out


def _pipelined_rate(world, wire: str, nbytes: int, slot_bytes: int, nsteps: int, iters: int) -> dict:
    comm = _gin(world, wire=wire, slot_bytes=slot_bytes, nsteps=nsteps)
    x = (np.arange(nbytes // 4, dtype=np.float32) % 64) * (world.rank + 1)
    y = np.empty_like(x)
    for _ in range(3):
        comm.allreduce(x, y)
    out = _rate_of(world, comm, lambda: comm.allreduce(x, y), iters)
    out["ok"] = bool((y == (np.arange(nbytes // 4, dtype=np.float32) % 64) * sum(range(1, world.size + 1))).all())
    out["calls"] = iters
    comm.close()
    return out


def _latency(world, blocks: int, iters: int) -> dict:
    comms = {"lsa": Communicator(world, "cpu", path="lsa"), "gin": _gin(world)}
    x = np.array([1.0, 2.0], np.float32) * (world.rank + 1)
    y = np.empty_like(x)
    us: dict = {k: [] for k in comms}
    for _ in range(blocks):
        for name, comm in comms.items():  # alternately, so drift hits both alike
            for _ in range(50):
                comm.allreduce(x, y)
            world.barrier(what="latency block")
            t0 = time.perf_counter()
            for _ in range(iters):
                comm.allreduce(x, y)
            us[name].append((time.perf_counter() - t0) / iters * 1e6)
    world.barrier(what="latency end")
    for c in comms.values():
        c.close()
    return us


def _engine(comm) -> str:
    """Which GIN engine carries `comm`: "native" (native.NativeProxy) or "python" (proxy.GinProxy)."""
    return "native" if type(comm.proxy).__name__ == "NativeProxy" else "python"


class _MpiAllreduce:
    """MPI's own Allreduce on numpy buffers: the baseline, timed like a communicator."""

    def __init__(self, world):
        from mpi4py import MPI

        self.comm, self.sum = world.comm, MPI.SUM

    def allreduce(self, x, y):
        self.comm.Allreduce(x, y, op=self.sum)

    def close(self):
        pass


def _time_allreduce(world, comm, x, y) -> float:
    world.barrier(what="iteration start")
    t0 = time.perf_counter()
    comm.allreduce(x, y)
    return time.perf_counter() - t0


def _busbw(world, nbytes: int, iters: int, warmup: int) -> dict:
    count = nbytes // 4
    comms = {"lsa": Communicator(world, "cpu", path="lsa"), "gin": _gin(world)}
    if world.kind == "mpi":
        comms["gin_mpi"] = _gin(world, network="mpi")
        comms["mpi"] = _MpiAllreduce(world)
    x = (np.arange(count, dtype=np.float32) % 1024) * (world.rank + 1)
    expected = (np.arange(count, dtype=np.float32) % 1024) * sum(range(1, world.size + 1))
    # series name -> (communicator, sendbuf, recvbuf): plain numpy buffers, and for each
    # communicator buffers from its alloc_symmetric ("_sym": the direct kernels, which
    # push over GIN where the engine carries the windows)
    series = {name: (comm, x, np.empty_like(x)) for name, comm in comms.items()}
    for name, comm in list(comms.items()):
        if isinstance(comm, Communicator):
            xs, ys = comm.alloc_symmetric(count, np.float32), comm.alloc_symmetric(count, np.float32)
            xs[:] = x
            series[f"{name}_sym"] = (comm, xs, ys)
    times: dict = {k: [] for k in series}
    ok = True
    for i in range(warmup + iters):
        for name, (comm, sendbuf, recvbuf) in series.items():  # alternately, so drift hits all alike
            recvbuf.fill(0)
            t = _time_allreduce(world, comm, sendbuf, recvbuf)
            ok = ok and bool((recvbuf == expected).all())
            if i >= warmup:
                times[name].append(t)
    geometry = {
        k: {"channels_max": c.max_channels, "slot_bytes": c.slot_bytes, "nsteps": c.nsteps}
        for k, (c, _, _) in series.items()
        if isinstance(c, Communicator)
    }
    kernels = {
        k: _kernel_of(c, s.size, k.endswith("_sym")) for k, (c, s, _) in series.items() if isinstance(c, Communicator)
    }
    engines = {k: _engine(c) for k, c in comms.items() if k.startswith("gin")}
    world.barrier(what="busbw end")
    for c in comms.values():
        c.close()
    return {"times": times, "ok": ok, "geometry": geometry, "engines": engines, "kernels": kernels}


def _kernel_of(comm, count: int, symmetric: bool) -> str:
    """The kernel of comm's AllReduce of `count` elements on plain or symmetric buffers."""
    kernels = [p.kernel for p in comm.planned("allreduce", count, symmetric)]
    return kernels[-1] if kernels else "?"


def _rate_summary(per: list[dict], calls: int) -> dict:
    seconds = max(p["seconds"] for p in per)
    ops = [p["ops"] for p in per]
    gin_ops = [p["ops"] - p["doorbells"] if p["doorbells"] is not None else None for p in per]
    return {
        "collectives_per_s": calls / seconds,
        "ops_per_collective_per_proxy": [o / calls for o in ops],
        "ops_per_s_per_proxy": [o / seconds for o in ops],
        "gin_ops_per_s_per_proxy": [None if g is None else g / seconds for g in gin_ops],
        "ops_per_s_all_proxies": sum(ops) / seconds,
        # latency-bound loops: one collective, and one proxy descriptor of it, take this long
        "us_per_collective": seconds / calls * 1e6,
        "us_per_op_per_proxy": [seconds / o * 1e6 if o else None for o in ops],
        "correct": all(p["ok"] for p in per),
        "engine": per[0]["engine"],
    }


def measure(world, args) -> dict | None:
    rates = {wire: _small_rate(world, wire, args.small_iters) for wire in WIRES}
    lat = _latency(world, args.latency_blocks, args.latency_iters)
    pipe = {
        wire: _pipelined_rate(world, wire, args.pipe_bytes, args.pipe_slot_bytes, args.pipe_steps, args.pipe_iters)
        for wire in WIRES
    }
    bw = _busbw(world, args.bytes, args.iters, args.warmup)
    cpus = cpu_list(allowed_cpus())
    gathered = world.allgather((rates, bw, pipe, lat, cpus), what="gin_rate results")
    if world.rank != 0:
        return None
    n = world.size
    out = {"world": world.kind, "nranks": n, "cpus": [g[4] for g in gathered], "rate": {}, "busbw": {}}
    out["pipelined"] = {}
    for wire in WIRES:
        out["rate"][wire] = _rate_summary([g[0][wire] for g in gathered], args.small_iters)
        out["pipelined"][wire] = {
            **_rate_summary([g[2][wire] for g in gathered], args.pipe_iters),
            "bytes": args.pipe_bytes,
            "slot_bytes": args.pipe_slot_bytes,
            "nsteps": args.pipe_steps,
        }
    lsa, gin = (statistics.median(gathered[0][3][k]) for k in ("lsa", "gin"))  # rank 0's blocks
    out["latency"] = {
        "lsa_us": lsa,
        "gin_us": gin,
        "gin_over_lsa": gin / lsa,
        "blocks": args.latency_blocks,
        "iters": args.latency_iters,
    }
    factor = 2 * (n - 1) / n
    for name in gathered[0][1]["times"]:
        # per iteration the slowest rank, then the median over iterations
        per_iter = [max(g[1]["times"][name][i] for g in gathered) for i in range(args.iters)]
        med = statistics.median(per_iter)
        out["busbw"][name] = {
            "median_s": med,
            "algbw_GBps": args.bytes / med / 1e9,
            "busbw_GBps": factor * args.bytes / med / 1e9,
            "geometry": gathered[0][1]["geometry"].get(name),
            "kernel": gathered[0][1]["kernels"].get(name),
        }
    out["busbw"]["bytes"] = args.bytes
    out["busbw"]["gin_engine"] = gathered[0][1]["engines"]["gin"]
    out["busbw"]["engines"] = gathered[0][1]["engines"]
    out["busbw"]["correct"] = all(g[1]["ok"] for g in gathered)
    return out


def _ops_line(r: dict) -> str:
    ops = ", ".join(f"{v:,.0f}" for v in r["ops_per_s_per_proxy"])
    gin_ops = ", ".join("-" if v is None else f"{v:,.0f}" for v in r["gin_ops_per_s_per_proxy"])
    return f"descriptors/s per proxy [{ops}], of them GIN operations (no doorbells)/s [{gin_ops}]"


def report(out: dict) -> str:
    lines = [
        f"# commref GIN rate: {out['nranks']} ranks, {out['world']} world, CPU engine, backend proxy; "
        f"CPUs per rank {out['cpus']}"
    ]
    for wire, r in out["rate"].items():
        per = ", ".join(f"{v:.1f}" for v in r["ops_per_collective_per_proxy"])
        lines.append(
            f"8-byte AllReduce, shm network, {wire:>9} wire, {r['engine']} engine: "
            f"{r['collectives_per_s']:,.0f} collectives/s; {_ops_line(r)} (all proxies "
            f"{r['ops_per_s_all_proxies']:,.0f}); descriptors per collective per proxy [{per}]; "
            f"{r['us_per_collective']:.1f} us per collective, us per descriptor per proxy "
            f"[{', '.join(f'{v:.2f}' for v in r['us_per_op_per_proxy'] if v)}]; correct={r['correct']}"
        )
    lat = out["latency"]
    lines.append(
        f"8-byte AllReduce latency (median of {lat['blocks']} alternating blocks of {lat['iters']} calls): "
        f"lsa {lat['lsa_us']:.2f} us, gin (shm, ordered, strong) {lat['gin_us']:.2f} us, "
        f"gin/lsa {lat['gin_over_lsa']:.2f}"
    )
    for wire, p in out["pipelined"].items():
        lines.append(
            f"pipelined: {p['bytes'] / 2**20:g} MiB AllReduce over gin (shm, {wire}, strong), "
            f"{p['slot_bytes']}-byte slots, {p['nsteps']} in flight: {_ops_line(p)}; "
            f"{p['us_per_collective'] / 1e3:.2f} ms per call; correct={p['correct']}"
        )
    b = out["busbw"]
    lines.append(
        f"{b['bytes'] / 2**20:g} MiB AllReduce (median, slowest rank per iteration; _sym: buffers from "
        f"alloc_symmetric, mpi: numpy buffers), engines {b['engines']}, correct={b['correct']}:"
    )
    names = [k for k in ("lsa", "gin", "gin_mpi", "lsa_sym", "gin_sym", "gin_mpi_sym", "mpi") if k in b]
    for name in names:
        r = b[name]
        geometry = "" if r["geometry"] is None else f"  {r['kernel']} {r['geometry']}"
        lines.append(
            f"  {name:>11}: {r['median_s'] * 1e3:8.2f} ms  algbw {r['algbw_GBps']:6.2f} GB/s  "
            f"busbw {r['busbw_GBps']:6.2f} GB/s{geometry}"
        )

    def ratio(a: str, over: str) -> str:
        return f"{b[a]['busbw_GBps'] / b[over]['busbw_GBps']:.2f}"

    lines.append(f"  gin/lsa busbw: plain {ratio('gin', 'lsa')}, symmetric {ratio('gin_sym', 'lsa_sym')}")
    if "gin_mpi" in b:
        lines.append(
            f"  gin over network mpi / MPI's Allreduce busbw: plain {ratio('gin_mpi', 'mpi')}, "
            f"symmetric {ratio('gin_mpi_sym', 'mpi')}"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--small-iters", type=int_type(1), default=3000, help="8-byte AllReduces per wire in the rate loop")
    p.add_argument("--bytes", type=parse_size, default=16 << 20, help="AllReduce size for busbw (default 16M)")
    p.add_argument("--iters", type=int_type(1), default=10, help="timed busbw iterations (default 10)")
    p.add_argument("--warmup", type=int_type(0), default=3, help="untimed busbw iterations first (default 3)")
    p.add_argument(
        "--latency-blocks", type=int_type(1), default=7, help="alternating LSA/GIN blocks of the latency test"
    )
    p.add_argument("--latency-iters", type=int_type(1), default=500, help="8-byte AllReduces per latency block")
    p.add_argument("--pipe-bytes", type=parse_size, default=1 << 20, help="AllReduce size of the pipelined rate")
    p.add_argument(
        "--pipe-slot-bytes", type=option_type("slot_bytes"), default=1024, help="FIFO slot bytes of the pipelined rate"
    )
    p.add_argument(
        "--pipe-steps", type=int_type(1), default=64, help="FIFO slots per link (in flight) of the pipelined rate"
    )
    p.add_argument("--pipe-iters", type=int_type(1), default=20, help="calls timed in the pipelined rate")
    p.add_argument("--nranks", type=int_type(2), default=2, help="ranks as threads when not under mpiexec")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results here")
    return p


def validate(args) -> None:
    for flag, value in (("--bytes", args.bytes), ("--pipe-bytes", args.pipe_bytes)):
        if value < 8:
            raise ValueError(f"{flag} must be at least 8 (two float32 elements), got {value}")


def footprint(args, nranks: int):
    """One rank's cost (programs.py): up to six communicators (LSA, GIN shm and mpi, plain
    and symmetric) over --bytes buffers."""
    from .footprint import program_footprint

    return program_footprint(4 * max(args.bytes, args.pipe_bytes), 6, nranks)


def run(args) -> int:
    """The measurements on this process's ranks (the MPI world under mpiexec, else
    --nranks threads); rank 0 prints the report and its JSON line."""
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
        print(f"# wrote {args.json}", flush=True)
    rates = [*out["rate"].values(), *out["pipelined"].values()]
    ok = out["busbw"]["correct"] and all(r["correct"] for r in rates)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return programs.run_module(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
