"""Expert parallelism: MoE dispatch and combine in DeepEP's two modes, built on the
device API alone (a DeviceComm and the kernels of device_kernels/kernels/device_api/ep.cu). The
public name is commref.ep.

    buf = Buffer(world, num_experts=16, hidden=1024, max_tokens_per_rank=128, num_topk=4,
                 low_latency_mode=True, path="auto")
    # high-throughput (DeepEP's normal mode)
    layout = buf.get_dispatch_layout(topk_idx)
    recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle = buf.dispatch(x, topk_idx, topk_weights, layout)
    combined_x, combined_weights = buf.combine(expert_out, handle, recv_topk_weights)
    # low-latency
    packed_x, packed_count, ll_handle = buf.low_latency_dispatch(x, topk_idx)
    combined_x = buf.low_latency_combine(expert_out, topk_idx, topk_weights, ll_handle)

Experts are split evenly over the ranks (rank r holds experts r*E/n .. (r+1)*E/n - 1);
`topk_idx` is int64 [tokens, topk] with -1 for "no expert"; tokens <= max_tokens_per_rank.

High-throughput. The layout step counts tokens per rank and per expert and marks
is_token_in_rank [tokens, n]. Dispatch sends each token once to every rank holding one
of its experts, with its top-k indices (local to that rank, -1 for the others' experts)
and weights (0 for the others'), into a flat receive buffer ordered by (source rank,
token index): source s's tokens are rows [prefix[s-1][r], prefix[s][r]) of rank r, where
rank_prefix_matrix[s][r] counts the tokens ranks 0..s send to r. Combine sends every
received row back to its source, which sums the copies of each token (DeepEP: the
output is the sum over the ranks the token reached of what they return; weights are
applied by the expert side), and the copies' top-k weights likewise.

Low-latency. Each (token, expert) pair goes into fixed slots of the expert's rank, one
block of max_tokens_per_rank slots per (local expert, source rank), with a count per
block written as -count-1 so that 0 means "not arrived" (DeepEP's encoding; the receiver
zeroes it after reading). The receiver packs each expert's rows by source rank:
packed_recv_x [local experts, n * max_tokens, hidden], packed_recv_count, and the handle's
recv_src_info (token index), recv_layout_range (begin << 32 | count per source). Combine
returns each expert's output row to its token's source, which reduces them with the
top-k weights: out[t] = sum_k w[t, k] * y[expert k](t) over k with topk_idx >= 0.

Protocols: how a receiver knows a message has landed over GIN (ep.cu has the
details), each a cell of the ordering study (docs/ordering.md):
  strong          last-put [strong]: the last put carries a strong signal
  signal-per-put  signal-per-put [weak]: every put a weak inc, counted
  headers         headers [weak]: DeepEP's unordered kernels, an 8-byte header in band
                  in every put plus a counting weak signal
  weak-last       last-put [weak]: puts without signals, a weak signal on the last one
auto is strong (and asks for a backend with strong signals), headers with backend="gda". Before anything
runs, the buffer asks the study (transports.gin.study.cells.study_safe) about its cell on the
wire of its GIN links and refuses an unsafe one with a CapabilityError naming the cell,
unless unsafe_ok=True (to watch it fail: tests/test_ep.py). Over LSA every protocol is
the same stores and one release signal.

Every operation is collective (all ranks, in the same order); a dispatch ends with a
barrier, a combine after a dispatch needs none, a combine after a combine starts with one
(ep.cu says why).
Results are returned as new arrays (the flat receive buffers are views of the first
num_recv rows of arrays of capacity n * max_tokens_per_rank).
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass
from importlib import resources
from typing import Any, NamedTuple

import numpy as np

from commref.transports.errors import CapabilityError
from commref.transports.gin.study.cells import study_safe, wire_column

from .device_comm import DeviceComm, Kernel, UsesDeviceComm

KERNELS = ("ep_layout", "ep_ht_dispatch", "ep_ht_combine", "ep_ll_dispatch", "ep_ll_combine")

# protocol -> the ordering study's (row, signal strength)
PROTOCOLS = {
    "strong": ("last-put", "strong"),
    "signal-per-put": ("signal-per-put", "weak"),
    "headers": ("headers", "weak"),
    "weak-last": ("last-put", "weak"),
}
PROTOCOL_CODES = {"strong": 0, "signal-per-put": 1, "headers": 2, "weak-last": 3}  # ep.cu EpProtocol
DTYPE_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}  # ep.cu EpDtype
# ep.cu EpConfig, word by word
CONFIG_FIELDS = (
    "hidden",
    "elemSize",
    "dtype",
    "topk",
    "experts",
    "localExperts",
    "maxTokens",
    "protocol",
    "xBytes",
    "xPad",
    "htRow",
    "htRecv",
    "htCount",
    "htStage",
    "htCountStage",
    "htCombRow",
    "htComb",
    "htCombStage",
    "llRow",
    "llRecv",
    "llCount",
    "llStage",
    "llCountStage",
    "llComb",
    "llCombStage",
    "scratch",
)
MAX_RANKS, MAX_TOPK, MAX_TOKENS = 64, 64, (1 << 24) - 1  # ep.cu: EP_MAX_RANKS, EP_MAX_TOPK, 24-bit token index

_kernels: dict[str, Kernel] = {}
_kernels_lock = threading.Lock()


def kernel(name: str) -> Kernel:
    """The EP kernel `name` (one Kernel per process; compiled on first launch)."""
    with _kernels_lock:
        if name not in _kernels:
            source = resources.files("commref.device_kernels").joinpath("kernels", "device_api", "ep.cu").read_text()
            _kernels[name] = Kernel(source, name, filename="ep.cu")
        return _kernels[name]


def study_cell(protocol: str, transport) -> tuple[str, str, str]:
    """(row, strength, column) of the ordering study that models `protocol` on GIN
    links of `transport` (semantics.Transport): one context, the wire's column."""
    row, strength = PROTOCOLS[protocol]
    return row, strength, wire_column(transport)


