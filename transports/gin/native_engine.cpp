// The native GIN progress engine: one std::thread per rank that carries the ORDERED wire
// at native speed, on the SHM network (every GIN peer's window mapped in this process)
// and, built with COMMREF_GIN_MPI (native.py's mpi_library()), on the MPI network.
// transports/gin/native.py (NativeProxy) drives it through the small extern "C" API at
// the bottom; transports/gin/proxy.py (GinProxy) stays the engine of the unordered wire
// and of runs with an observer.
//
// What it does, per descriptor (include/commref/gin.h, the same protocol as
// transports/gin/queue.py's QueueReader): it takes slot `next` once the slot's seq reads
// next + 1 (acquire: the descriptor's fields, written before the producer's release
// store, are visible), executes it, and stores consumed = next + 1 with release. One
// taker at a time takes every descriptor in slot order, so each (peer, ctx) is FIFO: the
// engine thread, or on network shm a CPU kernel through the queue's help hook (gin.h,
// "Help"; the `taking_` flag below decides who):
//   put:      src (this window) -> dst (peer window) by landLines (commref/land.h: line
//             by line, in order, for kernels polling LL lines); counter (release add, this
//             rank's counters + 8*id) once the source is copied; signal (release add,
//             index: peer window + signals offset + 8*id, VA: peer window + offset);
//   putValue: the 8-byte value stored at dst of the peer, then its signal;
//   signal:   the signal alone;
//   get:      memcpy peer window src -> this window dst before the slot is consumed, so a
//             flush (which waits for consumed) covers it;
//   flush, doorbell: nothing more on this wire (everything lands when taken).
// Offsets address the windows a descriptor names (GinDescriptor.windows, gin.h): 0 the
// connection window, others those given by commref_gin_engine_add_window (this rank's
// base and size, and each peer's base where it is mapped here). Every access is checked
// against its window's size first.
// On the MPI network (class MpiNet below) the same descriptors become messages to the
// peer's engine, which lands them in its own window; see MpiNet for the protocol.
// Refusals follow proxy.py's _remote_action (strong signal on a weak-only backend, VA
// without VA signals, add where signals count writes): the message is recorded, the
// world's abort word raised (so kernels fail instead of hanging), and the thread ends.
//
// Polling: after `spin_polls` empty polls with a pause instruction, `yield_polls` polls
// with sched_yield, then sleeps on the queue's idle word (a futex, gin.h's
// COMMREF_GIN_QUEUE_IDLE) until a producer rings it or a timeout that doubles from 1 us
// up to `sleep_max_ns` passes (the thread's timer slack is set to 1 us so that short
// sleeps are short). Kernels ring after each descriptor they publish and before they
// wait on a GIN signal, counter or credit, so an idle engine costs its host almost
// nothing and wakes when work comes; the timeout is for what does not ring: host
// producers (tests), and on network mpi the messages of peers. Any descriptor taken or
// message handled resets the backoff; while MPI sends or receives are in flight the
// engine yields but does not sleep (MPI moves their data only when polled).
//
// Wire model (wireBytesPerS or wireLatencyNs set; GinOptions.wire_rate, wire_latency):
// this rank's wire is one link that sends the descriptors in queue order. Descriptor i,
// first seen published at t_i, starts when the wire is free, s_i = max(t_i, f_(i-1)),
// is sent by f_i = s_i + bytes_i / rate (bytes_i: a put's or a get's bytes, 8 for a
// putValue, 0 otherwise), and takes effect at d_i = f_i + latency. The d_i never fall,
// so executing descriptors in queue order, each once the clock reaches its d_i, is the
// model exactly; a flush therefore returns once everything before it has landed. While
// the head is not due the engine polls (it never sleeps past d_i).
//
// Trace (when on): per descriptor, the events it made happen, appended in the order they
// happen to one bounded buffer (CommrefGinTraceRecord, decoded by native.py into the
// Python scheduler's ordered-wire tuples): post (seq, offset, nbytes, the signal as
// applied), data, counter, signal (the order they happen here; the Python proxy bumps
// the counter after the signal); flush (on every link of the context posted or rung
// so far), doorbell (its number on the link, from 1), get. Past traceCapacity records
// held, nothing more is recorded and the loss is counted (takeTrace's caller refuses
// the trace). Off, the fast path pays one relaxed load per descriptor; the link table
// (sequence numbers, doorbell counts) is kept either way, behind a one-entry cache.
#include <linux/futex.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "commref/gin.h"
#include "commref/land.h"

#ifdef COMMREF_GIN_MPI
#include <mpi.h>
#endif

#define COMMREF_GIN_API extern "C" __attribute__((visibility("default")))

// Configuration, mirrored field for field by native.py's EngineConfig (ctypes).
struct CommrefGinEngineConfig {
  uint64_t queueBase;      // address of the descriptor ring (window + ginQueueOff)
  uint64_t capacity;       // descriptors in the ring
  uint64_t windowBase;     // this rank's window
  uint64_t peerWindows;    // address of uint64[nranks]: each rank's window mapped here, 0 if not (copied)
  uint64_t signalsOff;     // WindowLayout.ginSignalsOff
  uint64_t countersOff;    // WindowLayout.ginCountersOff
  uint64_t abortWord;      // address of the world's abort word (uint64)
  uint64_t mpiComm;        // network mpi: the proxies' communicator (mpi4py's handle of a Dup), else 0
  int32_t network;         // kNetworkShm or kNetworkMpi
  int32_t mpiTag;          // network mpi: the tag of every message (one per GIN communicator)
  int32_t nranks, rank;
  int32_t strongSignals, vaSignals, strongAlways, signalsCountWrites;  // the backend's capabilities
  int32_t trace;                                                       // record landings from the start
  int32_t spinPolls, yieldPolls;
  int32_t kernelsHelp;     // network shm: install the queue's help hook (gin.h, "Help")
  uint64_t sleepMaxNs;     // longest idle sleep
  uint64_t traceCapacity;  // most trace records held at once (beyond: lost and counted)
  uint64_t windowBytes;    // every rank's window is this long: offsets are checked against it
  double timeoutS;         // stop() and the MPI network's waits: how long to wait
  double wireBytesPerS;    // the wire model (below): this rank's wire sends this many bytes/s; 0: unlimited
  uint64_t wireLatencyNs;  // ... and an operation takes effect this long after it is sent
  uint64_t streamMinBytes; // network shm: bulk puts (kGinBulk) from this size land with non-temporal stores; 0: never
  char backend[32];        // the backend's name, for messages
};

enum : int32_t { kNetworkShm = 0, kNetworkMpi = 1 };

