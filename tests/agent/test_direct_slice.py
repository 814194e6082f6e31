"""DIRECT_SLICE: a head slice that is one contiguous range inside a block on both sides, moved
zero-copy cache to cache (vLLM NixlConnector's one pass), byte for byte.

Planner: static feasibility per region (head-major blocks, whole source block into a head range
of ours when P > D, the reverse when D > P, both partial when neither divides, replicated heads,
dim-major K tiles; token-major slices, layout changes and block-size changes refused with the
reason), forced and auto choice by the cost model, descriptor counts against vLLM
NixlConnector's ``k * L * n``. Bytes: the runs applied as plain copies land exactly what the
global-head oracle expects and exactly what the independent reference pack/unpack
(:mod:`kvtriton.ops.reference`) lands by the staged route, every other byte untouched; then real
agents over NIXL in one process (pull and push, P > D and D > P, mixed SPLIT + REPLICATE cache,
-1 positions), the cost model's choice there, and one multi-process cluster.
"""

import dataclasses
import time

import numpy as np
import pytest
import torch
from helpers.specs import pieces_of_rows, pieces_of_runs

from kvtriton.errors import PlanError
from kvtriton.plan import (
    CostModel,
    PairPlan,
    RequestPlan,
    Route,
    Way,
    build_plan,
    choose_way,
    direct_runs,
    direct_slice_problem,
    slice_block_rows,
    slice_runs,
    split_sources,
    way_descriptors,
)
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

DS, DIRECT, STAGED = Route.DIRECT_SLICE, Route.DIRECT, Route.STAGED
# (P, D, total heads): P > D, D > P, neither divides (P3 -> D2 and P2 -> D3 with 6 heads), replicated heads
PAIRS = [(2, 1, 4), (1, 2, 4), (4, 2, 4), (2, 4, 4), (3, 2, 6), (2, 3, 6), (4, 1, 2), (1, 4, 2), (4, 2, 2)]


def _models(heads):
    return [RegionModel.gqa("l0", heads, 16), RegionModel.mla("mla", 24, torch.float16),
            RegionModel.gqa("l1", heads, 8, torch.float32)]


def _cpu(heads):
    """vLLM CPU caches: one K||V stream per layer, K dim-major per (block, head) tile."""
    return [RegionModel("attn.0", Kind.SPLIT, heads, (32,), torch.bfloat16), RegionModel.mla("mla", 24, torch.float16),
            RegionModel("attn.1", Kind.SPLIT, heads, (12,), torch.float32)]


CPU_MODES = {"attn.0": "direct_slice", "attn.1": "direct_slice"}


def _split(heads):
    return [RegionModel.gqa("l0", heads, 16), RegionModel.gqa("l1", heads, 8, torch.float32)]


def _specs(models, rank, tp, layout="HND", storage="separate", bs=4, pad=0):
    regs = make_rank_regions(models, rank, tp, 8, bs, layout=layout, storage=storage,
                             gen=torch.Generator().manual_seed(0), device="meta" if not pad else "cpu", pad_blocks=pad)
    return [r.spec for r in regs]


# --------------------------------------------------------------------------- planner
@pytest.mark.parametrize("p_tp,d_tp,heads", PAIRS)
def test_head_major_slices_are_feasible_everywhere(p_tp, d_tp, heads):
    for d in range(d_tp):
        dst, src = _specs(_models(heads), d, d_tp), _specs(_models(heads), 0, p_tp)
        plan = build_plan(d, d_tp, dst, p_tp, src, modes="direct_slice")
        assert plan.modes == (DS, DIRECT, DS) and not plan.staged  # the MLA latent: whole blocks, DIRECT
        sliced = [x for x in plan.direct if x.sliced]
        want = split_sources(d, d_tp, p_tp, heads)
        assert [x.heads for x in sliced] == [tuple((s.src_head, s.dst_head, s.num_heads) for s in want)] * 2
        assert plan.source_ranks == tuple(sorted({s.src_rank for s in want} | set(plan.direct[1].src_ranks)))


def test_infeasible_slices_are_refused_with_the_reason():
    # token-major blocks: a head range of a block is one range per token, not one range
    with pytest.raises(PlanError, match="direct_slice is not possible: .*not one contiguous range"):
        build_plan(0, 1, _specs(_split(4), 0, 1, "NHD"), 2, _specs(_split(4), 0, 2, "NHD"), modes="direct_slice")
    with pytest.raises(PlanError, match="direct_slice is not possible: .*destination .*not one contiguous"):
        build_plan(0, 2, _specs(_split(4), 0, 2, "NHD"), 4, _specs(_split(4), 0, 4, "HND"), modes="direct_slice")
    # layouts differ with two heads per slice: not the same order inside the range
    with pytest.raises(PlanError, match="not in the same order"):
        build_plan(0, 1, _specs(_split(4), 0, 1, "HND"), 2, _specs(_split(4), 0, 2, "NHD"), modes="direct_slice")
    # block sizes differ: a block is not the same tokens on both sides
    with pytest.raises(PlanError, match="block sizes differ"):
        build_plan(0, 1, _specs(_split(4), 0, 1, bs=8), 2, _specs(_split(4), 0, 2, bs=4), modes="direct_slice")
    # padded rows (head_dim stride > head_dim): heads are not adjacent
    with pytest.raises(PlanError, match="not one contiguous range"):
        build_plan(0, 1, _specs(_split(4), 0, 1, pad=1), 2, _specs(_split(4), 0, 2), modes="direct_slice")
    # whole-block DIRECT forced on a partial slice says which mode would do
    with pytest.raises(PlanError, match="use direct_slice"):
        build_plan(0, 1, _specs(_split(4), 0, 1), 2, _specs(_split(4), 0, 2), modes="direct")


