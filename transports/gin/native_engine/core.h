// What every part of the native GIN engine shares: its configuration (native.py's
// EngineConfig mirrors it), the clock and pause helpers, and class Core: the windows a
// descriptor may address and the checks of every access against them, the counters,
// the engine's statistics, and its failure (a refusal, or a message).
//
// Refusals: a descriptor the engine cannot carry (gin.h, GinRefusalCode; the conditions
// and their order: device_kernels/abi.py, GIN_REFUSALS) is recorded as a GinRefusal,
// code and numbers; the host formats its message from the one table of texts
// (transports/gin/engine.py), the same the Python proxy raises. Anything else that ends
// the engine (an MPI error, a timeout) is a message made here. Either way the world's
// abort word is raised (so kernels fail instead of hanging), and the thread ends.
#pragma once

#include <sched.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "commref/gin.h"

// The engine is host code over the device headers' queue and window records.
using namespace commref;

#define COMMREF_GIN_API extern "C" __attribute__((visibility("default")))

// Configuration, mirrored field for field by native.py's EngineConfig (ctypes).
struct CommrefGinEngineConfig {
  uint64_t queueBase;    // address of the descriptor ring (window + ginQueueOff)
  uint64_t capacity;     // descriptors in the ring
  uint64_t windowBase;   // this rank's window
  uint64_t peerWindows;  // address of uint64[nranks]: each rank's window mapped here, 0 if not (copied)
  uint64_t signalsOff;   // WindowLayout.ginSignalsOff
  uint64_t countersOff;  // WindowLayout.ginCountersOff
  uint64_t abortWord;    // address of the world's abort word (uint64)
  uint64_t mpiComm;      // network mpi: the proxies' communicator (mpi4py's handle of a Dup), else 0
  int32_t network;       // kNetworkShm or kNetworkMpi
  int32_t mpiTag;        // network mpi: the tag of every message (one per GIN communicator)
  int32_t nranks, rank;
  int32_t strongSignals, vaSignals, strongAlways, signalsCountWrites;  // the backend's capabilities
  int32_t trace;                                                       // record landings from the start
  int32_t spinPolls, yieldPolls;
  int32_t kernelsHelp;      // network shm: install the queue's help hook (gin.h, "Help")
  uint64_t sleepMaxNs;      // longest idle sleep
  uint64_t traceCapacity;   // most trace records held at once (beyond: lost and counted)
  uint64_t windowBytes;     // every rank's window is this long: offsets are checked against it
  double timeoutS;          // stop() and the MPI network's waits: how long to wait
  double wireBytesPerS;     // the wire model (wire.h): this rank's wire sends this many bytes/s; 0: unlimited
  uint64_t wireLatencyNs;   // ... and an operation takes effect this long after it is sent
  uint64_t streamMinBytes;  // network shm: bulk puts (kGinBulk) from this size land with non-temporal stores; 0: never
  int32_t unordered;        // the unordered wire (unordered.h), else the ordered one
  int32_t duplicates;       // unordered: every segment is placed a second time after its original
  int32_t flushOrdersLaterWrites;  // the backend promises that local completion orders later writes (gda)
  int32_t releasePolls;            // unordered: held puts are released once the queue was found empty this many times
  int32_t overtakenPolls;          // ... while a held put was overtaken by a later put's signal: this many times, or
  uint64_t overtakenNs;            // ... for this long since the first of them, if that is sooner
  int32_t independentContexts;     // ordered: contexts as separate ordering domains (contexts.h)
  int32_t batched;                 // unordered: kernels ring doorbells; links served at them from the first put
  int32_t paths;                   // unordered: packets sprayed over this many paths (unordered.h); 1: no spraying
  uint64_t seed;                   // the unordered wire's streams
  uint64_t segmentBytes;           // the unordered wire's unit of placement
  uint64_t plant;                  // tests only: planted bugs (kPlant*), 0 in every real run
  double faultDrop, faultDup, faultDelay;  // the lossy link (lossy.h): probabilities; all 0: no lossy link
  uint64_t faultRetransmitNs;              // ... a packet not acknowledged this long after it was sent is sent again
  uint64_t faultMaxDelayNs;                // ... a late copy arrives up to this long after it was sent
  uint64_t faultTransmissions;             // ... transmissions of a packet before it is undeliverable
  char backend[32];                        // the backend's name (the host names it in messages)
};

enum : int32_t { kNetworkShm = 0, kNetworkMpi = 1 };

// Planted bugs, for the tests that must catch them (native.py's PLANT_*): the strong flag
// cleared from every descriptor as it is taken; a put of more than kPlantBytes whose
// signal is applied before its data is copied.
enum : uint64_t { kPlantStripStrong = 1, kPlantSignalFirst = 2 };
constexpr uint64_t kPlantBytes = 4096;

namespace {

inline void cpuPause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

using Clock = std::chrono::steady_clock;

inline struct timespec timespecOf(uint64_t ns) { return {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)}; }

