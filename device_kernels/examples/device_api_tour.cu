// device_kernels/examples/device_api_tour.cu — one kernel per handle of the device API's
// section "teams, symmetric pointers, cooperative scopes, requests, rolling compares, VA
// signals" (device.h): teams, symptrs, scopes, requests, rolling, va_signals. Each runs
// on LSA and on GIN over the ordered and unordered wires (tests/test_device_api_scopes.py,
// which states what each returns); on a GPU they build with the other examples.
#include "commref/device.h"
using namespace commref;

// Teams: their values and conversions into out[2..], then a ring in the LSA team (signal
// 0) and one in the rail team (signal 1): out[0], out[1] are what arrived.
COMMREF_KERNEL(teams, KernelArgs, args) {
  DeviceComm comm(args);
  int64_t* out = comm.ptr<int64_t>(0);
  const Team w = comm.worldTeam(), l = comm.lsaTeam(), r = comm.railTeam();
  const Team ts[5] = {w, l, r, comm.innerFactor(w, l.nRanks), comm.outerFactor(w, l.nRanks)};
  if (threadIdx.x == 0) {
    int k = 2;
    for (const Team& t : ts) out[k++] = t.nRanks, out[k++] = t.rank, out[k++] = t.stride;
    for (int a = 0; a < 3; a++)
      for (int i = 0; i < ts[a].nRanks; i++) {
        out[k++] = comm.teamRankToWorld(ts[a], i);
        for (int b = 0; b < 3; b++)
          out[k++] = comm.teamRankToTeam(ts[b], ts[a], i), out[k++] = teamRankIsMember(ts[b], ts[a], i);
      }
    comm.local<uint64_t>(0)[0] = 1000 * comm.launch() + comm.rank();
  }
  __syncthreads();
  comm.put(comm.teamRankToWorld(l, (l.rank + 1) % l.nRanks), 8, 0, 8, WeakSignalInc(0));
  comm.put(comm.teamRankToWorld(r, (r.rank + 1) % r.nRanks), 16, 0, 8, WeakSignalInc(1));
  comm.waitSignal(0, comm.launch());
  comm.waitSignal(1, comm.launch());
  if (threadIdx.x == 0) out[0] = (int64_t)comm.local<uint64_t>(0)[1], out[1] = (int64_t)comm.local<uint64_t>(0)[2];
  comm.barrier();
}

// Symmetric pointers: arithmetic, a typed put, and the LSA views of every LSA peer.
COMMREF_KERNEL(symptrs, KernelArgs, args) {
  DeviceComm comm(args);
  int64_t* out = comm.ptr<int64_t>(0);
  const int r = comm.rank(), n = comm.nranks(), next = (r + 1) % n, prev = (r + n - 1) % n;
  SymPtr<uint64_t> base = comm.symPtr<uint64_t>(0), mine = base + 8, inbox = base;
  inbox += 16;
  mine -= 1;
  mine = mine + 1;
  if (threadIdx.x == 0) *(mine + r).localPtr() = 1000 * comm.launch() + r;
  __syncthreads();
  comm.put(next, inbox + r, mine + r, 1, WeakSignalInc(0));
  comm.waitSignal(0, comm.launch());
  comm.barrier();
  if (threadIdx.x == 0) {
    out[0] = inbox - mine;
    out[1] = (inbox - 3) - base;
    out[2] = (int64_t)*(inbox + prev).localPtr();
    out[3] = (mine + next).peerPtr(next) != nullptr;  // an LSA peer
    for (int i = 0; i < comm.lsaSize(); i++) out[4 + i] = (int64_t)*(mine + comm.lsaPeer(i)).lsaPtr(i);
    const Team l = comm.lsaTeam();
    out[4 + comm.lsaSize()] = (int64_t)*(mine + r).peerPtr(l, l.rank);
  }
  comm.barrier();
}

// Scopes (block of 64: two warps, eight tiles of 8): warp w puts its 32 bytes with
// signal w, each tile its 8 with signal 2, each thread alone signals 3; warp 0 waits
// for signal 4, which warp 1 gives this rank only after its own wait.
COMMREF_KERNEL(scopes, KernelArgs, args) {
  DeviceComm comm(args);
  uint64_t* out = comm.ptr<uint64_t>(0);
  uint8_t* got = comm.ptr<uint8_t>(1);
  const int r = comm.rank(), n = comm.nranks(), next = (r + 1) % n, prev = (r + n - 1) % n;
  const int t = threadIdx.x, w = t / 32;
  uint8_t* win = comm.local<uint8_t>(0);
  win[t] = (uint8_t)(r * 64 + t + 7 * comm.launch());
  __syncthreads();
  CoopWarp warp;
  CoopTile<8> tile;
  comm.put(warp, next, 64 + 32 * w, 32 * w, 32, WeakSignalInc(w));
  comm.put(tile, next, 128 + 8 * (t / 8), 8 * (t / 8), 8, WeakSignalInc(2));
  comm.signal(CoopThread(), next, WeakSignalInc(3));
  out[4 * t] = comm.waitSignal(warp, w, comm.launch(), prev);
  if (w == 1) comm.signal(warp, r, WeakSignalInc(4));
  out[4 * t + 1] = w == 0 ? comm.waitSignal(warp, 4, comm.launch(), r) : 0;
  out[4 * t + 2] = comm.waitSignal(tile, 2, 8 * comm.launch(), prev);
  out[4 * t + 3] = comm.waitSignal(CoopThread(), 3, 64 * comm.launch(), prev);
  comm.flush(warp);
  got[t] = win[64 + t];
  got[64 + t] = win[128 + t];
  comm.barrier();
}

