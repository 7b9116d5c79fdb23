"""all_reduce: every rank ends with the reduction of every rank's buffer."""

from __future__ import annotations

from .base import Buffers, Collective


class AllReduce(Collective):
    name = "all_reduce"
    coll = "allreduce"
    reducing = True

    def bus_factor(self, nranks: int) -> float:
        return 2 * (nranks - 1) / nranks

    def bound_bytes(self, size: int, nranks: int, in_place: bool = False) -> tuple[int, int]:
        # Reduce this rank's 1/n shard from the n inputs, then fetch the other shards.
        share = (nranks - 1) * size // nranks
        return share, share

    def run(self, comm, b: Buffers, op: str, root: int) -> None:
        comm.allreduce(b.send, b.recv, op)
