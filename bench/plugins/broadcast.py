"""broadcast: every rank ends with the root's buffer."""

from __future__ import annotations

from .base import Buffers, Collective


class Broadcast(Collective):
    name = "broadcast"
    coll = "broadcast"
    rooted = True

    def bus_factor(self, nranks: int) -> float:
        return 1.0

    def bound_bytes(self, size: int, nranks: int, in_place: bool = False) -> tuple[int, int]:
        # A non-root rank lands all of the root's bytes.
        return size, 0

    def run(self, comm, b: Buffers, op: str, root: int) -> None:
        comm.broadcast(b.send, b.recv, root)
