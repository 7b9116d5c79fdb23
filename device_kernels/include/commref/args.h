// commref/args.h — the launch ABI: plain structs passed to kernels by value, and the
// codes they carry.
//
// Every field is a fixed-width integer so that the host side can describe the same
// layout with a numpy structured dtype. Every struct and code here, in gin.h and in
// reduce.h has one Python twin in device_kernels/abi.py; the CPU build exports them
// all as one table (commref_abi_table(), cpu/abi.cpp) and
// tests/test_compile.py::test_abi_table_matches_python compares it, entry by entry,
// with abi.abi_table(). A layout change is one edit here and one there.
// Pointers travel as uint64_t device addresses.
#pragma once
#include "port.h"

namespace commref {

#define COMMREF_MAX_CHANNELS 16
#define COMMREF_DIRECT_MAX_RANKS 64  // ranks a direct kernel reduces over (direct.cu)
#define COMMREF_CONN_IN 4            // inbound FIFOs per channel: ring-from-prev, tree-from-child0/1, tree-from-parent
#define COMMREF_CONN_OUT 4           // outbound links per channel: ring-to-next, tree-to-parent, tree-to-child0/1

enum ConnIn { kInRing = 0, kInTreeChild0 = 1, kInTreeChild1 = 2, kInTreeParent = 3 };
enum ConnOut { kOutRing = 0, kOutTreeParent = 1, kOutTreeChild0 = 2, kOutTreeChild1 = 3 };

// Where each piece of connection state lives inside every rank's connection window.
// The layout is symmetric: the same offsets on every rank.
//   fifo[c][k][s]     a Simple slot: a 64-byte header (call descriptor, count) then
//                     slotBytes of data; written by the sender of inbound FIFO k (LSA:
//                     directly, GIN: by the proxy, from the sender's staging slot)
//   llFifo[c][k][s]   an LL slot (proto.h): 32 bytes of header lines, then 16-byte lines
//                     carrying llSlotBytes of data; likewise llStaging[c][j][s]
//   ll128Fifo[c][k][s] an LL128 slot (proto.h): a 128-byte header line, then 128-byte
//                     lines carrying ll128SlotBytes of data; likewise ll128Staging
//   ready[c][k]       uint64 steps posted (LSA)   written by that sender (release)
//   credit[c][j]      uint64 steps consumed (LSA) written by the receiver of outbound j
//   stepState         uint64 per (c, k) and (c, j): this rank's persistent step counters
//   staging[c][j][s]  GIN: the slot a sender fills before the proxy puts it
//   ginQueue          GIN: the descriptor ring, its claimed and consumed counters
//   ginSignals        GIN: indexed signals (ready of slot s of (c, k) at (c*4+k)*nsteps+s,
//                     credit of (c, j) at creditSignalBase + c*4+j), then ginCounters
//   sync[c][j]        LSA barrier of channel c (lsa.h): the SyncSlot rank j last wrote
//                     here, j < nranks; sync[c][nranks] holds this rank's epoch
// Flag words are COMMREF_FLAG_STRIDE bytes apart so that two writers never share a
// cache line.
#define COMMREF_SLOT_HEADER 64
#define COMMREF_FLAG_STRIDE 64  // bytes between flag words (WindowLayout.flagStride holds it)
// LL and LL128 slots (proto.h): an LL slot is COMMREF_LL_HEADER bytes of header lines,
// then a COMMREF_LL_LINE-byte line per 8 data bytes; an LL128 slot is one header line,
// then a COMMREF_LL128_LINE-byte line per COMMREF_LL128_LINE_DATA data bytes.
#define COMMREF_LL_LINE 16
#define COMMREF_LL_HEADER 32  // two lines: the first data lines share their 64-byte cache line
#define COMMREF_LL128_LINE 128
#define COMMREF_LL128_LINE_DATA 120
struct WindowLayout {
  uint64_t fifoOff, readyOff, creditOff, stateOff, stagingOff;
  uint64_t ginQueueOff, ginSignalsOff, ginCountersOff;
  uint64_t syncOff;
  uint64_t slotBytes;           // data bytes per slot; a slot occupies slotBytes + COMMREF_SLOT_HEADER
  uint32_t nsteps, flagStride;  // flagStride: COMMREF_FLAG_STRIDE
  // The LL and LL128 regions (proto.h: each protocol's slots are its own, so a flag is
  // only ever compared with lines that protocol wrote). Staging: GIN only (0 bytes else).
  uint64_t llFifoOff, llStagingOff, ll128FifoOff, ll128StagingOff;
  uint64_t llSlotBytes;     // data bytes per LL slot (a multiple of 8)
  uint64_t ll128SlotBytes;  // data bytes per LL128 slot (a multiple of COMMREF_LL128_LINE_DATA)
};

// The neighbours of this rank in channel c (-1 where there is none). A channel's ring
// is a permutation of the ranks (collectives/topology.py): this rank is at position
// ringPos, ringPrev at ringPos - 1 and ringNext at ringPos + 1 (mod nranks); the rank at
// every position is in CollArgs.ringRanks.
struct ChannelPeers {
  int32_t ringPrev, ringNext;
  int32_t treeParent, treeChild0, treeChild1;
  int32_t treeInAtParent;   // which inbound FIFO of the parent this rank feeds (1 or 2)
  int32_t treeOutAtParent;  // which outbound link of the parent feeds this rank (2 or 3)
  int32_t ringPos;          // this rank's position in the channel's ring
};

// The first failure of a kernel, in host-visible memory: the launcher turns it into
// an exception naming rank, peer, what was awaited, expected vs seen (wait.h says how
// a kernel fills it).
//   kNoInstance: the kernel has no instance for the call's (dtype, op): a GPU module
//     specialised for other ones was launched (COMMREF_DISPATCH_REDUCTION, reduce.h),
//     or a code is unknown. seen = dtype | op << 32 (the call's codes); expected = the
//     module's dtype | op mask << 32 (bit k: op code k), or ~0 where the build holds
//     every instance; what = 0, peer = -1, channel = the block.
enum ErrorCode : uint32_t { kOk = 0, kTimeout = 1, kMismatch = 2, kAborted = 3, kNoInstance = 4 };
enum WaitWhat : uint32_t {
  kWaitRecvReady = 1,     // data of a step from the sending peer
  kWaitSendCredit = 2,    // the receiving peer to free a FIFO slot
  kCallMismatch = 3,      // the peer's call descriptor (collective, algorithm, dtype, op, root) differs
  kCountMismatch = 4,     // the peer's element count differs
  kWaitGinQueue = 5,      // a free descriptor slot in the GIN queue (the proxy is behind)
  kWaitGinFlush = 6,      // the proxy to complete earlier operations (flush)
  kWaitLsaBarrier = 7,    // the peer to reach the same LSA barrier (direct kernels)
  kBufferMismatch = 8,    // the peer's symmetric buffer offset differs (direct kernels)
  kWaitSignal = 9,        // a user kernel's signal to reach a value (device.h)
  kWaitCounter = 10,      // a user kernel's counter to reach a value (device.h)
  kWaitBarrier = 11,      // the peer to reach a user kernel's barrier (device.h)
  kBadArgument = 12,      // a user kernel's device-API call out of range (expected: the limit, seen: the value)
  kWaitP2pAccept = 13,    // a send's receiver to take its first slot (kernels/p2p.cu)
  kP2pRecvMismatch = 14,  // a recv's sender posted another dtype or count (expected: its count, seen: its descriptor)
  kP2pSendRejected = 15   // a send's receiver posted another dtype or count (expected: its count, seen: its descriptor)
};
struct ErrorRecord {
  uint32_t code, what;
  int32_t rank, peer, channel, pad;
  uint64_t expected, seen;
};

// GIN: how a kernel reaches its proxy, and how its GIN connections signal.
enum GinProtocol : uint32_t {
  kGinStrong = 0,        // a slot's puts, a strong signal on the last (the default; always safe)
  kGinWeakLast = 1,      // each slot: putsPerSlot puts, a weak signal on the last one only (unsafe unordered)
  kGinSignalPerPut = 2,  // each slot: putsPerSlot puts, each with a weak signal; the receiver counts
  kGinFlushSignal = 3    // each slot: putsPerSlot puts, flush, then a weak signal
};
struct GinArgs {
  uint64_t peerMask;  // bit r set: the link to rank r goes over GIN (else LSA)
  uint32_t capacity;  // descriptors in the queue
  uint32_t protocol;  // GinProtocol
  uint32_t putsPerSlot;
  uint32_t checkHeaders;      // 0 where the header itself may land late (weak protocols)
  uint32_t creditSignalBase;  // ready signals first: (c*4 + k)*nsteps + slot; then credits: base + c*4 + j
  uint32_t doorbells;         // 1: the proxy decides landings at doorbells (unordered wire): connections ring one
                              // after each slot's puts and each credit; 0: the wire lands in posted order, none rung
  // Where this rank's queue (the descriptors, then the header: gin.h) and its counters
  // live, in host memory the proxy polls and the kernels reach: on the CPU engine the
  // window's ginQueueOff and ginCountersOff regions; on a GPU pinned host memory mapped
  // into the device (the window's regions then stay unused). Signals stay in the window.
  uint64_t queue;
  uint64_t counters;
};

// A user buffer inside a symmetric window (direct kernels): rank j's copy of it is at
// ((const uint64_t*)peerTable)[j] + offset in this address space. The offset is the
// same on every rank when the ranks allocated their windows symmetrically; the direct
// kernels check that at their first barrier. Over GIN a put names the window by
// ginWindow (GinDescriptor.windows, gin.h): the same on every rank, since ranks
// allocate and free their windows in the same order.
struct SymBuffer {
  uint64_t peerTable;  // -> uint64_t[nranks]: each rank's window, mapped here; 0 if none
  uint64_t offset;
  uint32_t ginWindow;  // the window's GIN id (1 ..< COMMREF_GIN_MAX_WINDOWS), 0 where GIN does not know it
  uint32_t pad;
};

// The call descriptor (CollArgs.callDesc): what every rank of a call must agree on,
// packed as X(field, shift, bits): field = (callDesc >> shift) & ((1 << bits) - 1).
// Kernels only compare whole descriptors (a step's header, an LSA barrier slot); the
// host packs them (abi.pack_call) and decodes a mismatch (abi.unpack_call).
#define COMMREF_CALL_VARIANT_SHIFT 52
#define COMMREF_CALL_VARIANT_BITS 4
#define COMMREF_CALL_FIELDS(X)                                                               \
  X(collective, 0, 4) /* Collective */                                                       \
  X(algorithm, 4, 4)  /* Algorithm */                                                        \
  X(dtype, 8, 8)      /* DataType (reduce.h) */                                              \
  X(op, 16, 8)        /* RedOp (reduce.h) */                                                 \
  X(root, 24, 16)     /* rooted collectives; 0 otherwise */                                  \
  X(nchannels, 40, 8)                                                                        \
  X(protocol, 48, 4)                                                /* Protocol (proto.h) */ \
  X(variant, COMMREF_CALL_VARIANT_SHIFT, COMMREF_CALL_VARIANT_BITS) /* nvls: NvlsVariant (kernels/nvls.cu); else 0 */
enum Collective : uint32_t {
  kAllReduce = 0,
  kAllGather = 1,
  kReduceScatter = 2,
  kBroadcast = 3,
  kReduce = 4,
  kAlltoAll = 5,
  kP2p = 6  // a send or recv (kernels/p2p.cu); its peer's descriptor must be the same
};
enum Algorithm : uint32_t { kRing = 0, kTree = 1, kDirect = 2, kNvls = 3 };
// An nvls AllReduce's call descriptor field `variant` (kernels/nvls.cu).
enum NvlsVariant : uint32_t { kNvlsOneShot = 0, kNvlsTwoShot = 1 };
// How a step's data and its readiness travel through a FIFO slot (proto.h). The direct
// kernels use no FIFO: their calls carry kProtoSimple.
enum Protocol : uint32_t { kProtoSimple = 0, kProtoLL = 1, kProtoLL128 = 2 };

struct CollArgs {
  uint64_t sendbuf, recvbuf;  // device addresses
  uint64_t count;             // elements (bytes for kernels that only move data), see each kernel
  uint64_t peerWindows;       // -> uint64_t[nranks]: each rank's connection window, mapped here
  uint64_t ringRanks;         // -> int32_t[nchannels][nranks]: the rank at position p of channel c's
                              //    ring at [c * nranks + p] (ChannelPeers.ringPos: this rank's)
  uint64_t errorRecord;       // -> ErrorRecord
  uint64_t abortFlag;         // -> uint64_t; nonzero when the job is being torn down
  uint64_t callDesc;          // COMMREF_CALL_FIELDS packed; must match on all ranks
  int64_t timeoutNs;          // deadline of every wait
  WindowLayout layout;
  int32_t rank, nranks, root, dtype, op, nchannels, elemSize;
  int32_t avgDivisor;    // what the rank that finishes a reduction divides it by: nranks for op
                         //    avg, 0 for none; a hierarchical phase's final step: the whole job's ranks
  int32_t streamStores;  // CPU: 1 = stream what another agent reads next past the cache (move.h)
  int32_t protocol;      // Protocol of every FIFO step of the call (proto.h)
  GinArgs gin;
  SymBuffer symSend, symRecv;  // direct kernels only
  ChannelPeers peers[COMMREF_MAX_CHANNELS];
};

// The device communicator (NCCL's ncclDevComm) that users' kernels receive
// (include/commref/device.h; commref.DeviceComm builds it). It is a communicator's launch
// record (windows, GIN queue, error record, abort word, deadline, the channels' ring and
// tree peers that Prims connect to) plus what the user asked for when creating it:
//   - the device window: bytes [windowOff, windowOff + windowBytes) of every rank's
//     connection window, addressed by offsets from windowOff (puts, gets, LSA pointers);
//   - signals: indexed GIN signals [signalBase, signalBase + nsignals) of every rank's
//     window (ginSignalsOff), the same words over LSA and GIN; after them the barriers'
//     (2 * ncontexts + 3) * (nranks + 1) words (device.h);
//   - counters: local-completion counters [0, ncounters) at `counters`;
//   - the LSA team: the ranks reached by load and store (lsaRanks -> int32_t[lsaSize]).
// `launch`: 1 for the first launch of a kernel on this device communicator, then 2, ...
// (every rank counts its own launches, so equal across ranks that launch alike);
// kernels derive signal targets from it instead of resetting signals.
#define COMMREF_KERNEL_MAX_ARGS 16
#define COMMREF_DEVCOMM_MAX_CONTEXTS 4  // GIN contexts of a device communicator, at most
enum DevCommFlags : uint32_t {
  kDevCommStrongSignals = 1u << 0,   // GIN links offer strong signals (else weak only: flush, then signal)
  kDevCommCountedWrites = 1u << 1,   // counted writes are safe on every GIN link (the ordering study)
  kDevCommStrictOrdering = 1u << 2,  // created with strict ordering (NCCL_WIN_STRICT_ORDERING): VA signals allowed
  kDevCommStridedTeams = 1u << 3     // every node holds lsaSize consecutive ranks: LSA and rail teams are strided
};
// Why a device-API argument was refused (kBadArgument), where the reason has a message
// of its own: ErrorRecord.peer holds it (-1: a limit of the argument's range).
enum BadArgumentReason : int32_t {
  kBadArgVaSignal = 1,       // a VA signal on a device communicator without strict ordering
  kBadArgVaOffset = 2,       // a VA signal's word not 8 aligned bytes inside the window
  kBadArgTeamRank = 3,       // a team rank outside the team
  kBadArgTeamShape = 4,      // a team that is not strided here, or a factor that does not divide
  kBadArgSymPtr = 5,         // a symmetric pointer used outside the window
  kBadArgBits = 6,           // a compare width outside 1 .. 64
  kBadArgRequestContext = 7  // a flush request waited on a handle of another context
};
struct DevComm {
  CollArgs coll;
  uint64_t windowOff, windowBytes;
  uint64_t counters;  // -> uint64_t[ncounters]
  uint64_t lsaRanks;  // -> int32_t[lsaSize], ascending
  uint64_t launch;
  uint32_t signalBase, nsignals, ncounters, flags;
  int32_t lsaRank, lsaSize;
  uint32_t ncontexts;  // GIN contexts the kernels may use: 0 .. ncontexts - 1 (at most 4, device.h)
  uint32_t pad;
};
// What a user kernel takes (COMMREF_KERNEL(name, KernelArgs, args)): the device
// communicator and up to COMMREF_KERNEL_MAX_ARGS 64-bit words (device addresses,
// integers, doubles' bits: commref.Kernel.launch packs them in order).
struct KernelArgs {
  DevComm comm;
  uint64_t arg[COMMREF_KERNEL_MAX_ARGS];
  uint32_t nargs, pad;
};

// One point-to-point operation of commref_p2p (kernels/p2p.cu), which takes CollArgs with
// sendbuf -> P2pOp[count], the operations of a group on one communicator, in the order
// they were posted; the launch has one block per (peer, direction), block `block` runs
// its operations in that order on one link: the window channel `channel` (after the
// collectives' channels), outbound link `conn` of a send, inbound FIFO `conn` of a recv.
// `done`: written by the kernel (thread 0, release) once the operation has completed, so
// that the host can name the one that failed.
// Zero copy (kernels/p2p.cu): a send whose buffer lies in a symmetric window, over an LSA
// link, has `symWindow` = the window's id (SymBuffer.ginWindow: the same on every rank)
// and `symOffset` = the buffer's offset in it; otherwise symWindow is 0. A recv over an
// LSA link has `symWindows` -> uint64_t[COMMREF_GIN_MAX_WINDOWS][2]: per window id, the
// address of its peer table (SymBuffer.peerTable; 0: no such window) and its bytes.
struct P2pOp {
  uint64_t buf;         // device address: the send's source, the recv's destination
  uint64_t count;       // elements: the slot header's count, which the peer's must equal
  uint64_t callDesc;    // kP2p and the dtype (COMMREF_CALL_FIELDS): the peer's must equal it
  uint64_t bytes;       // count * the dtype's size
  uint64_t symOffset;   // send, symWindow != 0: buf's offset in its window
  uint64_t symWindows;  // recv over LSA: the window table (above); 0 otherwise
  int32_t peer, send;   // send: 1 sends to peer, 0 receives from it
  int32_t channel, conn;
  int32_t block;
  uint32_t done;
  uint32_t symWindow;  // send: buf's window id, 0 where the send goes through the FIFO
  uint32_t pad;
};

struct CopyArgs {  // engine self-test and benchmark kernels
  uint64_t src, dst, bytes;
};

// commref_pack (kernels/pack.cu): the `n` copies of the CopyArgs table at `copies`, one
// after the other; none where `flagBytes` > 0 and the `flagBytes` bytes at `flag` differ
// from the low bytes of `clear` (a packed group's unpacking, collectives/packing.py).
struct PackArgs {
  uint64_t copies;
  uint32_t n, flagBytes;
  uint64_t flag, clear;
};

// commref_stream (kernels/selftest.cu, bench/bound.py): nin input and nout output arrays
// of `words` 32-bit words each, one after the other from `base` (inputs first); the
// first `shared` outputs are the first `shared` inputs (in place). words: a multiple of 16.
struct StreamArgs {
  uint64_t base, words;
  int32_t nin, nout, shared;
  int32_t streamStores;  // 1: non-temporal stores (where the build has them, move.h)
};

// One launch on the CPU engine, prepared once by the host and then run by its address
// alone (commref_cpu_launch_prepared, cpu/engine.cpp): a call that repeats pays for one
// argument where commref_cpu_launch takes four (ctypes converts each, about 0.1 us).
struct LaunchDesc {
  uint64_t kernel;  // void (*)(const void*), an entry point of the library
  uint64_t args;    // the kernel's argument record
  uint32_t grid, block;
};

// What this CPU guarantees of the accesses the line protocols rely on (proto.h), as
// commref_cpu_protocol_support() (cpu/engine.cpp) reports it at run time.
enum CpuProtocolSupport : uint32_t {
  kCpuAtomic16 = 1u << 0,   // an aligned 16-byte SSE load or store is single-copy atomic (x86-64 with AVX): LL
  kCpuStoreOrder = 1u << 1  // stores become visible in program order (x86-64, TSO): GIN lands LL128 lines in order
};

// What running a kernel on the CPU engine returns (commref_cpu_launch, cpu/engine.cpp).
enum LaunchStatus : int32_t {
  kLaunchOk = 0,
  kLaunchFailed = 1,   // the kernel aborted: its ErrorRecord says why
  kLaunchRefused = 2,  // the engine could not run it: bad grid or block, no thread or stack
  kLaunchStuck = 3     // CPU: a block's threads wait at barriers that can never complete (coop.h)
};

}  // namespace commref
