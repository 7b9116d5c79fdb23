"""The collectives the harness can sweep, one plugin per file (nccl-tests' layout).

Names are nccl-tests' (all_reduce, all_gather, reduce_scatter, broadcast, reduce);
commref's and nccl4py's spellings (allreduce, allgather) are accepted too.
"""

from __future__ import annotations

from .all_gather import AllGather
from .all_reduce import AllReduce
from .base import Buffers, Collective, Counts, Memory, SymmetricMemory
from .broadcast import Broadcast
from .reduce import Reduce
from .reduce_scatter import ReduceScatter

PLUGINS: dict[str, Collective] = {p.name: p for p in (AllReduce(), AllGather(), ReduceScatter(), Broadcast(),
                                                      Reduce())}
ALIASES = {p.coll: p.name for p in PLUGINS.values()} | {"reducescatter": "reduce_scatter", "bcast": "broadcast"}


def get(name: str) -> Collective:
    """The plugin for `name` in either spelling; ValueError names the choices."""
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in PLUGINS:
        raise ValueError(f"unknown collective {name!r}; choose one of {', '.join(PLUGINS)}")
    return PLUGINS[key]


__all__ = ["PLUGINS", "ALIASES", "get", "Collective", "Counts", "Buffers", "Memory", "SymmetricMemory"]
