"""What the communicator and the collectives need of a GIN progress engine, and what an
engine says when it refuses a descriptor.

GinEngine is the interface: proxy.GinProxy (the Python proxy: any wire, observer,
faults) and native.NativeProxy (the native engine: the ordered wire) implement it, and
plan.GinPlan.start_proxy returns one of them (or gpu_proxy.GpuProxy on a GPU).
GinWindowEngine adds the symmetric windows a descriptor may name (gin.h, "Windows"),
which only an engine whose `carries_windows` is true offers. EngineSite is what the
Python proxy and the native engine are both built on, their constructors' first argument.

Refusals: the conditions on which an engine refuses a descriptor are codes
(abi.GIN_REFUSALS, gin.h's GinRefusalCode, in the order every engine tests them); this
module holds the one text of each (REFUSAL_TEXT) and formats it (refusal()), for the
Python proxy, which tests the conditions itself, and for the native engine, which
reports a code and its numbers (abi.GIN_REFUSAL). Both engines therefore say the same
thing about the same descriptor.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from commref.device_kernels import abi
from commref.transports.gin import semantics
from commref.transports.gin.backends import Backend
from commref.transports.gin.wires import ProxyError


class EngineSite(NamedTuple):
    """Where a GIN engine runs: this rank's world, its connection window (windows.Window)
    and the window's layout (abi.WINDOW_LAYOUT), the descriptor queue's capacity, the
    backend, the wire's transport and the network ("shm" or "mpi")."""

    world: Any
    window: Any
    layout: np.ndarray
    capacity: int
    backend: Backend
    transport: semantics.Transport
    network: str


__all__ = ["GinEngine", "GinWindowEngine", "REFUSAL_TEXT", "refusal", "interface_gaps"]


@runtime_checkable
class GinEngine(Protocol):
    """One rank's GIN progress engine: it takes the descriptors its kernels post to the
    queue (queue.py) and carries them over its wire. Lifecycle: start() once the window
    is registered; at close quiesce(timeout) (every rank, so that peers get this rank's
    last data and credits) then stop()."""

    carries_windows: bool  # whether descriptors may name windows other than 0 (GinWindowEngine)

    def start(self) -> None:
        """Starts taking descriptors (a thread of its own)."""

    def quiesce(self, timeout: float) -> None:
        """Returns once every operation claimed so far has been taken and landed (network
        mpi: sent); ProxyError naming rank, expected and seen at the deadline."""

    def stop(self) -> None:
        """Stops and joins the engine (idempotent); stats, error and trace stay readable."""

    def pending(self, peer: int | None = None) -> bool:
        """Whether anything taken (for `peer`, or any) has not landed yet."""

    # Why the engine ended (it raised the world's abort word first), or None.
    error: BaseException | None
    # Counts so far, at least "ops" (descriptors taken) and "events" (landings).
    stats: dict
    # Set to {} to record per (peer, ctx) what was posted and what landed, in the
    # scheduler's tuples (scheduler.py); None when not recording.
    trace: dict | None


@runtime_checkable
class GinWindowEngine(GinEngine, Protocol):
    """An engine that carries symmetric windows (carries_windows true)."""

    def add_window(self, window_id: int, window) -> None:
        """Window `window_id` (1 ..< abi.GIN_MAX_WINDOWS) for descriptors' window ids:
        a transports.windows.SymmetricWindow of this rank. Between launches only."""

    def remove_window(self, window_id: int) -> None:
        """Forgets window `window_id`."""


def interface_gaps(cls: type, protocol: type = GinEngine) -> list[str]:
    """What `cls` lacks of `protocol`, one line each (empty: it implements it): a member
    missing, a method where a property is due or the reverse, or a method whose
    parameters differ from the protocol's by name, kind or default."""
    gaps = []
    members = {
        name
        for klass in protocol.__mro__
        if klass not in (object, Protocol) and getattr(klass, "_is_protocol", False)
        for name in (*vars(klass), *getattr(klass, "__annotations__", {}))
    }
    for name in sorted(members):
        if name.startswith("_"):
            continue
        want = inspect.getattr_static(protocol, name, None)
        have = inspect.getattr_static(cls, name, _MISSING)
        if have is _MISSING:
            annotated = any(name in vars(k).get("__annotations__", {}) for k in cls.__mro__)
            if not annotated and not _set_in_init(cls, name):
                gaps.append(f"{cls.__name__}.{name}: missing")
            continue
        if isinstance(want, property) or want is None:  # a property or a plain attribute
            if callable(have) and not isinstance(have, property):
                gaps.append(f"{cls.__name__}.{name}: a method, {protocol.__name__} has an attribute")
            elif (
                isinstance(want, property)
                and want.fset is not None
                and isinstance(have, property)
                and have.fset is None
            ):
                gaps.append(f"{cls.__name__}.{name}: read-only, {protocol.__name__} sets it")
            continue
        if not callable(have) or isinstance(have, property):
            gaps.append(f"{cls.__name__}.{name}: not a method")
            continue
        w, h = _params(want), _params(have)
        if w != h:
            gaps.append(f"{cls.__name__}.{name}({_shown(have)}): {protocol.__name__} has {name}({_shown(want)})")
    return gaps


