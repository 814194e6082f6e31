import pytest

from kvtriton.errors import TopologyError
from kvtriton.plan.topology import head_range, replicate_sources, split_sources


def valid_tps(heads, limit=16):
    return [tp for tp in range(1, limit + 1) if heads % tp == 0 or tp % heads == 0]


@pytest.mark.parametrize(
    "rank,tp,heads,expected",
    [(0, 1, 8, (0, 8)), (3, 4, 8, (6, 8)), (5, 16, 8, (2, 3)), (2, 3, 6, (4, 6)), (7, 8, 2, (1, 2))],
)
def test_head_range(rank, tp, heads, expected):
    assert head_range(rank, tp, heads) == expected


@pytest.mark.parametrize("tp,heads", [(3, 8), (5, 6), (4, 6), (0, 8)])
def test_head_range_rejects_unshardable(tp, heads):
    with pytest.raises(TopologyError, match="cannot shard|must both be"):
        head_range(0, tp, heads)


def test_head_range_rejects_rank_out_of_range():
    with pytest.raises(TopologyError, match="out of range"):
        head_range(4, 4, 8)


@pytest.mark.parametrize("heads", [1, 2, 4, 6, 8])
def test_split_sources_cover_each_destination_head_exactly_once(heads):
    for src_tp in valid_tps(heads):
        for dst_tp in valid_tps(heads):
            for d in range(dst_tp):
                d0, d1 = head_range(d, dst_tp, heads)
                covered = []
                for sl in split_sources(d, dst_tp, src_tp, heads):
                    s0, s1 = head_range(sl.src_rank, src_tp, heads)
                    # the source really owns what it is asked for
                    assert s0 <= s0 + sl.src_head and s0 + sl.src_head + sl.num_heads <= s1
                    glob = list(range(s0 + sl.src_head, s0 + sl.src_head + sl.num_heads))
                    assert glob == list(range(d0 + sl.dst_head, d0 + sl.dst_head + sl.num_heads))
                    covered += glob
                assert covered == list(range(d0, d1)), (src_tp, dst_tp, d)


def test_split_sources_non_dividing_pair():
    # P2 -> D3 with 6 heads: P0 owns 0-2, P1 owns 3-5; D1 owns 2-3 -> one head from each.
    s = split_sources(1, 3, 2, 6)
    assert [(x.src_rank, x.src_head, x.dst_head, x.num_heads) for x in s] == [(0, 2, 0, 1), (1, 0, 1, 1)]


def test_replicated_source_heads_are_spread_over_replicas():
    # D16 P16, 8 heads: heads replicated twice on both sides; D 2h and 2h+1 must use different replicas.
    picks = [split_sources(d, 16, 16, 8)[0].src_rank for d in range(16)]
    assert picks == list(range(16))
    # D8 <- P16: each of the 8 destinations reads one replica; choice is deterministic.
    assert [split_sources(d, 8, 16, 8)[0].src_rank for d in range(8)] == [2 * d for d in range(8)]


def test_replicate_sources_spread_and_stripe():
    assert [replicate_sources(d, 4, 2) for d in range(4)] == [(0,), (1,), (0,), (1,)]
    assert [replicate_sources(d, 2, 4) for d in range(2)] == [(0, 2), (1, 3)]
    assert replicate_sources(0, 1, 4) == (0, 1, 2, 3)
    assert replicate_sources(0, 1, 4, stripe=1) == (0,)
    # every source replica serves someone when P > D
    used = {r for d in range(2) for r in replicate_sources(d, 2, 4)}
    assert used == {0, 1, 2, 3}
    with pytest.raises(TopologyError):
        replicate_sources(2, 2, 4)
