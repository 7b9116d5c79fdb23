"""Tests of the worlds (transports/world.py, thread_world.py in-process, mpi_world.py under
mpiexec), their deadlines (deadlines.py), CPU binding (cpu_binding.py) and
commref.transports.errors."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from commref.transports.cpu_binding import CPU_BIND_ENV, CpuBinding, cpu_share, default_cpu_binding
from commref.transports.deadlines import TIMEOUT_ENV, default_timeout
from commref.transports.errors import CapabilityError, CommAborted, CommMismatch, CommrefError, CommTimeout
from commref.transports.mpi_world import MPIWorld, world_from_env
from commref.transports.thread_world import ThreadWorld
from commref.transports.world import World

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI_SCRIPT = os.path.join(REPO, "tests", "mpi_world_script.py")


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------


def test_error_hierarchy() -> None:
    for cls in (CommTimeout, CommAborted, CommMismatch, CapabilityError):
        assert issubclass(cls, CommrefError)
    assert issubclass(CommrefError, Exception)


def test_comm_timeout_message_and_fields() -> None:
    exc = CommTimeout.after(5.0, rank=2, peer=3, what="signal 7", expected=4, seen=3)
    assert str(exc) == "rank 2: timed out after 5.0 s waiting for peer 3: signal 7 (expected 4, seen 3)"
    assert (exc.rank, exc.peer, exc.what, exc.expected, exc.seen) == (2, 3, "signal 7", 4, 3)
    assert exc.peers == [3]
    many = CommTimeout.after(0.5, rank=0, peer=[1, 3], what="barrier")
    assert "waiting for peers [1, 3]" in str(many) and many.peers == [1, 3]
    plain = CommTimeout("custom", rank=1)
    assert str(plain) == "custom" and plain.peer is None and plain.peers == []


def test_errors_pickle_round_trip() -> None:
    errors: list[CommrefError] = [
        CommTimeout.after(1.0, rank=1, peer=[0], what="x", expected=2, seen=1),
        CommAborted("gone", rank=1, origin_rank=0, reason="ValueError: boom"),
        CommMismatch.between(rank=0, peer=1, field="count", mine=4, theirs=5, what="allreduce"),
        CapabilityError("no backend offers strong signals"),
    ]
    for exc in errors:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc)
        assert vars(back) == vars(exc)


# ---------------------------------------------------------------------------------------
# ThreadWorld: results
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("nranks", range(1, 9))
def test_thread_world_collectives(nranks: int) -> None:
    def body(world: World) -> dict[str, Any]:
        assert world.kind == "thread"
        assert (world.size, world.local_rank, world.local_size) == (nranks, world.rank, nranks)
        gathered = world.allgather(world.rank * 10)
        roots = [world.bcast(f"from {root}" if world.rank == root else None, root=root) for root in range(nranks)]
        for i in range(3):
            world.barrier(what=f"b{i}")
        again = world.allgather((world.rank, world.host))
        return {"gathered": gathered, "roots": roots, "again": again}

    results = ThreadWorld.run(nranks, body, timeout=10)
    assert len(results) == nranks
    for res in results:
        assert res["gathered"] == [r * 10 for r in range(nranks)]
        assert res["roots"] == [f"from {r}" for r in range(nranks)]
        assert [r for r, _ in res["again"]] == list(range(nranks))


def test_thread_world_args_and_results_by_rank() -> None:
    def body(world: World, base: int, *, scale: int) -> int:
        world.barrier()
        return base + scale * world.rank

    assert ThreadWorld.run(4, body, 100, scale=3, timeout=5) == [100, 103, 106, 109]


def test_thread_world_allgather_list_is_private() -> None:
    def body(world: World) -> list[int]:
        got = world.allgather(world.rank)
        got.append(-1)  # must not leak into other ranks' lists
        world.barrier()
        return got

    for got in ThreadWorld.run(3, body, timeout=5):
        assert got == [0, 1, 2, -1]


def test_thread_world_barrier_waits_for_late_rank() -> None:
    def body(world: World) -> float:
        if world.rank == 1:
            time.sleep(0.2)
        world.barrier(what="late")
        return time.monotonic()

    start = time.monotonic()
    exits = ThreadWorld.run(3, body, timeout=5)
    assert min(exits) - start >= 0.2


def test_thread_world_single() -> None:
    world = ThreadWorld.single(timeout=1)
    assert (world.rank, world.size, world.local_size) == (0, 1, 1)
    world.barrier()
    assert world.allgather("a") == ["a"]
    assert world.bcast("b") == "b"
    world.check_aborted()
    assert world.abort_word.dtype == np.uint64 and world.abort_word.shape == (1,)
    with pytest.raises(ValueError):
        world.bcast("b", root=1)


def test_thread_world_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ThreadWorld.run(0, lambda w: None)
    with pytest.raises(ValueError):
        ThreadWorld.run(1, lambda w: None, timeout=0)
    with pytest.raises(ValueError):
        ThreadWorld.single().barrier(timeout=-1)


# ---------------------------------------------------------------------------------------
# ThreadWorld: failures
# ---------------------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


def test_failing_rank_aborts_others_and_run_reraises_original() -> None:
    seen: dict[int, BaseException] = {}
    words: dict[int, np.ndarray] = {}

    def body(world: World) -> None:
        words[world.rank] = world.abort_word
        world.barrier(what="setup")
        if world.rank == 2:
            time.sleep(0.05)  # let the others block first
            raise Boom("rank 2 exploded")
        try:
            world.barrier(what="never completes")
        except CommAborted as exc:
            seen[world.rank] = exc
            raise

    start = time.monotonic()
    with pytest.raises(Boom, match="rank 2 exploded") as info:
        ThreadWorld.run(4, body, timeout=30)
    elapsed = time.monotonic() - start
    assert elapsed < 5, f"bystanders took {elapsed:.1f} s to abort (timeout 30 s)"
    assert sorted(seen) == [0, 1, 3]
    for rank, exc in seen.items():
        assert exc.rank == rank and exc.origin_rank == 2 and "Boom" in exc.reason
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "rank 2 failed first" in notes and "rank 0: CommAborted" in notes
    # One abort word shared by all ranks, raised on failure.
    assert len({id(w) for w in words.values()}) == 1
    assert words[0][0] == 1


def test_root_cause_preferred_over_later_aborted() -> None:
    def body(world: World) -> None:
        if world.rank == 0:
            raise KeyError("root cause")
        world.check_aborted()  # may or may not see the failure yet
        world.barrier()  # raises CommAborted

    with pytest.raises(KeyError, match="root cause"):
        ThreadWorld.run(3, body, timeout=10)


def test_thread_world_abort_call() -> None:
    def body(world: World) -> None:
        if world.rank == 1:
            world.abort("injected", code=3)
        world.barrier()

    with pytest.raises(CommAborted) as info:
        ThreadWorld.run(3, body, timeout=10)
    exc = info.value
    assert exc.rank == 1 and exc.origin_rank == 1 and exc.reason == "injected"
    assert "rank 1: aborting: injected" in str(exc)


def test_check_aborted_sees_abort_word() -> None:
    world = ThreadWorld.single(timeout=1)
    world.check_aborted()
    world.abort_word[0] = 1  # e.g. raised by device code
    with pytest.raises(CommAborted):
        world.check_aborted()
    with pytest.raises(CommAborted):
        world.barrier()


def test_barrier_deadline_names_missing_rank() -> None:
    timeout = 0.5

    def body(world: World) -> Any:
        world.barrier(what="setup")
        if world.rank == 2:
            time.sleep(timeout * 2)  # never joins
            return None
        start = time.monotonic()
        try:
            world.barrier(what="deadline test", timeout=timeout)
        except CommTimeout as exc:
            return exc, time.monotonic() - start
        return None

    results = ThreadWorld.run(4, body, timeout=10)
    assert results[2] is None
    for rank in (0, 1, 3):
        exc, waited = results[rank]
        assert exc.rank == rank and exc.peer == [2] and exc.peers == [2]
        assert (exc.expected, exc.seen) == (4, 3)
        assert "deadline test" in exc.what
        assert f"rank {rank}:" in str(exc) and "waiting for peer 2" in str(exc)
        assert timeout * 0.9 <= waited < timeout + 1.0


def test_uncaught_timeout_is_root_cause() -> None:
    def body(world: World) -> None:
        if world.rank == 0:
            time.sleep(1.0)
            return
        world.barrier(what="rank 0 missing", timeout=0.2)

    start = time.monotonic()
    with pytest.raises(CommTimeout) as info:
        ThreadWorld.run(3, body, timeout=10)
    assert time.monotonic() - start < 5
    assert info.value.peers == [0]


def test_mismatched_collectives() -> None:
    def body(world: World) -> None:
        world.bcast("x", root=0 if world.rank == 0 else 1, what="bcast")

    with pytest.raises(CommMismatch) as info:
        ThreadWorld.run(3, body, timeout=5)
    assert info.value.field == "collective"
    assert {info.value.mine, info.value.theirs} == {"bcast(root=0)", "bcast(root=1)"}


def test_run_never_hangs_on_stuck_rank() -> None:
    release = threading.Event()

    def body(world: World) -> None:
        if world.rank == 1:
            release.wait(30)  # stuck outside the control plane
        return None

    start = time.monotonic()
    try:
        with pytest.raises(CommTimeout) as info:
            ThreadWorld.run(2, body, timeout=0.2)  # watchdog: 2 * 0.2 + 1 s
    finally:
        release.set()
    assert time.monotonic() - start < 5
    assert info.value.rank is None and info.value.peers == [1]


# ---------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------


def test_default_timeout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert default_timeout() == 60.0
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert default_timeout() == 2.5
    assert ThreadWorld.single().timeout == 2.5
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=TIMEOUT_ENV):
        default_timeout()


def _clear_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_", "MV2_")):
            monkeypatch.delenv(name)


def test_launched_under_mpi_env(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_launcher_env(monkeypatch)
    assert not MPIWorld.launched_under_mpi()
    world = world_from_env(timeout=3)
    assert isinstance(world, ThreadWorld) and world.size == 1 and world.timeout == 3
    for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALRANKID"):
        monkeypatch.setenv(name, "0")
        assert MPIWorld.launched_under_mpi()
        monkeypatch.delenv(name)
    # mpiexec's own configuration, set where a job is started (hosts in other namespaces, say)
    monkeypatch.setenv("HYDRA_HOST_FILE", "/tmp/hosts")
    monkeypatch.setenv("HYDRA_LAUNCHER", "ssh")
    assert not MPIWorld.launched_under_mpi()


def test_launched_under_mpi_does_not_import_mpi() -> None:
    code = (
        "import sys; from commref.transports.mpi_world import MPIWorld; MPIWorld.launched_under_mpi(); "
        "assert 'mpi4py.MPI' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# ---------------------------------------------------------------------------------------
# MPIWorld under mpiexec
# ---------------------------------------------------------------------------------------


def _mpiexec() -> str | None:
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])


def _launch(
    mode: str, *extra: str, nranks: int = 3, launcher: tuple[str, ...] = (), env_extra: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("mpiexec not found")
    env = dict(os.environ)
    env.pop(TIMEOUT_ENV, None)
    env.pop(CPU_BIND_ENV, None)
    env.update(env_extra or {})
    start = time.monotonic()
    proc = subprocess.run(
        [mpiexec, "-n", str(nranks), *launcher, sys.executable, "-m", "mpi4py", MPI_SCRIPT, mode, *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, time.monotonic() - start


def test_mpi_world_basic(shm_leak_check) -> None:
    proc, _ = _launch("basic")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK basic" in proc.stdout
    assert '"local_ranks": [0, 1, 2]' in proc.stdout


def _cpus(proc: subprocess.CompletedProcess[str]) -> list[dict]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.split("OK cpus ", 1)[1].splitlines()[0])


def test_mpi_world_binds_ranks_to_cpu_shares(shm_leak_check) -> None:
    """auto: each rank's every thread (started before the world, the main one, one
    started after) on its own share of the CPUs, the shares together all of them."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs")
    ranks = _cpus(_launch("cpus", nranks=2)[0])
    shares = [cpu_share(r, 2, allowed) for r in range(2)]
    assert [r["cpus"] for r in ranks] == [sorted(s) for s in shares], ranks
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(allowed)
    for r in ranks:
        assert r["early"] == r["main"] == r["late"] == r["cpus"], ranks


