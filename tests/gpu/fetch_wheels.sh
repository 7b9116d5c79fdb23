#!/usr/bin/env bash
# Downloads, on a machine with an index, the wheels that tests/gpu/gpu_check.sh needs and
# the GPU machine lacks (its image has CuPy 14, cuda-bindings, cuda-pathfinder, NCCL and
# mpi4py, for Python 3.12): MPICH for mpiexec and nccl4py. They go to .whl/ (ignored by
# git), which gpu_check.sh installs from; carry .whl with the run.
# Usage: bash tests/gpu/fetch_wheels.sh   (from the repository root; ~17 MB)
set -euo pipefail
cd "$(dirname "$0")/../.."
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl mpich nccl4py "cuda-bindings>=12,<13" cuda-pathfinder
ls -l .whl
