// commref/move.h — how a block moves and reduces data: the element loops under every
// flow primitive and direct kernel.
//
// Each thread handles its own share of the n elements (elemRange: a contiguous range
// on the CPU, a stride on the GPU), the same share in every call with the same n, so
// consecutive calls over the same elements need no barrier between them. One
// exception, on the GPU: copies (copyToAll, copyOwnShare: no reduction) move 16-byte
// vectors (copyBytesToAll), so a thread's share of a copy is not its share of a
// reduction over the same elements; reduceCopy therefore never copies what it has just
// reduced (it stores the result to every output in the same element loop), and a copy
// that reads what a reduction wrote needs a barrier in between.
//
// Streamed stores (CPU, CollArgs.streamStores). Some outputs are read next by another
// agent: a peer's FIFO slot, GIN staging (the proxy). With streamStores they are
// written with non-temporal stores (streamBytes) from COMMREF_HANDOFF_STREAM_MIN_BYTES
// per thread on, and stores into user buffers (this rank's or, in the direct kernels, a
// peer's) from COMMREF_STREAM_MIN_BYTES on (skipping the read of the destination); a ring's receive steps, which store
// into the recvbuf a step at a time, go by the call's received bytes per thread instead, from
// COMMREF_RECEIVED_STREAM_MIN_BYTES on (Prims::streamReceived). Whether that pays
// depends on where the cores sit: a core hands lines dirty in its cache to a core that
// shares its L3 quickly, and to one across the machine slowly, and a virtual machine's
// cores can move between such placements. So the host measures both and picks per
// call (tuner.StoreChooser). The measurements behind the thresholds are in
// docs/performance.md ("Streamed stores").
#pragma once
#include "profile.h"
#include "reduce.h"

#define COMMREF_STREAM_MIN_BYTES (1u << 20)           // user buffers
#define COMMREF_HANDOFF_STREAM_MIN_BYTES (16u << 10)  // outputs another agent reads next
#define COMMREF_RECEIVED_STREAM_MIN_BYTES (4u << 20)  // a ring's received bytes (flow.h)

// streamBytes (CPU): land.h, shared with the GIN engine's landings.
#if defined(COMMREF_CPU)
#include "land.h"
#endif

