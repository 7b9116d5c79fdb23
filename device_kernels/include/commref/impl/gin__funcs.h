// commref/impl/gin__funcs.h — the bodies of gin.h's declarations (read gin.h for the
// contracts).
#pragma once

namespace commref {

__device__ __forceinline__ RemoteAction NoSignal() { return RemoteAction{0, 0, 0}; }
__device__ __forceinline__ RemoteAction StrongSignalInc(uint64_t id) {
  return RemoteAction{kGinHasSignal | kGinStrongSignal, id, 1};
}
__device__ __forceinline__ RemoteAction StrongSignalAdd(uint64_t id, uint64_t v) {
  return RemoteAction{kGinHasSignal | kGinStrongSignal | kGinSignalAdd, id, v};
}
__device__ __forceinline__ RemoteAction WeakSignalInc(uint64_t id) { return RemoteAction{kGinHasSignal, id, 1}; }
__device__ __forceinline__ RemoteAction WeakSignalAdd(uint64_t id, uint64_t v) {
  return RemoteAction{kGinHasSignal | kGinSignalAdd, id, v};
}
__device__ __forceinline__ RemoteAction VaSignal(RemoteAction r) {
  r.flags |= kGinVaSignal;
  return r;
}

__device__ __forceinline__ Gin::Gin(const CollArgs& a_, KernelEnv& env_, int ctx_) : a(a_), env(env_), ctx(ctx_) {}

__device__ __forceinline__ GinDescriptor* Gin::ring() const { return (GinDescriptor*)a.gin.queue; }
__device__ __forceinline__ char* Gin::queueHeader() const {
  return (char*)a.gin.queue + (uint64_t)a.gin.capacity * sizeof(GinDescriptor);
}
__device__ __forceinline__ uint64_t* Gin::claimed() const {
  return (uint64_t*)(queueHeader() + COMMREF_GIN_QUEUE_CLAIMED);
}
__device__ __forceinline__ const uint64_t* Gin::consumed() const {
  return (const uint64_t*)(queueHeader() + COMMREF_GIN_QUEUE_CONSUMED);
}
__device__ __forceinline__ void Gin::kick() const {
  if (!commref_help_progress(helpHook())) commref_wake_sleeper((uint32_t*)(queueHeader() + COMMREF_GIN_QUEUE_IDLE));
}
__device__ __forceinline__ void Gin::handOff() const {
  uint32_t* idle = (uint32_t*)(queueHeader() + COMMREF_GIN_QUEUE_IDLE);
  commref_wake_sleeper(idle, commref_help_later(helpHook()) ? kGinIdleRingAll : 0);
}
__device__ __forceinline__ const uint64_t* Gin::helpHook() const {
  return (const uint64_t*)(queueHeader() + COMMREF_GIN_QUEUE_HELP_FN);
}
__device__ __forceinline__ uint64_t* Gin::signals() const {
  return (uint64_t*)(windowOfGin() + a.layout.ginSignalsOff);
}
__device__ __forceinline__ uint64_t* Gin::counters() const { return (uint64_t*)a.gin.counters; }
__device__ __forceinline__ char* Gin::windowOfGin() const { return (char*)((const uint64_t*)a.peerWindows)[a.rank]; }

__device__ inline uint64_t Gin::post(uint32_t op, uint32_t flags, int peer, uint64_t dst, uint64_t src, uint64_t bytes,
                                     uint64_t signal, uint64_t value, uint32_t counter, uint32_t windows) const {
  if (env.failed) return 0;
  const uint64_t slot = fetch_add_relaxed(claimed(), 1);
  if (slot >= a.gin.capacity) {
    waitAtLeast(consumed(), slot + 1 - a.gin.capacity, env, kWaitGinQueue, peer, ctx, helpHook());
    if (env.failed) return slot;
  }
  GinDescriptor* d = ring() + slot % a.gin.capacity;
  d->op = op;
  d->flags = flags;
  d->peer = peer;
  d->ctx = ctx;
  d->dstOffset = dst;
  d->srcOffset = src;
  d->bytes = bytes;
  d->signal = signal;
  d->signalValue = value;
  d->counter = counter;
  d->windows = windows;
  store_release(&d->seq, slot + 1);
  handOff();
  return slot;
}

__device__ __forceinline__ uint64_t Gin::put(int peer, uint64_t dst, uint64_t src, uint64_t bytes, RemoteAction r,
                                             int counter, uint32_t windows) const {
  return post(kGinPut, r.flags | (counter >= 0 ? kGinHasCounter : 0), peer, dst, src, bytes, r.signal, r.value,
              (uint32_t)counter, windows);
}
__device__ __forceinline__ uint64_t Gin::putValue(int peer, uint64_t dst, uint64_t value, RemoteAction r) const {
  return post(kGinPutValue, r.flags, peer, dst, 0, value, r.signal, r.value, 0);
}
__device__ __forceinline__ uint64_t Gin::signal(int peer, RemoteAction r) const {
  return post(kGinSignal, r.flags, peer, 0, 0, 0, r.signal, r.value, 0);
}
__device__ __forceinline__ uint64_t Gin::get(int peer, uint64_t dst, uint64_t src, uint64_t bytes) const {
  return post(kGinGet, 0, peer, dst, src, bytes, 0, 0, 0);
}
__device__ __forceinline__ void Gin::doorbell(int peer) const { post(kGinDoorbell, 0, peer, 0, 0, 0, 0, 0, 0); }
__device__ inline void Gin::flush() const {
  const uint64_t slot = post(kGinFlush, 0, -1, 0, 0, 0, 0, 0, 0);
  if (env.failed) return;
  waitAtLeast(consumed(), slot + 1, env, kWaitGinFlush, -1, ctx, helpHook());
}

__device__ __forceinline__ uint64_t Gin::readSignal(uint64_t id) const { return load_acquire(signals() + id); }
__device__ inline uint64_t Gin::waitSignal(uint64_t id, uint64_t least, int peer, int channel) const {
  kick();
  return waitReached(signals() + id, least, env, kWaitRecvReady, peer, channel, helpHook());
}
__device__ __forceinline__ void Gin::resetSignal(uint64_t id) const { store_relaxed(signals() + id, 0); }
__device__ __forceinline__ uint64_t Gin::readCounter(uint64_t id) const { return load_acquire(counters() + id); }
__device__ inline uint64_t Gin::waitCounter(uint64_t id, uint64_t least) const {
  kick();
  return waitReached(counters() + id, least, env, kWaitGinFlush, -1, -1, helpHook());
}
__device__ __forceinline__ void Gin::resetCounter(uint64_t id) const { store_relaxed(counters() + id, 0); }

}  // namespace commref