// One event on link (peer, ctx); native.py's TRACE_DTYPE mirrors it.
enum : uint32_t { kTracePost = 1, kTraceFlush, kTraceDoorbell, kTraceData, kTraceSignal, kTraceCounter, kTraceGet };
enum : uint32_t { kTraceHasSignal = 1, kTraceStrong = 2, kTraceVa = 4 };  // a post's flags
struct CommrefGinTraceRecord {
  int32_t peer, ctx;
  uint32_t kind, flags;
  uint64_t seq;         // post, data, signal, counter: the put's seq on its link (from 0); doorbell: its number (from 1)
  uint64_t a, b, c, d;  // post: offset, nbytes, signal id or VA offset, signal value; counter: a = index;
                        // get: a = src, b = dst, c = bytes
};

namespace {

inline void cpuPause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

using Clock = std::chrono::steady_clock;

#ifdef COMMREF_GIN_MPI
// The MPI network's protocol, between the engines of two ranks on their own communicator
// (one tag). Every message starts with an MpiHeader. MPI keeps the messages of one
// (source, communicator, tag) in order, and the receiver handles them one at a time, so
// what a rank's engine sends to a peer lands there in the order it was sent: the wire
// stays ordered per (peer, ctx), and a put's signal is applied after its data.
// The tag (CommrefGinEngineConfig.mpiTag) is the communicator's own (plan.py's
// network_tag()): a communicator freed at stop may have its context id reused by a later
// one, and a message still in flight on the old one must not match the new engines.
//   put (kMsgPut): offset = dst offset at the target, size = bytes (0: a bare signal),
//     the signal (flags kMsgHasSignal, kMsgVa; signal = index or VA offset; value). Up to
//     kMpiInlineBytes of data ride inline behind the header (copied: the source is
//     reusable at once); more follow as the next messages (kMsgDataFollows), sent from
//     the source itself, in chunks of at most kMpiChunkBytes, which the target receives
//     straight into its window. Such a put's source is reusable, and its counter
//     bumped, when those sends complete; a flush waits for every send to complete.
//   get (kMsgGetRequest): offset = src offset at the target, size, signal = dst offset
//     here, windows as the descriptor's; the target answers kMsgGetReply (offset = dst,
//     data as for a put), which the requester lands before its get's slot is consumed.
//   Offsets at the target are in the window that `windows` names there.
struct MpiHeader {
  uint64_t kind, offset, size, flags, signal, value;
  uint64_t windows;  // put, get reply: ginWindows(0, the target's window); get request: the descriptor's
};
enum : uint64_t { kMsgPut = 1, kMsgGetRequest = 2, kMsgGetReply = 3 };
enum : uint64_t { kMsgHasSignal = 1, kMsgVa = 2, kMsgDataFollows = 4 };
constexpr uint64_t kMpiInlineBytes = 16 << 10;
constexpr uint64_t kMpiChunkBytes = 1ull << 30;  // MPI counts are int

// mpi4py's handle of a communicator: MPI_Comm's value (an int in MPICH, a pointer in Open MPI).
template <typename Comm>
Comm commFromHandle(uint64_t h) {
  if constexpr (std::is_pointer_v<Comm>) {
    return reinterpret_cast<Comm>(static_cast<uintptr_t>(h));
  } else {
    return static_cast<Comm>(h);
  }
}
constexpr bool kHaveMpi = true;
#else
constexpr bool kHaveMpi = false;
#endif

class Engine {
 public:
  explicit Engine(const CommrefGinEngineConfig& c) : cfg_(c) {
    const uint64_t* peers = reinterpret_cast<const uint64_t*>(c.peerWindows);
    peers_.assign(peers, peers + c.nranks);
    ring_ = reinterpret_cast<GinDescriptor*>(c.queueBase);
    const uint64_t header = c.queueBase + c.capacity * sizeof(GinDescriptor);  // gin.h: the words after the ring
    consumed_ = reinterpret_cast<uint64_t*>(header + COMMREF_GIN_QUEUE_CONSUMED);
    claimed_ = reinterpret_cast<const uint64_t*>(header + COMMREF_GIN_QUEUE_CLAIMED);
    idle_ = reinterpret_cast<uint32_t*>(header + COMMREF_GIN_QUEUE_IDLE);
    helperFn_ = reinterpret_cast<uint64_t*>(header + COMMREF_GIN_QUEUE_HELP_FN);
    helperCtx_ = reinterpret_cast<uint64_t*>(header + COMMREF_GIN_QUEUE_HELP_CTX);
    here_ = reinterpret_cast<char*>(c.windowBase);
    counters_ = here_ + c.countersOff;
    tracing_.store(c.trace != 0, std::memory_order_relaxed);
    traceCapacity_ = c.traceCapacity;
#ifdef COMMREF_GIN_MPI
    if (c.network == kNetworkMpi) {
      comm_ = commFromHandle<MPI_Comm>(c.mpiComm);
      landings_.resize((size_t)c.nranks);
    }
#endif
  }

  void start() {
    thread_ = std::thread([this] { run(); });
    // On network shm the CPU engine's kernels may take descriptors too (gin.h, "Help"). On
    // network mpi they do not: MPI progress from kernel threads measured no faster there, and
    // slowed the other communicators of the process.
    if (!mpi() && cfg_.kernelsHelp) {
      __atomic_store_n(helperCtx_, reinterpret_cast<uint64_t>(this), __ATOMIC_RELAXED);
      __atomic_store_n(helperFn_, reinterpret_cast<uint64_t>(&Engine::helpHook), __ATOMIC_RELEASE);
    }
  }

  // A kernel's turn at the queue (the help hook, network shm): takes what is published, if
  // no other thread is taking descriptors now; how many it took.
  static int helpHook(void* engine) { return static_cast<Engine*>(engine)->help(); }
  int help() {
    if (stop_.load(std::memory_order_relaxed) || failed_.load(std::memory_order_relaxed)) return 0;
    if (!published(__atomic_load_n(consumed_, __ATOMIC_ACQUIRE))) return 0;  // nothing to take: no RMW
    if (!tryTake()) return 0;
    const int took = drain(64);  // a failure sets failed_: the engine thread ends
    release();
    if (took <= 0) return 0;
    byKernels_.fetch_add((uint64_t)took, std::memory_order_relaxed);
    return took;
  }

  // 0: the thread ended and was joined; 1: it did not end within the timeout (not joined).
  int stop(double timeoutS) {
    stop_.store(true, std::memory_order_seq_cst);
    __atomic_store_n(helperFn_, 0, __ATOMIC_RELEASE);  // no new helper; wait out one inside drain()
    __atomic_store_n(helperCtx_, 0, __ATOMIC_RELAXED);
    take();
    release();
    if (!thread_.joinable()) return 0;
    wake();
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeoutS);
    while (!exited_.load(std::memory_order_acquire)) {
      if (Clock::now() > deadline) return 1;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    thread_.join();
    return 0;
  }

