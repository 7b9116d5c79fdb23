// commref/wait.h — bounded waits and the failure path of a kernel.
//
// Contract: no wait is unbounded. waitAtLeast() returns once *flag >= expected, and
// otherwise ends the kernel after env.timeoutNs, or as soon as the job's abort flag
// is raised, with an ErrorRecord that names this rank, the peer it waited on, what
// it waited for, and the expected and last seen values. Only the first failure of a
// launch is recorded.
#pragma once
#include "args.h"
#include "atomics.h"

struct KernelEnv {
  ErrorRecord* err;
  const uint64_t* abortFlag;
  int64_t timeoutNs;
  int32_t rank;
};

static __device__ __forceinline__ KernelEnv kernelEnv(const CollArgs& a) {
  KernelEnv env;
  env.err = (ErrorRecord*)a.errorRecord;
  env.abortFlag = (const uint64_t*)a.abortFlag;
  env.timeoutNs = a.timeoutNs;
  env.rank = a.rank;
  return env;
}

[[noreturn]] static __device__ void commref_fail(const KernelEnv& env, uint32_t code, uint32_t what, int peer,
                                                 int channel, uint64_t expected, uint64_t seen) {
  if (cas_relaxed(&env.err->code, kOk, kOk + 0x80000000u)) {  // claim the record, then fill it
    env.err->what = what;
    env.err->rank = env.rank;
    env.err->peer = peer;
    env.err->channel = channel;
    env.err->expected = expected;
    env.err->seen = seen;
#ifdef COMMREF_GPU
    __threadfence_system();
#endif
    env.err->code = code;
  }
  commref_kernel_abort();
}

static __device__ COMMREF_NOINLINE uint64_t waitAtLeast(const uint64_t* flag, uint64_t expected, const KernelEnv& env,
                                       uint32_t what, int peer, int channel) {
  uint64_t v = load_acquire(flag);
  if (v >= expected) return v;
  uint64_t start = commref_now_ns();
  for (uint32_t spins = 1;; spins++) {
    commref_spin_pause(spins);
    v = load_acquire(flag);
    if (v >= expected) return v;
    if ((spins & 63) == 0) {
      if (load_relaxed(env.abortFlag) != 0) commref_fail(env, kAborted, what, peer, channel, expected, v);
      if ((int64_t)(commref_now_ns() - start) > env.timeoutNs)
        commref_fail(env, kTimeout, what, peer, channel, expected, v);
    }
  }
}

// Like waitAtLeast, for counters that may wrap: done once (int64_t)(*flag - least) >= 0.
static __device__ COMMREF_NOINLINE uint64_t waitReached(const uint64_t* flag, uint64_t least, const KernelEnv& env,
                                                        uint32_t what, int peer, int channel) {
  uint64_t v = load_acquire(flag);
  if ((int64_t)(v - least) >= 0) return v;
  uint64_t start = commref_now_ns();
  for (uint32_t spins = 1;; spins++) {
    commref_spin_pause(spins);
    v = load_acquire(flag);
    if ((int64_t)(v - least) >= 0) return v;
    if ((spins & 63) == 0) {
      if (load_relaxed(env.abortFlag) != 0) commref_fail(env, kAborted, what, peer, channel, least, v);
      if ((int64_t)(commref_now_ns() - start) > env.timeoutNs) commref_fail(env, kTimeout, what, peer, channel, least, v);
    }
  }
}
