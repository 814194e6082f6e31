"""Block-size changes: prefill and decode engines that page their caches differently.

Every transfer is checked byte for byte against the per-token oracle (kvtriton.testing.oracle):
random KV per token, loaded into the source ranks' blocks at Bs tokens per block; afterwards every
wanted destination block holds exactly its tokens (below the request's end) and every other byte
of every destination cache is unchanged (canaries: the whole cache is compared with a snapshot,
including padded, non-contiguous blocks and the tail of a partial last block).
"""

import functools

import msgpack
import numpy as np
import pytest
import torch

from kvtriton import ops
from kvtriton.errors import IncompatibleRemoteError, LaunchError, PlanError, ProtocolError
from kvtriton.plan import Route, TokenMap, build_plan, compact_tokens, source_positions
from kvtriton.regions import Region
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination_tokens,
    load_source_tokens,
    local_transfer,
    make_global_tokens,
    make_rank_regions,
    snapshot,
)

MODELS = [RegionModel.gqa("attn.0", 4, 8, torch.bfloat16), RegionModel.mla("mla.0", 12, torch.float16),
          RegionModel.gqa("attn.1", 4, 8, torch.float32, v_head_dim=4)]


def _ids(n, num_blocks, gen, prefix=0):
    ids = torch.randperm(num_blocks, generator=gen)[:n].numpy().astype(np.int64)
    ids[:prefix] = -1
    return ids


