"""Bootstrap and control plane: who the ranks are, barrier, small-object exchange, abort.

One interface, :class:`World`, two implementations:

* :class:`MPIWorld` -- mpi4py, one rank per process (the distributed engine).
* :class:`ThreadWorld` -- N ranks as threads of one process (fast tests,
  ThreadSanitizer, several ranks on one GPU).

Contracts shared by both:

* **Every wait has a deadline.** ``barrier`` / ``allgather`` / ``bcast`` take a
  ``timeout`` in seconds (default ``world.timeout``, from ``$COMMREF_TIMEOUT``,
  60 s when unset). When it passes, the call raises
  :class:`~commref.transports.errors.CommTimeout` naming this rank, the peers that have
  not arrived, what was being waited for, and expected vs seen rank counts.
* **Collective calls.** Every rank must make the same sequence of control-plane
  calls (same operation, same ``root``), one call at a time per rank (the
  control plane is not meant to be driven by several threads of one rank at
  once). A call whose operation or root differs from a peer's raises
  :class:`~commref.transports.errors.CommMismatch` on the ranks that detect it.
* **Abort.** ``abort_word`` is a ``numpy.uint64`` array of shape ``(1,)``,
  alive as long as the world, whose address device kernels and proxies poll;
  nonzero means the job is aborting. ``abort`` sets it to 1 before anything
  else. ``mark_failed`` sets it without ending anything (a rank leaving its
  collectives because of an exception, which then goes on propagating); once it
  is set, every control-plane wait of this rank raises CommAborted at once
  instead of waiting for peers that may never come.
* ``allgather`` / ``bcast`` are for small Python objects (setup metadata), not
  for data-plane traffic.
"""

from __future__ import annotations

import abc
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, ClassVar, NoReturn, TypeVar

import numpy as np

from .errors import CommAborted, CommMismatch, CommTimeout
from .options import Choice, choice

if TYPE_CHECKING:  # pragma: no cover - typing only; never initializes MPI
    from mpi4py import MPI as _MPI

__all__ = [
    "TIMEOUT_ENV",
    "CPU_BIND_ENV",
    "CpuBinding",
    "allowed_cpus",
    "cpu_share",
    "default_cpu_binding",
    "default_timeout",
    "World",
    "MPIWorld",
    "ThreadWorld",
    "world_from_env",
]

T = TypeVar("T")

TIMEOUT_ENV = "COMMREF_TIMEOUT"
"""Environment variable holding the default deadline (seconds) of every wait."""

_DEFAULT_TIMEOUT_S = "60"

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
_MPI_LAUNCHER_PREFIXES = ("HYDRA_",)

# Control-plane operation codes, compared across ranks to detect mismatched calls.
_OP_BARRIER = 0
_OP_ALLGATHER = 1
_OP_BCAST = 2
_OP_NAMES = {_OP_BARRIER: "barrier", _OP_ALLGATHER: "allgather", _OP_BCAST: "bcast"}

# How often a ThreadWorld waiter re-checks the shared abort word (seconds).
_ABORT_POLL_S = 0.05


