"""Groups (ncclGroupStart / ncclGroupEnd): comm.group_start / group_end / group() and
commref.group_start / group_end / group(), one thread's group over every communicator.

- nesting counts as NCCL's: only the outermost group_end launches (the data is not
  there before it); group_end without group_start raises;
- a group over two communicators, posted in opposite orders on the two ranks;
- mixed groups: collectives recorded and launched at group_end with sends and receives
  in one group, exact, in either order of posting;
- an exception leaving `with group():` launches nothing.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from helpers import WORLD_TIMEOUT, close_after_barrier

import commref
from commref import Communicator
from commref.collectives.groups import grouping
from commref.transports.thread_world import ThreadWorld


def _comm(world, **kw) -> Communicator:
    return Communicator(world, "cpu", timeout=WORLD_TIMEOUT, slot_bytes=1024, nsteps=2, **kw)


def test_nested_groups_launch_at_the_outermost_end():
    def body(world):
        comm = _comm(world)
        n, r = world.size, world.rank
        x = np.arange(5000, dtype=np.int64) + 10_000 * r
        y = np.zeros_like(x)
        seen = []
        with commref.group():
            comm.group_start()
            comm.send(x, (r + 1) % n)
            comm.group_end()  # inner: records only
            seen.append(int(y.any()))
            with comm.group():
                comm.recv(y, (r - 1) % n)
            seen.append(int(y.any()))
        seen.append(bool((y == np.arange(5000, dtype=np.int64) + 10_000 * ((r - 1) % n)).all()))
        close_after_barrier(world, comm)
        return seen

    assert ThreadWorld.run(3, body, timeout=WORLD_TIMEOUT) == [[0, 0, True]] * 3


def test_group_end_without_group_start_raises():
    with pytest.raises(RuntimeError, match=r"group_end\(\) without a matching group_start\(\)"):
        commref.group_end()
    commref.group_start()
    commref.group_end()  # an empty group launches nothing
    with pytest.raises(RuntimeError, match="without a matching group_start"):
        Communicator.group_end()


def test_a_group_over_two_communicators_in_opposite_orders():
    """Rank 0 posts on comm a then b, rank 1 on b then a: a group's communicators run
    concurrently, so neither waits for the other."""

    def body(world):
        a, b = _comm(world), _comm(world, path="gin")
        peer = 1 - world.rank
        xs = [np.full(3000, 10 * world.rank + k, np.float32) for k in range(2)]
        ys = [np.zeros(3000, np.float32) for _ in range(2)]
        order = [(a, 0), (b, 1)] if world.rank == 0 else [(b, 1), (a, 0)]
        with commref.group():
            for comm, k in order:
                comm.send(xs[k], peer)
                comm.recv(ys[k], peer)
        close_after_barrier(world, b)
        close_after_barrier(world, a)
        return [float(y[0]) for y in ys] + [bool((y == y[0]).all()) for y in ys]

    assert ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT) == [[10.0, 11.0, True, True], [0.0, 1.0, True, True]]


@pytest.mark.parametrize("path", ["lsa", "gin"])
@pytest.mark.parametrize("p2p_first", [True, False])
def test_mixed_groups_of_collectives_and_p2p(path, p2p_first):
    """allreduce, a ring shift, allgather in one group (the p2p calls first on some
    ranks, last on others), three times on one communicator: every result exact."""

    def body(world):
        comm = _comm(world, path=path)
        n, r = world.size, world.rank
        results = []
        for k in range(3):
            x = np.arange(999, dtype=np.int32) * (r + 1) + k
            s, g = np.zeros_like(x), np.zeros(n * 7, np.float64)
            sent, got = np.arange(4321, dtype=np.uint8) ^ r, np.zeros(4321, np.uint8)

            def p2p():
                comm.recv(got, (r - 1) % n)
                comm.send(sent, (r + 1) % n)

            with comm.group():
                if p2p_first == (r % 2 == 0):
                    p2p()
                comm.allreduce(x, s)
                comm.allgather(np.full(7, r + k, np.float64), g)
                if p2p_first != (r % 2 == 0):
                    p2p()
            want = np.arange(999, dtype=np.int32) * (n * (n + 1) // 2) + n * k
            results.append(
                bool((s == want).all())
                and bool((g == np.repeat(np.arange(n, dtype=np.float64) + k, 7)).all())
                and bool((got == (np.arange(4321, dtype=np.uint8) ^ ((r - 1) % n))).all())
            )
        close_after_barrier(world, comm)
        return results

    assert ThreadWorld.run(3, body, timeout=WORLD_TIMEOUT) == [[True] * 3] * 3


def test_an_exception_in_a_group_launches_nothing():
    def body(world):
        comm = _comm(world)
        y = np.zeros(10, np.int32)
        with pytest.raises(ZeroDivisionError):
            with commref.group():
                comm.send(np.ones(10, np.int32), 1 - world.rank)
                comm.recv(y, 1 - world.rank)
                1 / 0
        # nothing was launched, nothing is left recorded: the next group starts afresh
        z = np.zeros(10, np.int32)
        with comm.group():
            comm.send(np.full(10, world.rank + 5, np.int32), 1 - world.rank)
            comm.recv(z, 1 - world.rank)
        close_after_barrier(world, comm)
        return int(y.sum()), int(z[0]), grouping()

    assert ThreadWorld.run(2, body, timeout=WORLD_TIMEOUT) == [(0, 6, False), (0, 5, False)]


def test_a_collective_that_fails_in_a_group_is_named():
    """Member #1, an allreduce whose count differs between the ranks, fails on both at
    group_end, named; member #0, a matched exchange, arrived."""

    def body(world):
        comm = Communicator(world, "cpu", timeout=3.0)
        peer, y = 1 - world.rank, np.zeros(6, np.uint32)
        try:
            with comm.group():
                comm.send(np.full(6, world.rank + 1, np.uint32), peer)
                comm.allreduce(np.ones(4 + world.rank, np.int32), np.zeros(4 + world.rank, np.int32))
                comm.recv(y, peer)
            message = None
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
        world.barrier(what="test done", timeout=30)
        comm.close()
        return message, int(y[0])

    for rank, (message, got) in enumerate(ThreadWorld.run(2, body, timeout=60)):
        assert message.startswith(f"CommMismatch: group member #1 (allreduce of {4 + rank} int32): rank {rank}:"), (
            message
        )
        assert "count is" in message, message
        assert got == 0  # the communicator's sends and receives launch after its collectives: not reached