// Requests: a get, then a flush request made and waited by each warp (block of 64);
// the value is there after the wait.
COMMREF_KERNEL(requests, KernelArgs, args) {
  DeviceComm comm(args);
  uint64_t* out = comm.ptr<uint64_t>(0);
  const int r = comm.rank(), n = comm.nranks(), next = (r + 1) % n;
  uint64_t* win = comm.local<uint64_t>(0);
  if (threadIdx.x == 0) win[0] = 1000 * comm.launch() + r;
  comm.barrier();
  comm.get(next, 8, 0, 8);
  const GinRequest q = comm.gin(0).flushAsync(CoopWarp());
  comm.gin(0).wait(CoopWarp(), q);
  out[threadIdx.x] = win[1];
  comm.get(next, 16, 0, 8);
  const GinRequest all = comm.gin(0).flushAsync();
  comm.gin(0).wait(all);
  if (threadIdx.x == 0) out[64] = win[2];
  comm.barrier();
}

// Rolling compares: signalReached over the cases of argument 1 (v, least, bits), then a
// 64-bit wrap and an 8-bit one on real signals, and counters as signals (block of 32).
COMMREF_KERNEL(rolling, KernelArgs, args) {
  DeviceComm comm(args);
  uint64_t* out = comm.ptr<uint64_t>(0);
  const uint64_t* cases = comm.ptr<const uint64_t>(1);
  const int r = comm.rank(), n = comm.nranks(), next = (r + 1) % n, prev = (r + n - 1) % n;
  const uint64_t ncases = comm.u64(2);
  if (threadIdx.x == 0)
    for (uint64_t i = 0; i < ncases; i++)
      out[16 + i] = signalReached(cases[3 * i], cases[3 * i + 1], (int)cases[3 * i + 2]);
  comm.signal(next, WeakSignalAdd(0, ~0ull - 2));  // 2^64 - 3
  comm.signal(next, WeakSignalAdd(1, 250));
  comm.barrier();
  uint64_t v0 = comm.readSignal(0), v1 = comm.readSignal(1, 8);
  comm.barrier();                                              // read before the peers add again
  comm.signal(next, WeakSignalAdd(0, 5));                      // 2 after the wrap
  comm.signal(next, WeakSignalAdd(1, 10));                     // 260: 4 at 8 bits
  uint64_t w0 = comm.waitSignal(CoopCta(), 0, ~0ull, prev);    // 2^64 - 1: reached by 2 only with wrap-around
  uint64_t w1 = comm.waitSignal(CoopWarp(), 1, 510, prev, 8);  // 254 at 8 bits; a 64-bit compare would wait
  for (int k = 0; k < 3; k++) comm.put(next, 0, 8, 8, NoSignal(), 0);
  uint64_t c0 = comm.waitCounter(CoopWarp(), 0, 3);
  uint64_t c1 = comm.waitCounter(CoopThread(), 0, 1, 1);  // 3 at 1 bit is 1
  uint64_t c2 = comm.readCounter(0, 2);
  __syncthreads();  // every thread's reads before the reset
  comm.resetCounter(0);
  uint64_t c3 = comm.readCounter(0);
  if (threadIdx.x == 31) {
    out[0] = v0, out[1] = v1, out[2] = w0, out[3] = w1, out[4] = comm.readSignal(1);
    out[5] = c0, out[6] = c1, out[7] = c2, out[8] = c3;
  }
  comm.barrier();
}

// VA signals (block of 32): a put with a weak VA increment, a strong VA add by a warp.
COMMREF_KERNEL(va_signals, KernelArgs, args) {
  DeviceComm comm(args);
  uint64_t* out = comm.ptr<uint64_t>(0);
  const int r = comm.rank(), n = comm.nranks(), next = (r + 1) % n, prev = (r + n - 1) % n;
  uint64_t* win = comm.local<uint64_t>(0);
  if (threadIdx.x == 0) win[0] = 1000 * comm.launch() + r;
  __syncthreads();
  comm.put(next, 64, 0, 8, VaSignal(WeakSignalInc(256)));
  const uint64_t seen = comm.waitVaSignal(256, comm.launch(), prev);
  const uint64_t data = win[8];
  comm.signal(CoopWarp(), next, VaSignal(StrongSignalAdd(264, 5)));
  const uint64_t strong = comm.waitVaSignal(CoopWarp(), 264, 5 * comm.launch(), prev);
  if (threadIdx.x == 0) out[0] = seen, out[1] = data, out[2] = strong, out[3] = comm.readVaSignal(256, 1);
  comm.barrier();
}
