"""Hierarchical scratch on the GPU: allocated from the pool of the stream its
phases run on.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

# ---- hierarchical scratch on the GPU ----


class _StreamXp:
    """CuPy's current stream, ExternalStream and pool allocation as Hierarchy.scratch uses
    them: each empty() records the stream current when it was allocated."""

    def __init__(self):
        xp, self.allocated, self.current = self, [], [types.SimpleNamespace(ptr=0)]

        class Stream:
            def __init__(self, ptr):
                self.ptr = ptr

            def __enter__(self):
                xp.current.append(self)
                return self

            def __exit__(self, *exc):
                xp.current.pop()

        self.Stream = Stream
        self.cuda = types.SimpleNamespace(ExternalStream=Stream, get_current_stream=lambda: xp.current[-1])

    def empty(self, count, dtype):
        self.allocated.append(self.current[-1].ptr)
        return np.empty(count, dtype)


class _PhaseRecorder:
    def __init__(self, name, log):
        self.name, self.log = name, log
        self.world = types.SimpleNamespace(members=[0, 1])

    def reduce_scatter(self, send, recv, op, stream=None):
        self.log.append((self.name, "reduce_scatter", stream))

    def allgather(self, send, recv, stream=None):
        self.log.append((self.name, "allgather", stream))

    def _collective(self, coll, send, recv, op, root, stream, algorithm, protocol, divisor):
        self.log.append((self.name, coll, stream))


@pytest.mark.parametrize("kind", ["cupy stream", "CUstream handle"])
def test_hierarchical_scratch_is_allocated_on_the_stream_its_phases_run_on(kind):
    """A caller's stream= other than the current one: the scratch comes from the pool of
    that stream (whose later allocations wait for the phases), not the current stream's
    (whose next allocation could take it while the phases still read it)."""
    from commref.collectives.hierarchical import Hierarchy, NodeShape

    xp, log = _StreamXp(), []
    h = Hierarchy(
        NodeShape(nodes=2, per_node=2, node=0, local=0), _PhaseRecorder("intra", log), _PhaseRecorder("inter", log), 4
    )
    stream = xp.Stream(0x77) if kind == "cupy stream" else 0x77
    h.reduce_scatter(np.zeros(16, np.float32), np.zeros(4, np.float32), "sum", stream, xp)
    h.allgather(np.zeros(4, np.float32), np.zeros(16, np.float32), stream, xp)
    assert xp.allocated == [0x77, 0x77], "scratch allocated on a stream the phases do not run on"
    assert xp.current[-1].ptr == 0, "the current stream is restored"
    assert [s for _, _, s in log] == [stream] * len(log) and len(log) == 6, log
    h.reduce_scatter(np.zeros(16, np.float32), np.zeros(4, np.float32), "sum", None, xp)
    assert xp.allocated[-1] == 0, "stream=None: the current stream"
