"""The World of one rank per process, over mpi4py (see world.py for the contracts), and
world_from_env: that world when an MPI launcher started this process, else a one-rank
ThreadWorld."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import numpy as np

from .cpu_binding import CpuBinding, allowed_cpus, bind_process, cpu_share, default_cpu_binding
from .errors import CommAborted, CommMismatch, CommTimeout
from .nodes import node_of
from .option_types import choice
from .thread_world import ThreadWorld
from .world import OP_ALLGATHER, OP_BARRIER, OP_BCAST, World, describe_op

if TYPE_CHECKING:  # pragma: no cover - typing only; never initializes MPI
    from mpi4py import MPI as _MPI

__all__ = ["MPIWorld", "world_from_env"]

# Environment variables set by MPI launchers (Hydra/MPICH, PMIx, Open MPI, MVAPICH).
_MPI_LAUNCHER_VARS = (
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_RANK",
)
# Not HYDRA_*: those configure MPICH's mpiexec (HYDRA_HOST_FILE, HYDRA_LAUNCHER, ...) in
# the shell that starts a job; a rank it starts has PMI_RANK and its kin.


class _Backoff:
    """Polling pause: ``sleep(0)`` for the first millisecond, then 50..200 us."""

    __slots__ = ("_spin_until", "_sleep_s")

    def __init__(self) -> None:
        self._spin_until = time.monotonic() + 1e-3
        self._sleep_s = 50e-6

    def pause(self) -> None:
        if time.monotonic() < self._spin_until:
            time.sleep(0)
            return
        time.sleep(self._sleep_s)
        self._sleep_s = min(self._sleep_s * 2, 200e-6)


class MPIWorld(World):
    """One rank per process over mpi4py.

    ``comm`` (default ``MPI.COMM_WORLD``) is duplicated; the world's own traffic
    runs on the private duplicate, so it never matches user messages. Other
    layers that need MPI traffic should ``Dup()`` :attr:`comm` themselves.

    ``barrier`` is deadline-bounded: each rank posts a nonblocking token send to
    and receive from every other rank (tag = a per-world epoch counter, so
    successive barriers never mix) and polls until all complete or the deadline
    passes. On timeout the ranks whose token has not arrived are the missing
    peers. ``allgather`` / ``bcast`` first run that barrier (so every rank is
    known to be present) and then use ``comm.allgather`` / ``comm.bcast``
    (pickled objects).

    ``abort`` prints ``commref: rank R aborting: <message>`` to stderr and calls
    ``MPI_Abort``, which ends every process of the job. The abort word is this
    process's own: ``mark_failed`` raises it, after which this rank's barriers (and
    ``check_aborted``) raise CommAborted at once, without waiting for peers; the
    peers learn of the failure when the job is aborted (the exception reaching
    ``python -m mpi4py``, or the launcher ending the job of a rank that died).
    """

    kind: ClassVar[str] = "mpi"

    def __init__(
        self,
        comm: _MPI.Comm | None = None,
        *,
        timeout: float | None = None,
        node: str | None = None,
        abort_word: np.ndarray | None = None,
        cpu_binding: CpuBinding | str | None = None,
    ) -> None:
        """`node` and `abort_word` (default: node_of and a fresh word) are a split's,
        inherited from its parent. `cpu_binding` (default ``$COMMREF_CPU_BIND``, else
        auto) applies to the world on MPI.COMM_WORLD, whose ranks are the processes
        (allowed_cpus then says where this one runs)."""
        from mpi4py import MPI

        binding = default_cpu_binding() if cpu_binding is None else choice(CpuBinding, cpu_binding, "cpu_binding")
        self._MPI = MPI
        self._parent: _MPI.Comm = MPI.COMM_WORLD if comm is None else comm
        self._comm: _MPI.Comm = self._parent.Dup()
        rank = self._comm.Get_rank()
        shared = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        try:
            local_rank, local_size = shared.Get_rank(), shared.Get_size()
            if comm is None and binding is CpuBinding.AUTO:
                masks = shared.allgather(allowed_cpus())
                if local_size > 1 and len(set(masks)) == 1:
                    bind_process(cpu_share(local_rank, local_size, masks[0]))
        finally:
            shared.Free()
        tag_ub = self._comm.Get_attr(MPI.TAG_UB)
        self._tag_ub: int = int(tag_ub) if tag_ub else 32767
        self._epoch = 0
        self._lock = threading.Lock()
        # Buffers of sends we had to give up on after a timeout; MPI may still read them.
        self._orphans: list[np.ndarray] = []
        host, size = MPI.Get_processor_name(), self._comm.Get_size()
        super().__init__(
            rank=rank,
            size=size,
            local_rank=local_rank,
            local_size=local_size,
            host=host,
            abort_word=np.zeros(1, dtype=np.uint64) if abort_word is None else abort_word,
            timeout=timeout,
            node=node_of(host, rank, size) if node is None else node,
        )
        self._split_comm: _MPI.Comm | None = None  # the communicator split() made, freed by free()
        self._failure: str | None = None  # mark_failed's reason

    @staticmethod
    def launched_under_mpi() -> bool:
        """True when an MPI launcher's environment variables are present.

        Looks only at the environment; does not import or initialize MPI.
        """
        env = os.environ
        return any(name in env for name in _MPI_LAUNCHER_VARS)

    @property
    def comm(self) -> _MPI.Comm:
        """The communicator this world was built from (not its private duplicate)."""
        return self._parent

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        with self._lock:
            self._sync(OP_BARRIER, -1, what, self._seconds(timeout))

    def allgather(self, obj: Any, what: str = "allgather", timeout: float | None = None) -> list[Any]:
        with self._lock:
            self._sync(OP_ALLGATHER, -1, what, self._seconds(timeout))
            return self._comm.allgather(obj)

    def bcast(self, obj: Any, root: int = 0, what: str = "bcast", timeout: float | None = None) -> Any:
        root = self._check_root(root)
        with self._lock:
            self._sync(OP_BCAST, root, what, self._seconds(timeout))
            return self._comm.bcast(obj, root=root)

    def abort(self, message: str, code: int = 1) -> NoReturn:
        self.abort_word[0] = 1
        sys.stdout.flush()
        print(f"commref: rank {self.rank} aborting: {message}", file=sys.stderr, flush=True)
        self._comm.Abort(code)
        raise SystemExit(code)  # MPI_Abort does not return; this is for type checkers

    def check_aborted(self) -> None:
        if self.aborting:
            raise self._aborted_error("check_aborted")

    def mark_failed(self, reason: str) -> None:
        self.abort_word[0] = 1
        self._failure = self._failure or reason

    def _aborted_error(self, what: str) -> CommAborted:
        reason = self._failure or "abort word set"
        return CommAborted(
            f"rank {self.rank}: {what}: aborted because this rank is failing: {reason}",
            rank=self.rank,
            origin_rank=self.rank if self._failure else None,
            reason=reason,
        )

    def _split(self, colors: list[int | None], members: list[int], what: str) -> MPIWorld | None:
        # Every rank is known present (split's allgather), so MPI_Comm_split returns.
        if not members:
            self._comm.Split(self._MPI.UNDEFINED, 0)  # MPI_COMM_NULL
            return None
        sub = self._comm.Split(colors[self.rank], members.index(self.rank))
        world = MPIWorld(sub, timeout=self.timeout, node=self.node, abort_word=self.abort_word)
        world._split_comm = sub
        return world

    def free(self) -> None:
        if self._split_comm is not None:
            self._comm.Free()
            self._split_comm.Free()
            self._split_comm = None

    def _sync(self, op: int, root: int, what: str, seconds: float) -> None:
        """Deadline-bounded all-to-all token exchange (the barrier). Raises CommAborted
        at once when this process's abort word is (or becomes) set."""
        MPI = self._MPI
        if self.aborting:
            raise self._aborted_error(what)
        deadline = time.monotonic() + seconds
        self._epoch += 1
        tag = self._epoch % self._tag_ub
        peers = [p for p in range(self.size) if p != self.rank]
        token = np.array([self._epoch, op, root], dtype=np.int64)
        inbox = np.zeros((self.size, 3), dtype=np.int64)
        recvs = [self._comm.Irecv(inbox[p], source=p, tag=tag) for p in peers]
        sends = [self._comm.Isend(token, dest=p, tag=tag) for p in peers]
        backoff = _Backoff()
        while True:
            if recvs:
                MPI.Request.Testsome(recvs)  # completed requests become REQUEST_NULL (falsy)
            if not any(recvs) and MPI.Request.Testall(sends):
                break
            if time.monotonic() >= deadline:
                self._give_up(peers, recvs, sends, token, inbox, what, seconds)
            if self.aborting:
                self._abandon(recvs, sends, token)
                raise self._aborted_error(what)
            backoff.pause()
        mine = (op, root)
        for p in peers:
            theirs = (int(inbox[p, 1]), int(inbox[p, 2]))
            if theirs != mine:
                raise CommMismatch.between(
                    rank=self.rank,
                    peer=p,
                    field="collective",
                    what=what,
                    mine=describe_op(*mine),
                    theirs=describe_op(*theirs),
                )

    def _abandon(self, recvs: list[_MPI.Request], sends: list[_MPI.Request], token: np.ndarray) -> None:
        """Gives up a barrier's requests: receives cancelled, sends freed (they may still
        complete, so their buffer is kept alive)."""
        for req in recvs:
            if req:
                req.Cancel()
                req.Wait()
        pending_sends = False
        for req in sends:
            if req:
                req.Free()
                pending_sends = True
        if pending_sends:
            self._orphans.append(token)

    def _give_up(
        self,
        peers: list[int],
        recvs: list[_MPI.Request],
        sends: list[_MPI.Request],
        token: np.ndarray,
        inbox: np.ndarray,
        what: str,
        seconds: float,
    ) -> NoReturn:
        missing = [p for p, req in zip(peers, recvs) if req]
        detail = f"{what}: ranks at the barrier"
        if not missing:  # every token arrived but ours were not delivered
            missing = [p for p, req in zip(peers, sends) if req]
            detail = f"{what}: barrier token delivery"
        self._abandon(recvs, sends, token)
        arrived = self.size - len(missing)
        raise CommTimeout.after(seconds, rank=self.rank, peer=missing, what=detail, expected=self.size, seen=arrived)


def world_from_env(timeout: float | None = None) -> World:
    """An :class:`MPIWorld` when launched by an MPI launcher, else ``ThreadWorld.single()``."""
    if MPIWorld.launched_under_mpi():
        return MPIWorld(timeout=timeout)
    return ThreadWorld.single(timeout=timeout)
