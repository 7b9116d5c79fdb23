"""The device API's barrier and its fences (device.h: barrier(fence, ctx), GinFenceLevel,
GinAllContexts): each fence level's promise tried on every wire, backend and engine of
the GIN path, and the freedom the weaker levels leave shown by the unordered wire.

The case: 2 ranks over GIN with 2 contexts; in each round rank 0 puts a stamp of the
round (8 bytes, no signal) to rank 1 on one context, both ranks meet at a barrier, and
rank 1 reads the word; a second barrier keeps the next round's put behind the read. A
read that is not the round's stamp is stale. The rounds run inside one launch (one
kernel, compiled once for the whole module)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers import PREAMBLE, WORLD_TIMEOUT

from commref import ThreadWorld
from commref.collectives.device_api import DeviceComm, Kernel
from commref.transports.gin.engines import ENGINE_ENV
from commref.transports.nodes import NODES_ENV

NONE, PUTS, GETS = 0, 1, 2  # GinFenceLevel
ALL = -1  # GinAllContexts
ROUNDS = 1000
PUT, PUT_DEFAULT, GET = 0, 1, 2  # the kernel's modes

# Arguments: mode, rounds, fence level, fenced contexts (a context or GinAllContexts),
# the context of the put or get, the count of stale reads (an array of one: rank 1's).
# Window: offset 0 the word rank 1 reads, offset 8 rank 0's source.
#   PUT: rank 0 puts its round's stamp on the context, both barrier(fence, fenced),
#     rank 1 reads, both meet again;
#   PUT_DEFAULT: the same with barrier();
#   GET: rank 0 stamps its source, both meet (fence none), rank 1 gets it on the
#     context, both barrier(fence, fenced), rank 1 reads what its get brought.
BARRIER_ROUNDS = (
    PREAMBLE
    + r"""
COMMREF_KERNEL(barrier_rounds, KernelArgs, args) {
  DeviceComm comm(args);
  const uint64_t mode = comm.u64(0), rounds = comm.u64(1);
  const GinFenceLevel fence = (GinFenceLevel)comm.u64(2);
  const int fenced = (int)comm.i64(3), ctx = (int)comm.i64(4);
  uint64_t* stale = comm.ptr<uint64_t>(5);
  uint64_t* word = comm.local<uint64_t>(0);
  uint64_t* source = comm.local<uint64_t>(8);
  for (uint64_t i = 0; i < rounds; i++) {
    const uint64_t stamp = comm.launch() << 32 | (i + 1);
    if (comm.rank() == 0 && threadIdx.x == 0) *source = stamp;
    __syncthreads();
    if (mode == 2) {
      comm.barrier(GinFenceLevel::None, 0);
      if (comm.rank() == 1) comm.gin(ctx).get(0, 0, 8, 8);
    } else if (comm.rank() == 0) {
      comm.gin(ctx).put(1, 0, 8, 8);
    }
    if (mode == 1)
      comm.barrier();
    else
      comm.barrier(fence, fenced);
    if (comm.rank() == 1 && threadIdx.x == 0 && load_relaxed(word) != stamp) stale[0]++;
    if (mode != 2) comm.barrier(fence, fenced);
  }
}
"""
)
KERNEL = Kernel(BARRIER_ROUNDS, "barrier_rounds")

# Every rank to every peer, through LSA or GIN by peer. Arguments: rounds, the count of
# stale reads (an array of one). Window: offset 8 this rank's source, 16 + 8 j the word
# rank j puts here. Round i: every rank puts its stamp to every peer on context i % 2,
# then a barrier that fences it: barrier(Puts, i % 2), barrier(), barrier(Gets, all) in
# turn; every rank reads every peer's word; a barrier of fence level none keeps the
# next round's puts behind the reads.
EVERY_PEER = (
    PREAMBLE
    + r"""
