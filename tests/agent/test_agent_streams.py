"""Ordering of an agent's kernels with the engine (hold(after=), the agent's stream, completions)
and warmup(), over real NIXL in one process.

On CPU the kernels run synchronously, so the CUDA events are replaced by a stand-in with the same
``query()`` whose completion the test controls: what must wait for the engine's writes (DIRECT
regions offered or written to the peer) waits, byte-exactly, and then goes on. The CUDA versions
(the agent's own stream waiting for the engine's stream on the device) are the ``gpu`` tests at
the end, which skip without a CUDA device.
"""

import contextlib
import time

import numpy as np
import pytest
import torch

from kvtriton.agent import TransferAgent
from kvtriton.agent.device import Completion, Lanes, ready_event
from kvtriton.ops import LaunchConfig, launch_config_for, pack
from kvtriton.plan import build_plan
from kvtriton.testing.oracle import RegionModel, check_destination, make_rank_regions, snapshot
from kvtriton.testing.seams import (
    agent_lanes,
    reap,
    replace_lanes,
    retire_chunks,
    set_fetch_event,
    set_hold_event,
)

pytest.importorskip("nixl", reason="the agent's transport needs NIXL: pip install 'kvtriton[nixl]'")

pytestmark = pytest.mark.nixl


class PendingEvent:
    """A CUDA event's host-side interface (``query``) whose completion the test decides."""

    def __init__(self):
        self.complete = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.complete


def _spin(e, seconds=0.3, until=None):
    """Progress every agent for ``seconds``, or until ``until(results so far)`` (then at most 30 s:
    a loaded machine is slow); returns decode rank 0's results."""
    got = []
    end = time.monotonic() + (30.0 if until is not None else seconds)
    while time.monotonic() < end and not (until is not None and until(got)):
        for a in e.agents:
            a.progress()
        got += e.da[0].results()
    return got


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_direct_regions_wait_for_the_holds_event(engines, mode):
    """A DIRECT (zero-copy) region is read by the NIC straight from the cache: it must not be
    offered (pull) or written (push) before the engine's writes to the held blocks are done."""
    e = engines(1, 2, mode=mode, models=[RegionModel.mla("mla", 24)])
    src, dst = np.array([4, 9, 2]), np.array([1, 0, 5])
    kv = e.request(src)
    e.pa[0].hold("r", src)
    pending = PendingEvent()
    set_hold_event(e.pa[0], "r", pending)  # the engine is still writing these blocks
    e.da[0].fetch("r", "P", src, dst)
    assert _spin(e, until=lambda got: got or pending.queries) == [] and _spin(e) == []
    assert pending.queries > 0  # asked, and nothing offered or written yet: no result, the cache untouched
    assert all(torch.equal(x, y) for x, y in zip(snapshot(e.D[0])[0], e.before[0][0]))
    assert e.pa[0].stats["direct_descriptors"] == 0 and e.da[0].stats["direct_descriptors"] == 0
    pending.complete = True
    got = _spin(e, until=bool)
    assert len(got) == 1 and got[0].ok, got
    check_destination(e.D[0], 0, 2, kv, dst, e.before[0])


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_wait_on_the_engine_is_not_the_peers_silence(engines, mode):
    """While the hold's event is pending the source's transfer deadline does not run out."""
    e = engines(1, 2, mode=mode, models=[RegionModel.mla("mla", 24)], timeout_s=0.3)
    src, dst = np.array([3]), np.array([3])
    kv = e.request(src)
    e.pa[0].hold("r", src)
    set_hold_event(e.pa[0], "r", pending := PendingEvent())
    e.da[0].fetch("r", "P", src, dst, timeout_s=5.0)
    assert _spin(e, until=lambda got: got or e.pa[0].debug_state()["serves"]) == []
    assert _spin(e, 0.6) == [] and e.pa[0].debug_state()["serves"]  # still served after 2 deadlines
    pending.complete = True
    got = _spin(e, until=bool)
    assert len(got) == 1 and got[0].ok, got
    check_destination(e.D[0], 0, 2, kv, dst, e.before[0])


