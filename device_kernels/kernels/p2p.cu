// Point-to-point: the sends and receives of a group on one communicator in one launch
// (collectives/p2p.py builds it). CollArgs.sendbuf -> P2pOp[count] (args.h); block b
// runs the operations whose `block` is b: first its sends, then its receives, each in
// posted order. A send of one step (zero copy, or bytes that fit a slot) is posted and
// its accept (below) awaited after the block's other operations, or before a send of
// several steps, or once kMaxPending are pending; a send of several steps awaits its
// accept after its first step. The host gives a block either the operations of one
// (peer, direction), so that every operation of the group is in flight at once, or
// (one block for all of a group's) only sends of one step, at most kMaxPending of them
// and at most nsteps operations per (peer, direction): every send is then posted before
// any wait on a peer. So a group posted in any order on any rank cannot wait on itself.
//
// Links. The link from rank s to rank r, d = (r - s) mod n, is outbound link (d - 1) % 4
// of window channel max_channels + (d - 1) / 4 at s and inbound FIFO (d - 1) % 4 of that
// channel at r (the device API's per-peer mapping, device.h, on channels of their own:
// the collectives' FIFOs and step counters are never touched). Each link is LSA or GIN
// by bit `peer` of CollArgs.gin.peerMask, as for the ring kernels (connection.h).
//
// An operation is Prims::send or Prims::recv (flow.h) over its link, in the Simple
// protocol, in steps of at most one slot; count 0 is one step of no data. Each step's
// header carries the operation's call descriptor (kP2p and the dtype) and its element
// count, which the receiver compares with its own:
//   - recv: thread 0 waits for the first step and checks its header. If the sender
//     posted another dtype or count, it writes its verdict (its own descriptor, its
//     count, and the step + 1) into words 2..4 of that slot's header on the sender's
//     side of the link (over LSA its own FIFO slot, which the sender maps; over GIN the
//     sender's staging slot, by a put whose weak signal is the link's credit), raises
//     the credit and fails with kP2pRecvMismatch (expected: the sender's count, seen: its
//     descriptor).
//   - send: after the first step (as said above), thread 0 waits for that step's credit (kWaitP2pAccept:
//     the receiver took the slot, or rejected it) and then reads the verdict words: a
//     verdict for this step fails with kP2pSendRejected (expected: the receiver's count,
//     seen: its descriptor). So a send completes only once its receiver has accepted it,
//     and a mismatch fails both ranks. Over GIN with a weak protocol (GinArgs.checkHeaders
//     0) headers are not checked, and a mismatch is not detected.
// Once an operation is done (a send: accepted) thread 0 sets its `done` word, so that
// the host can name the operation that failed.
//
// Zero copy (P2pOp.symWindow != 0: the send's buffer lies in a symmetric window and the
// link is LSA). The send posts one step without data whose header also carries, in
// words 5..7, step + 1 (the mark), the window id and the buffer's offset, and awaits
// that step's credit as above. The recv checks the first step's header as above; when it
// bears the mark, the block copies op.bytes straight from the sender's window (its peer
// table from P2pOp.symWindows, CollArgs.streamStores choosing streamed stores from
// COMMREF_STREAM_MIN_BYTES per thread) into the recvbuf, and thread 0 then raises the
// credit. So the sender's buffer is read once, by its receiver, and the send returns
// only after the receiver has copied it: the caller may then reuse it. A recv cannot
// tell ahead of time which way its send goes: either way works with any recvbuf. A
// mark whose window is not mapped here, or whose bytes run past the window, fails the
// recv with kBufferMismatch (expected: the window's bytes, seen: offset + bytes).
#include "commref/ring.h"

