import numpy as np
import pytest
import torch
from helpers.specs import gqa_specs, mla_specs

from bench.baselines import per_token_descriptor_count, vllm_direct_descriptor_count
from kvtriton.errors import IncompatibleRemoteError, PlanError, StagingError
from kvtriton.plan import (
    ChunkGeometry,
    Route,
    build_plan,
    compact_request,
    direct_runs,
    staged_descriptor_count,
)
from kvtriton.regions import Layout, Region


def test_llama70b_p4_d8_descriptor_counts():
    # DESIGN.md: 80 layers, 8 KV heads, head_dim 128, bf16, 8k tokens in 16-token blocks.
    layers, heads, n = 80, 8, 8192 // 16
    dst = gqa_specs(layers, heads, 128, 5, 8, 16)
    src = gqa_specs(layers, heads, 128, 0, 4, 16)
    plan = build_plan(5, 8, dst, 4, src)
    assert plan.source_ranks == (2,)  # D5 owns head 5, held by P2
    assert staged_descriptor_count(plan, n) == 1
    assert vllm_direct_descriptor_count(len(plan.source_ranks), layers, n) == 40_960
    assert vllm_direct_descriptor_count(len(plan.source_ranks), layers, n, kv_streams=2) == 81_920
    assert per_token_descriptor_count(1, layers, 8192) == 1_310_720
    # one block: 80 layers x K,V x 16 tokens x 1 head x 128 x 2 B = 655,360 B; 64 MiB chunks hold
    # 102 blocks, so 512 blocks need ceil(512/102) = 6 descriptors
    assert plan.staged[0].bytes_per_block == 655_360
    assert staged_descriptor_count(plan, n, chunk_bytes=64 << 20) == 6


def test_llama8b_p2_d1_descriptor_counts():
    layers, n = 32, 8192 // 64
    plan = build_plan(0, 1, gqa_specs(layers, 8, 128, 0, 1, 64), 2, gqa_specs(layers, 8, 128, 0, 2, 64))
    assert plan.source_ranks == (0, 1)
    assert staged_descriptor_count(plan, n) == 2
    assert vllm_direct_descriptor_count(2, layers, n) == 8_192
    seg = plan.staged[1].segments[0]
    assert (seg.src_head, seg.dst_head, seg.num_heads) == (0, 4, 4)  # P1's 4 heads land at 4..7


def test_p2_d3_six_heads_plan():
    plan = build_plan(1, 3, gqa_specs(2, 6, 64, 1, 3, 16), 2, gqa_specs(2, 6, 64, 0, 2, 16))
    assert plan.source_ranks == (0, 1)
    assert [(s.src_rank, s.segments[0].src_head, s.segments[0].dst_head) for s in plan.staged] == [
        (0, 2, 0), (1, 0, 1)]
    # regions in plan order, streams in order
    assert [(g.region, g.stream) for g in plan.staged[0].segments] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert staged_descriptor_count(plan, 100) == 2


def test_segment_offsets_follow_wire_format():
    plan = build_plan(0, 2, gqa_specs(2, 4, 8, 0, 2, 4), 1, gqa_specs(2, 4, 8, 0, 1, 4))
    read = plan.staged[0]
    tile = 4 * 2 * 8 * 2  # block_size x heads x head_dim x bf16
    assert read.bytes_per_block == 4 * tile
    assert read.segment_offsets(3).tolist() == [0, 3 * tile, 6 * tile, 9 * tile]
    assert read.segment_offsets(3, base=64).tolist()[1] == 64 + 3 * tile


def test_equal_tp_whole_blocks_follow_cost_model():
    big = gqa_specs(1, 8, 128, 0, 2, 64)  # 64 x 4 x 128 x 2 B = 64 KiB per block: direct
    assert build_plan(0, 2, big, 2, big).modes == (Route.DIRECT,)
    small = gqa_specs(1, 8, 16, 0, 2, 4)  # 512 B per block: staged beats 2.3 us per descriptor
    assert build_plan(0, 2, small, 2, small).modes == (Route.STAGED,)
    assert build_plan(0, 2, small, 2, small, modes="direct").modes == (Route.DIRECT,)
    other = gqa_specs(1, 8, 16, 0, 2, 4, layout=Layout.HND)
    with pytest.raises(PlanError, match="DIRECT needs whole blocks"):
        build_plan(0, 2, small, 2, other, modes={"layer.0": "direct"})
    with pytest.raises(PlanError, match="unknown regions"):
        build_plan(0, 2, small, 2, small, modes={"nope": "direct"})
    with pytest.raises(PlanError, match="unknown transfer mode"):
        build_plan(0, 2, small, 2, small, modes="teleport")


def test_direct_runs_coalesce_on_both_sides():
    lat = torch.empty(64, 16, 576, dtype=torch.bfloat16, device="meta")
    spec = [Region.mla("mla", lat, block_size=16).spec]
    plan = build_plan(0, 1, spec, 1, spec)
    assert plan.modes == (Route.DIRECT,)
    src = np.array([10, 11, 12, 20, 21, 5])
    dst = np.array([0, 1, 2, 3, 4, 9])  # runs: (10-12 -> 0-2), (20-21 -> 3-4), (5 -> 9)
    runs = direct_runs(plan, spec, spec, src, dst)
    block = 16 * 576 * 2
    assert len(runs) == 3
    assert runs.src_offset.tolist() == [10 * block, 20 * block, 5 * block]
    assert runs.dst_offset.tolist() == [0, 3 * block, 9 * block]
    assert runs.nbytes.tolist() == [3 * block, 2 * block, block]


