"""ThreadSanitizer build of the CPU engine and the kernels, run in a ThreadWorld.

The same sources are built with cpu_loader.TSAN_FLAGS and run in a subprocess that
preloads the compiler's libtsan (python itself is not instrumented; the preload
provides the runtime that the instrumented library needs and intercepts pthreads,
malloc and the like, so the GIL and Python's locks are seen as synchronization).
The subprocess runs ring and tree allreduce, ring allgather and (over LSA) the direct
allreduce, reduce_scatter and allgather on symmetric buffers, on 2 and 3 ranks with
several channels (blocks on the engine's pooled worker threads), with one thread per
block and with several (fibers, which the engine announces to TSan), over LSA
connections and over GIN (the kernels' side of it: the proxy is Python), then
launches the engine self-test kernels from several Python threads at once.

The device API's kernels too (DEVICE_SCRIPT): the conformance suite's litmus kernel
(tests/kernels/litmus.cu: strong and weak signals, signals alone, flush and counters,
gets, counted writes, barriers of every fence level and context set) over LSA and over
GIN, with one thread per block and with several, and commref.ep's dispatch and combine
over LSA, each user library built with the same flags (the litmus whose stale read is
shown on the wire are left out: they race by design). Negative: a kernel that counts
its write on the target's signal before storing the data (EARLY_COUNT) must be reported.

- Positive: the normal build runs clean (no ThreadSanitizer report at all) and
  every result is exact.
- Negative: built with COMMREF_TEST_BROKEN_RELEASE, store_release() is relaxed, so
  a flag publishes FIFO data without ordering it; TSan must report the data race
  between the sender's writes and the receiver's reads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from commref.device_kernels import abi, build, cpu_loader, gpu_loader

REPO = Path(__file__).resolve().parents[1]
TSAN_EXITCODE = 66
# halt_on_error=0: report every race and keep going (the negative test counts them).
# exitcode: a distinct status when anything was reported.
# report_signal_unsafe=0: python's own signal handlers are not our concern.
TSAN_OPTIONS = f"halt_on_error=0 exitcode={TSAN_EXITCODE} report_signal_unsafe=0 history_size=4"
RUN_TIMEOUT_S = 600

# Runs in the TSan subprocess: argv = library path, threads per block, connection path.
SCRIPT = r"""
import ctypes, json, os, sys, threading
from pathlib import Path

import numpy as np

from commref.collectives import calibration, catalogue, communicator, tuner, verify
from commref.collectives.symmetric import SymmetricArena
from commref.device_kernels import abi, cpu_loader
from commref.transports.thread_world import ThreadWorld

lib, threads, path = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
assert hasattr(ctypes.CDLL(None), "__tsan_switch_to_fiber"), "the TSan runtime is not loaded"
tsan_kernels = cpu_loader.CpuKernels(lib)
# The Communicator takes its kernels from cpu_loader.cpu_kernels(): hand it the TSan build
# (the uninstrumented library is never built nor loaded in this process).
cpu_loader.cpu_kernels = lambda defines=(): tsan_kernels
# Small messages on several channels, so that blocks also run on the engine's workers: a
# calibration whose channels start for nothing on many cores (the model then takes them all).
os.environ["COMMREF_MODEL"] = "reference"
calibration.REFERENCE = calibration.REFERENCE.replace(channel_s=0.0, cores=1024)
assert tuner.plan("allreduce", "ring", 3001 * 4, 3, "cpu", 3).nchannels == 3, "small messages are not split"

arenas = {}

