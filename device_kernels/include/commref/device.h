// commref/device.h — the device API of users' kernels (NCCL's Device API: ncclDevComm,
// ncclGin, the LSA and GIN barriers), over a DevComm (args.h) that commref.DeviceComm
// builds and commref.Kernel.launch passes.
//
//   #include "commref/device.h"
//   using namespace commref;  // or write commref::DeviceComm, commref::WeakSignalInc, ...
//   COMMREF_KERNEL(my_kernel, KernelArgs, args) {
//     DeviceComm comm(args);
//     const float* x = comm.ptr<const float>(0);     // launch argument 0: an array
//     ...
//     comm.put(peer, dstOffset, srcOffset, bytes, WeakSignalInc(0));
//     comm.waitSignal(0, comm.launch() * (comm.nranks() - 1));
//   }
//
// Every name is in namespace commref; COMMREF_KERNEL gives the kernel C linkage, so its
// symbol is its name wherever it is written.
//
// Contract:
//   - Every operation below is block-collective: all threads of the block call it with
//     the same arguments, and it returns in all of them (a __syncthreads inside; a wait
//     returns the same value in all of them). Over
//     LSA the block's threads copy together; over GIN thread 0 posts. Kernels where
//     blocks act independently use per-block signals.
//   - Offsets address the device window: bytes [0, windowBytes) of every rank's window.
//     local<T>(off) is this rank's; lsaPtr<T>(peer, off) a peer's, for LSA peers only
//     (nullptr otherwise). Out-of-range offsets, signal, counter and context ids, fence
//     levels, and a putValue destination that is not a multiple of 8, fail the launch (ValueError,
//     "a device-API call ... was given V where the limit is L").
//   - Contexts (GIN ordering domains): comm.gin(ctx) is a handle bound to context ctx
//     (< the communicator's contexts), with put / countedPut / putValue / signal / get /
//     flush; DeviceComm's own calls of those names are context 0's. Every call reads
//     the peer first: put(peer, dst, src, bytes, action, counter), as Gin's (gin.h).
//   - put / putValue / signal / get reach LSA peers by loads and stores and GIN peers
//     through the proxy, as connections do. The remote action is gin.h's RemoteAction,
//     its signal a user signal id: id i of rank r is GIN signal signalBase + i of r's
//     window, one word whether an LSA peer or the proxy adds to it.
//       strong (StrongSignalInc/StrongSignalAdd): once visible, every earlier put of this
//         rank to that peer on the context is visible (needs DevComm flag
//         kDevCommStrongSignals);
//       weak (WeakSignalInc/WeakSignalAdd): only the put it is attached to is visible;
//       NoSignal(): data only. VaSignal is not offered here (user signals are indexed).
//     Over LSA every signal is strong (the block's stores, then a release add).
//   - get lands after flush() of its context; a counter (local completion: the source
//     may be reused) increments once per put that names it, over LSA at once.
//   - countedPut: a put whose arrival counts one on the target's signal id (a weak
//     increment over GIN; the gda backend's counting signals), so the sender needs no
//     fence and flag: the receiver waits for the count, then reads (the wait acquires).
//     Over GIN only where the ordering study finds counted writes safe on the wire
//     (kDevCommCountedWrites; not where a write may be placed twice).
//   - barrier(fence, ctx): every rank, with a fence level (GinFenceLevel: None, Puts,
//     Gets) over one context or GinAllContexts; barrier() fences puts on every context.
//   - waitSignal, waitCounter, barrier and lsaBarrier wait with the communicator's
//     deadline and abort word, as the collectives do; on failure the whole block leaves
//     the kernel and the host raises CommTimeout / CommAborted naming rank and peer.
//   - On an unordered wire, operations are delivered in batches rung at waits, flushes,
//     barriers and the end of the kernel (doorbells, gin.h): every GIN operation posted
//     before a wait is in flight when the wait starts.
//   - Signals are never reset between launches: launch() (1, 2, ...) gives each launch
//     its targets (a launch expecting k signals waits for launch() * k).
//   - coll() is the communicator's launch record: commref::Prims<T, Op>(comm.coll(), c)
//     with commref::connectRing (flow.h) runs the collectives' own flow primitives on
//     channel c (c < the communicator's max_channels); connectSend / connectRecv give
//     them a connection per peer instead (below).
#pragma once
#include "flow.h"  // Prims, connectRing (over connection.h, gin.h, lsa.h, move.h)
#include "multimem.h"

