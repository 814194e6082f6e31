"""TransferAgent in one process: several agents over real NIXL (UCX), driven by hand.

The multi-process cluster tests (test_cluster.py) cover separate processes and faults; these
cover the protocol's paths quickly: pull/push, mixed regions, chunking and queueing, leases,
rejections and every bad-input path of the handshake."""

import time

import msgpack
import numpy as np
import pytest
import torch
from helpers.engines import MODELS

from kvtriton.agent import TransferAgent
from kvtriton.errors import (
    IncompatibleRemoteError,
    PlanError,
    ProtocolError,
    RequestAbortedError,
    RequestRejectedError,
    StagingError,
    TransferTimeoutError,
)
from kvtriton.protocol import wire
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination,
    concat_global_kv,
    make_rank_regions,
    snapshot,
)

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl



@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1)])
def test_mixed_regions_byte_exact_and_blocks_freed(engines, mode, p_tp, d_tp):
    e = engines(p_tp, d_tp, mode=mode)
    src, dst = np.array([9, 3, 4, 5, 40, 41]), np.array([0, 7, 8, 2, 30, 31])
    kv = e.request(src)
    for p in e.pa:
        p.hold("r", src)
    for d in e.da:
        d.fetch("r", "P", src, dst)
    got = e.drive(1)
    assert all(v[0].ok for v in got.values()), got
    for r in range(d_tp):
        check_destination(e.D[r], r, d_tp, kv, dst, e.before[r])
    e.settle()
    assert all([(f.req_id, f.reason) for f in p.freed()] == [("r", "done")] for p in e.pa)
    assert all(a.idle() and a.pool.free_slots == a.pool.num_slots for a in e.agents)


def test_triton_kernels_in_the_agent_path(engines):
    # the Triton interpreter's first launches took over the default 5 s on a host loaded by two suites:
    # what is checked is the bytes, so the fetch may take its time
    e = engines(2, 1, impl="triton", block_size=2, models=MODELS[:1], timeout_s=60.0)
    src, dst = np.array([5, 1]), np.array([3, 0])
    kv = e.request(src)
    for p in e.pa:
        p.hold("r", src)
    e.da[0].fetch("r", "P", src, dst)
    assert e.drive(1)[0][0].ok
    check_destination(e.D[0], 0, 1, kv, dst, e.before[0])


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_request_larger_than_staging_is_chunked(engines, mode):
    # one block of payload: l0 2 heads x 4 tok x 16 x 2B x 2 + l1 2 x 4 x 8 x 4B x 2 = 1 KiB; the
    # pool is 8 KiB, so 40 blocks (40 KiB) go in chunks of at most 2 KiB, two in flight.
    e = engines(1, 2, mode=mode, staging_bytes=8 << 10, p_blocks=64, d_blocks=64)
    src = np.arange(10, 50)
    dst = np.random.default_rng(1).permutation(64)[:40]
    kv = e.request(src)
    e.pa[0].hold("big", src)
    for d in e.da:
        d.fetch("big", "P", src, dst)
    got = e.drive(1)
    assert all(v[0].ok for v in got.values()), got
    assert all(v[0].descriptors > 10 for v in got.values())  # many chunks, one descriptor each
    for r in range(2):
        check_destination(e.D[r], r, 2, kv, dst, e.before[r])


def test_many_requests_queue_on_a_small_pool(engines):
    e = engines(2, 2, staging_bytes=8 << 10, p_blocks=200, d_blocks=200, models=MODELS[:1])
    rng = np.random.default_rng(2)
    src_all, dst_all = rng.permutation(200)[:192].reshape(32, 6), rng.permutation(200)[:192].reshape(32, 6)
    kvs = []
    for i in range(32):
        kvs.append(e.request(src_all[i]))
        for p in e.pa:
            p.hold(f"q{i}", src_all[i])
    for i in range(32):
        for d in e.da:
            d.fetch(f"q{i}", "P", src_all[i], dst_all[i])
    got = e.drive(32, timeout_s=60)
    assert all(r.ok for v in got.values() for r in v), [r for v in got.values() for r in v if not r.ok][:3]
    for r in range(2):
        check_destination(e.D[r], r, 2, concat_global_kv(kvs), dst_all.reshape(-1), e.before[r])


