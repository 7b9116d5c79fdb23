"""Where a call's data moves: the one decision of direct kernel or FIFO, and of LSA or
pushed.

The direct kernels (kernels/direct.cu) read each byte once where its owner left it and
store it where it must land, instead of copying it twice through a FIFO. With every
peer over LSA they load from and store to the peers' symmetric buffers; with peers over
GIN they push: puts from and into symmetric windows that the GIN engine carries. Every
other call runs a ring or tree kernel through the connections' FIFOs.

DirectRouter.route decides it for a call, in stages: the communicator (its ranks, its
GIN connections and engine: GinPlan.direct_refusal), the collective (whether it has a
direct kernel, and one that pushes: catalogue.Collective.gin_windows), the call (count,
in place, whether its buffers lie in symmetric windows). DirectRouter.kind is the
communicator's own answer (Communicator.direct_kernels). The tuner takes the route as
given (tuner.plan's `symmetric` and `why_not_direct`).
"""

from __future__ import annotations

from dataclasses import dataclass

from commref.device_kernels import abi

LSA, PUSH = "lsa", "push"


@dataclass(frozen=True)
class Route:
    """`direct`: how the call's direct kernel runs (LSA or PUSH), None: through the
    FIFOs; `sym`: the direct kernel's symSend and symRecv (SymmetricWindows.direct);
    `refusal`: why no direct kernel can run the call, as the sentence a call that asks
    for one raises (None where one runs, or where nobody asked)."""

    direct: str | None
    sym: tuple | None = None
    refusal: str | None = None


FIFO = Route(None)


def needs_symmetric(spec) -> str:
    """Why a call of `spec` over LSA runs no direct kernel: its buffers are not symmetric."""
    return (
        f"algorithm 'direct' needs buffers from Communicator.alloc_symmetric ({spec.name}: "
        f"{' and '.join(spec.peer_accessed)})"
    )


class DirectRouter:
    """The routes of one communicator of `nranks` ranks whose GIN peers are `peer_mask`;
    `gin_refusal`: why its GIN connections cannot carry pushes (GinPlan.direct_refusal;
    None when they can or no peer is over GIN); `several_nodes`: it runs "hierarchical",
    so its symmetric buffers live in the intra-node child (Communicator.alloc_symmetric)."""

    def __init__(self, nranks: int, peer_mask: int, gin_refusal: str | None, several_nodes: bool = False):
        self.nranks, self.pushes, self.several_nodes = nranks, bool(peer_mask), several_nodes
        # Whether the GIN engine is given the symmetric windows (it carries them).
        self.engine_carries_windows = self.pushes and gin_refusal is None
        if self.pushes and gin_refusal is not None:
            self.refusal = gin_refusal
        elif nranks > abi.DIRECT_MAX_RANKS:
            self.refusal = f"{nranks} ranks (direct kernels reach at most {abi.DIRECT_MAX_RANKS})"
        else:
            self.refusal = None  # the communicator's stage: why no call runs a direct kernel
        self._lsa_refusals: dict[str, str] = {}  # collective -> needs_symmetric()

    @property
    def kind(self) -> str | None:
        """LSA or PUSH: how this communicator's direct kernels run on buffers from
        alloc_symmetric; None where none run."""
        if self.refusal is not None or self.several_nodes:
            return None
        return PUSH if self.pushes else LSA

    def route(self, symmetric, spec, s, r, count: int, explain: bool = True) -> Route:
        """The route of a call of `spec` on buffers `s`, `r` (buffers.Buffer) of NCCL count
        `count`, given the communicator's symmetric windows (SymmetricWindows).
        `explain`: the call asks for the direct kernel, so a refusal must say why (else a
        call on a communicator without symmetric windows is routed at no cost)."""
        if "direct" not in spec.kernels or not (symmetric.windows or explain):
            return FIFO  # (no direct kernel: the tuner names the collectives that have one)
        if not self.pushes:
            sym = symmetric.direct(spec, s, r) if self.refusal is None and symmetric.windows else None
            if sym is not None:
                return Route(LSA, sym)
            why = self._lsa_refusals.get(spec.name)
            if why is None:
                why = self._lsa_refusals[spec.name] = needs_symmetric(spec)
            return Route(None, None, why)
        why = self.refusal or self._push_refusal(spec, s, r, count)
        if why is None:
            sym = symmetric.direct(spec, s, r, spec.gin_windows) if symmetric.windows else None
            if sym is not None:
                return Route(PUSH, sym)
            why = (
                f"{' and '.join(spec.gin_windows)} must come from Communicator.alloc_symmetric (the GIN engine "
                f"puts from and into those windows)"
            )
        return Route(None, None, f"algorithm 'direct' with peers over GIN: {why}")

    def _push_refusal(self, spec, s, r, count: int) -> str | None:
        """The collective's and the call's stage with GIN peers: why the direct kernel of
        `spec` cannot push this call whatever its buffers."""
        if spec.gin_windows is None:
            return f"{spec.name} has no direct kernel over GIN (it would stage every peer's block: use the ring)"
        if spec.gin_direct_even_out_of_place and count % self.nranks:
            return f"{spec.name} pushes equal blocks: count {count} is not a multiple of {self.nranks} ranks"
        if spec.gin_direct_even_out_of_place and s.overlaps(r):
            return f"{spec.name} stages peers' blocks in its recvbuf: not in place"
        return None
