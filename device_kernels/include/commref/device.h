// commref/device.h — the device API of users' kernels (NCCL's Device API: ncclDevComm,
// ncclGin, the LSA and GIN barriers), over a DevComm (args.h) that commref.DeviceComm
// builds and commref.Kernel.launch passes.
//
//   #include "commref/device.h"
//   COMMREF_KERNEL(my_kernel, KernelArgs, args) {
//     DeviceComm comm(args);
//     const float* x = comm.ptr<const float>(0);     // launch argument 0: an array
//     ...
//     comm.put(peer, dstOffset, srcOffset, bytes, weakInc(0));
//     comm.waitSignal(0, comm.launch() * (comm.nranks() - 1));
//   }
//
// Contract:
//   - Every operation below is block-collective: all threads of the block call it with
//     the same arguments, and it returns in all of them (a __syncthreads inside). Over
//     LSA the block's threads copy together; over GIN thread 0 posts. Kernels where
//     blocks act independently use per-block signals.
//   - Offsets address the device window: bytes [0, windowBytes) of every rank's window.
//     local<T>(off) is this rank's; lsaPtr<T>(peer, off) a peer's, for LSA peers only
//     (nullptr otherwise). Out-of-range offsets, signal, counter and context ids fail
//     the launch (CommMismatch, "a device-API argument within its limit").
//   - put / putValue / signal / get reach LSA peers by loads and stores and GIN peers
//     through the proxy, as connections do. A signal is the same word either way:
//     signal id i of rank r is GIN signal signalBase + i of r's window.
//       strong (strongInc/strongAdd): once visible, every earlier put of this rank to
//         that peer on the context is visible (needs DevComm flag kDevCommStrongSignals);
//       weak (weakInc/weakAdd): only the put it is attached to is visible.
//     Over LSA every signal is strong (the block's stores, then a release add).
//   - get lands after flush(ctx); a counter (local completion: the source may be
//     reused) increments once per put that names it, over LSA at once.
//   - countedPut: a put whose arrival counts one on the target's signal id (a weak
//     increment over GIN; the gda backend's counting signals), so the sender needs no
//     fence and flag: the receiver waits for the count, then reads (the wait acquires).
//     Over GIN only where the ordering study finds counted writes safe on the wire
//     (kDevCommCountedWrites; not where a write may be placed twice).
//   - waitSignal, waitCounter, barrier and lsaBarrier wait with the communicator's
//     deadline and abort word, as the collectives do; on failure the whole block leaves
//     the kernel and the host raises CommTimeout / CommAborted naming rank and peer.
//   - On an unordered wire, operations are delivered in batches rung at waits, flushes,
//     barriers and the end of the kernel (doorbells, gin.h): every GIN operation posted
//     before a wait is in flight when the wait starts.
//   - Signals are never reset between launches: launch() (1, 2, ...) gives each launch
//     its targets (a launch expecting k signals waits for launch() * k).
//   - coll() is the communicator's launch record: Prims<T, Op>(comm.coll(), c) with
//     connectRing (ring.h) runs the collectives' own flow primitives on channel c
//     (c < the communicator's max_channels); connectSend / connectRecv give them a
//     connection per peer instead (below).
#pragma once
#include "ring.h"

// A remote action on a user signal id (not a raw GIN index).
struct Signal {
  uint32_t flags;  // GinFlags: kGinHasSignal, kGinStrongSignal, kGinSignalAdd
  uint32_t id;
  uint64_t value;
};
static __device__ __forceinline__ Signal noSignal() { return Signal{0, 0, 0}; }
static __device__ __forceinline__ Signal strongInc(uint32_t id) { return Signal{kGinHasSignal | kGinStrongSignal, id, 1}; }
static __device__ __forceinline__ Signal strongAdd(uint32_t id, uint64_t v) {
  return Signal{kGinHasSignal | kGinStrongSignal | kGinSignalAdd, id, v};
}
static __device__ __forceinline__ Signal weakInc(uint32_t id) { return Signal{kGinHasSignal, id, 1}; }
static __device__ __forceinline__ Signal weakAdd(uint32_t id, uint64_t v) { return Signal{kGinHasSignal | kGinSignalAdd, id, v}; }

struct DeviceComm {
  const KernelArgs& args;
  const DevComm& dc;
  const CollArgs& a;
  KernelEnv env;
  Gin gin;
  uint64_t pending[COMMREF_DEVCOMM_MAX_CONTEXTS];  // thread 0: GIN peers posted to and not yet rung, per context

  __device__ explicit DeviceComm(const KernelArgs& k)
      : args(k), dc(k.comm), a(k.comm.coll), env(kernelEnv(k.comm.coll)), gin{k.comm.coll, env} {
    for (int c = 0; c < COMMREF_DEVCOMM_MAX_CONTEXTS; c++) pending[c] = 0;
  }
  // What was posted is delivered even if the kernel waits for nothing more.
  __device__ ~DeviceComm() {
    if (threadIdx.x == 0) ringDoorbells();
  }

