// commref/gin.h — the device side of GIN: kernels post operations, a CPU proxy thread
// (transports/gin/proxy.py) carries them over a wire.
//
// Contract (NCCL's GIN semantics, 2.30+; see also transports/gin/semantics.py):
//   - a context is an ordering domain; every (context, peer) pair is independent;
//   - put(peer, dst, src, bytes, remote action, local action) copies bytes from this
//     rank's window at src to the peer's window at dst;
//   - remote action: a signal, strong (once visible at the peer, this put and every
//     earlier put from this rank to that peer on the same context are visible) or weak
//     (only its own put is); inc or add; indexed (a signal slot of the peer) or VA (a
//     64-bit word at a window offset of the peer);
//   - local action: a counter of this rank increments once the source is reusable;
//   - putValue: a put of up to 8 bytes given by value; signal: a put of no data;
//   - get(peer, dst, src, bytes): lands in this rank's window; complete only after flush;
//   - flush(ctx): earlier puts' sources are reusable and earlier gets have landed. It
//     promises nothing about remote visibility, unless the backend declares that local
//     completion orders later writes;
//   - waitSignal(id, least) compares with wrap-around; resetSignal must not race with
//     incoming signals (only reset a signal no peer is still signalling).
//
// The queue: a ring of `capacity` descriptors in memory the proxy reads. A producer
// claims a slot with an atomic increment, waits (bounded) until the proxy has consumed
// the slot's previous occupant (backpressure: a full queue slows producers; the proxy
// never waits for a producer that has not claimed), writes the fields, then publishes
// the slot by storing seq = slot + 1 with release. The proxy consumes in slot order and
// stores consumed = slot + 1 once the operation is locally complete.
#pragma once
#include "wait.h"

