"""Trace replay: the judge of what a GIN engine did, link by link, against the model.

An engine that traces (the Python proxy's and the native engine's ``trace``, the GPU
proxy's) records per (peer, ctx) link, in the order they happen: what was posted
(("post", seq, offset, nbytes, signal)), flushes, and every event the link made happen:
a segment placed (("seg", seq, segment, copy); copy 1 is a duplicate), a put's whole
data on an ordered wire (("data", seq): its segments in address order), a signal
applied, a counter bumped, a get landed. The replay rebuilds each link's
semantics.Plan from the post records alone (sequence numbers, after-flush marks and
segments computed here) and asks semantics.enabled() whether each recorded event was
enabled at its point. The judge is bound when this module is imported, so a test that
patches the scheduler's view of semantics cannot change it.
"""

from __future__ import annotations

from . import semantics
from .backends import BACKENDS
from .semantics import Event, Plan, Put

MODEL_ENABLED = semantics.enabled  # the judge, bound before anything patches the module
SEGMENT_BYTES = 64  # the segment size the traced runs use unless told otherwise


def model_transport(backend: str, wire: str) -> semantics.Transport:
    """The semantics a backend on a wire promises (the rule plan.plan_gin applies)."""
    return semantics.Transport(
        wire,
        ordered=wire == "ordered",
        flush_orders_later_writes=BACKENDS[backend].caps.local_completion_orders_later_writes,
    )


class Disallowed(AssertionError):
    """A recorded event the model does not allow at its point, or a posted one that never landed."""


def replay(link, records, transport: semantics.Transport, strong_always: bool, segment_bytes: int) -> dict:
    """Checks one link's records against semantics.enabled(); returns counts per kind.
    Raises Disallowed at the first event the model does not allow at its point, or when
    a posted event never landed."""
    puts: list[Put] = []  # the live window of the plan (fully landed prefix dropped)
    segs: list = []
    landed: set = set()
    base = 0  # seq of puts[0]
    next_seq = 0
    flushed = False
    counts = {"post": 0, "seg": 0, "dup": 0, "signal": 0, "counter": 0, "get": 0, "hold": 0, "release": 0}

    def check(k: int, ev: Event) -> None:
        if ev in landed or ev not in MODEL_ENABLED(transport, Plan(puts, segs), landed, strong_always):
            what = "signal" if ev.is_signal else f"segment {ev.segment} copy {ev.copy}"
            pending = [
                (p.seq, sorted(e for e in {Event(i, s) for s in range(len(segs[i]))} if e not in landed))
                for i, p in enumerate(puts)
                if i < ev.put
            ]
            raise Disallowed(
                f"link {link}: record {k} ({records[k]}): {what} of put {base + ev.put} "
                f"({puts[ev.put].signal}) not enabled; earlier puts with data pending: "
                f"{[(s, e) for s, e in pending if e][:5]}"
            )
        landed.add(ev)

    def index(k: int, seq: int) -> int:
        i = seq - base
        if not 0 <= i < len(puts):
            raise Disallowed(f"link {link}: record {k} ({records[k]}) names put {seq}, not posted or already done")
        return i

    for k, rec in enumerate(records):
        kind = rec[0]
        if kind == "post":
            _, seq, offset, nbytes, signal = rec
            if seq != next_seq:
                raise Disallowed(f"link {link}: post {seq} out of sequence (expected {next_seq})")
            put = Put(link[1], seq, offset, nbytes, signal, flushed and next_seq > 0)
            puts.append(put)
            segs.append(semantics.segments(put, segment_bytes))
            next_seq, flushed = next_seq + 1, False
            counts["post"] += 1
        elif kind == "flush":
            flushed = True
        elif kind == "seg":
            _, seq, s, copy = rec
            check(k, Event(index(k, seq), s, copy))
            counts["dup" if copy else "seg"] += 1
        elif kind == "data":  # ordered wire: the whole data in one piece, segments in address order
            i = index(k, rec[1])
            for s in range(len(segs[i])):
                check(k, Event(i, s))
                counts["seg"] += 1
        elif kind == "signal":
            check(k, Event(index(k, rec[1]), -1))
            counts["signal"] += 1
        elif kind == "counter":  # a local completion: semantics.py does not order it against landings
            if not 0 <= rec[1] < next_seq:
                raise Disallowed(f"link {link}: record {k} ({rec}) names put {rec[1]}, never posted")
            counts["counter"] += 1
        elif kind in ("get", "hold", "release"):
            counts[kind] += 1
        elif kind != "doorbell":
            raise Disallowed(f"link {link}: unknown record {rec}")
        # drop the fully landed prefix (it cannot change what enabled() says of later puts)
        n = 0
        while (
            n < len(puts)
            and all(Event(n, s) in landed for s in range(len(segs[n])))
            and (puts[n].signal is None or Event(n, -1) in landed)
        ):
            n += 1
        if n:
            del puts[:n], segs[:n]
            landed = {Event(e.put - n, e.segment, e.copy) for e in landed if e.put >= n}
            base += n
    if puts:
        raise Disallowed(
            f"link {link}: puts {base}..{next_seq - 1} never fully landed "
            f"(first: {puts[0]}, landed {sorted(e for e in landed if e.put == 0)})"
        )
    return counts


def replay_trace(trace: dict, backend: str, wire: str, segment_bytes: int = SEGMENT_BYTES) -> dict:
    """Replays every link of an engine's trace (replay); counts per kind, summed."""
    transport = model_transport(backend, wire)
    total: dict = {}
    for link, records in trace.items():
        for key, n in replay(link, records, transport, BACKENDS[backend].strong_always, segment_bytes).items():
            total[key] = total.get(key, 0) + n
    return total
