"""`commref study --stress`: the study's protocols on the real GIN proxy.

For every cell (protocol x transport model x signal strength) the same sender program
that the explorer searched (collectives/study.py) is posted, message after message,
through the runtime path: descriptors written into a rank's GIN queue the way the
device's Gin::post writes them (gin.h: fields, then seq = slot + 1 with release; a
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
window then equals the message (nothing lost), and, on unordered wires, the order in
which the proxy landed the events is one that semantics.first_disallowed accepts for
the explorer's plan of the program (what runs is what was studied).

The two ranks share only the windows and the world's barriers (every wait bounded by
world.timeout): a few control words in the receiver's window (_Control) say which
message has landed and count the receiver's polls, for the pacing; at the end the
sender's per-cell counts (delivery orders) and the receiver's (polls, corruptions) are
gathered into every rank's cells.

Not stressed: counted-writes (the proxy keeps no placed-bytes counter to wait on).
On an ordered wire the proxy lands each operation when it takes it, so it is FIFO
across contexts too: a legal refinement of per-context FIFO, under which the /2ctx
counterexamples (another context overtaking) cannot occur.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import numpy as np

from commref.device_kernels import abi
from commref.transports.gin import semantics as sem
from commref.transports.gin.semantics import Event, TargetMemory

from . import study as st

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
    off += CAPACITY * abi.GIN_DESCRIPTOR.itemsize + 128
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

    def __init__(self, window, off: int, lib):
        addr = int(window.peer_addresses[1]) + off
        self.words = np.ctypeslib.as_array((ctypes.c_uint64 * 3).from_address(addr))
        self._keep = window  # the mapping must outlive this view
        self.landed_addr = addr
        self.lib = lib
        lib.commref_store_release_u64.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        lib.commref_load_acquire_u64.argtypes = [ctypes.c_void_p]
        lib.commref_load_acquire_u64.restype = ctypes.c_uint64

    def reset(self) -> None:
        self.words[:] = 0

    def landed(self) -> int:
        return int(self.lib.commref_load_acquire_u64(self.landed_addr))

    def set_landed(self, serial: int) -> None:
        self.lib.commref_store_release_u64(self.landed_addr, serial)

    def polls(self) -> int:
        return int(self.words[1])

    def polled(self) -> None:
        self.words[1] += 1  # only the receiver writes it

    def sent(self) -> int:
        return int(self.words[2])

    def count_sent(self) -> None:
        self.words[2] += 1  # only the sender's proxy writes it


class _HostQueue:
    """The producer side of a rank's GIN queue, as gin.h's Gin::post does it."""

    def __init__(self, window, layout, lib):
        qoff = int(layout["ginQueueOff"])
        nring = CAPACITY * abi.GIN_DESCRIPTOR.itemsize
        self.ring_bytes = window.local[qoff:qoff + nring]
        self.ring = self.ring_bytes.view(abi.GIN_DESCRIPTOR)
        self.words = window.local[qoff + nring:qoff + nring + 128].view(np.uint64)  # claimed, ..., consumed
        self.consumed_addr = self.words.ctypes.data + 64
        self.lib = lib
        lib.commref_store_release_u64.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        lib.commref_load_acquire_u64.argtypes = [ctypes.c_void_p]
        lib.commref_load_acquire_u64.restype = ctypes.c_uint64
        self.slot = 0

    def reset(self) -> None:
        self.ring_bytes[:] = 0
        self.words[:] = 0
        self.slot = 0

    def fill(self, op, flags=0, peer=-1, ctx=0, dst=0, src=0, nbytes=0, signal=0, value=0) -> int:
        slot = self.slot
        self.slot += 1
        self.words[0] = self.slot
        d = self.ring[slot % CAPACITY]
        d["op"], d["flags"], d["peer"], d["ctx"] = op, flags, peer, ctx
        d["dstOffset"], d["srcOffset"], d["bytes"] = dst, src, nbytes
        d["signal"], d["signalValue"], d["counter"] = signal, value, 0
        return slot

    def publish(self, slots: list[int]) -> None:
        # Last first: the proxy consumes in slot order, so it then takes them all at once.
        for slot in reversed(slots):
            self.lib.commref_store_release_u64(self.ring.ctypes.data + (slot % CAPACITY) * abi.GIN_DESCRIPTOR.itemsize,
                                               slot + 1)

    def consumed(self) -> int:
        return int(self.lib.commref_load_acquire_u64(self.consumed_addr))


def _post_message(q: _HostQueue, prog: st.Program, peer: int, deadline: float, proxy) -> None:
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


def _paced(land, ctl: _Control):
    """`land`, then a bounded wait until the receiver has polled twice: each state the
    proxy passes through is observed (on a real machine the receiver has its own core;
    in a ThreadWorld it shares the GIL with the proxy, under MPI maybe a core with
    another process). Which event lands next is still the proxy's choice."""
    def paced(*args):
        land(*args)
        polls, until = ctl.polls(), time.monotonic() + PACE_S
        while ctl.polls() < polls + 2 and time.monotonic() < until:
            time.sleep(0)
    return paced


