"""RequestPlan: the per-request plan, made once, against the computations each role made itself
before (destination fetch, source open, eager pack), and its purity."""


import numpy as np
import pytest
import torch

from kvtriton.errors import PlanError, StagingError
from kvtriton.plan import (
    ChunkGeometry,
    OfferTerms,
    RequestPlan,
    TokenMap,
    build_plan,
    compact_request,
    compact_tokens,
    head_range,
    ids_digest,
)
from kvtriton.regions import Region


def specs(rank, tp, heads=4, block_size=16, num_blocks=64, mla=True, layers=2):
    """GQA layers (staged between unequal TPs) and an MLA latent (DIRECT, striped over replicas)."""
    h = head_range(rank, tp, heads)
    t = torch.empty(num_blocks, block_size, h[1] - h[0], 32, dtype=torch.bfloat16, device="meta")
    out = [Region.attention(f"layer.{i}", t, t, block_size=block_size, total_heads=heads).spec for i in range(layers)]
    if mla:
        lat = torch.empty(num_blocks, block_size, 64, dtype=torch.bfloat16, device="meta")
        out.append(Region.mla("mla.0", lat, block_size=block_size).spec)
    return out


def pair(p_tp=2, d_tp=1, d_rank=0, src_bs=16, dst_bs=16, mla=True, **kw):
    return build_plan(d_rank, d_tp, specs(d_rank, d_tp, block_size=dst_bs, mla=mla), p_tp,
                      specs(0, p_tp, block_size=src_bs, mla=mla), modes=kw.get("modes"))


def cap_of(plan, blocks=2.5):
    """A chunk cap of about ``blocks`` tiles of the widest payload: several chunks per request."""
    return int(blocks * max(s.bytes_per_block for s in plan.staged))


SRC = np.array([5, 6, 7, -1, 9, 10, 30, 31])
DST = np.array([-1, 1, 2, 3, 4, 5, 40, 41])


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2)])
def test_for_fetch_equals_the_destinations_own_computation(p_tp, d_tp):
    plan = pair(p_tp, d_tp)
    cap = cap_of(plan)
    rp = RequestPlan.for_fetch(plan, SRC, DST, src_num_blocks=64, dst_num_blocks=64, chunk_bytes=cap)
    s_ids, d_ids = compact_request(SRC, DST, 64, 64)
    assert np.array_equal(rp.src_ids, s_ids) and np.array_equal(rp.dst_ids, d_ids) and rp.tokens is None
    n = d_ids.size
    assert rp.num_tiles == n
    assert rp.direct_ranks == plan.direct_ranks(n)
    assert rp.source_ranks == tuple(sorted({s.src_rank for s in plan.staged} | plan.direct_ranks(n)))
    assert rp.digest == plan.digest() and rp.wire_tokens() == {}
    for r in rp.source_ranks:
        read = plan.payload(r)
        p = rp.payload(r)
        if read is None:
            assert p is None
            continue
        assert p.read is read and p.src_rank == r
        assert p.chunks == ChunkGeometry.fit(read.bytes_per_block, n, cap)
        assert p.nbytes == read.payload_bytes(n)
        for c in range(p.chunks.count):
            lo, hi = p.chunks.bounds(c)
            assert np.array_equal(p.segment_offsets(c, base=7), read.segment_offsets(hi - lo, base=7))
        assert rp.sends_runs(r) == (r in plan.direct_ranks(n))


def test_chunk_caps_per_source_rank_and_a_payload_that_does_not_fit():
    plan = pair(2, 1, mla=False)
    bpb = plan.staged[0].bytes_per_block
    rp = RequestPlan.for_fetch(plan, SRC, DST, src_num_blocks=64, dst_num_blocks=64,
                               chunk_bytes={0: bpb - 1, 1: 2 * bpb})
    with pytest.raises(StagingError) as got:
        rp.payload(0)
    with pytest.raises(StagingError) as want:
        ChunkGeometry.fit(bpb, rp.num_tiles, bpb - 1)
    assert str(got.value) == str(want.value)
    assert rp.payload(1).chunks == ChunkGeometry.fit(bpb, rp.num_tiles, 2 * bpb)
    assert rp.payload(1).refit(bpb).chunks == ChunkGeometry.fit(bpb, rp.num_tiles, bpb)
    assert rp.offer_terms(0) is None and rp.offer_terms(1) is not None


def test_bad_ids_raise_plan_error_as_before():
    plan = pair()
    with pytest.raises(PlanError, match="out of range"):
        RequestPlan.for_fetch(plan, [1, 99], [1, 2], src_num_blocks=64, dst_num_blocks=64, chunk_bytes=4096)
    with pytest.raises(PlanError, match="repeat"):
        RequestPlan.for_fetch(plan, [1, 2], [3, 3], src_num_blocks=64, dst_num_blocks=64, chunk_bytes=4096)


def test_a_request_that_moves_nothing():
    rp = RequestPlan.for_fetch(pair(), [1, 2], [-1, -1], src_num_blocks=64, dst_num_blocks=64, chunk_bytes=1)
    assert rp.num_tiles == 0 and rp.direct_ranks == frozenset()