def _safe(protocol: str, transport) -> bool:
    row, strength, column = study_cell(protocol, transport)
    return study_safe(row, column, strength)


def protocol_refusal(protocol: str, transport, strong_signals: bool = True) -> str | None:
    """Why `protocol` must not run over GIN links of `transport` (None: the study
    finds its cell safe there, or there is no GIN link); `strong_signals`: whether
    the backend offers them (what the message proposes instead)."""
    if transport is None or _safe(protocol, transport):
        return None
    row, strength, column = study_cell(protocol, transport)
    safe = " or ".join(
        repr(p) for p in PROTOCOLS if _safe(p, transport) and (strong_signals or PROTOCOLS[p][1] != "strong")
    )
    return (
        f"EP protocol {protocol!r} over GIN on the {transport.name} wire: the ordering study finds "
        f"{row} [{strength}] on {column} unsafe (commref study --protocol {row} --transport {column}); "
        f"use protocol {safe}, or unsafe_ok=True to run it anyway"
    )


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def _regions(
    n: int, hidden: int, elem: int, topk: int, experts: int, max_tokens: int, low_latency: bool, staging: bool
) -> tuple[dict[str, int], int]:
    """The device window's layout (ep.cu EpConfig's offsets and row sizes) and its bytes."""
    per = experts // n
    x_bytes = hidden * elem
    x_pad = _round8(x_bytes)
    cfg = {
        "xBytes": x_bytes,
        "xPad": x_pad,
        "htRow": 8 + x_pad + 8 * topk,
        "htCombRow": 8 + x_pad + _round8(4 * topk),
        "llRow": 8 + x_pad,
    }
    at = 0

    def region(name: str, nbytes: int, needed: bool = True) -> None:
        nonlocal at
        cfg[name] = at if needed else 0
        if needed:
            at += (nbytes + 63) // 64 * 64

    T = max_tokens
    region("htRecv", n * T * cfg["htRow"])
    region("htCount", n * n * 8)
    region("htStage", n * T * cfg["htRow"], staging)
    region("htCountStage", n * 8)
    region("htComb", n * T * cfg["htCombRow"])
    region("htCombStage", n * T * cfg["htCombRow"], staging)
    region("llRecv", per * n * T * cfg["llRow"], low_latency)
    region("llCount", n * per * 8, low_latency)
    region("llStage", T * topk * cfg["llRow"], low_latency and staging)
    region("llCountStage", n * per * 8, low_latency)
    region("llComb", T * topk * cfg["llRow"], low_latency)
    region("llCombStage", per * n * T * cfg["llRow"], low_latency and staging)
    region("scratch", 24 * n + 8 * experts)
    return cfg, at


