"""Groups (NCCL's ncclGroupStart / ncclGroupEnd, nccl4py's ``with nccl.group():``).

A group belongs to the calling thread (each rank of a ThreadWorld is a thread), as
NCCL's does, and spans every communicator: ``group_start()`` / ``group_end()`` (also
Communicator.group_start / group_end, the same functions) nest, and only the outermost
group_end launches. Between them a call is recorded (management), not run; a call
outside a group is a group of one and runs at once.

A collective is recorded as given (calls.GIVEN: its arguments, unchecked) and a send
or receive checked (p2p.py). At the outermost group_end the collectives are checked,
every member of every communicator before anything launches (a bad argument launches
nothing), unless a communicator's calls repeat one of its kept groups on unchanged
arrays (schedule.Scheduler.replay), whose checks then hold. Each communicator's members
then launch on its scheduler (schedule.Scheduler.launch): its collectives in call order,
then all of its sends and receives in one launch (p2p.py), so that sends and receives
posted in any order on any rank cannot wait on each other; on the CPU all of them as one
launch where they can (schedule.py says when). Several communicators' members run
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


class OpenGroup:
    """A thread's open group: its nesting `depth` (> 0) and its members, `calls` in call
    order and the `schedulers` they run on (two lists: no tuple per member). A plain
    object: its attributes cost less to reach than a threading.local's. The extension's
    commref_pycall.OpenGroup, which its GroupScope opens, has the same fields."""

    __slots__ = ("depth", "calls", "schedulers")

    def __init__(self) -> None:
        self.depth, self.calls, self.schedulers = 1, [], []


class _GroupState(threading.local):
    """This thread's group: `open`, the OpenGroup, or None outside a group (a class
    default, so that a thread that never grouped reads it as a plain attribute lookup: a
    missing attribute of a threading.local costs ~0.7 us, as much as a tenth of an 8-byte
    collective on the CPU engine)."""

    open: OpenGroup | None = None


# This thread's group; Communicator._collective reads state.open to record a call as given.
state = _GroupState()


def grouping() -> bool:
    """Whether this thread is inside a group (calls are recorded, not run)."""
    return state.open is not None


def group_start() -> None:
    """ncclGroupStart: calls until the matching group_end are recorded; nests."""
    group = state.open
    if group is None:
        state.open = OpenGroup()
    else:
        group.depth += 1


def group_end() -> None:
    """ncclGroupEnd: the outermost one launches every recorded call (the module
    docstring); RuntimeError without a group_start."""
    group = _leave()
    if group is not None:
        launch(group.schedulers, group.calls)


def _leave() -> OpenGroup | None:
    """Closes one level of this thread's group: the group where that was its outermost
    (no longer open), else None; RuntimeError where none is open."""
    group = state.open
    if group is None:
        raise RuntimeError("group_end() without a matching group_start()")
    group.depth -= 1
    if group.depth:
        return None
    state.open = None
    return group


class _Group:
    """``with group():``: group_start() on entry; group_end() on a normal exit, while an
    exception leaving the block ends the group without launching anything."""

    __slots__ = ()

    def __enter__(self):
        group_start()

    def __exit__(self, exc_type, exc, tb):
        group = _leave()  # RuntimeError where a group_end() inside the block closed it
        if group is not None and exc_type is None:
            launch(group.schedulers, group.calls)


# What ``with group():`` enters: a _Group, or the commref_pycall extension's GroupScope
# (the same in C, its groups that extension's OpenGroups) once a CPU communicator has
# loaded the extension (communicator.record_in_c, use_scope).
_scope = _Group()


def group():
    """``with group():`` is group_start() ... group_end()."""
    return _scope


def use_scope(scope) -> None:
    """Makes `scope` what group() returns: an object that enters and exits as _Group does."""
    global _scope
    _scope = scope


def submit(scheduler, call) -> None:
    """Runs `call` (a checked p2p.P2pCall) on `scheduler`, or records it in this thread's
    group."""
    group = state.open
    if group is not None:
        group.calls.append(call)
        group.schedulers.append(scheduler)
    else:
        scheduler.launch([call])


def launch(schedulers: list, calls: list) -> None:
    """Runs a group's members (`calls`, each on its scheduler): checked first, then per
    scheduler in the order of its first member, concurrently (the module docstring);
    raises the failure of the lowest member."""
    if not calls:
        return
    failures: list = []
    first = schedulers[0]
    if schedulers.count(first) == len(schedulers):  # one communicator: no threads, no index map
        try:
            replayed = first.replay(calls)
        except BaseException as e:
            name_member(e)
            raise
        if replayed:
            return
        _run(first, _checked(first, calls, None), None, failures)
    else:
        order: dict = {}
        for i, (scheduler, call) in enumerate(zip(schedulers, calls)):
            mine, indices = order.setdefault(scheduler, ([], []))
            mine.append(call)
            indices.append(i)
        runs = [(s, _checked(s, mine, indices), indices) for s, (mine, indices) in order.items()]
        threads = [threading.Thread(target=_run, args=(*run, failures), daemon=True) for run in runs[1:]]
        for t in threads:
            t.start()
        _run(*runs[0], failures)
        for (scheduler, mine, _), t in zip(runs[1:], threads):
            _join(t, scheduler.comm, len(mine), failures)
    if failures:
        raise min(failures, key=lambda e: getattr(e, "group_index", len(calls)))


def _checked(scheduler, calls: list, indices: list | None) -> list:
    """One scheduler's members with each collective as given checked (Communicator._resolve:
    a kept call or a checked Call); a failure is raised named (name_member, `indices` as
    _run's)."""
    comm, out = scheduler.comm, []
    for at, call in enumerate(calls):
        if call.__class__ is tuple:
            try:
                call = comm._resolve(*call)
            except BaseException as e:
                e.member, e.member_at = call, at
                name_member(e, indices)
                raise
        out.append(call)
    return out


def _run(scheduler, calls: list, indices: list | None, failures: list) -> None:
    """One scheduler's checked members (`indices`: their indices in the group; None: the
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
    if call.__class__ is tuple:  # a collective as given (calls.GIVEN), named by what its sendbuf holds
        coll, send = call[2], call[0]
        size, dtype = getattr(send, "size", None), getattr(send, "dtype", None)
        return coll if size is None or dtype is None else f"{coll} of {size} {dtype}"
    if hasattr(call, "describe"):
        return call.describe()
    return f"{call.spec.name} of {call.signature.count} {call.s.dtype}"
