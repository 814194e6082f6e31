"""Issue 33, finding 3: a member cannot speak as another over NIXL. Two agents that met with the
shared secret (the real handshake on 127.0.0.1) seal every control message under the meeting's
pair keys (kvtriton.protocol.channel). A raw NIXL agent under the prefill's agent name, holding
the decode's metadata (as every member the decode met does), sends it forged messages; a genuine
message is replayed. Each is refused and counted before it is acted on, and the honest fetch then
lands byte-exact."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
from helpers.peer_agents import Agents, request_kv

from kvtriton.protocol import wire
from kvtriton.protocol.auth import Credential
from kvtriton.protocol.handshake import MetadataServer, meet
from kvtriton.testing.oracle import check_destination, snapshot
from kvtriton.transport.nixl import NixlTransport

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

SECRET = Credential(secret=b"s" * 32)
BLOCK_BYTES = 1024  # helpers.peer_agents: 1 KiB a block at TP1


def _met(eager_bytes: int | None):
    """P and D (integrity on both) met through the real handshake with the secret, and a raw NIXL
    agent named as P that loaded D's metadata."""
    agents = Agents()
    kw = dict(integrity=True, eager_bytes=eager_bytes, require_authenticated_peers=True, timeout_s=5.0)
    p, d = agents("P", 1, **kw), agents("D", 2, **kw)

    def on_meeting(m):
        p.add_remote(m.metadata, authenticated=True, keys=m.keys)

    with MetadataServer("127.0.0.1", 0, p.metadata, on_meeting=on_meeting, credential=SECRET) as srv:
        met = meet("127.0.0.1", srv.port, d.metadata(), credential=SECRET, timeout_s=5)
    d.add_remote(met.metadata, authenticated=True, keys=met.keys)
    raw = NixlTransport(p.transport.name)  # the forger: P's agent name, D's metadata
    raw.add_remote(wire.decode_metadata(d.metadata()).agent_md)
    return agents, (p, d, raw)


@pytest.fixture
def pair():  # no eager packs: P answers pulls only
    agents, made = _met(0)
    yield made
    made[2].close()
    agents.close()


@pytest.fixture
def pair_eager():  # P packs a hold for its consumer and offers it
    agents, made = _met(None)
    yield made
    made[2].close()
    agents.close()


def _drive(agents, reader, until_s=20.0, pumps=()):
    end = time.monotonic() + until_s
    while time.monotonic() < end:
        for x in pumps:
            x.poll_notifs()
        for a in agents:
            a.progress()
        got = reader.results()
        if got:
            return got
    return []


def _forge(raw: NixlTransport, d, msg: wire.Message, bad_before: int) -> None:
    """Send ``msg`` as P and let D handle it (D alone progresses: P sends nothing meanwhile)."""
    raw.send_notif(d.transport.name, msg.encode())
    end = time.monotonic() + 3
    while d.stats["bad_messages"] == bad_before and time.monotonic() < end:
        raw.poll_notifs()
        d.progress()


def _xid(d) -> str:
    (xid,) = d.debug_state()["parts"]
    return xid


def test_a_forged_reject_under_the_prefills_name_is_refused_and_counted(pair):
    # before: the decode failed the fetch with the forged Reject, counted as 0 bad messages
    p, d, raw = pair
    src, dst = [3, 9], [1, 6]
    kv = request_kv(p, src, 11)
    before = snapshot(d.test_regions)
    p.hold("r", src, consumer="D")
    d.fetch("r", "P", src, dst)
    d.progress()
    bad = d.stats["bad_messages"]
    _forge(raw, d, wire.Reject(_xid(d), "forged: give up"), bad)
    assert d.stats["forged_messages"] == 1 and d.stats["bad_messages"] == bad + 1
    got = _drive([p, d], d)
    assert got and got[0].ok, got
    check_destination(d.test_regions, d.rank, d.tp, kv, dst, before)


