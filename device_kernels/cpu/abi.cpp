// The ABI as the C++ headers define it, exported by the CPU library as one table of
// "name -> value" (commref_abi_table()). device_kernels/abi.py builds the same table
// from its own definitions (abi.abi_table()) and
// tests/test_compile.py::test_abi_table_matches_python asserts that the two are equal.
//
// Names are the Python ones, values integers or text:
//   sizeof(S), alignof(S)            every struct of the launch ABI
//   offsetof(S, f), sizeof(S::f)     every field, in declaration order; a static_assert
//   kind(S::f)                       below checks that the list covers each struct
//                                    ('i' signed, 'u' unsigned integer, 'V' struct or array)
//   NAME                             a constant (MAX_CHANNELS, WAIT_RECV_READY, ...)
//   DICT.key                         a code table (DTYPE_CODES.float32, GIN_PROTOCOLS.strong,
//                                    CXX_TYPES.7 = float, ...)
//   CALL_FIELDS.f.shift / .bits      the call descriptor's fields
//   kernel(name)                     every kernel of the library, with the struct it takes
// Compiled for the CPU build only.
#include <stddef.h>

#include <string>
#include <type_traits>

#include "commref/gin.h"
#include "commref/profile.h"
#include "commref/reduce.h"

using namespace commref;

