"""Bad input at every door, property-based (hypothesis): random invalid calls of every
collective on the Communicators of a ThreadWorld. tests/test_bad_input.py holds the
fixed cases and their messages; this file draws the combinations.

The contract under test (collectives/buffers.py, collectives/communicator.py,
transports/errors.py):

- Local input errors raise on the rank that got them, name it ("rank R: ..."), and
  are raised before anything is launched: TypeError for a buffer that is not an array
  (or is device memory on a CPU communicator), an unsupported dtype, or send and recv
  dtypes that differ; ValueError for a size that does not fit the collective, a
  buffer that is not C-contiguous, misaligned, a read-only recvbuf, buffers that
  overlap outside NCCL's in-place layout, a bad root, an unsupported op, an unknown
  or unavailable algorithm. Every rank may get a different one; none hangs; the SAME
  communicator then runs a valid call, exactly.
- Ranks that disagree on a call (collective, count, dtype, op, root or algorithm;
  each rank's call valid on its own) raise CommMismatch (the kernels compare the call
  descriptor every step carries, and the handshake of rooted and tree kernels) or
  CommAborted (torn down by a rank that raised), never CommTimeout: the job ends long
  before the deadline. A communicator refuses further calls after that, by design,
  so the valid call after is exact on fresh communicators of a fresh world.

Sizes: TOTAL_EXAMPLES examples in all (local errors and disagreements), with a 2 s
deadline on every wait so that a hang would show as CommTimeout within seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from stand_ins import FakeDeviceArray

from commref.collectives import catalogue
from commref.collectives.catalogue import RECV, SEND
from commref.collectives.communicator import Communicator
from commref.collectives.memory import Memory
from commref.collectives.verify import DTYPES, OPS, count_wrong, expected_output, make_input
from commref.transports.errors import CommAborted, CommMismatch
from commref.transports.thread_world import ThreadWorld

TIMEOUT_S = 2.0  # every wait of these communicators and worlds: a hang shows as CommTimeout
LOCAL_EXAMPLES = 400
ONE_BAD_RANK_EXAMPLES = 100
MISMATCH_EXAMPLES = 300
TOTAL_EXAMPLES = LOCAL_EXAMPLES + ONE_BAD_RANK_EXAMPLES + MISMATCH_EXAMPLES
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
SEED = 5


@dataclass(frozen=True)
class Call:
    """One rank's call: valid on its own (buffers made by `buffers`)."""

    coll: str
    count: int  # NCCL's count
    dtype: str
    op: str | None  # reducing collectives only
    root: int  # rooted collectives only (else 0)
    algorithm: str  # explicit: a kernel of the collective (never "auto": two ranks' autos could differ or agree)
    in_place: bool

    @property
    def spec(self) -> catalogue.Collective:
        return catalogue.get(self.coll)

    def signature(self) -> tuple:
        """What the ranks must agree on (in place or not is each rank's own choice)."""
        s = self.spec
        return (
            self.coll,
            self.count,
            self.dtype,
            self.op if s.reducing else None,
            self.root if s.rooted else 0,
            self.algorithm,
        )

    def buffers(self, rank: int, nranks: int):
        x = make_input(self.coll, self.dtype, self.op, SEED, rank, nranks, self.count)
        return self.spec.buffers(Memory(np), x, self.count, rank, nranks, self.in_place)

    def run(self, comm: Communicator, send, recv, op="unset", root="unset", algorithm="unset") -> None:
        """Calls the collective with these buffers; op, root, algorithm default to the call's."""
        self.spec.call(
            comm,
            send,
            recv,
            self.op if op == "unset" else op,
            self.root if root == "unset" else root,
            algorithm=self.algorithm if algorithm == "unset" else algorithm,
        )

    def wrong(self, out, rank: int, nranks: int) -> int:
        want = expected_output(self.coll, self.dtype, self.op, SEED, rank, nranks, self.count, self.root)
        return 0 if want is None else count_wrong(out, want)


def checked(call: Call, rank: int) -> list[str]:
    """The buffers this rank's call looks at: one only where the root alone passes the
    other (a non-root rank of broadcast or reduce)."""
    s = call.spec
    if s.rooted and rank != call.root and s.root_only:
        return [RECV] if s.root_only == SEND else [SEND]
    return [SEND, RECV]