def rank_main(world):
    n, r = world.size, world.rank
    comm = communicator.Communicator(world, "cpu", max_channels=3, slot_bytes=256, nsteps=2,
                                     threads=threads, timeout=120, path=path)
    assert comm.kernels is tsan_kernels
    wrong = {}
    for it in range(2):
        for algo in ("ring", "tree"):
            for count in (1, 3001):
                seed = 11 + it
                x = verify.make_input("allreduce", np.int32, "sum", seed, r, n, count)
                out = np.zeros_like(x)
                comm.allreduce(x, out, "sum", algorithm=algo)
                exp = verify.expected_output("allreduce", np.int32, "sum", seed, r, n, count)
                wrong[f"allreduce/{algo}/{count}/{it}"] = verify.count_wrong(out, exp)
        for count in (5, 7777):
            x = verify.make_input("allgather", np.uint8, None, 3 + it, r, n, count)
            out = np.zeros(count * n, np.uint8)
            comm.allgather(x, out)
            exp = verify.expected_output("allgather", np.uint8, None, 3 + it, r, n, count)
            wrong[f"allgather/ring/{count}/{it}"] = verify.count_wrong(out, exp)
        if path == "lsa":  # direct and nvls kernels: peers load this rank's symmetric buffers
            arena = arenas.get(r) or arenas.setdefault(r, SymmetricArena(comm, 1 << 20))
            for coll, dt, op, count, algo in (("allreduce", np.int32, "sum", 3001, "direct"),
                                              ("reduce_scatter", np.int32, "sum", 1001, "direct"),
                                              ("allgather", np.uint8, None, 7777, "direct"),
                                              ("allreduce", np.int32, "sum", 3001, "nvls")):
                arena.reset()
                x = verify.make_input(coll, dt, op, 21 + it, r, n, count)
                send = arena.take(x.size, dt)
                send[...] = x
                out = arena.take(catalogue.get(coll).counts(count, n)[1], dt)
                getattr(comm, coll)(send, out, *([op] if op else []), algorithm=algo)
                exp = verify.expected_output(coll, dt, op, 21 + it, r, n, count)
                wrong[f"{coll}/{algo}/{count}/{it}"] = verify.count_wrong(out, exp)
    arenas.pop(r, None)
    comm.close()  # with GIN: drains this rank's proxy (peers still wait for its last puts)
    return wrong

result = {}
for nranks in (2, 3):
    per_rank = ThreadWorld.run(nranks, rank_main, timeout=120)
    for rank, w in enumerate(per_rank):
        for case, bad in w.items():
            result[f"nranks={nranks}/rank={rank}/{case}"] = bad

# Engine: launches from several Python threads at once share the worker pool.
def selftest(grid, block, reps, errors):
    try:
        for _ in range(reps):
            dst = np.zeros(grid, np.uint64)
            a = np.zeros(1, abi.COPY_ARGS)
            a[0]["dst"] = dst.ctypes.data
            tsan_kernels.launch("commref_engine_selftest", grid, block, a)
            exp = np.arange(grid, dtype=np.uint64) * 1000000 + block * (block + 1) // 2 + grid * 1000
            if not (dst == exp).all():
                errors.append(f"selftest grid={grid} block={block}: {dst} != {exp}")
    except Exception as e:
        errors.append(repr(e))
errors = []
ths = [threading.Thread(target=selftest, args=(g, b, 10, errors)) for g, b in ((3, 7), (2, 1), (4, 33))]
for t in ths: t.start()
for t in ths: t.join()
result["engine/concurrent_selftest"] = len(errors)
print("RESULT " + json.dumps({"wrong": result, "errors": errors}), flush=True)
"""


# Runs in the TSan subprocess: argv = the collectives' TSan library, "positive" or "negative".
DEVICE_SCRIPT = r"""
import ctypes, json, sys
from pathlib import Path

import numpy as np

from commref import ep
from commref.collectives.device_api import DeviceComm, Kernel, ep_check
from commref.collectives.device_api import conformance as cf
from commref.device_kernels import cpu_loader
from commref.transports.thread_world import ThreadWorld