namespace commref {

// The queue region (GinArgs.queue: host memory, args.h): `capacity` descriptors, then a header of
// COMMREF_GIN_QUEUE_HEADER bytes that holds two uint64 counters and the engine's idle
// word, a cache line apart, at these byte offsets from the end of the descriptors.
//
// The idle word (uint32) is how a sleeping progress engine is rung (the native engine,
// native_engine/engine.cpp): the engine stores kGinIdleRingAll (1) there, a sequentially
// consistent fence, looks at the next slot once more, and only then sleeps on the word (a
// futex); a producer publishes its descriptor, a sequentially consistent fence, and wakes
// the word if it reads nonzero (commref_wake_sleeper, port.h). One of the two sees the
// other's store, so no descriptor waits for a sleeper. GPU producers never ring: an engine
// serving a GPU does not sleep on the word. An engine whose kernels help (below) and that
// keeps no clock (no wire model, no lossy link) stores kGinIdleKernelsTake (2) instead:
// CPU kernels ring only a 1, for each takes what it published at its next help or as its
// block ends (Gin::handOff), so that engine sleeps while they run instead of taking turns
// on their cores; host producers ring either.
//
// Help (the help hook, two words: a function int (*)(void*) and its argument): a host
// engine in this process that lets waiting kernels take descriptors too (the native
// engine on network shm; MPI's rule that a waiting thread makes progress) stores them
// while it starts and clears the function before it stops, and it stops only when no
// kernel of its communicator runs. A CPU kernel that waits on something its GIN queue
// leads to (a signal, a counter, a credit, a free slot, a flush) calls the hook between
// polls (commref_help_progress, port.h), and one that publishes owes it a call, made at
// its next help or as its block ends (commref_help_later). A call takes what is
// published, in slot order, if no other thread is taking descriptors at that moment; a
// taker looks at the queue again after it lets go, so whatever was published while it
// took is taken. One taker at a time keeps each (peer, context) FIFO. On a handful of
// cores this saves the handoff to the engine thread, which may be waiting for the very
// core the kernel spins on. A block that called the help hook calls the end hook (the
// third word; the engine stores the three) once as it ends (cpu/engine.cpp), where an
// engine makes the polls the block's waits would have made: the polls that release the
// native engine's held puts on the unordered wire (transports/gin/native_engine/idle.h,
// HeldRelease).
// GPU kernels call neither.
#define COMMREF_GIN_QUEUE_CLAIMED 0     // slots claimed by producers (fetch-add)
#define COMMREF_GIN_QUEUE_CONSUMED 64   // slots the proxy has completed (it alone stores)
#define COMMREF_GIN_QUEUE_IDLE 128      // nonzero while the engine sleeps or is about to (it alone stores)
#define COMMREF_GIN_QUEUE_HELP_FN 136   // the help hook: int (*)(void*), 0 when none (the engine alone stores)
#define COMMREF_GIN_QUEUE_HELP_CTX 144  // ... and its argument
#define COMMREF_GIN_QUEUE_HELP_END 152  // the end hook: void (*)(void*), the same argument; 0 when none
#define COMMREF_GIN_QUEUE_HEADER 192
// The idle word's values while the engine sleeps (0: awake).
constexpr uint32_t kGinIdleRingAll = 1;      // every producer rings
constexpr uint32_t kGinIdleKernelsTake = 2;  // host producers ring; helping kernels take their own
static_assert(COMMREF_GIN_QUEUE_CONSUMED >= COMMREF_GIN_QUEUE_CLAIMED + 8 &&
                  COMMREF_GIN_QUEUE_IDLE >= COMMREF_GIN_QUEUE_CONSUMED + 8 &&
                  COMMREF_GIN_QUEUE_HELP_FN >= COMMREF_GIN_QUEUE_IDLE + 8 &&
                  COMMREF_GIN_QUEUE_HELP_CTX == COMMREF_GIN_QUEUE_HELP_FN + 8 &&
                  COMMREF_GIN_QUEUE_HELP_END == COMMREF_GIN_QUEUE_HELP_CTX + 8 &&
                  COMMREF_GIN_QUEUE_HEADER >= COMMREF_GIN_QUEUE_HELP_END + 8 && COMMREF_GIN_QUEUE_CLAIMED % 8 == 0 &&
                  COMMREF_GIN_QUEUE_CONSUMED % 8 == 0 && COMMREF_GIN_QUEUE_IDLE % 8 == 0,
              "the GIN queue words are aligned inside the header");

// kGinDoorbell: "what I posted to this (peer, context) so far is a batch; deliver it".
// A kernel rings it before it waits on anything those operations lead to. The proxy
// decides landing orders at doorbells only, so on an unordered wire the order is a
// function of the seed and of the posted sequence alone (reproducible), never of when
// descriptors happened to reach the proxy.
enum GinOp : uint32_t { kGinPut = 1, kGinPutValue = 2, kGinSignal = 3, kGinGet = 4, kGinFlush = 5, kGinDoorbell = 6 };
enum GinFlags : uint32_t {
  kGinHasSignal = 1u << 0,
  kGinStrongSignal = 1u << 1,  // else weak
  kGinVaSignal = 1u << 2,      // else indexed
  kGinSignalAdd = 1u << 3,     // else inc (value 1)
  kGinHasCounter = 1u << 4,
  // Bulk data: nothing reads the destination's bytes before this put's signal or a later
  // one lands (FIFO slots of the Simple protocol, the direct kernels' pushes; not LL or
  // LL128 lines, which kernels poll), so an engine may land them with non-temporal
  // stores, fenced before any later signal (the native engine does, from its
  // streamMinBytes). The collectives set it where the call streams what another agent
  // reads next (CollArgs.streamStores: tuner.StoreChooser times whole calls both ways),
  // since whether streaming pays depends on where the cores sit (move.h).
  kGinBulk = 1u << 5
};

struct GinDescriptor {
  uint64_t seq;  // slot + 1 once published
  uint32_t op, flags;
  int32_t peer, ctx;
  uint64_t dstOffset, srcOffset;  // window offsets (dst at the target for puts, here for gets)
  uint64_t bytes;                 // bytes, or the value of a putValue
  uint64_t signal;                // signal index, or VA offset in the peer's window
  uint64_t signalValue;           // for add
  uint32_t counter;
  uint32_t windows;  // which windows the offsets address: ginWindows(src, dst)
};

// Windows (GinDescriptor.windows): a put or get addresses its source and its
// destination each in a window, by id: 0 is the connection window (the default), ids
// from 1 are the symmetric windows the engine was given (NCCL's registered windows;
// collectives/symmetric.py assigns the ids, the same on every rank). A put's source is
// here and its destination at the peer; a get's source at the peer and its destination
// here. Signals always live in the connection window. Only the native engine carries
// ids other than 0 (transports/gin/native_engine/); the other proxies refuse them.
#define COMMREF_GIN_MAX_WINDOWS 1024
static __host__ __device__ __forceinline__ uint32_t ginWindows(uint32_t src, uint32_t dst) { return src | dst << 16; }
static __host__ __device__ __forceinline__ uint32_t ginSrcWindow(uint32_t windows) { return windows & 0xffffu; }
static __host__ __device__ __forceinline__ uint32_t ginDstWindow(uint32_t windows) { return windows >> 16; }

// Why an engine refuses a descriptor, and which of its accesses (device_kernels/abi.py's
// GIN_REFUSALS and GIN_ACCESSES, which list the conditions in the order every engine
// tests them). An engine that refuses records a GinRefusal and ends; the host formats
// its message from one table (transports/gin/engine.py), so every engine says the same.
enum GinRefusalCode : uint32_t {
  kGinRefusePeerOutside = 1,     // peer outside [0, nranks)
  kGinRefusePeerUnmapped = 2,    // network shm: the peer's connection window is not mapped here
  kGinRefuseWindowUnknown = 3,   // a window id the engine was not given
  kGinRefuseOutsideWindow = 4,   // [offset, offset + bytes) reaches past the window's size
  kGinRefuseWindowUnmapped = 5,  // rank `owner`'s copy of the window is not mapped here
  kGinRefuseStrongSignal = 6,    // a strong signal on a backend of weak signals only
  kGinRefuseVaSignal = 7,        // a VA signal on a backend without VA signals
  kGinRefuseSignalAdd = 8,       // an add where signals count completed writes
  kGinRefuseUnknownOp = 9
};
enum GinAccess : uint32_t {
  kGinAccessPutSource = 1,
  kGinAccessPutDestination = 2,
  kGinAccessGetSource = 3,
  kGinAccessGetDestination = 4,
  kGinAccessSignal = 5,
  kGinAccessLanding = 6,
  kGinAccessGetRequest = 7
};
struct GinRefusal {
  uint32_t code, access;         // GinRefusalCode, GinAccess (0 where none)
  uint32_t op;                   // the descriptor's op
  int32_t peer;                  // its peer (the source, for the MPI network's landing and get_request)
  int32_t owner;                 // window_unmapped: whose copy
  uint32_t window;               // the window id an access names
  uint64_t offset, bytes, size;  // the range, and the window's size (outside_window)
};

// ---- remote actions: what a put or signal does at the peer, besides its data ----
// One vocabulary for Gin (here) and DeviceComm (device.h): `id` is a signal slot of the
// peer, a raw GIN signal index here and a user signal id on a DeviceComm (which adds its
// signalBase). Strong: once visible at the peer, this operation and every earlier put of
// this rank to that peer on the same context are visible. Weak: only its own put is.
struct RemoteAction {
  uint32_t flags;  // GinFlags: kGinHasSignal, kGinStrongSignal, kGinSignalAdd, kGinVaSignal
  uint64_t signal, value;
};
__device__ RemoteAction NoSignal();                                // data only
__device__ RemoteAction StrongSignalInc(uint64_t id);              // signal id += 1, strong
__device__ RemoteAction StrongSignalAdd(uint64_t id, uint64_t v);  // signal id += v, strong
__device__ RemoteAction WeakSignalInc(uint64_t id);                // signal id += 1, weak
__device__ RemoteAction WeakSignalAdd(uint64_t id, uint64_t v);    // signal id += v, weak
// The same action on the 64-bit word at window offset `id` of the peer (not a signal slot).
__device__ RemoteAction VaSignal(RemoteAction r);

// ---- Gin: a handle on this rank's GIN queue, bound to one context when made ----
// Every operation reads the peer first. Operations are posted by the calling thread
// alone (one descriptor each); on the same (context, peer) they are carried in post
// order, on different ones independently.
// Failure (wait.h): once env.failed is set, post() writes no descriptor and the waits
// return at once. A slot claimed before a failed queue wait stays unpublished.
struct Gin {
  const CollArgs& a;
  KernelEnv& env;
  int ctx;  // the context every operation of this handle is posted on