def default_timeout() -> float:
    """The default deadline in seconds: ``float($COMMREF_TIMEOUT)``, 60 when unset.

    Raises ValueError if the variable is not a positive number.
    """
    raw = os.environ.get(TIMEOUT_ENV, _DEFAULT_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive, finite number of seconds")
    return seconds


CPU_BIND_ENV = "COMMREF_CPU_BIND"
"""Environment variable holding how an MPI rank is placed on its host's CPUs (CpuBinding)."""


class CpuBinding(Choice):
    """How an MPIWorld places its process on the host's CPUs (``$COMMREF_CPU_BIND``).

    auto: when every rank of the host may run on the same CPUs (the launcher bound
    nothing, as MPICH's mpiexec by default), each rank takes its share of them
    (cpu_share) for every thread of its process and the threads it starts later (the
    CPU engine's kernel workers, the GIN engine). A rank's kernel and its proxy then
    hand their CPUs to each other instead of the scheduler moving every busy thread of
    the host over every core: at 2 ranks on 2 cores GIN runs were 2-5x slower in one
    of four unbound, and at 4 ranks on 2 cores the multi-node bench (MPI's Allreduce
    too) took 2.5-4x longer (docs/performance.md, "Binding ranks to CPUs"). Launcher
    binding (``mpiexec -bind-to core``, Open MPI's default) is kept as it is.
    none: placement is left to the launcher and the OS.
    """

    AUTO = "auto"
    NONE = "none"


def default_cpu_binding() -> CpuBinding:
    return choice(CpuBinding, os.environ.get(CPU_BIND_ENV, CpuBinding.AUTO.value), CPU_BIND_ENV)


def core_of(cpu: int) -> tuple[int, int]:
    """(package, core) of a CPU from sysfs; (0, cpu) where Linux does not say."""
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
            return int(package.read()), int(core.read())
    except (OSError, ValueError):
        return 0, cpu


def _equal_parts(items: list, local_rank: int, local_size: int) -> list:
    """Local rank `local_rank`'s part of `items`: consecutive equal parts, the remainder
    to the first ranks."""
    base, extra = divmod(len(items), local_size)
    start = local_rank * base + min(local_rank, extra)
    return items[start:start + base + (local_rank < extra)]


def cpu_share(local_rank: int, local_size: int, cpus, core=core_of) -> frozenset[int]:
    """Local rank `local_rank`'s share of `cpus` (shared by `local_size` ranks), as
    ``mpiexec -bind-to core`` places them: whole cores (the hyperthreads of one core,
    `core` gives a CPU's (package, core)) in equal consecutive parts while there are at
    least as many cores as ranks; else the CPUs in equal parts, a core's hyperthreads
    side by side; with fewer CPUs than ranks, one CPU each, round robin."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(cpus):
        cores.setdefault(core(cpu), []).append(cpu)
    groups = [cores[k] for k in sorted(cores)]
    if len(groups) >= local_size:
        return frozenset(cpu for group in _equal_parts(groups, local_rank, local_size) for cpu in group)
    ordered = [cpu for group in groups for cpu in group]
    if len(ordered) >= local_size:
        return frozenset(_equal_parts(ordered, local_rank, local_size))
    return frozenset([ordered[local_rank % len(ordered)]])


def allowed_cpus() -> frozenset[int]:
    """The CPUs the calling thread may run on (every CPU where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def _bind_process(cpus: frozenset[int]) -> None:
    """Every thread of this process onto `cpus` (threads started later inherit it);
    nothing where the OS has no per-thread affinity (Linux has)."""
    if not (hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


HOSTID_ENV = "COMMREF_HOSTID"
NODES_ENV = "COMMREF_NODES"


def check_nodes(value, nranks: int) -> int:
    """`value` (the --nodes option, or COMMREF_NODES) as a node count from 1 to `nranks`;
    else ValueError with one line."""
    try:
        n = int(str(value).strip())
    except ValueError:
        n = 0
    if not 1 <= n <= nranks:
        raise ValueError(f"{NODES_ENV} (--nodes) must be an integer from 1 to the number of ranks ({nranks}), "
                         f"not {value!r}")
    return n


def node_of(host: str, rank: int, size: int, environ=None) -> str:
    """This rank's node identity: what decides which ranks share a node (its LSA team).
    COMMREF_HOSTID when set (as NCCL_HOSTID overrides NCCL's host identity); else, with
    COMMREF_NODES=N, the job's ranks split into N simulated nodes of consecutive ranks on
    this host (rank r on node r * N // size: 5 ranks on 2 nodes are 3 + 2); else the host
    name. A bad COMMREF_NODES raises ValueError (one line)."""
    env = os.environ if environ is None else environ
    hostid = env.get(HOSTID_ENV, "").strip()
    if hostid:
        return hostid
    nodes = env.get(NODES_ENV, "").strip()
    if nodes:
        return f"{host}/node{rank * check_nodes(nodes, size) // size}"
    return host


def _check_timeout(timeout: float) -> float:
    seconds = float(timeout)
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    return seconds


def _describe_op(op: int, root: int) -> str:
    name = _OP_NAMES.get(op, f"op{op}")
    return f"{name}(root={root})" if op == _OP_BCAST else name


def _summary(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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


class World(abc.ABC):
    """The control plane of one rank.

    Attributes:
        rank, size: this rank and the number of ranks.
        local_rank, local_size: this rank among the ranks on its host, and how many.
        host: host name (the machine: what shared memory and CUDA IPC can reach).
        node: node identity (node_of: the host, unless overridden or simulated); the
            ranks of one node are an LSA team.
        members: each rank's rank in the world this one was split from (split);
            ``range(size)`` for a world that is no split.
        kind: ``"mpi"`` or ``"thread"``.
        timeout: default deadline of every wait, in seconds.
        abort_word: ``uint64[1]``; nonzero means the job is aborting. Kept alive
            for the world's lifetime, so its address (``abort_word.ctypes.data``)
            may be handed to device code.
    """

    kind: ClassVar[str]

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        local_rank: int,
        local_size: int,
        host: str,
        abort_word: np.ndarray,
        timeout: float | None = None,
        node: str | None = None,
    ) -> None:
        if abort_word.dtype != np.uint64 or abort_word.shape != (1,):
            raise ValueError("abort_word must be a numpy uint64 array of shape (1,)")
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.local_size = local_size
        self.host = host
        self.node = host if node is None else node
        self.abort_word = abort_word
        self.timeout = default_timeout() if timeout is None else _check_timeout(timeout)
        self.members: list[int] = list(range(size))

    # -- helpers -------------------------------------------------------------------

    def _seconds(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else _check_timeout(timeout)

    def _check_root(self, root: int) -> int:
        if not isinstance(root, (int, np.integer)) or isinstance(root, bool):
            raise TypeError(f"root must be an int, got {type(root).__name__}")
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} out of range for a world of {self.size} ranks")
        return int(root)

    @property
    def aborting(self) -> bool:
        """True once the abort word is nonzero."""
        return bool(self.abort_word[0] != 0)

    @property
    def abort_word_address(self) -> int:
        """Address of the abort word, for device code to poll."""
        return int(self.abort_word.ctypes.data)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, size={self.size}, "
            f"local_rank={self.local_rank}, local_size={self.local_size}, host={self.host!r}, node={self.node!r})"
        )

    # -- the interface ------------------------------------------------------------------

    @abc.abstractmethod
    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        """Return once every rank has entered this barrier.

        Raises CommTimeout (naming the ranks that have not arrived) when the
        deadline passes first, CommAborted if the job is aborting, CommMismatch
        if a peer is in a different control-plane operation.
        """

    @abc.abstractmethod
    def allgather(self, obj: Any, what: str = "allgather", timeout: float | None = None) -> list[Any]:
        """Return every rank's ``obj``, indexed by rank. Same errors as ``barrier``."""

    @abc.abstractmethod
    def bcast(self, obj: Any, root: int = 0, what: str = "bcast", timeout: float | None = None) -> Any:
        """Return ``root``'s ``obj`` on every rank (other ranks' ``obj`` is ignored).

        Same errors as ``barrier``; every rank must pass the same ``root``.
        """

    @abc.abstractmethod
    def abort(self, message: str, code: int = 1) -> NoReturn:
        """End the job because this rank failed. Sets the abort word to 1 first; never returns."""

    @abc.abstractmethod
    def check_aborted(self) -> None:
        """Raise CommAborted if the job is being torn down (see subclasses)."""

    @abc.abstractmethod
    def mark_failed(self, reason: str) -> None:
        """This rank failed (`reason`, one line) and leaves its collectives: raise the
        abort word so that nobody waits for it until a deadline (its own kernels, its
        proxy, and its control-plane waits stop; ThreadWorld: every rank's). Returns;
        raises nothing. The caller goes on raising its exception, which ends the job
        (ThreadWorld.run re-raises it; under ``python -m mpi4py`` it becomes MPI_Abort)."""

    def split(self, color: int, what: str = "split") -> "World":
        """Collective: the world of the ranks that pass the same `color` (an int), ranked
        in this world's order (MPI_Comm_split with key = rank). Each rank keeps its node
        identity, so a split's LSA teams are the parent's; the split shares the parent's
        abort word and deadline, and `members` lists its ranks by their parent rank.
        Every rank must call it; a rank that does not makes the others fail at the
        deadline, naming it."""
        colors = self.allgather(int(color), what=f"{what}: colors")
        members = [r for r, c in enumerate(colors) if c == colors[self.rank]]
        world = self._split(colors, members, what)
        world.members = members
        return world

    @abc.abstractmethod
    def _split(self, colors: list[int], members: list[int], what: str) -> "World":
        """The split world of this rank (split() has gathered the colors)."""

    def free(self) -> None:
        """Releases what a split world holds of the parent's resources (idempotent);
        the world must not be used afterwards."""


# ======================================================================================
# MPI
# ======================================================================================


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

    def __init__(self, comm: "_MPI.Comm | None" = None, *, timeout: float | None = None,
                 node: str | None = None, abort_word: np.ndarray | None = None,
                 cpu_binding: "CpuBinding | str | None" = None) -> None:
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
                    _bind_process(cpu_share(local_rank, local_size, masks[0]))
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
        self._split_comm: "_MPI.Comm | None" = None  # the communicator split() made, freed by free()
        self._failure: str | None = None  # mark_failed's reason

    @staticmethod
    def launched_under_mpi() -> bool:
        """True when an MPI launcher's environment variables are present.

        Looks only at the environment; does not import or initialize MPI.
        """
        env = os.environ
        if any(name in env for name in _MPI_LAUNCHER_VARS):
            return True
        return any(name.startswith(_MPI_LAUNCHER_PREFIXES) for name in env)

    @property
    def comm(self) -> "_MPI.Comm":
        """The communicator this world was built from (not its private duplicate)."""
        return self._parent

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        with self._lock:
            self._sync(_OP_BARRIER, -1, what, self._seconds(timeout))

    def allgather(self, obj: Any, what: str = "allgather", timeout: float | None = None) -> list[Any]:
        with self._lock:
            self._sync(_OP_ALLGATHER, -1, what, self._seconds(timeout))
            return self._comm.allgather(obj)

    def bcast(self, obj: Any, root: int = 0, what: str = "bcast", timeout: float | None = None) -> Any:
        root = self._check_root(root)
        with self._lock:
            self._sync(_OP_BCAST, root, what, self._seconds(timeout))
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
        return CommAborted(f"rank {self.rank}: {what}: aborted because this rank is failing: {reason}",
                           rank=self.rank, origin_rank=self.rank if self._failure else None, reason=reason)

    def _split(self, colors: list[int], members: list[int], what: str) -> "MPIWorld":
        # Every rank is known present (split's allgather), so MPI_Comm_split returns.
        sub = self._comm.Split(colors[self.rank], self.rank)
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
                    rank=self.rank, peer=p, field="collective", what=what,
                    mine=_describe_op(*mine), theirs=_describe_op(*theirs),
                )

    def _abandon(self, recvs: list["_MPI.Request"], sends: list["_MPI.Request"], token: np.ndarray) -> None:
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
        recvs: list["_MPI.Request"],
        sends: list["_MPI.Request"],
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
        raise CommTimeout.after(
            seconds, rank=self.rank, peer=missing, what=detail, expected=self.size, seen=arrived
        )


# ======================================================================================
# Threads
# ======================================================================================


class _ThreadGroup:
    """State shared by the ranks of one ThreadWorld group (guarded by ``cond``)."""

    def __init__(self, size: int, timeout: float, abort_word: np.ndarray | None = None) -> None:
        self.size = size
        self.timeout = timeout
        self.host = socket.gethostname()
        # A split's group shares its parent's word: a failure anywhere stops both.
        self.abort_word = np.zeros(1, dtype=np.uint64) if abort_word is None else abort_word
        self.cond = threading.Condition()
        # Barrier state for the generation in progress.
        self.generation = 0
        self.arrived: set[int] = set()
        self.payloads: list[Any] = [None] * size
        self.signatures: list[tuple[int, int] | None] = [None] * size
        # Result of the last completed generation.
        self.completed: tuple[list[Any], list[tuple[int, int] | None]] = ([], [])
        # Failure state.
        self.origin_rank: int | None = None
        self.reason: str | None = None
        self.abort_code: int | None = None
        self.fail_time: float | None = None
        self.failures: list[tuple[int, BaseException]] = []
        self.finished: set[int] = set()
        self.last_progress = time.monotonic()

    # Callers hold ``cond`` or accept a racy read (the flags only ever go from clear to set).
    @property
    def failed(self) -> bool:
        return self.reason is not None or bool(self.abort_word[0] != 0)

    def mark_failed(self, origin_rank: int | None, reason: str, code: int | None = None) -> None:
        """Record the first failure, raise the abort word and wake every waiter."""
        with self.cond:
            self.abort_word[0] = 1
            if self.reason is None:
                self.origin_rank = origin_rank
                self.reason = reason
                self.abort_code = code
                self.fail_time = time.monotonic()
            self.cond.notify_all()

    def aborted_error(self, rank: int, what: str) -> CommAborted:
        if self.reason is None:
            cause = "the job is aborting (abort word set)"
        elif self.origin_rank is None:
            cause = f"the job is aborting: {self.reason}"
        else:
            cause = f"rank {self.origin_rank} failed: {self.reason}"
        return CommAborted(
            f"rank {rank}: {what}: aborted because {cause}",
            rank=rank, origin_rank=self.origin_rank, reason=self.reason or "",
        )

    def exchange(self, rank: int, op: int, root: int, payload: Any, what: str, seconds: float) -> list[Any]:
        """Barrier that also gathers one payload per rank; returns the payloads by rank."""
        deadline = time.monotonic() + seconds
        with self.cond:
            if self.failed:
                raise self.aborted_error(rank, what)
            generation = self.generation
            self.arrived.add(rank)
            self.payloads[rank] = payload
            self.signatures[rank] = (op, root)
            self.last_progress = time.monotonic()
            if len(self.arrived) == self.size:
                self.completed = (self.payloads, self.signatures)
                self.generation += 1
                self.arrived = set()
                self.payloads = [None] * self.size
                self.signatures = [None] * self.size
                self.cond.notify_all()
            else:
                while self.generation == generation:
                    if self.failed:
                        raise self.aborted_error(rank, what)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        missing = sorted(set(range(self.size)) - self.arrived)
                        raise CommTimeout.after(
                            seconds, rank=rank, peer=missing, what=f"{what}: ranks at the barrier",
                            expected=self.size, seen=len(self.arrived),
                        )
                    self.cond.wait(min(remaining, _ABORT_POLL_S))
                self.last_progress = time.monotonic()
            # No later generation can complete without this rank, so this is ours.
            payloads, signatures = self.completed
        mine = signatures[rank]
        for peer, theirs in enumerate(signatures):
            if theirs != mine:
                assert mine is not None and theirs is not None
                raise CommMismatch.between(
                    rank=rank, peer=peer, field="collective", what=what,
                    mine=_describe_op(*mine), theirs=_describe_op(*theirs),
                )
        return payloads

    def record_failure(self, rank: int, exc: BaseException) -> None:
        with self.cond:
            self.failures.append((rank, exc))
        origin = exc.origin_rank if isinstance(exc, CommAborted) else rank
        self.mark_failed(origin, _summary(exc))

    def record_finished(self, rank: int) -> None:
        with self.cond:
            self.finished.add(rank)
            self.last_progress = time.monotonic()
            self.cond.notify_all()

    def wait_finished(self, grace: float) -> list[int]:
        """Wait until every rank thread finished; return the ranks still running when
        ``grace`` seconds passed without control-plane progress (or since the failure)."""
        with self.cond:
            while len(self.finished) < self.size:
                anchor = max(self.last_progress, self.fail_time or 0.0)
                remaining = anchor + grace - time.monotonic()
                if remaining <= 0:
                    return sorted(set(range(self.size)) - self.finished)
                self.cond.wait(remaining)
            return []

    def root_cause(self) -> BaseException:
        """The first failing rank's original exception, annotated with the others'."""
        failures = list(self.failures)
        primary = [f for f in failures if not isinstance(f[1], CommAborted)]
        if primary:
            rank, exc = primary[0]
        else:
            origin = [f for f in failures if f[0] == self.origin_rank]
            rank, exc = (origin or failures)[0]
        others = [f"rank {r}: {_summary(e)}" for r, e in failures if e is not exc]
        completed = sorted(self.finished - {r for r, _ in failures})
        note = f"commref ThreadWorld.run: rank {rank} failed first (root cause)"
        if others:
            note += "; other ranks: " + "; ".join(others)
        if completed:
            note += f"; ranks {completed} completed"
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(note)
        else:  # pragma: no cover - Python 3.10 keeps the note without printing it
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
        return exc


class ThreadWorld(World):
    """N ranks as threads of one process, sharing one group.

    Build one with :meth:`run` (N threads) or :meth:`single` (one rank, no
    thread). ``local_rank == rank`` and ``local_size == size``: all ranks are on
    this host. ``abort_word`` is one array shared by every rank of the group.

    Objects passed through ``allgather`` / ``bcast`` are shared by reference
    (no pickling); treat received objects as read-only. The returned list of
    ``allgather`` is a fresh list per rank.

    Failure: when a rank's function raises (see :meth:`run`) or a rank calls
    :meth:`abort`, the group is marked failed (abort word set to 1, origin rank
    and reason recorded) and every rank waiting in, or later entering,
    ``barrier`` / ``allgather`` / ``bcast`` / ``check_aborted`` raises
    CommAborted within ~50 ms. Waiters also notice an abort word raised by
    someone else (e.g. device code) that way.
    """

    kind: ClassVar[str] = "thread"

    def __init__(self, group: _ThreadGroup, rank: int, node: str | None = None) -> None:
        """Internal: use :meth:`run` or :meth:`single` (`node`: a split's, its parent's)."""
        super().__init__(
            rank=rank,
            size=group.size,
            local_rank=rank,
            local_size=group.size,
            host=group.host,
            abort_word=group.abort_word,
            timeout=group.timeout,
            node=node_of(group.host, rank, group.size) if node is None else node,
        )
        self._group = group

    @classmethod
    def single(cls, timeout: float | None = None) -> "ThreadWorld":
        """A one-rank world, without threads (what a non-MPI process runs as)."""
        seconds = default_timeout() if timeout is None else _check_timeout(timeout)
        return cls(_ThreadGroup(1, seconds), 0)

    @classmethod
    def run(
        cls,
        nranks: int,
        fn: Callable[..., T],
        *args: Any,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[T]:
        """Run ``fn(world, *args, **kwargs)`` on ``nranks`` rank threads; return the
        results indexed by rank.

        ``timeout`` is every rank's ``world.timeout`` (default ``$COMMREF_TIMEOUT``).

        If a rank raises (any BaseException), the group is marked failed, so ranks
        blocked in the control plane raise CommAborted promptly. Once every thread
        has finished, ``run`` re-raises the root cause: the first failure that is not
        a CommAborted (else the aborting rank's own CommAborted), with a note
        listing the other ranks' exceptions.

        Never hangs: if some rank thread is still running ``2 * timeout + 1`` s
        after the last control-plane activity of the group (an entry into or exit
        from a barrier/allgather/bcast, or a rank finishing) or after the first
        failure, the group is marked failed and ``run`` raises CommTimeout
        (``rank=None``, ``peer`` = the ranks still running), chained to the root
        cause if there is one. The stuck threads are daemon threads and are left
        behind.
        """
        if isinstance(nranks, bool) or not isinstance(nranks, (int, np.integer)):
            raise TypeError(f"nranks must be an int, got {type(nranks).__name__}")
        if nranks < 1:
            raise ValueError(f"nranks must be at least 1, got {nranks}")
        seconds = default_timeout() if timeout is None else _check_timeout(timeout)
        group = _ThreadGroup(int(nranks), seconds)
        results: list[Any] = [None] * group.size

        def rank_main(rank: int) -> None:
            try:
                results[rank] = fn(cls(group, rank), *args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised by run()
                group.record_failure(rank, exc)
            finally:
                group.record_finished(rank)

        threads = [
            threading.Thread(target=rank_main, args=(r,), name=f"commref-rank-{r}", daemon=True)
            for r in range(group.size)
        ]
        for thread in threads:
            thread.start()
        grace = 2 * seconds + 1.0
        try:
            stuck = group.wait_finished(grace)
        except BaseException:  # e.g. KeyboardInterrupt: tear the ranks down too
            group.mark_failed(None, "ThreadWorld.run interrupted")
            raise
        for rank, thread in enumerate(threads):
            if rank not in stuck:
                thread.join()  # already past record_finished; returns at once
        if stuck:
            cause = group.root_cause() if group.failures else None
            group.mark_failed(None, f"ranks {stuck} did not finish")
            raise CommTimeout.after(
                grace, rank=None, peer=stuck, what="ThreadWorld.run: rank threads to finish",
                expected=group.size, seen=group.size - len(stuck),
            ) from cause
        if group.failures:
            raise group.root_cause()
        return results

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        self._group.exchange(self.rank, _OP_BARRIER, -1, None, what, self._seconds(timeout))

    def allgather(self, obj: Any, what: str = "allgather", timeout: float | None = None) -> list[Any]:
        return list(self._group.exchange(self.rank, _OP_ALLGATHER, -1, obj, what, self._seconds(timeout)))

    def bcast(self, obj: Any, root: int = 0, what: str = "bcast", timeout: float | None = None) -> Any:
        root = self._check_root(root)
        payload = obj if self.rank == root else None
        return self._group.exchange(self.rank, _OP_BCAST, root, payload, what, self._seconds(timeout))[root]

    def abort(self, message: str, code: int = 1) -> NoReturn:
        """Mark the group failed (this rank is the origin unless another rank failed
        first) and raise CommAborted; bystanders raise CommAborted promptly."""
        group = self._group
        self.abort_word[0] = 1
        group.mark_failed(self.rank, message, code)
        if group.origin_rank == self.rank and group.reason == message:
            raise CommAborted(
                f"rank {self.rank}: aborting: {message}",
                rank=self.rank, origin_rank=self.rank, reason=message,
            )
        raise group.aborted_error(self.rank, f"abort({message!r})")

    def check_aborted(self) -> None:
        """Raise CommAborted if the group was marked failed or the abort word is set."""
        if self._group.failed:
            raise self._group.aborted_error(self.rank, "check_aborted")

    def mark_failed(self, reason: str) -> None:
        """Marks the group failed with this rank as the origin (unless a rank failed
        first): every rank's waits raise CommAborted naming it within ~50 ms."""
        self._group.mark_failed(self.rank, reason)

    def _split(self, colors: list[int], members: list[int], what: str) -> "ThreadWorld":
        # The first rank of each color makes its group; a second exchange hands it out.
        mine = _ThreadGroup(len(members), self.timeout, self.abort_word) if members[0] == self.rank else None
        groups = self.allgather(mine, what=f"{what}: groups")
        return ThreadWorld(groups[members[0]], members.index(self.rank), node=self.node)


def world_from_env(timeout: float | None = None) -> World:
    """An :class:`MPIWorld` when launched by an MPI launcher, else ``ThreadWorld.single()``."""
    if MPIWorld.launched_under_mpi():
        return MPIWorld(timeout=timeout)
    return ThreadWorld.single(timeout=timeout)