def test_token_map_on_both_sides():
    plan = pair(2, 1, src_bs=16, dst_bs=24, mla=False)
    assert plan.maps_tokens
    src, dst = np.arange(10, 16), np.array([-1, 3, 4, 5])
    rp = RequestPlan.for_fetch(plan, src, dst, src_num_blocks=64, dst_num_blocks=64, chunk_bytes=1 << 20,
                               num_tokens=90)
    m = compact_tokens(src, dst, 64, 64, 16, 24, 90)
    assert np.array_equal(rp.src_ids, m.read_ids) and np.array_equal(rp.dst_ids, m.tile_dst_ids)
    assert rp.num_tiles == m.num_tiles and rp.wire_tokens() == {"tokens": 90, "tiles": tuple(m.tiles.tolist())}
    assert all(rp.offer_terms(r) is None for r in rp.source_ranks)  # token maps are never offered
    # the source rebuilds the same request from the pull's fields
    chunk_blocks = rp.payload(0).chunks.blocks_per_chunk
    for r in (0, 1):
        sv = RequestPlan.for_serve(plan, r, rp.src_ids, held_blocks=src.size, chunk_blocks=chunk_blocks,
                                   num_tokens=90, tiles=rp.wire_tokens()["tiles"])
        want = TokenMap.for_source(m.tiles, m.read_ids, 90, 16, 24, src.size)
        assert np.array_equal(sv.tokens.src_ids, want.src_ids) and sv.num_tiles == want.num_tiles
        assert sv.payload(r).chunks == ChunkGeometry(plan.payload(r).bytes_per_block, want.num_tiles,
                                                     chunk_blocks)
        assert sv.dst_ids is None
    with pytest.raises(PlanError):  # a token map reaching past the held blocks
        RequestPlan.for_serve(plan, 0, rp.src_ids, held_blocks=2, chunk_blocks=1, num_tokens=90,
                              tiles=rp.wire_tokens()["tiles"])


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (4, 2)])
def test_source_checks_a_pull_against_the_same_request(p_tp, d_tp):
    plan = pair(p_tp, d_tp)
    cap = cap_of(plan)
    rp = RequestPlan.for_fetch(plan, SRC, DST, src_num_blocks=64, dst_num_blocks=64, chunk_bytes=cap)
    for r in rp.source_ranks:
        p = rp.payload(r)
        cb = p.chunks.blocks_per_chunk if p is not None else 0
        sv = RequestPlan.for_serve(plan, r, tuple(rp.src_ids.tolist()), held_blocks=64, chunk_blocks=cb)
        # what the source's open computed: n, the staged read, its DIRECT runs and the chunks
        assert sv.num_tiles == rp.src_ids.size and sv.sends_runs(r) == (r in plan.direct_ranks(rp.src_ids.size))
        assert sv.sends_runs(r) == rp.sends_runs(r)
        if p is None:
            assert sv.payload(r) is None
        else:
            assert sv.payload(r).chunks == p.chunks and sv.payload(r).chunks.fits(cap)
            assert sv.offer_terms(r) == rp.offer_terms(r)


def test_eager_hold_offers_match_the_fetch_of_every_held_block():
    plan = pair(2, 1)
    held = np.array([3, 4, 5, 8, 9])
    cap = cap_of(plan)
    hold = RequestPlan.for_hold(plan, held, chunk_bytes=cap)
    fetch = RequestPlan.for_fetch(plan, held, np.arange(20, 25), src_num_blocks=64, dst_num_blocks=64,
                                  chunk_bytes=cap)
    assert hold.ids_digest == ids_digest(held) == fetch.ids_digest
    for r in (0, 1):
        read = plan.payload(r)
        chunks = ChunkGeometry.fit(read.bytes_per_block, held.size, cap)  # what eager packed
        want = OfferTerms(plan.digest(), ids_digest(held), held.size, chunks.blocks_per_chunk,
                          int(r in plan.direct_ranks(held.size)))
        assert hold.offer_terms(r) == want == fetch.offer_terms(r)
    assert hold.cache_offer_terms() == OfferTerms(plan.digest(), ids_digest(held), held.size, 1, 0)
    assert hold.cache_offer_terms().same_blocks(fetch.cache_offer_terms())
    prefix = RequestPlan.for_fetch(plan, held, [-1, 21, 22, 23, 24], src_num_blocks=64, dst_num_blocks=64,
                                   chunk_bytes=cap)  # a suffix: another request
    assert prefix.offer_terms(0) != hold.offer_terms(0) and not prefix.cache_offer_terms().same_blocks(
        hold.cache_offer_terms())
    with pytest.raises(PlanError, match="token-mapped"):
        RequestPlan.for_hold(pair(2, 1, src_bs=16, dst_bs=24, mla=False), held, chunk_bytes=cap)


def test_ids_digest_is_the_one_offers_used():
    import hashlib
    ids = np.array([1, 2, 3], dtype=np.int32)
    assert ids_digest(ids) == hashlib.blake2b(ids.astype(np.int64).tobytes(), digest_size=12).hexdigest()
