// commref/lsa.h — window addressing shared by every connection, and the LSA half of
// a connection: ranks whose connection windows are mapped into each other
// (load/store, "LSA" in NCCL's words).
//
// LSA protocol (NCCL's simple protocol): the receiver owns a FIFO of nsteps slots.
//   sender, step s:   wait credit >= s + 1 - nsteps     (slot s % nsteps is free)
//                     write the slot's data and header into the receiver's FIFO,
//                     store_release(ready, s + 1)
//   receiver, step s: wait ready >= s + 1 (acquire), check the header, read the slot,
//                     store_release(credit, s + 1)      (the slot may be reused)
// Step counters are 64-bit and persist in the window across launches, so they never
// wrap and a kernel starts where the previous one on this connection stopped.
#pragma once
#include "wait.h"

namespace commref {

static __device__ __forceinline__ char* windowOf(const CollArgs& a, int rank) {
  return (char*)((const uint64_t*)a.peerWindows)[rank];
}
static __device__ __forceinline__ uint64_t* stepStateOf(const CollArgs& a, int channel, int index) {
  return (uint64_t*)(windowOf(a, a.rank) + a.layout.stateOff) + channel * (COMMREF_CONN_IN + COMMREF_CONN_OUT) + index;
}
static __device__ __forceinline__ uint64_t slotStride(const CollArgs& a) {
  return a.layout.slotBytes + COMMREF_SLOT_HEADER;
}
// Bytes between two slots of protocol `proto`'s FIFO (and staging) regions (args.h).
static __device__ __forceinline__ uint64_t protoSlotStride(const CollArgs& a, uint32_t proto) {
  if (proto == kProtoLL) return COMMREF_LL_HEADER + a.layout.llSlotBytes / 8 * COMMREF_LL_LINE;
  if (proto == kProtoLL128)
    return COMMREF_LL128_LINE + a.layout.ll128SlotBytes / COMMREF_LL128_LINE_DATA * COMMREF_LL128_LINE;
  return slotStride(a);
}
// Offsets, within a window, of inbound FIFO (c, k) and of outbound staging (c, j) of
// protocol `proto` (Simple by default).
static __device__ __forceinline__ uint64_t fifoOffset(const CollArgs& a, int c, int k, uint32_t proto = kProtoSimple) {
  const uint64_t base = proto == kProtoLL      ? a.layout.llFifoOff
                        : proto == kProtoLL128 ? a.layout.ll128FifoOff
                                               : a.layout.fifoOff;
  return base + ((uint64_t)c * COMMREF_CONN_IN + k) * a.layout.nsteps * protoSlotStride(a, proto);
}
static __device__ __forceinline__ uint64_t stagingOffset(const CollArgs& a, int c, int j,
                                                         uint32_t proto = kProtoSimple) {
  const uint64_t base = proto == kProtoLL      ? a.layout.llStagingOff
                        : proto == kProtoLL128 ? a.layout.ll128StagingOff
                                               : a.layout.stagingOff;
  return base + ((uint64_t)c * COMMREF_CONN_OUT + j) * a.layout.nsteps * protoSlotStride(a, proto);
}
static __device__ __forceinline__ uint64_t* readyWord(const CollArgs& a, int rank, int c, int k) {
  return (uint64_t*)(windowOf(a, rank) + a.layout.readyOff + ((uint64_t)c * COMMREF_CONN_IN + k) * a.layout.flagStride);
}
static __device__ __forceinline__ uint64_t* creditWord(const CollArgs& a, int rank, int c, int j) {
  return (uint64_t*)(windowOf(a, rank) + a.layout.creditOff +
                     ((uint64_t)c * COMMREF_CONN_OUT + j) * a.layout.flagStride);
}

// ---- LSA barrier (NCCL's ncclLsaBarrierSession), for the direct kernels ----
//
// Channel c of every rank meets at a barrier through sync[c][*] (args.h): rank j
// writes its SyncSlot in every peer's window, epoch last (release); each rank waits
// until every peer's slot in its own window shows the epoch. Epochs persist in the
// window like step counters.
//
// A kernel's first barrier (`check`) also compares what each peer wrote with this
// rank's own call. That is safe only there: a peer may already be one barrier ahead
// and rewriting its slot, which after a first barrier is a later barrier of the same
// call (the same values), but after a call's last barrier is the next call's first.
// `ginWindows` and `arrivals` serve the direct kernels over GIN (direct.cu): the GIN
// window ids of symSend and symRecv, and what rank `from` has sent this rank on channel c
// (a count; in this rank's own slot sync[c][nranks], its count before the running call).
struct SyncSlot {
  uint64_t epoch, callDesc, count, sendOffset, recvOffset, ginWindows, arrivals, pad;
};
// Byte offsets in a SyncSlot: the call's fields (callDesc .. ginWindows) and arrivals.
enum : uint64_t { kSyncCallFields = 8, kSyncCallBytes = 40, kSyncArrivals = 48 };
static_assert(sizeof(SyncSlot) == 64 && sizeof(SyncSlot) <= COMMREF_FLAG_STRIDE, "a SyncSlot fills one flag stride");

static __device__ __forceinline__ uint64_t syncSlotOffset(const CollArgs& a, int c, int from) {
  return a.layout.syncOff + ((uint64_t)c * (a.nranks + 1) + from) * a.layout.flagStride;
}
static __device__ __forceinline__ SyncSlot* syncSlot(const CollArgs& a, int rank, int c, int from) {
  return (SyncSlot*)(windowOf(a, rank) + syncSlotOffset(a, c, from));
}

// The call a rank states in its SyncSlot at each peer (lsaBarrier's, and the direct
// kernels' over GIN, direct.cu: pushEnter): callDesc, count, the symmetric buffers'
// offsets and GIN window ids; checkCall compares a peer's with this rank's own.
static __device__ __forceinline__ uint64_t syncWindows(const CollArgs& a) {
  return a.symSend.ginWindow | (uint64_t)a.symRecv.ginWindow << 32;
}
static __device__ __forceinline__ void storeCall(SyncSlot* s, const CollArgs& a) {
  store_relaxed(&s->callDesc, a.callDesc);
  store_relaxed(&s->count, a.count);
  store_relaxed(&s->sendOffset, a.symSend.offset);
  store_relaxed(&s->recvOffset, a.symRecv.offset);
  store_relaxed(&s->ginWindows, syncWindows(a));
}
static __device__ void checkCall(const SyncSlot* s, const CollArgs& a, KernelEnv& env, int peer, int c) {
  const uint64_t desc = load_relaxed(&s->callDesc), count = load_relaxed(&s->count);
  if (desc != a.callDesc) commref_fail(env, kMismatch, kCallMismatch, peer, c, a.callDesc, desc);
  if (count != a.count) commref_fail(env, kMismatch, kCountMismatch, peer, c, a.count, count);
  const uint64_t so = load_relaxed(&s->sendOffset), ro = load_relaxed(&s->recvOffset);
  const uint64_t w = load_relaxed(&s->ginWindows);
  if (so != a.symSend.offset) commref_fail(env, kMismatch, kBufferMismatch, peer, c, a.symSend.offset, so);
  if (ro != a.symRecv.offset) commref_fail(env, kMismatch, kBufferMismatch, peer, c, a.symRecv.offset, ro);
  if (w != syncWindows(a)) commref_fail(env, kMismatch, kBufferMismatch, peer, c, syncWindows(a), w);
}

// All threads of the block call it; thread 0 signals and waits. On return every peer's
// channel c has reached this barrier, and every write the block made before it is
// visible to the peers' blocks after theirs. If thread 0's waits or checks failed, the
// whole block leaves the kernel at the end instead (leaveIfFailed, wait.h).
static __device__ void lsaBarrier(const CollArgs& a, int c, KernelEnv& env, bool check) {
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t* state = &syncSlot(a, a.rank, c, a.nranks)->epoch;
    const uint64_t epoch = load_relaxed(state) + 1;
    store_relaxed(state, epoch);
    for (int k = 1; k < a.nranks; k++) {
      SyncSlot* s = syncSlot(a, (a.rank + k) % a.nranks, c, a.rank);
      storeCall(s, a);
      store_release(&s->epoch, epoch);
    }
    for (int k = 1; k < a.nranks; k++) {
      const int peer = (a.rank + a.nranks - k) % a.nranks;
      SyncSlot* s = syncSlot(a, a.rank, c, peer);
      waitAtLeast(&s->epoch, epoch, env, kWaitLsaBarrier, peer, c);
      if (check && !env.failed) checkCall(s, a, env, peer, c);
    }
  }
  leaveIfFailed(env.failed);
}

// Rank `rank`'s copy of a symmetric buffer, in this address space.
static __device__ __forceinline__ char* symPeer(const SymBuffer& b, int rank) {
  return (char*)(((const uint64_t*)b.peerTable)[rank] + b.offset);
}

}  // namespace commref
