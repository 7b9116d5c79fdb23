"""What the harness sweeps: one plugin per collective, derived from the collective
catalogue (commref.collectives.catalogue), in nccl-tests' terms.

As in nccl-tests, a plugin answers four questions and the harness does the rest:

- counts: for a sweep size in bytes, the element counts of sendbuf and recvbuf and
  the count NCCL's call takes (nccl-tests' getCollByteCount);
- bandwidth: the bytes algbw divides by time, and the bus factor that turns algbw
  into busbw (nccl-tests' getBw);
- data: buffers holding exact-checkable inputs (collectives.verify), the expected
  output, and how to restore an in-place input (nccl-tests' initData);
- run: one call on a Communicator, or on anything with nccl4py's method names (the
  baselines) (nccl-tests' runColl).

Bandwidth definitions (nccl-tests' doc/PERFORMANCE.md), for n ranks, element size t
and NCCL's count c: algbw bytes are the larger buffer's, c * t (all_reduce,
broadcast, reduce) or c * t * n (all_gather: recvbuf, reduce_scatter: sendbuf,
alltoall: either); the bus factors are 2 (n - 1) / n (all_reduce), (n - 1) / n
(all_gather, reduce_scatter, alltoall) and 1 (broadcast, reduce).

The collectives composed of sends and receives follow nccl-tests' gather, scatter,
alltoallv (rccl-tests' and NVIDIA's alltoallv branch), sendrecv and hypercube programs:
gather (recvbuf) and scatter (sendbuf) hold n blocks of c = size / t / n, bus factor
(n - 1) / n; alltoallv n blocks of c each way, bus factor (n - 1) / n, each pair moving
the layout's count of its block (collectives/p2p_collectives.alltoallv_layout);
sendrecv c = size / t each way, bus factor 1; hypercube c = size / t / n rounded down to
a multiple of 4 per rank, algbw of the (n - 1) c t bytes a rank receives, bus factor 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from commref.collectives import catalogue, verify
from commref.collectives.catalogue import CallBuffers as Buffers
from commref.collectives.memory import Memory, SymmetricMemory


@dataclass(frozen=True)
class Counts:
    """Element counts of one sweep size (nccl-tests' getCollByteCount)."""

    send: int
    recv: int
    param: int  # the count NCCL's call takes

    def size_bytes(self, itemsize: int) -> int:
        """The size column: nccl-tests prints max(sendBytes, recvBytes)."""
        return max(self.send, self.recv) * itemsize


class Collective:
    """The plugin of one catalogue entry."""

    def __init__(self, spec: catalogue.Collective):
        self.spec = spec
        self.name = spec.nccl_tests_name  # nccl-tests' name: all_reduce
        self.coll = spec.name  # commref's and nccl4py's: allreduce
        self.reducing, self.rooted = spec.reducing, spec.rooted
        # The variants measured: out of place, and in place where NCCL defines it.
        self.placements = (False, True) if spec.in_place_ok else (False,)

    def counts(self, nbytes: int, itemsize: int, nranks: int) -> Counts:
        """The counts of a sweep size: the larger buffer holds at most `nbytes` (the
        count a multiple of the catalogue's count_align: hypercube's 4)."""
        align = self.spec.count_align
        count = nbytes // itemsize // ((nranks if self.spec.scaled else 1) * align) * align
        return Counts(*self.spec.counts(count, nranks), count)

    def algbw_bytes(self, counts: Counts, itemsize: int, nranks: int) -> int:
        """nccl-tests' getBw bytes: the size column's (hypercube: the nranks - 1 blocks a
        rank receives, catalogue.Collective.algbw_share)."""
        return round(counts.size_bytes(itemsize) * self.spec.algbw_share(nranks))

    def bus_factor(self, nranks: int) -> float:
        return self.spec.bus_factor(nranks)

    def traffic(self, nranks: int, in_place: bool = False) -> catalogue.Traffic:
        """One rank's share of the least loads and stores of a call, out of place or in
        place (catalogue.Traffic; the bound, bench/bound.py)."""
        return self.spec.traffic(nranks, in_place)

    def input(self, counts: Counts, dtype, op: str | None, seed: int, rank: int, nranks: int) -> np.ndarray:
        return verify.make_input(self.coll, dtype, op, seed, rank, nranks, counts.param)

    def expected(
        self, counts: Counts, dtype, op: str | None, seed: int, rank: int, nranks: int, root: int
    ) -> np.ndarray | None:
        """What `out` must hold after the call; None where nothing is checked on this
        rank (reduce on a non-root rank)."""
        return verify.expected_output(self.coll, dtype, op, seed, rank, nranks, counts.param, root)

    def buffers(self, mem: Memory, x, counts: Counts, rank: int, nranks: int, root: int, in_place: bool) -> Buffers:
        return self.spec.buffers(mem, x, counts.param, rank, nranks, in_place)

    def run(self, comm, b: Buffers, op: str | None, root: int) -> None:
        self.bound(comm, b, op, root)()

    def bound(self, comm, b: Buffers, op: str | None, root: int) -> Callable[[], None]:
        """The call on `comm` with its arguments bound (catalogue.Collective.bound): what
        the timed loops repeat."""
        return self.spec.bound(comm, b.send, b.recv, op, root)


PLUGINS: dict[str, Collective] = {c.nccl_tests_name: Collective(c) for c in catalogue.CATALOGUE.values()}


def get(name: str) -> Collective:
    """The plugin for `name` in any of the catalogue's spellings; ValueError names the choices."""
    return PLUGINS[catalogue.get(name).nccl_tests_name]


__all__ = ["PLUGINS", "get", "Collective", "Counts", "Buffers", "Memory", "SymmetricMemory"]
