// The CPU execution engine: runs CUDA-style kernels compiled with the host compiler.
//
// Model (what port.h promises kernel code):
//   - a launch runs gridDim.x blocks at the same time, one OS thread per block (block 0
//     on the calling thread, the others on pooled worker threads), because blocks of
//     a collective wait on blocks of other ranks and must all make progress;
//   - the blockDim.x threads of a block are fibers (ucontext) on that block's OS thread,
//     switched cooperatively at __syncthreads() and at spin-wait pauses; a block of one
//     thread runs directly on the OS thread's stack;
//   - __shared__ is thread_local, so per block; blocks on one OS thread never overlap;
//   - __syncthreads_or(p) is __syncthreads() that also ORs p over the block's threads;
//   - warp_sync(mask, v, mode) (coop.h) is a barrier of the lanes `mask` of the caller's
//     warp (threads [32 w, 32 w + 32)) that returns the OR of their values or the lowest
//     lane's; lanes past the block's end or whose fibers returned do not take part. A
//     warp barrier that can never complete (its other lanes wait at __syncthreads, or
//     every fiber waits) ends the launch with kLaunchStuck (a GPU would hang there);
//   - commref_block_exit() (port.h: called by every thread of a block together once
//     a wait failed, see wait.h) ends the whole launch: the first fiber to call it
//     unwinds, the block's other fibers are abandoned, the other blocks stop at their
//     next spin pause, and commref_cpu_launch() returns kLaunchFailed. The device code
//     has already filled the ErrorRecord that the host turns into an exception.
// Under ThreadSanitizer (-fsanitize=thread) fiber switches are announced to TSan, and a
// switch synchronizes (fibers of one block are sequential on one OS thread).
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "commref/args.h"
#include "commref/profile.h"

using namespace commref;

#if defined(__SANITIZE_THREAD__)
#define COMMREF_TSAN 1
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
}
#endif

