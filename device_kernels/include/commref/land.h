// commref/land.h — how host code lands bytes that another agent reads next: landLines, a
// GIN proxy's put into a window that kernels poll (transports/gin: host_atomics.cpp for the
// Python proxy, native_engine/shm_net.h; the line protocols it serves are described in proto.h),
// and streamBytes, a copy with non-temporal stores (the CPU kernels' streamed stores,
// move.h, and the native engine's bulk puts, gin.h kGinBulk). Host code only.
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

namespace commref {

#if defined(__x86_64__)
// Copies n bytes from src to dst so that every 16-byte aligned line of dst is written by
// one MOVDQA (inline assembly: the compiler neither splits nor merges it), lines in
// ascending address order, the bytes before the first line and after the last one by
// plain stores, before and after the lines. So a kernel polling LL lines sees each line
// whole (on CPUs with AVX, as LL itself needs), and one polling an LL128 line's flag sees
// the line's data first (x86-64 stores become visible in program order). `ahead`, as
// streamBytesUnfenced's: aheadBytes of the next copy's source prefetched as this one goes.
static inline void landLines(void* to, const void* from, uint64_t n, const char* ahead = nullptr,
                             uint64_t aheadBytes = 0) {
  char* dst = (char*)to;
  const char* src = (const char*)from;
  uint64_t head = (16 - ((uint64_t)(uintptr_t)dst & 15)) & 15;
  if (head > n) head = n;
  uint64_t i = 0;
  for (; i < head; i++) dst[i] = src[i];
  for (; i + 16 <= n; i += 16) {
    if (((i - head) & 63) == 0 && i - head < aheadBytes) _mm_prefetch(ahead + (i - head), _MM_HINT_T0);
    const __m128i v = _mm_loadu_si128((const __m128i*)(src + i));
    asm volatile("movdqa %1, %0" : "=m"(*(__m128i*)(dst + i)) : "x"(v) : "memory");
  }
  for (; i < n; i++) dst[i] = src[i];
}
#else
// Not x86-64: a plain copy (transports/gin/plan.py refuses LL and LL128 over GIN there).
static inline void landLines(void* to, const void* from, uint64_t n, const char* = nullptr, uint64_t = 0) {
  memcpy(to, from, n);
}
#endif

// ThreadSanitizer does not see non-temporal stores: its builds copy with memcpy.
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
#define COMMREF_HAVE_STREAM 1
// memcpy with non-temporal stores, not fenced: they may become visible after later
// stores of this thread, so the caller fences (_mm_sfence) before the store that
// publishes them. `ahead`: the source of the next copy, aheadBytes of it prefetched a
// line per line copied (a copy in pieces of a few KiB in no particular order, whose
// next piece the hardware's prefetchers cannot guess).
static inline void streamBytesUnfenced(char* dst, const char* src, uint64_t bytes, const char* ahead = nullptr,
                                       uint64_t aheadBytes = 0) {
  uint64_t head = (16 - ((uintptr_t)dst & 15)) & 15;
  if (head > bytes) head = bytes;
  memcpy(dst, src, head);
  dst += head, src += head, bytes -= head;
  uint64_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    if (i < aheadBytes) _mm_prefetch(ahead + i, _MM_HINT_T0);
    const __m128i a = _mm_loadu_si128((const __m128i*)(src + i)), b = _mm_loadu_si128((const __m128i*)(src + i + 16));
    const __m128i c = _mm_loadu_si128((const __m128i*)(src + i + 32)),
                  d = _mm_loadu_si128((const __m128i*)(src + i + 48));
    _mm_stream_si128((__m128i*)(dst + i), a);
    _mm_stream_si128((__m128i*)(dst + i + 16), b);
    _mm_stream_si128((__m128i*)(dst + i + 32), c);
    _mm_stream_si128((__m128i*)(dst + i + 48), d);
  }
  memcpy(dst + i, src + i, bytes - i);
}

// memcpy with non-temporal stores; ends with a store fence, so that the flag that
// publishes the bytes is ordered after them.
static inline void streamBytes(char* dst, const char* src, uint64_t bytes) {
  streamBytesUnfenced(dst, src, bytes);
  _mm_sfence();
}
#endif

}  // namespace commref
