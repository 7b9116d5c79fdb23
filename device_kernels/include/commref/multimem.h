// commref/multimem.h — a multimem handle over the LSA team (NCCL's ncclMultimemHandle,
// NVLink SHARP "NVLS"): one address that stands for the same offset in every member's
// copy of a symmetric buffer.
//
//   Multimem m = lsaMultimem(args);                  // users' kernels: the device window
//   float s = m.ldReduce<float, OpSum>(off);         // every member's float at off, summed
//   m.st<float>(off, s);                             // s into every member's copy at off
//   m.barrier(barrierOff);                           // block-collective: every member's block
//
// Contract:
//   - Members are the LSA team's ranks, member i the team's i-th (ascending rank).
//     Offsets are bytes from the start of each member's copy (the device window for
//     lsaMultimem; a symmetric buffer for multimemOver), aligned to the element type.
//   - ldReduce<T, Op>(off): the reduction by Op of every member's T at off (reduce.h's
//     arithmetic: halves in float32, rounded once). st<T>(off, v): v lands at off in
//     every member's copy. Both are per-thread operations; a load sees what the
//     members stored before the barrier (or lsaBarrier) that ordered the two.
//   - The (T, Op) pairs are those NVLink multicast reduces (multimemSupported below):
//     sum over float32, float64, float16, bfloat16, int32, uint32, int64, uint64; min
//     and max over float16, bfloat16, int32, uint32, int64, uint64. Others do not
//     compile (a static_assert), so a kernel cannot ask multicast for what it lacks.
//   - Two implementations, one contract:
//       multicast (GPU, `mc` set: a CUDA multicast object mapped over every member's
//         copy): multimem.ld_reduce / multimem.st / multimem.red PTX (sm_90). The
//         switch reduces in an order of its own: exact-checkable inputs give the same
//         bits. 2-byte types are reduced as the aligned pair that holds them
//         (.f16x2 / .bf16x2: the 4-byte word at off & ~3 must lie in the mapping) and
//         stored per member (multimem.st has no 16-bit form).
//       emulated (the CPU engine, and GPUs without multicast: `mc` 0): LSA loads of
//         members 0, 1, ..., size - 1 folded in that order, and stores to each member:
//         the same bits on every rank and every run.
//   - barrier(off): block-collective, one block per member; on return every member's
//     block has reached it and every st and store before a member's barrier is visible
//     after it. It uses size words COMMREF_FLAG_STRIDE bytes apart at off of every
//     member's copy (off a multiple of 8), zero before the first barrier and never reset:
//     word j holds member j's count of barriers (multicast: one multimem.st.release of
//     it; emulated: a release store into each member's copy). A peer that does not come fails the
//     launch after the deadline (CommTimeout naming rank, peer, expected and seen count).
//   - check(off, bytes, align): block-collective; fails the launch (ValueError "a
//     device-API call ... was given V where the limit is L") unless [off, off + bytes)
//     lies within every member's copy and off is a multiple of align. ldReduce and st
//     do not check (they are per element); barrier checks its words.
#pragma once
#include "lsa.h"
#include "reduce.h"

namespace commref {

template <typename A, typename B>
struct is_same_type {
  static constexpr bool value = false;
};
template <typename A>
struct is_same_type<A, A> {
  static constexpr bool value = true;
};

// Whether NVLink multicast reduces T with Op (multimem.ld_reduce's types and operators).
template <typename T, typename Op>
static __device__ constexpr bool multimemSupported() {
  constexpr bool floatSum = is_same_type<T, float>::value || is_same_type<T, double>::value;
  constexpr bool half = is_same_type<T, half_t>::value || is_same_type<T, bf16_t>::value;
  constexpr bool integer = is_same_type<T, int32_t>::value || is_same_type<T, uint32_t>::value ||
                           is_same_type<T, int64_t>::value || is_same_type<T, uint64_t>::value;
  if (is_same_type<Op, OpSum>::value) return floatSum || half || integer;
  if (is_same_type<Op, OpMin>::value || is_same_type<Op, OpMax>::value) return half || integer;
  return false;
}

struct Multimem {
  const uint64_t* table;  // -> uint64_t[]: each rank's base, mapped here
  const int32_t* ranks;   // -> int32_t[size]: member i's rank; nullptr: member i is rank i
  uint64_t offset;        // added to each base: where member copies start
  uint64_t bytes;         // the copies' size (check)
  uint64_t mc;            // the multicast address of offset 0; 0: emulated by LSA loads and stores
  int size, member;       // members, this rank's index among them
  KernelEnv env;          // the launch's deadline, abort word and error record
  uint32_t waitWhat;      // what a barrier's wait names in a failure (WaitWhat, args.h)

  // Member i's copy at off (LSA).
  template <typename T>
  __device__ T* at(int i, uint64_t off) const;
  __device__ bool multicast() const { return mc != 0; }

  template <typename T, typename Op>
  __device__ T ldReduce(uint64_t off) const;
  template <typename T>
  __device__ void st(uint64_t off, T v) const;
  __device__ void barrier(uint64_t off);
  __device__ bool check(uint64_t off, uint64_t bytes, uint64_t align = 1);
};

// Over the device window of a users' kernel (args.h KernelArgs): the LSA team's copies;
// `mc`: a multicast mapping of the window (its offset 0), 0 for LSA emulation.
static __device__ Multimem lsaMultimem(const KernelArgs& k, uint64_t mc = 0);
// Over a symmetric buffer of a collective's launch whose every rank is an LSA peer.
static __device__ Multimem multimemOver(const CollArgs& a, const SymBuffer& b, uint64_t mc = 0);

}  // namespace commref

#include "impl/multimem__funcs.h"