assert hasattr(ctypes.CDLL(None), "__tsan_switch_to_fiber"), "the TSan runtime is not loaded"
lib, mode = Path(sys.argv[1]), sys.argv[2]
tsan_kernels = cpu_loader.CpuKernels(lib)
cpu_loader.cpu_kernels = lambda defines=(): tsan_kernels
plain_user_library = cpu_loader.build_user_cpu_library
cpu_loader.build_user_cpu_library = lambda source: plain_user_library(source, flags=cpu_loader.TSAN_FLAGS)
result = {}
LITMUS = Kernel(Path("tests/kernels/litmus.cu").read_text(), "litmus", filename="litmus.cu")

def litmus(world, wire, options, threads):
    # Not the litmus whose outcome is shown on the wire: they race by design (a get's
    # destination read before flush, while the engine's memcpy may be landing it).
    mask = sum(1 << t.code for t in cf.LITMUS if t.cls("A", wire) != cf.SHOWN)
    opts = dict(window_bytes=cf.WINDOW_BYTES, signals=cf.CODES, counters=1, contexts=2, counted_writes=True,
                device="cpu", threads=threads, timeout=120, **options)
    with DeviceComm(world, **opts) as dc:
        counts = np.zeros(2 * cf.CODES + 1, np.uint64)
        for _ in range(2):
            LITMUS.launch(dc, 1, args=(mask, 10, counts))
        return counts.tolist()

# A counted write planted to count before its data: the count (a release add on the
# target's signal) is published, then the data is stored; the receiver waits for the
# count and reads.
EARLY_COUNT = '''
#include "commref/device.h"
using namespace commref;
COMMREF_KERNEL(early_count, KernelArgs, args) {
  DeviceComm comm(args);
  uint64_t* seen = comm.ptr<uint64_t>(0);
  for (uint64_t i = 1; i <= 20; i++) {
    if (comm.rank() == 0) {
      comm.signal(1, StrongSignalInc(0));
      if (threadIdx.x == 0) *comm.lsaPtr<uint64_t>(1, 0) = comm.launch() << 32 | i;
    } else {
      comm.waitSignal(0, 20 * (comm.launch() - 1) + i, 0);
      if (threadIdx.x == 0) seen[0] += *comm.local<uint64_t>(0) != (comm.launch() << 32 | i);
    }
    comm.barrier();
  }
}
'''

def early_count(world):
    kernel = Kernel(EARLY_COUNT, "early_count")
    with DeviceComm(world, window_bytes=64, signals=1, device="cpu", path="lsa", timeout=120) as dc:
        seen = np.zeros(1, np.uint64)
        kernel.launch(dc, 1, args=(seen,))
        return int(seen[0])

def ep_round(world):
    x, topk, w = ep.make_inputs(world.rank, world.size, 12, 64, 8, 3, seed=7)
    all_topk = world.allgather(topk, what="tsan ep: topk")
    all_w = world.allgather(w, what="tsan ep: weights")
    with ep.Buffer(world, num_experts=8, hidden=64, max_tokens_per_rank=16, num_topk=3, low_latency_mode=True,
                   device="cpu", path="lsa", timeout=120) as buf:
        problems, _ = ep_check.checked_round(buf, (x, topk, w), all_topk, all_w)
        return len(problems)

if mode == "positive":
    for path, options in (("lsa", dict(path="lsa")), ("ordered", dict(path="gin", wire="ordered", backend="proxy"))):
        for threads in (1, 4):
            per_rank = ThreadWorld.run(2, litmus, path, options, threads, timeout=120)
            for t in cf.LITMUS:
                if t.cls("A", path) != cf.SHOWN:  # the others are never observed
                    result[f"litmus/{path}/threads={threads}/{t.name}"] = per_rank[1][2 * t.code]
    for rank, bad in enumerate(ThreadWorld.run(2, ep_round, timeout=120)):
        result[f"ep/lsa/rank={rank}"] = bad
else:
    result["early_count"] = ThreadWorld.run(2, early_count, timeout=120)[1]
