"""After a clean end the staging pool is whole at once; quarantine is for peers that failed.

Issue 21, item 6: in pull mode at P3->D2 (6 KV heads, fp8, block 4, NHD->HND, two requests) every
prefill rank kept part of its staging quarantined for ~``timeout_s`` after the last request ended
well, when a fetch skipped a prefix (-1 destination ids) its source had offered a pack of: the
pull withdrew the offer as if the decode might still READ it. A pull of the request from the
offer's own peer proves it is not reading the offer (a destination part either takes an offer or
pulls, never both), so nothing needs to wait. Every transfer here is checked byte for byte against
the oracle; the pool is read through ``debug_state()["staging"]`` right after ``freed()`` reports
every hold done, with no settling in between."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvtriton.testing.oracle import RegionModel, check_destination, snapshot
from kvtriton.testing.pair import EnginePair

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

FP8_6 = [RegionModel.gqa("l0", 6, 16, dtype=torch.float8_e4m3fn)]
TIMEOUT_S = 5.0  # long against the test: a quarantine would show


def _whole(agents) -> list[str]:
    """The agents whose staging is not whole (free_slots < num_slots), as ``name: free/num``."""
    out = []
    for a in agents:
        st = a.debug_state()["staging"]
        if st["free_slots"] != st["num_slots"] or st["retired"]:
            out.append(f"{a.engine_id}:{a.rank}: {st['free_slots']}/{st['num_slots']}, retired {st['retired']}")
    return out


def _untouched(regions, before, touched: np.ndarray) -> None:
    """Every byte of every block outside ``touched`` equals the snapshot ``before``."""
    keep = torch.ones(before[0][0].shape[0], dtype=torch.bool)
    keep[torch.as_tensor(touched)] = False
    for now, was in zip(snapshot(regions), before):
        for a, b in zip(now, was):
            assert torch.equal(a[keep], b[keep]), "bytes outside the fetched blocks changed"


def _until_freed(e: EnginePair, holds: int, timeout_s: float = 10.0) -> list:
    """Progress until every prefill rank reported ``holds`` freed holds; nothing after."""
    freed: dict[int, list] = {p.rank: [] for p in e.pa}
    deadline = time.monotonic() + timeout_s
    while any(len(v) < holds for v in freed.values()):
        assert time.monotonic() < deadline, f"freed {freed}"
        for a in e.agents:
            a.progress()
        for p in e.pa:
            freed[p.rank] += p.freed()
    return [f for v in freed.values() for f in v]


@pytest.mark.parametrize("flow", ["pull", "push"])
@pytest.mark.parametrize("eager", ["guess", "named", "off"])
@pytest.mark.parametrize("prefix", [0, 1, 3])
@pytest.mark.parametrize("offer_seen", [False, True])
def test_staging_is_whole_right_after_every_hold_is_done(flow, eager, prefix, offer_seen):
    # prefix: destination ids -1 at the start of each fetch (a prefix cache hit); 1 block is
    # inside the first packed chunk (the offer cannot serve the pull: withdrawn), 3 not on a chunk
    # boundary either (chunks of 1 KiB: 4 or 8 blocks), 0 asks exactly the pack
    kw = dict(eager_bytes=0) if eager == "off" else dict(eager_guess=eager == "guess")
    e = EnginePair(3, 2, models=FP8_6, mode=flow, timeout_s=TIMEOUT_S, chunk_bytes=1024, **kw)
    try:
        rng = np.random.default_rng(21 + prefix)
        # disjoint blocks on both sides: the two requests are in flight together
        reqs, srcs, dsts = [], rng.permutation(64)[:16].reshape(2, 8), rng.permutation(48)[:16].reshape(2, 8)
        for i in range(2):
            src, dst = srcs[i], dsts[i].copy()
            dst[:prefix] = -1
            reqs.append((f"r{i}", src, dst, e.request(src)))
        before = [snapshot(x) for x in e.D]
        for req, src, _, _ in reqs:
            for p in e.pa:
                p.hold(req, src, consumer="D" if eager == "named" else None)
        if offer_seen:  # packs made and offered before the fetches
            e.settle_offers(*(req for req, *_ in reqs))
        elif eager != "off":
            # packs made and offered, the decode fetching before it read the offers: the prefill's
            # progress alone (NIXL's progress thread delivers a pull sent at once before the prefill
            # packs, and the pull is then served lazily: that path is test_eager's)
            for p in e.pa:
                p.progress()
        for req, src, dst, _ in reqs:
            for d in e.da:
                d.fetch(req, "P", src, dst)
        got = e.drive(2)
        assert all(r.ok for v in got.values() for r in v), got
        touched = np.concatenate([dst[dst >= 0] for _, _, dst, _ in reqs])
        for r in range(2):
            for _, _, dst, kv in reqs:
                check_destination(e.D[r], r, 2, kv, dst)
            _untouched(e.D[r], before[r], touched)
        freed = _until_freed(e, 2)
        assert sorted((f.req_id, f.reason) for f in freed) == sorted((r, "done") for r, *_ in reqs for _ in range(3))
        assert not _whole(e.agents), _whole(e.agents)
        assert all(not a.debug_state()["serves"] and not a.debug_state()["eager"] for a in e.pa)
        if flow == "pull" and eager != "off":
            assert sum(p.stats["eager_offers"] for p in e.pa) > 0  # the path under test was taken
    finally:
        e.close()


def test_an_offer_withdrawn_by_a_released_hold_stays_quarantined():
    # the pack was offered (announced, as by a ready): the decode may READ it at any moment, so a
    # hold released by its engine keeps the offered slots out of the pool for timeout_s
    timeout = 0.6
    e = EnginePair(1, 1, models=FP8_6, timeout_s=timeout, chunk_bytes=1024)
    try:
        p = e.pa[0]
        e.request(np.arange(8))
        p.hold("r", np.arange(8), consumer="D")
        p.progress()
        assert p.stats["eager_offers"] == 1
        assert p.release("r")
        t_rel = time.monotonic()
        assert [f.reason for f in p.freed()] == ["released"]
        st = p.debug_state()["staging"]
        assert st["free_slots"] < st["num_slots"], st
        while p.debug_state()["staging"]["free_slots"] < p.debug_state()["staging"]["num_slots"]:
            assert time.monotonic() < t_rel + 3 * timeout, p.debug_state()["staging"]
            p.progress()
        assert time.monotonic() - t_rel >= 0.8 * timeout
    finally:
        e.close()
