"""A hold ends when its last reader is done, not by lease, when not every decode rank reads
every prefill rank (issue 19): P2->D3 with 6 KV heads (each prefill rank has two readers of
three), P2->D1 with 1 KV head (the head is replicated; the decode reads one replica and only
tells the other it is done). Agents are connected the way the vLLM connector's decode ranks
meet prefill ranks (:func:`kvtriton.plan.meeting_ranks`), so a rank that reads nothing from a
prefill rank sends it nothing."""

import time

import numpy as np
import pytest
import torch
from helpers.specs import gqa_specs, mla_specs

from kvtriton.plan import build_plan, check_tp, done_ranks, meeting_ranks, required_source_ranks
from kvtriton.testing.oracle import RegionModel, check_destination

LEASE_S = 60.0  # far past the test: a hold freed by lease would fail it


@pytest.mark.parametrize("heads", [1, 2, 4, 6, 8])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (8, 2), (2, 8), (2, 3), (3, 2),
                                       (16, 1), (1, 16), (6, 4), (4, 1)])
@pytest.mark.parametrize("with_mla", [False, True])
def test_every_reader_is_waited_for_and_every_source_rank_hears_a_done(heads, p_tp, d_tp, with_mla):
    """done_ranks and meeting_ranks agree: a source rank waits exactly for the destination
    ranks that meet it, never for none, and every rank whose plan reads it is among them."""
    try:
        check_tp(p_tp, heads), check_tp(d_tp, heads)
    except Exception:
        pytest.skip("TP sizes cannot shard this head count")
    specs = gqa_specs(2, heads, 32, 0, d_tp, 16) + (mla_specs(0, d_tp, 16) if with_mla else [])
    src_specs = gqa_specs(2, heads, 32, 0, p_tp, 16) + (mla_specs(0, p_tp, 16) if with_mla else [])
    meets = {d: set(meeting_ranks(d, d_tp, specs, p_tp)) for d in range(d_tp)}
    for d in range(d_tp):
        assert set(required_source_ranks(d, d_tp, specs, p_tp)) <= meets[d]
        dst = gqa_specs(2, heads, 32, d, d_tp, 16) + (mla_specs(d, d_tp, 16) if with_mla else [])
        for r in build_plan(d, d_tp, dst, p_tp, src_specs).source_ranks:
            assert d in done_ranks(r, p_tp, src_specs, d_tp)  # a reader is always waited for
    for r in range(p_tp):
        waits = done_ranks(r, p_tp, src_specs, d_tp)
        assert waits and {d for d in range(d_tp) if r in meets[d]} == set(waits), (r, waits, meets)


def _six_heads():
    return [RegionModel.gqa("l0", 6, 16), RegionModel.gqa("l1", 6, 8, torch.float32)]


def _one_head():
    return [RegionModel.gqa("l0", 1, 16), RegionModel.gqa("l1", 1, 8, torch.float32)]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("models,p_tp,d_tp", [(_six_heads, 2, 3), (_one_head, 2, 1),
                                              (lambda: _one_head() + [RegionModel.mla("mla", 24)], 2, 1)])
def test_holds_end_at_the_last_readers_done(engines, mode, models, p_tp, d_tp):
    e = engines(p_tp, d_tp, models=models(), mode=mode, connect=False)
    e.connect(meeting=True)
    src, dst = np.array([9, 3, 4, 5, 40]), np.array([0, 7, 8, 2, 30])
    kv = e.request(src)
    for p in e.pa:
        p.hold("r", src, lease_s=LEASE_S)
    for d in e.da:
        d.fetch("r", "P", src, dst)
    got = e.drive(1)
    assert all(v[0].ok for v in got.values()), got
    for r in range(d_tp):  # fresh random KV, compared byte for byte
        check_destination(e.D[r], r, d_tp, kv, dst, e.before[r])
    t0 = time.monotonic()
    freed = e.settle_freed(p_tp, timeout_s=5.0)  # by done: right after the reads, far inside the lease
    assert sorted((f.req_id, f.reason) for f in freed) == [("r", "done")] * p_tp, freed
    assert time.monotonic() - t0 < 5.0
    assert all(a.idle() and a.pool.free_slots == a.pool.num_slots for a in e.agents)
    assert all(p.stats["leases_expired"] == 0 for p in e.pa)
