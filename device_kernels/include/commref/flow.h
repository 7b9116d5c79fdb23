// commref/flow.h — flow primitives: the vocabulary every collective is written in.
//
// A Prims object is one block's view of one channel: up to two inbound and two
// outbound connections, each LSA or GIN (connection.h). Each primitive is one pipeline step on the connections it
// uses, moving at most slotElems() elements:
//
//   send(src, n)                        src            -> every send peer
//   recv(dst, n)                        recv peers     -> dst
//   recvReduceSend(src, n)              src (+) recv   -> send peers
//   recvReduceCopy(src, dst, n, last)   src (+) recv   -> dst
//   recvReduceCopySend(src, dst, n, l)  src (+) recv   -> dst and send peers
//   recvCopySend(dst, n)                recv           -> dst and send peers
//   recvSend(n)                         recv           -> send peers
//   copySend(src, dst, n)               src            -> dst (unless in place) and send peers
//   copy(src, dst, n, last)             src            -> dst (single-rank case)
//   handshake()                         no data: only the call descriptors are checked
//
// Outputs after dst (FIFO slots, GIN staging) are read next by a peer or the proxy and
// are streamed past the cache under CollArgs.streamStores (move.h). dst is streamed
// only in receive steps (recv, recvCopySend), and only when streamReceived() has said
// that the call receives many bytes: nothing in the call reads them again.
//
// `last` marks the step that completes a reduction: avg divides there, once.
// All threads of the block call the same primitives in the same order; thread 0 does
// the waits and the posts, the block moves the data between two barriers.
// Failure (wait.h): the barrier after thread 0's waits is leaveIfFailed(env.failed), a
// __syncthreads_or: if a wait of thread 0 failed (its own deadline, a mismatch, the abort
// flag, or another block of the launch that failed), every thread of the block leaves
// the kernel there together, before any of them moves data; thread 0 posts nothing once
// it has failed (connection.h), and a failure while posting (a GIN queue wait) ends the
// block at the next step's barrier or at finish().
// Every step happens on every rank even when n == 0, so step counters stay aligned.
//
// Protocols (proto.h): every primitive runs in the call's protocol, CollArgs.protocol.
// Simple moves the data between thread 0's waits and posts, as above. LL and LL128 move
// it in lines that carry their flags: thread 0 waits for the send credits, writes the
// header lines and waits for the inbound header lines; then each thread polls its own
// inbound lines (its words on the CPU, its 16 bytes of a 128-byte line on the GPU's
// LL128), reduces and writes them on; thread 0 publishes and releases after a barrier
// (connection.h). A line wait that fails ends the block at that barrier.
#pragma once
#include "connection.h"
#include "move.h"

namespace commref {

template <typename T, typename Op>
class Prims {
 public:
  __device__ Prims(const CollArgs& args, int channel)
      : a(args),
        env(kernelEnv(args)),
        channel_(channel),
        nrecv(0),
        nsend(0),
        streamReceived_(false),
        proto_((uint32_t)args.protocol) {}

  // `bytes`: what this channel's receive steps store into the recvbuf over the whole
  // call, on lines the call has not read itself (not in place). With streamStores, from
  // COMMREF_RECEIVED_STREAM_MIN_BYTES per thread on, the receive steps stream those
  // stores; below it the result still fits in the cache and streaming it costs
  // (docs/performance.md, "Streamed stores").
  __device__ void streamReceived(uint64_t bytes) {
    streamReceived_ = a.streamStores && bytes / blockDim.x >= COMMREF_RECEIVED_STREAM_MIN_BYTES;
  }

  // Elements one step moves at most: a slot's data in the call's protocol.
  __device__ uint64_t slotElems() const {
    const uint64_t bytes = proto_ == kProtoLL      ? a.layout.llSlotBytes
                           : proto_ == kProtoLL128 ? a.layout.ll128SlotBytes
                                                   : a.layout.slotBytes;
    return bytes / sizeof(T);
  }

