"""What a decode rank reads a source engine by (its plan, peers, chunk caps, the block counts ids
are checked below) is gathered once per engine and reused by every fetch; a source rank met again
(a restart under the same engine id, here with half the blocks) is read by its own metadata from
the next fetch on: ids past its cache are refused before anything moves, and ids inside it land
byte-exact. Real NIXL agents over UCX in one process, as in test_agent.py."""

import time

import pytest
import torch

from kvtriton.agent import TransferAgent
from kvtriton.errors import PlanError
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination,
    load_source,
    make_global_kv,
    make_rank_regions,
    snapshot,
)

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

# a split region read as head slices or staged, and an MLA latent read DIRECT (zero copy)
MODELS = [RegionModel.gqa("l0", 2, 16), RegionModel.mla("m0", 32, torch.float32)]
KW = dict(staging_bytes=64 << 10, slot_bytes=1024, timeout_s=1.0, impl="torch")


def _load(d: TransferAgent, p: TransferAgent, req: str, src: list[int], dst: list[int], gen) -> None:
    """Hold ``src`` on ``p`` (fresh random KV in it), fetch into ``dst`` on ``d``, check every byte."""
    kv = make_global_kv(MODELS, len(src), 4, gen)
    load_source(p.regions, 0, 1, kv, src)
    before = snapshot(d.regions)
    p.hold(req, src, lease_s=30)
    d.fetch(req, "P", src, dst)
    deadline = time.monotonic() + 10
    results = []
    while not results:
        for a in (p, d):
            a.progress()
        results = d.results()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{req} did not finish in 10 s")
    assert results[0].ok, results[0].error
    check_destination(d.regions, 0, 1, kv, dst, before)


def test_a_source_met_again_is_read_by_its_new_metadata(gen):
    p = TransferAgent("P", 0, 1, make_rank_regions(MODELS, 0, 1, 32, 4, gen=gen), **KW)
    d = TransferAgent("D", 0, 1, make_rank_regions(MODELS, 0, 1, 32, 4, gen=gen), **KW)
    p2 = None
    try:
        d.add_remote(p.metadata())
        p.add_remote(d.metadata())
        _load(d, p, "r1", [30, 5], [2, 31], gen)
        _load(d, p, "r2", [31, 4], [3, 30], gen)  # the second fetch reads by what the first gathered
        p.close()  # restarted under the same engine id, with half the blocks
        p2 = TransferAgent("P", 0, 1, make_rank_regions(MODELS, 0, 1, 16, 4, gen=gen), **KW)
        time.sleep(KW["timeout_s"] + 0.1)  # the closed agent silent for timeout_s: an agent may replace it
        d.add_remote(p2.metadata())  # once it fails its liveness check
        p2.add_remote(d.metadata())
        before = snapshot(d.regions)
        with pytest.raises(PlanError, match="source block id 20 at position 1 is out of range"):
            d.fetch("r3", "P", [3, 20], [0, 1])  # inside the old cache, past the new one
        assert all(torch.equal(a, b) for ra, rb in zip(snapshot(d.regions), before) for a, b in zip(ra, rb))
        _load(d, p2, "r4", [15, 0], [7, 8], gen)
    finally:
        for a in (p, d, p2):
            if a is not None:
                a.close()
