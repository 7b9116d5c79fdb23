// Litmus kernels of the device API's conformance suite (tests/test_device_conformance.py;
// the promises, their outcome classes per wire and the codes below are
// collectives/device_api/conformance.py's LITMUS).
//
// Two roles: rank 0 sends, rank 1 receives (other ranks only meet the barriers). Each
// round runs every litmus whose bit is set in the mask, in code order, then a barrier()
// that makes everything of the round visible before the next one begins. Every datum
// of a round carries the round's stamp; the receiver counts, per litmus, the reads of
// word A and of word B that are not this round's (stale): outcome 2 * code (A) and
// 2 * code + 1 (B) of the counts array.
//
// Window: litmus `code` owns bytes [256 code, 256 code + 256): +0 word A and +8 word B
// (rank 1's, written by rank 0's puts; or rank 1's get destination), +64 and +72 their
// sources (rank 0's).
//
// Arguments: mask (bit `code`: run it), rounds, counts (uint64[2 * kLitmusCodes + 1], rank
// 1; the last word counts the litmus run, round by round, so a run that did nothing shows).
#include "commref/device.h"
using namespace commref;

enum LitmusCode : int {
  kStrongCoversEarlier = 0,  // put A; put B + strong signal; wait; read A, B
  kWeakOwnOnly = 1,          // put A; put B + weak signal; wait; read A, B
  kStrongSignalAlone = 2,    // put A; strong signal alone; wait; read A
  kWeakSignalAlone = 3,      // put A; weak signal alone; wait; read A
  kFlushThenFlag = 4,        // put A; flush; put B + weak signal; wait; read A, B
  kCounterThenFlag = 5,      // put A counting counter 0; wait for it; put B + weak signal; wait; read A, B
  kGetAfterFlush = 6,        // rank 1: get A; flush; read A
  kGetBeforeFlush = 7,       // rank 1: get A; read A; flush
  kCountedWrite = 8,         // countedPut A; wait for the count; read A
  kOtherContext = 9,         // put A on context 1; put B on context 0 + strong signal; wait; read A, B
  kBarrierFenced = 10,       // put A on context 1; barrier(Puts, 1); read A
  kBarrierUnfenced = 11,     // put A on context 1; barrier(Puts, 0); read A
  kBarrierNone = 12,         // put A; barrier(None, all); read A
  kBarrierDefault = 13,      // put A on context 1; barrier(); read A
  kBarrierGets = 14,         // rank 1: get A on context 1; barrier(Gets, all); read A
  kLitmusCodes = 15
};

__device__ static uint64_t litmusOff(int code, int word) { return 256 * (uint64_t)code + 8 * (uint64_t)word; }

COMMREF_KERNEL(litmus, KernelArgs, args) {
  DeviceComm comm(args);
  const uint64_t mask = comm.u64(0), rounds = comm.u64(1);
  uint64_t* counts = comm.ptr<uint64_t>(2);
  const int r = comm.rank();
  const bool sender = r == 0, receiver = r == 1;
  // Signal `code` and counter 0 as they stand: the previous launch ended with barrier(),
  // after which every signal of it has landed.
  uint64_t base[kLitmusCodes];
  for (int c = 0; c < kLitmusCodes; c++) base[c] = receiver ? comm.readSignal((uint32_t)c) : 0;
  const uint64_t counterBase = sender ? comm.readCounter(0) : 0;
  DeviceGin ctx0 = comm.gin(0), ctx1 = comm.gin(1);
  for (uint64_t i = 0; i < rounds; i++) {
    // A's stamp of litmus c in this round; B's has bit 7 set.
    auto stamp = [&](int c, int word) { return comm.launch() << 40 | (i + 1) << 8 | (uint64_t)word << 7 | c; };
    if (sender && threadIdx.x == 0)
      for (int c = 0; c < kLitmusCodes; c++) {
        *comm.local<uint64_t>(litmusOff(c, 8)) = stamp(c, 0);
        *comm.local<uint64_t>(litmusOff(c, 9)) = stamp(c, 1);
      }
    __syncthreads();
    comm.barrier(GinFenceLevel::None, 0);  // the sources are stamped before any get reads them
    const uint64_t want = i + 1;           // signals and counts of this launch so far, per litmus
    for (int c = 0; c < kLitmusCodes; c++) {
      if (!(mask >> c & 1)) continue;
      const uint64_t a = litmusOff(c, 0), b = litmusOff(c, 1), srcA = litmusOff(c, 8), srcB = litmusOff(c, 9);
      const uint32_t id = (uint32_t)c;
      bool readB = false, waits = true;
      switch (c) {
        case kStrongCoversEarlier:
        case kWeakOwnOnly:
          if (sender) {
            ctx0.put(1, a, srcA, 8);
            ctx0.put(1, b, srcB, 8, c == kStrongCoversEarlier ? StrongSignalInc(id) : WeakSignalInc(id));
          }
          readB = true;
          break;
        case kStrongSignalAlone:
        case kWeakSignalAlone:
          if (sender) {
            ctx0.put(1, a, srcA, 8);
            ctx0.signal(1, c == kStrongSignalAlone ? StrongSignalInc(id) : WeakSignalInc(id));
          }
          break;
        case kFlushThenFlag:
        case kCounterThenFlag:
          if (sender) {
            if (c == kFlushThenFlag) {
              ctx0.put(1, a, srcA, 8);
              ctx0.flush();
            } else {
              ctx0.put(1, a, srcA, 8, NoSignal(), 0);
              comm.waitCounter(0, counterBase + want);
            }
            ctx0.put(1, b, srcB, 8, WeakSignalInc(id));
          }
          readB = true;
          break;
        case kCountedWrite:
          if (sender) ctx0.countedPut(1, a, srcA, 8, id);
          break;
        case kOtherContext:
          if (sender) {
            ctx1.put(1, a, srcA, 8);
            ctx0.put(1, b, srcB, 8, StrongSignalInc(id));
          }
          readB = true;
          break;
        case kGetAfterFlush:
        case kGetBeforeFlush:
          waits = false;
          if (receiver) {
            ctx0.get(0, a, srcA, 8);
            if (c == kGetAfterFlush) ctx0.flush();
          }
          break;
        case kBarrierGets:
          waits = false;
          if (receiver) ctx1.get(0, a, srcA, 8);
          comm.barrier(GinFenceLevel::Gets, GinAllContexts);
          break;
        default:  // the barriers after a put
          waits = false;
          if (sender) (c == kBarrierNone ? ctx0 : ctx1).put(1, a, srcA, 8);
          if (c == kBarrierFenced)
            comm.barrier(GinFenceLevel::Puts, 1);
          else if (c == kBarrierUnfenced)
            comm.barrier(GinFenceLevel::Puts, 0);
          else if (c == kBarrierNone)
            comm.barrier(GinFenceLevel::None, GinAllContexts);
          else
            comm.barrier();
      }
      if (!receiver) continue;
      if (waits) comm.waitSignal(id, base[c] + want, 0);
      if (threadIdx.x == 0) {
        if (load_relaxed(comm.local<uint64_t>(a)) != stamp(c, 0)) counts[2 * c]++;
        if (readB && load_relaxed(comm.local<uint64_t>(b)) != stamp(c, 1)) counts[2 * c + 1]++;
      }
      if (threadIdx.x == 0) counts[2 * kLitmusCodes]++;
      __syncthreads();
      if (c == kGetBeforeFlush) ctx0.flush();  // it lands before the round ends
    }
    comm.barrier();  // every put of the round is visible before the next round's
  }
}