namespace commref_cpu {

thread_local ThreadState* tl_thread = nullptr;
thread_local const uint64_t *tl_owedHelp = nullptr, *tl_helped = nullptr;

namespace {

// The profile build's counters (commref/profile.h): per phase, events, ns and bytes.
std::atomic<uint64_t> g_profile[kProfilePhases][3];

#ifdef COMMREF_PROFILE
// Times the enclosing scope as one event of `phase` (the engine's own phases).
struct EngineScope {
  uint32_t phase;
  uint64_t start = now_ns();
  ~EngineScope() { profile_add(phase, now_ns() - start, 0); }
};
#define COMMREF_ENGINE_SCOPE(phase) \
  EngineScope commref_engine_scope_ { (phase) }
#else
#define COMMREF_ENGINE_SCOPE(phase) ((void)0)
#endif

struct KernelAbort {};

std::vector<KernelInfo>& kernelRegistry() {  // built during static initialization
  static std::vector<KernelInfo> kernels;
  return kernels;
}

constexpr size_t kFiberStackBytes = 256 * 1024;

struct Launch {
  KernelFn kernel;
  const void* args;
  dim3 grid, block;
  std::atomic<int> failed{kLaunchOk};  // the LaunchStatus of the launch
  std::atomic<unsigned> remaining{0};  // blocks still running on workers
  std::atomic<unsigned> departed{0};   // workers done touching this Launch (it lives on the launcher's stack)
};

enum FiberState { kRunnable, kAtBarrier, kAtWarp, kDone };

// One block in execution on the current OS thread.
struct Block {
  Launch* launch;
  unsigned nthreads;
  std::vector<ThreadState> threads;
  // Fiber machinery, used when nthreads > 1.
  std::vector<ucontext_t> ctx;
  std::vector<FiberState> state;
  ucontext_t home;  // the OS thread's own context, resumed when the block ends
  unsigned cur = 0, nlive = 0, natBarrier = 0;
  int barrierOr = 0;      // __syncthreads_or: the OR of the barrier being formed
  int barrierOrDone = 0;  // ... and of the one last released (stable until this thread's next barrier)
  bool aborted = false;
  // warp_sync: per thread, the mask and value it arrived with and the result it leaves with
  std::vector<uint32_t> warpMask;
  std::vector<uint64_t> warpValue, warpResult;
#ifdef COMMREF_TSAN
  void* homeFiber = nullptr;
  std::vector<void*> tsanFiber;
#endif
};

thread_local Block* tl_block = nullptr;
thread_local std::vector<char*> tl_stacks;  // fiber stacks of this OS thread, reused

char* stackFor(unsigned i) {
  while (tl_stacks.size() <= i) {
    void* p =
        mmap(nullptr, kFiberStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    tl_stacks.push_back((char*)p);
  }
  return tl_stacks[i];
}

void switchTo(Block* b, unsigned from, unsigned to) {
  b->cur = to;
  tl_thread = &b->threads[to];
#ifdef COMMREF_TSAN
  __tsan_switch_to_fiber(b->tsanFiber[to], 0);
#endif
  swapcontext(&b->ctx[from], &b->ctx[to]);
  // Resumed: restore what this fiber sees.
  b->cur = from;
  tl_thread = &b->threads[from];
}

void switchHome(Block* b, unsigned from) {
#ifdef COMMREF_TSAN
  __tsan_switch_to_fiber(b->homeFiber, 0);
#endif
  swapcontext(&b->ctx[from], &b->home);
}

// The next runnable fiber after `from`, or -1.
int nextRunnable(Block* b, unsigned from) {
  for (unsigned k = 1; k <= b->nthreads; k++) {
    unsigned j = (from + k) % b->nthreads;
    if (b->state[j] == kRunnable && j != from) return (int)j;
  }
  return -1;
}

void releaseBarrierIfComplete(Block* b) {
  if (b->natBarrier > 0 && b->natBarrier == b->nlive) {
    for (unsigned j = 0; j < b->nthreads; j++)
      if (b->state[j] == kAtBarrier) b->state[j] = kRunnable;
    b->natBarrier = 0;
    b->barrierOrDone = b->barrierOr;
    b->barrierOr = 0;
  }
}

// Releases the warp barrier of `mask` in warp `w` once every lane of it that still runs
// has arrived there with that mask.
void releaseWarpIfComplete(Block* b, unsigned w, uint32_t mask) {
  uint32_t present = 0;
  for (unsigned lane = 0; lane < 32; lane++) {
    const unsigned t = w * 32 + lane;
    if (!((mask >> lane) & 1) || t >= b->nthreads || b->state[t] == kDone) continue;
    if (b->state[t] != kAtWarp || b->warpMask[t] != mask) return;  // not there yet
    present |= 1u << lane;
  }
  if (!present) return;
  uint64_t orValue = 0, lowest = b->warpValue[w * 32 + __builtin_ctz(present)];
  for (unsigned lane = 0; lane < 32; lane++)
    if ((present >> lane) & 1) orValue |= b->warpValue[w * 32 + lane];
  for (unsigned lane = 0; lane < 32; lane++) {
    if (!((present >> lane) & 1)) continue;
    const unsigned t = w * 32 + lane;
    b->state[t] = kRunnable;
    b->warpResult[t] = orValue;
    b->warpValue[t] = lowest;  // read back by mode 1
  }
}

// After fiber `me` returned: the warp barriers its lanes wait at may be complete now.
void releaseWarpOf(Block* b, unsigned me) {
  const unsigned w = me / 32;
  for (unsigned lane = 0; lane < 32; lane++) {
    const unsigned t = w * 32 + lane;
    if (t < b->nthreads && b->state[t] == kAtWarp) releaseWarpIfComplete(b, w, b->warpMask[t]);
  }
}

void fiberEntry(unsigned lo, unsigned hi) {
  Block* b = (Block*)(((uintptr_t)hi << 32) | (uintptr_t)lo);
  const unsigned me = b->cur;
  try {
    b->launch->kernel(b->launch->args);
  } catch (const KernelAbort&) {
    b->aborted = true;
    int ok = kLaunchOk;  // kLaunchStuck stays
    b->launch->failed.compare_exchange_strong(ok, kLaunchFailed);
    switchHome(b, me);  // never resumed
  }
  b->state[me] = kDone;
  b->nlive--;
  releaseBarrierIfComplete(b);
  releaseWarpOf(b, me);
  int next = nextRunnable(b, me);
  if (next >= 0) switchTo(b, me, (unsigned)next);  // never resumed: done fibers are not runnable
  switchHome(b, me);
}

// The help a thread of the block owes (port.h, commref_help_later), failed or not: what
// it published is taken before the block ends; then the end hook of the last hook it
// called (gin.h, "Help").
void settleHelp() {
  if (tl_owedHelp) commref::commref_help_progress(tl_owedHelp);  // clears tl_owedHelp
  commref::commref_help_end();                                   // clears tl_helped
}

void runBlock(Launch* L, unsigned blockId) {
  COMMREF_ENGINE_SCOPE(kProfileKernel);
  Block b;
  b.launch = L;
  b.nthreads = L->block.x;
  Block* saved = tl_block;
  ThreadState* savedThread = tl_thread;
  tl_block = &b;
  if (b.nthreads == 1) {  // on this thread's stack: no allocation on the path of small calls
    ThreadState only{dim3{0, 0, 0}, dim3{blockId, 0, 0}, L->block, L->grid};
    tl_thread = &only;
    try {
      L->kernel(L->args);
    } catch (const KernelAbort&) {
      int ok = kLaunchOk;
      L->failed.compare_exchange_strong(ok, kLaunchFailed);
    }
  } else {
    b.threads.resize(b.nthreads);
    for (unsigned t = 0; t < b.nthreads; t++) {
      b.threads[t].tid = dim3{t, 0, 0};
      b.threads[t].bid = dim3{blockId, 0, 0};
      b.threads[t].bdim = L->block;
      b.threads[t].gdim = L->grid;
    }
    b.ctx.resize(b.nthreads);
    b.state.assign(b.nthreads, kRunnable);
    b.warpMask.assign(b.nthreads, 0);
    b.warpValue.assign(b.nthreads, 0);
    b.warpResult.assign(b.nthreads, 0);
    b.nlive = b.nthreads;
#ifdef COMMREF_TSAN
    b.homeFiber = __tsan_get_current_fiber();
    b.tsanFiber.resize(b.nthreads);
#endif
    uintptr_t self = (uintptr_t)&b;
    for (unsigned t = 0; t < b.nthreads; t++) {
      char* stack = stackFor(t);
      if (!stack) {
        L->failed.store(kLaunchRefused);
        break;
      }
      getcontext(&b.ctx[t]);
      b.ctx[t].uc_stack.ss_sp = stack;
      b.ctx[t].uc_stack.ss_size = kFiberStackBytes;
      b.ctx[t].uc_link = nullptr;
      makecontext(&b.ctx[t], (void (*)())fiberEntry, 2, (unsigned)(self & 0xffffffffu), (unsigned)(self >> 32));
#ifdef COMMREF_TSAN
      b.tsanFiber[t] = __tsan_create_fiber(0);
#endif
    }
    if (L->failed.load() != kLaunchRefused) {
      b.cur = 0;
      tl_thread = &b.threads[0];
#ifdef COMMREF_TSAN
      __tsan_switch_to_fiber(b.tsanFiber[0], 0);
#endif
      swapcontext(&b.home, &b.ctx[0]);
    }
#ifdef COMMREF_TSAN
    for (void* f : b.tsanFiber)
      if (f) __tsan_destroy_fiber(f);
#endif
  }
  settleHelp();
  tl_block = saved;
  tl_thread = savedThread;
}

// ---- worker pool: OS threads that run blocks 1..grid-1 of launches ----

struct Worker {
  std::atomic<uint32_t> seq{0};  // bumped for each job
  Launch* launch = nullptr;
  unsigned blockId = 0;
};

std::mutex g_poolMu;
std::vector<Worker*> g_idle;

void workerLoop(Worker* w) {
  uint32_t seen = 0;
  prctl(PR_SET_NAME, "commref-block", 0, 0, 0);  // as top and perf name it
  for (;;) {
    w->seq.wait(seen);
    seen = w->seq.load(std::memory_order_acquire);
    Launch* L = w->launch;
    runBlock(L, w->blockId);
    {
      std::lock_guard<std::mutex> g(g_poolMu);
      g_idle.push_back(w);
    }
    if (L->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) L->remaining.notify_all();
    L->departed.fetch_add(1, std::memory_order_release);  // last touch of *L
  }
}

// An idle worker, or a new one; nullptr if no thread can be created.
Worker* takeWorker() {
  {
    std::lock_guard<std::mutex> g(g_poolMu);
    if (!g_idle.empty()) {
      Worker* w = g_idle.back();
      g_idle.pop_back();
      return w;
    }
  }
  Worker* w = new Worker();  // lives for the process
  try {
    std::thread(workerLoop, w).detach();
  } catch (...) {
    delete w;
    return nullptr;
  }
  return w;
}

void returnWorker(Worker* w) {
  std::lock_guard<std::mutex> g(g_poolMu);
  g_idle.push_back(w);
}

void backoff(uint32_t spins) {
  if (spins < 32) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  } else if (spins < COMMREF_SLEEPING_SPINS) {  // port.h
    sched_yield();
  } else {
    struct timespec ts = {0, 20000};
    nanosleep(&ts, nullptr);
  }
}

}  // namespace

void syncthreads() {
  Block* b = tl_block;
  if (b->nthreads == 1) return;
  const unsigned me = b->cur;
  b->state[me] = kAtBarrier;
  b->natBarrier++;
  releaseBarrierIfComplete(b);
  while (b->state[me] != kRunnable) {
    int next = nextRunnable(b, me);
    if (next < 0) {  // the others wait at a warp barrier that needs this thread: never released
      b->launch->failed.store(kLaunchStuck);
      throw KernelAbort();
    }
    switchTo(b, me, (unsigned)next);
    if (b->aborted || b->launch->failed.load(std::memory_order_relaxed)) throw KernelAbort();
  }
}

// A released barrier cannot be followed by another release before every thread that
// waited at it has run again (they are all needed at the next one), so barrierOrDone
// still holds this barrier's OR when the thread reads it.
int syncthreads_or(int predicate) {
  Block* b = tl_block;
  if (b->nthreads == 1) return predicate;
  b->barrierOr |= predicate;
  syncthreads();
  return b->barrierOrDone;
}

uint64_t warp_sync(uint32_t mask, uint64_t value, int mode) {
  Block* b = tl_block;
  if (b->nthreads == 1) return value;
  const unsigned me = b->cur;
  b->warpMask[me] = mask;
  b->warpValue[me] = value;
  b->state[me] = kAtWarp;
  releaseWarpIfComplete(b, me / 32, mask);
  while (b->state[me] != kRunnable) {
    int next = nextRunnable(b, me);
    if (next < 0) {  // nobody can run: the warp barrier never completes
      b->launch->failed.store(kLaunchStuck);
      throw KernelAbort();
    }
    switchTo(b, me, (unsigned)next);
    if (b->aborted || b->launch->failed.load(std::memory_order_relaxed)) throw KernelAbort();
  }
  return mode == 1 ? b->warpValue[me] : b->warpResult[me];
}

void spin_pause(uint32_t spins) {
  Block* b = tl_block;
  if (b->launch->failed.load(std::memory_order_relaxed)) throw KernelAbort();
  if (b->nthreads > 1) {
    int next = nextRunnable(b, b->cur);
    if (next >= 0) {
      switchTo(b, b->cur, (unsigned)next);
      if (b->aborted) throw KernelAbort();
    }
  }
  COMMREF_ENGINE_SCOPE(kProfileWait);
  backoff(spins);
}

void wake_sleeper(uint32_t* word, uint32_t only) {
  std::atomic_thread_fence(std::memory_order_seq_cst);  // the caller's publish before the load (port.h)
  const uint32_t v = __atomic_load_n(word, __ATOMIC_RELAXED);
  if (v != 0 && (only == 0 || v == only)) syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}

uint64_t now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void kernel_abort() { throw KernelAbort(); }

void profile_add(uint32_t phase, uint64_t ns, uint64_t bytes) {
  g_profile[phase][0].fetch_add(1, std::memory_order_relaxed);
  g_profile[phase][1].fetch_add(ns, std::memory_order_relaxed);
  g_profile[phase][2].fetch_add(bytes, std::memory_order_relaxed);
}

bool register_kernel(const KernelInfo& kernel) {
  kernelRegistry().push_back(kernel);
  return true;
}
unsigned kernel_count() { return (unsigned)kernelRegistry().size(); }
const KernelInfo& kernel_at(unsigned i) { return kernelRegistry()[i]; }

}  // namespace commref_cpu