def test_one_head_per_slice_crosses_layouts_and_dim_major_tiles_move():
    # one head: its tile is [token, dim] in either layout, but an NHD block of 2 heads is not one range
    assert direct_slice_problem(_specs(_split(4), 0, 4, "NHD")[0], _specs(_split(4), 0, 2, "HND")[0],
                                split_sources(0, 4, 2, 4)) is None
    # vLLM's CPU cache: one K||V stream, K dim-major per (block, head) tile, padded between blocks
    dst = _specs(_cpu(4), 0, 1, storage="vllm_cpu", pad=3)
    src = _specs(_cpu(4), 0, 2, storage="vllm_cpu", pad=3)
    assert dst[0].dim_major == (16,) and dst[0].num_streams == 1
    plan = build_plan(0, 1, dst, 2, src, modes=CPU_MODES)
    assert plan.modes == (DS, STAGED, DS)  # the MLA latent's rows are padded: staged, in a payload beside


def test_descriptor_counts_match_nixl_connector():
    """P2 -> D1 and P1 -> D2 (two streams each, L layers): one descriptor per (source rank, layer,
    stream, block) whatever the ids, what vLLM NixlConnector posts with K and V separate
    (``bench/baselines.py``); a whole-block slice still coalesces runs (DIRECT's count)."""
    from bench.baselines import vllm_direct_descriptor_count

    layers, n = 2, 12
    runs_ids, rand_ids = np.arange(3, 3 + n), np.random.default_rng(0).permutation(40)[:n]
    for p_tp, d_tp in ((2, 1), (1, 2)):
        dst, src = _specs(_split(4), 0, d_tp), _specs(_split(4), 0, p_tp)
        plan = build_plan(0, d_tp, dst, p_tp, src, modes="direct_slice")
        k = len(plan.source_ranks)
        for ids in (runs_ids, rand_ids):
            runs = direct_runs(plan, src, dst, ids, ids[::-1].copy())
            assert len(runs) == vllm_direct_descriptor_count(k, layers, n, kv_streams=2)
            assert set(runs.nbytes.tolist()) == {4 * 2 * 16 * 2, 4 * 2 * 8 * 4}  # two heads of a 4-token block
    # P2 -> D2: the slice is the whole block, so consecutive ids on both sides are one descriptor
    plan = build_plan(0, 2, _specs(_split(4), 0, 2), 2, _specs(_split(4), 0, 2), modes="direct_slice")
    assert len(direct_runs(plan, _specs(_split(4), 0, 2), _specs(_split(4), 0, 2), runs_ids, runs_ids)) == 2 * 2


def test_cost_model_picks_it_when_descriptors_are_large():
    dst, src = _specs(_split(4), 0, 1), _specs(_split(4), 0, 2)
    assert build_plan(0, 1, dst, 2, src, cost=CostModel(desc_us=1e-3)).routes == (DS, DS)
    assert build_plan(0, 1, dst, 2, src, cost=CostModel(desc_us=1e4)).routes == (STAGED, STAGED)
    # P3 -> D2, 6 heads: D0 reads source 1's head 2 only (no one-sided way): the slice is compared with
    # both repack passes; P2 -> D1 also allows read_unpack (one pass), so the bar is higher there
    tile = 4 * 1 * 8 * 4  # the smallest slice's descriptor (l1: fp32, one head, 4 tokens)
    two_passes = tile / 1e3 * (1 / 10 + 1 / 10)  # us, a 10 GB/s repack both ways
    cost = CostModel(desc_us=0.75 * two_passes, unpack_gbps=10.0)
    d6, s6 = _specs(_split(6), 0, 2), _specs(_split(6), 0, 3)
    assert build_plan(0, 2, d6, 3, s6, cost=cost).routes == (DS, DS)
    one_pass_tile = 4 * 2 * 8 * 4  # P2 -> D1 slices: two heads
    cost = CostModel(desc_us=0.75 * one_pass_tile / 1e3 * (1 / 10 + 1 / 10), unpack_gbps=10.0)  # beats two, not one
    assert build_plan(0, 1, dst, 2, src, cost=cost).routes == (STAGED, STAGED)
    assert CostModel().direct_slice_wins(64 << 10, read_unpack=True)  # vLLM P2 -> D1's 64 KiB reads
    # NHD: not feasible, so never chosen, whatever the model
    assert build_plan(0, 1, _specs(_split(4), 0, 1, "NHD"), 2, _specs(_split(4), 0, 2, "NHD"),
                      cost=CostModel(desc_us=1e-3)).routes == (STAGED, STAGED)


