// commref/impl/device_ext__funcs.h — the bodies of device.h's section "teams, symmetric
// pointers, cooperative scopes, requests, rolling compares, VA signals" (read device.h
// for the contracts).
#pragma once

namespace commref {

__device__ inline bool signalReached(uint64_t value, uint64_t least, int bits) {
  return (int64_t)((value - least) << (64 - bits)) >= 0;
}
static __device__ __forceinline__ uint64_t lowBits(uint64_t v, int bits) {
  return bits >= 64 ? v : v & ((1ull << bits) - 1);
}

// The scope's threads learn whether any of them failed (CoopCta: the block leaves).
template <typename Coop>
__device__ inline void DeviceComm::settle(const Coop& c) {
  if (c.any(env.failed)) env.failed = true;
}
template <>
__device__ inline void DeviceComm::settle<CoopCta>(const CoopCta&) {
  sync();
}

// ---- SymPtr ----
template <typename T>
__device__ inline T* SymPtr<T>::peerPtr(int peer) const {
  const uint64_t w = comm->dc.windowBytes;
  if (!comm->argumentOk(peer >= 0 && peer < comm->nranks(), comm->nranks(), (uint64_t)peer) ||
      !comm->refuse(offset <= w && sizeof(T) <= w - offset && offset % alignof(T) == 0, kBadArgSymPtr, w,
                    offset + sizeof(T)))
    return nullptr;
  return comm->template lsaPtr<T>(peer, offset);
}
template <typename T>
__device__ inline T* SymPtr<T>::localPtr() const {
  return peerPtr(comm->rank());
}
template <typename T>
__device__ inline T* SymPtr<T>::lsaPtr(int lsaRank) const {
  if (!comm->refuse(lsaRank >= 0 && lsaRank < comm->lsaSize(), kBadArgTeamRank, comm->lsaSize(), (uint64_t)lsaRank))
    return nullptr;
  return peerPtr(comm->lsaPeer(lsaRank));
}
template <typename T>
__device__ inline T* SymPtr<T>::peerPtr(Team team, int teamRank) const {
  const int peer = comm->teamRankToWorld(team, teamRank);
  return peer < 0 ? nullptr : peerPtr(peer);
}

// ---- DeviceGin: scopes, requests, symmetric pointers ----
// The scope's share of an LSA copy: the block's is the collectives' copy (move.h), a
// narrower scope's coop.h's.
template <typename Coop>
static __device__ __forceinline__ void scopeCopy(const Coop& c, uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  coopCopy(c, dst, src, bytes);
}
static __device__ __forceinline__ void scopeCopy(const CoopCta&, uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  copyOwnShare<uint8_t>(dst, src, bytes);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceGin::put(Coop c, int peer, uint64_t dst, uint64_t src, uint64_t bytes, RemoteAction r,
                                      int counter) const {
  if (comm.checkPut(peer, dst, src, bytes, r, counter, ctx)) {
    if (comm.isLsaPeer(peer)) {
      scopeCopy(c, comm.lsaPtr<uint8_t>(peer, dst), comm.local<uint8_t>(src), bytes);
      c.sync();
      if (c.thread_rank() == 0) {
        if (r.flags) fetch_add_release(comm.actionWord(peer, r), r.value);
        if (counter >= 0) fetch_add_release(comm.counterWord(counter), 1);
      }
    } else if (c.thread_rank() == 0) {
      comm.ginOn(ctx).put(peer, comm.dc.windowOff + dst, comm.dc.windowOff + src, bytes, comm.ginAction(r), counter);
      comm.pending[ctx] |= 1ull << peer;
    }
  }
  comm.settle(c);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceGin::signal(Coop c, int peer, RemoteAction r) const {
  c.sync();  // the scope's earlier stores, before an LSA signal publishes them
  if (c.thread_rank() == 0 && comm.checkPut(peer, 0, 0, 0, r, -1, ctx)) {
    if (comm.isLsaPeer(peer))
      fetch_add_release(comm.actionWord(peer, r), r.value);
    else {
      comm.ginOn(ctx).signal(peer, comm.ginAction(r));
      comm.pending[ctx] |= 1ull << peer;
    }
  }
  comm.settle(c);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceGin::putValue(Coop c, int peer, uint64_t dst, uint64_t value, RemoteAction r) const {
  if (c.thread_rank() == 0 && comm.checkPut(peer, dst, 0, 8, r, -1, ctx) && comm.argumentOk(dst % 8 == 0, 8, dst)) {
    if (comm.isLsaPeer(peer)) {
      store_relaxed(comm.lsaPtr<uint64_t>(peer, dst), value);
      if (r.flags) fetch_add_release(comm.actionWord(peer, r), r.value);
    } else {
      comm.ginOn(ctx).putValue(peer, comm.dc.windowOff + dst, value, comm.ginAction(r));
      comm.pending[ctx] |= 1ull << peer;
    }
  }
  comm.settle(c);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceGin::countedPut(Coop c, int peer, uint64_t dst, uint64_t src, uint64_t bytes,
                                             uint32_t id) const {
  if (c.thread_rank() == 0 && !comm.isLsaPeer(peer))
    comm.argumentOk(comm.dc.flags & kDevCommCountedWrites, kDevCommCountedWrites, comm.dc.flags);
  comm.settle(c);
  if (!comm.env.failed) put(c, peer, dst, src, bytes, WeakSignalInc(id), -1);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceGin::get(Coop c, int peer, uint64_t dst, uint64_t src, uint64_t bytes) const {
  if (comm.checkPut(peer, src, dst, bytes, NoSignal(), -1, ctx)) {
    if (comm.isLsaPeer(peer))
      scopeCopy(c, comm.local<uint8_t>(dst), comm.lsaPtr<const uint8_t>(peer, src), bytes);
    else if (c.thread_rank() == 0) {
      comm.ginOn(ctx).get(peer, comm.dc.windowOff + dst, comm.dc.windowOff + src, bytes);
      comm.pending[ctx] |= 1ull << peer;
    }
  }
  comm.settle(c);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceGin::flush(Coop c) const {
  comm.ringDoorbells();  // every thread: what it posted as a leader
  c.sync();
  if (c.thread_rank() == 0 && comm.contextOk(ctx) && comm.a.gin.capacity) comm.ginOn(ctx).flush();
  comm.settle(c);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline GinRequest DeviceGin::flushAsync(Coop c) const {
  comm.ringDoorbells();
  c.sync();
  uint64_t slot = 0;
  if (c.thread_rank() == 0 && comm.contextOk(ctx) && comm.a.gin.capacity)
    slot = comm.ginOn(ctx).post(kGinFlush, 0, -1, 0, 0, 0, 0, 0, 0) + 1;
  comm.settle(c);
  return GinRequest{c.broadcast(slot), ctx};
}
__device__ inline GinRequest DeviceGin::flushAsync() const { return flushAsync(CoopCta()); }
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceGin::wait(Coop c, GinRequest request) const {
  if (c.thread_rank() == 0 &&
      comm.refuse(request.ctx == ctx, kBadArgRequestContext, (uint64_t)ctx, (uint64_t)(uint32_t)request.ctx)) {
    if (request.slot) {
      const char* queue = (const char*)comm.a.gin.queue;
      const uint64_t* consumed =
          (const uint64_t*)(queue + (uint64_t)comm.a.gin.capacity * sizeof(GinDescriptor) + COMMREF_GIN_QUEUE_CONSUMED);
      comm.ringDoorbells();
      waitAtLeast(consumed, request.slot, comm.env, kWaitGinFlush, -1, ctx, comm.help());
    }
  }
  comm.settle(c);
}
__device__ inline void DeviceGin::wait(GinRequest request) const { wait(CoopCta(), request); }
template <typename T>
__device__ inline void DeviceGin::put(int peer, SymPtr<T> dst, SymPtr<T> src, uint64_t count, RemoteAction r,
                                      int counter) const {
  const uint64_t w = comm.dc.windowBytes;  // a count past the window is refused whole, not wrapped
  put(peer, dst.offset, src.offset, count <= w / sizeof(T) ? count * sizeof(T) : w + 1, r, counter);
}

// ---- DeviceComm: teams ----
__device__ inline Team DeviceComm::worldTeam() const { return Team{a.nranks, a.rank, 1}; }
__device__ inline Team DeviceComm::lsaTeam() {
  if (!refuse(dc.flags & kDevCommStridedTeams, kBadArgTeamShape, kDevCommStridedTeams, dc.flags)) return Team{1, 0, 1};
  return Team{dc.lsaSize, dc.lsaRank, 1};
}
__device__ inline Team DeviceComm::railTeam() {
  if (!refuse(dc.flags & kDevCommStridedTeams, kBadArgTeamShape, kDevCommStridedTeams, dc.flags)) return Team{1, 0, 1};
  return commref::teamOuterFactor(worldTeam(), dc.lsaSize);
}
__device__ inline int DeviceComm::teamRankToWorld(Team t, int i) {
  const bool shape = teamValid(t) && commref::teamRankToWorld(a.rank, t, 0) >= 0 &&
                     commref::teamRankToWorld(a.rank, t, t.nRanks - 1) < a.nranks;
  if (!refuse(shape, kBadArgTeamShape, a.nranks, (uint64_t)commref::teamRankToWorld(a.rank, t, t.nRanks - 1)) ||
      !refuse(i >= 0 && i < t.nRanks, kBadArgTeamRank, t.nRanks, (uint64_t)i))
    return -1;
  return commref::teamRankToWorld(a.rank, t, i);
}
__device__ inline int DeviceComm::teamRankToTeam(Team ta, Team tb, int i) {
  if (!refuse(teamValid(ta) && teamValid(tb), kBadArgTeamShape, 1, 0) ||
      !refuse(i >= 0 && i < tb.nRanks, kBadArgTeamRank, tb.nRanks, (uint64_t)i))
    return -1;
  return commref::teamRankToTeam(ta, tb, i);
}
__device__ inline Team DeviceComm::innerFactor(Team parent, int inner) {
  if (!refuse(teamValid(parent) && inner >= 1 && parent.nRanks % inner == 0, kBadArgTeamShape, (uint64_t)parent.nRanks,
              (uint64_t)inner))
    return Team{1, 0, 1};
  return commref::teamInnerFactor(parent, inner);
}
__device__ inline Team DeviceComm::outerFactor(Team parent, int inner) {
  if (!refuse(teamValid(parent) && inner >= 1 && parent.nRanks % inner == 0, kBadArgTeamShape, (uint64_t)parent.nRanks,
              (uint64_t)inner))
    return Team{1, 0, 1};
  return commref::teamOuterFactor(parent, inner);
}

// ---- DeviceComm: symmetric pointers, scopes, rolling compares, VA signals ----
template <typename T>
__device__ inline SymPtr<T> DeviceComm::symPtr(uint64_t off) {
  return SymPtr<T>{this, off};
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceComm::put(Coop c, int peer, uint64_t dst, uint64_t src, uint64_t bytes, RemoteAction r,
                                       int counter) {
  gin(0).put(c, peer, dst, src, bytes, r, counter);
}
template <typename T>
__device__ inline void DeviceComm::put(int peer, SymPtr<T> dst, SymPtr<T> src, uint64_t count, RemoteAction r,
                                       int counter) {
  gin(0).put(peer, dst, src, count, r, counter);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceComm::putValue(Coop c, int peer, uint64_t dst, uint64_t value, RemoteAction r) {
  gin(0).putValue(c, peer, dst, value, r);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceComm::countedPut(Coop c, int peer, uint64_t dst, uint64_t src, uint64_t bytes,
                                              uint32_t id) {
  gin(0).countedPut(c, peer, dst, src, bytes, id);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceComm::get(Coop c, int peer, uint64_t dst, uint64_t src, uint64_t bytes) {
  gin(0).get(c, peer, dst, src, bytes);
}

template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceComm::signal(Coop c, int peer, RemoteAction r) {
  gin(0).signal(c, peer, r);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline void DeviceComm::flush(Coop c) {
  gin(0).flush(c);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline uint64_t DeviceComm::waitSignal(Coop c, uint32_t id, uint64_t least, int peer, int bits) {
  const bool ok = signalOk(id);
  return waitWord(c, ok ? signalWord(a.rank, id) : nullptr, least, bits, kWaitSignal, peer);
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline uint64_t DeviceComm::waitCounter(Coop c, uint32_t id, uint64_t least, int bits) {
  const bool ok = counterOk(id);
  return waitWord(c, ok ? counterWord(id) : nullptr, least, bits, kWaitCounter, -1);
}
__device__ inline uint64_t DeviceComm::readSignal(uint32_t id, int bits) {
  return signalOk(id) && bitsOk(bits) ? lowBits(load_acquire(signalWord(a.rank, id)), bits) : 0;
}
__device__ inline uint64_t DeviceComm::readCounter(uint32_t id, int bits) {
  return counterOk(id) && bitsOk(bits) ? lowBits(load_acquire(counterWord(id)), bits) : 0;
}
__device__ inline uint64_t DeviceComm::readVaSignal(uint64_t off, int bits) {
  return vaOk(off) && bitsOk(bits) ? lowBits(load_acquire(local<uint64_t>(off)), bits) : 0;
}
template <typename Coop, typename Coop::CoopTag*>
__device__ inline uint64_t DeviceComm::waitVaSignal(Coop c, uint64_t off, uint64_t least, int peer, int bits) {
  const bool ok = vaOk(off);
  return waitWord(c, ok ? local<uint64_t>(off) : nullptr, least, bits, kWaitSignal, peer);
}
__device__ inline uint64_t DeviceComm::waitVaSignal(uint64_t off, uint64_t least, int peer, int bits) {
  return waitVaSignal(CoopCta(), off, least, peer, bits);
}
__device__ inline void DeviceComm::resetVaSignal(uint64_t off) {
  if (threadIdx.x == 0 && vaOk(off)) store_relaxed(local<uint64_t>(off), 0);
  sync();
}

// ---- DeviceComm, private ----
__device__ inline bool DeviceComm::refuse(bool ok, int32_t reason, uint64_t limit, uint64_t value) {
  if (!ok) commref_fail(env, kMismatch, kBadArgument, reason, blockIdx.x, limit, value);
  return ok;
}
__device__ inline bool DeviceComm::bitsOk(int bits) {
  return refuse(bits >= 1 && bits <= 64, kBadArgBits, 64, (uint64_t)(int64_t)bits);
}
__device__ inline bool DeviceComm::vaOk(uint64_t off) {
  const uint64_t w = dc.windowBytes;
  return refuse(dc.flags & kDevCommStrictOrdering, kBadArgVaSignal, kDevCommStrictOrdering, dc.flags) &&
         refuse(off % 8 == 0 && off <= w && 8 <= w - off, kBadArgVaOffset, w, off);
}
__device__ inline uint64_t* DeviceComm::actionWord(int peer, RemoteAction r) const {
  if (r.flags & kGinVaSignal) return (uint64_t*)(windowOf(a, peer) + dc.windowOff + r.signal);
  return signalWord(peer, (uint32_t)r.signal);
}
__device__ inline void DeviceComm::ringBlock() {
  if (!a.gin.doorbells) return;
  ringDoorbells();
  __syncthreads();
}
// The leader waits until *word has reached `least` at `bits` bits; every thread of the
// scope gets the low `bits` bits it saw.
template <typename Coop>
__device__ inline uint64_t DeviceComm::waitWord(const Coop& c, const uint64_t* word, uint64_t least, int bits,
                                                uint32_t what, int peer) {
  ringDoorbells();  // every thread: what it posted as a leader
  if (a.gin.doorbells) c.sync();
  uint64_t v = 0;
  if (c.thread_rank() == 0 && word && bitsOk(bits) && !env.failed) {
    if (a.gin.capacity) ginOn(0).kick();
    const uint64_t* hook = help();
    v = load_acquire(word);
    if (!signalReached(v, least, bits)) {
      const uint64_t start = commref_now_ns();
      for (uint32_t spins = 1;; spins++) {
        if (hook) commref_help_progress(hook);
        commref_spin_pause(spins);
        v = load_acquire(word);
        if (signalReached(v, least, bits)) break;
        if ((spins & 63) == 0 &&
            !keepWaiting(env, start, what, peer, blockIdx.x, lowBits(least, bits), lowBits(v, bits)))
          break;
      }
    }
  }
  settle(c);
  return c.broadcast(lowBits(v, bits));
}

}  // namespace commref
