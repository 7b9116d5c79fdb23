"""The group cases of `commref check` ("group" among its collectives): one group that
mixes collectives, the collectives composed of sends and receives, and a plain
exchange of send/recv pairs with every peer, every element checked.

A case draws its members from its seed, the same on every rank: MEMBERS of them, each a
collective of the catalogue (out of place, on its own inputs: verify.make_input with the
member's seed) or an exchange (a send to and a recv from every peer, of verify's
data-movement values for that (sender, receiver)). Each rank then posts them in an
order of its own (seeded by the case's seed and its rank): the collectives that run
kernels and the rest interleaved at random, and an exchange's sends and receives
shuffled. What must keep its order does: collectives in the same order on every rank,
as NCCL requires, and the operations on each (peer, direction) link, which groups match
in posted order (the members composed of sends and receives keep theirs too).
Hypercube takes no part: its steps depend on each other, so it runs in no group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import catalogue, verify
from .verify import DTYPES

GROUP = "group"  # the word `commref check` takes for these cases
MEMBERS = 6  # members of one case
EXCHANGE = "exchange"
# What a member may be: collectives with kernels (their sum where they reduce), the
# composed ones that can join a group, and the plain exchange.
KINDS = tuple(c for c in catalogue.NAMES if catalogue.get(c).rank_refusal is None) + (EXCHANGE,)


@dataclass(frozen=True)
class GroupCase:
    """One group of MEMBERS drawn members; the attributes summary_rows reads."""

    dtype: str
    count: int
    seed: int
    coll: str = GROUP
    algorithm: str = "mixed"
    op: str | None = None
    values: str = "small"
    in_place: bool = False

    @property
    def label(self) -> str:
        return self.algorithm

    def members(self, nranks: int) -> list[tuple[str, int, int]]:
        """(kind, root, seed) of each member, the same on every rank."""
        rng = np.random.default_rng([self.seed, 0x6A0])
        return [(str(rng.choice(KINDS)), int(rng.integers(nranks)), self.seed * 1_009 + i) for i in range(MEMBERS)]

    def kernel_specs(self, comm) -> set:
        """The kernel specializations its members need (Communicator.prepare)."""
        return {comm.kernel_spec(k, self.dtype, _op(k)) for k, _, _ in self.members(comm.nranks) if k != EXCHANGE}


def cases(dtypes, counts, seed: int) -> list[GroupCase]:
    """One group case per dtype and count, in a fixed order."""
    return [GroupCase(d, c, seed * 1_000_033 + i) for i, (d, c) in enumerate((d, c) for d in dtypes for c in counts)]


def _op(kind: str) -> str | None:
    return "sum" if catalogue.get(kind).reducing else None


def _payload(dt, seed: int, src: int, dst: int, nranks: int, count: int) -> np.ndarray:
    return verify.input_values(dt, None, seed, src * nranks + dst, count)


def run(comm, case: GroupCase, memory) -> int:
    """Posts the case's members in this rank's order in one group; returns the wrong
    elements here."""
    n, r = comm.nranks, comm.rank
    dt, count = DTYPES[case.dtype], case.count
    kernels, others, checks = [], [], []
    for kind, root, seed in case.members(n):
        if kind == EXCHANGE:
            posts = []
            for p in range(n):
                if p != r:
                    got = memory.sentinel(count, dt)
                    posts.append(lambda p=p, x=memory.copy_of(_payload(dt, seed, r, p, n, count)): comm.send(x, p))
                    posts.append(lambda p=p, got=got: comm.recv(got, p))
                    checks.append((got, _payload(dt, seed, p, r, n, count)))
            others.append(posts)
            continue
        spec, op = catalogue.get(kind), _op(kind)
        x = verify.make_input(kind, dt, op, seed, r, n, count)
        expected = verify.expected_output(kind, dt, op, seed, r, n, count, root)
        b = spec.buffers(memory, x, count, r, n, False)
        checks.append((b.out, memory.to_host(b.out).copy() if expected is None else expected))
        post = [lambda spec=spec, b=b, op=op, root=root: spec.call(comm, b.send, b.recv, op, root)]
        (kernels if spec.kernels else others).append(post)
    rng = np.random.default_rng([case.seed, r])
    for posts in others:
        rng.shuffle(posts)  # an exchange's links are its own: any order (one post elsewhere)
    order = [0] * len(kernels) + [1] * len(others)
    rng.shuffle(order)
    queues = [list(kernels), list(others)]
    with comm.group():
        for q in order:
            for post in queues[q].pop(0):
                post()
    return sum(verify.count_wrong(memory.to_host(out), want) for out, want in checks)
