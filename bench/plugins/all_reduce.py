"""all_reduce: every rank ends with the reduction of every rank's buffer."""

from __future__ import annotations

from .base import Buffers, Collective, Counts, device_copy, restorer, sentinel


class AllReduce(Collective):
    name = "all_reduce"
    coll = "allreduce"
    reducing = True

    def bus_factor(self, nranks: int) -> float:
        return 2 * (nranks - 1) / nranks

    def bound_bytes(self, size: int, nranks: int) -> tuple[int, int]:
        # Reduce this rank's 1/n shard from the n inputs, then fetch the other shards.
        share = (nranks - 1) * size // nranks
        return share, share

    def buffers(self, xp, x, counts: Counts, rank: int, nranks: int, root: int, in_place: bool) -> Buffers:
        if in_place:
            buf = device_copy(xp, x)
            return Buffers(buf, buf, buf, restorer(xp, buf, x))
        send, recv = device_copy(xp, x), sentinel(xp, counts.recv, x.dtype)
        return Buffers(send, recv, recv)

    def run(self, comm, b: Buffers, op: str, root: int) -> None:
        comm.allreduce(b.send, b.recv, op)
