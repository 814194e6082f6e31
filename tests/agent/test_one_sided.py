"""One-sided staging (READ_UNPACK: no pack pass; PACK_PLACE: no unpack pass), byte for byte.

Planner: which payloads allow which way, forced modes and their typed refusals. Descriptor math
(:func:`kvtriton.plan.tile_runs`): the bytes its pieces move equal what the reference pack
writes (READ_UNPACK) or the reference unpack places (PACK_PLACE). Agents over real NIXL in one
process: P>D and D>P, NHD and HND, runs and random ids with -1 positions, a mixed SPLIT+REPLICATE
cache, the cost model's per-request choice, an early release; and a multi-process cluster. Every
transfer is checked against the global-head oracle with whole-cache snapshots (canaries)."""

import time

import numpy as np
import pytest
import torch

from kvtriton.errors import PlanError, RequestRejectedError
from kvtriton.ops import pack_reference, unpack_reference
from kvtriton.plan import CostModel, Route, Way, build_plan, choose_way, one_sided_descriptors, tile_runs
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination,
    load_source,
    make_global_kv,
    make_rank_regions,
    snapshot,
)

MODELS = [RegionModel.gqa("l0", 4, 16), RegionModel.mla("mla", 24, torch.float16),
          RegionModel.gqa("l1", 4, 8, torch.float32)]
SPLIT_ONLY = [RegionModel.gqa("l0", 4, 16), RegionModel.gqa("l1", 4, 8, torch.float32)]
RU, PP, ST, DS = Way.READ_UNPACK, Way.PACK_PLACE, Way.STAGED, Way.DIRECT_SLICE
# descriptors cheap against a repack pass over a run of blocks, dear against one over a 128-byte tile:
# the one-sided ways win over runs, DIRECT_SLICE (one descriptor per block; HND caches allow it) does
# not. Runs coalesce only where consecutive blocks are back to back (K and V in separate tensors):
# over joint K||V blocks READ_UNPACK posts DIRECT_SLICE's descriptors plus a pass, and never wins.
ONE_SIDED_COST = CostModel(desc_us=0.05)


def _specs(models, rank, tp, layout="NHD", pad=0, bs=4):
    regs = make_rank_regions(models, rank, tp, 8, bs, layout=layout, gen=torch.Generator().manual_seed(0),
                             device="meta" if not pad else "cpu", pad_blocks=pad)
    return [r.spec for r in regs]


# --------------------------------------------------------------------------- planner
@pytest.mark.parametrize("p_tp,d_tp,ways", [(4, 2, (ST, RU)), (2, 4, (ST, PP)), (4, 1, (ST, RU)), (1, 4, (ST, PP))])
def test_ways_follow_the_geometry(p_tp, d_tp, ways):
    for d in range(d_tp):
        plan = build_plan(d, d_tp, _specs(SPLIT_ONLY, d, d_tp), p_tp, _specs(SPLIT_ONLY, 0, p_tp))
        assert plan.modes == (ST, ST)
        assert {s.ways for s in plan.staged} == {ways}


