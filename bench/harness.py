"""The benchmark harness: size sweep, timing, checking, the table, JSON and plots.

    commref bench all_reduce -b 8 -e 64M -f 2 --np 4

Flags keep nccl-tests' meanings: -b/-e first and last size in bytes (K, M, G
suffixes), -f multiplicative step or -i additive step, -n timed iterations, -w warmup
iterations, -c check (0/1), -o reduction op, -d dtype, -r root, -z blocking (accepted;
commref's CPU launches return when the collective is done, GPU calls are synchronized
per iteration), -t rank threads in one process (ThreadWorld).

Paths. --path lsa,gin,auto (and for GIN --backend, --wire, --network,
--gin-protocol, each a comma-separated list) measures every combination side by side,
one row per size and configuration; the path column names the configuration and what
carries its bytes. A combination the machine cannot set up (a backend without the
asked-for wire) is skipped with its reason; options this build's Communicator does
not take are refused before any rank starts.

Timing. Per size and placement (out-of-place, with the baseline; then in-place), every
series: `-w` untimed calls of each, one world barrier, then `-n` rounds in which each
series (and the baseline) makes one call, timed on every rank (GPU: each call is
followed by a stream synchronize inside the timed region). The series take turns call
by call, so that drift on a shared host (a neighbour's load, the vCPUs changing
placement) hits them alike and their medians compare side by side. Ranks are not
re-synchronized between calls: a collective synchronizes them itself, as in
nccl-tests. At the end of the size one allgather brings every rank's times together;
an iteration's time is the slowest rank's, and the time column is the median over
the iterations.

Checking (-c 1). The output of the last timed call is compared element by element
with commref.collectives.verify's reference; #wrong is the count summed over ranks. In place,
the input is restored before that last call (and the ranks meet at a barrier, so no
rank's timing includes another's restore).

Bandwidths are nccl-tests': algbw = bytes / time, busbw = algbw * bus factor (the
plugins define both, see plugins/base.py). "Avg bus bandwidth" is the mean busbw over
every size, out-of-place and in-place, as nccl-tests prints it. The bound column
and %bound (100 = as fast as this machine's memory allows) are bench/bound.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from commref.collectives import verify
from commref.collectives.options import (KEYWORDS, Algorithm, CommOptions, Device, Protocol, StreamStores,
                                        resolve_device)
from commref.collectives.verify import DTYPES, OPS
from commref.transports.gin import faults
from commref.transports.gin.faults import FaultSpec
from commref.transports.gin.options import Backend, GinProtocol, Network, Path, Wire
from commref.transports.options import OptionError, bounded

from . import plugins
from .baselines import BaselineUnavailable, make_baseline
from .bound import StreamMeter, bound as placement_bound
from .environment import LINKS, environment

SCHEMA = "commref-bench/2"
# Communicator's path options (GIN: backend, wire ordering model, network under it, signal
# protocol): the words of the typed options (collectives/options.py, transports/gin/options.py).
PATHS = Path.words()
BACKENDS = Backend.words()
WIRES = Wire.words()
NETWORKS = Network.words()
PROTOCOLS = GinProtocol.words()
PROGRESS_ENV = "COMMREF_BENCH_PROGRESS"  # set by the launching process: "bar" or "bar+rows"

# nccl-tests' type names, and the numpy names commref uses.
NCCL_TYPE_NAMES = {"int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
                   "uint64": "uint64", "float16": "half", "float32": "float", "float64": "double",
                   "bfloat16": "bfloat16"}
DTYPE_ALIASES = {v: k for k, v in NCCL_TYPE_NAMES.items()} | {"char": "int8", "int": "int32", "fp16": "float16",
                                                               "fp32": "float32", "fp64": "float64",
                                                               "bf16": "bfloat16"}


class NotAvailable(ValueError):
    """An option names something commref does not have yet."""


# ---------------------------------------------------------------------------------------
# flags
# ---------------------------------------------------------------------------------------

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from nccl-tests' size syntax: an integer with an optional K, M, G (or T)
    suffix, powers of 1024, either case; a trailing B is allowed (64M, 64MB, 1g)."""
    s = str(text).strip().upper()
    if s.endswith("IB"):
        s = s[:-2]
    elif s.endswith("B") and len(s) > 1 and not s[-2].isdigit():
        s = s[:-1]
    elif s.endswith("B") and s[:-1].isdigit():
        s = s[:-1]
    unit = s[-1] if s and s[-1] in _SUFFIX else ""
    digits = s[: len(s) - len(unit)]
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected an integer with an optional K, M or G "
                                         f"suffix, such as 8, 1K, 64M or 1G")
    return int(digits) * _SUFFIX[unit]


def sweep_sizes(minbytes: int, maxbytes: int, stepfactor: int = 2, stepbytes: int = 0) -> list[int]:
    """The sizes nccl-tests visits: from minbytes while <= maxbytes, times stepfactor
    (when > 1) or plus stepbytes."""
    if minbytes < 0 or maxbytes < minbytes:
        raise ValueError(f"need 0 <= minbytes <= maxbytes, got -b {minbytes} -e {maxbytes}")
    if stepfactor <= 1 and stepbytes <= 0:
        raise ValueError("need a step factor > 1 (-f) or a step in bytes > 0 (-i)")
    if stepfactor > 1 and minbytes == 0:
        raise ValueError("-b 0 with a step factor never grows; give -b >= 1 or use -i")
    sizes, size = [], minbytes
    while size <= maxbytes:
        sizes.append(size)
        size = size * stepfactor if stepfactor > 1 else size + stepbytes
    return sizes


def parse_dtype(text: str) -> str:
    key = text.strip().lower()
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose one of "
                                         f"{', '.join(sorted(set(DTYPES) | set(NCCL_TYPE_NAMES.values())))}")
    return key


def _fault_type(text: str) -> list[str]:
    """--fault: one spec (its commas separate the faults, not several values), as a
    one-item list of its canonical form, like the side-by-side flags."""
    return [str(FaultSpec.parse(option_type("fault")(text)))]