namespace commref {

struct DeviceComm;

// The fence of a barrier (NCCL's GIN barrier fence level, ncclGinFenceLevel): what a
// barrier(fence, ctx) promises besides that every rank has reached it, on the contexts
// it fences (one, or GinAllContexts: every context of the communicator).
enum class GinFenceLevel : uint32_t {
  // Only that every rank has reached the barrier: a put a peer posted before its
  // barrier may land after this rank leaves it (the unordered wire shows it).
  None = 0,
  // Also: every put a peer posted before its barrier on a fenced context is visible
  // here after it (data and signals). Puts on contexts it does not fence may not be.
  Puts = 1,
  // Also: every get this rank posted before the barrier on a fenced context has landed
  // here (and the sources of its puts there are reusable).
  Gets = 2
};
// The barrier's context set that names every context of the communicator (ncclGinAllContexts).
static constexpr int GinAllContexts = -1;

// A device communicator's GIN handle, bound to context `ctx` when made (comm.gin(ctx)).
// The operations of DeviceComm's contract (block-collective; peer first); DeviceComm's
// own put / countedPut / putValue / signal / get / flush are those of comm.gin(0).
struct DeviceGin {
  DeviceComm& comm;
  int ctx;

  // `bytes` of this rank's window at `src` to the peer's at `dst`, then `r` (a user
  // signal id) at the peer; `counter` (>= 0) counts one once the source is reusable.
  __device__ void put(int peer, uint64_t dst, uint64_t src, uint64_t bytes, RemoteAction r = NoSignal(),
                      int counter = -1) const;
  // A counted write: counts one on the target's signal `id` once its data is there
  // (kDevCommCountedWrites over GIN).
  __device__ void countedPut(int peer, uint64_t dst, uint64_t src, uint64_t bytes, uint32_t id) const;
  // The 8 bytes of `value` to the peer's window at `dst`, a multiple of 8: an unaligned
  // 8-byte store to a peer is a misaligned-address error on a GPU, which ends the CUDA
  // context (every rank of the process), so it fails the launch first, as a range error
  // does, on the CPU engine too.
  __device__ void putValue(int peer, uint64_t dst, uint64_t value, RemoteAction r = NoSignal()) const;
  // `r` alone; over LSA it publishes every store of the block before it.
  __device__ void signal(int peer, RemoteAction r) const;
  // `bytes` of the peer's window at `src` into this rank's at `dst`; over GIN the data
  // is there after flush().
  __device__ void get(int peer, uint64_t dst, uint64_t src, uint64_t bytes) const;
  // Earlier puts' sources are reusable and earlier gets have landed (gin.h: nothing
  // about remote visibility).
  __device__ void flush() const;
};

struct DeviceComm {
  __device__ explicit DeviceComm(const KernelArgs& k);
  // What was posted is delivered even if the kernel waits for nothing more.
  __device__ ~DeviceComm();

  // ---- who ----
  __device__ int rank() const;
  __device__ int nranks() const;
  __device__ int lsaRank() const;
  __device__ int lsaSize() const;
  __device__ int lsaPeer(int i) const;  // the LSA team's i-th rank
  __device__ bool isLsaPeer(int peer) const;
  __device__ uint64_t launch() const;  // 1, 2, ...: this launch's number
  __device__ const CollArgs& coll() const;

  // ---- launch arguments (commref.Kernel.launch packs them in order) ----
  __device__ uint64_t u64(int i);
  __device__ int64_t i64(int i);
  __device__ double f64(int i);
  template <typename T>
  __device__ T* ptr(int i);

  // ---- the device window ----
  template <typename T>
  __device__ T* local(uint64_t off) const;  // this rank's
  template <typename T>
  __device__ T* lsaPtr(int peer, uint64_t off) const;  // an LSA peer's; nullptr for a GIN peer

  // ---- one-sided operations (block-collective; DeviceGin's contract) ----
  __device__ DeviceGin gin(int ctx);  // a handle bound to context ctx
  __device__ void put(int peer, uint64_t dst, uint64_t src, uint64_t bytes, RemoteAction r = NoSignal(),
                      int counter = -1);
  __device__ void countedPut(int peer, uint64_t dst, uint64_t src, uint64_t bytes, uint32_t id);
  __device__ void putValue(int peer, uint64_t dst, uint64_t value, RemoteAction r = NoSignal());
  __device__ void signal(int peer, RemoteAction r);
  __device__ void get(int peer, uint64_t dst, uint64_t src, uint64_t bytes);
  __device__ void flush();

