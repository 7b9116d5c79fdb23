"""Bad sends and receives: every failure named on every rank involved, and nothing hangs.

- a send whose recv posted another dtype or count fails on both ranks with
  CommMismatch naming both ranks and what each posted, before the deadline (over LSA
  and GIN, a count of one slot and of many);
- a send with no recv, and a recv with no send, end at the deadline with CommTimeout
  naming the rank, the peer and what was awaited; a failure names the group member;
- a peer out of range or the rank itself is a ValueError before anything launches, and
  buffers get the collectives' checks (dtype, contiguity, alignment, read-only);
- afterwards a failed communicator refuses calls.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import close_after_barrier, errors_per_rank

from commref import CommAborted, CommMismatch, CommTimeout, Communicator
from commref.transports.thread_world import ThreadWorld

DEADLINE = 3.0  # every wait's deadline in these tests (Communicator(timeout=...))
TRANSPORTS = {
    "lsa": dict(path="lsa"),
    "gin": dict(path="gin", backend="proxy", wire="ordered"),
    "gin-unordered": dict(path="gin", backend="proxy", wire="unordered"),
}


def _comm(world, transport="lsa") -> Communicator:
    return Communicator(world, "cpu", timeout=DEADLINE, slot_bytes=1024, nsteps=2, **TRANSPORTS[transport])


def _run(body, *args, nranks=2):
    """Each rank's (exception type name, message, seconds) of body(world, comm), or None."""
    return errors_per_rank(nranks, lambda world: _comm(world, *args), body)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize(
    "sent, received, field",
    [
        ((10, "float32"), (40, "int8"), ("dtype", "float32", "int8")),
        ((10, "float32"), (11, "float32"), ("count", 10, 11)),
        ((5000, "int64"), (4999, "int64"), ("count", 5000, 4999)),  # many slots
        ((0, "uint8"), (3, "uint8"), ("count", 0, 3)),
    ],
)
def test_a_mismatched_pair_fails_on_both_ranks(transport, sent, received, field):
    def body(world, comm):
        with comm.group():
            if world.rank == 0:
                comm.send(np.zeros(sent[0], sent[1]), 1)
            else:
                comm.recv(np.zeros(received[0], received[1]), 0)

    (t0, m0, s0), (t1, m1, s1) = _run(body, transport)
    assert t0 == t1 == "CommMismatch", (m0, m1)
    send, recv = f"send of {sent[0]} {sent[1]}", f"recv of {received[0]} {received[1]}"
    name, at0, at1 = field
    assert f"rank 0: {send} to rank 1 does not match rank 1's {recv}: {name} is {at0!r} here and {at1!r} there" in m0
    assert f"rank 1: {recv} from rank 0 does not match rank 0's {send}: {name} is {at1!r} here and {at0!r} there" in m1
    assert m0.startswith(f"group member #0 ({send} to rank 1)"), m0
    assert m1.startswith(f"group member #0 ({recv} from rank 0)"), m1
    assert s0 < DEADLINE and s1 < DEADLINE, (s0, s1)  # found, not timed out


@pytest.mark.parametrize("transport", ["lsa", "gin"])
def test_a_send_without_recv_and_a_recv_without_send_time_out(transport):
    """Rank 0 sends to rank 1 and rank 2 receives from rank 1, which posts nothing."""

    def body(world, comm):
        if world.rank == 0:
            comm.send(np.ones(100, np.int32), 1)
        elif world.rank == 2:
            comm.recv(np.ones(100, np.int32), 1)

    (t0, m0, s0), idle, (t2, m2, s2) = _run(body, transport, nranks=3)
    assert t0 == "CommTimeout" and t2 == "CommTimeout" and idle is None, (m0, m2)
    assert m0.startswith("rank 0: timed out after 3.0 s waiting for peer 1: the receiver to accept a send"), m0
    assert m2.startswith("rank 2: timed out after 3.0 s waiting for peer 1: data of the next step (recv ready)"), m2
    assert DEADLINE <= min(s0, s2) and max(s0, s2) < 4 * DEADLINE, (s0, s2)


