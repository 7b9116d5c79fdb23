// commref/flow.h — flow primitives: the vocabulary every collective is written in.
//
// A Prims object is one block's view of one channel: up to two inbound and two
// outbound connections, each LSA or GIN (connection.h). Each primitive is one pipeline step on the connections it
// uses, moving at most slotElems() elements:
//
//   send(src, n)                        src            -> every send peer
//   recv(dst, n)                        recv peers     -> dst
//   recvReduceSend(src, n)              src (+) recv   -> send peers
//   recvReduceCopy(src, dst, n, last)   src (+) recv   -> dst
//   recvReduceCopySend(src, dst, n, l)  src (+) recv   -> dst and send peers
//   recvCopySend(dst, n)                recv           -> dst and send peers
//   copySend(src, dst, n)               src            -> dst (unless in place) and send peers
//   copy(src, dst, n, last)             src            -> dst (single-rank case)
//   handshake()                         no data: only the call descriptors are checked
//
// `last` marks the step that completes a reduction: avg divides there, once.
// All threads of the block call the same primitives in the same order; thread 0 does
// the waits and the posts, the block moves the data between two __syncthreads().
// Every step happens on every rank even when n == 0, so step counters stay aligned.
#pragma once
#include "connection.h"
#include "reduce.h"

// Copies this thread's share of n elements (the same share reduceInto computed).
template <typename T>
static __device__ __forceinline__ void copyOwnShare(T* dst, const T* src, uint64_t n) {
  ElemRange r = elemRange(n);
#ifdef COMMREF_CPU
  if (r.end > r.begin) memcpy(dst + r.begin, src + r.begin, (r.end - r.begin) * sizeof(T));
#else
  for (uint64_t i = r.begin; i < r.end; i += COMMREF_ELEM_STRIDE) dst[i] = src[i];
#endif
}

// Like copyOwnShare, for a destination nothing reads soon (a direct kernel's output,
// peer buffer to own buffer). On the CPU, copies of COMMREF_STREAM_MIN_BYTES and more
// use non-temporal stores, which skip reading the destination into the cache first:
// 1.2x to 1.7x the speed of memcpy for 8 MiB copies on the 2-core development host.
#define COMMREF_STREAM_MIN_BYTES (1u << 20)
#if defined(COMMREF_CPU) && defined(__x86_64__)
#include <emmintrin.h>
static inline void streamBytes(char* dst, const char* src, uint64_t bytes) {
  uint64_t head = (16 - ((uintptr_t)dst & 15)) & 15;
  if (head > bytes) head = bytes;
  memcpy(dst, src, head);
  dst += head, src += head, bytes -= head;
  uint64_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128((const __m128i*)(src + i)), b = _mm_loadu_si128((const __m128i*)(src + i + 16));
    const __m128i c = _mm_loadu_si128((const __m128i*)(src + i + 32)), d = _mm_loadu_si128((const __m128i*)(src + i + 48));
    _mm_stream_si128((__m128i*)(dst + i), a);
    _mm_stream_si128((__m128i*)(dst + i + 16), b);
    _mm_stream_si128((__m128i*)(dst + i + 32), c);
    _mm_stream_si128((__m128i*)(dst + i + 48), d);
  }
  memcpy(dst + i, src + i, bytes - i);
  _mm_sfence();  // order the streamed stores before the flag that publishes them
}
#endif
template <typename T>
static __device__ __forceinline__ void streamOwnShare(T* dst, const T* src, uint64_t n) {
#if defined(COMMREF_CPU) && defined(__x86_64__)
  ElemRange r = elemRange(n);
  const uint64_t bytes = (r.end - r.begin) * sizeof(T);
  if (bytes >= COMMREF_STREAM_MIN_BYTES) {
    streamBytes((char*)(dst + r.begin), (const char*)(src + r.begin), bytes);
    return;
  }
#endif
  copyOwnShare(dst, src, n);
}

template <typename T, typename Op, int NIN>
static __device__ __forceinline__ void reduceInto(const T* const* in, T* out, uint64_t n) {
  typedef Arith<T> A;
  const T* in0 = in[0];
  const T* in1 = NIN > 1 ? in[1] : in0;
  const T* in2 = NIN > 2 ? in[2] : in0;
  ElemRange r = elemRange(n);
  for (uint64_t i = r.begin; i < r.end; i += COMMREF_ELEM_STRIDE) {
    typename A::Compute v = A::load(in0[i]);
    if (NIN > 1) v = Op::apply(v, A::load(in1[i]));
    if (NIN > 2) v = Op::apply(v, A::load(in2[i]));
    out[i] = A::store(v);
  }
}

// out[k] = fold(in[0..nin)) for every k; divisor != 0 divides the result (avg).
template <typename T, typename Op>
static __device__ COMMREF_NOINLINE void reduceCopy(const T* const* in, int nin, T* const* out, int nout, uint64_t n,
                                                   int divisor) {
  if (nin == 1 && divisor == 0) {
    for (int k = 0; k < nout; k++)
      if (out[k] != in[0]) copyOwnShare(out[k], in[0], n);
    return;
  }
  T* out0 = out[0];
  if (nin == 1) copyOwnShare(out0, in[0], n);
  else if (nin == 2) reduceInto<T, Op, 2>(in, out0, n);
  else reduceInto<T, Op, 3>(in, out0, n);
  if (divisor != 0) {
    typedef Arith<T> A;
    ElemRange r = elemRange(n);
    for (uint64_t i = r.begin; i < r.end; i += COMMREF_ELEM_STRIDE) out0[i] = A::store(divideBy(A::load(out0[i]), divisor));
  }
  for (int k = 1; k < nout; k++) copyOwnShare(out[k], (const T*)out0, n);
}

