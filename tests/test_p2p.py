"""Communicator.send and recv (nccl4py's names and argument order), in groups.

- exact on random bytes (every bit pattern of every dtype) at 2, 3 and 5 ranks over
  LSA and over GIN on every backend and wire: a ring shift in a group, an all-pairs
  exchange posted in random order in one group, count 0, a count spanning many FIFO
  slots, several dtypes, and the same communicator's groups again (the p2p links'
  step counters persist) between collectives on it;
- a single send and recv outside a group (a group of one each);
- under mpiexec: the same ring shift and all-pairs exchange as mpi4py's Sendrecv moves
  them, compared byte for byte.
"""

from __future__ import annotations

import os
import re
import sys

import numpy as np

from commref import Communicator

# ---------------------------------------------------------------------------------------
# the MPI job (this file run under mpiexec): commref's send/recv against mpi4py's Sendrecv
# ---------------------------------------------------------------------------------------


def _payload(seed: int, src: int, dst: int, count: int, dtype: str) -> np.ndarray:
    """Random bytes (any bit pattern) that rank `src` sends rank `dst`, as `dtype`."""
    from commref.collectives.verify import DTYPES

    dt = np.dtype(DTYPES[dtype])
    raw = np.random.default_rng([seed, src, dst, count]).integers(0, 256, count * dt.itemsize, dtype=np.uint8)
    return raw.view(dt)


def _mpi_main() -> None:
    from mpi4py import MPI

    from commref.transports.mpi_world import MPIWorld

    world = MPIWorld()
    mpi, n, r = MPI.COMM_WORLD, world.size, world.rank
    for path in ("lsa", "gin"):
        extra = {"network": "mpi"} if path == "gin" else {}
        with Communicator(world, "cpu", path=path, slot_bytes=4096, **extra) as comm:
            same = True
            for count, dtype in ((0, "float32"), (1000, "float64"), (70_001, "int8")):
                x = _payload(5, r, (r + 1) % n, count, dtype)
                mine, theirs = np.zeros_like(x), np.zeros_like(x)
                with comm.group():
                    comm.send(x, (r + 1) % n)
                    comm.recv(mine, (r - 1) % n)
                mpi.Sendrecv(x.view(np.uint8), (r + 1) % n, recvbuf=theirs.view(np.uint8), source=(r - 1) % n)
                same &= (
                    mine.tobytes() == theirs.tobytes()
                    and theirs.tobytes() == _payload(5, (r - 1) % n, r, count, dtype).tobytes()
                )
            # all pairs, each rank posting in its own order
            peers = [p for p in range(n) if p != r]
            np.random.default_rng(r).shuffle(peers)
            got = {p: np.zeros(513, np.int32) for p in peers}
            with comm.group():
                for p in peers:
                    comm.recv(got[p], p)
                    comm.send(_payload(6, r, p, 513, "int32"), p)
            for p in peers:
                ref = np.zeros(513, np.int32)
                mpi.Sendrecv(_payload(6, r, p, 513, "int32"), p, recvbuf=ref, source=p)
                same &= got[p].tobytes() == ref.tobytes()
            sys.stdout.write(f"rank {r}: {path} same as mpi4py {same}\n")  # one write: the ranks share stdout
            sys.stdout.flush()


if __name__ == "__main__":
    _mpi_main()
    sys.exit(0)


# ---------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------

import pytest  # noqa: E402
from conftest import clean_env, run_mpi  # noqa: E402
from helpers import WORLD_TIMEOUT, close_after_barrier  # noqa: E402

from commref.transports.thread_world import ThreadWorld  # noqa: E402

# (path and GIN options): LSA, and GIN on every backend and wire it runs on (gda has
# weak signals only: its connections count a signal per put).
TRANSPORTS = {
    "lsa": dict(path="lsa"),
    "proxy-ordered": dict(path="gin", backend="proxy", wire="ordered"),
    "proxy-unordered": dict(path="gin", backend="proxy", wire="unordered"),
    "rc-ordered": dict(path="gin", backend="rc", wire="ordered"),
    "gda-ordered": dict(path="gin", backend="gda", wire="ordered", gin_protocol="signal-per-put"),
    "gda-unordered": dict(path="gin", backend="gda", wire="unordered", gin_protocol="signal-per-put"),
}
# Small slots, so that a few thousand elements span many slots (and wrap the FIFOs).
SLOT = dict(slot_bytes=1024, nsteps=2)
CASES = [(0, "float32"), (1, "int8"), (777, "bfloat16"), (5000, "float64"), (12_345, "uint8"), (3001, "float16")]


def _comm(world, transport: str) -> Communicator:
    return Communicator(world, "cpu", timeout=WORLD_TIMEOUT, **TRANSPORTS[transport], **SLOT)