  // Inbound FIFO `in` of this rank, fed by `peer` through its outbound link `outAtPeer`.
  __device__ void addRecv(int in, int peer, int outAtPeer) {
    rx[nrecv] = makeRecv(a, channel_, in, peer, outAtPeer);
    rxStep[nrecv] = load_relaxed(rx[nrecv].stepState);
    nrecv++;
  }
  __device__ int channel() const { return channel_; }
  // Outbound link `out` of this rank to `peer`, which receives on its FIFO `inAtPeer`.
  __device__ void addSend(int out, int peer, int inAtPeer) {
    tx[nsend] = makeSend(a, channel_, out, peer, inAtPeer);
    txStep[nsend] = load_relaxed(tx[nsend].stepState);
    nsend++;
  }
  // Persists the step counters for the next launch (or the next Prims on the same
  // connections in this launch). Call once, after the last step.
  __device__ void finish() {
    leaveIfFailed(env.failed);
    if (threadIdx.x == 0) {
      for (int i = 0; i < nrecv; i++) store_relaxed(rx[i].stepState, rxStep[i]);
      for (int i = 0; i < nsend; i++) store_relaxed(tx[i].stepState, txStep[i]);
    }
    __syncthreads();
  }

  // A step without data on every connection: each rank checks its peers' call
  // descriptors. Kernels whose data steps leave some rank without an inbound step
  // from a peer running the same kernel (rooted collectives, the tree) start with it,
  // so that every mismatch surfaces as CommMismatch rather than a timeout or, worse,
  // two ranks that both think they are the root.
  // Sends first, then receives: every rank does the same, so a ring of handshakes
  // cannot wait on itself.
  __device__ void handshake() {
    const uint32_t proto = proto_;
    if (threadIdx.x == 0) {
      for (int i = 0; i < nsend; i++) {
        connWaitCredit(tx[i], txStep[i], a, env);
        if (proto == kProtoSimple) {
          connPost(tx[i], txStep[i], 0, a, env);
        } else {  // the header lines alone, published at once (over GIN they travel only when put)
          connPostHeaderLines(tx[i], proto, txStep[i], a, env);
          connPostLines(tx[i], proto, txStep[i], proto == kProtoLL ? COMMREF_LL_HEADER : COMMREF_LL128_LINE, a, env);
        }
      }
      for (int i = 0; i < nrecv; i++) {
        if (proto == kProtoSimple)
          connWaitReady(rx[i], rxStep[i], a, env);
        else
          connWaitHeaderLines(rx[i], proto, rxStep[i], a, env);
        connRelease(rx[i], rxStep[i], a, env);
      }
    }
    leaveIfFailed(env.failed);
    for (int i = 0; i < nrecv; i++) rxStep[i]++;
    for (int i = 0; i < nsend; i++) txStep[i]++;
  }

  __device__ void send(const T* src, uint64_t n) { step(false, true, src, nullptr, n, false); }
  __device__ void recv(T* dst, uint64_t n) { step(true, false, nullptr, dst, n, false); }
  __device__ void recvReduceSend(const T* src, uint64_t n) { step(true, true, src, nullptr, n, false); }
  __device__ void recvReduceCopy(const T* src, T* dst, uint64_t n, bool last) { step(true, false, src, dst, n, last); }
  __device__ void recvReduceCopySend(const T* src, T* dst, uint64_t n, bool last) {
    step(true, true, src, dst, n, last);
  }
  __device__ void recvCopySend(T* dst, uint64_t n) { step(true, true, nullptr, dst, n, false); }
  __device__ void recvSend(uint64_t n) { step(true, true, nullptr, nullptr, n, false); }
  __device__ void copySend(const T* src, T* dst, uint64_t n) {
    step(false, true, src, dst == src ? nullptr : dst, n, false);
  }
  __device__ void copy(const T* src, T* dst, uint64_t n, bool last) { step(false, false, src, dst, n, last); }

