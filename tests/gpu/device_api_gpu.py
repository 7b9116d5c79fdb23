"""The device API on a GPU: a user's kernel with a syntax error is reported by NVRTC
with its line, then the fused RMSNorm example (commref.rmsnorm) runs N ranks as
threads of one process on one GPU, each on its own non-blocking stream, exact against
numpy; arguments after --np go to `python -m commref.rmsnorm`.

    python tests/gpu/device_api_gpu.py --np 4
    COMMREF_NODES=2 python tests/gpu/device_api_gpu.py --np 4 --path auto
"""

import sys

from commref import rmsnorm
from commref.collectives.device_api import CompileError, Kernel


def main() -> int:
    try:
        Kernel('#include "commref/device.h"\nCOMMREF_KERNEL(broken, KernelArgs, args) {\n  int x = ;\n}\n',
               "broken").compile("cuda")
        print("FAIL: a syntax error compiled")
        return 1
    except CompileError as e:
        print(str(e)[:300])
        if "broken.cu(3)" not in str(e):
            print("FAIL: the message does not name broken.cu(3)")
            return 1
    return rmsnorm._main(["--device", "cuda", "--hidden", "256", "--iters", "5", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
