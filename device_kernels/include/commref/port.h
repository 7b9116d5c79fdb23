// commref/port.h — the one place where CUDA and the CPU engine differ.
//
// Kernel code is written in CUDA C++ and uses only what this header provides:
//   - __global__ / __device__ / __forceinline__, __shared__ (per block)
//   - threadIdx, blockIdx, blockDim, gridDim, __syncthreads(), __syncthreads_or(p)
//   - COMMREF_KERNEL(name, ArgsType, args): a kernel taking one plain struct by value
//     (on the GPU a __grid_constant__ parameter: `args` and every reference bound to
//     it read the kernel parameter space, no per-thread copy)
//   - commref_now_ns(), commref_spin_pause(spins), commref_block_exit()
//   - COMMREF_SLEEPING_SPINS: a spin count from which commref_spin_pause sleeps (rather
//     than pausing or yielding); a wait known to be long may start its count there
//   - commref_wake_sleeper(word, only = 0): after a sequentially consistent fence, wakes a
//     host thread of this process that sleeps on `word` (a futex) if the word reads
//     nonzero (`only` nonzero: if it reads `only`; the GIN engine's idle word, gin.h);
//     nothing on the GPU
//   - commref_help_progress(hook): a waiting thread's turn at what a host progress engine
//     of this process would do next (the GIN queue's help hook, gin.h): calls
//     ((int (*)(void*))hook[0])((void*)hook[1]) when hook[0] is set; whether it was set
//     (false on the GPU, where it does nothing)
//   - commref_help_later(hook): as commref_help_progress, but at the calling thread's next
//     commref_help_progress or, at the latest, as its block ends (cpu/engine.cpp);
//     whether hook[0] was set (false on the GPU). A block that called a hook calls its
//     end hook, ((void (*)(void*))hook[2])((void*)hook[1]), once as it ends, if set
//   - COMMREF_ELEM_STRIDE: the stride of a thread's element loop (see below)
//
// On the CPU (COMMREF_CPU defined) the CPU execution engine (cpu/engine.cpp) runs a
// grid as one OS thread per block and the threads of a block as fibers on that OS
// thread. Consequences that kernel code may rely on, on both targets:
//   - __shared__ variables are per block (static thread_local on the CPU: fibers of
//     one block share an OS thread and blocks never share one at the same time);
//   - __syncthreads() is a barrier of the live threads of the block, and
//     __syncthreads_or(p) one that returns nonzero to every thread when p was nonzero
//     in any of them;
//   - a spin wait must call commref_spin_pause(spins) so that sibling fibers, other blocks
//     and other ranks (oversubscribed cores) make progress.
//
// Failure (the contract of wait.h): a kernel never traps. A failing thread records the
// error (commref_fail, wait.h) and returns; at the next block-uniform barrier
// (leaveIfFailed, wait.h: __syncthreads_or of the failure) every thread of the block
// calls commref_block_exit() together. On the GPU that is the PTX `exit` of every
// thread of the block: the block ends, the rest of the grid runs on (and stops at its
// own next wait, which polls the error record), the launch completes normally and the
// CUDA context stays usable; the host reads the record. On the CPU it throws out of the
// fiber and the engine ends the launch with kLaunchFailed (cpu/engine.cpp), as it did
// before the GPU stopped trapping; other blocks stop at their next spin pause.
// commref_block_exit() must only be called by all threads of a block at once, after a
// block-uniform decision: had thread 0 (which does the waits) left alone, its siblings
// would pass the next barrier without it and go on moving data.
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

// The most threads per block a kernel is compiled for: __launch_bounds__(512, 1), the
// GPU default block (collectives/tuner.py). The host refuses more than a kernel's
// CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, so correctness does not hang on it. ptxas
// (CUDA 13, sm_90, float32-sum module; registers / stack bytes / spill store+load bytes;
// the chosen column with the LL and LL128 paths in the flow primitives):
//                     (1024), by-value args   (512)                (512, 1): chosen
//   ring allreduce    64 / 1248 / 300+596     64 / 496 / 364+456   124 / 544 / 0
//   ring allgather    64 / 1216 / 164+288     64 / 464 / 132+292   115 / 544 / 0
//   tree allreduce    64 / 1968 / 120+184     64 / 1136 / 88+96    114 / 1312 / 0
//   direct allreduce  64 / 1840 / 20+16       63 / 1440 / 0        78 / 1088 / 0
// The first column is before __grid_constant__ as well, which alone took ~800 bytes of
// stack off each kernel. 1024 caps a thread at 64 registers and spills around every
// step; 512 alone still made ptxas aim at two blocks per SM (64 registers); with
// minBlocks = 1 it may use up to 128 and spills nothing. What stack is left is the Prims
// objects (passed by address to the out-of-line step) and the direct kernels' per-peer
// pointer arrays. tests/test_compile.py checks the ring kernels' stack.
#define COMMREF_MAX_THREADS 512
#define COMMREF_KERNEL(name, ArgsType, args) \
  extern "C" __global__ void __launch_bounds__(COMMREF_MAX_THREADS, 1) name(const __grid_constant__ ArgsType args)

