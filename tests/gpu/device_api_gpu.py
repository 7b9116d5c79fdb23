"""The device API on a GPU, N ranks as threads of one process on one GPU, each on its
own non-blocking stream:

1. a user's kernel with a syntax error is reported by NVRTC with its line;
2. the device-API operations, each exact against what it must leave, over LSA and over
   GIN (the copy-engine proxy), two launches each: put with weak signals and barrier,
   countedPut, counters with get and flush, putValue on a second context with
   lsaBarrier and resetSignal, and connectSend / connectRecv carrying the flow
   primitives (the kernels of tests/test_device_api.py, run there on the CPU engine);
3. the fused RMSNorm example (commref.rmsnorm), exact against numpy; arguments after
   --np go to `python -m commref.rmsnorm`.

    python tests/gpu/device_api_gpu.py --np 4
    COMMREF_NODES=2 python tests/gpu/device_api_gpu.py --np 4 --path auto
    python tests/gpu/device_api_gpu.py --precompile 90   # build every kernel it launches
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the CPU tests' kernels

from helpers import COUNTED, COUNTERS_GET, EXCHANGE, PREAMBLE, PRIMS_PER_PEER  # noqa: E402

from commref import rmsnorm  # noqa: E402
from commref.collectives.device_api import CompileError, DeviceComm, Kernel  # noqa: E402
from commref.collectives.gpu_stream import use_rank_gpu  # noqa: E402
from commref.transports.thread_world import ThreadWorld  # noqa: E402

# putValue on context 1 with a weak increment of the next rank's signal 0; the receiver
# waits for 1, reads the value, then every rank resets its signal between two barriers
# (no peer signals it meanwhile). Without the reset the next launch's wait would pass at
# once and read the previous launch's value.
VALUE_CONTEXT_RESET = (
    PREAMBLE
    + r"""
COMMREF_KERNEL(value_context_reset, KernelArgs, args) {
  DeviceComm comm(args);
  const int n = comm.nranks(), r = comm.rank(), prev = (r + n - 1) % n;
  comm.gin(1).putValue((r + 1) % n, 8 * r, 5000 + 10 * comm.launch() + r, WeakSignalInc(0));
  comm.waitSignal(0, 1, prev);
  uint64_t* out = comm.ptr<uint64_t>(0);
  if (threadIdx.x == 0) out[0] = comm.local<uint64_t>(0)[prev];
  comm.lsaBarrier();
  comm.barrier();
  comm.resetSignal(0);
  comm.barrier();
}
"""
)


def _device_ops(world, path: str) -> list[str]:
    """Every operation's kernel on this rank, two launches each; what differed."""
    import cupy

    use_rank_gpu(world)
    cupy.cuda.Stream(non_blocking=True).use()
    n, r, wrong = world.size, world.rank, []
    gin = dict(path=path)

    def check(what, got, want):
        if list(got) != list(want):
            wrong.append(f"rank {r} {path} {what}: got {list(got)[:8]}, want {list(want)[:8]}")

    with DeviceComm(world, window_bytes=4096, signals=1, device="cuda", **gin) as dc:
        kernel = Kernel(EXCHANGE, "exchange")
        for launch in (1, 2):
            out = cupy.zeros(n, np.uint64)
            kernel.launch(dc, 1, args=(out,))
            dc.synchronize()
            check("put + weak signal + barrier", out.get(), [1000 * launch + j for j in range(n)])
    chunks = 24
    with DeviceComm(world, window_bytes=2 * chunks * 64, signals=2, counted_writes=True, device="cuda", **gin) as dc:
        kernel = Kernel(COUNTED, "counted")
        for launch in (1, 2):
            out = cupy.zeros(chunks * 8, np.uint64)
            kernel.launch(dc, 1, args=(chunks, out))
            dc.synchronize()
            check("countedPut", out.get(), [launch << 32 | (r - 1) % n << 24 | i for i in range(chunks * 8)])
    if path != "lsa":  # get and counters are GIN operations
        with DeviceComm(world, window_bytes=64, counters=1, device="cuda", **gin) as dc:
            kernel = Kernel(COUNTERS_GET, "counters_get")
            for _ in (1, 2):
                out = cupy.zeros(1, np.uint64)
                kernel.launch(dc, 1, args=(out,))
                dc.synchronize()
                check("counter + get + flush", out.get(), [7000 + (r + 1) % n])
    with DeviceComm(world, window_bytes=8 * n, signals=1, contexts=2, strong_signals=False, device="cuda", **gin) as dc:
        kernel = Kernel(VALUE_CONTEXT_RESET, "value_context_reset")
        for launch in (1, 2):
            out = cupy.zeros(1, np.uint64)
            kernel.launch(dc, 1, args=(out,))
            dc.synchronize()
            check("putValue on context 1 + lsaBarrier + resetSignal", out.get(), [5000 + 10 * launch + (r - 1) % n])
    nbytes = 100
    with DeviceComm(world, window_bytes=64, device="cuda", max_channels=2, **gin) as dc:
        kernel = Kernel(PRIMS_PER_PEER, "prims_per_peer")
        for launch in (1, 2):
            src = cupy.asarray(
                np.array([(r * 16 + j) * launch % 256 for j in range(n) for _ in range(nbytes)], np.uint8)
            )
            dst = cupy.zeros(n * nbytes, np.uint8)
            kernel.launch(dc, 1, args=(src, dst, nbytes))
            dc.synchronize()
            want = [0 if j == r else (j * 16 + r) * launch % 256 for j in range(n) for _ in range(nbytes)]
            check("connectSend / connectRecv", dst.get(), want)
    return wrong


