// commref/flow.h — flow primitives: the vocabulary every collective is written in.
//
// A Prims object is one block's view of one channel: up to two inbound and two
// outbound connections, each LSA or GIN (connection.h). Each primitive is one pipeline step on the connections it
// uses, moving at most slotElems() elements:
//
//   send(src, n)                        src            -> every send peer
//   recv(dst, n)                        recv peers     -> dst
//   recvReduceSend(src, n)              src (+) recv   -> send peers
//   recvReduceCopy(src, dst, n, last)   src (+) recv   -> dst
//   recvReduceCopySend(src, dst, n, l)  src (+) recv   -> dst and send peers
//   recvCopySend(dst, n)                recv           -> dst and send peers
//   recvSend(n)                         recv           -> send peers
//   copySend(src, dst, n)               src            -> dst (unless in place) and send peers
//   copy(src, dst, n, last)             src            -> dst (single-rank case)
//   handshake()                         no data: only the call descriptors are checked
//
// Outputs after dst (FIFO slots, GIN staging) are read next by a peer or the proxy and
// are streamed past the cache under CollArgs.streamStores (move.h). dst is streamed
// only in receive steps (recv, recvCopySend), and only when streamReceived() has said
// that the call receives many bytes: nothing in the call reads them again.
//
// `last` marks the step that completes a reduction: avg divides there, once.
// All threads of the block call the same primitives in the same order; thread 0 does
// the waits and the posts, the block moves the data between two barriers.
// Failure (wait.h): the barrier after thread 0's waits is leaveIfFailed(env.failed), a
// __syncthreads_or: if a wait of thread 0 failed (its own deadline, a mismatch, the abort
// flag, or another block of the launch that failed), every thread of the block leaves
// the kernel there together, before any of them moves data; thread 0 posts nothing once
// it has failed (connection.h), and a failure while posting (a GIN queue wait) ends the
// block at the next step's barrier or at finish().
// Every step happens on every rank even when n == 0, so step counters stay aligned.
#pragma once
#include "connection.h"
#include "move.h"

template <typename T, typename Op>
class Prims {
 public:
  __device__ Prims(const CollArgs& args, int channel)
      : a(args), env(kernelEnv(args)), channel_(channel), nrecv(0), nsend(0), streamReceived_(false) {}

  // `bytes`: what this channel's receive steps store into the recvbuf over the whole
  // call, on lines the call has not read itself (not in place). With streamStores, from
  // COMMREF_RECEIVED_STREAM_MIN_BYTES per thread on, the receive steps stream those
  // stores; below it the result still fits in the cache and streaming it costs
  // (docs/performance.md, "Streamed stores").
  __device__ void streamReceived(uint64_t bytes) {
    streamReceived_ = a.streamStores && bytes / blockDim.x >= COMMREF_RECEIVED_STREAM_MIN_BYTES;
  }

  __device__ uint64_t slotElems() const { return a.layout.slotBytes / sizeof(T); }

  // Inbound FIFO `in` of this rank, fed by `peer` through its outbound link `outAtPeer`.
  __device__ void addRecv(int in, int peer, int outAtPeer) {
    rx[nrecv] = makeRecv(a, channel_, in, peer, outAtPeer);
    rxStep[nrecv] = load_relaxed(rx[nrecv].stepState);
    nrecv++;
  }
  // Outbound link `out` of this rank to `peer`, which receives on its FIFO `inAtPeer`.
  __device__ void addSend(int out, int peer, int inAtPeer) {
    tx[nsend] = makeSend(a, channel_, out, peer, inAtPeer);
    txStep[nsend] = load_relaxed(tx[nsend].stepState);
    nsend++;
  }
  // Persists the step counters for the next launch (or the next Prims on the same
  // connections in this launch). Call once, after the last step.
  __device__ void finish() {
    leaveIfFailed(env.failed);
    if (threadIdx.x == 0) {
      for (int i = 0; i < nrecv; i++) store_relaxed(rx[i].stepState, rxStep[i]);
      for (int i = 0; i < nsend; i++) store_relaxed(tx[i].stepState, txStep[i]);
    }
    __syncthreads();
  }