def test_a_forged_ready_at_attacker_written_staging_never_ends_ok_with_the_attackers_bytes(pair):
    # before: with integrity=True on both sides, the forged Ready's digest matched the bytes the
    # attacker wrote into P's staging, and the fetch ended ok with them in D's cache
    p, d, raw = pair
    src, dst = [2, 5], [0, 7]
    kv = request_kv(p, src, 12)
    before = snapshot(d.test_regions)
    p.hold("r", src, consumer="D")
    d.fetch("r", "P", src, dst)
    d.progress()  # the pull leaves; P does not answer yet
    assert d.debug_state()["parts"][_xid(d)]["chunks"] == 1
    nbytes = len(src) * BLOCK_BYTES
    evil = torch.full((nbytes,), 0x5A, dtype=torch.uint8)
    p.pool.view(0, nbytes).copy_(evil)  # what a member's one-sided WRITE into P's staging does
    digest = hashlib.blake2b(evil.numpy().tobytes(), digest_size=wire.DIGEST_BYTES).digest()
    bad = d.stats["bad_messages"]
    _forge(raw, d, wire.Ready(_xid(d), 0, 0, nbytes // 1024, nbytes, digest), bad)
    early = _drive([d], d, until_s=1.0)  # D alone: P has not answered
    assert not early, f"the fetch ended on the forger's word: {early}"
    assert d.stats["forged_messages"] == 1
    got = _drive([p, d], d)
    assert got and got[0].ok, got
    check_destination(d.test_regions, d.rank, d.tp, kv, dst, before)  # P's own pack, never the 0x5A bytes


def test_a_forged_offer_at_attacker_written_staging_never_ends_ok_with_the_attackers_bytes(pair_eager):
    # before: D kept the forged Offer (P's own terms, the attacker's slots, the digest of the
    # attacker's bytes), its fetch took it without a pull and ended ok with the attacker's bytes
    p, d, raw = pair_eager
    genuine: list[wire.Offer] = []
    real = p.transport.send_notif

    def late_offers(agent: str, msg: bytes) -> None:  # the genuine Offer is late (the forger raced it)
        m = wire.decode_message(d_opened(msg))
        if isinstance(m, wire.Offer):
            genuine.append(m)
            return
        real(agent, msg)

    def d_opened(msg: bytes) -> bytes:  # what D would read (the test sees P's plain message under the seal)
        return msg[18:-32] if msg[:1] == b"\xc1" else msg

    p.transport.send_notif = late_offers  # type: ignore[method-assign]
    src, dst = [4, 8], [2, 3]
    kv = request_kv(p, src, 13)
    before = snapshot(d.test_regions)
    p.hold("r", src, consumer="D")
    end = time.monotonic() + 5
    while not genuine and time.monotonic() < end:
        p.progress()
    (g,) = genuine
    nbytes = len(src) * BLOCK_BYTES
    slot = p.pool.num_slots - nbytes // 1024  # slots the genuine pack does not use
    assert slot >= g.slots[0] + g.slots[1]
    evil = torch.full((nbytes,), 0x5A, dtype=torch.uint8)
    p.pool.view(slot, nbytes).copy_(evil)  # what a member's one-sided WRITE into P's staging does
    digest = hashlib.blake2b(evil.numpy().tobytes(), digest_size=wire.DIGEST_BYTES).digest()
    forged = wire.Offer(g.xid, g.req, g.plan, g.ids, g.num_blocks, g.chunk_blocks, (slot, nbytes // 1024), g.runs,
                        digest)
    _forge(raw, d, forged, d.stats["bad_messages"])
    d.fetch("r", "P", src, dst)
    got = _drive([p, d], d)
    assert got and got[0].ok, got
    check_destination(d.test_regions, d.rank, d.tp, kv, dst, before)  # P's own pack, never the 0x5A bytes
    assert d.stats["forged_messages"] == 1


def test_a_replayed_genuine_message_is_refused(pair):
    # the forger captured a genuine sealed Pong (a member on the path, or D's own earlier message)
    # and sends it again under P's name: the counter was seen, so it is refused
    p, d, raw = pair
    sent: list[bytes] = []
    real = p.transport.send_notif

    def capture(agent: str, msg: bytes) -> None:
        sent.append(msg)
        real(agent, msg)

    p.transport.send_notif = capture  # type: ignore[method-assign]
    src, dst = [1, 6], [4, 5]
    kv = request_kv(p, src, 14)
    before = snapshot(d.test_regions)
    p.hold("r", src, consumer="D")
    d.fetch("r", "P", src, dst)
    got = _drive([p, d], d)
    assert got and got[0].ok, got
    assert sent, "P sent D nothing by send_notif"
    p.transport.send_notif = real  # type: ignore[method-assign]
    forged = d.stats["forged_messages"]
    for msg in sent:
        raw.send_notif(d.transport.name, msg)
    end = time.monotonic() + 3
    while d.stats["forged_messages"] < forged + len(sent) and time.monotonic() < end:
        raw.poll_notifs()
        d.progress()
    assert d.stats["forged_messages"] == forged + len(sent)
    check_destination(d.test_regions, d.rank, d.tp, kv, dst, before)


def test_a_flood_of_forged_messages_takes_no_place_in_the_prefills_queue(pair):
    # forged messages are refused as they arrive: they never fill the per-sender queue the genuine
    # ones wait in (kvtriton.agent.inbox)
    p, d, raw = pair
    src, dst = [5, 10], [6, 8]
    kv = request_kv(p, src, 15)
    before = snapshot(d.test_regions)
    for i in range(300):
        raw.send_notif(d.transport.name, wire.Pong(i).encode())
    p.hold("r", src, consumer="D")
    d.fetch("r", "P", src, dst)
    got = _drive([p, d], d, pumps=[raw])
    assert got and got[0].ok, got
    check_destination(d.test_regions, d.rank, d.tp, kv, dst, before)
    end = time.monotonic() + 3
    while (d.stats["forged_messages"] < 300 or not d.idle()) and time.monotonic() < end:  # idle: its Done sent
        raw.poll_notifs()
        d.progress()
    assert d.stats["forged_messages"] == 300
    assert d.idle()
