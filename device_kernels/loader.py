"""The command that builds the kernels into the cache ahead of their first use:
``python -m commref.device_kernels.loader`` builds the CPU library (cpu_loader), and
with ``--gpu CC`` the GPU images of the data-movement module and of each requested
(dtype, op) specialization (gpu_loader), one process per NVRTC compile.
"""

from __future__ import annotations

import sys

from . import abi, cpu_loader, gpu_loader


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m commref.device_kernels.loader",
        description="Builds the CPU library, or with --gpu the GPU images, into the cache.",
    )
    p.add_argument("--gpu", type=int, metavar="CC", help="compute capability to build GPU images for (e.g. 90)")
    p.add_argument("--dtype", nargs="*", default=[], choices=sorted(abi.DTYPE_CODES), help="reduction dtypes")
    p.add_argument("--op", nargs="*", default=["sum", "prod", "max", "min"], choices=sorted(abi.OP_CODES))
    args = p.parse_args(argv)
    if args.gpu is None:
        print(cpu_loader.build_cpu_library())
        return 0
    specs = [None, *((abi.DTYPE_CODES[d], abi.OP_CODES[o]) for d in args.dtype for o in args.op)]
    specs = list({gpu_loader.specialization(s): s for s in specs}.values())  # avg shares sum's module
    for path in gpu_loader.build_gpu_images(specs, args.gpu):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
