#!/usr/bin/env bash
# Downloads, on a machine with an index, the wheels that tests/gpu/gpu_check.sh needs and
# the GPU machine's image lacks: MPICH (for mpiexec) and nccl4py, for Python 3.12. The
# image has CuPy 14 (cupy-cuda13x), cuda-bindings 13, cuda-core, cuda-pathfinder,
# nvidia-nccl-cu13 and mpi4py, matching its CUDA 13: none of them is fetched, since a copy
# in /tmp/site (first on PYTHONPATH) would shadow the image's own. NCCL itself cannot
# travel (its wheel is about 300 MB; a run carries 64 MiB): nccl_compare.py prints the
# image's NCCL version and skips in one line where it refuses two ranks on one GPU.
# The wheels go to .whl/ (ignored by git), emptied first; carry .whl with the run.
# Usage: bash tests/gpu/fetch_wheels.sh   (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/../.."
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl mpich nccl4py
ls -l .whl