# The algorithms whose calls need buffers from alloc_symmetric (these calls' are plain).
SYMMETRIC_ONLY = ("direct", "nvls")


@st.composite
def calls(draw, nranks: int) -> Call:
    coll = draw(st.sampled_from(catalogue.KERNEL_NAMES))
    spec = catalogue.get(coll)
    return Call(
        coll,
        draw(st.integers(0, 40)),
        draw(st.sampled_from(list(DTYPES))),
        draw(st.sampled_from(list(OPS))) if spec.reducing else None,
        draw(st.integers(0, nranks - 1)) if spec.rooted else 0,
        draw(st.sampled_from([a for a in spec.kernels if a not in SYMMETRIC_ONLY])),
        draw(st.booleans()) if spec.in_place_ok else False,
    )


# ---------------------------------------------------------------------------------------
# local input errors
# ---------------------------------------------------------------------------------------

BAD_DTYPES = [
    np.complex64,
    np.complex128,
    np.bool_,
    np.int16,
    np.uint16,
    np.float128 if hasattr(np, "float128") else np.longdouble,
    ">f4",
    ">i8",
    ">f8",
    "U2",
    "S3",
    "V4",
    object,
    "M8[s]",
    "m8[ms]",
    "i4,f4",
]
BAD_ROOTS = [-1, "n", "n+3", -7, 0.0, 1.5, "0", None, True, False, np.float64(0), [0]]
BAD_OPS = ["xor", "SUM", "", None, 0, 2, b"sum", "sum ", "mean", "band", ("sum",)]
BAD_ALGORITHMS = ["foo", "RING", "rings", 5, "direct", "hierarchical", "tree", "nvls"]  # "tree", "nvls": allreduce only
NOT_ARRAYS = [None, [1.0, 2.0], (1, 2), b"\0" * 8, 3.0, "abc", np.float32(1.0), "memoryview", "device"]


def _zeros(n: int, dtype) -> np.ndarray:
    return np.zeros(n, dtype=dtype)


def _misaligned(n: int, dtype, offset: int) -> np.ndarray:
    dt = np.dtype(dtype)
    raw = np.zeros(n * dt.itemsize + dt.itemsize, np.uint8)
    view = np.frombuffer(raw, dtype=dt, count=n, offset=offset)
    assert view.ctypes.data % dt.itemsize
    return view


