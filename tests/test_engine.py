"""Unit tests of the CPU execution engine (device_kernels/cpu/engine.cpp), through the
self-test kernels of device_kernels/kernels/selftest.cu:

- commref_engine_selftest: dst[b] = b * 1000000 + sum_{t < blockDim} (t + 1) + gridDim * 1000,
  where the sum is read back by thread 0 through __shared__ memory after a
  __syncthreads(); checks per-block __shared__, the barrier, blockIdx/threadIdx/
  blockDim/gridDim.
- commref_copy: block b copies its share of `bytes`, the threads of a block split it.
- commref_empty: does nothing (launch cost).
- commref_stream: the bound's STREAM-like kernel (bench/bound.py): nin arrays summed
  into nout, the first `shared` outputs being the inputs.

commref_stream takes an abi.STREAM_ARGS record, the others one abi.COPY_ARGS record
(src, dst, bytes); their names are abi.ENGINE_KERNEL_NAMES. A launch returns
abi.LAUNCH_OK.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from commref.device_kernels import abi, build, cpu_loader

GRIDS = (1, 2, 3, 4, 5)
BLOCKS = (1, 2, 7, 64, 1024)
SENTINEL = 0xA5A5A5A5A5A5A5A5


@pytest.fixture(scope="module")
def kernels() -> cpu_loader.CpuKernels:
    return cpu_loader.cpu_kernels()


def copy_args(src: int = 0, dst: int = 0, nbytes: int = 0) -> np.ndarray:
    a = np.zeros(1, dtype=abi.COPY_ARGS)
    a[0]["src"], a[0]["dst"], a[0]["bytes"] = src, dst, nbytes
    return a


def selftest_expected(grid: int, block: int) -> np.ndarray:
    return (np.arange(grid, dtype=np.uint64) * 1_000_000 + block * (block + 1) // 2 + grid * 1000).astype(np.uint64)


def run_selftest(kernels: cpu_loader.CpuKernels, grid: int, block: int) -> np.ndarray:
    """Launches the self-test kernel; returns dst[0:grid] after checking that the
    element past the grid was not written."""
    dst = np.full(grid + 1, SENTINEL, dtype=np.uint64)
    args = copy_args(dst=dst.ctypes.data)
    assert kernels.launch("commref_engine_selftest", grid, block, args) == abi.LAUNCH_OK
    assert dst[grid] == SENTINEL, f"grid={grid} block={block}: the kernel wrote past dst[gridDim - 1]"
    return dst[:grid]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("grid", GRIDS)
def test_selftest_indices_shared_and_barrier(kernels, grid, block):
    got = run_selftest(kernels, grid, block)
    np.testing.assert_array_equal(got, selftest_expected(grid, block), err_msg=f"grid={grid} block={block}")


def test_selftest_repeated_with_shrinking_blocks(kernels):
    """The same OS threads (pooled workers, the caller) run blocks of successive
    launches; their fiber stacks and __shared__ are reused, and nothing of a previous
    launch may show through."""
    for block in (1024, 64, 7, 2, 1, 7, 1024):
        for grid in (5, 1, 3):
            np.testing.assert_array_equal(
                run_selftest(kernels, grid, block), selftest_expected(grid, block), err_msg=f"grid={grid} block={block}"
            )


COPY_SIZES = (0, 1, 2, 7, 63, 64, 65, 1001, 4099, 65537, (1 << 20) + 3)


@pytest.mark.parametrize("threads", (1, 2, 7, 64))
@pytest.mark.parametrize("grid", (1, 3, 5))
def test_copy_exact(kernels, grid, threads):
    rng = np.random.default_rng(grid * 100 + threads)
    for nbytes in COPY_SIZES:
        for src_off, dst_off in ((0, 0), (1, 3)):  # aligned and odd addresses
            src_buf = rng.integers(0, 256, nbytes + src_off + 16, dtype=np.uint8)
            dst_buf = np.full(nbytes + dst_off + 16, 0x5A, dtype=np.uint8)
            src = src_buf[src_off : src_off + nbytes]
            args = copy_args(src_buf.ctypes.data + src_off, dst_buf.ctypes.data + dst_off, nbytes)
            assert kernels.launch("commref_copy", grid, threads, args) == abi.LAUNCH_OK
            where = f"bytes={nbytes} grid={grid} threads={threads} offsets={src_off},{dst_off}"
            np.testing.assert_array_equal(dst_buf[dst_off : dst_off + nbytes], src, err_msg=where)
            assert (dst_buf[:dst_off] == 0x5A).all(), f"{where}: wrote before dst"
            assert (dst_buf[dst_off + nbytes :] == 0x5A).all(), f"{where}: wrote past dst + bytes"


def test_copy_more_blocks_than_bytes(kernels):
    """Blocks and threads whose share is empty must do nothing."""
    src = np.arange(3, dtype=np.uint8) + 1
    dst = np.zeros(8, dtype=np.uint8)
    assert kernels.launch("commref_copy", 5, 7, copy_args(src.ctypes.data, dst.ctypes.data, 3)) == abi.LAUNCH_OK
    np.testing.assert_array_equal(dst, [1, 2, 3, 0, 0, 0, 0, 0])


def test_empty_kernel(kernels):
    for grid, block in ((1, 1), (4, 1), (2, 1024), (1, 1024)):
        assert kernels.launch("commref_empty", grid, block, copy_args()) == abi.LAUNCH_OK


@pytest.mark.parametrize("grid,block", [(0, 1), (1, 0), (0, 0), (65536, 1), (1, 1025), (1, 4096), (70000, 2000)])
def test_bad_dimensions_raise(kernels, grid, block):
    dst = np.full(2, SENTINEL, dtype=np.uint64)
    with pytest.raises(build.KernelError, match=rf"grid={grid} block={block}"):
        kernels.launch("commref_engine_selftest", grid, block, copy_args(dst=dst.ctypes.data))
    assert (dst == SENTINEL).all(), "a rejected launch ran the kernel"
    # The engine is still usable after a rejected launch.
    np.testing.assert_array_equal(run_selftest(kernels, 2, 3), selftest_expected(2, 3))


def test_unknown_kernel_raises(kernels):
    with pytest.raises(build.KernelError, match="no kernel named"):
        kernels.launch("commref_no_such_kernel", 1, 1, copy_args())


def test_concurrent_launches_from_python_threads(kernels):
    """Several Python threads launch at once (as ThreadWorld ranks do): the worker pool,
    per-thread fiber stacks and per-block __shared__ must keep launches apart. ctypes
    releases the GIL during a launch, so these really overlap."""
    nthreads, iterations = 6, 25
    configs = [(3, 7), (2, 1), (4, 64), (1, 1024), (5, 2), (2, 33)]
    start = threading.Barrier(nthreads)
    errors: list[str] = []

    def worker(i: int) -> None:
        grid, block = configs[i % len(configs)]
        rng = np.random.default_rng(i)
        try:
            start.wait(timeout=60)
            for it in range(iterations):
                got = run_selftest(kernels, grid, block)
                if not np.array_equal(got, selftest_expected(grid, block)):
                    errors.append(f"thread {i} iteration {it}: selftest grid={grid} block={block} got {got}")
                    return
                n = int(rng.integers(1, 200_000))
                src = rng.integers(0, 256, n, dtype=np.uint8)
                dst = np.zeros(n, dtype=np.uint8)
                status = kernels.launch("commref_copy", grid, block, copy_args(src.ctypes.data, dst.ctypes.data, n))
                if status != abi.LAUNCH_OK or not np.array_equal(src, dst):
                    errors.append(
                        f"thread {i} iteration {it}: copy of {n} bytes grid={grid} block={block} "
                        f"status={status} wrong bytes={int(np.count_nonzero(src != dst))}"
                    )
                    return
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "concurrent launches did not finish within 120 s"
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("binding", ["extension", "ctypes"])
def test_bound_launches_run_and_fail_as_launch_does(binding, monkeypatch):
    """A prepared launch and a group of them run through the call CpuKernels.bind made,
    by the commref_pycall extension (built here: this Python has its headers) and by the
    ctypes fallback alike, with the same results and statuses as launch()."""
    monkeypatch.setenv("COMMREF_CPU_BINDING", "ctypes" if binding == "ctypes" else "auto")
    kernels = cpu_loader.CpuKernels(cpu_loader.build_cpu_library())
    assert kernels.binding == binding
    dst = np.full(4, SENTINEL, dtype=np.uint64)
    args = copy_args(dst=dst.ctypes.data)
    prepared = kernels.prepared("commref_engine_selftest", 3, 5, args.ctypes.data)
    for _ in range(3):
        dst[:] = SENTINEL
        assert prepared.call() == abi.LAUNCH_OK
        np.testing.assert_array_equal(dst[:3], selftest_expected(3, 5))
        assert dst[3] == SENTINEL
    # A group: two copies, then a launch the engine refuses (block 2000), then one not run.
    src = np.arange(64, dtype=np.uint8) + 1
    outs = [np.zeros(64, dtype=np.uint8) for _ in range(4)]
    records = [copy_args(src.ctypes.data, o.ctypes.data, 64) for o in outs]
    descs = np.zeros(4, dtype=abi.LAUNCH_DESC)
    for i, (rec, block) in enumerate(zip(records, (7, 1, 2000, 3))):
        descs[i] = (kernels.entry("commref_copy"), rec.ctypes.data, 2, block)
    status = kernels.bind(True, descs.ctypes.data, 4)()
    assert status == (2 << 8) | abi.LAUNCH_REFUSED, f"status {status:#x}"
    np.testing.assert_array_equal(outs[0], src)
    np.testing.assert_array_equal(outs[1], src)
    assert not outs[3].any(), "the member after the refused one ran"
    assert kernels.bind(True, descs.ctypes.data, 2)() == abi.LAUNCH_OK


def test_pycall_refuses_bad_bindings():
    extension = cpu_loader.pycall()
    assert extension is not None, "commref_pycall did not build against this Python's headers"
    with pytest.raises(ValueError, match="nonzero entry"):
        extension.Bound(0, 1)
    with pytest.raises(ValueError, match="32 bits"):
        extension.Bound(1, 1, 1 << 33)
    with pytest.raises(TypeError, match="takes no arguments"):
        extension.Bound(1, 1)(5)
    with pytest.raises(TypeError, match="sendbuf must be a numpy array, got list"):
        extension.Arrays([1.0], np.zeros(1))
    with pytest.raises(TypeError, match="more than 8 dimensions"):
        extension.Arrays(np.zeros((1,) * 9), np.zeros(1))


def test_pycall_arrays_match_only_the_same_arrays_unchanged():
    """commref_pycall.Arrays answers what RepeatedCall's Python test answers: the same
    live arrays, with their shape, strides and dtype, the second still writeable."""
    a, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    same = cpu_loader.pycall().Arrays(a, b)
    assert same(a, b)
    assert not same(b, a) and not same(a, a) and not same(a.copy(), b) and not same(a, b[:])
    b.flags.writeable = False
    assert not same(a, b)
    b.flags.writeable = True
    b.shape = (2, 2)
    assert not same(a, b)
    b.shape = (4,)
    a.dtype = np.int32
    assert not same(a, b)
    a.dtype = np.float32
    assert same(a, b)
    square = np.ones((2, 2), np.float32)
    same_square = cpu_loader.pycall().Arrays(square, b)
    square.strides = (4, 8)  # transposed in place: a change of strides alone
    assert not same_square(square, b)
    square.strides = (8, 4)
    assert same_square(square, b)
    del a
    assert not same(np.ones(4, np.float32), b), "a dead array matched its successor"


def test_pycall_repeats_answers_as_the_python_test_does():
    """commref_pycall.Repeats and launch_record's Python fallback say alike whether a
    group's calls as given repeat the kept members: records of the same length, each
    (sendbuf, recvbuf, *given) with its given the very objects (an equal op built anew
    is not), its arrays matched by the member's matcher; a member that raises raises."""
    from commref.collectives.launch_record import _repeats

    a, b, c = np.ones(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32)
    op = "sum"
    givens = [("allreduce", op, 0, None), ("allreduce", op, 0, None)]
    matchers = [cpu_loader.pycall().Arrays(a, b), cpu_loader.pycall().Arrays(a, c)]
    native = cpu_loader.pycall().Repeats(givens, matchers)

    def fallback(records):
        return _repeats(givens, matchers, records)

    same = [(a, b, "allreduce", op, 0, None), (a, c, "allreduce", op, 0, None)]
    anew = "".join(["s", "um"])
    cases = {
        "the same": (same, True),
        "one fewer": (same[:1], False),
        "one more": (same + same[:1], False),
        "an equal op built anew": ([same[0], (a, c, "allreduce", anew, 0, None)], False),
        "other arrays": ([same[0], (a, b, "allreduce", op, 0, None)], False),
        "a shorter record": ([same[0], (a, c, "allreduce", op, 0)], False),
        "not a tuple": ([same[0], list(same[1])], False),
    }
    for what, (records, expected) in cases.items():
        assert native(records) is expected and fallback(records) is expected, what
    c.shape = (2, 2)
    assert not native(same) and not fallback(same), "an array reshaped in place"

    def broken(x, y):
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        cpu_loader.pycall().Repeats(givens[:1], [broken])(same[:1])
    with pytest.raises(ValueError, match="as many matchers as givens"):
        cpu_loader.pycall().Repeats(givens, matchers[:1])
    with pytest.raises(TypeError, match="records must be a list"):
        native(tuple(same))


