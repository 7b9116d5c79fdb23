"""Standalone baselines: `commref bench ... --baseline mpich,openmpi,gloo`, each peer
timed as a job of its own, in processes where commref is not loaded.

    commref bench all_reduce -b 8 -e 16M -f 2097152 --np 2 --baseline mpi,mpich,openmpi,gloo

The launching process (commref.cli, outside any MPI job) runs rounds: -N of them (3
where -N is left out), each commref's job (the sweep with the in-process baseline, if
any, -N 1, its table printed as it runs) and then every available peer's job with the
same number of ranks, one after the other, so that a neighbour's load or the vCPUs'
placement changing hits all of them alike. A peer's job is bench/standalone.py (numpy,
mpi4py and, for gloo, torch; no commref) under the peer's own launcher:

    mpich    this environment's mpiexec and mpi4py (launcher.find_mpiexec)
    openmpi  $COMMREF_OPENMPI_PYTHON, a Python whose mpi4py runs on Open MPI, with the
             mpirun beside it (--oversubscribe, polling where the ranks fit the CPUs;
             --allow-run-as-root as root)
    gloo     torch.distributed's gloo over loopback TCP under this environment's
             mpiexec, MPI only passing the rendezvous port

It times the same collective, sizes (plugins.Counts), dtype, op, root, -n, -w and -m as
commref's series; every rank's times come back, and the row is made as commref's (-a's
combination of the ranks, the median over iterations: measure._result). After the last
round one table gives, per size and series, the medians over the rounds of commref's
out-of-place time and of each peer's, with commref's busbw over each peer's and over
the best (fastest) peer's. A peer that cannot run here is one line (`# Baseline NAME:
not measured (why)`) and '-' in its columns; a job that fails or passes its deadline
(-T's wait deadline plus 10 times what commref's job of the round took) is one line
naming the peer, the round and what failed, and the rounds go on without it.

Every job runs under transports/launcher.run_job: in a session of its own, ended with
the launcher (SIGINT, SIGTERM, SIGHUP; SIGKILL through its reaper), so an interrupted
bench leaves no process behind.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from commref.collectives.verify import DTYPES
from commref.transports import launcher
from commref.transports.deadlines import default_timeout

from . import plugins
from .arguments import NCCL_TYPE_NAMES, run_cycles, sweep_sizes
from .baselines import _short_mpi_name, split_baselines
from .measure import _result

STANDALONE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standalone.py")
OPENMPI_PYTHON_ENV = "COMMREF_OPENMPI_PYTHON"
# Set in commref's job of a round: the file its rank 0 writes the results document to
# (instead of --json, -J and --plot, which the launcher writes for the whole run).
ROUND_ENV = "COMMREF_BENCH_ROUND"
# A peer's job may take its wait deadline plus this many times what commref's job took.
DEADLINE_FACTOR = 10
INTERRUPTED = (129, 130, 143)  # run_job's statuses after SIGHUP, SIGINT, SIGTERM


@dataclasses.dataclass
class Peer:
    """One standalone peer: `kind` is standalone.py's ("mpi" or "gloo"); `argv(n)` the
    command line of its job on n ranks before the spec and output files; `why_not`
    why it cannot run here (None: it can)."""

    name: str
    kind: str
    launch: list[str]
    python: str
    why_not: str | None = None
    label: str = ""
    library: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)

    def argv(self, nranks: int, spec: str, out: str) -> list[str]:
        launch = list(self.launch)
        if self.name == "openmpi" and nranks <= len(os.sched_getaffinity(0)):
            # --oversubscribe only lifts mpirun's slot count (cores, not hyperthreads), but it
            # also makes Open MPI yield the CPU in every poll: ranks that fit poll, as without it.
            launch += ["--mca", "mpi_yield_when_idle", "0"]
        return [*launch, "-n", str(nranks), self.python, "-I", "-m", "mpi4py", STANDALONE, spec, out]


def _has(python: str, module: str) -> bool:
    """Whether `module` is importable in this interpreter (`python` is this one)."""
    return python == sys.executable and importlib.util.find_spec(module) is not None


def find_peer(name: str, environ=None) -> Peer:
    """The peer `name` (baselines.PEERS) as this host can run it; why_not says why not."""
    env = os.environ if environ is None else environ
    if name == "openmpi":
        python = env.get(OPENMPI_PYTHON_ENV, "")
        peer = Peer(name, "mpi", [], python, label="Open MPI")
        mpirun = os.path.join(os.path.dirname(python), "mpirun")
        if not python:
            peer.why_not = (
                f"${OPENMPI_PYTHON_ENV} is not set (a Python whose mpi4py runs on Open MPI, its mpirun "
                "beside it: docs/performance.md, 'Standalone baselines')"
            )
        elif not os.access(python, os.X_OK):
            peer.why_not = f"${OPENMPI_PYTHON_ENV}={python} is not an executable"
        elif not os.access(mpirun, os.X_OK):
            peer.why_not = f"no mpirun beside ${OPENMPI_PYTHON_ENV} ({mpirun})"
        else:
            peer.launch = [mpirun, *(["--allow-run-as-root"] if os.geteuid() == 0 else []), "--oversubscribe"]
        return peer
    peer = Peer(name, "gloo" if name == "gloo" else "mpi", [], sys.executable, label=name)
    peer.label = "gloo" if name == "gloo" else "MPICH"
    try:
        peer.launch = [launcher.find_mpiexec()]
    except launcher.LaunchError as e:
        peer.why_not = str(e)
        return peer
    if not _has(sys.executable, "mpi4py"):
        peer.why_not = "mpi4py is not installed here (pip install 'commref[mpich]')"
    elif name == "gloo" and not _has(sys.executable, "torch"):
        peer.why_not = "torch is not installed here (pip install 'commref[torch]')"
    return peer


def spec_of(args, peer: Peer, nranks: int) -> dict:
    """standalone.py's SPEC for `args`' sweep on `nranks` ranks."""
    plugin = plugins.get(args.collective)
    itemsize = DTYPES[args.datatype].itemsize
    sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    counts = [plugin.counts(size, itemsize, nranks) for size in sizes]
    return {
        "peer": peer.kind,
        "coll": plugin.coll,
        "dtype": args.datatype,
        "op": args.op if plugin.reducing else None,
        "root": args.root,
        "iters": args.iters,
        "warmup": args.warmup_iters,
        "agg": getattr(args, "agg_iters", 1),
        "timeout": wait_deadline(args),
        "sizes": [[c.send, c.recv, c.param] for c in counts],
    }


def wait_deadline(args) -> float:
    return getattr(args, "timeout", 0) or default_timeout()


def peer_rows(args, out: dict, nranks: int) -> list[dict]:
    """One row per size of a peer's OUT document: size, count, time_us, algbw, busbw."""
    plugin = plugins.get(args.collective)
    itemsize = DTYPES[args.datatype].itemsize
    rows = []
    for s in out["sizes"]:
        c = plugins.Counts(*s["counts"])
        nbytes = plugin.algbw_bytes(c, itemsize, nranks)
        r = _result(s["times"], nbytes, plugin.bus_factor(nranks), average=getattr(args, "average", 1))
        rows.append({"size": c.size_bytes(itemsize), "count": c.param, **r})
    return rows