def test_layouts_and_strides_decide_feasibility():
    # P4 -> D2 with 4 heads: one head per source rank, so its tile is its block in either layout,
    # and one head of an HND block is one range (direct_slice too)
    plan = build_plan(0, 2, _specs(SPLIT_ONLY, 0, 2, "HND"), 4, _specs(SPLIT_ONLY, 0, 4, "NHD"))
    assert all(s.ways == (ST, RU, DS) for s in plan.staged)
    # P2 -> D1: two heads per source rank, NHD source vs HND tiles: not the same bytes
    plan = build_plan(0, 1, _specs(SPLIT_ONLY, 0, 1, "HND"), 2, _specs(SPLIT_ONLY, 0, 2, "NHD"))
    assert all(s.ways == (ST,) for s in plan.staged)
    with pytest.raises(PlanError, match="read_unpack from source rank 0 is not possible: .*NHD"):
        build_plan(0, 1, _specs(SPLIT_ONLY, 0, 1, "HND"), 2, _specs(SPLIT_ONLY, 0, 2, "NHD"), modes="read_unpack")
    # padded (non-contiguous) blocks on the destination: no pack_place
    with pytest.raises(PlanError, match="pack_place .* not one contiguous range"):
        build_plan(0, 2, _specs(SPLIT_ONLY, 0, 2, pad=1), 1, _specs(SPLIT_ONLY, 0, 1), modes="pack_place")
    # heads split on both sides (P2 -> D3 style partial slices): neither
    with pytest.raises(PlanError, match="not the whole block"):
        build_plan(1, 4, _specs(SPLIT_ONLY, 1, 4), 2, _specs(SPLIT_ONLY, 0, 2), modes="read_unpack")


def test_forced_modes():
    d, p = _specs(MODELS, 0, 2), _specs(MODELS, 0, 4)
    plan = build_plan(0, 2, d, 4, p, modes="read_unpack")  # every region, MLA included (staged from replica 0)
    assert plan.modes == (RU, RU, RU) and all(s.ways == (RU,) for s in plan.staged)
    plan = build_plan(0, 2, d, 4, p, modes={"l0": "read_unpack", "l1": "read_unpack"})
    assert plan.modes == (RU, Route.DIRECT, RU) and all(s.ways == (RU,) for s in plan.staged)
    assert build_plan(0, 2, d, 4, p, modes="staged").staged[0].ways == (ST,)
    with pytest.raises(PlanError, match="force different modes"):
        build_plan(0, 2, d, 4, p, modes={"l0": "read_unpack", "l1": "staged"})
    with pytest.raises(PlanError, match="pack_place from source rank 0 is not possible"):
        build_plan(0, 2, d, 4, p, modes={"l0": "pack_place"})
    with pytest.raises(PlanError, match="expected one of"):
        build_plan(0, 2, d, 4, p, modes="one_sided")


def test_push_refuses_one_sided_modes():
    from kvtriton.agent import TransferAgent

    regs = make_rank_regions(SPLIT_ONLY, 0, 2, 8, 4, gen=torch.Generator().manual_seed(0))
    for m in ("read_unpack", {"l0": "pack_place"}):
        with pytest.raises(PlanError, match="only a pull"):
            TransferAgent("D", 0, 2, regs, mode="push", modes=m, transport=object())


def test_choice_follows_runs_and_model():
    d, p = _specs(SPLIT_ONLY, 0, 2), _specs(SPLIT_ONLY, 0, 4)
    read = build_plan(0, 2, d, 4, p).staged[0]
    runs, rand = np.arange(64), np.random.default_rng(0).permutation(64)
    assert one_sided_descriptors(read, p, runs) == len(read.segments)  # one run per segment
    assert one_sided_descriptors(read, p, rand) == 64 * len(read.segments)
    cheap, dear = CostModel(desc_us=0.01), CostModel(desc_us=1000.0)
    assert choose_way(read, p, d, runs, rand, cheap) is RU
    assert choose_way(read, p, d, runs, rand, dear) is ST
    assert choose_way(read, p, d, runs, rand, cheap, packed=True) is ST  # packed already: nothing to save
    pp = build_plan(0, 4, _specs(SPLIT_ONLY, 0, 4), 2, _specs(SPLIT_ONLY, 0, 2)).staged[0]
    assert choose_way(pp, p, _specs(SPLIT_ONLY, 0, 4), rand, runs, cheap) is PP


# --------------------------------------------------------------------------- descriptor math
def _apply(runs, cache_streams_bytes, staging, to_staging: bool):
    """Move the bytes ``runs`` describe (an independent loop over pieces, not the library's copy)."""
    for r, j, co, so, nb in zip(runs.region, runs.stream, runs.cache_offset, runs.staging_offset, runs.nbytes):
        cache = cache_streams_bytes[r][j]
        if to_staging:
            staging[so:so + nb] = cache[co:co + nb]
        else:
            cache[co:co + nb] = staging[so:so + nb]