template <typename T, typename Op>
class Prims {
 public:
  __device__ Prims(const CollArgs& args, int channel)
      : a(args), env(kernelEnv(args)), channel_(channel), nrecv(0), nsend(0) {}

  __device__ uint64_t slotElems() const { return a.layout.slotBytes / sizeof(T); }

  // Inbound FIFO `in` of this rank, fed by `peer` through its outbound link `outAtPeer`.
  __device__ void addRecv(int in, int peer, int outAtPeer) {
    rx[nrecv] = makeRecv(a, channel_, in, peer, outAtPeer);
    rxStep[nrecv] = load_relaxed(rx[nrecv].stepState);
    nrecv++;
  }
  // Outbound link `out` of this rank to `peer`, which receives on its FIFO `inAtPeer`.
  __device__ void addSend(int out, int peer, int inAtPeer) {
    tx[nsend] = makeSend(a, channel_, out, peer, inAtPeer);
    txStep[nsend] = load_relaxed(tx[nsend].stepState);
    nsend++;
  }
  // Persists the step counters for the next launch (or the next Prims on the same
  // connections in this launch). Call once, after the last step.
  __device__ void finish() {
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int i = 0; i < nrecv; i++) store_relaxed(rx[i].stepState, rxStep[i]);
      for (int i = 0; i < nsend; i++) store_relaxed(tx[i].stepState, txStep[i]);
    }
    __syncthreads();
  }

  // A step without data on every connection: each rank checks its peers' call
  // descriptors. Kernels whose data steps leave some rank without an inbound step
  // from a peer running the same kernel (rooted collectives, the tree) start with it,
  // so that every mismatch surfaces as CommMismatch rather than a timeout or, worse,
  // two ranks that both think they are the root.
  // Sends first, then receives: every rank does the same, so a ring of handshakes
  // cannot wait on itself.
  __device__ void handshake() {
    if (threadIdx.x == 0) {
      for (int i = 0; i < nsend; i++) {
        connWaitCredit(tx[i], txStep[i], a, env);
        connPost(tx[i], txStep[i], 0, a, env);
      }
      for (int i = 0; i < nrecv; i++) {
        connWaitReady(rx[i], rxStep[i], a, env);
        connRelease(rx[i], rxStep[i], a, env);
      }
    }
    __syncthreads();
    for (int i = 0; i < nrecv; i++) rxStep[i]++;
    for (int i = 0; i < nsend; i++) txStep[i]++;
  }

  __device__ void send(const T* src, uint64_t n) { step(false, true, src, nullptr, n, false); }
  __device__ void recv(T* dst, uint64_t n) { step(true, false, nullptr, dst, n, false); }
  __device__ void recvReduceSend(const T* src, uint64_t n) { step(true, true, src, nullptr, n, false); }
  __device__ void recvReduceCopy(const T* src, T* dst, uint64_t n, bool last) { step(true, false, src, dst, n, last); }
  __device__ void recvReduceCopySend(const T* src, T* dst, uint64_t n, bool last) { step(true, true, src, dst, n, last); }
  __device__ void recvCopySend(T* dst, uint64_t n) { step(true, true, nullptr, dst, n, false); }
  __device__ void copySend(const T* src, T* dst, uint64_t n) { step(false, true, src, dst == src ? nullptr : dst, n, false); }
  __device__ void copy(const T* src, T* dst, uint64_t n, bool last) { step(false, false, src, dst, n, last); }

 private:
  __device__ COMMREF_NOINLINE void step(bool useRecv, bool useSend, const T* src, T* dst, uint64_t n, bool last) {
    const int nr = useRecv ? nrecv : 0, ns = useSend ? nsend : 0;
    if (threadIdx.x == 0) {
      for (int i = 0; i < nr; i++) connWaitReady(rx[i], rxStep[i], a, env);
      for (int i = 0; i < ns; i++) connWaitCredit(tx[i], txStep[i], a, env);
    }
    __syncthreads();
    const T* in[3];
    T* out[3];
    int nin = 0, nout = 0;
    if (src) in[nin++] = src;
    for (int i = 0; i < nr; i++) in[nin++] = (const T*)connRecvData(rx[i], rxStep[i], a);
    if (dst) out[nout++] = dst;
    for (int i = 0; i < ns; i++) out[nout++] = (T*)connSendData(tx[i], txStep[i], a);
    if (nin > 0 && nout > 0) reduceCopy<T, Op>(in, nin, out, nout, n, last && a.op == kAvg ? a.nranks : 0);
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int i = 0; i < ns; i++) connPost(tx[i], txStep[i], n * sizeof(T), a, env);
      for (int i = 0; i < nr; i++) connRelease(rx[i], rxStep[i], a, env);
    }
    for (int i = 0; i < nr; i++) rxStep[i]++;
    for (int i = 0; i < ns; i++) txStep[i]++;
  }

  const CollArgs& a;
  KernelEnv env;
  int channel_;
  int nrecv, nsend;
  RecvConnection rx[2];
  SendConnection tx[2];
  uint64_t rxStep[2], txStep[2];
};
