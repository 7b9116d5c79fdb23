// kernels/device_api/ep.cu — MoE dispatch and combine (DeepEP's two modes) on the device API
// (include/commref/device.h) alone. commref.ep (collectives/device_api/ep_buffer.py) builds the buffer and
// launches these kernels; its module docstring is the user's view.
//
// Kernels (one block; every rank launches the same ones in the same order):
//   ep_layout        topk_idx -> tokens per rank, per expert, is_token_in_rank (local)
//   ep_ht_dispatch   high-throughput: each token once to every rank it selects, into a
//                    flat receive buffer ordered by (source rank, token index)
//   ep_ht_combine    each received token back to its source, which sums its copies
//   ep_ll_dispatch   low-latency: each (token, expert) pair into the expert's fixed slots
//                    for its source rank, with a count per slot (-n-1: 0 is "not arrived")
//   ep_ll_combine    each expert output back to its source, reduced with the top-k weights
//
// Messages. A source s sends a destination d one message per operation: rows (one put
// each over GIN, stored in place over LSA), and in dispatch a count message (the counts
// as ~count = -count-1, so that 0 is never a count: the receiver zeroes them after
// reading). How the receiver knows a message has landed is the buffer's protocol, each a
// cell of the ordering study (transports/gin/study/signaling.py; collectives/device_api/ep_buffer.py
// refuses a cell the study finds unsafe on the wire unless told otherwise):
//   strong          rows without signals, the last put (count message; in combine the
//                   last row) with a strong signal: "last-put [strong]"
//   signal-per-put  every row with a weak inc on the source's data signal, the count
//                   message with one on its count signal: "signal-per-put [weak]"
//   headers         every put starts with an 8-byte header (the operation's tag in the
//                   high word; a count word is never 0) and carries a weak inc on one
//                   signal; the receiver reads the puts whose header is valid once the
//                   signal has counted at least that many: "headers [weak]" (DeepEP's
//                   unordered kernels)
//   weak-last       rows without signals, the last put with a weak signal: "last-put
//                   [weak]", unsafe on an unordered wire (the study's counterexample)
// Over LSA the sender stores rows and counts into the peer's window and then signals
// once (a release add: every store before it is visible).
//
// Signals (user ids), of source s: dispatch data s, dispatch count n + s, combine data
// 2n + s. They are never reset: this rank's window keeps, per id, how many increments the
// operations before this one consumed (EpConfig.scratch).
//
// Reuse of the window. A dispatch ends with a barrier: no rank's next dispatch can
// overwrite the rows, counts and staging that this one's receivers still read. A combine
// that follows a dispatch needs none: its rows go to a region only combines use, at
// sources that wait for every row of theirs (so the puts and their staging are done with
// when the source returns), and the next combine's rows come only after the next
// dispatch, which no rank finishes before every rank has sent it a count message, i.e.
// has returned from this combine; its signals are ids of its own, which a peer already
// in the next dispatch does not touch. A combine that follows a combine (the same handle
// again, or the other mode's) begins with a barrier instead (argument syncFirst).
#include "commref/device.h"
using namespace commref;

// Launch argument 0 of every kernel: int64 words in the order of ep_buffer.py CONFIG_FIELDS.
struct EpConfig {
  int64_t hidden, elemSize, dtype, topk, experts, localExperts, maxTokens, protocol;
  int64_t xBytes, xPad;
  int64_t htRow, htRecv, htCount, htStage, htCountStage, htCombRow, htComb, htCombStage;
  int64_t llRow, llRecv, llCount, llStage, llCountStage, llComb, llCombStage;
  int64_t scratch;  // uint64[3 * nranks] signal bases, then int64[experts] slot counters
};

enum EpProtocol { kEpStrong = 0, kEpSignalPerPut = 1, kEpHeaders = 2, kEpWeakLast = 3 };
enum EpDtype { kEpBfloat16 = 0, kEpFloat16 = 1, kEpFloat32 = 2 };

// Thread 0's value of v, in every thread of the block.
template <typename T>
static __device__ T fromThread0(T v) {
  __shared__ T shared;
  __syncthreads();
  if (threadIdx.x == 0) shared = v;
  __syncthreads();
  return shared;
}

struct Ep {
  DeviceComm& comm;
  const EpConfig& c;
  const int n, me;
  const uint64_t tag;  // this operation's header tag: epoch << 32 (epoch 1 .. 2^32 - 1)

