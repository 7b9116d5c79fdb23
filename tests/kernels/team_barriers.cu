// Rail and hybrid barriers (device.h: railBarrier, hybridBarrier), block-wide and in a
// warp scope (tests/test_device_team_barriers.py).
//
// Arguments: kind (0 rail, 1 hybrid, 2 hybrid in a warp scope, 3 rail in a warp scope),
// rounds, fence level, fenced contexts, the count of stale reads (int64[2]: [0] of
// puts the barrier promises to make visible, [1] of puts it does not cover).
// Window: offset 8 this rank's source, 16 + 8 j the word rank j puts here.
// Round i: every rank stamps its source and puts it on context i % 2 to every peer
// (LSA or GIN by peer; kind 2: putValue in a warp scope, kind 3: put in one), then the
// barrier; every rank reads the word of every peer; a peer whose put the barrier covers
// (rail: the rail's members; hybrid: LSA peers, and rail members at fence Puts or Gets)
// counts in [0], any other in [1]; a barrier() makes every put of the round visible
// before the next round's.
#include "commref/device.h"
using namespace commref;

COMMREF_KERNEL(team_barriers, KernelArgs, args) {
  DeviceComm comm(args);
  const uint64_t kind = comm.u64(0), rounds = comm.u64(1);
  const GinFenceLevel fence = (GinFenceLevel)comm.u64(2);
  const int fenced = (int)comm.i64(3);
  int64_t* stale = comm.ptr<int64_t>(4);
  const int n = comm.nranks(), r = comm.rank(), lsa = comm.lsaSize();
  const bool warp = kind >= 2;
  for (uint64_t i = 0; i < rounds; i++) {
    const uint64_t stamp = comm.launch() << 40 | (i + 1) << 8 | (uint64_t)r;
    const int ctx = (int)(i % 2);
    if (threadIdx.x == 0) *comm.local<uint64_t>(8) = stamp;
    __syncthreads();
    for (int k = 1; k < n; k++) {
      const int peer = (r + k) % n;
      if (warp) {
        if (threadIdx.x < 32 && kind == 2) comm.gin(ctx).putValue(CoopWarp(), peer, 16 + 8 * r, stamp);
        if (threadIdx.x < 32 && kind == 3) comm.gin(ctx).put(CoopWarp(), peer, 16 + 8 * r, 8, 8);
        __syncthreads();
      } else {
        comm.gin(ctx).put(peer, 16 + 8 * r, 8, 8);
      }
    }
    if (kind == 0)
      comm.railBarrier(fence, fenced);
    else if (kind == 1)
      comm.hybridBarrier(fence, fenced);
    else if (threadIdx.x < 32) {
      if (kind == 2)
        comm.hybridBarrier(CoopWarp(), fence, fenced);
      else
        comm.railBarrier(CoopWarp(), fence, fenced);
    }
    __syncthreads();
    if (threadIdx.x == 0)
      for (int j = 0; j < n; j++) {
        if (j == r) continue;
        const bool rail = ((j - r) % lsa + lsa) % lsa == 0;
        const bool hybrid = kind == 1 || kind == 2;
        const bool fenceCovers = fence != GinFenceLevel::None && (fenced == GinAllContexts || fenced == ctx);
        const bool covered = hybrid ? comm.isLsaPeer(j) || (rail && fenceCovers) : rail && fenceCovers;
        const uint64_t want = comm.launch() << 40 | (i + 1) << 8 | (uint64_t)j;
        if (load_relaxed(comm.local<uint64_t>(16 + 8 * j)) != want) stale[covered ? 0 : 1]++;
      }
    comm.barrier(GinFenceLevel::Puts, GinAllContexts);
  }
}
