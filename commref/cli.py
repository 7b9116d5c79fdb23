"""The `commref` command line.

  commref check [collective ...] [--np N] [--dtype ...] [--op ...] [--algorithm ...] [--protocol ...] [--count ...]
  commref bench <collective> [-b 8] [-e 64M] [-f 2] [-n 20] ... [--np N]   (bench/arguments.py: its flags)
  commref model [collective] [--nodes N] [--gpus-per-node G] [--intra nvlink|pcie] [--*-rate ...] [--*-latency ...]
  commref study [--protocol ...] [--transport ...] [--bound PxS] [--json] [--plot FILE]
                [--stress [--explore] [--np 2] [--network shm|mpi]]

Every argument (and COMMREF_TIMEOUT, COMMREF_CPU_BIND, COMMREF_GIN_ENGINE, COMMREF_PROTO, COMMREF_MODEL) is parsed
and validated here, before any rank starts, with the typed options' own checks and messages (collectives/options.py,
transports/gin/options.py); a bad one ends the command with one line
`commref <command>: error: ...` on stderr and exit status 2.

This is the one place that starts ranks: with --np N outside an MPI job, commref
relaunches itself under mpiexec with N ranks (transports/launcher.py: one process each,
`python -m mpi4py -m commref.cli`, so that an exception on one rank aborts the job; each
rank announces itself first thing in main(), so that a rank killed by a signal ends the
job and no rank outlives it; a failed job's shared-memory segments are removed); inside
mpiexec/mpirun it uses the MPI world it was started in. --np N is first checked against
what this host can hold (transports/host_limits.py: memory, /dev/shm, RLIMIT_NPROC, 8
ranks per allowed CPU unless --oversubscribe), from one rank's footprint (FOOTPRINTS);
SIGINT, SIGTERM and SIGHUP, and a SIGKILL of this process, end the whole job
(transports/launcher.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time

from commref.bench import cluster_model, footprint, harness, peers, programs
from commref.bench.baselines import split_baselines
from commref.bench.flags import add_np, add_option, int_type
from commref.collectives import catalogue, group_check, tuner
from commref.collectives.calibration import model_source
from commref.collectives.catalogue import NAMES
from commref.collectives.group_check import GROUP
from commref.collectives.hierarchical import HIERARCHICAL, NodeShape, node_shape
from commref.collectives.options import CommOptions, Device, default_protocol
from commref.collectives.p2p_collectives import P2P
from commref.collectives.verify import DTYPES, OPS
from commref.device_kernels import abi
from commref.transports import host_limits, launcher
from commref.transports.cpu_binding import default_cpu_binding
from commref.transports.deadlines import default_timeout
from commref.transports.errors import CapabilityError
from commref.transports.gin import faults
from commref.transports.gin.backends import select_backend
from commref.transports.gin.engines import gin_engine
from commref.transports.gin.native import kernels_help_enabled
from commref.transports.gin.options import Backend, GinProtocol, Network, Path, Wire, default_path
from commref.transports.gin.plan import protocol_refusal_before_start, requirements
from commref.transports.mpi_world import MPIWorld
from commref.transports.nodes import NODES_ENV, check_nodes


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


# What `commref check` checks by default: every collective of the catalogue, and the group
# cases (collectives/group_check.py).
COLLECTIVES = (*NAMES, GROUP)


def _collective(name: str) -> str:
    """A collective of `commref check`: nccl4py's name (allreduce) or nccl-tests' (all_reduce),
    or "group" (the group cases)."""
    if name.strip().lower() == GROUP:
        return GROUP
    try:
        return catalogue.get(name).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_check_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "collectives",
        nargs="*",
        type=_collective,
        metavar="collective",
        help=f"collectives to check (default: all of {', '.join(COLLECTIVES)}; "
        "nccl-tests' names such as all_reduce work too; gather, scatter, alltoallv, sendrecv and "
        "hypercube are groups of sends and receives, hypercube at power-of-two ranks only; "
        f"{GROUP}: one group mixing collectives and sends/receives per dtype and count, posted in "
        "an order of each rank's own)",
    )
    add_np(
        c,
        "number of ranks (relaunches under mpiexec; checked against this host's CPUs, memory, "
        "/dev/shm and process limit first)",
        nodes=True,
    )
    c.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    c.add_argument("--op", nargs="+", default=list(OPS), choices=list(OPS))
    c.add_argument(
        "--algorithm",
        nargs="+",
        default=[],
        choices=list(catalogue.ALGORITHMS),
        help="algorithms (default: every one implemented for each collective)",
    )
    c.add_argument(
        "--protocol",
        nargs="+",
        default=[],
        choices=list(tuner.PROTOCOLS),
        help="protocols of the ring and tree cases, each a set of cases (default: the communicator's, "
        "COMMREF_PROTO or auto)",
    )
    c.add_argument("--count", nargs="+", type=int_type(0), default=[0, 1, 7, 1001], help="element counts")
    add_option(c, "--seed", 1, "seed of the inputs and of the unordered GIN wire")
    add_option(c, "--device", "auto", choices=Device)
    add_option(c, "--channels", None, "max channels (blocks) per launch", keyword="max_channels")
    add_option(c, "--slot-bytes", None, "FIFO slot size in bytes (a positive multiple of 64)")
    add_option(c, "--threads", None, "threads per block")
    add_option(
        c,
        "--path",
        None,
        "peers by load/store (lsa), through the GIN proxy (gin), or LSA where mapped (auto); "
        "default lsa, or auto with --nodes above 1",
        choices=Path,
    )
    add_option(c, "--backend", "auto", "GIN backend", choices=Backend)
    add_option(c, "--wire", "ordered", "GIN wire ordering model (unordered: seeded by --seed)", choices=Wire)
    add_option(c, "--network", "auto", "GIN wire network", choices=Network)
    add_option(
        c,
        "--gin-protocol",
        "strong",
        "how a GIN connection publishes a slot (only strong is safe on every wire)",
        choices=GinProtocol,
    )
    add_option(c, "--wire-rate", 0, "the GIN wire model: bytes/s of each rank's wire, e.g. 12.5G (0: unlimited)")
    add_option(c, "--wire-latency", 0, "the GIN wire model: seconds from send to effect, e.g. 5us")
    add_option(c, "--wire-paths", 1, "the unordered GIN wire's paths: its packets sprayed over them, as SRD's")
    add_option(
        c,
        "--fault",
        "none",
        "a lossy link under the GIN wire, with retransmission above it: drop, duplicate and delay "
        "probabilities, e.g. drop=0.05,dup=0.05,delay=0.05 (seeded by --seed)",
    )


def check_path(args) -> str:
    """--path, or where it was left out the default for the job's nodes."""
    return args.path or default_path(args.nodes).value