  const int dataIds;  // the data signals of this kind of operation: dataIds + source

  __device__ Ep(DeviceComm& cm, uint64_t epoch, bool combine)
      : comm(cm),
        c(*cm.ptr<const EpConfig>(0)),
        n(cm.nranks()),
        me(cm.rank()),
        tag(epoch << 32),
        dataIds(combine ? 2 * cm.nranks() : 0) {}
  __device__ int data(int source) const { return dataIds + source; }

  __device__ bool overGin(int peer) const { return !comm.isLsaPeer(peer); }
  __device__ bool valid(const char* row) const { return (load_relaxed((const uint64_t*)row) >> 32) == (tag >> 32); }
  __device__ uint64_t* base(int id) const { return comm.local<uint64_t>(c.scratch) + id; }

  // ---- sending ----
  // Where a row for `peer` is built: in place in its window over LSA, else in staging.
  __device__ char* rowAt(int peer, uint64_t dst, uint64_t stage) {
    return overGin(peer) ? comm.local<char>(stage) : comm.lsaPtr<char>(peer, dst);
  }
  __device__ RemoteAction rowSignal() const {
    return c.protocol == kEpSignalPerPut || c.protocol == kEpHeaders ? WeakSignalInc(data(me)) : NoSignal();
  }
  // The last put of a message (dispatch: its count message; combine: its last row).
  __device__ RemoteAction lastSignal(bool countMessage) const {
    if (c.protocol == kEpStrong) return StrongSignalInc(data(me));
    if (c.protocol == kEpSignalPerPut && countMessage) return WeakSignalInc(n + me);
    return WeakSignalInc(data(me));
  }
  // A row built at rowAt(): over GIN put with `s`; over LSA it is already there.
  __device__ void sendRow(int peer, uint64_t dst, uint64_t stage, uint64_t bytes, RemoteAction s) {
    __syncthreads();
    if (overGin(peer)) comm.put(peer, dst, stage, bytes, s);
  }
  // The end of a message over LSA: one release add publishes the block's stores.
  __device__ void endLsaMessage(int peer) {
    if (!overGin(peer)) comm.signal(peer, WeakSignalInc(data(me)));
  }
  // A count message of `words` words staged at `stage` (this rank's counts, ~count).
  __device__ void sendCounts(int peer, uint64_t dst, uint64_t stage, int words) {
    if (overGin(peer)) {
      comm.put(peer, dst, stage, 8ull * words, lastSignal(true));
    } else {
      if (threadIdx.x == 0)
        for (int w = 0; w < words; w++)
          store_relaxed(comm.lsaPtr<uint64_t>(peer, dst) + w, comm.local<uint64_t>(stage)[w]);
      endLsaMessage(peer);
    }
  }

  // ---- receiving ----
  __device__ void waitData(int s, uint64_t increments) { comm.waitSignal(data(s), *base(data(s)) + increments, s); }
  // Headers: the signal target after a read of `seen` increments and `validHeaders`
  // valid headers: their signals if some are missing, else one more put.
  __device__ uint64_t headersTarget(int s, uint64_t seen, uint64_t validHeaders) const {
    return *base(data(s)) + (seen >= validHeaders ? seen + 1 : validHeaders);
  }
  __device__ void consumed(int id, uint64_t increments) {
    __syncthreads();
    if (threadIdx.x == 0) *base(id) += increments;
    __syncthreads();
  }

  // Dispatch, first half: waits until the count message from `s` (first word at
  // `countWord`) may be read. Headers: `slots(f)` calls f(a, b, row) for every row slot
  // the message may fill, so the valid headers can be counted.
  template <class Slots>
  __device__ void awaitCounts(int s, const uint64_t* countWord, Slots slots) {
    if (!overGin(s) || c.protocol == kEpStrong || c.protocol == kEpWeakLast) {
      waitData(s, 1);
      return;
    }
    if (c.protocol == kEpSignalPerPut) {
      comm.waitSignal(n + s, *base(n + s) + 1, s);
      consumed(n + s, 1);
      return;
    }
    for (;;) {  // headers: the count message is a put whose header is its first word
      uint64_t target = 0;
      bool done = false;
      if (threadIdx.x == 0) {
        // The signal first, then the headers: every put signalled by then has a valid
        // header when they are read, so signalled >= valid means they are the same puts.
        // Until the count message's header is valid the slots need no scan: the wait is
        // for one more put, which the count message's own increment guarantees.
        const uint64_t seen = comm.readSignal(data(s)) - *base(data(s));
        const bool counted = load_relaxed(countWord) != 0;
        uint64_t validHeaders = counted;
        if (counted) slots([&](int, int, const char* row) { validHeaders += valid(row); });
        done = counted && seen >= validHeaders;
        target = headersTarget(s, seen, validHeaders);
      }
      if (fromThread0(done)) return;
      comm.waitSignal(data(s), fromThread0(target), s);
    }
  }

