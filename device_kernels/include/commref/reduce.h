// commref/reduce.h — element types and reduction operators, one definition for both
// targets. Codes follow ncclDataType_t and ncclRedOp_t so that a user of NCCL reads
// them without a table.
//
// Arithmetic contract (what the numpy references in collectives/verify.py mirror):
//   - integer sum and prod wrap modulo 2^bits (computed in the unsigned type);
//   - float16 and bfloat16 are reduced in float32 and rounded to nearest-even once
//     per stored value;
//   - avg is sum followed by one division by nranks at the rank that finishes the
//     reduction: truncation toward zero for integers, IEEE division for floats.
#pragma once
#include "port.h"

namespace commref {

// The element types, X(enumerator, code, C++ type, numpy name, ...): the DataType enum,
// the dispatch below and the ABI table (cpu/abi.cpp) all expand this one list. Extra
// arguments are passed on to X. half_t and bf16_t are defined below.
// clang-format off: the X-macro tables keep one entry per line or group by hand
#define COMMREF_DATA_TYPES(X, ...)                                                     \
  X(kInt8, 0, int8_t, int8, __VA_ARGS__) X(kUint8, 1, uint8_t, uint8, __VA_ARGS__)         \
  X(kInt32, 2, int32_t, int32, __VA_ARGS__) X(kUint32, 3, uint32_t, uint32, __VA_ARGS__)   \
  X(kInt64, 4, int64_t, int64, __VA_ARGS__) X(kUint64, 5, uint64_t, uint64, __VA_ARGS__)   \
  X(kFloat16, 6, half_t, float16, __VA_ARGS__) X(kFloat32, 7, float, float32, __VA_ARGS__) \
  X(kFloat64, 8, double, float64, __VA_ARGS__) X(kBfloat16, 9, bf16_t, bfloat16, __VA_ARGS__)
// clang-format on
#define COMMREF_DATA_TYPE_ENUMERATOR(K, code, T, name, ...) K = code,
enum DataType : int32_t { COMMREF_DATA_TYPES(COMMREF_DATA_TYPE_ENUMERATOR) };
// The reduction operators, X(enumerator, code, name): the RedOp enum and the ABI
// table. Which functor serves each is COMMREF_FOR_OP's business (avg reduces with
// OpSum and divides once at the end).
#define COMMREF_RED_OPS(X) X(kSum, 0, sum) X(kProd, 1, prod) X(kMax, 2, max) X(kMin, 3, min) X(kAvg, 4, avg)
#define COMMREF_RED_OP_ENUMERATOR(K, code, name) K = code,
enum RedOp : int32_t { COMMREF_RED_OPS(COMMREF_RED_OP_ENUMERATOR) };

static COMMREF_HD __forceinline__ uint32_t commref_f2u(float f) {
#ifdef COMMREF_GPU
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}
static COMMREF_HD __forceinline__ float commref_u2f(uint32_t u) {
#ifdef COMMREF_GPU
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

// IEEE binary16, converted in software so that no toolkit header is needed.
struct half_t {
  uint16_t bits;
  static COMMREF_HD __forceinline__ float toFloat(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0) {
      if (mant == 0) return commref_u2f(sign);
      int e = -14;
      while (!(mant & 0x400)) {
        mant <<= 1;
        e--;
      }
      mant &= 0x3ff;
      return commref_u2f(sign | ((uint32_t)(e + 127) << 23) | (mant << 13));
    }
    if (exp == 31) return commref_u2f(sign | 0x7f800000u | (mant << 13));
    return commref_u2f(sign | ((exp - 15 + 127) << 23) | (mant << 13));
  }
  static COMMREF_HD __forceinline__ uint16_t fromFloat(float f) {  // round to nearest even
    uint32_t x = commref_f2u(f), sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xff, mant = x & 0x7fffff;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    int e = (int)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) {
      if (e < -10) return (uint16_t)sign;
      mant |= 0x800000;
      int shift = 14 - e;
      uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
      if (rem > halfway || (rem == halfway && (h & 1))) h++;
      return (uint16_t)(sign | h);
    }
    uint32_t h = sign | ((uint32_t)e << 10) | (mant >> 13), rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)h;
  }
};

