"""The flags of `commref bench COLLECTIVE` (nccl-tests' and commref's), the sizes they
name (sweep_sizes), and validate, which checks them together before any rank starts.

    commref bench all_reduce -b 8 -e 64M -f 2 --np 4

Flags keep nccl-tests' meanings: -b/-e first and last size in bytes (K, M, G
suffixes), -f multiplicative step or -i additive step, -n timed iterations, -w warmup
iterations, -m operations aggregated per iteration in one group (the time reported is
the iteration's divided by it), -c check (0/1), -o reduction op, -d dtype, -r root, -z blocking (accepted;
commref's CPU launches return when the collective is done, GPU calls are synchronized
per iteration), -t rank threads in one process (ThreadWorld), -a how an iteration's
time combines the ranks' (AVERAGES), -N sweeps run one after another (0: until
interrupted), -I per-iteration statistics, -T the deadline of every wait in seconds,
-J nccl-tests' own JSON document (commref's own is --json). The side-by-side flags
(--path, --backend, ..., comma-separated) name the series (series.py).

What a run keeps is bounded before any rank starts (check_kept): the rows of every
cycle (MAX_KEPT_ROWS) and, with -I 1, every rank's time of every iteration
(MAX_ITERATION_TIMES).
"""

from __future__ import annotations

import argparse

from commref.collectives.options import Algorithm, CommOptions, Device, Protocol, StreamStores
from commref.collectives.verify import DTYPES, OPS
from commref.transports.deadlines import TIMEOUT_ENV
from commref.transports.gin.faults import FaultSpec
from commref.transports.gin.options import Backend, GinProtocol, Network, Path, Wire

from . import plugins, programs
from .baselines import split_baselines
from .flags import add_np, add_option, int_type, option_type, parse_size
from .series import communicator_kwargs, series_of

# Communicator's path options (GIN: backend, wire ordering model, network under it, signal
# protocol): the words of the typed options (collectives/options.py, transports/gin/options.py).
PATHS = Path.words()
BACKENDS = Backend.words()
WIRES = Wire.words()
NETWORKS = Network.words()
PROTOCOLS = GinProtocol.words()

# nccl-tests' type names, and the numpy names commref uses.
NCCL_TYPE_NAMES = {
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "uint32": "uint32",
    "int64": "int64",
    "uint64": "uint64",
    "float16": "half",
    "float32": "float",
    "float64": "double",
    "bfloat16": "bfloat16",
}
DTYPE_ALIASES = {v: k for k, v in NCCL_TYPE_NAMES.items()} | {
    "char": "int8",
    "int": "int32",
    "fp16": "float16",
    "fp32": "float32",
    "fp64": "float64",
    "bf16": "bfloat16",
}


# -a: how an iteration's time combines the ranks' times of that iteration (nccl-tests'
# --average; its default, 1, is commref's too).
AVERAGES = {0: "rank 0", 1: "average", 2: "minimum", 3: "maximum"}

# At most this many rows (size x series x cycle) are kept for the footer and the
# documents: -N n keeps every cycle's, -N 0 only the current one.
MAX_KEPT_ROWS = 50_000
# With -I 1, at most this many iteration times (every rank's, each placement, series,
# size and kept cycle) are kept: every rank holds them all (about 32 bytes each).
MAX_ITERATION_TIMES = 1_000_000
# Rounds of commref's job and the standalone peers' jobs when -N is left out.
ROUNDS = 3
# The most -m takes (nccl-tests' operations aggregated per iteration, in one group).
MAX_AGG_ITERS = 1024
# The most -T takes: a day.
MAX_TIMEOUT_S = 86_400.0


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
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; choose one of {', '.join(sorted(set(DTYPES) | set(NCCL_TYPE_NAMES.values())))}"
        )
    return key


def _fault_type(text: str) -> list[str]:
    """--fault: one spec (its commas separate the faults, not several values), as a
    one-item list of its canonical form, like the side-by-side flags."""
    return [str(FaultSpec.parse(option_type("fault")(text)))]


