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
//   - Every operation below is block-collective unless given a cooperative scope first
//     (the section above DeviceGin; coop.h): all threads of the block call it with
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
//       NoSignal(): data only. VaSignal(action) names, instead of a signal id, the 64-bit
//       word at that device-window offset of the peer (VA signals, below).
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
//     railBarrier(fence, ctx): the rail team's members alone; hybridBarrier(fence, ctx):
//     the LSA team's barrier x the rail barrier (their declarations say what each makes
//     visible). Each takes a scope first as well.
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
#include "flow.h"      // Prims, connectRing (over connection.h, gin.h, lsa.h, move.h)
#include "coop.h"      // CoopThread, CoopWarp, CoopTile<N>, CoopCta
#include "multimem.h"  // Multimem: one address for the LSA team's copies
#include "team.h"      // Team and its conversions

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
  // here after it (data and signals), and none of them lands over a put the peer posts
  // after its barrier, on any context. Puts on contexts it does not fence may not be.
  Puts = 1,
  // Also: every get this rank posted before the barrier on a fenced context has landed
  // here (and the sources of its puts there are reusable).
  Gets = 2
};
// The barrier's context set that names every context of the communicator (ncclGinAllContexts).
static constexpr int GinAllContexts = -1;

// ==== teams, symmetric pointers, cooperative scopes, requests, rolling compares, VA signals ====
//
// Teams (team.h): comm.worldTeam(), lsaTeam(), railTeam() are Team values; comm's
//   teamRankToWorld / teamRankToTeam / innerFactor / outerFactor are team.h's functions
//   with their arguments checked: a team rank outside its team, a team that is not
//   strided here (lsaTeam / railTeam where nodes do not each hold lsaSize consecutive
//   ranks) and a factor that does not divide its parent fail the launch (ValueError).
//
// SymPtr<T> (NCCL's ncclSymPtr): a typed pointer into the device window, a byte offset
//   that is the same on every rank. ptr + n, ptr - n, ptr += n move it by n elements;
//   ptr - other is the distance in elements. Arithmetic is unchecked; the views are:
//   localPtr() this rank's T*, lsaPtr(i) LSA-team rank i's, peerPtr(peer) world rank
//   peer's (nullptr for a GIN peer, which no load or store reaches), peerPtr(team, i)
//   team rank i's. A view of an element that is not whole inside the window (offset +
//   sizeof(T) past windowBytes, or offset not a multiple of alignof(T)) returns nullptr
//   and fails the launch (ValueError naming the window's bytes and the offset): the
//   caller must not dereference it, and the block leaves at its next device-API call.
//   comm.put(peer, dst, src, count, action, counter) with SymPtrs moves count elements.
//
// Cooperative scopes (coop.h): put, putValue, countedPut, get, signal, flush,
//   flushAsync, wait, waitSignal, waitCounter, waitVaSignal and the four barriers take a scope as their first argument
//   (CoopThread, CoopWarp, CoopTile<N>, CoopCta); without one they are block-collective
//   (CoopCta), as every other call. Every thread of the scope calls with the same
//   arguments; over LSA the scope's threads copy together, over GIN its leader posts; a
//   wait returns the leader's value to every thread of the scope. Scopes of one block
//   may act at the same time (each its own signals and data). A scope's GIN posts are
//   rung on an unordered wire at its own waits and flushes, at every block-wide wait,
//   flush and barrier, and at the end of the kernel. A failure inside a scope other than
//   CoopCta marks every thread of the scope failed: they post and copy nothing more,
//   their waits return at once, the launch fails (the host raises as for any failure)
//   and the block leaves at its next block-wide call; other scopes stop at their next
//   wait. Scopes narrower than the block do not exit the kernel on their own.
//
// Requests: gin.flushAsync(scope) posts a flush and returns at once with a GinRequest;
//   gin.wait(scope, request) waits (the communicator's deadline) until that flush is
//   complete: the sources of every put posted before it are reusable and every get
//   posted before it has landed. A request is waited on the handle of its context.
//   Over LSA a request is complete when made.
//
// Rolling compares: waitSignal / waitCounter / waitVaSignal(…, least, …, bits) are done
//   once (value - least) mod 2^bits < 2^(bits - 1) (signalReached), bits in 1 .. 64
//   (default 64: the signed difference of the 64-bit words); readSignal(id, bits) and
//   readCounter(id, bits) return the low `bits` bits. A width outside 1 .. 64 fails the
//   launch (ValueError). Counters have what signals have: read, wait (any scope, any
//   width), reset.
//
// VA signals: VaSignal(StrongSignalInc(off)) (or any action) adds to the 64-bit word at
//   device-window offset `off` of the peer, with the action's strong or weak promise, on
//   a device communicator created with strict_ordering=True (NCCL's
//   NCCL_WIN_STRICT_ORDERING; its backend must offer VA signals, so gda is skipped).
//   Elsewhere a VA signal fails the launch (ValueError: strict ordering). `off` must be
//   a multiple of 8 with off + 8 <= windowBytes. readVaSignal, waitVaSignal and
//   resetVaSignal read, wait on (rolling compare) and zero this rank's word, with the
//   same refusals.
struct GinRequest {
  uint64_t slot;  // the queue's completed-operations count that completes it; 0: complete
  int32_t ctx;    // the context it was posted on
};
// Whether `value` has reached `least` compared at `bits` bits with wrap-around: (value -
// least) mod 2^bits < 2^(bits - 1); bits in 1 .. 64.
__device__ bool signalReached(uint64_t value, uint64_t least, int bits = 64);

