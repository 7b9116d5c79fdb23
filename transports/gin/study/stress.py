"""`commref study --stress`: the study's protocols on the real GIN proxy.

For every cell (protocol x transport model x signal strength) the same sender program
that the explorer searched (explorer.py) is posted, message after message, through
the runtime path: descriptors written into a rank's GIN queue the way the device's
Gin::post writes them (queue.QueueWriter: fields, then seq = slot + 1 with release; a
flush waits until the proxy has consumed it), drained by commref.transports.gin.proxy.GinProxy
-- the progress thread the communicator runs -- which lands them on the target's window
over the shm wire with the model's semantics.Transport, choosing among
semantics.enabled() with its seeded generator. Two ranks of a ThreadWorld: rank 0
posts, rank 1 is the receiver and polls its own window while the events land -- or,
under mpiexec with 2 ranks (`commref study --stress --np 2`), the same two ranks as two
processes of an MPIWorld, the window mapped across them through /dev/shm, so that the
receiver polls from another process (and core) than the proxy's. The wire is shm (the
sender's proxy writes the receiver's window) or, under MPI, network "mpi" (it sends MPI
messages to the receiver's own proxy, which lands them in its window); every
time the receiver's check (the protocol's receive(), the same function the explorer
evaluates) accepts, it reads the data it accepted and counts a corruption if any of it
is stale. One proxy per seed; `messages` messages per seed.

What a poll does, as a real receiver must: read what it observes first (the signal
word, with acquire; then the flags / headers / last byte in a copy of the window),
decide, and only then read the data it accepted (a second copy). Reading the data
before the observation would report corruptions no receiver could see.

Also checked per message: the receiver accepted once everything had landed and the
window then equals the message (nothing lost), and the order in which the proxy landed
the events is one that semantics.first_disallowed accepts for the explorer's plan of
the program (what runs is what was studied; on an ordered wire a put's whole data,
landed in one piece, stands for its segments in address order).

The two ranks share only the windows and the world's barriers (every wait bounded by
world.timeout): a few control words in the receiver's window (_Control) say which
message has landed and count the receiver's polls, for the pacing; at the end the
sender's per-cell counts (delivery orders) and the receiver's (polls, corruptions) are
gathered into every rank's cells. The harness sees the proxy only through its
observer hook (observer.Observer: each landing, each MPI message sent or received):
that is where it paces the proxy, logs the delivery order and counts messages.

Not stressed: counted-writes (the proxy keeps no placed-bytes counter to wait on).
On an ordered wire the sender's proxy runs with independent contexts
(GinOptions.independent_contexts; scheduler.py): each (peer, context) stays FIFO while
the scheduler, seeded by the stress's seed, holds one context back as the other
overtakes it, so the /2ctx counterexamples occur. Without it the proxy would land each
operation when it takes it, FIFO across contexts too (a legal refinement of
per-context FIFO under which they cannot). With faults (`faults`) each (peer, context)
also recovers from its losses on its own, which lets one context overtake another too.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import numpy as np

from commref.device_kernels import abi
from commref.transports.gin import semantics as sem
from commref.transports.gin.atomics import host_atomics
from commref.transports.gin.backends import BACKENDS
from commref.transports.gin.engine import EngineSite
from commref.transports.gin.observer import Observer
from commref.transports.gin.proxy import GinProxy
from commref.transports.gin.queue import QueueWriter, queue_bytes
from commref.transports.gin.semantics import Event, TargetMemory
from commref.transports.gin.study import explorer
from commref.transports.gin.study import signaling as pr
from commref.transports.mpi_world import MPIWorld
from commref.transports.thread_world import ThreadWorld
from commref.transports.windows import register_window

CAPACITY = 64  # descriptors in the queue; a message posts at most 9 ops
NSIGNALS = 8
PACE_S = 0.005  # longest wait after a landing for the receiver to poll
NOT_STRESSED = {"counted-writes": "the proxy keeps no placed-bytes counter"}
NETWORKS = ("shm", "mpi")
DEFAULT_NETWORK = "shm"  # run_stress's when not given (mpi: under mpiexec only)


@dataclass
class StressCell:
    protocol: str
    strength: str | None
    model: str
    verdict: str  # the explorer's
    messages: int = 0
    corrupted: int = 0  # messages during which the receiver read stale data at least once
    polls: int = 0
    wrong_polls: int = 0
    orders_checked: int = 0
    orders_disallowed: int = 0
    example: str | None = None
    skipped: str | None = None
    seconds: float = 0.0
    world: str = "thread"  # the kind of world it ran in: "thread" or "mpi"
    network: str = "shm"  # the proxy's wire

    SENDER = ("orders_checked", "orders_disallowed")
    RECEIVER = ("messages", "corrupted", "polls", "wrong_polls", "example", "seconds")

    def key(self) -> tuple:
        return (self.protocol, self.strength or "-", self.model)

    @property
    def agrees(self) -> bool:
        """Proven safe cells must show no corruption (and the proxy no order the model
        forbids); an unsafe cell agrees either way (its corruption may be rare)."""
        if self.skipped:
            return True
        return self.orders_disallowed == 0 and (self.verdict == "unsafe" or self.corrupted == 0)


def _layout(data_bytes: int) -> tuple[np.ndarray, int, int]:
    """The window: data, GIN queue, signals, counters, then the harness's control words
    (returned: layout, control offset, window bytes)."""
    lay = np.zeros((), dtype=abi.WINDOW_LAYOUT)
    off = (data_bytes + 4095) // 4096 * 4096
    lay["ginQueueOff"] = off
    off += queue_bytes(CAPACITY)
    lay["ginSignalsOff"] = off
    off += NSIGNALS * 8
    lay["ginCountersOff"] = off
    off += 64
    return lay, off, off + 64


class _Control:
    """Words in the receiver's (rank 1's) window, mapped in both ranks (the same memory
    in a ThreadWorld, /dev/shm under MPI): `landed` = serial of the last message the
    sender saw fully landed (written by the sender with release after the proxy landed
    it), `polls` = the receiver's poll count (read by the sender's pacing), `sent` =
    MPI messages the sender's proxy sent so far (network "mpi": the receiver's proxy has
    landed the message once it has received that many)."""

    def __init__(self, window, off: int, atomics):
        addr = int(window.peer_addresses[1]) + off
        self.words = np.ctypeslib.as_array((ctypes.c_uint64 * 3).from_address(addr))
        self._keep = window  # the mapping must outlive this view
        self.landed_addr = addr
        self._load, self._store = atomics.load_acquire_u64, atomics.store_release_u64

    def reset(self) -> None:
        self.words[:] = 0

    def landed(self) -> int:
        return int(self._load(self.landed_addr))

    def set_landed(self, serial: int) -> None:
        self._store(self.landed_addr, serial)

    def polls(self) -> int:
        return int(self.words[1])

    def polled(self) -> None:
        self.words[1] += 1  # only the receiver writes it

    def sent(self) -> int:
        return int(self.words[2])

    def count_sent(self) -> None:
        self.words[2] += 1  # only the sender's proxy writes it


def _post_message(q: QueueWriter, prog: pr.Program, peer: int, deadline: float, proxy) -> None:
    pending: list[int] = []
    for kind, x in prog.steps:
        if kind == "flush":
            pending.append(q.fill(abi.GIN_FLUSH, ctx=x))
            q.publish(pending)
            pending = []
            _wait(lambda: q.consumed() >= q.slot, deadline, proxy, "the proxy to consume a flush")
            continue
        p = prog.puts[x]
        flags = 0
        if p.signal is not None:
            flags = abi.GIN_HAS_SIGNAL | (abi.GIN_STRONG if p.signal.strong else 0)
            assert p.signal.target == ("index", 0) and p.signal.value == 1
        if p.nbytes:
            pending.append(q.fill(abi.GIN_PUT, flags, peer, p.ctx, p.offset, p.offset, p.nbytes))
        else:
            pending.append(q.fill(abi.GIN_SIGNAL, flags, peer, p.ctx))
    q.publish(pending)


def _wait(cond, deadline: float, proxy, what: str) -> None:
    while not cond():
        if proxy.error is not None:
            raise proxy.error
        if time.monotonic() > deadline:
            raise TimeoutError(f"study --stress: waited too long for {what}")
        time.sleep(20e-6)


class _SenderObserver(Observer):
    """The sender's proxy, seen by the harness. After each landing, a bounded wait
    until the receiver has polled twice: each state the proxy passes through is observed
    (on a real machine the receiver has its own core; in a ThreadWorld it shares the GIL
    with the proxy, under MPI maybe a core with another process). Which event lands next
    is still the proxy's choice. Also: the delivery order (`log`: (ctx, seq, segment,
    copy) per landing, unordered wires) and, network "mpi", the messages sent."""

    def __init__(self, ctl: _Control, log: list | None):
        self.ctl, self.log = ctl, log

    def landed(self, peer, ctx, seq, segment, copy) -> None:
        if self.log is not None:
            self.log.append((ctx, seq, segment, copy))
        ctl = self.ctl
        polls, until = ctl.polls(), time.monotonic() + PACE_S
        while ctl.polls() < polls + 2 and time.monotonic() < until:
            time.sleep(0)

    def sent(self, peer, kind, nbytes) -> None:
        self.ctl.count_sent()


class _ReceiverObserver(Observer):
    """The receiver's proxy (network "mpi"): counts the messages it has landed."""

    def __init__(self):
        self.count = 0

    def received(self, peer, kind, nbytes) -> None:
        self.count += 1


