"""Helpers shared by the test modules to run and judge jobs (import them from here; no
test module imports another). Fixtures shared by them are in conftest.py; stand-ins for
a GPU's CuPy, driver and arrays in stand_ins.py."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from typing import NamedTuple

import numpy as np

from commref.bench.arguments import build_parser
from commref.collectives import check, verify
from commref.collectives.catalogue import CATALOGUE
from commref.collectives.catalogue import KERNEL_NAMES as COLLECTIVES
from commref.collectives.communicator import Communicator
from commref.device_kernels import abi, build
from commref.transports import job_reaper, launcher
from commref.transports.gin import semantics
from commref.transports.gin.atomics import host_atomics
from commref.transports.gin.backends import BACKENDS
from commref.transports.gin.replay import SEGMENT_BYTES
from commref.transports.thread_world import ThreadWorld

# Every wait's deadline in the in-process (ThreadWorld) tests: small, so that a bug
# ends a test in seconds; large enough for 5 ranks' sweeps on a loaded 2-core host.
WORLD_TIMEOUT = 60.0
REDUCING = {c.name for c in CATALOGUE.values() if c.reducing}

# The line under `commref check`'s table (commref.cli.check_summary).
_CHECK_SUMMARY = re.compile(
    r"^# (?P<rows>\d+) rows?, (?P<cases>\d+) cases? \((?P<what>.*)\): (?:no wrong elements in \d+ cases?|"
    r"(?P<wrong>\d+) wrong elements? in (?P<bad>\d+) of \d+ cases?, \d+ of \d+ rows?), [\d.]+ s$",
    re.M,
)


class CheckSummary(NamedTuple):
    rows: int
    cases: int
    wrong: int  # wrong elements
    bad_cases: int  # cases with a wrong element
    what: str  # counts, placements, denormal inputs


def check_summary(stdout: str) -> CheckSummary | None:
    """The summary of `commref check`'s output, or None when it printed none."""
    m = _CHECK_SUMMARY.search(stdout)
    if m is None:
        return None
    return CheckSummary(int(m["rows"]), int(m["cases"]), int(m["wrong"] or 0), int(m["bad"] or 0), m["what"])


def assert_check_clean(proc) -> CheckSummary:
    """Asserts that a `commref check` job ended 0 and printed a summary of some cases, none
    with a wrong element; returns the summary."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    s = check_summary(proc.stdout)
    assert s, out[-4000:]
    assert "no wrong elements" in proc.stdout, out[-2000:]
    assert s.cases > 0 and (s.wrong, s.bad_cases) == (0, 0), s
    return s


# `commref check` as a module (conftest.run_mpi(..., module=True) runs it under mpiexec).
CHECK_MODULE = ["commref.cli", "check"]
# One small case: an allreduce of 7 float32 elements, summed.
SMALL_CHECK = ["allreduce", "--dtype", "float32", "--op", "sum", "--count", "7"]


def many_channels_env(folder) -> dict[str, str]:
    """What a job's environment adds so that its tuner takes every channel it may
    (COMMREF_MODEL: a calibration file in `folder` whose channels start for nothing on
    many cores); pass it to conftest.clean_env."""
    from commref.collectives import calibration

    path = folder / "many-channels.json"
    planted = calibration.REFERENCE.replace(channel_s=0.0, cores=1024, source="planted")
    path.write_text(json.dumps(planted.to_json()))
    return {"COMMREF_MODEL": str(path)}


def multi_channel_check(channels: int, slot_bytes: int) -> list[str]:
    """`commref check`'s arguments for ring allreduce and reduce_scatter on 2100001 float32
    elements (8.4 MB per rank) on at most `channels` channels of `slot_bytes` slots (with
    many_channels_env, on all of them)."""
    return [
        *("allreduce", "reduce_scatter", "--dtype", "float32", "--op", "sum", "--algorithm", "ring"),
        *("--count", "2100001", "--channels", str(channels), "--slot-bytes", str(slot_bytes)),
    ]


# ---------------------------------------------------------------------------------------
# GIN sweeps in ThreadWorld
# ---------------------------------------------------------------------------------------


def gin_comm(world, **opts) -> Communicator:
    """A CPU communicator with WORLD_TIMEOUT's deadlines and `opts`."""
    return Communicator(world, "cpu", timeout=WORLD_TIMEOUT, **opts)


