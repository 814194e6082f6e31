"""Dim-major in-block order (vLLM's CPU attention cache) across block sizes, byte for byte.

vLLM's CPU attention stores each (block, head) tile of its K‖V stream as K dim-major
(``[head_size, block_size]``) then V token-major; ``RegionSpec.dim_major`` describes that. The
oracle (kvtriton.testing.oracle.token_elements) addresses the tokens' real elements from that
definition with index arithmetic, independently of the library's views: random KV per token is
loaded at Bs tokens per block, and after a transfer every wanted destination block holds exactly
its tokens and every other byte of every destination cache (padded blocks, the tail of a partial
last block) is unchanged.
"""

import functools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtriton import ops
from kvtriton.errors import LaunchError, RegionError
from kvtriton.plan import build_plan, compact_tokens
from kvtriton.regions import Kind, Region, token_parts
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination,
    check_destination_tokens,
    load_source,
    load_source_tokens,
    local_transfer,
    make_global_kv,
    make_global_tokens,
    make_rank_regions,
    snapshot,
    token_elements,
)

# a K||V stream of 2 x 8 (vllm_cpu storage: K dim-major), an MLA latent, and a two-stream GQA region
PACKED = RegionModel("attn.0", Kind.SPLIT, 4, (16,), torch.bfloat16)
MODELS = [PACKED, RegionModel.mla("mla.0", 12, torch.float16),
          RegionModel("attn.1", Kind.SPLIT, 4, (6,), torch.float32)]


def _ids(n, num_blocks, gen, prefix=0):
    ids = torch.randperm(num_blocks, generator=gen)[:n].numpy().astype(np.int64)
    ids[:prefix] = -1
    return ids


