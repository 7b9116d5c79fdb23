// Direct collectives: ranks load from and store to each other's symmetric buffers
// (NCCL's symmetric kernels, over LSA). No FIFO carries data, so each byte is read
// once from where its owner left it and stored once where it must land, instead of
// being copied twice through a slot:
//   AllGather      each rank stores its shard into its slot of every rank's recvbuf
//                  (NCCL's AllGather_ST);
//   ReduceScatter  each rank loads its part of every rank's sendbuf and reduces it
//                  into its own recvbuf (ReduceScatter_LD);
//   AllReduce      each rank loads its part of every sendbuf, reduces it, and stores
//                  the result into that part of every rank's recvbuf (RSxLD_AGxST);
//   AlltoAll       each rank stores block j of its sendbuf into its slot of rank j's
//                  recvbuf.
//
// Preconditions (the host checks them, the first barrier re-checks the offsets): the
// buffers peers access (AllGather, AlltoAll: recvbuf; ReduceScatter: sendbuf; AllReduce: both)
// lie in symmetric windows (Communicator.alloc_symmetric) at the same offsets on every
// rank, every rank maps every other rank's windows, and there are at most
// COMMREF_DIRECT_MAX_RANKS ranks.
//
// Each channel (block) takes the same share of every rank's part, so channel c only
// ever touches what channel c of a peer touches, and per-channel barriers order it:
//   handshake      the ring link's call check (a rank running a ring kernel instead
//                  shows up as CommMismatch, not as a timeout)
//   lsaBarrier     every peer has launched: its sendbuf holds this call's input and
//                  its recvbuf may be written
//   ...loads and stores
//   lsaBarrier     every peer is done: nobody reads this rank's sendbuf or writes its
//                  recvbuf any more, and what they stored is visible here
#include "commref/ring.h"

