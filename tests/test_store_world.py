"""StoreWorld (transports/store_world.py): the World over a key-value store, here a dict
behind a lock with torch.distributed.Store's methods, its ranks as threads. Needs no
torch; importing commref does not import it. A Communicator on StoreWorlds (one rank per
process: its windows are named per process) runs in tests/test_torch_backend.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from commref.transports.errors import CommAborted, CommMismatch, CommTimeout
from commref.transports.store_world import StoreWorld


class DictStore:
    """set / get / check / delete_key as torch's Store has them."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key, value) -> None:
        with self.lock:
            self.data[key] = bytes(value)

    def get(self, key) -> bytes:
        with self.lock:
            return self.data[key]

    def check(self, keys) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def delete_key(self, key) -> bool:
        with self.lock:
            return self.data.pop(key, None) is not None


def run(n: int, fn, timeout: float = 5.0, store=None):
    """fn(world) on `n` StoreWorld ranks (threads); returns results or exceptions by rank."""
    store = store or DictStore()
    out: list = [None] * n

    def main(r: int) -> None:
        world = None
        try:
            world = StoreWorld(store, r, n, timeout=timeout)
            out[r] = fn(world)
        except BaseException as e:  # noqa: BLE001 - returned
            out[r] = e
        finally:
            if world is not None:
                world.free()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout + 10)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    return out


def test_allgather_bcast_barrier_and_hosts():
    def fn(w):
        w.barrier()
        got = w.allgather(w.rank * 10)
        root = w.bcast(f"from {w.rank}", root=2)
        return got, root, w.local_rank, w.local_size, w.kind

    for r, (got, root, local_rank, local_size, kind) in enumerate(run(3, fn)):
        assert got == [0, 10, 20] and root == "from 2" and (local_rank, local_size) == (r, 3) and kind == "store"


def test_spent_keys_are_deleted():
    store = DictStore()
    run(2, lambda w: [w.barrier() for _ in range(5)], store=store)
    assert len([k for k in store.data if not k.endswith("abort")]) <= 2 * 2


def test_a_missing_rank_times_out_naming_it():
    def fn(w):
        if w.rank == 1:
            return None
        w.barrier(timeout=0.5)

    out = run(2, fn)
    assert isinstance(out[0], CommTimeout) and out[0].peers == [1], out


def test_a_mismatch_is_named():
    out = run(2, lambda w: w.barrier() if w.rank == 0 else w.bcast(1, root=0))
    assert all(isinstance(e, CommMismatch) for e in out), out


def test_a_failed_rank_aborts_its_peers_at_once():
    def fn(w):
        if w.rank == 1:
            w.mark_failed("rank 1 broke")
            return None
        t0 = time.monotonic()
        with pytest.raises(CommAborted, match="rank 1 failed: rank 1 broke"):
            w.barrier(timeout=30)
        deadline = time.monotonic() + 2
        while not w.aborting and time.monotonic() < deadline:  # the watcher raises the word
            time.sleep(0.01)
        return time.monotonic() - t0, bool(w.abort_word[0])

    out = run(2, fn, timeout=30)
    assert not isinstance(out[0], BaseException), out
    elapsed, word = out[0]
    assert elapsed < 5 and word


def test_split():
    def fn(w):
        sub = w.split(w.rank % 2)
        got = sub.allgather(w.rank)
        assert sub.abort_word is w.abort_word
        return got, sub.members

    out = run(4, fn)
    assert out[0] == ([0, 2], [0, 2]) and out[1] == ([1, 3], [1, 3]), out


def test_bad_ranks_are_refused():
    with pytest.raises(ValueError):
        StoreWorld(DictStore(), 2, 2)


def test_importing_commref_imports_no_torch():
    code = "import sys, commref, commref.transports.store_world; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
