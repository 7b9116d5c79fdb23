// commref/proto.h — the three protocols of a FIFO step (Protocol, args.h): what a slot
// holds, how its lines are stored and read, and what each protocol relies on. flow.h's
// Prims runs every primitive in the call's protocol (CollArgs.protocol);
// connection.h posts and checks the steps.
//
// Simple (kProtoSimple): a slot is a 64-byte header (call descriptor, count) and up to
//   slotBytes of data. The sender writes the data and the header, then releases the
//   link's ready word (LSA) or signals the slot (GIN); the receiver waits for that,
//   checks the header and reads. Relies on release/acquire only (atomics.h).
//
// LL (kProtoLL): the data travels with its flag. An LL slot is two header lines
//   (COMMREF_LL_HEADER bytes), then one 16-byte line per 8 data bytes: the 8 data bytes,
//   then an 8-byte flag equal to the step's flag (stepFlag below). The writer stores each
//   line with one 16-byte store; the reader polls each line with one 16-byte load until
//   its flag is the step's, and then has its data: no ready word, no fence. Header
//   lines: line 0 {callDesc, flag}, line 1 {count, flag}. Half of the bytes are flags.
//   Relies on an aligned 16-byte store and load being single-copy atomic (a reader never
//   sees the new flag with the old data):
//     - CPU: x86-64's MOVDQA, one instruction each way (llStoreLine, llLoadLine). Intel
//       (SDM vol. 3A, "Guaranteed atomic operations") and AMD (APM vol. 2, "Memory
//       access atomicity") guarantee it on processors that enumerate AVX
//       (CPUID.01H:ECX.AVX). The host refuses LL on CPUs that do not
//       (commref_cpu_protocol_support(), cpu/engine.cpp) and on other architectures.
//     - GPU: an aligned st/ld.volatile.global.v2.u64 reaching memory whole, what NCCL's
//       LL relies on too (the PTX memory model itself speaks of a vector access as of
//       its elements).
//
// LL128 (kProtoLL128): lines of 128 bytes: 120 data bytes (15 words) and the flag word
//   last. The writer stores a line's data before its flag; the reader loads the flag
//   and, once it is the step's, the data. An LL128 slot is a header line and one line
//   per 120 data bytes; 1/16 of the bytes are flags. The header line, which thread 0
//   writes alone, holds callDesc and count in words 0 and 1 and the flag last on the
//   CPU, and two LL lines {callDesc, flag}, {count, flag} on the GPU (ll128StoreHeader).
//   Relies on a line's data being visible no later than its flag:
//     - CPU: the flag is stored with release and loaded with acquire (atomics.h). On
//       x86-64 (TSO: stores become visible in program order, loads are not reordered
//       with loads) both are plain MOVs, the order the protocol needs costs nothing;
//       elsewhere the C++ memory model gives it at the price of the barriers.
//     - GPU: the 8 lanes of a line store it with one st.volatile.global.v2.u64
//       instruction of their warp (the flag in lane 7's vector) and read it likewise;
//       that the 128 bytes of such a store are seen together holds where NVLink carries
//       the warp's store as one write (NCCL enables LL128 there only). The PTX memory
//       model does not promise it, so the host refuses LL128 on GPUs unless every peer is
//       reached over NVLink (collectives/protocols.py).
//
// Over GIN the proxy lands the lines a sender staged (transports/gin): landLines (land.h)
// writes each aligned 16-byte line with one store, lines in ascending address order, and
// transports/gin/plan.py accepts LL and LL128 only on wires where the ordering study
// proves the matching cell safe (docs/ordering.md: ll-flag, ll-flag-8B).
//
// Stale lines: each protocol's slots are its own region of the window (args.h), written
// only by that protocol's steps, and a flag is step + 1 of the connection's persistent
// 64-bit step counter, which never repeats: a line left by an earlier step, or never
// written (0), never carries the current step's flag.
#pragma once
#include "move.h"
#include "wait.h"
#if defined(COMMREF_CPU) && defined(__x86_64__)
#include <emmintrin.h>
#define COMMREF_LL_X86 1
#endif