template <typename T>
struct SymPtr {
  DeviceComm* comm;
  uint64_t offset;  // bytes from the device window's start

  __device__ SymPtr operator+(int64_t n) const { return SymPtr{comm, offset + (uint64_t)(n * (int64_t)sizeof(T))}; }
  __device__ SymPtr operator-(int64_t n) const { return SymPtr{comm, offset - (uint64_t)(n * (int64_t)sizeof(T))}; }
  __device__ SymPtr& operator+=(int64_t n) { return *this = *this + n; }
  __device__ SymPtr& operator-=(int64_t n) { return *this = *this - n; }
  __device__ int64_t operator-(SymPtr o) const { return ((int64_t)offset - (int64_t)o.offset) / (int64_t)sizeof(T); }
  __device__ T* localPtr() const;
  __device__ T* lsaPtr(int lsaRank) const;
  __device__ T* peerPtr(int peer) const;
  __device__ T* peerPtr(Team team, int teamRank) const;
};

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

  // ---- scopes, requests, symmetric pointers (the section above DeviceGin) ----
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void put(Coop c, int peer, uint64_t dst, uint64_t src, uint64_t bytes, RemoteAction r = NoSignal(),
                      int counter = -1) const;
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void signal(Coop c, int peer, RemoteAction r) const;
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void putValue(Coop c, int peer, uint64_t dst, uint64_t value, RemoteAction r = NoSignal()) const;
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void countedPut(Coop c, int peer, uint64_t dst, uint64_t src, uint64_t bytes, uint32_t id) const;
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void get(Coop c, int peer, uint64_t dst, uint64_t src, uint64_t bytes) const;
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void flush(Coop c) const;
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ GinRequest flushAsync(Coop c) const;
  __device__ GinRequest flushAsync() const;  // block-collective
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void wait(Coop c, GinRequest request) const;
  __device__ void wait(GinRequest request) const;  // block-collective
  // `count` elements from this rank's `src` to the peer's `dst`.
  template <typename T>
  __device__ void put(int peer, SymPtr<T> dst, SymPtr<T> src, uint64_t count, RemoteAction r = NoSignal(),
                      int counter = -1) const;
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
  // Stores 0 into signal `id`: meant for when no peer can still be signalling it. Raced
  // by a peer's increments (the word is one 64-bit word, every increment an atomic add,
  // the reset a store), each increment lands whole either before the reset, and is
  // erased, or after it, and is counted: afterwards the signal holds the increments that
  // landed after the reset, from 0 up to those still in flight, never a torn value; which
  // ones is not defined, so targets derived from launch() no longer hold. A readSignal or
  // wait racing increments (no reset) sees a count some of them made: never more than
  // were sent, never less than an earlier read.
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
  // The rail team (railTeam(): the ranks of this rank's local index on every node) with
  // a fence over the contexts `ctx` names, as barrier(fence, ctx) but among the rail's
  // members only: every member calls it with the same fence and contexts; afterwards, at
  // GinFenceLevel::Puts, every put a member posted before its rail barrier to this rank
  // on a fenced context is visible here (Gets: this rank's gets there have landed).
  // Ranks outside the rail neither take part nor are covered. Only where every node holds
  // lsaSize consecutive ranks (strided teams): elsewhere it fails the launch (ValueError,
  // "the team is not a strided team here") before anything is posted.
  __device__ void railBarrier(GinFenceLevel fence = GinFenceLevel::Puts, int ctx = GinAllContexts);
  // The hybrid barrier (NCCL's ncclBarrierSession over the world): the LSA team's
  // barrier, then the rail barrier(fence, ctx), then (fence not None) the LSA team's
  // again. Every rank calls it with the same fence and contexts; it returns once every
  // rank has reached it. Afterwards every store or put to an LSA peer made before a
  // peer's hybrid barrier is visible here; at Puts, every GIN put a member of this
  // rank's rail posted to it before its barrier on a fenced context too (the puts of the
  // rail phase's fence). A GIN put to a rank outside the poster's rail is not covered:
  // a strong signal fences one peer's puts, and the rail phase signals rail members
  // only (barrier() signals every GIN peer). Strided teams only, as railBarrier.
  __device__ void hybridBarrier(GinFenceLevel fence = GinFenceLevel::Puts, int ctx = GinAllContexts);
  // The barriers in a scope (coop.h): the scope's threads call it (one scope of each
  // rank takes part); its leader signals and waits; the stores of the scope's threads
  // before it are published as the block's are by the block-wide barrier.
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void barrier(Coop c, GinFenceLevel fence = GinFenceLevel::Puts, int ctx = GinAllContexts);
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void lsaBarrier(Coop c);
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void railBarrier(Coop c, GinFenceLevel fence = GinFenceLevel::Puts, int ctx = GinAllContexts);
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void hybridBarrier(Coop c, GinFenceLevel fence = GinFenceLevel::Puts, int ctx = GinAllContexts);

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

  // ---- teams (the section above DeviceGin; team.h) ----
  __device__ Team worldTeam() const;
  __device__ Team lsaTeam();
  __device__ Team railTeam();
  __device__ int teamRankToWorld(Team t, int i);
  __device__ int teamRankToTeam(Team a, Team b, int i);  // -1: not a member of a
  __device__ Team innerFactor(Team parent, int inner);
  __device__ Team outerFactor(Team parent, int inner);

  // ---- symmetric pointers ----
  template <typename T>
  __device__ SymPtr<T> symPtr(uint64_t off);  // the element at byte `off` of the window

  // ---- scopes (coop.h) on context 0, rolling compares, counters as signals ----
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void put(Coop c, int peer, uint64_t dst, uint64_t src, uint64_t bytes, RemoteAction r = NoSignal(),
                      int counter = -1);
  template <typename T>
  __device__ void put(int peer, SymPtr<T> dst, SymPtr<T> src, uint64_t count, RemoteAction r = NoSignal(),
                      int counter = -1);
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void signal(Coop c, int peer, RemoteAction r);
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void putValue(Coop c, int peer, uint64_t dst, uint64_t value, RemoteAction r = NoSignal());
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void countedPut(Coop c, int peer, uint64_t dst, uint64_t src, uint64_t bytes, uint32_t id);
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void get(Coop c, int peer, uint64_t dst, uint64_t src, uint64_t bytes);
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ void flush(Coop c);
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ uint64_t waitSignal(Coop c, uint32_t id, uint64_t least, int peer = -1, int bits = 64);
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ uint64_t waitCounter(Coop c, uint32_t id, uint64_t least, int bits = 64);
  __device__ uint64_t readSignal(uint32_t id, int bits);
  __device__ uint64_t readCounter(uint32_t id, int bits);

  // ---- VA signals (strict ordering only) ----
  __device__ uint64_t readVaSignal(uint64_t off, int bits = 64);
  template <typename Coop, typename Coop::CoopTag* = nullptr>
  __device__ uint64_t waitVaSignal(Coop c, uint64_t off, uint64_t least, int peer = -1, int bits = 64);
  __device__ uint64_t waitVaSignal(uint64_t off, uint64_t least, int peer = -1, int bits = 64);  // block-collective
  __device__ void resetVaSignal(uint64_t off);  // block-collective; only when no peer can still be signalling it

  // Fails the launch with kBadArgument unless `ok`; returns ok.
  __device__ bool argumentOk(bool ok, uint64_t limit, uint64_t value);

 private:
  friend struct DeviceGin;
  template <typename T>
  friend struct SymPtr;
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
  enum BarrierTeam { kBarrierWorld = 0, kBarrierLsa = 1, kBarrierRail = 2 };
  __device__ int barrierSets() const;
  __device__ int barrierSet(int team, bool fenced, int c) const;
  __device__ bool barrierMember(int team, int peer) const;
  __device__ bool railOk();  // strided teams, else the launch fails
  template <typename Coop>
  __device__ void teamBarrier(const Coop& c, int team, GinFenceLevel fence, int ctx);
  template <typename Coop>
  __device__ void hybridOver(const Coop& c, GinFenceLevel fence, int ctx);
  // The section above DeviceGin.
  __device__ bool refuse(bool ok, int32_t reason, uint64_t limit, uint64_t value);  // argumentOk with a reason
  __device__ bool bitsOk(int bits);
  __device__ bool vaOk(uint64_t off);
  __device__ uint64_t* actionWord(int peer, RemoteAction r) const;  // the word r adds to over LSA
  __device__ void ringBlock();  // every thread rings what it posted, before a block-wide wait
  template <typename Coop>
  __device__ void settle(const Coop& c);  // the scope's threads learn whether any failed
  template <typename Coop>
  __device__ uint64_t waitWord(const Coop& c, const uint64_t* word, uint64_t least, int bits, uint32_t what, int peer);
};

}  // namespace commref

#include "impl/device__funcs.h"
#include "impl/device_ext__funcs.h"
#include "impl/barrier__funcs.h"
