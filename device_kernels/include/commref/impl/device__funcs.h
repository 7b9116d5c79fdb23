// commref/impl/device__funcs.h — the bodies of device.h's declarations (read device.h for
// the contracts).
#pragma once

namespace commref {

// ---- DeviceGin ----
// put, countedPut, putValue, signal and get are the scoped ones (device_ext__funcs.h) in
// the block's scope.
__device__ inline void DeviceGin::put(int peer, uint64_t dst, uint64_t src, uint64_t bytes, RemoteAction r,
                                      int counter) const {
  put(CoopCta(), peer, dst, src, bytes, r, counter);
}
__device__ inline void DeviceGin::countedPut(int peer, uint64_t dst, uint64_t src, uint64_t bytes, uint32_t id) const {
  countedPut(CoopCta(), peer, dst, src, bytes, id);
}
__device__ inline void DeviceGin::putValue(int peer, uint64_t dst, uint64_t value, RemoteAction r) const {
  putValue(CoopCta(), peer, dst, value, r);
}
__device__ inline void DeviceGin::signal(int peer, RemoteAction r) const { signal(CoopCta(), peer, r); }
__device__ inline void DeviceGin::get(int peer, uint64_t dst, uint64_t src, uint64_t bytes) const {
  get(CoopCta(), peer, dst, src, bytes);
}
__device__ inline void DeviceGin::flush() const {
  comm.ringBlock();
  if (threadIdx.x == 0 && comm.contextOk(ctx) && comm.a.gin.capacity) {
    comm.ringDoorbells();
    comm.ginOn(ctx).flush();
  }
  comm.sync();
}

// ---- DeviceComm ----
__device__ inline DeviceComm::DeviceComm(const KernelArgs& k)
    : args(k), dc(k.comm), a(k.comm.coll), env(kernelEnv(k.comm.coll)) {
  for (int c = 0; c < COMMREF_DEVCOMM_MAX_CONTEXTS; c++) pending[c] = 0;
}
// Every thread: a scope's leader (coop.h) may have posted.
__device__ inline DeviceComm::~DeviceComm() { ringDoorbells(); }

__device__ __forceinline__ int DeviceComm::rank() const { return a.rank; }
__device__ __forceinline__ int DeviceComm::nranks() const { return a.nranks; }
__device__ __forceinline__ int DeviceComm::lsaRank() const { return dc.lsaRank; }
__device__ __forceinline__ int DeviceComm::lsaSize() const { return dc.lsaSize; }
__device__ __forceinline__ int DeviceComm::lsaPeer(int i) const { return ((const int32_t*)dc.lsaRanks)[i]; }
__device__ __forceinline__ bool DeviceComm::isLsaPeer(int peer) const { return !((a.gin.peerMask >> peer) & 1); }
__device__ __forceinline__ uint64_t DeviceComm::launch() const { return dc.launch; }
__device__ __forceinline__ const CollArgs& DeviceComm::coll() const { return a; }

__device__ inline uint64_t DeviceComm::u64(int i) {
  if (!argumentOk(i < (int)args.nargs && i >= 0, args.nargs, (uint64_t)i)) return 0;
  return args.arg[i];
}
__device__ inline int64_t DeviceComm::i64(int i) { return (int64_t)u64(i); }
__device__ inline double DeviceComm::f64(int i) {
  const uint64_t bits = u64(i);
  double d;
  memcpy(&d, &bits, sizeof d);
  return d;
}
template <typename T>
__device__ inline T* DeviceComm::ptr(int i) {
  return (T*)u64(i);
}

template <typename T>
__device__ inline T* DeviceComm::local(uint64_t off) const {
  return (T*)(windowOf(a, a.rank) + dc.windowOff + off);
}
template <typename T>
__device__ inline T* DeviceComm::lsaPtr(int peer, uint64_t off) const {
  return isLsaPeer(peer) ? (T*)(windowOf(a, peer) + dc.windowOff + off) : nullptr;
}

__device__ __forceinline__ DeviceGin DeviceComm::gin(int ctx) { return DeviceGin{*this, ctx}; }
__device__ inline void DeviceComm::put(int peer, uint64_t dst, uint64_t src, uint64_t bytes, RemoteAction r,
                                       int counter) {
  gin(0).put(peer, dst, src, bytes, r, counter);
}
__device__ inline void DeviceComm::countedPut(int peer, uint64_t dst, uint64_t src, uint64_t bytes, uint32_t id) {
  gin(0).countedPut(peer, dst, src, bytes, id);
}
__device__ inline void DeviceComm::putValue(int peer, uint64_t dst, uint64_t value, RemoteAction r) {
  gin(0).putValue(peer, dst, value, r);
}
__device__ inline void DeviceComm::signal(int peer, RemoteAction r) { gin(0).signal(peer, r); }
__device__ inline void DeviceComm::get(int peer, uint64_t dst, uint64_t src, uint64_t bytes) {
  gin(0).get(peer, dst, src, bytes);
}
__device__ inline void DeviceComm::flush() { gin(0).flush(); }

__device__ inline uint64_t DeviceComm::readSignal(uint32_t id) {
  return signalOk(id) ? load_acquire(signalWord(a.rank, id)) : 0;
}
__device__ inline uint64_t DeviceComm::waitSignal(uint32_t id, uint64_t least, int peer) {
  __shared__ uint64_t seen;
  ringBlock();
  if (threadIdx.x == 0 && signalOk(id)) {
    ringDoorbells();
    if (a.gin.capacity) ginOn(0).kick();
    seen = waitReached(signalWord(a.rank, id), least, env, kWaitSignal, peer, blockIdx.x, help());
  }
  return shared(seen);
}
__device__ inline void DeviceComm::resetSignal(uint32_t id) {
  if (threadIdx.x == 0 && signalOk(id)) store_relaxed(signalWord(a.rank, id), 0);
  sync();
}
__device__ inline uint64_t DeviceComm::readCounter(uint32_t id) {
  return counterOk(id) ? load_acquire(counterWord(id)) : 0;
}
__device__ inline uint64_t DeviceComm::waitCounter(uint32_t id, uint64_t least) {
  __shared__ uint64_t seen;
  ringBlock();
  if (threadIdx.x == 0 && counterOk(id)) {
    ringDoorbells();
    if (a.gin.capacity) ginOn(0).kick();
    seen = waitReached(counterWord(id), least, env, kWaitCounter, -1, blockIdx.x, help());
  }
  return shared(seen);
}
__device__ inline void DeviceComm::resetCounter(uint32_t id) {
  if (threadIdx.x == 0 && counterOk(id)) store_relaxed(counterWord(id), 0);
  sync();
}

__device__ inline int DeviceComm::sendChannel(int peer) const { return (distance(a.rank, peer) - 1) / 4; }
__device__ inline int DeviceComm::recvChannel(int peer) const { return (distance(peer, a.rank) - 1) / 4; }
template <typename T, typename Op>
__device__ inline void DeviceComm::connectSend(Prims<T, Op>& p, int peer) {
  const int d = distance(a.rank, peer);
  if (linkOk(peer, d, p.channel())) p.addSend((d - 1) % 4, peer, (d - 1) % 4);
  sync();
}
template <typename T, typename Op>
__device__ inline void DeviceComm::connectRecv(Prims<T, Op>& p, int peer) {
  const int d = distance(peer, a.rank);
  if (linkOk(peer, d, p.channel())) p.addRecv((d - 1) % 4, peer, (d - 1) % 4);
  sync();
}

__device__ inline bool DeviceComm::argumentOk(bool ok, uint64_t limit, uint64_t value) {
  if (!ok) commref_fail(env, kMismatch, kBadArgument, -1, blockIdx.x, limit, value);
  return ok;
}

// ---- DeviceComm, private ----
__device__ __forceinline__ void DeviceComm::sync() { leaveIfFailed(env.failed); }
// Read between two barriers, so thread 0's next write to `word` (the same call again)
// waits until every thread has read this one.
__device__ inline uint64_t DeviceComm::shared(const uint64_t& word) {
  sync();
  const uint64_t v = word;
  __syncthreads();
  return v;
}
__device__ __forceinline__ Gin DeviceComm::ginOn(int ctx) { return Gin(a, env, ctx); }
__device__ inline const uint64_t* DeviceComm::help() { return a.gin.capacity ? ginOn(0).helpHook() : nullptr; }
__device__ inline uint64_t* DeviceComm::signalWord(int r, uint32_t id) const {
  return (uint64_t*)(windowOf(a, r) + a.layout.ginSignalsOff) + dc.signalBase + id;
}
__device__ inline uint64_t* DeviceComm::counterWord(uint32_t id) const { return (uint64_t*)dc.counters + id; }
__device__ inline RemoteAction DeviceComm::ginAction(RemoteAction r) const {
  if (r.flags & kGinVaSignal) return RemoteAction{r.flags, dc.windowOff + r.signal, r.value};  // window 0's offset
  return RemoteAction{r.flags, r.flags ? dc.signalBase + r.signal : 0, r.value};
}
__device__ inline int DeviceComm::distance(int from, int to) const {
  return ((to - from) % a.nranks + a.nranks) % a.nranks;
}
__device__ inline bool DeviceComm::linkOk(int peer, int d, int channel) {
  const int want = (d - 1) / 4;
  return argumentOk(peer >= 0 && peer < a.nranks && d != 0, a.nranks, (uint64_t)peer) &&
         argumentOk(want < a.nchannels, a.nchannels, (uint64_t)want) &&
         argumentOk(channel == want, want, (uint64_t)channel);
}
__device__ inline bool DeviceComm::signalOk(uint32_t id) { return argumentOk(id < dc.nsignals, dc.nsignals, id); }
__device__ inline bool DeviceComm::counterOk(uint32_t id) { return argumentOk(id < dc.ncounters, dc.ncounters, id); }
__device__ inline bool DeviceComm::contextOk(int ctx) {
  return argumentOk(ctx >= 0 && ctx < (int)dc.ncontexts && ctx < COMMREF_DEVCOMM_MAX_CONTEXTS, dc.ncontexts,
                    (uint64_t)ctx);
}
// A user signal id is checked against the communicator's signals before it is used; a
// VA signal's word (a window offset) against the window, on strict ordering only.
__device__ inline bool DeviceComm::checkPut(int peer, uint64_t dst, uint64_t src, uint64_t bytes, RemoteAction r,
                                            int counter, int ctx) {
  const uint64_t w = dc.windowBytes;
  return argumentOk(peer >= 0 && peer < a.nranks, a.nranks, (uint64_t)peer) &&
         argumentOk(dst <= w && bytes <= w - dst, w, dst + bytes) &&
         argumentOk(src <= w && bytes <= w - src, w, src + bytes) &&
         ((r.flags & kGinVaSignal) ? vaOk(r.signal)
                                   : (!r.flags || argumentOk(r.signal < dc.nsignals, dc.nsignals, r.signal))) &&
         (counter < 0 || counterOk(counter)) && contextOk(ctx) &&
         argumentOk(!(r.flags & kGinStrongSignal) || isLsaPeer(peer) || (dc.flags & kDevCommStrongSignals),
                    kDevCommStrongSignals, dc.flags);
}
__device__ inline void DeviceComm::ringDoorbells() {
  if (!a.gin.doorbells) return;
  for (int c = 0; c < COMMREF_DEVCOMM_MAX_CONTEXTS; c++) {
    for (int peer = 0; peer < a.nranks && pending[c]; peer++)
      if ((pending[c] >> peer) & 1) ginOn(c).doorbell(peer);
    pending[c] = 0;
  }
}
__device__ inline bool DeviceComm::fenceOk(GinFenceLevel fence, int ctx) {
  return argumentOk((uint32_t)fence <= (uint32_t)GinFenceLevel::Gets, (uint32_t)GinFenceLevel::Gets + 1,
                    (uint32_t)fence) &&
         (ctx == GinAllContexts || contextOk(ctx));
}
}  // namespace commref
