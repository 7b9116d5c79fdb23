"""broadcast: every rank ends with the root's buffer."""

from __future__ import annotations

from .base import Buffers, Collective, Counts, device_copy, restorer, sentinel


class Broadcast(Collective):
    name = "broadcast"
    coll = "broadcast"
    rooted = True

    def bus_factor(self, nranks: int) -> float:
        return 1.0

    def bound_bytes(self, size: int, nranks: int) -> tuple[int, int]:
        # A non-root rank lands all of the root's bytes.
        return size, 0

    def buffers(self, xp, x, counts: Counts, rank: int, nranks: int, root: int, in_place: bool) -> Buffers:
        if in_place:
            buf = device_copy(xp, x)
            return Buffers(buf, buf, buf, restorer(xp, buf, x))
        recv = sentinel(xp, counts.recv, x.dtype)
        return Buffers(device_copy(xp, x), recv, recv)

    def run(self, comm, b: Buffers, op: str, root: int) -> None:
        comm.broadcast(b.send, b.recv, root)