  void stats(uint64_t* out) const {
    out[0] = ops_.load(std::memory_order_acquire);
    out[1] = events_.load(std::memory_order_relaxed);
    out[2] = __atomic_load_n(claimed_, __ATOMIC_ACQUIRE);
    out[3] = running();
    out[4] = failed_.load(std::memory_order_acquire);
    out[5] = doorbells_.load(std::memory_order_relaxed);
    out[6] = inFlight_.load(std::memory_order_acquire);
    out[7] = byKernels_.load(std::memory_order_relaxed);
  }

  int failed() const { return failed_.load(std::memory_order_acquire); }

  uint64_t running() const { return thread_.joinable() && !exited_.load(std::memory_order_acquire); }

  size_t error(char* buf, size_t n) {
    if (!failed_.load(std::memory_order_acquire)) return 0;
    std::lock_guard<std::mutex> g(mu_);
    if (n) {
      std::snprintf(buf, n, "%s", error_.c_str());
    }
    return error_.size();
  }

  void setTrace(bool on) {
    std::lock_guard<std::mutex> g(mu_);
    trace_.clear();
    traceLost_ = 0;
    tracing_.store(on, std::memory_order_release);
  }

  size_t takeTrace(CommrefGinTraceRecord* out, size_t max, uint64_t* lost) {
    std::lock_guard<std::mutex> g(mu_);
    *lost = traceLost_;
    const size_t n = trace_.size() < max ? trace_.size() : max;
    if (n) {
      std::memcpy(out, trace_.data(), n * sizeof(CommrefGinTraceRecord));
      trace_.erase(trace_.begin(), trace_.begin() + n);
    }
    return n;
  }

 private:
  bool mpi() const { return cfg_.network == kNetworkMpi; }

  void run() {
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // 1 us: short sleeps stay short
    uint64_t idle = 0, sleepNs = 1000;
    const uint64_t spin = (uint64_t)cfg_.spinPolls, yields = spin + (uint64_t)cfg_.yieldPolls;
    while (!stop_.load(std::memory_order_acquire) && !failed_.load(std::memory_order_acquire)) {
      int took = 0, moved = 0;  // descriptors taken; messages received and sends completed (MPI)
      if (tryTake()) {
        took = drain(64);
        if (took >= 0) moved = network();
        release();
      }
      if (took < 0 || moved < 0) break;
      if (took > 0 || moved > 0 || waitingForWire()) {
        idle = 0;
        sleepNs = 1000;
        continue;
      }
      if (++idle <= spin) {
        cpuPause();
      } else if (idle <= yields || inFlight_.load(std::memory_order_relaxed)) {  // MPI needs polls to move data
        sched_yield();
      } else {
        sleep(sleepNs);
        sleepNs = sleepNs * 2 < cfg_.sleepMaxNs ? sleepNs * 2 : cfg_.sleepMaxNs;
      }
    }
    take();  // a helper leaves first
    abandonLandings();
    release();
    exited_.store(true, std::memory_order_release);
  }

  // The taker's turn (taking_, below): try once, wait for it, give it back.
  bool tryTake() { return !taking_.exchange(true, std::memory_order_acquire); }
  void take() {
    while (!tryTake()) std::this_thread::yield();
  }
  void release() { taking_.store(false, std::memory_order_release); }

  static struct timespec timespecOf(uint64_t ns) { return {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)}; }

  static uint64_t nowNs() {
    return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  }

  // The wire model: stamps every descriptor published since the last call with its
  // landing time, then whether `slot` (the head, published) is due.
  bool due(uint64_t slot) {
    const uint64_t now = nowNs();
    for (; stamped_ < next_ + cfg_.capacity && published(stamped_); stamped_++) {
      const GinDescriptor& d = ring_[stamped_ % cfg_.capacity];
      const uint64_t bytes = d.op == kGinPut || d.op == kGinGet ? d.bytes : d.op == kGinPutValue ? 8 : 0;
      const uint64_t start = now > wireFreeNs_ ? now : wireFreeNs_;
      wireFreeNs_ = start + (cfg_.wireBytesPerS > 0 ? (uint64_t)((double)bytes * 1e9 / cfg_.wireBytesPerS) : 0);
      landsAt_[stamped_ % cfg_.capacity] = wireFreeNs_ + cfg_.wireLatencyNs;
    }
    headDueNs_.store(landsAt_[slot % cfg_.capacity], std::memory_order_relaxed);
    return now >= landsAt_[slot % cfg_.capacity];
  }

  // The head is published but not due (wire model): poll until it is, sleeping for
  // most of a wait longer than 200 us (the timer slack is 1 us).
  bool waitingForWire() {
    if (!modeled_ || !published(__atomic_load_n(consumed_, __ATOMIC_ACQUIRE))) return false;
    const uint64_t now = nowNs(), headDue = headDueNs_.load(std::memory_order_relaxed);
    if (headDue > now + 200000) {
      const struct timespec ts = timespecOf(headDue - now - 100000);
      nanosleep(&ts, nullptr);
    } else if (headDue > now) {
      sched_yield();
    }
    return true;
  }

  bool published(uint64_t slot) const {
    return __atomic_load_n(&ring_[slot % cfg_.capacity].seq, __ATOMIC_ACQUIRE) == slot + 1;
  }