def _ring_shift_and_all_pairs(world, transport: str, seed: int):
    """Every case as a ring shift in a group, then an all-pairs exchange of every case
    posted in random order in one group, twice, with an allreduce between; returns the
    cases (and pairs) that arrived wrong."""
    comm = _comm(world, transport)
    n, r = world.size, world.rank
    wrong = []
    for count, dtype in CASES:
        x = _payload(seed, r, (r + 1) % n, count, dtype)
        y = np.zeros_like(x)
        with comm.group():
            comm.send(x, (r + 1) % n)
            comm.recv(y, (r - 1) % n)
        if y.tobytes() != _payload(seed, (r - 1) % n, r, count, dtype).tobytes():
            wrong.append(("shift", count, dtype))
    rng = np.random.default_rng([seed, r])
    for round_ in range(2):
        # Interleaved at random; a peer's sends (and receives) keep their order, which
        # is how a group matches several operations between the same two ranks.
        slots = [(kind, p) for p in range(n) if p != r for kind in ("send", "recv") for _ in CASES[1:4]]
        rng.shuffle(slots)
        posted: dict = {}
        ops = []
        for kind, p in slots:
            k = posted[kind, p] = posted.get((kind, p), -1) + 1
            ops.append((kind, p, CASES[1 + k]))
        got = {}
        with comm.group():
            for kind, p, (count, dtype) in ops:
                if kind == "send":
                    comm.send(_payload(seed + round_, r, p, count, dtype), p)
                else:
                    got[p, count] = np.zeros_like(_payload(0, 0, 0, count, dtype))
                    comm.recv(got[p, count], p)
        for (p, count), y in got.items():
            dtype = next(d for c, d in CASES if c == count)
            if y.tobytes() != _payload(seed + round_, p, r, count, dtype).tobytes():
                wrong.append(("pairs", round_, p, count))
        z = np.zeros(8, np.int64)
        comm.allreduce(np.full(8, r + 1, np.int64), z)
        if not (z == n * (n + 1) // 2).all():
            wrong.append(("allreduce", round_))
    close_after_barrier(world, comm)
    return wrong


@pytest.mark.parametrize("nranks", [2, 3, 5])
@pytest.mark.parametrize("transport", ["lsa", "proxy-unordered"])
def test_exact_at_2_3_5_ranks(transport, nranks):
    assert ThreadWorld.run(nranks, _ring_shift_and_all_pairs, transport, 7, timeout=WORLD_TIMEOUT) == [[]] * nranks


@pytest.mark.parametrize("transport", ["proxy-ordered", "rc-ordered", "gda-ordered", "gda-unordered"])
def test_exact_on_every_gin_backend_and_wire(transport):
    assert ThreadWorld.run(3, _ring_shift_and_all_pairs, transport, 8, timeout=WORLD_TIMEOUT) == [[]] * 3


def test_a_wrong_byte_would_show():
    """The comparison the exactness tests make sees a single flipped bit."""
    x = _payload(1, 0, 1, 777, "bfloat16")
    y = x.copy()
    y.view(np.uint8)[100] ^= 1
    assert x.tobytes() != y.tobytes() and x.tobytes() == x.copy().tobytes()
    assert _payload(1, 0, 1, 777, "bfloat16").tobytes() != _payload(1, 1, 0, 777, "bfloat16").tobytes()


@pytest.mark.parametrize("transport", ["lsa", "proxy-ordered"])
def test_single_send_and_recv_outside_a_group(transport):
    def body(world):
        comm = _comm(world, transport)
        x = np.arange(10_000, dtype=np.int32)
        y = np.zeros_like(x)
        if world.rank == 0:
            comm.send(x, 1)
            comm.recv(y, 1)
        else:
            comm.recv(y, 0)
            comm.send(y, 0)
        close_after_barrier(world, comm)
        return bool((y == x).all())

    assert ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT) == [True, True]


def test_the_p2p_links_are_their_own_channels():
    """Window channels after the collectives' (a link per peer, four per channel), and
    the link of s -> r, d = (r - s) mod n, is channel max_channels + (d - 1) // 4, link
    (d - 1) % 4 at both ends."""
    from commref.collectives.p2p import P2pCall, link
    from commref.device_kernels import abi

    assert [abi.p2p_channels(n) for n in (1, 2, 5, 6, 9, 64)] == [0, 1, 1, 2, 2, 16]
    for n in (2, 5, 9):
        for s in range(n):
            for r in range(n):
                if r != s:
                    at_s = link(s, n, 3, P2pCall("send", r, None))
                    at_r = link(r, n, 3, P2pCall("recv", s, None))
                    d = (r - s) % n
                    assert at_s == at_r == (3 + (d - 1) // 4, (d - 1) % 4)


@pytest.mark.mpi
def test_under_mpiexec_same_bytes_as_mpi4py_sendrecv(shm_leak_check):
    root = os.path.dirname(os.path.dirname(__file__))
    proc = run_mpi(3, [os.path.relpath(__file__, root)], timeout=180, env=clean_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    wanted = {f"rank {rank}: {path} same as mpi4py True" for rank in range(3) for path in ("lsa", "gin")}
    said = set(re.findall(r"rank \d: (?:lsa|gin) same as mpi4py (?:True|False)", proc.stdout))
    assert said == wanted, (proc.stdout + proc.stderr)[-4000:]