// bfloat16: the top half of a float32, rounded to nearest even.
struct bf16_t {
  uint16_t bits;
  static COMMREF_HD __forceinline__ float toFloat(uint16_t b) { return commref_u2f((uint32_t)b << 16); }
  static COMMREF_HD __forceinline__ uint16_t fromFloat(float f) {
    uint32_t x = commref_f2u(f);
    if ((x & 0x7fffffff) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
  }
};

// How a stored element becomes a value to reduce, and back.
template <typename T>
struct Arith {
  typedef T Compute;
  static COMMREF_HD __forceinline__ Compute load(T v) { return v; }
  static COMMREF_HD __forceinline__ T store(Compute v) { return v; }
};
template <>
struct Arith<half_t> {
  typedef float Compute;
  static COMMREF_HD __forceinline__ float load(half_t v) { return half_t::toFloat(v.bits); }
  static COMMREF_HD __forceinline__ half_t store(float v) {
    half_t h;
    h.bits = half_t::fromFloat(v);
    return h;
  }
};
template <>
struct Arith<bf16_t> {
  typedef float Compute;
  static COMMREF_HD __forceinline__ float load(bf16_t v) { return bf16_t::toFloat(v.bits); }
  static COMMREF_HD __forceinline__ bf16_t store(float v) {
    bf16_t h;
    h.bits = bf16_t::fromFloat(v);
    return h;
  }
};

template <typename C>
struct Unsigned {
  typedef C type;
};
template <>
struct Unsigned<int8_t> {
  typedef uint8_t type;
};
template <>
struct Unsigned<int32_t> {
  typedef uint32_t type;
};
template <>
struct Unsigned<int64_t> {
  typedef uint64_t type;
};

struct OpSum {
  template <typename C>
  static COMMREF_HD __forceinline__ C apply(C a, C b) {
    typedef typename Unsigned<C>::type U;
    return (C)(U)((U)a + (U)b);
  }
};
struct OpProd {
  template <typename C>
  static COMMREF_HD __forceinline__ C apply(C a, C b) {
    typedef typename Unsigned<C>::type U;
    return (C)(U)((U)a * (U)b);
  }
};
struct OpMax {
  template <typename C>
  static COMMREF_HD __forceinline__ C apply(C a, C b) {
    return a < b ? b : a;
  }
};
struct OpMin {
  template <typename C>
  static COMMREF_HD __forceinline__ C apply(C a, C b) {
    return b < a ? b : a;
  }
};
// Integer sum and prod go through the unsigned type (no signed overflow); for floats
// Unsigned<C> is C itself.

// avg's final division: truncation toward zero for integers (C++ semantics).
template <typename C>
static COMMREF_HD __forceinline__ C divideBy(C v, int n) {
  return (C)(v / (C)n);
}

// Calls BODY with the C++ element type and operator for (dtype, op), or FAIL for an
// unknown op; avg reduces with OpSum and divides once at the end (the caller passes the
// op code on).
#define COMMREF_FOR_OP(T, op, BODY, FAIL) \
  switch (op) {                           \
    case kSum:                            \
    case kAvg:                            \
      BODY(T, OpSum);                     \
      break;                              \
    case kProd:                           \
      BODY(T, OpProd);                    \
      break;                              \
    case kMax:                            \
      BODY(T, OpMax);                     \
      break;                              \
    case kMin:                            \
      BODY(T, OpMin);                     \
      break;                              \
    default:                              \
      FAIL;                               \
      break;                              \
  }
// COMMREF_DISPATCH_REDUCTION(args, BODY): BODY(T, Op) for the launch's (args.dtype,
// args.op). Where the kernel has no instance for them it does not run silently short:
// commref_fail_no_instance (wait.h; a kernel file includes both) records kNoInstance
// (args.h) and every block ends (wait.h's failure contract).
#if defined(COMMREF_ONLY_T)
// A specialised build (the GPU loader compiles one module per element type and
// operator, because every instance costs seconds of ptxas time): only the requested
// instance exists; a launch with any other (dtype, op) fails with kNoInstance.
#define COMMREF_INSTANCES ((uint64_t)(uint32_t)(COMMREF_ONLY_DTYPE) | (uint64_t)(uint32_t)(COMMREF_ONLY_OPMASK) << 32)
#define COMMREF_DISPATCH_REDUCTION(args, BODY)                          \
  if ((args).dtype == COMMREF_ONLY_DTYPE && (uint32_t)(args).op < 32 && \
      (((uint32_t)COMMREF_ONLY_OPMASK >> (args).op) & 1)) {             \
    BODY(COMMREF_ONLY_T, COMMREF_ONLY_OP);                              \
  } else {                                                              \
    commref_fail_no_instance(args, COMMREF_INSTANCES);                  \
  }
#else
#define COMMREF_INSTANCES (~0ull)  // every (dtype, op)
#define COMMREF_DATA_TYPE_CASE(K, code, T, name, args, BODY)                              \
  case K:                                                                                 \
    COMMREF_FOR_OP(T, (args).op, BODY, commref_fail_no_instance(args, COMMREF_INSTANCES)) \
    break;
#define COMMREF_DISPATCH_REDUCTION(args, BODY)             \
  switch ((args).dtype) {                                  \
    COMMREF_DATA_TYPES(COMMREF_DATA_TYPE_CASE, args, BODY) \
    default:                                               \
      commref_fail_no_instance(args, COMMREF_INSTANCES);   \
      break;                                               \
  }
#endif

}  // namespace commref
