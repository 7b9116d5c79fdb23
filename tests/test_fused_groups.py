"""Groups fused into one CPU launch (schedule.py, launch_record.FusedLaunch) and the
bench's -m (nccl-tests' agg_iters).

- a group of mixed collectives with sends and receives is one launch
  (Communicator.launches), every member's result exact against numpy;
- a group repeating a kept one on the same arrays goes straight to its kept launch
  (nothing is fused again, nothing checked again: Scheduler.replay), with the extension's
  test and the Python one, and stops doing so when an argument changes: a different
  array, a reshaped one, a freed symmetric window, an equal op that is another object;
- a collective's bad arguments in a group are raised at group_end, naming the member,
  and nothing of the group launches;
- a failing member is named at group_end on every rank, its successors not run (a
  collective, or a send after the collectives);
- a call whose streamStores the tuner times per call cannot join: its group launches
  member by member;
- -m N parses, shows in the header as "agg iters: N", and bad values fail in one line
  with status 2 before any rank starts.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WORLD_TIMEOUT, close_after_barrier

from commref import Communicator, cli
from commref.bench import arguments
from commref.collectives import schedule, tuner
from commref.transports.thread_world import ThreadWorld


def _comm(world, **kw) -> Communicator:
    return Communicator(world, "cpu", timeout=WORLD_TIMEOUT, slot_bytes=1024, nsteps=2, **kw)


def _inputs(rank: int, n: int):
    x = np.arange(12, dtype=np.int64) * (rank + 1)
    f = np.arange(6, dtype=np.float32) + 10 * rank
    return x, f


def test_a_mixed_group_is_one_launch_and_exact():
    def body(world):
        comm = _comm(world)
        r, n = world.rank, world.size
        x, f = _inputs(r, n)
        ar, ag = np.zeros_like(x), np.zeros(6 * n, np.float32)
        rs, bc, rd = np.zeros(12 // n, np.int64), np.zeros_like(x), np.zeros_like(x)
        sent, got = np.full(5, r + 7, np.int32), np.zeros(5, np.int32)
        before = comm.launches
        with comm.group():
            comm.allreduce(x, ar, "sum")
            comm.send(sent, (r + 1) % n)
            comm.allgather(f, ag)
            comm.reduce_scatter(x, rs, "max")
            comm.recv(got, (r - 1) % n)
            comm.broadcast(x, bc, 1)
            comm.reduce(x, rd, "sum", 2)
        launches = comm.launches - before
        close_after_barrier(world, comm)
        return launches, ar, ag, rs, bc, rd, got

    n = 3
    xs, fs = zip(*[_inputs(r, n) for r in range(n)])
    total, biggest = sum(xs), np.maximum.reduce(xs)
    for r, (launches, ar, ag, rs, bc, rd, got) in enumerate(ThreadWorld.run(n, body, timeout=WORLD_TIMEOUT)):
        assert launches == 1
        np.testing.assert_array_equal(ar, total)
        np.testing.assert_array_equal(ag, np.concatenate(fs))
        np.testing.assert_array_equal(rs, biggest[4 * r : 4 * r + 4])
        np.testing.assert_array_equal(bc, xs[1])
        if r == 2:
            np.testing.assert_array_equal(rd, total)
        np.testing.assert_array_equal(got, np.full(5, (r - 1) % n + 7, np.int32))


def _alternating_buffers(rank: int):
    """x, y (int32) and a, b (float64) for _alternating_groups on `rank`."""
    x, y = np.full(4, rank + 1, np.int32), np.zeros(4, np.int32)
    return x, y, np.arange(8, dtype=np.float64) + rank, np.zeros(16, np.float64)


def _alternating_groups(comm, armed: dict, arm_from: int, x, y, a, b, rounds: int = 5) -> list:
    """Two groups alternating for `rounds` rounds (8 AllReduces of x into y; a max
    AllReduce of x into y and an AllGather of a into b), `armed[rank]` true from round
    `arm_from` on and false after: per round the launches both took, the groups kept,
    y's sum and b's sum."""
    out = []
    for i in range(rounds):
        armed[comm.rank] = i >= arm_from
        before = comm.launches
        with comm.group():
            for _ in range(8):
                comm.allreduce(x, y)
        with comm.group():
            comm.allreduce(x, y, "max")
            comm.allgather(a, b)
        out.append((comm.launches - before, comm.kept_groups, int(y.sum()), float(b.sum())))
    armed[comm.rank] = False
    return out


def test_a_repeated_group_goes_straight_to_its_kept_launch(monkeypatch):
    """Eight calls on the same arrays (as -m 8 posts them), then distinct calls: after
    the groups are kept, repeating them fuses nothing (Scheduler.fuse would raise), one
    launch each, results exact."""
    fuse = schedule.Scheduler.fuse
    armed = {}

    def guarded(self, calls):
        if armed.get(self.comm.rank):
            raise AssertionError("a repeated group was fused again")
        return fuse(self, calls)

    monkeypatch.setattr(schedule.Scheduler, "fuse", guarded)

    def body(world):
        comm = _comm(world)
        out = _alternating_groups(comm, armed, 3, *_alternating_buffers(world.rank))
        close_after_barrier(world, comm)
        return out

    for out in ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT):
        assert [o[0] for o in out] == [2] * 5
        assert out[-1][1] == out[-2][1] <= schedule.REPEATED_GROUPS
        assert all(o[2:] == (8, 2 * sum(range(8)) + 8) for o in out)


@pytest.mark.parametrize("binding", ["extension", "ctypes"])
def test_a_repeating_group_replays_its_kept_launch_unchecked(binding, monkeypatch):
    """Two groups alternating (so each is looked up by its first sendbuf, not only the
    last): once kept, they run without a member checked again (Communicator._resolve
    would raise), one launch each, exact; an op equal to the kept one but another object,
    and an array reshaped in place, are checked again and stay exact."""
    monkeypatch.setenv("COMMREF_CPU_BINDING", "ctypes" if binding == "ctypes" else "auto")
    resolve = Communicator._resolve
    armed = {}

    def guarded(self, *given):
        if armed.get(self.rank):
            raise AssertionError("a repeating group's member was checked again")
        return resolve(self, *given)

    monkeypatch.setattr(Communicator, "_resolve", guarded)

    def body(world):
        comm = _comm(world)
        x, y, a, b = _alternating_buffers(world.rank)
        out = [(n, ys, bs) for n, _, ys, bs in _alternating_groups(comm, armed, 2, x, y, a, b)]
        anew = "".join(["m", "ax"])
        with comm.group():
            comm.allreduce(x, y, anew)
            comm.allgather(a, b)
        out.append((None, int(y.sum()), float(b.sum())))
        y.shape = (2, 2)
        with comm.group():
            for _ in range(8):
                comm.allreduce(x, y)
        out.append((None, int(y.sum()), None))
        close_after_barrier(world, comm)
        return out

    for out in ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT):
        assert [o[0] for o in out[:5]] == [2] * 5
        assert all(o[1:] == (8, 2 * sum(range(8)) + 8) for o in out[:6])
        assert out[6][1] == 12  # 3 per element: the sum, into the reshaped recvbuf


def test_bad_arguments_in_a_group_raise_at_group_end_and_launch_nothing():
    """A collective's arguments in a group are checked when the group ends: a recvbuf of
    the wrong size raises there, naming the member, on a new group and on one that
    repeats a kept group; no member launched (the first one's output is untouched)."""

    def body(world):
        comm = _comm(world)
        r = world.rank
        x, y = np.full(4, r + 1, np.int32), np.zeros(4, np.int32)
        messages = []
        for repeat in (False, True):
            for _ in range(2 if repeat else 0):  # kept, then repeated
                with comm.group():
                    comm.allreduce(x, y)
                    comm.allreduce(x, y, "max")
            y[:] = -1
            before = comm.launches
            try:
                with comm.group():
                    comm.allreduce(x, y)
                    comm.allreduce(x, np.zeros(5, np.int32), "max")
                messages.append(None)
            except ValueError as e:
                messages.append(str(e))
            messages.append((comm.launches - before, int(y.sum())))
        close_after_barrier(world, comm)
        return messages

    for r, messages in enumerate(ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT)):
        for message, (launched, untouched) in zip(messages[::2], messages[1::2]):
            assert message is not None and message.startswith(f"group member #1 (allreduce of 4 int32): rank {r}: ")
            assert launched == 0 and untouched == -4, (launched, untouched)


