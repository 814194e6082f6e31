"""The measured cost model: the planner reads it (pure), the wire carries it (untrusted), both
engines plan with the decode rank's, and kvtriton.costmodel measures and caches it."""

import json
import math

import msgpack
import numpy as np
import pytest
import torch

from kvtriton.errors import ProtocolError
from kvtriton.plan import CostModel, Route, Way, build_plan
from kvtriton.protocol import wire
from kvtriton.regions import Region
from kvtriton.testing.oracle import RegionModel, check_destination

DIRECT_LOVER = CostModel(desc_us=0.001)  # descriptors nearly free: every feasible region DIRECT
STAGED_LOVER = CostModel(desc_us=1e6)  # descriptors ruinous: everything STAGED


def _specs(block_size=16, heads=2, tp=2):
    t = torch.empty(8, block_size, heads, 128, dtype=torch.bfloat16, device="meta")
    return [Region.attention("l0", t, t, block_size=block_size, total_heads=heads * tp).spec]


def test_build_plan_follows_the_injected_model():
    specs = _specs()  # 16 x 2 x 128 x 2 B = 8 KiB per descriptor, whole blocks, same layout
    assert build_plan(0, 2, specs, 2, specs, cost=DIRECT_LOVER).modes == (Route.DIRECT,)
    assert build_plan(0, 2, specs, 2, specs, cost=STAGED_LOVER).modes == (Route.STAGED,)
    # the crossover is what decides: just above / below 8 KiB per descriptor
    at = CostModel(desc_us=1.0, pack_gbps=1.0, unpack_gbps=1.0)  # crossover 500 B
    assert at.crossover_bytes() == pytest.approx(500.0)
    assert at.prefers_direct(500) and not at.prefers_direct(499)


def test_estimates_add_up():
    m = CostModel(desc_us=2.0, pack_gbps=4.0, unpack_gbps=4.0, read_gbps=8.0, write_gbps=2.0, pass_us=10.0,
                  segment_us=3.0)
    assert m.direct_us(8000, 10) == pytest.approx(10 * 2.0 + 1.0)
    # bytes: pack 2 + unpack 2 us; one chunk: two passes of 10 us; one descriptor 2 us; wire 1 us
    assert m.staged_us(8000) == pytest.approx(2.0 + 2.0 + 20.0 + 2.0 + 1.0)
    assert m.staged_us(8000, op="WRITE") == pytest.approx(2.0 + 2.0 + 20.0 + 2.0 + 4.0)
    # 4 segments, 3 chunks: every chunk's pass pays 10 + 4 x 3 us
    assert m.pass_fixed_us(4, 3) == pytest.approx(3 * 22.0)
    assert m.staged_us(8000, 3, segments=4) == pytest.approx(4.0 + 6 * 22.0 + 3 * 2.0 + 1.0)
    assert m.way_us(Way.READ_UNPACK, 8000, 5, segments=4, chunks=3) == pytest.approx(2.0 + 3 * 22.0 + 5 * 2.0 + 1.0)
    assert m.way_us(Way.PACK_PLACE, 8000, 5, segments=4) == pytest.approx(2.0 + 22.0 + 5 * 2.0 + 1.0)
    assert m.way_us(Way.DIRECT_SLICE, 8000, 5, segments=4, chunks=3) == pytest.approx(5 * 2.0 + 1.0)


def test_a_pass_fixed_cost_decides_a_small_request():
    """A megabyte in one pass against ~100 zero-copy slices (the Llama with an MLA draft on real
    engines, issue 21): priced at bytes / GB/s alone the pass wins, with its fixed cost the slices
    do; at 64 MB the bytes dominate and the pass wins again."""
    free = CostModel(desc_us=2.4, pack_gbps=4.0, unpack_gbps=4.0, pass_us=0.01, segment_us=0.01)
    paid = CostModel(desc_us=2.4, pack_gbps=4.0, unpack_gbps=4.0, pass_us=75.0, segment_us=12.0)
    small, big = 800_000, 64 << 20
    for m, slice_wins in ((free, False), (paid, True)):
        assert (m.way_us(Way.DIRECT_SLICE, small, 110) < m.way_us(Way.READ_UNPACK, small, 5, segments=4)) is slice_wins
    assert paid.way_us(Way.READ_UNPACK, big, 5, segments=4) < paid.way_us(Way.DIRECT_SLICE, big, 110 * 80)


