"""The collective catalogue: one description per collective.

Everything commref knows about a collective that is not an algorithm lives here: its
names (commref's and nccl4py's, nccl-tests'), whether it reduces and whether it has a
root, the algorithms implemented for it and their kernels, the sizes of its buffers
and NCCL's in-place layout, which buffers the direct kernels access on peers, and
the bandwidth factors of nccl-tests. The Communicator's validation, the tuner, the
verification references, `commref check` and the benchmark plugins derive from it;
nothing else branches on a collective's name. Adding a collective is an entry here,
a kernel and a test (or, for one composed of sends and receives, its composition in
p2p_collectives.py: gather, scatter, alltoallv, and nccl-tests' sendrecv and
hypercube, algorithm "p2p").

Counts follow NCCL: `count` is the count NCCL's call takes (per-rank recvcount for
reduce_scatter, per-rank sendcount for allgather, per-peer count for alltoall); the
buffer named by `scaled` holds nranks * count elements, the other count elements
(BOTH: each buffer holds nranks * count, block j of sendbuf going to rank j). Of the
collectives composed of sends and receives: gather's sendcount, scatter's recvcount,
alltoallv's block per peer (its pairs send part of it: pair_count), sendrecv's count
and hypercube's sendcount.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from commref.device_kernels import abi

from . import p2p_collectives as p2pc
from .hierarchical import HIERARCHICAL
from .p2p_collectives import P2P

SEND, RECV = "sendbuf", "recvbuf"
BOTH = "sendbuf and recvbuf"  # Collective.scaled of a personalized exchange (alltoall)


@dataclass(frozen=True)
class Collective:
    name: str  # commref's and nccl4py's method name: allreduce
    nccl_tests_name: str  # all_reduce
    reducing: bool
    rooted: bool
    kernels: Mapping[str, str]  # algorithm -> kernel entry point (abi.KERNEL_NAMES); ring first; {}: composed only
    scaled: str | None  # the buffer of nranks * count elements (SEND, RECV, BOTH), or None: both count
    root_only: str | None  # the buffer only the root passes (others' is ignored), if any
    peer_accessed: tuple[str, ...]  # buffers the direct kernel loads from or stores to on peers
    bus_factor: Callable[[int], float]  # nccl-tests' busbw = algbw * bus_factor(nranks)
    # traffic(nranks, in_place): one rank's share of the least memory traffic any
    # algorithm needs for a call (Traffic below; bench/bound.py turns it into the bound).
    traffic: Callable[[int, bool], Traffic]
    # Algorithms made of other calls rather than one kernel: "hierarchical" (hierarchical.py).
    composed: tuple[str, ...] = ()
    # Whether NCCL defines an in-place form (in_place_layout); False: overlapping buffers
    # are refused, and check and bench run out of place only.
    in_place_ok: bool = True
    # The direct kernel where peers are over GIN (it pushes: direct.cu): the buffers its
    # puts read or write, which must lie in symmetric windows the GIN engine carries;
    # None where there is no such kernel.
    gin_windows: tuple[str, ...] | None = None
    # ... and whether it needs count (elements) to split evenly over the ranks and the
    # buffers not to overlap (the AllReduce stages peers' blocks in its recvbuf).
    gin_direct_even_out_of_place: bool = False
    # A collective composed of sends and receives (algorithm "p2p", p2p_collectives.py):
    # f(comm, sendbuf, recvbuf, root, **kwargs) runs one call on `comm` (a Communicator or
    # a baseline) with nccl-tests' arguments; None: the method `name` in nccl4py's order (bound).
    compose: Callable[..., None] | None = None
    # Why it cannot run on n ranks (hypercube: powers of two only), or None.
    rank_refusal: Callable[[int], str | None] | None = None
    # sendrecv: the rank whose sendbuf lands in a rank's recvbuf, f(rank, nranks).
    received_from: Callable[[int, int], int] | None = None
    # alltoallv: the elements rank s sends rank d out of its block of count, f(s, d, count);
    # the rest of each recvbuf block is left alone.
    pair_count: Callable[[int, int, int], int] | None = None
    # nccl-tests' getBw: algbw = size column * algbw_share(nranks) / time (hypercube counts
    # the nranks - 1 blocks a rank receives), and count_align: the per-rank count of a
    # sweep size rounded down to a multiple of it (hypercube's ALIGN 4).
    algbw_share: Callable[[int], float] = lambda n: 1.0
    count_align: int = 1

    @property
    def algorithms(self) -> tuple[str, ...]:
        return tuple(self.kernels) + self.composed

    def counts(self, count: int, nranks: int) -> tuple[int, int]:
        """(sendbuf, recvbuf) elements of a call of NCCL count `count`."""
        return (
            (count * nranks if self.scaled in (SEND, BOTH) else count),
            (count * nranks if self.scaled in (RECV, BOTH) else count),
        )

    @property
    def in_place_layout(self) -> str:
        """NCCL's in-place layout, in words."""
        if not self.in_place_ok:
            return "none: sendbuf and recvbuf must not overlap"
        if self.scaled == SEND:
            return "recvbuf == sendbuf + rank * recvcount"
        if self.scaled == RECV:
            return "sendbuf == recvbuf + rank * sendcount"
        return "sendbuf == recvbuf"

    def in_place_at(self, rank: int, count: int) -> int:
        """Where the smaller buffer starts inside the larger one in place (elements)."""
        return rank * count if self.scaled else 0

    def kernel_count(self, count: int, itemsize: int) -> int:
        """CollArgs.count: elements for a reduction, bytes for data movement."""
        return count if self.reducing else count * itemsize

    def call(self, comm, sendbuf, recvbuf, op: str | None, root: int, **kwargs) -> None:
        """One call of this collective on `comm` (a Communicator, or anything with
        nccl4py's method names and argument order; a composed collective's
        `compose` says how to run it there)."""
        self.bound(comm, sendbuf, recvbuf, op, root, **kwargs)()

    def bound(self, comm, sendbuf, recvbuf, op: str | None, root: int, **kwargs) -> Callable[[], None]:
        """call()'s call with its arguments bound: calling it (no arguments) makes the
        call, through no Python frame of commref's before the method's own (a timed
        loop's repeated call). A `comm` with bind_call (an in-process baseline,
        bench/baselines.py) binds its own call, so that no frame of its class stands
        between the loop and its library where the library makes the call in one."""
        if self.compose is not None:
            return functools.partial(self.compose, comm, sendbuf, recvbuf, root, **kwargs)
        args = _CALL_ARGS[self.reducing, self.rooted](sendbuf, recvbuf, op, root)
        bind = getattr(comm, "bind_call", None)  # a baseline's: straight to its library's call
        if bind is not None and not kwargs:
            return bind(self.name, *args)
        return functools.partial(getattr(comm, self.name), *args, **kwargs)

    def buffers(self, mem, x, count: int, rank: int, nranks: int, in_place: bool) -> CallBuffers:
        """One rank's buffers for a call on input `x` (host, sendbuf's count), in `mem`
        (collectives.memory.Memory): out of place, a copy of x and a sentinel-filled
        recvbuf; in place, NCCL's layout with x where this rank's input belongs."""
        send_n, recv_n = self.counts(count, nranks)
        if in_place and not self.in_place_ok:
            raise ValueError(f"{self.name} has no in-place form ({self.in_place_layout})")
        if not in_place:
            recv = mem.sentinel(recv_n, x.dtype)
            return CallBuffers(mem.copy_of(x), recv, recv)
        if self.scaled == RECV:  # sendbuf is this rank's slot of recvbuf
            whole = mem.sentinel(recv_n, x.dtype)
            at = self.in_place_at(rank, count)
            mine = whole[at : at + count]
            mine[...] = mem.asarray(x)
            return CallBuffers(mine, whole, whole, mem.restorer(mine, x))
        whole = mem.copy_of(x)
        at = self.in_place_at(rank, count)
        recv = whole[at : at + count] if self.scaled == SEND else whole
        return CallBuffers(whole, recv, recv, mem.restorer(whole, x))


