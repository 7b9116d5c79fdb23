// The multimem handle's multicast path (include/commref/multimem.h, `mc` set) over a real
// CUDA multicast object that tests/test_gpu_multicast.py binds to one GPU's memory: a
// team of one member, so every ld_reduce reduces that one copy and every store lands in
// it; what it checks is that the multimem PTX runs on the mapping, value for value.
//
// Arguments: uc, the memory's unicast address; mc, its multicast address; n, elements per
// region. Regions (bytes from both addresses): float [0, 4n) in, [4n, 8n) out;
// int32 [8n, 12n) in, [12n, 16n) out; bfloat16 [16n, 18n) in, [18n, 20n) out.
// out = in + 1 (float), in * 2 (int32, max-reduced), in (bfloat16, sum-reduced pairs).
#include "commref/multimem.h"
using namespace commref;

extern "C" __global__ void commref_multicast_check(uint64_t uc, uint64_t mc, uint64_t n) {
  const uint64_t table[1] = {uc};
  Multimem m{};
  m.table = table;
  m.ranks = nullptr;
  m.offset = 0;
  m.bytes = 20 * n;
  m.mc = mc;
  m.size = 1;
  m.member = 0;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
    m.st<float>(4 * (n + i), m.ldReduce<float, OpSum>(4 * i) + 1.0f);
    m.st<int32_t>(4 * (3 * n + i), 2 * m.ldReduce<int32_t, OpMax>(4 * (2 * n + i)));
    m.st<bf16_t>(18 * n + 2 * i, m.ldReduce<bf16_t, OpSum>(16 * n + 2 * i));
  }
}