  // Dispatch, second half, and combine: the `rows` rows of the message from `s`, each
  // passed to consume(a, b, row) once it may be read (rows(f) calls f(a, b, row) for
  // them in order; a, b: the caller's indices). `countMessage`: the message had one
  // (awaitCounts has run). `streamed`: consume reads the rows, so under headers each is
  // passed on as soon as the rule allows; otherwise (a combine, which reads the rows
  // after every message) the wait is for every put's increment. Then this message's
  // signal increments are consumed.
  template <class Rows, class Consume>
  __device__ void receive(int s, int64_t rows, bool countMessage, bool streamed, Rows forRows, Consume consume) {
    const bool gin = overGin(s);
    const uint64_t puts = (uint64_t)rows + countMessage;
    if (!gin || c.protocol == kEpStrong || c.protocol == kEpWeakLast) {
      if (!countMessage && rows == 0) return;  // a combine message of no rows is not sent
      if (!countMessage) waitData(s, 1);
      forRows(consume);
      consumed(data(s), 1);
      return;
    }
    if (c.protocol == kEpSignalPerPut || !streamed) {
      const uint64_t increments = c.protocol == kEpHeaders ? puts : rows;  // headers: the count message too
      waitData(s, increments);
      forRows(consume);
      consumed(data(s), increments);
      return;
    }
    // headers, streamed: rows are read in order as soon as the rule allows, while others
    // land. Rows before `next` were valid when consumed and stay so; once every put is
    // signalled, every row may be read without looking at its header.
    int64_t next = 0;  // rows consumed
    for (;;) {
      int64_t upto = 0;
      uint64_t target = 0;
      if (threadIdx.x == 0) {
        const uint64_t seen = comm.readSignal(data(s)) - *base(data(s));
        if (seen >= puts) {
          upto = rows;
        } else {
          uint64_t validHeaders = countMessage + next;  // the count message, read valid by awaitCounts
          int64_t j = 0, firstInvalid = -1;
          forRows([&](int, int, const char* row) {
            if (j >= next) {
              const bool v = valid(row);
              validHeaders += v;
              if (!v && firstInvalid < 0) firstInvalid = j;
            }
            j++;
          });
          upto = seen >= validHeaders ? (firstInvalid < 0 ? rows : firstInvalid) : next;
          target = headersTarget(s, seen, validHeaders);
        }
      }
      upto = fromThread0(upto);
      int64_t j = 0;
      forRows([&](int a, int b, const char* row) {
        if (j >= next && j < upto) consume(a, b, row);
        j++;
      });
      next = upto;
      if (next == rows) break;
      comm.waitSignal(data(s), fromThread0(target), s);
    }
    consumed(data(s), puts);
  }
};

// Row enumerators: f(a, b, row) for each row of a message, in order (a, b: indices the
// consumer wants). Functor classes rather than generic lambdas, which NVRTC refuses.
struct SlotRows {  // rows [0, count) of a block of slots `rowBytes` apart
  const char* first;
  int64_t rowBytes, count;
  template <class F>
  __device__ void operator()(F f) const {
    for (int64_t i = 0; i < count; i++) f(0, (int)i, first + i * rowBytes);
  }
};
struct ExpertRows {  // LL dispatch: per local expert e, the source's block of slots
  const char* recv;  // slot (e, s, 0): recv + (e * n + s) * maxTokens * rowBytes
  int64_t rowBytes, maxTokens, n, s, experts;
  const uint64_t* counts;  // ~count per expert, or nullptr: every slot
  template <class F>
  __device__ void operator()(F f) const {
    for (int64_t e = 0; e < experts; e++) {
      const char* first = recv + (e * n + s) * maxTokens * rowBytes;
      const int64_t m = counts ? (int64_t)~counts[e] : maxTokens;
      for (int64_t i = 0; i < m; i++) f((int)e, (int)i, first + i * rowBytes);
    }
  }
};
struct PairRows {  // LL combine: this rank's (token, top-k slot) pairs on rank d's experts
  const char* comb;
  int64_t rowBytes;
  const int64_t* topk;
  int64_t pairs, experts;
  int d;
  template <class F>
  __device__ void operator()(F f) const {
    for (int64_t i = 0; i < pairs; i++)
      if (topk[i] >= 0 && topk[i] / experts == d) f(0, 0, comb + i * rowBytes);
  }
};

