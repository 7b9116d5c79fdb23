"""Who talks to whom: the rings and the double binary tree, per channel, node-aware.

Every rank computes the same tables from the node of every rank and the channel count
(`nodes[r]`: any value that is equal for the ranks of one node; the communicator passes
(world.node, world.host) of every rank). Nodes are ordered by their lowest rank, the
ranks of a node by rank.

- Rings (`rings`): channel c's ring visits the ranks of each node consecutively, nodes in
  order, so it crosses each node boundary once; inside each node the ranks are rotated
  by c, so successive channels leave (and enter) a node of k > 1 ranks at different
  ranks (the pattern repeats every k channels). Position 0 of every ring is rank 0.
  With one node, or one rank per node on consecutive ranks, every ring is rank order.
- Trees (`double_binary_tree`): a double binary tree over the nodes (the second is the
  first shifted by one node), with a chain inside each node, its ranks in rank order.
  The chain's first rank (its head) has the link to the parent node; the links to the
  child nodes hang off the chain's last rank (its tail), so every rank keeps at most
  two children and each tree edge between two nodes is one link between one rank of
  each. (NCCL's tree has arity 3 instead: the head also takes the child nodes.) With
  one node the units of the tree are its ranks: the rank-level double binary tree (a
  chain would make the tree's depth n, not log n).

Device code reads the per-rank records as ChannelPeers (include/commref/args.h) and the
rank at each ring position as CollArgs.ringRanks (`ring_ranks`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from commref.device_kernels import abi

Tree = tuple[dict[int, int], dict[int, list[int]]]  # (parent of each rank, -1 for the root; children)


def node_groups(nodes: Sequence[Hashable]) -> list[list[int]]:
    """The ranks of each node, nodes ordered by their lowest rank."""
    groups: dict[Hashable, list[int]] = {}
    for r, n in enumerate(nodes):
        groups.setdefault(n, []).append(r)
    return list(groups.values())


def rings(groups: list[list[int]], nchannels: int) -> list[list[int]]:
    """The rank at each position of each channel's ring (module docstring)."""
    out = []
    for c in range(nchannels):
        order = [r for g in groups for r in g[c % len(g) :] + g[: c % len(g)]]
        start = order.index(min(order))
        out.append(order[start:] + order[:start])
    return out


def binary_tree(order: list[int]) -> Tree:
    """A balanced binary tree over `order` (in-order layout: the middle element is the
    root). Returns (parent of each element, -1 for the root; children of each element)."""
    parent: dict[int, int] = {}
    children: dict[int, list[int]] = {r: [] for r in order}

    def build(lo: int, hi: int, up: int) -> None:
        if lo >= hi:
            return
        mid = (lo + hi) // 2
        node = order[mid]
        parent[node] = up
        if up >= 0:
            children[up].append(node)
        build(lo, mid, node)
        build(mid + 1, hi, node)

    build(0, len(order), -1)
    return parent, children


def double_binary_tree(nranks: int, groups: list[list[int]] | None = None) -> list[Tree]:
    """Two spanning trees of the ranks (module docstring); `groups` (node_groups) default
    to one rank per node. Over units u = 0..m-1 (the nodes, or the ranks of a single
    node), the second unit tree is the first shifted by one unit, so that the leaves of
    one (every other unit in in-order layout) are inner units of the other."""
    if groups is None or len(groups) == 1:
        groups = [[r] for r in range(nranks)] if groups is None else [[r] for r in groups[0]]
    m = len(groups)
    trees = []
    for order in (list(range(m)), [(u + 1) % m for u in range(m)]):
        unit_parent, unit_children = binary_tree(order)
        chains = groups
        parent: dict[int, int] = {}
        children: dict[int, list[int]] = {r: [] for g in groups for r in g}
        for u, chain in enumerate(chains):
            up = unit_parent[u]
            parent[chain[0]] = chains[up][-1] if up >= 0 else -1
            for a, b in zip(chain, chain[1:]):
                parent[b] = a
                children[a].append(b)
            children[chain[-1]].extend(chains[v][0] for v in unit_children[u])
        trees.append((parent, children))
    return trees


def ring_ranks(nodes: Sequence[Hashable], nchannels: int) -> np.ndarray:
    """CollArgs.ringRanks: int32[nchannels, nranks], the rank at each position of each
    channel's ring."""
    return np.array(rings(node_groups(nodes), nchannels), dtype=np.int32).reshape(nchannels, len(nodes))


def channel_peers(rank: int, nodes: Sequence[Hashable], nchannels: int) -> np.ndarray:
    """ChannelPeers records for `rank`, one per channel (channel c uses tree c % 2);
    `nodes[r]` is rank r's node."""
    nranks = len(nodes)
    groups = node_groups(nodes)
    peers = np.zeros(abi.MAX_CHANNELS, dtype=abi.CHANNEL_PEERS)
    peers[:] = -1
    trees = double_binary_tree(nranks, groups)
    for c, ring in enumerate(rings(groups, nchannels)):
        p = peers[c]
        pos = ring.index(rank)
        p["ringPrev"] = ring[(pos - 1) % nranks]
        p["ringNext"] = ring[(pos + 1) % nranks]
        p["ringPos"] = pos
        parent, children = trees[c % 2]
        p["treeParent"] = parent[rank]
        kids = children[rank]
        p["treeChild0"] = kids[0] if len(kids) > 0 else -1
        p["treeChild1"] = kids[1] if len(kids) > 1 else -1
        if parent[rank] >= 0:
            idx = children[parent[rank]].index(rank)
            p["treeInAtParent"] = abi.IN_TREE_CHILD0 + idx
            p["treeOutAtParent"] = abi.OUT_TREE_CHILD0 + idx
    return peers
