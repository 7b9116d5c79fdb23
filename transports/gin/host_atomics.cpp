// Host-side atomics for the GIN proxy (transports/gin/proxy.py and its parts): it takes
// descriptors from a queue that kernels publish, lands data and applies signals in
// windows that kernels poll, possibly in another process. Loaded by
// transports/gin/atomics.py; the memory orders are the ones the device side pairs with
// (include/commref/atomics.h: system-scope acquire / release).
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
// A put's bytes landed where kernels may poll them: landLines (commref/land.h).
extern "C" __attribute__((visibility("default"))) void commref_gin_land(void* dst, const void* src, uint64_t n) {
  landLines(dst, src, n);
}
