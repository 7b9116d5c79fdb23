"""What the runtime asks the ordering study: which cell (protocol row, model column;
docs/ordering.md) models a GIN wire carrying line protocols or counted writes, and
the study's verdict on a cell (its explorer, run once per cell and process)."""

from __future__ import annotations

import functools

from commref.transports.gin import semantics

__all__ = ["counted_writes_cell", "counted_writes_refusal", "line_cell", "study_safe", "wire_column"]


def line_cell(protocol: str, transport: semantics.Transport, segment_bytes: int) -> tuple[str, str] | None:
    """The cell of the ordering study (docs/ordering.md: protocol row, model column) that
    models `protocol`'s lines ("ll" or "ll128") landing on a wire of `transport` that
    places `segment_bytes` at a time, or None where no cell models the landing.

    The proxies land each segment with landLines (include/commref/proto.h): every
    aligned 16-byte line by one store, in ascending address order. Segments are cut at
    multiples of segment_bytes of the destination (semantics.segments). So:
      - row: an LL line lands whole when segment_bytes is a multiple of 16 (ll-flag), as
        two 8-byte halves when only a multiple of 8 (ll-flag-8B); an LL128 line's data
        and flag are separate 8-byte units either way (ll-flag-8B: safe only where the
        units of a line land in order);
      - column: ordered is the ordered wire; on the unordered one, segments that are whole
        128-byte blocks (segment_bytes a multiple of 128) land each aligned block of a
        put in order (unordered+block128); otherwise unordered, or unordered+flush_orders
        where a flush orders later writes (what is safe without that is safe with it).
    The runtime wires place no duplicates (the lossy layer drops them)."""
    if segment_bytes % 8:
        return None
    row = "ll-flag" if protocol == "ll" and segment_bytes % 16 == 0 else "ll-flag-8B"
    if transport.ordered:
        column = "ordered"
    elif transport.duplicates:
        column = "unordered+duplicates"
    elif transport.placement == "block128" or segment_bytes % semantics.BLOCK_BYTES == 0:
        column = "unordered+block128"
    elif transport.flush_orders_later_writes:
        column = "unordered+flush_orders"
    else:
        column = "unordered"
    return row, column


def wire_column(transport: semantics.Transport) -> str:
    """The column of the ordering study that models a wire of `transport` for messages
    on one context (whole puts, whatever their segment size)."""
    if transport.ordered:
        return "ordered"
    if transport.duplicates:
        return "unordered+duplicates"
    if transport.placement == "block128":
        return "unordered+block128"
    if transport.flush_orders_later_writes:
        return "unordered+flush_orders"
    return "unordered"


@functools.cache
def study_safe(row: str, column: str, strength: str | None = None) -> bool:
    """The ordering study's verdict on a cell (the explorer's exhaustive search, at the
    study's default bound; a few milliseconds, once per process). `strength`: "weak"
    or "strong" for the rows with signals (None: weak), None for the others."""
    from commref.transports.gin.study import explorer, signaling

    return explorer.run_cell(signaling.PROTOCOL_BY_NAME[row], strength, signaling.MODEL_BY_NAME[column]).safe


def counted_writes_cell(transport: semantics.Transport) -> tuple[str, str]:
    """The cell of the ordering study that models counted writes (device.h countedPut)
    on a wire of `transport`: the counted-writes row, the wire's column."""
    return "counted-writes", wire_column(transport)


def counted_writes_refusal(transport: semantics.Transport | None) -> str | None:
    """Why counted writes cannot run over GIN links of `transport` (None: no GIN link,
    or the ordering study finds them safe there)."""
    if transport is None:
        return None
    row, column = counted_writes_cell(transport)
    if study_safe(row, column):
        return None
    return (
        f"counted writes over GIN on the {transport.name} wire: the ordering study finds {row} on {column} "
        f"unsafe (commref study --protocol {row} --transport {column})"
    )