def _flat(regions):
    """Each stream's bytes from its element 0 (the tensors the agent registers), as uint8 views."""
    out = []
    for r in regions:
        row = []
        for t in r.streams:
            st = t.untyped_storage()
            base = torch.empty(0, dtype=torch.uint8).set_(st)
            row.append(base[t.storage_offset() * t.element_size():])
        out.append(row)
    return out


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("ids", ["runs", "random"])
def test_tile_runs_match_the_reference_repack(layout, ids):
    gen = torch.Generator().manual_seed(7)
    n, nb = 12, 40
    rng = np.random.default_rng(3)
    src_ids = np.arange(5, 5 + n) if ids == "runs" else rng.permutation(nb)[:n]
    dst_ids = np.arange(20, 20 + n) if ids == "runs" else rng.permutation(nb)[:n]
    src_ids, dst_ids = src_ids.copy(), dst_ids.copy()
    src_ids[4], dst_ids[7] = 3, 2  # breaks in the runs
    for p_tp, d_tp, way in ((4, 2, RU), (2, 4, PP)):
        P = make_rank_regions(MODELS, 1, p_tp, nb, 4, layout=layout, storage="joint", gen=gen)
        D = make_rank_regions(MODELS, 1, d_tp, nb, 4, layout=layout, gen=gen)
        plan = build_plan(1, d_tp, [r.spec for r in D], p_tp, [r.spec for r in P], modes=way.value)
        read = plan.payload(1)
        offs = read.segment_offsets(n)
        packed = torch.randint(0, 256, (read.payload_bytes(n),), dtype=torch.uint8, generator=gen)
        if way is RU:  # pieces of the source's blocks == the packed payload
            pack_reference(P, read.segments, offs, src_ids, packed)
            got = torch.randint(0, 256, packed.shape, dtype=torch.uint8, generator=gen)
            runs = tile_runs(read, [r.spec for r in P], src_ids)
            _apply(runs, _flat(P), got, to_staging=True)
            assert len(runs) < n * len(read.segments) if ids == "runs" else True
            assert torch.equal(got, packed)
        else:  # pieces into the destination's blocks == what unpack places, and nothing else moves
            want = [[t.clone() for t in r.streams] for r in D]
            before = snapshot(D)
            runs = tile_runs(read, [r.spec for r in D], dst_ids)
            _apply(runs, _flat(D), packed, to_staging=False)
            got = snapshot(D)
            for r, streams in zip(D, want):
                for t, w in zip(r.streams, streams):
                    t.copy_(w)
            unpack_reference(D, read.segments, offs, dst_ids, packed)
            assert all(torch.equal(a, b) for x, y in zip(got, snapshot(D)) for a, b in zip(x, y))
            assert not all(torch.equal(a, b) for x, y in zip(got, before) for a, b in zip(x, y))


# --------------------------------------------------------------------------- agents over NIXL
nixl = pytest.importorskip("nixl")


def Pair(p_tp, d_tp, layout="NHD", d_layout=None, models=MODELS, seed=0, p_storage="joint", **kw):
    """The two-engine harness, both caches in ``layout`` unless ``d_layout`` says otherwise,
    chunks of 8 KiB and no eager packs unless ``kw`` says otherwise."""
    from kvtriton.testing.pair import EnginePair

    return EnginePair(p_tp, d_tp, models=models, seed=seed, p_layout=layout, d_layout=d_layout or layout,
                      p_storage=p_storage, **{"chunk_bytes": 8192, "eager_bytes": 0, **kw})


