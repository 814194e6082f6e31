"""Who may be a peer (kvtriton.agent.peers), over real NIXL on 127.0.0.1: an impostor claiming a
live decode's (engine, rank) cannot replace it and never reads a hold named for it, while the
honest decode's fetch completes byte-exact; a genuine restart replaces its old self; one agent
stands for one engine rank; the peer table is bounded; silent peers expire (their staging
returns); with a credential configured an unauthenticated engine neither binds an unbound hold
nor receives an eager guess, and learns nothing from a refusal; an idle engine does not turn the
guess off. Every transfer is checked byte for byte on fresh random data (bytes outside its blocks
included); staging is checked back to free."""

from __future__ import annotations

import gc
import time

import msgpack
import numpy as np
import pytest
import torch

from kvtriton.agent import TransferAgent
from kvtriton.errors import IncompatibleRemoteError, PeerDisconnectedError, PeerRefusedError, TransferTimeoutError
from kvtriton.protocol import wire
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination,
    load_source,
    make_global_kv,
    make_rank_regions,
    snapshot,
)
from kvtriton.testing.rogue import BS, PACKING_MODEL, RogueRig

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

MODELS = [RegionModel.gqa("l0", 4, 16)]  # 1 KiB a block at TP1
KW = dict(staging_bytes=8 << 10, slot_bytes=1024, impl="torch", cost=PACKING_MODEL)


@pytest.fixture
def made():
    out = []
    yield out
    for x in out:
        x.close()


def _agent(made, engine, seed, *, rank=0, tp=1, blocks=64, timeout_s=5.0, **kw):
    regs = make_rank_regions(MODELS, rank, tp, blocks, BS, gen=torch.Generator().manual_seed(seed))
    a = TransferAgent(engine, rank, tp, regs, timeout_s=timeout_s, **{**KW, **kw})
    made.append(a)
    return a, regs


def _meet(a, b, a_auth=False, b_auth=False):
    """Both directions: ``a`` adds ``b`` (authenticated ``b_auth``) and ``b`` adds ``a``."""
    a.add_remote(b.metadata(), authenticated=b_auth)
    b.add_remote(a.metadata(), authenticated=a_auth)


def _drive(agents, results_of, want=1, timeout_s=20.0):
    got, end = [], time.monotonic() + timeout_s
    while len(got) < want:
        assert time.monotonic() < end, f"no results after {timeout_s} s"
        for a in agents:
            a.progress()
        got += results_of.results()
    return got


def _request(models, p_regs, src, seed):
    kv = make_global_kv(models, len(src), BS, torch.Generator().manual_seed(seed))
    load_source(p_regs, 0, 1, kv, src)
    return kv


def _with_engine(md_bytes: bytes, **fields) -> bytes:
    d = msgpack.unpackb(md_bytes, raw=False)
    d.update(fields)
    return msgpack.packb(d, use_bin_type=True)


# --------------------------------------------------------------------------- identity pinned
@pytest.fixture
def rig():
    out = []

    def make(*a, **kw):
        r = RogueRig(*a, models=MODELS, **kw)
        out.append(r)
        return r

    yield make
    for r in out:
        r.close()


@pytest.mark.parametrize("authenticated", [False, True])
def test_an_impostor_cannot_take_over_a_live_decode_nor_read_its_hold(rig, made, authenticated):
    # before: add_remote replaced D:0 by whichever agent claimed it last; the impostor then
    # received holds named for D byte-exact and the real decode timed out
    x = rig()
    p, d = x.pa[0], x.da[0]
    d.start()  # the honest decode answers liveness checks from its own progress thread
    imp_regs = make_rank_regions(MODELS, 0, 1, 64, BS, gen=torch.Generator().manual_seed(7))
    imp = TransferAgent("D", 0, 1, imp_regs, timeout_s=1.0, **KW)  # same engine and rank, another agent, newer
    made.append(imp)
    imp.add_remote(p.metadata())
    assert wire.decode_metadata(imp.metadata()).generation > wire.decode_metadata(d.metadata()).generation
    with pytest.raises(PeerRefusedError, match="live agent"):
        p.add_remote(imp.metadata(), authenticated=authenticated)
    state = p.debug_state()
    assert state["peers"]["D:0"]["agent"] == d.transport.name and p.stats["peers_refused"] == 1
    assert imp.transport.name not in {v["agent"] for v in state["peers"].values()}
    src, dst = np.arange(6), np.arange(20, 26)
    kv = x.request(src)
    p.hold("h", src, consumer="D")
    imp_before = snapshot(imp_regs)
    imp.start()
    imp.fetch("h", "P", src, dst, timeout_s=1.0)  # P does not know its agent: its pull is dropped
    d.fetch("h", "P", src, dst)
    res = x.drive(1)[0]
    assert res.ok, res
    x.check_honest(kv, dst)
    end = time.monotonic() + 10
    got = []
    while not got and time.monotonic() < end:
        got = imp.results()
        time.sleep(0.01)
    assert len(got) == 1 and isinstance(got[0].error, TransferTimeoutError), got
    assert all(torch.equal(a, b) for now, was in zip(snapshot(imp_regs), imp_before) for a, b in zip(now, was))
    end = time.monotonic() + 10  # the impostor's pull reaches P whenever UCX delivers it: bounded wait
    while p.stats["bad_messages"] < 1 and time.monotonic() < end:
        p.progress()
        time.sleep(0.01)
    assert p.stats["bad_messages"] >= 1 and p.debug_state()["peers"]["D:0"]["agent"] == d.transport.name
    x.check_prefill_untouched()