  // Sleeps until rung, stopped, or `ns` pass (the protocol: gin.h, COMMREF_GIN_QUEUE_IDLE).
  void sleep(uint64_t ns) {
    __atomic_store_n(idle_, 1u, __ATOMIC_RELAXED);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!published(__atomic_load_n(consumed_, __ATOMIC_ACQUIRE)) && !stop_.load(std::memory_order_seq_cst)) {
      const struct timespec ts = timespecOf(ns);
      syscall(SYS_futex, idle_, FUTEX_WAIT_PRIVATE, 1u, &ts, nullptr, 0);
    }
    __atomic_store_n(idle_, 0u, __ATOMIC_RELAXED);
  }

  void wake() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (__atomic_load_n(idle_, __ATOMIC_RELAXED)) syscall(SYS_futex, idle_, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  }

  // Takes up to `budget` published descriptors in slot order; how many, or -1 on error.
  int drain(int budget) {
    int took = 0;
    while (took < budget) {
      const uint64_t slot = next_;
      if (!published(slot)) break;
      if (modeled_ && !due(slot)) break;
      const GinDescriptor c = ring_[slot % cfg_.capacity];
      if (!execute(c)) return -1;
      next_ = slot + 1;
      __atomic_store_n(consumed_, next_, __ATOMIC_RELEASE);  // frees the entry, completes flushes
      ops_.fetch_add(1, std::memory_order_release);
      took++;
    }
    return took;
  }

  bool fail(const std::string& msg) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (error_.empty()) error_ = msg;
    }
    failed_.store(1, std::memory_order_release);
    __atomic_store_n(reinterpret_cast<uint64_t*>(cfg_.abortWord), 1, __ATOMIC_RELEASE);
    return false;
  }

  std::string who() const { return "rank " + std::to_string(cfg_.rank) + ": "; }

  // A put's bytes into the peer's window (network shm). Bulk data (kGinBulk: read only
  // after a signal) from streamMinBytes goes past this core's cache with non-temporal
  // stores, fenced (streamBytes), so the peer's core reads it from memory instead of
  // fetching each line from this one (on a host whose cores do not share a cache that
  // is several times faster: docs/performance.md, "Two placements"). Anything else line
  // by line, for kernels that poll LL lines there.
  void land(char* dst, const char* src, uint64_t nbytes, bool bulk) const {
#ifdef COMMREF_HAVE_STREAM
    if (bulk && cfg_.streamMinBytes && nbytes >= cfg_.streamMinBytes) {
      streamBytes(dst, src, nbytes);
      return;
    }
#endif
    (void)bulk;
    landLines(dst, src, nbytes);
  }

  bool outside(const char* what, int32_t peer, uint64_t offset, uint64_t bytes, uint32_t window = 0,
               uint64_t windowBytes = 0) {
    return fail(who() + "GIN " + what + " (peer " + std::to_string(peer) + ") reaches [" + std::to_string(offset) +
                ", " + std::to_string(offset + bytes) + "), outside the " +
                std::to_string(window ? windowBytes : cfg_.windowBytes) + "-byte " +
                (window ? "window " + std::to_string(window) : std::string("connection window")));
  }

  // The bytes of window `id` (every rank's copy has them), 0 where the id names none.
  uint64_t windowBytes(uint32_t id) const {
    if (id == 0) return cfg_.windowBytes;
    return id < COMMREF_GIN_MAX_WINDOWS ? windows_[id].bytes.load(std::memory_order_acquire) : 0;
  }

  // Whether [offset, offset + bytes) lies in window `id` (fails, naming `what`, if not).
  bool known(uint32_t id, uint64_t offset, uint64_t bytes, const char* what, int32_t peer) {
    const uint64_t size = windowBytes(id);
    if (size == 0)
      return fail(who() + "GIN " + what + " (peer " + std::to_string(peer) + ") names window " + std::to_string(id) +
                  ", which this engine was not given");
    if (offset > size || bytes > size - offset) return outside(what, peer, offset, bytes, id, size);
    return true;
  }

  // Where [offset, offset + bytes) of rank `rank`'s copy of window `id` is mapped here;
  // nullptr (failed, naming `what`) outside it, or where it is not mapped.
  char* at(uint32_t id, int32_t rank, uint64_t offset, uint64_t bytes, const char* what, int32_t peer) {
    if (!known(id, offset, bytes, what, peer)) return nullptr;
    const uint64_t base = id == 0 ? (rank == cfg_.rank ? (uint64_t)here_ : peers_[rank])
                                  : (rank == cfg_.rank ? windows_[id].base : windows_[id].peers[rank]);
    if (base == 0) {
      fail(who() + "GIN " + what + ": rank " + std::to_string(rank) + "'s window " + std::to_string(id) +
           " is not mapped here");
      return nullptr;
    }
    return reinterpret_cast<char*>(base) + offset;
  }

 public:
  // Gives the engine window `id` (1 ..< COMMREF_GIN_MAX_WINDOWS): this rank's `bytes` at
  // `base`, and peers[r], rank r's copy mapped here (0 where it is not). Called by the
  // host between launches: no descriptor names `id` before it returns, nor after
  // removeWindow(id) until it is given again. 0, or 1 for a bad id.
  int addWindow(uint32_t id, uint64_t base, uint64_t bytes, const uint64_t* peers) {
    if (id == 0 || id >= COMMREF_GIN_MAX_WINDOWS || bytes == 0 || base == 0) return 1;
    Window& w = windows_[id];
    w.base = base;
    w.peers.assign(peers, peers + cfg_.nranks);
    w.bytes.store(bytes, std::memory_order_release);
    return 0;
  }
  void removeWindow(uint32_t id) {
    if (id != 0 && id < COMMREF_GIN_MAX_WINDOWS) windows_[id].bytes.store(0, std::memory_order_release);
  }

 private:

  struct Link {
    uint64_t seq = 0, doorbells = 0;  // operations posted, doorbells rung (the trace's numbers)
  };

  // The link (peer, ctx), created on first use (as the Python scheduler's link()); the
  // last one is cached (unordered_map nodes do not move).
  Link& link(int32_t peer, int32_t ctx) {
    const uint64_t key = ((uint64_t)(uint32_t)peer << 32) | (uint32_t)ctx;
    if (lastLink_ == nullptr || key != lastKey_) {
      lastLink_ = &links_[key];
      lastKey_ = key;
    }
    return *lastLink_;
  }

  bool tracing() const { return tracing_.load(std::memory_order_relaxed); }

  void record(const CommrefGinTraceRecord* r, size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    if (traceLost_ || trace_.size() + n > traceCapacity_) {  // refused from the first loss on: no holes
      traceLost_ += n;
      return;
    }
    trace_.insert(trace_.end(), r, r + n);
  }

  void traceFlush(int32_t ctx) {
    std::vector<CommrefGinTraceRecord> r;
    for (const auto& kv : links_)
      if ((int32_t)(uint32_t)kv.first == ctx) r.push_back({(int32_t)(kv.first >> 32), ctx, kTraceFlush, 0, 0, 0, 0, 0, 0});
    if (!r.empty()) record(r.data(), r.size());
  }

  void bumpCounter(uint32_t id) {  // the source is reusable from here on
    __atomic_fetch_add(reinterpret_cast<uint64_t*>(counters_ + 8 * (uint64_t)id), 1, __ATOMIC_RELEASE);
  }

  bool execute(const GinDescriptor& d) {
    if (d.op == kGinFlush) {  // shm: everything landed when taken; mpi: every send completes first
      if (mpi() && !completeSends(d.ctx)) return false;
      if (tracing()) traceFlush(d.ctx);
      return true;
    }
    if (d.op == kGinDoorbell) {
      const uint64_t n = ++link(d.peer, d.ctx).doorbells;
      doorbells_.fetch_add(1, std::memory_order_relaxed);
      if (tracing()) {
        const CommrefGinTraceRecord r{d.peer, d.ctx, kTraceDoorbell, 0, n, 0, 0, 0, 0};
        record(&r, 1);
      }
      return true;
    }
    if (d.peer < 0 || d.peer >= cfg_.nranks)
      return fail(who() + "GIN operation " + std::to_string(d.op) + " names peer " + std::to_string(d.peer) +
                  " outside [0, " + std::to_string(cfg_.nranks) + ")");
    char* peer = reinterpret_cast<char*>(peers_[d.peer]);
    if (!mpi() && peer == nullptr)
      return fail(who() + "GIN peer " + std::to_string(d.peer) + "'s window is not mapped here (network shm)");
    const uint32_t srcWin = ginSrcWindow(d.windows), dstWin = ginDstWindow(d.windows);
    if (d.op == kGinGet) {
      char* dst = at(dstWin, cfg_.rank, d.dstOffset, d.bytes, "get destination", d.peer);
      if (dst == nullptr) return false;
      if (mpi()) {
        if (!mpiGet(d)) return false;
      } else {
        const char* from = at(srcWin, d.peer, d.srcOffset, d.bytes, "get source", d.peer);
        if (from == nullptr) return false;
        std::memcpy(dst, from, d.bytes);
      }
      if (tracing()) {
        const CommrefGinTraceRecord r{d.peer, d.ctx, kTraceGet, 0, 0, d.srcOffset, d.dstOffset, d.bytes, 0};
        record(&r, 1);
      }
      return true;
    }
    const bool hasSignal = d.flags & kGinHasSignal, va = d.flags & kGinVaSignal;
    uint64_t value = 0;
    if (hasSignal) {
      const bool strong = d.flags & kGinStrongSignal, add = d.flags & kGinSignalAdd;
      const std::string peerName = std::to_string(d.peer), backend = cfg_.backend;
      if (strong && !cfg_.strongSignals)
        return fail(who() + "strong signal to peer " + peerName + " on backend " + backend +
                    ", which offers weak signals only");
      if (va && !cfg_.vaSignals) return fail(who() + "VA signal to peer " + peerName + " on backend " + backend);
      value = add ? d.signalValue : 1;
      if (cfg_.signalsCountWrites) {
        if (add)
          return fail(who() + "signal add on backend " + backend + ", whose signals count completed writes");
        value = 1;
      }
      const uint64_t where = va ? d.signal : cfg_.signalsOff + 8 * d.signal;
      if (!known(0, where, 8, "signal", d.peer)) return false;
    }
    uint64_t nbytes = 0;
    const char* src = reinterpret_cast<const char*>(&d.bytes);  // a putValue's value
    if (d.op == kGinPut) {
      nbytes = d.bytes;
      src = at(srcWin, cfg_.rank, d.srcOffset, nbytes, "put source", d.peer);
      if (src == nullptr) return false;
    } else if (d.op == kGinPutValue) {
      nbytes = 8;
    } else if (d.op != kGinSignal) {
      return fail(who() + "unknown GIN operation " + std::to_string(d.op));
    }
    char* dst = nullptr;  // network shm: where the data lands
    if (nbytes) {
      if (mpi() ? !known(dstWin, d.dstOffset, nbytes, "put destination", d.peer)
                : (dst = at(dstWin, d.peer, d.dstOffset, nbytes, "put destination", d.peer)) == nullptr)
        return false;
    }
    const bool counter = d.op == kGinPut && (d.flags & kGinHasCounter);
    const uint64_t seq = link(d.peer, d.ctx).seq++;
    bool counted = counter;  // the counter bumped before this returns (else when the sends complete)
    if (mpi()) {
      if (!mpiPut(d, src, nbytes, value, counter, seq, &counted)) return false;
    } else {
      if (nbytes) land(dst, src, nbytes, d.flags & kGinBulk);
      if (counter) bumpCounter(d.counter);
      if (hasSignal)  // after the data: release
        __atomic_fetch_add(reinterpret_cast<uint64_t*>(peer + (va ? d.signal : cfg_.signalsOff + 8 * d.signal)), value,
                           __ATOMIC_RELEASE);
    }
    events_.fetch_add(1, std::memory_order_relaxed);
    if (tracing()) {  // what happened, in its order: the put posted, its data, its counter, its signal
      CommrefGinTraceRecord r[4];
      size_t n = 0;
      uint32_t flags = 0;
      if (hasSignal) {
        flags = kTraceHasSignal | (va ? kTraceVa : 0) | ((d.flags & kGinStrongSignal) || cfg_.strongAlways ? kTraceStrong : 0);
      }
      r[n++] = {d.peer, d.ctx, kTracePost, flags, seq, d.dstOffset, nbytes, hasSignal ? d.signal : 0, value};
      if (nbytes) r[n++] = {d.peer, d.ctx, kTraceData, 0, seq, 0, 0, 0, 0};
      if (counted) r[n++] = {d.peer, d.ctx, kTraceCounter, 0, seq, d.counter, 0, 0, 0};
      if (hasSignal) r[n++] = {d.peer, d.ctx, kTraceSignal, 0, seq, 0, 0, 0, 0};
      record(r, n);
    }
    return true;
  }