def test_mpi_world_binds_more_ranks_than_cpus_round_robin(shm_leak_check) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    nranks = len(allowed) + 1
    if nranks > 8:
        pytest.skip("more CPUs than ranks this test starts")
    ranks = _cpus(_launch("cpus", nranks=nranks)[0])
    assert [r["cpus"] for r in ranks] == [[allowed[r % len(allowed)]] for r in range(nranks)], ranks
    for r in ranks:
        assert r["early"] == r["main"] == r["late"] == r["cpus"], ranks


@pytest.mark.parametrize("how", ["none", "launcher bound"])
def test_mpi_world_leaves_cpus_alone(how: str, shm_leak_check) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if how == "none":
        proc, _ = _launch("cpus", nranks=2, env_extra={CPU_BIND_ENV: "none"})
        expected = [allowed, allowed]
    else:
        if len(allowed) < 2:
            pytest.skip("needs 2 CPUs")
        proc, _ = _launch("cpus", nranks=2, launcher=("-bind-to", "core"), env_extra={CPU_BIND_ENV: "auto"})
        expected = None
    ranks = _cpus(proc)
    if expected is not None:
        assert [r["cpus"] for r in ranks] == expected, ranks
    else:  # whatever the launcher gave, as it gave it (each rank one core, which differ)
        assert ranks[0]["cpus"] != ranks[1]["cpus"], ranks
    for r in ranks:
        assert r["early"] == r["main"] == r["late"] == r["cpus"], ranks


