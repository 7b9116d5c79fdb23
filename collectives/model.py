"""The performance model: the predicted time of a call, from which the tuner takes every
choice (tuner.plan: algorithm, protocol, channels).

    t = call + steps x step latency + bytes through memory / memory rate
             + bytes over GIN / GIN rate + (channels - 1) x channel start

in the style of NCCL's tuning model (alpha-beta per step: for each algorithm and
protocol the number of dependent steps and the bytes each rank moves, protocol factors
on both, per-path rates). The terms (calibration.py): `call` the Python side of a call
and its launch; a step's latency a hop between cores over LSA (a rank's flag seen by a
rank spinning on another core; plus the scheduler's turn where ranks share cores) or
a GIN operation (kernel -> engine -> peer; plus the wire model's latency and per-op
cost where one is set); memory at the rate one core copies at the call's footprint
(the cache's rate up to half the last-level cache, memory's from twice it) times
the algorithm's efficiency, shared by the ranks of a core; GIN at the engine's rate,
or the wire model's where slower. `Paths` says where a communicator's peers are,
`Model.time` is the prediction, `Model.best` the argmin the tuner takes.

Steps and bytes per rank for n ranks and a call of S bytes (the larger buffer), ring
AllReduce: 2(n - 1) steps, 2(n - 1)/n S over the wire, (6(n - 1) + 2)/n S through
memory (each step loads its FIFO slot and its own input and stores the next slot; the
last stores the output); the others in Model._shape. The direct kernels move
catalogue.Traffic's least bytes (every peer's part loaded once, stored once) and pay
DIRECT_HOPS; the double binary tree 2 ceil(log2 n) steps and TREE_MEMORY S; the
hierarchical algorithm is its three phases' sum (intra-node reduce-scatter over LSA,
inter-node all-reduce of S / L over GIN, intra-node all-gather), each a call, times
HIERARCHICAL_PHASES on the CPU engine (where it was fitted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import catalogue
from .calibration import REFERENCE, Calibration, host_calibration

# The Python side of one collective call, in PY_UNITs of calibration.py (fitted on the
# reference host: an 8-byte AllReduce on 2 ranks took 1.1-1.2 us, 2 hops of it).
CALL_PY_UNITS = 2.5
# The fraction of the stream copy's rate that each kind of traffic runs at: the ring's
# FIFO hand-offs cross cores (a line another core wrote: fitted to 128 KiB-2 MiB
# AllReduce on 2 ranks), the direct kernels' loads of every peer's buffer (fitted: 16 MiB
# AllReduce, ring 1.68x direct, docs/performance.md).
FIFO_EFFICIENCY = 0.41
DIRECT_EFFICIENCY = 0.95
# Where ranks share a core, a rank spinning for its peer holds the core its peer needs:
# in-cache work runs this much slower again (fitted: --np 4 on 2 cores).
SPIN_PENALTY = 1.2
# Where ranks share a core over GIN, each rank's engine is a thread of its own beside its
# kernel, and a hop waits twice (kernel -> its engine -> the peer's kernel) for a turn
# among twice as many threads: this many scheduler turns per hop instead of one (fitted:
# --np 4 --path gin on 2 cores, 8 B-8 KiB AllReduce, 4 tree steps: a median of 40 us a
# call over 3 runs, 28-70 us).
GIN_SHARED_SWITCHES = 4
DIRECT_HOPS = 4  # the direct kernels' handshake and two barriers
# S through memory per rank of the double binary tree AllReduce: its levels hand a step
# on one after the other, so it moves more than its bytes say (fitted: 32-128 KiB on 4 ranks).
TREE_MEMORY = 10.0
# FIFO hand-offs of at least STREAMED_HANDOFF_BYTES are streamed past the cache (move.h)
# and, below the store chooser's sizes (tuner.STORE_CHOOSER_MIN_BYTES), always: the
# reader then takes them from memory, at the DRAM rate.
STREAMED_HANDOFF_BYTES = 16 * 1024
STORE_CHOOSER_MIN_BYTES = 64 * 1024
STREAMED_HANDOFF_FRACTION = 0.25  # of the DRAM rate: the reader's misses, one line at a time
# Protocols: (step latency factor, memory efficiency) on the CPU engine. A line protocol
# saves the ready word's line per hop, and moves data word by word (LL: 8 bytes per 16,
# LL128: 120 per 128, each line folded alone): fitted to docs/performance.md, "Tuner
# settings". Over GIN a line step posts two descriptors where Simple posts one. On
# GPUs no protocol has been measured: the model gives LL and LL128 no edge there.
PROTOCOL_FACTORS = {
    "cpu": {"simple": (1.0, 1.0), "ll": (0.55, 0.035), "ll128": (0.65, 0.09)},
    "gin": {"simple": (1.0, 1.0), "ll": (2.0, 0.035), "ll128": (2.0, 0.09)},
    "cuda": {"simple": (1.0, 1.0), "ll": (1.0, 0.5), "ll128": (1.0, 0.9)},
}
# The hierarchical algorithm's phases as separate calls cost this much more inside it: they
# cannot overlap, and each writes its result to memory for the next to read (fitted:
# `commref bench all_reduce -b 1M -e 16M -f 4 --np 4 --nodes 2 --path auto --algorithm
# ring,hierarchical --model`, with and without the wire model; docs/performance.md).
HIERARCHICAL_PHASES = 1.5
# The wire model's engine yields while the head of its queue is not due (docs/gin.md, "The
# wire model"): a step whose bytes take the wire at least this long pays a switch to the
# other thread on its core and back.
WIRE_YIELD_S = 1e-6
# Bytes a protocol puts on a link per data byte: LL 16 per 8, LL128 128 per 120.
WIRE_BYTES = {"simple": 1.0, "ll": 2.0, "ll128": 128 / 120}
# A call between hosts whose network is not modeled (network mpi across hosts): the rate
# and latency the model assumes for it.
NETWORK_RATE = 1.0e9
NETWORK_LATENCY = 20e-6


@dataclass(frozen=True)
class Paths:
    """What the model knows of a communicator's peers: whether they are reached over GIN
    (`gin`; with several `nodes` only between nodes), the GIN wire model (rate in bytes/s,
    0 none; latency in s), the ranks on this host (they share its cores), the device."""

    gin: bool = False
    nodes: int = 1
    wire_rate: float = 0.0
    wire_latency: float = 0.0
    wire_modeled: bool = False
    local_ranks: int = 1
    device: str = "cpu"
    between_hosts: bool = False  # GIN crosses real hosts with no wire model: NETWORK_*


@dataclass(frozen=True)
class Model:
    """Predictions on one communicator: `calibration` (the host terms) and `paths`."""

    calibration: Calibration = REFERENCE
    paths: Paths = field(default_factory=Paths)

    @classmethod
    def default(cls, paths: Paths | None = None) -> Model:
        return cls(host_calibration(), paths or Paths())

    # ---- terms ----

    @property
    def call_s(self) -> float:
        return CALL_PY_UNITS * self.calibration.py_unit_s

    def pack_s(self, nbytes: int) -> float:
        """Copying `nbytes` of a packed group's inputs into its staging buffer and its
        result out (packing.py): each byte loaded and stored twice, in the cache."""
        return 4 * nbytes / self.memory_rate(2 * nbytes)

    def share(self, local_ranks: int | None = None) -> float:
        """Ranks per core on this host (at least 1)."""
        ranks = self.paths.local_ranks if local_ranks is None else local_ranks
        return max(1.0, ranks / max(1, self.calibration.cores))

    def memory_rate(self, footprint: float, local_ranks: int | None = None) -> float:
        """Bytes a rank loads and stores per second at a per-rank `footprint`."""
        c = self.calibration
        total = footprint * (self.paths.local_ranks if local_ranks is None else local_ranks)
        lo, hi = c.llc_bytes / 2, c.llc_bytes * 2
        if total <= lo:
            rate = c.cached_Bps
        elif total >= hi:
            rate = c.dram_Bps
        else:  # between: geometric interpolation in the footprint
            f = math.log(total / lo) / math.log(hi / lo)
            rate = c.cached_Bps ** (1 - f) * c.dram_Bps**f
        return rate / self.share(local_ranks)

    def switch_s(self, gin: bool, local_ranks: int | None = None) -> float:
        """The scheduler's turns a dependent step waits for where ranks share a core."""
        if self.share(local_ranks) <= 1:
            return 0.0
        return self.calibration.switch_s * (GIN_SHARED_SWITCHES if gin else 1)

    def hop_s(self, gin: bool, local_ranks: int | None = None) -> float:
        """One dependent step's latency over LSA or GIN."""
        c, p = self.calibration, self.paths
        switch = self.switch_s(gin, local_ranks)
        if not gin:
            return c.hop_s + switch
        t = c.gin_op_s + switch
        if p.wire_modeled:
            t += c.wire_op_s + p.wire_latency
        elif p.between_hosts:
            t += NETWORK_LATENCY
        return t

    def gin_rate(self) -> float:
        """Bytes per second over GIN: the engine's rate (shared by the ranks of a core: each
        rank's engine is a thread of its own), or the wire model's or network's where slower."""
        p = self.paths
        rates = [self.calibration.gin_Bps / self.share()]
        if p.wire_modeled and p.wire_rate:
            rates.append(p.wire_rate)
        elif p.between_hosts:
            rates.append(NETWORK_RATE)
        return min(rates)

    # ---- predictions ----

    def time(
        self, coll: str, algorithm: str, protocol: str, nbytes: int, nranks: int, nchannels: int = 1, in_place=False
    ) -> float:
        """Predicted seconds of one call of `coll` (catalogue name) of `nbytes` (the larger
        buffer) on `nranks` ranks, run as `algorithm` with `protocol` and `nchannels`."""
        spec = catalogue.get(coll)
        if nranks <= 1:  # no peer: every algorithm copies its input once, split over the channels
            t = spec.traffic(1, in_place)
            moved = (t.loads(nbytes) + t.stores(nbytes)) / self.memory_rate(t.footprint(nbytes))
            return self.call_s + moved / self._parallel(nchannels) + (nchannels - 1) * self.calibration.channel_s
        if algorithm == "hierarchical":
            return self._hierarchical(spec.name, nbytes, nranks)
        gin = self.paths.gin
        if algorithm in ("direct", "nvls"):
            t = spec.traffic(nranks, in_place)
            mem = (t.loads(nbytes) + t.stores(nbytes)) / (self.memory_rate(t.footprint(nbytes)) * DIRECT_EFFICIENCY)
            sent = t.stores(nbytes) * (nranks - 1) / nranks
            moved = self._moved(mem, sent, gin)
            base = self.call_s + DIRECT_HOPS * self.hop_s(gin) + moved
            return base * (1.001 if algorithm == "nvls" else 1.0)  # the emulation loads what direct loads
        steps, wire_bytes, mem_bytes = self._shape(spec.name, algorithm, nbytes, nranks)
        lat, eff = PROTOCOL_FACTORS["gin" if gin else "cuda" if self.paths.device == "cuda" else "cpu"][protocol]
        t = spec.traffic(nranks, in_place)
        user = t.loads(nbytes) + t.stores(nbytes)  # the call's own buffers, at the footprint's rate
        fifo = max(0.0, mem_bytes - user)  # FIFO slots: in the cache, written on one core, read on another
        spin = SPIN_PENALTY if self.share() > 1 else 1.0
        cached = self.calibration.cached_Bps / self.share()
        bw = user / (self.memory_rate(t.footprint(nbytes)) * eff) + fifo * spin / (cached * FIFO_EFFICIENCY * eff)
        streamed = algorithm == "ring" and protocol == "simple" and nbytes < STORE_CHOOSER_MIN_BYTES
        if streamed and nbytes / nranks >= STREAMED_HANDOFF_BYTES:  # measured on the ring only
            bw += wire_bytes / (self.calibration.dram_Bps * STREAMED_HANDOFF_FRACTION / self.share())
        bw = self._moved(bw, wire_bytes * WIRE_BYTES[protocol], gin)
        p = self.paths
        if gin and p.wire_modeled and p.wire_rate and wire_bytes / max(1, steps) / p.wire_rate >= WIRE_YIELD_S:
            bw += steps * self.calibration.switch_s  # the engine yields while its head is not due
        parallel = self._parallel(nchannels)
        hop = self.hop_s(gin)
        switch = self.switch_s(gin)
        return (
            self.call_s
            + steps * ((hop - switch) * lat + switch)
            + bw / parallel
            + (nchannels - 1) * self.calibration.channel_s
        )

    def _parallel(self, nchannels: int) -> int:
        """How many of `nchannels` run at once: on a GPU all; on the CPU one per core of
        this rank's share of the host's cores."""
        if self.paths.device == "cuda":
            return nchannels
        return max(1, min(nchannels, int(self.calibration.cores // max(1, self.paths.local_ranks))))

    def _moved(self, memory_s: float, sent: float, gin: bool) -> float:
        """Seconds of a call's bandwidth terms: its memory work (`memory_s`) and the `sent`
        bytes over GIN or the LSA link (none on the CPU: the peers' memory is this one),
        overlapped where the calibration says they overlap (a GPU), else one after the other."""
        c = self.calibration
        link = sent / self.gin_rate() if gin else (sent / c.link_Bps if c.link_Bps else 0.0)
        return max(memory_s, link) if c.overlap else memory_s + link

    def _shape(self, coll: str, algorithm: str, s: int, n: int) -> tuple[int, float, float]:
        """(dependent steps, bytes a rank sends, bytes a rank moves through memory)."""
        if algorithm == "tree":
            depth = max(1, math.ceil(math.log2(n)))
            if coll == "allreduce":
                return 2 * depth, 2 * s, TREE_MEMORY * s
            return depth, s, 3 * s
        if coll == "allreduce":
            return 2 * (n - 1), 2 * (n - 1) / n * s, (6 * (n - 1) + 2) / n * s
        if coll == "reduce_scatter":
            return n - 1, (n - 1) / n * s, (4 * (n - 1) + 1) / n * s
        if coll == "allgather":
            return n - 1, (n - 1) / n * s, (3 * (n - 1) + 2) / n * s
        return n - 1, s, 3 * s

    def _hierarchical(self, coll: str, nbytes: int, nranks: int) -> float:
        p = self.paths
        nodes = max(2, p.nodes)
        per_node = max(1, nranks // nodes)
        intra = Model(self.calibration, Paths(local_ranks=p.local_ranks, device=p.device))
        inter = Model(self.calibration, Paths(**{**p.__dict__, "gin": True, "nodes": nodes}))
        t = inter.time("allreduce" if coll == "allreduce" else coll, "ring", "simple", nbytes // per_node, nodes)
        if coll in ("allreduce", "reduce_scatter"):
            t += intra.time("reduce_scatter", "ring", "simple", nbytes, per_node)
        if coll in ("allreduce", "allgather"):
            t += intra.time("allgather", "ring", "simple", nbytes, per_node)
        return t if self.calibration.overlap else t * HIERARCHICAL_PHASES  # fitted on the CPU engine only

    def best(self, coll: str, nbytes: int, nranks: int, algorithms, protocols, max_channels: int = 1):
        """The (algorithm, protocol, channels) of the least predicted time among
        `algorithms` x `protocols` (protocols only for ring and tree) x 1..max_channels;
        ties go to the earlier algorithm and protocol, and to fewer channels."""
        best = None
        for a in algorithms:
            for p in protocols if a in ("ring", "tree") else ("simple",):
                for ch in range(1, max(1, max_channels) + 1) if a != "hierarchical" else (0,):
                    t = self.time(coll, a, p, nbytes, nranks, max(ch, 1))
                    if best is None or t < best[0]:
                        best = (t, a, p, ch)
        return best[1], best[2], best[3]