# nccl4py's argument order, by (reducing, rooted): (sendbuf, recvbuf[, op][, root]).
_CALL_ARGS = {
    (False, False): lambda s, r, op, root: (s, r),
    (True, False): lambda s, r, op, root: (s, r, op),
    (False, True): lambda s, r, op, root: (s, r, root),
    (True, True): lambda s, r, op, root: (s, r, op, root),
}


@dataclass
class CallBuffers:
    """One rank's buffers of one call: `send` and `recv` as the call takes them, `out`
    what holds the result (recv), and `restore()` to put the input back before a call
    that must see it again (in place; None out of place)."""

    send: Any
    recv: Any
    out: Any
    restore: Callable[[], None] | None = None


@dataclass(frozen=True)
class Traffic:
    """One rank's share of the least memory traffic a call needs, whatever the
    algorithm: the loads and stores of the best one (direct loads and stores over
    symmetric buffers, NCCL's symmetric kernels), with the work split evenly among the
    ranks, which is what the bound divides by the rate at which all ranks stream at
    once (bench/bound.py). Each rank loads `nin` arrays and stores `nout` arrays of
    size / `parts` bytes each (size: the benchmark's size column, the larger buffer);
    the first `shared` outputs are the first `shared` inputs (in place), so the rank
    touches nin + nout - shared arrays. Every output element is the reduction of the
    inputs' elements at its index (a copy when nin == 1).

    Why it is the least: every input byte that some output depends on must be loaded
    at least once by some rank (an output depends on all of its inputs), every output
    byte that does not already hold its value must be stored at least once (out of
    place none does; in place the one input of a copy does), and a byte loaded once can
    be stored to any number of outputs. Summed over the ranks that is the job's least
    traffic; `nin`, `nout` and `parts` are one rank's even share of it."""

    nin: int
    nout: int
    shared: int
    parts: int

    @property
    def moves(self) -> bool:
        """False when the result is the input, already in place (one input, every
        output shared with it, or no input or no output, as a rooted call's in place
        on one rank): nothing needs to move."""
        return self.nin > 0 and self.nout > 0 and not (self.nin == 1 and self.nout == self.shared)

    def loads(self, size: int) -> float:
        """Bytes this rank loads, for a call of `size` bytes (the size column)."""
        return self.nin * size / self.parts if self.moves else 0.0

    def stores(self, size: int) -> float:
        """Bytes this rank stores."""
        return self.nout * size / self.parts if self.moves else 0.0

    def footprint(self, size: int) -> float:
        """Distinct bytes this rank touches (its share of the buffers the call uses)."""
        return (self.nin + self.nout - self.shared) * size / self.parts if self.moves else 0.0