def _ids(kind, n, nb_src, nb_dst, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "runs":
        src, dst = np.arange(3, 3 + n), np.arange(40 - n, 40)
    else:
        src, dst = rng.permutation(nb_src)[:n], rng.permutation(nb_dst)[:n]
    src, dst = src.astype(np.int64), dst.astype(np.int64)
    src[1], dst[4] = -1, -1  # a position the source does not hold, one the destination has
    return src, dst


def _expect(src, dst):
    """Where the oracle expects position j: nowhere when either side skips it."""
    out = dst.copy()
    out[src < 0] = -1
    return out


@pytest.mark.nixl
@pytest.mark.parametrize("way,p_tp,d_tp", [("read_unpack", 4, 2), ("read_unpack", 2, 1), ("pack_place", 2, 4),
                                           ("pack_place", 1, 2)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("ids", ["runs", "random"])
def test_agents_move_exact_bytes(way, p_tp, d_tp, layout, ids):
    e = Pair(p_tp, d_tp, layout, modes={"l0": way, "l1": way})  # the MLA region moves DIRECT alongside
    try:
        src, dst = _ids(ids, 17, 64, 48)
        kv, before = e.start(src, dst)
        got = e.drive()
        for i, d in enumerate(e.da):
            assert got[i][0].ok, got[i][0].error
            check_destination(e.D[i], i, d_tp, kv, _expect(src, dst), before[i])
            assert d.stats["one_sided_descriptors"] > 0 and d.stats["staged_descriptors"] == 0
        packs = sum(a.stats["pack_launches"] for a in e.pa)
        assert (packs == 0) == (way == "read_unpack")  # read_unpack: no source packs anything
        freed = e.settle_freed(p_tp)
        assert len(freed) == p_tp and all(f.reason == "done" for f in freed)
    finally:
        e.close()


@pytest.mark.nixl
def test_read_unpack_across_layouts_with_one_head_per_source():
    """P4 -> D2 with 4 heads: each source rank's single head is its whole block in NHD as in HND."""
    e = Pair(4, 2, "NHD", d_layout="HND", models=SPLIT_ONLY, modes="read_unpack")
    try:
        src, dst = _ids("random", 20, 64, 48, seed=5)
        kv, before = e.start(src, dst)
        got = e.drive()
        for i in range(2):
            assert got[i][0].ok, got[i][0].error
            check_destination(e.D[i], i, 2, kv, _expect(src, dst), before[i])
    finally:
        e.close()


@pytest.mark.nixl
@pytest.mark.parametrize("forced", [True, False])
def test_read_unpack_offer_skips_the_pull(forced, monkeypatch):
    """A hold naming its consumer is offered for read_unpack (no pack, no slots): the decode takes
    the offer and READs at once, in its fetch() call, without a pull to the source process; a
    second fetch of another request with no offer pulls as usual. Bytes exact either way."""
    from kvtriton.protocol import wire

    pulls = []
    real = wire.decode_message
    monkeypatch.setattr(wire, "decode_message", lambda b: (lambda m: (pulls.append(m) if isinstance(
        m, wire.Pull) else None, m)[1])(real(b)))
    kw = dict(modes="read_unpack") if forced else dict(cost=ONE_SIDED_COST, chunk_bytes=64 << 10,
                                                         p_storage="separate")
    e = Pair(4, 2, "HND", models=SPLIT_ONLY, eager_bytes=32 << 10, **kw)
    try:
        src, dst = _ids("runs", 20, 64, 48)
        keep = (src >= 0) & (dst >= 0)
        src, dst = src[keep], dst[keep]  # an offer is of every held block, in order
        kv = make_global_kv(SPLIT_ONLY, src.size, 4, e.gen)
        for r in range(4):
            load_source(e.P[r], r, 4, kv, src)
        before = [snapshot(x) for x in e.D]
        for p in e.pa:
            p.hold("r", src, lease_s=30, consumer="D")
        deadline = time.monotonic() + 10
        while not all(sum("r" in o for o in d.debug_state()["offers"].values()) == 2 for d in e.da):  # both sources
            assert time.monotonic() < deadline, "no offers"
            for a in e.pa + e.da:
                a.progress()
        for d in e.da:
            d.fetch("r", "P", src, dst)
            # posted by fetch() itself, no progress() between (Part.start_offered): a step's READs go
            # back to back, before the Done of a fetch finished in the step's next progress()
            assert d.stats["one_sided_descriptors"] + d.stats["direct_descriptors"] > 0
        got = e.drive()  # the sources progress (UCX serves READs through them here) but get no pull
        for i, d in enumerate(e.da):
            assert got[i][0].ok, got[i][0].error
            check_destination(e.D[i], i, 2, kv, _expect(src, dst), before[i])
            # read from the source's cache: by read_unpack (one-sided pieces) or by head slices, which count
            # as zero-copy descriptors (DIRECT runs and slices are one kind of row)
            key = "direct_descriptors" if dict(got[i][0].ways).get("direct_slice") else "one_sided_descriptors"
            assert d.stats["offers_taken"] == 2 and d.stats[key] > 0
        assert not any(isinstance(m, wire.Pull) for m in pulls)
        assert len(e.settle_freed(4)) == 4
    finally:
        e.close()


@pytest.mark.nixl
@pytest.mark.parametrize("desc_us,expect", [(ONE_SIDED_COST.desc_us, "one_sided"), (1e4, "staged")])
def test_auto_choice_per_request(desc_us, expect):
    """No forced mode: the destination's cost model picks the way per request and source rank."""
    cost = CostModel(desc_us=desc_us)
    for p_tp, d_tp in ((4, 2), (2, 4)):
        e = Pair(p_tp, d_tp, "HND", models=SPLIT_ONLY, cost=cost, chunk_bytes=64 << 10, p_storage="separate")
        try:
            src, dst = _ids("runs", 24, 64, 48)
            kv, before = e.start(src, dst)
            got = e.drive()
            for i, d in enumerate(e.da):
                assert got[i][0].ok, got[i][0].error
                check_destination(e.D[i], i, d_tp, kv, _expect(src, dst), before[i])
                # no staging: read_unpack / pack_place pieces, or head slices (zero-copy descriptors, as DIRECT runs)
                key = "staged_descriptors" if expect == "staged" else \
                    "direct_descriptors" if dict(got[i][0].ways).get("direct_slice") else "one_sided_descriptors"
                kinds = ("one_sided_descriptors", "staged_descriptors", "direct_descriptors")
                assert d.stats[key] > 0 and sum(d.stats[k] for k in kinds) == d.stats[key]
        finally:
            e.close()


@pytest.mark.nixl
@pytest.mark.parametrize("way,p_tp,d_tp", [("read_unpack", 2, 1), ("pack_place", 1, 2)])
def test_release_mid_transfer_fails_typed(way, p_tp, d_tp):
    """The source's engine takes the blocks back while the decode reads them: the fetch fails with
    RequestRejectedError at once, every block outside undefined_blocks holds exact bytes, and no
    staging stays allocated."""
    e = Pair(p_tp, d_tp, "NHD", models=SPLIT_ONLY, modes=way, chunk_bytes=2048, inflight_chunks=1)
    try:
        src, dst = _ids("runs", 30, 64, 48)
        kv, before = e.start(src, dst)
        for _ in range(3):  # the pull is answered and the first pieces move
            for a in e.pa + e.da:
                a.progress()
        assert all(p.release("r") for p in e.pa)
        got = e.drive()
        for i in range(d_tp):
            res = got[i][0]
            assert not res.ok and isinstance(res.error, RequestRejectedError), res
            exp = _expect(src, dst)
            bad = np.isin(exp, np.asarray(res.undefined_blocks))
            exp_ok = np.where(bad, -1, exp)
            assert bad.any()
            # blocks the result calls defined are exact; the rest are left out of the comparison
            snap = [[t.clone() for t in row] for row in before[i]]
            cur = snapshot(e.D[i])
            undefined = torch.as_tensor(np.asarray(res.undefined_blocks, dtype=np.int64))
            for x, y in zip(snap, cur):
                for a, b in zip(x, y):
                    a[undefined] = b[undefined]
            check_destination(e.D[i], i, d_tp, kv, exp_ok, snap)
        assert all(f.reason == "released" for f in e.settle_freed(p_tp))
    finally:
        e.close()


@pytest.mark.nixl
@pytest.mark.parametrize("way,p_tp,d_tp", [("read_unpack", 4, 2), ("pack_place", 2, 4)])
def test_cluster_processes(way, p_tp, d_tp):
    """Separate processes over NIXL: every decode rank exact, canaries intact, holds freed."""
    from kvtriton.testing.cluster import Cluster, ClusterConfig

    cfg = ClusterConfig(models=MODELS, p_tp=p_tp, d_tp=d_tp, mode="pull", block_size=4, p_layout="HND",
                        d_layout="HND", staging_bytes=32 << 10, slot_bytes=1024, timeout_s=20,
                        modes={"l0": way, "l1": way})
    with Cluster(cfg, start_timeout_s=180) as c:  # room for child start-up on a loaded host (beds building)
        reqs = c.requests(4, 9)
        freed = c.transfer_exact(reqs)
        assert all(len(v) == len(reqs) for v in freed.values())


@pytest.mark.nixl
def test_forged_way_is_refused():
    """A pull naming a way the plan does not allow (staged forced: no read_unpack) is rejected
    before anything is held for it; a ready for a read_unpack transfer is a protocol error."""
    from kvtriton.protocol import wire
    from kvtriton.testing.seams import Wiretap

    e = Pair(4, 2, "HND", models=SPLIT_ONLY, modes="staged")
    try:
        src = np.arange(4)
        for p in e.pa:
            p.hold("r", src, lease_s=30)
        d, p0 = e.da[0], e.pa[0]
        plan = d.plan_for("P")
        tap = Wiretap(d)  # sees the reject before d handles it
        tap.send(p0, wire.Pull("x|1", "r", 0, tuple(src.tolist()), 1, plan.digest(), way="read_unpack"))
        deadline = time.monotonic() + 5
        while not (rejects := tap.seen(wire.Reject)):
            assert time.monotonic() < deadline, "no reject"
            for a in (p0, d):
                a.progress()
        assert "the plan allows ['staged']" in rejects[0].reason and not p0.debug_state()["serves"]
    finally:
        e.close()


@pytest.mark.nixl
def test_ready_for_read_unpack_fails_the_fetch():
    """A source announcing a packed chunk for a read_unpack transfer (nothing is packed for it)
    fails that fetch with ProtocolError; no block is reported defined."""
    from kvtriton.errors import ProtocolError
    from kvtriton.protocol import wire

    e = Pair(4, 2, "HND", models=SPLIT_ONLY, modes="read_unpack")
    try:
        src, dst = np.arange(6), np.arange(10, 16)
        for p in e.pa:
            p.hold("r", src, lease_s=30)
        d, p0 = e.da[0], e.pa[0]
        d.fetch("r", "P", src, dst)
        xid = next(x for x, part in d.debug_state()["parts"].items() if part["src_rank"] == 0)
        p0.transport.send_notif(d.transport.name, wire.Ready(xid, 0, 0, 1, 1024).encode())
        res = []
        deadline = time.monotonic() + 5
        while not res:
            assert time.monotonic() < deadline, "no result"
            for a in (p0, d):  # p0 flushes the forged ready before it answers the pull (one ordered stream)
                a.progress()
            res = d.results()
        assert not res[0].ok and isinstance(res[0].error, ProtocolError), res[0]
        assert sorted(res[0].undefined_blocks) == dst.tolist()
    finally:
        e.close()