def test_lease_expiry_frees_blocks_and_late_fetch_is_rejected(engines):
    e = engines(1, 1, timeout_s=0.3)
    e.request(np.arange(4))
    e.pa[0].hold("old", np.arange(4), lease_s=0.05)
    # the hold was offered to D ahead (the eager guess), its DIRECT runs read from the cache: D
    # may be READing them unannounced, so its end is reported timeout_s after the lease
    # (Holds.keep_until)
    expired, freed = time.monotonic() + 0.05, []
    deadline = time.monotonic() + 5
    while not freed:
        assert time.monotonic() < deadline, "the hold was never freed"
        e.settle(0.02)
        freed = e.pa[0].freed()
    assert [(f.req_id, f.reason) for f in freed] == [("old", "lease_expired")]
    assert e.pa[0].stats["eager_offers"] == 1 and time.monotonic() - expired >= 0.3
    assert e.pa[0].stats["leases_expired"] == 1
    e.da[0].fetch("old", "P", np.arange(4), np.arange(4))
    res = e.drive(1)[0][0]
    assert not res.ok and isinstance(res.error, RequestRejectedError) and "not held" in str(res.error)
    assert e.da[0].pool.free_slots == e.da[0].pool.num_slots


def test_fetch_times_out_when_the_source_never_answers(engines):
    e = engines(1, 1, timeout_s=0.3, models=MODELS[:1])
    e.pa[0].hold("r", [1, 2])
    e.da[0].fetch("r", "P", [1, 2], [3, 4])
    deadline = time.monotonic() + 5
    res = []
    while not res and time.monotonic() < deadline:
        e.da[0].progress()  # the prefill agent is never driven: it looks dead
        res = e.da[0].results()
    assert res and isinstance(res[0].error, TransferTimeoutError) and "source ranks [0]" in str(res[0].error)
    assert e.da[0].pool.free_slots == e.da[0].pool.num_slots


def test_bad_ids_raise_before_anything_moves(engines):
    e = engines(1, 1)
    with pytest.raises(PlanError, match="out of range"):
        e.da[0].fetch("r", "P", [0, 64], [0, 1])
    with pytest.raises(PlanError, match="repeat"):
        e.da[0].fetch("r", "P", [0, 1], [5, 5])
    with pytest.raises(KeyError, match="unknown engine"):
        e.da[0].fetch("r", "Q", [0], [0])
    with pytest.raises(RequestRejectedError, match="block ids must be in"):
        e.pa[0].hold("r", [70])
    assert e.da[0].idle()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_zero_copy_regions_are_never_read_without_a_hold(engines, mode):
    # an MLA-only cache moves zero-copy; an unheld request must fail, not read stale blocks
    e = engines(1, 2, mode=mode, models=[RegionModel.mla("mla", 24)])
    before = snapshot(e.D[0])
    e.da[0].fetch("never-held", "P", [1, 2], [3, 4])
    res, deadline = None, time.monotonic() + 5
    while res is None and time.monotonic() < deadline:
        for a in e.agents:
            a.progress()
        got = e.da[0].results()
        res = got[0] if got else None
    assert res is not None and isinstance(res.error, RequestRejectedError), res
    assert all(torch.equal(x, y) for x, y in zip(snapshot(e.D[0])[0], before[0]))


def test_ids_outside_the_held_blocks_are_rejected(engines):
    e = engines(1, 1)
    e.pa[0].hold("r", [1, 2, 3])
    e.da[0].fetch("r", "P", [1, 2, 9], [0, 1, 2])
    res = e.drive(1)[0][0]
    assert isinstance(res.error, RequestRejectedError) and "not a subset" in str(res.error)


