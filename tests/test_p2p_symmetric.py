"""Zero-copy sends and receives on buffers from alloc_symmetric (kernels/p2p.cu).

- a send whose buffer lies in a symmetric window goes zero copy over LSA (its P2pOp
  names the window and offset), a plain one through the FIFO;
- exact on random bytes at several sizes and dtypes (count 0, one element, one and many
  FIFO slots), in groups, symmetric to symmetric and mixed: the sender's buffer symmetric
  and the receiver's plain, and the other way round, at 2 and 3 ranks;
- a mismatched dtype or count on the zero-copy path fails on both ranks with
  CommMismatch naming both ranks and what each posted, before the deadline;
- the sender may reuse its buffer once the call returns: overwriting it at once never
  changes what the receiver got;
- a sendrecv repeated on the same arrays runs its kept launch, exact every time, and a
  failure met there names the group member as a group's does;
- under mpiexec (the window is POSIX shared memory between processes): the same cases.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from commref import Communicator

# (count, dtype): none, one element, within one 1 KiB slot, many slots, many 64 KiB slots.
CASES = [(0, "float32"), (1, "int8"), (100, "float64"), (3001, "float16"), (70_001, "int32")]
SLOT = dict(slot_bytes=1024, nsteps=2)


def _payload(seed: int, src: int, dst: int, count: int, dtype: str) -> np.ndarray:
    """Random bytes (any bit pattern) that rank `src` sends rank `dst`, as `dtype`."""
    from commref.collectives.verify import DTYPES

    dt = np.dtype(DTYPES[dtype])
    raw = np.random.default_rng([seed, src, dst, count]).integers(0, 256, count * dt.itemsize, dtype=np.uint8)
    return raw.view(dt)


def _buffer(comm, symmetric: bool, count: int, dtype: str) -> np.ndarray:
    from commref.collectives.verify import DTYPES

    dt = np.dtype(DTYPES[dtype])
    return comm.alloc_symmetric(count, dt) if symmetric else np.zeros(count, dt)


def ring_shifts(world, comm, seed: int) -> list:
    """Every case as a ring shift in a group, for each (sender, receiver) placement; the
    cases that arrived wrong. Collective: every rank allocates alike."""
    n, r = world.size, world.rank
    wrong = []
    for send_sym, recv_sym in ((True, True), (True, False), (False, True)):
        for count, dtype in CASES:
            x = _buffer(comm, send_sym, count, dtype)
            y = _buffer(comm, recv_sym, count, dtype)
            x[...] = _payload(seed, r, (r + 1) % n, count, dtype)
            with comm.group():
                comm.send(x, (r + 1) % n)
                comm.recv(y, (r - 1) % n)
            if y.tobytes() != _payload(seed, (r - 1) % n, r, count, dtype).tobytes():
                wrong.append((send_sym, recv_sym, count, dtype))
            for a in (x, y):
                if send_sym and a is x or recv_sym and a is y:
                    comm.free_symmetric(a)
    return wrong


def reuse_after_return(world, comm, rounds: int = 6) -> list:
    """Each round: a symmetric ring shift of 300_000 int32, after which the sender
    overwrites its buffer at once; the rounds whose received bytes were not the old ones."""
    n, r = world.size, world.rank
    x = comm.alloc_symmetric(300_000, np.int32)
    y = np.zeros(300_000, np.int32)
    wrong = []
    for k in range(rounds):
        x[...] = 1000 * k + r
        with comm.group():
            comm.send(x, (r + 1) % n)
            comm.recv(y, (r - 1) % n)
        x[...] = -1  # the receiver has copied: this must not show there
        if not (y == 1000 * k + (r - 1) % n).all():
            wrong.append(k)
        world.barrier(what="round checked")  # the next round's sends come after every check
    comm.free_symmetric(x)
    return wrong


def mismatch(world, comm, sent, received) -> str | None:
    """Rank 0 sends `sent` (count, dtype) from a symmetric buffer, rank 1 receives
    `received`; the message of what each raised (None: nothing)."""
    x = comm.alloc_symmetric(max(sent[0], 1), sent[1])[: sent[0]]
    try:
        with comm.group():
            if world.rank == 0:
                comm.send(x, 1)
            elif world.rank == 1:
                comm.recv(np.zeros(received[0], received[1]), 0)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------------------
# the MPI job (this file run under mpiexec)
# ---------------------------------------------------------------------------------------


def _mpi_main() -> None:
    from commref.transports.mpi_world import MPIWorld

    world = MPIWorld()
    with Communicator(world, "cpu", path="lsa", timeout=30, **SLOT) as comm:
        wrong = ring_shifts(world, comm, 3) + reuse_after_return(world, comm)
        sys.stdout.write(f"rank {world.rank}: wrong {wrong}\n")
        sys.stdout.flush()
    with Communicator(world, "cpu", path="lsa", timeout=5, **SLOT) as comm:
        said = mismatch(world, comm, (10, "float32"), (11, "float32"))
        sys.stdout.write(f"rank {world.rank}: mismatch {said}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _mpi_main()
    sys.exit(0)


# ---------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------

import re  # noqa: E402

import pytest  # noqa: E402
from conftest import clean_env, run_mpi  # noqa: E402
from helpers import WORLD_TIMEOUT, close_after_barrier, errors_per_rank  # noqa: E402

from commref.transports.thread_world import ThreadWorld  # noqa: E402

DEADLINE = 3.0


def _comm(world, timeout: float = WORLD_TIMEOUT) -> Communicator:
    return Communicator(world, "cpu", path="lsa", timeout=timeout, **SLOT)


def test_a_send_from_a_window_goes_zero_copy():
    """The P2pOp of a send from a symmetric buffer names its window and offset; a plain
    send's names none; every recv over LSA gets the window table."""
    from commref.collectives.p2p import P2pCall

    def body(world):
        comm = _comm(world)
        w = comm.alloc_symmetric(1024, np.float32)
        check = comm._check
        calls = [
            P2pCall("send", 1 - world.rank, check.buffer(w[256:], "sendbuf")),
            P2pCall("send", 1 - world.rank, check.buffer(np.zeros(4, np.float32), "sendbuf")),
            P2pCall("recv", 1 - world.rank, check.buffer(np.zeros(4, np.float32), "recvbuf", write=True)),
        ]
        ops, _ = comm._scheduler.p2p.table(calls)
        table = comm._symmetric.table
        out = [int(v) for v in (ops[0]["symWindow"], ops[0]["symOffset"], ops[1]["symWindow"], ops[2]["symWindow"])]
        out.append(int(ops[2]["symWindows"]) == table.ctypes.data and int(table[out[0], 1]) == 4096)
        close_after_barrier(world, comm)
        return out

    assert ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT) == [[1, 1024, 0, 0, True]] * 2