def errors_per_rank(nranks: int, make_comm, body, timeout: float = 60) -> list:
    """Each rank's (exception type name, message, seconds) of body(world, comm) on a
    ThreadWorld, or None where it raised nothing; `make_comm(world)` builds the
    communicator. The ranks meet after the body, so one rank's error is not another's
    abort."""

    def rank(world):
        comm = make_comm(world)
        t0 = time.monotonic()
        try:
            body(world, comm)
            out = None
        except Exception as e:
            out = (type(e).__name__, str(e), time.monotonic() - t0)
        world.barrier(what="test done", timeout=30)
        comm.close()
        return out

    return ThreadWorld.run(nranks, rank, timeout=timeout)


def close_after_barrier(world, comm) -> None:
    """Closes `comm` once every rank is done: a stopped proxy drops what it has not
    delivered yet (see Communicator.close)."""
    world.barrier(what="test done")
    comm.close()


def _gin_sweep(world, opts, dtypes, ops, counts, seed, peer_mask=None):
    comm = gin_comm(world, **opts)
    try:
        if peer_mask is not None:  # force a mix of LSA and GIN links (see test_mixed_lsa_and_gin_links)
            comm.peer_mask = peer_mask(world.rank)
            comm.launch_record.record["gin"]["peerMask"] = comm.peer_mask
            world.barrier(what="peer masks set")
        info = {
            "backend": comm.backend.name if comm.backend else None,
            "peer_mask": comm.peer_mask,
            "network": comm.network,
            "proxy": comm.proxy is not None,
        }
        # The ring and tree kernels (direct ones never take GIN links; tests/test_direct.py).
        case_list = check.cases(list(COLLECTIVES), dtypes, ops, [], counts, world.size, seed, direct=False)
        wrong = check.run_sweep(comm, case_list)
        info["ops"] = comm.proxy.stats["ops"] if comm.proxy else 0
        return info, case_list, wrong
    finally:
        close_after_barrier(world, comm)


def ordered_shm_gin(backend: str, protocol: str, channels: int, **more) -> dict:
    """Communicator options: GIN on `backend` with `protocol` over the ordered wire and
    network shm, `channels` channels of 256-byte slots (and `more`)."""
    return dict(
        path="gin",
        backend=backend,
        wire="ordered",
        network="shm",
        gin_protocol=protocol,
        max_channels=channels,
        slot_bytes=256,
        **more,
    )


def run_gin_sweep(nranks, opts, dtypes, ops, counts, seed=11, peer_mask=None) -> list[dict]:
    """Every collective and algorithm (ring and tree) x dtype x op x count x placement on
    `nranks` ThreadWorld ranks with Communicator options `opts`, every element checked;
    asserts that all ran and none was wrong. Returns each rank's info (backend, peer
    mask, network, whether a proxy ran, its operations)."""
    results = ThreadWorld.run(nranks, _gin_sweep, opts, dtypes, ops, counts, seed, peer_mask, timeout=WORLD_TIMEOUT)
    info, case_list, wrong = results[0]
    assert all(r[2] == wrong for r in results), "ranks disagree on the per-case totals"
    # Every collective x algorithm x dtype x op x count x placement ran.
    nreducing = len(REDUCING) + 1  # allreduce has ring and tree
    out_of_place_only = sum(not CATALOGUE[c].in_place_ok for c in COLLECTIVES)  # alltoall (ring: no direct here)
    nmoving = len(COLLECTIVES) - len(REDUCING) - out_of_place_only
    denormal = nreducing * len(set(ops) & set(verify.DENORMAL_OPS)) * len(set(dtypes) & set(verify.SUBNORMAL_EXPONENT))
    assert len(case_list) == ((nreducing * len(ops) + nmoving) * 2 + out_of_place_only) * len(dtypes) * len(
        counts
    ) + denormal * len(counts)
    bad = [(c, w) for c, w in zip(case_list, wrong) if w]
    assert sum(wrong) == 0, f"{len(bad)} failing cases over GIN {opts}, first: {bad[:4]}"
    return [r[0] for r in results]


# ---------------------------------------------------------------------------------------
# GIN runs traced for the replay (commref.transports.gin.replay judges the traces)
# ---------------------------------------------------------------------------------------

TRACE_SLOT_BYTES = 256
TRACE_COUNT = 1001


