// Host-side atomics for the GIN proxy (transports/gin/proxy.py and its parts): it takes
// descriptors from a queue that kernels publish, lands data and applies signals in
// windows that kernels poll, possibly in another process. Loaded by
// transports/gin/atomics.py; the memory orders are the ones the device side pairs with
// (include/commref/atomics.h: system-scope acquire / release). The launch record's
// claim (collectives/launch_record.py, Communicator.abort) uses the 32-bit pair.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#include "commref/land.h"

extern "C" __attribute__((visibility("default"))) uint64_t commref_gin_atomic_add_u64(uint64_t* p, uint64_t v) {
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);  // release: data landed before is visible first
}
extern "C" __attribute__((visibility("default"))) uint64_t commref_gin_load_acquire_u64(const uint64_t* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
extern "C" __attribute__((visibility("default"))) void commref_gin_store_release_u64(uint64_t* p, uint64_t v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
// Whether *p was `expected` and is now `desired` (acquire-release), as a kernel's
// commref_fail claims an ErrorRecord (include/commref/wait.h).
extern "C" __attribute__((visibility("default"))) int commref_gin_cas_u32(uint32_t* p, uint32_t expected,
                                                                          uint32_t desired) {
  return __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
extern "C" __attribute__((visibility("default"))) void commref_gin_store_release_u32(uint32_t* p, uint32_t v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
// A put's bytes landed where kernels may poll them: landLines (commref/land.h).
extern "C" __attribute__((visibility("default"))) void commref_gin_land(void* dst, const void* src, uint64_t n) {
  commref::landLines(dst, src, n);
}
// A host producer's ring (include/commref/gin.h, COMMREF_GIN_QUEUE_IDLE): after its
// publish, a sequentially consistent fence, then a wake of the engine sleeping on the
// queue's idle word if the word reads nonzero (as commref_wake_sleeper does for kernels).
extern "C" __attribute__((visibility("default"))) void commref_gin_wake_sleeper(uint32_t* word) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (__atomic_load_n(word, __ATOMIC_RELAXED) != 0)
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}
