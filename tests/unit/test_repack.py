"""End-to-end repack through the planner with the torch reference: global KV -> sharded source
caches -> pack -> route per plan -> unpack -> every destination byte checked against the global
heads its rank owns, and every other byte unchanged."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtriton.errors import IncompatibleRemoteError, PlanError
from kvtriton.regions import Kind
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination,
    load_source,
    local_transfer,
    make_global_kv,
    make_rank_regions,
    snapshot,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8]


def run_case(models, src_tp, dst_tp, *, block_size=4, n=5, src_layout="NHD", dst_layout="NHD",
             src_storage="separate", dst_storage="separate", src_blocks=None, dst_blocks=None,
             src_pad=0, dst_pad=0, seed=0, modes=None, pad_ids=False, chunk_bytes=None):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    src_blocks = src_blocks or n + 3
    dst_blocks = dst_blocks or n + 2
    src = [make_rank_regions(models, r, src_tp, src_blocks, block_size, layout=src_layout,
                             storage=src_storage, gen=gen, pad_blocks=src_pad) for r in range(src_tp)]
    dst = [make_rank_regions(models, r, dst_tp, dst_blocks, block_size, layout=dst_layout,
                             storage=dst_storage, gen=gen, pad_blocks=dst_pad) for r in range(dst_tp)]
    src_ids = rng.permutation(src_blocks)[:n]  # unsorted, non-consecutive
    dst_ids = rng.permutation(dst_blocks)[:n]
    if pad_ids and n > 1:
        src_ids[0] = -1
        dst_ids[n - 1] = -1
    global_kv = make_global_kv(models, n, block_size, gen)
    for r in range(src_tp):
        load_source(src[r], r, src_tp, global_kv, src_ids)
    before = [snapshot(x) for x in dst]
    stats = local_transfer(src, dst, src_ids, dst_ids, modes=modes, chunk_bytes=chunk_bytes)
    expected_ids = np.where(src_ids >= 0, dst_ids, -1)
    for r in range(dst_tp):
        check_destination(dst[r], r, dst_tp, global_kv, expected_ids, before[r])
    return stats


def gqa(heads=8, head_dim=16, dtype=torch.bfloat16, name="attn"):
    return RegionModel.gqa(name, heads, head_dim, dtype)


@pytest.mark.parametrize("dst_tp,src_tp", [(1, 1), (2, 1), (4, 2), (4, 4), (1, 2), (2, 4), (1, 4)])
@pytest.mark.parametrize("layouts", [("NHD", "NHD"), ("HND", "NHD"), ("NHD", "HND")])
def test_explicit_tp_pairs(dst_tp, src_tp, layouts):
    stats = run_case([gqa(), gqa(name="attn2", head_dim=8)], src_tp, dst_tp,
                     src_layout=layouts[0], dst_layout=layouts[1])
    assert stats["staged_bytes"] + stats["direct_bytes"] > 0


def test_eight_heads_on_tp16():
    run_case([gqa(heads=8, head_dim=8)], 8, 16, n=3)
    run_case([gqa(heads=8, head_dim=8)], 16, 8, n=3)
    run_case([gqa(heads=8, head_dim=8)], 16, 16, n=3)


def test_mla_only_goes_direct_and_coalesces():
    models = [RegionModel.mla("mla0", 40), RegionModel.mla("mla1", 40)]
    stats = run_case(models, 2, 4)
    assert stats["staged_descs"] == 0 and stats["direct_descs"] > 0


def test_gqa_with_mla_draft_mixed():
    models = [gqa(), RegionModel.mla("draft.mla", 24, torch.float16), gqa(name="attn.1")]
    for src_tp, dst_tp in [(2, 4), (4, 2), (1, 2)]:
        stats = run_case(models, src_tp, dst_tp, src_layout="HND", dst_storage="joint")
        assert stats["staged_descs"] > 0 and stats["direct_descs"] > 0


def test_six_heads_p2_to_d3():
    run_case([gqa(heads=6, head_dim=8)], 2, 3, dst_layout="HND", src_storage="joint0")
    run_case([gqa(heads=6, head_dim=8)], 3, 2, src_layout="HND")


def test_padding_ids_chunking_and_forced_direct():
    run_case([gqa(), RegionModel.mla("m", 16)], 1, 2, n=2, pad_ids=True)  # every position padded away
    run_case([gqa()], 2, 4, pad_ids=True)
    run_case([gqa(), RegionModel.mla("m", 16)], 4, 2, n=7, chunk_bytes=3 * 4 * 4 * 16 * 2 * 2)
    run_case([gqa(heads=4)], 2, 2, modes="direct", src_storage="joint0", dst_storage="joint")


def test_incompatible_sides_raise_before_writing():
    a = [gqa(head_dim=16)]
    gen = torch.Generator().manual_seed(0)
    src = [make_rank_regions(a, 0, 1, 4, 4, gen=gen)]
    dst = [make_rank_regions([gqa(head_dim=8)], 0, 1, 4, 4, gen=gen)]
    before = snapshot(dst[0])
    with pytest.raises(IncompatibleRemoteError, match="head_dim"):
        local_transfer(src, dst, [0, 1], [2, 3])
    with pytest.raises(PlanError, match="out of range"):
        local_transfer(src, [make_rank_regions(a, 0, 1, 4, 4, gen=gen)], [0, 9], [2, 3])
    assert all(torch.equal(x, y) for x, y in zip(snapshot(dst[0])[0], before[0]))


def valid_tps(heads):
    return [tp for tp in (1, 2, 3, 4, 6, 8) if heads % tp == 0 or tp % heads == 0]


@st.composite
def cases(draw):
    heads = draw(st.sampled_from([1, 2, 4, 6, 8]))
    src_tp = draw(st.sampled_from(valid_tps(heads)))
    dst_tp = draw(st.sampled_from(valid_tps(heads)))
    models = []
    for i in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(DTYPES))
        if draw(st.booleans()):
            hd = draw(st.sampled_from([4, 8, 12]))
            vd = draw(st.sampled_from([hd, hd, 8]))
            models.append(RegionModel(f"r{i}", Kind.SPLIT, heads, (hd, vd), dtype))
        else:
            models.append(RegionModel.mla(f"r{i}", draw(st.sampled_from([8, 20])), dtype))
    return dict(
        models=models, src_tp=src_tp, dst_tp=dst_tp,
        block_size=draw(st.sampled_from([1, 2, 4])),
        n=draw(st.integers(1, 6)),
        src_layout=draw(st.sampled_from(["NHD", "HND"])),
        dst_layout=draw(st.sampled_from(["NHD", "HND"])),
        src_storage=draw(st.sampled_from(["separate", "joint", "joint0"])),
        dst_storage=draw(st.sampled_from(["separate", "joint", "joint0"])),
        src_extra=draw(st.integers(0, 4)), dst_extra=draw(st.integers(0, 4)),
        src_pad=draw(st.sampled_from([0, 0, 2])), dst_pad=draw(st.sampled_from([0, 0, 2])),
        pad_ids=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
        modes=draw(st.sampled_from([None, None, "staged"])),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_property_any_tp_pair_layout_dtype_storage(case):
    n = case["n"]
    run_case(case["models"], case["src_tp"], case["dst_tp"], block_size=case["block_size"], n=n,
             src_layout=case["src_layout"], dst_layout=case["dst_layout"],
             src_storage=case["src_storage"], dst_storage=case["dst_storage"],
             src_blocks=n + case["src_extra"], dst_blocks=n + case["dst_extra"],
             src_pad=case["src_pad"], dst_pad=case["dst_pad"], seed=case["seed"],
             pad_ids=case["pad_ids"], modes=case["modes"])


def test_padded_source_position_does_not_overwrite_the_last_block():
    """Regression (hypothesis, seed 734): with every source block in use, a -1 (padding) source id
    must not land in the last block, which another position of the request reads."""
    models = [RegionModel("r0", Kind.SPLIT, 6, (8, 8), torch.float32), RegionModel.mla("r1", 8, torch.float32)]
    run_case(models, 1, 1, block_size=4, n=5, src_blocks=5, dst_blocks=5, seed=734, pad_ids=True)