# For n ranks, size S (the size column) and in place or not. Each rank r takes part r
# (S / n bytes) of the work:
def _reduce_to_all(n: int, in_place: bool = False) -> Traffic:
    # all_reduce: part r of the n inputs, reduced, stored to part r of the n outputs.
    # Loads S, stores S, out of place and in place (the outputs are the inputs).
    return Traffic(n, n, n if in_place else 0, n)


def _reduce_to_one(n: int, in_place: bool = False) -> Traffic:
    # reduce_scatter (rank r's output is block r) and reduce (the root's output, part r
    # of it reduced by rank r): part r of the n inputs into one output of S / n.
    # Loads S, stores S / n; in place that output is rank r's own part of its input.
    return Traffic(n, 1, 1 if in_place else 0, n)


def _copy_to_all(n: int, in_place: bool = False) -> Traffic:
    # all_gather (rank r's shard) and broadcast (part r of the root's buffer): load S / n
    # once, store it to the n outputs; in place it already lies in one of them (rank r's
    # own recvbuf, or the root's), so n - 1. Loads S / n, stores S or (n - 1) S / n.
    return Traffic(1, n - 1 if in_place else n, 0, n)


def _exchange(n: int, in_place: bool = False) -> Traffic:
    # alltoall: every block of the sendbuf loaded once and stored once into its place
    # in some recvbuf. Loads S, stores S (no in-place form). alltoallv's too: it counts
    # every block whole, more than the layout's pairs move (p2p_collectives.pair_count).
    return Traffic(1, 1, 0, 1)


