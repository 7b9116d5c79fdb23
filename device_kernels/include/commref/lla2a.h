// commref/lla2a.h — the LL all-to-all session over the LSA team (NCCL's
// ncclLLA2ASession): small values to any member's slots, each an LL line that carries
// its own readiness, so a receiver needs no flag word and nobody resets anything
// between uses.
//
//   #include "commref/lla2a.h"
//   LLA2ASession s(lsaMultimem(args), off, blockIdx.x, slots);   // block-collective
//   s.bcast<float>(comm.lsaRank(), x);                // into slot lsaRank of every member
//   float sum = s.recvReduce<float, OpSum>(0, comm.lsaSize(), 1);
//   s.endEpoch();                                     // block-collective
//
// Contract:
//   - A line is 8 bytes: 4 bytes of data and a 4-byte flag, written by one 8-byte store,
//     so a load that sees the flag sees the data. A value of type T (4 or 8 bytes) takes
//     sizeof(T) / 4 lines: slot s of T is lines [s * W, s * W + W), W = sizeof(T) / 4,
//     all below `slots`.
//   - Memory: block b's region is LLA2ASession::bytes(slots) bytes from off + b * that,
//     in every member's device window (the same offsets), zero before its first use: a
//     word of this rank's completed epochs, then two banks of `slots` lines. Epoch e
//     (1, 2, ...) writes and reads bank e % 2 with flag (e mod (2^32 - 1)) + 1, so no
//     line of an earlier epoch matches, and sessions of later launches continue from
//     the epoch the word holds: no reset.
//   - The session runs over a multimem handle (multimem.h) of the LSA team: its members,
//     their copies and the launch's deadline. send<T>(member, slot, v): v into `slot` of
//     that member (lsaRank order); bcast<T>(slot, v): into `slot` of every member, this
//     rank included (the handle's st: one multimem.st per line with multicast). recv<T>(slot,
//     from): waits until `slot` holds this epoch's value and returns it (`from` names,
//     in a failure, the member expected to send it; -1: unknown). recvReduce<T, Op>(
//     first, count, stride): the fold by Op (reduce.h) of recv at first, first +
//     stride, ... in that order. All four are per-thread; a slot takes one value per
//     epoch.
//   - endEpoch(): block-collective; ends the epoch. Before it, every member must have
//     been sent at least one value by this rank and this rank must have received at
//     least one value from every member (NCCL's rule): then a member that writes bank
//     e % 2 again (epoch e + 2) has seen this rank's epoch e + 1, which this rank started
//     after reading bank e % 2, so no value lands on one not yet read. A session's last
//     call is endEpoch.
//   - A recv that does not see its value by the communicator's deadline returns 0 and
//     fails the launch (CommTimeout naming this rank, `from`, the flag expected and the
//     flag seen); the block leaves at its next endEpoch. A member outside the team, a
//     slot outside `slots`, or a region outside the window fails the launch as the
//     device API's range errors do (ValueError).
#pragma once
#include "device.h"  // DeviceComm, and multimem.h

namespace commref {

struct LLA2ASession {
  // Bytes of one block's region for `slots` lines (a multiple of COMMREF_FLAG_STRIDE).
  static __device__ __forceinline__ uint64_t bytes(uint32_t slots) {
    const uint64_t raw = 8 + 2ull * slots * 8;
    return (raw + COMMREF_FLAG_STRIDE - 1) / COMMREF_FLAG_STRIDE * COMMREF_FLAG_STRIDE;
  }

  // Block-collective: checks that the region lies in the window (else fails the launch).
  __device__ LLA2ASession(const Multimem& m, uint64_t off, uint32_t block, uint32_t slots);

  template <typename T>
  __device__ void send(int member, uint32_t slot, T v);
  template <typename T>
  __device__ void bcast(uint32_t slot, T v);
  template <typename T>
  __device__ T recv(uint32_t slot, int from = -1);
  template <typename T, typename Op>
  __device__ T recvReduce(uint32_t first, uint32_t count, uint32_t stride);
  __device__ void endEpoch();

  __device__ uint64_t epoch() const { return ep; }

 private:
  Multimem mm;
  uint64_t region;  // this block's region: its offset in each member's copy
  uint32_t slots;
  uint64_t ep;  // the running epoch

  __device__ uint32_t flag() const { return (uint32_t)(ep % 0xffffffffull) + 1; }
  __device__ uint64_t lineOffset(uint32_t line) const { return region + 8 + ((ep & 1) * slots + line) * 8; }
  __device__ bool lineOk(int member, uint32_t line, uint32_t lines);
  __device__ uint32_t load(uint32_t line, int from);
};

}  // namespace commref

#include "impl/lla2a__funcs.h"
