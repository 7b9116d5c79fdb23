"""The performance model's host terms (model.py): measured by a short probe on first use,
cached per host, agreed by every rank of a communicator.

    calibration = host_calibration()          # this process: the cache, else the probe
    calibration = agreed_calibration(world)   # collective: rank 0's, on every rank

What the probe measures (at most PROBE_DEADLINE_S, about 0.2 s here), on the CPU engine
with one block, as the collectives' kernels run:

- launch_s: one launch of the empty kernel (``commref_empty``: the ctypes call and the
  engine), the fastest of five batches;
- py_unit_s: a fixed piece of Python (PY_UNIT: calls, attribute and dict lookups, what a
  collective's Python side is made of), so the model scales the Python side of a call
  measured on the reference host (model.CALL_PY_UNITS) to this one; the fastest of five
  batches, and that batch's share of its core (cpu_share: this thread's CPU time over the
  wall time). A probe below CONTENDED_SHARE shared its core with other work, so its terms
  describe that load: the process uses them, but they are not cached, and the next
  process probes again;
- cached_Bps and dram_Bps: loads plus stores per second of the stream kernel's copy
  (``commref_stream``, bench/bound.py) over a footprint that stays in the cache
  (CACHED_FOOTPRINT) and one beyond the last-level cache (DRAM_FOOTPRINT), the fastest
  of five batches (a batch another process slowed down is not what memory allows); the rate of
  memory one core reaches, what the ring's FIFO copies and the direct kernels' loads run at;
- llc_bytes: the footprint from which one core's copy runs at less than half the
  in-cache rate (effective_llc: the first of 512 KiB, 1, 2, 4 MiB, ... up to the
  last-level cache sysfs names), measured before dram_Bps, whose footprint is at least
  twice it. A virtual machine may be shown a large shared cache it gets little of: on
  one 2-vCPU host sysfs named 480 MiB while the copy ran at 75-88 GB/s up to 1 MiB and
  24-27 GB/s from 4 MiB to 64 MiB;
- cores: the CPUs of this host.

The terms no probe of one process can reach (a hop between two cores, the GIN engine's
per-operation cost and copy rate, a switch between ranks that share a core) are the
reference host's (REFERENCE), the GIN rate scaled by this host's copy rate.

Cache: ``$COMMREF_CACHE_DIR/model/<host>-<key>.json``, the key a hash of commref's version
and of the sources the terms describe (this module, model.py, the CPU engine), so a new
build or another host probes again. COMMREF_MODEL=reference takes REFERENCE without a
probe (tests, and runs that must plan alike on every host); COMMREF_MODEL=probe (the
default) the cache or the probe; COMMREF_MODEL=FILE.json the terms of that file. Ranks
must plan alike, so a communicator takes rank 0's calibration (agreed_calibration),
whatever each host measured.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODEL_ENV = "COMMREF_MODEL"  # probe (default) or reference
MODEL_SOURCES = ("probe", "reference")
PROBE_DEADLINE_S = 0.5  # the probe stops measuring here and keeps REFERENCE's terms it has not reached
LOCK_DEADLINE_S = 10.0  # another process probing this host: wait this long for its result
CACHED_FOOTPRINT = 256 * 1024  # bytes of the in-cache copy (two arrays)
DRAM_FOOTPRINT = 64 * 1024 * 1024  # bytes of the beyond-the-cache copy, at least 2 x effective_llc
DEFAULT_LLC_BYTES = 32 * 1024 * 1024
# A probe whose fastest Python batch ran with less of its core than this (thread CPU time
# over wall time) shared the core with other work: its terms describe that load, not the
# host, so this process uses them but no cache keeps them.
CONTENDED_SHARE = 0.9


@dataclass(frozen=True)
class Calibration:
    """The host terms of the model (seconds, bytes per second). `source`: "probe",
    "cache", "reference" or "planted" (tests)."""

    launch_s: float  # one CPU-engine launch of an empty kernel
    py_unit_s: float  # one PY_UNIT of Python
    cached_Bps: float  # one core's loads + stores per second, footprint in cache
    dram_Bps: float  # the same beyond the last-level cache
    hop_s: float  # a flag written on one core seen by a rank spinning on another
    switch_s: float  # a hop to a rank that shares its core with another (the scheduler's turn)
    gin_op_s: float  # a GIN put or signal: kernel -> engine -> peer's memory
    gin_Bps: float  # bytes per second the GIN engine moves (network shm)
    wire_op_s: float  # the wire model's extra cost per operation (its clock and queue)
    channel_s: float  # one more channel's start (a worker's wake, its flags)
    link_Bps: float = 0.0  # LSA peers' bytes cross a link at this rate (0: their memory is this memory)
    overlap: bool = False  # transfers overlap the memory work (a GPU's copy engines and links)
    llc_bytes: int = DEFAULT_LLC_BYTES
    cores: int = 2
    cpu_share: float = 1.0  # probe: the share of its core its Python ran with (below CONTENDED_SHARE: not cached)
    host: str = ""
    key: str = ""
    source: str = "reference"

    def replace(self, **kw) -> Calibration:
        return dataclasses.replace(self, **kw)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Calibration:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# The development host (2 vCPUs, docs/performance.md, "The performance model"): the probe's
# terms as it measured them on 2026-12-02, the others fitted there to `commref bench
# all_reduce -b 8 -e 16M -f 4` at --np 2 and 4, LSA and GIN.
REFERENCE = Calibration(
    launch_s=0.59e-6,
    py_unit_s=0.36e-6,
    cached_Bps=160e9,
    dram_Bps=55e9,
    hop_s=0.15e-6,
    switch_s=2.3e-6,
    gin_op_s=0.4e-6,
    gin_Bps=40e9,
    wire_op_s=1.7e-6,
    channel_s=60e-6,
    llc_bytes=DEFAULT_LLC_BYTES,
    cores=2,
)


# A GPU: no probe runs there yet, so the model assumes an H100-class device (HBM at 3 TB/s,
# a flag over NVLink seen in 1 us, a block's start 2 us) until one is measured; with it
# the tuner's GPU choices are the model's shape, not measurements.
GPU = REFERENCE.replace(
    launch_s=4e-6,
    cached_Bps=3e12,
    dram_Bps=3e12,
    hop_s=1e-6,
    switch_s=0.0,
    gin_op_s=5e-6,
    gin_Bps=25e9,
    wire_op_s=0.0,
    channel_s=2e-6,
    llc_bytes=50 * 1024 * 1024,
    cores=1,
    source="assumed",
    link_Bps=450e9,
    overlap=True,
)


def model_source() -> str:
    """COMMREF_MODEL, validated: probe (unset or empty), reference, or the path of a
    calibration's JSON file (a cache file, or one written by hand: its terms are taken
    as they are, for experiments and tests)."""
    raw = os.environ.get(MODEL_ENV, "").strip()
    value = raw.lower() or "probe"
    if value in MODEL_SOURCES:
        return value
    if raw.endswith(".json") and os.path.isfile(raw):
        return raw
    raise ValueError(
        f"{MODEL_ENV} must be one of {', '.join(MODEL_SOURCES)} or a calibration's .json file, not {raw!r}"
    )


def source_key() -> str:
    """commref's version and the sources the terms describe, hashed."""
    from commref.device_kernels import build

    try:
        from importlib.metadata import version

        v = version("commref")
    except Exception:  # noqa: BLE001 - not installed: the sources alone
        v = "0+unknown"
    h = hashlib.sha256(v.encode())
    here = Path(__file__).resolve().parent
    engine = build.ENGINE_SOURCE
    for path in (here / "calibration.py", here / "model.py", engine):
        h.update(path.name.encode())
        h.update(path.read_bytes() if path.exists() else b"")
    return h.hexdigest()[:16]