def test_forged_ready_outside_staging_fails_the_request(engines):
    e = engines(1, 1, models=MODELS[:1])
    e.pa[0].hold("r", [1, 2])
    e.da[0].fetch("r", "P", [1, 2], [3, 4])
    xid = next(iter(e.da[0].debug_state()["parts"]))
    forged = wire.Ready(xid, chunk=0, slot=10_000, nslots=1, nbytes=512).encode()
    e.pa[0].transport.send_notif(e.da[0].transport.name, forged)
    deadline, res = time.monotonic() + 5, []
    while not res and time.monotonic() < deadline:
        e.pa[0].transport.poll_notifs()  # UCX needs the sender driven to deliver (P never serves)
        e.da[0].progress()
        res = e.da[0].results()
    assert res and isinstance(res[0].error, ProtocolError) and "does not match" in str(res[0].error)
    assert e.da[0].stats["bad_messages"] == 1


def test_handshake_gate(engines):
    e = engines(1, 1, connect=False)
    d = e.da[0]
    good = e.pa[0].metadata()
    raw = msgpack.unpackb(good, raw=False)

    def variant(**kw):
        x = msgpack.unpackb(good, raw=False)
        x.update(kw)
        return msgpack.packb(x, use_bin_type=True)

    with pytest.raises(ProtocolError, match="not valid msgpack"):
        d.add_remote(good[: len(good) // 2])
    with pytest.raises(ProtocolError, match="protocol version"):
        d.add_remote(variant(v=wire.PROTOCOL_VERSION + 1))
    regions = [dict(r) for r in raw["regions"]]
    regions[0]["spans"] = [1, 1]
    with pytest.raises(ProtocolError, match="cannot hold"):
        d.add_remote(variant(regions=regions))
    regions = [dict(r) for r in raw["regions"]]
    regions[2].update(dtype="float16", itemsize=2)
    with pytest.raises(IncompatibleRemoteError, match=r"region 2 \('l1'\): dtype differs"):
        d.add_remote(variant(regions=regions))
    with pytest.raises(IncompatibleRemoteError, match="region count"):
        d.add_remote(variant(regions=raw["regions"][:2]))
    with pytest.raises(IncompatibleRemoteError, match="slot_bytes"):
        d.add_remote(variant(staging={**raw["staging"], "slot_bytes": 2048}))
    with pytest.raises(IncompatibleRemoteError, match="this engine"):
        d.add_remote(e.da[0].metadata())
    assert not d.debug_state()["peers"] and d.transport.remotes == frozenset()  # nothing was connected
    d.add_remote(good)
    assert d.plan_for("P").source_ranks == (0,)


def _deliver(e, src_agent, dst_agent, raw):
    """Send raw bytes as a notification from one agent's transport to another's."""
    src_agent.transport.send_notif(dst_agent.transport.name, raw)


def test_garbage_messages_never_stop_progress(engines):
    e = engines(1, 1, models=MODELS[:1])
    src, dst = np.array([1, 2, 3]), np.array([4, 5, 6])
    kv = e.request(src)
    e.pa[0].hold("r", src)
    for raw in [
        msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": ["Pull"]}),  # unhashable type
        msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "Pull", "xid": "x", "req": "r", "dst_rank": 0, "ids": [2**63],
                       "chunk_blocks": 1, "plan": "p"}),  # overflows int64
        msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": "Ack", "xid": "x", "chunk": 2**60}),
        b"\x00\x01garbage",
    ]:
        _deliver(e, e.da[0], e.pa[0], raw)
    e.da[0].fetch("r", "P", src, dst)  # a real request right behind the garbage
    res = e.drive(1)[0][0]
    assert res.ok, res
    check_destination(e.D[0], 0, 1, kv, dst, e.before[0])
    assert e.pa[0].stats["bad_messages"] == 4


