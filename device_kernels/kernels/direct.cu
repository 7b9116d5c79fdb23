// Direct collectives: every rank loads its peers' symmetric buffers and stores into
// its own (NCCL's symmetric kernels, over LSA). No FIFO carries data, so each byte is
// copied once, from where its owner left it, instead of twice through a slot.
//
// Preconditions (the host checks them, the first barrier re-checks the offsets):
// sendbuf and recvbuf lie in symmetric windows (Communicator.alloc_symmetric) at the
// same offsets on every rank, every rank maps every other rank's windows, and there
// are at most COMMREF_DIRECT_MAX_RANKS ranks.
//
// Each channel (block) takes the same share of every rank's part, so channel c only
// ever reads what channel c of a peer wrote, and per-channel barriers order it:
//   handshake      the ring link's call check (a rank running a ring kernel instead
//                  shows up as CommMismatch, not as a timeout)
//   lsaBarrier     every peer has launched: its buffers hold this call's input
//   ...phases, separated by lsaBarrier where one reads what another phase wrote
//   lsaBarrier     no peer still reads this rank's buffers: the call may return
#pragma once
#include "ring.cu"

// Checks the call with the ring neighbours, then meets every peer at the entry barrier.
template <typename T, typename Op>
static __device__ void directEnter(const CollArgs& a, const KernelEnv& env) {
  const int c = blockIdx.x;
  Prims<T, Op> p(a, c);
  p.addRecv(kInRing, a.peers[c].ringPrev, kOutRing);
  p.addSend(kOutRing, a.peers[c].ringNext, kInRing);
  p.handshake();
  p.finish();
  lsaBarrier(a, c, env, true);
}

// out[0, n) = fold over k of in[k][0, n), k < nin (nin >= 1); divisor != 0 divides
// the result (avg). `streamMin` != ~0: the peers read `out` next (allreduce's reduced
// parts) and stores are streamed (move.h), so on the CPU it is folded off the cache
// (foldPieces; measured with the host in its slow placement, 16 MiB float32
// allreduce, 2 ranks: 9.6-13.1 GB/s busbw against 4.9-7.7 folding into `out`).
// Otherwise at most three inputs per pass fold into `out`, over pieces small enough to
// stay in cache between passes. Where nothing reads `out` soon (reduce_scatter) that
// measured faster in every placement, in place most of all (the output lines are the
// input lines).
template <typename T, typename Op>
static __device__ void foldInto(const T* const* in, int nin, T* out, uint64_t n, int divisor, uint64_t streamMin) {
#ifdef COMMREF_CPU
  if (streamMin != ~0ull) {
    foldPieces<T, Op>(in, nin, &out, 1, n, divisor, streamMin);
    return;
  }
#endif
  const uint64_t piece = nin <= 3 ? (n ? n : 1) : 16384;
  for (uint64_t base = 0; base < n; base += piece) {
    const uint64_t len = minU(piece, n - base);
    T* dst[1] = {out + base};
    for (int k = 0; k < nin;) {  // up to three inputs per pass; later passes fold into out
      const T* src[3];
      int m = 0;
      if (k > 0) src[m++] = out + base;
      while (m < 3 && k < nin) src[m++] = in[k++] + base;
      reduceCopy<T, Op>(src, m, dst, 1, len, k == nin ? divisor : 0, 1, ~0ull);
    }
  }
}

// Reduces elements [begin, end) of every rank's sendbuf (from element `shift`) into
// dst, completing the reduction (avg divides). Inputs in ring order from this rank,
// so that the ranks start on different peers.
template <typename T, typename Op>
static __device__ void directReduceRange(const CollArgs& a, uint64_t shift, Share s, T* dst, uint64_t streamMin) {
  const T* in[COMMREF_DIRECT_MAX_RANKS];
  for (int k = 0; k < a.nranks; k++) in[k] = (const T*)symPeer(a.symSend, (a.rank + k) % a.nranks) + shift + s.begin;
  foldInto<T, Op>(in, a.nranks, dst + s.begin, s.end - s.begin, a.op == kAvg ? a.nranks : 0, streamMin);
}

