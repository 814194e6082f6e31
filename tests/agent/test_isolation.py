"""The memory model narrowed (issue 18, item 6; docs/security.md): staging-only registration and
per-chunk integrity digests, over real NIXL in one process.

``register="staging"``: the metadata carries no cache address, every region is STAGED with only
the pack-READ-unpack way, a raw NIXL READ of the cache from a peer fails in the transport (the
memory is not registered) while the same READ of a default agent's cache succeeds, and a fetch
is byte-exact against the oracle. ``integrity=True``: byte-exact fetches, and a chunk whose
staging bytes are changed between its pack and its READ (pull: announced by Ready or by an
Offer; push: after the WRITE landed, before Data is handled) fails the fetch with
IntegrityError, every block undefined, no staging slot kept. Pull and push."""

import time

import msgpack
import numpy as np
import pytest
import torch

from kvtriton.agent import TransferAgent
from kvtriton.errors import IncompatibleRemoteError, IntegrityError, PlanError, ProtocolError, TransportError
from kvtriton.plan import Route, Way
from kvtriton.protocol import wire
from kvtriton.testing.oracle import RegionModel, check_destination, make_rank_regions
from kvtriton.testing.pair import EnginePair
from kvtriton.testing.seams import Wiretap
from kvtriton.transport.nixl import NixlTransport, XferStatus

pytestmark = pytest.mark.nixl

# a SPLIT region that could go DIRECT (same layout, P1 -> D1) and an MLA one that would by default
MODELS = [RegionModel.gqa("l0", 4, 16), RegionModel.mla("mla", 24, torch.float16)]
SAME_LAYOUT = dict(p_layout="HND", d_layout="HND", p_storage="separate")


def _exact(e: EnginePair, kv, dst) -> None:
    for r in range(e.d_tp):
        check_destination(e.D[r], r, e.d_tp, kv, dst, e.before[r])


def _no_leak(e: EnginePair, timeout_s: float = 10.0) -> None:
    """Progress until every agent's staging is all free again (quarantines included)."""
    deadline = time.monotonic() + timeout_s
    while any(a.pool.free_slots != a.pool.num_slots for a in e.agents):
        assert time.monotonic() < deadline, f"staging kept: {[(a.pool.free_slots, a.pool.num_slots) for a in e.agents]}"
        for a in e.agents:
            a.progress()
        for p in e.pa:
            p.freed()
        time.sleep(0.01)


# --------------------------------------------------------------------------- staging only
@pytest.mark.parametrize("flow", ["pull", "push"])
def test_staging_only_exposes_no_cache_and_moves_exact_bytes(flow):
    with EnginePair(1, 1, models=MODELS, mode=flow, **SAME_LAYOUT) as default:
        plan = default.da[0].plan_for("P")
        # the control: by default this pair reads the cache directly (so the check below can fail)
        assert Route.DIRECT in plan.routes or any(len(p.ways) > 1 for p in plan.staged)
    with EnginePair(1, 1, models=MODELS, mode=flow, register="staging", **SAME_LAYOUT, seed=1) as e:
        for a in e.agents:
            md = wire.decode_metadata(a.metadata())
            assert md.addrs == ((),) * len(MODELS) and md.spans == ((),) * len(MODELS)
            assert dict(md.planning)["register"] == "staging"
        plan = e.da[0].plan_for("P")
        assert plan.routes == (Route.STAGED,) * len(MODELS) and not plan.direct
        assert all(p.ways == (Way.STAGED,) for p in plan.staged)
        src, dst = np.array([7, 3, 11, 2, 5]), np.array([0, 4, 1, 9, 2])
        kv, _ = e.start(src, dst)
        res = e.drive(1)[0][0]
        assert res.ok, res.error
        _exact(e, kv, dst)
        assert e.da[0].stats["direct_descriptors"] == 0 and e.da[0].stats["one_sided_descriptors"] == 0