# --------------------------------------------------------------------------- bytes, in process
def _ids(kind, n, nb_src, nb_dst, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "runs":
        src, dst = np.arange(3, 3 + n), np.arange(nb_dst - n, nb_dst)
    else:
        src, dst = rng.permutation(nb_src)[:n], rng.permutation(nb_dst)[:n]
    src, dst = src.astype(np.int64), dst.astype(np.int64)
    src[1], dst[4] = -1, -1  # a position the source does not hold, one the destination has
    return src, dst


def _expect(src, dst):
    out = dst.copy()
    out[src < 0] = -1
    return out


def _caches(models, p_tp, d_tp, layout, storage, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    P = [make_rank_regions(models, r, p_tp, 40, 4, layout=layout, storage=storage, gen=gen, pad_blocks=pad)
         for r in range(p_tp)]
    D = [make_rank_regions(models, r, d_tp, 30, 4, layout=layout, storage=storage, gen=gen, pad_blocks=pad)
         for r in range(d_tp)]
    return gen, P, D


def _raw(regions):
    return [[s.view(torch.uint8).clone() for s in r.streams] for r in regions]


@pytest.mark.parametrize("p_tp,d_tp,heads", PAIRS)
@pytest.mark.parametrize("ids", ["runs", "random"])
@pytest.mark.parametrize("storage", ["separate", "joint", "vllm_cpu"])
def test_runs_land_what_the_reference_repack_lands(p_tp, d_tp, heads, ids, storage):
    """Fresh random caches and KV: the DIRECT_SLICE runs, applied as byte copies, give every decode
    rank exactly the oracle's blocks and exactly the bytes the reference pack + unpack give by
    the staged route on an identical copy of the caches; nothing else changes."""
    models = _cpu(heads) if storage == "vllm_cpu" else _models(heads)
    pad = 3 if storage == "vllm_cpu" else 0  # blocks padded apart: the slices stay one range each
    gen, P, D = _caches(models, p_tp, d_tp, "HND", storage, pad, seed=p_tp * 7 + d_tp + heads)
    _, P2, D2 = _caches(models, p_tp, d_tp, "HND", storage, pad, seed=p_tp * 7 + d_tp + heads)
    src, dst = _ids(ids, 9, 40, 30, seed=heads)
    kv = make_global_kv(models, src.size, 4, gen)
    for r in range(p_tp):
        load_source(P[r], r, p_tp, kv, src)
        load_source(P2[r], r, p_tp, kv, src)
    before = [snapshot(x) for x in D]
    stats = local_transfer(P, D, src, dst, modes=CPU_MODES if storage == "vllm_cpu" else "direct_slice")
    assert (stats["staged_descs"] > 0) == (storage == "vllm_cpu") and stats["direct_descs"] > 0
    staged = local_transfer(P2, D2, src, dst, modes="staged")
    assert staged["direct_descs"] == 0
    for i in range(d_tp):
        check_destination(D[i], i, d_tp, kv, _expect(src, dst), before[i])
        for a, b in zip(_raw(D[i]), _raw(D2[i])):
            for x, y in zip(a, b):
                assert torch.equal(x, y)


# --------------------------------------------------------------------------- agents over NIXL
nixl = pytest.importorskip("nixl")


def _pair(p_tp, d_tp, models, **kw):
    from kvtriton.testing.pair import EnginePair

    return EnginePair(p_tp, d_tp, models=models, p_layout="HND", d_layout="HND", p_storage="joint",
                      **{"chunk_bytes": 8192, "eager_bytes": 0, **kw})


@pytest.mark.nixl
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("p_tp,d_tp,heads", [(2, 1, 4), (1, 2, 4), (3, 2, 6), (4, 1, 2), (1, 4, 2)])
def test_agents_move_exact_bytes(mode, p_tp, d_tp, heads):
    """Mixed cache (two GQA regions by DIRECT_SLICE, an MLA latent by DIRECT), random ids with -1
    positions: every decode rank exact, canaries intact, no staging used, holds freed as done."""
    e = _pair(p_tp, d_tp, _models(heads), mode=mode, modes="direct_slice")
    try:
        src, dst = _ids("random", 13, 64, 48, seed=p_tp + d_tp)
        kv, before = e.start(src, dst)
        got = e.drive()
        for i in range(d_tp):
            assert got[i][0].ok, got[i][0].error
            check_destination(e.D[i], i, d_tp, kv, _expect(src, dst), before[i])
        stats = [a.stats for a in (e.da if mode == "pull" else e.pa)]  # who posts: the reader, or the writer
        assert sum(s["direct_descriptors"] for s in stats) > 0
        assert all(a.stats["staged_descriptors"] == 0 and a.stats["pack_launches"] == 0 for a in e.agents)
        freed = e.settle_freed(p_tp)
        assert len(freed) == p_tp and all(f.reason == "done" for f in freed)
    finally:
        e.close()


@pytest.mark.nixl
@pytest.mark.parametrize("desc_us,route", [(1e-3, "direct"), (1e4, "staged")])
def test_agents_follow_the_cost_model(desc_us, route):
    """No forced mode: P2 -> D1 and P1 -> D2 with HND caches go DIRECT_SLICE when descriptors are
    cheap for the model, STAGED (or a one-sided way) when they are dear; exact either way."""
    for p_tp, d_tp in ((2, 1), (1, 2)):
        e = _pair(p_tp, d_tp, _split(4), cost=CostModel(desc_us=desc_us))
        try:
            src, dst = _ids("random", 11, 64, 48, seed=3)
            kv, before = e.start(src, dst)
            got = e.drive()
            for i, d in enumerate(e.da):
                assert got[i][0].ok, got[i][0].error
                check_destination(e.D[i], i, d_tp, kv, _expect(src, dst), before[i])
                assert (d.stats["direct_descriptors"] > 0) == (route == "direct")
        finally:
            e.close()


@pytest.mark.nixl
def test_cluster_processes():
    """Separate processes over NIXL (P3 -> D2, 6 heads: both slices partial on one rank): every
    decode rank exact, canaries intact, holds freed."""
    from kvtriton.testing.cluster import Cluster, ClusterConfig

    cfg = ClusterConfig(models=_models(6), p_tp=3, d_tp=2, mode="pull", block_size=4, p_layout="HND",
                        d_layout="HND", staging_bytes=32 << 10, slot_bytes=1024, timeout_s=20,
                        modes="direct_slice")
    with Cluster(cfg, start_timeout_s=180) as c:  # room for child start-up on a loaded host
        reqs = c.requests(3, 9)
        freed = c.transfer_exact(reqs)
        assert all(len(v) == len(reqs) for v in freed.values())


@pytest.mark.nixl
@pytest.mark.parametrize("bad", ["past_the_cache", "negative"])
def test_forged_push_ranges_are_refused(bad):
    """Push: the decode names the blocks the source WRITEs its slices into. Ids past the decode's
    cache are refused with a Reject, negative ones as a malformed message (``bad_messages``), before
    any WRITE; no byte of the decode cache moves."""
    from kvtriton.protocol import wire
    from kvtriton.testing.seams import Wiretap

    e = _pair(2, 1, _split(4), mode="push", modes="direct_slice")
    try:
        src = np.arange(4)
        e.request(src)
        for p in e.pa:
            p.hold("r", src, lease_s=30)
        d, p0 = e.da[0], e.pa[0]
        before = snapshot(e.D[0])
        dst = (48, 49, 50, 1 << 40) if bad == "past_the_cache" else (0, 1, 2, -7)
        tap = Wiretap(d)
        tap.send(p0, wire.Push("x|1", "r", 0, tuple(src.tolist()), dst, 0, d.plan_for("P").digest()))
        deadline = time.monotonic() + 5
        while not (tap.seen(wire.Reject) if bad == "past_the_cache" else p0.stats["bad_messages"]):
            assert time.monotonic() < deadline, "neither a reject nor a refused message"
            for a in (p0, d):
                a.progress()
        if bad == "past_the_cache":
            assert "dst_ids must be 4 distinct ids in [0, 48)" in tap.seen(wire.Reject)[0].reason
        e.settle(0.2)
        assert p0.stats["direct_descriptors"] == 0 and not p0.debug_state()["serves"]
        for a, b in zip(before, snapshot(e.D[0])):
            for x, y in zip(a, b):
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    finally:
        e.close()


def _hold_until_offered(e, src, want):
    """Load a request into blocks ``src``, hold it on every prefill rank for consumer D, and
    progress until each decode rank ``i`` has ``want[i]`` offers of it; returns (global KV,
    snapshots of the decode caches)."""
    kv = e.request(src)
    before = [snapshot(x) for x in e.D]
    for p in e.pa:
        p.hold("r", src, lease_s=30, consumer="D")
    deadline = time.monotonic() + 10
    while any(sum("r" in o for o in d.debug_state()["offers"].values()) < want[i] for i, d in enumerate(e.da)):
        assert time.monotonic() < deadline, [d.debug_state()["offers"] for d in e.da]
        for a in e.agents:
            a.progress()
    return kv, before


def _fetch_offered(e, src, dst, want):
    """:func:`_hold_until_offered`, then every decode rank fetches the request into ``dst``; each
    result ok and byte-exact against the oracle; returns the results per decode rank."""
    kv, before = _hold_until_offered(e, src, want)
    for d in e.da:
        d.fetch("r", "P", src, dst)
    got = e.drive()
    for i in range(e.d_tp):
        assert got[i][0].ok, got[i][0].error
        check_destination(e.D[i], i, e.d_tp, kv, dst, before[i])
    return got


@pytest.mark.nixl
def test_eager_offer_confirms_slices_beside_a_staged_payload():
    """Pull with eager packing: the MLA latent forced staged is packed at hold time and offered,
    the offer also confirming the DIRECT_SLICE runs of the GQA regions; the decode takes it (no
    pull) and READs both. Exact bytes, holds freed as done."""
    e = _pair(2, 1, _models(4), eager_bytes=32 << 10, modes={"l0": "direct_slice", "mla": "staged",
                                                              "l1": "direct_slice"})
    try:
        src, dst = np.arange(5, 14), np.arange(20, 29)
        kv, before = _hold_until_offered(e, src, {0: 1})
        d = e.da[0]
        d.fetch("r", "P", src, dst)
        got = e.drive()
        assert got[0][0].ok, got[0][0].error
        check_destination(e.D[0], 0, 1, kv, dst, before[0])
        assert d.stats["offers_taken"] >= 1 and d.stats["direct_descriptors"] == 2 * 2 * 2 * src.size
        assert all(f.reason == "done" for f in e.settle_freed(2))
    finally:
        e.close()


@pytest.mark.nixl
@pytest.mark.parametrize("p_tp,d_tp,heads,modes", [(2, 1, 4, "direct_slice"), (1, 2, 4, "direct_slice"),
                                                   (1, 1, 4, "direct")])
def test_a_direct_only_hold_is_offered_and_read_with_no_pull(p_tp, d_tp, heads, modes):
    """A hold naming its consumer whose plan sends DIRECT runs only (no staged payload): each
    prefill rank offers its cache blocks once the hold is placed, and the decode READs at fetch
    time without a pull (the sources count each offer read, none pulled or missed). Exact bytes;
    afterwards the holds end as done, staging whole."""
    models = [RegionModel.gqa("l0", heads, 16), RegionModel.gqa("l1", heads, 8, torch.float32)]
    e = _pair(p_tp, d_tp, models, modes=modes, eager_bytes=32 << 10)  # eager on (it offers; nothing to pack)
    try:
        src, dst = np.arange(5, 14), np.arange(20, 29)
        want = {i: len(split_sources(i, d_tp, p_tp, heads)) for i in range(d_tp)}  # source ranks each one reads
        _fetch_offered(e, src, dst, want)
        assert sum(d.stats["offers_taken"] for d in e.da) == sum(want.values())
        assert all(a.stats["staged_descriptors"] == 0 and a.stats["pack_launches"] == 0 for a in e.agents)
        assert all(f.reason == "done" for f in e.settle_freed(p_tp))
        src_stats = [p.stats for p in e.pa]
        assert sum(s["eager_offer_reads"] for s in src_stats) == sum(want.values())
        assert all(s["eager_offer_pulls"] == 0 and s["eager_misses"] == 0 for s in src_stats)
    finally:
        e.close()


# --------------------------------------------------------------------------- the per-request way
def _band(heads_per_slice: int) -> CostModel:
    """A descriptor 1.5 passes of a 10 GB/s repack (both ways) over one slice (128 bytes a
    head here: 4 tokens x 16 bf16 or 8 fp32 dims), between the one-sided ways' one pass and
    staging's two: the plan cannot fix the route (a one-sided way beats a slice descriptor over
    runs, loses to it over scattered ids), so the payload may travel DIRECT_SLICE and each
    request's runs decide. A pass's fixed cost is left out (this test's payloads are a few KB: a
    real one would decide them all for the slice, see test_costmodel)."""
    return CostModel(desc_us=1.5 * 128 * heads_per_slice / 1e4, unpack_gbps=10.0, pass_us=0.01, segment_us=0.01)


BAND = _band(1)
DEAR = CostModel(desc_us=1e4)  # never a slice route: every feasible region in a payload
WAY_DS = Way.DIRECT_SLICE


@pytest.mark.parametrize("p_tp,d_tp,one_sided", [(2, 4, Way.PACK_PLACE), (4, 2, Way.READ_UNPACK)])
def test_the_slice_is_a_way_chosen_per_request_by_its_runs(p_tp, d_tp, one_sided):
    dst, src = _specs(_split(4), 0, d_tp), _specs(_split(4), 0, p_tp)
    plan = build_plan(0, d_tp, dst, p_tp, src, cost=BAND)
    assert plan.routes == (STAGED, STAGED)
    read = plan.staged[0]  # (P4 -> D2: one payload from each of two source ranks, alike)
    assert all(r.ways == (Way.STAGED, one_sided, WAY_DS) for r in plan.staged)
    rand = np.random.default_rng(0).permutation(40)[:11]
    runs = np.arange(3, 14)
    # one descriptor per (segment, block) for a partial slice, whatever the runs
    assert way_descriptors(read, WAY_DS, src, dst, runs, runs) == 11 * len(read.segments)
    assert choose_way(read, src, dst, rand, rand[::-1].copy(), BAND) is WAY_DS
    assert choose_way(read, src, dst, runs, runs, BAND) is one_sided
    assert choose_way(read, src, dst, rand, rand, BAND, packed=True) is not WAY_DS  # packed already: read that
    # cheap enough descriptors: fixed at plan time as the route, dear ones: never a slice
    assert build_plan(0, d_tp, dst, p_tp, src, cost=CostModel(desc_us=1e-3)).routes == (DS, DS)
    assert choose_way(read, src, dst, rand, rand, DEAR) is Way.STAGED
    # NHD caches: no slice is one range, so no such way
    nhd = build_plan(0, d_tp, _specs(_split(4), 0, d_tp, "NHD"), p_tp, _specs(_split(4), 0, p_tp, "NHD"), cost=BAND)
    assert all(WAY_DS not in s.ways for s in nhd.staged)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2), (2, 1)])