def run_case(src_bs, dst_bs, num_tokens, *, p_tp=2, d_tp=4, impl="torch", p_layout="NHD", d_layout="HND",
             p_storage="separate", d_storage="joint", dst_prefix=0, src_prefix=0, models=MODELS, seed=0,
             chunk_bytes=None, pad=1):
    gen = torch.Generator().manual_seed(seed)
    P = [make_rank_regions(models, r, p_tp, 24, src_bs, layout=p_layout, storage=p_storage, gen=gen, pad_blocks=pad)
         for r in range(p_tp)]
    D = [make_rank_regions(models, r, d_tp, 20, dst_bs, layout=d_layout, storage=d_storage, gen=gen, pad_blocks=pad)
         for r in range(d_tp)]
    tokens = make_global_tokens(models, num_tokens, gen)
    src_ids = _ids(-(-num_tokens // src_bs), 24, gen, src_prefix)
    dst_ids = _ids(-(-num_tokens // dst_bs), 20, gen, dst_prefix)
    for r, regions in enumerate(P):
        load_source_tokens(regions, r, p_tp, tokens, src_ids)
    before = [snapshot(regions) for regions in D]
    src_before = [snapshot(regions) for regions in P]
    kw = {} if impl == "torch" else {"impl": impl}
    stats = local_transfer(P, D, src_ids, dst_ids, pack=functools.partial(ops.pack, impl=impl),
                           unpack=functools.partial(ops.unpack, impl=impl), chunk_bytes=chunk_bytes,
                           num_tokens=num_tokens)
    del kw
    for r, regions in enumerate(D):
        check_destination_tokens(regions, r, d_tp, tokens, dst_ids, before[r])
    for r, regions in enumerate(P):  # the source is only read
        for now, was in zip(snapshot(regions), src_before[r]):
            assert all(torch.equal(x, y) for x, y in zip(now, was))
    return stats


# --------------------------------------------------------------------------- torch path: the full matrix
@pytest.mark.parametrize("src_bs,dst_bs", [(4, 8), (8, 4), (4, 6), (6, 4), (3, 5), (2, 6), (6, 2)])
@pytest.mark.parametrize("num_tokens", [23, 24])
def test_block_size_pairs_torch(src_bs, dst_bs, num_tokens):
    stats = run_case(src_bs, dst_bs, num_tokens)
    assert stats["direct_descs"] == 0 and stats["staged_descs"] > 0


@pytest.mark.parametrize("p_layout,d_layout", [("NHD", "NHD"), ("NHD", "HND"), ("HND", "NHD"), ("HND", "HND")])
@pytest.mark.parametrize("p_storage,d_storage", [("separate", "joint"), ("joint0", "separate")])
@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2), (1, 1), (2, 2)])
def test_layouts_storage_and_hetero_tp_torch(p_layout, d_layout, p_storage, d_storage, p_tp, d_tp):
    run_case(4, 6, 22, p_tp=p_tp, d_tp=d_tp, p_layout=p_layout, d_layout=d_layout, p_storage=p_storage,
             d_storage=d_storage)


@pytest.mark.parametrize("src_bs,dst_bs,dst_prefix,src_prefix", [
    (4, 8, 1, 2),   # source -1 prefix = the destination's, in whole tokens
    (4, 8, 1, 1),   # destination prefix ends mid-nothing: source holds more than needed
    (8, 4, 3, 1),   # destination prefix (12 tokens) ends inside source block 1
    (3, 5, 2, 3),   # coprime: 10 tokens skipped, source -1 covers tokens 0..8
    (6, 4, 2, 0),
])
def test_minus_one_prefixes(src_bs, dst_bs, dst_prefix, src_prefix):
    run_case(src_bs, dst_bs, 29, dst_prefix=dst_prefix, src_prefix=src_prefix)


def test_chunked_payloads_torch():
    stats = run_case(4, 6, 40, chunk_bytes=1500)
    assert stats["staged_descs"] > 4


# --------------------------------------------------------------------------- Triton (interpreter)
@pytest.mark.parametrize("src_bs,dst_bs,p_layout,d_layout,p_tp,d_tp", [
    (4, 8, "NHD", "HND", 2, 4),
    (8, 4, "HND", "NHD", 4, 2),
    (3, 5, "HND", "HND", 1, 2),
])
def test_block_size_change_triton(src_bs, dst_bs, p_layout, d_layout, p_tp, d_tp):
    models = MODELS[:2]
    run_case(src_bs, dst_bs, 13, impl="triton", p_layout=p_layout, d_layout=d_layout, p_tp=p_tp, d_tp=d_tp,
             dst_prefix=1, models=models, chunk_bytes=2000)


def test_triton_and_torch_stage_the_same_bytes():
    gen = torch.Generator().manual_seed(3)
    P = make_rank_regions(MODELS[:1], 0, 1, 16, 4, layout="HND", gen=gen, pad_blocks=1)
    D = make_rank_regions(MODELS[:1], 0, 1, 16, 6, layout="NHD", gen=gen)
    plan = build_plan(0, 1, [r.spec for r in D], 1, [r.spec for r in P])
    m = compact_tokens([5, 3, 9, 1, 0], [-1, 7, 2, 4], 16, 16, 4, 6, num_tokens=19)
    read = plan.staged[0]
    out = []
    for impl in ("torch", "triton"):
        staging = torch.randint(0, 256, (read.payload_bytes(m.num_tiles) + 64,), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(9))
        ops.pack(P, read.segments, read.segment_offsets(m.num_tiles, 32), m.src_ids, staging, impl=impl,
                 tiles=m.tiles, num_tokens=m.num_tokens)
        out.append(staging)
    assert torch.equal(out[0], out[1])
    canary = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    assert torch.equal(out[0][:32], canary[:32])  # guard bands before and after are untouched


# --------------------------------------------------------------------------- planner and gate
def _specs(models, rank, tp, bs, layout="NHD"):
    gen = torch.Generator().manual_seed(0)
    return [r.spec for r in make_rank_regions(models, rank, tp, 4, bs, layout=layout, gen=gen)]


def test_plan_stages_everything_and_records_block_sizes():
    plan = build_plan(1, 4, _specs(MODELS, 1, 4, 64), 2, _specs(MODELS, 0, 2, 16))
    assert plan.maps_tokens and (plan.src_block_size, plan.dst_block_size) == (16, 64)
    assert set(plan.modes) == {Route.STAGED}
    segs = [s for r in plan.staged for s in r.segments]
    assert all(s.block_size == 64 and s.source_block_size == 16 for s in segs)
    assert {s.region for s in segs} == {0, 1, 2}  # REPLICATE too (from one replica)
    same = build_plan(1, 4, _specs(MODELS, 1, 4, 16), 2, _specs(MODELS, 0, 2, 16))
    assert not same.maps_tokens and same.modes[1] is Route.DIRECT
    with pytest.raises(PlanError, match="block_size 64, remote .* block_size 16"):
        build_plan(1, 4, _specs(MODELS, 1, 4, 64), 2, _specs(MODELS, 0, 2, 16), modes={"mla.0": "direct"})


def test_gate_names_each_sides_block_sizes():
    local = _specs(MODELS[:2], 0, 2, 32)
    mixed = _specs(MODELS[:1], 0, 2, 16) + _specs(MODELS[1:2], 0, 2, 64)
    with pytest.raises(IncompatibleRemoteError,
                       match=r"local 32, remote 16.*remote engine .*'attn.0': 16, 'mla.0': 64"):
        build_plan(0, 2, local, 2, mixed)
    with pytest.raises(IncompatibleRemoteError, match="local engine pages its regions with several"):
        build_plan(0, 2, mixed, 2, local)


def test_compact_tokens_contract():
    m = compact_tokens([7, 8, 9], [-1, 4], 16, 16, 16, 24, num_tokens=40)
    assert m.tiles.tolist() == [1] and m.src_ids.tolist() == [-1, 8, 9] and m.read_ids.tolist() == [8, 9]
    # default token count: what both sides cover; extra ids past it are ignored
    m = compact_tokens([1, 2, 3, 4], [5, 6], 16, 16, 4, 6)
    assert m.num_tokens == 12 and m.src_ids.tolist() == [1, 2, 3]
    with pytest.raises(PlanError, match="position 1 .* needs source position 0"):
        compact_tokens([-1, 2, 3], [-1, 4, 5], 16, 16, 8, 6, num_tokens=17)
    with pytest.raises(PlanError, match="does not fit"):
        compact_tokens([1, 2], [3, 4], 16, 16, 4, 8, num_tokens=9)
    with pytest.raises(PlanError, match="repeat"):
        compact_tokens([1, 2, 3, 4], [5, 5], 16, 16, 4, 8)
    with pytest.raises(PlanError, match="out of range"):
        compact_tokens([1, 16], [3], 16, 16, 4, 8)
    # the source side rebuilds the same map from what the wire carries
    m = compact_tokens([7, 8, 9, 10, 11], [-1, 4, -1, 6], 16, 16, 5, 7, num_tokens=25)
    s = TokenMap.for_source(m.tiles, m.read_ids, m.num_tokens, 5, 7, 5)
    assert s.src_ids.tolist() == m.src_ids.tolist()
    with pytest.raises(PlanError, match="source ids"):
        TokenMap.for_source(m.tiles, m.read_ids[:-1], m.num_tokens, 5, 7, 5)
    with pytest.raises(PlanError, match="ascending"):
        TokenMap.for_source([3, 1], m.read_ids, m.num_tokens, 5, 7, 5)
    with pytest.raises(PlanError, match="past the 4 blocks held"):  # a peer cannot size our arrays
        TokenMap.for_source([1 << 40], [1], 1 << 50, 5, 7, 4)
    assert source_positions(np.array([0]), 3, 4, 8).tolist() == [0]


def test_launch_validation_for_token_maps():
    gen = torch.Generator().manual_seed(1)
    P = make_rank_regions(MODELS[:1], 0, 1, 8, 4, gen=gen)
    D = make_rank_regions(MODELS[:1], 0, 1, 8, 8, gen=gen)
    read = build_plan(0, 1, [r.spec for r in D], 1, [r.spec for r in P]).staged[0]
    staging = torch.zeros(read.payload_bytes(2), dtype=torch.uint8)
    offs = read.segment_offsets(2)
    with pytest.raises(LaunchError, match="pass tiles= and num_tokens="):
        ops.pack(P, read.segments, offs, [0, 1], staging)
    with pytest.raises(LaunchError, match="cover 8 tokens, fewer than num_tokens=9"):
        ops.pack(P, read.segments, offs, [0, 1], staging, tiles=[0, 1], num_tokens=9)
    with pytest.raises(LaunchError, match="ascending"):
        ops.pack(P, read.segments, offs, [0, 1, 2, 3], staging, tiles=[1, 1], num_tokens=16)
    with pytest.raises(LaunchError, match="ascending"):
        ops.pack(P, read.segments, offs, [0, 1, 2, 3], staging, tiles=[0, 2], num_tokens=16)
    with pytest.raises(LaunchError, match="staging holds"):
        ops.pack(P, read.segments, offs, [0, 1, 2, 3, 4, 5], staging, tiles=[0, 1, 2], num_tokens=24)
    with pytest.raises(LaunchError, match="repeat"):
        ops.unpack(D, read.segments, offs, [3, 3], staging, tiles=[0, 1], num_tokens=16)


# --------------------------------------------------------------------------- vLLM connector, scheduler side
def test_vllm_scheduler_pairs_blocks_of_different_sizes_by_tokens():
    from types import SimpleNamespace

    from kvtriton.integrations.vllm.scheduler import SchedulerSide, remote_params

    d = SchedulerSide(engine_id="D", host="127.0.0.1", port=1, tp_size=2, block_size=64)
    params = remote_params("P", "127.0.0.1", 6100, 1, 32, "p1", [4, 5, 6, 7])  # 100 tokens in 32-blocks
    req = SimpleNamespace(request_id="d1", kv_transfer_params=dict(params), num_prompt_tokens=100)
    assert d.get_num_new_matched_tokens(req, 64) == (36, True)  # one 64-block is a local prefix hit
    blocks = SimpleNamespace(get_block_ids=lambda: ([11, 12],))
    d.update_state_after_alloc(req, blocks, 36)
    load = d.build_messages(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=None)).loads["d1"]
    assert load.num_tokens == 100 and load.local_block_ids == (-1, 12)
    assert load.remote_block_ids == (4, 5, 6, 7) and load.source.block_size == 32
    bad = dict(params, remote_block_size=0)
    req2 = SimpleNamespace(request_id="d2", kv_transfer_params=bad, num_prompt_tokens=100)
    assert d.get_num_new_matched_tokens(req2, 0) == (0, False)  # bad params: computed locally