def run_case(src_bs, dst_bs, num_tokens, *, p_tp=2, d_tp=1, impl="torch", p_storage="vllm_cpu",
             d_storage="vllm_cpu", p_layout="HND", d_layout="HND", dst_prefix=0, src_prefix=0, seed=0,
             chunk_bytes=None, models=MODELS):
    MODELS = models  # noqa: N806  (the case's models)
    gen = torch.Generator().manual_seed(seed)
    P = [make_rank_regions(MODELS, r, p_tp, 24, src_bs, layout=p_layout, storage=p_storage, gen=gen, pad_blocks=3)
         for r in range(p_tp)]
    D = [make_rank_regions(MODELS, r, d_tp, 20, dst_bs, layout=d_layout, storage=d_storage, gen=gen, pad_blocks=3)
         for r in range(d_tp)]
    tokens = make_global_tokens(MODELS, num_tokens, gen)
    src_ids = _ids(-(-num_tokens // src_bs), 24, gen, src_prefix)
    dst_ids = _ids(-(-num_tokens // dst_bs), 20, gen, dst_prefix)
    for r, regions in enumerate(P):
        load_source_tokens(regions, r, p_tp, tokens, src_ids)
    before = [snapshot(regions) for regions in D]
    src_before = [snapshot(regions) for regions in P]
    stats = local_transfer(P, D, src_ids, dst_ids, pack=functools.partial(ops.pack, impl=impl),
                           unpack=functools.partial(ops.unpack, impl=impl), chunk_bytes=chunk_bytes,
                           num_tokens=num_tokens)
    for r, regions in enumerate(D):
        check_destination_tokens(regions, r, d_tp, tokens, dst_ids, before[r])
    for r, regions in enumerate(P):
        for now, was in zip(snapshot(regions), src_before[r]):
            assert all(torch.equal(x, y) for x, y in zip(now, was))
    return stats


# --------------------------------------------------------------------------- the oracle's own definition
def test_vllm_cpu_storage_is_k_dim_major_then_v_token_major():
    gen = torch.Generator().manual_seed(0)
    [r] = make_rank_regions([PACKED], 0, 1, 3, 4, storage="vllm_cpu", gen=gen, pad_blocks=5)
    assert r.spec.dim_major == (8,) and r.spec.layout.value == "HND" and not r.spec.token_major
    tok = torch.randint(-1000, 1000, (4, 4, 16), generator=gen).to(torch.int16).view(torch.bfloat16)
    load_source_tokens([r], 0, 1, [[tok]], [2])
    tile = r.streams[0][2].view(torch.int16).reshape(4, -1)  # per head: 4 tokens x 16 elements of bytes
    for h in range(4):  # how vLLM's cpu_attn_reshape_and_cache lays out one head (see test_vllm_connector)
        assert torch.equal(tile[h, :32], tok[:, h, :8].view(torch.int16).t().reshape(-1))
        assert torch.equal(tile[h, 32:], tok[:, h, 8:].view(torch.int16).reshape(-1))
    elems, idx = token_elements(r, 0)
    for (d0, view) in token_parts(r.streams[0].view(torch.int16), 8):  # the library's views agree
        assert torch.equal(view, elems[idx[..., d0:d0 + view.shape[-1]]])


def test_region_refuses_a_dim_major_part_it_cannot_describe():
    with pytest.raises(RegionError, match="needs an HND stream"):
        Region.attention("l", torch.zeros(2, 4, 2, 16), block_size=4, total_heads=2, dim_major=(8,))
    with pytest.raises(RegionError, match="dim_major 17"):
        Region.attention("l", torch.zeros(2, 2, 4, 16), layout="HND", block_size=4, total_heads=2, dim_major=(17,))
    with pytest.raises(RegionError, match="token stride"):  # head tiles not dense
        Region.attention("l", torch.zeros(2, 2, 4, 32)[..., :16], layout="HND", block_size=4, total_heads=2,
                         dim_major=(8,))


# --------------------------------------------------------------------------- torch path: token regrouping
# (9, 8): 72 (tile unit, cache unit) pairs, past the unit-gather limit: tokens move one by one
@pytest.mark.parametrize("src_bs,dst_bs", [(4, 8), (8, 4), (3, 5), (6, 4), (2, 6), (9, 8)])
@pytest.mark.parametrize("num_tokens", [23, 24])
def test_dim_major_block_size_pairs(src_bs, dst_bs, num_tokens):
    stats = run_case(src_bs, dst_bs, num_tokens)
    assert stats["direct_descs"] == 0 and stats["staged_descs"] > 0


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (2, 4), (4, 2), (1, 1)])
def test_dim_major_hetero_tp(p_tp, d_tp):
    run_case(4, 6, 22, p_tp=p_tp, d_tp=d_tp, chunk_bytes=700)


@pytest.mark.parametrize("src_bs,dst_bs,dst_prefix,src_prefix", [(4, 8, 1, 2), (8, 4, 3, 1), (3, 5, 2, 3)])
def test_dim_major_minus_one_prefixes(src_bs, dst_bs, dst_prefix, src_prefix):
    run_case(src_bs, dst_bs, 29, dst_prefix=dst_prefix, src_prefix=src_prefix)


@pytest.mark.parametrize("p_storage,p_layout,d_storage,d_layout", [
    ("vllm_cpu", "HND", "separate", "NHD"), ("vllm_cpu", "HND", "separate", "HND"),
    ("separate", "NHD", "vllm_cpu", "HND"), ("joint", "HND", "vllm_cpu", "HND"),
])
def test_orders_differ_across_a_block_size_change(p_storage, p_layout, d_storage, d_layout):
    # the pack transposes the dim-major part where one side is token-major
    run_case(8, 4, 21, p_tp=2, d_tp=2, p_storage=p_storage, p_layout=p_layout, d_storage=d_storage,
             d_layout=d_layout, dst_prefix=1)
    run_case(4, 8, 21, p_tp=1, d_tp=2, p_storage=p_storage, p_layout=p_layout, d_storage=d_storage,
             d_layout=d_layout)


# --------------------------------------------------------------------------- equal block sizes: whole tiles
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_equal_block_sizes_stay_whole_tile_copies(impl):
    gen = torch.Generator().manual_seed(4)
    P = [make_rank_regions(MODELS, r, 2, 16, 4, layout="HND", storage="vllm_cpu", gen=gen) for r in range(2)]
    D = [make_rank_regions(MODELS, 0, 1, 16, 4, layout="HND", storage="vllm_cpu", gen=gen, pad_blocks=2)]
    plan = build_plan(0, 1, [r.spec for r in D[0]], 2, [r.spec for r in P[0]])
    assert not plan.maps_tokens and all(sg.src_block_size is None for r in plan.staged for sg in r.segments)
    kv = make_global_kv(MODELS, 5, 4, gen)
    src_ids, dst_ids = _ids(5, 16, gen), _ids(5, 16, gen)
    for r in range(2):
        load_source(P[r], r, 2, kv, src_ids)
    before = snapshot(D[0])
    local_transfer(P, D, src_ids, dst_ids, pack=functools.partial(ops.pack, impl=impl),
                   unpack=functools.partial(ops.unpack, impl=impl))
    check_destination(D[0], 0, 1, kv, dst_ids, before)


# --------------------------------------------------------------------------- the kernels' boundary
def _mapped_request():
    gen = torch.Generator().manual_seed(6)
    P = make_rank_regions(MODELS[:1], 0, 1, 8, 4, layout="HND", storage="vllm_cpu", gen=gen)
    D = make_rank_regions(MODELS[:1], 0, 1, 8, 8, layout="HND", storage="vllm_cpu", gen=gen)
    read = build_plan(0, 1, [r.spec for r in D], 1, [r.spec for r in P]).staged[0]
    m = compact_tokens([3, 1, 6, 0], [5, 2], 8, 8, 4, 8, num_tokens=14)
    return P, D, read, m


def test_triton_refuses_dim_major_token_remap_before_launch_and_auto_runs_torch():
    P, D, read, m = _mapped_request()
    staging = torch.randint(0, 256, (read.payload_bytes(m.num_tiles),), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(1))
    was = staging.clone()
    offs = read.segment_offsets(m.num_tiles)
    with pytest.raises(LaunchError, match="impl='triton' cannot remap tokens of a dim-major"):
        ops.pack(P, read.segments, offs, m.src_ids, staging, impl="triton", tiles=m.tiles, num_tokens=m.num_tokens)
    assert torch.equal(staging, was)
    before = snapshot(D)
    with pytest.raises(LaunchError, match="impl='triton' cannot remap"):
        ops.unpack(D, read.segments, offs, m.dst_ids, staging, impl="triton", tiles=m.tiles, num_tokens=m.num_tokens)
    assert all(torch.equal(x, y) for x, y in zip(snapshot(D)[0], before[0]))
    ref = staging.clone()
    ops.pack(P, read.segments, offs, m.src_ids, ref, impl="torch", tiles=m.tiles, num_tokens=m.num_tokens)
    ops.pack(P, read.segments, offs, m.src_ids, staging, impl="auto", tiles=m.tiles, num_tokens=m.num_tokens)
    assert torch.equal(staging, ref) and not torch.equal(staging, was)


def test_segment_order_must_match_the_cache_where_no_tokens_are_regrouped():
    import dataclasses

    P, D, read, m = _mapped_request()
    staging = torch.zeros(read.payload_bytes(m.num_tiles), dtype=torch.uint8)
    offs = read.segment_offsets(m.num_tiles)
    other = tuple(dataclasses.replace(sg, dim_major=0) for sg in read.segments)
    with pytest.raises(LaunchError, match="unpack expects tiles in the local in-block order"):
        ops.unpack(D, other, offs, m.dst_ids, staging, tiles=m.tiles, num_tokens=m.num_tokens)
    whole = tuple(dataclasses.replace(sg, src_block_size=None, block_size=4, dim_major=0) for sg in read.segments)
    with pytest.raises(LaunchError, match="whole-block tiles keep the cache's in-block order"):
        ops.pack(P, whole, offs, [1, 2], staging)


# --------------------------------------------------------------------------- property: any pair, any mix
@st.composite
def _cases(draw):
    src_bs = draw(st.integers(1, 9))
    dst_bs = draw(st.integers(1, 9).filter(lambda b: b != src_bs))  # equal sizes: whole blocks (tested above)
    num_tokens = draw(st.integers(1, 20))
    n_dst = -(-num_tokens // dst_bs)
    dst_prefix = draw(st.integers(0, n_dst - 1))
    src_prefix = draw(st.integers(0, dst_prefix * dst_bs // src_bs))  # only tokens no wanted block needs
    width, dtype = draw(st.sampled_from([2, 8, 16])), draw(st.sampled_from([torch.bfloat16, torch.float32,
                                                                            torch.float8_e4m3fn]))
    models = [RegionModel("kv", Kind.SPLIT, 4, (width,), dtype), RegionModel.mla("mla", 6, torch.float16)]
    sides = [draw(st.sampled_from([("vllm_cpu", "HND"), ("vllm_cpu", "HND"), ("separate", "NHD"),
                                   ("separate", "HND")])) for _ in range(2)]
    return dict(src_bs=src_bs, dst_bs=dst_bs, num_tokens=num_tokens, dst_prefix=dst_prefix, src_prefix=src_prefix,
                models=models, p_storage=sides[0][0], p_layout=sides[0][1], d_storage=sides[1][0],
                d_layout=sides[1][1], p_tp=draw(st.sampled_from([1, 2, 4])), d_tp=draw(st.sampled_from([1, 2, 4])),
                chunk_bytes=draw(st.sampled_from([None, 200])), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_any_block_size_pair_and_in_block_order_is_byte_exact(case):
    src_bs, dst_bs, num_tokens = case.pop("src_bs"), case.pop("dst_bs"), case.pop("num_tokens")
    run_case(src_bs, dst_bs, num_tokens, **case)
