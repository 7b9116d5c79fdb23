"""The device API's teams, symmetric pointers, cooperative scopes, flush requests,
rolling compares and VA signals (device.h's section of those names; team.h, coop.h):
each used by a kernel of device_kernels/examples/device_api_tour.cu on LSA and on GIN
over the ordered and unordered wires; the scoped putValue, countedPut and get each by a
kernel of its own (SCOPED_OPS) in every scope; and each refusal a clear error."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import PREAMBLE, WORLD_TIMEOUT

from commref import CapabilityError, ThreadWorld
from commref.collectives.device_api import DeviceComm, Kernel, KernelError
from commref.device_kernels import build
from commref.transports.nodes import NODES_ENV

TOUR = (build.SOURCE_DIR / "examples" / "device_api_tour.cu").read_text()
PATHS = {
    "lsa": dict(path="lsa"),
    "gin-ordered": dict(path="gin"),
    "gin-unordered": dict(path="gin", wire="unordered", seed=3),
}
MASK64 = (1 << 64) - 1


def _tour(name: str) -> Kernel:
    return Kernel(TOUR, name, filename="device_api_tour.cu")  # one library for every kernel of the file


def _run(nranks, body, *args):
    return ThreadWorld.run(nranks, body, *args, timeout=WORLD_TIMEOUT)


def _stamp(rank: int, launch: int) -> int:
    return 1000 * launch + rank


@pytest.mark.parametrize("path", [*sorted(PATHS), "2x2 nodes"])
def test_teams_convert_ranks_as_their_member_lists_say(path, monkeypatch):
    """World, LSA and rail teams (and the LSA x rail factors of the world) against the
    member lists the communicator's LSA ranks give; then a ring in each team."""
    options = PATHS.get(path, dict(path="auto"))
    if path == "2x2 nodes":
        monkeypatch.setenv(NODES_ENV, "2")
    kernel, n = _tour("teams"), 4

    def body(world):
        r = world.rank
        with DeviceComm(world, window_bytes=64, signals=2, device="cpu", **options) as dc:
            lsa = dc.lsa_ranks
            size = len(lsa)
            members = [list(range(n)), lsa, [j * size + r % size for j in range(n // size)]]
            for launch in (1, 2):
                out = np.zeros(128, np.int64)
                kernel.launch(dc, 1, args=(out,))
                want = [(n, r, 1), (size, lsa.index(r), 1), (n // size, r // size, size)]
                want += want[1:]  # innerFactor(world, lsaSize) is the LSA team, outerFactor the rail
                table = [v for t in want for v in t]
                for a in members[:3]:
                    for w in a:
                        table.append(w)
                        for b in members:
                            table += [b.index(w) if w in b else -1, int(w in b)]
                assert out[2 : 2 + len(table)].tolist() == table, (r, out[2 : 2 + len(table)].tolist())
                lsa_prev = members[1][(members[1].index(r) - 1) % size]
                rail_prev = members[2][(members[2].index(r) - 1) % len(members[2])]
                assert out[:2].tolist() == [_stamp(lsa_prev, launch), _stamp(rail_prev, launch)]
            return dc.strided_teams, size

    results = _run(n, body)
    assert all(strided for strided, _ in results)
    assert {size for _, size in results} == {2 if path == "2x2 nodes" else 4 if path == "lsa" else 1}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_symmetric_pointers_move_and_view_the_window(path):
    kernel, n = _tour("symptrs"), 3

    def body(world):
        r = world.rank
        with DeviceComm(world, window_bytes=4096, signals=1, device="cpu", **PATHS[path]) as dc:
            for launch in (1, 2):
                out = np.zeros(16, np.int64)
                kernel.launch(dc, 1, args=(out,))
                size = len(dc.lsa_ranks)
                want = [8, 13, _stamp((r - 1) % n, launch), int((r + 1) % n in dc.lsa_ranks)]
                want += [_stamp(p, launch) for p in dc.lsa_ranks] + [_stamp(r, launch)]
                assert out[: 5 + size].tolist() == want, (r, out.tolist())

    _run(n, body)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_warps_tiles_and_threads_act_on_their_own(path):
    """Two warps, eight tiles of 8 and 64 single threads of one block each put or signal
    and wait for their own; warp 0 waits for what warp 1 signals only after its own wait
    (block-collective waits would never meet there)."""
    kernel, n, threads = _tour("scopes"), 3, 64

    def body(world):
        r = world.rank
        with DeviceComm(world, window_bytes=256, signals=5, device="cpu", **PATHS[path]) as dc:
            for launch in (1, 2):
                out = np.zeros((threads, 4), np.uint64)
                got = np.zeros(2 * threads, np.uint8)
                kernel.launch(dc, 1, threads, args=(out, got))
                want = [[launch, launch if t < 32 else 0, 8 * launch, 64 * launch] for t in range(threads)]
                assert out.tolist() == want, (r, launch)
                sent = [((r - 1) % n * 64 + t + 7 * launch) % 256 for t in range(threads)]
                assert got.tolist() == sent + sent, (r, launch)

    _run(n, body)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_flush_request_completes_earlier_gets(path):
    kernel, n = _tour("requests"), 3

    def body(world):
        with DeviceComm(world, window_bytes=64, device="cpu", **PATHS[path]) as dc:
            for launch in (1, 2):
                out = np.zeros(65, np.uint64)
                kernel.launch(dc, 1, 64, args=(out,))
                assert out.tolist() == [_stamp((world.rank + 1) % n, launch)] * 65

    _run(n, body)


def _reached(v: int, least: int, bits: int) -> bool:
    return (v - least) % (1 << bits) < 1 << (bits - 1)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_rolling_compares_wrap_at_their_width(path):
    kernel = _tour("rolling")
    rng = np.random.default_rng(5)
    cases = [(5, 2**64 - 1, 64), (2**64 - 1, 5, 64), (4, 254, 8), (254, 4, 8), (1, 0, 1), (0, 1, 1), (2**63, 0, 64)]
    cases += [
        (int(v), int(v) + int(d), int(b))
        for v, d, b in zip(rng.integers(0, 2**63, 40), rng.integers(-300, 300, 40), rng.integers(1, 65, 40))
    ]
    cases = [(v & MASK64, least & MASK64, bits) for v, least, bits in cases]
    table = np.array(cases, np.uint64)

    def body(world):
        with DeviceComm(world, window_bytes=64, signals=2, counters=1, device="cpu", **PATHS[path]) as dc:
            out = np.zeros(16 + len(cases), np.uint64)
            kernel.launch(dc, 1, 32, args=(out, table, len(cases)))
            assert out[:9].tolist() == [2**64 - 3, 250, 2, 4, 260, 3, 1, 3, 0], out[:9].tolist()
            assert out[16:].tolist() == [int(_reached(*c)) for c in cases]

    _run(3, body)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_va_signals_land_after_their_data_on_strict_ordering(path):
    kernel, n = _tour("va_signals"), 3

    def body(world):
        with DeviceComm(world, window_bytes=512, device="cpu", strict_ordering=True, **PATHS[path]) as dc:
            for launch in (1, 2):
                out = np.zeros(4, np.uint64)
                kernel.launch(dc, 1, 32, args=(out,))
                assert out.tolist() == [launch, _stamp((world.rank - 1) % n, launch), 5 * launch, launch & 1]
            return dc.backend

    assert set(_run(n, body)) == {None if path == "lsa" else "rc" if path == "gin-ordered" else "proxy"}


# The scoped putValue, countedPut and get (device.h's scopes), one kernel each. Argument
# 0 names the scope every thread of the 64-thread block calls with: 0 CoopThread, 1
# CoopWarp, 2 CoopTile<8>, 3 CoopCta; group g (thread t's, t / the scope's size) acts
# alone on its own slice, with peer next = rank + 1. Byte k of group g's 24-byte source
# slice at rank p in launch L is (7 p + 3 g + k + 11 L) % 256 (scopedBytes).
SCOPED_OPS = (
    PREAMBLE
    + r"""
__device__ int scopeSize(int scope) { return scope == 0 ? 1 : scope == 1 ? 32 : scope == 2 ? 8 : (int)blockDim.x; }
__device__ uint8_t scopedByte(int p, int g, int k, uint64_t launch) {
  return (uint8_t)((7 * p + 3 * g + k + 11 * launch) % 256);
}
// Thread 0 stamps this rank's source slices at 2048 + 24 g for every group.
__device__ void stampSources(DeviceComm& comm, int groups) {
  if (threadIdx.x == 0)
    for (int g = 0; g < groups; g++)
      for (int k = 0; k < 24; k++) comm.local<uint8_t>(2048 + 24 * g)[k] = scopedByte(comm.rank(), g, k, comm.launch());
  __syncthreads();
}

// Group g putValues (launch << 32 | rank << 16 | g) to next's word 8 g with a weak
// increment of signal 0; every rank waits for the previous rank's groups, copies its
// words into out[0 .. groups) and, after a barrier (every put has landed), out[64] the
// signal: one increment per group and launch, not one per thread.
COMMREF_KERNEL(scoped_put_value, KernelArgs, args) {
  DeviceComm comm(args);
  const int scope = (int)comm.u64(0), groups = (int)blockDim.x / scopeSize(scope);
  uint64_t* out = comm.ptr<uint64_t>(1);
  const int next = (comm.rank() + 1) % comm.nranks(), g = (int)threadIdx.x / scopeSize(scope);
  const uint64_t value = comm.launch() << 32 | (uint64_t)comm.rank() << 16 | (uint64_t)g;
  if (scope == 0) comm.putValue(CoopThread(), next, 8 * g, value, WeakSignalInc(0));
  if (scope == 1) comm.gin(0).putValue(CoopWarp(), next, 8 * g, value, WeakSignalInc(0));
  if (scope == 2) comm.gin(0).putValue(CoopTile<8>(), next, 8 * g, value, WeakSignalInc(0));
  if (scope == 3) comm.gin(0).putValue(CoopCta(), next, 8 * g, value, WeakSignalInc(0));
  comm.waitSignal(0, comm.launch() * groups);
  if (threadIdx.x == 0)
    for (int j = 0; j < groups; j++) out[j] = comm.local<uint64_t>(0)[j];
  comm.barrier();
  if (threadIdx.x == 0) out[64] = comm.readSignal(0);
  comm.barrier();  // nobody's next launch writes a word before it is read
}

// Group g countedPuts its 24 source bytes to next's 512 + 24 g (counting on signal 1);
// every rank waits for the previous rank's groups, copies what landed into out and,
// after a barrier, the signal into count[0]: one per group and launch.
COMMREF_KERNEL(scoped_counted_put, KernelArgs, args) {
  DeviceComm comm(args);
  const int scope = (int)comm.u64(0), groups = (int)blockDim.x / scopeSize(scope);
  uint8_t* out = comm.ptr<uint8_t>(1);
  const int next = (comm.rank() + 1) % comm.nranks(), g = (int)threadIdx.x / scopeSize(scope);
  stampSources(comm, groups);
  const uint64_t dst = 512 + 24 * g, src = 2048 + 24 * g;
  if (scope == 0) comm.countedPut(CoopThread(), next, dst, src, 24, 1);
  if (scope == 1) comm.gin(0).countedPut(CoopWarp(), next, dst, src, 24, 1);
  if (scope == 2) comm.gin(0).countedPut(CoopTile<8>(), next, dst, src, 24, 1);
  if (scope == 3) comm.gin(0).countedPut(CoopCta(), next, dst, src, 24, 1);
  comm.waitSignal(1, comm.launch() * groups);
  if (threadIdx.x == 0)
    for (int i = 0; i < 24 * groups; i++) out[i] = comm.local<uint8_t>(512)[i];
  comm.barrier();
  if (threadIdx.x == 0) comm.ptr<uint64_t>(2)[0] = comm.readSignal(1);
  comm.barrier();
}

// After a barrier (every source is stamped), group g gets next's 24 source bytes into
// its 512 + 24 g, flushes in its scope (its get has landed) and its threads copy the
// slice into out together.
COMMREF_KERNEL(scoped_get, KernelArgs, args) {
  DeviceComm comm(args);
  const int scope = (int)comm.u64(0), size = scopeSize(scope), groups = (int)blockDim.x / size;
  uint8_t* out = comm.ptr<uint8_t>(1);
  const int next = (comm.rank() + 1) % comm.nranks(), g = (int)threadIdx.x / size;
  stampSources(comm, groups);
  comm.barrier();
  const uint64_t dst = 512 + 24 * g, src = 2048 + 24 * g;
  if (scope == 0) comm.get(CoopThread(), next, dst, src, 24), comm.gin(0).flush(CoopThread());
  if (scope == 1) comm.gin(0).get(CoopWarp(), next, dst, src, 24), comm.gin(0).flush(CoopWarp());
  if (scope == 2) comm.gin(0).get(CoopTile<8>(), next, dst, src, 24), comm.gin(0).flush(CoopTile<8>());
  if (scope == 3) comm.gin(0).get(CoopCta(), next, dst, src, 24), comm.gin(0).flush(CoopCta());
  for (int k = (int)threadIdx.x % size; k < 24; k += size) out[24 * g + k] = comm.local<uint8_t>(dst)[k];
  comm.barrier();  // nobody's next launch stamps a source before it is read
}
"""
)
SCOPE_SIZES = {"thread": 1, "warp": 32, "tile8": 8, "cta": 64}
SCOPE_IDS = {"thread": 0, "warp": 1, "tile8": 2, "cta": 3}


def _scoped_bytes(p: int, groups: int, launch: int) -> list[int]:
    return [(7 * p + 3 * g + k + 11 * launch) % 256 for g in range(groups) for k in range(24)]


@pytest.mark.parametrize("scope", list(SCOPE_SIZES))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_scoped_put_value_posts_once_per_scope(path, scope):
    """Each scope's putValue lands its own word, once: the signal counts one increment
    per scope and launch (a scope whose every thread posted would count more)."""
    kernel, n, groups = Kernel(SCOPED_OPS, "scoped_put_value"), 3, 64 // SCOPE_SIZES[scope]

    def body(world):
        prev = (world.rank - 1) % n
        with DeviceComm(world, window_bytes=4096, signals=2, device="cpu", **PATHS[path]) as dc:
            for launch in (1, 2):
                out = np.zeros(65, np.uint64)
                kernel.launch(dc, 1, 64, args=(SCOPE_IDS[scope], out))
                assert out[:groups].tolist() == [launch << 32 | prev << 16 | g for g in range(groups)], out
                assert int(out[64]) == launch * groups, out[64]

    _run(n, body)


@pytest.mark.parametrize("scope", list(SCOPE_SIZES))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_scoped_counted_put_lands_its_bytes_and_counts_once(path, scope):
    kernel, n, groups = Kernel(SCOPED_OPS, "scoped_counted_put"), 3, 64 // SCOPE_SIZES[scope]

    def body(world):
        prev = (world.rank - 1) % n
        with DeviceComm(world, window_bytes=4096, signals=2, counted_writes=True, device="cpu", **PATHS[path]) as dc:
            for launch in (1, 2):
                out, count = np.zeros(24 * 64, np.uint8), np.zeros(1, np.uint64)
                kernel.launch(dc, 1, 64, args=(SCOPE_IDS[scope], out, count))
                assert out[: 24 * groups].tolist() == _scoped_bytes(prev, groups, launch), (world.rank, launch)
                assert not out[24 * groups :].any()
                assert int(count[0]) == launch * groups, count

    _run(n, body)


@pytest.mark.parametrize("scope", list(SCOPE_SIZES))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_scoped_get_lands_after_its_scopes_flush(path, scope):
    kernel, n, groups = Kernel(SCOPED_OPS, "scoped_get"), 3, 64 // SCOPE_SIZES[scope]

    def body(world):
        nxt = (world.rank + 1) % n
        with DeviceComm(world, window_bytes=4096, device="cpu", **PATHS[path]) as dc:
            for launch in (1, 2):
                out = np.zeros(24 * 64, np.uint8)
                kernel.launch(dc, 1, 64, args=(SCOPE_IDS[scope], out))
                assert out[: 24 * groups].tolist() == _scoped_bytes(nxt, groups, launch), (world.rank, launch)
                assert not out[24 * groups :].any()

    _run(n, body)


REFUSALS = (
    PREAMBLE
    + r"""
// Refusals, chosen by argument 0; each is followed by a block-wide call.
COMMREF_KERNEL(refusals, KernelArgs, args) {
  DeviceComm comm(args);
  const int which = (int)comm.u64(0), next = (comm.rank() + 1) % comm.nranks();
  if (which == 0) comm.signal(next, VaSignal(WeakSignalInc(256)));
  if (which == 1) comm.readVaSignal(12);
  if (which == 2) comm.teamRankToWorld(comm.worldTeam(), comm.nranks());
  if (which == 3) comm.innerFactor(comm.worldTeam(), 3);
  if (which == 4) {
    uint64_t* p = (comm.symPtr<uint64_t>(0) + 4096 / 8).localPtr();
    if (p) *p = 1;
  }
  if (which == 5) comm.waitSignal(CoopWarp(), 0, 1, -1, 65);
  if (which == 6) comm.gin(1).wait(comm.gin(0).flushAsync());
  if (which == 7) comm.railTeam();
  if (which == 8) comm.put(CoopWarp(), next, 4096, 0, 8);
  if (which == 9) comm.putValue(CoopWarp(), next, 12, 1);
  if (which == 10) comm.countedPut(CoopTile<8>(), next, 0, 8, 8, 3);
  if (which == 11) comm.get(CoopWarp(), next, 0, 508, 8);
  if (which == 12) comm.putValue(CoopThread(), next, 0, 1, WeakSignalInc(3));
  comm.flush();
}
"""
)

# which: (communicator options, nranks, the message after "where the limit is")
REFUSAL_CASES = {
    "va-signal-without-strict-ordering": (
        0,
        dict(path="gin"),
        2,
        r"4: a VA signal needs a device communicator "
        r"created with strict_ordering=True",
    ),
    "va-word-unaligned": (1, dict(strict_ordering=True), 2, r"512: a VA signal's word must be 8 aligned bytes"),
    "team-rank-outside": (2, {}, 2, r"2: a team rank outside its team"),
    "factor-not-dividing": (3, {}, 2, r"2: the team is not a strided team here"),
    "symmetric-pointer-outside": (4, {}, 2, r"512: a symmetric pointer used outside the device window"),
    "compare-width": (5, dict(signals=1), 2, r"64: a rolling compare's width must be 1 to 64 bits"),
    "request-of-another-context": (
        6,
        dict(path="gin", contexts=2),
        2,
        r"1: a flush request waited on the handle "
        r"of another context",
    ),
    "rail-team-on-unequal-nodes": (7, dict(path="auto"), 5, r"8: the team is not a strided team here"),
    "warp-put-outside": (8, {}, 2, r"512 \(ids"),
    "warp-put-value-unaligned": (9, {}, 2, r"8 \(ids.*putValue's destination a multiple of it"),
    "tile-counted-put-signal-outside": (10, dict(path="gin", signals=1), 2, r"1 \(ids"),
    "warp-get-outside": (11, {}, 2, r"512 \(ids"),
    "thread-put-value-signal-outside": (12, dict(path="gin", signals=1), 2, r"1 \(ids"),
}


@pytest.mark.parametrize("case", sorted(REFUSAL_CASES))
def test_refusals_fail_the_launch_clearly(case, monkeypatch):
    which, options, nranks, message = REFUSAL_CASES[case]
    if case == "rail-team-on-unequal-nodes":
        monkeypatch.setenv(NODES_ENV, "2")  # 5 ranks: nodes of 3 and 2
    kernel = Kernel(REFUSALS, "refusals")

    def body(world):
        with DeviceComm(world, window_bytes=512, device="cpu", timeout=5, **options) as dc:
            with pytest.raises(
                ValueError,
                match=rf"^rank {world.rank}: a device-API call in block 0 was given "
                rf"\d+ where the limit is {message}",
            ):
                kernel.launch(dc, 1, 32, args=(which,))
            return dc.strided_teams

    strided = _run(nranks, body)
    assert all(strided) == (case != "rail-team-on-unequal-nodes")


def test_strict_ordering_needs_a_backend_with_va_signals():
    def body(world):
        with pytest.raises(CapabilityError, match=r"gda lacks VA signals"):
            DeviceComm(
                world,
                window_bytes=64,
                device="cpu",
                strict_ordering=True,
                strong_signals=False,
                path="gin",
                backend="gda",
            )
        with DeviceComm(
            world,
            window_bytes=64,
            device="cpu",
            strict_ordering=True,
            strong_signals=False,
            path="gin",
            wire="unordered",
        ) as dc:
            return dc.backend  # gda is picked first for weak signals, unless VA signals are needed

    assert set(_run(2, body)) == {"proxy"}


STUCK = (
    PREAMBLE
    + r"""
COMMREF_KERNEL(stuck, KernelArgs, args) {
  DeviceComm comm(args);
  if (threadIdx.x < 16) CoopWarp().sync();  // needs lanes 16..31, which wait at __syncthreads
  else __syncthreads();
}
"""
)


def test_a_warp_scope_that_can_never_meet_ends_the_launch():
    kernel = Kernel(STUCK, "stuck")

    def body(world):
        with DeviceComm(world, window_bytes=64, device="cpu", timeout=5) as dc:
            with pytest.raises(KernelError, match=r"^stuck: the threads of a block wait for each other at barriers"):
                kernel.launch(dc, 1, 32)

    _run(1, body)