def test_a_changed_buffer_leaves_the_kept_group():
    """A different array, a reshaped array and a freed symmetric window each make the next
    group a new one (fused afresh: exact on the new buffers); alloc and free drop every
    kept group."""

    def body(world):
        comm = _comm(world)
        r = world.rank
        x, y = np.full(6, r + 1, np.int64), np.zeros(6, np.int64)

        def group(send, recv):
            with comm.group():
                comm.allreduce(send, recv)
                comm.allreduce(send, recv, "max")
            return recv.copy()

        seen = [group(x, y), group(x, y)]
        kept = comm.kept_groups
        z = np.zeros(6, np.int64)
        seen.append(group(x, z))  # a different recvbuf
        y2 = y.reshape(2, 3)
        seen.append(group(x.reshape(2, 3), y2).reshape(-1))  # the same memory, reshaped: other arrays
        grown = comm.kept_groups
        s = comm.alloc_symmetric(6, "int64")
        after_alloc = comm.kept_groups
        s[...] = r + 10
        seen.append(group(s, s))  # in place on a symmetric window: direct kernels
        seen.append(group(s, s))
        comm.free_symmetric(s)
        after_free = comm.kept_groups
        seen.append(group(x, y))
        close_after_barrier(world, comm)
        return kept, grown, after_alloc, after_free, seen

    for kept, grown, after_alloc, after_free, seen in ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT):
        assert kept >= 1 and grown > kept and after_alloc == 0 and after_free == 0
        for got in seen[:4] + seen[-1:]:  # the sum (3), then the max of the inputs (2), into recvbuf
            np.testing.assert_array_equal(got, np.full(6, 2))
        np.testing.assert_array_equal(seen[4], np.full(6, 21))  # in place: 10 + 11, then the max of 21 and 21
        np.testing.assert_array_equal(seen[5], np.full(6, 42))