namespace commref {

// The flag of step `step` of a connection (stepState: steps completed before it).
static __device__ __forceinline__ uint64_t stepFlag(uint64_t step) { return step + 1; }

// ---- user data as 8-byte words ----

// The `valid` (1..8) bytes at p as the low bytes of a word (the rest 0); p may have any
// alignment. Little-endian, like every target here, so a word's byte i is p[i].
static __device__ __forceinline__ uint64_t loadWord(const char* p, uint32_t valid) {
  if (valid == 8 && ((uint64_t)p & 7) == 0) return *(const uint64_t*)p;
  uint64_t w = 0;
  for (uint32_t i = 0; i < valid; i++) w |= (uint64_t)(uint8_t)p[i] << (8 * i);
  return w;
}
// Stores the low `valid` (1..8) bytes of w at p.
static __device__ __forceinline__ void storeWord(char* p, uint64_t w, uint32_t valid) {
  if (valid == 8 && ((uint64_t)p & 7) == 0) {
    *(uint64_t*)p = w;
    return;
  }
  for (uint32_t i = 0; i < valid; i++) p[i] = (char)(w >> (8 * i));
}

// Element by element (8 / sizeof(T) a word): the fold of in[0..nin) (nin 1..3) with Op
// in T's compute type, rounded to T, then divided when divisor != 0 (avg): what
// reduceCopy (move.h) stores for the same elements.
template <typename T, typename Op>
static __device__ __forceinline__ uint64_t foldWords(const uint64_t* in, int nin, int divisor) {
  typedef Arith<T> A;
  constexpr int K = 8 / sizeof(T);
  union Word {
    uint64_t w;
    T e[K];
  };
  Word x[3], out;
  for (int k = 0; k < nin; k++) x[k].w = in[k];
  for (int j = 0; j < K; j++) {
    typename A::Compute v = A::load(x[0].e[j]);
    for (int k = 1; k < nin; k++) v = Op::apply(v, A::load(x[k].e[j]));
    T t = A::store(v);
    if (divisor != 0) t = A::store(divideBy(A::load(t), divisor));
    out.e[j] = t;
  }
  return out.w;
}

#ifdef COMMREF_CPU
// out[k][0, n) = the fold of in[0..nin)[0, n) (nin 1..3) for every k, divided when divisor
// != 0 (avg), as reduceCopy stores the same elements: the sum rounded to T, then divided.
// out[0] may be in[0] (in place); the other outputs are copies of out[0].
template <typename T, typename Op>
static inline void foldLine(const T* const* in, int nin, T* const* out, int nout, uint64_t n, int divisor) {
  if (nin == 1) {
    if (out[0] != in[0]) memcpy(out[0], in[0], n * sizeof(T));
  } else if (nin == 2) {
    foldRange<T, Op, 2>(in, out[0], 0, n, 1, 0);
  } else {
    foldRange<T, Op, 3>(in, out[0], 0, n, 1, 0);
  }
  if (divisor != 0) {
    const T* sum[1] = {out[0]};
    foldRange<T, Op, 1>(sum, out[0], 0, n, 1, divisor);
  }
  for (int k = 1; k < nout; k++) memcpy(out[k], out[0], n * sizeof(T));
}
#endif

// ---- LL lines: {8 data bytes, 8-byte flag}, one 16-byte store or load ----

#ifdef COMMREF_GPU
static __device__ __forceinline__ void llStoreLine(char* line, uint64_t data, uint64_t flag) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(line), "l"(data), "l"(flag) : "memory");
}
static __device__ __forceinline__ void llLoadLine(const char* line, uint64_t& data, uint64_t& flag) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(data), "=l"(flag) : "l"(line) : "memory");
}
#elif defined(COMMREF_LL_X86)
// One MOVDQA each way (inline assembly, so that the compiler can neither split nor merge
// the access); aligned to 16 bytes by the slot layout.
static inline void llStoreLine(char* line, uint64_t data, uint64_t flag) {
  const __m128i v = _mm_set_epi64x((long long)flag, (long long)data);
  asm volatile("movdqa %1, %0" : "=m"(*(__m128i*)line) : "x"(v) : "memory");
}
static inline void llLoadLine(const char* line, uint64_t& data, uint64_t& flag) {
  __m128i v;
  asm volatile("movdqa %1, %0" : "=x"(v) : "m"(*(const __m128i*)line) : "memory");
  data = (uint64_t)_mm_cvtsi128_si64(v);
  flag = (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(v, v));
}
#else
// Not x86-64: no single-copy atomic 16-byte access is assumed here, so the host refuses
// LL (commref_cpu_protocol_support() reports none); these keep the source building and
// order the flag after the data with release/acquire.
static inline void llStoreLine(char* line, uint64_t data, uint64_t flag) {
  __atomic_store_n((uint64_t*)line, data, __ATOMIC_RELAXED);
  __atomic_store_n((uint64_t*)line + 1, flag, __ATOMIC_RELEASE);
}
static inline void llLoadLine(const char* line, uint64_t& data, uint64_t& flag) {
  flag = __atomic_load_n((const uint64_t*)line + 1, __ATOMIC_ACQUIRE);
  data = __atomic_load_n((const uint64_t*)line, __ATOMIC_RELAXED);
}
#endif