  // ---- who ----
  __device__ int rank() const { return a.rank; }
  __device__ int nranks() const { return a.nranks; }
  __device__ int lsaRank() const { return dc.lsaRank; }
  __device__ int lsaSize() const { return dc.lsaSize; }
  __device__ int lsaPeer(int i) const { return ((const int32_t*)dc.lsaRanks)[i]; }  // the LSA team's i-th rank
  __device__ bool isLsaPeer(int peer) const { return !((a.gin.peerMask >> peer) & 1); }
  __device__ uint64_t launch() const { return dc.launch; }
  __device__ const CollArgs& coll() const { return a; }

  // ---- launch arguments (commref.Kernel.launch packs them in order) ----
  __device__ uint64_t u64(int i) {
    if (!argumentOk(i < (int)args.nargs && i >= 0, args.nargs, (uint64_t)i)) return 0;
    return args.arg[i];
  }
  __device__ int64_t i64(int i) { return (int64_t)u64(i); }
  __device__ double f64(int i) {
    const uint64_t bits = u64(i);
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
  }
  template <typename T>
  __device__ T* ptr(int i) { return (T*)u64(i); }

  // ---- the device window ----
  template <typename T>
  __device__ T* local(uint64_t off) const { return (T*)(windowOf(a, a.rank) + dc.windowOff + off); }
  template <typename T>
  __device__ T* lsaPtr(int peer, uint64_t off) const {
    return isLsaPeer(peer) ? (T*)(windowOf(a, peer) + dc.windowOff + off) : nullptr;
  }

  // ---- one-sided operations (block-collective) ----
  __device__ void put(int peer, uint64_t dst, uint64_t src, uint64_t bytes, Signal s = noSignal(), int counter = -1,
                      int ctx = 0) {
    if (checkPut(peer, dst, src, bytes, s, counter, ctx)) {
      if (isLsaPeer(peer)) {
        copyOwnShare<uint8_t>(lsaPtr<uint8_t>(peer, dst), local<uint8_t>(src), bytes);
        __syncthreads();
        if (threadIdx.x == 0) {
          if (s.flags) fetch_add_release(signalWord(peer, s.id), s.value);
          if (counter >= 0) fetch_add_release(counterWord(counter), 1);
        }
      } else if (threadIdx.x == 0) {
        gin.put(ctx, peer, dc.windowOff + dst, dc.windowOff + src, bytes, ginAction(s), counter);
        pending[ctx] |= 1ull << peer;
      }
    }
    sync();
  }
  // A counted write: the put counts one on the target's signal `id` once its data is there.
  __device__ void countedPut(int peer, uint64_t dst, uint64_t src, uint64_t bytes, uint32_t id, int ctx = 0) {
    if (threadIdx.x == 0 && !isLsaPeer(peer))
      argumentOk(dc.flags & kDevCommCountedWrites, kDevCommCountedWrites, dc.flags);
    put(peer, dst, src, bytes, weakInc(id), -1, ctx);
  }
  __device__ void putValue(int peer, uint64_t dst, uint64_t value, Signal s = noSignal(), int ctx = 0) {
    if (threadIdx.x == 0 && checkPut(peer, dst, 0, 8, s, -1, ctx)) {
      if (isLsaPeer(peer)) {
        store_relaxed(lsaPtr<uint64_t>(peer, dst), value);
        if (s.flags) fetch_add_release(signalWord(peer, s.id), s.value);
      } else {
        gin.putValue(ctx, peer, dc.windowOff + dst, value, ginAction(s));
        pending[ctx] |= 1ull << peer;
      }
    }
    sync();
  }
  // A signal alone; over LSA it publishes every store of the block before it.
  __device__ void signal(int peer, Signal s, int ctx = 0) {
    __syncthreads();
    if (threadIdx.x == 0 && checkPut(peer, 0, 0, 0, s, -1, ctx)) {
      if (isLsaPeer(peer)) fetch_add_release(signalWord(peer, s.id), s.value);
      else {
        gin.signal(ctx, peer, ginAction(s));
        pending[ctx] |= 1ull << peer;
      }
    }
    sync();
  }
  // Copies `bytes` of the peer's window at src into this rank's at dst; over GIN the
  // data is there after flush(ctx).
  __device__ void get(int peer, uint64_t dst, uint64_t src, uint64_t bytes, int ctx = 0) {
    if (checkPut(peer, src, dst, bytes, noSignal(), -1, ctx)) {
      if (isLsaPeer(peer)) copyOwnShare<uint8_t>(local<uint8_t>(dst), lsaPtr<const uint8_t>(peer, src), bytes);
      else if (threadIdx.x == 0) {
        gin.get(ctx, peer, dc.windowOff + dst, dc.windowOff + src, bytes);
        pending[ctx] |= 1ull << peer;
      }
    }
    sync();
  }
  // Earlier puts' sources are reusable and earlier gets have landed (gin.h: nothing
  // about remote visibility).
  __device__ void flush(int ctx = 0) {
    if (threadIdx.x == 0 && contextOk(ctx) && a.gin.capacity) {
      ringDoorbells();
      gin.flush(ctx);
    }
    sync();
  }