def test_a_failing_member_is_named_and_its_successors_not_run():
    """Member #2 differs between the ranks (its op): both ranks raise CommMismatch at
    group_end naming it; members #0 and #1 ran, member #3 did not. (A group of
    AllReduces alone would pack into one call on the rank where they agree:
    test_packed_groups.py names that failure.)"""

    def body(world):
        comm = Communicator(world, "cpu", timeout=3.0)
        r = world.rank
        x = np.ones(4, np.int32)
        first, second, last = np.zeros(4, np.int32), np.zeros(8, np.int32), np.zeros(4, np.int32)
        try:
            with comm.group():
                comm.allreduce(x, first)
                comm.allgather(x, second)
                comm.allreduce(x, np.zeros(4, np.int32), "sum" if r == 0 else "max")
                comm.allreduce(x, last)
            message = None
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
        world.barrier(what="test done", timeout=30)
        comm.close()
        return message, int(first.sum()), int(second.sum()), int(last.sum())

    for r, (message, first, second, last) in enumerate(ThreadWorld.run(2, body, timeout=60)):
        assert message.startswith(f"CommMismatch: group member #2 (allreduce of 4 int32): rank {r}:"), message
        assert (first, second, last) == (8, 8, 0)


def test_agg_iters_parses_and_shows_in_the_header(capsys):
    args = arguments.build_parser().parse_args(["all_reduce", "-m", "8"])
    assert args.agg_iters == 8
    assert arguments.build_parser().parse_args(["all_reduce", "--agg_iters", "1024"]).agg_iters == 1024
    assert arguments.build_parser().parse_args(["all_reduce"]).agg_iters == 1
    argv = ["bench", "all_reduce", "-b", "64", "-e", "64", "-t", "2", "-m", "4", "-n", "2", "-w", "1"]
    assert cli.main([*argv, "--no-baseline", "--no-bound"]) == 0
    out = capsys.readouterr().out
    assert "agg iters: 4 " in out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["64"])
    assert row.split()[8] == "0" and row.split()[12] == "0", row  # #wrong out of place and in place