def _order(prog: pr.Program, log: list, by_ctx_seq: dict, base: dict[int, int]) -> list[Event]:
    """The observer's log of one message as events of the program's plan: (ctx, seq,
    segment, copy) per landing, seq counted from `base[ctx]`; segment None (the ordered
    wire's whole data in one piece) stands for every segment of the put in address order."""
    order = []
    for c, s, seg, cp in log:
        i = by_ctx_seq[(c, s - base[c])]
        if seg is None:
            order += [Event(i, k) for k in range(len(prog.plan.segs[i]))]
        else:
            order.append(Event(i, seg, cp))
    return order


def _describe(prog: pr.Program, read: pr.Read, stale) -> str:
    return f"{read.why}; stale " + ", ".join(f"[{o},{o + n})" for o, n in stale)


def _rank_main(world, cells, seeds: int, messages: int, bound, network: str = "shm", faults=None):
    shape = pr.Shape(*bound)
    data_bytes = max(pr.PROTOCOL_BY_NAME[c.protocol].program(shape, c.strength, False).window_bytes for c in cells)
    layout, ctl_off, nbytes = _layout(data_bytes)
    window = register_window(world, nbytes, "cpu")
    if any(int(a) == 0 for a in window.peer_addresses[:2]):
        window.close()
        raise RuntimeError("study --stress: ranks 0 and 1 must share a host (the shm wire maps the peer's window)")
    serial = 0
    comm = world.comm.Dup() if network == "mpi" else None  # the proxies' own (as the communicator's)
    atomics = host_atomics()
    # network "mpi": the receiver's proxies count what they landed across seeds, as ctl.sent() counts.
    receiver = _ReceiverObserver() if network == "mpi" and world.rank == 1 else None
    try:
        ctl = _Control(window, ctl_off, atomics)
        if world.rank == 1:
            ctl.reset()
        world.barrier(what="stress: control words reset")
        local = window.local
        sigs = local[int(layout["ginSignalsOff"]) : int(layout["ginSignalsOff"]) + NSIGNALS * 8].view(np.uint64)
        q = QueueWriter(local, layout, CAPACITY, atomics)
        for cell in cells:
            if cell.skipped:
                continue
            t0 = time.perf_counter()
            proto, model = pr.PROTOCOL_BY_NAME[cell.protocol], pr.MODEL_BY_NAME[cell.model]
            prog = proto.program(shape, cell.strength, model.split_ctx)
            w = prog.window_bytes
            per_ctx: dict[int, int] = {}
            for p in prog.puts:
                per_ctx[p.ctx] = per_ctx.get(p.ctx, 0) + 1
            by_ctx_seq = {(p.ctx, p.seq): i for i, p in enumerate(prog.puts)}
            for seed in range(seeds):
                proxy, log = None, []
                observer, sender_faults = receiver, None  # the receiver's proxy: its queue stays empty, it only lands
                if world.rank == 0:
                    local[:w] = np.frombuffer(prog.image, np.uint8)  # the sources, at the same offsets
                    q.reset()
                    observer = _SenderObserver(ctl, log)
                    sender_faults = faults
                if observer is not None:
                    site = EngineSite(world, window, layout, CAPACITY, BACKENDS["proxy"], model.transport, network)
                    proxy = GinProxy(
                        site,
                        seed,
                        prog.segment_bytes,
                        comm,
                        observer,
                        faults=sender_faults,
                        # the ordered wire's contexts as independent ordering domains (the sender's)
                        independent_contexts=world.rank == 0 and model.transport.ordered,
                    )
                    proxy.start()
                try:
                    for m in range(messages):
                        serial += 1  # the same on both ranks: every message ends in a barrier
                        if world.rank == 1:
                            local[:w] = pr.STALE
                            sigs[:] = 0
                        world.barrier(what="stress: receiver ready")
                        if world.rank == 0:
                            deadline = time.monotonic() + world.timeout
                            del log[:]
                            _post_message(q, prog, 1, deadline, proxy)

                            def landed(proxy=proxy):
                                return q.consumed() >= q.slot and not proxy.pending(1)

                            _wait(landed, deadline, proxy, "every event to land")
                            order = _order(prog, log, by_ctx_seq, {c: m * n for c, n in per_ctx.items()})
                            cell.orders_checked += 1
                            bad = sem.first_disallowed(model.transport, prog.plan, order, model.strong_always)
                            missing = {e for e in prog.plan.all_events(model.transport) if e.copy == 0} - set(order)
                            if bad is not None or missing:
                                cell.orders_disallowed += 1
                            ctl.set_landed(serial)
                        else:
                            _receive(
                                world,
                                proto,
                                prog,
                                cell,
                                local,
                                sigs,
                                ctl,
                                serial,
                                (lambda: receiver.count >= ctl.sent()) if receiver is not None else None,
                            )
                        world.barrier(what="stress: message checked")
                finally:
                    if proxy is not None:
                        proxy.stop()
            cell.seconds += time.perf_counter() - t0 if world.rank == 1 else 0.0
    finally:
        world.barrier(what="stress: done")
        window.close()
        if comm is not None:
            comm.Free()
    if world.kind != "thread":  # each process counted its half: gather both into every rank's cells
        halves = world.allgather(
            [[getattr(c, f) for f in (StressCell.SENDER if world.rank == 0 else StressCell.RECEIVER)] for c in cells],
            what="stress: per-cell counts",
        )
        for rank, fields in ((0, StressCell.SENDER), (1, StressCell.RECEIVER)):
            for c, values in zip(cells, halves[rank]):
                for f, v in zip(fields, values):
                    setattr(c, f, v)
    return cells


