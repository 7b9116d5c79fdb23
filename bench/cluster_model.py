"""`commref model`: the performance model (collectives/model.py) extrapolated to a
described GPU cluster, with published NCCL figures beside it where there are any.

    commref model all_reduce --nodes 1 --gpus-per-node 8 -b 1M -e 8G -f 4
    commref model all_reduce --nodes 2 --network-rate 50G --network-latency 5us

A row per size: the algorithm and protocol the tuner would take there (the model's
argmin), the predicted time, algbw and busbw (nccl-tests' bus factor). What the
model assumes (printed with the table): every GPU reaches the others of its node over
one link (NVLink, or PCIe with --intra pcie) at its rate in each direction, and the
other nodes over a NIC of its own at --network-rate; memory runs at --memory-rate;
transfers overlap the memory work, as a GPU's links and SMs do; a flat ring across
nodes pays the network's latency at every step; no in-switch reduction (NVLS / SHARP),
no congestion, no protocol factor measured on a GPU (docs/performance.md, "The model on
a described cluster").
"""

from __future__ import annotations

import argparse

from commref.collectives import catalogue, tuner
from commref.collectives.calibration import GPU
from commref.collectives.hierarchical import NodeShape
from commref.collectives.model import CALL_PY_UNITS, Model, Paths
from commref.transports.option_types import RATE_UNITS, TIME_UNITS, OptionError, quantity

from . import plugins
from .arguments import sweep_sizes
from .flags import int_type, parse_size

# The collectives the model describes (their ring, tree, direct and hierarchical forms).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")

# Published busbw figures (GB/s, large sizes), what they were measured on, and where.
# Only figures found in this repository's sources are listed (docs/performance.md).
PUBLISHED = [
    {
        "collective": "allreduce",
        "nodes": 1,
        "gpus": 8,
        "intra": "nvlink",
        "busbw": (460.0, 480.0),
        "what": "8x H100 SXM5, NVLink 4 through NVSwitch, nccl-tests all_reduce_perf -b 8 -e 8G -f 2 -g 8",
        "source": "Alaya NeW, 'NCCL-tests in practice' (2026), reference table: "
        "https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests (third-party, not NVIDIA)",
    },
    {
        "collective": "allreduce",
        "nodes": 1,
        "gpus": 8,
        "intra": "pcie",
        "busbw": (35.0, 45.0),
        "what": "8x H100 PCIe, no NVSwitch",
        "source": "the same table (third-party)",
    },
]


def _rate(what: str):
    def parse(text: str) -> float:
        try:
            value = quantity(text, what, RATE_UNITS, "bytes/s, e.g. 450G")
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{what} must be above 0 bytes/s, not {text!r}")
        return value

    return parse


def _latency(what: str):
    def parse(text: str) -> float:
        try:
            return quantity(text, what, TIME_UNITS, "seconds, e.g. 2us")
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _collective(text: str) -> str:
    try:
        name = plugins.get(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if name not in COLLECTIVES:
        raise argparse.ArgumentTypeError(f"the model describes {', '.join(COLLECTIVES)}, not {text!r}")
    return name


# The links a described cluster has: (name, default bytes/s one direction, its help,
# default latency in seconds); each gives --NAME-rate and --NAME-latency.
LINKS = (
    ("nvlink", 450e9, "bytes/s of a GPU's NVLink, one direction (default 450G: NVLink 4's 900 GB/s both ways)", 1e-6),
    ("pcie", 64e9, "bytes/s, one direction (default 64G: Gen5 x16)", 2e-6),
    ("network", 50e9, "bytes/s of each GPU's NIC (default 50G: 400 Gb/s)", 5e-6),
)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("collective", nargs="?", default="all_reduce", type=_collective, help=", ".join(COLLECTIVES))
    p.add_argument("--nodes", type=int_type(1, 1 << 16), default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int_type(1, 1024), default=8, help="GPUs per node (default 8)")
    p.add_argument(
        "--intra", choices=("nvlink", "pcie"), default="nvlink", help="the GPUs' link inside a node (default nvlink)"
    )
    for link, rate, rate_help, latency in LINKS:
        p.add_argument(f"--{link}-rate", type=_rate(f"--{link}-rate"), default=rate, help=rate_help)
        default_us = f"default {latency * 1e6:g}us"
        p.add_argument(f"--{link}-latency", type=_latency(f"--{link}-latency"), default=latency, help=default_us)
    p.add_argument(
        "--memory-rate", type=_rate("--memory-rate"), default=3e12, help="bytes/s of a GPU's memory (default 3T)"
    )
    p.add_argument(
        "--launch", type=_latency("--launch"), default=5e-6, help="fixed cost of one call, seconds (default 5us)"
    )
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"), help="first size (default 8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("8G"), help="last size (default 8G)")
    p.add_argument("-f", "--stepfactor", type=int, default=8, help="multiply the size by this (default 8)")
    return p


def validate(args) -> None:
    sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, 0)
    if args.nodes * args.gpus_per_node < 2:
        raise ValueError("the cluster needs at least 2 GPUs (--nodes x --gpus-per-node)")


