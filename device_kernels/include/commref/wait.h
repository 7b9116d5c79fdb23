// commref/wait.h — bounded waits and the failure path of a kernel.
//
// Contract: no wait is unbounded. waitAtLeast() returns once *flag >= expected, and
// otherwise fails after env.timeoutNs, or as soon as the job's abort flag is raised,
// with an ErrorRecord that names this rank, the peer it waited on, what it waited for,
// and the expected and last seen values. Only the first failure of a launch is
// recorded.
//
// Failure, on both targets (no __trap: it would poison the CUDA context of every rank
// on the device and the user's arrays):
//   - commref_fail() marks the calling thread's KernelEnv failed and, if no thread of
//     the launch did so before, claims the ErrorRecord (a CAS of its code from kOk to
//     kRecordClaimed), fills its fields and then publishes the code with a system-scope
//     release store. It then RETURNS. A thread that loses the claim writes nothing and
//     returns too; no thread ends the grid early, so the winner always completes the
//     record before the launch completes and the host reads it whole (the host checks
//     the record after every synchronize and before every launch).
//   - A failed thread (env.failed) does nothing more that others can see: later waits
//     return at once, and the posting functions (connPost, connRelease, Gin::post)
//     return without writing a slot header, a ready or credit word or a descriptor.
//   - Waits are done by thread 0 of a block (flow.h, lsa.h), which then meets the
//     block at leaveIfFailed(env.failed): a __syncthreads_or of the failure, after
//     which, if thread 0 failed, every thread of the block ends the kernel together
//     (commref_block_exit, port.h). So no thread of a failed block moves data into a
//     FIFO or a user buffer, or posts anything, once the failure is known.
//   - Every other block of the launch stops promptly: a wait polls the record's code
//     (every 64 spins, like the abort flag: the record is in host memory) and, once
//     another block has claimed it, fails without touching the record.
//   - On the CPU, commref_block_exit throws and the engine returns kLaunchFailed
//     (cpu/engine.cpp); its other blocks also stop at their next spin pause. On the
//     GPU the blocks return and the launch completes: the record is the failure.
// A kernel's first ErrorRecord state is kOk: the host never launches on a record that
// holds a failure (a communicator whose kernel failed is broken).
#pragma once
#include "args.h"
#include "atomics.h"