// The library's kernels are commref's own code; COMMREF_KERNEL gives each C linkage, so
// its symbol is its name (the loader looks kernels up by abi.KERNEL_NAMES).
namespace commref {

// Checks the call with the ring neighbours, then meets every peer at the entry barrier.
template <typename T, typename Op>
static __device__ void directEnter(const CollArgs& a, KernelEnv& env) {
  ringHandshake<T, Op>(a, blockIdx.x);
  lsaBarrier(a, blockIdx.x, env, true);
}

// out[0, n) = fold over k of in[k][0, n), k < nin (nin >= 1); divisor != 0 divides
// the result (avg). At most three inputs per pass fold into `out`, over pieces small
// enough to stay in cache between passes (nothing reads `out` soon, so it is folded
// in place rather than off the cache; docs/performance.md, "Streamed stores").
template <typename T, typename Op>
static __device__ void foldInto(const T* const* in, int nin, T* out, uint64_t n, int divisor) {
  const uint64_t piece = nin <= 3 ? (n ? n : 1) : 16384;
  for (uint64_t base = 0; base < n; base += piece) {
    const uint64_t len = minU(piece, n - base);
    T* dst[1] = {out + base};
    for (int k = 0; k < nin;) {  // up to three inputs per pass; later passes fold into out
      const T* src[3];
      int m = 0;
      if (k > 0) src[m++] = out + base;
      while (m < 3 && k < nin) src[m++] = in[k++] + base;
      reduceCopy<T, Op>(src, m, dst, 1, len, k == nin ? divisor : 0, 1, ~0ull);
    }
  }
}

// ReduceScatter: count = elements each rank receives; rank r reduces block r of
// every rank's sendbuf straight into its recvbuf. Inputs in ring order from this rank,
// so that the ranks start on different peers.
template <typename T, typename Op>
static __device__ void directReduceScatter(const CollArgs& a) {
  KernelEnv env = kernelEnv(a);
  const int c = blockIdx.x, n = a.nranks, r = a.rank;
  const Share s = channelShare(a.count, c, a.nchannels);
  directEnter<T, Op>(a, env);
  const T* in[COMMREF_DIRECT_MAX_RANKS];
  for (int k = 0; k < n; k++) in[k] = (const T*)symPeer(a.symSend, (r + k) % n) + (uint64_t)r * a.count + s.begin;
  foldInto<T, Op>(in, n, (T*)a.recvbuf + s.begin, s.end - s.begin, a.avgDivisor);
  lsaBarrier(a, c, env, false);
}

// AllGather (count = bytes per rank): rank r stores its sendbuf into slot r of every
// rank's recvbuf, its own first, reading each piece once (copyToAll). Only recvbufs
// are shared: the sendbuf may be any buffer. In place (sendbuf is slot r of this
// rank's recvbuf) the bytes are already in this rank's slot.
static __device__ void directAllGather(const CollArgs& a) {
  KernelEnv env = kernelEnv(a);
  const int c = blockIdx.x, n = a.nranks, r = a.rank;
  const uint64_t B = a.count;
  const Share s = channelShare(B, c, a.nchannels);
  directEnter<uint8_t, OpSum>(a, env);
  uint8_t* out[COMMREF_DIRECT_MAX_RANKS];
  for (int k = 0; k < n; k++) out[k] = (uint8_t*)symPeer(a.symRecv, (r + k) % n) + (uint64_t)r * B + s.begin;
  copyToAll((const uint8_t*)a.sendbuf + s.begin, out, n, s.end - s.begin, 0, userStreamMin(a.streamStores));
  lsaBarrier(a, c, env, false);
}

// AllReduce: rank r reduces its part of every rank's sendbuf (part j = [count*j/n,
// count*(j+1)/n)) and stores the result into that part of every rank's recvbuf, one
// pass, no barrier in between. In place is safe: only rank r reads or writes part r
// of any buffer, and foldToAll reads every input element before it writes that
// element anywhere.
template <typename T, typename Op>
static __device__ void directAllReduce(const CollArgs& a) {
  KernelEnv env = kernelEnv(a);
  const int c = blockIdx.x, n = a.nranks, r = a.rank;
  directEnter<T, Op>(a, env);
  const uint64_t mine = a.count * r / n;
  const Share s = channelShare(a.count * (r + 1) / n - mine, c, a.nchannels);
  const T* in[COMMREF_DIRECT_MAX_RANKS];
  T* out[COMMREF_DIRECT_MAX_RANKS];
  for (int k = 0; k < n; k++) {
    const int j = (r + k) % n;
    in[k] = (const T*)symPeer(a.symSend, j) + mine + s.begin;
    out[k] = (T*)symPeer(a.symRecv, j) + mine + s.begin;
  }
  foldToAll<T, Op>(in, n, out, n, s.end - s.begin, a.avgDivisor, userStreamMin(a.streamStores));
  lsaBarrier(a, c, env, false);
}

// AlltoAll (count = bytes per block): rank r stores block j of its sendbuf into slot r
// of rank j's recvbuf, starting with its own (j = r + k for k = 0, 1, ...: the ranks
// start on different peers). Only recvbufs are shared. Not in place (no such form:
// catalogue.py): a peer may store into this rank's recvbuf while it still reads its
// sendbuf.
static __device__ void directAlltoAll(const CollArgs& a) {
  KernelEnv env = kernelEnv(a);
  const int c = blockIdx.x, n = a.nranks, r = a.rank;
  const uint64_t B = a.count;
  const Share s = channelShare(B, c, a.nchannels);
  directEnter<uint8_t, OpSum>(a, env);
  for (int k = 0; k < n; k++) {
    const int j = (r + k) % n;
    uint8_t* out[1] = {(uint8_t*)symPeer(a.symRecv, j) + (uint64_t)r * B + s.begin};
    copyToAll((const uint8_t*)a.sendbuf + (uint64_t)j * B + s.begin, out, 1, s.end - s.begin, 0,
              userStreamMin(a.streamStores));
  }
  lsaBarrier(a, c, env, false);
}

// ---- Direct collectives over GIN ----
//
// Where some peers are reached over GIN (GinArgs.peerMask), nothing can be loaded from
// them: every rank pushes. A push moves one channel's share of a block straight from a
// symmetric buffer of this rank into the peer's (a GIN put naming both windows,
// SymBuffer.ginWindow; over LSA, stores into the mapped copy) and adds 1 to the peer's
// arrival word for (channel, this rank), SyncSlot.arrivals: a strong VA signal over
// GIN, a release add over LSA. So each byte crosses once, as in the LSA kernels, with
// no FIFO slot on either side.
//
// Arrival words count what each peer sent on the channel over every call; each call of
// a kind adds the same number per pair (ranks run the same calls: the ring handshake
// checks it first), so a rank waits for base + k, base being its own count before the
// call (its slot sync[c][nranks]). The k-th push from a peer has landed once the count
// reaches base + k: every signal is strong, and a strong signal lands after every put
// its sender posted before it on that (peer, context), so whichever k signals have
// landed, the first k puts have. The host runs these kernels only where the backend has
// strong and VA signals and its engine carries window ids (Communicator._direct_sym).
//
//   enter      every rank sends each peer its call (callDesc, count, offsets, window
//              ids: the SyncSlot fields) and waits for theirs: every peer runs this call
//              and its buffers may be written (arrival 1)
//   AllGather  push this rank's block into every peer's recvbuf          (arrival 2)
//   AlltoAll   push block j of the sendbuf into slot r of rank j's recvbuf (arrival 2)
//   AllReduce  (out of place, count a multiple of nranks) push block j of the sendbuf
//              into slot r of rank j's recvbuf, its staging (arrival 2); fold block r of
//              the sendbuf with the n - 1 staged blocks into recvbuf block r; tell every
//              peer its staging here is free (arrival 3); once a peer's is (its arrival
//              3), push the result into its recvbuf block r (arrival 4)
//   leave      a flush: the puts' sources (the next call rewrites them) were read
struct Pushes {
  const CollArgs& a;
  KernelEnv& env;
  int c;
  uint64_t base;  // what every peer had sent on channel c before this call

