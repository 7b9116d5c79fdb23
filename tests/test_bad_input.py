"""Bad inputs fail with clear errors, on the rank that got them, and never hang the job.

- Local input checks (single rank and every rank of a ThreadWorld): ValueError /
  TypeError with a message that names the problem, raised before anything is launched.
- Only ONE rank of a ThreadWorld gets the bad input: ThreadWorld.run re-raises that
  rank's ValueError/TypeError, and the other ranks, already inside their kernels, see
  the world's abort word and end promptly (well before the communicator's timeout).
- Cross-rank mismatches (count, dtype, op, root): CommMismatch naming the field.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
from stand_ins import FakeDeviceArray

from commref.collectives.communicator import Communicator
from commref.transports.errors import CommAborted, CommMismatch
from commref.transports.thread_world import ThreadWorld

KERNEL_TIMEOUT = 20.0  # communicator waits: a hang would take this long
PROMPT = 10.0  # a failing job must end well within this


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _misaligned(n: int) -> np.ndarray:
    raw = np.zeros(4 * n + 8, dtype=np.uint8)
    view = np.frombuffer(raw, dtype=np.float32, count=n, offset=1)
    assert view.ctypes.data % 4 != 0
    return view


def _case(name: str, comm: Communicator):
    """(callable making the bad call on `comm`, expected exception, message fragment)."""
    n = comm.nranks
    f = np.float32
    x = np.arange(6, dtype=f)
    y = np.zeros(6, dtype=f)
    table = {
        "allgather_recv_too_small": (
            lambda: comm.allgather(x, np.zeros(6 * n - 1, f)),
            ValueError,
            "allgather needs recvbuf of nranks * sendcount",
        ),
        "reduce_scatter_send_wrong_size": (
            lambda: comm.reduce_scatter(np.zeros(3 * n + 1, f), np.zeros(3, f)),
            ValueError,
            "reduce_scatter needs sendbuf of nranks * recvcount",
        ),
        "allreduce_count_differs": (lambda: comm.allreduce(x, np.zeros(5, f)), ValueError, "equal count"),
        "dtype_send_vs_recv": (
            lambda: comm.allreduce(x, np.zeros(6, np.int32)),
            TypeError,
            "sendbuf dtype float32 differs from recvbuf dtype int32",
        ),
        "dtype_complex64": (
            lambda: comm.allreduce(np.zeros(4, np.complex64), np.zeros(4, np.complex64)),
            TypeError,
            "unsupported dtype complex64",
        ),
        "dtype_bool": (
            lambda: comm.broadcast(np.zeros(4, bool), np.zeros(4, bool), 0),
            TypeError,
            "unsupported dtype bool",
        ),
        "dtype_big_endian": (
            lambda: comm.allreduce(np.zeros(4, ">f4"), np.zeros(4, ">f4")),
            TypeError,
            "unsupported dtype",
        ),
        "op_xor": (lambda: comm.allreduce(x, y, "xor"), ValueError, "unsupported op 'xor'"),
        "op_xor_reduce_scatter": (
            lambda: comm.reduce_scatter(np.zeros(2 * n, f), np.zeros(2, f), op="xor"),
            ValueError,
            "unsupported op",
        ),
        "recvbuf_readonly": (lambda: comm.allreduce(x, _readonly(np.zeros(6, f))), ValueError, "recvbuf is read-only"),
        "recvbuf_readonly_allgather": (
            lambda: comm.allgather(x, _readonly(np.zeros(6 * n, f))),
            ValueError,
            "read-only",
        ),
        "sendbuf_noncontiguous": (
            lambda: comm.allreduce(np.zeros(12, f)[::2], y),
            ValueError,
            "sendbuf must be C-contiguous",
        ),
        "recvbuf_noncontiguous_2d": (
            lambda: comm.allreduce(x, np.zeros((6, 2), f)[:, 0]),
            ValueError,
            "recvbuf must be C-contiguous",
        ),
        "sendbuf_misaligned": (
            lambda: comm.allreduce(_misaligned(6), y),
            ValueError,
            "sendbuf is not aligned to its element size 4",
        ),
        "recvbuf_misaligned": (lambda: comm.allreduce(x, _misaligned(6)), ValueError, "not aligned"),
        "broadcast_root_out_of_range": (
            lambda: comm.broadcast(x, y, n),
            ValueError,
            f"root must be a rank in [0, {n})",
        ),
        "reduce_root_negative": (lambda: comm.reduce(x, y, "sum", -1), ValueError, "root must be a rank"),
        "root_not_an_int": (lambda: comm.broadcast(x, y, 0.0), ValueError, "root must be a rank"),
        "wrong_device_send": (
            lambda: comm.allreduce(FakeDeviceArray(6), y),
            TypeError,
            "sendbuf is device memory (FakeDeviceArray)",
        ),
        "wrong_device_recv": (lambda: comm.allgather(x, FakeDeviceArray(6 * n)), TypeError, "recvbuf is device memory"),
        "not_an_array": (lambda: comm.allreduce([1.0, 2.0], y), TypeError, "must be a numpy array, got list"),
        "none_buffer": (lambda: comm.allreduce(None, y), TypeError, "sendbuf is required"),
        "tree_allgather": (
            lambda: comm.allgather(x, np.zeros(6 * n, f), algorithm="tree"),
            ValueError,
            "'tree' is implemented for allreduce only",
        ),
        "tree_reduce_scatter": (
            lambda: comm.reduce_scatter(np.zeros(2 * n, f), np.zeros(2, f), algorithm="tree"),
            ValueError,
            "allreduce only",
        ),
        "overlap_allreduce": (
            lambda: (lambda b: comm.allreduce(b[0:6], b[3:9]))(np.zeros(12, f)),
            ValueError,
            "allreduce buffers overlap but are not in place",
        ),
        "overlap_allgather_wrong_slot": (
            lambda: (lambda b: comm.allgather(b[1:3], b[: 2 * n]))(np.zeros(2 * n + 1, f)),
            ValueError,
            "allgather buffers overlap but are not in place (sendbuf == recvbuf + rank * sendcount)",
        ),
        "alltoall_sizes_differ": (
            lambda: comm.alltoall(np.zeros(2 * n, f), np.zeros(2 * n + 1, f)),
            ValueError,
            "alltoall needs sendbuf and recvbuf of nranks * count elements each",
        ),
        "alltoall_in_place": (
            lambda: (lambda b: comm.alltoall(b, b))(np.zeros(2 * n, f)),
            ValueError,
            "alltoall buffers overlap, and alltoall has no in-place form",
        ),
        "alltoall_tree": (
            lambda: comm.alltoall(np.zeros(2 * n, f), np.zeros(2 * n, f), algorithm="tree"),
            ValueError,
            "'tree' is implemented for allreduce only",
        ),
        "overlap_reduce_scatter_wrong_slot": (
            lambda: (lambda b: comm.reduce_scatter(b[: 2 * n], b[1:3]))(np.zeros(2 * n + 1, f)),
            ValueError,
            "reduce_scatter buffers overlap but are not in place",
        ),
    }
    return table[name]


# Errors raised below the Communicator (verify.dtype_name, tuner.plan) do not name the
# rank, unlike every other input check (see the report).
NO_RANK_IN_MESSAGE: set[str] = set()  # every input error names the rank

BAD_CASES = [
    "allgather_recv_too_small",
    "reduce_scatter_send_wrong_size",
    "allreduce_count_differs",
    "dtype_send_vs_recv",
    "dtype_complex64",
    "dtype_bool",
    "dtype_big_endian",
    "op_xor",
    "op_xor_reduce_scatter",
    "recvbuf_readonly",
    "recvbuf_readonly_allgather",
    "sendbuf_noncontiguous",
    "recvbuf_noncontiguous_2d",
    "sendbuf_misaligned",
    "recvbuf_misaligned",
    "broadcast_root_out_of_range",
    "reduce_root_negative",
    "root_not_an_int",
    "wrong_device_send",
    "wrong_device_recv",
    "not_an_array",
    "none_buffer",
    "tree_allgather",
    "tree_reduce_scatter",
    "overlap_allreduce",
    "overlap_allgather_wrong_slot",
    "overlap_reduce_scatter_wrong_slot",
    "alltoall_sizes_differ",
    "alltoall_in_place",
    "alltoall_tree",
]


@pytest.fixture(scope="module")
def single_comm():
    comm = Communicator(ThreadWorld.single(timeout=5.0), "cpu", timeout=5.0)
    yield comm
    comm.close()


@pytest.mark.parametrize("name", BAD_CASES)
def test_single_rank_bad_input(single_comm, name):
    call, exc, fragment = _case(name, single_comm)
    with pytest.raises(exc) as info:
        call()
    assert fragment in str(info.value)
    if name not in NO_RANK_IN_MESSAGE:
        assert "rank 0:" in str(info.value)
    # The check happened before any launch: the communicator still works.
    x = np.arange(5, dtype=np.int64)
    y = np.zeros_like(x)
    single_comm.allreduce(x, y)
    assert (y == x).all()


def test_every_rank_bad_input_in_thread_world():
    """All ranks get the same bad input: each raises its own error, nothing hangs, and
    the communicators keep working afterwards (nothing was launched)."""

    def fn(world):
        comm = Communicator(world, "cpu", timeout=KERNEL_TIMEOUT)
        seen = {}
        for name in BAD_CASES:
            call, exc, fragment = _case(name, comm)
            try:
                call()
            except exc as e:
                assert fragment in str(e), (name, str(e))
                assert name in NO_RANK_IN_MESSAGE or f"rank {world.rank}:" in str(e), (name, str(e))
                seen[name] = True
            else:
                seen[name] = False
        x = np.full(9, world.rank + 1, np.int32)
        y = np.zeros_like(x)
        comm.allreduce(x, y)
        return seen, int(y[0])

    t0 = time.monotonic()
    results = ThreadWorld.run(3, fn, timeout=KERNEL_TIMEOUT)
    assert time.monotonic() - t0 < PROMPT
    for seen, total in results:
        assert all(seen.values()), [k for k, v in seen.items() if not v]
        assert total == 6


# ---------------------------------------------------------------------------------------
# one rank's bad input must end the job promptly
# ---------------------------------------------------------------------------------------


ONE_RANK_CASES = [
    "allgather_recv_too_small",
    "dtype_complex64",
    "op_xor",
    "recvbuf_readonly",
    "sendbuf_misaligned",
    "broadcast_root_out_of_range",
    "wrong_device_send",
    "tree_allgather",
    "overlap_allreduce",
    "alltoall_in_place",
]


def _good_call(name: str, comm: Communicator):
    """The well-formed call the other ranks make (the same collective as the bad one)."""
    n = comm.nranks
    f = np.float32
    x = np.arange(6, dtype=f)
    if name.startswith("allgather") or name == "tree_allgather":
        return lambda: comm.allgather(x, np.zeros(6 * n, f))
    if name.startswith("broadcast"):
        return lambda: comm.broadcast(x, np.zeros(6, f), 0)
    if name.startswith("alltoall"):
        return lambda: comm.alltoall(np.zeros(6 * n, f), np.zeros(6 * n, f))
    return lambda: comm.allreduce(x, np.zeros(6, f))


@pytest.mark.parametrize("nranks, bad_rank", [(2, 1), (3, 0)])
@pytest.mark.parametrize("name", ONE_RANK_CASES)
def test_one_rank_bad_input_ends_the_job_promptly(name, nranks, bad_rank):
    others: dict[int, BaseException] = {}

    def fn(world):
        comm = Communicator(world, "cpu", timeout=KERNEL_TIMEOUT)
        if world.rank == bad_rank:
            time.sleep(0.05)  # the others are inside their kernels by now
            _case(name, comm)[0]()
            return "no error"
        try:
            _good_call(name, comm)()
        except BaseException as e:
            others[world.rank] = e
            raise
        return "completed"

    _, exc, fragment = _case(name, SimpleNamespace(nranks=nranks, rank=bad_rank))
    t0 = time.monotonic()
    with pytest.raises(exc) as info:
        ThreadWorld.run(nranks, fn, timeout=KERNEL_TIMEOUT)
    elapsed = time.monotonic() - t0
    assert elapsed < PROMPT, f"took {elapsed:.1f} s (communicator timeout {KERNEL_TIMEOUT} s)"
    assert fragment in str(info.value)
    assert name in NO_RANK_IN_MESSAGE or f"rank {bad_rank}:" in str(info.value)
    # The bystanders were torn down by the abort word, not by their own deadline (a
    # broadcast root may complete: its sends fit in the FIFO without any credit).
    assert bad_rank not in others
    for r, e in others.items():
        assert isinstance(e, CommAborted), f"rank {r}: {e!r}"


# ---------------------------------------------------------------------------------------
# cross-rank mismatches
# ---------------------------------------------------------------------------------------


def _mismatch_call(field: str, comm: Communicator):
    """Rank 1 makes a call that differs from the other ranks' in `field`."""
    other = comm.rank == 1
    x = np.arange(40, dtype=np.float32)
    y = np.zeros(40, dtype=np.float32)
    ring = {"algorithm": "ring"}
    if field == "count":
        n = 39 if other else 40
        return lambda: comm.allreduce(x[:n], y[:n], **ring)
    if field == "dtype":
        return lambda: comm.allreduce(x.view(np.int32) if other else x, y.view(np.int32) if other else y, **ring)
    if field == "op":
        return lambda: comm.allreduce(x, y, "max" if other else "sum", **ring)
    if field == "collective":
        if other:
            return lambda: comm.reduce_scatter(np.zeros(40 * comm.nranks, np.float32), y)
        return lambda: comm.allreduce(x, y, **ring)
    if field == "collective (auto algorithm)":  # 3+ ranks: the tuner picks a tree for a small allreduce
        if other:
            return lambda: comm.reduce_scatter(np.zeros(40 * comm.nranks, np.float32), y)
        return lambda: comm.allreduce(x, y)
    if field == "algorithm":
        return lambda: comm.allreduce(x, y, algorithm="tree" if other else "ring")
    if field == "reduce root":  # rank 1 thinks it is the root, the others that rank 0 is
        return lambda: comm.reduce(x, y, "sum", 1 if other else 0)
    if field == "broadcast root":
        return lambda: comm.broadcast(x, y, 1 if other else 0)
    raise ValueError(field)


