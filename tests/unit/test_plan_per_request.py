"""Per-request planning: the fast paths (grouped DIRECT runs, bitmap distinct check, memoised plan
values) against straightforward per-region / per-id references, and the validation they keep."""

import dataclasses

import numpy as np
import pytest
import torch
from helpers.specs import pieces_of_rows, pieces_of_runs

from kvtriton.errors import PlanError
from kvtriton.plan import PairPlan, build_plan, compact_request, compact_tokens, direct_block_rows, direct_runs
from kvtriton.regions import Region


def reference_runs(plan, src_specs, dst_specs, src_ids, dst_ids):
    """The per-region, per-rank, per-stream loop direct_runs replaced (region, rank, stream order)."""
    rows = []
    n = src_ids.size
    for dr in plan.direct:
        d = dst_specs[dr.region]
        for rank, part in zip(dr.src_ranks, np.array_split(np.arange(n), len(dr.src_ranks))):
            s = (src_specs[rank] if isinstance(src_specs, dict) else src_specs)[dr.region]
            for j in range(d.num_streams):
                tile = d.tile_bytes(j, d.local_heads)
                ss, ds = s.block_stride_bytes(j), d.block_stride_bytes(j)
                k = 0
                while k < part.size:
                    length = 1
                    if ss == tile and ds == tile:
                        while (k + length < part.size and src_ids[part[k + length]] == src_ids[part[k]] + length
                               and dst_ids[part[k + length]] == dst_ids[part[k]] + length):
                            length += 1
                    i = part[k]
                    rows.append((rank, dr.region, j, src_ids[i] * ss, dst_ids[i] * ds, length * tile))
                    k += length
    return rows


def runs_rows(runs):
    return list(zip(runs.src_rank.tolist(), runs.region.tolist(), runs.stream.tolist(), runs.src_offset.tolist(),
                    runs.dst_offset.tolist(), runs.nbytes.tolist()))


def mixed_specs(num_blocks=64, gqa=True):
    """MLA latents of two widths (one stream) interleaved with joint-K/V GQA regions (two strided
    streams; only when ``gqa``: whole-block DIRECT needs equal TP for a SPLIT region): geometry
    groups whose regions interleave in plan order."""
    specs = []
    for i in range(6):
        if gqa and i % 3 == 2:
            kv = torch.empty(num_blocks, 2, 16, 2, 64, dtype=torch.bfloat16, device="meta")
            specs.append(Region.attention(f"l{i}", kv=kv, block_size=16, total_heads=2).spec)
        else:
            lat = torch.empty(num_blocks, 16, 96 + 32 * (i % 2), dtype=torch.bfloat16, device="meta")
            specs.append(Region.mla(f"l{i}", lat, block_size=16).spec)
    return specs