def test_cpu_share_and_binding_option(monkeypatch: pytest.MonkeyPatch) -> None:
    def own_core(cpu):  # one CPU per core
        return 0, cpu

    def smt(cpu):  # 4 cores of 2 hyperthreads numbered as Linux does on x86: cpu i and i + 4 share one
        return 0, cpu % 4

    def two(cpu):  # two packages of 4 cores
        return cpu // 4, cpu % 4

    assert [sorted(cpu_share(r, 3, range(8), own_core)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert cpu_share(1, 2, {5, 9}, own_core) == {9}
    assert [cpu_share(r, 5, {0, 1}, own_core) for r in range(5)] == [{0}, {1}, {0}, {1}, {0}]
    assert [cpu_share(r, 2, range(8), smt) for r in range(2)] == [{0, 4, 1, 5}, {2, 6, 3, 7}]
    assert [cpu_share(r, 3, range(8), smt) for r in range(3)] == [{0, 4, 1, 5}, {2, 6}, {3, 7}]
    assert [cpu_share(r, 5, range(8), smt) for r in range(5)] == [{0, 4}, {1, 5}, {2, 6}, {3}, {7}]
    assert [cpu_share(r, 9, range(8), smt) for r in range(9)][7:] == [{7}, {0}]
    # a rank's share stays inside one package while the ranks divide the packages evenly
    assert [cpu_share(r, 2, range(8), two) for r in range(2)] == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    monkeypatch.delenv(CPU_BIND_ENV, raising=False)
    assert default_cpu_binding() is CpuBinding.AUTO
    monkeypatch.setenv(CPU_BIND_ENV, "none")
    assert default_cpu_binding() is CpuBinding.NONE
    monkeypatch.setenv(CPU_BIND_ENV, "cores")
    with pytest.raises(ValueError, match=f"{CPU_BIND_ENV} must be one of auto, none, not 'cores'"):
        default_cpu_binding()


def test_mpi_world_deadline_names_missing_rank(shm_leak_check) -> None:
    proc, elapsed = _launch("deadline", "1.0")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert elapsed < 60, f"job took {elapsed:.1f} s to end"
    assert "CommTimeout" in proc.stderr, proc.stderr
    assert "waiting for peer 2: deadline test" in proc.stderr, proc.stderr


def test_mpi_world_abort(shm_leak_check) -> None:
    proc, elapsed = _launch("abort")
    assert proc.returncode != 0
    assert elapsed < 60
    assert "commref: rank 1 aborting: injected failure" in proc.stderr, proc.stderr


def test_mpi_world_mismatch(shm_leak_check) -> None:
    proc, _ = _launch("mismatch")
    assert proc.returncode != 0
    assert "CommMismatch" in proc.stderr and "collective mismatch" in proc.stderr, proc.stderr