def option_type(keyword: str, many: bool = False) -> Callable[[str], Any]:
    """An argparse type for Communicator option `keyword` (collectives.options.KEYWORDS):
    the value is checked by CommOptions itself, so a bad one gets the API's message.
    `many`: a comma-separated list, each item checked (bench measures them side by side)."""
    def one(text: str):
        value: Any = text.strip()
        if value.lstrip("-").isdigit():
            value = int(value)
        else:
            value = value.lower()
        try:
            CommOptions.from_kwargs(**{keyword: value})
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e) + (" (comma-separated for several)" if many else "")) from None
        return value

    def parse(text: str):
        if not many:
            return one(text)
        items = [one(t) for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected one or more comma-separated values, got {text!r}")
        return list(dict.fromkeys(items))

    parse.__name__ = keyword  # argparse names the type in "invalid <type> value"
    return parse


def int_type(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse type for an integer in [low, high] (transports.options.bounded's
    check; argparse names the flag: "argument --np: must be >= 1, got 0")."""
    def parse(text: str) -> int:
        value: Any = text.strip()
        if value.lstrip("-").isdigit():
            value = int(value)
        try:
            return bounded(value, "value", low, high)
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("value ")) from None

    parse.__name__ = "integer"
    return parse


def _registrations(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        if part.strip() not in ("0", "2"):
            raise argparse.ArgumentTypeError(
                f"-R takes 0 (plain buffers) or 2 (symmetric), comma-separated; got {part.strip()!r}"
                + (" (local registration, nccl-tests' 1, has no commref counterpart)" if part.strip() == "1" else ""))
        out.append(int(part))
    return list(dict.fromkeys(out))


def _collective(text: str) -> str:
    try:
        return plugins.get(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("collective", type=_collective,
                   help="all_reduce, all_gather, reduce_scatter, broadcast or reduce (allreduce etc. also accepted)")
    g = p.add_argument_group("nccl-tests flags")
    g.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("32M"), help="first size (default 32M)")
    g.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"), help="last size (default 32M)")
    g.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this (default 2)")
    g.add_argument("-i", "--stepbytes", type=parse_size, default=0, help="add this to the size (when -f 1)")
    g.add_argument("-n", "--iters", type=int_type(1), default=20, help="timed iterations per size (default 20)")
    g.add_argument("-w", "--warmup_iters", type=int_type(0), default=5,
                   help="untimed iterations first (default 5)")
    g.add_argument("-c", "--check", type=int, default=1, choices=[0, 1], help="count wrong elements (default 1)")
    g.add_argument("-o", "--op", default="sum", choices=list(OPS), help="reduction op (default sum)")
    g.add_argument("-d", "--datatype", type=parse_dtype, default="float32", help="dtype (default float32)")
    g.add_argument("-r", "--root", type=int_type(0), default=0, help="root of broadcast and reduce (default 0)")
    g.add_argument("-z", "--blocking", type=int, default=0, choices=[0, 1],
                   help="accepted for compatibility: CPU calls are synchronous, GPU calls synchronized per iteration")
    g.add_argument("-R", "--local_register", type=_registrations, default=[0],
                   help="buffer registration: 0 plain buffers, 2 symmetric (Communicator.alloc_symmetric; "
                        "the direct kernels then run where they can: over LSA, or pushing over GIN, "
                        "docs/architecture.md); comma-separated "
                        "values are measured side by side (default 0; nccl-tests' 1, local registration, "
                        "has no commref counterpart)")
    g.add_argument("-t", "--nthreads", type=int_type(1), default=1,
                   help="ranks as threads of this process (ThreadWorld; default 1)")
    c = p.add_argument_group("commref")
    c.add_argument("--np", type=int_type(1), default=None, help="MPI ranks (relaunches under mpiexec)")
    c.add_argument("--nodes", type=int_type(1), default=None,
                   help="simulated nodes: the ranks split into this many nodes of consecutive ranks (COMMREF_NODES)")
    c.add_argument("--path", type=option_type("path", many=True), default=["lsa"],
                   help=f"{', '.join(PATHS)}; several comma-separated are measured side by side (default lsa)")
    c.add_argument("--backend", type=option_type("backend", many=True), default=None,
                   help=f"GIN backends: {', '.join(BACKENDS)} (comma-separated; Communicator's default if omitted)")
    c.add_argument("--wire", type=option_type("wire", many=True), default=None,
                   help=f"GIN wire ordering: {', '.join(WIRES)} (comma-separated)")
    c.add_argument("--network", type=option_type("network", many=True), default=None,
                   help=f"what carries GIN traffic: {', '.join(NETWORKS)} (comma-separated)")
    c.add_argument("--gin-protocol", type=option_type("gin_protocol", many=True), default=None,
                   help=f"how a GIN connection publishes a slot: {', '.join(PROTOCOLS)} (comma-separated; "
                        "only strong is safe on every wire)")
    c.add_argument("--wire-rate", type=option_type("wire_rate", many=True), default=None,
                   help="the GIN wire model: bytes/s of each rank's wire, e.g. 12.5G (comma-separated; 0: unlimited)")
    c.add_argument("--wire-latency", type=option_type("wire_latency", many=True), default=None,
                   help="the GIN wire model: seconds from send to effect, e.g. 5us (comma-separated)")
    c.add_argument("--fault", type=_fault_type, default=None,
                   help="a lossy link under the GIN wire, with retransmission above it: drop, duplicate and delay "
                        "probabilities, e.g. drop=0.05,dup=0.05,delay=0.05 (one value; the output counts "
                        "retransmissions and dropped duplicates)")
    c.add_argument("--algorithm", default=["auto"], type=option_type("algorithm", many=True),
                   help=f"{', '.join(Algorithm.words())}: auto picks direct for symmetric buffers (-R 2), hierarchical "
                        "from 1 MiB on several nodes, else ring or tree; comma-separated values are measured side by "
                        "side (default auto)")
    c.add_argument("--protocol", default=["auto"], type=option_type("protocol", many=True),
                   help=f"{', '.join(Protocol.words())}: how ring and tree steps move data (auto: COMMREF_PROTO, else "
                        "by size, the tuner's thresholds); comma-separated values are measured side by side "
                        "(default auto)")
    c.add_argument("--stream-stores", type=option_type("stream_stores", many=True), default=None,
                   help=f"CPU: store what another core reads next past the cache: {', '.join(StreamStores.words())} "
                        "(auto measures both, the default); comma-separated values are measured side by side")
    c.add_argument("--seed", type=option_type("seed"), default=1,
                   help="seed of the exact-checkable inputs and of GIN's unordered wire (default 1)")
    c.add_argument("--device", default="auto", type=option_type("device"), choices=Device.words())
    c.add_argument("--channels", type=option_type("max_channels"), default=None,
                   help="max channels (blocks) per launch")
    c.add_argument("--slot-bytes", type=option_type("slot_bytes"), default=None,
                   help="FIFO slot size in bytes (a positive multiple of 64)")
    c.add_argument("--threads", type=option_type("threads"), default=None, help="threads per block")
    c.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="measure MPI (CPU) or NCCL (GPU) in the same sweep (default on)")
    c.add_argument("--bound", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the memory-bandwidth bound column (default on)")
    c.add_argument("--json", metavar="FILE", default=None, help="write results and environment as JSON")
    c.add_argument("--plot", metavar="FILE", default=None, help="write busbw vs size as a PNG")
    return p


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(
        prog="commref bench", description="nccl-tests-style sweep of one collective, with baselines and a bound."))


# ---------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    """One configuration measured side by side with the others: a path, and for GIN
    its backend, wire, network and signal protocol (None: Communicator's default)."""

    path: str
    backend: str | None = None
    wire: str | None = None
    network: str | None = None
    gin_protocol: str | None = None
    wire_rate: str | None = None  # the wire model (GinOptions.wire_rate, wire_latency)
    wire_latency: str | None = None
    fault: str | None = None  # a lossy link under the wire (GinOptions.fault)
    register: int = 0  # -R: 0 plain buffers, 2 symmetric
    stores: str | None = None  # --stream-stores (None: Communicator's default, auto)
    algorithm: str = "auto"
    protocol: str = "auto"  # of the ring and tree steps (--protocol)
    # Whose ranks run it: "job" (every rank), or with several nodes "intra-node" (each
    # node's ranks, over LSA) or "inter-node" (one rank per node, over GIN), the
    # hierarchical algorithm's two child communicators, all teams at once.
    team: str = "job"

    @property
    def label(self) -> str:
        parts = [self.path] + [f"{k.removeprefix('wire_')}-{v}" if k in MODEL_FLAGS else str(v)
                               for k, v in self.gin_options().items()]
        return "/".join(([self.team] if self.team != "job" else []) + parts
                        + ([self.algorithm] if self.algorithm != "auto" else [])
                        + ([self.protocol] if self.protocol != "auto" else [])
                        + (["sym"] if self.register == 2 else [])
                        + ([f"stores-{self.stores}"] if self.stores else []))

    def gin_options(self) -> dict:
        """The GIN fields that are set, in declaration order (GIN_FLAGS' names)."""
        return {k: getattr(self, k) for k in GIN_FLAGS if getattr(self, k) is not None}


GIN_FLAGS = {"backend": "--backend", "wire": "--wire", "network": "--network", "gin_protocol": "--gin-protocol",
             "wire_rate": "--wire-rate", "wire_latency": "--wire-latency", "fault": "--fault"}
MODEL_FLAGS = ("wire_rate", "wire_latency", "fault")


def series_of(args) -> list[Series]:
    """Every configuration the flags ask for. LSA takes no GIN options; gin and auto
    are crossed with every backend, wire, network and protocol given."""
    out = []
    for register, stores, algorithm, protocol in itertools.product(getattr(args, "local_register", None) or [0],
                                                                   getattr(args, "stream_stores", None) or [None],
                                                                   _algorithms(args), _protocols(args)):
        for path in args.path:
            if path == "lsa":
                out.append(Series("lsa", register=register, stores=stores, algorithm=algorithm, protocol=protocol))
                continue
            for combo in itertools.product(*[getattr(args, k, None) or [None] for k in GIN_FLAGS]):
                out.append(Series(path, *combo, register=register, stores=stores, algorithm=algorithm,
                                  protocol=protocol))
    if any(getattr(args, k, None) for k in GIN_FLAGS) and all(s.path == "lsa" for s in out):
        raise NotAvailable(f"{', '.join(GIN_FLAGS.values())} choose GIN transports; add --path gin (or auto)")
    return list(dict.fromkeys(out))


def _algorithms(args) -> list[str]:
    value = getattr(args, "algorithm", None) or ["auto"]
    return [value] if isinstance(value, str) else list(value)


def _protocols(args) -> list[str]:
    value = getattr(args, "protocol", None) or ["auto"]
    return [value] if isinstance(value, str) else list(value)


def team_series(series: Series, comm) -> list[tuple[Series, Any]]:
    """With several nodes that can run the hierarchical algorithm: the intra-node and
    inter-node rows beside `series` (the first on a path that crosses nodes), run on
    its communicator's two child communicators; else none."""
    from commref.collectives.hierarchical import NodeShape

    if series.path == "lsa" or not isinstance(getattr(comm, "node_shape", None), NodeShape):
        return []
    h = comm.hierarchy()
    base = dataclasses.replace(series, algorithm="auto")
    return [(dataclasses.replace(base, team="intra-node"), h.intra), (dataclasses.replace(base, team="inter-node"),
                                                                       h.inter)]


def communicator_kwargs(args, series: Series) -> dict:
    """Communicator options for `series`. Raises NotAvailable when this build's
    Communicator does not take an option the series needs (its signature says which,
    so a path works here as soon as Communicator offers it)."""
    from commref.collectives.communicator import Communicator

    kw: dict[str, Any] = {"algorithm": series.algorithm, "max_channels": args.channels,
                          "slot_bytes": args.slot_bytes, "threads": args.threads}
    if series.stores:
        kw["stream_stores"] = series.stores
    if series.protocol != "auto":  # auto: the Communicator's default (COMMREF_PROTO, else auto)
        kw["protocol"] = series.protocol
    if series.path == "lsa":
        return kw
    wanted = {"path": series.path, **series.gin_options()}
    params = inspect.signature(Communicator).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        params = {**params, **KEYWORDS}  # Communicator(world, device, **kwargs): CommOptions' keywords
    missing = [k for k in wanted if k not in params]
    if missing:
        flags = " ".join(f"{GIN_FLAGS.get(k, '--' + k)} {wanted[k]}" for k in wanted)
        raise NotAvailable(f"{flags} is not available yet: this commref's Communicator has no "
                           f"{', '.join(missing)} option; use --path lsa")
    kw.update(wanted)
    if "seed" in params:
        kw["seed"] = args.seed  # the unordered wire's seed: runs are reproducible
    return kw


def validate(args) -> None:
    """Every check that needs no ranks (the parser's types check each flag; this checks
    them together, and again for args built by hand); raises ValueError (OptionError,
    NotAvailable) with a one-line reason."""
    if args.iters < 1:
        raise ValueError(f"-n must be >= 1, got {args.iters}")
    if args.warmup_iters < 0:
        raise ValueError(f"-w must be >= 0, got {args.warmup_iters}")
    if args.nthreads < 1:
        raise ValueError(f"-t must be >= 1, got {args.nthreads}")
    if args.np is not None and args.np < 1:
        raise ValueError(f"--np must be >= 1, got {args.np}")
    if args.nthreads > 1 and args.np and args.np > 1:
        raise ValueError("-t (rank threads) and --np (MPI ranks) do not combine; choose one")
    sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    for s in series_of(args):
        CommOptions.from_kwargs(device=args.device, **communicator_kwargs(args, s))
    from commref.transports.world import MPIWorld, check_nodes

    # Ranks of this run: --np, else -t, else (under an mpiexec started by hand) unknown here.
    nranks = args.np or (None if MPIWorld.launched_under_mpi() else args.nthreads)
    if args.root < 0 or (nranks is not None and args.root >= nranks):
        raise ValueError(f"-r {args.root} is not a rank of this run")
    if getattr(args, "nodes", None) is not None and nranks is not None:
        check_nodes(args.nodes, nranks)


# ---------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------


@dataclass
class Ctx:
    """What one rank needs while it sweeps."""

    world: Any
    args: Any
    plugin: plugins.Collective
    dtype: np.dtype
    device: str
    xp: Any
    corrupt: Callable | None = None  # test hook: corrupt(label, in_place, rank, out) after the last call
    link: str = "?"  # what carries the bytes (describe_link), for the path column
    memory: dict = dataclasses.field(default_factory=dict)  # series label -> plugins.Memory of its buffers

    def memory_of(self, label: str) -> plugins.Memory:
        mem = self.memory.get(label) or self.memory.setdefault(None, plugins.Memory(self.xp))
        if isinstance(mem, plugins.SymmetricMemory):
            mem.reset()
        return mem

    def to_host(self, a) -> np.ndarray:
        return a if self.xp is np else self.xp.asnumpy(a)


@dataclass
class Timed:
    """One variant of a size that time_interleaved times: `call` then `sync` per
    iteration; `before_last` (untimed, then a barrier) runs before the last call."""

    call: Callable[[], None]
    sync: Callable[[], None]
    before_last: Callable[[], None] | None = None


def time_interleaved(world, variants: list[Timed], iters: int, warmup: int) -> list[list[float]]:
    """Seconds of each of `iters` calls of every variant on this rank, the variants taking
    turns call by call (iteration i of each, then i + 1 of each), so that drift on a
    shared host (a neighbour's load, the vCPUs changing placement) hits all of them alike
    and their medians compare side by side. First `warmup` untimed calls of each, then a
    barrier."""
    for v in variants:
        for _ in range(warmup):
            v.call()
            v.sync()
    world.barrier(what="bench: timed calls")
    times: list[list[float]] = [[] for _ in variants]
    for i in range(iters):
        last = i == iters - 1
        if last and any(v.before_last is not None for v in variants):
            for v in variants:
                if v.before_last is not None:
                    v.before_last()
                    v.sync()
            world.barrier(what="bench: checked calls")
        for v, out in zip(variants, times):
            t0 = time.perf_counter()
            v.call()
            v.sync()
            out.append(time.perf_counter() - t0)
    return times


def time_calls(world, call: Callable[[], None], sync: Callable[[], None], iters: int, warmup: int,
               before_last: Callable[[], None] | None = None) -> list[float]:
    """Seconds of each of `iters` calls on this rank (time_interleaved of one variant)."""
    return time_interleaved(world, [Timed(call, sync, before_last)], iters, warmup)[0]


def measure(ctx: Ctx, runners: list[tuple[str, Any, tuple]], in_place: bool, baseline: tuple | None = None) -> dict:
    """One rank's times and wrong elements for one placement of one size, every runner
    (label, runner, (input, expected, counts) of its ranks: the job's or a team's) timed
    interleaved with the others and with `baseline` ((runner, input, counts), out of
    place; its times under "baseline"). Other keys: the runners' labels."""
    args, plugin, w = ctx.args, ctx.plugin, ctx.world
    op = args.op if plugin.reducing else None
    check = bool(args.check)
    variants, checks = [], []
    for label, runner, (x, expected, counts) in runners:
        rank, n = _team(runner, w)
        b = plugin.buffers(ctx.memory_of(label), x, counts, rank, n, args.root, in_place)
        variants.append(Timed(lambda b=b, runner=runner: plugin.run(runner, b, op, args.root), runner.synchronize,
                              b.restore if (check and b.restore) else None))
        checks.append((label, b, expected))
    if baseline is not None:
        base, x, counts = baseline
        bb = plugin.buffers(ctx.memory_of(None), x, counts, w.rank, w.size, args.root, False)
        variants.append(Timed(lambda: plugin.run(base, bb, op, args.root), base.synchronize))
    times = time_interleaved(w, variants, args.iters, args.warmup_iters)
    out = {}
    for (label, b, expected), t in zip(checks, times):
        wrong = None
        if check:
            if ctx.corrupt is not None:
                ctx.corrupt(label, in_place, w.rank, b.out)
            wrong = 0 if expected is None else verify.count_wrong(ctx.to_host(b.out), expected)
        out[label] = {"times": t, "wrong": wrong}
    if baseline is not None:
        out["baseline"] = times[-1]
    return out


def _result(times_per_rank: list[list[float]], nbytes: int, factor: float, wrong_per_rank=None) -> dict:
    per_iter = np.max(np.asarray(times_per_rank, dtype=float), axis=0)
    t = float(np.median(per_iter))
    algbw = nbytes / t / 1e9 if t > 0 else 0.0
    out = {"time_us": t * 1e6, "algbw": algbw, "busbw": algbw * factor}
    if wrong_per_rank is not None:
        out["wrong"] = None if any(v is None for v in wrong_per_rank) else int(sum(wrong_per_rank))
    return out


def size_bound(plugin, size: int, nranks: int, bus_bytes: float, every: list[dict]) -> dict:
    """The bound column of one size from every rank's stream rounds ("stream|0",
    "stream|1": a list of rounds on each rank): busbw and time_us out of place,
    in_place_busbw and in_place_time_us (None where the collective has no in-place
    form, or the call moves nothing), and each placement's details (bench/bound.py:
    bound())."""
    out: dict[str, Any] = {}
    for in_place in (False, True):
        key = f"stream|{int(in_place)}"
        b = None
        if in_place in plugin.placements and all(key in r for r in every):
            rounds = [[r[key][k] for r in every] for k in range(len(every[0][key]))]
            b = placement_bound(plugin.traffic(nranks, in_place), size, nranks, bus_bytes, rounds)
        out["in_place" if in_place else "out_of_place"] = b
    oop, ip = out["out_of_place"], out["in_place"]
    return {"busbw": oop and oop["busbw"], "time_us": oop and oop["time_us"],
            "in_place_busbw": ip and ip["busbw"], "in_place_time_us": ip and ip["time_us"], **out}


def _pct(result: dict | None, bound_us: float | None) -> float | None:
    """100 * the bound's time / ours (= our busbw / the bound's busbw, also where the bus
    factor is 0); None without both."""
    if not result or bound_us is None or result["time_us"] <= 0:
        return None
    return 100 * bound_us / result["time_us"]


def _team(runner, world) -> tuple[int, int]:
    """(rank, ranks) of the ranks a runner calls among: a communicator's own (a team's
    child communicator has fewer), else the world's (baselines)."""
    return getattr(runner, "rank", world.rank), getattr(runner, "nranks", world.size)


def sweep(ctx: Ctx, runners: list[tuple[Series, Any]], baseline, meter: StreamMeter | None,
          emit: Callable[[list[dict]], None] | None = None, progress: Callable[[int, int, int], None] | None = None
          ) -> list[dict]:
    """Runs the sweep on this rank; returns the rows (every rank gets them). `emit` gets
    each size's rows as they complete (rank 0 prints them)."""
    args, plugin, w = ctx.args, ctx.plugin, ctx.world
    n, itemsize = w.size, ctx.dtype.itemsize
    op = args.op if plugin.reducing else None
    sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    factor = plugin.bus_factor(n)
    rows: list[dict] = []
    for k, size in enumerate(sizes):
        counts = plugin.counts(size, itemsize, n)
        nbytes = plugin.algbw_bytes(counts, itemsize, n)
        size_col = counts.size_bytes(itemsize)
        x = plugin.input(counts, ctx.dtype, op, args.seed, w.rank, n)
        expected = plugin.expected(counts, ctx.dtype, op, args.seed, w.rank, n, args.root) if args.check else None
        mine: dict[str, Any] = {}
        stream = {}  # placement -> the bound's stream rounds on this rank, before and after the collectives
        if meter is not None:
            stream = {ip: [meter.measure(plugin.traffic(n, ip), size_col, args.iters)] for ip in plugin.placements}
        data = {(w.rank, n): (counts, x, expected)}  # a team's own counts, input and expected output
        timed = []
        for s, comm in runners:
            team = _team(comm, w)
            if team not in data:
                tc = plugin.counts(size, itemsize, team[1])
                data[team] = (tc, plugin.input(tc, ctx.dtype, op, args.seed, *team),
                              plugin.expected(tc, ctx.dtype, op, args.seed, *team, args.root) if args.check else None)
            tc, tx, texp = data[team]
            timed.append((s.label, comm, (tx, texp, tc)))
        for in_place in plugin.placements:  # every series (and the baseline, out of place) side by side
            got = measure(ctx, timed, in_place, (baseline, x, counts) if baseline is not None and not in_place
                          else None)
            if "baseline" in got:
                mine["baseline"] = got.pop("baseline")
            for label, result in got.items():
                mine[f"{label}|{int(in_place)}"] = result
        for in_place, rounds in stream.items():  # every rank streams at once, at each placement's footprint
            rounds.append(meter.measure(plugin.traffic(n, in_place), size_col, args.iters))
            mine[f"stream|{int(in_place)}"] = rounds
        every = w.allgather(mine, what="bench: results of one size")

        base = None
        if baseline is not None:
            base = _result([r["baseline"] for r in every], nbytes, factor)
        bound = None
        if meter is not None:
            bound = size_bound(plugin, size_col, n, nbytes * factor, every)
        size_rows = []
        for s, comm in runners:
            res = {"in_place": None}  # stays None where the collective has no in-place form
            tn = _team(comm, w)[1]
            tc = data[(comm.rank, tn)][0] if s.team != "job" else counts
            t_factor, t_bytes = plugin.bus_factor(tn), plugin.algbw_bytes(tc, itemsize, tn)
            for in_place in plugin.placements:
                key = f"{s.label}|{int(in_place)}"
                res["in_place" if in_place else "out_of_place"] = _result(
                    [r[key]["times"] for r in every], t_bytes, t_factor, [r[key]["wrong"] for r in every])
            oop = res["out_of_place"]
            if s.team != "job":  # the job's baseline and bound do not compare with a team's
                base_s, bound_s = None, None
            else:
                base_s, bound_s = base, bound
            size_rows.append({
                "series": s.label, "path": f"{s.label}:{series_link(comm, ctx.link)}", "size": tc.size_bytes(itemsize),
                "count": tc.param,
                "type": NCCL_TYPE_NAMES[args.datatype],
                "redop": args.op if plugin.reducing else "none", "root": args.root if plugin.rooted else -1,
                "out_of_place": oop, "in_place": res["in_place"],
                "baseline": base_s,
                "ratio": (oop["busbw"] / base_s["busbw"]) if base_s and base_s["busbw"] > 0 else None,
                "bound": bound_s,
                "pct_of_bound": _pct(oop, bound_s and bound_s["time_us"]),
                "in_place_pct_of_bound": _pct(res["in_place"], bound_s and bound_s["in_place_time_us"]),
            })
        rows.extend(size_rows)
        if emit is not None:
            emit(size_rows)
        if progress is not None:
            progress(k + 1, len(sizes), size_col)
    return rows


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------


def _time_str(us: float) -> str:
    """nccl-tests' precision: fewer decimals as the time grows."""
    if us >= 10000:
        return f"{us:.0f}"
    if us >= 100:
        return f"{us:.1f}"
    return f"{us:.2f}"


def _num(v, fmt="{:.2f}", none="-") -> str:
    return none if v is None else fmt.format(v)


# (name, unit, width) of each column, as format_row lays them out ("  " between).
_FIELDS = [("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8), ("redop", "", 6), ("root", "", 6)]
_BLOCK = [("time", "(us)", 7), ("algbw", "(GB/s)", 6), ("busbw", "(GB/s)", 6), ("#wrong", "", 6)]
_EXTRA = [("time", "(us)", 7), ("busbw", "(GB/s)", 7), ("ratio", "(x)", 6), ("busbw", "(GB/s)", 7),
          ("%bound", "(%)", 6), ("%ip", "(%)", 4)]
_GROUP_WIDTHS = [sum(w + 2 for *_, w in _FIELDS) - 2] + [sum(w + 2 for *_, w in _BLOCK)] * 2 + [
    sum(w + 2 for *_, w in _EXTRA[:3]), sum(w + 2 for *_, w in _EXTRA[3:])]


def _head_line(pick: int) -> str:
    cols = _FIELDS + _BLOCK + _BLOCK + _EXTRA
    line = "  ".join(f"{c[pick]:>{c[2]}}" for c in cols) + "  " + ("path" if pick == 0 else "")
    return "#" + line[1:]


def table_head(baseline_label: str | None) -> list[str]:
    groups = ["", "out-of-place", "in-place", baseline_label or "baseline", "bound"]
    line = "".join(f"{g:^{w}}" for g, w in zip(groups, _GROUP_WIDTHS))
    return ["#" + line[1:].rstrip(), _head_line(0), _head_line(1).rstrip()]


def format_row(r: dict) -> str:
    o, i = r["out_of_place"], r["in_place"]
    base, bound = r.get("baseline"), r.get("bound")
    wrong = lambda v: "N/A" if v is None else str(v)  # noqa: E731
    in_place = (f"  {_time_str(i['time_us']):>7}  {i['algbw']:6.2f}  {i['busbw']:6.2f}  {wrong(i.get('wrong')):>6}"
                if i else f"  {'-':>7}  {'-':>6}  {'-':>6}  {'N/A':>6}")  # no in-place form
    return (f"{r['size']:12d}  {r['count']:12d}  {r['type']:>8}  {r['redop']:>6}  {r['root']:6d}"
            f"  {_time_str(o['time_us']):>7}  {o['algbw']:6.2f}  {o['busbw']:6.2f}  {wrong(o.get('wrong')):>6}"
            + in_place +
            f"  {_time_str(base['time_us']) if base else '-':>7}  {_num(base and base['busbw']):>7}"
            f"  {_num(r.get('ratio')):>6}"
            f"  {_num(bound and bound['busbw']):>7}  {_num(r.get('pct_of_bound'), '{:.0f}'):>6}"
            f"  {_num(r.get('in_place_pct_of_bound'), '{:.0f}'):>4}  {r['path']}")


def summary(rows: list[dict]) -> dict:
    """Per series: wrong elements over every size and variant (None without -c 1), and
    the mean busbw over every size, out-of-place and in-place (nccl-tests' average)."""
    out = {}
    for label in dict.fromkeys(r["series"] for r in rows):
        cells = [r[k] for r in rows if r["series"] == label for k in ("out_of_place", "in_place") if r[k]]
        wrongs = [c["wrong"] for c in cells]
        out[label] = {"out_of_bounds": None if None in wrongs else int(sum(wrongs)),
                      "avg_busbw": sum(c["busbw"] for c in cells) / len(cells) if cells else 0.0}
    return out


def footer(rows: list[dict]) -> list[str]:
    """nccl-tests' closing lines, one pair per series."""
    sums = summary(rows)
    lines = []
    for label, s in sums.items():
        tag = f" ({label})" if len(sums) > 1 else ""
        oob = s["out_of_bounds"]
        lines.append(f"# Out of bounds values : {'N/A' if oob is None else oob} {'FAILED' if oob else 'OK'}{tag}")
        lines.append(f"# Avg bus bandwidth    : {s['avg_busbw']:.4g}{tag}")
    lines.append("#")
    return lines


def header(ctx: Ctx, env: dict, runners, baseline, link: str, skipped=()) -> list[str]:
    a = ctx.args
    lines = [
        f"# commref bench {ctx.plugin.name}: {env['nranks']} ranks ({env['world']}), device {ctx.device}, "
        f"dtype {a.datatype}, op {a.op if ctx.plugin.reducing else 'none'}",
        f"# nThread {a.nthreads} nGpus {1 if ctx.device == 'cuda' else 0} minBytes {a.minbytes} maxBytes {a.maxbytes} "
        + (f"step: {a.stepfactor}(factor)" if a.stepfactor > 1 else f"step: {a.stepbytes}(bytes)")
        + f" warmup iters: {a.warmup_iters} iters: {a.iters} agg iters: 1 validation: {a.check} graph: 0"
        + f" blocking: {a.blocking}",
        "#",
        "# Using devices",
    ]
    for r, d in enumerate(env["ranks"]):
        lines.append(f"#  Rank {r:2d} Group  0 Pid {d['pid']:6d} on {d['node']:>10} cpus {d['cpus']} device {d['device']}")
    lines.append("#")
    paths = ", ".join(s.label for s, _ in runners)
    lines.append(f"# Path: {paths} over {link} ({LINKS.get(link, link)}); algorithm {','.join(_algorithms(a))}; "
                 f"protocol {','.join(_protocols(a))}; seed {a.seed}")
    teams = {s.team: c for s, c in runners if s.team != "job"}
    if teams:
        lines.append(f"# Teams: intra-node = each node's {teams['intra-node'].nranks} ranks at once, inter-node = "
                     f"one rank per node ({teams['inter-node'].nranks}), every rail at once; the same bytes per rank, "
                     f"busbw with the team's bus factor, no baseline or bound")
    lines.extend(f"# GPU sharing: {line}" for line in env.get("gpu_sharing", ()))
    lines.extend(f"# Skipped {s.label}: {why}" for s, why in skipped)
    if baseline is not None:
        lines.append(f"# Baseline: {baseline.label}, out-of-place, same sweep; ratio = our out-of-place busbw / "
                     f"baseline busbw")
        lines.extend(f"# Baseline note: {n}" for n in dict.fromkeys(baseline.notes))
    elif env.get("baseline_unavailable"):
        lines.append(f"# Baseline: none ({env['baseline_unavailable']})")
    lines.append("# Bound: busbw if each rank only loaded and stored the least bytes any algorithm must, at the rate "
                 "memory serves loads and stores with every rank streaming at once (the fastest STREAM-like kernel at "
                 "the call's footprint, measured before and after each size's calls; bench/bound.py); %bound = our "
                 "out-of-place busbw / bound (100 = as fast as memory allows), %ip = our in-place busbw / the in-place "
                 "bound")
    lines.append("#")
    return lines


# ---------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------


class Report:
    """Rank 0's output: the table through `out`, and a rich progress bar on stderr
    when progress_mode() asks for one. Other ranks' Reports print nothing."""

    def __init__(self, active: bool, out: Callable[[str], None], total: int, title: str):
        self.active, self.out, self.total, self.title = active, out, total, title
        self.bar = self.console = None
        mode = progress_mode() if active else None
        if mode:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:  # rich is in the bench extra; the table works without it
                return
            console = Console(stderr=True, force_terminal=True)
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=console, transient=True,
                                redirect_stdout=False, redirect_stderr=False)
            self.task = self.bar.add_task(title, total=total)
            self.bar.start()
            if mode == "bar+rows":  # both streams reach one terminal: keep rows above the bar
                self.console = console

    def lines(self, lines) -> None:
        if not self.active:
            return
        for line in lines:
            if self.console is not None:
                self.console.print(line, markup=False, highlight=False, soft_wrap=True)
            else:
                self.out(line)

    def rows(self, rows: list[dict]) -> None:
        self.lines(format_row(r) for r in rows)

    def progress(self, done: int, total: int, size: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, description=f"{self.title}: {_human(size)} done")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return str(n)


def progress_mode() -> str | None:
    """'bar' when stderr is a terminal, 'bar+rows' when stdout is one too (rows then go
    through the bar's console so they print above it); None otherwise. Under mpiexec
    the launching process decides (PROGRESS_ENV), since the ranks' streams are pipes."""
    if PROGRESS_ENV in os.environ:
        return os.environ[PROGRESS_ENV] or None
    try:
        if not sys.stderr.isatty():
            return None
        return "bar+rows" if sys.stdout.isatty() else "bar"
    except (AttributeError, ValueError):
        return None


def setup_device(world, device: str):
    """(device, device_id, xp, sync) for this rank: numpy on the CPU; on CUDA, CuPy on
    GPU local_rank % count with a stream of this rank's own. Ranks sharing a GPU get
    NCCL_MULTI_RANK_GPU_ENABLE=1 before NCCL starts."""
    device = resolve_device(device)
    if device != "cuda":
        return device, None, np, (lambda: None)
    import cupy

    ngpus = cupy.cuda.runtime.getDeviceCount()
    device_id = world.local_rank % ngpus
    cupy.cuda.Device(device_id).use()
    if world.local_size > ngpus:
        os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    cupy.cuda.Stream(non_blocking=True).use()
    return device, device_id, cupy, (lambda: cupy.cuda.get_current_stream().synchronize())


def setup_baseline(world, device: str, device_id: int | None, plugin, dtype, op: str | None):
    """(baseline or None, why not). Every rank agrees, or the baseline would hang."""
    baseline, why = None, None
    try:
        baseline = make_baseline(world, device, device_id)
        baseline.check(plugin.coll, dtype, op)
    except BaselineUnavailable as e:
        baseline, why = None, str(e)
    if not all(world.allgather(baseline is not None, what="bench: baseline available")) and baseline is not None:
        baseline.close()
        baseline, why = None, "not available on every rank"
    return baseline, why


def setup_communicators(world, args, device: str, device_id: int | None, plugin, op: str | None):
    """A Communicator per series: ([(series, comm)], [(series, reason)]). A series whose
    setup this machine cannot meet (CapabilityError: a backend without the asked-for
    wire, say) is skipped with its reason on every rank, so the others still run."""
    from commref.collectives.communicator import Communicator
    from commref.transports.errors import CapabilityError

    runners, skipped = [], []
    for s in series_of(args):
        kw = {k: v for k, v in communicator_kwargs(args, s).items() if v is not None}
        if device_id is not None:
            kw["device_id"] = device_id
        comm, err = None, None
        try:
            comm = Communicator(world, device, **kw)
        except CapabilityError as e:
            err = str(e)
        errors = [e for e in world.allgather(err, what="bench: series setup") if e]
        if errors:
            if comm is not None:
                comm.close()
            skipped.append((s, errors[0]))
            continue
        if hasattr(comm, "prepare"):  # GPU: load the kernel module before any collective runs
            comm.prepare([comm.kernel_spec(plugin.coll, args.datatype, op)])
        runners.append((s, comm))
        if not any(t.team != "job" for t, _ in runners):  # with several nodes: the teams, once
            runners.extend(team_series(s, comm))
    if not runners:
        raise NotAvailable("no configuration can run here: "
                           + "; ".join(f"{s.label}: {why}" for s, why in skipped))
    return runners, skipped


def symmetric_memory(args, plugin, dtype, nranks: int, xp, runners) -> dict:
    """A SymmetricMemory for each -R 2 series, sized for the largest size's send and
    recv buffers (collective: every rank allocates in the same order)."""
    out = {}
    largest = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)[-1]
    c = plugin.counts(largest, dtype.itemsize, nranks)
    capacity = plugins.SymmetricMemory.capacity(c.send, c.recv, dtype.itemsize)
    for s, comm in runners:
        if s.register == 2:
            out[s.label] = plugins.SymmetricMemory(comm, xp, capacity)
    return out


def series_link(comm, link: str) -> str:
    """The path column's link for one series: the GIN network when GIN carries some
    peers, else what carries LSA traffic."""
    network = getattr(comm, "network", None)
    return network if isinstance(network, str) and getattr(comm, "peer_mask", 0) else link


def fault_counts(world, runners) -> dict[str, list[dict]]:
    """Collective: per series with a lossy wire (--fault), every rank's GIN proxy stats."""
    out = {}
    for s, comm in runners:
        if s.fault and FaultSpec.parse(s.fault).active and s.team == "job":
            comm.proxy.quiesce(comm.timeout)  # final counts: everything posted has landed
            out[s.label] = world.allgather(dict(getattr(comm.proxy, "stats", None) or {}),
                                           what="bench: GIN fault statistics")
    return out


def run_rank(world, args, corrupt: Callable | None = None, out: Callable[[str], None] = print) -> dict:
    """The whole benchmark on one rank of `world`; returns the results document (the
    JSON file's content) on every rank. Rank 0 prints the table through `out`.
    `corrupt(label, in_place, rank, out)` is a test hook run after each last call."""
    plugin = plugins.get(args.collective)
    dtype = DTYPES[args.datatype]
    op = args.op if plugin.reducing else None
    device, device_id, xp, sync = setup_device(world, args.device)
    ctx = Ctx(world, args, plugin, dtype, device, xp, corrupt)
    runners, skipped = setup_communicators(world, args, device, device_id, plugin, op)
    ctx.memory = symmetric_memory(args, plugin, dtype, world.size, xp, runners)
    baseline, baseline_error = (setup_baseline(world, device, device_id, plugin, dtype, op) if args.baseline
                                else (None, "--no-baseline"))
    meter = StreamMeter(world, xp, sync) if args.bound else None
    env = environment(world, device, device_id, baseline, baseline_error)
    ctx.link = env["link"]
    sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)

    report = Report(world.rank == 0, out, len(sizes), plugin.name)
    t0 = time.perf_counter()
    try:
        report.lines(header(ctx, env, runners, baseline, env["link"], skipped))
        report.lines(table_head(baseline.label if baseline else None))
        rows = sweep(ctx, runners, baseline, meter, report.rows, report.progress)
        gin_faults = fault_counts(world, runners)
        report.lines(f"# GIN faults ({label}): {faults.summary(stats)}" for label, stats in gin_faults.items())
        report.lines(footer(rows))
    finally:
        report.close()
    elapsed = time.perf_counter() - t0
    doc = {
        "schema": SCHEMA,
        "collective": plugin.name,
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
        "environment": env,
        "series": [dataclasses.asdict(s) | {"label": s.label, "link": series_link(c, env["link"])}
                   for s, c in runners],
        "skipped": [dataclasses.asdict(s) | {"label": s.label, "reason": why} for s, why in skipped],
        "baseline": {"label": baseline.label, "library": baseline.library, "notes": sorted(set(baseline.notes))}
        if baseline else None,
        "bus_factor": plugin.bus_factor(world.size),
        "rows": rows,
        "gin_faults": {label: faults.totals(stats) for label, stats in gin_faults.items()},
        "summary": summary(rows),
        "elapsed_s": elapsed,
    }
    for _, comm in runners:
        comm.close()
    if baseline is not None:
        baseline.close()
    world.barrier(what="bench: done")
    return doc


def write_outputs(doc: dict, args) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=_jsonable)
            f.write("\n")
    if args.plot:
        from .plot import plot

        plot([doc], args.plot)


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def exit_code(doc: dict) -> int:
    bad = [s["out_of_bounds"] for s in doc["summary"].values() if s["out_of_bounds"]]
    return 1 if bad else 0


def run(args) -> int:
    """The benchmark on the ranks of this process, for validated `args`: the MPI world
    this process was started in (mpiexec), else -t ranks as threads (one by default).
    Returns the exit status (1 when an element was wrong). Starts no job: with --np,
    commref.cli relaunches under mpiexec and the ranks call this."""
    from commref.transports.world import MPIWorld, ThreadWorld

    def out(line: str) -> None:
        print(line, flush=True)

    if MPIWorld.launched_under_mpi():
        world = MPIWorld()
        doc = run_rank(world, args, out=out)
        if world.rank == 0:
            write_outputs(doc, args)
        return exit_code(doc)
    if args.nthreads > 1:
        doc = ThreadWorld.run(args.nthreads, run_rank, args, out=out)[0]
    else:
        doc = run_rank(ThreadWorld.single(), args, out=out)
    write_outputs(doc, args)
    return exit_code(doc)


def main(argv: list[str] | None = None) -> int:
    """`commref bench ...` in this process (argv without the leading 'bench'): parse,
    validate, run. --np N > 1 needs the `commref bench` command (commref.cli), which
    relaunches under mpiexec."""
    from commref.transports.world import MPIWorld

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        validate(args)
        if args.np and args.np > 1 and not MPIWorld.launched_under_mpi():
            raise ValueError(f"--np {args.np} starts MPI ranks: run `commref bench ... --np {args.np}`")
    except ValueError as e:  # NotAvailable and OptionError included
        print(f"commref bench: error: {e}", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