#ifdef COMMREF_GIN_MPI
  // ---- the MPI network (the protocol: MpiHeader, above) ----

  struct Send {
    MPI_Request req;
    char* staging;      // malloc'd header and inline data, freed once the send completes; or null
    bool counter;       // a zero-copy put's last send: bump its counter on completion
    uint32_t counterId;
    int32_t peer, ctx;
    uint64_t seq;       // the put's seq on its link (the trace's counter record)
  };

  bool mpiError(const char* call, int rc, int32_t peer) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = std::snprintf(text, sizeof text, "error %d", rc);
    return fail(who() + "GIN MPI network: " + call + " (peer " + std::to_string(peer) + ") failed: " +
                std::string(text, (size_t)len));
  }

  bool isend(int32_t peer, const void* buf, uint64_t bytes, char* staging, bool counter, const GinDescriptor* d,
             uint64_t seq) {
    Send s{MPI_REQUEST_NULL, staging, counter, d ? d->counter : 0, peer, d ? d->ctx : 0, seq};
    const int rc = MPI_Isend(buf, (int)bytes, MPI_BYTE, peer, cfg_.mpiTag, comm_, &s.req);
    if (rc != MPI_SUCCESS) {
      std::free(staging);
      return mpiError("MPI_Isend", rc, peer);
    }
    sends_.push_back(s);
    inFlight_.store(sends_.size(), std::memory_order_release);
    return true;
  }

  // Sends header `h` with `bytes` of `data` to `peer` (inline, or following from `data`
  // itself). *counted: whether the put's counter (if `counter`) was bumped here.
  bool sendWithData(int32_t peer, MpiHeader h, const char* data, uint64_t bytes, bool counter,
                    const GinDescriptor* d, uint64_t seq, bool* counted) {
    const bool inlined = bytes <= kMpiInlineBytes;
    if (!inlined) h.flags |= kMsgDataFollows;
    const uint64_t msgBytes = sizeof h + (inlined ? bytes : 0);
    char* staging = static_cast<char*>(std::malloc(msgBytes));
    if (staging == nullptr) return fail(who() + "GIN MPI network: out of memory for a " + std::to_string(msgBytes) + "-byte message");
    std::memcpy(staging, &h, sizeof h);
    if (inlined && bytes) std::memcpy(staging + sizeof h, data, bytes);
    if (!isend(peer, staging, msgBytes, staging, false, d, seq)) return false;
    *counted = false;
    if (inlined) {
      if (counter) bumpCounter(d->counter);
      *counted = counter;
      return true;
    }
    for (uint64_t off = 0; off < bytes; off += kMpiChunkBytes) {
      const uint64_t n = bytes - off < kMpiChunkBytes ? bytes - off : kMpiChunkBytes;
      if (!isend(peer, data + off, n, nullptr, counter && off + n == bytes, d, seq)) return false;
    }
    return true;
  }

  bool mpiPut(const GinDescriptor& d, const char* src, uint64_t nbytes, uint64_t value, bool counter, uint64_t seq,
              bool* counted) {
    MpiHeader h{kMsgPut, d.dstOffset, nbytes, 0, d.signal, value, ginWindows(0, ginDstWindow(d.windows))};
    if (d.flags & kGinHasSignal) h.flags |= kMsgHasSignal | (d.flags & kGinVaSignal ? kMsgVa : 0);
    // (a putValue's 8 bytes, which live in the descriptor, always go inline)
    return sendWithData(d.peer, h, src, nbytes, counter, &d, seq, counted);
  }

  // Completes sends in order while the oldest has completed; bumps zero-copy puts'
  // counters. Sends completed, or -1 on error.
  int reap() {
    int n = 0;
    while (!sends_.empty()) {
      Send& s = sends_.front();
      int done = 0;
      const int rc = MPI_Test(&s.req, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return mpiError("MPI_Test", rc, s.peer), -1;
      if (!done) break;
      if (s.counter) {
        bumpCounter(s.counterId);
        if (tracing()) {
          const CommrefGinTraceRecord r{s.peer, s.ctx, kTraceCounter, 0, s.seq, s.counterId, 0, 0, 0};
          record(&r, 1);
        }
      }
      std::free(s.staging);
      sends_.pop_front();
      n++;
    }
    inFlight_.store(sends_.size(), std::memory_order_release);
    return n;
  }

  // A bounded wait's check: false (failed, with a message naming what() was awaited: a
  // callable, so the message is built only then) past the deadline or once the job aborts.
  template <typename What>
  bool keepWaiting(const Clock::time_point& deadline, What what) {
    if (__atomic_load_n(reinterpret_cast<const uint64_t*>(cfg_.abortWord), __ATOMIC_ACQUIRE) != 0)
      return fail(who() + "GIN MPI network: the job aborted while " + what());
    if (Clock::now() > deadline)
      return fail(who() + "GIN MPI network: timed out after " + std::to_string(cfg_.timeoutS) + " s " + what());
    return true;
  }

  Clock::duration timeout() const {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg_.timeoutS));
  }

  // Makes progress (receiving too: a peer may be waiting on this rank) until done(),
  // within the timeout; false on failure or at the deadline (what(): keepWaiting's).
  template <typename Done, typename What>
  bool progressUntil(Done done, What what) {
    const auto end = Clock::now() + timeout();
    for (uint32_t spins = 0; !done(); spins++) {
      if (progressMpi() < 0) return false;
      if (done()) break;
      if ((spins & 63) == 0 && !keepWaiting(end, what)) return false;
      waitPause(spins);
    }
    return true;
  }

  static void waitPause(uint32_t spins) {
    if (spins < 256) cpuPause();
    else sched_yield();
  }

  // What a message from a peer does here, done in arrival order per source once its
  // data is in the window: a put's data (received straight into the window: `reqs`; or
  // inline, `held` when it arrived behind an unfinished landing) and then its signal; a
  // get reply's data; a get request's reply (after every earlier put of that source).
  struct Landing {
    MpiHeader h;
    std::vector<MPI_Request> reqs;  // receives of the data that follows the header
    std::vector<char> held;         // inline data kept until the landings before it finish
    char* at = nullptr;             // where its data lands (put, get reply) or is read (get request) here
    Clock::time_point since;        // when the header came (the deadline of its data)
  };

  // Does what `l`, whose data is in the window, leaves to do. False on failure.
  bool finish(int32_t src, Landing& l) {
    const MpiHeader& h = l.h;
    if (!l.held.empty()) landLines(l.at, l.held.data(), l.held.size());
    if (h.kind == kMsgPut && (h.flags & kMsgHasSignal)) {  // after its data: release
      const uint64_t where = h.flags & kMsgVa ? h.signal : cfg_.signalsOff + 8 * h.signal;
      __atomic_fetch_add(reinterpret_cast<uint64_t*>(here_ + where), h.value, __ATOMIC_RELEASE);
    } else if (h.kind == kMsgGetReply) {
      getPeer_ = -1;
    } else if (h.kind == kMsgGetRequest) {
      bool counted = false;
      return sendWithData(src, MpiHeader{kMsgGetReply, h.signal, h.size, 0, 0, 0, ginWindows(0, ginDstWindow(h.windows))},
                          l.at, h.size, false, nullptr, 0, &counted);
    }
    return true;
  }

  // Finishes, per source and in order, the landings whose data has arrived; how many, or -1.
  int advanceLandings() {
    if (pendingLandings_ == 0) return 0;
    int n = 0;
    for (int32_t src = 0; src < cfg_.nranks; src++) {
      auto& q = landings_[src];
      while (!q.empty()) {
        Landing& l = q.front();
        if (!l.reqs.empty()) {
          int done = 0;
          const int rc = MPI_Testall((int)l.reqs.size(), l.reqs.data(), &done, MPI_STATUSES_IGNORE);
          if (rc != MPI_SUCCESS) return mpiError("MPI_Testall", rc, src), -1;
          if (!done) {
            if (!keepWaiting(l.since + timeout(), [&] {
                  return "receiving " + std::to_string(l.h.size) + " bytes of data from peer " + std::to_string(src) +
                         " (expected after its header, not all seen)";
                }))
              return -1;
            break;
          }
          l.reqs.clear();
        }
        if (!finish(src, l)) return -1;
        q.pop_front();
        pendingLandings_--;
        n++;
      }
    }
    return n;
  }

  // Receives and handles one message (its header) that MPI_Iprobe found.
  bool receive(const MPI_Status& st) {
    int count = 0;
    const int32_t src = st.MPI_SOURCE;
    int rc = MPI_Get_count(&st, MPI_BYTE, &count);
    if (rc != MPI_SUCCESS) return mpiError("MPI_Get_count", rc, src);
    rbuf_.resize((size_t)count);
    rc = MPI_Recv(rbuf_.data(), count, MPI_BYTE, src, cfg_.mpiTag, comm_, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return mpiError("MPI_Recv", rc, src);
    if ((size_t)count < sizeof(MpiHeader) || src < 0 || src >= cfg_.nranks)
      return fail(who() + "GIN MPI network: a " + std::to_string(count) + "-byte message from peer " +
                  std::to_string(src) + " is not one of this engine's");
    Landing l;
    std::memcpy(&l.h, rbuf_.data(), sizeof l.h);
    const MpiHeader& h = l.h;
    const uint64_t bodyBytes = (uint64_t)count - sizeof h;
    if (h.kind != kMsgPut && h.kind != kMsgGetRequest && h.kind != kMsgGetReply)
      return fail(who() + "GIN MPI network: a message of unknown kind " + std::to_string(h.kind) + " from peer " +
                  std::to_string(src));
    const bool request = h.kind == kMsgGetRequest;
    l.at = at(request ? ginSrcWindow(h.windows) : ginDstWindow(h.windows), cfg_.rank, h.offset, h.size,
              request ? "get request" : "landing", src);
    if (l.at == nullptr) return false;
    if (h.kind == kMsgPut && (h.flags & kMsgHasSignal) &&
        !known(0, h.flags & kMsgVa ? h.signal : cfg_.signalsOff + 8 * h.signal, 8, "signal", src))
      return false;
    if (h.kind == kMsgGetReply && src != getPeer_)
      return fail(who() + "GIN MPI network: a get reply from peer " + std::to_string(src) + ", expected " +
                  (getPeer_ < 0 ? std::string("none") : "one from peer " + std::to_string(getPeer_)));
    auto& q = landings_[src];
    if (h.kind != kMsgGetRequest && (h.flags & kMsgDataFollows)) {  // receives straight into the window, in order
      for (uint64_t off = 0; off < h.size; off += kMpiChunkBytes) {
        const uint64_t n = h.size - off < kMpiChunkBytes ? h.size - off : kMpiChunkBytes;
        l.reqs.push_back(MPI_REQUEST_NULL);
        rc = MPI_Irecv(l.at + off, (int)n, MPI_BYTE, src, cfg_.mpiTag, comm_, &l.reqs.back());
        if (rc != MPI_SUCCESS) return mpiError("MPI_Irecv", rc, src);
      }
    } else if (h.kind != kMsgGetRequest) {
      if (bodyBytes != h.size)
        return fail(who() + "GIN MPI network: a message from peer " + std::to_string(src) + " carries " +
                    std::to_string(bodyBytes) + " bytes of data, its header says " + std::to_string(h.size));
      if (q.empty()) {  // nothing of this source before it is unfinished: land it now
        if (h.size) landLines(l.at, rbuf_.data() + sizeof h, h.size);
        return finish(src, l);
      }
      l.held.assign(rbuf_.data() + sizeof h, rbuf_.data() + count);
    } else if (q.empty()) {
      return finish(src, l);
    }
    l.since = Clock::now();
    q.push_back(std::move(l));
    pendingLandings_++;
    return true;
  }

  // Receives what peers sent (up to a budget) and completes sends; how many, or -1.
  int progressMpi() {
    int n = 0;
    for (; n < 64; n++) {
      int flag = 0;
      MPI_Status st;
      const int rc = MPI_Iprobe(MPI_ANY_SOURCE, cfg_.mpiTag, comm_, &flag, &st);
      if (rc != MPI_SUCCESS) return mpiError("MPI_Iprobe", rc, -1), -1;
      if (!flag) break;
      if (!receive(st)) return -1;
    }
    const int landed = advanceLandings();
    const int reaped = landed < 0 ? -1 : reap();
    inFlight_.store(sends_.size() + pendingLandings_, std::memory_order_release);
    return reaped < 0 ? -1 : n + landed + reaped;
  }

  // A flush on the MPI network: every send completes (its source reusable), while this
  // engine keeps receiving (a peer's flush may wait on this rank's receives).
  bool completeSends(int32_t ctx) {
    return progressUntil([&] { return sends_.empty(); }, [&] {
      return "flushing context " + std::to_string(ctx) + " (expected its " + std::to_string(sends_.size()) +
             " sends to complete; the oldest goes to peer " + std::to_string(sends_.front().peer) + ")";
    });
  }

  // A get: asks `d.peer` and lands its reply before the get's slot is consumed.
  bool mpiGet(const GinDescriptor& d) {
    getPeer_ = d.peer;
    bool counted = false;
    if (!sendWithData(d.peer, MpiHeader{kMsgGetRequest, d.srcOffset, d.bytes, 0, d.dstOffset, 0, d.windows}, nullptr, 0,
                      false, nullptr, 0, &counted))
      return false;
    return progressUntil([&] { return getPeer_ < 0; }, [&] {
      return "getting " + std::to_string(d.bytes) + " bytes from peer " + std::to_string(d.peer) +
             " (expected its reply, seen none)";
    });
  }

  int network() { return mpi() ? progressMpi() : 0; }

  // The thread ends (stopped, or failed) with receives into the window still posted:
  // they are cancelled so that nothing writes the window after it is freed.
  void abandonLandings() {
    for (auto& q : landings_)
      for (auto& l : q)
        for (auto& r : l.reqs)
          if (r != MPI_REQUEST_NULL) {
            MPI_Cancel(&r);
            MPI_Request_free(&r);
          }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  // In flight, oldest first (taker only). Sends still in flight when the engine
  // is destroyed (after a failure) keep their staging buffers: MPI may still read them.
  std::deque<Send> sends_;
  std::vector<char> rbuf_;   // the message being received
  std::vector<std::deque<Landing>> landings_;  // per source: unfinished landings, oldest first
  uint64_t pendingLandings_ = 0;               // in landings_, all sources
  int32_t getPeer_ = -1;     // the peer whose get reply is awaited, or -1
#else
  bool completeSends(int32_t) { return fail(who() + "GIN MPI network: this engine was built without MPI"); }
  bool mpiGet(const GinDescriptor&) { return completeSends(0); }
  bool mpiPut(const GinDescriptor&, const char*, uint64_t, uint64_t, bool, uint64_t, bool*) { return completeSends(0); }
  int network() { return 0; }
  void abandonLandings() {}
#endif

  CommrefGinEngineConfig cfg_;
  std::vector<uint64_t> peers_;
  // The windows given by addWindow, by id (entry 0 unused: the connection window is
  // here_ and peers_); bytes 0 where none.
  struct Window {
    std::atomic<uint64_t> bytes{0};
    uint64_t base = 0;
    std::vector<uint64_t> peers;
  };
  std::unique_ptr<Window[]> windows_{new Window[COMMREF_GIN_MAX_WINDOWS]};
  GinDescriptor* ring_;
  uint64_t* consumed_;
  const uint64_t* claimed_;
  uint32_t* idle_;  // the queue's idle word (the engine alone stores it)
  uint64_t* helperFn_;   // the queue's help hook (gin.h): the function, 0 when none ...
  uint64_t* helperCtx_;  // ... and its argument (this engine)
  // Whoever holds it takes descriptors: the engine thread, or a kernel waiting on the
  // queue (help()). So descriptors are taken one at a time, in slot order, as before; the
  // state below marked "taker only" is touched under it.
  std::atomic<bool> taking_{false};
  char* here_;
  char* counters_;
  uint64_t next_ = 0;  // the next slot to take (taker only)
  // The wire model (taker only): whether it is on, the first slot not stamped
  // yet, each stamped slot's landing time, when the wire is next free, the head's time.
  const bool modeled_ = cfg_.wireBytesPerS > 0 || cfg_.wireLatencyNs > 0;
  uint64_t stamped_ = 0, wireFreeNs_ = 0;
  std::atomic<uint64_t> headDueNs_{0};  // stored by the taker, read by the engine thread
  std::vector<uint64_t> landsAt_ = std::vector<uint64_t>(modeled_ ? cfg_.capacity : 0);
  std::unordered_map<uint64_t, Link> links_;  // (peer, ctx) -> its link (taker only)
  uint64_t lastKey_ = 0;
  Link* lastLink_ = nullptr;
  std::atomic<bool> stop_{false}, exited_{false}, tracing_{false};
  std::atomic<uint64_t> ops_{0}, events_{0}, doorbells_{0}, inFlight_{0};
  std::atomic<uint64_t> byKernels_{0};  // of ops_, descriptors kernels took through the help hook
  std::atomic<int> failed_{0};
  std::mutex mu_;  // error_, trace_, traceLost_
  std::string error_;
  std::vector<CommrefGinTraceRecord> trace_;
  uint64_t traceCapacity_;
  uint64_t traceLost_ = 0;  // records not kept since the trace was last set
  std::thread thread_;
};

}  // namespace