def test_gate_accepts_a_block_size_change_of_dim_major_blocks_and_refuses_malformed_ones():
    import dataclasses

    local = _specs(MODELS[:1], 0, 2, 64, layout="HND")
    cpu = [dataclasses.replace(s, dim_major=(4, 0)) for s in _specs(MODELS[:1], 0, 2, 32, layout="HND")]
    plan = build_plan(0, 2, local, 2, cpu)  # described precisely: tokens are regrouped
    assert plan.maps_tokens and all(sg.dim_major == 0 for r in plan.staged for sg in r.segments)
    plan = build_plan(0, 2, cpu, 2, local)
    assert [sg.dim_major for sg in plan.staged[0].segments] == [4, 0]  # tiles in the destination's order
    bad = [dataclasses.replace(s, dim_major=(9, 0)) for s in _specs(MODELS[:1], 0, 2, 32, layout="HND")]
    with pytest.raises(IncompatibleRemoteError, match="remote engine: stream 0: dim_major 9"):
        build_plan(0, 2, local, 2, bad)
    nhd = [dataclasses.replace(s, dim_major=(4, 0)) for s in _specs(MODELS[:1], 0, 2, 32)]
    with pytest.raises(IncompatibleRemoteError, match="needs an HND stream"):
        build_plan(0, 2, local, 2, nhd)
    same = [dataclasses.replace(s, dim_major=(4, 0)) for s in _specs(MODELS[:1], 0, 2, 64, layout="HND")]
    with pytest.raises(IncompatibleRemoteError, match=r"in-block order differs .* local \[0, 0\], remote \[4, 0\]"):
        build_plan(0, 2, local, 2, same)  # equal block sizes: whole tiles cannot reorder
    assert not build_plan(0, 2, same, 2, same).maps_tokens  # whole blocks move as before