def precompile(cc: int) -> int:
    """Builds every user kernel this script and the examples launch into the image
    cache, one NVRTC process each, so that no rank compiles while its peers wait."""
    import concurrent.futures

    from commref.collectives.device_api import ep_buffer
    from commref.device_kernels import gpu_loader

    kernels = [
        Kernel(EXCHANGE, "exchange"),
        Kernel(COUNTED, "counted"),
        Kernel(COUNTERS_GET, "counters_get"),
        Kernel(VALUE_CONTEXT_RESET, "value_context_reset"),
        Kernel(PRIMS_PER_PEER, "prims_per_peer"),
        rmsnorm.kernel(),
        *{ep_buffer.kernel(name).path: ep_buffer.kernel(name) for name in ep_buffer.KERNELS}.values(),
    ]
    paths = [k.path for k in kernels] + [Path(__file__).resolve().parents[1] / "kernels" / "multicast.cu"]
    with concurrent.futures.ProcessPoolExecutor(len(paths)) as pool:  # multicast.cu: tests/test_gpu_multicast.py's
        for image in pool.map(gpu_loader.build_user_gpu_image, paths, [cc] * len(paths)):
            print(image)
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--precompile"]:
        return precompile(int(sys.argv[2]))
    try:
        Kernel(
            '#include "commref/device.h"\nusing namespace commref;\n'
            "COMMREF_KERNEL(broken, KernelArgs, args) {\n  int x = ;\n}\n",
            "broken",
        ).compile("cuda")
        print("FAIL: a syntax error compiled")
        return 1
    except CompileError as e:
        print(str(e)[:300])
        if "broken.cu(4)" not in str(e):
            print("FAIL: the message does not name broken.cu(4)")
            return 1
    args = sys.argv[1:]
    np_ = int(args[args.index("--np") + 1]) if "--np" in args else 2
    for path in [args[args.index("--path") + 1]] if "--path" in args else ["lsa", "gin"]:
        wrong = [w for ws in ThreadWorld.run(np_, _device_ops, path) for w in ws]
        print(f"# device API operations, {np_} ranks, {path}: {len(wrong)} wrong")
        for w in wrong[:10]:
            print("  " + w)
        if wrong:
            return 1
    return rmsnorm._main(["--device", "cuda", "--hidden", "256", "--iters", "3", *args])


if __name__ == "__main__":
    sys.exit(main())