# Each collective method's call forms: recorded by the extension's Recorder, or answered
# by the method (a positional argument given again by keyword, a missing or unknown one).
_FORMS = {
    "allreduce": [(), ("max",), {"op": "max"}, ("min", {"stream": None, "algorithm": "ring", "protocol": "simple"})],
    "reduce_scatter": [(), ("prod",), {"protocol": "ll"}],
    "allgather": [(), {"algorithm": "ring"}],
    "broadcast": [(1,), {"root": 1}, (1, {"protocol": "ll128"})],
    "reduce": [(), ("max", 1), ("max", {"root": 1}), {"op": "max", "root": 1}],
    "alltoall": [(), {"algorithm": "direct", "stream": None}],
}
_BAD_FORMS = [("allreduce", ("max",), {"op": "max"}), ("allgather", ("sum",), {}), ("broadcast", (), {"bogus": 1})]


def _split(form) -> tuple[tuple, dict]:
    if isinstance(form, dict):
        return (), form
    if form and isinstance(form[-1], dict):
        return form[:-1], form[-1]
    return form, {}


def test_a_call_recorded_in_c_is_the_record_the_method_makes():
    """On the CPU engine a group records a collective through commref_pycall.Recorder
    (communicator.record_in_c); its record must be, object for object, the one the
    Python method makes (Communicator._collective), for every method and call form, and
    a bad form must raise the method's own TypeError."""
    from commref.collectives import communicator, groups
    from commref.device_kernels import cpu_loader

    assert cpu_loader.pycall() is not None, "the commref_pycall extension must build here"

    def record(call, *args, **kwargs) -> tuple:
        with pytest.raises(KeyboardInterrupt), commref.group():  # left by an exception: nothing launches
            call(*args, **kwargs)
            calls, schedulers = groups.state.open.calls, groups.state.open.schedulers
            assert len(calls) == len(schedulers) == 1
            got = (calls[0], schedulers[0])
            raise KeyboardInterrupt
        return got

    def body(world):
        comm = _comm(world)
        s, r = np.ones(4, np.float32), np.zeros(4, np.float32)
        for name, forms in _FORMS.items():
            recorder, method = getattr(comm, name), getattr(Communicator, name)
            assert type(recorder).__name__ == "Recorder" and recorder.__wrapped__ == method.__get__(comm)
            assert inspect.signature(recorder) == inspect.signature(recorder.__wrapped__)
            assert recorder.__doc__ == method.__doc__ and recorder.__name__ == name
            for form in forms:
                args, kwargs = _split(form)
                (c_record, c_sched), (py_record, py_sched) = (
                    record(recorder, s, r, *args, **kwargs),
                    record(method, comm, s, r, *args, **kwargs),
                )
                assert len(c_record) == len(py_record) and c_sched is py_sched, (name, form)
                assert all(a is b for a, b in zip(c_record, py_record)), (name, form, c_record, py_record)
        for name, args, kwargs in _BAD_FORMS:
            errors = []
            for call, first in ((getattr(comm, name), ()), (getattr(Communicator, name), (comm,))):
                with pytest.raises(KeyboardInterrupt), commref.group():
                    with pytest.raises(TypeError) as e:
                        call(*first, s, r, *args, **kwargs)
                    errors.append(str(e.value).split(": ", 1)[-1])
                    assert groups.state.open.calls == []
                    raise KeyboardInterrupt
            assert errors[0] == errors[1], (name, errors)
        comm.close()
        return [name in comm.__dict__ for name in communicator.RECORDED]  # close() drops the recorders

    assert ThreadWorld.run(1, body, timeout=WORLD_TIMEOUT) == [[False] * len(communicator.RECORDED)]


