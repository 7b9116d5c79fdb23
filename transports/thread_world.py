"""The World of N ranks as threads of one process (see world.py for the contracts):
fast tests, ThreadSanitizer, several ranks on one GPU."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, NoReturn, TypeVar

import numpy as np

from .deadlines import check_timeout, default_timeout
from .errors import CommAborted, CommMismatch, CommTimeout
from .nodes import node_of
from .world import OP_ALLGATHER, OP_BARRIER, OP_BCAST, World, describe_op

__all__ = ["ThreadWorld"]

T = TypeVar("T")

# How often a ThreadWorld waiter re-checks the shared abort word (seconds).
_ABORT_POLL_S = 0.05


def _summary(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
            rank=rank,
            origin_rank=self.origin_rank,
            reason=self.reason or "",
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
                            seconds,
                            rank=rank,
                            peer=missing,
                            what=f"{what}: ranks at the barrier",
                            expected=self.size,
                            seen=len(self.arrived),
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
                    rank=rank,
                    peer=peer,
                    field="collective",
                    what=what,
                    mine=describe_op(*mine),
                    theirs=describe_op(*theirs),
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
    def single(cls, timeout: float | None = None) -> ThreadWorld:
        """A one-rank world, without threads (what a non-MPI process runs as)."""
        seconds = default_timeout() if timeout is None else check_timeout(timeout)
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
        seconds = default_timeout() if timeout is None else check_timeout(timeout)
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
                grace,
                rank=None,
                peer=stuck,
                what="ThreadWorld.run: rank threads to finish",
                expected=group.size,
                seen=group.size - len(stuck),
            ) from cause
        if group.failures:
            raise group.root_cause()
        return results

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        self._group.exchange(self.rank, OP_BARRIER, -1, None, what, self._seconds(timeout))

    def allgather(self, obj: Any, what: str = "allgather", timeout: float | None = None) -> list[Any]:
        return list(self._group.exchange(self.rank, OP_ALLGATHER, -1, obj, what, self._seconds(timeout)))

    def bcast(self, obj: Any, root: int = 0, what: str = "bcast", timeout: float | None = None) -> Any:
        root = self._check_root(root)
        payload = obj if self.rank == root else None
        return self._group.exchange(self.rank, OP_BCAST, root, payload, what, self._seconds(timeout))[root]

    def abort(self, message: str, code: int = 1) -> NoReturn:
        """Mark the group failed (this rank is the origin unless another rank failed
        first) and raise CommAborted; bystanders raise CommAborted promptly."""
        group = self._group
        self.abort_word[0] = 1
        group.mark_failed(self.rank, message, code)
        if group.origin_rank == self.rank and group.reason == message:
            raise CommAborted(
                f"rank {self.rank}: aborting: {message}",
                rank=self.rank,
                origin_rank=self.rank,
                reason=message,
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

    def _split(self, colors: list[int | None], members: list[int], what: str) -> ThreadWorld | None:
        # The first rank of each color makes its group; a second exchange hands it out.
        mine = (
            _ThreadGroup(len(members), self.timeout, self.abort_word) if members and members[0] == self.rank else None
        )
        groups = self.allgather(mine, what=f"{what}: groups")
        if not members:
            return None
        return ThreadWorld(groups[members[0]], members.index(self.rank), node=self.node)
