"""reduce_scatter: rank r ends with shard r of the reduction of every rank's buffer.
In place, rank r's recvbuf is its own shard of sendbuf."""

from __future__ import annotations

from .base import Buffers, Collective, Counts, Memory, device_copy, restorer, sentinel


class ReduceScatter(Collective):
    name = "reduce_scatter"
    coll = "reduce_scatter"
    reducing = True

    def counts(self, nbytes: int, itemsize: int, nranks: int) -> Counts:
        per_rank = nbytes // itemsize // nranks
        return Counts(per_rank * nranks, per_rank, per_rank)

    def algbw_bytes(self, counts: Counts, itemsize: int, nranks: int) -> int:
        return counts.param * itemsize * nranks

    def bus_factor(self, nranks: int) -> float:
        return (nranks - 1) / nranks

    def bound_bytes(self, size: int, nranks: int, in_place: bool = False) -> tuple[int, int]:
        # Reduce this rank's 1/n shard from the n inputs.
        return 0, (nranks - 1) * size // nranks

    def buffers(self, mem: Memory, x, counts: Counts, rank: int, nranks: int, root: int, in_place: bool) -> Buffers:
        c = counts.param
        if in_place:
            buf = device_copy(mem, x)
            mine = buf[rank * c : (rank + 1) * c]
            return Buffers(buf, mine, mine, restorer(mem, buf, x))
        recv = sentinel(mem, counts.recv, x.dtype)
        return Buffers(device_copy(mem, x), recv, recv)

    def run(self, comm, b: Buffers, op: str, root: int) -> None:
        comm.reduce_scatter(b.send, b.recv, op)