@pytest.mark.parametrize("src_tp", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_direct_runs_match_per_region_reference(src_tp, seed):
    rng = np.random.default_rng(seed)
    specs = mixed_specs(gqa=src_tp == 1)
    plan = build_plan(0, 1, specs, src_tp, specs, modes="direct")
    for n in (0, 1, 2, 5, 37):
        ids = rng.permutation(64)[:n]
        src = np.sort(ids) if seed else ids  # sorted: long runs; shuffled: mostly single blocks
        dst = rng.permutation(64)[:n] if seed == 0 else np.arange(n) + 3
        runs = direct_runs(plan, specs, specs, src, dst)
        assert runs_rows(runs) == reference_runs(plan, specs, specs, src, dst)


@pytest.mark.parametrize("src_tp", [2, 3])
def test_direct_runs_of_one_source_rank_are_its_rows_of_the_whole(src_tp):
    """What one pair of ranks posts (``src_rank=``) is exactly that rank's rows of every rank's
    runs, in the same order; a rank the plan does not read gives none."""
    rng = np.random.default_rng(src_tp)
    specs = mixed_specs(gqa=False)
    plan = build_plan(0, 1, specs, src_tp, specs, modes="direct")
    src, dst = rng.permutation(64)[:29], np.arange(29) + 5
    every = runs_rows(direct_runs(plan, specs, specs, src, dst))
    for r in range(src_tp):
        assert runs_rows(direct_runs(plan, specs, specs, src, dst, src_rank=r)) == [x for x in every if x[0] == r]
    assert len(direct_runs(plan, specs, specs, src, dst, src_rank=src_tp + 1)) == 0


@pytest.mark.parametrize("src_tp", [1, 2, 3])
def test_block_rows_name_the_pieces_direct_runs_move(src_tp):
    """The index form a request posts over prepared lists (:func:`direct_block_rows`) names, block
    by block, exactly the bytes of :func:`direct_runs` for that source rank; its descriptor
    count is the runs' (NIXL merges the pairs adjacent on both sides) and its bytes theirs."""
    rng = np.random.default_rng(10 + src_tp)
    specs = mixed_specs(gqa=src_tp == 1)
    plan = build_plan(0, 1, specs, src_tp, specs, modes="direct")
    tiles = {(d.region, j): specs[d.region].tile_bytes(j, specs[d.region].local_heads) for d in plan.direct
             for j in range(specs[d.region].num_streams)}
    for n in (0, 1, 5, 37):
        src = rng.permutation(64)[:n] if n % 2 else np.sort(rng.permutation(64)[:n])
        dst = np.arange(n) + 7 if n % 2 else rng.permutation(64)[:n]
        for r in range(src_tp + 1):  # the last: a rank the plan does not read
            runs = direct_runs(plan, specs, specs, src, dst, src_rank=r)
            rows = direct_block_rows(plan, specs, specs, r)
            s_idx, d_idx, count, nbytes = rows.select(src, dst)
            assert (count, nbytes) == (len(runs), runs.total_bytes)
            assert pieces_of_rows(rows, s_idx, d_idx) == pieces_of_runs(runs, lambda g, j, nb: tiles[g, j])
    pair = PairPlan(plan, 0, specs, specs)  # made once per peer: its rows computed once
    assert pair.rows() is pair.rows() and pair.rows().key == direct_block_rows(plan, specs, specs, 0).key


def test_direct_runs_rank_mapping_with_different_strides_and_cache_refresh():
    specs = mixed_specs(gqa=False)
    wide = mixed_specs(gqa=False)
    # rank 1 stores its latents with a padded block stride: runs there never coalesce
    padded = [dataclasses.replace(s, strides=tuple((st[0] + 8, st[1], st[2]) for st in s.strides))
              if s.num_streams == 1 else s for s in wide]
    plan = build_plan(0, 1, specs, 2, specs, modes="direct")
    src, dst = np.arange(10, 30), np.arange(20)
    by_rank = {0: specs, 1: padded}
    got = direct_runs(plan, by_rank, specs, src, dst)
    assert runs_rows(got) == reference_runs(plan, by_rank, specs, src, dst)
    # the memo must not serve rank 1's old geometry once the lists hold other specs
    again = {0: specs, 1: specs}
    assert runs_rows(direct_runs(plan, again, specs, src, dst)) == reference_runs(plan, again, specs, src, dst)
    padded[:] = specs  # same list object, new contents
    assert runs_rows(direct_runs(plan, by_rank, specs, src, dst)) == reference_runs(plan, by_rank, specs, src, dst)


def test_direct_runs_repeat_one_group_for_many_layers():
    lat = torch.empty(128, 16, 576, dtype=torch.bfloat16, device="meta")
    specs = [Region.mla(f"mla{i}", lat, block_size=16).spec for i in range(61)]
    plan = build_plan(0, 4, specs, 8, specs)
    rng = np.random.default_rng(3)
    src = np.concatenate([np.arange(a, a + 8) for a in rng.permutation(16)[:8] * 8])
    dst = np.concatenate([np.arange(a, a + 8) for a in rng.permutation(16)[:8] * 8])
    runs = direct_runs(plan, specs, specs, src, dst)
    assert runs_rows(runs) == reference_runs(plan, specs, specs, src, dst)
    assert runs.region.tolist() == sorted(runs.region.tolist())


# a small request's list (ids.SMALL_REQUEST), then the bitmap, then the sort
@pytest.mark.parametrize("n,num_blocks", [(8, 16), (100, 128), (100, 1 << 20)])
def test_distinct_and_range_checks_every_path(n, num_blocks):
    from kvtriton.plan.ids import SMALL_REQUEST

    assert 8 <= SMALL_REQUEST < 100  # the paths named above are the ones these sizes take
    ids = np.arange(n) * (num_blocks // n)
    s, d = compact_request(np.arange(n), ids, n, num_blocks)
    assert d.tolist() == ids.tolist()
    bad = ids.copy()
    bad[5] = bad[2]
    with pytest.raises(PlanError, match=rf"repeat: \[{bad[2]}\]"):
        compact_request(np.arange(n), bad, n, num_blocks)
    with pytest.raises(PlanError, match="repeat"):
        compact_tokens(np.arange(n), bad, n, num_blocks, 16, 16)
    for v, what in ((num_blocks, "destination block id"), (-2, "destination block id")):
        far = ids.copy()
        far[n - 1] = v
        with pytest.raises(PlanError, match=rf"{what} {v} at position {n - 1} is out of range"):
            compact_request(np.arange(n), far, n, num_blocks)


def test_compact_request_returns_copies_and_rejects_before_anything():
    src, dst = np.arange(4, dtype=np.int64), np.arange(4, dtype=np.int64)
    s, d = compact_request(src, dst, 4, 4)
    src[0] = dst[0] = 3  # the caller reuses its arrays: the compacted request must not change
    assert s.tolist() == [0, 1, 2, 3] and d.tolist() == [0, 1, 2, 3]
    for args, msg in ((([0, -2], [0, 1], 4, 4)), "source block id -2 at position 1"), \
                     ((([0, 1], [0, 4], 4, 4)), "destination block id 4 at position 1"):
        with pytest.raises(PlanError, match=msg):
            compact_request(*args)
    assert compact_request([], [], 4, 4)[0].size == 0


def test_plan_memos_equal_fresh_values():
    from helpers.specs import gqa_specs

    dst, src = gqa_specs(4, 8, 128, 1, 4, 16), gqa_specs(4, 8, 128, 0, 2, 16)
    plan = build_plan(1, 4, dst, 2, src)
    fresh = build_plan(1, 4, dst, 2, src)
    assert plan.digest() == plan.digest() == fresh.digest()
    read = plan.staged[0]
    assert read.bytes_per_block == sum(s.tile_bytes for s in read.segments)
    tiles = [s.tile_bytes for s in read.segments]
    want = [7 * sum(tiles[:i]) + 100 for i in range(len(tiles))]
    assert read.segment_offsets(7, base=100).tolist() == want
    assert read.segment_offsets(7, base=100).tolist() == want  # the cached starts are not modified


def _runs_reference(*sides):
    """Runs consecutive on every side, counted one position at a time (pure Python)."""
    n = len(sides[0])
    return sum(1 for j in range(n) if j == 0 or any(s[j] != s[j - 1] + 1 for s in sides))


@pytest.mark.parametrize("seed", range(6))
def test_run_counts_match_a_per_position_reference(seed):
    from kvtriton.plan.runs import id_runs, pair_run_count, pair_runs, run_count

    rng = np.random.default_rng(seed)
    for n in (0, 1, 2, 3, 17, 300):
        # runs of random lengths at random places, some adjacent (merging), some repeated
        src = np.cumsum(rng.choice([1, 1, 1, 2, -5, 0], size=n)).astype(np.int64) + 1000
        dst = np.cumsum(rng.choice([1, 1, 1, 3, -7], size=n)).astype(np.int64) + 1000
        assert run_count(src) == _runs_reference(src.tolist()) == id_runs(src)[0].size
        assert pair_run_count(src, dst) == _runs_reference(src.tolist(), dst.tolist()) == pair_runs(src, dst)[0].size


@pytest.mark.parametrize("seed", range(4))
def test_compact_request_drops_padded_positions_like_a_reference(seed):
    rng = np.random.default_rng(seed)
    n, nb = 64, 200
    src = rng.permutation(nb)[:n]
    dst = rng.permutation(nb)[:n]
    src[rng.random(n) < 0.2] = -1
    dst[rng.random(n) < 0.2] = -1
    want = [(s, d) for s, d in zip(src.tolist(), dst.tolist()) if s >= 0 and d >= 0]
    for args in ((src, dst), (src.tolist(), dst.tolist())):
        s, d = compact_request(*args, nb, nb)
        assert list(zip(s.tolist(), d.tolist())) == want and s.dtype == d.dtype == np.int64
    s, d = compact_request(np.abs(src), np.arange(n), nb, n)  # no -1 at all: every position, a copy
    assert s.tolist() == np.abs(src).tolist() and d.tolist() == list(range(n))
    with pytest.raises(PlanError, match="source block ids but"):
        compact_request(src, dst[:-1], nb, nb)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2), (2, 1)])
