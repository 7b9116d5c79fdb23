"""Groups (NCCL's ncclGroupStart / ncclGroupEnd, nccl4py's ``with nccl.group():``).

A group belongs to the calling thread (each rank of a ThreadWorld is a thread), as
NCCL's does, and spans every communicator: ``group_start()`` / ``group_end()`` (also
Communicator.group_start / group_end, the same functions) nest, and only the outermost
group_end launches. Between them a call is checked and recorded (management), not run;
a call outside a group is a group of one and runs at once.

At the outermost group_end each communicator's members launch on its scheduler
(schedule.Scheduler.launch): its collectives in call order, then all of its sends and
receives in one launch (p2p.py), so that sends and receives posted in any order on any
rank cannot wait on each other; on the CPU all of them as one launch where they can
(schedule.py says when), and a group repeating a kept one on the same arrays goes
straight to that launch. Several communicators' members run
concurrently, one thread each, as NCCL's kernels on several communicators do, so their
order may differ between ranks. A failure is raised at group_end naming the member: its
index among the group's calls, the call, and its peer; a communicator's members after
its failed one are not launched. AllReduces packed into one call (packing.py) fail
together, named by the first of them and their count. An exception leaving
``with group():`` ends the group without launching anything.
"""

from __future__ import annotations

import threading

from commref.transports.errors import CommTimeout


class _GroupState(threading.local):
    """This thread's group: `depth`, its nesting (0: none); its members, `calls` in call
    order and the `schedulers` they run on (two lists: no tuple per member).
    Class defaults, so that reading `depth` in a thread that never grouped is a plain
    attribute lookup (a missing attribute of a threading.local costs ~0.7 us, as much as
    a tenth of an 8-byte collective on the CPU engine)."""

    depth = 0
    calls: list = []
    schedulers: list = []


# This thread's group; Communicator's kept-call path reads state.depth to choose record_kept.
state = _GroupState()


def grouping() -> bool:
    """Whether this thread is inside a group (calls are recorded, not run)."""
    return state.depth > 0


def group_start() -> None:
    """ncclGroupStart: calls until the matching group_end are recorded; nests."""
    if state.depth <= 0:
        state.depth, state.calls, state.schedulers = 0, [], []
    state.depth += 1


def group_end() -> None:
    """ncclGroupEnd: the outermost one launches every recorded call (the module
    docstring); RuntimeError without a group_start."""
    if state.depth <= 0:
        raise RuntimeError("group_end() without a matching group_start()")
    state.depth -= 1
    if state.depth:
        return
    schedulers, calls = state.schedulers, state.calls
    state.schedulers, state.calls = [], []
    launch(schedulers, calls)


class _Group:
    """``with group():``: group_start() on entry; group_end() on a normal exit, while an
    exception leaving the block ends the group without launching anything."""

    __slots__ = ()

    def __enter__(self):
        group_start()

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            group_end()
            return
        state.depth -= 1
        if not state.depth:
            state.calls, state.schedulers = [], []


_GROUP = _Group()


def group() -> _Group:
    """``with group():`` is group_start() ... group_end()."""
    return _GROUP


def submit(scheduler, call) -> None:
    """Runs `call` (calls.Call or p2p.P2pCall) on `scheduler`, or records it in this
    thread's group."""
    if state.depth:
        state.calls.append(call)
        state.schedulers.append(scheduler)
    else:
        scheduler.launch([call])


def record_kept(scheduler, kept) -> None:
    """A kept call (launch_record.RepeatedCall) that matched its arrays, as a member of
    this thread's open group (state.depth > 0); outside a group the caller runs it at
    once (Scheduler.run_cpu)."""
    state.calls.append(kept)
    state.schedulers.append(scheduler)


def launch(schedulers: list, calls: list) -> None:
    """Runs a group's members (`calls`, each on its scheduler): per scheduler in the order
    of its first member, concurrently (the module docstring); raises the failure of the
    lowest member."""
    if not calls:
        return
    failures: list = []
    first = schedulers[0]
    if schedulers.count(first) == len(schedulers):  # one communicator: no threads, no index map
        _run(first, calls, None, failures)
    else:
        order: dict = {}
        for i, (scheduler, call) in enumerate(zip(schedulers, calls)):
            mine, indices = order.setdefault(scheduler, ([], []))
            mine.append(call)
            indices.append(i)
        runs = list(order.items())
        threads = [threading.Thread(target=_run, args=(s, *run, failures), daemon=True) for s, run in runs[1:]]
        for t in threads:
            t.start()
        _run(runs[0][0], *runs[0][1], failures)
        for (scheduler, (mine, _)), t in zip(runs[1:], threads):
            _join(t, scheduler.comm, len(mine), failures)
    if failures:
        raise min(failures, key=lambda e: getattr(e, "group_index", len(calls)))


def _run(scheduler, calls: list, indices: list | None, failures: list) -> None:
    """One scheduler's members (`indices`: their indices in the group; None: the
    positions in `calls`); a failure goes to `failures`, named (name_member: from the
    `member` and `member_at` that schedule.Scheduler.launch sets)."""
    try:
        scheduler.launch(calls)
    except BaseException as e:
        name_member(e, indices)
        failures.append(e)


def name_member(e: BaseException, indices: list | None = None) -> None:
    """Names the group member that `e` names (its `member`, at `member_at` among the
    calls that launched; `indices`: their indices in the group, None: the same): sets
    `e.group_index` and prefixes its message with the member, its index and the call."""
    member, at = getattr(e, "member", None), getattr(e, "member_at", None)
    if member is not None and at is not None:
        e.group_index = at if indices is None else indices[at]
        if e.args and isinstance(e.args[0], str):
            e.args = (f"group member #{e.group_index} ({describe(member)}): {e.args[0]}", *e.args[1:])


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