namespace commref {

#if defined(COMMREF_CPU) && defined(COMMREF_PROFILE)
// The bytes this thread's share of n elements of T spans, times `arrays` (profile.h).
template <typename T>
static inline uint64_t shareBytes(uint64_t n, int arrays) {
  const ElemRange r = elemRange(n);
  return (r.end - r.begin) * sizeof(T) * (uint64_t)arrays;
}
#endif

#ifdef COMMREF_GPU
// The block's threads together: thread t moves vectors t, t + blockDim.x, ... of
// [0, nvec) from `in` to every output but those equal to `in`, four in flight at a time.
template <typename V>
static __device__ __forceinline__ void copyVectors(const char* in, char* const* out, int nout, uint64_t at,
                                                   uint64_t nvec) {
  const V* src = (const V*)(in + at);
  const uint64_t B = blockDim.x;
  uint64_t i = threadIdx.x;
  for (; i + 3 * B < nvec; i += 4 * B) {
    V v[4];
#pragma unroll
    for (int u = 0; u < 4; u++) v[u] = src[i + u * B];
    for (int k = 0; k < nout; k++) {
      if (out[k] == in) continue;
      V* dst = (V*)(out[k] + at);
#pragma unroll
      for (int u = 0; u < 4; u++) dst[i + u * B] = v[u];
    }
  }
  for (; i < nvec; i += B) {
    const V v = src[i];
    for (int k = 0; k < nout; k++)
      if (out[k] != in) ((V*)(out[k] + at))[i] = v;
  }
}

// out[k][0, bytes) = in[0, bytes) for every k < nout (outputs equal to `in` are
// skipped), by the whole block, reading `in` once. When every output lies at the same
// address modulo 16 as `in` (else 8, else 4), the bytes up to in's next 16- (8-, 4-)
// byte boundary go one per thread, the body as 16- (8-, 4-) byte vectors (uint4, uint2,
// uint32_t), and what is left one byte per thread; otherwise every byte on its own.
static __device__ COMMREF_NOINLINE void copyBytesToAll(const char* in, char* const* out, int nout, uint64_t bytes) {
  uint64_t rel = 0;
  for (int k = 0; k < nout; k++) rel |= (uint64_t)out[k] ^ (uint64_t)in;
  const uint64_t width = (rel & 15) == 0 ? 16 : (rel & 7) == 0 ? 8 : (rel & 3) == 0 ? 4 : 1;
  uint64_t head = (width - ((uint64_t)in & (width - 1))) & (width - 1);
  if (head > bytes) head = bytes;
  const uint64_t nvec = (bytes - head) / width, tail = head + nvec * width;
  const uint64_t t = threadIdx.x, B = blockDim.x;
  for (uint64_t i = t; i < head; i += B)
    for (int k = 0; k < nout; k++)
      if (out[k] != in) out[k][i] = in[i];
  for (uint64_t i = tail + t; i < bytes; i += B)
    for (int k = 0; k < nout; k++)
      if (out[k] != in) out[k][i] = in[i];
  if (width == 16)
    copyVectors<uint4>(in, out, nout, head, nvec);
  else if (width == 8)
    copyVectors<uint2>(in, out, nout, head, nvec);
  else if (width == 4)
    copyVectors<uint32_t>(in, out, nout, head, nvec);
  else
    copyVectors<uint8_t>(in, out, nout, head, nvec);
}
#endif

#ifdef COMMREF_CPU
// One thread's copy of `bytes` bytes: streamed (where this build can) or memcpy'd.
static inline void moveBytes(void* dst, const void* src, uint64_t bytes, bool stream) {
#ifdef COMMREF_HAVE_STREAM
  if (stream) {
    streamBytes((char*)dst, (const char*)src, bytes);
    return;
  }
#endif
  (void)stream;
  memcpy(dst, src, bytes);
}
#endif

// Copies this thread's share of n elements; streamed (CPU) when the share is at least
// `streamMin` bytes. GPU: in 16-byte vectors where the alignment allows (copyBytesToAll).
template <typename T>
static __device__ __forceinline__ void copyOwnShare(T* dst, const T* src, uint64_t n, uint64_t streamMin = ~0ull) {
#ifdef COMMREF_CPU
  COMMREF_PROFILE_SCOPE(kProfileCopy, shareBytes<T>(n, 2));
  ElemRange r = elemRange(n);
  const uint64_t bytes = (r.end - r.begin) * sizeof(T);
  if (bytes) moveBytes(dst + r.begin, src + r.begin, bytes, bytes >= streamMin);
#else
  (void)streamMin;
  char* out[1] = {(char*)dst};
  copyBytesToAll((const char*)src, out, 1, n * sizeof(T));
#endif
}

// out[i] = fold of in[0..NIN)[i], divided when divisor != 0, for i from `begin` to
// `end` by `step`: the one element loop of every reduction here.
template <typename T, typename Op, int NIN>
static __device__ __forceinline__ void foldRange(const T* const* in, T* out, uint64_t begin, uint64_t end,
                                                 uint64_t step, int divisor) {
  typedef Arith<T> A;
  const T* in0 = in[0];
  const T* in1 = NIN > 1 ? in[1] : in0;
  const T* in2 = NIN > 2 ? in[2] : in0;
  for (uint64_t i = begin; i < end; i += step) {
    typename A::Compute v = A::load(in0[i]);
    if (NIN > 1) v = Op::apply(v, A::load(in1[i]));
    if (NIN > 2) v = Op::apply(v, A::load(in2[i]));
    if (divisor != 0) v = divideBy(v, divisor);
    out[i] = A::store(v);
  }
}

// This thread's share of out = fold of in[0..NIN).
template <typename T, typename Op, int NIN>
static __device__ __forceinline__ void reduceInto(const T* const* in, T* out, uint64_t n) {
  ElemRange r = elemRange(n);
  foldRange<T, Op, NIN>(in, out, r.begin, r.end, COMMREF_ELEM_STRIDE, 0);
}

#ifdef COMMREF_CPU
// Every out[k] = fold over in[0..nin) of this thread's share (any nin >= 1), a piece
// at a time in a buffer on the stack, each piece then written to every output
// (streamed when the share is at least `streamMin` bytes): a result that only other
// agents read never enters this core's cache.
template <typename T, typename Op>
static void foldPieces(const T* const* in, int nin, T* const* out, int nout, uint64_t n, int divisor,
                       uint64_t streamMin) {
  const ElemRange r = elemRange(n);
  const uint64_t kPiece = 8192 / sizeof(T);
  T piece[kPiece];
  const bool stream = (r.end - r.begin) * sizeof(T) >= streamMin;
  for (uint64_t base = r.begin; base < r.end; base += kPiece) {
    const uint64_t len = (r.end - base) < kPiece ? (r.end - base) : kPiece;
    for (int k = 0; k < nin;) {  // up to three inputs per pass; later passes fold into the piece
      const T* src[3];
      int m = 0;
      if (k > 0) src[m++] = piece;
      while (m < 3 && k < nin) src[m++] = in[k++] + base;
      const int div = k == nin ? divisor : 0;
      if (m == 1)
        foldRange<T, Op, 1>(src, piece, 0, len, 1, div);
      else if (m == 2)
        foldRange<T, Op, 2>(src, piece, 0, len, 1, div);
      else
        foldRange<T, Op, 3>(src, piece, 0, len, 1, div);
    }
    for (int k = 0; k < nout; k++) moveBytes(out[k] + base, piece, len * sizeof(T), stream);
  }
}
#endif

#if defined(COMMREF_CPU) && defined(COMMREF_PROFILE)
// How many of out[0..nout) are not `in` (the outputs a copy stores to).
template <typename T>
static inline int distinctOutputs(const T* in, T* const* out, int nout) {
  int k = 0;
  for (int i = 0; i < nout; i++) k += out[i] != in;
  return k;
}
#endif

// out[k] = in for every k < nout (outputs equal to `in` are skipped), reading `in`
// once: on the CPU a piece at a time, each piece copied to every output while it sits
// in this core's L2; on the GPU each 16-byte vector (where the alignment allows:
// copyBytesToAll) is loaded once and stored nout times. Outputs from index `handoff` on
// are streamed (CPU) when this thread's share is at least `streamMin` bytes.
template <typename T>
static __device__ COMMREF_NOINLINE void copyToAll(const T* in, T* const* out, int nout, uint64_t n, int handoff,
                                                  uint64_t streamMin) {
  const ElemRange r = elemRange(n);
#ifdef COMMREF_CPU
  COMMREF_PROFILE_SCOPE(kProfileCopy, shareBytes<T>(n, 1 + distinctOutputs(in, out, nout)));
  const uint64_t kPiece = 262144 / sizeof(T);
  const bool big = (r.end - r.begin) * sizeof(T) >= streamMin;
  for (uint64_t base = r.begin; base < r.end; base += kPiece) {
    const uint64_t bytes = ((r.end - base) < kPiece ? (r.end - base) : kPiece) * sizeof(T);
    for (int k = 0; k < nout; k++)
      if (out[k] != in) moveBytes(out[k] + base, in + base, bytes, big && k >= handoff);
  }
#else
  (void)r, (void)handoff, (void)streamMin;
  copyBytesToAll((const char*)in, (char* const*)out, nout, n * sizeof(T));
#endif
}

// out[k] = fold over in[0..nin) for every k < nout (any nin >= 1), divided when
// divisor != 0 (avg). Every input element is read before any output element at the
// same index is written, so outputs may be the inputs (in place). CPU: foldPieces
// (streamed from `streamMin` bytes per thread); GPU: one element at a time, in registers.
template <typename T, typename Op>
static __device__ COMMREF_NOINLINE void foldToAll(const T* const* in, int nin, T* const* out, int nout, uint64_t n,
                                                  int divisor, uint64_t streamMin) {
#ifdef COMMREF_CPU
  COMMREF_PROFILE_SCOPE(kProfileReduce, shareBytes<T>(n, nin + nout));
  foldPieces<T, Op>(in, nin, out, nout, n, divisor, streamMin);
#else
  (void)streamMin;
  typedef Arith<T> A;
  const ElemRange r = elemRange(n);
  for (uint64_t i = r.begin; i < r.end; i += COMMREF_ELEM_STRIDE) {
    typename A::Compute v = A::load(in[0][i]);
    for (int k = 1; k < nin; k++) v = Op::apply(v, A::load(in[k][i]));
    if (divisor != 0) v = divideBy(v, divisor);
    const T t = A::store(v);
    for (int k = 0; k < nout; k++) out[k][i] = t;
  }
#endif
}

// The share sizes from which outputs another agent reads next, and copies into user
// buffers, are streamed (~0: never).
static __device__ __forceinline__ uint64_t handoffStreamMin(bool streamStores) {
  return streamStores ? COMMREF_HANDOFF_STREAM_MIN_BYTES : ~0ull;
}
static __device__ __forceinline__ uint64_t userStreamMin(bool streamStores) {
  return streamStores ? COMMREF_STREAM_MIN_BYTES : ~0ull;
}

// out[k] = fold(in[0..nin)) for every k, nin in 1..3; divisor != 0 divides the result
// (avg). Outputs from index `handoff` on are read next by another agent and are
// streamed from `streamMin` bytes per thread on (see above; ~0: never).
template <typename T, typename Op>
static __device__ COMMREF_NOINLINE void reduceCopy(const T* const* in, int nin, T* const* out, int nout, uint64_t n,
                                                   int divisor, int handoff, uint64_t streamMin) {
  if (nin == 1 && divisor == 0) {
    copyToAll(in[0], out, nout, n, handoff, streamMin);
    return;
  }
#ifdef COMMREF_GPU
  // One element loop: the fold, rounded to T (the sum is stored as T before avg's
  // division, as in the CPU's second pass below), then stored to every output. A copy
  // of out[0] would move vectors, other threads' elements (see the top of this file).
  (void)handoff, (void)streamMin;
  typedef Arith<T> A;
  const ElemRange r = elemRange(n);
  for (uint64_t i = r.begin; i < r.end; i += COMMREF_ELEM_STRIDE) {
    typename A::Compute v = A::load(in[0][i]);
    for (int k = 1; k < nin; k++) v = Op::apply(v, A::load(in[k][i]));
    T t = A::store(v);
    if (divisor != 0) t = A::store(divideBy(A::load(t), divisor));
    for (int k = 0; k < nout; k++) out[k][i] = t;
  }
#else
  COMMREF_PROFILE_SCOPE(kProfileReduce, shareBytes<T>(n, nin + nout));
  if (handoff == 0 && streamMin != ~0ull) {  // only other agents read the result: fold it off the cache
    foldPieces<T, Op>(in, nin, out, nout, n, divisor, streamMin);
    return;
  }
  T* out0 = out[0];
  if (nin == 1)
    copyOwnShare(out0, in[0], n);
  else if (nin == 2)
    reduceInto<T, Op, 2>(in, out0, n);
  else
    reduceInto<T, Op, 3>(in, out0, n);
  if (divisor != 0) {  // a second pass: the sum is stored as T, then divided (reduce.h)
    const T* sum[1] = {out0};
    ElemRange r = elemRange(n);
    foldRange<T, Op, 1>(sum, out0, r.begin, r.end, COMMREF_ELEM_STRIDE, divisor);
  }
  copyToAll((const T*)out0, out + 1, nout - 1, n, handoff - 1, streamMin);
#endif
}

}  // namespace commref
