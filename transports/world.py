"""Bootstrap and control plane: who the ranks are, barrier, small-object exchange, abort.

One interface, :class:`World` (this module), two implementations:

* ``mpi_world.MPIWorld`` -- mpi4py, one rank per process (the distributed engine).
* ``thread_world.ThreadWorld`` -- N ranks as threads of one process (fast tests,
  ThreadSanitizer, several ranks on one GPU).

Contracts shared by both:

* **Every wait has a deadline.** ``barrier`` / ``allgather`` / ``bcast`` take a
  ``timeout`` in seconds (default ``world.timeout``, from ``$COMMREF_TIMEOUT``,
  60 s when unset; deadlines.py). When it passes, the call raises
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
from typing import Any, ClassVar, NoReturn

import numpy as np

from .deadlines import check_timeout, default_timeout

__all__ = ["World"]

# Control-plane operation codes, compared across ranks to detect mismatched calls (by
# both implementations: a token's op and root, a group member's signature).
OP_BARRIER = 0
OP_ALLGATHER = 1
OP_BCAST = 2
OP_NAMES = {OP_BARRIER: "barrier", OP_ALLGATHER: "allgather", OP_BCAST: "bcast"}


def describe_op(op: int, root: int) -> str:
    """An operation code and root as a mismatch names them: "barrier", "bcast(root=1)"."""
    name = OP_NAMES.get(op, f"op{op}")
    return f"{name}(root={root})" if op == OP_BCAST else name


class World(abc.ABC):
    """The control plane of one rank.

    Attributes:
        rank, size: this rank and the number of ranks.
        local_rank, local_size: this rank among the ranks on its host, and how many.
        host: host name (the machine: what shared memory and CUDA IPC can reach).
        node: node identity (nodes.node_of: the host, unless overridden or simulated); the
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
        self.timeout = default_timeout() if timeout is None else check_timeout(timeout)
        self.members: list[int] = list(range(size))

    # -- helpers -------------------------------------------------------------------

    def _seconds(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else check_timeout(timeout)

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

    def split(self, color: int | None, what: str = "split", key: int | None = None) -> World | None:
        """Collective: the world of the ranks that pass the same `color` (an int >= 0),
        ranked by `key` (default: this world's rank), ties broken by rank, as
        MPI_Comm_split. A rank passing None joins no world and gets None. Each rank keeps
        its node identity, so a split's LSA teams are the parent's; the split shares the
        parent's abort word and deadline, and `members` lists its ranks by their parent
        rank. Every rank must call it; a rank that does not makes the others fail at the
        deadline, naming it. A color or key that is not an int (or a negative color)
        raises ValueError on every rank, naming the ranks that passed it."""
        key = self.rank if key is None else key
        entries = self.allgather((color, key), what=f"{what}: colors")
        bad = [
            (r, c, k)
            for r, (c, k) in enumerate(entries)
            if not _is_int(k) or not (c is None or (_is_int(c) and c >= 0))
        ]
        if bad:
            said = "; ".join(f"rank {r} passed color {c!r}, key {k!r}" for r, c, k in bad)
            raise ValueError(f"rank {self.rank}: {what}: a color is an int >= 0 (or none) and a key an int: {said}")
        colors = [c for c, _ in entries]
        if color is None:
            self._split(colors, [], what)
            return None
        members = sorted((r for r, c in enumerate(colors) if c == color), key=lambda r: (entries[r][1], r))
        world = self._split(colors, members, what)
        world.members = members
        return world

    @abc.abstractmethod
    def _split(self, colors: list[int | None], members: list[int], what: str) -> World | None:
        """The split world of this rank, whose ranks are `members` in their order (none:
        this rank passed no color; it still takes part, then gets None). split() has
        gathered and checked the colors."""

    def free(self) -> None:
        """Releases what a split world holds of the parent's resources (idempotent);
        the world must not be used afterwards."""


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