 private:
  __device__ COMMREF_NOINLINE void step(bool useRecv, bool useSend, const T* src, T* dst, uint64_t n, bool last) {
    const int nr = useRecv ? nrecv : 0, ns = useSend ? nsend : 0;
    if (proto_ != kProtoSimple && nr + ns > 0) {
      stepLines(useRecv, useSend, src, dst, n, last);
      return;
    }
    if (threadIdx.x == 0) {
      for (int i = 0; i < nr; i++) connWaitReady(rx[i], rxStep[i], a, env);
      for (int i = 0; i < ns; i++) connWaitCredit(tx[i], txStep[i], a, env);
    }
    leaveIfFailed(env.failed);
    const T* in[3];
    T* out[3];
    int nin = 0, nout = 0;
    if (src) in[nin++] = src;
    for (int i = 0; i < nr; i++) in[nin++] = (const T*)connRecvData(rx[i], rxStep[i], a);
    if (dst) out[nout++] = dst;
    for (int i = 0; i < ns; i++) out[nout++] = (T*)connSendData(tx[i], txStep[i], a);
    // Outputs from `handoff` on are streamed (see the top of this file).
    const int handoff = dst && !(streamReceived_ && !src) ? 1 : 0;
    if (nin > 0 && nout > 0)
      reduceCopy<T, Op>(in, nin, out, nout, n, last ? a.avgDivisor : 0, handoff, handoffStreamMin(a.streamStores));
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int i = 0; i < ns; i++) connPost(tx[i], txStep[i], n * sizeof(T), a, env);
      for (int i = 0; i < nr; i++) connRelease(rx[i], rxStep[i], a, env);
    }
    for (int i = 0; i < nr; i++) rxStep[i]++;
    for (int i = 0; i < ns; i++) txStep[i]++;
  }

  // One LL or LL128 step (see the top of this file and proto.h).
  __device__ COMMREF_NOINLINE void stepLines(bool useRecv, bool useSend, const T* src, T* dst, uint64_t n, bool last) {
    const int nr = useRecv ? nrecv : 0, ns = useSend ? nsend : 0;
    const uint32_t proto = proto_;
    if (threadIdx.x == 0) {
      for (int i = 0; i < ns; i++) {
        connWaitCredit(tx[i], txStep[i], a, env);
        connPostHeaderLines(tx[i], proto, txStep[i], a, env);
      }
      for (int i = 0; i < nr; i++) connWaitHeaderLines(rx[i], proto, rxStep[i], a, env);
    }
    leaveIfFailed(env.failed);
    const uint64_t nbytes = n * sizeof(T);
    const int divisor = last ? a.avgDivisor : 0;
    uint64_t lineBytes;
    if (proto == kProtoLL) {
      moveLL(nr, ns, (const char*)src, (char*)dst, nbytes, divisor);
      lineBytes = COMMREF_LL_HEADER + (nbytes + 7) / 8 * COMMREF_LL_LINE;
    } else {
      moveLL128(nr, ns, (const char*)src, (char*)dst, nbytes, divisor);
      lineBytes =
          COMMREF_LL128_LINE + (nbytes + COMMREF_LL128_LINE_DATA - 1) / COMMREF_LL128_LINE_DATA * COMMREF_LL128_LINE;
    }
    leaveIfFailed(env.failed);  // a line wait failed: the block leaves before posting anything
    if (threadIdx.x == 0) {
      for (int i = 0; i < ns; i++) connPostLines(tx[i], proto, txStep[i], lineBytes, a, env);
      for (int i = 0; i < nr; i++) connRelease(rx[i], rxStep[i], a, env);
    }
    for (int i = 0; i < nr; i++) rxStep[i]++;
    for (int i = 0; i < ns; i++) txStep[i]++;
  }

  // The first data line of inbound (recv) or outbound (send) connection i's slot of this
  // step, and the help hook to call while polling an inbound one (GIN), or nullptr.
  __device__ const char* inLines(int i, uint32_t proto) const {
    return connRecvLines(rx[i], proto, rxStep[i], a) + (proto == kProtoLL ? COMMREF_LL_HEADER : COMMREF_LL128_LINE);
  }
  __device__ char* outLines(int i, uint32_t proto) const {
    return connSendLines(tx[i], proto, txStep[i], a) + (proto == kProtoLL ? COMMREF_LL_HEADER : COMMREF_LL128_LINE);
  }
  __device__ const uint64_t* inHelp(int i) {
    if (!rx[i].gin) return nullptr;
    Gin g{a, env};
    return g.helpHook();
  }

  // LL: word w (8 bytes) of the step's data travels in line w; each thread takes its
  // words (a contiguous range on the CPU, a stride on the GPU), waits for them on every
  // inbound line, folds them with src's, and stores them to dst and every outbound line.
  // CPU: a thread takes its inbound lines in batches, and waits for a batch's last line
  // before the others. Lines are checked one by one all the same (the wait only chooses
  // where to poll), but a sender's thread stores its lines in order, so the batch is then
  // usually all there; a reader that polled each line as it came would pull every cache
  // line back while the writer still fills it (a 1 MiB LL AllReduce on 2 ranks: 3.9 ms
  // without batches, 1.2 ms with them, measured 2026-11).
  static constexpr uint64_t kLLBatch = 64, kLL128Batch = 8;  // 1 KiB of lines each
  __device__ void moveLL(int nr, int ns, const char* src, char* dst, uint64_t nbytes, int divisor) {
    const char* in0 = nr > 0 ? inLines(0, kProtoLL) : nullptr;
    const char* in1 = nr > 1 ? inLines(1, kProtoLL) : nullptr;
    char* out0 = ns > 0 ? outLines(0, kProtoLL) : nullptr;
    char* out1 = ns > 1 ? outLines(1, kProtoLL) : nullptr;
    const uint64_t* help0 = nr > 0 ? inHelp(0) : nullptr;
    const uint64_t* help1 = nr > 1 ? inHelp(1) : nullptr;
    const uint64_t nwords = (nbytes + 7) / 8;
#ifdef COMMREF_GPU
    for (uint64_t w = threadIdx.x; w < nwords; w += blockDim.x) {
#else
    const ElemRange r = elemRange(nwords);
    for (uint64_t w = r.begin; w < r.end; w++) {
      if ((w - r.begin) % kLLBatch == 0) {  // the batch's last line first (see kLLBatch)
        const uint64_t last = (w + kLLBatch < r.end ? w + kLLBatch : r.end) - 1;
        if (in0) llWaitLine(in0 + last * COMMREF_LL_LINE, stepFlag(rxStep[0]), env, rx[0].peer, channel_, help0);
        if (in1) llWaitLine(in1 + last * COMMREF_LL_LINE, stepFlag(rxStep[1]), env, rx[1].peer, channel_, help1);
      }
#endif
      const uint32_t valid = nbytes - 8 * w < 8 ? (uint32_t)(nbytes - 8 * w) : 8;
      const uint64_t line = w * COMMREF_LL_LINE;
      uint64_t v[3];
      int k = 0;
      if (src) v[k++] = loadWord(src + 8 * w, valid);
      if (in0) v[k++] = llWaitLine(in0 + line, stepFlag(rxStep[0]), env, rx[0].peer, channel_, help0);
      if (in1) v[k++] = llWaitLine(in1 + line, stepFlag(rxStep[1]), env, rx[1].peer, channel_, help1);
      if (env.failed) break;
      const uint64_t res = k > 1 || divisor != 0 ? foldWords<T, Op>(v, k, divisor) : v[0];
      if (dst) storeWord(dst + 8 * w, res, valid);
      if (out0) llStoreLine(out0 + line, res, stepFlag(txStep[0]));
      if (out1) llStoreLine(out1 + line, res, stepFlag(txStep[1]));
    }
  }

  // LL128: line L carries data bytes [120 L, 120 L + 120) in its words 0..14, word 15 is
  // the flag (proto.h).
#ifdef COMMREF_CPU
  // Each thread takes a contiguous range of lines: waits for each on every inbound slot
  // (acquire), folds its words, stores them to dst and to every outbound line, then
  // releases the outbound lines' flags.
  void moveLL128(int nr, int ns, const char* src, char* dst, uint64_t nbytes, int divisor) {
    const char* in[2] = {nr > 0 ? inLines(0, kProtoLL128) : nullptr, nr > 1 ? inLines(1, kProtoLL128) : nullptr};
    char* out[2] = {ns > 0 ? outLines(0, kProtoLL128) : nullptr, ns > 1 ? outLines(1, kProtoLL128) : nullptr};
    const uint64_t* help[2] = {nr > 0 ? inHelp(0) : nullptr, nr > 1 ? inHelp(1) : nullptr};
    const uint64_t nlines = (nbytes + COMMREF_LL128_LINE_DATA - 1) / COMMREF_LL128_LINE_DATA;
    const ElemRange r = elemRange(nlines);
    for (uint64_t L = r.begin; L < r.end; L++) {
      if ((L - r.begin) % kLL128Batch == 0) {  // the batch's last line first (see kLLBatch)
        const uint64_t last = (L + kLL128Batch < r.end ? L + kLL128Batch : r.end) - 1;
        for (int i = 0; i < nr; i++)
          ll128WaitLine(in[i] + last * COMMREF_LL128_LINE, stepFlag(rxStep[i]), env, rx[i].peer, channel_, help[i]);
      }
      const uint64_t base = L * COMMREF_LL128_LINE_DATA, at = L * COMMREF_LL128_LINE;
      const uint64_t lineValid = nbytes - base < COMMREF_LL128_LINE_DATA ? nbytes - base : COMMREF_LL128_LINE_DATA;
      for (int i = 0; i < nr; i++) ll128WaitLine(in[i] + at, stepFlag(rxStep[i]), env, rx[i].peer, channel_, help[i]);
      if (env.failed) break;
      // The line's elements (120 bytes hold whole elements of every type), as reduceCopy folds them.
      const T* ins[3];
      T* outs[3];
      int k = 0, m = 0;
      if (src) ins[k++] = (const T*)(src + base);
      for (int i = 0; i < nr; i++) ins[k++] = (const T*)(in[i] + at);
      if (dst) outs[m++] = (T*)(dst + base);
      for (int i = 0; i < ns; i++) outs[m++] = (T*)(out[i] + at);
      foldLine<T, Op>(ins, k, outs, m, lineValid / sizeof(T), divisor);
      for (int i = 0; i < ns; i++) ll128StoreFlag(out[i] + at, stepFlag(txStep[i]));
    }
  }
#else
  // Each full warp takes 4 lines at a time, 8 lanes a line: lane j holds the line's
  // bytes [16 j, 16 j + 16), words 2j and 2j + 1, lane 7 word 14 and the flag, and the 8
  // lanes load and store the line with one v2.u64 instruction of the warp (proto.h). A
  // partial warp (blockDim.x not a multiple of 32) takes no lines.
  __device__ void moveLL128(int nr, int ns, const char* src, char* dst, uint64_t nbytes, int divisor) {
    const unsigned kAll = 0xffffffffu;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (warp >= nwarps) return;
    const int j = lane & 7, flagLane = lane | 7;
    const char* in[2] = {nr > 0 ? inLines(0, kProtoLL128) : nullptr, nr > 1 ? inLines(1, kProtoLL128) : nullptr};
    char* out[2] = {ns > 0 ? outLines(0, kProtoLL128) : nullptr, ns > 1 ? outLines(1, kProtoLL128) : nullptr};
    const uint64_t nlines = (nbytes + COMMREF_LL128_LINE_DATA - 1) / COMMREF_LL128_LINE_DATA;
    for (uint64_t first = (uint64_t)warp * 4; first < nlines; first += (uint64_t)nwarps * 4) {
      const uint64_t L = first + (lane >> 3);
      const bool active = L < nlines;
      const uint64_t at = L * COMMREF_LL128_LINE + 16 * j;
      uint64_t rv[2][2];
      for (int i = 0; i < nr; i++) {
        const uint64_t flag = stepFlag(rxStep[i]);
        if (active) llLoadLine(in[i] + at, rv[i][0], rv[i][1]);
        uint64_t start = 0;
        for (uint32_t spins = 1;; spins++) {
          // The line is whole once lane 7 of its group sees the flag; a group reloads together.
          const bool mine = !active || j != 7 || rv[i][1] == flag;
          const bool ok = __shfl_sync(kAll, mine, flagLane);
          if (__all_sync(kAll, ok)) break;
          if (spins == 1) start = commref_now_ns();
          if ((spins & 63) == 0 && !ok && lane == flagLane)
            keepWaiting(env, start, kWaitRecvReady, rx[i].peer, channel_, flag, rv[i][1]);
          if (__any_sync(kAll, env.failed)) {  // the warp leaves together (the block at the next barrier)
            env.failed = true;
            return;
          }
          commref_spin_pause(spins);
          if (!ok) llLoadLine(in[i] + at, rv[i][0], rv[i][1]);
        }
      }
      uint64_t res[2] = {0, 0};
      for (int u = 0; u < 2; u++) {
        const uint64_t q = 2 * j + u, byte = L * COMMREF_LL128_LINE_DATA + 8 * q;
        if (!active || q >= COMMREF_LL128_WORDS || byte >= nbytes) continue;
        const uint32_t valid = nbytes - byte < 8 ? (uint32_t)(nbytes - byte) : 8;
        uint64_t v[3];
        int k = 0;
        if (src) v[k++] = loadWord(src + byte, valid);
        for (int i = 0; i < nr; i++) v[k++] = rv[i][u];
        res[u] = k > 1 || divisor != 0 ? foldWords<T, Op>(v, k, divisor) : v[0];
        if (dst) storeWord(dst + byte, res[u], valid);
      }
      __syncwarp(kAll);
      for (int i = 0; i < ns; i++)
        if (active) llStoreLine(out[i] + at, res[0], j == 7 ? stepFlag(txStep[i]) : res[1]);
    }
  }
#endif

  const CollArgs& a;
  KernelEnv env;
  int channel_;
  int nrecv, nsend;
  RecvConnection rx[2];
  SendConnection tx[2];
  uint64_t rxStep[2], txStep[2];
  bool streamReceived_;
  uint32_t proto_;  // Protocol (args.h) of every step
};

// Connects p to channel c's ring: inbound from ringPrev, outbound to ringNext.
template <typename T, typename Op>
__device__ inline void connectRing(Prims<T, Op>& p, const CollArgs& a, int c) {
  p.addRecv(kInRing, a.peers[c].ringPrev, kOutRing);
  p.addSend(kOutRing, a.peers[c].ringNext, kInRing);
}

}  // namespace commref
