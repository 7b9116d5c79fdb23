// commref/impl/multimem__funcs.h — the bodies of multimem.h's declarations (read
// multimem.h for the contract).
#pragma once

namespace commref {

// ---- multicast PTX (sm_90): one instruction per access, every member's copy ----
#ifdef COMMREF_GPU
template <typename T, typename Op>
struct MultimemPtx;
#define COMMREF_MM_LD(T, Op, ptx, C, R)                                                                       \
  template <>                                                                                                 \
  struct MultimemPtx<T, Op> {                                                                                 \
    static __device__ __forceinline__ C ldReduce(uint64_t p) {                                                \
      C v;                                                                                                    \
      asm volatile("multimem.ld_reduce.relaxed.sys.global." ptx " %0, [%1];" : "=" R(v) : "l"(p) : "memory"); \
      return v;                                                                                               \
    }                                                                                                         \
  };
COMMREF_MM_LD(float, OpSum, "add.f32", float, "f")
COMMREF_MM_LD(double, OpSum, "add.f64", double, "d")
COMMREF_MM_LD(half_t, OpSum, "add.acc::f32.f16x2", uint32_t, "r")
COMMREF_MM_LD(bf16_t, OpSum, "add.acc::f32.bf16x2", uint32_t, "r")
COMMREF_MM_LD(half_t, OpMin, "min.f16x2", uint32_t, "r")
COMMREF_MM_LD(bf16_t, OpMin, "min.bf16x2", uint32_t, "r")
COMMREF_MM_LD(half_t, OpMax, "max.f16x2", uint32_t, "r")
COMMREF_MM_LD(bf16_t, OpMax, "max.bf16x2", uint32_t, "r")
COMMREF_MM_LD(int32_t, OpSum, "add.u32", int32_t, "r")
COMMREF_MM_LD(uint32_t, OpSum, "add.u32", uint32_t, "r")
COMMREF_MM_LD(int64_t, OpSum, "add.u64", int64_t, "l")
COMMREF_MM_LD(uint64_t, OpSum, "add.u64", uint64_t, "l")
COMMREF_MM_LD(int32_t, OpMin, "min.s32", int32_t, "r")
COMMREF_MM_LD(uint32_t, OpMin, "min.u32", uint32_t, "r")
COMMREF_MM_LD(int64_t, OpMin, "min.s64", int64_t, "l")
COMMREF_MM_LD(uint64_t, OpMin, "min.u64", uint64_t, "l")
COMMREF_MM_LD(int32_t, OpMax, "max.s32", int32_t, "r")
COMMREF_MM_LD(uint32_t, OpMax, "max.u32", uint32_t, "r")
COMMREF_MM_LD(int64_t, OpMax, "max.s64", int64_t, "l")
COMMREF_MM_LD(uint64_t, OpMax, "max.u64", uint64_t, "l")
#undef COMMREF_MM_LD

static __device__ __forceinline__ void multimemSt32(uint64_t p, uint32_t v) {
  asm volatile("multimem.st.relaxed.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ void multimemSt64(uint64_t p, uint64_t v) {
  asm volatile("multimem.st.relaxed.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Publishes like store_release (every write of this thread, and of its block after a
// __syncthreads, is visible before v is), in every member's copy.
static __device__ __forceinline__ void multimemStRelease64(uint64_t p, uint64_t v) {
  __threadfence_system();
  asm volatile("multimem.st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
#endif

template <typename T>
__device__ inline T* Multimem::at(int i, uint64_t off) const {
  const int rank = ranks ? ranks[i] : i;
  return (T*)(table[rank] + offset + off);
}

template <typename T, typename Op>
__device__ inline T Multimem::ldReduce(uint64_t off) const {
  static_assert(multimemSupported<T, Op>(), "NVLink multicast does not reduce this type with this operator");
#ifdef COMMREF_GPU
  if (mc) {
    if constexpr (sizeof(T) == 2) {
      const uint32_t pair = MultimemPtx<T, Op>::ldReduce(mc + (off & ~3ull));
      T v;
      v.bits = (uint16_t)((off & 2) ? pair >> 16 : pair & 0xffff);
      return v;
    } else {
      return MultimemPtx<T, Op>::ldReduce(mc + off);
    }
  }
#endif
  typedef Arith<T> A;
  typename A::Compute acc = A::load(*at<const T>(0, off));
  for (int i = 1; i < size; i++) acc = Op::apply(acc, A::load(*at<const T>(i, off)));
  return A::store(acc);
}

template <typename T>
__device__ inline void Multimem::st(uint64_t off, T v) const {
#ifdef COMMREF_GPU
  if (mc && sizeof(T) >= 4) {
    if constexpr (sizeof(T) == 4) {
      uint32_t bits;
      memcpy(&bits, &v, 4);  // T's bytes as the store's word
      multimemSt32(mc + off, bits);
      return;
    } else if constexpr (sizeof(T) == 8) {
      uint64_t bits;
      memcpy(&bits, &v, 8);
      multimemSt64(mc + off, bits);
      return;
    }
  }
#endif
  for (int i = 0; i < size; i++) *at<T>(i, off) = v;
}

__device__ inline void Multimem::barrier(uint64_t off) {
  if (!check(off, (uint64_t)size * COMMREF_FLAG_STRIDE, 8)) return;
  if (threadIdx.x == 0 && !env.failed) {
    const uint64_t mine = off + (uint64_t)member * COMMREF_FLAG_STRIDE;
    const uint64_t epoch = load_relaxed(at<const uint64_t>(member, mine)) + 1;
#ifdef COMMREF_GPU
    if (mc) {
      multimemStRelease64(mc + mine, epoch);
    } else
#endif
    {
      for (int k = 1; k <= size; k++) store_release(at<uint64_t>((member + k) % size, mine), epoch);
    }
    for (int k = 1; k < size; k++) {
      const int j = (member + size - k) % size;
      waitAtLeast(at<const uint64_t>(member, off + (uint64_t)j * COMMREF_FLAG_STRIDE), epoch, env, waitWhat,
                  ranks ? ranks[j] : j, blockIdx.x);
    }
  }
  leaveIfFailed(env.failed);
}

__device__ inline bool Multimem::check(uint64_t off, uint64_t n, uint64_t align) {
  const bool inside = off <= bytes && n <= bytes - off, aligned = align <= 1 || off % align == 0;
  if (threadIdx.x == 0 && !inside) commref_fail(env, kMismatch, kBadArgument, -1, blockIdx.x, bytes, off + n);
  if (threadIdx.x == 0 && inside && !aligned) commref_fail(env, kMismatch, kBadArgument, -1, blockIdx.x, align, off);
  const bool ok = inside && aligned;
  leaveIfFailed(env.failed);
  return ok;
}

static __device__ inline Multimem lsaMultimem(const KernelArgs& k, uint64_t mc) {
  const DevComm& d = k.comm;
  Multimem m;
  m.table = (const uint64_t*)d.coll.peerWindows;
  m.ranks = (const int32_t*)d.lsaRanks;
  m.offset = d.windowOff;
  m.bytes = d.windowBytes;
  m.mc = mc;
  m.size = d.lsaSize;
  m.member = d.lsaRank;
  m.env = kernelEnv(d.coll);
  m.waitWhat = kWaitBarrier;
  return m;
}

static __device__ inline Multimem multimemOver(const CollArgs& a, const SymBuffer& b, uint64_t mc) {
  Multimem m;
  m.table = (const uint64_t*)b.peerTable;
  m.ranks = nullptr;
  m.offset = b.offset;
  m.bytes = ~0ull;  // the host checked the call's buffers
  m.mc = mc;
  m.size = a.nranks;
  m.member = a.rank;
  m.env = kernelEnv(a);
  m.waitWhat = kWaitLsaBarrier;
  return m;
}

}  // namespace commref
