// The native GIN progress engine: one std::thread per rank that carries the ordered and
// the unordered wire at native speed, on the SHM network (every GIN peer's window mapped
// in this process) and, built with COMMREF_GIN_MPI (native.py's mpi_library()), on the
// MPI network. transports/gin/native.py (NativeProxy) drives it through the small
// extern "C" API at the bottom; transports/gin/proxy.py (GinProxy) stays the engine of
// runs with an observer and of a lossy ordered wire. Both implement engine.py's GinEngine.
//
// One translation unit (native.py builds it) of the parts, one concept each:
//   core.h    configuration, windows and the checks of every access, counters,
//             statistics, failure and refusals
//   wire.h    ordered delivery per (peer, ctx) link, the trace, the wire model
//   unordered.h the unordered wire: held puts, doorbells, seeded landing orders
//   contexts.h  independent contexts on the ordered wire
//   lossy.h   the lossy link under the unordered wire, and its reliability layer
//   idle.h    the idle word the thread sleeps on, when it polls after all, the help
//             hooks, when held puts are released
//   shm_net.h the SHM network: landing in mapped peer windows
//   mpi_net.h the MPI network: messages to the peer's engine
//   this file the engine: reading the queue, executing descriptors, the progress loop
//
// What it does, per descriptor: docs/gin.md, "Threads and words" (the protocol of gin.h,
// as transports/gin/queue.py's QueueReader). One taker at a time (the engine thread, or on
// network shm a CPU kernel through the help hook; `taking_` decides) takes every
// descriptor in slot order, so each (peer, ctx) is FIFO. Every access is checked against
// its window first (Core::at, Core::known); refusals end the engine (core.h).
//
// Polling (docs/gin.md, "Polling"): `spin_polls` empty polls with a pause, `yield_polls`
// with sched_yield, then sleeps (idle.h) doubling from 1 us to `sleep_max_ns`; where kernels
// help and nothing needs a clock (helped_), it sleeps from the first empty poll unless
// traffic was heavy lately (BusyWatch). Work resets the backoff; MPI in flight: yields.
#include <sys/prctl.h>

#include <thread>

#include "contexts.h"
#include "core.h"
#include "idle.h"
#include "lossy.h"
#include "mpi_net.h"
#include "shm_net.h"
#include "unordered.h"
#include "wire.h"

namespace {

class Engine : public Core {
 public:
  explicit Engine(const CommrefGinEngineConfig& c)
      : Core(c),
        delivery_(c),
        wire_(cfg_, reinterpret_cast<const GinDescriptor*>(c.queueBase)),
        shm_(c),
        mpi_(*this, delivery_),
        uw_(cfg_),
        ch_(cfg_),
        lossy_(cfg_) {
    ring_ = reinterpret_cast<GinDescriptor*>(c.queueBase);
    const uint64_t header = c.queueBase + c.capacity * sizeof(GinDescriptor);  // gin.h: the words after the ring
    consumed_ = reinterpret_cast<uint64_t*>(header + COMMREF_GIN_QUEUE_CONSUMED);
    claimed_ = reinterpret_cast<const uint64_t*>(header + COMMREF_GIN_QUEUE_CLAIMED);
    idle_ = IdleWord(reinterpret_cast<uint32_t*>(header + COMMREF_GIN_QUEUE_IDLE));
    hooks_ = HelpHooks(reinterpret_cast<uint64_t*>(header + COMMREF_GIN_QUEUE_HELP_FN));
  }

  void start() {
    // On network shm the CPU engine's kernels may take descriptors too (gin.h, "Help"). On
    // network mpi they do not: MPI progress from kernel threads measured no faster there, and
    // slowed the other communicators of the process.
    const bool help = kernelsHelp();
    helped_ = help && !wire_.modeled && !lossy_.active();  // before the thread reads it
    thread_ = std::thread([this] { run(); });
    if (help) hooks_.install(&Engine::helpHook, cfg_.unordered ? &Engine::endHook : nullptr, this);
  }