def traced_sweep(
    world,
    seed,
    timeout,
    count=TRACE_COUNT,
    slot_bytes=TRACE_SLOT_BYTES,
    segment_bytes=SEGMENT_BYTES,
    max_channels=1,
    collectives=COLLECTIVES,
    on_comm=None,
    **gin,
):
    """One reduced sweep of `collectives` (every GIN collective unless told; float32 sum,
    `count` elements, out of place) with the proxy's trace on, over `max_channels`
    channels (a connection's context is its channel); `gin`: the Communicator's GIN
    keywords; `on_comm(comm)` runs on the communicator before the sweep (a caller's
    assertions, or to keep its proxy). Returns (this rank's proxy trace, wrong elements
    here, strong flags the proxy received)."""
    comm = Communicator(
        world,
        "cpu",
        timeout=timeout,
        path="gin",
        seed=seed,
        max_channels=max_channels,
        slot_bytes=slot_bytes,
        segment_bytes=segment_bytes,
        **gin,
    )
    try:
        if on_comm is not None:
            on_comm(comm)
        comm.proxy.trace = {}
        cases = check.cases(
            list(collectives),
            ["float32"],
            ["sum"],
            [],
            [count],
            world.size,
            seed,
            direct=False,
            in_place=(False,),
            denormals=False,
        )
        wrong = sum(check.run_case(comm, c) for c in cases)
        world.barrier(what="traced sweep done")
        proxy = comm.proxy
    finally:
        comm.close()  # quiesces the proxy: everything posted has landed
    return {k: list(v) for k, v in proxy.trace.items()}, wrong, getattr(proxy, "strong_seen", 0)


def fault_counts(stdout: str) -> tuple[str, tuple[int, ...]]:
    """The "# GIN faults" line that `commref check --fault` prints: (its spec and seed as
    printed, (packets, dropped, duplicated, delayed, retransmitted, duplicates dropped))."""
    f = re.search(
        r"^# GIN faults (.*): (\d+) packets: (\d+) dropped, (\d+) duplicated, (\d+) delayed; "
        r"(\d+) retransmitted, (\d+) duplicates dropped",
        stdout,
        re.M,
    )
    assert f, stdout[-2000:]
    return f.group(1), tuple(map(int, f.groups()[1:]))


def collectives_run(world, backend, wire, protocol, seeds, timeout=30.0, network="shm", **more):
    """Per seed: traced_sweep's (trace, wrong elements, strong flags received); `more`:
    traced_sweep's other keywords (max_channels, the Communicator's GIN keywords)."""
    return [
        traced_sweep(world, seed, timeout, backend=backend, wire=wire, network=network, gin_protocol=protocol, **more)
        for seed in seeds
    ]


# (backend, protocol) on the ordered wire with independent contexts (GinOptions.independent_contexts)
INDEPENDENT = [
    ("proxy", "strong"),
    ("rc", "strong"),
    ("rc", "weak-last"),
    ("gda", "signal-per-put"),
    ("gda", "flush-signal"),
]

# The planted-bug runs (a strong flag stripped, a signal before its data): slots large
# enough that the strong protocol splits each into several puts, the strong signal on
# the last; at least half the seeds must catch a plant.
PLANTED_SEEDS = range(4)
PLANTED_SLOT_BYTES = 16384  # a slot of 64 + 16384 bytes goes as 4 puts of about 4 KiB under strong
PLANTED_SEGMENT_BYTES = 4096
PLANTED_COUNT = 16384  # float32: 64 KiB per rank, 4 full slots


def planted_run(world, seed, timeout, wire="unordered"):
    """The collectives over GIN (proxy backend, `wire`, strong protocol) through the
    planted runs' slots; returns (this rank's proxy trace, wrong elements here)."""
    trace, wrong, _ = traced_sweep(
        world,
        seed,
        timeout,
        count=PLANTED_COUNT,
        slot_bytes=PLANTED_SLOT_BYTES,
        segment_bytes=PLANTED_SEGMENT_BYTES,
        backend="proxy",
        network="shm",
        gin_protocol="strong",
        wire=wire,
    )
    return trace, wrong


def trace_kinds(trace: dict) -> dict:
    """How many records of each kind (its first field) a trace holds, over its links."""
    out: dict = {}
    for records in trace.values():
        for r in records:
            out[r[0]] = out.get(r[0], 0) + 1
    return out