def test_a_genuine_restart_replaces_its_old_self_and_a_replay_is_refused(rig):
    x = rig()
    p, old = x.pa[0], x.da[0]
    src, dst = np.arange(4), np.arange(8, 12)
    kv = x.request(src)
    p.hold("a", src)
    old.fetch("a", "P", src, dst)
    assert x.drive(1)[0].ok
    x.check_honest(kv, dst)
    old_md = old.metadata()
    old.close()  # the decode process restarts: a new agent for D:0 (its cache tensors reused)
    del old, x.da[0]  # in one process its UCX worker ends with its last handle (a restart: at once)
    gc.collect()
    new = TransferAgent("D", 0, 1, x.D[0], timeout_s=5.0, **KW)
    x.da.append(new)
    new.add_remote(p.metadata())
    assert p.add_remote(new.metadata()) == "D"  # unauthenticated: the old agent is gone (unreachable)
    assert p.debug_state()["peers"]["D:0"]["agent"] == new.transport.name and p.stats["peers_replaced"] == 1
    with pytest.raises(PeerRefusedError, match="not newer"):
        p.add_remote(old_md)  # the dead agent's registration replayed
    src, dst = np.arange(30, 36), np.arange(40, 46)
    x.before = [snapshot(r) for r in x.D]
    kv = x.request(src)
    p.hold("b", src)
    new.fetch("b", "P", src, dst)
    res = x.drive(1)[0]
    assert res.ok, res
    x.check_honest(kv, dst)


def test_a_silent_live_agent_is_replaced_only_by_an_authenticated_restart(rig):
    # the old D:0 agent still exists but does not answer (its progress never runs while P waits):
    # an unauthenticated claim is refused (it was heard from within timeout_s); an authenticated
    # one (it proved the credential) replaces it once the liveness check goes unanswered
    x = rig()
    p, old = x.pa[0], x.da[0]
    new = TransferAgent("D", 0, 1, x.D[0], timeout_s=5.0, **KW)
    x.da.append(new)
    new.add_remote(p.metadata())
    t0 = time.monotonic()
    with pytest.raises(PeerRefusedError, match="silent for timeout_s"):
        p.add_remote(new.metadata())
    assert p.debug_state()["peers"]["D:0"]["agent"] == old.transport.name
    p.add_remote(new.metadata(), authenticated=True)
    assert time.monotonic() - t0 < 8  # two checks of min(timeout_s, 2) s each
    state = p.debug_state()["peers"]["D:0"]
    assert state["agent"] == new.transport.name and state["authenticated"] and p.stats["peers_replaced"] == 1
    x.da.remove(old)
    old.close()
    src, dst = np.arange(6), np.arange(12, 18)
    kv = x.request(src)
    p.hold("r", src, consumer="D")
    new.fetch("r", "P", src, dst)
    res = x.drive(1)[0]
    assert res.ok, res
    x.check_honest(kv, dst)


def test_an_older_generation_is_refused_even_for_a_free_identity(made):
    p, _ = _agent(made, "P", 1)
    d, _ = _agent(made, "D", 2)
    p.add_remote(d.metadata())
    stale = _with_engine(d.metadata(), gen=wire.decode_metadata(d.metadata()).generation - 1, agent="D:0:other")
    with pytest.raises(PeerRefusedError):  # another agent, not newer: refused before NIXL sees it
        p.add_remote(stale)
    assert p.debug_state()["peers"]["D:0"]["agent"] == d.transport.name


# --------------------------------------------------------------------------- bounds
def test_one_agent_registers_one_engine_id_and_the_share_holds(made):
    # before: one agent registered 50 engine ids and the honest engine's share fell to one chunk
    p, _ = _agent(made, "P", 1)
    d, _ = _agent(made, "D", 2)
    x, _ = _agent(made, "X", 3)
    _meet(p, d)
    share = p.debug_state()["staging"]["share"]
    p.add_remote(x.metadata())
    refused = 0
    for i in range(50):
        try:
            p.add_remote(_with_engine(x.metadata(), engine=f"E{i}"))
        except PeerRefusedError as e:
            assert "one NIXL agent" in str(e)
            refused += 1
    assert refused == 50 and p.stats["peers_refused"] == 50
    assert sorted(p.debug_state()["peers"]) == ["D:0", "X:0"]
    assert p.debug_state()["staging"]["share"] == share // 2  # two engines: half each, not 1/51