def cluster_model(args) -> tuple[Model, int]:
    """The model of the described cluster and its ranks."""
    nvlink = args.intra == "nvlink"
    cal = GPU.replace(
        py_unit_s=args.launch / CALL_PY_UNITS,
        launch_s=args.launch,
        cached_Bps=args.memory_rate,
        dram_Bps=args.memory_rate,
        hop_s=args.nvlink_latency if nvlink else args.pcie_latency,
        link_Bps=args.nvlink_rate if nvlink else args.pcie_rate,
        gin_op_s=args.network_latency,
        gin_Bps=args.network_rate,
        cores=args.gpus_per_node,
        source="described",
    )
    paths = Paths(gin=args.nodes > 1, nodes=args.nodes, local_ranks=args.gpus_per_node, device="cuda")
    return Model(cal, paths), args.nodes * args.gpus_per_node


def rows(args) -> list[dict]:
    """A row per size: the model's choice, time, algbw and busbw."""
    m, n = cluster_model(args)
    spec = catalogue.get(plugins.get(args.collective).coll)
    plugin = plugins.get(args.collective)
    nodes = NodeShape(args.nodes, args.gpus_per_node, 0, 0) if args.nodes > 1 and args.gpus_per_node > 1 else None
    out = []
    for size in sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, 0):
        algorithms = tuner.auto_algorithms(spec, n, False, nodes, "auto")
        a, p, _ = m.best(spec.name, size, n, algorithms, tuner.PROTOCOLS, 1)
        t = m.time(spec.name, a, p, size, n)
        algbw = size / t / 1e9
        out.append(
            {
                "size": size,
                "algorithm": a,
                "protocol": p,
                "time_us": t * 1e6,
                "algbw": algbw,
                "busbw": algbw * plugin.bus_factor(n),
            }
        )
    return out


def published(args) -> list[dict]:
    coll = catalogue.get(plugins.get(args.collective).coll).name
    return [
        f
        for f in PUBLISHED
        if (f["collective"], f["nodes"], f["gpus"], f["intra"]) == (coll, args.nodes, args.gpus_per_node, args.intra)
    ]


def run(args) -> int:
    table = rows(args)
    m, n = cluster_model(args)
    c = m.calibration
    link = "NVLink" if args.intra == "nvlink" else "PCIe"
    print(f"# commref model {args.collective}: {args.nodes} node(s) x {args.gpus_per_node} GPUs = {n} ranks")
    print(
        f"# Assumed: {link} {c.link_Bps / 1e9:g} GB/s per GPU each way, {c.hop_s * 1e6:g} us a step; "
        + (f"network {c.gin_Bps / 1e9:g} GB/s per GPU, {c.gin_op_s * 1e6:g} us a step; " if args.nodes > 1 else "")
        + f"memory {c.cached_Bps / 1e9:g} GB/s; a call {args.launch * 1e6:g} us; transfers overlap memory work; "
        "no in-switch reduction (NVLS/SHARP), no congestion, no GPU-measured protocol factors"
    )
    print(f"# {'size':>12}  {'algorithm':>12}  {'protocol':>8}  {'time (us)':>10}  {'algbw':>8}  {'busbw':>8}")
    for r in table:
        print(
            f"  {r['size']:12d}  {r['algorithm']:>12}  {r['protocol']:>8}  {r['time_us']:10.2f}  "
            f"{r['algbw']:8.2f}  {r['busbw']:8.2f}"
        )
    figures = published(args)
    if not figures:
        print("# Published NCCL figures: none found for this cluster (docs/performance.md lists the ones used)")
    for f in figures:
        lo, hi = f["busbw"]
        best = max(r["busbw"] for r in table)
        print(
            f"# Published: {f['what']}: busbw {lo:g}-{hi:g} GB/s at large sizes; the model's largest busbw "
            f"here {best:.1f} GB/s ({best / hi:.2f}-{best / lo:.2f} of it); source: {f['source']}"
        )
    return 0