// ReduceScatter: count = elements each rank receives; rank r reduces block r of
// every rank's sendbuf straight into its recvbuf.
template <typename T, typename Op>
static __device__ void directReduceScatter(const CollArgs& a) {
  const KernelEnv env = kernelEnv(a);
  const int c = blockIdx.x;
  const Share s = channelShare(a.count, c, a.nchannels);
  directEnter<T, Op>(a, env);
  directReduceRange<T, Op>(a, (uint64_t)a.rank * a.count, s, (T*)a.recvbuf, ~0ull);
  lsaBarrier(a, c, env, false);
}

// AllGather (count = bytes per rank): rank r copies each peer's sendbuf into its slot
// of recvbuf. In place, a peer's sendbuf is its slot of its own recvbuf.
static __device__ void directAllGather(const CollArgs& a) {
  const KernelEnv env = kernelEnv(a);
  const int c = blockIdx.x, n = a.nranks, r = a.rank;
  const uint64_t B = a.count;
  const Share s = channelShare(B, c, a.nchannels);
  const bool inPlace = a.sendbuf == a.recvbuf + (uint64_t)r * B;
  uint8_t* dst = (uint8_t*)a.recvbuf;
  directEnter<uint8_t, OpSum>(a, env);
  for (int k = 0; k < n; k++) {
    const int j = (r + k) % n;
    if (j == r && inPlace) continue;
    const uint8_t* src = inPlace ? (const uint8_t*)symPeer(a.symRecv, j) + (uint64_t)j * B
                                 : (const uint8_t*)symPeer(a.symSend, j);
    copyOwnShare(dst + (uint64_t)j * B + s.begin, src + s.begin, s.end - s.begin,
                 userStreamMin(a.streamStores));
  }
  lsaBarrier(a, c, env, false);
}

// AllReduce: rank r reduces its part of every rank's sendbuf into its own recvbuf
// (part j = [count*j/n, count*(j+1)/n)), then, once every rank has, copies the other
// parts from their owners' recvbufs. In place is safe: in the first phase only rank r
// reads or writes part r of rank r's buffer.
template <typename T, typename Op>
static __device__ void directAllReduce(const CollArgs& a) {
  const KernelEnv env = kernelEnv(a);
  const int c = blockIdx.x, n = a.nranks, r = a.rank;
  T* dst = (T*)a.recvbuf;
  directEnter<T, Op>(a, env);
  const uint64_t mine = a.count * r / n;
  const Share part = channelShare(a.count * (r + 1) / n - mine, c, a.nchannels);
  directReduceRange<T, Op>(a, mine, part, dst + mine, handoffStreamMin(a.streamStores));
  lsaBarrier(a, c, env, false);  // every part is reduced
  for (int k = 1; k < n; k++) {
    const int j = (r + k) % n;
    const uint64_t at = a.count * j / n;
    const Share s = channelShare(a.count * (j + 1) / n - at, c, a.nchannels);
    copyOwnShare(dst + at + s.begin, (const T*)symPeer(a.symRecv, j) + at + s.begin, s.end - s.begin,
                 userStreamMin(a.streamStores));
  }
  lsaBarrier(a, c, env, false);
}

#define DIRECT_ALLREDUCE(T, Op) directAllReduce<T, Op>(args)
#define DIRECT_REDUCE_SCATTER(T, Op) directReduceScatter<T, Op>(args)

COMMREF_KERNEL(commref_direct_allreduce, CollArgs, args) { COMMREF_DISPATCH_REDUCTION(args.dtype, args.op, DIRECT_ALLREDUCE) }
COMMREF_KERNEL(commref_direct_reduce_scatter, CollArgs, args) { COMMREF_DISPATCH_REDUCTION(args.dtype, args.op, DIRECT_REDUCE_SCATTER) }
COMMREF_KERNEL(commref_direct_allgather, CollArgs, args) { directAllGather(args); }
