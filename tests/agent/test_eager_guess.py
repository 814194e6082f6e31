"""Eager packing of holds that name no consumer (kvtriton.agent.source.eager, ``eager_guess``): packed
for the only connected engine without binding the hold to it; another engine that pulls first is
served lazily and the guess freed; a rogue cannot use the guess; a pull that skips a -1 prefix of
whole packed chunks is served from the pack. Every transfer is checked byte for byte against the
oracle on fresh random data, bytes outside its blocks included; staging is checked back to free."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from helpers.engines import MODELS, Engines  # the two-engine harness

from kvtriton.agent import TransferAgent
from kvtriton.errors import RequestRejectedError
from kvtriton.protocol import wire
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination,
    load_source,
    make_global_kv,
    make_rank_regions,
    snapshot,
)
from kvtriton.testing.rogue import PACKING_MODEL
from kvtriton.transport.progress import ENV

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

ONE = MODELS[:1]  # l0: 1 KiB a block at TP1, 512 B at TP2


@pytest.fixture
def made():
    out = []
    yield out
    for x in out:
        x.close()


def _free(agents, *engines) -> bool:
    pool_state = [a.debug_state()["staging"] for a in agents]
    return all(a.pool.free_slots == a.pool.num_slots and st["eager_slots"] == 0
               and not any(st["engine_slots"].get(e, 0) for e in engines) for a, st in zip(agents, pool_state))


def _other(e: Engines, made: list, name: str, seed: int):
    """A second decode engine (tp 1) connected to every prefill rank of ``e``."""
    regs = make_rank_regions(e.models, 0, 1, 48, e.block_size, layout="HND", gen=torch.Generator().manual_seed(seed))
    agent = TransferAgent(name, 0, 1, regs, staging_bytes=64 << 10, slot_bytes=1024, timeout_s=e.pa[0].timeout_s,
                          impl="torch")
    made.append(agent)
    for p in e.pa:
        agent.add_remote(p.metadata())
        p.add_remote(agent.metadata())
    return agent, regs


def _drive(agents, want, timeout_s=20.0):
    import time

    got, end = [], time.monotonic() + timeout_s
    while len(got) < want:
        assert time.monotonic() < end, "no result in time"
        for a in agents:
            a.progress()
        for a in agents:
            got += a.results()
    return got


def _settle(agents, seconds, poll=()):
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for a in agents:
            a.progress()
        for a in poll:  # a rogue's transport: driven (UCX needs it), its inbox dropped
            a.transport.poll_notifs()


@pytest.mark.parametrize("offer_seen", [True, False])
@pytest.mark.parametrize("p_tp,d_tp,models", [(1, 2, ONE), (2, 1, MODELS), (1, 1, ONE)])
def test_an_unnamed_hold_is_packed_for_the_only_engine_and_taken_byte_exact(made, p_tp, d_tp, models, offer_seen):
    e = Engines(p_tp, d_tp, models=models, p_blocks=64, d_blocks=64)
    made.append(e)
    rng = np.random.default_rng(11)
    src, dst = rng.permutation(64)[:6], rng.permutation(64)[:6]
    kv = e.request(src)
    for p in e.pa:
        p.hold("r", src)  # no consumer: D is the only engine connected
        p.progress()
        assert p.packed_ahead("r") > 0 and p.stats["eager_guessed"] == 1
        assert p.debug_state()["holds"]["r"]["consumer"] is None  # the guess binds nothing
    if offer_seen:  # until every offer sent has arrived (a fixed wait lost the race on a loaded CI host)
        e.settle_offers("r")
    for d in e.da:
        d.fetch("r", "P", src, dst)
    got = e.drive(1)
    assert all(v[0].ok for v in got.values()), got
    for r in range(d_tp):
        check_destination(e.D[r], r, d_tp, kv, dst, e.before[r])
    e.settle_done()
    assert sum(p.stats["eager_hits"] for p in e.pa) == sum(len(p.debug_state()["plans"]) for p in e.pa) > 0
    assert sum(p.stats["eager_misses"] for p in e.pa) == 0
    offers = sum(p.stats["eager_offers"] for p in e.pa)
    assert sum(d.stats["offers_taken"] for d in e.da) == (offers if offer_seen else 0)
    assert offers > 0 or models is MODELS
    assert all([(f.req_id, f.reason) for f in p.freed()] == [("r", "done")] for p in e.pa)
    assert _free(e.agents, "D")


@pytest.mark.parametrize("guessed_took_offer", [False, True])
def test_another_engine_pulling_first_is_served_lazily_and_the_guess_is_freed(made, guessed_took_offer):
    e = Engines(1, 1, models=ONE, p_blocks=64, d_blocks=48, timeout_s=0.5)
    made.append(e)
    p, d = e.pa[0], e.da[0]
    src = np.array([9, 3, 4, 5, 40, 41, 17, 2])
    kv = e.request(src)
    p.hold("r", src)
    e.settle_offers("r")  # packed for D (the only engine) and offered to it
    assert p.stats["eager_offers"] == 1 and d.has_offer("P", "r")
    x, x_regs = _other(e, made, "E", seed=5)  # a second engine connects, then pulls first
    x_before = snapshot(x_regs)
    d_dst, x_dst = np.arange(8) + 10, np.arange(8) + 30
    if guessed_took_offer:  # D takes the offer (no pull sent), but E's pull reaches P first
        d.fetch("r", "P", src, d_dst)
        assert d.stats["offers_taken"] == 1
    x.fetch("r", "P", src, x_dst)
    got = _drive([p, x], 1)
    assert got[0].ok, got
    check_destination(x_regs, 0, 1, kv, x_dst, x_before)
    assert p.debug_state()["holds"]["r"]["consumer"] == "E" and p.stats["eager_misses"] >= 1
    st = p.debug_state()
    assert not st["offered"] and st["staging"]["eager_slots"] == 0
    if not guessed_took_offer:  # the withdrawn offer is dropped; D's pull is refused (the hold is E's)
        _settle([p, d, x], 0.1)
        assert not d.has_offer("P", "r")
        d.fetch("r", "P", src, d_dst)
    res = _drive([p, d, x], 1)[0]
    assert not res.ok and isinstance(res.error, RequestRejectedError), res
    if guessed_took_offer:  # D may have READ the offer before the reject: undefined_blocks say which
        assert set(res.undefined_blocks) <= set(d_dst.tolist())
    else:  # D wrote nothing
        check_destination(e.D[0], 0, 1, kv, np.full(8, -1), e.before[0])
    _settle([p, d, x], 0.8)  # withdrawn offer slots are quarantined for timeout_s
    assert _free([p], "D", "E") and [(f.req_id, f.reason) for f in p.freed()] == [("r", "done")]


def test_a_rogue_cannot_use_the_guess():
    # R (a rogue: genuine handshake, never reads or acks) is the only engine when the holds are
    # placed: they are packed and offered to it, within its share and eager_bytes, and bind nothing
    regs = [make_rank_regions(ONE, 0, 1, 64, 4, gen=torch.Generator().manual_seed(s)) for s in range(3)]
    kw = dict(staging_bytes=32 << 10, slot_bytes=1024, timeout_s=0.5, impl="torch", cost=PACKING_MODEL)
    p, r, d = (TransferAgent(n, 0, 1, g, **kw) for n, g in zip("PRD", regs))
    try:
        r.add_remote(p.metadata())
        p.add_remote(r.metadata())
        src = np.arange(8)
        kv = make_global_kv(ONE, 8, 4, torch.Generator().manual_seed(21))
        load_source(regs[0], 0, 1, kv, src)
        p_before = snapshot(regs[0])
        for i in range(6):  # 8 KiB each, eager budget 16 KiB: two packed and offered, the rest lazy
            p.hold(f"h{i}", src)
        p.progress()
        st = p.debug_state()
        pool_state = st["staging"]
        reserve = st["settings"]["inflight_chunks"] * p.pool.slots_for(st["settings"]["chunk_bytes"])
        assert p.stats["eager_guessed"] == 2 and pool_state["eager_slots"] <= pool_state["eager_budget_slots"]
        assert pool_state["engine_slots"].get("R", 0) <= pool_state["share"] - reserve
        assert all(h["consumer"] is None for h in st["holds"].values())
        # D connects: two engines, so nothing more is guessed
        d.add_remote(p.metadata())
        p.add_remote(d.metadata())
        p.hold("late", src)
        p.progress()
        assert p.packed_ahead("late") == 0 and p.stats["eager_guessed"] == 2
        # D pulls a hold whose pack was offered to R: D is served, R's offer is withdrawn
        dst = np.arange(8) + 20
        before = snapshot(regs[2])
        d.fetch("h0", "P", src, dst)
        got = _drive([p, d], 1)
        assert got[0].ok, got
        check_destination(regs[2], 0, 1, kv, dst, before)
        st = p.debug_state()
        assert st["holds"]["h0"]["consumer"] == "D" and ("h0" not in st["offered"])
        # D pulls h1 (also offered to R): P binds it to D and withdraws R's offer; then R acks that
        # offer and reports h1 done: neither binds, frees or counts
        d.fetch("h1", "P", src, dst)
        deadline = time.monotonic() + 5.0  # D's pull handled (D itself not progressed yet: no done);
        while p.debug_state()["holds"]["h1"]["consumer"] is None and time.monotonic() < deadline:
            p.progress()  # with NIXL's progress thread the pull lands a moment after fetch() returns
        st = p.debug_state()
        assert st["holds"]["h1"]["consumer"] == "D" and not st["offered"]
        bad = p.stats["bad_messages"]
        r.transport.send_notif(p.transport.name, wire.Ack("h1|P:0>0!", 0).encode())
        r.transport.send_notif(p.transport.name, wire.Done("h1", 0, 1).encode())
        _settle([p], 0.2, poll=[r])
        assert p.stats["bad_messages"] >= bad + 2 and p.stats["refused"] >= 1
        assert p.debug_state()["holds"]["h1"]["consumer"] == "D"
        got = _drive([p, d], 1)
        assert got[0].ok, got
        check_destination(regs[2], 0, 1, kv, dst, before)
        for i in range(6):
            p.release(f"h{i}")
        p.release("late")
        _settle([p, d], 0.8, poll=[r])
        assert _free([p], "R", "D")
        assert all(torch.equal(a, b) for ra, rb in zip(snapshot(regs[0]), p_before) for a, b in zip(ra, rb))
    finally:
        for a in (p, r, d):
            a.close()


@pytest.mark.parametrize("offer_seen", [True, False])
@pytest.mark.parametrize("skip,hit", [(4, True), (8, True), (2, False), (0, True)])
def test_a_pull_skipping_a_prefix_of_whole_chunks_is_served_from_the_pack(made, skip, hit, offer_seen):
    # 1 KiB blocks, 4 KiB chunks: 10 held blocks are packed as [0,4) [4,8) [8,10)
    e = Engines(1, 1, models=ONE, p_blocks=64, d_blocks=64, chunk_bytes=4 << 10, timeout_s=0.5)
    made.append(e)
    p, d = e.pa[0], e.da[0]
    rng = np.random.default_rng(skip + 7)
    src, dst = rng.permutation(64)[:10], rng.permutation(64)[:10]
    kv = e.request(src)
    p.hold("r", src)
    p.progress()
    assert p.packed_ahead("r") == 3
    if offer_seen:
        e.settle_offers("r")
    dst_prefix = dst.copy()
    dst_prefix[:skip] = -1  # the decode has these blocks already (prefix cache)
    d.fetch("r", "P", src, dst_prefix)
    res = e.drive(1)[0][0]
    assert res.ok, res
    check_destination(e.D[0], 0, 1, kv, dst_prefix, e.before[0])  # the prefix blocks untouched
    e.settle_done()
    assert p.stats["eager_hits"] == int(hit) and p.stats["eager_misses"] == int(not hit)
    assert d.stats["offers_taken"] == int(offer_seen and skip == 0)
    # the chunks before the suffix were offered, but the pull came from the offered rank itself:
    # it is not reading them, so they are back at once (no quarantine)
    assert _free(e.agents, "D") and not p.debug_state()["serves"]


def test_a_renew_keeps_an_unbound_offered_hold_only_from_the_offered_peer(made):
    # D holds a guessed offer (it may be READing it, not acked yet): its renew keeps the lease and
    # binds nothing; E, never offered it, is refused and cannot keep it alive
    e = Engines(1, 1, models=ONE, p_blocks=64, d_blocks=48)
    made.append(e)
    p, d = e.pa[0], e.da[0]
    src = np.array([5, 1, 7, 30])
    kv = e.request(src)
    p.hold("r", src, lease_s=0.4)
    e.settle_offers("r")
    assert p.stats["eager_offers"] == 1 and d.has_offer("P", "r")
    x, x_regs = _other(e, made, "E", seed=9)
    for _ in range(8):  # 0.8 s: twice the lease, renewed by D every 0.1 s
        d.transport.send_notif(p.transport.name, wire.Renew("r", 0).encode())
        x.transport.send_notif(p.transport.name, wire.Renew("r", 0).encode())
        _settle([p, d, x], 0.1)
    hold = p.debug_state()["holds"].get("r")
    assert hold is not None and hold["consumer"] is None and p.stats["refused"] >= 8
    dst = np.array([3, 9, 11, 40])
    d.fetch("r", "P", src, dst)
    res = _drive([p, d, x], 1)[0]
    assert res.ok, res
    check_destination(e.D[0], 0, 1, kv, dst, e.before[0])
    _settle([p, d, x], 0.1)  # D's done
    assert d.stats["offers_taken"] == 1 and [(f.req_id, f.reason) for f in p.freed()] == [("r", "done")]


@pytest.mark.parametrize("whole", [True, False])
def test_a_prefix_pull_with_direct_runs_takes_the_offered_suffix_and_reads_the_runs(made, whole):
    # MLA is read DIRECT from the source, the GQA layers staged: the offer confirms the runs; a
    # fetch skipping a prefix pulls instead, takes the packed suffix (whole chunks) and reads the runs
    e = Engines(1, 2, models=MODELS, p_blocks=64, d_blocks=64, chunk_bytes=4 << 10, timeout_s=0.5)
    made.append(e)
    p = e.pa[0]
    rng = np.random.default_rng(5 + whole)
    src, dsts = rng.permutation(64)[:12], [rng.permutation(64)[:12] for _ in e.da]
    kv = e.request(src)
    p.hold("r", src)
    e.settle_offers("r")
    packs = [s for s in p.debug_state()["serves"] if s["offered"]]
    assert len(packs) == 2 and all(s["reads_cache"] for s in packs)  # both ranks offered, runs confirmed
    bpc = {s["rank"]: s["blocks_per_chunk"] for s in packs}
    skip = min(bpc.values()) if whole else 1
    assert all(b < 12 for b in bpc.values())
    for d, dst in zip(e.da, dsts):
        dst[:skip] = -1
        d.fetch("r", "P", src, dst)
    got = e.drive(1)
    assert all(v[0].ok for v in got.values()), got
    for r in range(2):
        check_destination(e.D[r], r, 2, kv, dsts[r], e.before[r])
    e.settle(0.1)
    hits = sum(1 for r in range(2) if whole and skip % bpc[r] == 0)
    assert hits >= 1 or not whole
    assert p.stats["eager_hits"] == hits and p.stats["eager_misses"] == 2 - hits
    assert sum(d.stats["offers_taken"] for d in e.da) == 0
    e.settle(0.8)
    assert _free(e.agents, "D") and not p.debug_state()["serves"]


MLA = [RegionModel.mla("mla", 24, torch.float16)]  # REPLICATE: DIRECT runs only, nothing to pack


def _wait_offer(d, req: str, timeout_s: float = 5.0) -> None:
    """Progress the decode alone until it holds the offer of ``req`` (bounded)."""
    end = time.monotonic() + timeout_s
    while not d.has_offer("P", req):
        assert time.monotonic() < end, f"no offer of {req} reached the decode"
        d.progress()


def test_an_unnamed_cache_read_hold_is_offered_from_hold_itself_and_read_with_no_pull(made, monkeypatch):
    # the plan reads the prefill's cache (DIRECT runs): hold() itself offers the blocks to the only
    # engine connected (no progress() on the prefill before the decode has the offer: NIXL's thread
    # moves it, as in serving), and the fetch READs them with no pull
    monkeypatch.setenv(ENV, "1")
    e = Engines(1, 1, models=MLA, p_blocks=64, d_blocks=48)
    made.append(e)
    p, d = e.pa[0], e.da[0]
    src, dst = np.array([9, 3, 4, 5, 40, 41, 17, 2]), np.arange(8) + 10
    kv = e.request(src)
    p.hold("r", src)
    assert p.stats["eager_offers"] == 1 and p.stats["eager_guessed"] == 1 and p.stats["eager_chunks"] == 0
    _wait_offer(d, "r")
    d.fetch("r", "P", src, dst)
    res = e.drive(1)[0][0]
    assert res.ok, res
    check_destination(e.D[0], 0, 1, kv, dst, e.before[0])
    e.settle_done()
    assert d.stats["offers_taken"] == 1 and p.stats["eager_offer_reads"] == 1
    assert p.stats["eager_offer_pulls"] == 0 and p.stats["eager_misses"] == 0
    assert [(f.req_id, f.reason) for f in p.freed()] == [("r", "done")]


@pytest.mark.parametrize("guessed_took_offer", [False, True])
def test_a_withdrawn_guessed_cache_offer_keeps_the_blocks_for_timeout_s(made, guessed_took_offer, monkeypatch):
    # the blocks were offered to D (the guess); E pulls first and binds the hold: D's offer is
    # withdrawn, but D may be READing the cache already, so after E is done the hold's end is
    # reported only timeout_s after the withdrawal (the engine would reuse the blocks under D's READ)
    monkeypatch.setenv(ENV, "1")
    e = Engines(1, 1, models=MLA, p_blocks=64, d_blocks=48, timeout_s=0.6)
    made.append(e)
    p, d = e.pa[0], e.da[0]
    src = np.array([9, 3, 4, 5, 40, 41, 17, 2])
    kv = e.request(src)
    p.hold("r", src)
    _wait_offer(d, "r")
    x, x_regs = _other(e, made, "E", seed=5)
    x_before = snapshot(x_regs)
    d_dst, x_dst = np.arange(8) + 10, np.arange(8) + 30
    if guessed_took_offer:  # D READs the offered blocks (no pull); E's pull reaches P first
        d.fetch("r", "P", src, d_dst)
        assert d.stats["offers_taken"] == 1
    x.fetch("r", "P", src, x_dst)
    withdrawn = time.monotonic()
    got = _drive([p, x], 1)
    assert got[0].ok, got
    check_destination(x_regs, 0, 1, kv, x_dst, x_before)
    _settle([p, x], 0.1)  # E's done reached P: the hold ended
    st = p.debug_state()
    assert "r" not in st["holds"] and not st["offered"] and p.stats["eager_misses"] >= 1
    assert p.freed() == []  # D may still be reading: the blocks are not the engine's yet
    if guessed_took_offer:  # D read them before or after the reject: exact, or failed naming its blocks
        res = _drive([p, d, x], 1)[0]
        if res.ok:
            check_destination(e.D[0], 0, 1, kv, d_dst, e.before[0])
        else:
            assert isinstance(res.error, RequestRejectedError) and set(res.undefined_blocks) <= set(d_dst.tolist())
    freed: list = []
    end = time.monotonic() + 5.0
    while not freed and time.monotonic() < end:
        _settle([p, d, x], 0.05)
        freed = p.freed()
    assert [(f.req_id, f.reason) for f in freed] == [("r", "done")]
    assert time.monotonic() - withdrawn >= 0.6


#: a cost model near the pack_place / direct_slice crossover for GQA_4 at P1->D2 (block 4): which is
#: cheaper turns on the destination's runs of ids, which the source's guess does not know
NEAR = dict(desc_us=1.0, pass_us=20.0, segment_us=0.01, unpack_gbps=10.0)
GQA_4 = [RegionModel.gqa("l0", 4, 16), RegionModel.gqa("l1", 4, 16)]


@pytest.mark.parametrize("pull_us", [500.0, 1e-3])
def test_a_fetch_takes_the_offered_cache_when_its_own_choice_is_dearer_by_less_than_a_pull(made, pull_us):
    # the prefill's ids are scattered: guessing the decode's as its own, it offers its cache
    # (direct_slice). The decode's ids run on, so pack_place (the source packs, we place it
    # in runs) is cheaper by less than a pull: with the offer in hand the decode reads the
    # cache now (no pull); with a pull priced at nothing (the control) it pulls for pack_place
    from kvtriton.plan import CostModel, build_plan, choose_way

    cost = CostModel(**NEAR, pull_us=pull_us)
    e = Engines(1, 2, models=GQA_4, p_blocks=64, d_blocks=48, p_layout="HND", p_storage="separate",
                cost=cost)
    made.append(e)
    p = e.pa[0]
    src, dst = np.random.default_rng(0).permutation(64)[:8], np.arange(8) + 5
    src_specs, dst_specs = [r.spec for r in e.P[0]], [r.spec for r in e.D[0]]
    read = build_plan(0, 2, dst_specs, 1, src_specs).staged[0]
    assert choose_way(read, src_specs, dst_specs, src, src, cost).value == "direct_slice"  # the source's guess
    assert choose_way(read, src_specs, dst_specs, src, dst, cost).value == "pack_place"  # ours, alone
    kv = e.request(src)
    p.hold("r", src, consumer="D")
    e.settle_offers("r")
    assert p.stats["eager_offers"] == 2 and p.stats["eager_chunks"] == 0  # the cache offered, nothing packed
    for d in e.da:
        assert d.has_offer("P", "r")
        d.fetch("r", "P", src, dst)
    got = e.drive(1)
    assert all(v[0].ok for v in got.values()), got
    for r in range(2):
        check_destination(e.D[r], r, 2, kv, dst, e.before[r])
    e.settle(0.2)
    ways = {w for v in got.values() for w, _ in v[0].ways}
    if pull_us > 1:  # the offer taken: the cache read at once, nothing asked of the prefill
        assert ways == {"direct_slice"} and sum(d.stats["offers_taken"] for d in e.da) == 2
        assert p.stats["eager_offer_pulls"] == 0 and p.stats["eager_misses"] == 0
    else:  # the control: the decode's own choice, a pull the prefill answers by packing
        assert ways == {"pack_place"} and sum(d.stats["offers_taken"] for d in e.da) == 0
    assert [(f.req_id, f.reason) for f in p.freed()] == [("r", "done")]
    assert _free(e.agents, "D")


@pytest.mark.parametrize("consumer", [None, "D"])
def test_a_hold_released_while_its_offered_cache_may_be_read_is_freed_only_after_timeout_s(made, consumer,
                                                                                          monkeypatch):
    # the decode took the offer of the prefill's cache blocks and READs them: nothing tells the
    # prefill until its Done. The prefill's engine releases the request meanwhile (an abort): its
    # blocks must not be reported free before timeout_s, or the engine reuses them under the READ
    # (its keep was set after the hold had ended, so it kept nothing: freed at once)
    monkeypatch.setenv(ENV, "1")
    e = Engines(1, 1, models=MLA, p_blocks=64, d_blocks=48, timeout_s=0.6)
    made.append(e)
    p, d = e.pa[0], e.da[0]
    src, dst = np.array([9, 3, 4, 5, 40, 41, 17, 2]), np.arange(8) + 10
    kv = e.request(src)
    p.hold("r", src, consumer=consumer)
    _wait_offer(d, "r")
    d.fetch("r", "P", src, dst)
    assert d.stats["offers_taken"] == 1
    released = time.monotonic()
    assert p.release("r")
    assert p.freed() == []  # the decode may be reading the blocks: not the engine's yet
    res = _drive([d], 1)[0]  # the READ landed: exact, or failed naming its blocks
    if res.ok:
        check_destination(e.D[0], 0, 1, kv, dst, e.before[0])
    else:
        assert isinstance(res.error, RequestRejectedError) and set(res.undefined_blocks) <= set(dst.tolist())
    freed: list = []
    end = time.monotonic() + 5.0
    while not freed and time.monotonic() < end:
        _settle([p, d], 0.05)
        freed = p.freed()
    assert [(f.req_id, f.reason) for f in freed] == [("r", "released")]
    assert time.monotonic() - released >= 0.6
