"""all_gather: every rank ends with the concatenation of every rank's buffer, in rank
order. In place, rank r's sendbuf is its own slot of recvbuf."""

from __future__ import annotations

from .base import Buffers, Collective, Counts, Memory, device_copy, restorer, sentinel


class AllGather(Collective):
    name = "all_gather"
    coll = "allgather"

    def counts(self, nbytes: int, itemsize: int, nranks: int) -> Counts:
        per_rank = nbytes // itemsize // nranks
        return Counts(per_rank, per_rank * nranks, per_rank)

    def algbw_bytes(self, counts: Counts, itemsize: int, nranks: int) -> int:
        return counts.param * itemsize * nranks

    def bus_factor(self, nranks: int) -> float:
        return (nranks - 1) / nranks

    def bound_bytes(self, size: int, nranks: int, in_place: bool = False) -> tuple[int, int]:
        # Land the n - 1 other ranks' shards in this rank's recvbuf, and out of place
        # this rank's own shard too.
        return ((nranks - 1) * size // nranks if in_place else size), 0

    def buffers(self, mem: Memory, x, counts: Counts, rank: int, nranks: int, root: int, in_place: bool) -> Buffers:
        c = counts.param
        recv = sentinel(mem, counts.recv, x.dtype)
        if in_place:
            mine = recv[rank * c : (rank + 1) * c]
            mine[...] = mem.asarray(x)
            return Buffers(mine, recv, recv, restorer(mem, mine, x))
        return Buffers(device_copy(mem, x), recv, recv)

    def run(self, comm, b: Buffers, op: str, root: int) -> None:
        comm.allgather(b.send, b.recv)