def _metadata(cost):
    spec = _specs()[0]
    span = tuple(wire.stream_span(spec, j) for j in range(spec.num_streams))
    return wire.RankMetadata(engine="D", rank=0, tp=2, agent="a", agent_md=b"x", mem="DRAM", dev=0,
                             regions=(spec,), addrs=((4096, 1 << 20),), spans=(span,),
                             staging=wire.StagingInfo(1 << 30, 1024, 4, 2048), cost=cost)


def test_metadata_carries_the_cost_model():
    m = CostModel(desc_us=1.5, pack_gbps=3.0, unpack_gbps=4.0, read_gbps=5.0, write_gbps=6.0)
    got = wire.decode_metadata(wire.encode_metadata(_metadata(m)))
    assert got.cost == m and got.cost.as_dict() == m.as_dict()
    assert wire.decode_metadata(wire.encode_metadata(_metadata(None))).cost is None


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, 1e12, True, "2.3", None, [1.0]])
def test_metadata_rejects_a_bad_cost_model(bad):
    d = msgpack.unpackb(wire.encode_metadata(_metadata(CostModel())), raw=False)
    d["cost"]["desc_us"] = bad
    with pytest.raises(ProtocolError, match="cost.desc_us"):
        wire.decode_metadata(msgpack.packb(d, use_bin_type=True))
    d["cost"] = [1, 2]
    with pytest.raises(ProtocolError, match="cost"):
        wire.decode_metadata(msgpack.packb(d, use_bin_type=True))


@pytest.mark.nixl
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_source_plans_with_the_destinations_model(mode):
    """Decode prefers DIRECT, prefill's own model would say STAGED: the transfer must still agree
    (the source plans with the model the decode rank's metadata carries) and be byte-exact."""
    pytest.importorskip("nixl")
    from helpers.engines import Engines

    from kvtriton.agent import TransferAgent

    models = [RegionModel.gqa("l0", 4, 16)]
    e = Engines(1, 1, models=models, mode=mode, d_layout="NHD", p_storage="separate", connect=False,
                cost=DIRECT_LOVER)
    try:
        for p in e.pa:
            p.close()
        e.pa = [TransferAgent("P", 0, 1, e.P[0], staging_bytes=64 << 10, slot_bytes=1024, mode=mode,
                              timeout_s=5.0, impl="torch", cost=STAGED_LOVER)]
        e.da[0].add_remote(e.pa[0].metadata())
        e.pa[0].add_remote(e.da[0].metadata())
        assert e.da[0].plan_for("P").modes == (Route.DIRECT,)
        src, dst = np.array([9, 3, 4, 5, 40]), np.array([0, 7, 8, 2, 30])
        kv = e.request(src)
        e.pa[0].hold("r", src)
        e.da[0].fetch("r", "P", src, dst)
        got = e.drive(1)
        assert got[0][0].ok, got
        check_destination(e.D[0], 0, 1, kv, dst, e.before[0])
        assert e.da[0].stats["direct_descriptors"] + e.pa[0].stats["direct_descriptors"] > 0
        assert e.da[0].stats["staged_descriptors"] + e.pa[0].stats["staged_descriptors"] == 0
    finally:
        e.close()