@pytest.mark.parametrize("nranks", [2, 3])
def test_exact_symmetric_and_mixed(nranks):
    def body(world):
        comm = _comm(world)
        wrong = ring_shifts(world, comm, 11)
        close_after_barrier(world, comm)
        return wrong

    assert ThreadWorld.run(nranks, body, timeout=WORLD_TIMEOUT) == [[]] * nranks


def test_all_pairs_in_one_group_from_windows():
    """Every rank sends every other rank a slice of one symmetric window, posted in
    random order in one group, the receives into plain buffers."""

    def body(world):
        comm = _comm(world)
        n, r = world.size, world.rank
        w = comm.alloc_symmetric(n * 5000, np.uint8)
        for p in range(n):
            w[p * 5000 : (p + 1) * 5000] = _payload(4, r, p, 5000, "uint8")
        got = {p: np.zeros(5000, np.uint8) for p in range(n) if p != r}
        ops = [(k, p) for p in got for k in ("send", "recv")]
        np.random.default_rng(r).shuffle(ops)
        with comm.group():
            for k, p in ops:
                if k == "send":
                    comm.send(w[p * 5000 : (p + 1) * 5000], p)
                else:
                    comm.recv(got[p], p)
        wrong = [p for p, y in got.items() if y.tobytes() != _payload(4, p, r, 5000, "uint8").tobytes()]
        close_after_barrier(world, comm)
        return wrong

    assert ThreadWorld.run(4, body, timeout=WORLD_TIMEOUT) == [[]] * 4


def test_the_sender_may_reuse_its_buffer_once_the_call_returns():
    def body(world):
        comm = _comm(world)
        wrong = reuse_after_return(world, comm)
        close_after_barrier(world, comm)
        return wrong

    assert ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT) == [[], []]