def test_a_pair_plan_is_the_functions_over_geometry_computed_once(p_tp, d_tp):
    """PairPlan (made once per peer) chooses, counts and lists exactly what the functions do over
    the spec lists; a DIRECT_SLICE part's rows are the DIRECT rows then the slice rows, one
    table (one READ) whose selection counts both; RequestPlan.for_fetch records the pair's choice
    per source rank, and for_hold the same choice over its own ids, labelled a guess."""
    models = _models(4)  # two GQA regions staged (the slice a per-request way) and an MLA latent DIRECT
    dst, src = _specs(models, 0, d_tp), _specs(models, 0, p_tp)
    band = _band(4 // max(p_tp, d_tp))  # the slice a per-request way for these heads
    plan = build_plan(0, d_tp, dst, p_tp, src, cost=band)
    assert plan.staged
    pairs = {r: PairPlan(plan, r, src, dst, band) for r in plan.source_ranks}
    rng = np.random.default_rng(1)
    chosen = set()
    for s, t in ((rng.permutation(8)[:6], rng.permutation(8)[:6]), (np.arange(1, 7), np.arange(2, 8))):
        rp = RequestPlan.for_fetch(plan, s, t, src_num_blocks=8, dst_num_blocks=8, chunk_bytes=1 << 20, pairs=pairs)
        for read in plan.staged:
            pair = pairs[read.src_rank]
            assert WAY_DS in read.ways
            chosen.add(rp.way(read.src_rank))
            want = choose_way(read, src, dst, s, t, band)
            assert pair.choose_way(s, t) is want and rp.way(read.src_rank) is want
            for way in read.ways:
                assert pair.way_descriptors(way, s, t) == way_descriptors(read, way, src, dst, s, t)
            assert pair.slice_runs(s, t).src_offset.tolist() == slice_runs(read, src, dst, s, t).src_offset.tolist()
            rows = pair.rows(WAY_DS)
            direct, sliced = pair.rows(), slice_block_rows(read, src, dst)
            assert len(rows) == len(direct) + len(sliced) and rows is pair.rows(WAY_DS)  # made once
            count = rows.select(s, t)[2]
            assert count == direct.select(s, t)[2] + sliced.select(s, t)[2]
            assert count == len(direct_runs(plan, src, dst, s, t, src_rank=read.src_rank)) \
                + len(slice_runs(read, src, dst, s, t))
        assert not rp.guessed
    assert WAY_DS in chosen  # scattered ids: the slice way, read with the DIRECT rows in one table
    assert any(len(p.direct_rows) for p in pairs.values())  # the latent's rows (one replica's)
    hold = RequestPlan.for_hold(plan, s, chunk_bytes=1 << 20, pairs=pairs)
    assert hold.guessed and all(hold.way(r.src_rank) is choose_way(r, src, dst, s, s, band) for r in plan.staged)


def test_a_whole_block_slice_coalesces_runs_on_both_sides():
    # P2 -> D2: the slice is the whole block; the staged route keeps the slice as a per-request way
    # (whole-block DIRECT by this request's runs)
    dst, src = _specs(_split(4), 0, 2), _specs(_split(4), 0, 2)
    read = build_plan(0, 2, dst, 2, src, cost=CostModel(desc_us=1e4)).staged[0]
    assert WAY_DS in read.ways
    runs = np.arange(3, 14)
    assert way_descriptors(read, WAY_DS, src, dst, runs, runs + 5) == len(read.segments)
    rs = slice_runs(read, src, dst, runs, runs + 5)
    assert len(rs) == len(read.segments) and set(rs.nbytes.tolist()) == {11 * 4 * 2 * 16 * 2, 11 * 4 * 2 * 8 * 4}


def _slice_runs_per_segment(read, src_specs, dst_specs, src_ids, dst_ids):
    """The straightforward loop slice_runs replaced: per segment, per block (or per run on both
    sides where the slice is the whole block and blocks lie back to back on both sides)."""
    rows = []
    for g in read.segments:
        s, d = src_specs[g.region], dst_specs[g.region]
        j = g.stream
        ss, ds = s.block_stride_bytes(j), d.block_stride_bytes(j)
        s_off, d_off = g.src_head * s.strides[j][2] * s.itemsize, g.dst_head * d.strides[j][2] * d.itemsize
        whole = ss == g.tile_bytes and ds == g.tile_bytes
        k = 0
        while k < len(src_ids):
            n = 1
            while (whole and k + n < len(src_ids) and src_ids[k + n] == src_ids[k] + n
                   and dst_ids[k + n] == dst_ids[k] + n):
                n += 1
            rows.append((read.src_rank, g.region, j, int(src_ids[k]) * ss + s_off, int(dst_ids[k]) * ds + d_off,
                         n * g.tile_bytes))
            k += n
    return rows


@pytest.mark.parametrize("p_tp,d_tp", [(2, 2), (2, 4), (4, 2), (3, 2)])
def test_slice_runs_match_the_per_segment_loop(p_tp, d_tp):
    """slice_runs (one numpy pass per kind of segment, columns memoised per payload) gives the rows
    of the per-segment loop, in its order, for whole-block and partial slices and mixes of both;
    a memo never serves another spec list's geometry."""
    heads = 6 if 3 in (p_tp, d_tp) else 4
    models = _split(heads) + [RegionModel.gqa("one", 1, 16)]  # one KV head: replicated, a whole-block slice
    dst, src = _specs(models, 0, d_tp), _specs(models, 0, p_tp)
    read = build_plan(0, d_tp, dst, p_tp, src, cost=CostModel(desc_us=1e4)).staged[0]
    assert WAY_DS in read.ways
    rng = np.random.default_rng(p_tp * 10 + d_tp)
    tiles = {(g.region, g.stream): g.tile_bytes for g in read.segments}
    for ids in (rng.permutation(8)[:6], np.arange(1, 8), np.r_[np.arange(0, 3), rng.permutation(5)[:3] + 3]):
        # ids of the specs' 8 blocks: a run, then scattered
        dst_ids = np.r_[np.arange(1, 1 + ids.size // 2), rng.permutation(8)[:ids.size - ids.size // 2]]
        got = slice_runs(read, src, dst, ids, dst_ids)
        rows = list(zip(got.src_rank.tolist(), got.region.tolist(), got.stream.tolist(), got.src_offset.tolist(),
                        got.dst_offset.tolist(), got.nbytes.tolist()))
        assert rows == _slice_runs_per_segment(read, src, dst, ids, dst_ids)
        assert way_descriptors(read, WAY_DS, src, dst, ids, dst_ids) == len(rows)
        # the index form over prepared lists names the same bytes, as many descriptors once merged
        block_rows = slice_block_rows(read, src, dst)
        s_idx, d_idx, count, nbytes = block_rows.select(ids, dst_ids)
        assert (count, nbytes) == (len(got), got.total_bytes)
        assert pieces_of_rows(block_rows, s_idx, d_idx) == pieces_of_runs(got, lambda r, j, nb: tiles[r, j])
    padded = [dataclasses.replace(x, strides=tuple((st[0] * 2, st[1], st[2]) for st in x.strides)) for x in src]
    ids = np.arange(0, 7)
    rows = slice_runs(read, padded, dst, ids, ids + 1)
    assert rows.src_offset.tolist() == [r[3] for r in _slice_runs_per_segment(read, padded, dst, ids, ids + 1)]


@pytest.mark.parametrize("p_tp,d_tp,heads", [(2, 4, 4), (4, 2, 4), (2, 1, 4), (1, 2, 4)])
@pytest.mark.parametrize("ids", ["runs", "random"])
@pytest.mark.parametrize("storage", ["separate", "vllm_cpu"])
def test_slice_runs_land_what_the_reference_repack_lands(p_tp, d_tp, heads, ids, storage):
    """The way's descriptors (:func:`slice_runs`), applied as plain byte copies between fresh
    random caches, land exactly what the reference pack + unpack land by the staged route on an
    identical copy; every other byte untouched."""
    models = _cpu(heads)[::2] if storage == "vllm_cpu" else _split(heads)  # (the MLA latent's padded rows: staged)
    pad = 3 if storage == "vllm_cpu" else 0
    gen, P, D = _caches(models, p_tp, d_tp, "HND", storage, pad, seed=p_tp * 5 + d_tp)
    _, P2, D2 = _caches(models, p_tp, d_tp, "HND", storage, pad, seed=p_tp * 5 + d_tp)
    src, dst = _ids(ids, 9, 40, 30, seed=heads + 1)
    keep = (src >= 0) & (dst >= 0)
    kv = make_global_kv(models, src.size, 4, gen)
    for r in range(p_tp):
        load_source(P[r], r, p_tp, kv, src)
        load_source(P2[r], r, p_tp, kv, src)
    before = [snapshot(x) for x in D]
    staged = local_transfer(P2, D2, src, dst, modes="staged")
    assert staged["direct_descs"] == 0
    for i in range(d_tp):
        dst_specs = [r.spec for r in D[i]]
        plan = build_plan(i, d_tp, dst_specs, p_tp, [r.spec for r in P[0]], cost=DEAR)
        raw_dst = _storage_bytes(D[i])
        for read in plan.staged:
            assert WAY_DS in read.ways
            raw_src = _storage_bytes(P[read.src_rank])
            rs = slice_runs(read, [r.spec for r in P[read.src_rank]], dst_specs, src[keep], dst[keep])
            for g, j, so, do, nb in zip(rs.region, rs.stream, rs.src_offset, rs.dst_offset, rs.nbytes):
                raw_dst[g][j][do:do + nb] = raw_src[g][j][so:so + nb]  # an independent byte loop
        check_destination(D[i], i, d_tp, kv, _expect(src, dst), before[i])
        # byte for byte what the staged route's reference repack left, every other byte included
        for a, b in zip(_storage_bytes(D[i]), _storage_bytes(D2[i])):
            for x, y in zip(a, b):
                assert torch.equal(x, y)


def _storage_bytes(regions):
    """Each stream's bytes from its element 0 to the end of its storage (what its offsets index), as
    writable uint8 views."""
    out = []
    for r in regions:
        row = []
        for t in r.streams:
            base = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
            row.append(base[t.storage_offset() * t.element_size():])
        out.append(row)
    return out


@pytest.mark.nixl
@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2), (2, 1), (1, 2)])
def test_agents_choose_the_slice_per_request(p_tp, d_tp):
    """No forced mode, a model in the band, a mixed cache (two GQA regions in each source rank's
    payload, the MLA latent by DIRECT runs): scattered ids go DIRECT_SLICE (nothing packed, no
    staged descriptor: nothing unpacked), ids in runs go the one-sided way; both exact, holds
    freed as done and staging whole after each."""
    from kvtriton.testing.pair import EnginePair

    # K and V in their own tensors on both sides: a run of blocks is one range for the one-sided
    # ways (over joint K||V blocks they would post a slice's descriptors and a pass besides)
    e = EnginePair(p_tp, d_tp, models=_models(4), p_layout="HND", d_layout="HND", p_storage="separate",
                   chunk_bytes=8192, eager_bytes=0,
                   cost=_band(4 // max(p_tp, d_tp)))
    try:
        one_sided = "pack_place" if d_tp > p_tp else "read_unpack"
        for k, kind in enumerate(("random", "runs")):
            src, dst = _ids(kind, 40, 64, 48, seed=p_tp + d_tp + k)
            packs0 = sum(a.stats["pack_launches"] for a in e.agents)
            staged0 = sum(a.stats["staged_descriptors"] for a in e.agents)
            kv, before = e.start(src, dst, req=f"r{k}")
            got = e.drive()
            payloads = {i: len(e.da[i].debug_state()["reading"]["P"]["ways"]) for i in range(d_tp)}
            for i in range(d_tp):
                res = got[i][0]
                assert res.ok, res.error
                check_destination(e.D[i], i, d_tp, kv, _expect(src, dst), before[i])
                way = "direct_slice" if kind == "random" else one_sided
                ways = dict(res.ways)
                assert ways.get(way, 0) == payloads[i] and ways.get("direct", 0) >= 1, ways
            if kind == "random":  # nothing packed, nothing staged
                assert sum(a.stats["pack_launches"] for a in e.agents) == packs0
                assert sum(a.stats["staged_descriptors"] for a in e.agents) == staged0
            freed = e.settle_freed(p_tp)
            assert len(freed) == p_tp and all(f.reason == "done" for f in freed)
    finally:
        e.close()


@pytest.mark.nixl
@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2)])
def test_an_eager_hold_offers_the_cache_for_a_slice_and_is_read_with_no_pull(p_tp, d_tp):
    """Eager packing on, consumer named, scattered ids: each prefill rank guesses from the
    decode's model that it will be read DIRECT_SLICE, packs nothing and offers its cache blocks;
    the decodes READ the slices at fetch time without a pull. Exact; holds done; staging whole."""
    e = _pair(p_tp, d_tp, _split(4), cost=BAND, eager_bytes=32 << 10)
    try:
        src = np.random.default_rng(5).permutation(64)[:9].astype(np.int64)
        dst = np.random.default_rng(6).permutation(48)[:9].astype(np.int64)
        want = {i: len(split_sources(i, d_tp, p_tp, 4)) for i in range(d_tp)}
        got = _fetch_offered(e, src, dst, want)
        for i in range(d_tp):
            assert dict(got[i][0].ways) == {"direct_slice": want[i]}, got[i][0].ways
        assert all(a.stats["pack_launches"] == 0 and a.stats["staged_descriptors"] == 0 for a in e.agents)
        assert all(f.reason == "done" for f in e.settle_freed(p_tp))  # (the sources saw every RunsDone)
        src_stats = [p.stats for p in e.pa]
        assert sum(s["eager_offer_reads"] for s in src_stats) == sum(want.values())
        assert all(s["eager_offer_pulls"] == 0 and s["eager_misses"] == 0 for s in src_stats)
    finally:
        e.close()


