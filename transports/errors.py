"""Exception hierarchy shared by every commref layer.

Contract:

* Every failure that commref itself detects is a :class:`CommrefError`.
* A wait that passed its deadline raises :class:`CommTimeout`, naming this rank,
  the peer(s) it was waiting for, what it was waiting for, and expected vs seen.
* A rank that is torn down because *another* rank failed raises
  :class:`CommAborted` (the root cause is the other rank's exception).
* Ranks that called the same collective with different arguments raise
  :class:`CommMismatch`.
* A missing capability (e.g. no GIN backend meets the requirements) raises
  :class:`CapabilityError`.
* Bad user input is a plain :class:`ValueError` / :class:`TypeError`, not a
  ``CommrefError``.

All exceptions keep their structured fields as attributes and survive pickling
(``__reduce__``), so they can cross process boundaries (e.g. an MPI allgather of
per-rank failures).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "CommrefError",
    "CommTimeout",
    "CommAborted",
    "CommMismatch",
    "CapabilityError",
    "format_seconds",
    "format_peers",
]

Peer = int | list[int] | None


def format_seconds(seconds: float) -> str:
    """Format a duration for messages: ``5.0``, ``60.0``, ``0.5``, ``0.025``."""
    seconds = float(seconds)
    return f"{seconds:.1f}" if seconds >= 1.0 else f"{seconds:.3g}"


def format_peers(peer: int | Sequence[int] | None) -> str:
    """``peer 3``, ``peers [1, 3]``, or ``peers (unknown)`` for messages."""
    if peer is None:
        return "peers (unknown)"
    if isinstance(peer, int):
        return f"peer {peer}"
    peers = list(peer)
    if len(peers) == 1:
        return f"peer {peers[0]}"
    return f"peers {peers}"


class CommrefError(Exception):
    """Base class of every error commref detects itself."""


class CommTimeout(CommrefError):
    """A wait passed its deadline.

    Attributes:
        rank: the rank that timed out (``None`` for a supervisor such as
            ``ThreadWorld.run`` that is not itself a rank).
        peer: the peer (int) or peers (list of ints) that did not show up, or
            ``None`` when unknown.
        what: what was being waited for.
        expected: the value / count the waiter needed.
        seen: the value / count it observed when the deadline passed.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None,
        peer: Peer = None,
        what: str = "",
        expected: Any = None,
        seen: Any = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.what = what
        self.expected = expected
        self.seen = seen

    @classmethod
    def after(
        cls,
        timeout: float,
        *,
        rank: int | None,
        peer: Peer = None,
        what: str = "",
        expected: Any = None,
        seen: Any = None,
    ) -> CommTimeout:
        """Build the standard message.

        ``rank 2: timed out after 5.0 s waiting for peer 3: <what> (expected
        <expected>, seen <seen>)``
        """
        who = "supervisor" if rank is None else f"rank {rank}"
        message = (
            f"{who}: timed out after {format_seconds(timeout)} s waiting for "
            f"{format_peers(peer)}: {what} (expected {expected}, seen {seen})"
        )
        return cls(message, rank=rank, peer=peer, what=what, expected=expected, seen=seen)

    @property
    def peers(self) -> list[int]:
        """``peer`` normalized to a list (empty when unknown)."""
        if self.peer is None:
            return []
        if isinstance(self.peer, int):
            return [self.peer]
        return list(self.peer)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild,
            (
                type(self),
                str(self),
                dict(rank=self.rank, peer=self.peer, what=self.what, expected=self.expected, seen=self.seen),
            ),
        )


class CommAborted(CommrefError):
    """The job is being torn down because a rank failed.

    Attributes:
        rank: the rank that raises this exception.
        origin_rank: the rank whose failure started the abort (``None`` when
            unknown; equal to ``rank`` when this rank called ``abort`` itself).
        reason: the origin's failure summary.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None,
        origin_rank: int | None = None,
        reason: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.origin_rank = origin_rank
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild,
            (type(self), str(self), dict(rank=self.rank, origin_rank=self.origin_rank, reason=self.reason)),
        )


class CommMismatch(CommrefError):
    """Ranks called the same collective with different arguments.

    Attributes:
        rank: the rank that detected the mismatch.
        peer: a rank whose value differs from this rank's.
        field: the argument that differs (e.g. ``"collective"``, ``"count"``).
        mine: this rank's value.
        theirs: the peer's value.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None,
        peer: int | None = None,
        field: str = "",
        mine: Any = None,
        theirs: Any = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.field = field
        self.mine = mine
        self.theirs = theirs

    @classmethod
    def between(cls, *, rank: int, peer: int, field: str, mine: Any, theirs: Any, what: str = "") -> CommMismatch:
        """Build the standard message: ``rank 0: <what>: <field> mismatch with
        rank 2: mine=<mine>, theirs=<theirs>``."""
        context = f"{what}: " if what else ""
        message = f"rank {rank}: {context}{field} mismatch with rank {peer}: mine={mine!r}, theirs={theirs!r}"
        return cls(message, rank=rank, peer=peer, field=field, mine=mine, theirs=theirs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild,
            (
                type(self),
                str(self),
                dict(rank=self.rank, peer=self.peer, field=self.field, mine=self.mine, theirs=self.theirs),
            ),
        )


class CapabilityError(CommrefError):
    """A required capability is missing (e.g. no backend meets the requirements).

    The message names the missing capability.
    """


def _rebuild(cls: type[CommrefError], message: str, fields: dict[str, Any]) -> CommrefError:
    """Unpickling helper for the keyword-only constructors above."""
    return cls(message, **fields)  # type: ignore[call-arg]