@pytest.mark.parametrize("register", ["all", "staging"])
def test_raw_nixl_read_of_the_cache(register):
    # a peer holding the rank's metadata: by default it READs the cache at will; staging-only,
    # the cache is not registered and NIXL refuses the descriptors; staging stays readable
    regs = make_rank_regions(MODELS, 0, 1, 16, 4, gen=torch.Generator().manual_seed(2))
    agent = TransferAgent("P", 0, 1, regs, staging_bytes=16 << 10, slot_bytes=1024, impl="torch", register=register)
    raw = NixlTransport("raw-reader")
    try:
        cache = regs[0].streams[0]
        n = cache.untyped_storage().nbytes()
        buf = torch.zeros(n, dtype=torch.uint8)
        raw.register(buf)
        local = raw.prep_local(np.array([[buf.data_ptr(), n, 0]]), "DRAM")
        name = raw.add_remote(wire.decode_metadata(agent.metadata()).agent_md)
        target = np.array([[cache.untyped_storage().data_ptr(), n, 0]])
        staging = raw.prep_remote(name, np.array([[agent.pool.addr, 1024, 0]]), "DRAM")  # always allowed
        assert staging is not None
        if register == "staging":
            assert not raw.has_remote(name, target)
            with pytest.raises(TransportError, match="not all inside memory registered"):
                raw.prep_remote(name, target, "DRAM")
            return
        assert raw.has_remote(name, target)
        rem = raw.prep_remote(name, target, "DRAM")
        x = raw.post("READ", local, [0], rem, [0])
        deadline = time.monotonic() + 10
        while x.status is not XferStatus.DONE:
            assert time.monotonic() < deadline
            agent.progress()
            raw.poll(x)
        want = torch.frombuffer(bytearray(bytes(cache.untyped_storage())), dtype=torch.uint8)
        assert torch.equal(buf, want)  # the whole cache, read without asking
    finally:
        raw.close()
        agent.close()


@pytest.mark.parametrize("option", [dict(register="staging"), dict(integrity=True)])
@pytest.mark.parametrize("modes", ["direct", "read_unpack", "pack_place", {"l0": "staged", "mla": "direct"}])
def test_forcing_direct_or_one_sided_is_refused(option, modes):
    regs = make_rank_regions(MODELS, 0, 1, 8, 4, gen=torch.Generator().manual_seed(3))
    name = "register='staging'" if "register" in option else "integrity=True"
    with pytest.raises(PlanError, match=name):
        TransferAgent("P", 0, 1, regs, staging_bytes=16 << 10, slot_bytes=1024, modes=modes, **option)


def test_staging_only_with_modes_staged_is_accepted_and_bad_register_value_refused():
    regs = make_rank_regions(MODELS, 0, 1, 8, 4, gen=torch.Generator().manual_seed(3))
    TransferAgent("P", 0, 1, regs, staging_bytes=16 << 10, slot_bytes=1024, modes="staged", register="staging").close()
    with pytest.raises(ValueError, match="register must be"):
        TransferAgent("P", 0, 1, regs, staging_bytes=16 << 10, slot_bytes=1024, register="cache")


@pytest.mark.parametrize("setting,kw", [("register", dict(register="staging")), ("integrity", dict(integrity=True))])
def test_engines_must_agree_on_register_and_integrity(setting, kw):
    with EnginePair(1, 1, models=MODELS, connect=False, **SAME_LAYOUT) as e:
        regs = make_rank_regions(MODELS, 0, 1, 8, 4, layout="HND", gen=torch.Generator().manual_seed(4))
        other = TransferAgent("Q", 0, 1, regs, staging_bytes=64 << 10, slot_bytes=1024, impl="torch", **kw)
        try:
            for a, b in ((e.da[0], other), (other, e.da[0])):
                with pytest.raises(IncompatibleRemoteError, match=f"planning setting '{setting}'"):
                    a.add_remote(b.metadata())
                assert not a.debug_state()["peers"]
        finally:
            other.close()