def cache_path(host: str, key: str) -> Path:
    from commref.device_kernels.build import cache_dir

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in host) or "host"
    return cache_dir() / "model" / f"{safe}-{key}.json"


def llc_bytes() -> int:
    """The largest cache of CPU 0 (sysfs), else DEFAULT_LLC_BYTES."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KM")) * scale)
        except (OSError, ValueError):
            continue
    return best or DEFAULT_LLC_BYTES


def effective_llc(rate_at, cached_Bps: float | None, named_llc: int, deadline: float) -> int:
    """The first footprint (bytes, doubling from 2 x CACHED_FOOTPRINT up to `named_llc`)
    at which `rate_at(footprint)` (loads + stores per second, None past the deadline) is
    below half of `cached_Bps`; `named_llc` when none is, or past the deadline."""
    if not cached_Bps:
        return named_llc
    footprint = 2 * CACHED_FOOTPRINT
    while footprint < named_llc and time.perf_counter() < deadline:
        rate = rate_at(footprint)
        if rate is None:
            break
        if rate < cached_Bps / 2:
            return footprint
        footprint *= 2
    return named_llc


def _py_unit() -> None:
    """PY_UNIT: what a collective call's Python side does, in miniature."""
    d, acc = {"a": 1, "b": 2, "c": 3}, 0
    for k in ("a", "b", "c", "a", "b", "c", "a", "b"):
        acc += d.get(k, 0) + len(k)
    return acc


def _fastest(fn, reps: int, batches: int, deadline: float) -> tuple[float, float] | None:
    """fn's time per call in the fastest of `batches` batches (`reps` calls each), and
    that batch's share of its core (this thread's CPU time over the wall time: below 1
    where something else ran on the core meanwhile; a kernel's worker thread's time is
    not this thread's); None when the deadline passed before the first batch ended."""
    best = None
    for _ in range(batches):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(reps):
            fn()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if best is None or wall < best[0]:
            best = (wall, cpu)
        if time.perf_counter() > deadline:
            break
    return None if best is None else (best[0] / reps, min(1.0, best[1] / best[0]) if best[0] > 0 else 1.0)


