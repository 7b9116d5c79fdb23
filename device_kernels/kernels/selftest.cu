// Kernels that exercise the execution engine itself (tests and bench/engine_bench.py).
#include "commref/ring.h"

// Block b copies its share of the bytes; the threads of a block split that share.
COMMREF_KERNEL(commref_copy, CopyArgs, args) {
  const Share s = channelShare(args.bytes, blockIdx.x, gridDim.x);
  copyOwnShare<uint8_t>((uint8_t*)args.dst + s.begin, (const uint8_t*)args.src + s.begin, s.end - s.begin);
}

COMMREF_KERNEL(commref_empty, CopyArgs, args) {}

// Checks the CUDA execution model: per-block __shared__, __syncthreads(), indices.
// dst[block] = blockIdx * 1000000 + sum over threads (threadIdx + 1) + gridDim * 1000,
// where the sum is read back through shared memory after a barrier.
COMMREF_KERNEL(commref_engine_selftest, CopyArgs, args) {
  __shared__ uint64_t contrib[1024];
  contrib[threadIdx.x] = threadIdx.x + 1;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t sum = 0;
    for (unsigned t = 0; t < blockDim.x; t++) sum += contrib[t];
    ((uint64_t*)args.dst)[blockIdx.x] = blockIdx.x * 1000000ull + sum + gridDim.x * 1000ull;
  }
  __syncthreads();
  contrib[threadIdx.x] = 0;  // reused by the next block on this OS thread: must not leak
}