def _registrations(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        if part.strip() not in ("0", "2"):
            raise argparse.ArgumentTypeError(
                f"-R takes 0 (plain buffers) or 2 (symmetric), comma-separated; got {part.strip()!r}"
                + (" (local registration, nccl-tests' 1, has no commref counterpart)" if part.strip() == "1" else "")
            )
        out.append(int(part))
    return list(dict.fromkeys(out))


def _timeout(text: str) -> float:
    """-T: seconds, a positive finite number up to MAX_TIMEOUT_S, or 0 (nccl-tests' "no
    timeout"), which keeps the default deadline: commref's waits always have one."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (such as 30 or 0.5), got {text!r}") from None
    if not 0 <= seconds <= MAX_TIMEOUT_S:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"must be 0 (the default deadline, ${TIMEOUT_ENV}) or a number of seconds up to "
            f"{MAX_TIMEOUT_S:g}, got {text!r}"
        )
    return seconds


def _output_file(text: str) -> str:
    """A file to write: a name whose folder exists, not a folder itself."""
    import os

    path = os.path.abspath(os.path.expanduser(text))
    if not text.strip() or os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name")
    if not os.path.isdir(os.path.dirname(path)):
        raise argparse.ArgumentTypeError(f"the folder of {text!r} does not exist")
    return text


def _baseline(text: str) -> str:
    """--baseline: a comma list of at most one in-process baseline (BASELINES) and any
    of the standalone peers (PEERS), or none; its canonical form (split_baselines)."""
    try:
        inprocess, peers = split_baselines(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return ",".join(p for p in ([inprocess] if inprocess != "none" or not peers else []) + list(peers))


def _collective(text: str) -> str:
    try:
        return plugins.get(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}; or a bench program: {', '.join(programs.NAMES)}") from None


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "collective",
        type=_collective,
        help=f"{', '.join(plugins.PLUGINS)} (allreduce etc. also accepted; gather, scatter, alltoallv, "
        "sendrecv and hypercube are groups of sends and receives, hypercube at power-of-two ranks only); "
        f"or a bench program with flags of its own: {', '.join(programs.NAMES)} (commref bench NAME -h)",
    )
    g = p.add_argument_group("nccl-tests flags")
    g.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("32M"), help="first size (default 32M)")
    g.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"), help="last size (default 32M)")
    g.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this (default 2)")
    g.add_argument("-i", "--stepbytes", type=parse_size, default=0, help="add this to the size (when -f 1)")
    g.add_argument("-n", "--iters", type=int_type(1), default=20, help="timed iterations per size (default 20)")
    g.add_argument("-w", "--warmup_iters", type=int_type(0), default=5, help="untimed iterations first (default 5)")
    g.add_argument(
        "-m",
        "--agg_iters",
        type=int_type(1, MAX_AGG_ITERS),
        default=1,
        help=f"operations aggregated per iteration in one group (1..{MAX_AGG_ITERS}); the time is the "
        "iteration's divided by this, as nccl-tests (default 1)",
    )
    g.add_argument("-c", "--check", type=int, default=1, choices=[0, 1], help="count wrong elements (default 1)")
    g.add_argument("-o", "--op", default="sum", choices=list(OPS), help="reduction op (default sum)")
    g.add_argument("-d", "--datatype", type=parse_dtype, default="float32", help="dtype (default float32)")
    g.add_argument(
        "-r", "--root", type=int_type(0), default=0, help="root of broadcast, reduce, gather and scatter (default 0)"
    )
    g.add_argument(
        "-z",
        "--blocking",
        type=int,
        default=0,
        choices=[0, 1],
        help="accepted for compatibility: CPU calls are synchronous, GPU calls synchronized per iteration",
    )
    g.add_argument(
        "-R",
        "--local_register",
        type=_registrations,
        default=[0],
        help="buffer registration: 0 plain buffers, 2 symmetric (Communicator.alloc_symmetric; "
        "the direct kernels then run where they can: over LSA, or pushing over GIN, "
        "docs/architecture.md); comma-separated "
        "values are measured side by side (default 0; nccl-tests' 1, local registration, "
        "has no commref counterpart)",
    )
    g.add_argument(
        "-t",
        "--nthreads",
        type=int_type(1),
        default=1,
        help="ranks as threads of this process (ThreadWorld; default 1)",
    )
    g.add_argument(
        "-a",
        "--average",
        type=int,
        default=1,
        choices=list(AVERAGES),
        help="an iteration's time from the ranks' times: "
        + ", ".join(f"{k} {v}" for k, v in AVERAGES.items())
        + "; the time column is the median over iterations (default 1, as nccl-tests)",
    )
    g.add_argument(
        "-N",
        "--run_cycles",
        type=int_type(0),
        default=None,
        help="run the whole sweep this many times, a table each (0: until Ctrl-C or SIGTERM; default 1); "
        "with standalone baselines (--baseline mpich,openmpi,gloo) the rounds, each commref's job then "
        "every peer's (default 3)",
    )
    g.add_argument(
        "-I",
        "--iteration_stats",
        type=int,
        default=0,
        choices=[0, 1],
        help="1: keep every rank's time of every iteration and print i_min, i_max, i_p99 and i_cv%% "
        "of each iteration's slowest rank per size and placement (default 0)",
    )
    g.add_argument(
        "-T",
        "--timeout",
        type=_timeout,
        default=0.0,
        help=f"deadline of every wait, seconds: a run whose wait passes it fails saying so (default 0: "
        f"${TIMEOUT_ENV}, else 60)",
    )
    g.add_argument(
        "-J",
        "--nccl-tests-json",
        dest="nccl_json",
        metavar="FILE",
        type=_output_file,
        default=None,
        help="write nccl-tests' own JSON document (its config, results and, with -I 1, per-iteration "
        "times); nccl-tests spells this --json, which here is commref's own document",
    )
    c = p.add_argument_group("commref")
    add_np(
        c,
        "MPI ranks (relaunches under mpiexec; checked against this host's CPUs, memory, /dev/shm "
        "and process limit first)",
        nodes=True,
    )
    add_option(
        c,
        "--path",
        None,
        f"{', '.join(PATHS)}; several comma-separated are measured side by side (default lsa, or "
        "auto with --nodes above 1)",
        many=True,
    )
    add_option(
        c,
        "--backend",
        None,
        f"GIN backends: {', '.join(BACKENDS)} (comma-separated; Communicator's default if omitted)",
        many=True,
    )
    add_option(c, "--wire", None, f"GIN wire ordering: {', '.join(WIRES)} (comma-separated)", many=True)
    add_option(c, "--network", None, f"what carries GIN traffic: {', '.join(NETWORKS)} (comma-separated)", many=True)
    add_option(
        c,
        "--gin-protocol",
        None,
        f"how a GIN connection publishes a slot: {', '.join(PROTOCOLS)} (comma-separated; "
        "only strong is safe on every wire)",
        many=True,
    )
    add_option(
        c,
        "--wire-rate",
        None,
        "the GIN wire model: bytes/s of each rank's wire, e.g. 12.5G (comma-separated; 0: unlimited)",
        many=True,
    )
    add_option(
        c,
        "--wire-latency",
        None,
        "the GIN wire model: seconds from send to effect, e.g. 5us (comma-separated)",
        many=True,
    )
    add_option(
        c,
        "--wire-paths",
        None,
        "the unordered GIN wire's paths, its packets sprayed over them as SRD's (comma-separated; 1: none)",
        many=True,
    )
    c.add_argument(
        "--fault",
        type=_fault_type,
        default=None,
        help="a lossy link under the GIN wire, with retransmission above it: drop, duplicate and delay "
        "probabilities, e.g. drop=0.05,dup=0.05,delay=0.05 (one value; the output counts "
        "retransmissions and dropped duplicates)",
    )
    add_option(
        c,
        "--algorithm",
        ["auto"],
        f"{', '.join(Algorithm.words())}: auto picks direct for symmetric buffers (-R 2), hierarchical "
        "from 1 MiB on several nodes, else ring or tree; comma-separated values are measured side by "
        "side (default auto)",
        many=True,
    )
    add_option(
        c,
        "--protocol",
        ["auto"],
        f"{', '.join(Protocol.words())}: how ring and tree steps move data (auto: COMMREF_PROTO, else "
        "by size, the tuner's thresholds); comma-separated values are measured side by side "
        "(default auto)",
        many=True,
    )
    add_option(
        c,
        "--stream-stores",
        None,
        f"CPU: store what another core reads next past the cache: {', '.join(StreamStores.words())} "
        "(auto measures both, the default); comma-separated values are measured side by side",
        many=True,
    )
    add_option(c, "--seed", 1, "seed of the exact-checkable inputs and of GIN's unordered wire (default 1)")
    add_option(c, "--device", "auto", choices=Device)
    add_option(c, "--channels", None, "max channels (blocks) per launch", keyword="max_channels")
    add_option(c, "--slot-bytes", None, "FIFO slot size in bytes (a positive multiple of 64)")
    add_option(c, "--threads", None, "threads per block")
    c.add_argument(
        "--baseline",
        default="auto",
        type=_baseline,
        metavar="LIST",
        help="peers to compare with, comma-separated: at most one in-process baseline timed in the same "
        "processes, right after each size's series with commref quiesced (auto: MPI on the CPU, NCCL on a "
        "GPU, the default; mpi; nccl), and any of the standalone peers, each timed as a job of its own "
        "with the same ranks, sizes and statistic, rounds alternating with commref's (-N rounds, default "
        "3): mpich (this environment's mpiexec and mpi4py), openmpi ($COMMREF_OPENMPI_PYTHON: a Python "
        "whose mpi4py runs on Open MPI, its mpirun beside it), gloo (torch.distributed's, where torch is "
        "installed; in the same processes under an mpiexec started by hand); or none",
    )
    c.add_argument("--no-baseline", dest="baseline", action="store_const", const="none", help="--baseline none")
    c.add_argument(
        "--bound",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the memory-bandwidth bound column (default on)",
    )
    c.add_argument(
        "--profile",
        action="store_true",
        help="CPU: after each size's timed calls, profile -n more calls of each series on the profile build "
        "(time in copies, reductions, waits and the rest; bytes moved against the least) and print it",
    )
    c.add_argument(
        "--model",
        action="store_true",
        help="print the performance model's predicted time (collectives/model.py) beside the measured "
        "out-of-place time of every row, and their ratio",
    )
    c.add_argument(
        "--json",
        metavar="FILE",
        type=_output_file,
        default=None,
        help="write commref's results document (results and environment) as JSON",
    )
    c.add_argument(
        "--plot",
        metavar="FILE",
        default=None,
        help="write a PNG: busbw and time vs size (log axes), the kernel each series ran per size",
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(
        argparse.ArgumentParser(
            prog="commref bench", description="nccl-tests-style sweep of one collective, with baselines and a bound."
        )
    )


def validate(args) -> None:
    """Every check that needs no ranks (the parser's types check each flag; this checks
    them together, and again for args built by hand); raises ValueError (OptionError,
    NotAvailable) with a one-line reason."""
    peers = split_baselines(getattr(args, "baseline", "none"))[1]
    if peers and run_cycles(args) == 0:
        raise ValueError("standalone baselines run in rounds: -N 0 (until interrupted) does not combine; give -N n")
    if peers and args.nthreads > 1:
        raise ValueError("standalone baselines run one rank per process: give --np N, not -t (rank threads)")
    if args.iters < 1:
        raise ValueError(f"-n must be >= 1, got {args.iters}")
    if args.warmup_iters < 0:
        raise ValueError(f"-w must be >= 0, got {args.warmup_iters}")
    agg = getattr(args, "agg_iters", 1)
    if not isinstance(agg, int) or not 1 <= agg <= MAX_AGG_ITERS:
        raise ValueError(f"-m must be in [1, {MAX_AGG_ITERS}], got {agg!r}")
    if args.nthreads < 1:
        raise ValueError(f"-t must be >= 1, got {args.nthreads}")
    if args.np is not None and args.np < 1:
        raise ValueError(f"--np must be >= 1, got {args.np}")
    if args.nthreads > 1 and args.np and args.np > 1:
        raise ValueError("-t (rank threads) and --np (MPI ranks) do not combine; choose one")
    sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    for s in series_of(args):
        CommOptions.from_kwargs(device=args.device, **communicator_kwargs(args, s))
    from commref.transports.mpi_world import MPIWorld
    from commref.transports.nodes import check_nodes

    # Ranks of this run: --np, else -t, else (under an mpiexec started by hand) unknown here.
    nranks = args.np or (None if MPIWorld.launched_under_mpi() else args.nthreads)
    if args.root < 0 or (nranks is not None and args.root >= nranks):
        raise ValueError(f"-r {args.root} is not a rank of this run")
    if getattr(args, "nodes", None) is not None and nranks is not None:
        check_nodes(args.nodes, nranks)
    if run_cycles(args) == 0:
        files = [f for f, v in (("--json", args.json), ("-J", args.nccl_json), ("--plot", args.plot)) if v]
        if files:
            raise ValueError(f"-N 0 runs until interrupted, so {' and '.join(files)} would never be written; give -N n")
    if getattr(args, "profile", False):
        if args.device == "cuda":
            raise ValueError("--profile profiles the CPU engine's kernels; a GPU run has no profile (use nsys or ncu)")
        if args.nthreads > 1:
            raise ValueError(
                "--profile needs each rank in a process of its own (--np N): rank threads (-t) share one profile"
            )
    if args.json and args.nccl_json and _same_file(args.json, args.nccl_json):
        raise ValueError(f"--json and -J name the same file, {args.json}; give each its own")
    check_kept(args, nranks or 1)


def run_cycles(args) -> int:
    """-N: the sweeps (rounds, with standalone peers) to run; where it was left out, 1, or
    ROUNDS when --baseline names a standalone peer and this process can start jobs
    (it runs in no MPI job)."""
    n = getattr(args, "run_cycles", 1)
    if n is None:
        from commref.transports.mpi_world import MPIWorld

        peers = split_baselines(getattr(args, "baseline", "none"))[1]
        return ROUNDS if peers and not MPIWorld.launched_under_mpi() else 1
    return n


def _same_file(a: str, b: str) -> bool:
    import os

    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))


def kept_rows(args) -> int:
    """Rows a run keeps at once: every cycle's (-N 0: the current one's), a row per size
    and series (with several nodes, the hierarchical teams' two rows too)."""
    sizes = len(sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes))
    teams = 2 if (getattr(args, "nodes", None) or 1) > 1 else 0
    return (run_cycles(args) or 1) * sizes * (len(series_of(args)) + teams)


