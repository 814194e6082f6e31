"""Eager packing (kvtriton.agent.source.eager): a hold that names its consumer is packed before the pull,
the pull is answered from the pack when it asks exactly that, and otherwise served lazily; eager
staging is bounded, freed with the hold, given up for real pulls, and reserved for the consumer.
Every transfer is checked byte for byte against the oracle, bytes outside its blocks included."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.engines import MODELS  # the engines fixture in conftest.py builds its harness

from kvtriton.testing.oracle import RegionModel, check_destination
from kvtriton.testing.rogue import RogueRig

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

ONE = MODELS[:1]  # l0: 1 KiB a block at TP1, 512 B at TP2


def _all_free(e) -> bool:
    pool_state = [a.debug_state()["staging"] for a in e.agents]
    return all(a.pool.free_slots == a.pool.num_slots and not st["engine_slots"].get("D", 0)
               and st["eager_slots"] == 0 for a, st in zip(e.agents, pool_state))


@pytest.mark.parametrize("offer_seen", [True, False])
@pytest.mark.parametrize("p_tp,d_tp,staging,nblocks,models", [
    (1, 2, 64 << 10, 6, ONE),     # every chunk packed ahead (and offered), for both decode ranks
    (1, 2, 64 << 10, 6, MODELS),  # with MLA read directly: offered, the offer confirms the DIRECT runs
    (2, 1, 64 << 10, 6, MODELS),  # the decode reads both prefill ranks
    (1, 1, 8 << 10, 24, ONE),     # larger than the eager budget: the first chunks ahead, the rest lazily
])
def test_a_pull_is_answered_from_the_eager_pack_byte_exact(engines, p_tp, d_tp, staging, nblocks, models,
                                                           offer_seen):
    # offer_seen: the decode has the source's offer when it fetches (it READs without a pull);
    # else its pull arrives first and is answered from the pack at once
    e = engines(p_tp, d_tp, staging_bytes=staging, p_blocks=64, d_blocks=64, models=models)
    rng = np.random.default_rng(3)
    src, dst = rng.permutation(64)[:nblocks], rng.permutation(64)[:nblocks]
    kv = e.request(src)
    for p in e.pa:
        p.hold("r", src, consumer="D")
        assert p.packed_ahead("r") == 0  # packed in the next progress(), not inside hold()
        p.progress()
        assert p.packed_ahead("r") > 0 and p.stats["eager_chunks"] == p.packed_ahead("r")
        pool_state = p.debug_state()["staging"]
        assert pool_state["eager_slots"] <= pool_state["eager_budget_slots"]
    if offer_seen:
        e.settle_offers("r")
    for d in e.da:
        d.fetch("r", "P", src, dst)
    got = e.drive(1)
    assert all(v[0].ok for v in got.values()), got
    for r in range(d_tp):
        check_destination(e.D[r], r, d_tp, kv, dst, e.before[r])
    e.settle_done()
    hits = sum(p.stats["eager_hits"] for p in e.pa)
    assert hits == sum(len(p.debug_state()["plans"]) for p in e.pa) and hits >= max(p_tp, d_tp)
    assert sum(p.stats["eager_misses"] for p in e.pa) == 0
    offers = sum(p.stats["eager_offers"] for p in e.pa)
    # offered: packs of every chunk (with DIRECT runs too: the offer confirms them)
    assert offers == (0 if staging == 8 << 10 else sum(
        1 for p in e.pa for plan in p.debug_state()["plans"] if plan["staged_from_me"]))
    assert offers > 0 or staging == 8 << 10
    assert sum(d.stats["offers_taken"] for d in e.da) == (offers if offer_seen else 0)
    assert all([(f.req_id, f.reason) for f in p.freed()] == [("r", "done")] for p in e.pa)
    assert _all_free(e)
    assert all(not d.debug_state()["parts"] for d in e.da)  # offered parts are forgotten too


@pytest.mark.parametrize("ask", ["subset", "reordered"])
def test_a_pull_that_does_not_match_the_pack_frees_it_and_is_served_lazily(engines, ask):
    e = engines(1, 1, models=ONE, timeout_s=0.5)
    src, dst = np.array([9, 3, 4, 5, 40, 41]), np.array([0, 7, 8, 2, 30, 31])
    kv = e.request(src)
    e.pa[0].hold("r", src, consumer="D")
    e.pa[0].progress()
    assert e.pa[0].packed_ahead("r") > 0
    if ask == "subset":
        keep = np.array([0, 2, 5])
        r_ids, d_ids, kv_want = src[keep], dst[keep], [[s[keep] for s in streams] for streams in kv]
    else:
        order = np.arange(6)[::-1].copy()
        r_ids, d_ids, kv_want = src[order], dst[order], [[s[order] for s in streams] for streams in kv]
    e.da[0].fetch("r", "P", r_ids, d_ids)
    res = e.drive(1)[0][0]
    assert res.ok, res
    check_destination(e.D[0], 0, 1, kv_want, d_ids, e.before[0])
    # the pack was offered (every chunk, no DIRECT runs): the decode declined it and pulled
    assert e.pa[0].stats["eager_offers"] == 1 and e.da[0].stats["offers_taken"] == 0
    assert e.pa[0].stats["eager_misses"] == 1 and e.pa[0].stats["eager_hits"] == 0
    assert e.pa[0].debug_state()["staging"]["eager_slots"] == 0 and not e.pa[0].debug_state()["offered"]
    e.settle(0.8)  # a withdrawn offer's slots are quarantined for timeout_s
    assert _all_free(e)


@pytest.mark.parametrize("how", ["release", "lease"])
def test_a_hold_that_ends_before_its_pull_frees_its_eager_slots(engines, how):
    e = engines(1, 1, models=ONE, timeout_s=0.3)
    p = e.pa[0]
    e.request(np.arange(8))
    p.hold("r", np.arange(8), consumer="D", lease_s=0.2)
    p.progress()
    assert p.packed_ahead("r") == 1 and p.pool.free_slots < p.pool.num_slots  # 8 KiB: one 16 KiB chunk
    if how == "release":
        assert p.release("r")
    else:
        e.settle(0.4)
    assert [f.reason for f in p.freed()] == ["released" if how == "release" else "lease_expired"]
    st = p.debug_state()
    assert p.packed_ahead("r") == 0 and st["staging"]["eager_slots"] == 0 and not st["serves"]
    # the pack had been offered to D:0 (announced, as by a ready): its slots are quarantined for
    # timeout_s, and D drops the offer when told
    assert p.stats["eager_offers"] == 1
    e.settle(0.5)
    assert _all_free(e) and not e.da[0].debug_state()["offers"].get("P:0")


def test_holds_beyond_the_eager_budget_are_served_lazily(engines):
    # budget: 4 KiB = one 4-block hold of 1 KiB blocks; the second and third go lazily
    e = engines(1, 1, models=ONE, p_blocks=64, d_blocks=64, eager_bytes=4 << 10)
    p = e.pa[0]
    kvs, srcs, dsts = [], np.arange(12).reshape(3, 4), np.arange(30, 42).reshape(3, 4)
    for i in range(3):
        kvs.append(e.request(srcs[i]))
        p.hold(f"r{i}", srcs[i], consumer="D")
    p.progress()
    assert [p.packed_ahead(f"r{i}") for i in range(3)] == [1, 0, 0]  # one 4 KiB chunk
    for i in range(3):
        e.da[0].fetch(f"r{i}", "P", srcs[i], dsts[i])
    got = e.drive(3)[0]
    assert all(r.ok for r in got), got
    for i in range(3):
        check_destination(e.D[0], 0, 1, kvs[i], dsts[i])
    e.settle_done()
    assert p.stats["eager_hits"] == 1 and p.stats["eager_misses"] == 0
    assert _all_free(e)


def test_eager_packing_is_off_with_zero_budget_or_unnamed_without_guessing(engines):
    e = engines(1, 1, models=ONE, eager_bytes=0)
    e.request(np.arange(4))
    e.pa[0].hold("a", np.arange(4), consumer="D")
    f = engines(1, 1, models=ONE, eager_guess=False)
    f.request(np.arange(4))
    f.pa[0].hold("a", np.arange(4))
    e.pa[0].progress()
    f.pa[0].progress()
    assert e.pa[0].packed_ahead("a") == f.pa[0].packed_ahead("a") == 0
    assert e.pa[0].pool.free_slots == e.pa[0].pool.num_slots == f.pa[0].pool.free_slots


def test_a_pull_needing_staging_evicts_eager_packs_of_other_holds(engines):
    # the pool is 8 KiB; hold A's eager pack takes all of it, then B (never packed) is pulled first
    e = engines(1, 1, models=ONE, staging_bytes=8 << 10, eager_bytes=8 << 10, p_blocks=64, d_blocks=64)
    p = e.pa[0]
    a_src, b_src = np.arange(0, 8), np.arange(8, 12)
    kv_a, kv_b = e.request(a_src), None
    p.hold("A", a_src, consumer="D")
    p.progress()
    assert p.packed_ahead("A") == 4 and p.pool.free_slots == 0
    kv_b = e.request(b_src)
    p.hold("B", b_src)  # no consumer: lazy
    e.da[0].fetch("B", "P", b_src, np.arange(40, 44))
    res = e.drive(1)[0][0]
    assert res.ok, res
    assert p.stats["eager_evicted"] >= 1
    e.da[0].fetch("A", "P", a_src, np.arange(20, 28))
    res = e.drive(1)[0][0]
    assert res.ok, res
    check_destination(e.D[0], 0, 1, kv_a, np.arange(20, 28))
    check_destination(e.D[0], 0, 1, kv_b, np.arange(40, 44))
    e.settle_done()
    assert _all_free(e)


def test_a_rogue_engine_cannot_take_the_consumers_eager_pack():
    x = RogueRig(models=[RegionModel.gqa("l0", 4, 16)], staging_bytes=16 << 10)
    try:
        p = x.pa[0]
        src, dst = np.arange(4), np.arange(20, 24)
        kv = x.request(src)
        p.hold("r", src, consumer="D")
        x.settle(0.05)
        packed = p.packed_ahead("r")
        st = p.debug_state()
        assert packed > 0 and st["staging"]["engine_slots"].get("D", 0) <= st["staging"]["share"]
        chunk_blocks = st["eager"]["r"]["0"]["blocks_per_chunk"]
        x.rogue_pull("r", src, chunk_blocks=chunk_blocks)  # exactly what was packed, wrong engine
        x.settle(0.1)
        assert not p.debug_state()["serves"] and p.stats["refused"] == 1 and p.stats["eager_misses"] == 0
        assert p.packed_ahead("r") == packed  # untouched: still the consumer's
        x.da[0].fetch("r", "P", src, dst)
        assert x.drive(1)[0].ok
        x.check_honest(kv, dst)
        assert p.stats["eager_hits"] == 1
        # a hold named for the rogue: its eager packs stay within its engine's share (ids in no run:
        # R stores P's layout, so over a run of whole blocks it would read P's cache direct_slice
        # and nothing would be packed)
        for i in range(4):
            p.hold(f"bait{i}", np.arange(8 * i + 7, 8 * i - 1, -1), consumer="R")
        x.settle(0.05)
        pool_state = p.debug_state()["staging"]
        assert 0 < pool_state["engine_slots"].get("R", 0) <= pool_state["share"]
        x.settle(0.1)
        for i in range(4):
            p.release(f"bait{i}")
        pool_state = p.debug_state()["staging"]
        assert pool_state["engine_slots"].get("R", 0) == 0 and pool_state["eager_slots"] == 0
        x.check_prefill_untouched()
    finally:
        x.close()


@pytest.mark.parametrize("bad", ["slots outside staging", "other ids", "other chunks"])
def test_a_forged_or_stale_offer_is_declined_and_the_fetch_pulls(engines, bad):
    from kvtriton.plan import ids_digest
    from kvtriton.protocol import wire

    e = engines(1, 1, models=ONE, eager_guess=False)
    src, dst = np.array([7, 1, 12, 3]), np.array([5, 6, 2, 9])
    kv = e.request(src)
    e.pa[0].hold("r", src)  # no consumer, no guess: nothing is offered by P itself
    plan = e.da[0].plan_for("P").digest()
    slots, ids, cb = (0, 4), ids_digest(src), 4
    if bad == "slots outside staging":
        slots = (e.da[0].debug_state()["peers"]["P:0"]["staging_slots"] - 1, 4)
    elif bad == "other ids":
        ids = ids_digest(src[::-1].copy())
    else:
        slots, cb = (0, 2, 2, 2), 2
    e.pa[0].transport.send_notif(e.da[0].transport.name,
                                 wire.Offer("r|P:0>0!", "r", plan, ids, 4, cb, slots).encode())
    for _ in range(50):  # up to 5 s on a loaded host
        e.settle(0.1)
        if e.da[0].debug_state()["offers"].get("P:0", {}).get("r") is not None:
            break
    assert e.da[0].debug_state()["offers"].get("P:0", {}).get("r") is not None
    e.da[0].fetch("r", "P", src, dst)
    res = e.drive(1)[0][0]
    assert res.ok, res
    check_destination(e.D[0], 0, 1, kv, dst, e.before[0])
    assert e.da[0].stats["offers_taken"] == 0 and not e.da[0].debug_state()["offers"].get("P:0")