@pytest.mark.parametrize(
    "sent, received, field",
    [
        ((10, "float32"), (40, "int8"), ("dtype", "float32", "int8")),
        ((10, "float32"), (11, "float32"), ("count", 10, 11)),
        ((70_000, "int64"), (69_999, "int64"), ("count", 70_000, 69_999)),  # many slots' worth
    ],
)
def test_a_mismatch_on_the_zero_copy_path_fails_on_both_ranks(sent, received, field):
    def body(world, comm):
        said = mismatch(world, comm, sent, received)
        if said:
            raise RuntimeError(said)

    (t0, m0, s0), (t1, m1, s1) = errors_per_rank(2, lambda world: _comm(world, DEADLINE), body)
    assert m0.startswith("CommMismatch") and m1.startswith("CommMismatch"), (m0, m1)
    send, recv = f"send of {sent[0]} {sent[1]}", f"recv of {received[0]} {received[1]}"
    name, at0, at1 = field
    assert f"rank 0: {send} to rank 1 does not match rank 1's {recv}: {name} is {at0!r} here and {at1!r} there" in m0
    assert f"rank 1: {recv} from rank 0 does not match rank 0's {send}: {name} is {at1!r} here and {at0!r} there" in m1
    assert s0 < DEADLINE and s1 < DEADLINE, (s0, s1)  # found, not timed out


def test_a_repeated_sendrecv_goes_straight_to_its_kept_launch():
    """sendrecv again on the same arrays (symmetric and plain) runs the kept launch,
    exact every time; another view of the same memory is checked afresh."""
    from commref.collectives.p2p_collectives import sendrecv

    def body(world):
        comm = _comm(world)
        n, r = world.size, world.rank
        out = []
        pairs = [(comm.alloc_symmetric(5000, np.int32), np.zeros(5000, np.int32))]
        pairs.append((np.zeros(7, np.uint32), np.zeros(7, np.uint32)))
        for x, y in pairs:
            for k in range(4):
                x[...] = 100 * k + r
                sendrecv(comm, x, y)
                out.append(bool((y == 100 * k + (r - 1) % n).all()))
            x[...] = 7 * r
            sendrecv(comm, x.reshape(-1, 1)[:, 0], y)  # a new view: checked, then kept too
            out.append(bool((y == 7 * ((r - 1) % n)).all()))
        out.append(comm.kept_calls > 0)
        close_after_barrier(world, comm)
        return out

    assert ThreadWorld.run(3, body, timeout=WORLD_TIMEOUT) == [[True] * 11] * 3


def test_a_kept_sendrecv_fails_as_a_group_does():
    """A mismatch met by a kept sendrecv names the group member on both ranks."""
    from commref.collectives.p2p_collectives import sendrecv

    def body(world, comm):
        x = comm.alloc_symmetric(64, np.float32)
        y = np.zeros(64, np.float32)
        sendrecv(comm, x, y)  # kept
        if world.rank == 1:
            y = np.zeros(65, np.float32)
            x = comm.alloc_symmetric(65, np.float32)
        else:
            comm.alloc_symmetric(65, np.float32)  # every rank allocates alike
        sendrecv(comm, x, y)

    (t0, m0, s0), (t1, m1, s1) = errors_per_rank(2, lambda world: _comm(world, DEADLINE), body)
    assert t0 == t1 == "CommMismatch", (m0, m1)
    assert m0.startswith("group member #0 (send of 64 float32 to rank 1)") or m0.startswith("group member #1"), m0
    assert "does not match rank 1's" in m0 and "does not match rank 0's" in m1, (m0, m1)
    assert s0 < DEADLINE and s1 < DEADLINE, (s0, s1)


@pytest.mark.mpi
def test_under_mpiexec(shm_leak_check):
    root = os.path.dirname(os.path.dirname(__file__))
    proc = run_mpi(2, [os.path.relpath(__file__, root)], timeout=120, env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert sorted(re.findall(r"rank \d: wrong .*", proc.stdout)) == ["rank 0: wrong []", "rank 1: wrong []"], out
    said = dict(re.findall(r"rank (\d): mismatch (.*)", proc.stdout))
    assert said["0"].startswith("CommMismatch") and "rank 0: send of 10 float32 to rank 1 does not match" in said["0"]
    assert said["1"].startswith("CommMismatch") and "rank 1: recv of 11 float32 from rank 0 does not match" in said["1"]
