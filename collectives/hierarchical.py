"""Hierarchical collectives (algorithm "hierarchical"): inside a node over LSA, across
nodes over GIN, so that only 1/L of the data crosses the network.

The job is N nodes of L ranks each, the ranks of a node consecutive (world rank =
node * L + local; mpirun's default placement, and COMMREF_NODES'). Two child
communicators, split from the world:

    intra   the L ranks of this rank's node (LSA where the window is mapped)
    inter   the N ranks with this rank's local index, one per node (GIN)

and each collective is a short sequence of their calls (c = count, l = local index):

    AllReduce      c' = c // L, m = L * c'
                   1. intra ReduceScatter  send[:m] -> recv[l c' : (l+1) c']
                   2. inter AllReduce      that shard, in place
                   3. intra AllGather      that shard -> recv[:m], in place
                   the last c - m (< L) elements by the flat algorithm
    ReduceScatter  1. for each node j: intra ReduceScatter of send's node-j segment
                      (L * c elements) -> scratch[j c : (j+1) c]
                   2. inter ReduceScatter  scratch -> recv
    AllGather      1. inter AllGather      send -> scratch (N blocks: node j's rank
                      with this local index at j)
                   2. for each node j: intra AllGather scratch block j -> recv's
                      node-j segment (L blocks)

Every byte crosses the network once per node pair it must reach (the inter phase
moves 1/L of what a flat ring's GIN hops move per rank), and inside the node the
child picks its own algorithm: a direct kernel where the buffers are symmetric
(Communicator.alloc_symmetric on a communicator with a hierarchy allocates in the
intra communicator's windows, which the node's ranks map).

avg: the phases reduce with sum and the last reducing phase divides once by the
whole job's ranks (CollArgs.avgDivisor), so integers truncate once, as the flat
algorithms do. In place follows NCCL's layouts throughout: every phase's buffers are
either disjoint or in that phase's in-place layout.

This is a composition of launches, not one fused LSA x GIN kernel: the phases run one
after the other on the calling thread (CPU) or in stream order (GPU: each child joins
the caller's stream), so a phase's inter-node traffic does not overlap the next
phase's intra-node work.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

HIERARCHICAL = "hierarchical"


@dataclass(frozen=True)
class NodeShape:
    """Where this rank sits in a job of `nodes` nodes of `per_node` consecutive ranks."""

    nodes: int
    per_node: int
    node: int  # this rank's node (index in rank order)
    local: int  # this rank's index inside its node


def node_shape(nodes: list, rank: int) -> NodeShape | str:
    """This rank's NodeShape from every rank's node identity (windows.rank_nodes), or
    why the hierarchical algorithm cannot run on this job (a sentence)."""
    order = list(dict.fromkeys(nodes))
    sizes = [nodes.count(n) for n in order]
    if len(order) < 2:
        return "it needs ranks on several nodes (this job is one node)"
    if min(sizes) < 2:
        return f"it needs several ranks on every node (ranks per node: {sizes})"
    if len(set(sizes)) > 1:
        return f"it needs the same number of ranks on every node (ranks per node: {sizes})"
    per_node = sizes[0]
    if any(nodes[r] != order[r // per_node] for r in range(len(nodes))):
        return "it needs the ranks of each node to be consecutive (place ranks by node, as mpirun does by default)"
    return NodeShape(len(order), per_node, rank // per_node, rank % per_node)


class Hierarchy:
    """The hierarchical collectives of one rank over its `intra` and `inter` child
    communicators (Communicator builds them: split worlds, the parent's options).
    Calls take flat arrays (numpy or CuPy) already validated by the parent, and the
    parent's flat AllReduce for the tail that does not split into L shards."""

    def __init__(self, shape: NodeShape, intra, inter, nranks: int):
        self.shape, self.intra, self.inter, self.nranks = shape, intra, inter, nranks
        self._scratch = None  # CPU: reused across calls (launches are synchronous there)

    def close(self) -> None:
        for child in (self.inter, self.intra):
            child.close()  # each frees its split world

    def _phase(self, what: str, child, fn, *args, **kwargs) -> None:
        """One phase's call on `child`; a failure gets a note naming the phase and the
        child's ranks by their rank in the job."""
        try:
            fn(*args, **kwargs)
        except Exception as e:
            e.add_note(
                f"in the hierarchical algorithm's {what} (child communicator of job ranks "
                f"{child.world.members}; its rank k is job rank members[k])"
            )
            raise

    def scratch(self, xp, count: int, dtype, stream=None) -> object:
        """`count` elements of `dtype` the phases may use until their kernels end.

        GPU: taken from CuPy's pool on the stream the phases are ordered by, the call's
        `stream` (None: the current one; a CuPy stream or a CUstream handle). The array is
        freed when the call returns, while the phases may still run; the pool hands a freed
        block only to later allocations on the stream it was allocated on, and every phase
        joined that stream (Communicator.enqueue: the stream waits for the phase's done
        event), so its next user runs after them. Allocated on another stream (the current
        one, when the caller passed stream=), the block could go to an allocation whose
        kernels run while the phases still read it."""
        if xp is not np:
            with _on_stream(xp, stream):
                return xp.empty(count, dtype)
        nbytes = count * np.dtype(dtype).itemsize
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch[:nbytes].view(dtype)

    def allreduce(self, send, recv, op: str, stream, flat) -> None:
        L, l, count = self.shape.per_node, self.shape.local, recv.size  # noqa: E741 (L ranks per node, l this rank: the docs' names)
        shard = count // L
        if shard == 0:  # fewer elements than ranks per node: the flat algorithm
            flat(send, recv)
            return
        m, reducing, divisor = L * shard, _phase_op(op), self._divisor(op)
        mine = recv[l * shard : (l + 1) * shard]
        self._phase(
            "intra-node ReduceScatter", self.intra, self.intra.reduce_scatter, send[:m], mine, reducing, stream=stream
        )
        self._phase(
            "inter-node AllReduce",
            self.inter,
            self.inter._collective,
            "allreduce",
            mine,
            mine,
            op,
            0,
            stream,
            None,
            None,
            divisor,
        )
        self._phase("intra-node AllGather", self.intra, self.intra.allgather, mine, recv[:m], stream=stream)
        if m < count:
            flat(send[m:], recv[m:])

    def reduce_scatter(self, send, recv, op: str, stream, xp) -> None:
        N, L, count = self.shape.nodes, self.shape.per_node, recv.size
        partial = self.scratch(xp, N * count, recv.dtype, stream)
        for j in range(N):
            self._phase(
                f"intra-node ReduceScatter of node {j}'s blocks",
                self.intra,
                self.intra.reduce_scatter,
                send[j * L * count : (j + 1) * L * count],
                partial[j * count : (j + 1) * count],
                _phase_op(op),
                stream=stream,
            )
        self._phase(
            "inter-node ReduceScatter",
            self.inter,
            self.inter._collective,
            "reduce_scatter",
            partial,
            recv,
            op,
            0,
            stream,
            None,
            None,
            self._divisor(op),
        )

    def allgather(self, send, recv, stream, xp) -> None:
        N, L, count = self.shape.nodes, self.shape.per_node, send.size
        blocks = self.scratch(xp, N * count, send.dtype, stream)
        self._phase("inter-node AllGather", self.inter, self.inter.allgather, send, blocks, stream=stream)
        for j in range(N):
            self._phase(
                f"intra-node AllGather of node {j}'s blocks",
                self.intra,
                self.intra.allgather,
                blocks[j * count : (j + 1) * count],
                recv[j * L * count : (j + 1) * L * count],
                stream=stream,
            )

    def _divisor(self, op: str) -> int | None:
        """avg's one division, by the job's ranks, in the last reducing phase."""
        return self.nranks if op == "avg" else None


def _on_stream(cupy, stream):
    """A context in which `stream` (a CuPy stream, a CUstream handle, or None: the
    current one) is CuPy's current stream."""
    if stream is None:
        return contextlib.nullcontext()
    if isinstance(stream, int):
        return cupy.cuda.ExternalStream(stream)
    return stream


def _phase_op(op: str) -> str:
    """The op of the phases before the last reducing one (avg sums until then)."""
    return "sum" if op == "avg" else op
