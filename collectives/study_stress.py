"""`commref study --stress`: the study's protocols on the real GIN proxy.

For every cell (protocol x transport model x signal strength) the same sender program
that the explorer searched (collectives/study.py) is posted, message after message,
through the runtime path: descriptors written into a rank's GIN queue the way the
device's Gin::post writes them (gin.h: fields, then seq = slot + 1 with release; a
flush waits until the proxy has consumed it), drained by transports.gin.proxy.GinProxy
-- the progress thread the communicator runs -- which lands them on the target's window
over the shm wire with the model's semantics.Transport, choosing among
semantics.enabled() with its seeded generator. Two ranks of a ThreadWorld: rank 0
posts, rank 1 is the receiver and polls its own window while the events land; every
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

from device_kernels import abi
from transports.gin import semantics as sem
from transports.gin.semantics import Event, TargetMemory

from . import study as st

CAPACITY = 64  # descriptors in the queue; a message posts at most 9 ops
NSIGNALS = 8
PACE_S = 0.005  # longest wait after a landing for the receiver to poll
NOT_STRESSED = {"counted-writes": "the proxy keeps no placed-bytes counter"}


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

    def key(self) -> tuple:
        return (self.protocol, self.strength or "-", self.model)

    @property
    def agrees(self) -> bool:
        """Proven safe cells must show no corruption (and the proxy no order the model
        forbids); an unsafe cell agrees either way (its corruption may be rare)."""
        if self.skipped:
            return True
        return self.orders_disallowed == 0 and (self.verdict == "unsafe" or self.corrupted == 0)


def _layout(data_bytes: int) -> tuple[np.ndarray, int]:
    lay = np.zeros((), dtype=abi.WINDOW_LAYOUT)
    off = (data_bytes + 4095) // 4096 * 4096
    lay["ginQueueOff"] = off
    off += CAPACITY * abi.GIN_DESCRIPTOR.itemsize + 128
    lay["ginSignalsOff"] = off
    off += NSIGNALS * 8
    lay["ginCountersOff"] = off
    off += 64
    return lay, off


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


def _paced(land, shared):
    """`land`, then a bounded wait until the receiver has polled twice: each state the
    proxy passes through is observed (on a real machine the receiver has its own core;
    here it shares the GIL with the proxy). Which event lands next is still the proxy's
    choice."""
    def paced(*args):
        land(*args)
        polls, until = shared.get("polls", 0), time.monotonic() + PACE_S
        while shared.get("polls", 0) < polls + 2 and time.monotonic() < until:
            time.sleep(0)
    return paced


def _describe(prog: st.Program, read: st.Read, stale) -> str:
    return f"{read.why}; stale " + ", ".join(f"[{o},{o + n})" for o, n in stale)


def _rank_main(world, cells, seeds: int, messages: int, bound, shared, lib):
    from transports.gin.backends import BACKENDS
    from transports.gin.proxy import GinProxy
    from transports.windows import register_window

    shape = st.Shape(*bound)
    data_bytes = max(st.PROTOCOL_BY_NAME[c.protocol].program(shape, c.strength, False).window_bytes for c in cells)
    layout, nbytes = _layout(data_bytes)
    window = register_window(world, nbytes, "cpu")
    try:
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
                    proxy = GinProxy(world, window, layout, CAPACITY, BACKENDS["proxy"], model.transport, "shm",
                                     seed, prog.segment_bytes, lib)
                    if not model.transport.ordered:
                        land = proxy._land

                        def recording(peer, link, ev, land=land, log=log):
                            put = link.puts[ev.put]
                            log.append((put.ctx, put.seq, ev.segment, ev.copy))
                            land(peer, link, ev)

                        proxy._land = recording
                    proxy._land_data = _paced(proxy._land_data, shared)
                    proxy._land_signal = _paced(proxy._land_signal, shared)
                    proxy.start()
                try:
                    for m in range(messages):
                        key = (ci, seed, m)
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
                            shared["landed"] = key
                        else:
                            _receive(world, proto, prog, cell, local, sigs, shared, key)
                        world.barrier(what="stress: message checked")
                finally:
                    if proxy is not None:
                        proxy.stop()
            cell.seconds += time.perf_counter() - t0 if world.rank == 1 else 0.0
    finally:
        world.barrier(what="stress: done")
        window.close()
    return cells


def _receive(world, proto, prog, cell, local, sigs, shared, key) -> None:
    w = prog.window_bytes
    accepted = wrong = False
    deadline = time.monotonic() + world.timeout
    while True:
        done = shared.get("landed") == key
        signal = int(sigs[0])  # observe first ...
        mem = TargetMemory(bytearray(local[:w]), {("index", 0): signal})
        read = proto.receive(prog, mem)
        cell.polls += 1
        shared["polls"] = shared.get("polls", 0) + 1
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
               messages: int = 5, verdicts: dict | None = None) -> list[StressCell]:
    """Stress-runs every selected cell on the proxy (ThreadWorld, 2 ranks, shm wire) with
    messages of the bound's largest shape. `verdicts`: the explorer's verdict per
    cell key (computed here when not given)."""
    from device_kernels import loader
    from transports.world import ThreadWorld

    cells = []
    for proto in protocols or st.PROTOCOLS:
        for strength in proto.strengths:
            if strengths and strength is not None and strength not in strengths:
                continue
            for model in models or st.MODELS:
                key = (proto.name, strength or "-", model.name)
                verdict = (verdicts or {}).get(key) or st.run_cell(proto, strength, model, bound).verdict
                cells.append(StressCell(proto.name, strength, model.name, verdict,
                                        skipped=NOT_STRESSED.get(proto.name)))
    lib = loader.cpu_kernels()._lib
    ThreadWorld.run(2, _rank_main, cells, seeds, messages, bound, {}, lib)
    return cells


def format_stress(cells: list[StressCell], seeds: int, messages: int, bound) -> str:
    models = [m for m in st.MODELS if any(c.model == m.name for c in cells)]
    rows = []
    for c in cells:
        r = (c.protocol, c.strength or "-")
        if r not in rows:
            rows.append(r)
    by = {c.key(): c for c in cells}
    w0 = max(len(f"{p} [{s}]") for p, s in rows) + 2
    width = 13
    title = (f"Corrupted messages per cell on the GIN proxy (ThreadWorld, shm wire; {seeds} seeds x {messages} "
             f"messages of {bound[0]}x{bound[1]}): S/U = the explorer's verdict, then corrupted/messages.")
    lines = [title, "".ljust(w0) + "".join(m.short.ljust(width) for m in models).rstrip()]
    for p, s in rows:
        line = f"{p} [{s}]".ljust(w0)
        for m in models:
            c = by.get((p, s, m.name))
            if c is None:
                txt = "-"
            elif c.skipped:
                txt = "n/a"
            else:
                txt = f"{c.verdict[0].upper()} {c.corrupted}/{c.messages}" + ("" if c.agrees else " !!")
            line += txt.ljust(width)
        lines.append(line.rstrip())
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
            "orders_disallowed": c.orders_disallowed, "agrees": c.agrees, "example": c.example,
            "seconds": round(c.seconds, 3)}
