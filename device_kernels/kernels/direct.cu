// Direct collectives: ranks load from and store to each other's symmetric buffers
// (NCCL's symmetric kernels, over LSA). No FIFO carries data, so each byte is read
// once from where its owner left it and stored once where it must land, instead of
// being copied twice through a slot:
//   AllGather      each rank stores its shard into its slot of every rank's recvbuf
//                  (NCCL's AllGather_ST);
//   ReduceScatter  each rank loads its part of every rank's sendbuf and reduces it
//                  into its own recvbuf (ReduceScatter_LD);
//   AllReduce      each rank loads its part of every sendbuf, reduces it, and stores
//                  the result into that part of every rank's recvbuf (RSxLD_AGxST);
//   AlltoAll       each rank stores block j of its sendbuf into its slot of rank j's
//                  recvbuf.
//
// Preconditions (the host checks them, the first barrier re-checks the offsets): the
// buffers peers access (AllGather, AlltoAll: recvbuf; ReduceScatter: sendbuf; AllReduce: both)
// lie in symmetric windows (Communicator.alloc_symmetric) at the same offsets on every
// rank, every rank maps every other rank's windows, and there are at most
// COMMREF_DIRECT_MAX_RANKS ranks.
//
// Each channel (block) takes the same share of every rank's part, so channel c only
// ever touches what channel c of a peer touches, and per-channel barriers order it:
//   handshake      the ring link's call check (a rank running a ring kernel instead
//                  shows up as CommMismatch, not as a timeout)
//   lsaBarrier     every peer has launched: its sendbuf holds this call's input and
//                  its recvbuf may be written
//   ...loads and stores
//   lsaBarrier     every peer is done: nobody reads this rank's sendbuf or writes its
//                  recvbuf any more, and what they stored is visible here
#include "commref/ring.h"

// Checks the call with the ring neighbours, then meets every peer at the entry barrier.
template <typename T, typename Op>
static __device__ void directEnter(const CollArgs& a, KernelEnv& env) {
  ringHandshake<T, Op>(a, blockIdx.x);
  lsaBarrier(a, blockIdx.x, env, true);
}

