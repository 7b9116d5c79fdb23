#!/usr/bin/env bash
# Every GPU check in one run, for a machine with one NVIDIA GPU (see README "GPU").
# Wheels the machine's image lacks travel in .whl/ (tests/gpu/fetch_wheels.sh fetches them).
# Usage: bash tests/gpu/gpu_check.sh                     (from the repository root)
#        GPU_CHECK_DRY_RUN=1 bash tests/gpu/gpu_check.sh  (lists the steps, runs nothing)
# Every step has a deadline; with the install's they bound the run (the sum is printed at
# the end, and by the dry run). COMMREF_TIMEOUT, the deadline of every wait inside commref, is below every step's,
# so a hang ends in commref's diagnostic (rank, peer, expected vs seen), not in rc 124.
set -u
cd "$(dirname "$0")/../.."
DRY=${GPU_CHECK_DRY_RUN:-0}
INSTALL_S=15 PROBE_S=5  # the wheels' install; each probe outside a step (MPI's name, the GPU's architecture)
export COMMREF_TIMEOUT=8 NCCL_MULTI_RANK_GPU_ENABLE=1 CUDA_MODULE_LOADING=EAGER NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# The image's own CUDA packages (cuda-bindings, cuda-core, cuda-pathfinder, CuPy, mpi4py)
# match its CUDA major; a wheel of one of them would shadow it from /tmp/site: not installed.
wheels=$(ls .whl/*.whl 2>/dev/null | grep -v -E '/(cuda_bindings|cuda_core|cuda_pathfinder|cupy[_a-z0-9]*|mpi4py|numpy)-')
if [ "$DRY" != 1 ] && [ -n "$wheels" ]; then
  timeout $INSTALL_S python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $wheels && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
MPIEXEC=$(command -v mpiexec || command -v mpirun || echo /tmp/site/bin/mpiexec)  # the one mpi4py was built with
PY=$(command -v python3)  # absolute: the launcher's PATH may find another python3
export PYTHONPATH=$PWD:${PYTHONPATH:-}  # commref from this tree, no install
MPIFLAGS=""
if timeout $PROBE_S "$MPIEXEC" --version 2>&1 | grep -q "Open MPI"; then
  MPIFLAGS="--oversubscribe -x PYTHONPATH -x COMMREF_TIMEOUT -x NCCL_MULTI_RANK_GPU_ENABLE -x CUDA_MODULE_LOADING -x NCCL_DEBUG"
fi
MPI2="$MPIEXEC -n 2 $MPIFLAGS $PY -m mpi4py"
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
SWEEP2="tests/gpu/thread_world_gpu.py --np 2 --channels 1 --dtype float32 --op sum --count 7 1001"
# The 2-rank sweep under compute-sanitizer ($0: the tool), or a skip where it is not installed.
SANITIZE='[ -n "$SANITIZER" ] || { echo "skip: compute-sanitizer is not installed"; exit 77; }; '\
'exec "$SANITIZER" --tool "$0" --error-exitcode 1 "$PY" '"$SWEEP2"
export SANITIZER PY

status=0 planned=$((INSTALL_S + 2 * PROBE_S))
step() {  # step NAME DEADLINE COMMAND...: rc 0 passes, 77 is a skip (the command says why), else fails
  local name=$1 limit=$2; shift 2
  planned=$((planned + limit))
  [ "$limit" -gt "$COMMREF_TIMEOUT" ] || { echo "gpu_check: step '$name' ($limit s) not above COMMREF_TIMEOUT"; status=1; }
  if [ "$DRY" = 1 ]; then echo "=== $name [$limit s]: $*"; return; fi
  echo; echo "=== $name [$limit s]"
  local t0=$SECONDS rc
  timeout "$limit" "$@"; rc=$?
  case $rc in
    0) echo "=== ok in $((SECONDS - t0)) s" ;;
    77) echo "=== skipped in $((SECONDS - t0)) s" ;;
    124) echo "=== FAIL: the step's $limit s deadline passed before commref's ($COMMREF_TIMEOUT s)"; status=1 ;;
    *) echo "=== FAIL rc=$rc in $((SECONDS - t0)) s"; status=1 ;;
  esac
}
echo "gpu_check: COMMREF_TIMEOUT=$COMMREF_TIMEOUT s; mpiexec: $MPIEXEC $MPIFLAGS"

step "versions: driver, CUDA, CuPy, NCCL, MPI" 10 python3 - <<'EOF'
import subprocess
print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip())
import cupy
rt = cupy.cuda.runtime
print(f"CUDA driver {rt.driverGetVersion()}, runtime {rt.runtimeGetVersion()}; CuPy {cupy.__version__}")
try:
    import nccl.core as nccl
    print(f"NCCL {nccl.get_version()} (nccl4py {nccl.__version__})")
except Exception as e:
    try:
        from cupy.cuda import nccl as cupy_nccl
        print(f"NCCL {cupy_nccl.get_version()} (CuPy's bindings; nccl4py: {e})")
    except Exception as e2:
        print(f"NCCL: none found (nccl4py: {e}; CuPy: {e2})")
from mpi4py import MPI
print(MPI.Get_library_version().splitlines()[0])
import commref
print("commref", commref.__version__, "from", commref.__file__)
from commref.collectives import nvls
why = nvls.multicast_support("cuda")
print(f"NVLink multicast: {why or 'supported'}; {cupy.cuda.runtime.getDeviceCount()} GPU(s); algorithm nvls runs"
      " its LSA emulation in the MPI check below; the GPU tests' multicast test runs multimem PTX over a multicast"
      " object where the device has one (its skip says why not)")
EOF
CC=90
[ "$DRY" = 1 ] || CC=$(timeout $PROBE_S python3 -c "import cupy; print(cupy.cuda.Device(0).compute_capability)") || CC=90
# Every module the steps below load (their dtypes and ops), built before any rank starts,
# NVRTC processes in parallel: collectives' modules and users' kernels at once.
step "compile collectives and users' kernels for sm_$CC (NVRTC)" 45 bash -c \
  "python3 -m commref.device_kernels.loader --gpu $CC --dtype float32 bfloat16 int32 int8 --op sum max >/dev/null &
   python3 tests/gpu/device_api_gpu.py --precompile $CC >/dev/null; a=\$?; wait \$!; b=\$?; exit \$((a | b))"
step "GPU tests (pytest -m gpu; -rs: each skip says why)" 20 python3 -m pytest -q -rs -m gpu tests -p no:cacheprovider
step "4 ranks as threads on one GPU" 15 python3 tests/gpu/thread_world_gpu.py --np 4 --dtype float32 bfloat16 int8 \
  --op sum max --count 0 7 1001 65537
step "8 ranks as threads on one GPU" 15 python3 tests/gpu/thread_world_gpu.py --np 8 --channels 1 --dtype float32 \
  --op sum max --count 7 1001 65537
step "2 MPI ranks on one GPU through CUDA IPC (ring, tree, direct, nvls)" 20 $MPI2 -m commref.cli check --device cuda \
  --dtype float32 bfloat16 int32 --op sum max --count 0 7 1001 65537
step "protocols simple and LL, 2 MPI ranks (the tuner never picks LL on cuda)" 15 $MPI2 -m commref.cli check \
  --device cuda --protocol simple ll --algorithm ring tree --dtype float32 int8 --op sum --count 7 1001 65537
step "GIN: 2 ranks as threads (proxy strong; gda signal-per-put)" 15 bash -c \
  "python3 tests/gpu/thread_world_gpu.py --np 2 --path gin --dtype float32 int8 --op sum max --count 0 7 65537 &&
   python3 tests/gpu/thread_world_gpu.py --np 2 --path gin --backend gda --gin-protocol signal-per-put \
     --dtype float32 --op sum --count 7 65537"
step "GIN: 2 MPI ranks, network shm (CUDA IPC)" 12 $MPI2 -m commref.cli check --device cuda --path gin \
  --network shm --dtype float32 int32 --op sum max --count 0 7 65537
step "GIN: 2 MPI ranks, network mpi (device-to-host, MPI, host-to-device)" 12 $MPI2 -m commref.cli check \
  --device cuda --path gin --network mpi --dtype float32 --op sum --count 7 65537
step "hierarchical and alltoall: 4 thread ranks, 2 simulated nodes" 15 env COMMREF_NODES=2 python3 \
  tests/gpu/thread_world_gpu.py --np 4 --path auto --dtype float32 int32 --op sum avg --count 0 7 65537
step "device API: every operation over LSA and GIN, fused RMSNorm; 4 thread ranks, then 2 simulated nodes" 28 \
  bash -c "python3 tests/gpu/device_api_gpu.py --np 4 &&
    COMMREF_NODES=2 python3 tests/gpu/device_api_gpu.py --np 4 --path auto"
step "failure paths: mismatch, abort, proxy error, residency refusal" 20 python3 tests/gpu/failures_gpu.py
step "EP dispatch and combine: 4 thread ranks over LSA; 2x2 simulated nodes over GIN" 15 bash -c \
  "python3 -m commref.ep --np 4 --device cuda &&
    COMMREF_NODES=2 python3 -m commref.ep --np 4 --device cuda --path auto --protocol headers"
step "commref vs NCCL (nccl4py), 2 MPI ranks on one GPU" 15 $MPI2 tests/gpu/nccl_compare.py
step "bench: ours vs NCCL, 2 MPI ranks" 15 $MPI2 -m commref.cli bench all_reduce -b 8 -e 16M -f 8 \
  --device cuda -n 5 -w 2 -R 0,2
step "bench: 4 ranks as threads" 10 "$PY" -m commref.cli bench all_reduce -b 8 -e 16M -f 8 -t 4 --device cuda -n 5 -w 2
step "compute-sanitizer memcheck, 2 thread ranks" 18 bash -c "$SANITIZE" memcheck
step "compute-sanitizer racecheck, 2 thread ranks" 18 bash -c "$SANITIZE" racecheck

verdict=$([ $status -eq 0 ] && echo PASS || echo FAIL)
[ "$DRY" = 1 ] && verdict="dry run, nothing ran"
echo; echo "gpu_check: worst case $planned s (steps, install and probes), COMMREF_TIMEOUT $COMMREF_TIMEOUT s; $verdict"
exit $status