@pytest.mark.nixl
def test_load_or_measure_caches_per_transport(tmp_path, monkeypatch):
    pytest.importorskip("nixl")
    from kvtriton import costmodel

    monkeypatch.setenv("KVTRITON_CACHE_DIR", str(tmp_path))
    path = costmodel.cache_path("cpu")
    assert path.parent.parent == tmp_path and costmodel.transport_key() in path.name
    m = costmodel.load_or_measure("cpu", impl="torch")
    assert m.source.startswith("measured") and path.exists()
    for v in m.as_dict().values():
        assert math.isfinite(v) and v > 0
    again = costmodel.load_or_measure("cpu", impl="torch")
    assert again == m and again.source.startswith("cached")
    path.write_text(json.dumps({"version": 1, "desc_us": -1}))  # a bad cache is measured over
    assert costmodel.load_or_measure("cpu", impl="torch").source.startswith("measured")
    assert json.loads(path.read_text())["desc_us"] > 0


# ------------------------------------------------------------------ the descriptor-cost fit (synthetic timings)
COUNTS = (1, 128, 512, 2048)


def _rounds(desc_us, base_ms, rng, jitter_ms=0.0):
    """One row per round: base (bandwidth, per round) + desc_us per descriptor + jitter."""
    return [[b + c * desc_us / 1e3 + rng.normal(0, jitter_ms) for c in COUNTS] for b in base_ms]


def test_fit_desc_us_ignores_bandwidth_that_changes_between_rounds():
    from kvtriton.costmodel import fit_desc_us

    rng = np.random.default_rng(0)
    # tcp here: the one-descriptor time is 3.7 ms on one connection state and 15 ms on another;
    # comparing medians taken at different times can even give a negative difference
    base = [3.7, 15.0, 3.7, 15.0, 3.8, 14.0, 3.6]
    got, spread = fit_desc_us(COUNTS, _rounds(1.4, base, rng))
    assert got == pytest.approx(1.4, rel=1e-9) and spread == pytest.approx(0, abs=1e-9)
    got, spread = fit_desc_us(COUNTS, _rounds(1.4, base, rng, jitter_ms=0.05))
    assert got == pytest.approx(1.4, abs=0.1) and 0 < spread < 0.5


def test_fit_desc_us_survives_a_disturbed_point_per_round_and_a_bad_round():
    from kvtriton.costmodel import fit_desc_us

    rng = np.random.default_rng(1)
    rounds = _rounds(2.0, [5.0] * 7, rng, jitter_ms=0.02)
    for r, row in enumerate(rounds):
        row[r % len(COUNTS)] += 8.0  # a load burst hits one transfer of every round
    rounds[3] = [x * 4 for x in rounds[3]]  # and one whole round runs 4x slow
    got, _ = fit_desc_us(COUNTS, rounds)
    assert got == pytest.approx(2.0, abs=0.3)


def test_fit_desc_us_reports_an_unresolved_slope_as_such():
    from kvtriton.costmodel import fit_desc_us

    rng = np.random.default_rng(2)
    got, spread = fit_desc_us(COUNTS, _rounds(0.0, [4.0] * 9, rng, jitter_ms=0.3))
    assert abs(got) < spread * 3 and spread > 0  # zero within its spread; the caller floors it
    with pytest.raises(ValueError, match="descriptor counts"):
        fit_desc_us([1], [[1.0]])
    with pytest.raises(ValueError, match="descriptor counts"):
        fit_desc_us(COUNTS, [[1.0, 2.0]])


def test_fit_pass_us_separates_the_call_from_its_segments():
    from kvtriton.costmodel import FIXED_SEGMENTS, fit_pass_us

    rng = np.random.default_rng(3)
    # 90 us a call, 12 us a segment, each round under its own load (x1 .. x1.3) plus jitter; one round 5x slow
    rounds = [[f * (90 + 12 * s) / 1e3 + rng.normal(0, 0.002) for s in FIXED_SEGMENTS]
              for f in rng.uniform(1.0, 1.3, 9)]
    rounds[4] = [x * 5 for x in rounds[4]]
    per_pass, per_segment = fit_pass_us(FIXED_SEGMENTS, rounds)
    assert per_pass == pytest.approx(90 * 1.15, rel=0.2) and per_segment == pytest.approx(12 * 1.15, rel=0.2)
    with pytest.raises(ValueError, match="two segment counts"):
        fit_pass_us([2, 2], [[1.0, 1.0]])
    with pytest.raises(ValueError, match="two segment counts"):
        fit_pass_us([2, 8], [[1.0]])


