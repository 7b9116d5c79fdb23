// What the engine does when it finds nothing to take: the idle word its thread sleeps on
// (include/commref/gin.h, COMMREF_GIN_QUEUE_IDLE), the help and end hooks through which
// CPU kernels take turns, when the unordered wire's held puts go, and where kernels help,
// whether traffic lately was heavy enough for the thread to keep polling (docs/gin.md,
// "Polling", measures these).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

#include "core.h"

namespace {

// The engine's side of the idle word's protocol (gin.h): it stores the value that says
// who must ring, a sequentially consistent fence, looks at the queue once more, and only
// then sleeps; a producer publishes, fences, and wakes the word if it reads nonzero.
class IdleWord {
 public:
  IdleWord() = default;
  explicit IdleWord(uint32_t* word) : word_(word) {}

  // Sleeps until rung or `ns` pass, unless `mustStayAwake()` (called after the fence:
  // something published, a stop) says otherwise. `asleep`: kGinIdleRingAll or
  // kGinIdleKernelsTake.
  template <typename Check>
  void sleep(uint64_t ns, uint32_t asleep, Check mustStayAwake) {
    __atomic_store_n(word_, asleep, __ATOMIC_RELAXED);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!mustStayAwake()) {
      const struct timespec ts = timespecOf(ns);
      syscall(SYS_futex, word_, FUTEX_WAIT_PRIVATE, asleep, &ts, nullptr, 0);
    }
    __atomic_store_n(word_, 0u, __ATOMIC_RELAXED);
  }

  // Wakes the thread if it sleeps (after a fence: the caller's stores before the load).
  void wake() const {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (__atomic_load_n(word_, __ATOMIC_RELAXED)) syscall(SYS_futex, word_, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  }

 private:
  uint32_t* word_ = nullptr;  // the queue's idle word (the engine alone stores it)
};

// The queue's help and end hooks (include/commref/gin.h, "Help"): the help function, its
// argument and the end function, three words from COMMREF_GIN_QUEUE_HELP_FN that the
// engine alone stores and kernels read as hook[0], hook[1] and hook[2].
class HelpHooks {
 public:
  HelpHooks() = default;
  explicit HelpHooks(uint64_t* words) : w_(words) {}

  // The help function last: a kernel that reads it set reads the others set.
  void install(int (*help)(void*), void (*end)(void*), void* arg) {
    __atomic_store_n(&w_[1], reinterpret_cast<uint64_t>(arg), __ATOMIC_RELAXED);
    __atomic_store_n(&w_[2], reinterpret_cast<uint64_t>(end), __ATOMIC_RELEASE);
    __atomic_store_n(&w_[0], reinterpret_cast<uint64_t>(help), __ATOMIC_RELEASE);
  }
  void clear() {
    __atomic_store_n(&w_[0], 0, __ATOMIC_RELEASE);
    __atomic_store_n(&w_[1], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&w_[2], 0, __ATOMIC_RELAXED);
  }

 private:
  uint64_t* w_ = nullptr;
};

// When the unordered wire's held puts are released (unordered.h, "Liveness"): once the
// takers found the queue empty releasePolls times in a row with puts held; while one of
// them was overtaken, also overtakenPolls times or for overtakenNs since the first of
// them, whichever is sooner. Taker only.
class HeldRelease {
 public:
  explicit HeldRelease(const CommrefGinEngineConfig& c)
      : releasePolls_((uint64_t)c.releasePolls), overtakenPolls_((uint64_t)c.overtakenPolls), graceNs_(c.overtakenNs) {}

  // A pass over the queue that took `took` descriptors ended, `held` puts held: whether
  // to release them now.
  bool poll(int took, uint64_t held, bool overtaken) {
    if (took > 0 || !held) return polls_ = 0, false;
    if (++polls_ == 1) sinceNs_ = nowNs();
    if (polls_ < releasePolls_) return false;
    if (overtaken && polls_ < overtakenPolls_ && nowNs() - sinceNs_ < graceNs_) return false;
    return polls_ = 0, true;
  }

 private:
  uint64_t releasePolls_, overtakenPolls_, graceNs_;
  uint64_t polls_ = 0, sinceNs_ = 0;  // empty passes in a row with puts held, since (nowNs)
};

// Where kernels help, the engine thread sleeps from its first empty poll, except for a
// while after heavy traffic: a take that drained its whole budget (a backlog), or
// kBytes of puts and gets taken within kWindowNs. Then it polls for kAwakeNs as where
// kernels do not help, so that it takes the next bulk puts beside the kernels instead of
// leaving each to the kernel's next wait.
class BusyWatch {
 public:
  static constexpr uint64_t kBytes = 16384, kWindowNs = 100000, kAwakeNs = 1000000;

  bool lately() const { return nowNs() - busyAtNs_.load(std::memory_order_relaxed) < kAwakeNs; }

  // The taker's part, after a take of `descriptors` carrying `bytes` of puts and gets.
  void took(int descriptors, int budget, uint64_t bytes) {
    const uint64_t now = nowNs();
    if (now - windowNs_ > kWindowNs) windowNs_ = now, bytes_ = 0;
    bytes_ += bytes;
    if (descriptors < budget && bytes_ < kBytes) return;
    busyAtNs_.store(now, std::memory_order_relaxed);
    windowNs_ = now, bytes_ = 0;
  }

 private:
  std::atomic<uint64_t> busyAtNs_{0};  // when the last heavy take was (nowNs)
  uint64_t windowNs_ = 0, bytes_ = 0;  // taker only: the window's start and its bytes
};

}  // namespace
