// Ring collectives, written once on flow primitives. Data flows along each channel's
// ring, ringPrev -> this rank -> ringNext (a permutation of the ranks: ChannelPeers);
// chunks are ordered by ring position, blocks that belong to a rank (AllGather,
// ReduceScatter) by rank (ringRank). Each channel (block) takes a contiguous share of
// the data and pipelines it through its own FIFOs in steps of at most one slot per chunk.
#include "commref/ring.h"

// The library's kernels are commref's own code; COMMREF_KERNEL gives each C linkage, so
// its symbol is its name (the loader looks kernels up by abi.KERNEL_NAMES).
namespace commref {

// AllReduce: reduce-scatter around the ring, then all-gather.
// Within a loop of nranks chunks, the rank at ring position q finishes chunk q.
template <typename T, typename Op>
static __device__ void ringAllReduce(const CollArgs& a) {
  const int c = blockIdx.x, n = a.nranks, q = a.peers[c].ringPos;
  const T* src = (const T*)a.sendbuf;
  T* dst = (T*)a.recvbuf;
  const Share share = channelShare(a.count, c, a.nchannels);
  Prims<T, Op> p(a, c);
  if (!joinRing(p, a, c, src, dst, share, true)) return;
  if (src != dst) p.streamReceived((share.end - share.begin) * sizeof(T) / n * (n - 1));
  const uint64_t loop = p.slotElems() * n;
  FOR_EACH_PIECE(base, ls, share, loop) {
    const uint64_t cs = (ls + n - 1) / n;  // chunk size, at most one slot
#define CHUNK(j) const uint64_t off = minU((uint64_t)ringMod(j, n) * cs, ls), len = minU(cs, ls - off), at = base + off
    {
      CHUNK(q - 1);
      p.send(src + at, len);
    }
    for (int k = 1; k < n - 1; k++) {
      CHUNK(q - k - 1);
      p.recvReduceSend(src + at, len);
    }
    {
      CHUNK(q);
      p.recvReduceCopySend(src + at, dst + at, len, true);
    }
    for (int k = 1; k < n - 1; k++) {
      CHUNK(q - k);
      p.recvCopySend(dst + at, len);
    }
    {
      CHUNK(q + 1);
      p.recv(dst + at, len);
    }
#undef CHUNK
  }
  p.finish();
}

// ReduceScatter: count = elements each rank receives; rank r receives block r. Step k
// carries the block of the rank k + 1 positions back along the ring, so each block's
// last step is at its rank.
template <typename T, typename Op>
static __device__ void ringReduceScatter(const CollArgs& a) {
  const int c = blockIdx.x, n = a.nranks, r = a.rank, q = a.peers[c].ringPos;
  const uint64_t R = a.count;
  const T* src = (const T*)a.sendbuf;
  T* dst = (T*)a.recvbuf;
  const Share share = channelShare(R, c, a.nchannels);
  Prims<T, Op> p(a, c);
  if (!joinRing(p, a, c, src, dst, share, true)) return;
  FOR_EACH_PIECE(base, len, share, p.slotElems()) {
    p.send(src + (uint64_t)ringRank(a, c, q - 1) * R + base, len);
    for (int k = 1; k < n - 1; k++) p.recvReduceSend(src + (uint64_t)ringRank(a, c, q - k - 1) * R + base, len);
    p.recvReduceCopy(src + (uint64_t)r * R + base, dst + base, len, true);
  }
  p.finish();
}

// Reduce: the ring starts after the root and ends at it; the root finishes the reduction.
template <typename T, typename Op>
static __device__ void ringReduce(const CollArgs& a) {
  const int c = blockIdx.x;
  const bool first = a.peers[c].ringPrev == a.root, last = a.rank == a.root;
  const T* src = (const T*)a.sendbuf;
  T* dst = (T*)a.recvbuf;
  const Share share = channelShare(a.count, c, a.nchannels);
  Prims<T, Op> p(a, c);
  if (!joinRing(p, a, c, src, dst, share, true)) return;
  p.handshake();  // the root's inbound link carries no data: check the call first
  FOR_EACH_PIECE(base, len, share, p.slotElems()) {
    if (first)
      p.send(src + base, len);
    else if (!last)
      p.recvReduceSend(src + base, len);
    else
      p.recvReduceCopy(src + base, dst + base, len, true);
  }
  p.finish();
}

// AllGather moves bytes: count = bytes each rank contributes; rank j's bytes land at
// recvbuf + j * count. In place when sendbuf == recvbuf + rank * count. The k-th
// received block is that of the rank k positions back along the ring.
static __device__ void ringAllGather(const CollArgs& a) {
  const int c = blockIdx.x, n = a.nranks, r = a.rank, q = a.peers[c].ringPos;
  const uint64_t B = a.count;
  const uint8_t* src = (const uint8_t*)a.sendbuf;
  uint8_t* dst = (uint8_t*)a.recvbuf;
  const Share share = channelShare(B, c, a.nchannels);
  Prims<uint8_t, OpSum> p(a, c);
  if (!joinRing(p, a, c, src, dst, share, false)) return;
  p.streamReceived((share.end - share.begin) * (n - 1));
  FOR_EACH_PIECE(base, len, share, p.slotElems()) {
    p.copySend(src + base, dst + (uint64_t)r * B + base, len);
    for (int k = 1; k < n - 1; k++) p.recvCopySend(dst + (uint64_t)ringRank(a, c, q - k) * B + base, len);
    p.recv(dst + (uint64_t)ringRank(a, c, q + 1) * B + base, len);
  }
  p.finish();
}

// Broadcast moves bytes from the root along the ring that starts at it and ends before it.
static __device__ void ringBroadcast(const CollArgs& a) {
  const int c = blockIdx.x;
  const bool first = a.rank == a.root, last = a.peers[c].ringNext == a.root;
  const uint8_t* src = (const uint8_t*)a.sendbuf;
  uint8_t* dst = (uint8_t*)a.recvbuf;
  const Share share = channelShare(a.count, c, a.nchannels);
  Prims<uint8_t, OpSum> p(a, c);
  if (!joinRing(p, a, c, src, dst, share, false)) return;
  p.streamReceived(share.end - share.begin);
  p.handshake();  // two ranks that both think they are the root must not both send
  FOR_EACH_PIECE(base, len, share, p.slotElems()) {
    if (first)
      p.copySend(src + base, dst + base, len);
    else if (!last)
      p.recvCopySend(dst + base, len);
    else
      p.recv(dst + base, len);
  }
  p.finish();
}

// AlltoAll moves bytes: count = bytes per block; block j of this rank's sendbuf
// (sendbuf + j * count) lands in block `rank` of rank j's recvbuf (not in place: no such
// form). Over the ring links, LSA or GIN per peer like every ring kernel, each block
// travels from its rank to its destination along the ring: for each distance k in
// 1..n-1, one step sends this rank's block for the rank k positions ahead, k - 1 steps
// pass on blocks that travel through (recvSend), one step receives the block from the
// rank k positions back. Traffic: a rank sends n (n - 1) / 2 blocks (block k goes k
// hops) against the n - 1 of a direct exchange, n / 2 times the bytes (2x at 4 ranks,
// 4x at 8); the direct kernel (direct.cu) stores each block once, where it lands.
static __device__ void ringAlltoAll(const CollArgs& a) {
  const int c = blockIdx.x, n = a.nranks, r = a.rank, q = a.peers[c].ringPos;
  const uint64_t B = a.count;
  const uint8_t* src = (const uint8_t*)a.sendbuf;
  uint8_t* dst = (uint8_t*)a.recvbuf;
  const Share share = channelShare(B, c, a.nchannels);
  Prims<uint8_t, OpSum> p(a, c);
  // This rank's own block (with a single rank, the whole call).
  p.copy(src + (uint64_t)r * B + share.begin, dst + (uint64_t)r * B + share.begin, share.end - share.begin, false);
  if (n == 1) return;
  connectRing(p, a, c);
  p.streamReceived((share.end - share.begin) * (n - 1));
  FOR_EACH_PIECE(base, len, share, p.slotElems()) {
    for (int k = 1; k < n; k++) {
      p.send(src + (uint64_t)ringRank(a, c, q + k) * B + base, len);
      for (int h = 1; h < k; h++) p.recvSend(len);
      p.recv(dst + (uint64_t)ringRank(a, c, q - k) * B + base, len);
    }
  }
  p.finish();
}

#define RING_ALLREDUCE(T, Op) ringAllReduce<T, Op>(args)
#define RING_REDUCE_SCATTER(T, Op) ringReduceScatter<T, Op>(args)
#define RING_REDUCE(T, Op) ringReduce<T, Op>(args)

COMMREF_KERNEL(commref_ring_allreduce, CollArgs, args) { COMMREF_DISPATCH_REDUCTION(args, RING_ALLREDUCE) }
COMMREF_KERNEL(commref_ring_reduce_scatter, CollArgs, args) { COMMREF_DISPATCH_REDUCTION(args, RING_REDUCE_SCATTER) }
COMMREF_KERNEL(commref_ring_reduce, CollArgs, args) { COMMREF_DISPATCH_REDUCTION(args, RING_REDUCE) }
COMMREF_KERNEL(commref_ring_allgather, CollArgs, args) { ringAllGather(args); }
COMMREF_KERNEL(commref_ring_broadcast, CollArgs, args) { ringBroadcast(args); }
COMMREF_KERNEL(commref_ring_alltoall, CollArgs, args) { ringAlltoAll(args); }

}  // namespace commref