# Private memory of a check rank beyond the interpreter's, per byte of the largest case's
# sendbuf + recvbuf: the buffers, the input and the expected result. Measured: allreduce
# and allgather of 3000001 float64 on 2 ranks (72 MB of buffers), RssAnon 185 MiB at its
# peak against 46 MiB at start: 2.0x; counted as 3 for the other dtypes' temporaries.
CHECK_BUFFER_FACTOR = 3


def check_footprint(args, nranks: int) -> host_limits.Footprint:
    """What one rank of `commref check --np nranks` costs its host (host_limits.check_ranks):
    the connection window, the direct cases' symmetric buffers and MPICH's segment in
    /dev/shm; the largest case's buffers in private memory."""
    options = CommOptions.from_kwargs(device="cpu", **check_options(args))
    colls = list(dict.fromkeys(args.collectives)) or list(COLLECTIVES)
    count, itemsize = max(args.count), max(DTYPES[d].itemsize for d in args.dtype)
    # A group case holds its members' buffers at once, each at most an alltoall's.
    buffers = itemsize * max(
        group_check.MEMBERS * 2 * nranks * count if c == GROUP else sum(catalogue.get(c).counts(count, nranks))
        for c in colls
    )
    direct = nranks <= abi.DIRECT_MAX_RANKS and (not args.algorithm or {"direct", "nvls"} & set(args.algorithm))
    shm = (
        host_limits.MPICH_SHM_PER_RANK
        + footprint.connection_window_bytes(options, nranks)
        + (buffers + 2 * 4096 if direct else 0)
    )
    return host_limits.Footprint(
        host_limits.RANK_MEMORY + CHECK_BUFFER_FACTOR * buffers, shm, footprint.rank_tasks(options, nranks)
    )


def check_options(args) -> dict:
    """The Communicator keywords of `commref check`'s flags."""
    return {
        "max_channels": args.channels,
        "slot_bytes": args.slot_bytes,
        "threads": args.threads,
        "path": check_path(args),
        "backend": args.backend,
        "wire": args.wire,
        "network": args.network,
        "seed": args.seed,
        "gin_protocol": args.gin_protocol,
        "wire_rate": args.wire_rate,
        "wire_latency": args.wire_latency,
        "wire_paths": args.wire_paths,
        "fault": args.fault,
    }