inline uint64_t nowNs() {
  return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// The links (peer, ctx) of one part of the engine (the unordered wire, the lossy link,
// independent contexts), keyed by both numbers; a link is made on first use with its
// `peer` and `ctx` set. Nodes do not move, so a link's address stays valid. Taker only.
template <typename L>
class LinkMap {
 public:
  static uint64_t key(int32_t peer, int32_t ctx) { return ((uint64_t)(uint32_t)peer << 32) | (uint32_t)ctx; }

  // The link (peer, ctx); `made(link)` runs once, on a link just made.
  template <typename Made>
  L& at(int32_t peer, int32_t ctx, Made made) {
    auto it = map_.find(key(peer, ctx));
    if (it == map_.end()) {
      it = map_.emplace(key(peer, ctx), L{}).first;
      it->second.peer = peer;
      it->second.ctx = ctx;
      made(it->second);
    }
    return it->second;
  }
  L& at(int32_t peer, int32_t ctx) {
    return at(peer, ctx, [](L&) {});
  }
  // The link (peer, ctx), or null where none was made.
  L* find(int32_t peer, int32_t ctx) {
    auto it = map_.find(key(peer, ctx));
    return it == map_.end() ? nullptr : &it->second;
  }
  // (key, link) pairs, in no particular order.
  auto begin() { return map_.begin(); }
  auto end() { return map_.end(); }

 private:
  std::unordered_map<uint64_t, L> map_;
};

class Core {
 public:
  explicit Core(const CommrefGinEngineConfig& c) : cfg_(c) {
    const uint64_t* peers = reinterpret_cast<const uint64_t*>(c.peerWindows);
    peers_.assign(peers, peers + c.nranks);
    here_ = reinterpret_cast<char*>(c.windowBase);
    counters_ = here_ + c.countersOff;
  }

  // ---- failure ----

  // Ends the engine with `msg` (the first failure is kept); false, for `return fail(...)`.
  bool fail(const std::string& msg) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (error_.empty() && !refused_) error_ = msg;
    }
    return raise();
  }

  // Ends the engine refusing a descriptor (the first failure is kept); false.
  bool refuse(const GinRefusal& r) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (error_.empty() && !refused_) {
        refusal_ = r;
        refused_ = true;
      }
    }
    return raise();
  }

  std::string who() const { return "rank " + std::to_string(cfg_.rank) + ": "; }

  int failed() const { return failed_.load(std::memory_order_acquire); }

  // The failure's message (0 bytes when it is a refusal or there is none).
  size_t error(char* buf, size_t n) {
    if (!failed()) return 0;
    std::lock_guard<std::mutex> g(mu_);
    if (n) std::snprintf(buf, n, "%s", error_.c_str());
    return error_.size();
  }

  // 1 (and *out) when the engine failed refusing a descriptor, else 0.
  int refusal(GinRefusal* out) {
    if (!failed()) return 0;
    std::lock_guard<std::mutex> g(mu_);
    if (refused_) *out = refusal_;
    return refused_ ? 1 : 0;
  }

  // ---- windows (gin.h, "Windows") ----

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

  // The bytes of window `id` (every rank's copy has them), 0 where the id names none.
  uint64_t windowBytes(uint32_t id) const {
    if (id == 0) return cfg_.windowBytes;
    return id < COMMREF_GIN_MAX_WINDOWS ? windows_[id].bytes.load(std::memory_order_acquire) : 0;
  }

  // Whether [offset, offset + bytes) lies in window `id`; refuses (naming `access` of
  // operation `op` to or from `peer`) if not.
  bool known(uint32_t id, uint64_t offset, uint64_t bytes, uint32_t access, uint32_t op, int32_t peer) {
    const uint64_t size = windowBytes(id);
    if (size == 0) return refuse({kGinRefuseWindowUnknown, access, op, peer, 0, id, offset, bytes, 0});
    if (offset > size || bytes > size - offset)
      return refuse({kGinRefuseOutsideWindow, access, op, peer, 0, id, offset, bytes, size});
    return true;
  }

  // Where [offset, offset + bytes) of rank `rank`'s copy of window `id` is mapped here;
  // nullptr (refused) outside it, or where it is not mapped.
  char* at(uint32_t id, int32_t rank, uint64_t offset, uint64_t bytes, uint32_t access, uint32_t op, int32_t peer) {
    if (!known(id, offset, bytes, access, op, peer)) return nullptr;
    const uint64_t base = id == 0 ? (rank == cfg_.rank ? (uint64_t)here_ : peers_[rank])
                                  : (rank == cfg_.rank ? windows_[id].base : windows_[id].peers[rank]);
    if (base == 0) {
      refuse({kGinRefuseWindowUnmapped, access, op, peer, rank, id, offset, bytes, 0});
      return nullptr;
    }
    return reinterpret_cast<char*>(base) + offset;
  }

  void bumpCounter(uint32_t id) {  // the source is reusable from here on
    __atomic_fetch_add(reinterpret_cast<uint64_t*>(counters_ + 8 * (uint64_t)id), 1, __ATOMIC_RELEASE);
  }

  const CommrefGinEngineConfig cfg_;
  std::vector<uint64_t> peers_;  // each rank's connection window mapped here, 0 where not
  char* here_;                   // this rank's connection window
  char* counters_;
  // Statistics (native.py's stats): descriptors taken, puts and signals landed (network
  // mpi: sent), doorbells, MPI sends and landings in flight, descriptors kernels took,
  // puts taken and not fully landed (unordered wire), of them held.
  std::atomic<uint64_t> ops_{0}, events_{0}, doorbells_{0}, inFlight_{0}, byKernels_{0}, pending_{0}, held_{0};
  std::atomic<int> failed_{0};

 private:
  bool raise() {
    failed_.store(1, std::memory_order_release);
    __atomic_store_n(reinterpret_cast<uint64_t*>(cfg_.abortWord), 1, __ATOMIC_RELEASE);
    return false;
  }

  // The windows given by addWindow, by id (entry 0 unused: the connection window is
  // here_ and peers_); bytes 0 where none.
  struct Window {
    std::atomic<uint64_t> bytes{0};
    uint64_t base = 0;
    std::vector<uint64_t> peers;
  };
  std::unique_ptr<Window[]> windows_{new Window[COMMREF_GIN_MAX_WINDOWS]};
  std::mutex mu_;  // error_, refusal_, refused_
  std::string error_;
  GinRefusal refusal_{};
  bool refused_ = false;
};

}  // namespace
