// commref/port.h — the one place where CUDA and the CPU engine differ.
//
// Kernel code is written in CUDA C++ and uses only what this header provides:
//   - __global__ / __device__ / __forceinline__, __shared__ (per block)
//   - threadIdx, blockIdx, blockDim, gridDim, __syncthreads()
//   - COMMREF_KERNEL(name, ArgsType, args): a kernel taking one plain struct by value
//   - commref_now_ns(), commref_spin_pause(spins), commref_kernel_abort()
//   - COMMREF_ELEM_STRIDE: the stride of a thread's element loop (see below)
//
// On the CPU (COMMREF_CPU defined) the CPU execution engine (cpu/engine.cpp) runs a
// grid as one OS thread per block and the threads of a block as fibers on that OS
// thread. Consequences that kernel code may rely on, on both targets:
//   - __shared__ variables are per block (static thread_local on the CPU: fibers of
//     one block share an OS thread and blocks never share one at the same time);
//   - __syncthreads() is a barrier of the live threads of the block;
//   - a spin wait must call commref_spin_pause(spins) so that sibling fibers, other blocks
//     and other ranks (oversubscribed cores) make progress.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define COMMREF_GPU 1
#else
#ifndef COMMREF_CPU
#define COMMREF_CPU 1
#endif
#endif

#ifdef COMMREF_GPU
#if defined(__CUDACC_RTC__)
// NVRTC has no standard headers; the fixed-width types are all we need.
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned short uint16_t;
typedef short int16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
#else
#include <stdint.h>
#endif

#define COMMREF_KERNEL(name, ArgsType, args) \
  extern "C" __global__ void __launch_bounds__(1024) name(const ArgsType args)

// GPU threads stride through elements so that a warp's accesses coalesce.
#define COMMREF_ELEM_STRIDE (blockDim.x)
#define COMMREF_HD __host__ __device__
// Functions that many kernels share stay out of line on the GPU: inlining every
// (dtype, op) instance into every kernel multiplies code size and compile time.
#define COMMREF_NOINLINE __noinline__

static __device__ __forceinline__ uint64_t commref_now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
static __device__ __forceinline__ void commref_spin_pause(uint32_t spins) {
  if (spins > 64) __nanosleep(64);
}
// The diagnostic is already in host-visible memory; a trap ends the kernel and
// makes the host's synchronize fail, which the launcher turns into the diagnostic.
[[noreturn]] static __device__ __forceinline__ void commref_kernel_abort() {
  __trap();
  __builtin_unreachable();
}
static __device__ __forceinline__ void commref_memcpy(void* dst, const void* src, uint64_t bytes) {
  char* d = (char*)dst;
  const char* s = (const char*)src;
  for (uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) d[i] = s[i];
}

#else  // COMMREF_CPU

#include <stddef.h>
#include <stdint.h>
#include <string.h>

struct dim3 {
  unsigned x, y, z;
};

namespace commref_cpu {
// What a running CUDA thread sees; the engine points tl_thread at the running fiber.
struct ThreadState {
  dim3 tid, bid, bdim, gdim;  // threadIdx, blockIdx, blockDim, gridDim
};
extern thread_local ThreadState* tl_thread;
void syncthreads();
void spin_pause(uint32_t spins);
uint64_t now_ns();
[[noreturn]] void kernel_abort();
// Every COMMREF_KERNEL of the library registers itself while the library loads; the
// ABI table (cpu/abi.cpp) lists what registered.
typedef void (*KernelFn)(const void* args);
struct KernelInfo {
  const char* name;
  const char* argsType;  // the struct the kernel takes
  KernelFn fn;
};
bool register_kernel(const KernelInfo& kernel);
unsigned kernel_count();
const KernelInfo& kernel_at(unsigned i);
}  // namespace commref_cpu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(x)
#define __shared__ static thread_local
#define threadIdx (commref_cpu::tl_thread->tid)
#define blockIdx (commref_cpu::tl_thread->bid)
#define blockDim (commref_cpu::tl_thread->bdim)
#define gridDim (commref_cpu::tl_thread->gdim)
#define __syncthreads() commref_cpu::syncthreads()
#define COMMREF_HD
#define COMMREF_NOINLINE

// The engine calls every kernel through one signature: void(const void* args).
#define COMMREF_KERNEL(name, ArgsType, args)                                                   \
  static void name##__body(const ArgsType& args);                                              \
  extern "C" __attribute__((visibility("default"))) void name(const void* p) {                \
    name##__body(*static_cast<const ArgsType*>(p));                                            \
  }                                                                                            \
  [[maybe_unused]] static const bool name##__registered =                                      \
      commref_cpu::register_kernel(commref_cpu::KernelInfo{#name, #ArgsType, name});           \
  static void name##__body(const ArgsType& args)

// CPU threads of a block take contiguous element ranges (see elemRange in flow.h),
// so the inner loops have unit stride and vectorize.
#define COMMREF_ELEM_STRIDE 1

static inline uint64_t commref_now_ns() { return commref_cpu::now_ns(); }
static inline void commref_spin_pause(uint32_t spins) { commref_cpu::spin_pause(spins); }
[[noreturn]] static inline void commref_kernel_abort() { commref_cpu::kernel_abort(); }
static inline void commref_memcpy(void* dst, const void* src, uint64_t bytes) {
  // Thread t of the block copies its contiguous share.
  uint64_t nt = blockDim.x, t = threadIdx.x;
  uint64_t b = bytes * t / nt, e = bytes * (t + 1) / nt;
  if (e > b) memcpy((char*)dst + b, (const char*)src + b, e - b);
}
#endif

// A thread's share of n elements: for (i = begin; i < n_end; i += COMMREF_ELEM_STRIDE).
struct ElemRange {
  uint64_t begin, end;
};
static __device__ __forceinline__ ElemRange elemRange(uint64_t n) {
#ifdef COMMREF_GPU
  return ElemRange{threadIdx.x, n};
#else
  uint64_t nt = blockDim.x, t = threadIdx.x;
  return ElemRange{n * t / nt, n * (t + 1) / nt};
#endif
}