// The block copies `bytes` from src to dst.
static __device__ void blockCopy(void* dst, const void* src, uint64_t bytes) {
  copyOwnShare<uint8_t>((uint8_t*)dst, (const uint8_t*)src, bytes);
}

// ---- layout ----

// args: cfg, topk_idx (int64 [ntok, topk]), ntok, num_tokens_per_rank (int32 [n]),
// num_tokens_per_expert (int32 [experts]), is_token_in_rank (bool [ntok, n]).
COMMREF_KERNEL(ep_layout, KernelArgs, args) {
  DeviceComm comm(args);
  const EpConfig& c = *comm.ptr<const EpConfig>(0);
  const int64_t* topk = comm.ptr<const int64_t>(1);
  const int64_t ntok = comm.i64(2), K = c.topk, E = c.experts, per = c.localExperts;
  int32_t* perRank = comm.ptr<int32_t>(3);
  int32_t* perExpert = comm.ptr<int32_t>(4);
  uint8_t* inRank = comm.ptr<uint8_t>(5);
  const int n = comm.nranks();
  for (int64_t t = threadIdx.x; t < ntok; t += blockDim.x) {
    for (int r = 0; r < n; r++) inRank[t * n + r] = 0;
    for (int64_t k = 0; k < K; k++)
      if (topk[t * K + k] >= 0) inRank[t * n + topk[t * K + k] / per] = 1;
  }
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t count = 0;
    for (int64_t i = 0; i < ntok * K; i++) count += topk[i] == e;
    perExpert[e] = count;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < n; r += blockDim.x) {
    int32_t count = 0;
    for (int64_t t = 0; t < ntok; t++) count += inRank[t * n + r];
    perRank[r] = count;
  }
}

// ---- high-throughput ----

