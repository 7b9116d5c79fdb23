"""The device API on a GPU: users' kernels compiled by NVRTC and launched through the
driver, N ranks as threads of one process on one GPU (each on its own non-blocking
stream): the fused RMSNorm example exact against numpy over LSA, and over GIN (the
copy-engine proxy) across simulated nodes; a syntax error reported with its line.

    python tests/gpu/device_api_gpu.py --np 4
    COMMREF_NODES=2 python tests/gpu/device_api_gpu.py --np 4 --path auto
"""

import argparse
import sys
import time

import numpy as np

from commref.collectives.device_api import CompileError, Kernel
from commref.rmsnorm import FusedRMSNorm, reference
from commref.transports.world import ThreadWorld

TOKENS, HIDDEN = 37, 256


def inputs(nranks: int):
    rng = np.random.default_rng(11)
    partials = [rng.integers(-3, 4, size=(TOKENS, HIDDEN)).astype(np.float32) for _ in range(nranks)]
    weight = (rng.integers(1, 9, size=HIDDEN) / 4).astype(np.float32)
    return partials, weight, reference(partials, weight, 1e-6)


def body(world, args):
    import cupy

    partials, weight, want = inputs(world.size)
    with cupy.cuda.Device(0):
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.use()
        options = dict(path=args.path, strong_signals=not args.weak) if args.path != "lsa" else {}
        wrong = 0
        with FusedRMSNorm(world, tokens=TOKENS, hidden=HIDDEN, device="cuda", **options) as norm:
            x, w = cupy.asarray(partials[world.rank]), cupy.asarray(weight)
            for _ in range(5):
                got = norm(x, w, threads=args.threads)
                norm.dc.synchronize()
                wrong += int((cupy.asnumpy(got) != want).sum())
            return wrong, norm.dc.backend


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--path", choices=["lsa", "gin", "auto"], default="lsa")
    p.add_argument("--weak", action="store_true", help="GIN with weak signals only (the gda backend)")
    p.add_argument("--threads", type=int, default=128)
    args = p.parse_args()
    t0 = time.time()
    try:
        Kernel('#include "commref/device.h"\nCOMMREF_KERNEL(broken, KernelArgs, args) {\n  int x = ;\n}\n',
               "broken").compile("cuda")
        print("FAIL: a syntax error compiled")
        sys.exit(1)
    except CompileError as e:
        ok = "broken.cu(3)" in str(e)
        print(f"syntax error reported with its line: {ok}\n{str(e)[:300]}")
        if not ok:
            sys.exit(1)
    results = ThreadWorld.run(args.np, body, args, timeout=60)
    wrong = sum(w for w, _ in results)
    print(f"# fused RMSNorm, {args.np} ranks ({args.path}, backend {results[0][1]}): {wrong} wrong elements, "
          f"{time.time() - t0:.1f} s")
    sys.exit(0 if wrong == 0 else 1)


if __name__ == "__main__":
    main()