  __device__ Gin(const CollArgs& a, KernelEnv& env, int ctx = 0);

  // Copies `bytes` from this rank's window at `src` to the peer's at `dst` (window ids:
  // ginWindows); `r` at the peer once the data is there; `counter` (>= 0) of this rank
  // counts one once the source is reusable. Returns the descriptor's slot.
  __device__ uint64_t put(int peer, uint64_t dst, uint64_t src, uint64_t bytes, RemoteAction r = NoSignal(),
                          int counter = -1, uint32_t windows = 0) const;
  // A put of the 8 bytes of `value` to the peer's window at `dst`.
  __device__ uint64_t putValue(int peer, uint64_t dst, uint64_t value, RemoteAction r = NoSignal()) const;
  // A put of no data: only `r`.
  __device__ uint64_t signal(int peer, RemoteAction r) const;
  // Copies `bytes` of the peer's window at `src` into this rank's at `dst`; landed only
  // after flush().
  __device__ uint64_t get(int peer, uint64_t dst, uint64_t src, uint64_t bytes) const;
  // "What this handle posted to `peer` so far is a batch; deliver it" (kGinDoorbell).
  __device__ void doorbell(int peer) const;
  // Waits until every operation posted before it (on any context) is locally complete:
  // sources reusable, gets landed. Nothing about remote visibility.
  __device__ void flush() const;

