// The native GIN progress engine: one std::thread per rank that carries the common case,
// the ORDERED wire on the SHM network (every GIN peer's window mapped in this process),
// at native speed. transports/gin/native.py (NativeProxy) drives it through the small
// extern "C" API at the bottom; transports/gin/proxy.py (GinProxy) stays the engine of
// the unordered wire, of the MPI network and of runs with an observer.
//
// What it does, per descriptor (include/commref/gin.h, the same protocol as
// transports/gin/queue.py's QueueReader): it takes slot `next` once the slot's seq reads
// next + 1 (acquire: the descriptor's fields, written before the producer's release
// store, are visible), executes it, and stores consumed = next + 1 with release. One
// thread takes every descriptor in slot order, so each (peer, ctx) is FIFO:
//   put:      memcpy src (this window) -> dst (peer window); counter (release add, this
//             rank's counters + 8*id) once the source is copied; signal (release add,
//             index: peer window + signals offset + 8*id, VA: peer window + offset);
//   putValue: the 8-byte value stored at dst of the peer, then its signal;
//   signal:   the signal alone;
//   get:      memcpy peer window src -> this window dst before the slot is consumed, so a
//             flush (which waits for consumed) covers it;
//   flush, doorbell: nothing more on this wire (everything lands when taken).
// Refusals follow proxy.py's _remote_action (strong signal on a weak-only backend, VA
// without VA signals, add where signals count writes): the message is recorded, the
// world's abort word raised (so kernels fail instead of hanging), and the thread ends.
//
// Polling: after `spin_polls` empty polls with a pause instruction, `yield_polls` polls
// with sched_yield, then sleeps that double from 1 us up to `sleep_max_ns` (the thread's
// timer slack is set to 1 us so that short sleeps are short). Any descriptor taken
// resets the backoff.
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
#include <sched.h>
#include <sys/prctl.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "commref/gin.h"

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
  int32_t nranks, rank;
  int32_t strongSignals, vaSignals, strongAlways, signalsCountWrites;  // the backend's capabilities
  int32_t trace;                                                       // record landings from the start
  int32_t spinPolls, yieldPolls, pad;
  uint64_t sleepMaxNs;     // longest idle sleep
  uint64_t traceCapacity;  // most trace records held at once (beyond: lost and counted)
  double timeoutS;         // stop(): how long to wait for the thread to end
  char backend[32];        // the backend's name, for messages
};

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

class Engine {
 public:
  explicit Engine(const CommrefGinEngineConfig& c) : cfg_(c) {
    const uint64_t* peers = reinterpret_cast<const uint64_t*>(c.peerWindows);
    peers_.assign(peers, peers + c.nranks);
    ring_ = reinterpret_cast<GinDescriptor*>(c.queueBase);
    consumed_ = reinterpret_cast<uint64_t*>(c.queueBase + c.capacity * sizeof(GinDescriptor) + COMMREF_GIN_QUEUE_CONSUMED);
    claimed_ = reinterpret_cast<const uint64_t*>(c.queueBase + c.capacity * sizeof(GinDescriptor) + COMMREF_GIN_QUEUE_CLAIMED);
    counters_ = reinterpret_cast<char*>(c.windowBase + c.countersOff);
    tracing_.store(c.trace != 0, std::memory_order_relaxed);
    traceCapacity_ = c.traceCapacity;
  }

  void start() { thread_ = std::thread([this] { run(); }); }