def _run_mismatch(field: str, nranks: int, timeout: float = KERNEL_TIMEOUT):
    """Runs the mismatched call; returns (what ThreadWorld.run raised or None, each
    rank's exception, seconds)."""
    errors: dict[int, BaseException] = {}

    def fn(world):
        comm = Communicator(world, "cpu", timeout=timeout)
        try:
            _mismatch_call(field, comm)()
        except BaseException as e:
            errors[world.rank] = e
            raise
        return "completed"

    t0 = time.monotonic()
    raised = None
    try:
        ThreadWorld.run(nranks, fn, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - inspected by the callers
        raised = e
    return raised, errors, time.monotonic() - t0


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("field", ["count", "dtype", "op", "collective"])
def test_cross_rank_mismatch(field, nranks):
    root, errors, elapsed = _run_mismatch(field, nranks)
    assert elapsed < PROMPT, f"took {elapsed:.1f} s: {root!r}"
    assert isinstance(root, CommMismatch), repr(root)
    assert root.field == field and f"{field} is " in str(root) and "differs from peer" in str(root)
    # Every rank either saw the mismatch itself or was aborted by the world: none timed out.
    assert set(errors) == set(range(nranks))
    assert all(isinstance(e, (CommMismatch, CommAborted)) for e in errors.values()), errors
    assert all(e.field == field for e in errors.values() if isinstance(e, CommMismatch))


def test_mismatch_names_both_values():
    _, errors, _ = _run_mismatch("count", 2)
    values = {(e.mine, e.theirs) for e in errors.values() if isinstance(e, CommMismatch)}
    assert values and values <= {(40, 39), (39, 40)}
    if isinstance(errors[0], CommMismatch):
        assert "count is 40 here and 39 there" in str(errors[0])
        assert errors[0].peer == 1


# Mismatches that would put the ranks on connections that never meet (ring vs tree FIFOs,
# or a rooted chain that starts at different ranks): the kernels' ring handshake turns
# them into CommMismatch too.
@pytest.mark.parametrize(
    "field, nranks", [("algorithm", 2), ("collective (auto algorithm)", 3), ("reduce root", 2), ("broadcast root", 2)]
)
def test_cross_rank_mismatch_on_disjoint_connections(field, nranks):
    root, errors, elapsed = _run_mismatch(field, nranks, timeout=5.0)
    assert isinstance(root, CommMismatch), f"{root!r} after {elapsed:.1f} s"
    assert elapsed < PROMPT, f"took {elapsed:.1f} s"


@pytest.mark.parametrize("field", ["algorithm", "reduce root"])
def test_undetected_mismatch_still_never_hangs(field):
    """These mismatches end promptly with CommMismatch, well before the deadline."""
    root, errors, elapsed = _run_mismatch(field, 2, timeout=5.0)
    assert elapsed < 2.0, f"took {elapsed:.1f} s"
    assert isinstance(root, CommMismatch), repr(root)
