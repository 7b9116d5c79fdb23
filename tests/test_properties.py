"""Property tests (hypothesis): structures and collectives over generated shapes."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commref.collectives import check, topology
from commref.collectives.communicator import Communicator
from commref.collectives.verify import DTYPES, OPS
from commref.transports.gin import semantics
from commref.transports.thread_world import ThreadWorld


@given(st.integers(1, 64))
def test_double_binary_tree_is_two_spanning_trees(n):
    for parent, children in topology.double_binary_tree(n):
        roots = [r for r in range(n) if parent[r] == -1]
        assert len(roots) == 1
        assert sorted(parent) == list(range(n))
        for r in range(n):
            assert len(children[r]) <= 2
            for c in children[r]:
                assert parent[c] == r
        # every rank reaches the root
        for r in range(n):
            seen, x = set(), r
            while parent[x] != -1:
                assert x not in seen
                seen.add(x)
                x = parent[x]
            assert x == roots[0]


@given(st.integers(2, 64))
def test_double_binary_tree_spreads_inner_nodes(n):
    """Few ranks are inner nodes of both trees (the point of the second tree)."""
    (p0, c0), (p1, c1) = topology.double_binary_tree(n)
    inner_both = [r for r in range(n) if c0[r] and c1[r]]
    assert len(inner_both) <= n // 2 + 1


@given(
    st.lists(st.tuples(st.integers(0, 1), st.integers(0, 300), st.booleans(), st.booleans()), min_size=1, max_size=5),
    st.sampled_from([64, 128]),
)
def test_ordered_wire_lands_each_context_in_posting_order(ops, seg):
    """On an ordered wire, whatever the order of choices, each context's events land in
    posting order."""
    seqs = {0: 0, 1: 0}
    puts = []
    for ctx, nbytes, has_sig, strong in ops:
        puts.append(semantics.Put(ctx, seqs[ctx], 0, nbytes, semantics.Signal(strong) if has_sig else None))
        seqs[ctx] += 1
    plan = semantics.Plan.of(puts, seg)
    landed, order = set(), []
    while True:
        en = semantics.enabled(semantics.ORDERED, plan, landed)
        if not en:
            break
        assert len({plan.puts[e.put].ctx for e in en}) == len(en)  # one head per context
        e = en[-1]
        landed.add(e)
        order.append(e)
    assert len(order) == len(plan.all_events(semantics.ORDERED))
    for ctx in (0, 1):
        mine = [e for e in order if plan.puts[e.put].ctx == ctx]
        assert mine == sorted(mine, key=lambda e: (plan.puts[e.put].seq, e.segment if e.segment >= 0 else 1 << 30))


def _allreduce_case(world, count, dtype, op, algorithm, channels):
    comm = Communicator(world, "cpu", max_channels=channels, slot_bytes=256, timeout=30)
    case = check.Case("allreduce", algorithm, dtype, op, count, False, 0, seed=count + 17)
    return check.run_case(comm, case)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 5),
    st.integers(0, 3000),
    st.sampled_from(list(DTYPES)),
    st.sampled_from(list(OPS)),
    st.sampled_from(["ring", "tree"]),
    st.integers(1, 3),
)
def test_allreduce_matches_reference(nranks, count, dtype, op, algorithm, channels):
    wrong = ThreadWorld.run(nranks, _allreduce_case, count, dtype, op, algorithm, channels, timeout=60)
    assert sum(wrong) == 0
