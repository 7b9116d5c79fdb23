"""The `commref` command line.

  commref check [collective ...] [--np N] [--dtype ...] [--op ...] [--algorithm ...] [--count ...]
  commref bench <collective> [-b 8] [-e 64M] [-f 2] [-n 20] ... [--np N]   (bench/harness.py)
  commref study [--protocol ...] [--transport ...] [--bound PxS] [--json] [--stress [--np 2] [--network shm|mpi]]   (collectives/study.py)

With --np N outside an MPI job, commref relaunches itself under mpiexec with N ranks
(one process each, `python -m mpi4py` so that an exception on one rank aborts the
job); inside mpiexec/mpirun it uses the MPI world it was started in.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from commref.collectives.verify import COLLECTIVES, DTYPES, OPS


def find_mpiexec() -> str:
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    for name in ("mpiexec", "mpirun"):
        exe = shutil.which(name, path=path)
        if exe:
            return exe
    raise SystemExit("commref: --np needs mpiexec (pip install 'commref[mpich]' or use your MPI's launcher)")


def relaunch_under_mpi(nranks: int, argv: list[str]) -> int:
    """Runs this command again as `nranks` MPI processes and returns their exit code."""
    cmd = [find_mpiexec(), "-n", str(nranks), sys.executable, "-m", "mpi4py", "-m", "commref.cli", *argv]
    env = dict(os.environ, COMMREF_UNDER_MPIEXEC="1")
    return subprocess.run(cmd, env=env).returncode


def _strip_np(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--np":
            skip = True
            continue
        if a.startswith("--np="):
            continue
        out.append(a)
    return out


def _world(args):
    from commref.transports.world import MPIWorld, ThreadWorld

    if MPIWorld.launched_under_mpi():
        return MPIWorld()
    return ThreadWorld.single()


def cmd_check(args, argv) -> int:
    from commref.transports.world import MPIWorld

    if args.np and args.np > 1 and not MPIWorld.launched_under_mpi():
        return relaunch_under_mpi(args.np, _strip_np(argv))
    from commref.device_kernels import abi

    from commref.collectives import check
    from commref.collectives.communicator import Communicator

    world = _world(args)
    comm = Communicator(world, args.device, max_channels=args.channels, slot_bytes=args.slot_bytes,
                        threads=args.threads, path=args.path, backend=args.backend, wire=args.wire,
                        network=args.network, seed=args.seed, gin_protocol=args.gin_protocol)
    colls = list(dict.fromkeys(args.collectives)) or list(COLLECTIVES)
    direct = not comm.peer_mask and world.size <= abi.DIRECT_MAX_RANKS
    case_list = check.cases(colls, args.dtype, args.op, args.algorithm, args.count, world.size, args.seed,
                            direct=direct)
    t0 = time.perf_counter()
    wrong = check.run_sweep(comm, case_list)
    elapsed = time.perf_counter() - t0
    if world.rank == 0:
        rows = check.summary_rows(case_list, wrong)
        print(check.format_table(rows, world.size, comm.device))
        bad = sum(1 for w in wrong if w)
        print(f"# {len(case_list)} cases, counts {list(args.count)}, in-place and out-of-place, "
              f"{sum(wrong)} wrong elements in {bad} cases, {elapsed:.1f} s")
        sys.stdout.flush()
    ok = sum(wrong) == 0
    world.barrier(what="check done")
    return 0 if ok else 1


def cmd_study(args, argv) -> int:
    """`commref study`; with --np 2 (or under mpiexec -n 2) --stress runs the proxy and
    the receiver as two processes (collectives/study_stress.py). Only rank 0 prints."""
    import contextlib

    from commref.transports.world import MPIWorld

    from commref.transports.gin.study import report as study

    if args.np is not None and args.np != 2:
        raise SystemExit("commref study: --np must be 2 (a sender and a receiver)")
    if args.np and not args.stress:
        raise SystemExit("commref study: --np needs --stress (the explorer runs in one process)")
    if not MPIWorld.launched_under_mpi():
        if args.network == "mpi" and args.stress and not args.np:
            raise SystemExit("commref study: --network mpi needs --np 2 (or mpiexec -n 2)")
        if args.np:
            return relaunch_under_mpi(args.np, _strip_np(argv))
        return study.run(args)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        rc = study.run(args)
        sys.stdout.flush()
        return rc
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        return study.run(args)


def _collective(name: str) -> str:
    """A collective of `commref check`: nccl4py's name (allreduce) or nccl-tests' (all_reduce)."""
    by_key = {c.replace("_", ""): c for c in COLLECTIVES}
    key = name.lower().replace("_", "")
    if key not in by_key:
        raise argparse.ArgumentTypeError(f"unknown collective {name!r}; choose from {', '.join(COLLECTIVES)}")
    return by_key[key]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commref", description="Collective-communication kernels: reference and tests.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="run the verification sweep and report wrong elements per case")
    c.add_argument("collectives", nargs="*", type=_collective, metavar="collective",
                   help=f"collectives to check (default: all of {', '.join(COLLECTIVES)}; "
                        "nccl-tests' names such as all_reduce work too)")
    c.add_argument("--np", type=int, default=None, help="number of ranks (relaunches under mpiexec)")
    c.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    c.add_argument("--op", nargs="+", default=list(OPS), choices=list(OPS))
    c.add_argument("--algorithm", nargs="+", default=[], choices=["ring", "tree", "direct"],
                   help="algorithms (default: every one implemented for each collective)")
    c.add_argument("--count", nargs="+", type=int, default=[0, 1, 7, 1001], help="element counts")
    c.add_argument("--seed", type=int, default=1, help="seed of the inputs and of the unordered GIN wire")
    c.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    c.add_argument("--channels", type=int, default=None, help="max channels (blocks) per launch")
    c.add_argument("--slot-bytes", type=int, default=None, help="FIFO slot size in bytes")
    c.add_argument("--threads", type=int, default=None, help="threads per block")
    c.add_argument("--path", default="lsa", choices=["lsa", "gin", "auto"],
                   help="peers by load/store (lsa), through the GIN proxy (gin), or LSA where mapped (auto)")
    c.add_argument("--backend", default="auto", choices=["auto", "proxy", "rc", "gda"], help="GIN backend")
    c.add_argument("--wire", default="ordered", choices=["ordered", "unordered"],
                   help="GIN wire ordering model (unordered: seeded by --seed)")
    c.add_argument("--network", default="auto", choices=["auto", "shm", "mpi"], help="GIN wire network")
    c.add_argument("--gin-protocol", default="strong",
                   choices=["strong", "weak-last", "signal-per-put", "flush-signal"],
                   help="how a GIN connection publishes a slot (only strong is safe on every wire)")
    from commref.transports.gin.study import report as study

    st = sub.add_parser("study", help="ordering study: protocol x transport model x signal strength -> safe/unsafe "
                                      "(docs/ordering.md)")
    study.add_arguments(st)
    st.add_argument("--np", type=int, default=None,
                    help="with --stress: run the stress as 2 MPI processes (relaunches under mpiexec; 2 only)")
    st.add_argument("--network", default="shm", choices=["shm", "mpi"],
                    help="with --stress: the proxy's wire (mpi: MPI messages to the receiver's proxy; needs --np 2 "
                         "or mpiexec)")
    sub.add_parser("bench", add_help=False,
                   help="nccl-tests-style sweep with baselines and a bound (commref bench -h for its flags)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the bench layer parses its own (nccl-tests) flags
        from commref.bench.harness import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "check":
        return cmd_check(args, argv)
    if args.command == "study":
        return cmd_study(args, argv)
    return 2


if __name__ == "__main__":
    sys.exit(main())