def test_wire_carries_block_size_and_dim_major():

    from kvtriton.protocol import wire

    k = torch.zeros(8, 2, 4, 16, dtype=torch.float16)
    spec = Region.attention("l0", k, k.clone(), layout="HND", block_size=4, total_heads=4, dim_major=(8, 0)).spec
    spans = tuple(wire.stream_span(spec, j) for j in range(2))
    md = wire.RankMetadata(engine="P", rank=0, tp=2,  # 2 of 4 heads: rank 0 of TP2
                           agent="P:0:x", agent_md=b"x", mem="DRAM", dev=0,
                           regions=(spec,), addrs=((4096, 1 << 20),), spans=(spans,),
                           staging=wire.StagingInfo(1 << 30, 4096, 16, 8192))
    got = wire.decode_metadata(wire.encode_metadata(md))
    assert got.regions[0].block_size == 4 and got.regions[0].dim_major == (8, 0) and not got.regions[0].token_major
    for bad in ((17, 0), (8,), (8, 0, 0)):
        raw = msgpack.unpackb(wire.encode_metadata(md), raw=False)
        raw["regions"][0]["dim_major"] = list(bad)
        with pytest.raises(ProtocolError, match="dim_major"):
            wire.decode_metadata(msgpack.packb(raw, use_bin_type=True))
    raw["regions"][0]["dim_major"] = [0, 0]
    assert wire.decode_metadata(msgpack.packb(raw, use_bin_type=True)).regions[0].dim_major == ()
    for cls in (wire.Pull, wire.Push):
        m = cls(*(["x", "r", 0, (1, 2)] + ([(3,)] if cls is wire.Push else []) + [1, "d", 40, (0, 2)]))
        assert wire.decode_message(m.encode()) == m
