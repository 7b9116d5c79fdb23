// commref/coop.h — cooperative scopes (NCCL's ncclCoop*): which threads of a block
// call a device-API operation together. DeviceComm's operations are block-collective
// (CoopCta) unless given another scope as their first argument.
//
// Contract:
//   - A warp is the 32 threads [32 w, 32 w + 32) of a block (fewer in a block's last
//     warp when blockDim.x is not a multiple of 32), on the GPU and on the CPU engine
//     alike (COMMREF_WARP_SIZE).
//   - CoopThread: the calling thread alone. CoopWarp: the caller's warp. CoopTile<N>
//     (N a power of two, 1 <= N <= 32): the N consecutive threads [N t, N t + N) of the
//     caller's warp. CoopCta: the whole block.
//   - thread_rank() is the caller's index in the scope, size() the scope's threads; its
//     leader is thread_rank() 0.
//   - sync(): every thread of the scope has reached it, and their earlier memory
//     operations are visible to each other (GPU: __syncwarp(mask) / __syncthreads; CPU
//     engine: the scope's fibers meet, commref_cpu::warp_sync). any(p): sync() that
//     returns whether p was true in any of them; broadcast(v): sync() that returns the
//     leader's v to every thread of the scope.
//   - Every thread of a scope calls these (and every operation given the scope) at the
//     same point with the same arguments; threads outside it do not take part. A warp
//     scope waits only for its own threads, so warps of one block proceed independently
//     between block-wide calls. A thread must not wait in a warp scope for a thread of it
//     that waits at __syncthreads (on the CPU engine that ends the launch, KernelError).
#pragma once
#include "wait.h"

#define COMMREF_WARP_SIZE 32

#ifdef COMMREF_CPU
namespace commref_cpu {
// cpu/engine.cpp: the threads of the caller's warp named by `mask` (bit i: lane i) meet;
// returns the OR of their `value`s (mode 0) or the value of the lowest lane of `mask`
// (mode 1). Lanes of the mask past the block's end, or whose threads have returned, do
// not take part.
uint64_t warp_sync(uint32_t mask, uint64_t value, int mode);
}  // namespace commref_cpu
#endif

namespace commref {

// The lanes of the caller's warp that exist (the block's last warp may be partial).
static __device__ __forceinline__ uint32_t warpLanesPresent() {
  const uint32_t base = threadIdx.x & ~(COMMREF_WARP_SIZE - 1u), n = blockDim.x - base;
  return n >= 32 ? 0xffffffffu : (1u << n) - 1u;
}
static __device__ __forceinline__ uint32_t laneOf() { return threadIdx.x & (COMMREF_WARP_SIZE - 1u); }

// The scope of the lanes `mask` of the caller's warp (CoopWarp, CoopTile).
struct CoopLanes {
  typedef void CoopTag;
  uint32_t mask;
  __device__ int thread_rank() const { return popcLanes(mask & ((1u << laneOf()) - 1u)); }
  __device__ int size() const { return popcLanes(mask); }
  __device__ void sync() const {
#ifdef COMMREF_GPU
    __syncwarp(mask);
#else
    commref_cpu::warp_sync(mask, 0, 0);
#endif
  }
  __device__ bool any(bool p) const {
#ifdef COMMREF_GPU
    return __any_sync(mask, p);
#else
    return commref_cpu::warp_sync(mask, p ? 1 : 0, 0) != 0;
#endif
  }
  __device__ uint64_t broadcast(uint64_t v) const {
#ifdef COMMREF_GPU
    return __shfl_sync(mask, (unsigned long long)v, __ffs(mask) - 1);
#else
    return commref_cpu::warp_sync(mask, v, 1);
#endif
  }
  static __device__ __forceinline__ int popcLanes(uint32_t m) {
#ifdef COMMREF_GPU
    return __popc(m);
#else
    return __builtin_popcount(m);
#endif
  }
};

struct CoopThread {
  typedef void CoopTag;
  __device__ int thread_rank() const { return 0; }
  __device__ int size() const { return 1; }
  __device__ void sync() const {}
  __device__ bool any(bool p) const { return p; }
  __device__ uint64_t broadcast(uint64_t v) const { return v; }
};

struct CoopWarp : CoopLanes {
  __device__ CoopWarp() : CoopLanes{warpLanesPresent()} {}
};

template <int N>
struct CoopTile : CoopLanes {
  static_assert(N >= 1 && N <= COMMREF_WARP_SIZE && (N & (N - 1)) == 0, "a tile is a power of two up to a warp");
  __device__ CoopTile()
      : CoopLanes{(N == 32 ? 0xffffffffu : ((1u << N) - 1u) << (laneOf() / N * N)) & warpLanesPresent()} {}
};

struct CoopCta {
  typedef void CoopTag;
  __device__ int thread_rank() const { return threadIdx.x; }
  __device__ int size() const { return blockDim.x; }
  __device__ void sync() const { __syncthreads(); }
  __device__ bool any(bool p) const { return __syncthreads_or(p) != 0; }
  __device__ uint64_t broadcast(uint64_t v) const {
    __shared__ uint64_t word;
    __syncthreads();  // every thread has read the previous broadcast's word
    if (threadIdx.x == 0) word = v;
    __syncthreads();
    return word;
  }
};

// The scope's share of `bytes` (contiguous ranges), copied by the calling thread.
template <typename Coop>
static __device__ __forceinline__ void coopCopy(const Coop& c, uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  const uint64_t n = (uint64_t)c.size(), t = (uint64_t)c.thread_rank();
  for (uint64_t i = bytes * t / n, end = bytes * (t + 1) / n; i < end; i++) dst[i] = src[i];
}

}  // namespace commref
