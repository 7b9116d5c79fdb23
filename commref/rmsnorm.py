"""A fused RMSNorm with ReduceScatter and AllGather in one user kernel
(device_kernels/examples/rmsnorm.cu), on commref's device API: NCCL's Device API
example, run on the CPU engine and on GPUs from the same source.

    with FusedRMSNorm(world, tokens=64, hidden=256) as norm:
        y = norm(x_partial, weight)     # every rank: RMSNorm(sum of the partials) * weight
"""

from __future__ import annotations

import functools
from importlib import resources

import numpy as np

from commref.collectives.device_api import DeviceComm, Kernel

KERNEL = "commref_rmsnorm_rs_ag"


@functools.lru_cache(maxsize=None)
def kernel() -> Kernel:
    source = resources.files("commref.device_kernels").joinpath("examples", "rmsnorm.cu").read_text()
    return Kernel(source, KERNEL, filename="rmsnorm.cu")


def window_bytes(tokens: int, hidden: int, nranks: int) -> int:
    """The device window the kernel uses (rmsnorm.cu): staging, an inbox slot per rank
    of the largest shard, the output."""
    shard = -(-tokens // nranks)
    return 4 * hidden * (2 * tokens + nranks * shard)


def reference(partials: list[np.ndarray], weight: np.ndarray, eps: float) -> np.ndarray:
    """What every rank must get, in float32 with the kernel's operation order: the sum
    in rank order, the mean of squares in hidden order, one division and square root."""
    v = partials[0].astype(np.float32).copy()
    for p in partials[1:]:
        v += p
    ss = np.zeros(v.shape[0], np.float32)
    for h in range(v.shape[1]):
        ss += v[:, h] * v[:, h]
    inv = np.float32(1) / np.sqrt(ss / np.float32(v.shape[1]) + np.float32(eps))
    return (v * inv[:, None]) * weight.astype(np.float32)


class FusedRMSNorm:
    """The fused kernel on a device communicator of its own over `world`'s ranks; other
    keywords are DeviceComm's (path, wire, strong_signals, device, ...)."""

    def __init__(self, world, *, tokens: int, hidden: int, eps: float = 1e-6, **options):
        if tokens < 1 or hidden < 1:
            raise ValueError(f"tokens and hidden must be positive, got {tokens} and {hidden}")
        self.tokens, self.hidden, self.eps = tokens, hidden, float(eps)
        self.dc = DeviceComm(world, window_bytes=window_bytes(tokens, hidden, world.size), signals=2, **options)
        self.kernel = kernel()

    def __call__(self, x, weight, out=None, threads: int | None = None):
        shape = (self.tokens, self.hidden)
        xp = np if self.dc.device == "cpu" else __import__("cupy")
        for name, a, want in (("x", x, shape), ("weight", weight, (self.hidden,))):
            if tuple(a.shape) != want or a.dtype != np.float32:
                raise ValueError(f"{name} must be float32 of shape {want}, not {a.dtype} {tuple(a.shape)}")
        out = xp.empty(shape, np.float32) if out is None else out
        self.kernel.launch(self.dc, 1, threads, (xp.ascontiguousarray(x), xp.ascontiguousarray(weight), out,
                                                 self.tokens, self.hidden, self.eps))
        return out

    def close(self) -> None:
        self.dc.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.dc.__exit__(*exc)
