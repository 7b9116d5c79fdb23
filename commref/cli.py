"""The `commref` command line.

  commref check [collective ...] [--np N] [--dtype ...] [--op ...] [--algorithm ...] [--protocol ...] [--count ...]
  commref bench <collective> [-b 8] [-e 64M] [-f 2] [-n 20] ... [--np N]   (bench/harness.py's flags)
  commref study [--protocol ...] [--transport ...] [--bound PxS] [--json] [--stress [--np 2] [--network shm|mpi]]

Every argument (and COMMREF_TIMEOUT, COMMREF_CPU_BIND, COMMREF_GIN_ENGINE, COMMREF_PROTO) is parsed and validated here,
before any rank starts, with the typed options' own checks and messages (collectives/options.py,
transports/gin/options.py); a bad one ends the command with one line
`commref <command>: error: ...` on stderr and exit status 2.

This is the one place that starts ranks: with --np N outside an MPI job, commref
relaunches itself under mpiexec with N ranks (transports/launch.py: one process each,
`python -m mpi4py -m commref.cli`, so that an exception on one rank aborts the job; each
rank announces itself first thing in main(), so that a rank killed by a signal ends the
job and no rank outlives it; a failed job's shared-memory segments are removed); inside
mpiexec/mpirun it uses the MPI world it was started in.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time

from commref.bench import harness
from commref.collectives import catalogue, tuner
from commref.collectives.catalogue import NAMES as COLLECTIVES
from commref.collectives.hierarchical import HIERARCHICAL, NodeShape, node_shape
from commref.collectives.options import CommOptions, Device, default_protocol
from commref.collectives.verify import DTYPES, OPS
from commref.transports import launch
from commref.transports.gin.options import Backend, GinProtocol, Network, Path, Wire
from commref.transports.errors import CapabilityError
from commref.transports.gin import faults
from commref.transports.gin.backends import select_backend
from commref.transports.gin.native import kernels_help_enabled
from commref.transports.gin.plan import gin_engine, protocol_refusal_before_start, requirements
from commref.transports.world import NODES_ENV, MPIWorld, check_nodes, default_cpu_binding, default_timeout


def _study():
    """The ordering study: a module with add_arguments(parser) and run(args)."""
    from commref.transports.gin.study import report as study

    return study


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, `PROG: error: MESSAGE`, and exit
    status 2 (no usage block); its subcommands' parsers are Parsers too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def one_line(message) -> str:
    return re.sub(r"\s*\n\s*", " ", str(message).strip())


# ---------------------------------------------------------------------------------------
# commref check
# ---------------------------------------------------------------------------------------


def _collective(name: str) -> str:
    """A collective of `commref check`: nccl4py's name (allreduce) or nccl-tests' (all_reduce)."""
    try:
        return catalogue.get(name).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_check_arguments(c: argparse.ArgumentParser) -> None:
    option = harness.option_type
    c.add_argument("collectives", nargs="*", type=_collective, metavar="collective",
                   help=f"collectives to check (default: all of {', '.join(COLLECTIVES)}; "
                        "nccl-tests' names such as all_reduce work too)")
    c.add_argument("--np", type=harness.int_type(1), default=None,
                   help="number of ranks (relaunches under mpiexec)")
    c.add_argument("--nodes", type=harness.int_type(1), default=None,
                   help="simulated nodes: the ranks split into this many nodes of consecutive ranks (COMMREF_NODES)")
    c.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    c.add_argument("--op", nargs="+", default=list(OPS), choices=list(OPS))
    c.add_argument("--algorithm", nargs="+", default=[], choices=list(catalogue.ALGORITHMS),
                   help="algorithms (default: every one implemented for each collective)")
    c.add_argument("--protocol", nargs="+", default=[], choices=list(tuner.PROTOCOLS),
                   help="protocols of the ring and tree cases, each a set of cases (default: the communicator's, "
                        "COMMREF_PROTO or auto)")
    c.add_argument("--count", nargs="+", type=harness.int_type(0), default=[0, 1, 7, 1001],
                   help="element counts")
    c.add_argument("--seed", type=option("seed"), default=1, help="seed of the inputs and of the unordered GIN wire")
    c.add_argument("--device", default="auto", type=option("device"), choices=Device.words())
    c.add_argument("--channels", type=option("max_channels"), default=None, help="max channels (blocks) per launch")
    c.add_argument("--slot-bytes", type=option("slot_bytes"), default=None,
                   help="FIFO slot size in bytes (a positive multiple of 64)")
    c.add_argument("--threads", type=option("threads"), default=None, help="threads per block")
    c.add_argument("--path", default="lsa", type=option("path"), choices=Path.words(),
                   help="peers by load/store (lsa), through the GIN proxy (gin), or LSA where mapped (auto)")
    c.add_argument("--backend", default="auto", type=option("backend"), choices=Backend.words(), help="GIN backend")
    c.add_argument("--wire", default="ordered", type=option("wire"), choices=Wire.words(),
                   help="GIN wire ordering model (unordered: seeded by --seed)")
    c.add_argument("--network", default="auto", type=option("network"), choices=Network.words(),
                   help="GIN wire network")
    c.add_argument("--gin-protocol", default="strong", type=option("gin_protocol"), choices=GinProtocol.words(),
                   help="how a GIN connection publishes a slot (only strong is safe on every wire)")
    c.add_argument("--wire-rate", default=0, type=option("wire_rate"),
                   help="the GIN wire model: bytes/s of each rank's wire, e.g. 12.5G (0: unlimited)")
    c.add_argument("--wire-latency", default=0, type=option("wire_latency"),
                   help="the GIN wire model: seconds from send to effect, e.g. 5us")
    c.add_argument("--fault", default="none", type=option("fault"),
                   help="a lossy link under the GIN wire, with retransmission above it: drop, duplicate and delay "
                        "probabilities, e.g. drop=0.05,dup=0.05,delay=0.05 (seeded by --seed)")


def check_options(args) -> dict:
    """The Communicator keywords of `commref check`'s flags."""
    return {"max_channels": args.channels, "slot_bytes": args.slot_bytes, "threads": args.threads,
            "path": args.path, "backend": args.backend, "wire": args.wire, "network": args.network,
            "seed": args.seed, "gin_protocol": args.gin_protocol, "wire_rate": args.wire_rate,
            "wire_latency": args.wire_latency, "fault": args.fault}