def probe(deadline_s: float = PROBE_DEADLINE_S) -> Calibration:
    """Measures this host's terms (see the module's doc), within `deadline_s`; the terms
    it has not reached by then are REFERENCE's."""
    from commref.device_kernels import abi, cpu_loader

    deadline = time.perf_counter() + deadline_s
    kernels = cpu_loader.cpu_kernels()
    terms: dict = {"llc_bytes": llc_bytes(), "cores": os.cpu_count() or 1}
    py = _fastest(_py_unit, 2000, 5, deadline)
    if py is not None:
        terms["py_unit_s"], terms["cpu_share"] = py
    empty = np.zeros(1, dtype=abi.COPY_ARGS)
    address, entry = empty.ctypes.data, kernels.launch

    def launch_empty():
        entry("commref_empty", 1, 1, empty, address=address)

    launch = _fastest(launch_empty, 500, 5, deadline)
    terms["launch_s"] = launch and launch[0]

    def copy_rate(footprint: int, passes: int) -> float | None:
        """Loads + stores per second of the stream kernel's copy over `footprint` bytes."""
        words = footprint // 8 // 16 * 16  # two arrays of 4-byte words, whole lines
        buf = np.full(2 * words + 16, 0x3F3F3F3F, dtype=np.uint32)
        off = (-buf.ctypes.data % 64) // 4
        args = np.zeros(1, dtype=abi.STREAM_ARGS)
        args[0]["base"], args[0]["words"] = buf.ctypes.data + 4 * off, words
        args[0]["nin"], args[0]["nout"], args[0]["shared"] = 1, 1, 0
        a_address = args.ctypes.data

        def copy():
            entry("commref_stream", 1, 1, args, address=a_address)

        copy()  # first touch
        seconds = _fastest(copy, passes, 5, deadline)  # the fastest batch: what memory allows
        return 2 * words * 4 / seconds[0] if seconds else None

    if time.perf_counter() < deadline:
        terms["cached_Bps"] = copy_rate(CACHED_FOOTPRINT, 100)
    terms["llc_bytes"] = effective_llc(
        lambda f: copy_rate(f, max(3, 100 * CACHED_FOOTPRINT // f)),
        terms.get("cached_Bps"),
        terms["llc_bytes"],
        deadline,
    )
    if time.perf_counter() < deadline:
        terms["dram_Bps"] = copy_rate(max(DRAM_FOOTPRINT, 2 * terms["llc_bytes"]), 3)
    measured = {k: v for k, v in terms.items() if v}
    cal = REFERENCE.replace(**measured, source="probe")
    # The GIN engine copies what it moves: its rate follows this host's copy rate.
    return cal.replace(gin_Bps=REFERENCE.gin_Bps * cal.cached_Bps / REFERENCE.cached_Bps)


_memo: dict[tuple, Calibration] = {}


def host_calibration() -> Calibration:
    """This host's calibration: REFERENCE under COMMREF_MODEL=reference, else the cached
    one, else the probe's (cached for next time; one process probes a host at a time,
    the others wait up to LOCK_DEADLINE_S for its result, then probe themselves)."""
    source = model_source()
    if source == "reference":
        return REFERENCE
    if source != "probe":
        cal = _read(Path(source))
        if cal is None:
            raise ValueError(f"{MODEL_ENV}={source}: not a calibration's JSON (calibration.Calibration's fields)")
        return cal.replace(source="file")
    host, key = socket.gethostname(), source_key()
    memo = _memo.get((host, key))
    if memo is not None:
        return memo
    path = cache_path(host, key)
    cal = _read(path)
    if cal is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            end = time.monotonic() + LOCK_DEADLINE_S
            locked = False
            while not locked and time.monotonic() < end:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                except BlockingIOError:
                    time.sleep(0.01)
            cal = _read(path)
            if cal is None:
                cal = probe().replace(host=host, key=key)
                if cal.cpu_share >= CONTENDED_SHARE:
                    _write(path, cal)
    _memo[(host, key)] = cal
    return cal


def _read(path: Path) -> Calibration | None:
    try:
        return Calibration.from_json(json.loads(path.read_text())).replace(source="cache")
    except (OSError, ValueError, TypeError, AttributeError):  # missing, not JSON, not a record of the fields
        return None


def _write(path: Path, cal: Calibration) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cal.to_json(), indent=1) + "\n")
    os.replace(tmp, path)


def agreed_calibration(world) -> Calibration:
    """Collective: rank 0's host_calibration on every rank of `world` (ranks must plan
    alike). Only rank 0 reads the cache or probes."""
    mine = host_calibration() if world.rank == 0 else None
    return world.bcast(mine, root=0, what="performance model: calibration")