def _scope_log(scope, monkeypatch) -> list:
    """What ``with scope:`` does (groups._Group or commref_pycall.GroupScope) in nested,
    mixed, failing and broken groups, as a log of launches and errors."""
    from commref.collectives import groups

    log: list = []

    def launch(schedulers, calls):
        log.append(("launch", list(schedulers), list(calls)))
        if "boom" in calls:
            raise ValueError("a member failed")

    monkeypatch.setattr(groups, "launch", launch)  # what _Group calls; GroupScope was given it

    def member(name):
        groups.state.open.calls.append(name)
        groups.state.open.schedulers.append("s")

    with scope:
        member("a")
        with scope:
            member("b")
        log.append(("inner closed", groups.state.open.depth))
        groups.group_start()
        member("c")
        groups.group_end()
    log.append(("open", groups.state.open))
    with pytest.raises(ZeroDivisionError), scope:
        member("d")
        1 / 0
    log.append(("open", groups.state.open))
    with pytest.raises(ValueError, match="a member failed"), scope:
        member("boom")
    log.append(("open", groups.state.open))
    with pytest.raises(RuntimeError, match=r"group_end\(\) without a matching group_start\(\)"), scope:
        member("e")
        groups.group_end()  # closes (and launches) the group the block opened
    log.append(("open", groups.state.open))
    groups.group_start()  # a group that group_start opened, entered and left by the scope
    with scope:
        member("f")
    log.append(("depth", groups.state.open.depth))
    groups.group_end()
    return log


def test_the_c_group_scope_does_what_the_python_one_does(monkeypatch):
    """commref_pycall.GroupScope (``with group():`` once a CPU communicator loaded the
    extension) must nest, launch, refuse and fail exactly as groups._Group does."""
    from commref.collectives import groups
    from commref.device_kernels import cpu_loader

    extension = cpu_loader.pycall()
    assert extension is not None, "the commref_pycall extension must build here"
    logs = []
    for make in (lambda launch: groups._Group(), lambda launch: extension.GroupScope(groups.state, launch)):
        with monkeypatch.context() as m:
            calls = []
            scope = make(lambda s, c: calls.append(None) or groups.launch(s, c))
            logs.append(_scope_log(scope, m))
    assert logs[0] == logs[1], logs
    assert logs[0][0] == ("inner closed", 1) and logs[0][1][0] == "launch"
    assert ("launch", ["s"] * 3, ["a", "b", "c"]) in logs[0]
    assert not any(entry[0] == "launch" and "d" in entry[2] for entry in logs[0])  # the exception: nothing launched