def run_peer(peer: Peer, args, nranks: int, workdir: str, deadline: float, say: Callable[[str], None]):
    """One job of `peer`; its rows, or None after saying why (peer.failures)."""
    spec, out = os.path.join(workdir, f"{peer.name}.spec.json"), os.path.join(workdir, f"{peer.name}.out.json")
    with open(spec, "w") as f:
        json.dump(spec_of(args, peer, nranks), f)
    if os.path.exists(out):
        os.remove(out)
    errors = os.path.join(workdir, f"{peer.name}.stderr")
    with open(errors, "wb") as err:
        rc = launcher.run_job(peer.argv(nranks, spec, out), timeout=deadline, stderr=err)
    if rc in INTERRUPTED:
        raise KeyboardInterrupt
    why = None
    if rc == 124:
        why = f"its job did not finish within {deadline:g} s"
    elif rc != 0:
        with open(errors, errors="replace") as f:
            tail = [line.strip() for line in f.read().splitlines() if line.strip()][-2:]
        why = f"its job exited with status {rc}" + (f": {' / '.join(tail)}" if tail else "")
    elif not os.path.exists(out):
        why = "its job wrote no results"
    if why is None:
        with open(out) as f:
            doc = json.load(f)
        if doc.get("commref_loaded"):
            why = "commref was loaded in its processes"
        elif doc.get("unavailable"):
            peer.why_not = doc["unavailable"]
            say(f"# Baseline {peer.name}: not measured ({peer.why_not})")
            return None
        else:
            peer.library = doc["library"]
            peer.label = _label(peer, doc["library"])
            expected = {"mpich": "MPICH", "openmpi": "Open MPI"}.get(peer.name)
            if expected and expected not in peer.library:
                peer.notes.append(f"its job ran on {peer.label}, not {expected}")
            peer.notes = sorted(set(peer.notes) | set(doc.get("notes", ())))
            return peer_rows(args, doc, nranks)
    peer.failures.append(why)
    say(f"# Baseline {peer.name}: failed: {why}")
    return None


def _label(peer: Peer, library: str) -> str:
    if peer.kind == "gloo":
        return library.replace(" gloo", "").replace("torch ", "gloo (torch ").split("+")[0] + ")"
    return _short_mpi_name(library)


