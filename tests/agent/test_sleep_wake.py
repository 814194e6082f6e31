"""Sleep and wake (vLLM 0.34's ``unregister_kv_caches`` / ``restore_kv_caches``) at agent level,
over real NIXL on 127.0.0.1: :meth:`TransferAgent.unregister` drops a rank's registration (its
fetches in flight fail typed, its holds are released, its peers forgotten), :meth:`restore`
registers it again under a newer metadata generation, and a peer that meets it again drops its
old keys. Each transfer after a wake is checked byte for byte (``view(torch.uint8)``) against
an independent reference: the source's blocks, refilled with fresh random data after the wake."""

from __future__ import annotations

import time

import pytest
import torch

from kvtriton import Region
from kvtriton.agent import TransferAgent
from kvtriton.errors import PeerDisconnectedError, TransferTimeoutError, UnregisteredError
from kvtriton.protocol import wire

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

BLOCKS, HEADS, BS, DIM = 16, 2, 4, 32


@pytest.fixture
def made():
    out: list[TransferAgent] = []

    def make(engine: str, modes: str, **kw) -> TransferAgent:
        caches = [torch.zeros(BLOCKS, HEADS, BS, DIM) for _ in range(2)]
        regs = [Region.attention(f"l{i}", c, layout="HND", block_size=BS, total_heads=HEADS)
                for i, c in enumerate(caches)]
        a = TransferAgent(engine, 0, 1, regs, staging_bytes=1 << 20, slot_bytes=4096, timeout_s=10.0, modes=modes,
                          **kw)
        a.test_caches = caches  # type: ignore[attr-defined]
        out.append(a)
        return a

    yield make
    for a in out:
        a.close()


def refill(agent: TransferAgent, gen: torch.Generator) -> list[torch.Tensor]:
    """Fresh random bytes in ``agent``'s caches (in place: the registered memory); a copy of them."""
    for c in agent.test_caches:  # type: ignore[attr-defined]
        c.copy_(torch.randn(c.shape, generator=gen))
    return [c.clone() for c in agent.test_caches]  # type: ignore[attr-defined]


def meet(p: TransferAgent, d: TransferAgent) -> None:
    d.add_remote(p.metadata(), authenticated=True)
    p.add_remote(d.metadata(), authenticated=True)


def run(p: TransferAgent, d: TransferAgent, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while not (res := d.results()):
        assert time.monotonic() < deadline, "no result"
        d.progress()
        p.progress()
    return res[0]


def transfer_is_exact(p: TransferAgent, d: TransferAgent, req: str, gen: torch.Generator) -> None:
    ref = refill(p, gen)
    for c in d.test_caches:  # type: ignore[attr-defined]
        c.fill_(-1.0)
    src, dst = [3, 7, 11], [0, 5, 9]
    p.hold(req, src)
    d.fetch(req, "P", src, dst)
    res = run(p, d)
    assert res.ok, res.error
    for want, got in zip(ref, d.test_caches):  # type: ignore[attr-defined]
        for s, t in zip(src, dst):
            assert torch.equal(got[t].view(torch.uint8), want[s].view(torch.uint8))
        untouched = [b for b in range(BLOCKS) if b not in dst]
        assert torch.equal(got[untouched], torch.full_like(got[untouched], -1.0))


@pytest.mark.parametrize("modes", ["staged", "direct"])
def test_source_sleeps_and_wakes_then_transfers_byte_exact(made, modes):
    gen = torch.Generator().manual_seed(34)
    p, d = made("P", modes), made("D", modes)
    meet(p, d)
    transfer_is_exact(p, d, "before", gen)
    old = wire.decode_metadata(p.metadata()).generation
    p.hold("kept", [1, 2])
    p.unregister()
    p.unregister()  # idempotent
    assert not p.registered
    freed = {f.req_id: f.reason for f in p.freed()}
    assert freed.get("kept") == "released", freed  # the hold went: its blocks are the engine's again
    with pytest.raises(UnregisteredError):
        p.hold("asleep", [1])
    # a peer still holding the sleeper's metadata: its fetch fails typed, never reads freed memory
    # (its messages reach an agent that forgot it: it times out, and a connector meets the source again)
    d.fetch("during", "P", [1, 2], [1, 2], timeout_s=1.0)
    res = run(p, d)
    assert not res.ok and isinstance(res.error, (TransferTimeoutError, PeerDisconnectedError)), res
    p.restore()
    p.restore()  # idempotent
    assert p.registered and wire.decode_metadata(p.metadata()).generation > old
    meet(p, d)  # the decode drops its old keys (a newer registration of the same agent)
    assert d.debug_state()["peers"]["P:0"]["agent"] == p.transport.name
    transfer_is_exact(p, d, "after", gen)


@pytest.mark.parametrize("modes", ["staged", "direct"])
def test_destination_sleeps_with_a_fetch_in_flight_then_wakes(made, modes):
    gen = torch.Generator().manual_seed(35)
    p, d = made("P", modes), made("D", modes)
    meet(p, d)
    p.hold("r", [3])
    d.fetch("r", "P", [3], [4])  # in flight: the source has not progressed yet
    d.unregister()
    res = d.results()
    assert [r.req_id for r in res] == ["r"] and isinstance(res[0].error, UnregisteredError), res
    with pytest.raises(UnregisteredError):
        d.fetch("r2", "P", [3], [4])
    with pytest.raises(UnregisteredError):
        d.add_remote(p.metadata())
    p.progress()  # the source may see the fetch's messages; it forgets them with the peer
    d.restore()
    meet(p, d)  # the source drops the destination's old keys and connects the new ones
    p.release("r")
    transfer_is_exact(p, d, "after", gen)


def test_a_peer_that_expired_the_sleeper_meets_it_again_after_restore(made):
    """A decode that dropped the prefill while it slept (silent past ``peer_expiry_s``) must take
    the same agent back once it restored its memory and met it authenticated again: it is the
    agent's own newer registration, not a stale replay of one that left."""
    gen = torch.Generator().manual_seed(36)
    p, d = made("P", "staged"), made("D", "staged")
    meet(p, d)
    transfer_is_exact(p, d, "before", gen)
    # a short expiry only while the prefill sleeps: a first transfer on a loaded 2-core host can
    # keep a rank from answering pings for seconds (kernels warming up)
    d._peers.expiry_s = 1.0
    p.unregister()
    deadline = time.monotonic() + 20.0
    while "P:0" in d.debug_state()["peers"]:
        assert time.monotonic() < deadline, "the decode never expired the sleeping prefill"
        d.progress()
        time.sleep(0.02)
    d._peers.expiry_s = 60.0
    p.restore()
    meet(p, d)  # refused before: "held it before and left it: a stale or replayed registration"
    assert d.debug_state()["peers"]["P:0"]["agent"] == p.transport.name
    transfer_is_exact(p, d, "after", gen)
    # the registration it had before the sleep stays refused: it is older than the one met now
