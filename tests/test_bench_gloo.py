"""The gloo baseline (bench/baselines.py, GlooBaseline): under mpiexec, every
collective the bench runs, driven by its plugin with the baseline as the communicator,
leaves what the numpy reference says on every rank; and `--baseline gloo` reaches it
from the CLI. Skipped where torch is not installed (it is in the test extra)."""

from __future__ import annotations

import sys


def _mpi_main() -> None:
    import numpy as np

    from commref.bench.baselines import GlooBaseline
    from commref.collectives import verify
    from commref.collectives.memory import Memory
    from commref.transports.mpi_world import MPIWorld

    world = MPIWorld(timeout=60)
    base = GlooBaseline(world)
    mem, wrong, cases = Memory(np), [], 0
    for name, p in _runnable(world.size):
        for dtype in ("float32", "bfloat16", "int32", "uint8"):
            dt = verify.DTYPES[dtype]
            op = "sum" if p.reducing else None
            if p.reducing and dtype == "uint8":
                op = "max"
            for nbytes in (0, 4 * 1024, 96 * 1024):
                counts = p.counts(nbytes, dt.itemsize, world.size)
                root = (nbytes // 1024 + 1) % world.size
                x = p.input(counts, dt, op, 7, world.rank, world.size)
                expected = p.expected(counts, dt, op, 7, world.rank, world.size, root)
                b = p.buffers(mem, x, counts, world.rank, world.size, root, False)
                p.run(base, b, op, root)
                cases += 1
                if expected is not None and verify.count_wrong(b.out, expected):
                    wrong.append(f"{name}/{dtype}/{nbytes}")
    sys.stdout.write(f"rank {world.rank}: {cases} cases, wrong: {wrong}\n")
    sys.stdout.flush()
    base.close()


def _runnable(nranks: int) -> list:
    """The plugins whose collective runs on `nranks` ranks (hypercube: powers of two)."""
    from commref.bench import plugins

    return [(n, p) for n, p in plugins.PLUGINS.items() if not (p.spec.rank_refusal and p.spec.rank_refusal(nranks))]


if __name__ == "__main__":
    _mpi_main()
    sys.exit(0)


# ---------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------

import pytest  # noqa: E402
from conftest import run_mpi  # noqa: E402

from commref.bench.arguments import build_parser  # noqa: E402

torch = pytest.importorskip("torch", reason="the gloo baseline needs torch (the test extra installs it)")


@pytest.mark.parametrize("nranks", [2, 3])
def test_every_collective_of_the_gloo_baseline_is_exact(nranks):
    proc = run_mpi(nranks, [__file__], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    want = len(_runnable(nranks)) * 4 * 3
    assert lines == [f"rank {r}: {want} cases, wrong: []" for r in range(nranks)], proc.stdout + proc.stderr


def test_the_bench_takes_gloo_as_its_baseline():
    argv = ["commref", "bench", "all_reduce", "-b", "1K", "-e", "1K", "-n", "2", "-w", "1", "--baseline", "gloo"]
    proc = run_mpi(2, [*argv, "--no-bound"], timeout=240, module=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# Baseline: gloo (torch " in proc.stdout, proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.strip().startswith("1024 ")).split()
    assert row[-7] != "-" and row[-5] != "-", row  # the baseline's time and the ratio: it was timed


def test_baseline_choices():
    p = build_parser()
    assert p.parse_args(["all_reduce"]).baseline == "auto"
    assert p.parse_args(["all_reduce", "--no-baseline"]).baseline == "none"
    assert p.parse_args(["all_reduce", "--baseline", "gloo"]).baseline == "gloo"
    with pytest.raises(SystemExit):
        p.parse_args(["all_reduce", "--baseline", "ucc"])
