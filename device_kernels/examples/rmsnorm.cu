// A fused RMSNorm with ReduceScatter and AllGather in one kernel (NCCL's Device API
// example, on commref's device API: include/commref/device.h).
//
// Every rank holds a partial x_r [tokens, hidden] (float32) of the hidden states, as a
// row-parallel layer leaves them; every rank ends with
//     y = RMSNorm(sum_r x_r) * w,   RMSNorm(v) = v / sqrt(mean(v^2) + eps), per token.
// Rank j owns the tokens [j * tokens / n, (j + 1) * tokens / n) (its shard):
//   1. reduce-scatter: each rank puts its partial of shard j into rank j's inbox slot
//      for it, each put with a weak increment of signal kReduced (safe on every wire: a
//      weak signal publishes its own put, and the owner counts n - 1 of them);
//   2. the owner sums the n partials in rank order, normalizes its shard and scales it;
//   3. all-gather: it puts the result into every rank's output at the shard's place,
//      with a weak increment of signal kGathered; every rank waits for n - 1.
// The device window (bytes, every rank alike; S = the largest shard in tokens):
//   [0, T*H*4)                 staging: this rank's partial (a put's source)
//   [T*H*4, T*H*4 + n*S*H*4)   inbox: slot r holds rank r's partial of this rank's shard
//   then T*H*4                 output: the gathered result
// No barrier is needed between launches: a rank writes a peer's inbox in launch k + 1
// only after it received that peer's shard of launch k, which the peer sent after
// reading its inbox; and likewise for the output.
// Arguments: x (float*), w (float*), y (float*), tokens, hidden, eps (a double).
#include "commref/device.h"
using namespace commref;

enum : uint32_t { kReduced = 0, kGathered = 1 };

static __device__ __forceinline__ uint64_t shardBegin(uint64_t tokens, int j, int n) { return tokens * j / n; }

COMMREF_KERNEL(commref_rmsnorm_rs_ag, KernelArgs, args) {
  DeviceComm comm(args);
  const float* x = comm.ptr<const float>(0);
  const float* w = comm.ptr<const float>(1);
  float* y = comm.ptr<float>(2);
  const uint64_t T = comm.u64(3), H = comm.u64(4);
  const float eps = (float)comm.f64(5);
  const int n = comm.nranks(), r = comm.rank();
  const uint64_t row = H * sizeof(float), S = (T + n - 1) / n;
  const uint64_t staging = 0, inbox = T * row, output = inbox + (uint64_t)n * S * row;

  float* stage = comm.local<float>(staging);
  for (uint64_t i = threadIdx.x; i < T * H; i += blockDim.x) stage[i] = x[i];
  __syncthreads();

  // 1. reduce-scatter: this rank's partial of shard j to rank j's inbox slot r.
  for (int k = 1; k < n; k++) {
    const int j = (r + k) % n;
    const uint64_t b = shardBegin(T, j, n), e = shardBegin(T, j + 1, n);
    comm.put(j, inbox + (uint64_t)r * S * row, staging + b * row, (e - b) * row, WeakSignalInc(kReduced));
  }
  comm.waitSignal(kReduced, comm.launch() * (n - 1));

  // 2. this rank's shard: sum the partials in rank order, normalize, scale; the result
  // goes straight into this rank's output at the shard's place.
  const uint64_t b = shardBegin(T, r, n), e = shardBegin(T, r + 1, n);
  const float* slots = comm.local<const float>(inbox);
  float* out = comm.local<float>(output);
  for (uint64_t t = b + threadIdx.x; t < e; t += blockDim.x) {
    float* v = out + t * H;
    for (uint64_t h = 0; h < H; h++) {
      float s = 0.0f;
      for (int q = 0; q < n; q++) s += q == r ? stage[t * H + h] : slots[((uint64_t)q * S + (t - b)) * H + h];
      v[h] = s;
    }
    float ss = 0.0f;
    for (uint64_t h = 0; h < H; h++) ss += v[h] * v[h];
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
    for (uint64_t h = 0; h < H; h++) v[h] = v[h] * inv * w[h];
  }
  __syncthreads();

  // 3. all-gather: this rank's shard into every peer's output.
  for (int k = 1; k < n; k++) {
    const int j = (r + k) % n;
    comm.put(j, output + b * row, output + b * row, (e - b) * row, WeakSignalInc(kGathered));
  }
  comm.waitSignal(kGathered, comm.launch() * (n - 1));
  for (uint64_t i = threadIdx.x; i < T * H; i += blockDim.x) y[i] = out[i];
}
