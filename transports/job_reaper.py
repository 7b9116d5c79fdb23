"""Finding and ending every process of one job, and the shared memory it left; and the
reaper, a small process that does this when the launcher itself is killed.

A job's processes are found by a marker in their environment (/proc/PID/environ): the
launcher (transports/launcher.py) puts ``COMMREF_JOB_DIR=<the job's own directory>`` in
mpiexec's environment, and mpiexec, its proxies, the ranks and what the ranks start all
inherit it. Names are not used: other engineers' jobs of the same programs run on the
host at the same time. A process manager may put its proxies and ranks in sessions of
their own (MPICH's hydra does: setsid), so a process group does not hold the job either.

`end_processes` stops (SIGSTOP) every marked process, so that a proxy cannot start
more ranks meanwhile, reads which /dev/shm files they map or hold open (and hydra's
topology files they hold), then kills them (SIGKILL), and scans again until none is left.

The reaper is this file run as a script (``python -I -S job_reaper.py``: the standard
library only, so it starts in milliseconds), in a session of its own, before the job
starts. It reads one JSON line from its stdin (marker, job directory, the /dev/shm
snapshot taken before the job, the segment patterns) and then waits for end of file.
The launcher holds the pipe's write end and writes ``done`` before closing it when it
has cleaned up itself. End of file without ``done`` means the launcher died (SIGKILL,
the OOM killer): the reaper ends the job's processes, removes the job's segments (those
its processes mapped and the new ones no process maps, `remove_orphans`) and the job's
directory, and says so in one line on stderr.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import sys
import time

SHM_DIR = "/dev/shm"
# MPICH's hydra proxy writes its node's topology for its ranks to a file of this name
# (hard-coded, not under TMPDIR), held open while it runs and removed when it exits: a
# proxy that is killed leaves it. Patterns of the segments' kind are names in SHM_DIR,
# or absolute like this one.
HYDRA_TOPOLOGY = "/tmp/hydra_hwloc_xmlfile_*"
_HELD_PREFIXES = (SHM_DIR + "/", HYDRA_TOPOLOGY.removesuffix("*"))


def shm_segments(patterns: tuple[str, ...]) -> set[str]:
    """The files in /dev/shm whose names match any of `patterns` (an absolute pattern:
    the files it matches)."""
    return {p for pattern in patterns for p in glob.glob(os.path.join(SHM_DIR, pattern))}


def mapped_files(pids=None) -> set[str]:
    """The /dev/shm files that the processes `pids` (default: every process this user
    can read) map."""
    mapped = set()
    paths = glob.glob("/proc/[0-9]*/maps") if pids is None else [f"/proc/{p}/maps" for p in pids]
    for maps in paths:
        try:
            with open(maps) as f:
                for line in f:
                    if SHM_DIR + "/" in line:
                        path = line.split(None, 5)[5].strip()
                        mapped.add(path.removesuffix(" (deleted)"))
        except (OSError, IndexError):
            pass
    return mapped


def held_files(pids=None) -> set[str]:
    """The /dev/shm files that the processes `pids` (default: every process this user can
    read) map, and those and hydra's topology files (HYDRA_TOPOLOGY) they hold open."""
    held = mapped_files(pids)
    fds = glob.glob("/proc/[0-9]*/fd/*") if pids is None else [f for p in pids for f in glob.glob(f"/proc/{p}/fd/*")]
    for fd in fds:
        try:
            path = os.readlink(fd)
        except OSError:  # closed meanwhile, or another user's
            continue
        if path.startswith(_HELD_PREFIXES):
            held.add(path.removesuffix(" (deleted)"))
    return held


def remove_orphans(
    before: set[str], patterns: tuple[str, ...], settle_s: float = 3.0, poll_s: float = 0.2
) -> list[str]:
    """Removes the segments matching `patterns` that are not in `before` (a shm_segments()
    snapshot taken when the job started) and that no live process maps or holds open
    (held_files) in two scans `poll_s` apart. Segments still held are waited for (their
    processes may be exiting) up to `settle_s`, then left alone. Returns the paths removed."""
    removed: list[str] = []
    candidates = shm_segments(patterns) - before
    unmapped_before: set[str] = set()
    deadline = time.monotonic() + settle_s
    scans = 0
    while candidates:
        scans += 1
        unmapped = candidates - held_files()
        for path in sorted(unmapped & unmapped_before):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
            except OSError:  # not ours to remove (another user's): leave it
                candidates.discard(path)
        candidates &= shm_segments(patterns)
        unmapped_before = unmapped
        if not candidates or (scans >= 2 and time.monotonic() >= deadline):
            break
        time.sleep(poll_s)
    return removed


def job_processes(marker: str) -> list[int]:
    """Live processes (not zombies) whose environment holds `marker` ("NAME=VALUE"
    exactly), this one excepted."""
    needle = b"\0" + marker.encode() + b"\0"
    me, out = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in b"\0" + f.read() + b"\0":  # a zombie's environ reads empty
                    out.append(int(name))
        except OSError:  # gone, or another user's
            pass
    return out


def end_processes(marker: str, timeout_s: float = 3.0) -> tuple[list[int], set[str]]:
    """Stops then kills every process of the job (`marker`), scanning again until none is
    left or `timeout_s` has passed. Returns (the pids killed, the files they held when
    stopped: held_files)."""
    killed: list[int] = []
    segments: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        pids = job_processes(marker)
        if not pids or time.monotonic() > deadline:
            return killed, segments
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            if sig == signal.SIGSTOP:
                segments |= held_files(pids)
        killed.extend(p for p in pids if p not in killed)
        time.sleep(0.02)  # the killed processes become zombies, which job_processes skips


def remove_job_segments(segments: set[str], before: set[str], patterns: tuple[str, ...]) -> list[str]:
    """Unlinks `segments` (files the job's processes mapped) that match `patterns` and are
    not in `before` (the snapshot taken when the job started). Returns those removed."""
    removed = []
    names = {p for p in shm_segments(patterns)}
    for path in sorted((segments & names) - before):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only end of file on stdin ends the reaper
    line = sys.stdin.buffer.readline()
    if not line.endswith(b"\n"):  # the launcher died before it told the job: it started none
        return 0
    config = json.loads(line)
    rest = sys.stdin.buffer.read()  # until the launcher closes its end
    if rest.startswith(b"done"):
        return 0
    marker, job_dir = config["marker"], config["job_dir"]
    before, patterns = set(config["before"]), tuple(config["patterns"])
    killed, segments = end_processes(marker)
    removed = remove_job_segments(segments, before, patterns)
    removed += remove_orphans(before, patterns, settle_s=0.5)
    for d in (job_dir, job_dir + ".closed"):
        shutil.rmtree(d, ignore_errors=True)
    print(
        f"commref: the launcher (pid {config['launcher']}) is gone; its job's reaper killed {len(killed)} "
        f"process(es) and removed {len(removed)} shared-memory segment(s)",
        file=sys.stderr,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