using namespace commref_cpu;

// Runs kernel(args) over grid x block and returns when every block has finished: a
// LaunchStatus (args.h): kLaunchOk, kLaunchFailed if the kernel aborted (see the
// ErrorRecord it wrote), kLaunchRefused if the engine could not run it (bad
// dimensions, no thread for a block, no stack for a fiber).
extern "C" __attribute__((visibility("default"))) int commref_cpu_launch(void (*kernel)(const void*), const void* args,
                                                                         unsigned grid, unsigned block) {
  if (grid < 1 || grid > 4096 || block < 1 || block > 1024) return kLaunchRefused;
  Launch L;
  L.kernel = kernel;
  L.args = args;
  L.grid = dim3{grid, 1, 1};
  L.block = dim3{block, 1, 1};
  L.remaining.store(grid - 1);
  // Every block must run concurrently (blocks wait on blocks of other ranks): get all
  // the workers before starting any, or run nothing.
  std::vector<Worker*> workers;
  for (unsigned b = 1; b < grid; b++) {
    Worker* w = takeWorker();
    if (!w) {
      for (Worker* x : workers) returnWorker(x);
      return kLaunchRefused;
    }
    workers.push_back(w);
  }
  for (unsigned b = 1; b < grid; b++) {
    Worker* w = workers[b - 1];
    w->launch = &L;
    w->blockId = b;
    w->seq.fetch_add(1, std::memory_order_release);
    w->seq.notify_one();
  }
  runBlock(&L, 0);
  for (uint32_t spins = 0;; spins++) {
    unsigned left = L.remaining.load(std::memory_order_acquire);
    if (left == 0) break;
    if (spins < 1000)
      sched_yield();
    else
      L.remaining.wait(left, std::memory_order_acquire);
  }
  while (L.departed.load(std::memory_order_acquire) != grid - 1) sched_yield();  // brief: workers are leaving
  return L.failed.load();
}

