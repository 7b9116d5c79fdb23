// commref/impl/barrier__funcs.h — the bodies of device.h's barriers: the world barrier,
// the LSA barrier, the rail barrier and the hybrid barrier, block-wide and in a scope
// (read device.h for the contracts).
#pragma once

namespace commref {

// Barrier words (args.h): after the user's signals, nranks words of each of
// 2 * ncontexts + 3 word sets, then an epoch per set. Sets 0 .. ncontexts - 1: the world
// barrier's fence on that context; set ncontexts: the world barrier of
// GinFenceLevel::None; set ncontexts + 1: the LSA barrier (and a hybrid barrier's LSA
// phases); sets ncontexts + 2 + c: the rail barrier's fence on context c (and a hybrid
// barrier's rail phase); set 2 * ncontexts + 2: the rail barrier of GinFenceLevel::None.
// Word j of a set of rank r counts rank j's signals to r in that set: one per barrier of
// the set rank j reached, two where j is a GIN member of a fenced barrier (arrive and
// acknowledge, teamBarrier); the set's epoch counts the barriers this rank reached. A set per context keeps the
// contexts apart: they are independent ordering domains, so a peer's signal of its next barrier on one context may land
// before this barrier's on another, and must not stand in for it; and an unfenced signal must not stand in for a
// fencing one. Inside one set a later signal may stand in for an earlier one: the peer sent it after leaving this
// barrier, and a fence (a strong signal, or a weak one after a flush) covers every earlier put of its context too.
__device__ inline int DeviceComm::barrierSets() const { return 2 * (int)dc.ncontexts + 3; }
__device__ inline uint64_t* DeviceComm::barrierWord(int r, int set, int from) const {
  return signalWord(r, dc.nsignals + set * a.nranks + from);
}
__device__ inline uint64_t* DeviceComm::epochWord(int set) const {
  return signalWord(a.rank, dc.nsignals + barrierSets() * a.nranks + set);
}
// The word set of team `team`'s barrier on context c (fenced) or without fence.
__device__ inline int DeviceComm::barrierSet(int team, bool fenced, int c) const {
  const int n = (int)dc.ncontexts;
  if (team == kBarrierLsa) return n + 1;
  if (team == kBarrierRail) return fenced ? n + 2 + c : 2 * n + 2;
  return fenced ? c : n;
}
__device__ inline bool DeviceComm::barrierMember(int team, int peer) const {
  if (team == kBarrierLsa) return isLsaPeer(peer);
  if (team == kBarrierRail) return distance(a.rank, peer) % dc.lsaSize == 0;
  return true;
}
__device__ inline bool DeviceComm::railOk() {
  return refuse(dc.flags & kDevCommStridedTeams, kBadArgTeamShape, kDevCommStridedTeams, dc.flags);
}
// The scope's leader signals every member of the team and waits for each; the scope's
// threads meet before (their stores, then the leader's release adds) and after.
//
// A fenced barrier over GIN has two phases. Arrive: this rank signals every GIN member
// on each fenced context, behind its puts there (a strong signal, or a weak one after a
// flush), and waits for every member's arrival. Acknowledge: it signals every GIN member
// again, now that each member's puts have landed here, and waits for every member's
// acknowledgement, which says this rank's puts have landed there. So a rank leaves only
// once its own fenced puts have landed at every member: none of them can land over a
// put it posts after the barrier, on any context. A GIN member's word therefore counts
// two signals per barrier of a fenced set (an LSA member's, one: its stores are there
// at once); a count of 2 e - 1 means the member reached barrier e, 2 e that it also saw
// this rank reach it.
template <typename Coop>
__device__ inline void DeviceComm::teamBarrier(const Coop& coop, int team, GinFenceLevel fence, int ctx) {
  ringDoorbells();  // every thread: what it posted as a leader
  coop.sync();
  if (coop.thread_rank() == 0 && !env.failed && fenceOk(fence, ctx) && (team != kBarrierRail || railOk())) {
    const bool lsaOnly = team == kBarrierLsa;
    const bool fenced = !lsaOnly && fence != GinFenceLevel::None;
    // Contexts first .. last carry the barrier's signals, each into a set of its own.
    const int first = ctx == GinAllContexts ? 0 : ctx;
    const int last = fenced && ctx == GinAllContexts ? (int)dc.ncontexts - 1 : first;
    uint64_t epoch[COMMREF_DEVCOMM_MAX_CONTEXTS];
    for (int c = first; c <= last; c++) {
      const int set = barrierSet(team, fenced, c);
      epoch[c] = load_relaxed(epochWord(set)) + 1;
      store_relaxed(epochWord(set), epoch[c]);
    }
    const bool strong = dc.flags & kDevCommStrongSignals;
    const bool acked = fenced && a.gin.peerMask;  // GIN members acknowledge
    if (!lsaOnly && a.gin.peerMask && (fence == GinFenceLevel::Gets || (fenced && !strong))) {
      // Gets: this rank's gets have landed. Weak only: this rank's puts of a context land
      // before the weak signal that follows the flush there.
      ringDoorbells();
      for (int c = first; c <= last && !env.failed; c++) ginOn(c).flush();
    }
    for (int phase = 0; phase < (acked ? 2 : 1) && !env.failed; phase++) {
      for (int k = 1; k < a.nranks; k++) {
        const int peer = (a.rank + k) % a.nranks;
        if (!barrierMember(team, peer) || (phase == 1 && isLsaPeer(peer))) continue;
        for (int c = first; c <= last; c++) {
          const int set = barrierSet(team, fenced, c);
          if (isLsaPeer(peer))
            fetch_add_release(barrierWord(peer, set, a.rank), 1);
          else if (!lsaOnly) {
            const uint64_t id = dc.signalBase + dc.nsignals + set * a.nranks + a.rank;
            ginOn(c).signal(peer, fenced && strong ? StrongSignalInc(id) : WeakSignalInc(id));
            pending[c] |= 1ull << peer;
          }
        }
      }
      ringDoorbells();
      for (int k = 1; k < a.nranks && !env.failed; k++) {
        const int peer = (a.rank + a.nranks - k) % a.nranks;
        if (!barrierMember(team, peer) || (phase == 1 && isLsaPeer(peer))) continue;
        const bool twice = acked && !isLsaPeer(peer);
        for (int c = first; c <= last && !env.failed; c++) {
          if (a.gin.capacity) ginOn(0).kick();
          const uint64_t least = twice ? 2 * epoch[c] - 1 + (uint64_t)phase : epoch[c];
          waitReached(barrierWord(a.rank, barrierSet(team, fenced, c), peer), least, env, kWaitBarrier, peer,
                      blockIdx.x, help());
        }
      }
    }
  }
  settle(coop);
}
// Inner LSA team, outer rail over GIN, and the LSA team again when fencing (NCCL's
// ncclBarrierSession over the world): the second LSA phase carries what the rail phase
// made visible to every member of the node.
template <typename Coop>
__device__ inline void DeviceComm::hybridOver(const Coop& coop, GinFenceLevel fence, int ctx) {
  if (coop.thread_rank() == 0) (void)(fenceOk(fence, ctx) && railOk());
  settle(coop);
  if (env.failed) return;
  teamBarrier(coop, kBarrierLsa, GinFenceLevel::None, 0);
  teamBarrier(coop, kBarrierRail, fence, ctx);
  if (fence != GinFenceLevel::None) teamBarrier(coop, kBarrierLsa, GinFenceLevel::None, 0);
}

__device__ inline void DeviceComm::barrier(GinFenceLevel fence, int ctx) {
  teamBarrier(CoopCta(), kBarrierWorld, fence, ctx);
}
__device__ inline void DeviceComm::lsaBarrier() { teamBarrier(CoopCta(), kBarrierLsa, GinFenceLevel::None, 0); }
__device__ inline void DeviceComm::railBarrier(GinFenceLevel fence, int ctx) {
  teamBarrier(CoopCta(), kBarrierRail, fence, ctx);
}
__device__ inline void DeviceComm::hybridBarrier(GinFenceLevel fence, int ctx) { hybridOver(CoopCta(), fence, ctx); }
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceComm::barrier(Coop c, GinFenceLevel fence, int ctx) {
  teamBarrier(c, kBarrierWorld, fence, ctx);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceComm::lsaBarrier(Coop c) {
  teamBarrier(c, kBarrierLsa, GinFenceLevel::None, 0);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceComm::railBarrier(Coop c, GinFenceLevel fence, int ctx) {
  teamBarrier(c, kBarrierRail, fence, ctx);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceComm::hybridBarrier(Coop c, GinFenceLevel fence, int ctx) {
  hybridOver(c, fence, ctx);
}

}  // namespace commref
