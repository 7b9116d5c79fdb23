"""The GIN proxy: one progress thread per rank that drains its kernels' descriptor
queue (include/commref/gin.h) and carries each operation over a wire.

Wires move bytes and signals to the target:
- ``shm``: the target's window is mapped here (same host); the proxy writes into it
  and applies signals with atomic adds;
- ``mpi``: MPI messages to the target's proxy, which lands them in its own window
  (across processes and nodes: the distributed path; usable on one host too).

What may land when is decided by commref.transports.gin.semantics (the one definition):
on an ``ordered`` wire each (context, target) is FIFO; on an ``unordered`` wire a
seeded random generator picks among the enabled events, landing some now and keeping
others back so that later operations can overtake them. A put's source is copied when
the proxy takes the descriptor, so the source is reusable (counter incremented)
immediately after; a get lands before the proxy consumes the descriptor, so flush,
which waits for consumption, covers both.
"""

from __future__ import annotations

import ctypes
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from commref.device_kernels import abi
from commref.transports.gin import semantics
from commref.transports.gin.backends import Backend

# An MPI wire message: 6 x uint64 header (kind, offset, size, is_va, signal, value),
# then the data bytes.
_MSG_DATA, _MSG_SIGNAL, _MSG_GET_REQ, _MSG_GET_RESP = 1, 2, 3, 4
_HEADER = 48
_TAG = 7171


def _int32(x: int) -> int:
    return x - (1 << 32) if x & 0x80000000 else x


def _header(kind: int, offset: int = 0, size: int = 0, is_va: int = 0, signal: int = 0, value: int = 0):
    return np.array([kind, offset, size, is_va, signal, value], np.uint64)


class ProxyError(RuntimeError):
    """The proxy met an operation it cannot carry (names rank, peer, operation)."""


@dataclass
class _Link:
    """What this rank posted to one target and has not fully landed yet."""

    puts: list = field(default_factory=list)  # semantics.Put
    payloads: list = field(default_factory=list)  # np.uint8 arrays
    segs: list = field(default_factory=list)
    landed: set = field(default_factory=set)
    next_seq: dict = field(default_factory=dict)  # ctx -> seq
    after_flush: dict = field(default_factory=dict)  # ctx -> bool
    rng: random.Random | None = None  # this link's own stream (doorbell mode)
    doorbells: int = 0  # rung so far; > 0 switches the link to doorbell mode
    ring: bool = False  # a doorbell is waiting to be served