  // A step without data on every connection: each rank checks its peers' call
  // descriptors. Kernels whose data steps leave some rank without an inbound step
  // from a peer running the same kernel (rooted collectives, the tree) start with it,
  // so that every mismatch surfaces as CommMismatch rather than a timeout or, worse,
  // two ranks that both think they are the root.
  // Sends first, then receives: every rank does the same, so a ring of handshakes
  // cannot wait on itself.
  __device__ void handshake() {
    if (threadIdx.x == 0) {
      for (int i = 0; i < nsend; i++) {
        connWaitCredit(tx[i], txStep[i], a, env);
        connPost(tx[i], txStep[i], 0, a, env);
      }
      for (int i = 0; i < nrecv; i++) {
        connWaitReady(rx[i], rxStep[i], a, env);
        connRelease(rx[i], rxStep[i], a, env);
      }
    }
    leaveIfFailed(env.failed);
    for (int i = 0; i < nrecv; i++) rxStep[i]++;
    for (int i = 0; i < nsend; i++) txStep[i]++;
  }

  __device__ void send(const T* src, uint64_t n) { step(false, true, src, nullptr, n, false); }
  __device__ void recv(T* dst, uint64_t n) { step(true, false, nullptr, dst, n, false); }
  __device__ void recvReduceSend(const T* src, uint64_t n) { step(true, true, src, nullptr, n, false); }
  __device__ void recvReduceCopy(const T* src, T* dst, uint64_t n, bool last) { step(true, false, src, dst, n, last); }
  __device__ void recvReduceCopySend(const T* src, T* dst, uint64_t n, bool last) { step(true, true, src, dst, n, last); }
  __device__ void recvCopySend(T* dst, uint64_t n) { step(true, true, nullptr, dst, n, false); }
  __device__ void recvSend(uint64_t n) { step(true, true, nullptr, nullptr, n, false); }
  __device__ void copySend(const T* src, T* dst, uint64_t n) { step(false, true, src, dst == src ? nullptr : dst, n, false); }
  __device__ void copy(const T* src, T* dst, uint64_t n, bool last) { step(false, false, src, dst, n, last); }

 private:
  __device__ COMMREF_NOINLINE void step(bool useRecv, bool useSend, const T* src, T* dst, uint64_t n, bool last) {
    const int nr = useRecv ? nrecv : 0, ns = useSend ? nsend : 0;
    if (threadIdx.x == 0) {
      for (int i = 0; i < nr; i++) connWaitReady(rx[i], rxStep[i], a, env);
      for (int i = 0; i < ns; i++) connWaitCredit(tx[i], txStep[i], a, env);
    }
    leaveIfFailed(env.failed);
    const T* in[3];
    T* out[3];
    int nin = 0, nout = 0;
    if (src) in[nin++] = src;
    for (int i = 0; i < nr; i++) in[nin++] = (const T*)connRecvData(rx[i], rxStep[i], a);
    if (dst) out[nout++] = dst;
    for (int i = 0; i < ns; i++) out[nout++] = (T*)connSendData(tx[i], txStep[i], a);
    // Outputs from `handoff` on are streamed (see the top of this file).
    const int handoff = dst && !(streamReceived_ && !src) ? 1 : 0;
    if (nin > 0 && nout > 0)
      reduceCopy<T, Op>(in, nin, out, nout, n, last ? a.avgDivisor : 0, handoff,
                        handoffStreamMin(a.streamStores));
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int i = 0; i < ns; i++) connPost(tx[i], txStep[i], n * sizeof(T), a, env);
      for (int i = 0; i < nr; i++) connRelease(rx[i], rxStep[i], a, env);
    }
    for (int i = 0; i < nr; i++) rxStep[i]++;
    for (int i = 0; i < ns; i++) txStep[i]++;
  }

  const CollArgs& a;
  KernelEnv env;
  int channel_;
  int nrecv, nsend;
  RecvConnection rx[2];
  SendConnection tx[2];
  uint64_t rxStep[2], txStep[2];
  bool streamReceived_;
};