class Layout(NamedTuple):
    """get_dispatch_layout's result (DeepEP's, without the RDMA ranks)."""

    num_tokens_per_rank: Any  # int32 [n]
    num_tokens_per_expert: Any  # int32 [experts]
    is_token_in_rank: Any  # bool [tokens, n]


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs of a high-throughput dispatch."""

    buffer: int  # id() of the Buffer
    rank_prefix_matrix: Any  # int32 [n, n]: tokens ranks 0..s send to r, at [s][r]
    recv_src_idx: Any  # int32 [num_recv]: each received row's token index at its source
    is_token_in_rank: Any  # bool [tokens, n]
    token_idx_in_rank: Any  # int32 [tokens, n]: a token's row among those sent to a rank, -1 if not sent
    num_tokens_per_rank: Any  # int32 [n]
    num_recv: int
    num_tokens: int
    addresses: tuple = ()  # of rank_prefix_matrix, token_idx_in_rank, num_tokens_per_rank (combine's arguments)


class DispatchResult(NamedTuple):
    recv_x: Any
    recv_topk_idx: Any  # int64 [num_recv, topk]: the receiver's local expert, -1 for other ranks' experts
    recv_topk_weights: Any  # float32 [num_recv, topk]: 0 where recv_topk_idx is -1
    num_recv_tokens_per_expert_list: list
    handle: DispatchHandle


@dataclass(frozen=True)
class LowLatencyHandle:
    """What low_latency_combine needs of a low-latency dispatch."""

    buffer: int
    recv_src_info: Any  # int32 [local experts, n * max_tokens]: token index at its source
    recv_src_topk: Any  # int32, same shape: which of the token's top-k slots chose the expert
    recv_layout_range: Any  # int64 [local experts, n]: begin << 32 | count of each source's rows
    topk_idx: Any  # the dispatch's topk_idx (a copy)
    num_tokens: int
    addresses: tuple = ()  # of recv_src_info, recv_src_topk, recv_layout_range (combine's arguments)


class LowLatencyResult(NamedTuple):
    packed_recv_x: Any  # [local experts, n * max_tokens, hidden]
    packed_recv_count: Any  # int32 [local experts]
    handle: LowLatencyHandle


class Buffer(UsesDeviceComm):
    """An EP communication buffer over the ranks of `world` (DeepEP's deep_ep.Buffer):
    a DeviceComm whose device window holds the receive, count and staging regions of
    both modes (the low-latency ones with low_latency_mode=True).

    num_experts (a multiple of the number of ranks), hidden, max_tokens_per_rank (the
    most tokens a rank dispatches in one call), num_topk; dtype of the tokens
    ("bfloat16", "float16", "float32"; on a GPU a bfloat16 buffer takes uint16 arrays,
    CuPy having no bfloat16); protocol (PROTOCOLS or "auto") and unsafe_ok (see the
    module docstring); device and the other keywords go to DeviceComm (path, wire,
    backend, seed, timeout, ...). Collective."""

    def __init__(
        self,
        world,
        *,
        num_experts: int,
        hidden: int,
        max_tokens_per_rank: int,
        num_topk: int,
        dtype: str = "bfloat16",
        low_latency_mode: bool = False,
        protocol: str = "auto",
        unsafe_ok: bool = False,
        device: str = "auto",
        **options,
    ):
        n = world.size
        for name, v, low in (
            ("num_experts", num_experts, 1),
            ("hidden", hidden, 1),
            ("max_tokens_per_rank", max_tokens_per_rank, 1),
            ("num_topk", num_topk, 1),
        ):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ValueError(f"commref.ep: {name} must be a positive integer, not {v!r}")
        if num_experts % n:
            raise ValueError(f"commref.ep: num_experts ({num_experts}) must be a multiple of the number of ranks ({n})")
        if num_topk > min(num_experts, MAX_TOPK):
            raise ValueError(f"commref.ep: num_topk ({num_topk}) must be at most num_experts and {MAX_TOPK}")
        if n > MAX_RANKS or max_tokens_per_rank > MAX_TOKENS:
            raise ValueError(f"commref.ep: at most {MAX_RANKS} ranks and {MAX_TOKENS} tokens per rank")
        if dtype not in DTYPE_CODES:
            raise ValueError(f"commref.ep: dtype must be one of {', '.join(DTYPE_CODES)}, not {dtype!r}")
        if protocol != "auto" and protocol not in PROTOCOLS:
            raise ValueError(f"commref.ep: protocol must be auto or one of {', '.join(PROTOCOLS)}, not {protocol!r}")
        import ml_dtypes  # noqa: F401 (numpy's bfloat16)

        self.nranks, self.num_experts, self.hidden = n, int(num_experts), int(hidden)
        self.max_tokens, self.num_topk = int(max_tokens_per_rank), int(num_topk)
        self.low_latency_mode = low_latency_mode
        self.local_experts = self.num_experts // n
        self.dtype = np.dtype(dtype)
        regions, window = _regions(
            n,
            self.hidden,
            self.dtype.itemsize,
            self.num_topk,
            self.num_experts,
            self.max_tokens,
            low_latency_mode,
            staging=options.get("path", "auto") != "lsa",
        )
        # strong signals: required by strong, asked for by auto unless the backend named has none
        strong = protocol == "strong" or (protocol == "auto" and options.get("backend", "auto") != "gda")
        self.dc = DeviceComm(world, window_bytes=window, signals=3 * n, strong_signals=strong, device=device, **options)
        try:
            comm = self.dc.comm
            self.rank, self.device = self.dc.rank, self.dc.device
            self.transport = comm.gin.transport if comm.gin.used else None
            if protocol == "auto":
                protocol = "strong" if self.dc.strong_signals else "headers"
            self.protocol = protocol
            self.cell = study_cell(protocol, self.transport) if self.transport is not None else None
            refusal = protocol_refusal(protocol, self.transport, self.dc.strong_signals)
            if refusal and not unsafe_ok:
                raise CapabilityError(f"rank {self.rank}: {refusal}")
            self.unsafe = refusal is not None
            if self.device == "cuda":
                import cupy

                self.xp = cupy
            else:
                self.xp = np
            cfg = dict(
                regions,
                hidden=self.hidden,
                elemSize=self.dtype.itemsize,
                dtype=DTYPE_CODES[dtype],
                topk=self.num_topk,
                experts=self.num_experts,
                localExperts=self.local_experts,
                maxTokens=self.max_tokens,
                protocol=PROTOCOL_CODES[protocol],
            )
            self._cfg = self.xp.asarray(np.array([cfg[f] for f in CONFIG_FIELDS], np.int64))
            self._cfg_address = self._address(self._cfg)
            self._kernels = {name: kernel(name) for name in KERNELS}
            self.dc.window().fill(0)  # counts, headers and signal bases start at 0 on every rank ...
            if self.device == "cuda":
                self.xp.cuda.Device(comm.device_id).synchronize()
            world.barrier(what="commref.ep: buffer windows cleared")  # ... before any peer writes
        except BaseException:
            self.dc.close()
            raise
        self._epoch = 0
        self._after_combine = False  # the last operation was a combine: the next one syncs first (ep.cu)
        self.launches = 0  # EP kernels launched (bad input raises before any)

    # ---- what every call checks first ----

    def _tag(self) -> int:
        self._epoch += 1
        return self._epoch % 0xFFFFFFFF + 1

    def _address(self, a) -> int:
        """The device address of an array this buffer made or checked (_array): passed to a
        kernel as an integer, it skips Kernel.launch's checks, which it has passed. On the
        CPU through the buffer protocol where the array exports a writeable one (0.4 us,
        where .ctypes takes 1.1; collectives/buffers.py does the same)."""
        if self.device != "cpu":
            return int(a.data.ptr)
        try:
            return ctypes.addressof(ctypes.c_char.from_buffer(a))
        except (TypeError, ValueError, BufferError):
            return a.ctypes.data

    def _outputs(self, *specs) -> tuple[list, list[int]]:
        """Fresh arrays of the (shape, dtype) specs, carved from one allocation (64-byte
        aligned), and their device addresses: one allocation and one address lookup per
        call instead of one of each per array (about a microsecond apiece on the CPU)."""
        offsets, total = [], 0
        for shape, dtype in specs:
            offsets.append(total)
            total += -(-math.prod(shape) * np.dtype(dtype).itemsize // 64) * 64
        arena = self.xp.empty(max(total, 64), np.uint8)
        base = self._address(arena)
        if self.device == "cpu":
            arrays = [np.ndarray(shape, dtype, arena, off) for (shape, dtype), off in zip(specs, offsets)]
        else:
            arrays = [
                arena[off : off + math.prod(shape) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
                for (shape, dtype), off in zip(specs, offsets)
            ]
        return arrays, [base + off for off in offsets]

    def _launch(self, name: str, *args) -> None:
        self.launches += 1
        self._kernels[name].launch(self.dc, 1, args=(self._cfg_address, *args))
        if name != "ep_layout":
            self._after_combine = name.endswith("combine")

    def _array(self, a, name: str, shape: tuple, dtypes: tuple) -> Any:
        on_gpu = hasattr(a, "__cuda_array_interface__")
        if self.device == "cpu" and not isinstance(a, np.ndarray):
            raise TypeError(f"commref.ep: {name} must be a numpy array on the CPU engine, not {type(a).__name__}")
        if self.device == "cuda" and not on_gpu:
            raise TypeError(
                f"commref.ep: {name} must be a CuPy array on GPU {self.dc.comm.device_id}, not {type(a).__name__}"
            )
        if a.dtype not in dtypes:
            raise TypeError(
                f"commref.ep: {name} must be {' or '.join(np.dtype(d).name for d in dtypes)}, not {a.dtype}"
            )
        if tuple(a.shape) != shape:
            raise ValueError(f"commref.ep: {name} must have shape {shape}, not {tuple(a.shape)}")
        if not a.flags.c_contiguous:
            raise ValueError(f"commref.ep: {name} must be contiguous")
        return a

    def _x_dtypes(self) -> tuple:
        if self.device == "cuda" and self.dtype.name == "bfloat16":
            return (np.dtype(np.uint16),)  # bfloat16 bits
        return (self.dtype,)

    def _topk(self, topk_idx) -> int:
        """Checks topk_idx (int64 [tokens, topk], values -1 .. num_experts - 1); returns tokens."""
        if getattr(topk_idx, "ndim", None) != 2:
            raise ValueError(
                f"commref.ep: topk_idx must be 2-D [tokens, {self.num_topk}], not "
                f"{getattr(topk_idx, 'shape', type(topk_idx).__name__)}"
            )
        ntok = topk_idx.shape[0]
        if ntok > self.max_tokens:
            raise ValueError(f"commref.ep: {ntok} tokens exceed max_tokens_per_rank ({self.max_tokens})")
        self._array(topk_idx, "topk_idx", (ntok, self.num_topk), (np.dtype(np.int64),))
        if topk_idx.size:
            lo, hi = int(topk_idx.min()), int(topk_idx.max())
            if lo < -1 or hi >= self.num_experts:
                bad = lo if lo < -1 else hi
                raise ValueError(
                    f"commref.ep: topk_idx holds {bad}: expert indices are -1 (none) or 0 .. {self.num_experts - 1}"
                )
        return ntok

    def _x(self, x, ntok: int):
        return self._array(x, "x", (ntok, self.hidden), self._x_dtypes())

    # ---- high-throughput ----

    def get_dispatch_layout(self, topk_idx) -> Layout:
        """Tokens per rank, per expert, and is_token_in_rank of `topk_idx` (local)."""
        ntok = self._topk(topk_idx)
        arrays, addresses = self._outputs(
            ((self.nranks,), np.int32), ((self.num_experts,), np.int32), ((ntok, self.nranks), np.bool_)
        )
        self._launch("ep_layout", self._address(topk_idx), ntok, *addresses)
        return Layout(*arrays)

    def dispatch(self, x, topk_idx, topk_weights, layout: Layout | None = None) -> DispatchResult:
        """High-throughput dispatch of this rank's tokens `x` [tokens, hidden] with their
        `topk_idx` and `topk_weights` (float32 [tokens, topk]); `layout` from
        get_dispatch_layout (computed here if None)."""
        ntok = self._topk(topk_idx)
        self._x(x, ntok)
        self._array(topk_weights, "topk_weights", (ntok, self.num_topk), (np.dtype(np.float32),))
        n = self.nranks
        if layout is None:
            layout = self.get_dispatch_layout(topk_idx)
        else:
            layout = Layout(*layout)
            self._array(layout.num_tokens_per_rank, "layout.num_tokens_per_rank", (n,), (np.dtype(np.int32),))
            self._array(layout.is_token_in_rank, "layout.is_token_in_rank", (ntok, n), (np.dtype(np.bool_),))
        cap = n * self.max_tokens
        (recv_x, recv_topk, recv_w, recv_src, prefix, per_expert, slot, num_recv), addresses = self._outputs(
            ((cap, self.hidden), x.dtype),
            ((cap, self.num_topk), np.int64),
            ((cap, self.num_topk), np.float32),
            ((cap,), np.int32),
            ((n, n), np.int32),
            ((self.local_experts,), np.int32),
            ((ntok, n), np.int32),
            ((1,), np.int32),
        )
        kept = (addresses[4], addresses[6], self._address(layout.num_tokens_per_rank))
        a = self._address
        self._launch(
            "ep_ht_dispatch",
            a(x),
            a(topk_idx),
            a(topk_weights),
            a(layout.is_token_in_rank),
            ntok,
            self._tag(),
            *addresses,
        )
        m = int(num_recv[0])
        handle = DispatchHandle(
            id(self), prefix, recv_src[:m], layout.is_token_in_rank, slot, layout.num_tokens_per_rank, m, ntok, kept
        )
        return DispatchResult(recv_x[:m], recv_topk[:m], recv_w[:m], [int(v) for v in per_expert.tolist()], handle)

    def combine(self, x, handle: DispatchHandle, topk_weights=None):
        """High-throughput combine: `x` [num_recv, hidden] (one row per received token,
        in the dispatch's order) back to the tokens' sources, each token's copies summed.
        Returns (combined_x [tokens, hidden], combined_topk_weights [tokens, topk] or None:
        the copies of `topk_weights` [num_recv, topk] summed)."""
        if not isinstance(handle, DispatchHandle) or handle.buffer != id(self):
            raise ValueError("commref.ep: combine needs the handle of a dispatch of this buffer")
        self._array(x, "x", (handle.num_recv, self.hidden), self._x_dtypes())
        if topk_weights is not None:
            self._array(topk_weights, "topk_weights", (handle.num_recv, self.num_topk), (np.dtype(np.float32),))
        ntok = handle.num_tokens
        (out, out_w), (out_address, w_address) = self._outputs(
            ((ntok, self.hidden), x.dtype), ((ntok, self.num_topk), np.float32)
        )
        prefix, slot, per_rank = handle.addresses
        self._launch(
            "ep_ht_combine",
            self._address(x),
            0 if topk_weights is None else self._address(topk_weights),
            prefix,
            slot,
            per_rank,
            ntok,
            self._tag(),
            out_address,
            0 if topk_weights is None else w_address,
            int(self._after_combine),
        )
        return out, (out_w if topk_weights is not None else None)

    # ---- low-latency ----

    def _need_low_latency(self) -> None:
        if not self.low_latency_mode:
            raise ValueError("commref.ep: the low-latency calls need a Buffer made with low_latency_mode=True")

    def low_latency_dispatch(self, x, topk_idx) -> LowLatencyResult:
        """Low-latency dispatch of `x` [tokens, hidden]: every (token, expert) pair of
        `topk_idx` into the expert's slots for this rank."""
        self._need_low_latency()
        ntok = self._topk(topk_idx)
        self._x(x, ntok)
        n, per, T = self.nranks, self.local_experts, self.max_tokens
        (packed, count, src_info, src_topk, layout_range), addresses = self._outputs(
            ((per, n * T, self.hidden), x.dtype),
            ((per,), np.int32),
            ((per, n * T), np.int32),
            ((per, n * T), np.int32),
            ((per, n), np.int64),
        )
        kept = tuple(addresses[2:])
        self._launch("ep_ll_dispatch", self._address(x), self._address(topk_idx), ntok, self._tag(), *addresses)
        handle = LowLatencyHandle(id(self), src_info, src_topk, layout_range, topk_idx.copy(), ntok, kept)
        return LowLatencyResult(packed, count, handle)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle):
        """Low-latency combine: `x` packed as the dispatch's packed_recv_x (each expert's
        output per received row) back to the sources; returns [tokens, hidden], each
        token's rows reduced with its `topk_weights` (float32 [tokens, topk])."""
        self._need_low_latency()
        if not isinstance(handle, LowLatencyHandle) or handle.buffer != id(self):
            raise ValueError(
                "commref.ep: low_latency_combine needs the handle of a low_latency_dispatch of this buffer"
            )
        ntok = self._topk(topk_idx)
        if ntok != handle.num_tokens or not bool(self.xp.array_equal(topk_idx, handle.topk_idx)):
            raise ValueError("commref.ep: low_latency_combine needs the topk_idx of its dispatch")
        self._array(x, "x", (self.local_experts, self.nranks * self.max_tokens, self.hidden), self._x_dtypes())
        self._array(topk_weights, "topk_weights", (ntok, self.num_topk), (np.dtype(np.float32),))
        (out,), (out_address,) = self._outputs(((ntok, self.hidden), x.dtype))
        a = self._address
        self._launch(
            "ep_ll_combine",
            a(x),
            a(topk_idx),
            a(topk_weights),
            ntok,
            self._tag(),
            *handle.addresses,
            out_address,
            int(self._after_combine),
        )
        return out


__all__ = [
    "Buffer",
    "Layout",
    "DispatchHandle",
    "DispatchResult",
    "LowLatencyHandle",
    "LowLatencyResult",
    "PROTOCOLS",
    "study_cell",
    "protocol_refusal",
    "kernel",
]
