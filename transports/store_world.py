"""The World of one rank per process over a key-value store (see world.py for the
contracts): ranks that a rendezvous other than MPI started, such as torch.distributed's
(torchrun's env://, a TCPStore or a FileStore), bootstrap commref through the store that
rendezvous already has.

The store is any object with torch.distributed.Store's methods ``set(key, bytes)``,
``get(key) -> bytes`` and ``check(keys) -> bool`` (all keys present, without waiting),
plus ``delete_key(key)`` where it has one (used to drop spent keys; optional). Nothing
here imports torch.

Contracts, beyond world.py's:

* **Keys.** Everything lives under ``prefix`` (default ``"commref"``); two worlds on one
  store need different prefixes, and a split's keys live under its parent's. Each
  control-plane call has an epoch (the per-world call counter, equal on every rank); a
  rank posts ``<prefix>/<epoch>/<rank>`` (the pickled operation code, root and payload)
  and polls for every peer's key of that epoch, with a deadline. Keys of epoch e-1 are
  deleted by their owner once epoch e is complete (every rank has then read them).
* **Abort across processes.** ``mark_failed`` and ``abort`` raise this process's abort
  word and set ``<root prefix>/abort`` (origin rank, reason). Every wait polls that key,
  and a watcher thread (one per root world, daemon, polling every 50 ms) raises the
  abort word of every process that sees it, so the peers' kernels and waits end with
  CommAborted instead of at their deadlines. ``abort`` then ends this process
  (``os._exit(code)``): there is no launcher to end the job, and the peers stop on the key.
* **Hosts.** ``host`` is ``socket.gethostname()``; ``local_rank`` / ``local_size`` come
  from one allgather of the hosts when the world is made (a collective: every rank makes
  its world). Ranks on other hosts are reachable only through GIN over network "mpi",
  which needs an MPIWorld: a Communicator on a StoreWorld spans one host.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
from typing import Any, ClassVar, NoReturn

import numpy as np

from .errors import CommAborted, CommMismatch, CommTimeout
from .nodes import node_of
from .world import OP_ALLGATHER, OP_BARRIER, OP_BCAST, World, describe_op

__all__ = ["StoreWorld"]

# How often the watcher thread looks for the abort key (seconds).
_WATCH_S = 0.05


class _Backoff:
    """Polling pause: 100 us at first, doubling to 5 ms."""

    __slots__ = ("_sleep_s",)

    def __init__(self) -> None:
        self._sleep_s = 100e-6

    def pause(self) -> None:
        time.sleep(self._sleep_s)
        self._sleep_s = min(self._sleep_s * 2, 5e-3)


class _AbortState:
    """What the ranks of one root world (and its splits) share in this process: the
    abort word, the abort key and its watcher."""

    def __init__(self, store, key: str) -> None:
        self.store, self.key = store, key
        self.word = np.zeros(1, dtype=np.uint64)
        self.origin: int | None = None
        self.reason: str | None = None
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="commref-store-abort-watcher", daemon=True)
        self.watcher.start()

    def poll(self) -> bool:
        """True once the job is aborting: this process's word, or the store's key."""
        if self.word[0]:
            return True
        try:
            present = self.store.check([self.key])
        except Exception:  # the store is gone (shutdown): nothing to learn from it
            return False
        if present:
            self._learn()
        return bool(self.word[0])

    def _learn(self) -> None:
        try:
            origin, reason = pickle.loads(self.store.get(self.key))
        except Exception:
            origin, reason = None, "abort key set"
        with self.lock:
            if self.reason is None:
                self.origin, self.reason = origin, reason
        self.word[0] = 1

    def fail(self, rank: int, reason: str) -> None:
        with self.lock:
            first = self.reason is None
            if first:
                self.origin, self.reason = rank, reason
        self.word[0] = 1
        if first:
            try:
                self.store.set(self.key, pickle.dumps((rank, reason)))
            except Exception:  # best effort: the peers then end at their deadlines
                pass

    def _watch(self) -> None:
        while not self.stop.wait(_WATCH_S):
            if self.poll():
                return

    def error(self, rank: int, what: str) -> CommAborted:
        if self.reason is None:
            cause = "the job is aborting (abort word set)"
        elif self.origin is None:
            cause = f"the job is aborting: {self.reason}"
        else:
            cause = f"rank {self.origin} failed: {self.reason}"
        message = f"rank {rank}: {what}: aborted because {cause}"
        return CommAborted(message, rank=rank, origin_rank=self.origin, reason=self.reason or "")


class StoreWorld(World):
    """One rank per process over a key-value store (module docstring: keys, abort, hosts).

    ``StoreWorld(store, rank, size, prefix="commref", timeout=None)`` is collective:
    every rank of the job makes it with the same store and prefix."""

    kind: ClassVar[str] = "store"

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        *,
        prefix: str = "commref",
        timeout: float | None = None,
        node: str | None = None,
        _abort: _AbortState | None = None,
    ) -> None:
        if not isinstance(size, int) or size < 1 or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"StoreWorld: rank {rank!r} of size {size!r}: need 0 <= rank < size")
        self._store, self._prefix = store, prefix
        self._abort = _AbortState(store, f"{prefix}/abort") if _abort is None else _abort
        self._owns_abort = _abort is None
        self._epoch = 0
        self._splits = 0
        self._lock = threading.Lock()
        self._multi_get = getattr(store, "multi_get", None)
        host = socket.gethostname()
        super().__init__(
            rank=rank,
            size=size,
            local_rank=0,
            local_size=1,
            host=host,
            abort_word=self._abort.word,
            timeout=timeout,
            node=node_of(host, rank, size) if node is None else node,
        )
        hosts = self.allgather(host, what="store world hosts")
        self.local_rank = sum(1 for h in hosts[:rank] if h == host)
        self.local_size = sum(1 for h in hosts if h == host)

    @property
    def store(self):
        """The store this world runs on."""
        return self._store

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        self._exchange(OP_BARRIER, -1, None, what, self._seconds(timeout))

    def allgather(self, obj: Any, what: str = "allgather", timeout: float | None = None) -> list[Any]:
        return self._exchange(OP_ALLGATHER, -1, obj, what, self._seconds(timeout))

    def bcast(self, obj: Any, root: int = 0, what: str = "bcast", timeout: float | None = None) -> Any:
        root = self._check_root(root)
        payload = obj if self.rank == root else None
        return self._exchange(OP_BCAST, root, payload, what, self._seconds(timeout))[root]

    def abort(self, message: str, code: int = 1) -> NoReturn:
        self._abort.fail(self.rank, message)
        sys.stdout.flush()
        print(f"commref: rank {self.rank} aborting: {message}", file=sys.stderr, flush=True)
        os._exit(code)

    def check_aborted(self) -> None:
        if self._abort.poll():
            raise self._abort.error(self.rank, "check_aborted")

    def mark_failed(self, reason: str) -> None:
        self._abort.fail(self.rank, reason)

    def _split(self, colors: list[int | None], members: list[int], what: str) -> StoreWorld | None:
        self._splits += 1  # equal on every rank: split is collective
        if not members:
            return None
        prefix = f"{self._prefix}/split{self._splits}/{colors[self.rank]}"
        return StoreWorld(
            self._store,
            members.index(self.rank),
            len(members),
            prefix=prefix,
            timeout=self.timeout,
            node=self.node,
            _abort=self._abort,
        )

    def free(self) -> None:
        """Stops the abort watcher of a root world (a split shares its parent's)."""
        if self._owns_abort:
            self._abort.stop.set()

    # -- the exchange ----------------------------------------------------------------

    def _key(self, epoch: int, rank: int) -> str:
        return f"{self._prefix}/{epoch}/{rank}"

    def _exchange(self, op: int, root: int, payload: Any, what: str, seconds: float) -> list[Any]:
        """Posts this rank's (op, root, payload) for the next epoch and returns every
        rank's payload, once all are posted; CommTimeout naming the ranks that did not
        post by the deadline, CommAborted once the job aborts, CommMismatch where a peer
        posted another operation or root."""
        with self._lock:
            if self._abort.poll():
                raise self._abort.error(self.rank, what)
            deadline = time.monotonic() + seconds
            self._epoch += 1
            epoch = self._epoch
            self._store.set(self._key(epoch, self.rank), pickle.dumps((op, root, payload)))
            pending = [r for r in range(self.size) if r != self.rank]
            backoff = _Backoff()
            while pending:
                if self._store.check([self._key(epoch, r) for r in pending]):
                    break
                pending = [r for r in pending if not self._store.check([self._key(epoch, r)])]
                if not pending:
                    break
                if self._abort.poll():
                    raise self._abort.error(self.rank, what)
                if time.monotonic() >= deadline:
                    raise CommTimeout.after(
                        seconds,
                        rank=self.rank,
                        peer=pending,
                        what=f"{what}: ranks at the store barrier",
                        expected=self.size,
                        seen=self.size - len(pending),
                    )
                backoff.pause()
            keys = [self._key(epoch, r) for r in range(self.size)]
            raw = self._multi_get(keys) if self._multi_get is not None else [self._store.get(k) for k in keys]
            entries = [pickle.loads(bytes(b)) for b in raw]
            if epoch > 1:
                self._delete(self._key(epoch - 1, self.rank))
        for p, (theirs_op, theirs_root, _) in enumerate(entries):
            if (theirs_op, theirs_root) != (op, root):
                raise CommMismatch.between(
                    rank=self.rank,
                    peer=p,
                    field="collective",
                    what=what,
                    mine=describe_op(op, root),
                    theirs=describe_op(theirs_op, theirs_root),
                )
        return [payload for _, _, payload in entries]

    def _delete(self, key: str) -> None:
        delete = getattr(self._store, "delete_key", None)
        if delete is None:
            return
        try:
            delete(key)
        except Exception:  # a store that cannot delete keeps them: only space is lost
            pass