def test_duplicate_ready_fails_the_request(engines):
    # the pool allows 2 chunks of 1 KiB: chunk 0 announced twice must not count as chunk 1
    e = engines(1, 1, models=MODELS[:1], staging_bytes=4 << 10)
    e.pa[0].hold("r", np.arange(8))
    e.da[0].fetch("r", "P", np.arange(8), np.arange(8, 16))
    xid, part = next(iter(e.da[0].debug_state()["parts"].items()))
    assert part["chunks"] > 1
    dup = wire.Ready(xid, chunk=0, slot=0, nslots=1, nbytes=1024).encode()
    _deliver(e, e.pa[0], e.da[0], dup)
    _deliver(e, e.pa[0], e.da[0], dup)
    res = e.drive(1)[0][0]
    assert not res.ok and isinstance(res.error, ProtocolError) and "duplicate" in str(res.error)


@pytest.mark.parametrize("setting,kw", [
    ("replicate_stripe", dict(replicate_stripe=1)),  # decode reads MLA from one replica, prefill expects two
    ("modes", dict(modes="staged")),
])  # cost models may differ: the source plans with the destination's (tests/agent/test_costmodel.py)
def test_engines_with_different_planning_settings_refuse_to_connect(setting, kw):
    # they would plan the same transfer differently: refused at the handshake, naming the setting
    gen = torch.Generator().manual_seed(0)
    models = [RegionModel.mla("mla", 24)]
    base = dict(staging_bytes=64 << 10, slot_bytes=1024, timeout_s=5, impl="torch")
    p = TransferAgent("P", 0, 2, make_rank_regions(models, 0, 2, 8, 4, gen=gen), **base)
    d = TransferAgent("D", 0, 1, make_rank_regions(models, 0, 1, 8, 4, gen=gen), **base, **kw)
    try:
        for a, b in ((d, p), (p, d)):
            with pytest.raises(IncompatibleRemoteError, match=f"planning setting '{setting}'"):
                a.add_remote(b.metadata())
            assert not a.debug_state()["peers"] and a.transport.remotes == frozenset()
    finally:
        p.close()
        d.close()


def test_close_reports_pending_fetches(engines):
    e = engines(1, 1, models=MODELS[:1])
    e.pa[0].hold("r", [1])
    e.da[0].fetch("r", "P", [1], [2])
    e.da[0].close()
    res = e.da[0].results()
    assert len(res) == 1 and not res[0].ok and "closed" in str(res[0].error)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_abort_cancels_a_fetch_and_frees_staging_on_both_sides(engines, mode):
    e = engines(1, 1, mode=mode, models=MODELS[:1], timeout_s=0.5)
    src = np.arange(8)
    e.request(src)
    e.pa[0].hold("r", src)
    e.da[0].fetch("r", "P", src, np.arange(8))
    e.da[0].progress()  # the request is on the wire; the source has not answered yet
    assert e.da[0].abort("r") and not e.da[0].abort("r")
    res = e.da[0].results()
    assert len(res) == 1 and not res[0].ok and isinstance(res[0].error, RequestAbortedError)
    e.settle(0.2)
    assert not e.pa[0].debug_state()["serves"]  # the source was told (well before its 0.5 s silence deadline)
    e.settle(1.0)  # push quarantines granted slots for timeout_s
    assert e.da[0].results() == []  # nothing more is reported for an aborted fetch
    assert all(a.pool.free_slots == a.pool.num_slots and not a.debug_state()["serves"] for a in e.agents)
    # the hold survives the abort: a retry still works
    e.da[0].fetch("r", "P", src, np.arange(8))
    assert e.drive(1)[0][0].ok