  // This rank's GIN signal `id` and counter `id` (raw indices).
  __device__ uint64_t readSignal(uint64_t id) const;
  // Waits until signal `id` has reached `least` (wrap-around compare); `peer` and
  // `channel` name the wait in a failure.
  __device__ uint64_t waitSignal(uint64_t id, uint64_t least, int peer, int channel) const;
  // Only when no peer can still be signalling `id`.
  __device__ void resetSignal(uint64_t id) const;
  __device__ uint64_t readCounter(uint64_t id) const;
  __device__ uint64_t waitCounter(uint64_t id, uint64_t least) const;
  __device__ void resetCounter(uint64_t id) const;

  // The queue's parts, for the flow primitives' waits.
  // Before a wait on what the engine delivers (on network mpi it receives it): where
  // kernels help the engine (the help hook is set: "Help" above) the calling kernel takes
  // what is published now; elsewhere it rings the engine if it sleeps
  // (COMMREF_GIN_QUEUE_IDLE).
  __device__ void kick() const;
  // After a publish: where kernels help, the calling thread takes what it published at
  // its next help or as its block ends (commref_help_later), ringing only an engine asleep
  // with kGinIdleRingAll; elsewhere it rings the engine if it sleeps.
  __device__ void handOff() const;
  __device__ const uint64_t* helpHook() const;  // the help hook's two words
  __device__ uint64_t* signals() const;         // this rank's GIN signal words
  __device__ uint64_t* counters() const;        // this rank's GIN counters

  // Posts one descriptor on this handle's context; returns its slot.
  __device__ uint64_t post(uint32_t op, uint32_t flags, int peer, uint64_t dst, uint64_t src, uint64_t bytes,
                           uint64_t signal, uint64_t value, uint32_t counter, uint32_t windows = 0) const;

 private:
  __device__ GinDescriptor* ring() const;
  __device__ char* queueHeader() const;
  __device__ uint64_t* claimed() const;
  __device__ const uint64_t* consumed() const;
  __device__ char* windowOfGin() const;
};

}  // namespace commref

#include "impl/gin__funcs.h"