def _describe(prog: st.Program, read: st.Read, stale) -> str:
    return f"{read.why}; stale " + ", ".join(f"[{o},{o + n})" for o, n in stale)


def _rank_main(world, cells, seeds: int, messages: int, bound, lib, network: str = "shm"):
    from commref.transports.gin.backends import BACKENDS
    from commref.transports.gin.proxy import GinProxy
    from commref.transports.windows import register_window

    shape = st.Shape(*bound)
    data_bytes = max(st.PROTOCOL_BY_NAME[c.protocol].program(shape, c.strength, False).window_bytes for c in cells)
    layout, ctl_off, nbytes = _layout(data_bytes)
    window = register_window(world, nbytes, "cpu")
    if any(int(a) == 0 for a in window.peer_addresses[:2]):
        window.close()
        raise RuntimeError("study --stress: ranks 0 and 1 must share a host (the shm wire maps the peer's window)")
    serial = 0
    comm = world.comm.Dup() if network == "mpi" else None  # the proxies' own (as the communicator's)
    received = [0]  # network "mpi", receiver: messages its proxy has landed
    try:
        ctl = _Control(window, ctl_off, lib)
        if world.rank == 1:
            ctl.reset()
        world.barrier(what="stress: control words reset")
        local = window.local
        sigs = local[int(layout["ginSignalsOff"]):int(layout["ginSignalsOff"]) + NSIGNALS * 8].view(np.uint64)
        q = _HostQueue(window, layout, lib)
        for ci, cell in enumerate(cells):
            if cell.skipped:
                continue
            t0 = time.perf_counter()
            proto, model = st.PROTOCOL_BY_NAME[cell.protocol], st.MODEL_BY_NAME[cell.model]
            prog = proto.program(shape, cell.strength, model.split_ctx)
            w = prog.window_bytes
            per_ctx: dict[int, int] = {}
            for p in prog.puts:
                per_ctx[p.ctx] = per_ctx.get(p.ctx, 0) + 1
            by_ctx_seq = {(p.ctx, p.seq): i for i, p in enumerate(prog.puts)}
            for seed in range(seeds):
                proxy, log = None, []
                if world.rank == 0:
                    local[:w] = np.frombuffer(prog.image, np.uint8)  # the sources, at the same offsets
                    q.reset()
                    proxy = GinProxy(world, window, layout, CAPACITY, BACKENDS["proxy"], model.transport, network,
                                     seed, prog.segment_bytes, lib, comm)
                    if not model.transport.ordered:
                        land = proxy._land

                        def recording(peer, link, ev, land=land, log=log):
                            put = link.puts[ev.put]
                            log.append((put.ctx, put.seq, ev.segment, ev.copy))
                            land(peer, link, ev)

                        proxy._land = recording
                    proxy._land_data = _paced(proxy._land_data, ctl)
                    proxy._land_signal = _paced(proxy._land_signal, ctl)
                    if network == "mpi":
                        send = proxy._send

                        def counted_send(*args, send=send):
                            send(*args)
                            ctl.count_sent()

                        proxy._send = counted_send
                    proxy.start()
                elif network == "mpi":  # the receiver's proxy: its queue stays empty, it only lands
                    proxy = GinProxy(world, window, layout, CAPACITY, BACKENDS["proxy"], model.transport, network,
                                     seed, prog.segment_bytes, lib, comm)
                    recv = proxy._receive

                    def counted_receive(recv=recv):
                        n = recv()
                        received[0] += n
                        return n

                    proxy._receive = counted_receive
                    proxy.start()
                try:
                    for m in range(messages):
                        serial += 1  # the same on both ranks: every message ends in a barrier
                        if world.rank == 1:
                            local[:w] = st.STALE
                            sigs[:] = 0
                        world.barrier(what="stress: receiver ready")
                        if world.rank == 0:
                            deadline = time.monotonic() + world.timeout
                            del log[:]
                            _post_message(q, prog, 1, deadline, proxy)
                            def landed(proxy=proxy):
                                return q.consumed() >= q.slot and not any(l.puts for (p, _), l in proxy.links.items() if p == 1)

                            _wait(landed, deadline, proxy, "every event to land")
                            if not model.transport.ordered:
                                order = [Event(by_ctx_seq[(c, s - m * per_ctx[c])], seg, cp) for c, s, seg, cp in log]
                                cell.orders_checked += 1
                                bad = sem.first_disallowed(model.transport, prog.plan, order, model.strong_always)
                                missing = {e for e in prog.plan.all_events(model.transport) if e.copy == 0} - set(order)
                                if bad is not None or missing:
                                    cell.orders_disallowed += 1
                            ctl.set_landed(serial)
                        else:
                            _receive(world, proto, prog, cell, local, sigs, ctl, serial,
                                     (lambda: received[0] >= ctl.sent()) if network == "mpi" else None)
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
        halves = world.allgather([[getattr(c, f) for f in (StressCell.SENDER if world.rank == 0 else
                                                            StressCell.RECEIVER)] for c in cells],
                                 what="stress: per-cell counts")
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
            stale = st.stale_ranges(prog, data, read)
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