def stream_args(base: int, words: int, nin: int, nout: int, shared: int, streamed: bool) -> np.ndarray:
    a = np.zeros(1, dtype=abi.STREAM_ARGS)
    a[0]["base"], a[0]["words"] = base, words
    a[0]["nin"], a[0]["nout"], a[0]["shared"], a[0]["streamStores"] = nin, nout, shared, int(streamed)
    return a


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("grid,threads", [(1, 1), (3, 1), (2, 4)])
@pytest.mark.parametrize(
    "shape", [(1, 1, 0), (2, 1, 0), (2, 2, 0), (2, 2, 2), (3, 1, 1), (1, 3, 0), (4, 4, 4), (1, 1, 1), (1, 0, 0)]
)
def test_stream_sums_inputs_into_every_output(kernels, shape, grid, threads, streamed):
    """commref_stream: every output word = the wrapping sum of the inputs' words at its
    index (a copy for one input), outputs past `shared` after the inputs, inputs that
    are not outputs unchanged, nothing written outside the arrays (64-byte aligned,
    whole lines, as bench/bound.py lays them out)."""
    nin, nout, shared = shape
    words = 16 * 37
    arrays = nin + nout - shared
    raw = np.zeros(arrays * words + 64, dtype=np.uint32)
    off = (-raw.ctypes.data % 64) // 4
    buf = raw[off : off + arrays * words + 16]
    rng = np.random.default_rng(sum(shape))
    buf[:] = rng.integers(0, 2**32, size=buf.size, dtype=np.uint32)
    before = buf.copy()
    a = stream_args(buf.ctypes.data, words, nin, nout, shared, streamed)
    assert kernels.launch("commref_stream", grid, threads, a) == abi.LAUNCH_OK
    ins = before[: nin * words].reshape(nin, words)
    total = ins.sum(axis=0, dtype=np.uint32)  # numpy wraps like the kernel
    after = buf[: arrays * words].reshape(arrays, words)
    for j in range(nout):
        np.testing.assert_array_equal(after[j if j < shared else nin + j - shared], total, err_msg=f"output {j}")
    for k in range(shared, nin):
        np.testing.assert_array_equal(after[k], ins[k], err_msg=f"input {k} changed")
    np.testing.assert_array_equal(buf[arrays * words :], before[arrays * words :], err_msg="wrote past the arrays")


def test_stream_refuses_bad_shapes(kernels):
    """Arguments the kernel cannot honour (words not whole lines, more shared arrays
    than inputs, no input) leave memory alone."""
    buf = np.full(64, 7, dtype=np.uint32)
    for shape, words in (((1, 1, 0), 17), ((1, 2, 2), 16), ((0, 1, 0), 16)):
        a = stream_args(buf.ctypes.data, words, *shape, False)
        assert kernels.launch("commref_stream", 1, 1, a) == abi.LAUNCH_OK
        assert (buf == 7).all(), shape