  // 0: the thread ended and was joined; 1: it did not end within the timeout (not joined).
  int stop(double timeoutS) {
    stop_.store(true, std::memory_order_release);
    if (!thread_.joinable()) return 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeoutS);
    while (!exited_.load(std::memory_order_acquire)) {
      if (std::chrono::steady_clock::now() > deadline) return 1;
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
  void run() {
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // 1 us: short sleeps stay short
    uint64_t idle = 0, sleepNs = 1000;
    const uint64_t spin = (uint64_t)cfg_.spinPolls, yields = spin + (uint64_t)cfg_.yieldPolls;
    while (!stop_.load(std::memory_order_acquire)) {
      const int took = drain(64);
      if (took < 0) break;
      if (took > 0) {
        idle = 0;
        sleepNs = 1000;
        continue;
      }
      if (++idle <= spin) {
        cpuPause();
      } else if (idle <= yields) {
        sched_yield();
      } else {
        struct timespec ts = {0, (long)sleepNs};
        nanosleep(&ts, nullptr);
        sleepNs = sleepNs * 2 < cfg_.sleepMaxNs ? sleepNs * 2 : cfg_.sleepMaxNs;
      }
    }
    exited_.store(true, std::memory_order_release);
  }

  // Takes up to `budget` published descriptors in slot order; how many, or -1 on error.
  int drain(int budget) {
    int took = 0;
    while (took < budget) {
      const uint64_t slot = next_;
      GinDescriptor* d = ring_ + slot % cfg_.capacity;
      if (__atomic_load_n(&d->seq, __ATOMIC_ACQUIRE) != slot + 1) break;  // not published yet
      const GinDescriptor c = *d;
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
      error_ = msg;
    }
    failed_.store(1, std::memory_order_release);
    __atomic_store_n(reinterpret_cast<uint64_t*>(cfg_.abortWord), 1, __ATOMIC_RELEASE);
    return false;
  }

  std::string who() const { return "rank " + std::to_string(cfg_.rank) + ": "; }

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

  bool execute(const GinDescriptor& d) {
    if (d.op == kGinFlush) {  // everything lands when taken
      if (tracing()) traceFlush(d.ctx);
      return true;
    }
    if (d.op == kGinDoorbell) {
      const uint64_t n = ++link(d.peer, d.ctx).doorbells;
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
    if (peer == nullptr)
      return fail(who() + "GIN peer " + std::to_string(d.peer) + "'s window is not mapped here (network shm)");
    char* here = reinterpret_cast<char*>(cfg_.windowBase);
    if (d.op == kGinGet) {
      std::memcpy(here + d.dstOffset, peer + d.srcOffset, d.bytes);
      if (tracing()) {
        const CommrefGinTraceRecord r{d.peer, d.ctx, kTraceGet, 0, 0, d.srcOffset, d.dstOffset, d.bytes, 0};
        record(&r, 1);
      }
      return true;
    }
    uint64_t* signal = nullptr;
    uint64_t value = 0;
    if (d.flags & kGinHasSignal) {
      const bool strong = d.flags & kGinStrongSignal, va = d.flags & kGinVaSignal, add = d.flags & kGinSignalAdd;
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
      signal = reinterpret_cast<uint64_t*>(peer + (va ? d.signal : cfg_.signalsOff + 8 * d.signal));
    }
    uint64_t nbytes = 0;
    if (d.op == kGinPut) {
      std::memcpy(peer + d.dstOffset, here + d.srcOffset, d.bytes);
      nbytes = d.bytes;
    } else if (d.op == kGinPutValue) {
      std::memcpy(peer + d.dstOffset, &d.bytes, 8);
      nbytes = 8;
    } else if (d.op != kGinSignal) {
      return fail(who() + "unknown GIN operation " + std::to_string(d.op));
    }
    const bool counter = d.op == kGinPut && (d.flags & kGinHasCounter);
    if (counter)  // the source is reusable from here on
      __atomic_fetch_add(reinterpret_cast<uint64_t*>(counters_ + 8 * (uint64_t)d.counter), 1, __ATOMIC_RELEASE);
    if (signal) __atomic_fetch_add(signal, value, __ATOMIC_RELEASE);  // after the data: release
    events_.fetch_add(1, std::memory_order_relaxed);
    const uint64_t seq = link(d.peer, d.ctx).seq++;
    if (tracing()) {  // what happened, in its order: the put posted, its data, its counter, its signal
      CommrefGinTraceRecord r[4];
      size_t n = 0;
      uint32_t flags = 0;
      if (signal) {
        flags = kTraceHasSignal | (d.flags & kGinVaSignal ? kTraceVa : 0) |
                ((d.flags & kGinStrongSignal) || cfg_.strongAlways ? kTraceStrong : 0);
      }
      r[n++] = {d.peer, d.ctx, kTracePost, flags, seq, d.dstOffset, nbytes, signal ? d.signal : 0, signal ? value : 0};
      if (nbytes) r[n++] = {d.peer, d.ctx, kTraceData, 0, seq, 0, 0, 0, 0};
      if (counter) r[n++] = {d.peer, d.ctx, kTraceCounter, 0, seq, d.counter, 0, 0, 0};
      if (signal) r[n++] = {d.peer, d.ctx, kTraceSignal, 0, seq, 0, 0, 0, 0};
      record(r, n);
    }
    return true;
  }

  CommrefGinEngineConfig cfg_;
  std::vector<uint64_t> peers_;
  GinDescriptor* ring_;
  uint64_t* consumed_;
  const uint64_t* claimed_;
  char* counters_;
  uint64_t next_ = 0;  // the next slot to take (engine thread only)
  std::unordered_map<uint64_t, Link> links_;  // (peer, ctx) -> its link (engine thread only)
  uint64_t lastKey_ = 0;
  Link* lastLink_ = nullptr;
  std::atomic<bool> stop_{false}, exited_{false}, tracing_{false};
  std::atomic<uint64_t> ops_{0}, events_{0};
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

COMMREF_GIN_API void* commref_gin_engine_create(const CommrefGinEngineConfig* c) {
  if (c == nullptr || c->capacity == 0 || c->nranks <= 0 || c->rank < 0 || c->rank >= c->nranks || !c->queueBase ||
      !c->windowBase || !c->peerWindows || !c->abortWord)
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
// out: ops (descriptors taken), events (puts and signals landed), claimed, running, failed.
COMMREF_GIN_API void commref_gin_engine_stats(void* h, uint64_t* out) { static_cast<Engine*>(h)->stats(out); }
COMMREF_GIN_API int commref_gin_engine_failed(void* h) { return static_cast<Engine*>(h)->failed(); }
COMMREF_GIN_API uint64_t commref_gin_engine_error(void* h, char* buf, uint64_t n) {
  return static_cast<Engine*>(h)->error(buf, n);
}
COMMREF_GIN_API void commref_gin_engine_set_trace(void* h, int on) { static_cast<Engine*>(h)->setTrace(on != 0); }
// Moves up to `max` records (oldest first) to `out`; *lost: records not kept (buffer full).
COMMREF_GIN_API uint64_t commref_gin_engine_take_trace(void* h, CommrefGinTraceRecord* out, uint64_t max,
                                                       uint64_t* lost) {
  return static_cast<Engine*>(h)->takeTrace(out, max, lost);
}