def test_release_drops_a_hold_and_a_fetch_fails_at_once(engines):
    e = engines(1, 1, models=MODELS[:1], timeout_s=30.0)
    src = np.arange(4)
    e.request(src)
    e.pa[0].hold("r", src)
    assert e.pa[0].release("r") and not e.pa[0].release("r")
    assert [(f.req_id, f.reason) for f in e.pa[0].freed()] == [("r", "released")]
    e.da[0].fetch("r", "P", src, np.arange(4))
    t0 = time.monotonic()
    res = e.drive(1)[0][0]
    assert not res.ok and isinstance(res.error, RequestRejectedError) and time.monotonic() - t0 < 5


def test_a_block_larger_than_a_chunk_fails_the_fetch_with_a_staging_error(engines):
    e = engines(1, 1, models=MODELS[:1], block_size=16, chunk_bytes=1024)
    e.pa[0].hold("r", [1, 2])
    e.da[0].fetch("r", "P", [1, 2], [3, 4])
    res = e.da[0].results()  # reported at once: nothing was sent
    assert len(res) == 1 and isinstance(res[0].error, StagingError) and "more than a chunk" in str(res[0].error)
    assert e.da[0].pool.free_slots == e.da[0].pool.num_slots


def test_debug_state_is_plain_json_with_the_documented_keys(engines):
    """debug_state() is the contract tests read (kvtriton.agent.debug documents every key): plain
    JSON values only, the same keys on every agent, mid-transfer included."""
    import json

    e = engines(1, 2, staging_bytes=64 << 10)
    src, dst = np.array([9, 3, 4]), np.array([0, 7, 8])
    kv = e.request(src)
    e.pa[0].hold("r", src, consumer="D")
    e.pa[0].hold("guessed", [1, 2])
    e.settle(0.1)  # both packed ahead and offered to both decode ranks (the second by eager_guess)
    e.da[0].fetch("r", "P", src, dst)
    keys = {"engine", "rank", "tp", "flow", "settings", "peers", "holds", "serves", "serve_counts", "offered", "eager",
            "staging", "plans", "reading", "fetches", "parts", "parts_by_way", "offers", "warmed", "inbox", "stalls"}
    p, d = e.pa[0].debug_state(), e.da[0].debug_state()
    for state in (p, d, e.da[1].debug_state()):
        assert set(state) == keys and json.loads(json.dumps(state)) == state
    assert p["holds"]["r"]["consumer"] == "D" and p["holds"]["guessed"]["block_ids"] == [1, 2]
    assert sorted(p["offered"]["r"]) == ["D:0", "D:1"] and p["serve_counts"]["by_engine"] == {"D": 4}
    assert sorted(p["peers"]) == ["D:0", "D:1"] and len(p["plans"]) == 2
    assert all(x["staged_from_me"] for x in p["plans"])
    assert d["fetches"]["r"]["engine"] == "P" and set(d["parts"]) == set(d["fetches"]["r"]["parts"])
    assert sum(d["parts_by_way"].values()) == len(d["parts"]) == 1 and "P" in d["reading"]
    end = time.monotonic() + 20
    while not (res := e.da[0].results()) and time.monotonic() < end:
        for a in e.agents:
            a.progress()
    assert res and res[0].ok, res
    check_destination(e.D[0], 0, 2, kv, dst, e.before[0])


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_cache_to_cache_lists_are_prepared_once_per_peer(engines, mode):
    """DIRECT runs and direct slices post indices into lists prepared once per peer (vLLM's own
    per-request path): many requests, scattered and in runs, each byte-exact, and each peer
    keeps the one set of lists it was first read by; the counted descriptors are the runs NIXL
    posts once the pairs adjacent on both sides merged."""
    models = [RegionModel.gqa("l0", 4, 16), RegionModel.mla("mla", 24, torch.float16)]
    e = engines(2, 1, mode=mode, models=models, p_layout="HND", p_storage="separate", modes="direct_slice")
    rng = np.random.default_rng(7)
    posting = e.da if mode == "pull" else e.pa  # the side that posts the READs (pull) or WRITEs (push)
    for k, run in enumerate((False, True, False, True)):
        n = 9
        src = np.arange(20, 20 + n) if run else rng.permutation(64)[:n]
        dst = np.arange(3, 3 + n) if run else rng.permutation(48)[:n]
        before = [snapshot(x) for x in e.D]
        kv = e.request(src)
        for p in e.pa:
            p.hold(f"r{k}", src)
        e.da[0].fetch(f"r{k}", "P", src, dst)
        res = e.drive(1)[0]
        assert res[0].ok, res
        check_destination(e.D[0], 0, 1, kv, dst, before[0])
        if mode == "pull":
            # l0: each prefill rank's 2 of 4 heads into our blocks, one per (rank, K/V, block) whatever
            # the runs; the latent: half the positions from each replica, one run each when in runs
            assert res[0].descriptors == 2 * 2 * n + (2 if run else n)
        for a in posting:
            peers = a.debug_state()["peers"]
            assert all(v["row_lists"] == 1 for v in peers.values()), peers
        e.settle()