def test_metadata_from_an_older_peer_without_the_pass_cost_takes_the_default():
    d = msgpack.unpackb(wire.encode_metadata(_metadata(CostModel(desc_us=1.5, pull_us=900.0))), raw=False)
    assert wire.decode_metadata(msgpack.packb(d, use_bin_type=True)).cost.pull_us == 900.0
    del d["cost"]["pass_us"], d["cost"]["segment_us"], d["cost"]["pull_us"]
    got = wire.decode_metadata(msgpack.packb(d, use_bin_type=True)).cost
    assert got == CostModel(desc_us=1.5)  # every field the peer did not send: the default
    d["cost"]["segment_us"] = -3.0  # sent, it is checked like every other field
    with pytest.raises(ProtocolError, match="cost.segment_us"):
        wire.decode_metadata(msgpack.packb(d, use_bin_type=True))


def test_the_repack_probe_moves_cold_blocks(monkeypatch):
    """Issue 36: the repack probe's blocks are cold, as the descriptor probe's pieces are: each
    call moves the next of PROBE_SPAN disjoint block sets spread over caches PROBE_SPAN x the
    payload, so no call repacks blocks a recent call left in the last-level cache (a warm probe
    overstated the repack rate and the crossover sat above the 4 KiB slices direct reads won)."""
    from kvtriton import costmodel, ops

    nb, sets = costmodel.probe_id_sets(64, costmodel.PROBE_SPAN)
    assert sets.shape == (costmodel.PROBE_SPAN, 64) and np.unique(sets).size == sets.size
    assert sets.min() >= 0 and sets.max() < nb == 64 * costmodel.PROBE_SPAN + 8
    seen = {"pack": [], "unpack": []}

    def recorder(op):
        return lambda regions, segments, offs, ids, staging, impl: seen[op].append(
            (ids.numpy().copy(), regions[0].spec.num_blocks))

    monkeypatch.setattr(ops, "pack", recorder("pack"))
    monkeypatch.setattr(ops, "unpack", recorder("unpack"))
    pack, unpack, nbytes, _ = costmodel._repack_probe("cpu", "torch")
    for _ in range(costmodel.PROBE_SPAN + 1):
        pack()
        unpack()
    for op in ("pack", "unpack"):
        calls = [ids for ids, _ in seen[op]]
        span = costmodel.PROBE_SPAN
        assert all(np.intersect1d(calls[i], calls[j]).size == 0 for i in range(span) for j in range(i))
        assert np.array_equal(calls[span], calls[0])  # the sets cycle
        # the caches hold PROBE_SPAN x the payload: the blocks a call moves are a quarter of them
        assert seen[op][0][1] >= span * calls[0].size
    assert nbytes == costmodel.PROBE_BYTES


def test_a_cached_model_without_the_unmeasured_numbers_is_read_with_their_defaults(tmp_path):
    """``pull_us`` is not measured (``kvtriton.plan.cost.UNMEASURED``): a cache written before the
    model had it is read, not measured over; a measured number missing still is."""
    from kvtriton import costmodel

    path = tmp_path / "m.json"
    old = {k: v for k, v in CostModel(desc_us=1.7).as_dict().items() if k != "pull_us"}
    path.write_text(json.dumps(dict(version=costmodel.CACHE_VERSION, **old)))
    got = costmodel.read_cache(path)
    assert got == CostModel(desc_us=1.7) and got.source.startswith("cached")
    del old["segment_us"]
    path.write_text(json.dumps(dict(version=costmodel.CACHE_VERSION, **old)))
    assert costmodel.read_cache(path) is None