// Polls the LL line until its flag is `flag`; returns its data. Bounded like every wait
// (wait.h): on a failure (deadline, abort, another block's failure) env.failed is set
// and the value is meaningless. `help`: the GIN queue's help hook, or nullptr.
static __device__ COMMREF_NOINLINE uint64_t llWaitLine(const char* line, uint64_t flag, KernelEnv& env, int peer,
                                                       int channel, const uint64_t* help) {
  uint64_t d, f;
  llLoadLine(line, d, f);
  if (f == flag || env.failed) return d;
  const uint64_t start = commref_now_ns();
  for (uint32_t spins = 1;; spins++) {
    if (help) commref_help_progress(help);
    commref_spin_pause(spins);
    llLoadLine(line, d, f);
    if (f == flag) return d;
    if ((spins & 63) == 0 && !keepWaiting(env, start, kWaitRecvReady, peer, channel, flag, f)) return d;
  }
}

// ---- LL128 lines: 15 data words, the flag word last ----

#define COMMREF_LL128_WORDS (COMMREF_LL128_LINE_DATA / 8)  // data words of a line
#define COMMREF_LL128_FLAG_WORD (COMMREF_LL128_LINE / 8 - 1)

#ifdef COMMREF_CPU
// The flag word of an LL128 line: stored after the line's data (release), loaded before
// it (acquire); see the top of this file.
static inline void ll128StoreFlag(char* line, uint64_t flag) {
  store_release((uint64_t*)line + COMMREF_LL128_FLAG_WORD, flag);
}
static inline uint64_t ll128LoadFlag(const char* line) {
  return load_acquire((const uint64_t*)line + COMMREF_LL128_FLAG_WORD);
}

// The header line of an LL128 slot: call descriptor and count in words 0 and 1, the flag last.
static inline void ll128StoreHeader(char* line, uint64_t desc, uint64_t count, uint64_t flag) {
  ((uint64_t*)line)[0] = desc;
  ((uint64_t*)line)[1] = count;
  ll128StoreFlag(line, flag);
}
// True once the header line carries `flag` (then desc and count are its); `seen`: the flag read.
static inline bool ll128ReadHeader(const char* line, uint64_t flag, uint64_t& desc, uint64_t& count, uint64_t& seen) {
  seen = ll128LoadFlag(line);
  if (seen != flag) return false;
  desc = ((const uint64_t*)line)[0];
  count = ((const uint64_t*)line)[1];
  return true;
}

// Polls the LL128 line until its flag is `flag` (bounded, as llWaitLine).
static COMMREF_NOINLINE void ll128WaitLine(const char* line, uint64_t flag, KernelEnv& env, int peer, int channel,
                                           const uint64_t* help) {
  uint64_t f = ll128LoadFlag(line);
  if (f == flag || env.failed) return;
  const uint64_t start = commref_now_ns();
  for (uint32_t spins = 1;; spins++) {
    if (help) commref_help_progress(help);
    commref_spin_pause(spins);
    f = ll128LoadFlag(line);
    if (f == flag) return;
    if ((spins & 63) == 0 && !keepWaiting(env, start, kWaitRecvReady, peer, channel, flag, f)) return;
  }
}
#endif

#ifdef COMMREF_GPU
// The header line of an LL128 slot, written and read by one thread (not a warp): as two
// LL lines, {desc, flag} and {count, flag}, each seen whole (see LL above).
static __device__ __forceinline__ void ll128StoreHeader(char* line, uint64_t desc, uint64_t count, uint64_t flag) {
  llStoreLine(line, desc, flag);
  llStoreLine(line + COMMREF_LL_LINE, count, flag);
}
static __device__ __forceinline__ bool ll128ReadHeader(const char* line, uint64_t flag, uint64_t& desc, uint64_t& count,
                                                       uint64_t& seen) {
  uint64_t f1;
  llLoadLine(line, desc, seen);
  llLoadLine(line + COMMREF_LL_LINE, count, f1);
  return seen == flag && f1 == flag;
}
#endif

}  // namespace commref
