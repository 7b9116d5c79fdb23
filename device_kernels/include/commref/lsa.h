// commref/lsa.h — LsaConnection: a one-directional link between two ranks whose
// connection windows are mapped into each other (load/store, "LSA" in NCCL's words).
//
// Protocol (NCCL's simple protocol): the receiver owns a FIFO of nsteps slots.
//   sender, step s:   wait credit >= s + 1 - nsteps     (slot s % nsteps is free)
//                     write data into the receiver's slot, write the step header,
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

struct LsaSendConnection {
  int peer, channel;
  char* fifo;              // the receiver's FIFO, mapped here
  uint64_t* ready;         // the receiver's ready word
  uint64_t* header;        // the receiver's step headers: 2 words per slot
  const uint64_t* credit;  // in this rank's window: steps the receiver consumed
  uint64_t* stepState;     // this rank's persistent step counter for the link
};

struct LsaRecvConnection {
  int peer, channel;
  const char* fifo;
  const uint64_t* ready;
  const uint64_t* header;
  uint64_t* credit;        // in the sender's window
  uint64_t* stepState;
};

// Sending side of channel c's outbound link `out` to `peer`, which receives it on its
// inbound FIFO `inAtPeer`.
static __device__ LsaSendConnection lsaSend(const CollArgs& a, int c, int out, int peer, int inAtPeer) {
  const WindowLayout& L = a.layout;
  char* pw = windowOf(a, peer);
  uint64_t k = (uint64_t)c * COMMREF_CONN_IN + inAtPeer;
  LsaSendConnection s;
  s.peer = peer;
  s.channel = c;
  s.fifo = pw + L.fifoOff + k * L.nsteps * L.slotBytes;
  s.ready = (uint64_t*)(pw + L.readyOff + k * L.flagStride);
  s.header = (uint64_t*)(pw + L.headerOff + k * L.nsteps * 16);
  s.credit = (const uint64_t*)(windowOf(a, a.rank) + L.creditOff + ((uint64_t)c * COMMREF_CONN_OUT + out) * L.flagStride);
  s.stepState = stepStateOf(a, c, COMMREF_CONN_IN + out);
  return s;
}

// Receiving side of channel c's inbound FIFO `in`, fed by `peer` through its
// outbound link `outAtPeer`.
static __device__ LsaRecvConnection lsaRecv(const CollArgs& a, int c, int in, int peer, int outAtPeer) {
  const WindowLayout& L = a.layout;
  char* mw = windowOf(a, a.rank);
  uint64_t k = (uint64_t)c * COMMREF_CONN_IN + in;
  LsaRecvConnection r;
  r.peer = peer;
  r.channel = c;
  r.fifo = mw + L.fifoOff + k * L.nsteps * L.slotBytes;
  r.ready = (const uint64_t*)(mw + L.readyOff + k * L.flagStride);
  r.header = (const uint64_t*)(mw + L.headerOff + k * L.nsteps * 16);
  r.credit = (uint64_t*)(windowOf(a, peer) + L.creditOff + ((uint64_t)c * COMMREF_CONN_OUT + outAtPeer) * L.flagStride);
  r.stepState = stepStateOf(a, c, in);
  return r;
}

// ---- the connection interface that flow.h uses (LSA implementation) ----

static __device__ __forceinline__ void lsaWaitCredit(const LsaSendConnection& s, uint64_t step, const CollArgs& a,
                                                     const KernelEnv& env) {
  if (step + 1 > a.layout.nsteps)
    waitAtLeast(s.credit, step + 1 - a.layout.nsteps, env, kWaitSendCredit, s.peer, s.channel);
}
static __device__ __forceinline__ char* lsaSendSlot(const LsaSendConnection& s, uint64_t step, const CollArgs& a) {
  return s.fifo + (step % a.layout.nsteps) * a.layout.slotBytes;
}
// Publishes step `step`: header first, then ready with release (covers the slot data
// the whole block wrote before the preceding __syncthreads()).
static __device__ __forceinline__ void lsaPost(const LsaSendConnection& s, uint64_t step, const CollArgs& a) {
  uint64_t* h = s.header + 2 * (step % a.layout.nsteps);
  h[0] = a.callDesc;
  h[1] = a.count;
  store_release(s.ready, step + 1);
}
static __device__ __forceinline__ void lsaWaitReady(const LsaRecvConnection& r, uint64_t step, const CollArgs& a,
                                                    const KernelEnv& env) {
  waitAtLeast(r.ready, step + 1, env, kWaitRecvReady, r.peer, r.channel);
  const uint64_t* h = r.header + 2 * (step % a.layout.nsteps);
  if (h[0] != a.callDesc) commref_fail(env, kMismatch, kCallMismatch, r.peer, r.channel, a.callDesc, h[0]);
  if (h[1] != a.count) commref_fail(env, kMismatch, kCountMismatch, r.peer, r.channel, a.count, h[1]);
}
static __device__ __forceinline__ const char* lsaRecvSlot(const LsaRecvConnection& r, uint64_t step, const CollArgs& a) {
  return r.fifo + (step % a.layout.nsteps) * a.layout.slotBytes;
}
static __device__ __forceinline__ void lsaRelease(const LsaRecvConnection& r, uint64_t step) {
  store_release(r.credit, step + 1);
}