def validate_check(args) -> None:
    options = CommOptions.from_kwargs(device=args.device, **check_options(args))
    if options.gin.path != Path.LSA:  # a backend that cannot carry the wire or protocol: one line, no ranks
        backend = select_backend(requirements(options.gin), options.gin.backend.value)
        for protocol in args.protocol:  # a GIN wire the ordering study does not clear for it: the same
            why = protocol_refusal_before_start(options.gin, backend, protocol, options.device.value)
            if why:
                raise CapabilityError(why)
    if args.nodes is not None and not MPIWorld.launched_under_mpi():  # under mpiexec: the world checks it
        check_nodes(args.nodes, args.np or 1)
        if args.nodes > 1 and options.gin.path == Path.LSA:
            raise ValueError(f"--path lsa needs every rank on one node, not {args.nodes} nodes: use --path auto "
                             f"(LSA inside a node, GIN between nodes) or --path gin")
    if HIERARCHICAL in args.algorithm and not MPIWorld.launched_under_mpi():
        np_, nodes = args.np or 1, args.nodes or 1
        shape = node_shape([r * nodes // np_ for r in range(np_)], 0)
        if not isinstance(shape, NodeShape):
            raise ValueError(f"--algorithm hierarchical with --np {np_} and --nodes {nodes}: {shape}")


def run_check(args) -> int:
    """The verification sweep on this process's ranks (the MPI world under mpiexec, else one rank)."""
    from commref.collectives import check
    from commref.collectives.communicator import Communicator
    from commref.transports.world import ThreadWorld

    world = MPIWorld() if MPIWorld.launched_under_mpi() else ThreadWorld.single()
    nodes = world.allgather(world.node, what="check nodes")
    with Communicator(world, args.device, **check_options(args)) as comm:
        colls = list(dict.fromkeys(args.collectives)) or list(COLLECTIVES)
        direct = comm.direct_kernels
        hierarchical = isinstance(comm.node_shape, NodeShape)
        if HIERARCHICAL in args.algorithm and not hierarchical:
            raise ValueError(f"--algorithm hierarchical cannot run on this job: {comm.node_shape}")
        refused = [p for p in args.protocol if p in comm.protocol_refusals]
        if refused:
            raise CapabilityError(f"protocol {refused[0]!r} cannot run here: {comm.protocol_refusals[refused[0]]}")
        case_list = check.cases(colls, args.dtype, args.op, args.algorithm, args.count, world.size, args.seed,
                                direct=direct is not None, hierarchical=hierarchical, protocols=args.protocol,
                                pushed=direct == "push")
        t0 = time.perf_counter()
        wrong = check.run_sweep(comm, case_list)
        elapsed = time.perf_counter() - t0
        if comm.proxy is not None:
            comm.proxy.quiesce(comm.timeout)  # the counts below are final: everything posted has landed
        stats = world.allgather(dict(getattr(comm.proxy, "stats", None) or {}), what="check GIN statistics")
        if world.rank == 0:
            rows = check.summary_rows(case_list, wrong)
            print(check.format_table(rows, world.size, comm.device))
            gin = comm.options.gin
            if gin.wire_modeled and comm.peer_mask:
                rate = f"{gin.wire_rate / 1e9:g} GB/s" if gin.wire_rate else "unlimited bytes/s"
                print(f"# GIN wire model: {rate} per rank's wire, {gin.wire_latency * 1e6:g} us latency")
            if gin.fault.active and comm.peer_mask:
                print(f"# GIN faults {gin.fault}, seed {gin.seed}: {faults.summary(stats)}")
            if len(set(nodes)) > 1:
                members = {n: [r for r, m in enumerate(nodes) if m == n] for n in dict.fromkeys(nodes)}
                print(f"# {len(members)} nodes: " + "; ".join(f"{n}: ranks {rs}" for n, rs in members.items())
                      + f"; GIN peers of rank 0: {[r for r in range(world.size) if comm.peer_mask >> r & 1]}, "
                      f"network {comm.network}")
            bad = sum(1 for w in wrong if w)
            denormal = sum(c.values == "denormal" for c in case_list)
            out_only = [c for c in colls if not catalogue.get(c).in_place_ok]  # no in-place form
            placements = "out-of-place" if len(out_only) == len(colls) else "in-place and out-of-place" + (
                f" ({', '.join(out_only)} out-of-place only: no in-place form)" if out_only else "")
            print(f"# {len(case_list)} cases, counts {list(args.count)}, {placements}, "
                  f"{denormal} on denormal inputs, "
                  f"{sum(wrong)} wrong elements in {bad} cases, {elapsed:.1f} s")
            sys.stdout.flush()
    ok = sum(wrong) == 0
    world.barrier(what="check done")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------
# commref bench (flags, validation and the ranks' work: bench/harness.py)
# ---------------------------------------------------------------------------------------


def run_bench(args) -> int:
    return harness.run(args)


# ---------------------------------------------------------------------------------------
# commref study
# ---------------------------------------------------------------------------------------


def add_study_arguments(st: argparse.ArgumentParser) -> None:
    _study().add_arguments(st)
    st.add_argument("--np", type=int, default=None,
                    help="with --stress: run the stress as 2 MPI processes (relaunches under mpiexec; 2 only)")
    st.add_argument("--network", default="shm", choices=[Network.SHM.value, Network.MPI.value],
                    help="with --stress: the proxy's wire (mpi: MPI messages to the receiver's proxy; needs --np 2 "
                         "or mpiexec)")


def _study_error(e: SystemExit) -> ValueError:
    """The study's own SystemExit("commref study: ...") as a ValueError without the prefix."""
    return ValueError(re.sub(r"^commref study( --\w+)?: ", "", str(e.code)))


def validate_study(args) -> None:
    if args.np is not None and args.np != 2:
        raise ValueError(f"--np must be 2 (a sender and a receiver), got {args.np}")
    if args.np and not args.stress:
        raise ValueError("--np needs --stress (the explorer runs in one process)")
    if args.network == Network.MPI and args.stress and not args.np and not MPIWorld.launched_under_mpi():
        raise ValueError("--network mpi needs --np 2 (or mpiexec -n 2)")
    try:
        _study().parse_bound(args.bound)
    except SystemExit as e:
        raise _study_error(e) from None
    if args.stress and (args.seeds < 1 or args.messages < 1):
        raise ValueError("--seeds and --messages must be at least 1")


def run_study(args) -> int:
    """`commref study`; under mpiexec (--np 2) --stress runs the proxy and the receiver
    as two processes. Only rank 0 prints."""
    study = _study()
    if not MPIWorld.launched_under_mpi():
        return study.run(args)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        rc = study.run(args)
        sys.stdout.flush()
        return rc
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        return study.run(args)


# ---------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------

# command -> (add its arguments, validate (ValueError), run on this process's ranks)
COMMANDS = {
    "check": (add_check_arguments, validate_check, run_check),
    "bench": (harness.add_arguments, harness.validate, run_bench),
    "study": (add_study_arguments, validate_study, run_study),
}
HELP = {
    "check": "run the verification sweep and report wrong elements per case",
    "bench": "nccl-tests-style sweep with baselines and a bound (commref bench -h for its flags)",
    "study": "ordering study: protocol x transport model x signal strength -> safe/unsafe (docs/ordering.md)",
}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="commref", description="Collective-communication kernels: reference and tests.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{check,bench,study}")
    p.commands = {name: sub.add_parser(name, help=HELP[name], description=HELP[name]) for name in COMMANDS}
    for name, (add_arguments, _, _) in COMMANDS.items():
        add_arguments(p.commands[name])
    return p


def validate(args) -> None:
    """Every check that needs no rank; ValueError (OptionError included) with one line."""
    default_timeout()  # COMMREF_TIMEOUT, which every rank's waits use
    default_cpu_binding()  # COMMREF_CPU_BIND: auto or none (transports/world.py)
    gin_engine()  # COMMREF_GIN_ENGINE: auto, native or python (transports/gin/plan.py)
    kernels_help_enabled()  # COMMREF_GIN_KERNELS_HELP: 0 or 1 (transports/gin/native.py)
    default_protocol()  # COMMREF_PROTO: auto, simple, ll or ll128 (collectives/options.py)
    COMMANDS[args.command][1](args)


def relaunch(args, argv: list[str]) -> int:
    """Runs this command line (without --np) as args.np MPI ranks; the job's status."""
    env = {}
    if args.command == "bench":  # the ranks' streams are pipes: this terminal decides the progress bar
        env[harness.PROGRESS_ENV] = harness.progress_mode() or ""
    return launch.relaunch(args.np, launch.strip_np(argv), env=env)


def export_nodes(args) -> None:
    """--nodes N becomes COMMREF_NODES=N for this process and the ranks it launches
    (transports/world.node_of reads it on every rank)."""
    if getattr(args, "nodes", None) is not None:
        os.environ[NODES_ENV] = str(args.nodes)


def main(argv: list[str] | None = None) -> int:
    launch.announce_rank()  # a rank of a job that --np started: its launcher watches whether it dies
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the command's parser (commref check: error: ...)
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # a usage error (one line printed) or --help
        return e.code if isinstance(e.code, int) else 2
    command = args.command
    try:
        validate(args)
        export_nodes(args)
        if args.np is not None and args.np > 1 and not MPIWorld.launched_under_mpi():
            return relaunch(args, argv)
    except (ValueError, CapabilityError, launch.LaunchError) as e:  # OptionError, NotAvailable: ValueErrors
        print(f"commref {command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    del args.command  # not one of the command's own flags (bench writes its flags to JSON)
    return COMMANDS[command][2](args)


if __name__ == "__main__":
    sys.exit(main())
