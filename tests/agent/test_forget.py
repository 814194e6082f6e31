"""``TransferAgent.forget``: a rank forgets an idle peer engine (the vLLM connector's
``forget_idle_s``) and the pair parts (kvtriton.agent.peers, "Parting"), over real NIXL: every
rank of that engine leaves the table, the same agent is taken back when met again (its
registration no older, authenticated when a credential is configured) and transfers byte-exact
on fresh random data; an agent that was replaced since, or an unauthenticated one under the
credential, stays refused. Before: a parted agent met again was refused as a "stale or
replayed registration", so an engine once dropped could never be met again by the same peer."""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers.peer_agents import Agents, request_kv

from kvtriton.errors import PeerRefusedError
from kvtriton.testing.oracle import check_destination

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl


@pytest.fixture
def agents():
    a = Agents()
    yield a
    a.close()


def _peers(a) -> set[str]:
    return set(a.debug_state()["peers"])


def _exact(p, d, req: str, seed: int) -> None:
    src, dst = np.array([3, 7, 11]), np.array([0, 5, 9])
    kv = request_kv(p, src, seed)
    p.hold(req, src)
    d.fetch(req, "P", src, dst)
    deadline = time.monotonic() + 30
    while not (res := d.results()):
        assert time.monotonic() < deadline, "no result"
        d.progress()
        p.progress()
    assert res[0].ok, res[0].error
    check_destination(d.test_regions, 0, 1, kv, dst)


def test_a_forgotten_engine_is_met_again_and_a_replaced_agent_is_not(agents):
    p, d = agents("P", 1), agents("D", 2, flow="pull")
    d.add_remote(p.metadata())
    p.add_remote(d.metadata())
    _exact(p, d, "a", 10)
    assert d.forget("P") == 1 and p.forget("D") == 1  # each side forgets the other (idle)
    assert _peers(d) == set() and _peers(p) == set() and d.forget("P") == 0
    d.add_remote(p.metadata())  # the same agents, met again
    p.add_remote(d.metadata())
    _exact(p, d, "b", 11)
    old = d.metadata()
    assert p.forget("D") == 1
    d2 = agents("D", 3)  # D:0 restarted meanwhile: a new agent takes it
    p.add_remote(d2.metadata())
    with pytest.raises(PeerRefusedError, match="held it before"):
        p.add_remote(old)  # the replaced agent stays refused, parted or not


def test_under_the_credential_a_parted_agent_comes_back_authenticated_only(agents):
    p = agents("P", 4, require_authenticated_peers=True)
    d = agents("D", 5)
    p.add_remote(d.metadata(), authenticated=True)
    d.add_remote(p.metadata())
    assert p.forget("D") == 1
    with pytest.raises(PeerRefusedError):
        p.add_remote(d.metadata())  # unauthenticated: the engine registered authenticated here
    assert _peers(p) == set()
    p.add_remote(d.metadata(), authenticated=True)
    assert _peers(p) == {"D:0"}
    _exact(p, d, "c", 12)


@pytest.mark.parametrize("credential", [False, True])
def test_a_live_peer_dropped_for_silence_is_met_again(agents, credential):
    """A host stall longer than ``peer_expiry_s`` (CI saw engine processes not run for 66-192 s)
    drops a live decode rank for silence; when it meets the prefill again it is taken back, as a
    parted one is (authenticated only, under the credential). Before: refused for good as "held it
    before and left it", so every later load of the pair failed and was recomputed."""
    kw = {"require_authenticated_peers": True} if credential else {}
    p = agents("P", 6, peer_expiry_s=1.0, **kw)
    d = agents("D", 7, flow="pull")
    p.add_remote(d.metadata(), authenticated=credential)
    d.add_remote(p.metadata())
    _exact(p, d, "s1", 13)
    deadline = time.monotonic() + 20
    while "D:0" in _peers(p):  # the decode stalls: only the prefill runs, its pings unanswered
        assert time.monotonic() < deadline, "the prefill never dropped the silent decode"
        p.progress()
        time.sleep(0.05)
    if credential:
        with pytest.raises(PeerRefusedError):
            p.add_remote(d.metadata())  # unauthenticated: refused under the credential
        assert _peers(p) == set()
    p.add_remote(d.metadata(), authenticated=credential)  # the same live agent, met again
    assert _peers(p) == {"D:0"}
    _exact(p, d, "s2", 14)
