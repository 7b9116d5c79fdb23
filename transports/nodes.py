"""A rank's node: what decides which ranks share a node (its LSA team). The host name,
unless ``$COMMREF_HOSTID`` overrides it or ``$COMMREF_NODES`` splits the job's ranks
into simulated nodes on one host."""

from __future__ import annotations

import os

__all__ = ["HOSTID_ENV", "NODES_ENV", "check_nodes", "node_of"]

HOSTID_ENV = "COMMREF_HOSTID"
NODES_ENV = "COMMREF_NODES"


def check_nodes(value, nranks: int) -> int:
    """`value` (the --nodes option, or COMMREF_NODES) as a node count from 1 to `nranks`;
    else ValueError with one line."""
    try:
        n = int(str(value).strip())
    except ValueError:
        n = 0
    if not 1 <= n <= nranks:
        raise ValueError(
            f"{NODES_ENV} (--nodes) must be an integer from 1 to the number of ranks ({nranks}), not {value!r}"
        )
    return n


def node_of(host: str, rank: int, size: int, environ=None) -> str:
    """This rank's node identity: what decides which ranks share a node (its LSA team).
    COMMREF_HOSTID when set (as NCCL_HOSTID overrides NCCL's host identity); else, with
    COMMREF_NODES=N, the job's ranks split into N simulated nodes of consecutive ranks on
    this host (rank r on node r * N // size: 5 ranks on 2 nodes are 3 + 2); else the host
    name. A bad COMMREF_NODES raises ValueError (one line)."""
    env = os.environ if environ is None else environ
    hostid = env.get(HOSTID_ENV, "").strip()
    if hostid:
        return hostid
    nodes = env.get(NODES_ENV, "").strip()
    if nodes:
        return f"{host}/node{rank * check_nodes(nodes, size) // size}"
    return host
