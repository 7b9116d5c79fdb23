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

from commref.collectives.device_api import DeviceComm, Kernel, UsesDeviceComm

KERNEL = "commref_rmsnorm_rs_ag"


@functools.cache
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


class FusedRMSNorm(UsesDeviceComm):
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
        if self.dc.device == "cpu":
            xp = np
        else:
            import cupy as xp
        for name, a, want in (("x", x, shape), ("weight", weight, (self.hidden,))):
            if tuple(a.shape) != want or a.dtype != np.float32:
                raise ValueError(f"{name} must be float32 of shape {want}, not {a.dtype} {tuple(a.shape)}")
        out = xp.empty(shape, np.float32) if out is None else out
        self.kernel.launch(
            self.dc,
            1,
            threads,
            (xp.ascontiguousarray(x), xp.ascontiguousarray(weight), out, self.tokens, self.hidden, self.eps),
        )
        return out


def _main(argv=None) -> int:
    """Under mpiexec (one rank per process), or --np N ranks as threads: runs the fused
    kernel on small-integer inputs and counts the elements that differ from reference()."""
    import argparse

    from commref._selfcheck import add_peer_arguments, run_ranks, use_rank_stream
    from commref.collectives.options import resolve_device

    p = argparse.ArgumentParser(prog="python -m commref.rmsnorm", description=_main.__doc__)
    p.add_argument("--np", type=int, help="ranks as threads of this process (default: the MPI job's ranks)")
    p.add_argument("--tokens", type=int, default=37)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    add_peer_arguments(p)
    p.add_argument("--weak", action="store_true", help="weak signals suffice (the gda backend qualifies)")
    args = p.parse_args(argv)

    device = resolve_device(args.device)

    def body(world):
        if device == "cuda":
            cupy = use_rank_stream(world)
        rng = np.random.default_rng(11)
        partials = [rng.integers(-3, 4, size=(args.tokens, args.hidden)).astype(np.float32) for _ in range(world.size)]
        weight = (rng.integers(1, 9, size=args.hidden) / 4).astype(np.float32)
        want = reference(partials, weight, 1e-6)
        gin = dict(path=args.path, wire=args.wire, network=args.network, strong_signals=not args.weak)
        with FusedRMSNorm(
            world, tokens=args.tokens, hidden=args.hidden, device=device, **(gin if args.path != "lsa" else {})
        ) as norm:
            x, w = partials[world.rank], weight
            if device == "cuda":
                x, w = cupy.asarray(x), cupy.asarray(w)
            wrong = 0
            for _ in range(args.iters):
                got = norm(x, w)
                norm.dc.synchronize()
                got = got if isinstance(got, np.ndarray) else got.get()
                wrong += int((got != want).sum())
            return wrong, norm.dc.backend

    results, reporting = run_ranks(args.np, body)
    wrong = sum(w for w, _ in results)
    if reporting:
        print(
            f"# fused RMSNorm: {len(results)} ranks, path {args.path}, backend {results[0][1]}, "
            f"{args.iters} launches: {wrong} wrong elements"
        )
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    import sys

    sys.exit(_main())