_MISSING = object()


def _params(fn) -> list[tuple]:
    """A method's parameters after self: (name, kind, default) each."""
    return [(p.name, p.kind, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]


def _shown(fn) -> str:
    """A method's parameters after self as written, without annotations."""
    return ", ".join(
        str(p.replace(annotation=inspect.Parameter.empty)) for p in list(inspect.signature(fn).parameters.values())[1:]
    )


def _set_in_init(cls: type, name: str) -> bool:
    """Whether some __init__ of cls's classes assigns self.<name> (an instance attribute)."""
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            for target in targets:
                for t in ast.walk(target):
                    if (
                        isinstance(t, ast.Attribute)
                        and t.attr == name
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    ):
                        return True
    return False


# The one text of each refusal (abi.GIN_REFUSALS), after "rank R: ". Fields: op, peer
# (the descriptor's; for the MPI network's landing and get_request the source), nranks,
# backend, access (abi.GIN_ACCESSES' name in words), window, owner, offset, end (offset +
# bytes, as the 64-bit sum), size, window_name ("window W", or "connection window").
REFUSAL_TEXT = {
    abi.GIN_REFUSALS["peer_outside"]: "GIN operation {op} names peer {peer} outside [0, {nranks})",
    abi.GIN_REFUSALS["peer_unmapped"]: "GIN peer {peer}'s window is not mapped here (network shm)",
    abi.GIN_REFUSALS["window_unknown"]: "GIN {access} (peer {peer}) names window {window}, which this engine was "
    "not given",
    abi.GIN_REFUSALS["outside_window"]: "GIN {access} (peer {peer}) reaches [{offset}, {end}), outside the "
    "{size}-byte {window_name}",
    abi.GIN_REFUSALS["window_unmapped"]: "GIN {access}: rank {owner}'s window {window} is not mapped here",
    abi.GIN_REFUSALS["strong_signal"]: "strong signal to peer {peer} on backend {backend}, which offers weak "
    "signals only",
    abi.GIN_REFUSALS["va_signal"]: "VA signal to peer {peer} on backend {backend}",
    abi.GIN_REFUSALS["signal_add"]: "signal add on backend {backend}, whose signals count completed writes",
    abi.GIN_REFUSALS["unknown_op"]: "unknown GIN operation {op}",
}
assert set(REFUSAL_TEXT) == set(abi.GIN_REFUSALS.values()), "every refusal code has one text"

_ACCESS_NAMES = {code: name.replace("_", " ") for name, code in abi.GIN_ACCESSES.items()}


def refusal(
    rank: int,
    code: int,
    *,
    nranks: int = 0,
    backend: str = "",
    access: int = 0,
    op: int = 0,
    peer: int = 0,
    owner: int = 0,
    window: int = 0,
    offset: int = 0,
    bytes: int = 0,  # noqa: A002
    size: int = 0,
) -> ProxyError:
    """The ProxyError of refusal `code` (abi.GIN_REFUSALS) with its numbers (the fields of
    abi.GIN_REFUSAL, and what the engine's host knows: `nranks`, `backend`)."""
    text = REFUSAL_TEXT.get(code)
    if text is None:
        return ProxyError(f"rank {rank}: the GIN engine refused a descriptor with unknown refusal code {code}")
    return ProxyError(
        f"rank {rank}: "
        + text.format(
            op=op,
            peer=peer,
            nranks=nranks,
            backend=backend,
            access=_ACCESS_NAMES.get(access, f"access {access}"),
            window=window,
            owner=owner,
            offset=offset,
            end=(offset + bytes) % (1 << 64),
            size=size,
            window_name=f"window {window}" if window else "connection window",
        )
    )


class DescriptorChecks:
    """The refusals of a Python-side engine (GinProxy, GpuProxy), with refusal()'s texts
    in abi.GIN_REFUSALS' order as the native engine makes them. For a class with `rank`,
    `world`, `backend` and `_window_bytes` (the connection window, every rank's as long)."""

    def _check(self, window: int, offset: int, nbytes: int, access: str, op: int, peer: int) -> None:
        """Refuses an access of [offset, offset + nbytes) in window `window` that this
        engine does not carry (a window other than 0) or that leaves the window."""
        size = self._window_bytes if window == 0 else 0
        if size == 0:
            raise self._refusal("window_unknown", op, peer, access=access, window=window, offset=offset, nbytes=nbytes)
        if offset > size or nbytes > size - offset:
            raise self._refusal(
                "outside_window", op, peer, access=access, window=window, offset=offset, nbytes=nbytes, size=size
            )

    def _refusal(
        self,
        code: str,
        op: int,
        peer: int,
        access: str = "",
        window: int = 0,
        offset: int = 0,
        nbytes: int = 0,
        size: int = 0,
    ) -> ProxyError:
        return refusal(
            self.rank,
            abi.GIN_REFUSALS[code],
            nranks=self.world.size,
            backend=self.backend.name,
            access=abi.GIN_ACCESSES.get(access, 0),
            op=op,
            peer=peer,
            window=window,
            offset=offset,
            bytes=nbytes,
            size=size,
        )
