// commref/profile.h — where a CPU launch's time goes: the COMMREF_PROFILE build only.
//
// Contract. In a CPU build with COMMREF_PROFILE defined, every thread of a launch adds
// to the library's counters (cpu/engine.cpp, read by commref_cpu_profile):
//   - kProfileCopy / kProfileReduce: the time of each outermost data-moving call of
//     move.h (copyToAll, copyOwnShare, reduceCopy, foldToAll; a call made inside
//     another counts as part of it), and the bytes it loaded and stored, counted as
//     STREAM counts them (each element loaded once per input, stored once per output
//     written);
//   - kProfileWait: the time spent pausing in spin waits (commref_spin_pause: a peer's
//     flag, a credit, a proxy's landing; the polling loads between pauses are not
//     counted), and the number of pauses;
//   - kProfileHelp: the time a waiting thread spends in the host progress engine's help
//     hook (commref_help_progress, port.h: the GIN engine's work done on the kernel's
//     core: taking descriptors, landing puts);
//   - kProfileKernel: each block's whole run, and the number of blocks run.
// A block's time that is none of copy, reduce, wait and help is its other work: flag
// stores, fences, loop and slot bookkeeping. The counters are per process (every rank thread of
// a ThreadWorld adds to the same ones). In every other build the scopes are empty and
// the counters stay zero (commref_cpu_profile returns 0: not a profile build).
#pragma once

#ifdef COMMREF_CPU
#include <stdint.h>  // port.h includes this header from its CPU part
#else
#include "port.h"  // uint32_t under NVRTC
#endif

namespace commref {

enum ProfilePhase : uint32_t {
  kProfileCopy = 0,
  kProfileReduce = 1,
  kProfileWait = 2,
  kProfileHelp = 3,
  kProfileKernel = 4
};
constexpr uint32_t kProfilePhases = 5;

}  // namespace commref

#if defined(COMMREF_CPU) && defined(COMMREF_PROFILE)

namespace commref_cpu {
uint64_t now_ns();
// Adds one event of `phase` that took `ns` and moved `bytes`.
void profile_add(uint32_t phase, uint64_t ns, uint64_t bytes);
}  // namespace commref_cpu

namespace commref {

// Times the scope it lives in; only the outermost scope of a thread records.
class ProfileScope {
 public:
  ProfileScope(uint32_t phase, uint64_t bytes) : phase_(phase), bytes_(bytes), outer_(depth()++ == 0) {
    if (outer_) start_ = commref_cpu::now_ns();
  }
  ~ProfileScope() {
    depth()--;
    if (outer_) commref_cpu::profile_add(phase_, commref_cpu::now_ns() - start_, bytes_);
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  static uint32_t& depth() {
    static thread_local uint32_t d = 0;
    return d;
  }
  uint32_t phase_;
  uint64_t bytes_, start_ = 0;
  bool outer_;
};

}  // namespace commref

#define COMMREF_PROFILE_SCOPE(phase, bytes) ::commref::ProfileScope commref_profile_scope_((phase), (bytes))
#else
#define COMMREF_PROFILE_SCOPE(phase, bytes) ((void)0)
#endif