def test_direct_runs_stripe_over_replicas_and_respect_gaps():
    lat = torch.empty(64, 16, 576, dtype=torch.bfloat16, device="meta")
    spec = [Region.mla("mla", lat, block_size=16).spec]
    plan = build_plan(0, 1, spec, 4, spec)  # D1 <- P4: stripe over all four replicas
    assert plan.direct[0].src_ranks == (0, 1, 2, 3)
    runs = direct_runs(plan, spec, spec, np.arange(8), np.arange(8))
    assert runs.src_rank.tolist() == [0, 1, 2, 3] and runs.nbytes.tolist() == [2 * 16 * 576 * 2] * 4
    # joint [nb, 2, ...] storage: blocks are not back to back, one descriptor per block
    kv = torch.empty(64, 2, 16, 8, 128, dtype=torch.bfloat16, device="meta")
    jspec = [Region.attention("l", kv=kv, block_size=16, total_heads=8).spec]
    jplan = build_plan(0, 1, jspec, 1, jspec, modes="direct")
    assert len(direct_runs(jplan, jspec, jspec, np.arange(4), np.arange(4))) == 2 * 4


def test_compact_request_drops_padding_and_validates():
    s, d = compact_request([3, -1, 5, 7], [0, 1, -1, 2], 8, 4)
    assert s.tolist() == [3, 7] and d.tolist() == [0, 2]
    with pytest.raises(PlanError, match="source block id 8 at position 1 is out of range"):
        compact_request([0, 8], [0, 1], 8, 4)
    with pytest.raises(PlanError, match="destination block id -2"):
        compact_request([0, 1], [0, -2], 8, 4)
    with pytest.raises(PlanError, match="3 source block ids but 2"):
        compact_request([0, 1, 2], [0, 1], 8, 4)
    with pytest.raises(PlanError, match="repeat"):
        compact_request([0, 1], [2, 2], 8, 4)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d[:1], "region count differs"),
        (lambda d: gqa_specs(2, 8, 64, 0, 2, 16, dtype=torch.float16), "dtype differs"),
        (lambda d: gqa_specs(2, 8, 128, 0, 2, 16), "head_dim per stream differs"),
        (lambda d: gqa_specs(1, 8, 64, 0, 2, 32) + d[1:], "remote engine pages its regions with several block sizes"),
        (lambda d: gqa_specs(2, 16, 64, 0, 4, 16), "total KV heads differs"),
        (lambda d: gqa_specs(2, 8, 64, 0, 4, 16), "holds 2 heads, but tp=2"),
        (lambda d: list(reversed([s.__class__(**{**s.__dict__, "name": f"x{i}"}) for i, s in enumerate(d)])),
         "name"),
    ],
)
def test_incompatible_remotes_are_rejected_with_the_region_named(mutate, match):
    local = gqa_specs(2, 8, 64, 0, 2, 16)
    remote = mutate(gqa_specs(2, 8, 64, 0, 2, 16))
    with pytest.raises(IncompatibleRemoteError, match=match):
        build_plan(0, 2, local, 2, remote)


def test_unshardable_tp_is_rejected():
    local = gqa_specs(1, 6, 64, 0, 2, 16)
    with pytest.raises(IncompatibleRemoteError, match="cannot shard 6 KV heads"):
        build_plan(0, 2, local, 4, local)
    with pytest.raises(PlanError, match="out of range"):
        build_plan(2, 2, local, 2, local)


def test_chunk_geometry_covers_the_request_once():
    for n, per, chunk_bytes in [(10, 1000, 4096), (7, 64, 64), (512, 655_360, 64 << 20), (1, 8, 1 << 20)]:
        g = ChunkGeometry.fit(per, n, chunk_bytes)
        bounds = [g.bounds(i) for i in range(g.count)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(hi == lo for (_, hi), (lo, _) in zip(bounds, bounds[1:]))  # adjacent, no overlap
        assert all(0 < g.nbytes(i) <= chunk_bytes for i in range(g.count))
        assert sum(g.nbytes(i) for i in range(g.count)) == n * per
        assert g.fits(chunk_bytes) and not g.fits(per * g.blocks_per_chunk - 1)
    assert ChunkGeometry.fit(100, 0, 4096).count == 0
    with pytest.raises(StagingError, match="more than a chunk"):
        ChunkGeometry.fit(5000, 3, 4096)


@pytest.mark.parametrize("heads", [1, 2, 4, 6, 8])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (8, 2), (2, 8), (2, 3), (3, 2),
                                       (16, 1), (1, 16), (6, 4)])
@pytest.mark.parametrize("with_mla", [False, True])
def test_required_source_ranks_match_the_plan(heads, p_tp, d_tp, with_mla):
    """A decode rank connects to required_source_ranks before it has any source metadata; the
    plan it builds afterwards must read from exactly those ranks (DIRECT MLA stripes included)."""
    from kvtriton.plan import check_tp, required_source_ranks
    try:
        check_tp(p_tp, heads), check_tp(d_tp, heads)
    except Exception:
        pytest.skip("TP sizes cannot shard this head count")
    for d_rank in range(d_tp):
        dst = gqa_specs(2, heads, 32, d_rank, d_tp, 16, layout=Layout.HND)
        src = gqa_specs(2, heads, 32, 0, p_tp, 16)
        if with_mla:
            dst, src = dst + mla_specs(d_rank, d_tp, 16), src + mla_specs(0, p_tp, 16)
        plan = build_plan(d_rank, d_tp, dst, p_tp, src)
        assert required_source_ranks(d_rank, d_tp, dst, p_tp) == plan.source_ranks
