"""Windows, peers and host words on a GPU and their teardown, through the stand-in for
CuPy (stand_ins.FakeCuda, conftest's `fake`): windows are zeroed on a stream that is
synchronized before registration completes; peers without peer access stay unmapped
and are refused with the reason; host words are pinned portable and mapped (the shared
abort word once per process, reference-counted); close() frees a rank's own window only
after every rank has finished, and nothing a failed peer may still use.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from stand_ins import run_threads

from commref.collectives import launch_record
from commref.collectives.communicator import Communicator
from commref.transports.errors import CapabilityError

# ---- windows, peers, host words ----


def _construct(world, fake, device_of_rank):
    comm = Communicator(world, "cuda", max_channels=1, device_id=device_of_rank(world.rank))
    comm.close()
    return True


def test_window_zeroed_on_a_stream_synchronized_before_use(fake):
    run_threads(2, _construct, fake, lambda r: 0)
    memsets = fake.calls("memsetAsync")
    assert len(memsets) == 2
    for _, ptr, value, nbytes, stream in memsets:
        assert value == 0 and stream != 0, "zeroed on a stream of its own, not the legacy default stream"
        log = [e[1:] for e in fake.log]
        after = log[log.index(("memsetAsync", ptr, value, nbytes, stream)) :]
        assert ("streamSynchronize", stream) in after


def test_no_peer_access_leaves_the_peer_unmapped_and_is_refused(fake):
    fake.can_access_peer = lambda a, b: False
    with pytest.raises(CapabilityError, match="no peer access between device 0 and device 1"):
        run_threads(2, _construct, fake, lambda r: r)
    assert not fake.calls("deviceEnablePeerAccess")


def test_peer_access_enabled_once_per_pair(fake, monkeypatch):
    from commref.transports import windows

    monkeypatch.setattr(windows, "_peer_enabled", set())
    run_threads(2, _construct, fake, lambda r: r)
    run_threads(2, _construct, fake, lambda r: r)
    enabled = [c[1:] for c in fake.calls("deviceEnablePeerAccess")]
    assert sorted(enabled) == [(0, 1), (1, 0)]


def test_host_words_pinned_and_abort_word_registered_once(fake):
    abort = np.zeros(1, np.uint64)
    words = [launch_record.HostWords(abort, "cuda", d) for d in (0, 1, 0)]
    allocs = fake.calls("hostAlloc")
    assert len(allocs) == 3 and all(flags == 1 | 2 for _, _, _, flags in allocs), "portable and mapped"
    assert all(not w.failed for w in words), "the error record starts zeroed"
    (reg,) = fake.calls("hostRegister")
    assert reg[3] == 1 | 2 and reg[1] <= abort.ctypes.data < reg[1] + reg[2]
    words[0].close()
    words[1].close()
    assert not fake.calls("hostUnregister"), "still in use"
    words[2].close()
    words[2].close()  # idempotent
    assert fake.calls("hostUnregister") == [("hostUnregister", reg[1])]
    assert len(fake.calls("freeHost")) == 3


def test_abort_word_registered_elsewhere_is_used_not_unregistered(fake):
    abort = np.zeros(1, np.uint64)
    start = abort.ctypes.data // 4096 * 4096
    fake.registered[start] = 4096  # someone else pinned that page
    w = launch_record.HostWords(abort, "cuda", 0)
    w.close()
    assert not fake.calls("hostUnregister")


def test_host_register_errors_other_than_already_registered_raise(fake, monkeypatch):
    runtime = fake.module.cuda.runtime

    def refuse(ptr, nbytes, flags):
        raise runtime.CUDARuntimeError(2)  # cudaErrorMemoryAllocation

    monkeypatch.setattr(runtime, "hostRegister", refuse)
    with pytest.raises(runtime.CUDARuntimeError):
        launch_record.HostWords(np.zeros(1, np.uint64), "cuda", 0)
    assert len(fake.calls("freeHost")) == 1, "the error record allocated before is released"


# ---- teardown ----


def _close_late(world, fake):
    comm = Communicator(world, "cuda", max_channels=1)
    if world.rank == 1:
        time.sleep(0.3)  # still "running": rank 0 must not free its window meanwhile
        fake.note("rank 1 done")
    comm.close()
    comm.close()  # idempotent
    return comm.window.address


def test_close_frees_own_window_after_every_rank_is_done(fake):
    addresses = run_threads(2, _close_late, fake)
    log = [e[1:] for e in fake.log]
    done = log.index(("rank 1 done",))
    frees = [i for i, e in enumerate(log) if e[0] == "free" and e[1] in addresses]
    assert len(frees) == 2 and min(frees) > done, "a window was freed while a peer still ran"


def test_close_after_a_peer_failed_returns_and_frees_nothing_a_peer_may_use(fake):
    seen = {}

    def body(world):
        comm = Communicator(world, "cuda", max_channels=1)
        if world.rank == 1:
            raise RuntimeError("rank 1 fails")
        time.sleep(0.1)  # rank 1 has failed by now
        t0 = time.monotonic()
        try:
            comm.close()
        except Exception as e:  # the job is aborting: close says so, after doing what is safe
            seen["error"] = type(e).__name__
        seen["seconds"] = time.monotonic() - t0
        seen["window"] = comm.window.address
        comm.close()  # a second close does nothing

    with pytest.raises(RuntimeError, match="rank 1 fails"):
        run_threads(2, body)
    assert seen["error"] == "CommAborted" and seen["seconds"] < 5
    assert ("free", seen["window"]) not in fake.calls("free"), "freed while a failed peer may still map it"