def _noncontiguous(n: int, dtype, how: str) -> np.ndarray:
    if how == "strided":
        return np.zeros(2 * n, dtype)[::2]
    if how == "reversed":
        return np.zeros(n, dtype)[::-1]
    if how == "column":
        return np.zeros((n, 2), dtype)[:, 0]
    return np.asfortranarray(np.zeros((2, n // 2), dtype))  # "fortran": 2-d, n even


@st.composite
def defects(draw, call: Call, rank: int, nranks: int):
    """(description, expected exception type, f(comm)) of an invalid call based on `call`."""
    s = call.spec
    sn, rn = s.counts(call.count, nranks)
    dt = DTYPES[call.dtype]
    sizes = {SEND: sn, RECV: rn}
    look = checked(call, rank)
    both = look == [SEND, RECV]
    kinds = ["not_array", "bad_dtype", "bad_algorithm"]
    kinds += ["misaligned"] if dt.itemsize > 1 and any(sizes[b] for b in look) else []
    kinds += ["noncontiguous"] if any(sizes[b] >= 2 for b in look) else []
    kinds += ["readonly"] if RECV in look else []
    kinds += ["dtype_differs", "wrong_size"] if both else []
    # overlap: recvbuf starts k elements after sendbuf (-rn < k < sn), any k but NCCL's in-place one
    at = s.in_place_at(rank, call.count)
    in_place_k = (-at if s.scaled == RECV else at) if s.in_place_ok else None
    shifts = [k for k in range(-(rn - 1), sn) if k != in_place_k] if sn and rn else []
    kinds += ["overlap"] if both and shifts else []
    kinds += ["bad_root"] if s.rooted else []
    kinds += ["bad_op"] if s.reducing else []
    kind = draw(st.sampled_from(kinds))
    good = call.buffers(rank, nranks)
    args = {SEND: good.send, RECV: good.recv}

    def with_buffers(bufs, **kw):
        return lambda comm: call.run(comm, bufs[SEND], bufs[RECV], **kw)

    if kind == "not_array":
        which, what = draw(st.sampled_from(look)), draw(st.sampled_from(NOT_ARRAYS))
        if what == "memoryview":
            what = memoryview(np.zeros(max(sizes[which], 1) * dt.itemsize, np.uint8))
        elif what == "device":
            what = FakeDeviceArray(max(sizes[which], 1))
        return f"{kind}: {which} is {type(what).__name__}", TypeError, with_buffers({**args, which: what})
    if kind == "bad_dtype":
        bad = np.dtype(draw(st.sampled_from(BAD_DTYPES)))
        bufs = {b: _zeros(sizes[b], bad) for b in (SEND, RECV)}
        return f"{kind}: dtype {bad}", TypeError, with_buffers(bufs)
    if kind == "dtype_differs":
        other = draw(st.sampled_from([d for d in DTYPES if d != call.dtype]))
        which = draw(st.sampled_from([SEND, RECV]))
        bufs = {b: _zeros(sizes[b], DTYPES[other] if b == which else dt) for b in (SEND, RECV)}
        return f"{kind}: {which} dtype {other}", TypeError, with_buffers(bufs)
    if kind == "wrong_size":
        which = draw(st.sampled_from([SEND, RECV]))
        delta = draw(st.integers(1, 5) | st.integers(-sizes[which], -1) if sizes[which] else st.integers(1, 5))
        bufs = {b: _zeros(sizes[b] + (delta if b == which else 0), dt) for b in (SEND, RECV)}
        return f"{kind}: {which} {delta:+d} elements", ValueError, with_buffers(bufs)
    if kind == "overlap":
        k = draw(st.sampled_from(shifts))
        a = draw(st.integers(max(0, -k), max(0, -k) + 3))  # sendbuf's offset in one allocation
        b = a + k
        base = _zeros(max(a + sn, b + rn), dt)
        return (
            f"{kind}: overlap send at {a}, recv at {b}",
            ValueError,
            with_buffers({SEND: base[a : a + sn], RECV: base[b : b + rn]}),
        )
    if kind == "misaligned":
        which = draw(st.sampled_from([b for b in look if sizes[b]]))
        offset = draw(st.integers(1, dt.itemsize - 1))
        return (
            f"{kind}: {which} misaligned by {offset}",
            ValueError,
            with_buffers({**args, which: _misaligned(sizes[which], dt, offset)}),
        )
    if kind == "noncontiguous":
        which = draw(st.sampled_from([b for b in look if sizes[b] >= 2]))
        fortran = ["fortran"] if sizes[which] % 2 == 0 and sizes[which] >= 4 else []
        how = draw(st.sampled_from(["strided", "reversed", "column"] + fortran))
        bufs = {**args, which: _noncontiguous(sizes[which], dt, how)}
        return f"{kind}: {which} {how}", ValueError, with_buffers(bufs)
    if kind == "readonly":
        recv = _zeros(rn, dt)
        recv.flags.writeable = False
        return f"{kind}: recvbuf read-only", ValueError, with_buffers({**args, RECV: recv})
    if kind == "bad_root":
        root = draw(st.sampled_from(BAD_ROOTS))
        root = {"n": nranks, "n+3": nranks + 3}.get(root, root) if isinstance(root, str) else root
        return f"{kind}: root {root!r}", ValueError, with_buffers(args, root=root)
    if kind == "bad_op":
        op = draw(st.sampled_from(BAD_OPS))
        return f"{kind}: op {op!r}", ValueError, with_buffers(args, op=op)
    algorithm = draw(st.sampled_from([a for a in BAD_ALGORITHMS if a not in s.kernels]))
    return f"{kind}: algorithm {algorithm!r}", ValueError, with_buffers(args, algorithm=algorithm)


def _local_errors(world, call: Call, bad: list):
    """Each rank makes its own invalid call, then the valid `call`. Returns (what was
    raised, seconds, wrong elements of the valid call)."""
    with Communicator(world, "cpu", timeout=TIMEOUT_S) as comm:
        what, expected, f = bad[world.rank]
        t0 = time.monotonic()
        try:
            f(comm)
            raised = None
        except Exception as e:  # noqa: BLE001 - inspected by the test
            raised = e
        seconds = time.monotonic() - t0
        b = call.buffers(world.rank, world.size)
        call.run(comm, b.send, b.recv)
        return raised, seconds, call.wrong(b.out, world.rank, world.size)


@settings(max_examples=LOCAL_EXAMPLES, **SETTINGS)
@given(st.data())
def test_invalid_calls_raise_locally_and_the_communicator_stays_exact(data):
    nranks = data.draw(st.integers(1, 4), label="nranks")
    call = data.draw(calls(nranks), label="valid call")
    bad = [data.draw(defects(call, r, nranks), label=f"rank {r}") for r in range(nranks)]
    for what, _, _ in bad:
        event(what.split(":")[0])
    results = ThreadWorld.run(nranks, _local_errors, call, bad, timeout=TIMEOUT_S)
    for rank, ((what, expected, _), (raised, seconds, wrong)) in enumerate(zip(bad, results)):
        assert type(raised) is expected, f"rank {rank}, {what}: expected {expected.__name__}, got {raised!r}"
        assert str(raised).startswith(f"rank {rank}: "), f"rank {rank}, {what}: {raised}"
        assert "  " not in str(raised), f"rank {rank}, {what}: a message with a hole: {raised}"
        assert seconds < TIMEOUT_S / 2, f"rank {rank}, {what}: raised after {seconds:.2f} s"
        assert wrong == 0, f"rank {rank}: {wrong} wrong elements in the valid call after {what}"


def _one_bad_rank(world, call: Call, bad_rank: int, bad, outcome: dict):
    """`bad_rank` makes the invalid call `bad`, the others the valid `call` and then a
    world barrier (where a rank that could complete its part learns of the failure)."""
    with Communicator(world, "cpu", timeout=TIMEOUT_S) as comm:
        t0 = time.monotonic()
        try:
            if world.rank == bad_rank:
                bad[2](comm)
            else:
                b = call.buffers(world.rank, world.size)
                call.run(comm, b.send, b.recv)
                world.barrier(what="after the call")
        except Exception as e:  # noqa: BLE001
            outcome[world.rank] = (e, time.monotonic() - t0)
            raise
        outcome[world.rank] = (None, time.monotonic() - t0)


@settings(max_examples=ONE_BAD_RANK_EXAMPLES, **SETTINGS)
@given(st.data())
def test_one_rank_with_an_invalid_call_ends_the_job_promptly(data):
    """The rank with the invalid call raises its TypeError / ValueError; the others, in
    the collective or waiting after it, raise CommAborted well before the deadline."""
    nranks = data.draw(st.integers(2, 4), label="nranks")
    call = data.draw(calls(nranks), label="valid call")
    bad_rank = data.draw(st.integers(0, nranks - 1), label="bad rank")
    bad = data.draw(defects(call, bad_rank, nranks), label="its invalid call")
    event(bad[0].split(":")[0])
    outcome: dict = {}
    try:
        ThreadWorld.run(nranks, _one_bad_rank, call, bad_rank, bad, outcome, timeout=TIMEOUT_S)
        raised = None
    except Exception as e:  # noqa: BLE001
        raised = e
    assert type(raised) is bad[1] and str(raised).startswith(f"rank {bad_rank}: "), f"{bad[0]}: {raised!r}"
    assert sorted(outcome) == list(range(nranks))
    for rank, (exc, seconds) in outcome.items():
        if rank != bad_rank:
            assert isinstance(exc, CommAborted), f"rank {rank}: {exc!r} ({bad[0]} on rank {bad_rank})"
            assert seconds < TIMEOUT_S / 2, f"rank {rank} aborted after {seconds:.2f} s"


# ---------------------------------------------------------------------------------------
# ranks that disagree
# ---------------------------------------------------------------------------------------


def _disagreeing(world, mine: list[Call]):
    """Each rank makes its own (locally valid) call, then meets the others at a world
    barrier: a rank whose part of the call needed nothing from a disagreeing peer may
    complete it (a chain's first rank sends and leaves), and learns of the failure
    there. Returns (exception or None, seconds, whether the call itself completed)."""
    with Communicator(world, "cpu", timeout=TIMEOUT_S) as comm:
        call = mine[world.rank]
        b = call.buffers(world.rank, world.size)
        t0 = time.monotonic()
        completed = False
        try:
            call.run(comm, b.send, b.recv)
            completed = True
            world.barrier(what="after the call")
        except Exception as e:  # noqa: BLE001
            return e, time.monotonic() - t0, completed
        return None, time.monotonic() - t0, completed


def _valid(world, call: Call) -> int:
    with Communicator(world, "cpu", timeout=TIMEOUT_S) as comm:
        b = call.buffers(world.rank, world.size)
        call.run(comm, b.send, b.recv)
        return call.wrong(b.out, world.rank, world.size)


@st.composite
def disagreements(draw):
    nranks = draw(st.integers(2, 4), label="nranks")
    base = draw(calls(nranks), label="the others' call")
    field = draw(st.sampled_from(["collective", "count", "dtype", "op", "root", "algorithm", "anything"]))
    deviators = draw(st.sets(st.integers(0, nranks - 1), min_size=1, max_size=nranks - 1), label="deviating ranks")
    s = base.spec
    mine = []
    for r in range(nranks):
        if r not in deviators:
            mine.append(base)
            continue
        if field == "count":
            other = replace(base, count=draw(st.integers(0, 40).filter(lambda c: c != base.count)))
        elif field == "dtype":
            other = replace(base, dtype=draw(st.sampled_from([d for d in DTYPES if d != base.dtype])))
        elif field == "op" and s.reducing:
            other = replace(base, op=draw(st.sampled_from([o for o in OPS if o != base.op])))
        elif field == "root" and s.rooted:
            other = replace(base, root=draw(st.sampled_from([x for x in range(nranks) if x != base.root])))
        elif field == "algorithm" and len([a for a in s.kernels if a not in SYMMETRIC_ONLY]) > 1:
            other = replace(
                base,
                algorithm=draw(st.sampled_from([a for a in s.kernels if a not in (*SYMMETRIC_ONLY, base.algorithm)])),
            )
        elif field == "collective":
            other = draw(calls(nranks).filter(lambda c: c.coll != base.coll))
        else:  # anything: an independent call that differs somewhere
            other = draw(calls(nranks).filter(lambda c: c.signature() != base.signature()))
        mine.append(replace(other, in_place=draw(st.booleans()) and other.spec.in_place_ok))
    return nranks, base, mine


@settings(max_examples=MISMATCH_EXAMPLES, **SETTINGS)
@given(disagreements())
def test_ranks_that_disagree_raise_comm_mismatch_not_a_hang(case):
    nranks, base, mine = case
    assert len({c.signature() for c in mine}) > 1
    outcome: dict = {}

    def fn(world):
        outcome[world.rank] = _disagreeing(world, mine)
        if outcome[world.rank][0] is not None:
            raise outcome[world.rank][0]

    t0 = time.monotonic()
    try:
        ThreadWorld.run(nranks, fn, timeout=TIMEOUT_S)
        root = None
    except Exception as e:  # noqa: BLE001
        root = e
    elapsed = time.monotonic() - t0
    assert isinstance(root, CommMismatch), f"{root!r} after {elapsed:.2f} s; calls {mine}"
    assert sorted(outcome) == list(range(nranks))
    for rank, (exc, seconds, completed) in outcome.items():
        assert isinstance(exc, (CommMismatch, CommAborted)), f"rank {rank}: {exc!r}; calls {mine}"
        assert seconds < TIMEOUT_S, f"rank {rank} ended after {seconds:.2f} s: {exc!r}"
        event("a rank completed its part" if completed else "every rank raised in the call")
    # a fresh world and fresh communicators: the valid call is exact
    assert ThreadWorld.run(nranks, _valid, base, timeout=TIMEOUT_S) == [0] * nranks