@pytest.mark.nixl
@pytest.mark.parametrize("p_tp,d_tp,heads", [(2, 1, 4), (1, 2, 4)])
def test_runs_done_rides_on_the_done(p_tp, d_tp, heads):
    """Pull: the RunsDone of a part whose READ landed in the call that finished its fetch rides on
    that fetch's Done to the same source rank (one notification, not two): every source rank gets
    exactly one RunsDone per decode rank reading it, separate or riding, the last to land riding;
    bytes exact, holds freed as done (P1 -> D2: the one source rank waits for both decode ranks),
    no transfer left served."""
    from kvtriton.protocol import wire
    from kvtriton.testing.seams import Wiretap

    e = _pair(p_tp, d_tp, _models(heads), modes="direct_slice")
    taps = [Wiretap(p) for p in e.pa]
    try:
        src, dst = _ids("random", 13, 64, 48, seed=p_tp + d_tp)
        kv, before = e.start(src, dst)
        got = e.drive()
        for i in range(d_tp):
            assert got[i][0].ok, got[i][0].error
            check_destination(e.D[i], i, d_tp, kv, _expect(src, dst), before[i])
        freed = e.settle_freed(p_tp)
        assert len(freed) == p_tp and all(f.reason == "done" for f in freed)
        riding = [m.runs_done for t in taps for m in t.seen(wire.Done) if m.runs_done]
        assert riding, "no RunsDone rode on a Done"
        for t in taps:
            separate = [m.xid for m in t.seen(wire.RunsDone)]
            ridden = [m.runs_done for m in t.seen(wire.Done) if m.runs_done]
            assert len(separate) + len(ridden) == d_tp and len(set(separate + ridden)) == d_tp
        assert all(not p.debug_state()["serves"] for p in e.pa)
        assert all(a.stats["bad_messages"] == 0 for a in e.agents)
    finally:
        for t in taps:
            t.close()
        e.close()


@pytest.mark.nixl
def test_runs_done_riding_is_checked_as_a_runs_done():
    """A Done carrying a RunsDone for a transfer the sender has none of is a bad message as that
    RunsDone alone would be (counted; nothing else dropped), and the done itself still ends the
    hold; a Done whose riding RunsDone is an empty string is malformed (counted, not handled)."""
    from kvtriton.protocol import wire

    e = _pair(1, 1, _split(4), modes="direct_slice")
    try:
        p, d = e.pa[0], e.da[0]
        p.hold("r", np.arange(4), lease_s=30, consumer="D")
        empty = wire.encode_message("Done", req="r", dst_rank=0, dst_tp=1, runs_done="")
        for raw in (empty, wire.Done("r", 0, 1, "r|D<0#7").encode()):
            d.transport.send_notif(p.transport.name, raw)
        freed, deadline = [], time.monotonic() + 5
        while not freed:
            assert time.monotonic() < deadline, "the done did not end the hold"
            for a in (p, d):
                a.progress()
            freed += p.freed()
        assert freed[0].reason == "done" and p.stats["bad_messages"] == 2
    finally:
        e.close()