// commref_cpu_launch of the launch that `d` describes (args.h, LaunchDesc): one argument
// for ctypes to convert instead of four, on the path of every repeated small call.
extern "C" __attribute__((visibility("default"))) int commref_cpu_launch_prepared(const LaunchDesc* d) {
  return commref_cpu_launch((void (*)(const void*))(uintptr_t)d->kernel, (const void*)(uintptr_t)d->args, d->grid,
                            d->block);
}

// The launches of `n` LaunchDescs (args.h) one after the other, as one entry: a group's
// members fused into one call from the host. Returns kLaunchOk when every one returned
// it; else (i << 8) | status of member i, the first that did not, whose successors are
// not run (n must stay below 2^24).
extern "C" __attribute__((visibility("default"))) int commref_cpu_launch_group(const LaunchDesc* d, unsigned n) {
  for (unsigned i = 0; i < n; i++) {
    int status = commref_cpu_launch_prepared(&d[i]);
    if (status != kLaunchOk) return (int)(i << 8) | status;
  }
  return kLaunchOk;
}

// The profile counters (commref/profile.h) into out[phase * 3 + (events, ns, bytes)]
// (kProfilePhases * 3 words), zeroed after reading when `reset`. Returns 1 in the profile
// build, 0 in every other (whose counters stay zero).
extern "C" __attribute__((visibility("default"))) int commref_cpu_profile(uint64_t* out, int reset) {
  for (uint32_t p = 0; p < kProfilePhases; p++)
    for (int k = 0; k < 3; k++)
      out[p * 3 + k] = reset ? g_profile[p][k].exchange(0, std::memory_order_relaxed)
                             : g_profile[p][k].load(std::memory_order_relaxed);
#ifdef COMMREF_PROFILE
  return 1;
#else
  return 0;
#endif
}

// CpuProtocolSupport (args.h) of the CPU this runs on: the host refuses LL, and LL and
// LL128 over GIN, where a guarantee they rely on is missing (proto.h).
extern "C" __attribute__((visibility("default"))) uint32_t commref_cpu_protocol_support() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return kCpuStoreOrder | (__builtin_cpu_supports("avx") ? kCpuAtomic16 : 0u);
#else
  return 0;
#endif
}