// out[0, n) = fold over k of in[k][0, n), k < nin (nin >= 1); divisor != 0 divides
// the result (avg). At most three inputs per pass fold into `out`, over pieces small
// enough to stay in cache between passes (nothing reads `out` soon, so it is folded
// in place rather than off the cache; docs/performance.md, "Streamed stores").
template <typename T, typename Op>
static __device__ void foldInto(const T* const* in, int nin, T* out, uint64_t n, int divisor) {
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

// ReduceScatter: count = elements each rank receives; rank r reduces block r of
// every rank's sendbuf straight into its recvbuf. Inputs in ring order from this rank,
// so that the ranks start on different peers.
template <typename T, typename Op>
static __device__ void directReduceScatter(const CollArgs& a) {
  KernelEnv env = kernelEnv(a);
  const int c = blockIdx.x, n = a.nranks, r = a.rank;
  const Share s = channelShare(a.count, c, a.nchannels);
  directEnter<T, Op>(a, env);
  const T* in[COMMREF_DIRECT_MAX_RANKS];
  for (int k = 0; k < n; k++) in[k] = (const T*)symPeer(a.symSend, (r + k) % n) + (uint64_t)r * a.count + s.begin;
  foldInto<T, Op>(in, n, (T*)a.recvbuf + s.begin, s.end - s.begin, a.avgDivisor);
  lsaBarrier(a, c, env, false);
}

// AllGather (count = bytes per rank): rank r stores its sendbuf into slot r of every
// rank's recvbuf, its own first, reading each piece once (copyToAll). Only recvbufs
// are shared: the sendbuf may be any buffer. In place (sendbuf is slot r of this
// rank's recvbuf) the bytes are already in this rank's slot.
static __device__ void directAllGather(const CollArgs& a) {
  KernelEnv env = kernelEnv(a);
  const int c = blockIdx.x, n = a.nranks, r = a.rank;
  const uint64_t B = a.count;
  const Share s = channelShare(B, c, a.nchannels);
  directEnter<uint8_t, OpSum>(a, env);
  uint8_t* out[COMMREF_DIRECT_MAX_RANKS];
  for (int k = 0; k < n; k++) out[k] = (uint8_t*)symPeer(a.symRecv, (r + k) % n) + (uint64_t)r * B + s.begin;
  copyToAll((const uint8_t*)a.sendbuf + s.begin, out, n, s.end - s.begin, 0, userStreamMin(a.streamStores));
  lsaBarrier(a, c, env, false);
}

// AllReduce: rank r reduces its part of every rank's sendbuf (part j = [count*j/n,
// count*(j+1)/n)) and stores the result into that part of every rank's recvbuf, one
// pass, no barrier in between. In place is safe: only rank r reads or writes part r
// of any buffer, and foldToAll reads every input element before it writes that
// element anywhere.
template <typename T, typename Op>
static __device__ void directAllReduce(const CollArgs& a) {
  KernelEnv env = kernelEnv(a);
  const int c = blockIdx.x, n = a.nranks, r = a.rank;
  directEnter<T, Op>(a, env);
  const uint64_t mine = a.count * r / n;
  const Share s = channelShare(a.count * (r + 1) / n - mine, c, a.nchannels);
  const T* in[COMMREF_DIRECT_MAX_RANKS];
  T* out[COMMREF_DIRECT_MAX_RANKS];
  for (int k = 0; k < n; k++) {
    const int j = (r + k) % n;
    in[k] = (const T*)symPeer(a.symSend, j) + mine + s.begin;
    out[k] = (T*)symPeer(a.symRecv, j) + mine + s.begin;
  }
  foldToAll<T, Op>(in, n, out, n, s.end - s.begin, a.avgDivisor, userStreamMin(a.streamStores));
  lsaBarrier(a, c, env, false);
}

// AlltoAll (count = bytes per block): rank r stores block j of its sendbuf into slot r
// of rank j's recvbuf, starting with its own (j = r + k for k = 0, 1, ...: the ranks
// start on different peers). Only recvbufs are shared. Not in place (no such form:
// catalogue.py): a peer may store into this rank's recvbuf while it still reads its
// sendbuf.
static __device__ void directAlltoAll(const CollArgs& a) {
  KernelEnv env = kernelEnv(a);
  const int c = blockIdx.x, n = a.nranks, r = a.rank;
  const uint64_t B = a.count;
  const Share s = channelShare(B, c, a.nchannels);
  directEnter<uint8_t, OpSum>(a, env);
  for (int k = 0; k < n; k++) {
    const int j = (r + k) % n;
    uint8_t* out[1] = {(uint8_t*)symPeer(a.symRecv, j) + (uint64_t)r * B + s.begin};
    copyToAll((const uint8_t*)a.sendbuf + (uint64_t)j * B + s.begin, out, 1, s.end - s.begin, 0,
              userStreamMin(a.streamStores));
  }
  lsaBarrier(a, c, env, false);
}

#define DIRECT_ALLREDUCE(T, Op) directAllReduce<T, Op>(args)
#define DIRECT_REDUCE_SCATTER(T, Op) directReduceScatter<T, Op>(args)

COMMREF_KERNEL(commref_direct_allreduce, CollArgs, args) { COMMREF_DISPATCH_REDUCTION(args, DIRECT_ALLREDUCE) }
COMMREF_KERNEL(commref_direct_reduce_scatter, CollArgs, args) { COMMREF_DISPATCH_REDUCTION(args, DIRECT_REDUCE_SCATTER) }
COMMREF_KERNEL(commref_direct_allgather, CollArgs, args) { directAllGather(args); }
COMMREF_KERNEL(commref_direct_alltoall, CollArgs, args) { directAlltoAll(args); }