class RecordingLanes:
    """Stands in for the agent's CUDA stream on CPU: records what each launch was ordered after,
    and hands out completions the test finishes by hand (the kernels themselves ran already)."""

    def __init__(self):
        self.launches: list[object] = []  # the ``after`` of each pack/unpack, in order
        self.pending: list[ManualCompletion] = []
        self.cuda = False

    @contextlib.contextmanager
    def launching(self, after=None):
        self.launches.append(after)
        yield

    def completion(self):
        c = ManualCompletion()
        self.pending.append(c)
        return c

    def finish_all(self):
        for c in self.pending:
            c.finished = True

    def on_device(self):
        return contextlib.nullcontext()

    def synchronize(self):
        pass


class ManualCompletion:
    finished = False

    def done(self) -> bool:
        return self.finished


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_kernel_completions_gate_every_next_step(engines, mode):
    """Packs run after the hold's event, unpacks after the fetch's; a packed chunk is announced
    (pull) or written (push) only once its pack completed, and the fetch is reported only once
    every unpack into its blocks completed (the engine may then read them from any stream)."""
    e = engines(1, 1, mode=mode, models=[RegionModel.gqa("l0", 4, 16)], modes="staged")
    lanes = {a: RecordingLanes() for a in e.agents}
    for a, fake in lanes.items():
        replace_lanes(a, fake)
    src, dst = np.array([6, 1, 7]), np.array([2, 9, 4])
    kv = e.request(src)
    e.pa[0].hold("r", src)
    set_hold_event(e.pa[0], "r", hold_event := PendingEvent())
    hold_event.complete = True  # (only DIRECT runs query it on the host)
    e.da[0].fetch("r", "P", src, dst)
    set_fetch_event(e.da[0], "r", fetch_event := object())
    p, d = lanes[e.pa[0]], lanes[e.da[0]]
    assert _spin(e, until=lambda got: got or p.launches) == [] and _spin(e) == []
    assert p.launches and all(x is hold_event for x in p.launches)  # packed, after the engine's writes
    assert d.launches == []  # nothing announced or written before the packs completed
    p.finish_all()
    assert _spin(e, until=lambda got: got or d.launches) == []  # unpacked, but the unpacks are not done
    assert d.launches and all(x is fetch_event for x in d.launches)
    assert _spin(e) == []
    d.finish_all()
    got = _spin(e, until=bool)
    assert len(got) == 1 and got[0].ok, got
    check_destination(e.D[0], 0, 1, kv, dst, e.before[0])


def test_hold_after_is_for_cuda_agents(engines):
    e = engines(1, 1)
    with pytest.raises(ValueError, match="CUDA agents"):
        e.pa[0].hold("r", [1], after=object())
    with pytest.raises(ValueError, match="CUDA agents"):
        e.da[0].fetch("r", "P", [1], [2], after=object())
    assert not e.pa[0].debug_state()["holds"] and not e.da[0].debug_state()["fetches"]  # nothing half-done
    assert ready_event(torch.device("cpu"), None) is None
    assert Completion(None).done() and Lanes(torch.device("cpu")).completion().done()


# ------------------------------------------------------------------ warmup
def _warm(op: str, cfg: LaunchConfig) -> dict:
    """How debug_state()["warmed"] lists a compiled specialisation."""
    return {"op": op, "config": cfg._asdict()}


def _agent(impl, **kw):
    g = torch.Generator().manual_seed(5)
    regions = make_rank_regions([RegionModel.gqa("l0", 4, 16), RegionModel.mla("mla", 24, torch.float16)],
                                0, 1, 32, 4, gen=g)
    return regions, TransferAgent("P", 0, 1, regions, staging_bytes=64 << 10, slot_bytes=1024, impl=impl, **kw)


