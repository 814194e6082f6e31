"""Issue 33, finding 5: registration generations are counted by the receiver per identity, never
taken as sent, over real NIXL on 127.0.0.1. A registration that claims generation 2^64-1 does not
lock the real rank out once its agent is gone, a restart whose clock stepped back an hour is not
refused, and a replay of an agent that already left the identity still is."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch

from kvtriton import Region
from kvtriton.agent import TransferAgent
from kvtriton.errors import PeerRefusedError
from kvtriton.protocol import wire

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl


def with_generation(md: bytes, gen: int) -> bytes:
    d = msgpack.unpackb(md, raw=False)
    d["gen"] = gen
    return msgpack.packb(d, use_bin_type=True)


@pytest.fixture
def made():
    out: list[TransferAgent] = []

    def make(engine: str, rank: int = 0, fill: bool = True, timeout_s: float = 1.0) -> TransferAgent:
        heads = 2 if engine == "P" else 1
        k = torch.randn(16, heads, 4, 32) if fill else torch.zeros(16, heads, 4, 32)
        regs = [Region.attention("l0", k, layout="HND", block_size=4, total_heads=2)]
        a = TransferAgent(engine, rank, 1 if engine == "P" else 2, regs, staging_bytes=1 << 20, slot_bytes=4096,
                          timeout_s=timeout_s)
        a.test_regions = regs  # type: ignore[attr-defined]
        out.append(a)
        return a

    yield make
    for a in out:
        try:
            a.close()
        except Exception:  # noqa: BLE001 - closed by the test already
            pass


def fetch_works(p: TransferAgent, d: TransferAgent) -> None:
    d.add_remote(p.metadata(), authenticated=True)
    p.hold("r", [3, 7])
    d.fetch("r", "P", [3, 7], [0, 5])
    deadline = time.monotonic() + 10
    while not (res := d.results()):
        assert time.monotonic() < deadline
        d.progress()
        p.progress()
    assert res[0].ok, res
    src, dst = p.test_regions[0].streams[0], d.test_regions[0].streams[0]  # type: ignore[attr-defined]
    assert torch.equal(dst[0], src[3, 0:1]) and torch.equal(dst[5], src[7, 0:1])


def test_a_squat_at_the_largest_generation_does_not_lock_the_rank_out(made):
    p = made("P")
    squatter = made("D", fill=False)
    p.add_remote(with_generation(squatter.metadata(), 2**64 - 1), authenticated=True)
    assert p.debug_state()["peers"]["D:0"]["agent"] == squatter.transport.name
    squatter.close()  # the squatter's agent is gone; the real rank starts
    d = made("D", fill=False)
    assert wire.decode_metadata(d.metadata()).generation < 2**64 - 1
    assert p.add_remote(d.metadata(), authenticated=True) == "D"  # before: refused for good ("not newer")
    assert p.debug_state()["peers"]["D:0"]["agent"] == d.transport.name
    fetch_works(p, d)


def test_a_restart_whose_clock_stepped_back_is_not_refused(made):
    p = made("P")
    d1 = made("D", fill=False)
    first = d1.metadata()
    p.add_remote(first, authenticated=True)
    d1.close()
    d2 = made("D", fill=False)
    behind = with_generation(d2.metadata(), wire.decode_metadata(first).generation - 3600 * 10**9)
    assert p.add_remote(behind, authenticated=True) == "D"  # before: refused (an hour behind)
    assert p.debug_state()["peers"]["D:0"]["agent"] == d2.transport.name
    # the agent that left the identity cannot come back: a replay of its registration is refused
    with pytest.raises(PeerRefusedError, match="held it before"):
        p.add_remote(first, authenticated=True)
    assert p.debug_state()["peers"]["D:0"]["agent"] == d2.transport.name