namespace commref {

// Words 2..4 of a Simple slot's header: a receiver's verdict on the step (above).
enum : int { kVerdictDesc = 2, kVerdictCount = 3, kVerdictStep = 4 };
// Words 5..7: a zero-copy send's mark (step + 1), window id and offset (above).
enum : int { kZeroCopyStep = 5, kZeroCopyWindow = 6, kZeroCopyOffset = 7 };

// The sender's address of a zero-copy send's bytes whose mark is in slot header `h`
// (thread 0), or nullptr after failing the recv (the top).
static __device__ const char* p2pZeroCopySource(const P2pOp& op, const uint64_t* h, KernelEnv& env) {
  const uint64_t id = h[kZeroCopyWindow], offset = h[kZeroCopyOffset];
  const uint64_t* table = (const uint64_t*)op.symWindows;
  const uint64_t* peers = table && id < COMMREF_GIN_MAX_WINDOWS ? (const uint64_t*)table[2 * id] : nullptr;
  const uint64_t winBytes = peers ? table[2 * id + 1] : 0;
  const char* base = peers ? (const char*)peers[op.peer] : nullptr;
  if (!base || offset > winBytes || op.bytes > winBytes - offset) {
    commref_fail(env, kMismatch, kBufferMismatch, op.peer, op.channel, winBytes, offset + op.bytes);
    return nullptr;
  }
  return base + offset;
}

// The receiver's check of step `step`, the first of `op` (thread 0, see the top).
static __device__ void p2pCheckFirst(const CollArgs& a, const P2pOp& op, uint64_t step, KernelEnv& env) {
  const RecvConnection r = makeRecv(a, op.channel, op.conn, op.peer, op.conn);
  if (!connWaitSlot(r, step, a, env)) return;
  uint64_t* h = connSlotHeader(r, step, a);
  const uint64_t desc = h[0], count = h[1];
  if (desc == a.callDesc && count == a.count) return;
  h[kVerdictDesc] = a.callDesc;
  h[kVerdictCount] = a.count;
  if (r.gin) {
    h[kVerdictStep] = step + 1;
    Gin g{a, env, r.channel};
    const uint64_t slot = (step % a.layout.nsteps) * slotStride(a) + kVerdictDesc * 8;
    g.put(r.peer, stagingOffset(a, op.channel, op.conn) + slot, fifoOffset(a, op.channel, op.conn) + slot, 24,
          WeakSignalInc(r.creditSignal));
    if (a.gin.doorbells) g.doorbell(r.peer);
  } else {
    store_release(&h[kVerdictStep], step + 1);
    store_release(r.credit, step + 1);
  }
  commref_fail(env, kMismatch, kP2pRecvMismatch, op.peer, op.channel, count, desc);
}

// A zero-copy send of at least this many bytes, in a block that received nothing, sleeps
// while its receiver copies (its core is better spent on the copy: a CPU engine's blocks
// share the host's cores); after receiving, the block polls first (the peer is copying
// too, and done about as soon).
#define COMMREF_P2P_SLEEP_MIN_BYTES (256u << 10)

// The sender's wait for the receiver's verdict on step `step`, the first of `op` (thread 0).
static __device__ void p2pAwaitAccept(const CollArgs& a, const P2pOp& op, uint64_t step, KernelEnv& env,
                                      bool received = false) {
  const SendConnection s = makeSend(a, op.channel, op.conn, op.peer, op.conn);
  const uint64_t* help = nullptr;
  if (s.gin) {  // the credit comes through the engine: help it meanwhile (gin.h)
    Gin g{a, env};
    g.kick();
    help = g.helpHook();
  }
  const bool sleep = op.symWindow && op.bytes >= COMMREF_P2P_SLEEP_MIN_BYTES && !received;
  waitAtLeast(s.credit, step + 1, env, kWaitP2pAccept, op.peer, op.channel, help, sleep ? COMMREF_SLEEPING_SPINS : 1);
  if (env.failed) return;
  const uint64_t* h = (const uint64_t*)(s.slots + (step % a.layout.nsteps) * slotStride(a));
  if (load_acquire(&h[kVerdictStep]) == step + 1)
    commref_fail(env, kMismatch, kP2pSendRejected, op.peer, op.channel, h[kVerdictCount], h[kVerdictDesc]);
}

// Posts a zero-copy send (the top): one step without data, its header marked. Its
// accept is awaited later (p2pAwaitAll). Thread 0.
static __device__ void p2pPostZeroCopy(const CollArgs& a, const P2pOp& op, uint64_t first, KernelEnv& env) {
  const SendConnection s = makeSend(a, op.channel, op.conn, op.peer, op.conn);
  connWaitCredit(s, first, a, env);
  if (env.failed) return;
  uint64_t* h = (uint64_t*)(s.slots + (first % a.layout.nsteps) * slotStride(a));
  h[kZeroCopyWindow] = op.symWindow;
  h[kZeroCopyOffset] = op.symOffset;
  h[kZeroCopyStep] = first + 1;
  connPublishHeader(s, first, a);  // words 0, 1, then the ready word (release)
  store_relaxed(s.stepState, first + 1);
}

// Sends of one step whose accept is still awaited (p2pBlock), at most kMaxPending at once.
enum : int { kMaxPending = 32 };
struct Pending {
  int n;                       // the same in every thread of the block
  uint32_t op[kMaxPending];    // thread 0's: the operation's index
  uint64_t step[kMaxPending];  // and its step
};

// Awaits the accept of every pending send, in posted order, and marks each done; the
// block leaves together if one failed. `received`: the block has run a receive.
static __device__ void p2pAwaitAll(const CollArgs& args, const P2pOp* ops, Pending& pend, bool received) {
  KernelEnv env = kernelEnv(args);
  if (threadIdx.x == 0)
    for (int k = 0; k < pend.n && !env.failed; k++) {
      p2pAwaitAccept(args, ops[pend.op[k]], pend.step[k], env, received);
      if (!env.failed) store_release_u32((uint32_t*)&ops[pend.op[k]].done, 1);
    }
  leaveIfFailed(env.failed);
  pend.n = 0;
}

// One operation. `a`: the launch's record with this operation's descriptor and count;
// `streamed`: the launch's streamStores.
// Returns whether the operation is done; a send of one step (zero copy, or data that
// fits a slot) is only posted, and returns false with its first step in `first`.
static __device__ bool p2pRun(const CollArgs& a, const P2pOp& op, bool streamed, uint64_t& first) {
  const int c = op.channel, j = op.conn;
  first = load_relaxed(stepStateOf(a, c, op.send ? COMMREF_CONN_IN + j : j));
  KernelEnv env = kernelEnv(a);
  if (op.send && op.symWindow) {
    if (threadIdx.x == 0) p2pPostZeroCopy(a, op, first, env);
    leaveIfFailed(env.failed);
    return false;
  }
  __shared__ const char* zeroCopyFrom;  // recv: the sender's bytes when its send is zero copy
  const Share all{0, op.bytes};
  Prims<uint8_t, OpSum> p(a, c);
  if (op.send) {
    const uint8_t* src = (const uint8_t*)op.buf;
    const bool oneStep = op.bytes <= a.layout.slotBytes;
    p.addSend(j, op.peer, j);
    FOR_EACH_PIECE(base, len, all, p.slotElems()) {
      p.send(src + base, len);
      if (base == 0 && !oneStep) {  // before the next steps wait for credits (the top)
        if (threadIdx.x == 0) p2pAwaitAccept(a, op, first, env);
        leaveIfFailed(env.failed);
      }
    }
    p.finish();
    return !oneStep;
  } else {
    uint8_t* dst = (uint8_t*)op.buf;
    if (threadIdx.x == 0) {
      zeroCopyFrom = nullptr;
      p2pCheckFirst(a, op, first, env);
      const RecvConnection r = makeRecv(a, c, j, op.peer, j);
      const uint64_t* h = connSlotHeader(r, first, a);
      if (!env.failed && !r.gin && h[kZeroCopyStep] == first + 1) zeroCopyFrom = p2pZeroCopySource(op, h, env);
    }
    leaveIfFailed(env.failed);
    if (zeroCopyFrom) {
      copyOwnShare(dst, (const uint8_t*)zeroCopyFrom, op.bytes, streamed ? COMMREF_STREAM_MIN_BYTES : ~0ull);
      __syncthreads();
      if (threadIdx.x == 0) {
        const RecvConnection r = makeRecv(a, c, j, op.peer, j);
        connRelease(r, first, a, env);
        store_relaxed(r.stepState, first + 1);
      }
      __syncthreads();
      return true;
    }
    p.addRecv(j, op.peer, j);
    FOR_EACH_PIECE(base, len, all, p.slotElems()) p.recv(dst + base, len);
  }
  p.finish();
  return true;
}

static __device__ void p2pBlock(const CollArgs& args) {
  const P2pOp* ops = (const P2pOp*)args.sendbuf;
  __shared__ CollArgs a;  // the launch's record with the running operation's descriptor and count
  Pending pend;
  pend.n = 0;
  bool received = false;
  for (int sends = 1; sends >= 0; sends--)
    for (uint64_t i = 0; i < args.count; i++) {
      const P2pOp& op = ops[i];
      if (op.block != (int32_t)blockIdx.x || op.send != sends) continue;
      // A send of several steps, and a send that finds the list full, first await the
      // pending accepts (in one block for all, the host posts neither: p2p.py).
      if (sends && (pend.n == kMaxPending || (!op.symWindow && op.bytes > args.layout.slotBytes)))
        p2pAwaitAll(args, ops, pend, false);  // before any receive: sends run first
      if (threadIdx.x == 0) {
        a = args;
        a.callDesc = op.callDesc;
        a.count = op.count;
        a.protocol = kProtoSimple;
        a.streamStores = 0;  // FIFO steps: plain stores; zero-copy receives: the launch's (the top)
      }
      __syncthreads();
      uint64_t first;
      received |= !sends;
      if (p2pRun(a, op, args.streamStores != 0, first)) {
        if (threadIdx.x == 0) store_release_u32((uint32_t*)&op.done, 1);
      } else {
        pend.op[pend.n] = (uint32_t)i;
        pend.step[pend.n] = first;
        pend.n++;
      }
      __syncthreads();  // thread 0 rewrites `a` for the next operation only after every thread is done with it
    }
  p2pAwaitAll(args, ops, pend, received);
}

COMMREF_KERNEL(commref_p2p, CollArgs, args) { p2pBlock(args); }

}  // namespace commref