  // ---- signals and counters ----
  __device__ uint64_t readSignal(uint32_t id) { return signalOk(id) ? load_acquire(signalWord(a.rank, id)) : 0; }
  // Waits until this rank's signal `id` reaches `least` (wrap-around compare); `peer`
  // names, in a failure, whom the signal was expected from (-1: any).
  __device__ uint64_t waitSignal(uint32_t id, uint64_t least, int peer = -1) {
    __shared__ uint64_t seen;
    if (threadIdx.x == 0 && signalOk(id)) {
      ringDoorbells();
      if (a.gin.capacity) gin.wakeEngine();
      seen = waitReached(signalWord(a.rank, id), least, env, kWaitSignal, peer, blockIdx.x, help());
    }
    sync();
    return seen;
  }
  // Only when no peer can still be signalling `id`.
  __device__ void resetSignal(uint32_t id) {
    if (threadIdx.x == 0 && signalOk(id)) store_relaxed(signalWord(a.rank, id), 0);
    sync();
  }
  __device__ uint64_t readCounter(uint32_t id) { return counterOk(id) ? load_acquire(counterWord(id)) : 0; }
  __device__ uint64_t waitCounter(uint32_t id, uint64_t least) {
    __shared__ uint64_t seen;
    if (threadIdx.x == 0 && counterOk(id)) {
      ringDoorbells();
      if (a.gin.capacity) gin.wakeEngine();
      seen = waitReached(counterWord(id), least, env, kWaitCounter, -1, blockIdx.x, help());
    }
    sync();
    return seen;
  }
  __device__ void resetCounter(uint32_t id) {
    if (threadIdx.x == 0 && counterOk(id)) store_relaxed(counterWord(id), 0);
    sync();
  }

  // ---- barriers (block-collective; one block of each rank takes part) ----
  // Every rank: afterwards every put a peer made before its barrier is visible here
  // (over GIN a strong signal, or, on weak-only backends, a flush then a weak signal:
  // gda declares that local completion orders later writes).
  __device__ void barrier() { barrierOver(false); }
  // The LSA team only, by loads and stores.
  __device__ void lsaBarrier() { barrierOver(true); }

  // ---- a connection per peer: the flow primitives between any two ranks ----
  // The link from rank s to rank r, d = (r - s) mod n, is channel (d - 1) / 4's outbound
  // link (d - 1) % 4 at s and inbound FIFO (d - 1) % 4 at r: on a channel every sender
  // arrives on a FIFO of its own and every receiver is reached by a link of its own.
  // n ranks need ceil((n - 1) / 4) channels (the communicator's max_channels). Usage:
  //   Prims<T, Op> tx(comm.coll(), comm.sendChannel(peer)); comm.connectSend(tx, peer);
  //   Prims<T, Op> rx(comm.coll(), comm.recvChannel(peer)); comm.connectRecv(rx, peer);
  // A device communicator's FIFOs serve either these links or the ring and tree
  // (connectRing, its collectives), not both: step counters persist per FIFO.
  __device__ int sendChannel(int peer) const { return (distance(a.rank, peer) - 1) / 4; }
  __device__ int recvChannel(int peer) const { return (distance(peer, a.rank) - 1) / 4; }
  template <typename T, typename Op>
  __device__ void connectSend(Prims<T, Op>& p, int peer) {
    const int d = distance(a.rank, peer);
    if (linkOk(peer, d, p.channel())) p.addSend((d - 1) % 4, peer, (d - 1) % 4);
    sync();
  }
  template <typename T, typename Op>
  __device__ void connectRecv(Prims<T, Op>& p, int peer) {
    const int d = distance(peer, a.rank);
    if (linkOk(peer, d, p.channel())) p.addRecv((d - 1) % 4, peer, (d - 1) % 4);
    sync();
  }

  // Fails the launch with kBadArgument unless `ok`; returns ok.
  __device__ bool argumentOk(bool ok, uint64_t limit, uint64_t value) {
    if (!ok) commref_fail(env, kMismatch, kBadArgument, -1, blockIdx.x, limit, value);
    return ok;
  }