@pytest.mark.parametrize(
    "value, message",
    [("0", "must be in [1, 1024], got 0"), ("1025", "must be in [1, 1024], got 1025"), ("x", "must be an integer")],
)
def test_bad_agg_iters_is_one_line_and_status_2(capsys, value, message):
    assert cli.main(["bench", "all_reduce", "--np", "2", "-m", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("commref bench: error: argument -m/--agg_iters: ") and err.count("\n") == 1, err
    assert message in err


def test_validate_refuses_agg_iters_built_by_hand():
    args = arguments.build_parser().parse_args(["all_reduce"])
    args.agg_iters = 0
    with pytest.raises(ValueError, match=r"-m must be in \[1, 1024\], got 0"):
        arguments.validate(args)


def test_a_failing_send_after_fused_collectives_is_named():
    """The sends and receives run last in the fused launch: a recv whose count differs
    from its send fails there on both ranks, named (member #1), after member #0 ran."""

    def body(world):
        comm = Communicator(world, "cpu", timeout=3.0)
        r, peer = world.rank, 1 - world.rank
        x, y = np.ones(4, np.int32), np.zeros(4, np.int32)
        try:
            with comm.group():
                comm.allreduce(x, y)
                if r == 0:
                    comm.send(np.ones(10, np.float32), peer)
                else:
                    comm.recv(np.zeros(11, np.float32), peer)
            message = None
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
        world.barrier(what="test done", timeout=30)
        comm.close()
        return message, int(y.sum())

    (m0, y0), (m1, y1) = ThreadWorld.run(2, body, timeout=60)
    assert m0.startswith("CommMismatch: group member #1 (send of 10 float32 to rank 1): rank 0:"), m0
    assert m1.startswith("CommMismatch: group member #1 (recv of 11 float32 from rank 0): rank 1:"), m1
    assert y0 == y1 == 8


def test_a_call_whose_stores_are_timed_launches_alone():
    """A call large enough for the tuner to time its streamStores per call cannot join a
    fused launch: that group's members launch one by one, exact."""

    def body(world):
        comm = _comm(world, stream_stores="auto")
        big = tuner.STORE_CHOOSER_MIN_BYTES // 8
        x, y = np.full(big, world.rank + 1, np.int64), np.zeros(big, np.int64)
        a, b = np.ones(3, np.int32), np.zeros(3, np.int32)
        before = comm.launches
        with comm.group():
            comm.allreduce(a, b)
            comm.allreduce(x, y)
        launches, kept = comm.launches - before, comm.kept_groups
        close_after_barrier(world, comm)
        return launches, kept, int(b.sum()), bool((y == 3).all())

    assert ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT) == [(2, 0, 6, True)] * 2


def test_a_fused_groups_sends_are_zero_copy_in_one_block():
    """A fused group's sends and receives take the table a group of sends alone takes
    (p2p.P2pLauncher.prepare: zero copy from a symmetric window, one block for a small
    group): one launch, exact, the send's window named."""
    seen = []
    real = schedule.P2pLauncher.prepare

    def spy(self, calls):
        got = real(self, calls)
        seen.append((int(got[0]["symWindow"][[c.kind == "send" for c in calls]].min()), got[1]))
        return got

    def body(world):
        comm = Communicator(world, "cpu", path="lsa", timeout=WORLD_TIMEOUT, slot_bytes=1024, nsteps=2)
        r, n = world.rank, world.size
        x, ar = np.arange(8, dtype=np.int64) + r, np.zeros(8, np.int64)
        sent, got = comm.alloc_symmetric(3000, np.float32), np.zeros(3000, np.float32)
        sent[...] = r + 0.5
        before = comm.launches
        with comm.group():
            comm.allreduce(x, ar, "sum")
            comm.send(sent, (r + 1) % n)
            comm.recv(got, (r - 1) % n)
        launches = comm.launches - before
        comm.free_symmetric(sent)
        close_after_barrier(world, comm)
        return launches, ar, got

    n = 2
    mp = pytest.MonkeyPatch()
    mp.setattr(schedule.P2pLauncher, "prepare", spy)
    try:
        results = ThreadWorld.run(n, body, timeout=WORLD_TIMEOUT)
    finally:
        mp.undo()
    assert seen and all(window > 0 and nblocks == 1 for window, nblocks in seen), seen
    for r, (launches, ar, got) in enumerate(results):
        assert launches == 1
        np.testing.assert_array_equal(ar, sum(np.arange(8, dtype=np.int64) + q for q in range(n)))
        np.testing.assert_array_equal(got, np.full(3000, (r - 1) % n + 0.5, np.float32))
