"""Who talks to whom: the ring and the double binary tree, per channel.

Device code reads these as ChannelPeers records (include/commref/args.h). Every rank
computes the same tables from (nranks, nchannels) alone.
"""

from __future__ import annotations

import numpy as np

from commref.device_kernels import abi


def binary_tree(order: list[int]) -> tuple[dict[int, int], dict[int, list[int]]]:
    """A balanced binary tree over `order` (in-order layout: the middle element is the
    root). Returns (parent of each rank, -1 for the root; children of each rank)."""
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


def double_binary_tree(nranks: int) -> list[tuple[dict[int, int], dict[int, list[int]]]]:
    """Two trees; the second is the first shifted by one rank, so that the leaves of
    one (every other rank in in-order layout) are inner nodes of the other."""
    first = list(range(nranks))
    second = [(i + 1) % nranks for i in range(nranks)]
    return [binary_tree(first), binary_tree(second)]


def channel_peers(rank: int, nranks: int, nchannels: int) -> np.ndarray:
    """ChannelPeers records for `rank`, one per channel (channel c uses tree c % 2)."""
    peers = np.zeros(abi.MAX_CHANNELS, dtype=abi.CHANNEL_PEERS)
    peers[:] = -1
    trees = double_binary_tree(nranks)
    for c in range(nchannels):
        p = peers[c]
        p["ringPrev"] = (rank - 1) % nranks
        p["ringNext"] = (rank + 1) % nranks
        parent, children = trees[c % 2]
        p["treeParent"] = parent[rank]
        kids = children[rank]
        p["treeChild0"] = kids[0] if len(kids) > 0 else -1
        p["treeChild1"] = kids[1] if len(kids) > 1 else -1
        if parent[rank] >= 0:
            idx = children[parent[rank]].index(rank)
            p["treeInAtParent"] = abi.IN_TREE_CHILD0 + idx
            p["treeOutAtParent"] = abi.OUT_TREE_CHILD0 + idx
        p["pad"] = 0
    return peers