// HT dispatch row: [tag | token][x: xPad bytes][topk pairs: int32 local expert (-1: not
// this rank's), float32 weight (0 then)].
// args: cfg, x, topk_idx, topk_weights (float32 [ntok, topk]), is_token_in_rank, ntok,
// epoch, recv_x [n * maxTokens, hidden], recv_topk_idx (int64), recv_topk_weights
// (float32), recv_src_idx (int32), rank_prefix_matrix (int32 [n, n]),
// num_recv_tokens_per_expert (int32 [localExperts]), token_idx_in_rank (int32 [ntok, n]),
// num_recv (int32 [1]).
COMMREF_KERNEL(ep_ht_dispatch, KernelArgs, args) {
  DeviceComm comm(args);
  Ep ep(comm, comm.u64(6), false);
  const EpConfig& c = ep.c;
  const int n = ep.n, me = ep.me;
  const char* x = comm.ptr<const char>(1);
  const int64_t* topk = comm.ptr<const int64_t>(2);
  const float* weights = comm.ptr<const float>(3);
  const uint8_t* inRank = comm.ptr<const uint8_t>(4);
  const int64_t ntok = comm.i64(5), K = c.topk, T = c.maxTokens, per = c.localExperts;
  char* recvX = comm.ptr<char>(7);
  int64_t* recvTopk = comm.ptr<int64_t>(8);
  float* recvWeights = comm.ptr<float>(9);
  int32_t* recvSrc = comm.ptr<int32_t>(10);
  int32_t* prefix = comm.ptr<int32_t>(11);
  int32_t* perExpert = comm.ptr<int32_t>(12);
  int32_t* slotOf = comm.ptr<int32_t>(13);
  int32_t* numRecv = comm.ptr<int32_t>(14);

  // This rank's counts (staged as ~count) and each token's slot at each destination.
  uint64_t* counts = comm.local<uint64_t>(c.htCountStage);
  if (threadIdx.x == 0) {
    for (int d = 0; d < n; d++) {
      int32_t slot = 0;
      for (int64_t t = 0; t < ntok; t++) slotOf[t * n + d] = inRank[t * n + d] ? slot++ : -1;
      counts[d] = ~(uint64_t)slot;
    }
  }
  __syncthreads();

  for (int k = 1; k <= n; k++) {
    const int d = (me + k) % n;
    const int64_t rows = (int64_t)~counts[d];
    int64_t i = 0;
    for (int64_t t = 0; t < ntok && i < rows; t++) {
      if (!inRank[t * n + d]) continue;
      const uint64_t dst = c.htRecv + (uint64_t)(me * T + i) * c.htRow;
      const uint64_t stage = c.htStage + (uint64_t)(d * T + i) * c.htRow;
      char* row = ep.rowAt(d, dst, stage);
      blockCopy(row + 8, x + t * c.xBytes, c.xBytes);
      if (threadIdx.x == 0) {
        *(uint64_t*)row = ep.tag | (uint64_t)t;
        int32_t* pairs = (int32_t*)(row + 8 + c.xPad);
        for (int64_t j = 0; j < K; j++) {
          const int64_t e = topk[t * K + j];
          const bool mine = e >= d * per && e < (d + 1) * per;
          pairs[2 * j] = mine ? (int32_t)(e - d * per) : -1;
          const float w = mine ? weights[t * K + j] : 0.0f;
          memcpy(&pairs[2 * j + 1], &w, 4);
        }
      }
      ep.sendRow(d, dst, stage, c.htRow, ep.rowSignal());
      i++;
    }
    ep.sendCounts(d, c.htCount + (uint64_t)me * n * 8, c.htCountStage, n);
  }

  // Every source's count message: the whole count matrix, then where each source's rows go.
  const uint64_t* matrix = comm.local<const uint64_t>(c.htCount);  // [s][d] = ~count
  for (int s = 0; s < n; s++)
    ep.awaitCounts(s, matrix + s * n,
                   SlotRows{comm.local<const char>(c.htRecv + (uint64_t)s * T * c.htRow), c.htRow, T});
  if (threadIdx.x == 0) {
    for (int d = 0; d < n; d++) {
      int32_t sum = 0;
      for (int s = 0; s < n; s++) prefix[s * n + d] = sum += (int32_t)~load_relaxed(matrix + s * n + d);
    }
    numRecv[0] = prefix[(n - 1) * n + me];
    for (int64_t e = 0; e < per; e++) perExpert[e] = 0;
  }
  __syncthreads();

  int64_t start = 0;  // where source s's rows go in the flat buffer
  for (int s = 0; s < n; s++) {
    const int64_t rows = (int64_t)~matrix[s * n + me];
    ep.receive(s, rows, true, true,
               SlotRows{comm.local<const char>(c.htRecv + (uint64_t)s * T * c.htRow), c.htRow, rows},
               [&](int, int i, const char* row) {
                 const int64_t pos = start + i;
                 blockCopy(recvX + pos * c.xBytes, row + 8, c.xBytes);
                 if (threadIdx.x == 0) {
                   recvSrc[pos] = (int32_t)(uint32_t)*(const uint64_t*)row;
                   const int32_t* pairs = (const int32_t*)(row + 8 + c.xPad);
                   for (int64_t j = 0; j < K; j++) {
                     recvTopk[pos * K + j] = pairs[2 * j];
                     memcpy(&recvWeights[pos * K + j], &pairs[2 * j + 1], 4);
                     if (pairs[2 * j] >= 0) perExpert[pairs[2 * j]]++;
                   }
                 }
               });
    start += rows;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 0; w < n * n; w++) store_relaxed(comm.local<uint64_t>(c.htCount) + w, 0);
  comm.barrier();
}

// out = the sum over j < m of w[j] (1 without w) times the row at srcs[j], elements of
// type T, in float32 in the order of j, rounded once to T.
template <typename T>
static __device__ void sumRows(char* out, const char* const* srcs, const float* w, int m, int64_t hidden) {
  typedef Arith<T> A;
  T* o = (T*)out;
#ifdef COMMREF_CPU
  // A piece at a time, each source's pass over it one loop the compiler vectorizes.
  const int64_t kPiece = 1024;
  float acc[kPiece];
  const ElemRange r = elemRange(hidden);
  for (int64_t base = r.begin; base < (int64_t)r.end; base += kPiece) {
    const int64_t len = (int64_t)r.end - base < kPiece ? (int64_t)r.end - base : kPiece;
    for (int64_t i = 0; i < len; i++) acc[i] = 0.0f;
    for (int j = 0; j < m; j++) {
      const T* src = (const T*)srcs[j] + base;
      const float wj = w ? w[j] : 1.0f;
      for (int64_t i = 0; i < len; i++) acc[i] += wj * (float)A::load(src[i]);
    }
    for (int64_t i = 0; i < len; i++) o[base + i] = A::store((typename A::Compute)acc[i]);
  }
#else
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < m; j++) acc += (w ? w[j] : 1.0f) * (float)A::load(((const T*)srcs[j])[i]);
    o[i] = A::store((typename A::Compute)acc);
  }