 private:
  __device__ void sync() { leaveIfFailed(env.failed); }
  __device__ const uint64_t* help() const { return a.gin.capacity ? gin.helpHook() : nullptr; }
  __device__ uint64_t* signalWord(int r, uint32_t id) const {
    return (uint64_t*)(windowOf(a, r) + a.layout.ginSignalsOff) + dc.signalBase + id;
  }
  __device__ uint64_t* counterWord(uint32_t id) const { return (uint64_t*)dc.counters + id; }
  __device__ GinRemoteAction ginAction(Signal s) const {
    return GinRemoteAction{s.flags, s.flags ? dc.signalBase + s.id : 0, s.value};
  }
  __device__ int distance(int from, int to) const { return ((to - from) % a.nranks + a.nranks) % a.nranks; }
  __device__ bool linkOk(int peer, int d, int channel) {
    const int want = (d - 1) / 4;
    return argumentOk(peer >= 0 && peer < a.nranks && d != 0, a.nranks, (uint64_t)peer) &&
           argumentOk(want < a.nchannels, a.nchannels, (uint64_t)want) &&
           argumentOk(channel == want, want, (uint64_t)channel);
  }
  __device__ bool signalOk(uint32_t id) { return argumentOk(id < dc.nsignals, dc.nsignals, id); }
  __device__ bool counterOk(uint32_t id) { return argumentOk(id < dc.ncounters, dc.ncounters, id); }
  __device__ bool contextOk(int ctx) {
    return argumentOk(ctx >= 0 && ctx < (int)dc.ncontexts && ctx < COMMREF_DEVCOMM_MAX_CONTEXTS, dc.ncontexts,
                      (uint64_t)ctx);
  }
  __device__ bool checkPut(int peer, uint64_t dst, uint64_t src, uint64_t bytes, Signal s, int counter, int ctx) {
    const uint64_t w = dc.windowBytes;
    return argumentOk(peer >= 0 && peer < a.nranks, a.nranks, (uint64_t)peer) &&
           argumentOk(dst <= w && bytes <= w - dst, w, dst + bytes) &&
           argumentOk(src <= w && bytes <= w - src, w, src + bytes) && (!s.flags || signalOk(s.id)) &&
           (counter < 0 || counterOk(counter)) && contextOk(ctx) &&
           argumentOk(!(s.flags & kGinStrongSignal) || isLsaPeer(peer) || (dc.flags & kDevCommStrongSignals),
                      kDevCommStrongSignals, dc.flags);
  }
  __device__ void ringDoorbells() {
    if (!a.gin.doorbells) return;
    for (int c = 0; c < COMMREF_DEVCOMM_MAX_CONTEXTS; c++) {
      for (int peer = 0; peer < a.nranks && pending[c]; peer++)
        if ((pending[c] >> peer) & 1) gin.doorbell(c, peer);
      pending[c] = 0;
    }
  }
  // Barrier words (args.h): after the user's signals, a word per peer of the world
  // barrier, then of the LSA barrier, then each barrier's epoch (this rank's count).
  __device__ uint64_t* barrierWord(int r, bool lsa, int from) const {
    return signalWord(r, dc.nsignals + (lsa ? a.nranks : 0) + from);
  }
  __device__ void barrierOver(bool lsaOnly) {
    __syncthreads();
    if (threadIdx.x == 0) {
      uint64_t* epochWord = signalWord(a.rank, dc.nsignals + 2 * a.nranks + (lsaOnly ? 1 : 0));
      const uint64_t epoch = load_relaxed(epochWord) + 1;
      store_relaxed(epochWord, epoch);
      const bool strong = dc.flags & kDevCommStrongSignals;
      if (!lsaOnly && !strong && a.gin.peerMask) {  // weak only: this rank's puts complete before its signals
        ringDoorbells();
        gin.flush(0);
      }
      for (int k = 1; k < a.nranks; k++) {
        const int peer = (a.rank + k) % a.nranks;
        if (isLsaPeer(peer)) fetch_add_release(barrierWord(peer, lsaOnly, a.rank), 1);
        else if (!lsaOnly) {
          const uint64_t id = dc.signalBase + dc.nsignals + a.rank;
          gin.signal(0, peer, strong ? StrongSignalInc(id) : WeakSignalInc(id));
          pending[0] |= 1ull << peer;
        }
      }
      ringDoorbells();
      for (int k = 1; k < a.nranks && !env.failed; k++) {
        const int peer = (a.rank + a.nranks - k) % a.nranks;
        if (lsaOnly && !isLsaPeer(peer)) continue;
        if (a.gin.capacity) gin.wakeEngine();
        waitReached(barrierWord(a.rank, lsaOnly, peer), epoch, env, kWaitBarrier, peer, blockIdx.x, help());
      }
    }
    sync();
  }
};