def test_pair_way_descriptors_count_what_the_ways_build(layout, p_tp, d_tp):
    """PairPlan.way_descriptors (counts from geometry found once per pair, runs counted per
    request) equals the descriptors each way builds for random ids: tile_runs for the one-sided
    ways, slice_runs for DIRECT_SLICE, one per chunk STAGED; with chunks, the free function's count."""
    from helpers.specs import gqa_specs

    from kvtriton.plan import Way, slice_runs, tile_runs, way_descriptors
    from kvtriton.plan.types import Layout

    lay = Layout[layout]
    dst, src = gqa_specs(3, 8, 64, 0, d_tp, 16, 64, lay), gqa_specs(3, 8, 64, 0, p_tp, 16, 64, lay)
    plan = build_plan(0, d_tp, dst, p_tp, src)
    assert plan.staged
    rng = np.random.default_rng(7)
    for read in plan.staged:
        pair = PairPlan(plan, read.src_rank, src, dst)
        for n in (1, 5, 40):
            s = rng.permutation(64)[:n]
            t = np.sort(rng.permutation(64)[:n]) if n > 5 else rng.permutation(64)[:n]  # runs on one side
            built = {Way.STAGED: 1, Way.READ_UNPACK: len(tile_runs(read, src, s, Way.READ_UNPACK)),
                     Way.PACK_PLACE: len(tile_runs(read, dst, t, Way.PACK_PLACE))}
            if Way.DIRECT_SLICE in read.ways:
                built[Way.DIRECT_SLICE] = len(slice_runs(read, src, dst, s, t))
            for way, want in built.items():
                assert pair.way_descriptors(way, s, t) == want, (way, n)
                for chunks in (2, 3):
                    assert pair.way_descriptors(way, s, t, chunks) == way_descriptors(read, way, src, dst, s, t, chunks)


