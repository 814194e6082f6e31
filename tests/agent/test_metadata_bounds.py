"""Issue 33, finding 6: a peer's metadata sizes are bounded by this rank's settings and checked
before the agent's lock is taken, over real NIXL on 127.0.0.1. A RankMetadata that claims 2^22 or
2^24 staging slots (or 2^30 cache blocks) is refused fast with a typed error naming the limit,
nothing is prepared for it, and ``progress()`` on another thread is never held up by it; an
honest peer is still admitted and served byte-exact afterwards."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest
import torch
from helpers.peer_agents import MODELS, Agents

from kvtriton.errors import PeerRefusedError
from kvtriton.testing.oracle import (
    check_destination,
    load_source,
    make_global_kv,
    snapshot,
)
from kvtriton.testing.rogue import BS

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl


@pytest.fixture
def made():
    agents = Agents()
    yield agents
    agents.close()


def lying(md: bytes, *, num_slots: int | None = None, num_blocks: int | None = None) -> bytes:
    d = msgpack.unpackb(md, raw=False)
    if num_slots is not None:
        d["staging"]["num_slots"] = num_slots
    if num_blocks is not None:
        for r in d["regions"]:
            r["num_blocks"] = num_blocks
            r["spans"] = [num_blocks * s[0] * r["itemsize"] for s in r["strides"]]
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize(("lie", "limit"), [(dict(num_slots=1 << 22), "max_peer_slots"),
                                            (dict(num_slots=1 << 24), "max_peer_slots"),
                                            (dict(num_blocks=1 << 30), "max_peer_blocks")])
def test_lying_metadata_is_refused_fast_and_progress_goes_on(made, lie, limit):
    # before: 2^22-2^24 slots passed the decoder and add_remote built and checked that many
    # descriptors under the agent's lock (0.6-1.8 s on an idle host, 10-25 s loaded), progress()
    # blocked meanwhile; 2^30 blocks were accepted
    p = made("P", 1)
    d = made("D", 2)
    bad = lying(d.metadata(), **lie)
    out: dict = {}

    def register():
        t0 = time.perf_counter()
        try:
            p.add_remote(bad, authenticated=True)
        except Exception as e:  # noqa: BLE001 - checked below
            out["error"] = e
        out["s"] = time.perf_counter() - t0

    t = threading.Thread(target=register)
    worst = 0.0
    t.start()
    while t.is_alive():
        t0 = time.perf_counter()
        p.progress()
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.0005)
    t.join()
    assert isinstance(out.get("error"), PeerRefusedError) and limit in str(out["error"]), out
    assert out["s"] < 0.5 and worst < 0.5, (out, worst)
    assert not p.debug_state()["peers"] and p.stats["peers_refused"] == 1
    # the honest rank behind the lie is admitted and served byte-exact
    p.add_remote(d.metadata(), authenticated=True)
    d.add_remote(p.metadata(), authenticated=True)
    src, dst = np.arange(5), np.arange(10, 15)
    kv = make_global_kv(MODELS, len(src), BS, torch.Generator().manual_seed(3))
    load_source(p.test_regions, 0, 1, kv, src)
    before = snapshot(d.test_regions)
    p.hold("r", src)
    d.fetch("r", "P", src, dst)
    end = time.monotonic() + 20
    while not (got := d.results()):
        assert time.monotonic() < end
        p.progress()
        d.progress()
    assert got[0].ok, got
    check_destination(d.test_regions, 0, 1, kv, dst, before)


def test_the_limits_are_settings_and_never_below_our_own_pool(made):
    p = made("P", 1, max_peer_slots=16, max_peer_blocks=128)
    d = made("D", 2, staging_bytes=16 << 10)  # 16 slots: at the limit
    assert p.add_remote(d.metadata(), authenticated=True) == "D"
    e = made("E", 3, staging_bytes=32 << 10)  # 32 slots
    with pytest.raises(PeerRefusedError, match="max_peer_slots"):
        p.add_remote(e.metadata(), authenticated=True)
    with pytest.raises(PeerRefusedError, match="max_peer_blocks"):
        p.add_remote(lying(made("F", 4).metadata(), num_blocks=129), authenticated=True)
    big = made("B", 5, max_peer_slots=1)  # a limit below our own pool (8 slots) is raised to it
    assert big.add_remote(made("G", 6).metadata(), authenticated=True) == "G"