  // A kernel's turn at the queue (the help hook, network shm): takes what is published, if
  // no other thread is taking descriptors now; how many it took.
  static int helpHook(void* engine) { return static_cast<Engine*>(engine)->help(); }
  // A block that helped ends (gin.h; the hook is installed on the unordered wire only):
  // it makes the empty polls its next waits would have made while puts are held, up to
  // the count that releases an overtaken one (HeldRelease). On the ordered wire held
  // contexts (independent contexts) stay held for the next kernel's contexts to overtake.
  static void endHook(void* engine) { static_cast<Engine*>(engine)->ended(); }
  void ended() {
    if (stop_.load(std::memory_order_relaxed) || failed_.load(std::memory_order_relaxed)) return;
    int took = 0;
    for (int i = 0, n = 0; i < cfg_.overtakenPolls && n >= 0 && held_.load(std::memory_order_relaxed); i++) {
      take();                  // waits for its turn, unlike help(): each of these polls counts
      n = drain(kTakeBudget);  // a failure sets failed_: the engine thread ends
      release();
      if (n > 0) took += n;
    }
    if (took) byKernels_.fetch_add((uint64_t)took, std::memory_order_relaxed);
  }
  int help() {
    if (stop_.load(std::memory_order_relaxed) || failed_.load(std::memory_order_relaxed)) return 0;
    if (!published(__atomic_load_n(consumed_, __ATOMIC_ACQUIRE)) && !held_.load(std::memory_order_relaxed) &&
        !lossyOut_.load(std::memory_order_relaxed))
      return 0;  // nothing to take, nothing held or outstanding: no RMW
    int took = 0, empty = 0;
    // Looks again after letting go (gin.h, "Help"); a second empty pass ends (wire model).
    for (;;) {
      if (!tryTake()) break;
      const int n = drain(kTakeBudget);  // a failure sets failed_: the engine thread ends
      release();
      if (n < 0 || (n == 0 && ++empty > 1)) break;
      took += n;
      std::atomic_thread_fence(std::memory_order_seq_cst);  // the release before the look
      if (!published(__atomic_load_n(consumed_, __ATOMIC_ACQUIRE))) break;
    }
    if (took) byKernels_.fetch_add((uint64_t)took, std::memory_order_relaxed);
    if (!helped_ || (took && busy_.lately())) wake();  // a clock to keep, or bulk to copy beside kernels
    return took;
  }

  void park(bool on) { parked_.store(on, std::memory_order_seq_cst), wake(); }  // parked: 20 ms sleeps; rung: awake
  // 0: the thread ended and was joined; 1: it did not end within the timeout (not joined).
  int stop(double timeoutS) {
    stop_.store(true, std::memory_order_seq_cst);
    hooks_.clear();  // no new helper; wait out one inside drain()
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
    out[8] = pending_.load(std::memory_order_acquire);
  }

  uint64_t running() const { return thread_.joinable() && !exited_.load(std::memory_order_acquire); }

  Delivery& delivery() { return delivery_; }
  void faultStats(uint64_t* out) const { lossy_.stats(out); }

 private:
  bool mpi() const { return cfg_.network == kNetworkMpi; }
  bool kernelsHelp() const { return !mpi() && cfg_.kernelsHelp; }
  auto failWith() {  // a failure's callback: the message, named by this rank
    return [this](const std::string& m) { return fail(who() + m); };
  }

  // ---- the progress loop ----