def test_peer_without_cache_addresses_is_refused_when_the_plan_needs_them():
    # a staging-only peer whose metadata claims the default setting: the plan (DIRECT, one-sided)
    # would reach a cache it does not expose; refused at add_remote naming the option
    with EnginePair(1, 1, models=MODELS, connect=False, **SAME_LAYOUT) as e:
        regs = make_rank_regions(MODELS, 0, 1, 64, 4, layout="HND", storage="separate",
                                 gen=torch.Generator().manual_seed(5))
        p = TransferAgent("Q", 0, 1, regs, staging_bytes=64 << 10, slot_bytes=1024, impl="torch", register="staging")
        try:
            d = msgpack.unpackb(p.metadata(), raw=False)
            d["planning"] = [list(x) for x in wire.decode_metadata(e.da[0].metadata()).planning]
            with pytest.raises(IncompatibleRemoteError, match="register='staging'"):
                e.da[0].add_remote(msgpack.packb(d, use_bin_type=True))
            assert not e.da[0].debug_state()["peers"]
            # addresses in some regions only: malformed
            d = msgpack.unpackb(e.pa[0].metadata(), raw=False)
            d["regions"][1]["addrs"], d["regions"][1]["spans"] = [], []
            with pytest.raises(ProtocolError, match="or none in any"):
                wire.decode_metadata(msgpack.packb(d, use_bin_type=True))
        finally:
            p.close()


# --------------------------------------------------------------------------- integrity
@pytest.mark.parametrize("flow,tps", [("pull", (1, 2)), ("pull", (2, 1)), ("push", (1, 2))])
def test_integrity_fetch_is_byte_exact(flow, tps):
    with EnginePair(*tps, models=MODELS, mode=flow, integrity=True, staging_bytes=16 << 10, seed=6) as e:
        assert all(r is Route.STAGED for r in e.da[0].plan_for("P").routes)
        src, dst = np.array([4, 9, 1, 30, 12, 6, 7]), np.array([3, 0, 8, 2, 5, 11, 1])
        kv, _ = e.start(src, dst)
        got = e.drive(1)
        assert all(r[0].ok for r in got.values()), got
        _exact(e, kv, dst)
        assert sum(a.stats["digested_chunks"] for a in e.pa) > 0
        assert sum(a.stats["digested_chunks"] for a in e.da) > 0
        assert sum(a.stats["integrity_failures"] for a in e.da) == 0


def _scribble(t: torch.Tensor) -> None:
    t.add_(1)  # every byte changes (uint8 wraps)


def _until_seen(tap: Wiretap, kind, *agents, timeout_s: float = 10.0):
    """Progress ``agents`` until ``tap`` holds back a ``kind`` message (bounded); the first one."""
    deadline = time.monotonic() + timeout_s
    while not tap.seen(kind):
        assert time.monotonic() < deadline, f"no {kind.__name__} within {timeout_s} s"
        for a in agents:
            a.progress()
        tap.poll()
    return tap.seen(kind)[0]


def _failed_typed(e: EnginePair, dst) -> None:
    res = e.drive(1, timeout_s=15)[0][0]
    assert not res.ok and isinstance(res.error, IntegrityError), res.error
    assert "does not match the digest" in str(res.error)
    assert sorted(res.undefined_blocks) == sorted(int(i) for i in dst if i >= 0)
    assert e.da[0].stats["integrity_failures"] == 1


def test_integrity_pull_detects_staging_changed_before_the_read():
    # no eager pack: the source announces each chunk by Ready; the decode holds the first one back
    # while the test changes the source's staging under it
    with EnginePair(1, 1, models=MODELS, integrity=True, staging_bytes=8 << 10, eager_bytes=0, timeout_s=1.0,
                    seed=7) as e:
        src, dst = np.array([5, 6, 7, 8, 9, 10]), np.array([1, 2, 3, 4, 5, 6])
        tap = Wiretap(e.da[0])
        tap.hold()
        e.request(src)
        e.pa[0].hold("r", src, lease_s=2.0)
        e.da[0].fetch("r", "P", src, dst)
        ready = _until_seen(tap, wire.Ready, e.pa[0], e.da[0])
        assert len(ready.digest) == wire.DIGEST_BYTES
        _scribble(e.pa[0].pool.view(ready.slot, ready.nbytes))
        tap.release()
        _failed_typed(e, dst)
        tap.close()
        _no_leak(e)


