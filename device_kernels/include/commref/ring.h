// commref/ring.h — what the kernels share: channel shares, pieces, and the ring links
// (every kernel that is not a ring kernel still checks its call over them).
#pragma once
#include "flow.h"

namespace commref {

static __device__ __forceinline__ int ringMod(int x, int n) { return ((x % n) + n) % n; }
static __device__ __forceinline__ uint64_t minU(uint64_t x, uint64_t y) { return x < y ? x : y; }

// The rank at position pos (mod nranks) of channel c's ring (CollArgs.ringRanks; this
// rank's own position is a.peers[c].ringPos).
static __device__ __forceinline__ int ringRank(const CollArgs& a, int c, int pos) {
  return ((const int32_t*)a.ringRanks)[(uint64_t)c * a.nranks + ringMod(pos, a.nranks)];
}

// Channel c's share [begin, end) of n items.
struct Share {
  uint64_t begin, end;
};
static __device__ __forceinline__ Share channelShare(uint64_t n, int c, int nchannels) {
  Share s;
  s.begin = n * c / nchannels;
  s.end = n * (c + 1) / nchannels;
  return s;
}

// Connects p to channel c's ring and returns true; with a single rank there is no ring:
// it copies this channel's share of src to dst (`last`: the copy completes a reduction)
// and returns false.
template <typename T, typename Op>
static __device__ bool joinRing(Prims<T, Op>& p, const CollArgs& a, int c, const T* src, T* dst, const Share& share,
                                bool last) {
  if (a.nranks == 1) {
    p.copy(src + share.begin, dst + share.begin, share.end - share.begin, last);
    return false;
  }
  connectRing(p, a, c);
  return true;
}

// Checks the call with channel c's ring neighbours and moves no data (Prims::handshake):
// kernels that are not ring kernels start with it, so that a rank running another
// collective or algorithm shows up as CommMismatch, not as a timeout.
template <typename T, typename Op>
static __device__ void ringHandshake(const CollArgs& a, int c) {
  Prims<T, Op> p(a, c);
  connectRing(p, a, c);
  p.handshake();
  p.finish();
}

// Pieces of at most `piece` items covering [begin, end); there is always at least one
// piece (possibly empty) so that every call makes at least one checked step.
#define FOR_EACH_PIECE(base, len, share, piece)                                                              \
  for (uint64_t base = (share).begin, _first = 1; _first || base < (share).end; base += (piece), _first = 0) \
    for (uint64_t len = minU((piece), (share).end - base), _once = 1; _once; _once = 0)

}  // namespace commref