def test_compact_request_converts_lists_as_numpy_does():
    """Engines hand lists of ints (converted item by item); any other list keeps numpy's rules:
    nested lists flatten, numpy ints and bools are ints, an int past int64 is refused."""
    assert [a.tolist() for a in compact_request([[0, 1], [2, 3]], [[4, 5], [6, 7]], 8, 8)] == [[0, 1, 2, 3],
                                                                                                [4, 5, 6, 7]]
    assert [a.tolist() for a in compact_request([np.int64(3), True, -1], [0, 1, 2], 8, 8)] == [[3, 1], [0, 1]]
    with pytest.raises(OverflowError):
        compact_request([1 << 70], [0], 8, 8)
    with pytest.raises(PlanError, match="source block id 9 at position 1"):
        compact_request([0, 9], [0, 1], 8, 8)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2), (2, 1)])
def test_pair_choose_way_remembered_per_key_matches_the_choice_over_ids(layout, p_tp, d_tp):
    """PairPlan.choose_way remembers its choice per (blocks, chunks, packed, descriptor counts)
    and takes the request's run counts from one RunCounts shared by its pairs: it picks what
    the free choose_way picks (geometry and runs found on every call) for random, run-heavy and
    repeated ids, chunk counts, offered payloads and cost models favouring each way."""
    from helpers.specs import gqa_specs

    from kvtriton.plan import CostModel, Way, choose_way
    from kvtriton.plan.pair import RunCounts
    from kvtriton.plan.types import Layout

    lay = Layout[layout]
    dst, src = gqa_specs(3, 8, 64, 0, d_tp, 16, 64, lay), gqa_specs(3, 8, 64, 0, p_tp, 16, 64, lay)
    plan = build_plan(0, d_tp, dst, p_tp, src)
    rng = np.random.default_rng(11)
    costs = [CostModel(), CostModel(desc_us=0.01), CostModel(desc_us=50.0),
             CostModel(desc_us=2.3, pack_gbps=0.5, unpack_gbps=0.5), CostModel(desc_us=0.3, pass_us=400.0)]
    seen: set[Way] = set()
    for cost in costs:
        pairs = [PairPlan(plan, read.src_rank, src, dst, cost) for read in plan.staged]
        for n in (1, 2, 7, 40, 64):
            for trial in range(8):
                s = rng.permutation(64)[:n] if trial % 3 else np.arange(n) + rng.integers(0, 64 - n + 1)
                t = rng.permutation(64)[:n] if trial % 2 else np.sort(rng.permutation(64)[:n])
                runs = RunCounts(s, t)
                for chunks in (1, 3):
                    for packed, cached in ((False, False), (True, False), (False, True)):
                        for pair, read in zip(pairs, plan.staged):
                            kw = dict(chunks=chunks, packed=packed, cache_offered=cached)
                            want = choose_way(read, src, dst, s, t, cost, **kw)
                            assert pair.choose_way(s, t, runs=runs, **kw) is want
                            assert pair.choose_way(s, t, **kw) is want
                            seen.add(want)
    assert len(seen) > 1  # the costs above make the choice differ


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_an_offer_of_the_source_cache_saves_the_pull_the_other_ways_pay(layout):
    """With the source's cache blocks offered, the ways reading them start at once and the others
    pull first (``CostModel.pull_us``): the choice is the cheapest way with the pull added to the
    ways not reading the cache. So it moves to a cache-reading way only where the way chosen
    without the offer was cheaper by less than a pull (the near-crossover requests, where the
    source's guess and ours part), and with a pull priced at nothing it never moves."""
    from helpers.specs import gqa_specs

    from kvtriton.plan import CostModel, choose_way
    from kvtriton.plan.types import Layout
    from kvtriton.plan.ways import way_descriptors

    lay = Layout[layout]
    dst, src = gqa_specs(2, 2, 64, 0, 1, 16, 128, lay), gqa_specs(2, 2, 64, 0, 2, 16, 128, lay)
    plan = build_plan(0, 1, dst, 2, src)
    read = plan.staged[0]
    rng = np.random.default_rng(5)
    moved = 0
    for cost in (CostModel(), CostModel(desc_us=4.0), CostModel(pull_us=3000.0)):
        free = CostModel(**{**cost.as_dict(), "pull_us": 1e-6})
        for n in range(1, 129):
            s, t = rng.permutation(128)[:n], rng.permutation(128)[:n]
            alone = choose_way(read, src, dst, s, t, cost)
            offered = choose_way(read, src, dst, s, t, cost, cache_offered=True)
            assert choose_way(read, src, dst, s, t, free, cache_offered=True) is alone
            nbytes, segments = read.payload_bytes(n), len(read.segments)

            def base(way, s=s, t=t, nbytes=nbytes, segments=segments, cost=cost):
                return cost.way_us(way, nbytes, way_descriptors(read, way, src, dst, s, t), segments=segments)

            def us(way, cost=cost):
                return base(way) + (0.0 if way.reads_source_cache else cost.pull_us)
            assert us(offered) == min(us(w) for w in read.ways)
            assert base(alone) == min(base(w) for w in read.ways)
            if offered is not alone:  # it was dearer by less than the pull it saves
                moved += 1
                assert offered.reads_source_cache and not alone.reads_source_cache
                assert 0 <= base(offered) - base(alone) <= cost.pull_us
            # a packed offer in hand: the cache is not read, whatever was offered besides
            assert not choose_way(read, src, dst, s, t, cost, packed=True, cache_offered=True).reads_source_cache
    assert moved  # some requests near the crossover take the offered cache rather than pull