#endif
}
static __device__ void sumRowsOf(int64_t dtype, char* out, const char* const* srcs, const float* w, int m,
                                 int64_t hidden) {
  if (dtype == kEpBfloat16)
    sumRows<bf16_t>(out, srcs, w, m, hidden);
  else if (dtype == kEpFloat16)
    sumRows<half_t>(out, srcs, w, m, hidden);
  else
    sumRows<float>(out, srcs, w, m, hidden);
}

#define EP_MAX_RANKS 64
#define EP_MAX_TOPK 64

// HT combine row: [tag | slot][y: xPad bytes][topk weights: float32, padded to 8].
// args: cfg, y [num_recv, hidden], recv_topk_weights (float32 [num_recv, topk] or 0),
// rank_prefix_matrix, token_idx_in_rank, num_tokens_per_rank (int32 [n]), ntok, epoch,
// combined_x [ntok, hidden], combined_topk_weights (float32 [ntok, topk] or 0), syncFirst.
COMMREF_KERNEL(ep_ht_combine, KernelArgs, args) {
  DeviceComm comm(args);
  Ep ep(comm, comm.u64(7), true);
  const EpConfig& c = ep.c;
  const int n = ep.n, me = ep.me;
  const char* y = comm.ptr<const char>(1);
  const float* weights = comm.ptr<const float>(2);
  const int32_t* prefix = comm.ptr<const int32_t>(3);
  const int32_t* slotOf = comm.ptr<const int32_t>(4);
  const int32_t* perRank = comm.ptr<const int32_t>(5);
  const int64_t ntok = comm.i64(6), K = c.topk, T = c.maxTokens;
  char* out = comm.ptr<char>(8);
  float* outWeights = comm.ptr<float>(9);
  const int64_t combRow = c.htCombRow;
  if (comm.u64(10)) comm.barrier();

  for (int k = 1; k <= n; k++) {  // each source's rows back to it
    const int s = (me + k) % n;
    const int64_t start = s ? prefix[(s - 1) * n + me] : 0, rows = prefix[s * n + me] - start;
    for (int64_t i = 0; i < rows; i++) {
      const uint64_t dst = c.htComb + (uint64_t)(me * T + i) * combRow;
      const uint64_t stage = c.htCombStage + (uint64_t)(start + i) * combRow;
      char* row = ep.rowAt(s, dst, stage);
      blockCopy(row + 8, y + (start + i) * c.xBytes, c.xBytes);
      if (threadIdx.x == 0) {
        *(uint64_t*)row = ep.tag | (uint64_t)i;
        float* w = (float*)(row + 8 + c.xPad);
        for (int64_t j = 0; j < K; j++) w[j] = weights ? weights[(start + i) * K + j] : 0.0f;
      }
      ep.sendRow(s, dst, stage, combRow, i == rows - 1 ? ep.lastSignal(false) : ep.rowSignal());
    }
    if (rows) ep.endLsaMessage(s);
  }
  for (int d = 0; d < n; d++) {  // the rows of the tokens this rank sent to d
    const int64_t rows = perRank[d];
    ep.receive(d, rows, false, false,
               SlotRows{comm.local<const char>(c.htComb + (uint64_t)d * T * combRow), combRow, rows},
               [](int, int, const char*) {});
  }
  for (int64_t t = 0; t < ntok; t++) {
    const char* srcs[EP_MAX_RANKS];
    int m = 0;
    for (int d = 0; d < n; d++)
      if (slotOf[t * n + d] >= 0)
        srcs[m++] = comm.local<const char>(c.htComb + (uint64_t)(d * T + slotOf[t * n + d]) * combRow) + 8;
    sumRowsOf(c.dtype, out + t * c.xBytes, srcs, nullptr, m, c.hidden);
    if (outWeights && threadIdx.x == 0)
      for (int64_t j = 0; j < K; j++) {
        float acc = 0.0f;
        for (int i = 0; i < m; i++) acc += ((const float*)(srcs[i] + c.xPad))[j];
        outWeights[t * K + j] = acc;
      }
  }
  // No barrier: see the top (combine).
}

