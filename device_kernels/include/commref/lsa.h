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

static __device__ __forceinline__ char* windowOf(const CollArgs& a, int rank) {
  return (char*)((const uint64_t*)a.peerWindows)[rank];
}
static __device__ __forceinline__ uint64_t* stepStateOf(const CollArgs& a, int channel, int index) {
  return (uint64_t*)(windowOf(a, a.rank) + a.layout.stateOff) +
         channel * (COMMREF_CONN_IN + COMMREF_CONN_OUT) + index;
}
static __device__ __forceinline__ uint64_t slotStride(const CollArgs& a) {
  return a.layout.slotBytes + COMMREF_SLOT_HEADER;
}
// Offsets, within a window, of inbound FIFO (c, k) and of outbound staging (c, j).
static __device__ __forceinline__ uint64_t fifoOffset(const CollArgs& a, int c, int k) {
  return a.layout.fifoOff + ((uint64_t)c * COMMREF_CONN_IN + k) * a.layout.nsteps * slotStride(a);
}
static __device__ __forceinline__ uint64_t stagingOffset(const CollArgs& a, int c, int j) {
  return a.layout.stagingOff + ((uint64_t)c * COMMREF_CONN_OUT + j) * a.layout.nsteps * slotStride(a);
}
static __device__ __forceinline__ uint64_t* readyWord(const CollArgs& a, int rank, int c, int k) {
  return (uint64_t*)(windowOf(a, rank) + a.layout.readyOff + ((uint64_t)c * COMMREF_CONN_IN + k) * a.layout.flagStride);
}
static __device__ __forceinline__ uint64_t* creditWord(const CollArgs& a, int rank, int c, int j) {
  return (uint64_t*)(windowOf(a, rank) + a.layout.creditOff + ((uint64_t)c * COMMREF_CONN_OUT + j) * a.layout.flagStride);
}
