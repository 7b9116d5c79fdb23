// Kernels that exercise the execution engine itself (tests and bench/engine_bench.py).
#include "commref/ring.h"
#if defined(COMMREF_CPU) && defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_THREAD__)
#include <immintrin.h>
#endif

// The library's kernels are commref's own code; COMMREF_KERNEL gives each C linkage, so
// its symbol is its name (the loader looks kernels up by abi.KERNEL_NAMES).
namespace commref {

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

// STREAM-like memory traffic, for the benchmark's bound (bench/bound.py): every output
// word i = the wrapping sum of the inputs' words i (a copy when nin == 1), each input
// word loaded once and each output word stored once, in 64-byte lines; block b takes
// its share of the lines of every array, the threads of a block split that share.
// streamStores: the stores skip the cache (non-temporal), where the build has them.
// The bound must be a rate no collective beats, so on the CPU the loop takes the
// widest vectors the CPU has (AVX-512, AVX2, else SSE2), where the collectives'
// loops are compiled for SSE2: where the arrays stay in cache that is faster; a plain
// copy with cached stores is memcpy, as the collectives copy.
#define COMMREF_STREAM_MAX_ARRAYS 64

#ifdef COMMREF_CPU
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_THREAD__)
#define COMMREF_STREAM_WIDE 1
#endif

// One line-loop per vector width W (32-bit words per vector): loads a line of every
// input, sums, stores it to every output.
#define COMMREF_STREAM_LOOP(NAME, W, ATTR, NT_STORE)                                                        \
  ATTR static void NAME(const uint32_t* const* in, int nin, uint32_t* const* out, int nout, uint64_t begin, \
                        uint64_t end, bool streamed) {                                                      \
    typedef uint32_t Vec __attribute__((vector_size(4 * W)));                                               \
    for (uint64_t i = begin; i < end; i += 16) {                                                            \
      Vec v[16 / W];                                                                                        \
      for (int u = 0; u < 16 / W; u++) v[u] = *(const Vec*)(in[0] + i + W * u);                             \
      for (int k = 1; k < nin; k++)                                                                         \
        for (int u = 0; u < 16 / W; u++) v[u] += *(const Vec*)(in[k] + i + W * u);                          \
      for (int j = 0; j < nout; j++) {                                                                      \
        if (streamed) {                                                                                     \
          for (int u = 0; u < 16 / W; u++) NT_STORE(out[j] + i + W * u, v[u]);                              \
        } else {                                                                                            \
          for (int u = 0; u < 16 / W; u++) *(Vec*)(out[j] + i + W * u) = v[u];                              \
        }                                                                                                   \
      }                                                                                                     \
    }                                                                                                       \
  }

#ifdef COMMREF_HAVE_STREAM
#define COMMREF_NT_STORE_4(p, v) _mm_stream_si128((__m128i*)(p), (__m128i)(v))
#else
#define COMMREF_NT_STORE_4(p, v) (*(Vec*)(p) = (v))  // Vec: the loop's vector type
#endif
COMMREF_STREAM_LOOP(streamLines4, 4, , COMMREF_NT_STORE_4)
#ifdef COMMREF_STREAM_WIDE
#define COMMREF_NT_STORE_8(p, v) _mm256_stream_si256((__m256i*)(p), (__m256i)(v))
#define COMMREF_NT_STORE_16(p, v) _mm512_stream_si512((__m512i*)(p), (__m512i)(v))
COMMREF_STREAM_LOOP(streamLines8, 8, __attribute__((target("avx2"))), COMMREF_NT_STORE_8)
COMMREF_STREAM_LOOP(streamLines16, 16, __attribute__((target("avx512f"))), COMMREF_NT_STORE_16)
#endif

static void streamLines(const uint32_t* const* in, int nin, uint32_t* const* out, int nout, uint64_t begin,
                        uint64_t end, bool streamed) {
  if (nin == 1 && nout == 1 && !streamed) {  // STREAM's copy, as the collectives copy
    if (out[0] != in[0]) memcpy(out[0] + begin, in[0] + begin, (end - begin) * sizeof(uint32_t));
    return;
  }
#ifdef COMMREF_STREAM_WIDE
  static const int width = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f") ? 16
                                                  : __builtin_cpu_supports("avx2")  ? 8
                                                                                    : 4);
  if (width == 16)
    streamLines16(in, nin, out, nout, begin, end, streamed);
  else if (width == 8)
    streamLines8(in, nin, out, nout, begin, end, streamed);
  else
    streamLines4(in, nin, out, nout, begin, end, streamed);
#else
  streamLines4(in, nin, out, nout, begin, end, streamed);
#endif
#ifdef COMMREF_HAVE_STREAM
  if (streamed) _mm_sfence();
#endif
}
#endif

COMMREF_KERNEL(commref_stream, StreamArgs, args) {
  const int nin = args.nin, nout = args.nout, shared = args.shared;
  if (nin < 1 || nin > COMMREF_STREAM_MAX_ARRAYS || nout < 0 || nout > COMMREF_STREAM_MAX_ARRAYS || shared < 0 ||
      shared > nin || shared > nout || args.words % 16 != 0)
    return;
  uint32_t* base = (uint32_t*)args.base;
  const uint32_t* in[COMMREF_STREAM_MAX_ARRAYS];
  uint32_t* out[COMMREF_STREAM_MAX_ARRAYS];
  for (int k = 0; k < nin; k++) in[k] = base + (uint64_t)k * args.words;
  for (int j = 0; j < nout; j++) out[j] = base + (uint64_t)(j < shared ? j : nin + j - shared) * args.words;
  const Share s = channelShare(args.words / 16, blockIdx.x, gridDim.x);  // in lines
#ifdef COMMREF_CPU
  const ElemRange r = elemRange(s.end - s.begin);
  streamLines(in, nin, out, nout, (s.begin + r.begin) * 16, (s.begin + r.end) * 16, args.streamStores != 0);
#else
  for (uint64_t i = s.begin * 16 + threadIdx.x; i < s.end * 16; i += blockDim.x) {
    uint32_t v = in[0][i];
    for (int k = 1; k < nin; k++) v += in[k][i];
    for (int j = 0; j < nout; j++) out[j][i] = v;
  }
#endif
}

}  // namespace commref