def test_the_peer_table_is_bounded(made):
    # before: unbounded (352 accepted)
    p, _ = _agent(made, "P", 1, max_peers=3, max_peer_engines=2)
    others = [_agent(made, e, 10 + i)[0] for i, e in enumerate(["A", "B", "C"])]
    d0, _ = _agent(made, "D", 20, rank=0, tp=2)
    d1, _ = _agent(made, "D", 21, rank=1, tp=2)
    p.add_remote(others[0].metadata())
    p.add_remote(d0.metadata())
    with pytest.raises(PeerRefusedError, match="max_peer_engines"):
        p.add_remote(others[1].metadata())
    p.add_remote(d1.metadata())  # a rank of a known engine: within the engine bound
    with pytest.raises(PeerRefusedError, match="max_peers"):
        p.add_remote(others[2].metadata())
    assert sorted(p.debug_state()["peers"]) == ["A:0", "D:0", "D:1"] and p.stats["peers_refused"] == 2


def test_a_silent_peer_expires_and_its_staging_returns(rig):
    # before: a peer that stopped answering stayed in the table for ever
    x = rig(timeout_s=0.5, peer_expiry_s=1.5)
    p = x.pa[0]
    for i in range(4):
        p.hold(f"bait{i}", [40 + i])
        x.rogue_pull(f"bait{i}", [40 + i], chunk_blocks=1)  # the rogue's agent never runs progress()
    x.settle(0.1)
    assert p.debug_state()["staging"]["engine_slots"].get("R", 0) > 0
    end = time.monotonic() + 10
    while "R:0" in p.debug_state()["peers"] and time.monotonic() < end:
        x.step()  # the honest decode answers the pings from its progress(); the rogue does not
    assert sorted(p.debug_state()["peers"]) == ["D:0"] and p.stats["peers_expired"] == 1
    x.settle(0.7)  # quarantine of slots the rogue may still have been reading
    assert p.pool.free_slots == p.pool.num_slots and not p.debug_state()["serves"]
    src, dst = np.arange(8), np.arange(10, 18)  # the decode is still served, byte-exact
    kv = x.request(src)
    p.hold("h", src)
    x.da[0].fetch("h", "P", src, dst)
    res = x.drive(1)[0]
    assert res.ok, res
    x.check_honest(kv, dst)


def test_a_fetch_from_a_peer_that_stops_answering_fails_typed(made):
    p, p_regs = _agent(made, "P", 1, timeout_s=30.0, peer_expiry_s=1.0)
    d, _ = _agent(made, "D", 2, timeout_s=30.0, peer_expiry_s=1.0)
    _meet(p, d)
    src = np.arange(4)
    _request(MODELS, p_regs, src, 5)
    d.fetch("r", "P", src, np.arange(4), timeout_s=30.0)  # P never runs progress() again
    t0 = time.monotonic()
    got = []
    while not got and time.monotonic() - t0 < 10:
        d.progress()
        got = d.results()
    assert len(got) == 1 and isinstance(got[0].error, PeerDisconnectedError), got
    assert time.monotonic() - t0 < 5  # the expiry, not the 30 s transfer timeout
    assert d.pool.free_slots == d.pool.num_slots


# --------------------------------------------------------------------------- authenticated engines only
def _auth_rig(made, **kw):
    """P (credential configured) with D added authenticated and R added unauthenticated."""
    p, p_regs = _agent(made, "P", 1, require_authenticated_peers=True, **kw)
    d, d_regs = _agent(made, "D", 2)
    r, r_regs = _agent(made, "R", 3)
    _meet(p, d, a_auth=True, b_auth=True)
    _meet(p, r, a_auth=True, b_auth=False)
    return p, p_regs, d, d_regs, r, r_regs


def test_an_unauthenticated_engine_never_binds_an_unbound_hold(made):
    # before: an unbound hold belonged to whoever pulled first (10/10 races won by the rogue)
    p, p_regs, d, d_regs, r, r_regs = _auth_rig(made)
    assert p.debug_state()["peers"]["R:0"]["authenticated"] is False
    src, dst = np.arange(5), np.arange(30, 35)
    kv = _request(MODELS, p_regs, src, 9)
    d_before, r_before = snapshot(d_regs), snapshot(r_regs)
    p.hold("u", src)
    r.fetch("u", "P", src, dst)  # the rogue pulls first
    got = _drive([p, r], r)
    assert not got[0].ok and str(got[0].error).endswith("refused by P:0"), got  # no reason, no engine name
    assert p.debug_state()["holds"]["u"]["consumer"] is None and p.stats["refused"] >= 1
    assert all(torch.equal(a, b) for now, was in zip(snapshot(r_regs), r_before) for a, b in zip(now, was))
    d.fetch("u", "P", src, dst)
    got = _drive([p, d, r], d)
    assert got[0].ok, got
    check_destination(d_regs, 0, 1, kv, dst, d_before)
    d.progress()  # its Done goes in the progress after the result (Fetches.finish)
    p.progress()
    assert [(f.req_id, f.reason) for f in p.freed()] == [("u", "done")]