def test_integrity_offer_detects_staging_changed_before_the_read():
    # an eager pack offered ahead of the pull: the digests ride on the Offer
    with EnginePair(1, 1, models=MODELS, integrity=True, staging_bytes=16 << 10, timeout_s=1.0, seed=8) as e:
        src, dst = np.array([2, 3, 4, 5]), np.array([7, 8, 9, 10])
        tap = Wiretap(e.da[0])
        tap.hold()
        e.request(src)
        e.pa[0].hold("r", src, lease_s=2.0, consumer="D")
        offer = _until_seen(tap, wire.Offer, e.pa[0])
        assert len(offer.digests) == wire.DIGEST_BYTES * (len(offer.slots) // 2)
        _scribble(e.pa[0].pool.view(offer.slots[0], 64))
        tap.release()
        e.da[0].progress()  # the offer is kept
        assert e.da[0].has_offer("P", "r")
        e.da[0].fetch("r", "P", src, dst)
        _failed_typed(e, dst)
        assert e.da[0].stats["offers_taken"] == 1
        tap.close()
        _no_leak(e)


def test_integrity_push_detects_staging_changed_after_the_write():
    # push: the source WRITEs into the slot the decode granted; the Data notice is held back
    # while the test changes the landed bytes in the decode's own staging
    with EnginePair(1, 1, models=MODELS, mode="push", integrity=True, staging_bytes=8 << 10, timeout_s=1.0,
                    seed=9) as e:
        src, dst = np.array([11, 12, 13, 14, 15]), np.array([0, 1, 2, 3, 4])
        grants, tap = Wiretap(e.pa[0]), Wiretap(e.da[0])
        tap.hold()
        e.request(src)
        e.pa[0].hold("r", src, lease_s=2.0)
        e.da[0].fetch("r", "P", src, dst)
        data = _until_seen(tap, wire.Data, e.pa[0], e.da[0])
        grant = next(g for g in grants.seen(wire.Grant) if g.chunk == data.chunk)
        _scribble(e.da[0].pool.view(grant.slot, data.nbytes))
        tap.release()
        _failed_typed(e, dst)
        tap.close()
        grants.close()
        _no_leak(e)


def test_integrity_digest_field_is_validated():
    ok = wire.Ready("x", 0, 0, 1, 10, b"\0" * wire.DIGEST_BYTES)
    assert wire.decode_message(ok.encode()) == ok
    for bad in (b"\0" * 5, b"\0" * (wire.DIGEST_BYTES * 2)):
        with pytest.raises(ProtocolError, match="digest"):
            wire.decode_message(wire.Ready("x", 0, 0, 1, 10, bad).encode())
    with pytest.raises(ProtocolError, match="digest"):
        wire.decode_message(wire.encode_message("Data", xid="x", chunk=0, nbytes=1, digest="not bytes"))
    # absent: none (a peer without integrity); the destination with integrity on then refuses the chunk
    assert wire.decode_message(wire.encode_message("Ready", xid="x", chunk=0, slot=0, nslots=1, nbytes=1)).digest == b""
    offer = wire.Offer("x", "r", "p", "i", 2, 1, (0, 1, 1, 1), digests=b"\1" * (2 * wire.DIGEST_BYTES))
    assert wire.decode_message(offer.encode()) == offer


def test_integrity_refuses_a_chunk_announced_without_digest():
    # the source's real Ready is dropped and one without a digest is sent in its place: the
    # destination READs the (intact) bytes but will not unpack what it cannot check
    with EnginePair(1, 1, models=MODELS, integrity=True, staging_bytes=8 << 10, eager_bytes=0, timeout_s=1.0,
                    seed=10) as e:
        src, dst = np.array([5, 6, 7]), np.array([1, 2, 3])
        tap, forger = Wiretap(e.da[0]), Wiretap(e.pa[0])
        tap.hold()
        e.request(src)
        e.pa[0].hold("r", src, lease_s=2.0)
        e.da[0].fetch("r", "P", src, dst)
        real = _until_seen(tap, wire.Ready, e.pa[0], e.da[0])
        deadline = time.monotonic() + 10
        tap.held.clear()  # the real announcement never reaches the agent
        forger.send(e.da[0], wire.Ready(real.xid, real.chunk, real.slot, real.nslots, real.nbytes))
        while len(tap.seen(wire.Ready)) < 2:
            assert time.monotonic() < deadline
            tap.poll()
        tap.release()
        res = e.drive(1, timeout_s=15)[0][0]
        assert not res.ok and isinstance(res.error, IntegrityError) and "without a digest" in str(res.error)
        assert sorted(res.undefined_blocks) == sorted(dst.tolist())
        tap.close()
        forger.close()
        _no_leak(e)