# ---------------------------------------------------------------------------------------
# buffers, geometries, leftovers
# ---------------------------------------------------------------------------------------

# (threads per block, max channels, slot bytes, FIFO steps)
GEOMETRIES = {
    "1thread-3ch-slot128-2steps": (1, 3, 128, 2),
    "4fibers-2ch-slot256-4steps": (4, 2, 256, 4),
}


def orphan_segments(before: set[str], patience_s: float = 5.0) -> set[str]:
    """Segments (launcher.SEGMENTS: hydra's topology files too) that appeared since
    `before` and that no live process maps or holds open. A concurrent job's live
    segments are not ours, nor those that vanish within `patience_s` (another test's
    cleanup, as shm_leak_check's)."""
    deadline = time.monotonic() + patience_s
    while True:
        left = (launcher.shm_segments() - before) - job_reaper.held_files()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------
# users' kernels on the device API (the CPU tests and tests/gpu/device_api_gpu.py run them)
# ---------------------------------------------------------------------------------------

PREAMBLE = '#include "commref/device.h"\nusing namespace commref;\n'


def user_kernel(name: str, body: str) -> str:
    """The source of a user's kernel `name` on the device API: PREAMBLE, then the kernel,
    whose DeviceComm `comm` the lines of `body` use."""
    return (
        PREAMBLE
        + f"\nCOMMREF_KERNEL({name}, KernelArgs, args) {{\n  DeviceComm comm(args);\n"
        + body.lstrip("\n")
        + "}\n"
    )


# Each rank puts its launch-stamped word to every peer at its own slot (weak signal 0
# per put) and reads the n words once n - 1 have arrived; the barrier keeps a fast rank
# from overwriting a slot in the next launch before its owner read it.
EXCHANGE = user_kernel(
    "exchange",
    r"""
  const int n = comm.nranks(), r = comm.rank();
  uint64_t* mine = comm.local<uint64_t>(0);
  if (threadIdx.x == 0) mine[64 + r] = 1000 * comm.launch() + r;
  __syncthreads();
  for (int k = 1; k < n; k++) comm.put((r + k) % n, r * 8, (64 + r) * 8, 8, WeakSignalInc(0));
  comm.waitSignal(0, comm.launch() * (n - 1));
  uint64_t* out = comm.ptr<uint64_t>(0);
  if (threadIdx.x == 0) for (int j = 0; j < n; j++) out[j] = j == r ? mine[64 + r] : mine[j];
  comm.barrier();
""",
)


# Counted writes: `chunks` puts of 64 bytes to the next rank, none with a flag; the
# receiver waits until signal 1 has counted them all, then reads.
COUNTED = user_kernel(
    "counted",
    r"""
  const int n = comm.nranks(), r = comm.rank();
  const uint64_t chunks = comm.u64(0);
  uint64_t* src = comm.local<uint64_t>(chunks * 64);
  for (uint64_t i = threadIdx.x; i < chunks * 8; i += blockDim.x) src[i] = comm.launch() << 32 | (uint64_t)r << 24 | i;
  __syncthreads();
  for (uint64_t c = 0; c < chunks; c++) comm.countedPut((r + 1) % n, c * 64, chunks * 64 + c * 64, 64, 1);
  comm.waitSignal(1, comm.launch() * chunks, (r + n - 1) % n);
  uint64_t* out = comm.ptr<uint64_t>(1);
  const uint64_t* got = comm.local<const uint64_t>(0);
  for (uint64_t i = threadIdx.x; i < chunks * 8; i += blockDim.x) out[i] = got[i];
  comm.barrier();
""",
)


# Local completion and get: a put that names counter 0 (waitCounter), then a get of
# the next rank's stamp, complete after flush.
COUNTERS_GET = user_kernel(
    "counters_get",
    r"""
  const int n = comm.nranks(), r = comm.rank();
  uint64_t* w = comm.local<uint64_t>(0);
  if (threadIdx.x == 0) w[0] = 7000 + r;
  comm.barrier();  // every stamp is written before anyone gets it
  comm.put((r + 1) % n, 16, 0, 8, NoSignal(), 0);
  comm.waitCounter(0, comm.launch());
  comm.get((r + 1) % n, 8, 0, 8);
  comm.flush();
  uint64_t* out = comm.ptr<uint64_t>(0);
  if (threadIdx.x == 0) out[0] = w[1];
  comm.barrier();
""",
)


