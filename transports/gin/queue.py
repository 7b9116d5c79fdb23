"""A rank's GIN descriptor queue (include/commref/gin.h), both sides, and where it lives.

Layout (commref.device_kernels.abi): at `layout["ginQueueOff"]` of a region, `capacity`
descriptors (abi.GIN_DESCRIPTOR), then the queue header (abi.GIN_QUEUE_HEADER bytes):
the claimed counter at GIN_QUEUE_CLAIMED, the consumed counter at GIN_QUEUE_CONSUMED
and the engine's idle word at GIN_QUEUE_IDLE (a cache line apart). A producer claims slot k, writes the
descriptor's fields into ring[k % capacity] and publishes it by storing seq = k + 1
with release; it may reuse a ring entry once consumed >= k + 1 - capacity.

- QueueReader: the consumer (the proxy): takes published descriptors in slot order
  and decodes each into a Descriptor, here and nowhere else; advances `consumed`.
- QueueWriter: a producer on the host, as Gin::post does it on the device (one
  producer, so the claim needs no atomic): the ordering study's stress posts through it.
- HostProducer: a producer on the host beside the kernels, as Gin::post does it (the
  claim an atomic increment, so it may share the queue with running kernels), which
  rings the engine's idle word after each publish: the host one-sided calls
  (transports/gin/rma.py) post through it.
- QueueRegion: where a communicator's queue and counters live (GinArgs.queue,
  GinArgs.counters): the window's regions on the CPU engine, pinned host memory mapped
  into the device on a GPU.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from commref.device_kernels import abi

DESCRIPTOR_BYTES = abi.GIN_DESCRIPTOR.itemsize


class Descriptor(NamedTuple):
    """One GIN operation, field for field abi.GIN_DESCRIPTOR (gin.h GinDescriptor)."""

    seq: int
    op: int  # abi.GIN_PUT, GIN_PUT_VALUE, GIN_SIGNAL, GIN_GET, GIN_FLUSH, GIN_DOORBELL
    flags: int  # abi.GIN_HAS_SIGNAL | GIN_STRONG | GIN_VA | GIN_ADD | GIN_HAS_COUNTER | GIN_BULK
    peer: int
    ctx: int
    dstOffset: int
    srcOffset: int
    bytes: int  # the value itself for GIN_PUT_VALUE
    signal: int  # slot index, or window offset of a VA signal
    signalValue: int
    counter: int
    windows: int  # source and destination window ids (abi.gin_windows); 0, 0: the connection window


assert Descriptor._fields == abi.GIN_DESCRIPTOR.names, "Descriptor must follow abi.GIN_DESCRIPTOR"


def queue_bytes(capacity: int) -> int:
    """Bytes of a queue of `capacity` descriptors with its header (the ginQueueOff region)."""
    return capacity * DESCRIPTOR_BYTES + abi.GIN_QUEUE_HEADER


class _Queue:
    def __init__(self, local: np.ndarray, layout, capacity: int, atomics):
        qoff = int(layout["ginQueueOff"])
        nring = capacity * DESCRIPTOR_BYTES
        self.capacity = capacity
        self.ring = local[qoff : qoff + nring].view(abi.GIN_DESCRIPTOR)
        self.header = local[qoff + nring : qoff + nring + abi.GIN_QUEUE_HEADER]
        self.ring_addr = self.ring.ctypes.data
        self.claimed_addr = self.header.ctypes.data + abi.GIN_QUEUE_CLAIMED
        self.consumed_addr = self.header.ctypes.data + abi.GIN_QUEUE_CONSUMED
        self.atomics = atomics
        self._load = atomics.load_acquire_u64
        self._store = atomics.store_release_u64

    def seq_addr(self, slot: int) -> int:
        return self.ring_addr + (slot % self.capacity) * DESCRIPTOR_BYTES

    def claimed(self) -> int:
        return int(self._load(self.claimed_addr))

    def consumed(self) -> int:
        return int(self._load(self.consumed_addr))


class QueueReader(_Queue):
    """The consumer side: `take()` returns the next published descriptor (None when the
    next slot is not published yet); `done()` marks it consumed, which frees its ring
    entry and completes a flush waiting on it."""

    def __init__(self, local: np.ndarray, layout, capacity: int, atomics):
        super().__init__(local, layout, capacity, atomics)
        self.next = 0  # the next slot to take; consumed once done() is called for it

    def take(self) -> Descriptor | None:
        slot = self.next
        addr = self.ring_addr + (slot % self.capacity) * DESCRIPTOR_BYTES
        if self._load(addr) != slot + 1:
            return None  # not published yet (the acquire orders the reads of its fields after)
        return Descriptor._make(self.ring[slot % self.capacity].item())

    def done(self) -> None:
        self.next += 1
        self._store(self.consumed_addr, self.next)


class QueueWriter(_Queue):
    """The producer side on the host, as gin.h's Gin::post (one producer): fill() claims
    a slot and writes its fields, publish() releases filled slots to the consumer."""

    def __init__(self, local: np.ndarray, layout, capacity: int, atomics):
        super().__init__(local, layout, capacity, atomics)
        self.words = self.header.view(np.uint64)
        self.fields = self.ring[list(abi.GIN_DESCRIPTOR.names[1:])]  # every field but seq (a view)
        self.slot = 0  # slots claimed so far

    def reset(self) -> None:
        """An empty queue (no consumer may be running)."""
        self.ring.view(np.uint8)[:] = 0
        self.header[:] = 0
        self.slot = 0

    def fill(
        self,
        op: int,
        flags: int = 0,
        peer: int = -1,
        ctx: int = 0,
        dst: int = 0,
        src: int = 0,
        nbytes: int = 0,
        signal: int = 0,
        value: int = 0,
        counter: int = 0,
        windows: int = 0,
    ) -> int:
        """Claims the next slot and writes the descriptor's fields (not seq); returns the slot."""
        slot = self.slot
        if slot >= self.capacity and self.consumed() < slot + 1 - self.capacity:
            raise RuntimeError(f"GIN queue full: slot {slot} of {self.capacity} while {self.consumed()} consumed")
        self.slot += 1
        self.words[abi.GIN_QUEUE_CLAIMED // 8] = self.slot
        self.fields[slot % self.capacity] = (op, flags, peer, ctx, dst, src, nbytes, signal, value, counter, windows)
        return slot

    def publish(self, slots: list[int]) -> None:
        """seq = slot + 1 with release, last first: the consumer takes in slot order, so it
        then takes them all at once."""
        for slot in reversed(slots):
            self._store(self.seq_addr(slot), slot + 1)


class HostProducer(_Queue):
    """A host producer that may share the queue with other producers (kernels), as gin.h's
    Gin::post: post() claims slot k by an atomic increment of the claimed word, waits
    (bounded by `timeout` seconds, and by the abort word when `abort_word` is given: a
    uint64 array whose element 0 is nonzero once the job fails) until the consumer has
    consumed the slot's previous occupant, writes the fields, publishes seq = k + 1 with
    release, then rings the engine (atomics.wake_sleeper on the idle word), so that an
    engine sleeping on it takes the descriptor at once. A slot claimed and then given up
    at the deadline stays unpublished: the queue is unusable afterwards (as after a
    kernel's failed queue wait, wait.h), and the caller must fail the communicator."""

    def __init__(self, local: np.ndarray, layout, capacity: int, atomics, timeout: float, abort_word=None):
        super().__init__(local, layout, capacity, atomics)
        self.fields = self.ring[list(abi.GIN_DESCRIPTOR.names[1:])]  # every field but seq (a view)
        self.idle_addr = self.header.ctypes.data + abi.GIN_QUEUE_IDLE
        self.timeout, self.abort_word = timeout, abort_word
        self._claim, self._wake = atomics.add_u64, atomics.wake_sleeper

    def post(
        self,
        op: int,
        flags: int = 0,
        peer: int = -1,
        ctx: int = 0,
        dst: int = 0,
        src: int = 0,
        nbytes: int = 0,
        signal: int = 0,
        value: int = 0,
        counter: int = 0,
        windows: int = 0,
    ) -> int:
        """Posts one descriptor; returns its slot. RuntimeError naming the slot, expected
        and seen consumption if the ring stays full past the deadline or the job fails."""
        slot = int(self._claim(self.claimed_addr, 1))
        need = slot + 1 - self.capacity
        if self.consumed() < need:
            deadline = time.monotonic() + self.timeout
            while self.consumed() < need:
                failed = self.abort_word is not None and self.abort_word[0]
                if failed or time.monotonic() > deadline:
                    why = "the job failed" if failed else f"not within {self.timeout} s"
                    raise RuntimeError(
                        f"GIN queue full: slot {slot} of {self.capacity} waited for {need} consumed "
                        f"({why}), seen {self.consumed()}"
                    )
                self._wake(self.idle_addr)  # an engine asleep would drain the ring late
                time.sleep(20e-6)
        self.fields[slot % self.capacity] = (op, flags, peer, ctx, dst, src, nbytes, signal, value, counter, windows)
        self._store(self.seq_addr(slot), slot + 1)
        self._wake(self.idle_addr)
        return slot

    def wake(self) -> None:
        """Wakes the engine if it sleeps on the idle word (nothing otherwise), as kernels
        ring before they wait on a signal: on network mpi a peer's messages do not wake
        it, so a host waiting for one rings between its polls."""
        self._wake(self.idle_addr)


class QueueRegion:
    """A rank's GIN queue and counters: `queue` (uint8, the queue region: ring then
    header, QueueReader(region.queue, QueueRegion.LAYOUT, ...)) and `counters` (uint64)
    as host arrays for the proxy; `queue_address` and `counters_address` as the kernels
    address them (GinArgs).

    device "cpu": views of the window's ginQueueOff and ginCountersOff regions.
    device "cuda": one pinned allocation, portable and mapped (cudaHostAlloc), zeroed,
    queue then counters, addressed by the device as host_memory.mapped_device_pointer
    says. close() frees it: call it once no kernel and no proxy uses it."""

    LAYOUT = {"ginQueueOff": 0}  # the queue starts the `queue` array

    def __init__(self, window, layout, capacity: int, counters: int, device: str = "cpu", device_id: int = 0):
        qbytes = queue_bytes(capacity)
        self._free = None
        if device == "cuda":
            import ctypes

            import cupy
            from cupy.cuda import runtime

            from commref.transports.host_memory import CUDA_HOST_PORTABLE_MAPPED, mapped_device_pointer

            nbytes = qbytes + 8 * counters
            with cupy.cuda.Device(device_id):
                ptr = runtime.hostAlloc(max(nbytes, 8), CUDA_HOST_PORTABLE_MAPPED)
                try:
                    self.queue_address = mapped_device_pointer(ptr, device_id, registered=False)
                except BaseException:
                    runtime.freeHost(ptr)
                    raise
                self._free = lambda: runtime.freeHost(ptr)
            host = np.frombuffer((ctypes.c_char * max(nbytes, 8)).from_address(ptr), dtype=np.uint8)
            host[:] = 0  # cudaHostAlloc does not zero
            self.queue, counters_u8 = host[:qbytes], host[qbytes:nbytes]
            self.counters_address = self.queue_address + qbytes
        else:
            local = window.local
            qoff, coff = int(layout["ginQueueOff"]), int(layout["ginCountersOff"])
            self.queue, counters_u8 = local[qoff : qoff + qbytes], local[coff : coff + 8 * counters]
            self.queue_address = int(window.address) + qoff
            self.counters_address = int(window.address) + coff
        self.counters = counters_u8.view(np.uint64)

    def close(self) -> None:
        """Frees a GPU region (idempotent; nothing on the CPU, where the window owns it)."""
        free, self._free = self._free, None
        if free is not None:
            free()