  void run() {
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);   // 1 us: short sleeps stay short
    prctl(PR_SET_NAME, "commref-gin", 0, 0, 0);  // as top and perf name it
    uint64_t idle = 0, sleepNs = 1000, heldPolls = 0;
    constexpr uint64_t kYieldEvery = 8;
    const uint64_t spin = (uint64_t)cfg_.spinPolls, yields = spin + (uint64_t)cfg_.yieldPolls;
    while (!stop_.load(std::memory_order_acquire) && !failed_.load(std::memory_order_acquire)) {
      int took = 0, moved = 0;            // descriptors taken; messages received and sends completed (MPI)
      const bool contended = !tryTake();  // another taker holds the queue: it looks again as it lets go
      if (!contended) {
        took = drain(kTakeBudget);
        if (took >= 0) moved = mpi() ? mpi_.progress() : 0;
        release();
      }
      if (took < 0 || moved < 0) break;
      if (took > 0 || moved > 0 || waitingForWire()) {
        idle = 0;
        sleepNs = 1000;
        continue;
      }
      if (helped_ && !parked_.load(std::memory_order_relaxed) && !busy_.lately()) {  // kernels take theirs: sleep
        // Contended, it sleeps all the same, and long: waking soon would keep a taker
        // preempted on this core from the queue.
        const bool nap = held_.load(std::memory_order_relaxed) && !contended && sleepNs > kHeldNapNs;
        sleep(nap ? kHeldNapNs : sleepNs, true, true, contended);
        sleepNs = sleepNs * 2 < cfg_.sleepMaxNs ? sleepNs * 2 : cfg_.sleepMaxNs;
        continue;
      }
      if (lossyOut_.load(std::memory_order_relaxed) && !held_.load(std::memory_order_relaxed) && kernelsHelp()) {
        const uint64_t due = lossyDueNs_.load(std::memory_order_relaxed), now = nowNs();  // its next timer:
        if (due > now + kLossyNapMinNs) {  // sleeps toward it; waiting kernels help (progress) meanwhile
          sleep(due - now);
          continue;
        }
      }
      if (held_.load(std::memory_order_relaxed) || lossyOut_.load(std::memory_order_relaxed)) {
        // unordered: each empty poll counts toward a release; the lossy link's timers run
        // Every kYieldEvery-th poll while an overtaken put is held yields: a receiver
        // sharing this core gets to act on the signal that overtook it.
        if (overtaken_.load(std::memory_order_relaxed) && heldPolls++ % kYieldEvery == 0)
          sched_yield();
        else
          cpuPause();
        continue;
      }
      heldPolls = 0;
      if (parked_.load(std::memory_order_acquire) && !inFlight_.load(std::memory_order_relaxed)) {
        sleep(20'000'000);  // bounded: a ring racing sleep()'s checks is not lost for long
      } else if (++idle <= spin) {
        cpuPause();
      } else if (idle <= yields || inFlight_.load(std::memory_order_relaxed)) {  // MPI needs polls to move data
        sched_yield();
      } else {
        sleep(sleepNs);
        sleepNs = sleepNs * 2 < cfg_.sleepMaxNs ? sleepNs * 2 : cfg_.sleepMaxNs;
      }
    }
    take();  // a helper leaves first
    mpi_.abandon();
    release();
    exited_.store(true, std::memory_order_release);
  }

  // The taker's turn (taking_, below): try once, wait for it, give it back.
  bool tryTake() { return !taking_.exchange(true, std::memory_order_acquire); }
  void take() {
    while (!tryTake()) std::this_thread::yield();
  }
  void release() {  // the unordered wire's streamed stores fenced first (shm_net.h)
    shm_.settle();
    taking_.store(false, std::memory_order_release);
  }

  // The wire model holds the head back (published, not due): waits toward its time.
  bool waitingForWire() {
    if (!wire_.modeled || !published(__atomic_load_n(consumed_, __ATOMIC_ACQUIRE))) return false;
    wire_.awaitHead();
    return true;
  }

  bool published(uint64_t slot) const {
    return __atomic_load_n(&ring_[slot % cfg_.capacity].seq, __ATOMIC_ACQUIRE) == slot + 1;
  }

  // Sleeps until rung, stopped, or `ns` pass; not while something is published (unless
  // `contended`: its taker looks again) or, unless `whileHeld`, while puts are held.
  // `kernelsTake`: helping kernels need not ring (gin.h).
  void sleep(uint64_t ns, bool whileHeld = false, bool kernelsTake = false, bool contended = false) {
    idle_.sleep(ns, kernelsTake ? kGinIdleKernelsTake : kGinIdleRingAll, [&] {
      return (!contended && published(__atomic_load_n(consumed_, __ATOMIC_ACQUIRE))) ||
             stop_.load(std::memory_order_seq_cst) || (!whileHeld && held_.load(std::memory_order_relaxed));
    });
  }
  void wake() { idle_.wake(); }

  // ---- reading the queue ----