def test_a_failure_names_its_group_member():
    """Rank 0: #0 recv from 1 (matched), #1 send to 1 (rank 1 expects another dtype)."""

    def body(world, comm):
        with comm.group():
            if world.rank == 0:
                comm.recv(np.zeros(5, np.int32), 1)
                comm.send(np.zeros(10, np.float32), 1)
            else:
                comm.send(np.zeros(5, np.int32), 0)
                comm.recv(np.zeros(10, np.int32), 0)

    (t0, m0, _), (t1, m1, _) = _run(body)
    assert t0 == t1 == "CommMismatch"
    assert m0.startswith("group member #1 (send of 10 float32 to rank 1): rank 0:"), m0
    assert m1.startswith("group member #1 (recv of 10 int32 from rank 0): rank 1:"), m1


@pytest.mark.parametrize(
    "peer, said",
    [
        (-1, "send peer must be a rank in [0, 3), got -1"),
        (3, "send peer must be a rank in [0, 3), got 3"),
        (1.0, "send peer must be a rank in [0, 3), got 1.0"),
        (True, "send peer must be a rank in [0, 3), got True"),
        ("self", "send peer {r} is this rank"),
    ],
)
def test_bad_peers_raise_before_anything_launches(peer, said):
    def body(world, comm):
        n, r = world.size, world.rank
        with pytest.raises(ValueError) as bad:
            comm.send(np.zeros(4, np.int32), r if peer == "self" else peer)
        with pytest.raises(ValueError):
            with comm.group():
                comm.recv(np.zeros(4, np.int32), (r - 1) % n)
                comm.recv(np.zeros(4, np.int32), r if peer == "self" else peer)
        # nothing launched: the links are where they were, and a ring shift is exact
        y = np.zeros(4, np.int32)
        with comm.group():
            comm.send(np.full(4, r, np.int32), (r + 1) % n)
            comm.recv(y, (r - 1) % n)
        assert (y == (r - 1) % n).all()
        raise ValueError(str(bad.value))

    for r, (kind, message, _) in enumerate(_run(body, nranks=3)):
        assert kind == "ValueError" and message.startswith(f"rank {r}: ") and said.format(r=r) in message, message


@pytest.mark.parametrize(
    "make, kind, said",
    [
        (lambda: np.zeros(8, np.complex64), TypeError, "complex64"),
        (lambda: np.zeros((4, 4), np.float32)[:, 1], ValueError, "must be C-contiguous"),
        (lambda: np.zeros(9, np.float32).view(np.uint8)[1:33].view(np.float32), ValueError, "not aligned"),
        (lambda: [1.0, 2.0], TypeError, "must be a numpy array"),
        (lambda: None, TypeError, "is required"),
    ],
)
def test_bad_buffers_get_the_collectives_checks(make, kind, said):
    def body(world):
        comm = _comm(world)
        messages = []
        for op in (comm.send, comm.recv):
            with pytest.raises(kind) as e:
                op(make(), 1 - world.rank)
            messages.append(str(e.value))
        read_only = np.zeros(4, np.int32)
        read_only.flags.writeable = False
        with pytest.raises(ValueError, match="recvbuf is read-only"):
            comm.recv(read_only, 1 - world.rank)
        close_after_barrier(world, comm)
        return messages

    for r, (send, recv) in enumerate(ThreadWorld.run(2, body, timeout=60)):
        assert send.startswith(f"rank {r}: sendbuf") and said in send, send
        assert recv.startswith(f"rank {r}: recvbuf") and said in recv, recv


def test_a_failed_communicator_refuses_later_calls():
    def body(world, comm):
        with pytest.raises(CommMismatch):
            with comm.group():
                if world.rank == 0:
                    comm.send(np.zeros(3, np.int8), 1)
                else:
                    comm.recv(np.zeros(4, np.int8), 0)
        peer = 1 - world.rank
        theirs = "recv (4 int8)" if world.rank == 0 else "send (3 int8)"
        said = re.escape(f"unusable: an earlier call failed: rank {world.rank}: peer {peer}'s {theirs} does not match")
        with pytest.raises(CommAborted, match=said):
            comm.send(np.zeros(3, np.int8), peer)
        raise CommTimeout("done", rank=world.rank)  # a marker that both got this far

    assert [out[1] for out in _run(body)] == ["done", "done"]