def validate_check(args) -> None:
    options = CommOptions.from_kwargs(device=args.device, **check_options(args))
    if args.collectives and not MPIWorld.launched_under_mpi():  # every one refuses these ranks: nothing to check
        why = [catalogue.get(c).rank_refusal for c in args.collectives if c != GROUP]
        reasons = [f(args.np or 1) for f in why if f is not None]
        if len(reasons) == len(args.collectives) and all(reasons):
            raise ValueError(f"nothing to check at --np {args.np or 1}: {'; '.join(dict.fromkeys(reasons))}")
    if options.gin.path != Path.LSA:  # a backend that cannot carry the wire or protocol: one line, no ranks
        backend = select_backend(requirements(options.gin), options.gin.backend.value)
        for protocol in args.protocol:  # a GIN wire the ordering study does not clear for it: the same
            why = protocol_refusal_before_start(options.gin, backend, protocol, options.device.value)
            if why:
                raise CapabilityError(why)
    if args.nodes is not None and not MPIWorld.launched_under_mpi():  # under mpiexec: the world checks it
        check_nodes(args.nodes, args.np or 1)
        if args.nodes > 1 and options.gin.path == Path.LSA:  # typed: a left-out --path is auto here
            raise ValueError(
                f"--path lsa --nodes {args.nodes}: LSA needs every rank on one node; use --path auto "
                f"(LSA inside a node, GIN between nodes, the default with --nodes), or --path gin"
            )
    if HIERARCHICAL in args.algorithm and not MPIWorld.launched_under_mpi():
        np_, nodes = args.np or 1, args.nodes or 1
        shape = node_shape([r * nodes // np_ for r in range(np_)], 0)
        if not isinstance(shape, NodeShape):
            raise ValueError(f"--algorithm hierarchical with --np {np_} and --nodes {nodes}: {shape}")


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def check_summary(rows, case_list, wrong, colls, counts, elapsed: float) -> str:
    """The line under check's table: the rows it shows, the cases they hold, the wrong elements."""
    out_only = [c for c in colls if c == GROUP or not catalogue.get(c).in_place_ok]  # no in-place form
    placements = (
        "out-of-place"
        if len(out_only) == len(colls)
        else "in-place and out-of-place" + (f", {', '.join(out_only)} out-of-place only" if out_only else "")
    )
    denormal = sum(c.values == "denormal" for c in case_list)
    bad_rows = sum(1 for *_, cells in rows if any(w for _, w in cells.values()))
    bad_cases = sum(1 for w in wrong if w)
    cases = plural(len(case_list), "case")
    verdict = (
        f"{plural(sum(wrong), 'wrong element')} in {bad_cases} of {cases}, {bad_rows} of {plural(len(rows), 'row')}"
        if bad_cases
        else f"no wrong elements in {cases}"
    )
    return (
        f"# {plural(len(rows), 'row')}, {cases} (counts {list(counts)}, {placements}; {denormal} on "
        f"denormal inputs): {verdict}, {elapsed:.1f} s"
    )


def run_check(args) -> int:
    """The verification sweep on this process's ranks (the MPI world under mpiexec, else one rank)."""
    from commref.collectives import check
    from commref.collectives.communicator import Communicator
    from commref.transports.thread_world import ThreadWorld

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
        case_list = check.cases(
            [c for c in colls if c != GROUP],
            args.dtype,
            args.op,
            args.algorithm,
            args.count,
            world.size,
            args.seed,
            direct=direct is not None,
            hierarchical=hierarchical,
            protocols=args.protocol,
            pushed=direct == "push",
            device=comm.device,
        )
        skipped = check.skipped(colls, world.size, comm.device)
        grouped = GROUP in colls and (not args.algorithm or P2P in args.algorithm)  # sends and receives: p2p's
        if grouped and not any(why.startswith(f"{GROUP} ") for why in skipped):
            case_list += group_check.cases(args.dtype, args.count, args.seed)
        t0 = time.perf_counter()
        wrong = check.run_sweep(comm, case_list)
        elapsed = time.perf_counter() - t0
        if comm.proxy is not None:
            comm.proxy.quiesce(comm.timeout)  # the counts below are final: everything posted has landed
        stats = world.allgather(dict(getattr(comm.proxy, "stats", None) or {}), what="check GIN statistics")
        if world.rank == 0:
            rows = check.summary_rows(case_list, wrong)
            print(check.format_table(rows, world.size, comm.device))
            for why in skipped:
                print(f"# {why}")
            gin = comm.options.gin
            if gin.wire_modeled and comm.peer_mask:
                rate = f"{gin.wire_rate / 1e9:g} GB/s" if gin.wire_rate else "unlimited bytes/s"
                print(f"# GIN wire model: {rate} per rank's wire, {gin.wire_latency * 1e6:g} us latency")
            if gin.wire_paths > 1 and comm.peer_mask:
                print(f"# GIN unordered wire: packets sprayed over {gin.wire_paths} paths, seed {gin.seed}")
            if gin.fault.active and comm.peer_mask:
                print(f"# GIN faults {gin.fault}, seed {gin.seed}: {faults.summary(stats)}")
            if len(set(nodes)) > 1:
                members = {n: [r for r, m in enumerate(nodes) if m == n] for n in dict.fromkeys(nodes)}
                print(
                    f"# {len(members)} nodes: "
                    + "; ".join(f"{n}: ranks {rs}" for n, rs in members.items())
                    + f"; GIN peers of rank 0: {[r for r in range(world.size) if comm.peer_mask >> r & 1]}, "
                    f"network {comm.network}"
                )
            print(check_summary(rows, case_list, wrong, colls, args.count, elapsed))
            sys.stdout.flush()
    ok = sum(wrong) == 0
    world.barrier(what="check done")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------
# commref bench (flags: bench/arguments.py; the ranks' work: bench/harness.py; programs: bench/programs.py)
# ---------------------------------------------------------------------------------------


def program_of(args) -> programs.Program | None:
    """The bench program these parsed args run (None: the collective sweep)."""
    return programs.get(getattr(args, "program", None) or "")


def run_bench(args) -> int:
    program = program_of(args)
    return program.load().run(args) if program else harness.run(args)


def validate_bench(args) -> None:
    program = program_of(args)
    if program is None:
        return harness.validate(args)
    if not program.mpi and args.np is not None and args.np > 1:
        raise ValueError(f"{program.name} runs in one process: it takes no --np")
    program.load().validate(args)


def bench_footprint(args, nranks: int) -> host_limits.Footprint:
    program = program_of(args)
    return program.load().footprint(args, nranks) if program else footprint.sweep_footprint(args, nranks)


def bench_program(argv: list[str]) -> programs.Program | None:
    """The bench program `commref bench NAME ...` names, if NAME is one."""
    return programs.get(argv[1]) if len(argv) > 1 and argv[0] == "bench" else None


def add_program_arguments(bench: argparse.ArgumentParser, program: programs.Program) -> None:
    """`commref bench NAME`: the program's own flags (and --np where it runs on MPI ranks)."""
    sub = bench.add_subparsers(dest="program", required=True, metavar=program.name)
    p = sub.add_parser(program.name, help=program.summary, description=program.summary)
    program.load().add_arguments(p)
    add_np(p, "MPI ranks (relaunches under mpiexec)" if program.mpi else "not taken: it runs in one process")


# ---------------------------------------------------------------------------------------
# commref study
# ---------------------------------------------------------------------------------------


def add_study_arguments(st: argparse.ArgumentParser) -> None:
    _study().add_arguments(st)
    add_np(st, "with --stress: run the stress as 2 MPI processes (relaunches under mpiexec; 2 only)", type=int)
    st.add_argument(
        "--network",
        default="shm",
        choices=[Network.SHM.value, Network.MPI.value],
        help="with --stress: the proxy's wire (mpi: MPI messages to the receiver's proxy; needs --np 2 or mpiexec)",
    )


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
        _study().check_plot(args.plot)
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


def study_footprint(args, nranks: int) -> host_limits.Footprint:
    """One rank of `commref study --stress --np 2`: the interpreter, a small window, the proxy."""
    return host_limits.Footprint(
        host_limits.RANK_MEMORY, host_limits.MPICH_SHM_PER_RANK + 16 * host_limits.MIB, host_limits.RANK_TASKS + 2
    )


# command -> (add its arguments, validate (ValueError), run on this process's ranks)
COMMANDS = {
    "check": (add_check_arguments, validate_check, run_check),
    "bench": (harness.add_arguments, validate_bench, run_bench),
    "study": (add_study_arguments, validate_study, run_study),
    "model": (cluster_model.add_arguments, cluster_model.validate, cluster_model.run),
}
# command -> one rank's footprint (host_limits.Footprint) for --np N
FOOTPRINTS = {"check": check_footprint, "bench": bench_footprint, "study": study_footprint}
HELP = {
    "check": "run the verification sweep and report wrong elements per case",
    "bench": "nccl-tests-style sweep with baselines and a bound, or a bench program "
    f"({', '.join(programs.NAMES)}; commref bench NAME -h for its flags)",
    "study": "ordering study: protocol x transport model x signal strength -> safe/unsafe (docs/ordering.md)",
    "model": "the performance model on a described cluster: predicted time and busbw per size, published "
    "NCCL figures beside it (docs/performance.md)",
}


def build_parser(program: programs.Program | None = None) -> argparse.ArgumentParser:
    """The command line; with `program` (bench_program), `commref bench` takes that
    program's flags instead of the collective sweep's."""
    p = Parser(prog="commref", description="Collective-communication kernels: reference and tests.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{check,bench,study,model}")
    p.commands = {name: sub.add_parser(name, help=HELP[name], description=HELP[name]) for name in COMMANDS}
    for name, (add_arguments, _, _) in COMMANDS.items():
        if name == "bench" and program is not None:
            add_program_arguments(p.commands[name], program)
        else:
            add_arguments(p.commands[name])
    return p


def validate(args) -> None:
    """Every check that needs no rank; ValueError (OptionError included) with one line."""
    default_timeout()  # COMMREF_TIMEOUT, which every rank's waits use
    default_cpu_binding()  # COMMREF_CPU_BIND: auto or none (transports/cpu_binding.py)
    gin_engine()  # COMMREF_GIN_ENGINE: auto, native or python (transports/gin/engines.py)
    kernels_help_enabled()  # COMMREF_GIN_KERNELS_HELP: 0 or 1 (transports/gin/native.py)
    default_protocol()  # COMMREF_PROTO: auto, simple, ll or ll128 (collectives/options.py)
    model_source()  # COMMREF_MODEL: probe or reference (collectives/calibration.py)
    COMMANDS[args.command][1](args)
    if getattr(args, "np", None) is not None and not MPIWorld.launched_under_mpi():  # the job must fit this host
        host_limits.check_ranks(args.np, FOOTPRINTS[args.command](args, args.np), args.oversubscribe)


def bench_env() -> dict[str, str]:
    """What a bench job's ranks get from this process: the ranks' streams are pipes, so
    this terminal decides the progress bar."""
    return {harness.PROGRESS_ENV: harness.progress_mode() or ""}


def relaunch(args, argv: list[str]) -> int:
    """Runs this command line (without --np) as args.np MPI ranks; the job's status."""
    env = bench_env() if args.command == "bench" else {}
    return launcher.relaunch(args.np, launcher.strip_np(argv), env=env)


def standalone_rounds(args) -> bool:
    """Whether this is the collective sweep with standalone baselines, outside any MPI
    job: this process then runs the rounds of commref's and the peers' jobs (bench/peers.py)."""
    return (
        args.command == "bench"
        and program_of(args) is None
        and bool(split_baselines(args.baseline)[1])
        and not MPIWorld.launched_under_mpi()
    )


def export_nodes(args) -> None:
    """--nodes N becomes COMMREF_NODES=N for this process and the ranks it launches
    (transports/nodes.node_of reads it on every rank)."""
    if getattr(args, "nodes", None) is not None:
        os.environ[NODES_ENV] = str(args.nodes)


def main(argv: list[str] | None = None) -> int:
    launcher.announce_rank()  # a rank of a job that --np started: its launcher watches whether it dies
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(bench_program(argv))
    try:
        args, extra = parser.parse_known_args(argv)
        # Errors are named by the command's parser: `commref check: error: ...` (`commref bench ep: ...`).
        prog = " ".join(filter(None, (parser.commands[args.command].prog, getattr(args, "program", None))))
        if extra:
            Parser(prog=prog).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # a usage error (one line printed) or --help
        return e.code if isinstance(e.code, int) else 2
    command = args.command
    try:
        validate(args)
        export_nodes(args)
        if standalone_rounds(args):
            return peers.run_rounds(args, argv, args.np or 1, env=bench_env())
        if getattr(args, "np", None) is not None and args.np > 1 and not MPIWorld.launched_under_mpi():
            return relaunch(args, argv)
    except (ValueError, CapabilityError, launcher.LaunchError) as e:  # OptionError, NotAvailable: ValueErrors
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    del args.command  # not one of the command's own flags (bench writes its flags to JSON)
    return COMMANDS[command][2](args)


if __name__ == "__main__":
    sys.exit(main())