def test_messages_are_fenced_reading_only_the_peers_staging(engines):
    """After the decode's messages to a source (RunsDone, Done) one fence READ follows in the
    background (``NixlTransport.fences``): over a transport whose messages lack remote completion (TCP
    here) a later READ would otherwise wait for that source's next progress. Each fence reads
    the source's staging into a buffer of the reader's own and is released once landed; loads
    stay byte-exact and the sources' staging is untouched. Only the side that posts transfers
    fences: a source that only messages (its offers) never does, since a fence of its own made
    the decode's next READ wait for the source's progress. So with the offers taken in, a load
    lands with only the decode rank progressing (after the first two, which wire UCX up)."""
    models = [RegionModel.mla("mla", 64, torch.float16), RegionModel.mla("mla2", 32, torch.float16)]
    e = engines(2, 1, models=models, p_layout="HND", p_storage="separate")
    rng = np.random.default_rng(11)
    staging_before = [a.pool.tensor.clone() for a in e.pa]
    for k in range(4):
        src, dst = rng.permutation(64)[:10], rng.permutation(48)[:10]
        before = [snapshot(x) for x in e.D]
        kv = e.request(src)
        for p in e.pa:
            p.hold(f"r{k}", src, consumer="D")
        e.settle(0.1)
        e.da[0].fetch(f"r{k}", "P", src, dst)
        res = e.drive(1, agents=e.da if k >= 2 else None)[0]
        assert res[0].ok, res
        check_destination(e.D[0], 0, 1, kv, dst, before[0])
        e.settle(0.2)
        peers = e.da[0].debug_state()["peers"]
        # one fence per load per source rank (its RunsDone and Done), landed and released
        assert all(v["fences"] == k + 1 and not v["fencing"] and not v["unflushed"] for v in peers.values()), peers
        assert all(v["fences"] == 0 for p in e.pa for v in p.debug_state()["peers"].values())
    assert all(torch.equal(a.pool.tensor, b) for a, b in zip(e.pa, staging_before))


def test_flow_is_the_name_and_mode_its_alias():
    """``flow=`` names pull/push; ``mode=`` (its old name) still works for one release, and the
    two may not disagree. Checked before any NIXL agent is made (transport given)."""
    from kvtriton.agent.settings import Flow, flow_of

    assert flow_of(None, None) is Flow.PULL
    assert flow_of("push", None) is Flow.PUSH and flow_of(None, "push") is Flow.PUSH
    assert flow_of("pull", "pull") is Flow.PULL
    with pytest.raises(ValueError, match="disagree"):
        flow_of("pull", "push")
    with pytest.raises(ValueError, match="flow must be 'pull' or 'push'"):
        flow_of("sideways", None)
    with pytest.raises(ValueError, match="mode must be 'pull' or 'push'"):
        flow_of(None, "sideways")