namespace commref {

// The code of a record that a failing thread has claimed and is still filling.
#define COMMREF_RECORD_CLAIMED 0x80000000u

struct KernelEnv {
  ErrorRecord* err;
  const uint64_t* abortFlag;
  int64_t timeoutNs;
  int32_t rank;
  bool failed;  // this thread failed, or saw that another block of the launch did
};

static __device__ __forceinline__ KernelEnv kernelEnv(const CollArgs& a) {
  KernelEnv env;
  env.err = (ErrorRecord*)a.errorRecord;
  env.abortFlag = (const uint64_t*)a.abortFlag;
  env.timeoutNs = a.timeoutNs;
  env.rank = a.rank;
  env.failed = false;
  return env;
}

// Records the launch's first failure (see the top) and returns; the caller returns to
// its block's next leaveIfFailed().
static __device__ COMMREF_NOINLINE void commref_fail(KernelEnv& env, uint32_t code, uint32_t what, int peer,
                                                     int channel, uint64_t expected, uint64_t seen) {
  if (env.failed) return;  // one failure per thread: the first
  env.failed = true;
  if (!cas_relaxed(&env.err->code, kOk, COMMREF_RECORD_CLAIMED)) return;  // another thread's record
  env.err->what = what;
  env.err->rank = env.rank;
  env.err->peer = peer;
  env.err->channel = channel;
  env.err->expected = expected;
  env.err->seen = seen;
  store_release_u32(&env.err->code, code);  // the fields are visible before the code
}

// Some thread of this launch has claimed the record: the launch has failed.
static __device__ __forceinline__ bool launchFailed(const KernelEnv& env) {
  return load_relaxed_u32(&env.err->code) != kOk;
}

// All threads of the block call it at the same point: a barrier after which, if any
// thread's `failed` was true, every thread of the block leaves the kernel together.
static __device__ __forceinline__ void leaveIfFailed(bool failed) {
  if (__syncthreads_or(failed)) commref_block_exit();
}

// Called by every thread of every block of a launch whose (dtype, op) the kernel has
// no instance for (COMMREF_DISPATCH_REDUCTION, reduce.h): records kNoInstance (seen:
// the call's dtype | op << 32; expected: what the module holds, `instances`) and ends
// the block. Block-uniform: dtype and op are the launch's.
static __device__ COMMREF_NOINLINE void commref_fail_no_instance(const CollArgs& a, uint64_t instances) {
  KernelEnv env = kernelEnv(a);
  if (threadIdx.x == 0)
    commref_fail(env, kNoInstance, 0, -1, blockIdx.x, instances,
                 (uint64_t)(uint32_t)a.dtype | (uint64_t)(uint32_t)a.op << 32);
  leaveIfFailed(true);
}

// The slow path of the waits below, every 64 spins: false once the wait must end
// (env.failed is then set; the record names it unless another block's failure did).
static __device__ __forceinline__ bool keepWaiting(KernelEnv& env, uint64_t start, uint32_t what, int peer, int channel,
                                                   uint64_t expected, uint64_t seen) {
  if (load_relaxed(env.abortFlag) != 0) {
    commref_fail(env, kAborted, what, peer, channel, expected, seen);
    return false;
  }
  if (launchFailed(env)) {  // another block of this launch failed first: its record stands
    env.failed = true;
    return false;
  }
  if ((int64_t)(commref_now_ns() - start) > env.timeoutNs) {
    commref_fail(env, kTimeout, what, peer, channel, expected, seen);
    return false;
  }
  return true;
}

// Returns the value seen: >= expected, unless the wait failed (env.failed; at once if
// it was already set). `help`: a progress hook (port.h, commref_help_progress) the wait
// calls before each pause, or nullptr. `spinsFrom`: the first pause's spin count
// (COMMREF_SLEEPING_SPINS: sleep from the first pause on, for a wait known to be long,
// so that its core goes to whoever it waits on).
static __device__ COMMREF_NOINLINE uint64_t waitAtLeast(const uint64_t* flag, uint64_t expected, KernelEnv& env,
                                                        uint32_t what, int peer, int channel,
                                                        const uint64_t* help = nullptr, uint32_t spinsFrom = 1) {
  uint64_t v = load_acquire(flag);
  if (v >= expected || env.failed) return v;
  uint64_t start = commref_now_ns();
  for (uint32_t spins = spinsFrom;; spins++) {
    if (help) commref_help_progress(help);
    commref_spin_pause(spins);
    v = load_acquire(flag);
    if (v >= expected) return v;
    if ((spins & 63) == 0 && !keepWaiting(env, start, what, peer, channel, expected, v)) return v;
  }
}

// Like waitAtLeast, for counters that may wrap: done once (int64_t)(*flag - least) >= 0.
static __device__ COMMREF_NOINLINE uint64_t waitReached(const uint64_t* flag, uint64_t least, KernelEnv& env,
                                                        uint32_t what, int peer, int channel,
                                                        const uint64_t* help = nullptr) {
  uint64_t v = load_acquire(flag);
  if ((int64_t)(v - least) >= 0 || env.failed) return v;
  uint64_t start = commref_now_ns();
  for (uint32_t spins = 1;; spins++) {
    if (help) commref_help_progress(help);
    commref_spin_pause(spins);
    v = load_acquire(flag);
    if ((int64_t)(v - least) >= 0) return v;
    if ((spins & 63) == 0 && !keepWaiting(env, start, what, peer, channel, least, v)) return v;
  }
}

}  // namespace commref