  // ---- signals and counters (this rank's) ----
  __device__ uint64_t readSignal(uint32_t id);
  // Waits until signal `id` reaches `least` (wrap-around compare); `peer` names, in a
  // failure, whom the signal was expected from (-1: any). Every thread of the block gets
  // the value thread 0 saw.
  __device__ uint64_t waitSignal(uint32_t id, uint64_t least, int peer = -1);
  // Only when no peer can still be signalling `id`.
  __device__ void resetSignal(uint32_t id);
  __device__ uint64_t readCounter(uint32_t id);
  __device__ uint64_t waitCounter(uint32_t id, uint64_t least);
  __device__ void resetCounter(uint32_t id);

  // ---- barriers (block-collective; one block of each rank takes part) ----
  // Every rank, with a fence (GinFenceLevel, above) over the contexts `ctx` names: one
  // context (0 <= ctx < the communicator's contexts) or GinAllContexts. Every rank calls
  // it with the same fence and contexts. barrier() is barrier(GinFenceLevel::Puts,
  // GinAllContexts): afterwards every put a peer posted before its barrier, on any
  // context, is visible here. A fence level outside GinFenceLevel, or a context that is
  // neither one of the communicator's nor GinAllContexts, fails the launch (ValueError)
  // before anything is posted. Over LSA every level holds (stores, then a release add).
  // Over GIN each fenced context carries a signal to every GIN peer: strong where the
  // backend offers strong signals; on weak-only backends (gda, which declares that local
  // completion orders later writes) a flush of the context, then a weak signal.
  __device__ void barrier(GinFenceLevel fence = GinFenceLevel::Puts, int ctx = GinAllContexts);
  // The LSA team only, by loads and stores: every store or put to an LSA peer made
  // before a peer's lsaBarrier is visible after it.
  __device__ void lsaBarrier();

  // ---- a connection per peer: the flow primitives between any two ranks ----
  // The link from rank s to rank r, d = (r - s) mod n, is channel (d - 1) / 4's outbound
  // link (d - 1) % 4 at s and inbound FIFO (d - 1) % 4 at r: on a channel every sender
  // arrives on a FIFO of its own and every receiver is reached by a link of its own.
  // n ranks need ceil((n - 1) / 4) channels (the communicator's max_channels). Usage:
  //   Prims<T, Op> tx(comm.coll(), comm.sendChannel(peer)); comm.connectSend(tx, peer);
  //   Prims<T, Op> rx(comm.coll(), comm.recvChannel(peer)); comm.connectRecv(rx, peer);
  // A device communicator's FIFOs serve either these links or the ring and tree
  // (connectRing, its collectives), not both: step counters persist per FIFO.
  __device__ int sendChannel(int peer) const;
  __device__ int recvChannel(int peer) const;
  template <typename T, typename Op>
  __device__ void connectSend(Prims<T, Op>& p, int peer);
  template <typename T, typename Op>
  __device__ void connectRecv(Prims<T, Op>& p, int peer);

  // Fails the launch with kBadArgument unless `ok`; returns ok.
  __device__ bool argumentOk(bool ok, uint64_t limit, uint64_t value);

 private:
  friend struct DeviceGin;
  const KernelArgs& args;
  const DevComm& dc;
  const CollArgs& a;
  KernelEnv env;
  uint64_t pending[COMMREF_DEVCOMM_MAX_CONTEXTS];  // thread 0: GIN peers posted to and not yet rung, per context

  __device__ void sync();
  // `word` (__shared__, written by thread 0 before the call) in every thread.
  __device__ uint64_t shared(const uint64_t& word);
  __device__ Gin ginOn(int ctx);  // the queue handle of context ctx
  __device__ const uint64_t* help();
  __device__ uint64_t* signalWord(int r, uint32_t id) const;
  __device__ uint64_t* counterWord(uint32_t id) const;
  __device__ RemoteAction ginAction(RemoteAction r) const;  // user signal id -> GIN signal index
  __device__ int distance(int from, int to) const;
  __device__ bool linkOk(int peer, int d, int channel);
  __device__ bool signalOk(uint32_t id);
  __device__ bool counterOk(uint32_t id);
  __device__ bool contextOk(int ctx);
  __device__ bool checkPut(int peer, uint64_t dst, uint64_t src, uint64_t bytes, RemoteAction r, int counter, int ctx);
  __device__ void ringDoorbells();
  __device__ bool fenceOk(GinFenceLevel fence, int ctx);
  __device__ uint64_t* barrierWord(int r, int set, int from) const;
  __device__ uint64_t* epochWord(int set) const;
  __device__ void barrierOver(bool lsaOnly, GinFenceLevel fence, int ctx);
};

}  // namespace commref

#include "impl/device__funcs.h"