print("RESULT " + json.dumps({"wrong": result}), flush=True)
"""


def find_libtsan() -> tuple[str | None, str]:
    """The compiler's ThreadSanitizer runtime, or None and why not."""
    try:
        cxx = cpu_loader.host_compiler()
    except build.KernelError as e:
        return None, f"no ThreadSanitizer runtime: {e}"
    out = subprocess.run(
        [cxx, "-print-file-name=libtsan.so"], capture_output=True, text=True, check=False
    ).stdout.strip()
    # Without the runtime the compiler echoes the bare name back.
    if not out or not os.path.isabs(out) or not os.path.exists(out):
        return None, f"no ThreadSanitizer runtime: `{cxx} -print-file-name=libtsan.so` gave {out!r}"
    return os.path.realpath(out), ""


LIBTSAN, WHY_NO_TSAN = find_libtsan()
if LIBTSAN is None:
    print(WHY_NO_TSAN)
pytestmark = pytest.mark.skipif(LIBTSAN is None, reason=WHY_NO_TSAN)


# The script reduces int32 with sum only: both builds hold that one reduction instance
# (and every data-movement kernel), as a GPU module does (gpu_loader.specialization),
# which makes each build a fraction of the forty instances' compile time.
INT32_SUM = gpu_loader.specialization((abi.DTYPE_CODES["int32"], abi.OP_CODES["sum"]))


@pytest.fixture(scope="module")
def tsan_library() -> Path:
    return cpu_loader.build_cpu_library(flags=cpu_loader.TSAN_FLAGS, defines=INT32_SUM)


@pytest.fixture(scope="module")
def broken_tsan_library() -> Path:
    return cpu_loader.build_cpu_library(
        flags=cpu_loader.TSAN_FLAGS, defines=(*INT32_SUM, "COMMREF_TEST_BROKEN_RELEASE")
    )