  __device__ Gin gin() const { return Gin{a, env, c}; }  // channel c is context c
  __device__ bool lsa(int peer) const { return !overGin(a, peer); }

  // Over GIN one arrival is the strong VA signal that adds 1 to the peer's word for
  // (channel c, this rank); what was posted to the peer is rung after it (doorbells).
  __device__ RemoteAction arrival() const {
    return VaSignal(StrongSignalAdd(syncSlotOffset(a, c, a.rank) + kSyncArrivals, 1));
  }
  __device__ void ring(int peer) const {
    if (a.gin.doorbells) gin().doorbell(peer);
  }

  // Thread 0, a GIN peer: a put of `bytes` (src here, dst at the peer, in `windows`) that
  // lands as one arrival; `bulk`: nothing reads it before (kGinBulk).
  __device__ void putArrival(int peer, uint64_t dst, uint64_t src, uint64_t bytes, uint32_t windows, bool bulk) const {
    RemoteAction r = arrival();
    if (bulk) r.flags |= kGinBulk;
    gin().put(peer, dst, src, bytes, r, -1, windows);
    ring(peer);
  }

  // Thread 0: one arrival at `peer` (after what this rank pushed there before it).
  __device__ void signal(int peer) const {
    if (lsa(peer)) {
      fetch_add_release(&syncSlot(a, peer, c, a.rank)->arrivals, 1);
      return;
    }
    gin().signal(peer, arrival());
    ring(peer);
  }

  // All threads: `bytes` at byte `from` of this rank's `src` to byte `to` of the peer's
  // `dst`, then one arrival there.
  __device__ void push(int peer, const SymBuffer& src, uint64_t from, const SymBuffer& dst, uint64_t to,
                       uint64_t bytes) const {
    if (lsa(peer)) {
      uint8_t* out[1] = {(uint8_t*)symPeer(dst, peer) + to};
      copyToAll((const uint8_t*)symPeer(src, a.rank) + from, out, 1, bytes, 0, userStreamMin(a.streamStores));
      __syncthreads();
      if (threadIdx.x == 0) signal(peer);
      return;
    }
    // Read after the arrival: bulk where the call streams its handoffs (gin.h, kGinBulk).
    if (threadIdx.x == 0)
      putArrival(peer, dst.offset + to, src.offset + from, bytes, ginWindows(src.ginWindow, dst.ginWindow),
                 a.streamStores);
  }

