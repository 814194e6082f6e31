"""A rogue peer over real NIXL: it completes a genuine handshake with the prefill engine, then
sends forged control messages (pinning staging, releasing others' holds, squatting transfer
ids, renewing what is not its own). Every test runs an honest decode next to it and checks the
honest request byte-exact, the bytes outside its blocks untouched and no staging leaked; plus
the lifecycle an engine needs (-1 ids in hold, release in flight, renewal, undefined blocks)."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import torch

from kvtriton.errors import PlanError, ProtocolError, RequestRejectedError, TransferTimeoutError
from kvtriton.protocol import wire
from kvtriton.testing.oracle import RegionModel, check_destination, snapshot
from kvtriton.testing.rogue import RogueRig

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

MODELS = [RegionModel.gqa("l0", 4, 16)]  # 1 KiB a block at TP1


@pytest.fixture
def rig():
    made = []

    def make(*a, **kw):
        r = RogueRig(*a, models=MODELS, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


# --------------------------------------------------------------------------- 1. staging pinning
def test_rogue_pulls_cannot_pin_staging(rig):
    # P's pool: 8 slots of 1 KiB. The rogue pulls a dozen held requests and never READs or acks.
    x = rig(timeout_s=0.6)
    p = x.pa[0]
    for i in range(12):
        p.hold(f"bait{i}", [40 + i, 52 + i % 8])
        x.rogue_pull(f"bait{i}", [40 + i, 52 + i % 8], chunk_blocks=1)
    x.settle(0.1)
    pool_state = p.debug_state()["staging"]
    assert pool_state["engine_slots"].get("R", 0) <= pool_state["share"] == 4  # two engines: half each
    src, dst = np.arange(0, 24), np.arange(10, 34)  # 24 KiB: three times the pool, in chunks
    kv = x.request(src)
    p.hold("h", src)
    x.da[0].fetch("h", "P", src, dst, timeout_s=5.0)
    res = x.drive(1)[0]
    assert res.ok, res
    x.check_honest(kv, dst)
    # the rogue went silent: its transfers expire (waiting does not extend them), their slots are
    # quarantined for timeout_s, then everything is back
    x.settle(2.5)
    assert not p.debug_state()["serves"]
    assert p.pool.free_slots == p.pool.num_slots and sum(p.debug_state()["staging"]["engine_slots"].values()) == 0
    x.check_prefill_untouched()


def test_a_slowly_acking_consumer_cannot_keep_a_hold_past_its_hard_bound(rig):
    # the rogue is the hold's consumer and acks one chunk just before each silence deadline: its
    # transfer would last 40 x 0.35 s; the hold goes at lease + timeout_s whatever it does
    x = rig(timeout_s=0.5)
    p = x.pa[0]
    p.hold("slow", np.arange(40), lease_s=0.3)
    x.rogue_pull("slow", np.arange(40), chunk_blocks=1)
    t0, freed, next_ack, readies = time.monotonic(), [], 0.0, []
    while not freed and time.monotonic() - t0 < 5:
        p.progress()
        readies += [m for m in x.rogue_inbox() if isinstance(m, wire.Ready)]
        if readies and time.monotonic() > next_ack:
            r = readies.pop(0)
            x.forge(wire.Ack(r.xid, r.chunk))  # claims it read the chunk: progress, as far as P knows
            next_ack = time.monotonic() + 0.35
        freed = p.freed()
    elapsed = time.monotonic() - t0
    assert [(f.req_id, f.reason) for f in freed] == [("slow", "lease_expired")]
    assert elapsed < 4.0, elapsed  # lease + timeout_s = 0.8 s; unbounded, the rogue would hold it 14 s
    assert not p.debug_state()["serves"]
    x.settle(0.8)  # quarantine of slots the rogue may still read
    assert p.pool.free_slots == p.pool.num_slots


# --------------------------------------------------------------------------- 2. entitlement
def test_done_from_an_engine_that_never_fetched_does_not_release(rig):
    x = rig(p_tp=2, d_tp=2)
    src, dst = np.array([3, 9, 4]), np.array([7, 1, 2])
    kv = x.request(src)
    for p in x.pa:
        p.hold("r", src)
    for to in range(2):  # a tp=1 engine that reads from every P rank, before the honest pull
        x.forge(wire.Done("r", 0, 1), to)
    x.settle(0.1)
    assert all("r" in p.debug_state()["holds"] for p in x.pa)
    for d in x.da:
        d.fetch("r", "P", src, dst)
    while not all(p.debug_state()["holds"]["r"]["consumer"] == "D" for p in x.pa):
        for a in x.honest:  # one agent at a time: stop as soon as both P ranks saw D's pull
            a.progress()
            if all(p.debug_state()["holds"]["r"]["consumer"] == "D" for p in x.pa):
                break
    for to in range(2):  # now bound to D: a done from R is a bad message
        x.forge(wire.Done("r", 0, 1), to)
    got = x.drive(2)
    assert all(r.ok for r in got), got
    x.check_honest(kv, dst)
    x.settle(0.1)
    assert all([(f.req_id, f.reason) for f in p.freed()] == [("r", "done")] for p in x.pa)
    assert sum(p.stats["refused"] for p in x.pa) >= 2 and sum(p.stats["bad_messages"] for p in x.pa) >= 2


def test_a_named_consumer_refuses_every_other_engine(rig):
    x = rig()
    p = x.pa[0]
    src, dst = np.arange(4), np.arange(20, 24)
    kv = x.request(src)
    p.hold("r", src, consumer="D")
    x.rogue_pull("r", src)
    x.forge(wire.Renew("r", 0))
    x.settle(0.1)
    assert not p.debug_state()["serves"] and p.stats["refused"] == 2
    x.da[0].fetch("r", "P", src, dst)
    assert x.drive(1)[0].ok
    x.check_honest(kv, dst)


# --------------------------------------------------------------------------- 3. transfer ids
def test_a_squatted_transfer_id_does_not_reach_the_honest_transfer(rig):
    x = rig()
    p = x.pa[0]
    src, dst = np.arange(8), np.arange(30, 38)
    kv = x.request(src)
    p.hold("r", src)
    p.hold("bait", [50, 51])
    honest_xid = "r|D:0<0#0"  # what the decode will name its transfer (predictable)
    x.forge(wire.Pull(honest_xid, "bait", 0, (50, 51), 1, x.rogue.plan_for("P").digest()))
    x.settle(0.1)
    x.da[0].fetch("r", "P", src, dst)
    assert next(iter(x.da[0].debug_state()["parts"])) == honest_xid
    x.settle(0.02)
    for m in (wire.Abort(honest_xid), wire.Ack(honest_xid, 0), wire.RunsDone(honest_xid)):
        x.forge(m)  # aimed at the honest transfer: they only reach the rogue's own
    res = x.drive(1)[0]
    assert res.ok, res
    x.check_honest(kv, dst)
    x.settle(0.1)  # the decode's last ack may still be on its way when its result is reported
    assert all(s["engine"] == "R" for s in p.debug_state()["serves"])


# --------------------------------------------------------------------------- 4. ready
@pytest.mark.parametrize("field,value,where", [
    ("chunk", -1, "wire"), ("nbytes", -1, "wire"), ("nslots", 0, "wire"), ("chunk", 99, "agent")])
def test_a_ready_outside_the_transfer_is_a_protocol_error(rig, field, value, where):
    x = rig()
    x.pa[0].hold("r", [1, 2])
    d = x.da[0]
    d.fetch("r", "P", [1, 2], [3, 4])
    xid = next(iter(d.debug_state()["parts"]))
    body = dict(xid=xid, chunk=0, slot=0, nslots=1, nbytes=1024)
    body[field] = value
    raw = wire.encode_message("Ready", **body)
    if where == "wire":
        with pytest.raises(ProtocolError, match=field):
            wire.decode_message(raw)
    d._on_message(x.pa[0].transport.name, raw)
    assert d.stats["bad_messages"] == 1
    if where == "agent":
        res = d.results()
        assert len(res) == 1 and isinstance(res[0].error, ProtocolError) and "outside" in str(res[0].error)


# --------------------------------------------------------------------------- 6. request size
def test_a_huge_pull_is_refused_by_size_and_requests_are_bounded(rig, monkeypatch):
    x = rig()
    p = x.pa[0]
    p.hold("r", [1, 2])
    huge = msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "Pull", "xid": "x", "req": "r", "dst_rank": 0,
                          "ids": list(range(1 << 22)), "chunk_blocks": 1, "plan": "p"})
    with pytest.raises(ProtocolError, match="bytes is more than"):
        wire.decode_message(huge)
    too_many = wire.encode_message("Pull", xid="x", req="r", dst_rank=0, ids=[1] * (wire.MAX_REQUEST_BLOCKS + 1),
                                   chunk_blocks=1, plan="p")
    with pytest.raises(ProtocolError, match="MAX_REQUEST_BLOCKS"):
        wire.decode_message(too_many)
    monkeypatch.setattr(wire, "MAX_REQUEST_BLOCKS", 3)
    with pytest.raises(PlanError, match="MAX_REQUEST_BLOCKS"):
        x.da[0].fetch("big", "P", [1, 2, 3, 4], [1, 2, 3, 4])
    with pytest.raises(RequestRejectedError, match="MAX_REQUEST_BLOCKS"):
        p.hold("big", [1, 2, 3, 4])


# --------------------------------------------------------------------------- 8, 10, 11, 12
def test_hold_takes_minus_one_ids_like_fetch(rig):
    x = rig()
    src, dst = np.array([-1, -1, 5, 6]), np.array([-1, -1, 8, 9])  # a prefix the decode has
    kv = x.request(np.array([0, 0, 5, 6]))
    x.pa[0].hold("r", src)
    assert x.pa[0].debug_state()["holds"]["r"]["block_ids"] == [5, 6]
    x.da[0].fetch("r", "P", src, dst)
    assert x.drive(1)[0].ok
    check_destination(x.D[0], 0, 1, kv, dst, x.before[0])
    x.settle(0.05)
    assert [(f.req_id, f.reason) for f in x.pa[0].freed()] == [("r", "done")]


def test_release_while_a_fetch_reads_fails_it_at_once_with_undefined_blocks(rig):
    x = rig(timeout_s=30.0)
    src, dst = np.arange(24), np.arange(30, 54)  # 24 chunks-worth through an 8-slot pool
    kv = x.request(src)
    x.pa[0].hold("r", src)
    d = x.da[0]
    d.fetch("r", "P", src, dst)
    xid = next(iter(d.debug_state()["parts"]))
    while d.debug_state()["parts"][xid]["chunks_done"] < 2:
        x.step()
    assert x.pa[0].release("r")
    t0 = time.monotonic()
    res = x.drive(1)[0]
    assert not res.ok and isinstance(res.error, RequestRejectedError) and "released" in str(res.error)
    assert time.monotonic() - t0 < 2
    undefined = set(res.undefined_blocks)
    assert undefined and undefined < set(dst.tolist())  # some landed, the rest are named
    defined = np.where(np.isin(dst, list(undefined)), -1, dst)
    check_destination(x.D[0], 0, 1, kv, defined)  # every block not named holds the right bytes
    outside = [j for j in range(64) if j not in set(dst.tolist())]
    for now, was in zip(snapshot(x.D[0]), x.before[0]):
        assert all(torch.equal(a[outside], b[outside]) for a, b in zip(now, was))
    x.settle(0.2)  # P quarantines the slots D may still READ for timeout_s; D's own are back
    assert d.pool.free_slots == d.pool.num_slots


def test_an_outstanding_fetch_renews_the_hold_and_only_its_consumer_can(rig):
    # P has two ranks; rank 1 is never driven, so D's fetch stays outstanding after rank 0's part
    # landed. Rank 0's lease is 0.8 s: D's renewals keep it; the rogue's do not keep its own.
    x = rig(p_tp=2, d_tp=1, timeout_s=30.0, d_kw=dict(renew_interval_s=0.1))
    p0, d = x.pa[0], x.da[0]
    src = np.arange(4)
    x.request(src)
    for p in x.pa:
        p.hold("r", src, lease_s=0.8)
    p0.hold("bait", [60], lease_s=0.8)
    d.fetch("r", "P", src, np.arange(4))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.5:
        p0.progress()
        d.progress()
        x.forge(wire.Renew("bait", 0))
        x.rogue_inbox()
        time.sleep(0.01)
    st = p0.debug_state()
    assert "r" in st["holds"] and not st["serves"]  # served, then kept by renewal alone
    assert "bait" not in p0.debug_state()["holds"] and p0.stats["refused"] > 0
    d.abort("r")  # the decode gives up (or dies): no more renewals, the lease runs out
    t1 = time.monotonic()
    while "r" in p0.debug_state()["holds"] and time.monotonic() - t1 < 3:
        p0.progress()
    assert "r" not in p0.debug_state()["holds"] and time.monotonic() - t1 < 0.8 + 1.0
    reasons = {f.req_id: f.reason for f in p0.freed()}
    assert reasons == {"r": "lease_expired", "bait": "lease_expired"}


def test_a_timed_out_fetch_names_every_block_undefined(rig):
    x = rig(p_tp=2, d_tp=1, timeout_s=0.3)
    x.pa[0].hold("r", [1, 2])
    x.pa[1].hold("r", [1, 2])
    x.da[0].fetch("r", "P", [1, 2], [5, 6])
    deadline, res = time.monotonic() + 5, []
    while not res and time.monotonic() < deadline:
        x.pa[0].progress()  # rank 1 never answers: every block misses its heads
        x.da[0].progress()
        res = x.da[0].results()
    assert isinstance(res[0].error, TransferTimeoutError) and res[0].undefined_blocks == (5, 6)
