"""The device API's teams, symmetric pointers, cooperative scopes, flush requests,
rolling compares and VA signals (device.h's section of those names; team.h, coop.h):
each used by a kernel of device_kernels/examples/device_api_tour.cu on LSA and on GIN
over the ordered and unordered wires, and each refusal a clear error."""

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
