"""Batched pack (kvtriton.agent.source.packing): a source rank serving several decode ranks of one request
packs their chunks in one launch, each destination's tiles in its own slots, byte for byte; a
destination whose launch is refused fails alone. Launches are counted through the agent's
``pack_launches`` stat (and, for the batch alone, by wrapping the launcher); every payload is
checked against an independent reference (torch indexing of the source cache, or the oracle),
and the bytes around it (staging canaries, untouched cache blocks) are checked too."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtriton import Region, build_plan
from kvtriton.agent.device import Lanes
from kvtriton.agent.links import Chunk
from kvtriton.agent.source import packing
from kvtriton.agent.source.packing import PackBatch, PackJob
from kvtriton.errors import LaunchError
from kvtriton.plan import ChunkGeometry, Payload
from kvtriton.protocol import wire
from kvtriton.regions import Layout
from kvtriton.staging import StagingPool
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination,
    check_destination_tokens,
    load_source_tokens,
    make_global_tokens,
)
from kvtriton.testing.rogue import RogueRig
from kvtriton.testing.seams import Wiretap

BS, HD = 4, 16


# --------------------------------------------------------------------------- the batch alone
def _rig(impl: str, d_tp: int = 4, heads: int = 8, nb: int = 12):
    gen = torch.Generator().manual_seed(7)
    k = torch.randint(-2**15, 2**15, (nb, BS, heads, HD), dtype=torch.int16, generator=gen).view(torch.bfloat16)
    v = torch.randint(-2**15, 2**15, (nb, BS, heads, HD), dtype=torch.int16, generator=gen).view(torch.bfloat16)
    src = [Region.attention("l0", k, v, block_size=BS, total_heads=heads)]
    hd = heads // d_tp
    dst_specs = [Region.attention("l0", torch.empty(1, hd, BS, HD, dtype=torch.bfloat16),
                                  torch.empty(1, hd, BS, HD, dtype=torch.bfloat16), layout="HND",
                                  block_size=BS, total_heads=heads).spec]
    reads = [build_plan(d, d_tp, dst_specs, 1, [src[0].spec]).staged[0] for d in range(d_tp)]
    pool = StagingPool(64, 256)
    pool.tensor.copy_(torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8, generator=gen))  # canaries
    s = SimpleNamespace(pool=pool, regions=src, impl=impl, lanes=Lanes(torch.device("cpu")))
    return s, (k, v), reads


def _expected(kv, read: Payload, ids) -> torch.Tensor:
    """The payload by torch indexing of the source cache (independent of ops and the reference)."""
    out = []
    for seg in read.segments:
        t = kv[seg.stream][torch.as_tensor(ids)][:, :, seg.src_head:seg.src_head + seg.num_heads]
        if seg.dst_layout is Layout.HND:
            t = t.permute(0, 2, 1, 3)
        out.append(t.contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(out)


def _jobs(s, reads, ids, failed):
    geo = ChunkGeometry(reads[0].bytes_per_block, len(ids), len(ids))
    jobs = []
    for d, read in enumerate(reads):
        slot = s.pool.alloc_bytes(geo.nbytes(0))
        ch = Chunk(0, slot, s.pool.slots_for(geo.nbytes(0)), geo.nbytes(0))
        jobs.append(PackJob.for_chunk(read, geo, ch, np.asarray(ids, dtype=np.int64), None, None,
                                      alive=lambda: True, failed=lambda e, d=d: failed.append((d, e))))
    return jobs


def _launches(monkeypatch) -> list:
    calls = []
    real = packing.pack

    def counting(regions, segments, *a, **kw):
        calls.append(len(segments))
        return real(regions, segments, *a, **kw)

    monkeypatch.setattr(packing, "pack", counting)
    return calls


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_four_destinations_pack_in_one_launch_byte_exact(monkeypatch, impl):
    s, kv, reads = _rig(impl)
    ids = [9, 2, 5]
    before = s.pool.tensor.clone()
    failed, calls = [], _launches(monkeypatch)
    jobs = _jobs(s, reads, ids, failed)
    stats = {"pack_launches": 0, "packed_chunks": 0}
    batch = PackBatch(s, stats)
    for j in jobs:
        batch.add(j)
    batch.launch()
    assert calls == [sum(len(r.segments) for r in reads)] and not failed
    assert stats == {"pack_launches": 1, "packed_chunks": 4}
    assert len({id(j.chunk.kernel) for j in jobs}) == 1 and jobs[0].chunk.kernel.done()
    want = before.clone()
    for j, read in zip(jobs, reads):
        off = s.pool.offset(j.chunk.slot)
        want[off:off + j.chunk.nbytes] = _expected(kv, read, ids)
    assert torch.equal(s.pool.tensor, want)  # every payload exact, every other staging byte as it was


def test_a_refused_destination_fails_alone_and_writes_nothing(monkeypatch):
    s, kv, reads = _rig("torch")
    ids = [3, 11, 0, 4]
    bad = Payload(0, tuple(seg.__class__(**{**seg.__dict__, "region": 5}) for seg in reads[2].segments))
    reads = reads[:2] + [bad] + reads[3:]
    before = s.pool.tensor.clone()
    failed, calls = [], _launches(monkeypatch)
    jobs = _jobs(s, reads, ids, failed)
    batch = PackBatch(s, {"pack_launches": 0, "packed_chunks": 0})
    for j in jobs:
        batch.add(j)
    batch.launch()
    # the joint launch was refused before writing; then one launch per destination, the bad one refused
    assert len(calls) == 1 + 4 and [d for d, _ in failed] == [2] and isinstance(failed[0][1], LaunchError)
    assert batch.stats == {"pack_launches": 3, "packed_chunks": 3}
    assert jobs[2].chunk.kernel is None
    want = before.clone()
    for d, (j, read) in enumerate(zip(jobs, reads)):
        if d != 2:
            off = s.pool.offset(j.chunk.slot)
            want[off:off + j.chunk.nbytes] = _expected(kv, read, ids)
    assert torch.equal(s.pool.tensor, want)  # the bad destination's slots keep their canary


def test_jobs_of_different_blocks_or_ended_owners(monkeypatch):
    s, kv, reads = _rig("torch")
    failed, calls = [], _launches(monkeypatch)
    a = _jobs(s, reads[:2], [1, 2], failed)
    b = _jobs(s, reads[2:], [7, 8], failed)
    b[1].alive = lambda: False  # its owner ended after reserving: its slots may already be reused
    before = s.pool.tensor.clone()
    batch = PackBatch(s, {"pack_launches": 0, "packed_chunks": 0})
    for j in a + b:
        batch.add(j)
    batch.launch()
    assert len(calls) == 2 and not failed and b[1].chunk.kernel is None
    off = s.pool.offset(b[1].chunk.slot)
    assert torch.equal(s.pool.tensor[off:off + b[1].chunk.nbytes], before[off:off + b[1].chunk.nbytes])
    for j, read, ids in [(a[0], reads[0], [1, 2]), (a[1], reads[1], [1, 2]), (b[0], reads[2], [7, 8])]:
        off = s.pool.offset(j.chunk.slot)
        assert torch.equal(s.pool.tensor[off:off + j.chunk.nbytes], _expected(kv, read, ids))


# --------------------------------------------------------------------------- in the agent (NIXL)
try:
    import nixl  # noqa: F401
    HAVE_NIXL = True
except ImportError:
    HAVE_NIXL = False


def needs_nixl(test):
    return pytest.mark.nixl(pytest.mark.skipif(not HAVE_NIXL, reason="needs nixl")(test))


def _all_exact(e, kv, dst) -> None:
    """Drive until every decode rank has its result: each ok and byte-exact, every other byte of
    its cache untouched."""
    got = e.drive(1)
    assert all(v[0].ok for v in got.values()), got
    for r in range(e.d_tp):
        check_destination(e.D[r], r, e.d_tp, kv, dst, e.before[r])


def _refuse(monkeypatch, which) -> None:
    """The batch's launcher refuses (as its validation would) every launch with a segment ``which``
    picks, before writing anything."""
    real = packing.pack

    def refusing(regions, segments, *a, **kw):
        if any(which(seg) for seg in segments):
            raise LaunchError("refused for the test")
        return real(regions, segments, *a, **kw)

    monkeypatch.setattr(packing, "pack", refusing)


def _gather(agent, n: int, drive=(), timeout_s: float = 5.0) -> None:
    """Wait until ``agent`` has received messages from ``n`` peers, without handling them
    (``drive``: callables run meanwhile, UCX needs both sides polled): its next progress() then
    handles them all before it packs (one step)."""
    deadline = time.monotonic() + timeout_s
    tap = Wiretap(agent)
    tap.hold()
    while len(tap.held) < n:
        assert time.monotonic() < deadline, f"{agent.engine_id}:{agent.rank} heard from fewer than {n} peers"
        for step in drive:
            step()
        tap.poll()
    tap.close()  # the agent's next poll receives everything held


@needs_nixl
@pytest.mark.parametrize("p_tp,d_tp", [(1, 4), (2, 8)])
@pytest.mark.parametrize("eager,mode", [(False, "pull"), (True, "pull"), (False, "push")])
def test_one_source_packs_its_decode_ranks_in_one_launch(engines, p_tp, d_tp, eager, mode):
    # push: the pack of a chunk waits for its grant, so how many share a launch depends on when
    # the grants arrive; its launches are counted, not asserted
    models = [RegionModel.gqa("l0", 8, 16)]  # 8 heads: 1 KiB a block per decode rank of D8
    e = engines(p_tp, d_tp, models=models, staging_bytes=64 << 10, p_blocks=64, d_blocks=48, mode=mode)
    rng = np.random.default_rng(11)
    src, dst = rng.permutation(64)[:6], rng.permutation(48)[:6]
    kv = e.request(src)
    per_p = d_tp // p_tp
    for p in e.pa:
        p.hold("r", src, consumer="D" if eager else None)
        if eager:
            p.progress()  # packs every decode rank's payload, one chunk each, in one launch
            assert (p.stats["pack_launches"], p.stats["packed_chunks"]) == (1, per_p)
    for d in e.da:
        d.fetch("r", "P", src, dst)
    if not eager:
        for d in e.da:
            d.progress()  # each decode rank sends its pull
        for p in e.pa:
            _gather(p, per_p, [d.progress for d in e.da])
            p.progress()  # every pull handled, then one launch for all of them
            if mode == "pull":
                assert (p.stats["pack_launches"], p.stats["packed_chunks"]) == (1, per_p)
    _all_exact(e, kv, dst)
    e.settle(0.2)
    for p in e.pa:
        assert p.stats["packed_chunks"] == per_p and 1 <= p.stats["pack_launches"] <= (1 if mode == "pull" else per_p)
        assert p.stats["eager_hits"] == (per_p if eager else 0)
        assert [(f.req_id, f.reason) for f in p.freed()] == [("r", "done")]
    assert all(a.pool.free_slots == a.pool.num_slots for a in e.agents)


@needs_nixl
def test_chunked_pulls_batch_each_step_byte_exact(engines):
    # 24 blocks of 1 KiB per decode rank in 4 KiB chunks (6 each), two in flight per transfer
    models = [RegionModel.gqa("l0", 4, 64)]
    e = engines(1, 4, models=models, staging_bytes=64 << 10, chunk_bytes=4 << 10, p_blocks=64, d_blocks=48)
    rng = np.random.default_rng(12)
    src, dst = rng.permutation(64)[:24], rng.permutation(48)[:24]
    kv = e.request(src)
    p = e.pa[0]
    p.hold("r", src)
    for d in e.da:
        d.fetch("r", "P", src, dst)
        d.progress()
    _gather(p, 4, [d.progress for d in e.da])
    p.progress()
    assert (p.stats["pack_launches"], p.stats["packed_chunks"]) == (2, 8)  # chunks 0 and 1 of all four
    _all_exact(e, kv, dst)
    assert p.stats["packed_chunks"] == 24 and p.stats["pack_launches"] < 24
    e.settle_done()  # every staging slot back (the asserted state, not a fixed wait)
    assert all(a.pool.free_slots == a.pool.num_slots for a in e.agents)


@needs_nixl
@pytest.mark.parametrize("rogue", ["silent", "aborts", "refused"])
def test_a_rogue_in_the_batch_cannot_spoil_the_others(monkeypatch, rogue):
    # D (tp 2) pulls "r"; the rogue engine R pulls "bait", held on the same blocks: the three
    # destinations' chunks share their block ids, so they are packed in one launch
    x = RogueRig(1, 2, models=[RegionModel.gqa("l0", 4, 16)], timeout_s=1.0)
    try:
        p = x.pa[0]
        src, dst = np.array([17, 4]), np.array([30, 2])
        kv = x.request(src)
        p.hold("r", src)
        p.hold("bait", src)
        if rogue == "refused":  # its launch is refused (as a bad plan would be): it alone fails
            _refuse(monkeypatch, lambda seg: seg.num_heads == 4)  # R (tp 1) reads all 4 heads
        xid = x.rogue_pull("bait", src, chunk_blocks=2)
        for d in x.da:
            d.fetch("r", "P", src, dst, timeout_s=5.0)
            d.progress()
        _gather(p, 3, [d.progress for d in x.da] + [x.rogue_inbox])
        p.progress()
        if rogue == "refused":
            assert (p.stats["pack_launches"], p.stats["packed_chunks"]) == (2, 2)
        else:
            assert (p.stats["pack_launches"], p.stats["packed_chunks"]) == (1, 3)
        if rogue == "aborts":  # gone while its pack may still run: its slots wait for the launch
            x.forge(wire.Abort(xid))
        got = x.drive(2)
        assert all(r.ok for r in got), got
        x.check_honest(kv, dst)
        # the rogue's transfer expires (silent: 1 s) and its slots leave quarantine (1 s more)
        end = time.monotonic() + 6.0
        while (p.debug_state()["serves"] or p.pool.free_slots < p.pool.num_slots) and time.monotonic() < end:
            x.settle(0.05)
        assert not p.debug_state()["serves"]
        assert p.pool.free_slots == p.pool.num_slots and sum(p.debug_state()["staging"]["engine_slots"].values()) == 0
        x.check_prefill_untouched()
    finally:
        x.close()


@needs_nixl
def test_an_eager_pack_refused_for_one_rank_leaves_the_others_and_goes_lazily(engines, monkeypatch):
    e = engines(1, 4, models=[RegionModel.gqa("l0", 8, 16)], staging_bytes=64 << 10, p_blocks=64, d_blocks=48)
    rng = np.random.default_rng(13)
    src, dst = rng.permutation(64)[:5], rng.permutation(48)[:5]
    kv = e.request(src)
    p = e.pa[0]
    _refuse(monkeypatch, lambda seg: seg.src_head == 4)  # decode rank 2 of 4 reads heads 4-5
    p.hold("r", src, consumer="D")
    p.progress()  # the joint launch is refused: ranks 0, 1, 3 one launch each, rank 2's pack freed
    assert (p.stats["pack_launches"], p.stats["packed_chunks"]) == (3, 3)
    assert p.packed_ahead("r") == 3  # and already offered to their ranks
    assert sorted(s["rank"] for s in p.debug_state()["serves"] if s["offered"]) == [0, 1, 3]
    monkeypatch.undo()
    for d in e.da:
        d.fetch("r", "P", src, dst)
    _all_exact(e, kv, dst)
    e.settle_done()
    assert p.stats["eager_hits"] == 3 and p.stats["packed_chunks"] == 4  # rank 2 packed lazily
    assert p.pool.free_slots == p.pool.num_slots and p.debug_state()["staging"]["eager_slots"] == 0


@needs_nixl
def test_token_mapped_pulls_share_a_launch_too():
    # block sizes differ (4 -> 6 tokens): the four decode ranks' pulls carry the same token map
    from helpers.block_size_pair import Pair  # the block-size-change harness

    e = Pair(1, 4, 4, 6, "pull", models=[RegionModel.gqa("l0", 8, 16)], chunk_bytes=16 << 10)
    try:
        n_tok = 37  # partial last block on both sides
        src = np.random.default_rng(3).permutation(64)[:-(-n_tok // 4)]
        dst = np.random.default_rng(4).permutation(48)[:-(-n_tok // 6)]
        dst[0] = -1  # a prefix the decode side already has
        tokens = make_global_tokens(e.models, n_tok, e.gen)
        load_source_tokens(e.P[0], 0, 1, tokens, src)
        p = e.pa[0]
        p.hold("r", src)
        for d in e.da:
            d.fetch("r", "P", src, dst, num_tokens=n_tok)
            d.progress()
        _gather(p, 4, [d.progress for d in e.da])
        p.progress()
        assert (p.stats["pack_launches"], p.stats["packed_chunks"]) == (1, 4)
        got = e.drive(1)
        assert all(v[0].ok for v in got.values()), got
        for r in range(4):
            check_destination_tokens(e.D[r], r, 4, tokens, dst, e.before[r])
    finally:
        e.close()
