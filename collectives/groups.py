"""Groups (NCCL's ncclGroupStart / ncclGroupEnd, nccl4py's ``with nccl.group():``).

A group belongs to the calling thread (each rank of a ThreadWorld is a thread), as
NCCL's does, and spans every communicator: ``group_start()`` / ``group_end()`` (also
Communicator.group_start / group_end, the same functions) nest, and only the outermost
group_end launches. Between them a call is checked and recorded (management), not run;
a call outside a group is a group of one and runs at once.

At the outermost group_end each communicator's members launch on its scheduler
(schedule.Scheduler.launch): its collectives one launch each, in call order, then all
of its sends and receives in one launch (p2p.py), so that sends and receives posted in
any order on any rank cannot wait on each other. Several communicators' members run
concurrently, one thread each, as NCCL's kernels on several communicators do, so their
order may differ between ranks. A failure is raised at group_end naming the member: its
index among the group's calls, the call, and its peer; a communicator's members after
its failed one are not launched. An exception leaving ``with group():`` ends the group
without launching anything.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from commref.transports.errors import CommTimeout


class _GroupState(threading.local):
    """This thread's group: `depth`, its nesting (0: none); `members`, [(scheduler, call)].
    Class defaults, so that reading `depth` in a thread that never grouped is a plain
    attribute lookup (a missing attribute of a threading.local costs ~0.7 us, as much as
    a tenth of an 8-byte collective on the CPU engine)."""

    depth = 0
    members: list = []


_state = _GroupState()


def grouping() -> bool:
    """Whether this thread is inside a group (calls are recorded, not run)."""
    return _state.depth > 0


def group_start() -> None:
    """ncclGroupStart: calls until the matching group_end are recorded; nests."""
    if not grouping():
        _state.depth, _state.members = 0, []
    _state.depth += 1


def group_end() -> None:
    """ncclGroupEnd: the outermost one launches every recorded call (the module
    docstring); RuntimeError without a group_start."""
    if not grouping():
        raise RuntimeError("group_end() without a matching group_start()")
    _state.depth -= 1
    if _state.depth:
        return
    members, _state.members = _state.members, []
    launch(members)


@contextmanager
def group():
    """``with group():`` is group_start() ... group_end()."""
    group_start()
    try:
        yield
    except BaseException:
        _state.depth -= 1
        if not _state.depth:
            _state.members = []
        raise
    group_end()


def submit(scheduler, call) -> None:
    """Runs `call` (calls.Call or p2p.P2pCall) on `scheduler`, or records it in this
    thread's group as its member number `call.group_index`."""
    if grouping():
        call.group_index = len(_state.members)
        _state.members.append((scheduler, call))
    else:
        scheduler.launch([call])


def launch(members: list) -> None:
    """Runs a group's members: per scheduler in the order of its first member,
    concurrently (the module docstring); raises the failure of the lowest member."""
    order: dict = {}
    for scheduler, call in members:
        order.setdefault(scheduler, []).append(call)
    runs, failures = list(order.items()), []
    threads = [threading.Thread(target=_run, args=(*run, failures), daemon=True) for run in runs[1:]]
    for t in threads:
        t.start()
    if runs:
        _run(*runs[0], failures)
    for (scheduler, calls), t in zip(runs[1:], threads):
        _join(t, scheduler.comm, len(calls), failures)
    if failures:
        raise min(failures, key=lambda e: getattr(getattr(e, "member", None), "group_index", len(members)))


def _run(scheduler, calls: list, failures: list) -> None:
    """One scheduler's members; a failure goes to `failures`, its message naming the
    member (schedule.Scheduler.launch sets the exception's `member`)."""
    try:
        scheduler.launch(calls)
    except BaseException as e:
        name_member(e)
        failures.append(e)


def name_member(e: BaseException) -> None:
    """Prefixes the message of `e` with the group member it names (its `member`), if any."""
    member = getattr(e, "member", None)
    if member is not None and e.args and isinstance(e.args[0], str):
        e.args = (f"group member #{member.group_index} ({describe(member)}): {e.args[0]}", *e.args[1:])


def _join(thread: threading.Thread, comm, ncalls: int, failures: list) -> None:
    """Waits for one communicator's thread. Its launches end by their own deadlines; this
    waits one timeout per launch and one more, then aborts the communicator."""
    thread.join(comm.timeout * (ncalls + 1))
    if thread.is_alive():
        comm.abort()
        thread.join(comm.timeout)
        if thread.is_alive():
            failures.append(
                CommTimeout(
                    f"rank {comm.rank}: a group's launches on another communicator did not end; it was aborted",
                    rank=comm.rank,
                    what="a group's launches",
                )
            )


def describe(call) -> str:
    """A group member in words: "send of 10 float32 to rank 1", "allreduce of 8 int32"."""
    if hasattr(call, "describe"):
        return call.describe()
    return f"{call.spec.name} of {call.signature.count} {call.s.dtype}"