// ---- low-latency ----

// LL dispatch row: [tag | token << 8 | top-k slot][x: xPad bytes], at the destination in
// the slots of (local expert, source rank): llRecv + ((e * n + s) * maxTokens + i) * llRow.
// Count message to d: d's localExperts counts of this rank's tokens, as ~count, at
// d's llCount + s * localExperts words.
// args: cfg, x, topk_idx, ntok, epoch, packed_recv_x [localExperts, n * maxTokens,
// hidden], packed_recv_count (int32 [localExperts]), recv_src_info (int32
// [localExperts, n * maxTokens]), recv_src_topk (int32, same), recv_layout_range (int64
// [localExperts, n]: begin << 32 | count).
COMMREF_KERNEL(ep_ll_dispatch, KernelArgs, args) {
  DeviceComm comm(args);
  Ep ep(comm, comm.u64(4), false);
  const EpConfig& c = ep.c;
  const int n = ep.n, me = ep.me;
  const char* x = comm.ptr<const char>(1);
  const int64_t* topk = comm.ptr<const int64_t>(2);
  const int64_t ntok = comm.i64(3), K = c.topk, T = c.maxTokens, per = c.localExperts;
  char* recvX = comm.ptr<char>(5);
  int32_t* recvCount = comm.ptr<int32_t>(6);
  int32_t* srcInfo = comm.ptr<int32_t>(7);
  int32_t* srcTopk = comm.ptr<int32_t>(8);
  int64_t* range = comm.ptr<int64_t>(9);
  int64_t* slots = comm.local<int64_t>(c.scratch + 24ull * n);  // per expert: rows sent so far

  if (threadIdx.x == 0)
    for (int64_t e = 0; e < c.experts; e++) slots[e] = 0;
  for (int64_t t = 0; t < ntok; t++)
    for (int64_t j = 0; j < K; j++) {
      const int64_t e = topk[t * K + j];
      if (e < 0) continue;
      const int d = (int)(e / per);
      const int64_t i = fromThread0(threadIdx.x == 0 ? slots[e]++ : 0);
      const uint64_t dst = c.llRecv + (uint64_t)(((e - d * per) * n + me) * T + i) * c.llRow;
      const uint64_t stage = c.llStage + (uint64_t)(t * K + j) * c.llRow;
      char* row = ep.rowAt(d, dst, stage);
      blockCopy(row + 8, x + t * c.xBytes, c.xBytes);
      if (threadIdx.x == 0) *(uint64_t*)row = ep.tag | (uint64_t)t << 8 | (uint64_t)j;
      ep.sendRow(d, dst, stage, c.llRow, ep.rowSignal());
    }
  __syncthreads();
  for (int k = 1; k <= n; k++) {
    const int d = (me + k) % n;
    uint64_t* counts = comm.local<uint64_t>(c.llCountStage + (uint64_t)d * per * 8);
    if (threadIdx.x == 0)
      for (int64_t e = 0; e < per; e++) counts[e] = ~(uint64_t)slots[d * per + e];
    __syncthreads();
    ep.sendCounts(d, c.llCount + (uint64_t)me * per * 8, c.llCountStage + (uint64_t)d * per * 8, (int)per);
  }

  const uint64_t* counts = comm.local<const uint64_t>(c.llCount);  // [s][e] = ~count
  const char* recv = comm.local<const char>(c.llRecv);
  for (int s = 0; s < n; s++) ep.awaitCounts(s, counts + s * per, ExpertRows{recv, c.llRow, T, n, s, per, nullptr});
  if (threadIdx.x == 0)
    for (int64_t e = 0; e < per; e++) {
      int64_t begin = 0;
      for (int s = 0; s < n; s++) {
        const int64_t m = (int64_t)~load_relaxed(counts + s * per + e);
        range[e * n + s] = begin << 32 | m;
        begin += m;
      }
      recvCount[e] = (int32_t)begin;
    }
  __syncthreads();
  for (int s = 0; s < n; s++) {
    int64_t rows = 0;
    for (int64_t e = 0; e < per; e++) rows += (int64_t)~counts[s * per + e];
    ep.receive(s, rows, true, true, ExpertRows{recv, c.llRow, T, n, s, per, counts + s * per},
               [&](int e, int i, const char* row) {
                 const int64_t pos = e * n * T + (range[e * n + s] >> 32) + i;
                 blockCopy(recvX + pos * c.xBytes, row + 8, c.xBytes);
                 if (threadIdx.x == 0) {
                   const uint64_t h = *(const uint64_t*)row;
                   srcInfo[pos] = (int32_t)((h >> 8) & 0xffffff);
                   srcTopk[pos] = (int32_t)(h & 0xff);
                 }
               });
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int64_t w = 0; w < n * per; w++) store_relaxed(comm.local<uint64_t>(c.llCount) + w, 0);
  comm.barrier();
}