def run_under_tsan(
    lib: Path, threads: int, tmp_path: Path, path: str = "lsa", script_text: str = SCRIPT, argv: tuple = ()
) -> tuple[subprocess.CompletedProcess, dict | None]:
    """`script_text` (SCRIPT: argv lib, threads, path; DEVICE_SCRIPT: argv lib, mode)
    in a subprocess under TSan; its RESULT line."""
    script = tmp_path / "tsan_script.py"
    script.write_text(script_text)
    env = dict(os.environ)
    env["LD_PRELOAD"] = LIBTSAN
    env["TSAN_OPTIONS"] = TSAN_OPTIONS
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("COMMREF_TIMEOUT", "120")
    proc = subprocess.run(
        [sys.executable, str(script), str(lib), *(argv or (str(threads), path))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return proc, result


def reports(stderr: str) -> list[str]:
    """The TSan reports in `stderr`, one string each."""
    return re.findall(r"={18}\nWARNING: ThreadSanitizer:.*?(?:\n={18}|\Z)", stderr, flags=re.DOTALL)


def describe(proc: subprocess.CompletedProcess, limit: int = 12000) -> str:
    hint = ""
    if "unexpected memory mapping" in proc.stderr:
        hint = (
            "hint: this ThreadSanitizer runtime does not support the kernel's address-space randomisation; "
            "try `sysctl vm.mmap_rnd_bits=28`\n"
        )
    return (
        f"{hint}exit status {proc.returncode}\n--- stdout (tail) ---\n{proc.stdout[-3000:]}\n"
        f"--- stderr (head) ---\n{proc.stderr[:limit]}"
    )


@pytest.mark.parametrize("path", ["lsa", "gin"])
@pytest.mark.parametrize("threads", [1, 5])
def test_tsan_clean_collectives(tsan_library, tmp_path, threads, path):
    """path="gin" runs the kernels' GIN side (descriptor queue, signal waits) against
    the proxy; the proxy is Python, so only the kernels' half is instrumented."""
    proc, result = run_under_tsan(tsan_library, threads, tmp_path, path)
    found = reports(proc.stderr)
    summaries = sorted(set(re.findall(r"SUMMARY: ThreadSanitizer: .*", proc.stderr)))
    assert "WARNING: ThreadSanitizer" not in proc.stderr, (
        f"{len(found)} ThreadSanitizer report(s) with threads={threads} path={path}:\n"
        + "\n".join(summaries)
        + "\n"
        + describe(proc)
    )
    assert proc.returncode == 0, describe(proc)
    assert result is not None, describe(proc)
    bad = {case: n for case, n in result["wrong"].items() if n}
    assert not bad and not result["errors"], f"wrong results under TSan: {bad} {result['errors']}"
    per_iteration = 6 + (4 if path == "lsa" else 0)  # 4 allreduce + 2 allgather (+ 3 direct, 1 nvls)
    assert len(result["wrong"]) == 2 * (2 + 3) * per_iteration + 1  # every case ran on every rank
    assert path != "lsa" or any("/direct/" in case for case in result["wrong"])
    assert path != "lsa" or any("/nvls/" in case for case in result["wrong"])


@pytest.mark.parametrize("threads", [1, 5])
def test_tsan_detects_broken_release(broken_tsan_library, tmp_path, threads):
    proc, result = run_under_tsan(broken_tsan_library, threads, tmp_path)
    assert "WARNING: ThreadSanitizer: data race" in proc.stderr, (
        "a relaxed flag publish went unnoticed by ThreadSanitizer\n" + describe(proc)
    )
    assert proc.returncode == TSAN_EXITCODE, describe(proc)
    # The races are on what the flags publish: FIFO slots and step headers, written by
    # the sender (lsaPost, reduceCopy) and read by the receiver (lsaWaitReady, reduceCopy).
    summaries = re.findall(r"SUMMARY: ThreadSanitizer: data race (\S+)", proc.stderr)
    assert any("/commref/" in s for s in summaries), "\n".join(summaries) + "\n" + describe(proc)
    assert result is not None, describe(proc)  # the run itself completed


def test_tsan_clean_device_api_kernels(tsan_library, tmp_path):
    """The litmus kernel over LSA and GIN (1 and 4 threads per block) and commref.ep over
    LSA: no ThreadSanitizer report, every forbidden or refined outcome unseen, the EP
    round exact."""
    proc, result = run_under_tsan(tsan_library, 0, tmp_path, script_text=DEVICE_SCRIPT, argv=("positive",))
    summaries = sorted(set(re.findall(r"SUMMARY: ThreadSanitizer: .*", proc.stderr)))
    assert "WARNING: ThreadSanitizer" not in proc.stderr, "\n".join(summaries) + "\n" + describe(proc)
    assert proc.returncode == 0 and result is not None, describe(proc)
    bad = {case: n for case, n in result["wrong"].items() if n}
    assert not bad, f"under TSan: {bad}"
    assert sum(c.startswith("litmus/lsa/") for c in result["wrong"]) == 2 * 15  # every litmus, 1 and 4 threads
    assert sum(c.startswith("litmus/ordered/") for c in result["wrong"]) == 2 * 14  # all but get-before-flush
    assert sum(c.startswith("ep/") for c in result["wrong"]) == 2


def test_tsan_detects_a_count_published_before_its_data(tsan_library, tmp_path):
    """A counted write whose count is released before its data is stored (EARLY_COUNT):
    the receiver's read races with the sender's store, and TSan says so (the window is
    too short for a stale read to show on the CPU)."""
    proc, result = run_under_tsan(tsan_library, 0, tmp_path, script_text=DEVICE_SCRIPT, argv=("negative",))
    assert "WARNING: ThreadSanitizer: data race" in proc.stderr, describe(proc)
    assert proc.returncode == TSAN_EXITCODE, describe(proc)
    summaries = re.findall(r"SUMMARY: ThreadSanitizer: data race (\S+)", proc.stderr)
    assert any("early_count" in s for s in summaries), "\n".join(summaries) + "\n" + describe(proc)
    assert result is not None, describe(proc)
