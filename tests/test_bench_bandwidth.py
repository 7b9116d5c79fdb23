"""The benchmark suite's bandwidth definitions (bench/plugins): bus factors,
algbw bytes and counts as nccl-tests' PERFORMANCE.md defines them, and the collectives'
names in both spellings.
"""

from __future__ import annotations

import pytest

from commref.bench import plugins

# ---------------------------------------------------------------------------------------
# bandwidth definitions (nccl-tests' PERFORMANCE.md)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bus_factors_are_nccl_tests(n: int) -> None:
    assert plugins.get("all_reduce").bus_factor(n) == pytest.approx(2 * (n - 1) / n)
    assert plugins.get("all_gather").bus_factor(n) == pytest.approx((n - 1) / n)
    assert plugins.get("reduce_scatter").bus_factor(n) == pytest.approx((n - 1) / n)
    assert plugins.get("broadcast").bus_factor(n) == 1.0
    assert plugins.get("reduce").bus_factor(n) == 1.0
    assert plugins.get("alltoall").bus_factor(n) == pytest.approx((n - 1) / n)


def test_algbw_bytes_and_counts_follow_nccl_tests() -> None:
    t = 4  # float32
    # all_reduce, broadcast, reduce: count = size / t, algbw bytes = count * t.
    for name in ("all_reduce", "broadcast", "reduce"):
        p = plugins.get(name)
        c = p.counts(10, t, 4)
        assert (c.send, c.recv, c.param) == (2, 2, 2)
        assert p.algbw_bytes(c, t, 4) == 8 and c.size_bytes(t) == 8
    # all_gather: per-rank count = size / t / n; size column and algbw bytes = total.
    ag = plugins.get("all_gather").counts(100, t, 3)
    assert (ag.send, ag.recv, ag.param) == (8, 24, 8)
    assert ag.size_bytes(t) == 96 and plugins.get("all_gather").algbw_bytes(ag, t, 3) == 96
    rs = plugins.get("reduce_scatter").counts(100, t, 3)
    assert (rs.send, rs.recv, rs.param) == (24, 8, 8)
    assert rs.size_bytes(t) == 96 and plugins.get("reduce_scatter").algbw_bytes(rs, t, 3) == 96
    # alltoall: both buffers hold n blocks of count = size / t / n (per peer).
    aa = plugins.get("alltoall").counts(100, t, 3)
    assert (aa.send, aa.recv, aa.param) == (24, 24, 8)
    assert aa.size_bytes(t) == 96 and plugins.get("alltoall").algbw_bytes(aa, t, 3) == 96
    # Sizes below typesize * nranks round to zero elements, as in nccl-tests.
    assert plugins.get("all_gather").counts(8, t, 4).size_bytes(t) == 0


def test_collective_names_in_both_spellings() -> None:
    for a, b in [
        ("allreduce", "all_reduce"),
        ("allgather", "all_gather"),
        ("reduce_scatter", "reduce_scatter"),
        ("broadcast", "broadcast"),
        ("reduce", "reduce"),
        ("All-Reduce", "all_reduce"),
        ("alltoall", "alltoall"),
        ("all_to_all", "alltoall"),
    ]:
        assert plugins.get(a).name == b
    with pytest.raises(ValueError, match="unknown collective"):
        plugins.get("scan")