def _to_or_from_root(n: int, in_place: bool = False) -> Traffic:
    # gather (the root's recvbuf, S) and scatter (the root's sendbuf, S): each of the n
    # blocks loaded once and stored once, S / n per rank; in place the root's own block
    # is already where it belongs: (n - 1) S / n in all, (n - 1) S / n^2 per rank.
    return Traffic(n - 1, n - 1, 0, n * n) if in_place else Traffic(1, 1, 0, n)


def _shift(n: int, in_place: bool = False) -> Traffic:
    # sendrecv: every rank's buffer (S) loaded once and stored once in its neighbour's.
    return Traffic(1, 1, 0, 1)


CATALOGUE: dict[str, Collective] = {
    c.name: c
    for c in (
        Collective(
            "allreduce",
            "all_reduce",
            reducing=True,
            rooted=False,
            kernels={
                "ring": "commref_ring_allreduce",
                "tree": "commref_tree_allreduce",
                "direct": "commref_direct_allreduce",
                "nvls": "commref_nvls_allreduce",
            },
            scaled=None,
            root_only=None,
            peer_accessed=(SEND, RECV),
            bus_factor=lambda n: 2 * (n - 1) / n,
            traffic=_reduce_to_all,
            composed=(HIERARCHICAL,),
            gin_windows=(SEND, RECV),
            gin_direct_even_out_of_place=True,
        ),
        Collective(
            "allgather",
            "all_gather",
            reducing=False,
            rooted=False,
            kernels={"ring": "commref_ring_allgather", "direct": "commref_direct_allgather"},
            scaled=RECV,
            root_only=None,
            peer_accessed=(RECV,),
            bus_factor=lambda n: (n - 1) / n,
            traffic=_copy_to_all,
            composed=(HIERARCHICAL,),
            gin_windows=(RECV,),
        ),
        Collective(
            "reduce_scatter",
            "reduce_scatter",
            reducing=True,
            rooted=False,
            kernels={"ring": "commref_ring_reduce_scatter", "direct": "commref_direct_reduce_scatter"},
            scaled=SEND,
            root_only=None,
            peer_accessed=(SEND,),
            bus_factor=lambda n: (n - 1) / n,
            traffic=_reduce_to_one,
            composed=(HIERARCHICAL,),
        ),
        Collective(
            "broadcast",
            "broadcast",
            reducing=False,
            rooted=True,
            kernels={"ring": "commref_ring_broadcast"},
            scaled=None,
            root_only=SEND,
            peer_accessed=(),
            bus_factor=lambda n: 1.0,
            traffic=_copy_to_all,
        ),
        Collective(
            "reduce",
            "reduce",
            reducing=True,
            rooted=True,
            kernels={"ring": "commref_ring_reduce"},
            scaled=None,
            root_only=RECV,
            peer_accessed=(),
            bus_factor=lambda n: 1.0,
            traffic=_reduce_to_one,
        ),
        Collective(
            "alltoall",
            "alltoall",
            reducing=False,
            rooted=False,
            kernels={"ring": "commref_ring_alltoall", "direct": "commref_direct_alltoall"},
            scaled=BOTH,
            root_only=None,
            peer_accessed=(RECV,),
            bus_factor=lambda n: (n - 1) / n,
            traffic=_exchange,
            # NCCL defines no in-place alltoall (its in-place page names the other
            # collectives only) and nccl-tests does not check its in-place column.
            in_place_ok=False,
            gin_windows=(SEND, RECV),
        ),
        # Composed of sends and receives in groups (p2p_collectives.py, its docstring).
        Collective(
            "gather",
            "gather",
            reducing=False,
            rooted=True,
            kernels={},
            scaled=RECV,
            root_only=RECV,
            peer_accessed=(),
            bus_factor=lambda n: (n - 1) / n,
            traffic=_to_or_from_root,
            composed=(P2P,),
            compose=p2pc.call_gather,
        ),
        Collective(
            "scatter",
            "scatter",
            reducing=False,
            rooted=True,
            kernels={},
            scaled=SEND,
            root_only=SEND,
            peer_accessed=(),
            bus_factor=lambda n: (n - 1) / n,
            traffic=_to_or_from_root,
            composed=(P2P,),
            compose=p2pc.call_scatter,
        ),
        Collective(
            "alltoallv",
            "alltoallv",
            reducing=False,
            rooted=False,
            kernels={},
            scaled=BOTH,
            root_only=None,
            peer_accessed=(),
            bus_factor=lambda n: (n - 1) / n,
            traffic=_exchange,
            composed=(P2P,),
            in_place_ok=False,
            compose=p2pc.call_alltoallv,
            pair_count=p2pc.pair_count,
        ),
        Collective(
            "sendrecv",
            "sendrecv",
            reducing=False,
            rooted=False,
            kernels={},
            scaled=None,
            root_only=None,
            peer_accessed=(),
            bus_factor=lambda n: 1.0,
            traffic=_shift,
            composed=(P2P,),
            in_place_ok=False,
            compose=p2pc.call_sendrecv,
            received_from=lambda rank, n: (rank - 1) % n,
        ),
        Collective(
            "hypercube",
            "hypercube",
            reducing=False,
            rooted=False,
            kernels={},
            scaled=RECV,
            root_only=None,
            peer_accessed=(),
            bus_factor=lambda n: 1.0,
            traffic=_copy_to_all,
            composed=(P2P,),
            compose=p2pc.call_hypercube,
            rank_refusal=p2pc.power_of_two_refusal,
            algbw_share=lambda n: (n - 1) / n,
            count_align=4,
        ),
    )
}
NAMES = tuple(CATALOGUE)
# The collectives with kernels of their own; the others are composed of sends and receives.
KERNEL_NAMES = tuple(c.name for c in CATALOGUE.values() if c.kernels)
ALGORITHMS = tuple(abi.ALGORITHM_CODES) + (HIERARCHICAL, P2P)


def _key(name: str) -> str:
    return str(name).strip().lower().replace("-", "").replace("_", "")


# Every spelling users type: commref's, nccl-tests' (all_reduce), and bcast.
_BY_KEY = {_key(n): c for c in CATALOGUE.values() for n in (c.name, c.nccl_tests_name)} | {
    "bcast": CATALOGUE["broadcast"]
}


def get(name: str) -> Collective:
    """The collective called `name` in commref's, nccl4py's or nccl-tests' spelling
    (allreduce, all_reduce, all-reduce); ValueError lists the choices."""
    spec = _BY_KEY.get(_key(name))
    if spec is not None:
        return spec
    raise ValueError(
        f"unknown collective {name!r}; choose from {', '.join(NAMES)} "
        f"(or nccl-tests' {', '.join(c.nccl_tests_name for c in CATALOGUE.values())})"
    )


def with_algorithm(algorithm: str) -> tuple[str, ...]:
    """The collectives that implement `algorithm`."""
    return tuple(c.name for c in CATALOGUE.values() if algorithm in c.algorithms)
