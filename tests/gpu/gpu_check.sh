#!/usr/bin/env bash
# Every GPU check in one run, for a machine with one NVIDIA GPU (see README "GPU").
# Wheels missing on that machine travel in .whl/ (tests/gpu/fetch_wheels.sh fetches them).
# Usage: bash tests/gpu/gpu_check.sh   (from the repository root; each step has a deadline,
# together 480 s, so the run ends within 8 minutes)
set -u
cd "$(dirname "$0")/../.."
# The launcher must match the MPI that mpi4py was built with: prefer the machine's own.
MPIEXEC=$(command -v mpiexec || command -v mpirun || true)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
[ -n "$MPIEXEC" ] || MPIEXEC=/tmp/site/bin/mpiexec
PY=$(command -v python3)  # absolute: the launcher's PATH may find another python3
# commref itself from this tree, no install (commref/__init__.py finds the layer folders).
export PYTHONPATH=$PWD:${PYTHONPATH:-}
python3 -c "import commref; print('commref', commref.__version__, 'from', commref.__file__)" || exit 1
export PYTHONPATH=${PYTHONPATH:-} COMMREF_TIMEOUT=${COMMREF_TIMEOUT:-60} NCCL_MULTI_RANK_GPU_ENABLE=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
MPIFLAGS=""
if "$MPIEXEC" --version 2>&1 | grep -q "Open MPI"; then
  MPIFLAGS="--oversubscribe -x PYTHONPATH -x COMMREF_TIMEOUT -x NCCL_MULTI_RANK_GPU_ENABLE -x CUDA_MODULE_LOADING -x NCCL_DEBUG"
fi
export CUDA_MODULE_LOADING=EAGER NCCL_DEBUG=${NCCL_DEBUG:-WARN}
echo "mpiexec: $MPIEXEC $MPIFLAGS"; python3 -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
status=0
step() { echo; echo "=== $1"; shift; local t0=$SECONDS; "$@"; local rc=$?; echo "=== rc=$rc in $((SECONDS - t0)) s"; [ $rc -eq 0 ] || status=1; }
nvidia-smi -L
python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())"
# Build every GPU module the checks below use into the image cache before any rank
# starts (one NVRTC process per module); the ranks then only load them.
CC=$(python3 -c "import cupy; print(cupy.cuda.Device(0).compute_capability)")
step "compile kernels for sm_$CC (NVRTC)" timeout 65 python3 -m commref.device_kernels.loader --gpu "$CC" \
  --dtype float32 bfloat16 float16 float64 int32 int8 uint8 --op sum prod max min
step "GPU tests (pytest -m gpu)" timeout 40 python3 -m pytest -q -m gpu tests -p no:cacheprovider
step "4 ranks in ThreadWorld on one GPU" timeout 40 python3 tests/gpu/thread_world_gpu.py --np 4
step "2 MPI ranks on one GPU through CUDA IPC" timeout 45 "$MPIEXEC" -n 2 $MPIFLAGS "$PY" -m mpi4py -m commref.cli check \
  --device cuda --dtype float32 bfloat16 int32 --count 0 7 1001 65537
# GIN on the GPU: the copy-engine proxy (transports/gin/gpu_proxy.py; needs cuda-python)
step "GIN: 2 ranks as threads on one GPU (proxy strong, gda signal-per-put)" timeout 35 bash -c \
  "python3 tests/gpu/thread_world_gpu.py --np 2 --path gin --dtype float32 int8 --op sum max --count 0 7 1001 65537 &&
   python3 tests/gpu/thread_world_gpu.py --np 2 --path gin --backend gda --gin-protocol signal-per-put --dtype float32 --op sum --count 7 65537"
step "GIN: 2 MPI ranks on one GPU through CUDA IPC (network shm)" timeout 35 "$MPIEXEC" -n 2 $MPIFLAGS "$PY" -m mpi4py \
  -m commref.cli check --device cuda --path gin --network shm --dtype float32 int32 --count 0 7 1001 65537
step "GIN: 2 MPI ranks on one GPU, network mpi (device-to-host, MPI, host-to-device)" timeout 35 "$MPIEXEC" -n 2 \
  $MPIFLAGS "$PY" -m mpi4py -m commref.cli check --device cuda --path gin --network mpi --dtype float32 --count 0 7 65537
step "hierarchical and alltoall: 4 ranks as threads on one GPU, 2 simulated nodes (LSA inside, GIN across)" \
  timeout 30 env COMMREF_NODES=2 python3 tests/gpu/thread_world_gpu.py --np 4 --path auto --dtype float32 int32 \
  --op sum avg --count 0 7 1001 65537
step "device API: users' kernels (NVRTC), fused RMSNorm, 4 ranks as threads on one GPU; GIN across 2 simulated nodes" \
  timeout 35 bash -c "python3 tests/gpu/device_api_gpu.py --np 4 &&
    COMMREF_NODES=2 python3 tests/gpu/device_api_gpu.py --np 4 --path auto"
step "EP: MoE dispatch and combine (commref.ep, both modes), 4 ranks as threads on one GPU over LSA; 2x2 simulated nodes over GIN (headers)" \
  timeout 25 bash -c "python3 -m commref.ep --np 4 --device cuda &&
    COMMREF_NODES=2 python3 -m commref.ep --np 4 --device cuda --path auto --protocol headers"
step "commref vs NCCL (nccl4py), 2 ranks one GPU" timeout 35 "$MPIEXEC" -n 2 $MPIFLAGS "$PY" -m mpi4py tests/gpu/nccl_compare.py
if [ -f bench/harness.py ] && [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then
  step "bench: ours vs NCCL, 2 ranks one GPU" timeout 40 "$MPIEXEC" -n 2 $MPIFLAGS "$PY" -m mpi4py -m commref.cli bench \
    all_reduce -b 8 -e 64M -f 8 --device cuda -n 5 -w 2 -R 0,2
  step "bench: 4 ranks as threads on one GPU" timeout 20 "$PY" -m commref.cli bench \
    all_reduce -b 8 -e 64M -f 8 -t 4 --device cuda -n 5 -w 2
fi
echo; echo "gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