// GPU threads stride through elements so that a warp's accesses coalesce.
#define COMMREF_ELEM_STRIDE (blockDim.x)
#define COMMREF_HD __host__ __device__
// Functions that many kernels share stay out of line on the GPU: inlining every
// (dtype, op) instance into every kernel multiplies code size and compile time.
#define COMMREF_NOINLINE __noinline__

namespace commref {

static __device__ __forceinline__ uint64_t commref_now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define COMMREF_SLEEPING_SPINS 65u
static __device__ __forceinline__ void commref_spin_pause(uint32_t spins) {
  if (spins > 64) __nanosleep(64);
}
// Ends the calling thread; every thread of the block calls it at once (see the top).
// No __trap(): a trap would poison the CUDA context of every rank on the device.
[[noreturn]] static __device__ __forceinline__ void commref_block_exit() {
  asm volatile("exit;" ::: "memory");
  __builtin_unreachable();
}
static __device__ __forceinline__ void commref_wake_sleeper(uint32_t*, uint32_t = 0) {}
static __device__ __forceinline__ bool commref_help_progress(const uint64_t*) { return false; }
static __device__ __forceinline__ bool commref_help_later(const uint64_t*) { return false; }

}  // namespace commref

#else  // COMMREF_CPU

#include <math.h>  // CUDA's device math functions (sqrtf, ...) on the host
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "profile.h"

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
void wake_sleeper(uint32_t* word, uint32_t only);
uint64_t now_ns();
// The help hook this thread owes a call (commref_help_later), or nullptr; the engine
// calls it as each block ends. tl_helped: the last help hook the thread called, whose
// end hook (gin.h) the engine calls as the block ends.
extern thread_local const uint64_t *tl_owedHelp, *tl_helped;
[[noreturn]] void kernel_abort();
int syncthreads_or(int predicate);
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
#define __grid_constant__
#define __shared__ static thread_local
#define threadIdx (commref_cpu::tl_thread->tid)
#define blockIdx (commref_cpu::tl_thread->bid)
#define blockDim (commref_cpu::tl_thread->bdim)
#define gridDim (commref_cpu::tl_thread->gdim)
#define __syncthreads() commref_cpu::syncthreads()
#define __syncthreads_or(p) commref_cpu::syncthreads_or((p) ? 1 : 0)
#define COMMREF_HD
#define COMMREF_NOINLINE

// The engine calls every kernel through one signature: void(const void* args).
#define COMMREF_KERNEL(name, ArgsType, args)                                         \
  static void name##__body(const ArgsType& args);                                    \
  extern "C" __attribute__((visibility("default"))) void name(const void* p) {       \
    name##__body(*static_cast<const ArgsType*>(p));                                  \
  }                                                                                  \
  [[maybe_unused]] static const bool name##__registered =                            \
      commref_cpu::register_kernel(commref_cpu::KernelInfo{#name, #ArgsType, name}); \
  static void name##__body(const ArgsType& args)

// CPU threads of a block take contiguous element ranges (see elemRange in flow.h),
// so the inner loops have unit stride and vectorize.
#define COMMREF_ELEM_STRIDE 1

namespace commref {

static inline uint64_t commref_now_ns() { return commref_cpu::now_ns(); }
// cpu/engine.cpp: a pause below 32 spins, sched_yield below COMMREF_SLEEPING_SPINS, then 20 us sleeps.
#define COMMREF_SLEEPING_SPINS 20000u
static inline void commref_spin_pause(uint32_t spins) { commref_cpu::spin_pause(spins); }
// Throws out of the fiber: the engine abandons the block and returns kLaunchFailed.
[[noreturn]] static inline void commref_block_exit() { commref_cpu::kernel_abort(); }
static inline void commref_wake_sleeper(uint32_t* word, uint32_t only = 0) { commref_cpu::wake_sleeper(word, only); }
static inline bool commref_help_progress(const uint64_t* hook) {
  const uint64_t fn = __atomic_load_n(hook, __ATOMIC_ACQUIRE);
  if (!fn) return false;
  commref_cpu::tl_owedHelp = nullptr;
  commref_cpu::tl_helped = hook;
  COMMREF_PROFILE_SCOPE(kProfileHelp, 0);
  reinterpret_cast<int (*)(void*)>(fn)(reinterpret_cast<void*>(__atomic_load_n(hook + 1, __ATOMIC_RELAXED)));
  return true;
}
// The end hook of the last help hook the thread called (tl_helped), if set; the engine
// calls it as each block ends, after the help the block owes.
static inline void commref_help_end() {
  const uint64_t* hook = commref_cpu::tl_helped;
  commref_cpu::tl_helped = nullptr;
  const uint64_t fn = hook ? __atomic_load_n(hook + 2, __ATOMIC_ACQUIRE) : 0;
  if (!fn) return;
  COMMREF_PROFILE_SCOPE(kProfileHelp, 0);
  reinterpret_cast<void (*)(void*)>(fn)(reinterpret_cast<void*>(__atomic_load_n(hook + 1, __ATOMIC_RELAXED)));
}
static inline bool commref_help_later(const uint64_t* hook) {
  if (!__atomic_load_n(hook, __ATOMIC_ACQUIRE)) return false;
  commref_cpu::tl_owedHelp = hook;
  return true;
}
}  // namespace commref
#endif

namespace commref {
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

}  // namespace commref
