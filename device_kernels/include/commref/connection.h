// commref/connection.h — a Connection: one direction of one link, LSA or GIN, chosen
// per peer at run time (bit `peer` of CollArgs.gin.peerMask), as NCCL's Flow does.
// flow.h uses only the functions below; each has an LSA and a GIN body.
//
// GIN protocol (a slot = 64-byte header + data, as for LSA):
//   sender, step s:   wait until its credit signal >= s + 1 - nsteps; fill its own
//                     staging slot; put it into the receiver's FIFO slot with a remote
//                     action that depends on GinArgs.protocol:
//                       strong:         one put with StrongSignalInc(ready) if header +
//                                       data < 2 * kGinStrongMinPutBytes; else
//                                       min(putsPerSlot, total / kGinStrongMinPutBytes)
//                                       puts, StrongSignalInc(ready) on the last only
//                                       (it covers the earlier puts of its context)
//                       weak-last:      putsPerSlot puts, WeakSignalInc(ready) on the last
//                       signal-per-put: putsPerSlot puts, each WeakSignalInc(ready)
//                       flush-signal:   putsPerSlot puts, flush, then WeakSignalInc(ready)
//   receiver, step s: wait until the ready signal of slot s % nsteps has counted every
//                     signal of this use of the slot ((s / nsteps + 1) * signals per
//                     slot); read the slot; WeakSignalInc(credit) at the sender (a
//                     credit carries no data).
// Ready signals are per slot: a cumulative per-link count would let signals of step
// s + 1 stand in for a late put of step s (the sender may run nsteps ahead).
// On an unordered wire (GinArgs.doorbells) each slot's operations and each credit end
// with a doorbell (gin.h), so the wire reorders within what a step posted, reproducibly
// for a given seed; an ordered wire lands in posted order and needs none.
// Only strong is safe on every wire; the others exist for the ordering experiments.
// Failure (wait.h): the functions below are thread 0's; once env.failed is set they
// wait for nothing and post nothing (no header, ready, credit or descriptor).
// Signals: ready of slot s of inbound (c, k) at (c*4 + k)*nsteps + s of the receiver,
// credit of outbound (c, j) at creditSignalBase + c*4 + j of the sender. Context = channel.
//
// LL and LL128 steps (proto.h) move their data in lines of their own slots, which the
// receiver polls; credits work as above. Every step of every protocol also publishes its
// Simple slot's header (call descriptor, count) and readiness after its data (the ready
// word over LSA; over GIN a put of the header with the slot's ready signals), so that
//   - a Simple receiver facing a sender in another protocol reads that header and fails
//     with kMismatch (the descriptor carries the protocol), and an LL or LL128 receiver
//     looks at it while it waits for its header lines (connWaitHeaderLines): a peer in
//     another protocol is a CommMismatch, not a timeout;
//   - the GIN ready signals of a slot count every use of the slot, whatever the protocol
//     of each, so the counts a Simple receiver waits for stay right.
// Over GIN the sender stages its lines and puts them in one put without a signal: the
// proxy lands them line by line (land.h) and the receiver polls the flags.
#pragma once
#include "gin.h"
#include "lsa.h"
#include "proto.h"

