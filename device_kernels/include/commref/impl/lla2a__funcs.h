// commref/impl/lla2a__funcs.h — the bodies of lla2a.h's declarations (read lla2a.h for
// the contract).
#pragma once

namespace commref {

// A value as its 4-byte LL words.
template <typename T>
union LLWords {
  T value;
  uint32_t word[sizeof(T) / 4];
};

// Orders this thread's earlier loads and stores before its later ones, for every
// observer (endEpoch: the reads of an epoch before the next epoch's sends).
static __device__ __forceinline__ void lla2aFence() {
#ifdef COMMREF_GPU
  __threadfence_system();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

__device__ inline LLA2ASession::LLA2ASession(const Multimem& m, uint64_t off, uint32_t block, uint32_t n)
    : mm(m), region(off + (uint64_t)block * bytes(n)), slots(n), ep(0) {
  mm.check(region, bytes(n), 8);  // leaves the kernel together unless it holds
  ep = load_relaxed(mm.at<const uint64_t>(mm.member, region)) + 1;
}

// One per-thread check: a failure is recorded now and the block leaves at endEpoch.
__device__ inline bool LLA2ASession::lineOk(int member, uint32_t line, uint32_t lines) {
  if (member < 0 || member >= mm.size) {
    commref_fail(mm.env, kMismatch, kBadArgument, -1, blockIdx.x, (uint64_t)mm.size, (uint64_t)(int64_t)member);
    return false;
  }
  if (line > slots || lines > slots - line) {
    commref_fail(mm.env, kMismatch, kBadArgument, -1, blockIdx.x, slots, (uint64_t)line + lines);
    return false;
  }
  return !mm.env.failed;
}

template <typename T>
__device__ inline void LLA2ASession::send(int member, uint32_t slot, T v) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "an LL value is 4 or 8 bytes");
  constexpr uint32_t W = sizeof(T) / 4;
  if (!lineOk(member, slot * W, W)) return;
  LLWords<T> x;
  x.value = v;
  for (uint32_t w = 0; w < W; w++)
    store_relaxed(mm.at<uint64_t>(member, lineOffset(slot * W + w)), (uint64_t)flag() << 32 | x.word[w]);
}

template <typename T>
__device__ inline void LLA2ASession::bcast(uint32_t slot, T v) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "an LL value is 4 or 8 bytes");
  constexpr uint32_t W = sizeof(T) / 4;
  if (!lineOk(0, slot * W, W)) return;
  LLWords<T> x;
  x.value = v;
  for (uint32_t w = 0; w < W; w++) {
    const uint64_t line = (uint64_t)flag() << 32 | x.word[w];
    if (mm.multicast())
      mm.st<uint64_t>(lineOffset(slot * W + w), line);
    else
      for (int i = 0; i < mm.size; i++) store_relaxed(mm.at<uint64_t>(i, lineOffset(slot * W + w)), line);
  }
}

__device__ inline uint32_t LLA2ASession::load(uint32_t line, int from) {
  const uint64_t* p = mm.at<const uint64_t>(mm.member, lineOffset(line));
  const uint32_t want = flag();
  uint64_t v = load_relaxed(p);
  if ((uint32_t)(v >> 32) == want) return (uint32_t)v;
  const uint64_t start = commref_now_ns();
  for (uint32_t spins = 1; !mm.env.failed; spins++) {
    commref_spin_pause(spins);
    v = load_relaxed(p);
    if ((uint32_t)(v >> 32) == want) return (uint32_t)v;
    if ((spins & 63) == 0 && !keepWaiting(mm.env, start, kWaitRecvReady, from, blockIdx.x, want, v >> 32)) break;
  }
  return 0;
}

template <typename T>
__device__ inline T LLA2ASession::recv(uint32_t slot, int from) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "an LL value is 4 or 8 bytes");
  constexpr uint32_t W = sizeof(T) / 4;
  LLWords<T> x;
  for (uint32_t w = 0; w < W; w++) x.word[w] = 0;
  if (lineOk(mm.member, slot * W, W))
    for (uint32_t w = 0; w < W; w++) x.word[w] = load(slot * W + w, from);
  return x.value;
}

template <typename T, typename Op>
__device__ inline T LLA2ASession::recvReduce(uint32_t first, uint32_t count, uint32_t stride) {
  typedef Arith<T> A;
  if (count == 0) return A::store(A::load(T{}));
  typename A::Compute acc = A::load(recv<T>(first));
  for (uint32_t i = 1; i < count; i++) acc = Op::apply(acc, A::load(recv<T>(first + i * stride)));
  return A::store(acc);
}

__device__ inline void LLA2ASession::endEpoch() {
  lla2aFence();
  __syncthreads();
  if (threadIdx.x == 0 && !mm.env.failed) store_relaxed(mm.at<uint64_t>(mm.member, region), ep);
  leaveIfFailed(mm.env.failed);
  ep++;
}

}  // namespace commref