  // Thread 0: until `peer`'s arrivals here reach base + k.
  __device__ void waitFor(int peer, uint64_t k) const {
    if (a.gin.peerMask) gin().kick();
    waitAtLeast(&syncSlot(a, a.rank, c, peer)->arrivals, base + k, env, kWaitRecvReady, peer, c, gin().helpHook());
  }
  // All threads: until `peer`'s arrivals (awaitAll: every peer's) reach base + k.
  __device__ void await(int peer, uint64_t k) const {
    if (threadIdx.x == 0) waitFor(peer, k);
    leaveIfFailed(env.failed);
  }
  __device__ void awaitAll(uint64_t k) const {
    if (threadIdx.x == 0)
      for (int i = 1; i < a.nranks; i++) waitFor((a.rank + a.nranks - i) % a.nranks, k);
    leaveIfFailed(env.failed);
  }
};

// Arrival 1 (see above): checks the call with the ring neighbours, sends every peer this
// rank's call and waits for theirs, comparing them with its own.
template <typename T, typename Op>
static __device__ Pushes pushEnter(const CollArgs& a, KernelEnv& env) {
  const int c = blockIdx.x, n = a.nranks, r = a.rank;
  ringHandshake<T, Op>(a, c);
  Pushes p{a, env, c, load_relaxed(&syncSlot(a, r, c, n)->arrivals)};
  if (threadIdx.x == 0) {
    storeCall(syncSlot(a, r, c, r), a);  // this rank's call, the source of its GIN puts
    const uint64_t from = syncSlotOffset(a, c, r) + kSyncCallFields;
    for (int k = 1; k < n; k++) {
      const int peer = (r + k) % n;
      if (p.lsa(peer)) {
        storeCall(syncSlot(a, peer, c, r), a);
        p.signal(peer);  // release: the fields before the arrival
      } else {
        p.putArrival(peer, from, from, kSyncCallBytes, 0, false);
      }
    }
  }
  p.awaitAll(1);
  if (threadIdx.x == 0)
    for (int k = 1; k < n; k++) checkCall(syncSlot(a, r, c, (r + k) % n), a, env, (r + k) % n, c);
  leaveIfFailed(env.failed);
  return p;
}

// The call's last step: the GIN puts' sources were read (a flush), and this rank's count
// moves past the call's `arrivals` per peer.
static __device__ void pushLeave(const Pushes& p, uint64_t arrivals) {
  if (threadIdx.x == 0) {
    if (p.a.gin.peerMask) p.gin().flush();
    store_relaxed(&syncSlot(p.a, p.a.rank, p.c, p.a.nranks)->arrivals, p.base + arrivals);
  }
  leaveIfFailed(p.env.failed);
}

// AllGather and AlltoAll (count = bytes per block): this rank's own block into its slot
// r of its recvbuf, and block j (AlltoAll: of the sendbuf; AllGather: this rank's one,
// from that slot) into slot r of every peer j's recvbuf.
static __device__ void pushExchange(const CollArgs& a, bool alltoall) {
  KernelEnv env = kernelEnv(a);
  const int n = a.nranks, r = a.rank;
  const uint64_t B = a.count;
  const Share s = channelShare(B, blockIdx.x, a.nchannels);
  const Pushes p = pushEnter<uint8_t, OpSum>(a, env);
  uint8_t* mine[1] = {(uint8_t*)a.recvbuf + r * B + s.begin};  // AllGather's puts read it from there
  copyToAll((const uint8_t*)a.sendbuf + (alltoall ? r * B : 0) + s.begin, mine, 1, s.end - s.begin, 0,
            userStreamMin(a.streamStores));
  __syncthreads();
  for (int k = 1; k < n; k++) {
    const int j = (r + k) % n;
    if (alltoall)
      p.push(j, a.symSend, j * B + s.begin, a.symRecv, r * B + s.begin, s.end - s.begin);
    else
      p.push(j, a.symRecv, r * B + s.begin, a.symRecv, r * B + s.begin, s.end - s.begin);
  }
  p.awaitAll(2);
  pushLeave(p, 2);
}

template <typename T, typename Op>
static __device__ void pushAllReduce(const CollArgs& a) {
  KernelEnv env = kernelEnv(a);
  const int n = a.nranks, r = a.rank;
  const uint64_t B = a.count / n, es = sizeof(T);  // count % n == 0 (the host's condition)
  const Share s = channelShare(B, blockIdx.x, a.nchannels);
  const uint64_t len = s.end - s.begin, at = r * B + s.begin;  // this rank's share of block r
  const Pushes p = pushEnter<T, Op>(a, env);
  for (int k = 1; k < n; k++) {
    const int j = (r + k) % n;
    p.push(j, a.symSend, (j * B + s.begin) * es, a.symRecv, at * es, len * es);
  }
  p.awaitAll(2);
  const T* in[COMMREF_DIRECT_MAX_RANKS];
  in[0] = (const T*)a.sendbuf + at;
  for (int k = 1; k < n; k++) in[k] = (const T*)a.recvbuf + ((r + k) % n) * B + s.begin;
  foldInto<T, Op>(in, n, (T*)a.recvbuf + at, len, a.avgDivisor);
  __syncthreads();
  if (threadIdx.x == 0)
    for (int k = 1; k < n; k++) p.signal((r + k) % n);  // the staging here is free
  for (int k = 1; k < n; k++) {
    const int j = (r + k) % n;
    p.await(j, 3);
    p.push(j, a.symRecv, at * es, a.symRecv, at * es, len * es);
  }
  p.awaitAll(4);
  pushLeave(p, 4);
}

#define DIRECT_ALLREDUCE(T, Op) directAllReduce<T, Op>(args)
#define DIRECT_REDUCE_SCATTER(T, Op) directReduceScatter<T, Op>(args)

#define PUSH_ALLREDUCE(T, Op) pushAllReduce<T, Op>(args)

// Over LSA alone the kernels load and store; with GIN peers they push (above).
COMMREF_KERNEL(commref_direct_allreduce, CollArgs, args) {
  if (args.gin.peerMask) {
    COMMREF_DISPATCH_REDUCTION(args, PUSH_ALLREDUCE)
  } else {
    COMMREF_DISPATCH_REDUCTION(args, DIRECT_ALLREDUCE)
  }
}
COMMREF_KERNEL(commref_direct_reduce_scatter, CollArgs, args) {
  COMMREF_DISPATCH_REDUCTION(args, DIRECT_REDUCE_SCATTER)
}
COMMREF_KERNEL(commref_direct_allgather, CollArgs, args) {
  if (args.gin.peerMask)
    pushExchange(args, false);
  else
    directAllGather(args);
}
COMMREF_KERNEL(commref_direct_alltoall, CollArgs, args) {
  if (args.gin.peerMask)
    pushExchange(args, true);
  else
    directAlltoAll(args);
}

}  // namespace commref