// LL combine row: [tag | token << 8 | top-k slot][y: xPad bytes], at the source in slot
// llComb + (token * topk + slot) * llRow.
// args: cfg, y (packed like packed_recv_x), topk_idx, topk_weights, ntok, epoch,
// recv_src_info, recv_src_topk, recv_layout_range, combined_x [ntok, hidden], syncFirst.
COMMREF_KERNEL(ep_ll_combine, KernelArgs, args) {
  DeviceComm comm(args);
  Ep ep(comm, comm.u64(5), true);
  const EpConfig& c = ep.c;
  const int n = ep.n, me = ep.me;
  const char* y = comm.ptr<const char>(1);
  const int64_t* topk = comm.ptr<const int64_t>(2);
  const float* weights = comm.ptr<const float>(3);
  const int64_t ntok = comm.i64(4), K = c.topk, T = c.maxTokens, per = c.localExperts;
  const int32_t* srcInfo = comm.ptr<const int32_t>(6);
  const int32_t* srcTopk = comm.ptr<const int32_t>(7);
  const int64_t* range = comm.ptr<const int64_t>(8);
  char* out = comm.ptr<char>(9);
  if (comm.u64(10)) comm.barrier();

  for (int k = 1; k <= n; k++) {  // every expert's outputs for source s back to s
    const int s = (me + k) % n;
    int64_t rows = 0, j = 0;
    for (int64_t e = 0; e < per; e++) rows += range[e * n + s] & 0xffffffff;
    for (int64_t e = 0; e < per; e++)
      for (int64_t i = 0, begin = range[e * n + s] >> 32, m = range[e * n + s] & 0xffffffff; i < m; i++, j++) {
        const int64_t pos = e * n * T + begin + i;
        const int64_t t = srcInfo[pos], slot = srcTopk[pos];
        const uint64_t dst = c.llComb + (uint64_t)(t * K + slot) * c.llRow;
        const uint64_t stage = c.llCombStage + (uint64_t)pos * c.llRow;
        char* row = ep.rowAt(s, dst, stage);
        blockCopy(row + 8, y + pos * c.xBytes, c.xBytes);
        if (threadIdx.x == 0) *(uint64_t*)row = ep.tag | (uint64_t)t << 8 | (uint64_t)slot;
        ep.sendRow(s, dst, stage, c.llRow, j == rows - 1 ? ep.lastSignal(false) : ep.rowSignal());
      }
    if (rows) ep.endLsaMessage(s);
  }
  for (int d = 0; d < n; d++) {  // the rows of this rank's (token, slot) pairs on d's experts
    int64_t rows = 0;
    for (int64_t i = 0; i < ntok * K; i++) rows += topk[i] >= 0 && topk[i] / per == d;
    ep.receive(d, rows, false, false, PairRows{comm.local<const char>(c.llComb), c.llRow, topk, ntok * K, per, d},
               [](int, int, const char*) {});
  }
  for (int64_t t = 0; t < ntok; t++) {
    const char* srcs[EP_MAX_TOPK];
    float w[EP_MAX_TOPK];
    int m = 0;
    for (int64_t j = 0; j < K; j++)
      if (topk[t * K + j] >= 0) {
        srcs[m] = comm.local<const char>(c.llComb + (uint64_t)(t * K + j) * c.llRow) + 8;
        w[m++] = weights[t * K + j];
      }
    sumRowsOf(c.dtype, out + t * c.xBytes, srcs, w, m, c.hidden);
  }
  // No barrier: see the top (combine).
}