def test_the_eager_guess_goes_only_to_an_authenticated_engine(made):
    # before: eager_guess offered every unbound hold to the only connected engine, whoever it was
    # (and a second engine connected turned it off)
    p, p_regs, d, d_regs, r, r_regs = _auth_rig(made, staging_bytes=64 << 10, chunk_bytes=2048)
    src, dst = np.arange(3, -1, -1), np.arange(50, 54)  # no run: packed (over a run D would read our cache)
    kv = _request(MODELS, p_regs, src, 11)
    before = snapshot(d_regs)
    p.hold("g", src)
    end = time.monotonic() + 10
    while "g" not in d.debug_state()["offers"].get("P:0", {}):
        assert time.monotonic() < end, "no offer reached the authenticated decode"
        for a in (p, d, r):
            a.progress()
    state = p.debug_state()
    assert state["offered"]["g"] == ["D:0"] and not r.debug_state()["offers"]
    assert p.stats["eager_guessed"] == 1  # R connected does not turn the guess off: D is the only trusted one
    d.fetch("g", "P", src, dst)
    assert _drive([p, d, r], d)[0].ok
    check_destination(d_regs, 0, 1, kv, dst, before)
    assert d.stats["offers_taken"] == 1 and not r.debug_state()["offers"]  # read from the offer, no pull


def test_no_guess_for_an_unauthenticated_engine_alone(made):
    p, p_regs = _agent(made, "P", 1, require_authenticated_peers=True)
    r, _ = _agent(made, "R", 3)
    _meet(p, r, a_auth=True, b_auth=False)
    _request(MODELS, p_regs, np.arange(4), 12)
    p.hold("g", np.arange(4))
    for _ in range(5):
        p.progress()
        r.progress()
    assert p.stats["eager_guessed"] == 0 and not p.debug_state()["eager"] and not p.debug_state()["offered"]
    assert not r.debug_state()["offers"]


def test_an_idle_engine_does_not_turn_the_guess_off(made):
    # before: a second connected engine, even one that never pulled, turned the guess off
    p, p_regs = _agent(made, "P", 1)
    d, d_regs = _agent(made, "D", 2)
    idle, _ = _agent(made, "I", 3)
    _meet(p, d)
    _meet(p, idle)
    src, dst = np.arange(4), np.arange(10, 14)
    _request(MODELS, p_regs, src, 13)
    p.hold("first", src)
    for _ in range(3):
        p.progress()
    assert p.stats["eager_guessed"] == 0  # two engines, neither read yet: no guess
    d.fetch("first", "P", src, dst)
    assert _drive([p, d], d)[0].ok
    src, dst = np.arange(25, 19, -1), np.arange(30, 36)  # no run: packed (over a run D would read our cache)
    kv = _request(MODELS, p_regs, src, 14)
    before = snapshot(d_regs)
    p.hold("second", src)
    for _ in range(5):
        p.progress()
        d.progress()
    assert p.stats["eager_guessed"] == 1  # D read lately, I never did: D is guessed
    d.fetch("second", "P", src, dst)
    assert _drive([p, d], d)[0].ok
    check_destination(d_regs, 0, 1, kv, dst, before)
    assert p.stats["eager_hits"] >= 1


# --------------------------------------------------------------------------- refusal texts
def test_refusals_say_why_only_to_authenticated_callers(made):
    p, _ = _agent(made, "P", 1, require_authenticated_peers=True)
    other = make_rank_regions([RegionModel.gqa("l0", 4, 32)], 0, 1, 64, BS, gen=torch.Generator().manual_seed(4))
    x = TransferAgent("X", 0, 1, other, timeout_s=5.0, **KW)
    made.append(x)
    with pytest.raises(IncompatibleRemoteError) as e:
        p.add_remote(x.metadata())
    assert str(e.value) == "P:0 refused the peer"  # nothing about head_dim, nothing to pass the gate with
    with pytest.raises(IncompatibleRemoteError, match="head_dim"):
        p.add_remote(x.metadata(), authenticated=True)
    q, _ = _agent(made, "Q", 2)  # no credential configured: today's full reasons
    with pytest.raises(IncompatibleRemoteError, match="head_dim"):
        q.add_remote(x.metadata())