def kept_iteration_times(args, nranks: int) -> int:
    """With -I 1, the iteration times every rank of a `nranks`-rank run keeps (each
    row's two placements, -n times of every rank); 0 without -I 1."""
    return kept_rows(args) * 2 * args.iters * nranks if getattr(args, "iteration_stats", 0) else 0


def check_kept(args, nranks: int) -> None:
    """ValueError unless what a run of `nranks` ranks keeps stays within MAX_KEPT_ROWS rows
    and MAX_ITERATION_TIMES iteration times (validate checks with the ranks it knows of,
    every rank again with its world's)."""
    rows = kept_rows(args)
    if rows > MAX_KEPT_ROWS:
        raise ValueError(
            f"-N {run_cycles(args)} keeps {rows} rows (a row per size and series each cycle), more than "
            f"{MAX_KEPT_ROWS}; lower -N or the sizes, or give -N 0 (until interrupted, one cycle kept)"
        )
    kept = kept_iteration_times(args, nranks)
    if kept > MAX_ITERATION_TIMES:
        raise ValueError(
            f"-I 1 keeps every rank's time of every iteration: {rows} rows x 2 placements x -n {args.iters} "
            f"x {nranks} ranks = {kept} times, more than {MAX_ITERATION_TIMES}; lower -n, -N, the sizes "
            "or the ranks"
        )
