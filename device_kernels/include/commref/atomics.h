// commref/atomics.h — 64-bit flag operations at system scope.
//
// Flags (step counters, credits, signals) are the only words that two agents touch
// concurrently; everything else is plain data whose visibility a flag publishes.
//   store_release(p, v): every write this thread made (and, after __syncthreads(),
//                        every write its block made) is visible before p == v is.
//   load_acquire(p):     reads after it see everything published by the release
//                        store it observed.
//   load_relaxed / store_relaxed: no ordering; for polling or private counters.
//   fetch_add_release(p, v): an add that publishes like store_release (a signal of
//                        several writers, device.h).
//   load_relaxed_u32 / store_release_u32: the same for a 32-bit word (the ErrorRecord's
//                        code, wait.h).
// Scope is the whole system (other GPUs, the host, other processes mapping the page).
#pragma once
#include "port.h"

namespace commref {

#ifdef COMMREF_GPU
static __device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
static __device__ __forceinline__ uint64_t load_relaxed(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
static __device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
  __threadfence_system();  // cumulativity for the block's writes ordered by bar.sync
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ void store_relaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ uint32_t load_relaxed_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Orders this thread's earlier writes before p == v (the writes are its own: no fence).
static __device__ __forceinline__ void store_release_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ uint64_t fetch_add_relaxed(uint64_t* p, uint64_t v) {
  return atomicAdd((unsigned long long*)p, (unsigned long long)v);
}
// Adds v to *p after every write this thread (and, after __syncthreads(), its block)
// made is visible: a signal another agent waits on with load_acquire.
static __device__ __forceinline__ uint64_t fetch_add_release(uint64_t* p, uint64_t v) {
  __threadfence_system();
  uint64_t old;
  asm volatile("atom.release.sys.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}
static __device__ __forceinline__ bool cas_relaxed(uint32_t* p, uint32_t expected, uint32_t desired) {
  return atomicCAS((unsigned int*)p, expected, desired) == expected;
}
#else
static inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline uint64_t load_relaxed(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void store_release(uint64_t* p, uint64_t v) {
#ifdef COMMREF_TEST_BROKEN_RELEASE
  // Deliberately wrong, for the ThreadSanitizer negative test only: publishing a
  // flag without release lets the reader see the flag before the data.
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}
static inline void store_relaxed(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
static inline uint32_t load_relaxed_u32(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void store_release_u32(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline uint64_t fetch_add_relaxed(uint64_t* p, uint64_t v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline uint64_t fetch_add_release(uint64_t* p, uint64_t v) { return __atomic_fetch_add(p, v, __ATOMIC_RELEASE); }
static inline bool cas_relaxed(uint32_t* p, uint32_t expected, uint32_t desired) {
  return __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}
#endif

}  // namespace commref