def median_rows(rounds: list[list[dict]], nbytes_factor: dict) -> dict:
    """(series or peer, size) -> time_us, algbw, busbw of the median time over the rounds,
    and every round's time_us; `nbytes_factor`: size -> (algbw bytes, bus factor)."""
    times: dict = {}
    for rows in rounds:
        for r in rows:
            times.setdefault(r["size"], []).append(r["time_us"])
    out = {}
    for size, ts in times.items():
        t = float(np.median(ts))
        nbytes, factor = nbytes_factor[size]
        algbw = nbytes / (t * 1e-6) / 1e9 if t > 0 else 0.0
        out[size] = {"time_us": t, "algbw": algbw, "busbw": algbw * factor, "rounds_us": ts}
    return out


def summary(args, nranks: int, docs: list[dict], peers: list[Peer], peer_rounds: dict) -> list[dict]:
    """The rows of the closing table: per series of commref's job and size, the medians
    over the rounds (commref's out of place, the in-process baseline's, each peer's) and
    commref's busbw over each peer's and over the best peer's."""
    plugin = plugins.get(args.collective)
    itemsize = DTYPES[args.datatype].itemsize
    nbytes_factor = {}
    for size in sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes):
        c = plugin.counts(size, itemsize, nranks)
        nbytes_factor[c.size_bytes(itemsize)] = (plugin.algbw_bytes(c, itemsize, nranks), plugin.bus_factor(nranks))
    jobs = [s["label"] for s in docs[0]["series"] if s.get("team", "job") == "job"] if docs else []
    peer_medians = {p.name: median_rows(peer_rounds.get(p.name, []), nbytes_factor) for p in peers}
    baseline = [
        [r["baseline"] | {"size": r["size"]} for r in d["rows"] if r["series"] == jobs[0] and r.get("baseline")]
        for d in docs
    ]
    inprocess = median_rows([b for b in baseline if b], nbytes_factor) if jobs else {}
    out = []
    for label in jobs:
        ours = median_rows(
            [[r["out_of_place"] | {"size": r["size"]} for r in d["rows"] if r["series"] == label] for d in docs],
            nbytes_factor,
        )
        for size, mine in ours.items():
            row = {"series": label, "size": size, "count": None, "commref": mine, "inprocess": inprocess.get(size)}
            row["count"] = next(r["count"] for r in docs[0]["rows"] if r["series"] == label and r["size"] == size)
            row["peers"] = {name: m.get(size) for name, m in peer_medians.items()}
            row["ratio"] = {
                name: (mine["busbw"] / m["busbw"] if m and m["busbw"] > 0 else None) for name, m in row["peers"].items()
            }
            measured = {n: m for n, m in row["peers"].items() if m}
            best = min(measured, key=lambda n: measured[n]["time_us"]) if measured else None
            row["best_peer"], row["ratio_best"] = best, row["ratio"][best] if best else None
            out.append(row)
    return out