def test_warmup_runs_each_specialisation_once_and_moves_nothing():
    """Under the interpreter (conftest) the Triton path runs: warmup launches every (op, config)
    a request of this agent's own geometry would, once, without changing a byte."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter path; on CUDA test_warmup_compiles_what_requests_launch runs")
    regions, a = _agent("auto")
    try:
        before = snapshot(regions)
        staging = a.pool.tensor.clone()
        new = a.warmup()
        assert new and all(op in ("pack", "unpack") and isinstance(c, LaunchConfig) for op, c in new)
        assert a.warmup() == []  # each specialisation once
        assert all(torch.equal(x, y) for r0, r1 in zip(before, snapshot(regions)) for x, y in zip(r0, r1))
        assert torch.equal(a.pool.tensor, staging)
        # every chunk size a request can have launches a warmed specialisation
        plan = build_plan(0, 1, a.specs, 1, a.specs)  # the agent's own geometry, its (default) settings
        read = plan.payload(0)
        for n in range(1, a.chunk_bytes // read.bytes_per_block + 1):
            for op in ("pack", "unpack"):
                cfg = launch_config_for(op, regions, read.segments, read.segment_offsets(n, base=a.pool.offset(3)),
                                        np.arange(n), a.pool.tensor)
                assert _warm(op, cfg) in a.debug_state()["warmed"], (op, n, cfg)
    finally:
        a.close()


def test_warmup_is_free_under_the_torch_path_and_opt_in_at_construction():
    _, a = _agent("torch", warmup=True)
    try:
        assert a.warmup() == [] and not a.debug_state()["warmed"]
    finally:
        a.close()
    if not torch.cuda.is_available():
        _, b = _agent("auto", warmup=True)  # interpreter: construction warmed the own-geometry plan
        try:
            assert b.debug_state()["warmed"] and b.warmup(peers=False) == []
        finally:
            b.close()


def test_add_remote_warms_what_serving_and_fetching_that_peer_launch(engines):
    """TP 1 -> 2: the prefill rank packs half the heads per decode rank, a shape its own geometry
    does not have; with warmup=True, add_remote compiled it (and the decode ranks' unpacks)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter path")
    e = engines(1, 2, impl="auto", warmup=True, models=[RegionModel.gqa("l0", 4, 16)])
    p = e.pa[0]
    p_warmed = p.debug_state()["warmed"]
    for d in e.da:
        d_warmed = d.debug_state()["warmed"]
        to_d = build_plan(d.rank, 2, d.specs, 1, p.specs).payload(0)  # what p serves d by
        from_p = d.plan_for("P").payload(0)
        for n in (1, 2, 3, 4):
            ids = np.arange(n)
            assert _warm("pack", launch_config_for("pack", p.regions, to_d.segments, to_d.segment_offsets(n), ids,
                                                   p.pool.tensor)) in p_warmed
            assert _warm("unpack", launch_config_for("unpack", d.regions, from_p.segments,
                                                     from_p.segment_offsets(n), ids, d.pool.tensor)) in d_warmed


# ------------------------------------------------------------------ CUDA
def _compiled(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled kernels elsewhere (no JITFunction.device_caches)")
    return sum(len(c[0]) for c in caches.values())


@pytest.mark.gpu
def test_pack_on_the_agents_stream_waits_for_the_engines_writes():
    """The engine rewrites a block on its own stream behind a ~0.5 s sleep; a pack queued on the
    agent's stream after ``hold``'s event (``ready_event``) reads the new bytes, not the old ones,
    and its completion is not done before the engine's write is."""
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(11)
    regions = make_rank_regions([RegionModel.gqa("l0", 4, 64)], 0, 1, 16, 16, device=dev, gen=g)
    a = TransferAgent("P", 0, 1, regions, staging_bytes=1 << 20, slot_bytes=4096, modes="staged")
    try:
        a.warmup()  # no compile between queuing the engine's work and the pack
        read = build_plan(0, 1, a.specs, 1, a.specs, modes="staged").payload(0)
        lanes = agent_lanes(a)
        streams = [regions[0].nhd(j).view(torch.uint8) for j in range(regions[0].spec.num_streams)]
        fresh = [torch.randint(0, 256, s[7].shape, dtype=torch.uint8, generator=g).to(dev) for s in streams]
        canary = torch.randint(0, 256, (a.pool.nbytes,), dtype=torch.uint8, generator=g).to(dev)
        a.pool.tensor.copy_(canary)
        torch.cuda.synchronize()
        engine = torch.cuda.Stream(dev)
        with torch.cuda.stream(engine):  # device-to-device only: nothing here makes the host wait
            torch.cuda._sleep(1_000_000_000)
            for s, f in zip(streams, fresh):
                s[7].copy_(f)
        after = ready_event(dev, engine)
        with lanes.launching(after=after):
            pack(regions, read.segments, read.segment_offsets(1), [7], a.pool.tensor)
        done = lanes.completion()
        assert not done.done()  # still behind the engine's sleep
        lanes.synchronize()
        assert done.done() and after.query()
        n = read.bytes_per_block  # one block's staged bytes, from offset 0
        want = torch.zeros(a.pool.nbytes, dtype=torch.uint8, device=dev)
        pack(regions, read.segments, read.segment_offsets(1), [7], want, impl="torch")  # the reference
        torch.cuda.synchronize()
        assert torch.equal(a.pool.tensor[:n].cpu(), want[:n].cpu())
        assert torch.equal(a.pool.tensor[n:].cpu(), canary[n:].cpu())
    finally:
        a.close()


@pytest.mark.gpu
def test_unpack_on_the_agents_stream_waits_for_the_engines_last_use():
    """The engine still writes a block's old contents behind a ~0.5 s sleep; an unpack into it
    queued after ``fetch``'s event lands after that write, so the block ends with the payload."""
    from kvtriton.ops import unpack

    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(13)
    regions = make_rank_regions([RegionModel.gqa("l0", 4, 64)], 0, 1, 16, 16, device=dev, gen=g)
    a = TransferAgent("D", 0, 1, regions, staging_bytes=1 << 20, slot_bytes=4096, modes="staged")
    try:
        a.warmup()
        read = build_plan(0, 1, a.specs, 1, a.specs, modes="staged").payload(0)
        lanes = agent_lanes(a)
        streams = [regions[0].nhd(j).view(torch.uint8) for j in range(regions[0].spec.num_streams)]
        stale = [torch.randint(0, 256, s[5].shape, dtype=torch.uint8, generator=g).to(dev) for s in streams]
        payload = torch.randint(0, 256, (a.pool.nbytes,), dtype=torch.uint8, generator=g).to(dev)
        a.pool.tensor.copy_(payload)
        unpack(regions, read.segments, read.segment_offsets(1), [5], a.pool.tensor, impl="torch")  # reference
        want = [s.clone() for s in streams]
        torch.cuda.synchronize()
        engine = torch.cuda.Stream(dev)
        with torch.cuda.stream(engine):
            torch.cuda._sleep(1_000_000_000)
            for s, x in zip(streams, stale):
                s[5].copy_(x)  # the block's previous request, still running
        after = ready_event(dev, engine)
        with lanes.launching(after=after):
            unpack(regions, read.segments, read.segment_offsets(1), [5], a.pool.tensor)
        done = lanes.completion()
        assert not done.done()
        lanes.synchronize()
        torch.cuda.synchronize()
        for s, w in zip(streams, want):
            assert torch.equal(s.cpu(), w.cpu())
    finally:
        a.close()


@pytest.mark.gpu
def test_warmup_compiles_what_requests_launch():
    """After warmup(), a request's pack and unpack compile nothing new (no stall in progress())."""
    from kvtriton.ops import unpack
    from kvtriton.ops.launch import _kernel

    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(12)
    regions = make_rank_regions([RegionModel.gqa("l0", 8, 128), RegionModel.mla("mla", 576)],
                                0, 1, 64, 16, device=dev, gen=g)
    a = TransferAgent("P", 0, 1, regions, staging_bytes=8 << 20, slot_bytes=64 << 10, warmup=True,
                      modes="staged")
    try:
        assert a.debug_state()["warmed"]
        count = _compiled(_kernel("pack")) + _compiled(_kernel("unpack"))
        read = build_plan(0, 1, a.specs, 1, a.specs, modes="staged").payload(0)
        with (lanes := agent_lanes(a)).launching():
            for n in (1, 3, 6, 13):
                offs = read.segment_offsets(n, base=a.pool.offset(2))
                pack(regions, read.segments, offs, np.arange(n), a.pool.tensor)
                unpack(regions, read.segments, offs, np.arange(40, 40 + n), a.pool.tensor)
        lanes.synchronize()
        assert _compiled(_kernel("pack")) + _compiled(_kernel("unpack")) == count
    finally:
        a.close()


def test_retired_slots_wait_for_the_pack_still_running_into_them():
    """A transfer dropped (or an eager pack freed) while its pack is still running on the
    agent's stream keeps its slots until that pack completed: an unpack or a peer's WRITE into
    them is not ordered after it."""
    from kvtriton.agent.links import Chunk

    _, a = _agent("torch")
    try:
        pool = a.pool
        free0 = pool.free_slots
        slot = pool.alloc(2)
        pending, freed = ManualCompletion(), []
        retire_chunks(a, {0: Chunk(0, slot, 2, 2048, kernel=pending)}, 0.0, on_free=freed.append)
        reap(a)
        assert pool.free_slots == free0 - 2 and not freed  # the pack may still write there
        pending.finished = True
        reap(a)
        assert pool.free_slots == free0 and len(freed) == 1
    finally:
        a.close()
