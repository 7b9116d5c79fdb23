"""The series of a sweep: every configuration the flags ask for, measured side by side
(a path, and for GIN its backend, wire, network and signal protocol; -R, --algorithm,
--protocol, --stream-stores), the Communicator options of each, and the hierarchical
algorithm's teams beside them.

--path lsa,gin,auto (and for GIN --backend, --wire, --network, --gin-protocol, each a
comma-separated list) measures every combination side by side, one row per size and
configuration; the path column names the configuration and what carries its bytes. A
combination the machine cannot set up (a backend without the asked-for wire) is
skipped with its reason; options this build's Communicator does not take are refused
before any rank starts (NotAvailable).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from dataclasses import dataclass
from typing import Any

from commref.collectives.options import KEYWORDS
from commref.transports.gin.options import default_path


class NotAvailable(ValueError):
    """An option names something commref does not have yet."""


@dataclass(frozen=True)
class Series:
    """One configuration measured side by side with the others: a path, and for GIN
    its backend, wire, network and signal protocol (None: Communicator's default)."""

    path: str
    backend: str | None = None
    wire: str | None = None
    network: str | None = None
    gin_protocol: str | None = None
    wire_rate: str | None = None  # the wire model (GinOptions.wire_rate, wire_latency)
    wire_latency: str | None = None
    wire_paths: str | None = None  # the unordered wire's spraying (GinOptions.wire_paths)
    fault: str | None = None  # a lossy link under the wire (GinOptions.fault)
    register: int = 0  # -R: 0 plain buffers, 2 symmetric
    stores: str | None = None  # --stream-stores (None: Communicator's default, auto)
    algorithm: str = "auto"
    protocol: str = "auto"  # of the ring and tree steps (--protocol)
    # Whose ranks run it: "job" (every rank), or with several nodes "intra-node" (each
    # node's ranks, over LSA) or "inter-node" (one rank per node, over GIN), the
    # hierarchical algorithm's two child communicators, all teams at once.
    team: str = "job"

    @property
    def label(self) -> str:
        parts = [self.path] + [
            f"{k.removeprefix('wire_')}-{v}" if k in MODEL_FLAGS else str(v) for k, v in self.gin_options().items()
        ]
        return "/".join(
            ([self.team] if self.team != "job" else [])
            + parts
            + ([self.algorithm] if self.algorithm != "auto" else [])
            + ([self.protocol] if self.protocol != "auto" else [])
            + (["sym"] if self.register == 2 else [])
            + ([f"stores-{self.stores}"] if self.stores else [])
        )

    def gin_options(self) -> dict:
        """The GIN fields that are set, in declaration order (GIN_FLAGS' names)."""
        return {k: getattr(self, k) for k in GIN_FLAGS if getattr(self, k) is not None}


GIN_FLAGS = {
    "backend": "--backend",
    "wire": "--wire",
    "network": "--network",
    "gin_protocol": "--gin-protocol",
    "wire_rate": "--wire-rate",
    "wire_latency": "--wire-latency",
    "wire_paths": "--wire-paths",
    "fault": "--fault",
}
MODEL_FLAGS = ("wire_rate", "wire_latency", "wire_paths", "fault")


def series_of(args) -> list[Series]:
    """Every configuration the flags ask for. LSA takes no GIN options; gin and auto
    are crossed with every backend, wire, network and protocol given."""
    out = []
    for register, stores, algorithm, protocol in itertools.product(
        getattr(args, "local_register", None) or [0],
        getattr(args, "stream_stores", None) or [None],
        algorithms_of(args),
        protocols_of(args),
    ):
        for path in paths_of(args):
            if path == "lsa":
                out.append(Series("lsa", register=register, stores=stores, algorithm=algorithm, protocol=protocol))
                continue
            for combo in itertools.product(*[getattr(args, k, None) or [None] for k in GIN_FLAGS]):
                out.append(
                    Series(path, *combo, register=register, stores=stores, algorithm=algorithm, protocol=protocol)
                )
    if any(getattr(args, k, None) for k in GIN_FLAGS) and all(s.path == "lsa" for s in out):
        raise NotAvailable(f"{', '.join(GIN_FLAGS.values())} choose GIN transports; add --path gin (or auto)")
    return list(dict.fromkeys(out))


def paths_of(args) -> list[str]:
    """--path, or where it was left out the default for the job's nodes."""
    return getattr(args, "path", None) or [default_path(getattr(args, "nodes", None)).value]


def algorithms_of(args) -> list[str]:
    """--algorithm as a list (one word where args were built by hand; auto where left out)."""
    value = getattr(args, "algorithm", None) or ["auto"]
    return [value] if isinstance(value, str) else list(value)


def protocols_of(args) -> list[str]:
    """--protocol as a list (one word where args were built by hand; auto where left out)."""
    value = getattr(args, "protocol", None) or ["auto"]
    return [value] if isinstance(value, str) else list(value)


def team_series(series: Series, comm) -> list[tuple[Series, Any]]:
    """With several nodes that can run the hierarchical algorithm: the intra-node and
    inter-node rows beside `series` (the first on a path that crosses nodes), run on
    its communicator's two child communicators; else none."""
    from commref.collectives.hierarchical import NodeShape

    if series.path == "lsa" or not isinstance(getattr(comm, "node_shape", None), NodeShape):
        return []
    h = comm.hierarchy()
    base = dataclasses.replace(series, algorithm="auto")
    return [
        (dataclasses.replace(base, team="intra-node"), h.intra),
        (dataclasses.replace(base, team="inter-node"), h.inter),
    ]


def communicator_kwargs(args, series: Series) -> dict:
    """Communicator options for `series`. Raises NotAvailable when this build's
    Communicator does not take an option the series needs (its signature says which,
    so a path works here as soon as Communicator offers it)."""
    from commref.collectives.communicator import Communicator

    kw: dict[str, Any] = {
        "algorithm": series.algorithm,
        "max_channels": args.channels,
        "slot_bytes": args.slot_bytes,
        "threads": args.threads,
    }
    if series.stores:
        kw["stream_stores"] = series.stores
    if series.protocol != "auto":  # auto: the Communicator's default (COMMREF_PROTO, else auto)
        kw["protocol"] = series.protocol
    if series.path == "lsa":
        return kw
    wanted = {"path": series.path, **series.gin_options()}
    params = inspect.signature(Communicator).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        params = {**params, **KEYWORDS}  # Communicator(world, device, **kwargs): CommOptions' keywords
    missing = [k for k in wanted if k not in params]
    if missing:
        flags = " ".join(f"{GIN_FLAGS.get(k, '--' + k)} {wanted[k]}" for k in wanted)
        raise NotAvailable(
            f"{flags} is not available yet: this commref's Communicator has no "
            f"{', '.join(missing)} option; use --path lsa"
        )
    kw.update(wanted)
    if "seed" in params:
        kw["seed"] = args.seed  # the unordered wire's seed: runs are reproducible
    return kw


def series_link(comm, link: str) -> str:
    """The path column's link for one series: the GIN network when GIN carries some
    peers, else what carries LSA traffic."""
    network = getattr(comm, "network", None)
    return network if isinstance(network, str) and getattr(comm, "peer_mask", 0) else link