def _num(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _time(us) -> str:
    if us is None:
        return "-"
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


def table(args, rows: list[dict], peers: list[Peer], inprocess_label: str | None) -> list[str]:
    """The closing table's lines: a group line, the column heads, a row per size and series."""
    short = inprocess_label and inprocess_label.removeprefix("MPI (").removesuffix(")")
    groups = [("commref", 2)] + ([(short + " in-process", 3)] if short else [])
    groups += [(p.label if not p.why_not else p.name, 3) for p in peers] + [("best peer", 2)]

    def heads(row: tuple[str, str, str, str], time: str, busbw: str, ratio: str, peer: str) -> str:
        """One line of column heads: the row's four, then each group's."""
        size, count, dtype, redop = row
        return f"#{size:>11}  {count:>12}  {dtype:>6}  {redop:>5}" + "".join(
            (f"  {time:>8}  {busbw:>6}" + (f"  {ratio:>5}" if n == 3 else ""))
            if g != "best peer"
            else f"  {peer:>8}  {ratio:>6}"
            for g, n in groups
        )

    lines = [
        "#" + f"{'':>41}" + "".join(f"  {g[: 23 if n == 3 else 15]:^{25 if n == 3 else 16}}" for g, n in groups),
        heads(("size", "count", "type", "redop"), "time", "busbw", "ratio", "peer") + "  series",
        heads(("(B)", "(elements)", "", ""), "(us)", "(GB/s)", "(x)", ""),
    ]
    for r in rows:
        mine, cells = r["commref"], []
        cells.append(f"  {_time(mine['time_us']):>8}  {mine['busbw']:6.2f}")
        if inprocess_label:
            b = r["inprocess"]
            ratio = mine["busbw"] / b["busbw"] if b and b["busbw"] > 0 else None
            cells.append(f"  {_time(b and b['time_us']):>8}  {_num(b and b['busbw']):>6}  {_num(ratio):>5}")
        for p in peers:
            m = r["peers"][p.name]
            ratio = r["ratio"][p.name]
            cells.append(f"  {_time(m and m['time_us']):>8}  {_num(m and m['busbw']):>6}  {_num(ratio):>5}")
        cells.append(f"  {r['best_peer'] or '-':>8}  {_num(r['ratio_best']):>6}")
        redop = args.op if plugins.get(args.collective).reducing else "none"
        lines.append(
            f" {r['size']:11d}  {r['count']:12d}  {NCCL_TYPE_NAMES[args.datatype]:>6}  {redop:>5}"
            + "".join(cells)
            + f"  {r['series']}"
        )
    return lines


def run_rounds(args, argv: list[str], nranks: int, env: dict | None = None) -> int:
    """`commref bench ARGV` with standalone peers (validated `args`), from the launching
    process: the rounds, then the closing table, and --json, -J and --plot for the whole
    run. Returns the status: commref's job's where it failed (1: wrong elements), 128 + N
    after signal N, else 0."""
    from .output import write_outputs

    def say(line: str) -> None:
        print(line, flush=True)

    inprocess, names = split_baselines(args.baseline)
    peers = [find_peer(n) for n in names]
    rounds = run_cycles(args)
    for p in peers:
        if p.why_not:
            say(f"# Baseline {p.name}: not measured ({p.why_not})")
    runnable = [p for p in peers if not p.why_not]
    say(
        f"# Standalone baselines: {rounds} rounds, each commref's job then "
        + (", ".join(f"{p.name}'s" for p in runnable) or "no peer's")
        + f" job of {nranks} ranks (bench/standalone.py: no commref in its processes)"
    )
    workdir = tempfile.mkdtemp(prefix="commref-bench-rounds-")
    docs: list[dict] = []
    peer_rounds: dict[str, list[list[dict]]] = {}
    t_start = time.perf_counter()
    status = 0
    try:
        for k in range(1, rounds + 1):
            say(f"# Round {k} of {rounds}: commref")
            doc_path = os.path.join(workdir, f"commref-{k}.json")
            round_argv = launcher.strip_np(argv) + ["--baseline", inprocess, "-N", "1"]
            t0 = time.perf_counter()
            rc = launcher.relaunch(nranks, round_argv, env=dict(env or {}, **{ROUND_ENV: doc_path}))
            took = time.perf_counter() - t0
            if rc in INTERRUPTED:
                return rc
            if rc != 0 or not os.path.exists(doc_path):
                say(f"# Round {k}: commref's job exited with status {rc}; no more rounds")
                status = rc or 1
                break
            with open(doc_path) as f:
                doc = json.load(f)
            for r in doc["rows"]:
                r["cycle"] = k
            docs.append(doc)
            for p in runnable:
                if p.why_not:  # found unavailable by its first job
                    continue
                say(f"# Round {k} of {rounds}: {p.name}")
                got = run_peer(p, args, nranks, workdir, wait_deadline(args) + DEADLINE_FACTOR * took, say)
                if got is not None:
                    peer_rounds.setdefault(p.name, []).append(got)
    except KeyboardInterrupt:
        say("# interrupted")
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not docs:
        return status or 1
    rows = summary(args, nranks, docs, peers, peer_rounds)
    inprocess_label = docs[-1]["baseline"]["label"] if docs[-1].get("baseline") else None
    say("#")
    say(
        f"# Medians over {len(docs)} rounds of each out-of-place time (each round's: the median over -n "
        f"{args.iters} iterations); ratio = commref's busbw / the peer's; best peer = the fastest measured"
    )
    for p in peers:
        if p.library:
            command = " ".join(p.argv(nranks, "SPEC", "OUT"))
            say(f"# Baseline {p.name}: {p.label}, its own {nranks}-rank job: {command}")
        for note in p.notes:
            say(f"# Baseline {p.name} note: {note}")
    for line in table(args, rows, peers, inprocess_label):
        say(line)
    merged = dict(docs[-1])
    merged["rows"] = [r for d in docs for r in d["rows"]]
    merged["params"] = dict(merged["params"], baseline=args.baseline, run_cycles=rounds)
    merged["elapsed_s"] = time.perf_counter() - t_start
    merged["standalone"] = {
        "rounds": len(docs),
        "peers": [
            {
                "name": p.name,
                "label": p.label,
                "library": p.library,
                "command": p.argv(nranks, "SPEC", "OUT") if p.launch else None,
                "unavailable": p.why_not,
                "failures": p.failures,
                "notes": p.notes,
            }
            for p in peers
        ],
        "rows": rows,
    }
    write_outputs(merged, args)
    wrong = [s["out_of_bounds"] for d in docs for s in d["summary"].values() if s["out_of_bounds"]]
    return status or (1 if wrong else 0)