def _receive(world, proto, prog, cell, local, sigs, ctl: _Control, serial: int, arrived=None) -> None:
    """Polls until the sender reports message `serial` landed (network "mpi": and
    `arrived()`, i.e. this rank's proxy has landed all it was sent)."""
    w = prog.window_bytes
    accepted = wrong = False
    deadline = time.monotonic() + world.timeout
    while True:
        done = ctl.landed() == serial and (arrived is None or arrived())
        signal = int(sigs[0])  # observe first ...
        mem = TargetMemory(bytearray(local[:w]), {("index", 0): signal})
        read = proto.receive(prog, mem)
        cell.polls += 1
        ctl.polled()
        if read is not None:
            accepted = True
            data = TargetMemory(bytearray(local[:w]), {("index", 0): signal})  # ... then read the data
            stale = pr.stale_ranges(prog, data, read)
            if stale:
                cell.wrong_polls += 1
                if not wrong and cell.example is None:
                    cell.example = _describe(prog, read, stale)
                wrong = True
        if done:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("study --stress: the sender never reported the message landed")
        time.sleep(0)  # let the proxy land the next event
    cell.messages += 1
    cell.corrupted += wrong
    if not accepted:
        raise AssertionError(f"study --stress {cell.key()}: the receiver never accepted a fully landed message")
    if bytes(local[:w]) != prog.image:
        raise AssertionError(f"study --stress {cell.key()}: the window differs from the message once all landed")


