// NVLS AllReduce: the reduction done by the memory system (NVLink SHARP's multicast
// objects, NCCL's symmetric NVLS kernels) through a multimem handle over the LSA team
// (multimem.h): ldReduce reads the reduction of every rank's copy at an offset, st
// writes one value into every rank's copy.
//   one-shot  every rank ldReduces the whole sendbuf into its own recvbuf: each byte of
//             a result is read once per rank, nothing is stored to a peer
//   two-shot  rank r ldReduces its part (part j = [count*j/n, count*(j+1)/n)) of the
//             sendbufs and sts it into that part of every recvbuf: each element is
//             reduced once in the job
// The call descriptor's variant field (args.h) names one; one-shot in place runs
// two-shot (a rank would overwrite its sendbuf while its peers still read it; in
// two-shot only rank r reads or writes part r, each element read before it is written),
// so every rank decides alike: the buffers' offsets, which decide whether they overlap,
// are the same on every rank (the first barrier checks them).
//
// Preconditions, as the direct kernels' (direct.cu): both buffers in symmetric windows
// (Communicator.alloc_symmetric) at the same offsets on every rank, every rank an LSA
// peer, (dtype, op) one that multicast reduces (multimemSupported; the host refuses the
// others). Multicast hardware: the handles' `mc` (0 here: LSA emulation, multimem.h).
//
//   handshake      the ring link's call check (another kernel shows up as CommMismatch)
//   lsaBarrier     every rank has launched: its sendbuf holds this call's input
//   ...ldReduce and st (one-shot: plain stores into this rank's recvbuf)
//   lsaBarrier     every rank is done: nobody reads this rank's sendbuf any more, and
//                  what the others stored here is visible
#include "commref/multimem.h"
#include "commref/ring.h"

namespace commref {

static __device__ __forceinline__ uint32_t callVariant(const CollArgs& a) {
  return (uint32_t)((a.callDesc >> COMMREF_CALL_VARIANT_SHIFT) & ((1u << COMMREF_CALL_VARIANT_BITS) - 1));
}

template <typename T, typename Op>
static __device__ void nvlsAllReduce(const CollArgs& a) {
  if constexpr (!multimemSupported<T, Op>()) {
    commref_fail_no_instance(a, 0);  // the host refuses these first (collectives/nvls.py)
  } else {
    typedef Arith<T> A;
    KernelEnv env = kernelEnv(a);
    const int c = blockIdx.x, n = a.nranks, r = a.rank;
    ringHandshake<T, Op>(a, c);
    lsaBarrier(a, c, env, true);
    const Multimem in = multimemOver(a, a.symSend), out = multimemOver(a, a.symRecv);
    const uint64_t es = sizeof(T), bytes = a.count * es;
    const bool overlap = a.sendbuf < a.recvbuf + bytes && a.recvbuf < a.sendbuf + bytes;
    const bool oneShot = callVariant(a) == kNvlsOneShot && !overlap;
    const uint64_t first = oneShot ? 0 : a.count * r / n, last = oneShot ? a.count : a.count * (r + 1) / n;
    const Share s = channelShare(last - first, c, a.nchannels);
    for (uint64_t i = first + s.begin + threadIdx.x; i < first + s.end; i += blockDim.x) {
      T v = in.template ldReduce<T, Op>(i * es);
      if (a.avgDivisor != 0) v = A::store(divideBy(A::load(v), a.avgDivisor));
      if (oneShot)
        ((T*)a.recvbuf)[i] = v;
      else
        out.template st<T>(i * es, v);
    }
    lsaBarrier(a, c, env, false);
  }
}

#define NVLS_ALLREDUCE(T, Op) nvlsAllReduce<T, Op>(args)

COMMREF_KERNEL(commref_nvls_allreduce, CollArgs, args) { COMMREF_DISPATCH_REDUCTION(args, NVLS_ALLREDUCE) }

}  // namespace commref