namespace {

// ---- structs ----

// clang-format off: the X-macro tables keep one entry per line or group by hand
#define COMMREF_ABI_STRUCTS(S) \
  S(WindowLayout) S(ChannelPeers) S(ErrorRecord) S(GinArgs) S(GinDescriptor) S(GinRefusal) S(SymBuffer) S(CollArgs) S(CopyArgs) S(DevComm) S(P2pOp) \
  S(KernelArgs) S(LaunchDesc) S(StreamArgs) S(PackArgs)

// Every field of every struct above, in declaration order.
#define COMMREF_ABI_FIELDS(F)                                                                                   \
  F(WindowLayout, fifoOff) F(WindowLayout, readyOff) F(WindowLayout, creditOff) F(WindowLayout, stateOff)       \
  F(WindowLayout, stagingOff) F(WindowLayout, ginQueueOff) F(WindowLayout, ginSignalsOff)                       \
  F(WindowLayout, ginCountersOff) F(WindowLayout, syncOff) F(WindowLayout, slotBytes) F(WindowLayout, nsteps)   \
  F(WindowLayout, flagStride) F(WindowLayout, llFifoOff) F(WindowLayout, llStagingOff)                           \
  F(WindowLayout, ll128FifoOff) F(WindowLayout, ll128StagingOff) F(WindowLayout, llSlotBytes)                   \
  F(WindowLayout, ll128SlotBytes)                                                                               \
  F(ChannelPeers, ringPrev) F(ChannelPeers, ringNext) F(ChannelPeers, treeParent) F(ChannelPeers, treeChild0)   \
  F(ChannelPeers, treeChild1) F(ChannelPeers, treeInAtParent) F(ChannelPeers, treeOutAtParent)                  \
  F(ChannelPeers, ringPos)                                                                                      \
  F(ErrorRecord, code) F(ErrorRecord, what) F(ErrorRecord, rank) F(ErrorRecord, peer) F(ErrorRecord, channel)   \
  F(ErrorRecord, pad) F(ErrorRecord, expected) F(ErrorRecord, seen)                                             \
  F(GinArgs, peerMask) F(GinArgs, capacity) F(GinArgs, protocol) F(GinArgs, putsPerSlot)                        \
  F(GinArgs, checkHeaders) F(GinArgs, creditSignalBase) F(GinArgs, doorbells)                                   \
  F(GinArgs, queue) F(GinArgs, counters)                                                                        \
  F(GinDescriptor, seq) F(GinDescriptor, op) F(GinDescriptor, flags) F(GinDescriptor, peer) F(GinDescriptor, ctx) \
  F(GinDescriptor, dstOffset) F(GinDescriptor, srcOffset) F(GinDescriptor, bytes) F(GinDescriptor, signal)      \
  F(GinDescriptor, signalValue) F(GinDescriptor, counter) F(GinDescriptor, windows)                                 \
  F(GinRefusal, code) F(GinRefusal, access) F(GinRefusal, op) F(GinRefusal, peer) F(GinRefusal, owner)        \
  F(GinRefusal, window) F(GinRefusal, offset) F(GinRefusal, bytes) F(GinRefusal, size)                      \
  F(SymBuffer, peerTable) F(SymBuffer, offset) F(SymBuffer, ginWindow) F(SymBuffer, pad)                                                             \
  F(CollArgs, sendbuf) F(CollArgs, recvbuf) F(CollArgs, count) F(CollArgs, peerWindows) F(CollArgs, ringRanks)  \
  F(CollArgs, errorRecord) F(CollArgs, abortFlag) F(CollArgs, callDesc) F(CollArgs, timeoutNs)                  \
  F(CollArgs, layout) F(CollArgs, rank) F(CollArgs, nranks) F(CollArgs, root) F(CollArgs, dtype)                \
  F(CollArgs, op) F(CollArgs, nchannels) F(CollArgs, elemSize) F(CollArgs, avgDivisor) F(CollArgs, streamStores) \
  F(CollArgs, protocol) F(CollArgs, gin) F(CollArgs, symSend) F(CollArgs, symRecv) F(CollArgs, peers)               \
  F(CopyArgs, src) F(CopyArgs, dst) F(CopyArgs, bytes)                                                           \
  F(PackArgs, copies) F(PackArgs, n) F(PackArgs, flagBytes) F(PackArgs, flag) F(PackArgs, clear)                \
  F(P2pOp, buf) F(P2pOp, count) F(P2pOp, callDesc) F(P2pOp, bytes) F(P2pOp, symOffset) F(P2pOp, symWindows)     \
  F(P2pOp, peer) F(P2pOp, send) F(P2pOp, channel) F(P2pOp, conn) F(P2pOp, block) F(P2pOp, done)                 \
  F(P2pOp, symWindow) F(P2pOp, pad)                                                                             \
  F(DevComm, coll) F(DevComm, windowOff) F(DevComm, windowBytes) F(DevComm, counters) F(DevComm, lsaRanks)      \
  F(DevComm, launch) F(DevComm, signalBase) F(DevComm, nsignals) F(DevComm, ncounters) F(DevComm, flags)        \
  F(DevComm, lsaRank) F(DevComm, lsaSize) F(DevComm, ncontexts) F(DevComm, pad)                                \
  F(KernelArgs, comm) F(KernelArgs, arg) F(KernelArgs, nargs) F(KernelArgs, pad)                               \
  F(LaunchDesc, kernel) F(LaunchDesc, args) F(LaunchDesc, grid) F(LaunchDesc, block)                          \
  F(StreamArgs, base) F(StreamArgs, words) F(StreamArgs, nin) F(StreamArgs, nout) F(StreamArgs, shared)        \
  F(StreamArgs, streamStores)

struct Field {
  const char* strct;
  const char* name;
  uint64_t offset, size;
  char kind;
};

template <typename T>
constexpr char kindOf() {
  return std::is_integral_v<T> ? (std::is_signed_v<T> ? 'i' : 'u') : 'V';
}

// clang-format on
#define COMMREF_ABI_FIELD(S, f) Field{#S, #f, offsetof(S, f), sizeof(S::f), kindOf<decltype(S::f)>()},
constexpr Field kFields[] = {COMMREF_ABI_FIELDS(COMMREF_ABI_FIELD)};

constexpr bool sameName(const char* a, const char* b) {
  while (*a && *a == *b) a++, b++;
  return *a == *b;
}

// The structs have no implicit padding (explicit pad fields instead), so the listed
// fields of S, in order, must follow each other without a gap and end at sizeof(S):
// a field missing from the list, or listed out of order, breaks the chain.
constexpr bool listedCompletely(const char* strct, uint64_t size) {
  uint64_t end = 0;
  for (const Field& f : kFields) {
    if (!sameName(f.strct, strct)) continue;
    if (f.offset != end) return false;
    end += f.size;
  }
  return end == size;
}
#define COMMREF_ABI_COMPLETE(S)                                                                                   \
  static_assert(listedCompletely(#S, sizeof(S)), "COMMREF_ABI_FIELDS in cpu/abi.cpp must list every field of " #S \
                                                 ", in declaration order, and " #S " must have no implicit padding");
COMMREF_ABI_STRUCTS(COMMREF_ABI_COMPLETE)

// ---- the call descriptor ----

constexpr bool callFieldsDisjoint() {
  uint64_t used = 0;
  bool ok = true;
#define COMMREF_ABI_CALL_FIELD_BITS(name, shift, bits)            \
  ok = ok && (shift) + (bits) <= 64 && (bits) > 0 && (bits) < 64; \
  ok = ok && (used & (((1ull << (bits)) - 1) << (shift))) == 0;   \
  used |= ((1ull << (bits)) - 1) << (shift);
  COMMREF_CALL_FIELDS(COMMREF_ABI_CALL_FIELD_BITS)
  return ok;
}
static_assert(callFieldsDisjoint(), "COMMREF_CALL_FIELDS (args.h): fields overlap or leave the 64 bits");

// ---- the table ----

struct Table {
  std::string text;
  void add(const std::string& name, long long value) { text += name + "\ti\t" + std::to_string(value) + "\n"; }
  void add(const std::string& name, const std::string& value) { text += name + "\ts\t" + value + "\n"; }
};

// Constants: (Python name, C++ value).
// clang-format off: the X-macro tables keep one entry per line or group by hand
#define COMMREF_ABI_CONSTANTS(C)                                                                               \
  C(MAX_CHANNELS, COMMREF_MAX_CHANNELS) C(DIRECT_MAX_RANKS, COMMREF_DIRECT_MAX_RANKS)                          \
  C(CONN_IN, COMMREF_CONN_IN) C(CONN_OUT, COMMREF_CONN_OUT)                                                    \
  C(IN_RING, kInRing) C(IN_TREE_CHILD0, kInTreeChild0) C(IN_TREE_CHILD1, kInTreeChild1)                        \
  C(IN_TREE_PARENT, kInTreeParent)                                                                             \
  C(OUT_RING, kOutRing) C(OUT_TREE_PARENT, kOutTreeParent) C(OUT_TREE_CHILD0, kOutTreeChild0)                  \
  C(OUT_TREE_CHILD1, kOutTreeChild1)                                                                           \
  C(ERR_OK, kOk) C(ERR_TIMEOUT, kTimeout) C(ERR_MISMATCH, kMismatch) C(ERR_ABORTED, kAborted)                  \
  C(ERR_NO_INSTANCE, kNoInstance) C(RECORD_CLAIMED, COMMREF_RECORD_CLAIMED)                                   \
  C(WAIT_RECV_READY, kWaitRecvReady) C(WAIT_SEND_CREDIT, kWaitSendCredit) C(CALL_MISMATCH, kCallMismatch)      \
  C(COUNT_MISMATCH, kCountMismatch) C(WAIT_GIN_QUEUE, kWaitGinQueue) C(WAIT_GIN_FLUSH, kWaitGinFlush)          \
  C(WAIT_LSA_BARRIER, kWaitLsaBarrier) C(BUFFER_MISMATCH, kBufferMismatch)                                     \
  C(WAIT_SIGNAL, kWaitSignal) C(WAIT_COUNTER, kWaitCounter) C(WAIT_BARRIER, kWaitBarrier)                      \
  C(BAD_ARGUMENT, kBadArgument) C(WAIT_P2P_ACCEPT, kWaitP2pAccept) C(P2P_RECV_MISMATCH, kP2pRecvMismatch)      \
  C(P2P_SEND_REJECTED, kP2pSendRejected) C(KERNEL_MAX_ARGS, COMMREF_KERNEL_MAX_ARGS)                                    \
  C(DEVCOMM_STRONG_SIGNALS, kDevCommStrongSignals) C(DEVCOMM_MAX_CONTEXTS, COMMREF_DEVCOMM_MAX_CONTEXTS)                                                            \
  C(DEVCOMM_COUNTED_WRITES, kDevCommCountedWrites)                                                             \
  C(DEVCOMM_STRICT_ORDERING, kDevCommStrictOrdering) C(DEVCOMM_STRIDED_TEAMS, kDevCommStridedTeams) \
  C(PROFILE_COPY, kProfileCopy) C(PROFILE_REDUCE, kProfileReduce) C(PROFILE_WAIT, kProfileWait) C(PROFILE_HELP, kProfileHelp)               \
  C(PROFILE_KERNEL, kProfileKernel) C(PROFILE_PHASES, kProfilePhases)                                         \
  C(LAUNCH_OK, kLaunchOk) C(LAUNCH_FAILED, kLaunchFailed) C(LAUNCH_REFUSED, kLaunchRefused) C(LAUNCH_STUCK, kLaunchStuck)                    \
  C(GIN_PUT, kGinPut) C(GIN_PUT_VALUE, kGinPutValue) C(GIN_SIGNAL, kGinSignal) C(GIN_GET, kGinGet)             \
  C(GIN_FLUSH, kGinFlush) C(GIN_DOORBELL, kGinDoorbell)                                                        \
  C(GIN_HAS_SIGNAL, kGinHasSignal) C(GIN_STRONG, kGinStrongSignal) C(GIN_VA, kGinVaSignal)                     \
  C(GIN_ADD, kGinSignalAdd) C(GIN_HAS_COUNTER, kGinHasCounter) C(GIN_BULK, kGinBulk)                                                 \
  C(SLOT_HEADER, COMMREF_SLOT_HEADER) C(FLAG_STRIDE, COMMREF_FLAG_STRIDE)                                      \
  C(LL_LINE, COMMREF_LL_LINE) C(LL_HEADER, COMMREF_LL_HEADER) C(LL128_LINE, COMMREF_LL128_LINE)                \
  C(LL128_LINE_DATA, COMMREF_LL128_LINE_DATA) C(CPU_ATOMIC_16, kCpuAtomic16) C(CPU_STORE_ORDER, kCpuStoreOrder)   \
  C(GIN_QUEUE_CLAIMED, COMMREF_GIN_QUEUE_CLAIMED) C(GIN_QUEUE_CONSUMED, COMMREF_GIN_QUEUE_CONSUMED) C(GIN_QUEUE_IDLE, COMMREF_GIN_QUEUE_IDLE)            \
  C(GIN_QUEUE_HELP_FN, COMMREF_GIN_QUEUE_HELP_FN) C(GIN_QUEUE_HELP_CTX, COMMREF_GIN_QUEUE_HELP_CTX) C(GIN_QUEUE_HELP_END, COMMREF_GIN_QUEUE_HELP_END)                                                      \
  C(GIN_QUEUE_HEADER, COMMREF_GIN_QUEUE_HEADER) C(GIN_MAX_WINDOWS, COMMREF_GIN_MAX_WINDOWS)

// Code tables: (Python dict, enumerator, Python key). DTYPE_CODES and OP_CODES come
// from reduce.h's lists below.
#define COMMREF_ABI_CODES(C)                                                                                   \
  C(BAD_ARGUMENT_REASONS, kBadArgVaSignal, "va_signal") C(BAD_ARGUMENT_REASONS, kBadArgVaOffset, "va_offset") \
  C(BAD_ARGUMENT_REASONS, kBadArgTeamRank, "team_rank") C(BAD_ARGUMENT_REASONS, kBadArgTeamShape, "team_shape") \
  C(BAD_ARGUMENT_REASONS, kBadArgSymPtr, "sym_ptr") C(BAD_ARGUMENT_REASONS, kBadArgBits, "bits")            \
  C(BAD_ARGUMENT_REASONS, kBadArgRequestContext, "request_context")                                          \
  C(COLLECTIVE_CODES, kAllReduce, "allreduce") C(COLLECTIVE_CODES, kAllGather, "allgather")                    \
  C(COLLECTIVE_CODES, kReduceScatter, "reduce_scatter") C(COLLECTIVE_CODES, kBroadcast, "broadcast")           \
  C(COLLECTIVE_CODES, kReduce, "reduce") C(COLLECTIVE_CODES, kAlltoAll, "alltoall")                            \
  C(COLLECTIVE_CODES, kP2p, "p2p")                                                                             \
  C(ALGORITHM_CODES, kRing, "ring") C(ALGORITHM_CODES, kTree, "tree") C(ALGORITHM_CODES, kDirect, "direct")    \
  C(ALGORITHM_CODES, kNvls, "nvls") C(NVLS_VARIANTS, kNvlsOneShot, "one_shot")                                  \
  C(NVLS_VARIANTS, kNvlsTwoShot, "two_shot")                                                                   \
  C(PROTOCOL_CODES, kProtoSimple, "simple") C(PROTOCOL_CODES, kProtoLL, "ll")                                  \
  C(PROTOCOL_CODES, kProtoLL128, "ll128")                                                                      \
  C(GIN_PROTOCOLS, kGinStrong, "strong") C(GIN_PROTOCOLS, kGinWeakLast, "weak-last")                           \
  C(GIN_PROTOCOLS, kGinSignalPerPut, "signal-per-put") C(GIN_PROTOCOLS, kGinFlushSignal, "flush-signal")   \
  C(GIN_REFUSALS, kGinRefusePeerOutside, "peer_outside") C(GIN_REFUSALS, kGinRefusePeerUnmapped, "peer_unmapped") \
  C(GIN_REFUSALS, kGinRefuseWindowUnknown, "window_unknown")                                                   \
  C(GIN_REFUSALS, kGinRefuseOutsideWindow, "outside_window")                                                   \
  C(GIN_REFUSALS, kGinRefuseWindowUnmapped, "window_unmapped")                                                 \
  C(GIN_REFUSALS, kGinRefuseStrongSignal, "strong_signal") C(GIN_REFUSALS, kGinRefuseVaSignal, "va_signal")    \
  C(GIN_REFUSALS, kGinRefuseSignalAdd, "signal_add") C(GIN_REFUSALS, kGinRefuseUnknownOp, "unknown_op")        \
  C(GIN_ACCESSES, kGinAccessPutSource, "put_source") C(GIN_ACCESSES, kGinAccessPutDestination, "put_destination") \
  C(GIN_ACCESSES, kGinAccessGetSource, "get_source") C(GIN_ACCESSES, kGinAccessGetDestination, "get_destination") \
  C(GIN_ACCESSES, kGinAccessSignal, "signal") C(GIN_ACCESSES, kGinAccessLanding, "landing")                     \
  C(GIN_ACCESSES, kGinAccessGetRequest, "get_request")

std::string build() {
  Table t;
// clang-format on
#define COMMREF_ABI_ADD_STRUCT(S)                \
  t.add("sizeof(" #S ")", (long long)sizeof(S)); \
  t.add("alignof(" #S ")", (long long)alignof(S));
  COMMREF_ABI_STRUCTS(COMMREF_ABI_ADD_STRUCT)
  for (const Field& f : kFields) {
    const std::string s = f.strct, n = f.name;
    t.add("offsetof(" + s + ", " + n + ")", (long long)f.offset);
    t.add("sizeof(" + s + "::" + n + ")", (long long)f.size);
    t.add("kind(" + s + "::" + n + ")", std::string(1, f.kind));
  }
#define COMMREF_ABI_ADD_CONSTANT(name, value) t.add(#name, (long long)(value));
  COMMREF_ABI_CONSTANTS(COMMREF_ABI_ADD_CONSTANT)
#define COMMREF_ABI_ADD_CODE(dict, value, key) t.add(std::string(#dict ".") + key, (long long)(value));
  COMMREF_ABI_CODES(COMMREF_ABI_ADD_CODE)
#define COMMREF_ABI_ADD_DATA_TYPE(K, code, T, name, ...) \
  t.add("DTYPE_CODES." #name, (long long)(K));           \
  t.add("CXX_TYPES." + std::to_string((long long)(K)), std::string(#T));
  COMMREF_DATA_TYPES(COMMREF_ABI_ADD_DATA_TYPE)
#define COMMREF_ABI_ADD_RED_OP(K, code, name) t.add("OP_CODES." #name, (long long)(K));
  COMMREF_RED_OPS(COMMREF_ABI_ADD_RED_OP)
#define COMMREF_ABI_ADD_CALL_FIELD(name, shift, bits)       \
  t.add("CALL_FIELDS." #name ".shift", (long long)(shift)); \
  t.add("CALL_FIELDS." #name ".bits", (long long)(bits));
  COMMREF_CALL_FIELDS(COMMREF_ABI_ADD_CALL_FIELD)
  for (unsigned i = 0; i < commref_cpu::kernel_count(); i++) {
    const commref_cpu::KernelInfo& k = commref_cpu::kernel_at(i);
    t.add(std::string("kernel(") + k.name + ")", std::string(k.argsType));
  }
  return t.text;
}

}  // namespace

// The table, one entry a line: name TAB type TAB value, type 'i' (a decimal integer)
// or 's' (text). Built on the first call, after every kernel has registered.
extern "C" __attribute__((visibility("default"))) const char* commref_abi_table() {
  static const std::string table = build();
  return table.c_str();
}