  // Takes up to `budget` published descriptors in slot order; how many, or -1 on error.
  int drain(int budget) {
    int took = 0;
    uint64_t bytes = 0;  // put and get bytes taken
    if (lossy_.active() && !lossy_.progress([this](const Packet& q) { return deliver(q); }, failWith())) return -1;
    while (took < budget) {
      const uint64_t slot = next_;
      if (!published(slot)) {
        if ((cfg_.unordered || cfg_.independentContexts) && !idleUnordered(took)) return -1;
        break;
      }
      if (wire_.modeled && !wire_.due(slot, next_, [this](uint64_t s) { return published(s); })) break;
      const GinDescriptor c = ring_[slot % cfg_.capacity];
      if (!execute(c)) return -1;
      next_ = slot + 1;
      __atomic_store_n(consumed_, next_, __ATOMIC_RELEASE);  // frees the entry, completes flushes
      ops_.fetch_add(1, std::memory_order_release);
      took++;
      if (c.op == kGinPut || c.op == kGinGet) bytes += c.bytes;
    }
    if (helped_ && took) busy_.took(took, kTakeBudget, bytes);
    if (cfg_.unordered || cfg_.independentContexts) {
      pending_.store(uw_.pending() + ch_.pending() + lossy_.outstanding(), std::memory_order_release);
      lossyOut_.store(lossy_.outstanding(), std::memory_order_relaxed);
      lossyDueNs_.store(lossy_.nextDueNs(), std::memory_order_relaxed);
      held_.store(uw_.held() + ch_.held(), std::memory_order_relaxed);
      overtaken_.store(uw_.overtaken() + ch_.held(), std::memory_order_relaxed);  // a held context: overtaken
    }
    return took;
  }

  // ---- the unordered wire (unordered.h) ----

  // The landing callback: carries one of the wire's landings on this engine's network.
  auto landing() {
    return [this](const Landing& e) { return carry(e); };
  }
  // The landing callbacks of contexts.h: what is left of an op, one segment of it.
  template <typename E>
  struct Whole {
    E* e;
    bool operator()(Pending& p) const { return e->landWhole(p); }
  };
  template <typename E>
  struct Seg {
    E* e;
    bool operator()(Pending& p, uint64_t k) const { return e->landSegment(p, k); }
  };
  Whole<Engine> wholeFn() { return {this}; }
  Seg<Engine> segFn() { return {this}; }

  // The queue was found empty after taking `took`: links without doorbells land; held
  // puts are released when HeldRelease says (a held context counts as overtaken). False
  // on error.
  bool idleUnordered(int took) {
    std::string why;
    if (!uw_.serveUnrung(landing(), &why)) return failUnordered(why);
    if (!heldRelease_.poll(took, uw_.held() + ch_.held(), uw_.overtaken() || ch_.held())) return true;
    auto release = [this](const Pending& p, uint32_t why) { traceHeld(p, kTraceRelease, why); };
    if (cfg_.independentContexts) return ch_.releaseIdle(wholeFn(), segFn(), release);
    return uw_.releaseHeld(release, landing(), &why) || failUnordered(why);
  }

  // ---- independent contexts on the ordered wire (contexts.h) ----

  bool landSegment(Pending& p, uint64_t k) {
    p.landed[k]++;
    p.dataLeft--;
    return carry(Landing{&p, (int64_t)k, 0});
  }

