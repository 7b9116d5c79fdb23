"""The bench programs beside the collective sweep: `commref bench NAME [flags]` runs one,
as `commref bench all_reduce ...` runs the sweep.

A program is a module of this package with

- ``add_arguments(parser)``: its flags (``commref bench NAME --help`` lists them);
- ``validate(args)``: every check that needs no rank (ValueError, one line);
- ``run(args) -> int``: its work on this process's ranks (the MPI world under mpiexec,
  else its ranks as threads), the exit status (1: a wrong result or a missed target);
- where it runs on MPI ranks, ``footprint(args, nranks)``: what one rank costs the host
  (host_limits.Footprint), checked before `--np` starts any.

``python -m commref.bench.MODULE`` (the program's module, in PROGRAMS) runs the same
module in one process (run_module).
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Program:
    name: str  # the word after `commref bench`
    module: str  # the module of this package
    summary: str
    mpi: bool  # takes --np (MPI ranks); otherwise it runs in one process

    def load(self) -> ModuleType:
        return importlib.import_module(f"{__package__}.{self.module}")


PROGRAMS = {
    p.name: p
    for p in (
        Program(
            "ep",
            "ep_bench",
            "MoE dispatch and combine (commref.ep) against the same exchange on mpi4py's Alltoallv",
            mpi=True,
        ),
        Program(
            "gin_rate",
            "gin_rate",
            "GIN proxy operations/s, GIN-vs-LSA latency and GIN-vs-LSA-vs-MPI bandwidth",
            mpi=True,
        ),
        Program(
            "soak", "soak", "many mixed collectives and communicators; what a process holds at start and end", mpi=True
        ),
        Program(
            "engine", "engine_bench", "CPU engine: the copy kernel against numpy, and the cost of a launch", mpi=False
        ),
    )
}
NAMES = tuple(PROGRAMS)


def get(name: str) -> Program | None:
    """The program called `name` (gin-rate and gin_rate alike), or None."""
    return PROGRAMS.get(name.replace("-", "_"))


def run_module(module: ModuleType, argv: list[str] | None = None) -> int:
    """`python -m MODULE ARGV`: a program module's flags parsed and validated (a bad
    one is argparse's usage error), then its run on this process's ranks."""
    name = module.__spec__.name if module.__spec__ else module.__name__  # under -m, __name__ is __main__
    p = module.add_arguments(
        argparse.ArgumentParser(prog=f"python -m {name}", description=module.__doc__.split("\n\n")[0])
    )
    args = p.parse_args(argv)
    try:
        module.validate(args)
    except ValueError as e:
        p.error(str(e))
    return module.run(args)