namespace commref {

struct SendConnection {
  int peer, channel;
  bool gin;
  char* slots;             // LSA: the receiver's FIFO (mapped); GIN: this rank's staging
  uint64_t* ready;         // LSA: the receiver's ready word
  const uint64_t* credit;  // LSA: in this rank's window; GIN: this rank's credit signal
  uint64_t peerFifoOff;    // GIN: the FIFO's offset in the receiver's window
  uint64_t stagingOff;     // GIN: the staging slots' offset in this rank's window
  uint32_t readySignal;    // GIN: the receiver's ready signal of slot 0 (slot s: + s)
  uint64_t* stepState;
  int out, inAtPeer;  // this link's outbound index here, its inbound FIFO at the peer (LL, LL128 slots)
};

struct RecvConnection {
  int peer, channel;
  bool gin;
  const char* slots;      // this rank's FIFO
  const uint64_t* ready;  // LSA: ready word; GIN: this rank's ready signal of slot 0
  uint64_t* credit;       // LSA: in the sender's window
  uint32_t creditSignal;  // GIN: the sender's credit signal index
  uint64_t* stepState;
  int in;  // this rank's inbound FIFO index (LL, LL128 slots)
};

static __device__ __forceinline__ bool overGin(const CollArgs& a, int peer) { return (a.gin.peerMask >> peer) & 1; }

// Outbound link `out` of channel c to `peer`, which receives on its FIFO `inAtPeer`.
static __device__ SendConnection makeSend(const CollArgs& a, int c, int out, int peer, int inAtPeer) {
  SendConnection s;
  s.peer = peer;
  s.channel = c;
  s.gin = overGin(a, peer);
  s.peerFifoOff = fifoOffset(a, c, inAtPeer);
  s.stagingOff = stagingOffset(a, c, out);
  s.readySignal = (c * COMMREF_CONN_IN + inAtPeer) * a.layout.nsteps;
  if (s.gin) {
    KernelEnv env = kernelEnv(a);
    Gin g{a, env};
    s.slots = windowOf(a, a.rank) + s.stagingOff;
    s.ready = nullptr;
    s.credit = g.signals() + a.gin.creditSignalBase + c * COMMREF_CONN_OUT + out;
  } else {
    s.slots = windowOf(a, peer) + s.peerFifoOff;
    s.ready = readyWord(a, peer, c, inAtPeer);
    s.credit = creditWord(a, a.rank, c, out);
  }
  s.stepState = stepStateOf(a, c, COMMREF_CONN_IN + out);
  s.out = out;
  s.inAtPeer = inAtPeer;
  return s;
}

// Inbound FIFO `in` of channel c, fed by `peer` through its outbound link `outAtPeer`.
static __device__ RecvConnection makeRecv(const CollArgs& a, int c, int in, int peer, int outAtPeer) {
  RecvConnection r;
  r.peer = peer;
  r.channel = c;
  r.gin = overGin(a, peer);
  r.slots = windowOf(a, a.rank) + fifoOffset(a, c, in);
  r.creditSignal = a.gin.creditSignalBase + c * COMMREF_CONN_OUT + outAtPeer;
  if (r.gin) {
    KernelEnv env = kernelEnv(a);
    Gin g{a, env};
    r.ready = g.signals() + (c * COMMREF_CONN_IN + in) * a.layout.nsteps;
    r.credit = nullptr;
  } else {
    r.ready = readyWord(a, a.rank, c, in);
    r.credit = creditWord(a, peer, c, outAtPeer);
  }
  r.stepState = stepStateOf(a, c, in);
  r.in = in;
  return r;
}

// Strong protocol: the least bytes of a put when a slot is split. A slot of header +
// data below twice this stays one put (small messages keep their latency: one
// descriptor per slot); a larger one goes as several puts of at least this many bytes,
// at most putsPerSlot, the strong signal on the last. The split is what relies on the
// strong signal's promise (every earlier put of its context to that peer is visible
// first), as NCCL's GIN kernels do; 4 KiB per put keeps the per-descriptor cost small
// against the bytes it carries.
constexpr uint64_t kGinStrongMinPutBytes = 4096;

static __device__ __forceinline__ uint32_t signalsPerSlot(const CollArgs& a) {
  return a.gin.protocol == kGinSignalPerPut ? a.gin.putsPerSlot : 1;
}

// Waits until slot `step` of the link is free to fill.
static __device__ __forceinline__ void connWaitCredit(const SendConnection& s, uint64_t step, const CollArgs& a,
                                                      KernelEnv& env) {
  if (step + 1 > a.layout.nsteps) {
    const uint64_t* help = nullptr;
    if (s.gin) {  // the credit comes through it (network mpi: it receives it); help it meanwhile (gin.h)
      Gin g{a, env};
      g.kick();
      help = g.helpHook();
    }
    waitAtLeast(s.credit, step + 1 - a.layout.nsteps, env, kWaitSendCredit, s.peer, s.channel, help);
  }
}
// Where the block writes the data of step `step` (the header goes 64 bytes before).
static __device__ __forceinline__ char* connSendData(const SendConnection& s, uint64_t step, const CollArgs& a) {
  return s.slots + (step % a.layout.nsteps) * slotStride(a) + COMMREF_SLOT_HEADER;
}
// Writes the call descriptor and count into the Simple slot of step `step` (the
// receiver's over LSA, this rank's staging over GIN) and, over LSA, releases the ready
// word: the step is published. Over GIN the caller then puts the slot; returns s.gin.
static __device__ __forceinline__ bool connPublishHeader(const SendConnection& s, uint64_t step, const CollArgs& a) {
  uint64_t* h = (uint64_t*)(s.slots + (step % a.layout.nsteps) * slotStride(a));
  h[0] = a.callDesc;
  h[1] = a.count;
  if (!s.gin) store_release(s.ready, step + 1);
  return s.gin;
}
// Publishes step `step` carrying `bytes` of data. Thread 0, after the block's __syncthreads().
static __device__ void connPost(const SendConnection& s, uint64_t step, uint64_t bytes, const CollArgs& a,
                                KernelEnv& env) {
  if (env.failed || !connPublishHeader(s, step, a)) return;
  const uint64_t slot = (step % a.layout.nsteps) * slotStride(a);
  Gin g{a, env, s.channel};  // a connection's context is its channel
  const uint64_t total = COMMREF_SLOT_HEADER + bytes, dst = s.peerFifoOff + slot, src = s.stagingOff + slot;
  const uint64_t readySignal = s.readySignal + step % a.layout.nsteps;
  uint32_t n = a.gin.putsPerSlot;
  if (a.gin.protocol == kGinStrong) {  // the header is in the first put
    const uint64_t fit = total / kGinStrongMinPutBytes;
    n = fit < 1 ? 1 : (fit < n ? (uint32_t)fit : n);
  }
  for (uint32_t i = 0; i < n; i++) {
    const uint64_t b = total * i / n, e = total * (i + 1) / n;
    RemoteAction r = NoSignal();
    if (a.gin.protocol == kGinStrong && i == n - 1)
      r = StrongSignalInc(readySignal);
    else if (a.gin.protocol == kGinSignalPerPut || (a.gin.protocol == kGinWeakLast && i == n - 1))
      r = WeakSignalInc(readySignal);
    if (a.streamStores) r.flags |= kGinBulk;  // the receiver reads the slot after its ready signal
    g.put(s.peer, dst + b, src + b, e - b, r);
  }
  if (a.gin.protocol == kGinFlushSignal) {
    g.flush();
    g.signal(s.peer, WeakSignalInc(readySignal));
  }
  if (a.gin.doorbells) g.doorbell(s.peer);
  commref_help_progress(g.helpHook());  // a turn at the queue (gin.h, "Help"): the engine may be off its core
}
// Waits for step `step` of the Simple slots; returns whether its header may be checked
// (false after a failed wait, and over GIN where a weak protocol's header may land after
// its signal). Thread 0.
static __device__ bool connWaitSlot(const RecvConnection& r, uint64_t step, const CollArgs& a, KernelEnv& env) {
  if (r.gin) {
    Gin g{a, env};
    g.kick();  // the data comes through it (network mpi: it receives it); help it meanwhile (gin.h)
    waitReached(r.ready + step % a.layout.nsteps, (step / a.layout.nsteps + 1) * signalsPerSlot(a), env, kWaitRecvReady,
                r.peer, r.channel, g.helpHook());
    if (!a.gin.checkHeaders) return false;
  } else {
    waitAtLeast(r.ready, step + 1, env, kWaitRecvReady, r.peer, r.channel);
  }
  return !env.failed;  // after a failed wait the slot may hold anything
}
// The header (call descriptor, count) of the Simple slot of step `step`.
static __device__ __forceinline__ uint64_t* connSlotHeader(const RecvConnection& r, uint64_t step, const CollArgs& a) {
  return (uint64_t*)(r.slots + (step % a.layout.nsteps) * slotStride(a));
}
// Waits for step `step` and checks its header. Thread 0.
static __device__ void connWaitReady(const RecvConnection& r, uint64_t step, const CollArgs& a, KernelEnv& env) {
  if (!connWaitSlot(r, step, a, env)) return;
  const uint64_t* h = connSlotHeader(r, step, a);
  if (h[0] != a.callDesc) commref_fail(env, kMismatch, kCallMismatch, r.peer, r.channel, a.callDesc, h[0]);
  if (h[1] != a.count) commref_fail(env, kMismatch, kCountMismatch, r.peer, r.channel, a.count, h[1]);
}
static __device__ __forceinline__ const char* connRecvData(const RecvConnection& r, uint64_t step, const CollArgs& a) {
  return r.slots + (step % a.layout.nsteps) * slotStride(a) + COMMREF_SLOT_HEADER;
}
// Returns slot `step` to the sender. Thread 0, after the block's __syncthreads().
static __device__ __forceinline__ void connRelease(const RecvConnection& r, uint64_t step, const CollArgs& a,
                                                   KernelEnv& env) {
  if (env.failed) return;
  if (r.gin) {
    Gin g{a, env, r.channel};
    // A credit publishes no data, so a weak signal suffices (and every backend has one).
    g.signal(r.peer, WeakSignalInc(r.creditSignal));
    if (a.gin.doorbells) g.doorbell(r.peer);
  } else {
    store_release(r.credit, step + 1);
  }
}

// ---- LL and LL128 steps (proto.h) ----

// Slot `step` of the connection's `proto` (LL or LL128) slots, where its header lines
// start: of the receiver's FIFO (LSA), of this rank's staging (GIN), of this rank's FIFO.
static __device__ __forceinline__ uint64_t lineSlot(const CollArgs& a, uint32_t proto, uint64_t step) {
  return (step % a.layout.nsteps) * protoSlotStride(a, proto);
}
static __device__ __forceinline__ char* connSendLines(const SendConnection& s, uint32_t proto, uint64_t step,
                                                      const CollArgs& a) {
  const uint64_t at = lineSlot(a, proto, step);
  if (s.gin) return windowOf(a, a.rank) + stagingOffset(a, s.channel, s.out, proto) + at;
  return windowOf(a, s.peer) + fifoOffset(a, s.channel, s.inAtPeer, proto) + at;
}
static __device__ __forceinline__ const char* connRecvLines(const RecvConnection& r, uint32_t proto, uint64_t step,
                                                            const CollArgs& a) {
  return windowOf(a, a.rank) + fifoOffset(a, r.channel, r.in, proto) + lineSlot(a, proto, step);
}

// Writes the header lines of step `step` (call descriptor and count, with the step's
// flag). Thread 0, once the step's credit is in: the receiver may check the header while
// the block still writes the data.
static __device__ void connPostHeaderLines(const SendConnection& s, uint32_t proto, uint64_t step, const CollArgs& a,
                                           const KernelEnv& env) {
  if (env.failed) return;
  char* slot = connSendLines(s, proto, step, a);
  const uint64_t flag = stepFlag(step);
  if (proto == kProtoLL) {
    llStoreLine(slot, a.callDesc, flag);
    llStoreLine(slot + COMMREF_LL_LINE, a.count, flag);
  } else {
    ll128StoreHeader(slot, a.callDesc, a.count, flag);
  }
}

// Whether the Simple slot of step `step` shows that the sender published the step (every
// protocol does, after its data) under another call descriptor or count: then the step
// fails with kMismatch (recorded) and it returns true. Thread 0.
static __device__ bool connProbeMismatch(const RecvConnection& r, uint64_t step, const CollArgs& a, KernelEnv& env) {
  if (r.gin) {
    if (!a.gin.checkHeaders) return false;  // a weak protocol's header may land after its signal
    const uint64_t least = (step / a.layout.nsteps + 1) * signalsPerSlot(a);
    if ((int64_t)(load_acquire(r.ready + step % a.layout.nsteps) - least) < 0) return false;
  } else if (load_acquire(r.ready) < step + 1) {
    return false;
  }
  const uint64_t* h = (const uint64_t*)(r.slots + (step % a.layout.nsteps) * slotStride(a));
  if (h[0] != a.callDesc)
    commref_fail(env, kMismatch, kCallMismatch, r.peer, r.channel, a.callDesc, h[0]);
  else if (h[1] != a.count)
    commref_fail(env, kMismatch, kCountMismatch, r.peer, r.channel, a.count, h[1]);
  return env.failed;
}

// Waits for the header lines of step `step` and checks them (as connWaitReady checks a
// Simple header). Thread 0. Bounded like every wait; every 64 polls it also probes the
// Simple slot (connProbeMismatch), where a sender in another protocol publishes.
static __device__ void connWaitHeaderLines(const RecvConnection& r, uint32_t proto, uint64_t step, const CollArgs& a,
                                           KernelEnv& env) {
  if (env.failed) return;
  const char* slot = connRecvLines(r, proto, step, a);
  const uint64_t flag = stepFlag(step);
  const uint64_t* help = nullptr;
  if (r.gin) {  // the lines come through the engine (network shm: kernels help it, gin.h)
    Gin g{a, env};
    g.kick();
    help = g.helpHook();
  }
  uint64_t desc = 0, count = 0, seen = 0, start = 0;
  for (uint32_t spins = 0;; spins++) {
    if (proto == kProtoLL) {
      uint64_t f1;
      llLoadLine(slot, desc, seen);
      llLoadLine(slot + COMMREF_LL_LINE, count, f1);
      if (seen == flag && f1 == flag) break;
    } else if (ll128ReadHeader(slot, flag, desc, count, seen)) {
      break;
    }
    if (spins == 0) {
      start = commref_now_ns();
    } else if ((spins & 63) == 0) {
      if (connProbeMismatch(r, step, a, env)) return;
      if (!keepWaiting(env, start, kWaitRecvReady, r.peer, r.channel, flag, seen)) return;
    }
    if (help) commref_help_progress(help);
    commref_spin_pause(spins + 1);
  }
  if (desc != a.callDesc)
    commref_fail(env, kMismatch, kCallMismatch, r.peer, r.channel, a.callDesc, desc);
  else if (count != a.count)
    commref_fail(env, kMismatch, kCountMismatch, r.peer, r.channel, a.count, count);
}

// Publishes step `step`, whose `lineBytes` of header and data lines the block has
// written: its Simple slot's header and readiness (see the top of this file); over GIN
// first the put of the staged lines. Thread 0, after the block's barrier.
static __device__ void connPostLines(const SendConnection& s, uint32_t proto, uint64_t step, uint64_t lineBytes,
                                     const CollArgs& a, KernelEnv& env) {
  if (env.failed || !connPublishHeader(s, step, a)) return;
  const uint64_t slot = (step % a.layout.nsteps) * slotStride(a);
  Gin g{a, env, s.channel};  // a connection's context is its channel
  const uint64_t lines = lineSlot(a, proto, step);
  g.put(s.peer, fifoOffset(a, s.channel, s.inAtPeer, proto) + lines, stagingOffset(a, s.channel, s.out, proto) + lines,
        lineBytes, NoSignal());
  // The header, with as many ready signals as a Simple step of this slot sends.
  const uint64_t readySignal = s.readySignal + step % a.layout.nsteps;
  g.put(s.peer, s.peerFifoOff + slot, s.stagingOff + slot, COMMREF_SLOT_HEADER,
        a.gin.protocol == kGinStrong ? StrongSignalInc(readySignal) : WeakSignalInc(readySignal));
  for (uint32_t i = 1; i < signalsPerSlot(a); i++) g.signal(s.peer, WeakSignalInc(readySignal));
  if (a.gin.doorbells) g.doorbell(s.peer);
  commref_help_progress(g.helpHook());
}

}  // namespace commref
