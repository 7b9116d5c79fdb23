"""reduce: the root ends with the reduction of every rank's buffer; other ranks'
recvbufs are not checked (NCCL ignores them)."""

from __future__ import annotations

from .base import Buffers, Collective


class Reduce(Collective):
    name = "reduce"
    coll = "reduce"
    reducing = True
    rooted = True

    def bus_factor(self, nranks: int) -> float:
        return 1.0

    def bound_bytes(self, size: int, nranks: int, in_place: bool = False) -> tuple[int, int]:
        # Work spread evenly: reduce a 1/n shard from the n inputs, and the root
        # gathers the other shards.
        share = (nranks - 1) * size // nranks
        return share, share

    def run(self, comm, b: Buffers, op: str, root: int) -> None:
        comm.reduce(b.send, b.recv, op, root)