class GinProxy:
    """Progress thread of one rank. start() after the window is registered; stop() at close."""

    def __init__(self, world, window, layout: np.ndarray, capacity: int, backend: Backend,
                 transport: semantics.Transport, network: str, seed: int, segment_bytes: int, lib,
                 mpi_comm=None):
        self.world, self.rank, self.backend, self.transport = world, world.rank, backend, transport
        self.network, self.segment_bytes = network, segment_bytes
        self.window = window
        self.local = window.local
        self.base = int(window.address)
        self.layout = layout
        self.capacity = capacity
        qoff = int(layout["ginQueueOff"])
        self.ring = self.local[qoff : qoff + capacity * abi.GIN_DESCRIPTOR.itemsize].view(abi.GIN_DESCRIPTOR)
        # The same ring as rows of uint64 words: one tolist() per descriptor is much
        # cheaper than reading its fields by name.
        assert abi.GIN_DESCRIPTOR.itemsize == 72
        self.ring_words = self.local[qoff : qoff + capacity * 72].view(np.uint64).reshape(capacity, 9)
        self.consumed_addr = self.base + qoff + capacity * abi.GIN_DESCRIPTOR.itemsize + 64
        self.signals_off = int(layout["ginSignalsOff"])
        self.counters_off = int(layout["ginCountersOff"])
        self.rng = random.Random(seed * 1_000_003 + self.rank)
        self.seed = seed
        self.links: dict[tuple[int, int], _Link] = {}  # (peer, ctx) -> what is pending there
        self.trace: dict | None = None  # (peer, ctx) -> landed (put seq, segment, copy), when enabled
        self.comm = mpi_comm
        self.error: BaseException | None = None
        self.stats = {"ops": 0, "events": 0}
        self._lib = lib
        self._atomic_add = lib.commref_atomic_add_u64
        self._atomic_add.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        self._atomic_add.restype = ctypes.c_uint64
        self._load_acquire = lib.commref_load_acquire_u64
        self._load_acquire.argtypes = [ctypes.c_void_p]
        self._load_acquire.restype = ctypes.c_uint64
        self._store_release = lib.commref_store_release_u64
        self._store_release.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        self._consumed = 0
        self._flushed_ctx: set[int] = set()
        self._stop = threading.Event()
        self._pending_sends: list = []
        self._get_reply: dict = {}
        self._thread = threading.Thread(target=self._main, name=f"commref-gin-proxy-{self.rank}", daemon=True)

    # ---- lifecycle ----

    def start(self) -> None:
        self._thread.start()

    def quiesce(self, timeout: float) -> None:
        """Waits until every operation posted so far has been taken from the queue and
        landed (MPI: sent). Call before stop() so that peers get this rank's last
        data and credits."""
        claimed_addr = self.consumed_addr - 64
        deadline = time.monotonic() + timeout
        while True:
            claimed = self._load_acquire(claimed_addr)
            if (self._consumed >= claimed and not any(l.puts for l in self.links.values())
                    and not self._pending_sends) or self.error is not None or not self._thread.is_alive():
                return
            if time.monotonic() > deadline:
                raise ProxyError(f"rank {self.rank}: GIN proxy did not drain within {timeout} s "
                                 f"(expected {claimed} operations taken, seen {self._consumed})")
            time.sleep(50e-6)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _main(self) -> None:
        idle = 0
        try:
            while not self._stop.is_set():
                took = self._drain(64)
                landed = self._deliver()
                if self.network == "mpi":
                    landed += self._receive()
                    self._reap_sends()
                if took or landed:
                    idle = 0
                    continue
                idle += 1
                time.sleep(0 if idle < 200 else 50e-6)
        except BaseException as e:  # the kernels must not wait forever on a dead proxy
            self.error = e
            self.world.abort_word[0] = 1

    # ---- the queue ----

    def _drain(self, budget: int) -> int:
        took = 0
        while took < budget:
            slot = self._consumed
            if self._load_acquire(self._desc_addr(slot)) != slot + 1:
                break  # not published yet (the acquire orders the reads of its fields after)
            self._execute(self.ring_words[slot % self.capacity].tolist())
            self._consumed = slot + 1
            self._store_release(self.consumed_addr, slot + 1)
            took += 1
        self.stats["ops"] += took
        return took

    def _desc_addr(self, slot: int) -> int:
        return self.ring.ctypes.data + (slot % self.capacity) * abi.GIN_DESCRIPTOR.itemsize

    def _execute(self, w: list) -> None:
        """Carries one descriptor, given as its 9 uint64 words (gin.h GinDescriptor:
        seq, op|flags, peer|ctx, dstOffset, srcOffset, bytes, signal, signalValue, counter)."""
        op, flags = w[1] & 0xFFFFFFFF, w[1] >> 32
        peer, ctx = _int32(w[2] & 0xFFFFFFFF), _int32(w[2] >> 32)
        dst, src, nbytes, sig, sigval, counter = w[3], w[4], w[5], w[6], w[7], w[8] & 0xFFFFFFFF
        if op == abi.GIN_FLUSH:
            for (_, c), link in self.links.items():
                if c == ctx:
                    link.after_flush[ctx] = True
            self._flushed_ctx.add(ctx)
            return
        if op == abi.GIN_DOORBELL:
            # Served right here, at its place in the posted sequence (not whenever the
            # proxy next iterates): that is what makes the landing order reproducible.
            link = self._link(peer, ctx)
            link.doorbells += 1
            link.ring = True
            self._deliver_link(peer, link)
            return
        if not 0 <= peer < self.world.size:
            raise ProxyError(f"rank {self.rank}: GIN operation {op} names peer {peer} outside [0, {self.world.size})")
        if op == abi.GIN_GET:
            self._get(peer, src, dst, nbytes)
            return
        signal = None
        if flags & abi.GIN_HAS_SIGNAL:
            strong = bool(flags & abi.GIN_STRONG)
            if strong and not self.backend.caps.strong_signals:
                raise ProxyError(f"rank {self.rank}: strong signal to peer {peer} on backend "
                                 f"{self.backend.name}, which offers weak signals only")
            va = bool(flags & abi.GIN_VA)
            if va and not self.backend.caps.va_signals:
                raise ProxyError(f"rank {self.rank}: VA signal to peer {peer} on backend {self.backend.name}")
            value = sigval if flags & abi.GIN_ADD else 1
            if self.backend.signals_count_writes:
                if flags & abi.GIN_ADD:
                    raise ProxyError(f"rank {self.rank}: signal add on backend {self.backend.name}, whose signals "
                                     f"count completed writes")
                value = 1
            signal = semantics.Signal(strong or self.backend.strong_always, ("va" if va else "index", sig), value)
        if op == abi.GIN_PUT:
            payload = self.local[src : src + nbytes].copy()  # the source is reusable from here on
        elif op == abi.GIN_PUT_VALUE:
            payload = np.frombuffer(nbytes.to_bytes(8, "little"), dtype=np.uint8).copy()
        elif op == abi.GIN_SIGNAL:
            payload = np.zeros(0, np.uint8)
        else:
            raise ProxyError(f"rank {self.rank}: unknown GIN operation {op}")
        if flags & abi.GIN_HAS_COUNTER:
            self._atomic_add(self.base + self.counters_off + 8 * counter, 1)
        self._post(peer, ctx, dst, payload, signal)

    # ---- delivery ----

    def _link(self, peer: int, ctx: int) -> _Link:
        link = self.links.get((peer, ctx))
        if link is None:
            link = self.links[(peer, ctx)] = _Link(rng=random.Random(f"{self.seed}:{self.rank}:{peer}:{ctx}"))
            if ctx in self._flushed_ctx:
                link.after_flush[ctx] = True
        return link

    def _post(self, peer: int, ctx: int, offset: int, payload: np.ndarray, signal) -> None:
        link = self._link(peer, ctx)
        seq = link.next_seq.get(ctx, 0)
        link.next_seq[ctx] = seq + 1
        self._flushed_ctx.discard(ctx)
        put = semantics.Put(ctx, seq, offset, int(payload.size), signal, link.after_flush.pop(ctx, False))
        if self.transport.ordered:  # FIFO: the only enabled event is always the head
            self._land_data(peer, offset, payload)
            if signal is not None:
                self._land_signal(peer, signal)
            if self.trace is not None:
                self.trace.setdefault((peer, ctx), []).append((seq, "put+signal" if signal else "put"))
            self.stats["events"] += 1
            return
        link.puts.append(put)
        link.payloads.append(payload)
        link.segs.append(semantics.segments(put, self.segment_bytes))

    def _deliver(self) -> int:
        """Lands pending events of the unordered wire.

        Links whose kernels ring doorbells (every commref connection does) are served at
        doorbells only: all that is pending lands, in an order drawn from the link's own
        random stream among the enabled events, so the order depends only on the seed
        and the posted sequence. Other links (raw device API use) land at random while
        the proxy iterates, holding some events back so that later ones can overtake."""
        landed = 0
        for (peer, _), link in self.links.items():
            if link.puts and not link.doorbells:
                landed += self._deliver_link(peer, link)
        return landed

    def _deliver_link(self, peer: int, link: _Link) -> int:
        landed = 0
        plan = semantics.Plan(link.puts, link.segs)
        while True:
            choices = semantics.enabled(self.transport, plan, link.landed, self.backend.strong_always)
            if not choices:
                break
            ev = (link.rng if link.doorbells else self.rng).choice(choices)
            self._land(peer, link, ev)
            link.landed.add(ev)
            landed += 1
            if link.doorbells:
                if ev.is_signal:
                    time.sleep(0)  # let a receiver in this process see the state right after a signal
            elif self.rng.random() < 0.5:
                break
        link.ring = False
        self._prune(link)
        self.stats["events"] += landed
        return landed

    def _land(self, peer: int, link: _Link, ev: semantics.Event) -> None:
        put = link.puts[ev.put]
        if self.trace is not None:
            self.trace.setdefault((peer, put.ctx), []).append((put.seq, ev.segment, ev.copy))
        if ev.is_signal:
            self._land_signal(peer, put.signal)
            return
        off, n = link.segs[ev.put][ev.segment]
        rel = off - put.offset
        self._land_data(peer, off, link.payloads[ev.put][rel : rel + n])

    def _prune(self, link: _Link) -> None:
        """Drops the fully landed prefix (originals and signals; a duplicate not placed by
        then simply never happens)."""
        k = 0
        while k < len(link.puts):
            done = all(semantics.Event(k, s) in link.landed for s in range(len(link.segs[k])))
            if link.puts[k].signal is not None:
                done = done and semantics.Event(k, -1) in link.landed
            if not done:
                break
            k += 1
        if k:
            del link.puts[:k], link.payloads[:k], link.segs[:k]
            link.landed = {semantics.Event(e.put - k, e.segment, e.copy) for e in link.landed if e.put >= k}

    # ---- landing: shm writes directly, mpi sends to the target's proxy ----

    def _land_data(self, peer: int, offset: int, data: np.ndarray) -> None:
        if data.size == 0:
            return
        if self.network == "shm":
            ctypes.memmove(int(self.window.peer_addresses[peer]) + offset, data.ctypes.data, data.size)
        else:
            self._send(peer, _header(_MSG_DATA, offset, data.size), data)

    def _land_signal(self, peer: int, sig: semantics.Signal) -> None:
        kind, where = sig.target
        if self.network == "shm":
            self._apply_signal(int(self.window.peer_addresses[peer]), kind, where, sig.value)
        else:
            self._send(peer, _header(_MSG_SIGNAL, is_va=int(kind == "va"), signal=where, value=sig.value))

    def _apply_signal(self, base: int, kind: str, where: int, value: int) -> None:
        addr = base + (where if kind == "va" else self.signals_off + 8 * where)
        self._atomic_add(addr, value)

    def _send(self, peer: int, header: np.ndarray, data: np.ndarray | None = None) -> None:
        msg = header.view(np.uint8) if data is None else np.concatenate([header.view(np.uint8), data])
        self._pending_sends.append((self.comm.Isend(msg, dest=peer, tag=_TAG), msg))

    def _reap_sends(self) -> None:
        if self._pending_sends:
            self._pending_sends = [(r, m) for r, m in self._pending_sends if not r.Test()]

    def _receive(self) -> int:
        from mpi4py import MPI

        n = 0
        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG, status=status):
            buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            src = status.Get_source()
            self.comm.Recv(buf, source=src, tag=_TAG)
            h = buf[:_HEADER].view(np.uint64)
            kind = int(h[0])
            if kind == _MSG_DATA:
                off, size = int(h[1]), int(h[2])
                ctypes.memmove(self.base + off, buf[_HEADER:].ctypes.data, size)
            elif kind == _MSG_SIGNAL:
                self._apply_signal(self.base, "va" if int(h[3]) else "index", int(h[4]), int(h[5]))
            elif kind == _MSG_GET_REQ:
                off, size = int(h[1]), int(h[2])
                self._send(src, _header(_MSG_GET_RESP, 0, size), self.local[off : off + size].copy())
            elif kind == _MSG_GET_RESP:
                self._get_reply[src] = buf[_HEADER:].copy()
            n += 1
        return n

    def _get(self, peer: int, src: int, dst: int, n: int) -> None:
        if self.network == "shm":
            ctypes.memmove(self.base + dst, int(self.window.peer_addresses[peer]) + src, n)
            return
        self._send(peer, _header(_MSG_GET_REQ, src, n))
        deadline = time.monotonic() + self.world.timeout
        while peer not in self._get_reply:
            self._receive()
            self._reap_sends()
            self._deliver()
            if time.monotonic() > deadline:
                raise ProxyError(f"rank {self.rank}: GIN get from peer {peer} got no reply within "
                                 f"{self.world.timeout} s (expected {n} bytes, seen none)")
            time.sleep(0)
        data = self._get_reply.pop(peer)
        ctypes.memmove(self.base + dst, data.ctypes.data, n)
