"""Issue 33, finding 4: with a credential configured (``require_authenticated_peers``), a peer
added unauthenticated never replaces, binds or receives anything of an authenticated engine,
stalled or not, over real NIXL on 127.0.0.1: not a decode silent past ``timeout_s``, not an
identity whose authenticated agent expired, not another rank of an authenticated engine; and an
unauthenticated agent that came first does not lock the authenticated engine out. Every honest
fetch is checked byte for byte; the impostor's cache is checked untouched."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from helpers.peer_agents import Agents, request_kv

from kvtriton.errors import PeerRefusedError
from kvtriton.testing.oracle import (
    check_destination,
    snapshot,
)

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl


@pytest.fixture
def made():
    agents = Agents()
    yield lambda engine, seed, *, timeout_s=5.0, **kw: agents(engine, seed, timeout_s=timeout_s, **kw)
    agents.close()


def _drive(agents, reader, timeout_s=20.0):
    end = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < end, f"no results after {timeout_s} s"
        for a in agents:
            a.progress()
        got = reader.results()
        if got:
            return got


def _untouched(agent, before):
    return all(torch.equal(a, b) for now, was in zip(snapshot(agent.test_regions), before) for a, b in zip(now, was))


def _honest_fetch(p, d, req, src, dst, seed, others=()):
    kv = request_kv(p, src, seed)
    before = snapshot(d.test_regions)
    p.hold(req, src, consumer="D")
    d.fetch(req, "P", src, dst)
    got = _drive([p, d, *others], d)
    assert got[0].ok, got
    check_destination(d.test_regions, d.rank, d.tp, kv, dst, before)


def test_a_stalled_authenticated_decode_is_not_replaced_by_an_unauthenticated_agent(made):
    # before: D:0 silent for timeout_s was replaced by the impostor, which then read the hold
    # named for D byte-exact
    p = made("P", 1, timeout_s=0.5, require_authenticated_peers=True)
    d = made("D", 2, timeout_s=0.5)
    d.add_remote(p.metadata(), authenticated=True)
    p.add_remote(d.metadata(), authenticated=True)
    imp = made("D", 3, timeout_s=0.5)  # same engine and rank, another agent
    imp.add_remote(p.metadata())
    time.sleep(0.7)  # D's progress never runs: silent for more than timeout_s
    with pytest.raises(PeerRefusedError, match="^P:0 refused the peer$"):
        p.add_remote(imp.metadata(), authenticated=False)
    assert p.debug_state()["peers"]["D:0"]["agent"] == d.transport.name and p.stats["peers_replaced"] == 0
    src, dst = np.arange(6), np.arange(20, 26)
    kv = request_kv(p, src, 9)
    p.hold("h", src, consumer="D")
    imp_before = snapshot(imp.test_regions)
    imp.fetch("h", "P", src, dst, timeout_s=1.0)  # P does not know its agent: its pull is dropped
    got = _drive([p, imp], imp)
    assert not got[0].ok, got
    assert _untouched(imp, imp_before)
    before = snapshot(d.test_regions)
    d.fetch("h", "P", src, dst)
    got = _drive([p, d, imp], d)
    assert got[0].ok, got
    check_destination(d.test_regions, 0, 1, kv, dst, before)


def test_an_expired_authenticated_identity_and_its_other_ranks_stay_closed_to_unauthenticated_agents(made):
    # before: once the authenticated D:0 expired, an unauthenticated D:0 was admitted as new; an
    # unauthenticated D:1 was admitted next to a live authenticated D:0; both read holds named D
    p = made("P", 1, require_authenticated_peers=True, peer_expiry_s=1.0)
    d0 = made("D", 2, tp=2)
    p.add_remote(d0.metadata(), authenticated=True)
    d1 = made("D", 3, rank=1, tp=2)
    with pytest.raises(PeerRefusedError, match="^P:0 refused the peer$"):
        p.add_remote(d1.metadata(), authenticated=False)
    assert sorted(p.debug_state()["peers"]) == ["D:0"]
    end = time.monotonic() + 10
    while "D:0" in p.debug_state()["peers"]:  # D:0 never answers a ping: it expires
        assert time.monotonic() < end
        p.progress()
    assert p.stats["peers_expired"] == 1
    imp = made("D", 4, tp=2)
    with pytest.raises(PeerRefusedError, match="^P:0 refused the peer$"):
        p.add_remote(imp.metadata(), authenticated=False)
    with pytest.raises(PeerRefusedError, match="^P:0 refused the peer$"):
        p.add_remote(d1.metadata(), authenticated=False)
    assert not p.debug_state()["peers"]
    # the engine's authenticated restart is admitted (a new agent for D:0)
    d0b = made("D", 5, tp=2)
    assert p.add_remote(d0b.metadata(), authenticated=True) == "D"
    assert p.debug_state()["peers"]["D:0"]["agent"] == d0b.transport.name


def test_an_unauthenticated_squatter_does_not_lock_the_authenticated_engine_out(made):
    # before: the squatter, alive and answering, kept D:0 ("live agent"): the real decode was
    # refused and the squatter read every hold named for D
    p = made("P", 1, require_authenticated_peers=True)
    squat = made("D", 2)
    squat.add_remote(p.metadata())
    p.add_remote(squat.metadata(), authenticated=False)
    squat.start()  # it answers liveness checks
    d = made("D", 3)
    d.add_remote(p.metadata(), authenticated=True)
    assert p.add_remote(d.metadata(), authenticated=True) == "D"
    state = p.debug_state()["peers"]
    assert state["D:0"]["agent"] == d.transport.name and state["D:0"]["authenticated"]
    assert p.stats["peers_replaced"] == 1
    before = snapshot(squat.test_regions)
    _honest_fetch(p, d, "r", np.arange(5), np.arange(30, 35), 11)
    with pytest.raises(PeerRefusedError, match="^P:0 refused the peer$"):  # and it cannot come back
        p.add_remote(squat.metadata(), authenticated=False)
    squat.close()
    assert _untouched(squat, before)


def test_an_agent_met_again_authenticated_is_upgraded_not_dropped(made):
    p = made("P", 1, require_authenticated_peers=True)
    d = made("D", 2)
    d.add_remote(p.metadata(), authenticated=True)
    assert p.add_remote(d.metadata(), authenticated=False) == "D"
    assert p.add_remote(d.metadata(), authenticated=True) == "D"  # the same agent, over a proven exchange
    state = p.debug_state()["peers"]["D:0"]
    assert state["agent"] == d.transport.name and state["authenticated"] and p.stats["peers_replaced"] == 0
    _honest_fetch(p, d, "u", np.arange(4), np.arange(40, 44), 13)