COMMREF_KERNEL(every_peer, KernelArgs, args) {
  DeviceComm comm(args);
  const uint64_t rounds = comm.u64(0);
  uint64_t* stale = comm.ptr<uint64_t>(1);
  const int n = comm.nranks(), r = comm.rank();
  for (uint64_t i = 0; i < rounds; i++) {
    const uint64_t stamp = comm.launch() << 40 | (i + 1) << 8;
    if (threadIdx.x == 0) *comm.local<uint64_t>(8) = stamp | r;
    __syncthreads();
    for (int k = 1; k < n; k++) comm.gin((int)(i % 2)).put((r + k) % n, 16 + 8 * r, 8, 8);
    if (i % 3 == 0)
      comm.barrier(GinFenceLevel::Puts, (int)(i % 2));
    else if (i % 3 == 1)
      comm.barrier();
    else
      comm.barrier(GinFenceLevel::Gets, GinAllContexts);
    if (threadIdx.x == 0)
      for (int j = 0; j < n; j++)
        if (j != r && load_relaxed(comm.local<uint64_t>(16 + 8 * j)) != (stamp | j)) stale[0]++;
    comm.barrier(GinFenceLevel::None, GinAllContexts);
  }
}
"""
)

# Every backend on each wire it runs on, and on the ordered wire both engines (the
# native engine carries it by default, the Python proxy when COMMREF_GIN_ENGINE asks):
# rc is ordered only, gda the weak-only backend (strong signals not required).
CASES = {
    "ordered-rc-native": dict(wire="ordered", backend="rc"),
    "ordered-rc-python": dict(wire="ordered", backend="rc", engine="python"),
    "ordered-proxy-native": dict(wire="ordered", backend="proxy"),
    "ordered-proxy-python": dict(wire="ordered", backend="proxy", engine="python"),
    "ordered-gda-native": dict(wire="ordered", backend="gda", strong_signals=False),
    "ordered-gda-python": dict(wire="ordered", backend="gda", strong_signals=False, engine="python"),
    "unordered-proxy": dict(wire="unordered", backend="proxy", seed=11),
    "unordered-gda": dict(wire="unordered", backend="gda", strong_signals=False, seed=11),
}
UNORDERED = ["unordered-proxy", "unordered-gda"]


def _stale_reads(case, monkeypatch, mode, fence, fenced, ctx, rounds=ROUNDS):
    """Rank 1's stale reads in `rounds` rounds of one launch over CASES[case]."""
    options = dict(CASES[case])
    engine = options.pop("engine", None)
    if engine:
        monkeypatch.setenv(ENGINE_ENV, engine)

    def body(world):
        with DeviceComm(world, window_bytes=64, contexts=2, device="cpu", path="gin", **options) as dc:
            stale = np.zeros(1, np.uint64)
            start = time.monotonic()
            KERNEL.launch(dc, 1, args=(mode, rounds, fence, fenced, ctx, stale))
            return int(stale[0]), dc.backend, type(dc.comm.proxy).__name__, time.monotonic() - start

    (mine, *_), (stale, backend, proxy, seconds) = ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)
    assert mine == 0  # rank 0 reads nothing
    assert backend == options["backend"]
    assert proxy == ("GinProxy" if engine == "python" else "NativeProxy")
    print(f"{case} mode {mode} fence {fence} contexts {fenced} context {ctx}: {stale}/{rounds} stale, {seconds:.1f} s")
    return stale


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "mode, fence, fenced",
    [(PUT_DEFAULT, 0, 0), (PUT, PUTS, ALL), (PUT, PUTS, 1), (PUT, GETS, ALL)],
    ids=["barrier()", "puts-all", "puts-ctx1", "gets-all"],
)
def test_a_put_before_a_fencing_barrier_is_visible_after_it(case, mode, fence, fenced, monkeypatch):
    """barrier(), and a barrier fencing puts (or gets) on every context or on the put's
    own: no read of a put on context 1 is stale."""
    stale = _stale_reads(case, monkeypatch, mode, fence, fenced, ctx=1)
    assert stale == 0, f"{stale} of {ROUNDS} reads stale"


@pytest.mark.parametrize("case", UNORDERED)
@pytest.mark.parametrize(
    "fence, fenced, ctx", [(PUTS, 0, 1), (NONE, ALL, 1), (NONE, ALL, 0)], ids=["puts-ctx0", "none-ctx1", "none-ctx0"]
)
def test_the_weaker_fences_show_a_stale_read_on_the_unordered_wire(case, fence, fenced, ctx, monkeypatch):
    """What a fence leaves out may still be in flight after it: a put on a context the
    barrier does not fence, or any put past a barrier of fence level none. The
    unordered wire holds puts back, so some read is stale (the tests above can fail)."""
    stale = _stale_reads(case, monkeypatch, PUT, fence, fenced, ctx)
    assert stale > 0, f"no stale read in {ROUNDS} rounds"


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_get_before_a_barrier_fencing_gets_has_landed_after_it(case, monkeypatch):
    stale = _stale_reads(case, monkeypatch, GET, GETS, ALL, ctx=1)
    assert stale == 0, f"{stale} of {ROUNDS} reads stale"


@pytest.mark.parametrize(
    "fence, fenced, limit, seen",
    [(3, ALL, 3, 3), (7, 0, 3, 7), (PUTS, 2, 2, 2), (NONE, -2, 2, (1 << 64) - 2)],
    ids=["level-3", "level-7", "context-2", "context-minus-2"],
)
def test_a_bad_fence_level_or_context_fails_clearly(fence, fenced, limit, seen):
    """On every rank alike, before the barrier posts anything: a ValueError naming the
    value and the limit, not a wait for signals nobody sends. The bad barrier is the
    round's second (PUT_DEFAULT: the first is barrier()), so no put of the failed launch
    is left without its doorbell: on the unordered wire such a put stays pending, and
    closing the communicator waits for it until the world's deadline."""

    def body(world):
        options = dict(window_bytes=64, contexts=2, device="cpu", path="gin", wire="unordered", timeout=5)
        with DeviceComm(world, **options) as dc:
            start = time.monotonic()
            with pytest.raises(
                ValueError,
                match=rf"^rank {world.rank}: a device-API call in block 0 was given {seen} where the limit is {limit} ",
            ):
                KERNEL.launch(dc, 1, args=(PUT_DEFAULT, 1, fence, fenced, 0, np.zeros(1, np.uint64)))
            assert time.monotonic() - start < 5  # the deadline was not what ended it

    ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)


@pytest.mark.parametrize("wire", ["ordered", "unordered"])
def test_fenced_barriers_over_lsa_and_gin_peers_alike(wire, monkeypatch):
    """4 ranks on 2 simulated nodes (LSA inside a node, GIN across), every rank putting
    to every peer on the two contexts in turn, barriers of every kind in turn: no read
    is stale, and the barriers' word sets keep the ranks in step."""
    monkeypatch.setenv(NODES_ENV, "2")
    kernel, rounds = Kernel(EVERY_PEER, "every_peer"), 300

    def body(world):
        options = dict(path="auto", wire=wire, seed=5)
        with DeviceComm(world, window_bytes=64, contexts=2, device="cpu", **options) as dc:
            stale = np.zeros(1, np.uint64)
            for _ in range(2):
                kernel.launch(dc, 1, args=(rounds, stale))
            return int(stale[0]), dc.lsa_ranks

    results = ThreadWorld.run(4, body, timeout=WORLD_TIMEOUT)
    assert [lsa for _, lsa in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    stale = [n for n, _ in results]
    print(f"every peer, {wire}: {stale} stale of {2 * rounds * 3} reads per rank")
    assert stale == [0] * 4