def prims_kernel(name: str, body: str) -> str:
    """A user's kernel on the collectives' flow primitives (Prims): user_kernel, whose
    `body` sends from `src` (pointer slot 0) and receives into `dst` (slot 1)."""
    return user_kernel(name, SRC_DST + body.lstrip("\n"))


SRC_DST = """  const uint8_t* src = comm.ptr<const uint8_t>(0);
  uint8_t* dst = comm.ptr<uint8_t>(1);
"""


# The collectives' own flow primitives from a user kernel: channel 0's ring, each rank
# sends 32 bytes to the next and receives the previous rank's.
PRIMS_RING = prims_kernel(
    "prims_ring",
    r"""
  Prims<uint8_t, OpSum> p(comm.coll(), 0);
  connectRing(p, comm.coll(), 0);
  p.send(src, 32);
  p.recv(dst, 32);
  p.finish();
""",
)

# A connection per peer: every rank sends a block of `bytes` to every peer through the
# flow primitives and receives one from each (an all-to-all on Prims).
PRIMS_PER_PEER = prims_kernel(
    "prims_per_peer",
    r"""
  const uint64_t bytes = comm.u64(2);
  const int n = comm.nranks(), r = comm.rank();
  for (int k = 1; k < n; k++) {
    const int peer = (r + k) % n;
    Prims<uint8_t, OpSum> tx(comm.coll(), comm.sendChannel(peer));
    comm.connectSend(tx, peer);
    tx.send(src + peer * bytes, bytes);
    tx.finish();
  }
  for (int k = 1; k < n; k++) {
    const int peer = (r + n - k) % n;
    Prims<uint8_t, OpSum> rx(comm.coll(), comm.recvChannel(peer));
    comm.connectRecv(rx, peer);
    rx.recv(dst + peer * bytes, bytes);
    rx.finish();
  }
""",
)