COMMREF_GIN_API uint64_t commref_gin_engine_config_size() { return sizeof(CommrefGinEngineConfig); }
COMMREF_GIN_API uint64_t commref_gin_engine_trace_record_size() { return sizeof(CommrefGinTraceRecord); }
// sizeof(MPI_Comm) of the MPI this engine was built with (0: built without MPI), which
// native.py compares with mpi4py's before it hands over a handle.
COMMREF_GIN_API uint64_t commref_gin_engine_mpi_comm_size() {
#ifdef COMMREF_GIN_MPI
  return sizeof(MPI_Comm);
#else
  return 0;
#endif
}

COMMREF_GIN_API void* commref_gin_engine_create(const CommrefGinEngineConfig* c) {
  if (c == nullptr || c->capacity == 0 || c->nranks <= 0 || c->rank < 0 || c->rank >= c->nranks || !c->queueBase ||
      !c->windowBase || !c->peerWindows || !c->abortWord || (c->network != kNetworkShm && c->network != kNetworkMpi) ||
      (c->network == kNetworkMpi && (!kHaveMpi || !c->mpiComm)))
    return nullptr;
  try {
    return new Engine(*c);
  } catch (...) {
    return nullptr;
  }
}
COMMREF_GIN_API int commref_gin_engine_start(void* h) {
  try {
    static_cast<Engine*>(h)->start();
    return 0;
  } catch (...) {
    return 1;
  }
}
COMMREF_GIN_API int commref_gin_engine_stop(void* h, double timeoutS) { return static_cast<Engine*>(h)->stop(timeoutS); }
COMMREF_GIN_API void commref_gin_engine_destroy(void* h) { delete static_cast<Engine*>(h); }
// out: ops (descriptors taken), events (puts and signals landed), claimed, running, failed,
// doorbells (of the ops), in flight (MPI network: sends not complete, landings not finished),
// by kernels (of the ops, taken by kernels through the help hook).
COMMREF_GIN_API void commref_gin_engine_stats(void* h, uint64_t* out) { static_cast<Engine*>(h)->stats(out); }
COMMREF_GIN_API int commref_gin_engine_failed(void* h) { return static_cast<Engine*>(h)->failed(); }
COMMREF_GIN_API uint64_t commref_gin_engine_error(void* h, char* buf, uint64_t n) {
  return static_cast<Engine*>(h)->error(buf, n);
}
COMMREF_GIN_API void commref_gin_engine_set_trace(void* h, int on) { static_cast<Engine*>(h)->setTrace(on != 0); }
// Window `id` for descriptors' window ids (gin.h, "Windows"): this rank's `bytes` at
// `base`, and `peers`: uint64[nranks], each rank's copy mapped here (0: not mapped). 0, or
// 1 for a bad id, size or base.
COMMREF_GIN_API int commref_gin_engine_add_window(void* h, uint32_t id, uint64_t base, uint64_t bytes,
                                                  const uint64_t* peers) {
  return static_cast<Engine*>(h)->addWindow(id, base, bytes, peers);
}
COMMREF_GIN_API void commref_gin_engine_remove_window(void* h, uint32_t id) {
  static_cast<Engine*>(h)->removeWindow(id);
}
// Moves up to `max` records (oldest first) to `out`; *lost: records not kept (buffer full).
COMMREF_GIN_API uint64_t commref_gin_engine_take_trace(void* h, CommrefGinTraceRecord* out, uint64_t max,
                                                       uint64_t* lost) {
  return static_cast<Engine*>(h)->takeTrace(out, max, lost);
}