def run_stress(
    protocols=None,
    models=None,
    strengths=None,
    bound=pr.DEFAULT_BOUND,
    seeds: int = 10,
    messages: int = 5,
    verdicts: dict | None = None,
    world=None,
    network: str | None = None,
    faults=None,
) -> list[StressCell]:
    """Stress-runs every selected cell on the proxy (2 ranks, shm wire) with messages of
    the bound's largest shape. `world`: an MPIWorld of 2 ranks on one host (every rank
    calls this; each returns every cell's full counts); None: under mpiexec the job's
    MPIWorld (MPIWorld.launched_under_mpi()), else a ThreadWorld of 2 ranks.
    `network`: the proxy's wire, "shm" or (MPI only) "mpi"; default DEFAULT_NETWORK.
    `verdicts`: the explorer's verdict per cell key (computed here when not given).
    `faults`: a faults.FaultSpec: the sender's proxy runs a lossy link under its wire with
    the reliability layer above it (the delivery orders checked are the scheduler's,
    which that layer lands unchanged)."""
    if world is None and MPIWorld.launched_under_mpi():
        world = MPIWorld()
    if world is not None and world.size != 2:
        raise SystemExit(f"commref study --stress: runs on 2 ranks, not {world.size} (mpiexec -n 2 / --np 2)")
    network = network or DEFAULT_NETWORK
    if network not in NETWORKS or (network == "mpi" and world is None):
        raise SystemExit(
            f"commref study --stress: network {network!r} needs one of {NETWORKS} (mpi: under mpiexec, --np 2)"
        )

    cells = []
    for proto in protocols or pr.PROTOCOLS:
        for strength in proto.strengths:
            if strengths and strength is not None and strength not in strengths:
                continue
            for model in models or pr.MODELS:
                key = (proto.name, strength or "-", model.name)
                verdict = (verdicts or {}).get(key) or explorer.run_cell(proto, strength, model, bound).verdict
                cells.append(
                    StressCell(
                        proto.name,
                        strength,
                        model.name,
                        verdict,
                        skipped=NOT_STRESSED.get(proto.name),
                        world="thread" if world is None else world.kind,
                        network=network,
                    )
                )
    if world is None:
        ThreadWorld.run(2, _rank_main, cells, seeds, messages, bound, "shm", faults)
    else:
        _rank_main(world, cells, seeds, messages, bound, network, faults)
    return cells