def nvcc_sm90(
    src, out, output: str = "-cubin", timeout: float | None = None, flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """nvcc compiles `src` for sm_90 to `out` (`output`: -cubin or -ptx; `flags` added)
    with the loader's include path, as the loader builds kernels; the output captured as text."""
    cmd = ["nvcc", "-arch=sm_90", "-std=c++17", output, *flags, "-I", str(build.INCLUDE_DIR), "-o", str(out), str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------
# the benchmark's command line
# ---------------------------------------------------------------------------------------


def bench_args(*argv: str):
    """The benchmark's arguments for the command line `argv` (bench/arguments.py)."""
    return build_parser().parse_args(list(argv))


# A quick benchmark run: 2 iterations after 1 warm-up, no baseline and no bound.
QUICK_BENCH = ("-n", "2", "-w", "1", "--no-baseline", "--no-bound")


# ---------------------------------------------------------------------------------------
# a GIN engine fed host-posted descriptors (the native engine's and the Python proxy's)
# ---------------------------------------------------------------------------------------

POSTED_CAP = 8  # entries of the descriptor queue in `posted`

# One event per ThreadWorld (its ranks share one abort-word array); each entry keeps its array
# alive, so no later world's array can take its id.
_ABORT_CLEARED: dict[int, tuple[np.ndarray, threading.Event]] = {}
_ABORT_CLEARED_LOCK = threading.Lock()


def abort_cleared(world) -> threading.Event:
    """The event by which the rank whose engine raised the abort word on purpose (a refusal under
    test) tells the other ranks of its ThreadWorld that it has cleared the word again. They wait
    for it before their next barrier, which would (rightly) abort while the word is up."""
    with _ABORT_CLEARED_LOCK:
        entry = _ABORT_CLEARED.setdefault(id(world.abort_word), (world.abort_word, threading.Event()))
    return entry[1]


def posted_layout():
    from commref.transports.gin.queue import queue_bytes

    lay = np.zeros((), abi.WINDOW_LAYOUT)
    lay["ginQueueOff"] = 4096
    lay["ginSignalsOff"] = 4096 + queue_bytes(POSTED_CAP)
    lay["ginCountersOff"] = int(lay["ginSignalsOff"]) + 256
    return lay, int(lay["ginCountersOff"]) + 64


def posted(world, engine: str, backend: str, posts, quiesce=True, timeout=WORLD_TIMEOUT, **proxy_kw):
    """Rank 0 runs a proxy of `engine` ("native" or "python") and posts `posts` (QueueWriter.fill
    keyword sets) to its own queue; every rank returns its window (rank 0 also the proxy's
    trace, stats, error and the abort word)."""
    from commref.transports.gin.engine import EngineSite
    from commref.transports.gin.native import NativeProxy
    from commref.transports.gin.proxy import GinProxy, ProxyError
    from commref.transports.gin.queue import QueueWriter
    from commref.transports.windows import register_window

    lay, nbytes = posted_layout()
    window = register_window(world, nbytes, "cpu")
    try:
        local = window.local
        local[:2048] = ((np.arange(2048) * (world.rank + 3)) % 251 + 1).astype(np.uint8)
        world.barrier(what="sources written")
        out = None
        cleared = abort_cleared(world)
        if world.rank != 0:
            assert cleared.wait(timeout), f"rank {world.rank}: rank 0 never cleared the abort word"
        else:
            try:
                cls = NativeProxy if engine == "native" else GinProxy
                site = EngineSite(world, window, lay, POSTED_CAP, BACKENDS[backend], semantics.ORDERED, "shm")
                proxy = cls(site, 0, 64, **proxy_kw)
                proxy.trace = {}
                proxy.start()
                q = QueueWriter(local, lay, POSTED_CAP, host_atomics())
                for p in posts:
                    slot = q.fill(**p)
                    q.publish([slot])
                    deadline = time.monotonic() + timeout
                    while q.consumed() <= slot and proxy.error is None:  # the queue is small
                        assert time.monotonic() < deadline, f"slot {slot} not consumed ({q.consumed()})"
                        time.sleep(1e-4)
                    if proxy.error is not None:
                        break
                if quiesce:
                    proxy.quiesce(timeout)
                proxy.stop()
                proxy.stop()  # idempotent
                err = proxy.error
                try:
                    trace = proxy.trace
                except ProxyError as e:
                    trace = e
                out = {
                    "trace": trace,
                    "stats": proxy.stats,
                    "error": None if err is None else str(err),
                    "abort": int(world.abort_word[0]),
                    "pending": proxy.pending(),
                }
                world.abort_word[0] = 0
            finally:
                cleared.set()
        world.barrier(what="landed")
        return out, local.copy()
    finally:
        window.close()


def mixed_posts():
    put, sig, val, get = abi.GIN_PUT, abi.GIN_SIGNAL, abi.GIN_PUT_VALUE, abi.GIN_GET
    strong = abi.GIN_HAS_SIGNAL | abi.GIN_STRONG
    posts = []
    for i in range(12):
        peer, ctx = 1 + i % 2, i % 3
        if i % 4 == 0:
            posts.append(
                dict(
                    op=put,
                    flags=strong | abi.GIN_HAS_COUNTER,
                    peer=peer,
                    ctx=ctx,
                    dst=1024 + 64 * i,
                    src=64 * i,
                    nbytes=50 + i,
                    signal=i % 5,
                    counter=i % 3,
                )
            )
        elif i % 4 == 1:
            posts.append(dict(op=put, flags=0, peer=peer, ctx=ctx, dst=1024 + 64 * i, src=64 * i, nbytes=64))
        elif i % 4 == 2:
            posts.append(
                dict(
                    op=val,
                    flags=strong | abi.GIN_VA | abi.GIN_ADD,
                    peer=peer,
                    ctx=ctx,
                    dst=1024 + 64 * i,
                    nbytes=0x1122334455667700 + i,
                    signal=1900,
                    value=7,
                )
            )
        else:
            posts.append(dict(op=sig, flags=abi.GIN_HAS_SIGNAL | abi.GIN_ADD, peer=peer, ctx=ctx, signal=3, value=5))
        posts.append(dict(op=abi.GIN_DOORBELL, peer=peer, ctx=ctx))
        if i == 6:  # links (1, 0), (2, 0) exist: both record it; (2, 0) posts again after it
            posts.append(dict(op=abi.GIN_FLUSH, ctx=0))
    posts.append(dict(op=get, peer=2, ctx=0, dst=1500, src=100, nbytes=40))
    posts.append(dict(op=abi.GIN_FLUSH, ctx=-1))  # no link of context -1: recorded nowhere
    posts.append(dict(op=abi.GIN_DOORBELL, peer=2, ctx=3))  # a link with a doorbell only
    posts.append(dict(op=abi.GIN_FLUSH, ctx=3))
    return posts