  // What is left of op `p`, in order: its data in one piece when none of it has landed
  // (else it has: the segments of a cut op), then its signal.
  bool landWhole(Pending& p) {
    const bool wasDone = p.done();
    if (p.dataLeft && p.dataLeft == p.landed.size()) {
      if (mpi()) {
        if (p.stagedSrc) {  // staged: segment by segment, each inline (a staged copy may not outlive its send)
          for (uint64_t k = 0; k < p.landed.size(); k++)
            if (!landSegment(p, k)) return false;
        } else {
          GinDescriptor put{};
          put.peer = p.peer;
          put.ctx = p.ctx;
          put.dstOffset = p.dstOffset;
          put.counter = p.counterId;
          put.windows = ginWindows(0, p.dstWin);
          bool counted = false;
          if (!mpi_.put(put, p.src, p.nbytes, 0, p.counter && !p.counted, p.seq, &counted)) return false;
          p.counted = p.counter;  // bumped here, or when its sends complete
          if (counted) traceHeld(p, kTraceCounter, p.counterId);
        }
      } else {
        shm_.land(p.dst, p.src, p.nbytes, p.bulk);
        count(p);
      }
      std::fill(p.landed.begin(), p.landed.end(), 1);
      p.dataLeft = 0;
      if (!(mpi() && p.stagedSrc)) trace(p.peer, p.ctx, kTraceData, p.seq);
    }
    if (p.hasSignal && !p.signalDone) {
      p.signalDone = true;
      if (!signalOf(p)) return false;
    }
    if (p.nbytes == 0) count(p);
    if (!wasDone) events_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  bool postIndependent(const GinDescriptor& d, const char* src, char* dst, uint64_t nbytes, uint64_t value) {
    Pending p = pendingOf(d, src, dst, nbytes, value);
    p.seq = delivery_.link(d.peer, d.ctx).seq++;
    p.landed.assign(p.nseg(uw_.segmentBytes()), 0);
    p.dataLeft = p.landed.size();
    if (delivery_.tracing()) delivery_.tracePost(d, p.seq, nbytes, value, cfg_.strongAlways);
    auto hold = [this](const Pending& q, uint64_t ops) { traceHeld(q, kTraceHold, ops); };
    auto release = [this](const Pending& q, uint32_t why) { traceHeld(q, kTraceRelease, why); };
    return ch_.post(std::move(p), wholeFn(), segFn(), hold, release);
  }

  bool failUnordered(const std::string& why) { return failed() ? false : fail(who() + "unordered GIN wire: " + why); }

  // One trace record of `kind` (wire.h, the trace) when tracing.
  void trace(int32_t peer, int32_t ctx, uint32_t kind, uint64_t seq, uint64_t a = 0, uint64_t b = 0) {
    if (!delivery_.tracing()) return;
    const CommrefGinTraceRecord r{peer, ctx, kind, 0, seq, a, b, 0, 0};
    delivery_.record(&r, 1);
  }
  void traceHeld(const Pending& p, uint32_t kind, uint64_t a) { trace(p.peer, p.ctx, kind, p.seq, a); }

  // A put's source copied into the put (it is reusable from here on) and its counter bumped.
  void stage(Pending& p) {
    if (!p.stagedSrc && p.nbytes) {
      p.staged.assign(p.src, p.src + p.nbytes);
      p.src = p.staged.data();
      p.stagedSrc = true;
    }
    count(p);
  }

  void count(Pending& p) {
    if (!p.counter || p.counted) return;
    bumpCounter(p.counterId);
    p.counted = true;
    traceHeld(p, kTraceCounter, p.counterId);
  }

  // One landing of the unordered wire, as a packet: over the lossy link (lossy.h) when
  // faults are on, else delivered at once.
  bool carry(const Landing& e) {
    Pending& p = *e.put;
    if (e.segment < 0 ? !signalOf(p) : !carrySegment(p, e)) return false;
    if (p.done()) events_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  bool carrySegment(Pending& p, const Landing& e) {
    uint64_t off = 0, n = 0;
    p.segment(uw_.segmentBytes(), (uint64_t)e.segment, &off, &n);
    Packet k = Packet::of(p);
    std::tie(k.dstOffset, k.nbytes, k.whole) = std::tie(off, n, p.nbytes);
    k.dst = p.dst ? p.dst + (off - p.dstOffset) : nullptr;
    k.src = p.src + (off - p.dstOffset);
    std::tie(k.ahead, k.aheadBytes) = std::tie(e.ahead, e.aheadBytes);
    if (!send(std::move(k))) return false;
    trace(p.peer, p.ctx, kTraceSeg, p.seq, (uint64_t)e.segment, e.copy);
    if (p.dataLeft == 0) count(p);  // its bytes are sent (or copied): the source is reusable
    return true;
  }

  bool signalOf(const Pending& p) {
    Packet k = Packet::of(p);
    k.isSignal = true;
    if (!send(std::move(k))) return false;
    trace(p.peer, p.ctx, kTraceSignal, p.seq);
    return true;
  }

  bool send(Packet&& k) {
    if (!lossy_.active()) return deliver(k);
    return lossy_.send(std::move(k), [this](const Packet& q) { return deliver(q); }, failWith());
  }

  // Lands one packet on this engine's network.
  bool deliver(const Packet& k) {
    if (mpi()) return mpi_.deliver(k);
    shm_.deliver(k, reinterpret_cast<char*>(peers_[k.peer]));
    return true;
  }

  // A put (putValue, signal) taken onto the unordered wire: posted, landing at its doorbell.
  bool postUnordered(const GinDescriptor& d, const char* src, char* dst, uint64_t nbytes, uint64_t value) {
    Pending& q = uw_.post(pendingOf(d, src, dst, nbytes, value));
    if (delivery_.tracing()) delivery_.tracePost(d, q.seq, nbytes, value, cfg_.strongAlways);
    if ((cfg_.plant & kPlantSignalFirst) && nbytes > kPlantBytes && q.hasSignal) {
      q.signalDone = true;  // planted: the signal before any of its data
      if (!signalOf(q)) return false;
    }
    if (q.nbytes == 0 && !q.hasSignal) count(q);
    return true;
  }

  // A put (putValue, signal) as the wires hold it (seq, segments and flush marks: theirs).
  Pending pendingOf(const GinDescriptor& d, const char* src, char* dst, uint64_t nbytes, uint64_t value) {
    Pending p;
    p.peer = d.peer;
    p.ctx = d.ctx;
    p.hasSignal = d.flags & kGinHasSignal;
    p.va = d.flags & kGinVaSignal;
    p.strong = p.hasSignal && ((d.flags & kGinStrongSignal) || cfg_.strongAlways);
    p.counter = d.op == kGinPut && (d.flags & kGinHasCounter);
    p.counterId = d.counter;
    p.dstWin = ginDstWindow(d.windows);
    p.signal = d.signal;
    p.value = value;
    p.dstOffset = d.dstOffset;
    p.nbytes = nbytes;
    p.bulk = d.flags & kGinBulk;
    p.src = src;
    p.dst = dst;
    if (d.op == kGinPutValue) {  // its value lives in the descriptor
      p.staged.assign(src, src + 8);
      p.src = p.staged.data();
      p.stagedSrc = true;
    }
    return p;
  }

  bool doorbellUnordered(const GinDescriptor& d) {
    std::string why;
    auto hold = [this](const Pending& p, uint64_t until) { traceHeld(p, kTraceHold, until); };
    auto release = [this](const Pending& p, uint32_t why) { traceHeld(p, kTraceRelease, why); };
    return uw_.doorbell(uw_.link(d.peer, d.ctx), hold, release, landing(), &why) || failUnordered(why);
  }

  // ---- executing a descriptor ----

  // Carries one descriptor; false when it was refused or failed (the engine ends). The
  // checks run in abi.GIN_REFUSALS' order, as the Python proxy's do.
  bool execute(const GinDescriptor& taken) {
    GinDescriptor d = taken;
    if (cfg_.plant & kPlantStripStrong) d.flags &= ~(uint32_t)kGinStrongSignal;  // planted
    if (d.op == kGinFlush) {  // shm: everything landed when taken; mpi: every send completes first
      if (cfg_.unordered) {   // the sources of what is not landed yet are copied: reusable
        auto stageIt = [this](Pending& p) { stage(p); };
        auto traced = [this](int32_t peer, int32_t ctx) { trace(peer, ctx, kTraceFlush, 0); };
        uw_.flush(d.ctx, stageIt, traced);
      }
      if (cfg_.independentContexts) ch_.flush(d.ctx, [this](Pending& p) { stage(p); });
      if (mpi() && !mpi_.completeSends(d.ctx)) return false;
      if (!cfg_.unordered && delivery_.tracing()) delivery_.traceFlush(d.ctx);
      return true;
    }
    if (d.op == kGinDoorbell && cfg_.unordered) {
      doorbells_.fetch_add(1, std::memory_order_relaxed);
      if (delivery_.tracing()) trace(d.peer, d.ctx, kTraceDoorbell, uw_.link(d.peer, d.ctx).doorbells + 1);
      return doorbellUnordered(d);
    }
    if (d.op == kGinDoorbell) {
      const uint64_t n = ++delivery_.link(d.peer, d.ctx).doorbells;
      doorbells_.fetch_add(1, std::memory_order_relaxed);
      trace(d.peer, d.ctx, kTraceDoorbell, n);
      return true;
    }
    if (d.peer < 0 || d.peer >= cfg_.nranks) return refuse({kGinRefusePeerOutside, 0, d.op, d.peer, 0, 0, 0, 0, 0});
    char* peer = reinterpret_cast<char*>(peers_[d.peer]);
    if (!mpi() && peer == nullptr) return refuse({kGinRefusePeerUnmapped, 0, d.op, d.peer, 0, 0, 0, 0, 0});
    const uint32_t srcWin = ginSrcWindow(d.windows), dstWin = ginDstWindow(d.windows);
    if (d.op == kGinGet) {
      auto release = [this](const Pending& q, uint32_t why) { traceHeld(q, kTraceRelease, why); };
      if (cfg_.independentContexts && !ch_.forced(d.peer, d.ctx, wholeFn(), segFn(), release)) return false;
      char* dst = at(dstWin, cfg_.rank, d.dstOffset, d.bytes, kGinAccessGetDestination, d.op, d.peer);
      if (dst == nullptr) return false;
      if (mpi()) {
        if (!mpi_.get(d)) return false;
      } else {
        const char* from = at(srcWin, d.peer, d.srcOffset, d.bytes, kGinAccessGetSource, d.op, d.peer);
        if (from == nullptr) return false;
        ShmNet::get(dst, from, d.bytes);
      }
      if (delivery_.tracing()) {
        const CommrefGinTraceRecord r{d.peer, d.ctx, kTraceGet, 0, 0, d.srcOffset, d.dstOffset, d.bytes, 0};
        delivery_.record(&r, 1);
      }
      return true;
    }
    const bool hasSignal = d.flags & kGinHasSignal, va = d.flags & kGinVaSignal;
    uint64_t value = 0;
    if (hasSignal) {
      const bool strong = d.flags & kGinStrongSignal, add = d.flags & kGinSignalAdd;
      if (strong && !cfg_.strongSignals) return refuse({kGinRefuseStrongSignal, 0, d.op, d.peer, 0, 0, 0, 0, 0});
      if (va && !cfg_.vaSignals) return refuse({kGinRefuseVaSignal, 0, d.op, d.peer, 0, 0, 0, 0, 0});
      value = add ? d.signalValue : 1;
      if (cfg_.signalsCountWrites) {
        if (add) return refuse({kGinRefuseSignalAdd, 0, d.op, d.peer, 0, 0, 0, 0, 0});
        value = 1;
      }
      const uint64_t where = va ? d.signal : cfg_.signalsOff + 8 * d.signal;
      if (!known(0, where, 8, kGinAccessSignal, d.op, d.peer)) return false;
    }
    uint64_t nbytes = 0;
    const char* src = reinterpret_cast<const char*>(&d.bytes);  // a putValue's value
    if (d.op == kGinPut) {
      nbytes = d.bytes;
      src = at(srcWin, cfg_.rank, d.srcOffset, nbytes, kGinAccessPutSource, d.op, d.peer);
      if (src == nullptr) return false;
    } else if (d.op == kGinPutValue) {
      nbytes = 8;
    } else if (d.op != kGinSignal) {
      return refuse({kGinRefuseUnknownOp, 0, d.op, d.peer, 0, 0, 0, 0, 0});
    }
    char* dst = nullptr;  // network shm: where the data lands
    if (nbytes) {
      if (mpi() ? !known(dstWin, d.dstOffset, nbytes, kGinAccessPutDestination, d.op, d.peer)
                : (dst = at(dstWin, d.peer, d.dstOffset, nbytes, kGinAccessPutDestination, d.op, d.peer)) == nullptr)
        return false;
    }
    if (cfg_.unordered) return postUnordered(d, src, dst, nbytes, value);
    if (cfg_.independentContexts) return postIndependent(d, src, dst, nbytes, value);
    const bool counter = d.op == kGinPut && (d.flags & kGinHasCounter);
    const uint64_t seq = delivery_.link(d.peer, d.ctx).seq++;
    bool counted = counter;  // the counter bumped before this returns (else when the sends complete)
    if (mpi()) {
      if (!mpi_.put(d, src, nbytes, value, counter, seq, &counted)) return false;
    } else {
      const bool early = (cfg_.plant & kPlantSignalFirst) && nbytes > kPlantBytes && hasSignal;
      if (early) shm_.signal(peer, va, d.signal, value);  // planted: before the data
      if (nbytes) shm_.land(dst, src, nbytes, d.flags & kGinBulk);
      if (counter) bumpCounter(d.counter);
      if (hasSignal && !early) shm_.signal(peer, va, d.signal, value);  // after the data
    }
    events_.fetch_add(1, std::memory_order_relaxed);
    if (delivery_.tracing())
      delivery_.tracePut(d, seq, nbytes, value, counted, cfg_.strongAlways,
                         (cfg_.plant & kPlantSignalFirst) && nbytes > kPlantBytes && hasSignal && !mpi());
    return true;
  }

  Delivery delivery_;
  WireModel wire_;
  ShmNet shm_;
  MpiNet mpi_;
  UnorderedWire uw_;
  IndependentContexts ch_;
  Lossy lossy_;
  std::atomic<uint64_t> lossyOut_{0};    // packets the lossy link has not delivered (lossy_'s, mirrored)
  std::atomic<uint64_t> lossyDueNs_{0};  // ... and when its next timer or late copy is due
  std::atomic<uint64_t> overtaken_{0};   // unordered: held puts a later signal overtook (uw_'s, mirrored)
  HeldRelease heldRelease_{cfg_};        // unordered: when held puts are released (idle.h; taker only)
  GinDescriptor* ring_;
  uint64_t* consumed_;
  const uint64_t* claimed_;
  IdleWord idle_;    // the queue's idle word (idle.h)
  HelpHooks hooks_;  // the queue's help and end hooks (idle.h)
  // Whoever holds it takes descriptors: the engine thread, or a kernel waiting on the
  // queue (help()). So descriptors are taken one at a time, in slot order; the state
  // marked "taker only" (next_, the links, the wire model, the MPI network) is touched
  // under it.
  std::atomic<bool> taking_{false};
  uint64_t next_ = 0;  // the next slot to take (taker only)
  std::atomic<bool> stop_{false}, exited_{false}, parked_{false};
  bool helped_ = false;  // kernels help and nothing needs the thread's clock: it sleeps when idle (the top)
  static constexpr uint64_t kHeldNapNs = 16000;     // helped_: the longest sleep while puts are held
  static constexpr uint64_t kLossyNapMinNs = 2000;  // the lossy link: the shortest sleep toward a timer
  static constexpr int kTakeBudget = 64;            // descriptors a take drains at most
  BusyWatch busy_;                                  // helped_: whether the thread polls after all (idle.h)
  std::thread thread_;
};

}  // namespace

COMMREF_GIN_API uint64_t commref_gin_engine_config_size() { return sizeof(CommrefGinEngineConfig); }
COMMREF_GIN_API uint64_t commref_gin_engine_trace_record_size() { return sizeof(CommrefGinTraceRecord); }
COMMREF_GIN_API uint64_t commref_gin_engine_refusal_size() { return sizeof(GinRefusal); }
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
  } catch (...) { return nullptr; }
}
COMMREF_GIN_API int commref_gin_engine_start(void* h) {
  try {
    static_cast<Engine*>(h)->start();
    return 0;
  } catch (...) { return 1; }
}
COMMREF_GIN_API int commref_gin_engine_stop(void* h, double timeoutS) {
  return static_cast<Engine*>(h)->stop(timeoutS);
}
COMMREF_GIN_API void commref_gin_engine_destroy(void* h) { delete static_cast<Engine*>(h); }
COMMREF_GIN_API void commref_gin_engine_park(void* h, int on) { static_cast<Engine*>(h)->park(on != 0); }
// out: ops (descriptors taken), events (puts and signals landed), claimed, running, failed,
// doorbells (of the ops), in flight (MPI network: sends not complete, landings not finished),
// by kernels (of the ops, taken by kernels through the help hook).
COMMREF_GIN_API void commref_gin_engine_stats(void* h, uint64_t* out) { static_cast<Engine*>(h)->stats(out); }
// The lossy link's counts (lossy.h): packets, dropped, duplicated, delayed, retransmits, dup_dropped.
COMMREF_GIN_API void commref_gin_engine_fault_stats(void* h, uint64_t* out) {
  static_cast<Engine*>(h)->faultStats(out);
}
COMMREF_GIN_API int commref_gin_engine_failed(void* h) { return static_cast<Engine*>(h)->failed(); }
// The failure's message (a failure other than a refusal), as snprintf: its length.
COMMREF_GIN_API uint64_t commref_gin_engine_error(void* h, char* buf, uint64_t n) {
  return static_cast<Engine*>(h)->error(buf, n);
}
// 1 and *out when the engine failed refusing a descriptor (the host formats its message:
// transports/gin/engine.py), else 0.
COMMREF_GIN_API int commref_gin_engine_refusal(void* h, GinRefusal* out) {
  return static_cast<Engine*>(h)->refusal(out);
}
COMMREF_GIN_API void commref_gin_engine_set_trace(void* h, int on) {
  static_cast<Engine*>(h)->delivery().setTrace(on != 0);
}
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
  return static_cast<Engine*>(h)->delivery().takeTrace(out, max, lost);
}
