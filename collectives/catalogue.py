"""The collective catalogue: one description per collective.

Everything commref knows about a collective that is not an algorithm lives here: its
names (commref's and nccl4py's, nccl-tests'), whether it reduces and whether it has a
root, the algorithms implemented for it and their kernels, the sizes of its buffers
and NCCL's in-place layout, which buffers the direct kernels access on peers, and
the bandwidth factors of nccl-tests. The Communicator's validation, the tuner, the
verification references, `commref check` and the benchmark plugins derive from it;
nothing else branches on a collective's name. Adding a collective is an entry here,
a kernel and a test.

Counts follow NCCL: `count` is the count NCCL's call takes (per-rank recvcount for
reduce_scatter, per-rank sendcount for allgather, per-peer count for alltoall); the
buffer named by `scaled` holds nranks * count elements, the other count elements
(BOTH: each buffer holds nranks * count, block j of sendbuf going to rank j).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from commref.device_kernels import abi

from .hierarchical import HIERARCHICAL

SEND, RECV = "sendbuf", "recvbuf"
BOTH = "sendbuf and recvbuf"  # Collective.scaled of a personalized exchange (alltoall)


@dataclass(frozen=True)
class Collective:
    name: str  # commref's and nccl4py's method name: allreduce
    nccl_tests_name: str  # all_reduce
    reducing: bool
    rooted: bool
    kernels: Mapping[str, str]  # algorithm -> kernel entry point (abi.KERNEL_NAMES); ring first
    scaled: str | None  # the buffer of nranks * count elements (SEND, RECV, BOTH), or None: both count
    root_only: str | None  # the buffer only the root passes (others' is ignored), if any
    peer_accessed: tuple[str, ...]  # buffers the direct kernel loads from or stores to on peers
    bus_factor: Callable[[int], float]  # nccl-tests' busbw = algbw * bus_factor(nranks)
    # (copy bytes, add bytes) one rank must at least move for a call whose larger buffer
    # is `size` bytes, out of place or in place (bench/bound.py).
    bound_bytes: Callable[[int, int, bool], tuple[int, int]]
    # Algorithms made of other calls rather than one kernel: "hierarchical" (hierarchical.py).
    composed: tuple[str, ...] = ()
    # Whether NCCL defines an in-place form (in_place_layout); False: overlapping buffers
    # are refused, and check and bench run out of place only.
    in_place_ok: bool = True

    @property
    def algorithms(self) -> tuple[str, ...]:
        return tuple(self.kernels) + self.composed

    def counts(self, count: int, nranks: int) -> tuple[int, int]:
        """(sendbuf, recvbuf) elements of a call of NCCL count `count`."""
        return ((count * nranks if self.scaled in (SEND, BOTH) else count),
                (count * nranks if self.scaled in (RECV, BOTH) else count))

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
        nccl4py's method names and argument order)."""
        method = getattr(comm, self.name)
        self.call_form(functools.partial(method, **kwargs) if kwargs else method, sendbuf, recvbuf, op, root)

    @property
    def call_form(self) -> Callable[..., None]:
        """f(method, sendbuf, recvbuf, op, root) calls `method` with this collective's
        arguments in nccl4py's order (sendbuf, recvbuf[, op][, root])."""
        return _CALL_FORMS[self.reducing, self.rooted]

    def buffers(self, mem, x, count: int, rank: int, nranks: int, in_place: bool) -> "CallBuffers":
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
_CALL_FORMS = {
    (False, False): lambda f, s, r, op, root: f(s, r),
    (True, False): lambda f, s, r, op, root: f(s, r, op),
    (False, True): lambda f, s, r, op, root: f(s, r, root),
    (True, True): lambda f, s, r, op, root: f(s, r, op, root),
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


def _reduce_bound(size: int, nranks: int, in_place: bool = False) -> tuple[int, int]:
    # Reduce this rank's 1/n shard from the n inputs, then fetch the other shards.
    share = (nranks - 1) * size // nranks
    return share, share


CATALOGUE: dict[str, Collective] = {c.name: c for c in (
    Collective(
        "allreduce", "all_reduce", reducing=True, rooted=False,
        kernels={"ring": "commref_ring_allreduce", "tree": "commref_tree_allreduce",
                 "direct": "commref_direct_allreduce"},
        scaled=None, root_only=None, peer_accessed=(SEND, RECV),
        bus_factor=lambda n: 2 * (n - 1) / n, bound_bytes=_reduce_bound, composed=(HIERARCHICAL,)),
    Collective(
        "allgather", "all_gather", reducing=False, rooted=False,
        kernels={"ring": "commref_ring_allgather", "direct": "commref_direct_allgather"},
        scaled=RECV, root_only=None, peer_accessed=(RECV,),
        bus_factor=lambda n: (n - 1) / n,
        # Land the n - 1 other ranks' shards in this rank's recvbuf, and out of place
        # this rank's own shard too.
        bound_bytes=lambda size, n, in_place=False: (((n - 1) * size // n if in_place else size), 0),
        composed=(HIERARCHICAL,)),
    Collective(
        "reduce_scatter", "reduce_scatter", reducing=True, rooted=False,
        kernels={"ring": "commref_ring_reduce_scatter", "direct": "commref_direct_reduce_scatter"},
        scaled=SEND, root_only=None, peer_accessed=(SEND,),
        bus_factor=lambda n: (n - 1) / n,
        # Reduce this rank's 1/n shard from the n inputs.
        bound_bytes=lambda size, n, in_place=False: (0, (n - 1) * size // n), composed=(HIERARCHICAL,)),
    Collective(
        "broadcast", "broadcast", reducing=False, rooted=True,
        kernels={"ring": "commref_ring_broadcast"},
        scaled=None, root_only=SEND, peer_accessed=(),
        bus_factor=lambda n: 1.0,
        # A non-root rank lands all of the root's bytes.
        bound_bytes=lambda size, n, in_place=False: (size, 0)),
    Collective(
        "reduce", "reduce", reducing=True, rooted=True,
        kernels={"ring": "commref_ring_reduce"},
        scaled=None, root_only=RECV, peer_accessed=(),
        bus_factor=lambda n: 1.0,
        # Work spread evenly: reduce a 1/n shard from the n inputs; the root gathers the rest.
        bound_bytes=_reduce_bound),
    Collective(
        "alltoall", "alltoall", reducing=False, rooted=False,
        kernels={"ring": "commref_ring_alltoall", "direct": "commref_direct_alltoall"},
        scaled=BOTH, root_only=None, peer_accessed=(RECV,),
        bus_factor=lambda n: (n - 1) / n,
        # Land the n - 1 other ranks' blocks in this rank's recvbuf, and its own block.
        bound_bytes=lambda size, n, in_place=False: (size, 0),
        # NCCL defines no in-place alltoall (its in-place page names the other
        # collectives only) and nccl-tests does not check its in-place column.
        in_place_ok=False),
)}
NAMES = tuple(CATALOGUE)
ALGORITHMS = tuple(abi.ALGORITHM_CODES) + (HIERARCHICAL,)


def _key(name: str) -> str:
    return str(name).strip().lower().replace("-", "").replace("_", "")


# Every spelling users type: commref's, nccl-tests' (all_reduce), and bcast.
_BY_KEY = {_key(n): c for c in CATALOGUE.values() for n in (c.name, c.nccl_tests_name)} | {
    "bcast": CATALOGUE["broadcast"]}


def get(name: str) -> Collective:
    """The collective called `name` in commref's, nccl4py's or nccl-tests' spelling
    (allreduce, all_reduce, all-reduce); ValueError lists the choices."""
    spec = _BY_KEY.get(_key(name))
    if spec is not None:
        return spec
    raise ValueError(f"unknown collective {name!r}; choose from {', '.join(NAMES)} "
                     f"(or nccl-tests' {', '.join(c.nccl_tests_name for c in CATALOGUE.values())})")


def with_algorithm(algorithm: str) -> tuple[str, ...]:
    """The collectives that implement `algorithm`."""
    return tuple(c.name for c in CATALOGUE.values() if algorithm in c.algorithms)