def run_stress(protocols=None, models=None, strengths=None, bound=st.DEFAULT_BOUND, seeds: int = 10,
               messages: int = 5, verdicts: dict | None = None, world=None,
               network: str | None = None) -> list[StressCell]:
    """Stress-runs every selected cell on the proxy (2 ranks, shm wire) with messages of
    the bound's largest shape. `world`: an MPIWorld of 2 ranks on one host (every rank
    calls this; each returns every cell's full counts); None: under mpiexec the job's
    MPIWorld (MPIWorld.launched_under_mpi()), else a ThreadWorld of 2 ranks.
    `network`: the proxy's wire, "shm" or (MPI only) "mpi"; default DEFAULT_NETWORK.
    `verdicts`: the explorer's verdict per cell key (computed here when not given)."""
    from commref.device_kernels import loader
    from commref.transports.world import MPIWorld, ThreadWorld

    if world is None and MPIWorld.launched_under_mpi():
        world = MPIWorld()
    if world is not None and world.size != 2:
        raise SystemExit(f"commref study --stress: runs on 2 ranks, not {world.size} (mpiexec -n 2 / --np 2)")
    network = network or DEFAULT_NETWORK
    if network not in NETWORKS or (network == "mpi" and world is None):
        raise SystemExit(f"commref study --stress: network {network!r} needs one of {NETWORKS} "
                         "(mpi: under mpiexec, --np 2)")

    cells = []
    for proto in protocols or st.PROTOCOLS:
        for strength in proto.strengths:
            if strengths and strength is not None and strength not in strengths:
                continue
            for model in models or st.MODELS:
                key = (proto.name, strength or "-", model.name)
                verdict = (verdicts or {}).get(key) or st.run_cell(proto, strength, model, bound).verdict
                cells.append(StressCell(proto.name, strength, model.name, verdict,
                                        skipped=NOT_STRESSED.get(proto.name),
                                        world="thread" if world is None else world.kind, network=network))
    lib = loader.cpu_kernels()._lib
    if world is None:
        ThreadWorld.run(2, _rank_main, cells, seeds, messages, bound, lib)
    else:
        _rank_main(world, cells, seeds, messages, bound, lib, network)
    return cells


def format_stress(cells: list[StressCell], seeds: int, messages: int, bound) -> str:
    models = [m for m in st.MODELS if any(c.model == m.name for c in cells)]
    where = (("2 MPI processes" if cells and cells[0].world == "mpi" else "ThreadWorld") + ", "
             + (cells[0].network if cells else "shm") + " wire")
    title = (f"Corrupted messages per cell on the GIN proxy ({where}; {seeds} seeds x {messages} "
             f"messages of {bound[0]}x{bound[1]}): S/U = the explorer's verdict, then corrupted/messages.")

    def text(c) -> str:
        if c is None:
            return "-"
        if c.skipped:
            return "n/a"
        return f"{c.verdict[0].upper()} {c.corrupted}/{c.messages}" + ("" if c.agrees else " !!")

    lines = [title] + st.matrix_lines(cells, models, text, [13] * len(models))
    bad = [c for c in cells if not c.agrees]
    unseen = [c for c in cells if not c.skipped and c.verdict == "unsafe" and c.corrupted == 0]
    orders = sum(c.orders_checked for c in cells)
    lines.append("")
    lines.append(f"# {orders} delivery orders of the proxy checked against semantics.enabled(): "
                 f"{sum(c.orders_disallowed for c in cells)} not allowed")
    for c in cells:
        if c.skipped:
            lines.append(f"# {c.protocol}: not stressed ({c.skipped})")
            break
    if unseen:
        lines.append("# unsafe but not observed: " + ", ".join(f"{c.protocol} [{c.strength or '-'}] @ {c.model}"
                                                               for c in unseen))
    lines.append("# disagreements (a safe cell corrupted, or an order the model forbids): "
                 + (", ".join(f"{c.key()}: {c.example}" for c in bad) if bad else "none"))
    return "\n".join(lines)


def stress_json(c: StressCell) -> dict:
    return {"protocol": c.protocol, "strength": c.strength, "transport": c.model, "verdict": c.verdict,
            "skipped": c.skipped, "messages": c.messages, "corrupted": c.corrupted, "polls": c.polls,
            "wrong_polls": c.wrong_polls, "orders_checked": c.orders_checked,
            "orders_disallowed": c.orders_disallowed, "agrees": c.agrees, "example": c.example, "world": c.world,
            "network": c.network,
            "seconds": round(c.seconds, 3)}
