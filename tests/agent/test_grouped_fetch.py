"""A request per KV cache group over real NIXL (issue 32, point 1): a model of three groups (a
sliding-window-like SPLIT layer whose list is shorter, a full-attention SPLIT layer, one block per
request of state-like regions: SPLIT by heads and REPLICATE) at P1->D2, P2->D1 and P2->D3
(6 heads), checked byte for byte per region against the prefill caches, every other block
untouched, one READ per (source rank, chunk) for the whole grouped request; bad grouped input
is a typed error before anything is launched or sent."""

import time

import pytest
import torch

from kvtriton.errors import PlanError, RequestRejectedError
from kvtriton.plan import RequestPlan
from kvtriton.protocol import wire
from kvtriton.regions import Kind
from tests.helpers.grouped import LAYERS, Grouped

# per group: prefill ids, decode ids (group 0 shorter than group 1; group 2 one state slot; the
# decode's lists are disjoint across groups, so a region writing another group's positions shows)
SRC = [[3, 4], [7, 8, 9, 10, 11], [20]]
DST = [[5, 6], [10, 11, 12, 13, 14], [3]]


def _expected_reads(e: Grouped, d: int, src, dst) -> int:
    """Chunks of every staged payload of decode rank ``d``'s request (the planner's count)."""
    agent = e.da[d]
    caps = min(a.debug_state()["settings"]["chunk_bytes"] for a in (agent, e.pa[0]))
    rp = RequestPlan.for_fetch(agent.plan_for("P"), src, dst, src_num_blocks=32, dst_num_blocks=24, chunk_bytes=caps)
    return sum(p.chunks.count for p in rp.payloads.values())


def _run(e: Grouped, src, dst, req: str = "r"):
    for p in e.pa:
        p.hold(req, src, consumer="D")
    before = [a.stats["staged_descriptors"] for a in e.da]
    for d in e.da:
        d.fetch(req, "P", src, dst)
    got = e.drive()
    assert all(len(v) == 1 and v[0].ok for v in got.values()), got
    assert e.check(src, dst) > 0
    return [a.stats["staged_descriptors"] - b for a, b in zip(e.da, before)]


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (2, 3)])
def test_grouped_request_moves_each_group_byte_exact(p_tp, d_tp):
    e = Grouped(p_tp, d_tp, seed=p_tp * 10 + d_tp)
    try:
        reads = _run(e, SRC, DST)
        plans = [a.plan_for("P") for a in e.da]
        # one READ per source rank for the whole request (every group's slices in one payload)
        assert reads == [len(p.staged) for p in plans]
        assert reads == [_expected_reads(e, d, SRC, DST) for d in range(d_tp)]
        assert any(p.direct for p in plans)  # the REPLICATE state region moved DIRECT, its group's block only
    finally:
        e.close()


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1)])
def test_grouped_request_with_a_direct_slice_region(p_tp, d_tp):
    """The state region's head slices move cache to cache (Route.DIRECT_SLICE): its group's block only."""
    e = Grouped(p_tp, d_tp, seed=17, modes={"ssm": "direct_slice"})
    try:
        assert all(a.plan_for("P").routes[2].value == "direct_slice" for a in e.da)
        _run(e, SRC, DST)
    finally:
        e.close()


def test_grouped_request_by_push():
    e = Grouped(2, 3, seed=3, mode="push")
    try:
        _run(e, SRC, DST)  # the source WRITEs each chunk (and the DIRECT rows: its group's block only)
    finally:
        e.close()


def test_grouped_request_in_small_chunks_one_read_per_chunk():
    e = Grouped(2, 3, seed=5, chunk_bytes=1024, slot_bytes=256)
    try:
        reads = _run(e, SRC, DST)
        want = [_expected_reads(e, d, SRC, DST) for d in range(3)]
        assert reads == want and all(r > len(a.plan_for("P").staged) for r, a in zip(reads, e.da))
    finally:
        e.close()


def test_grouped_request_with_an_empty_group_and_skips():
    e = Grouped(1, 2, seed=7)
    try:
        src, dst = [[], [7, -1, 9, 10], [20]], [[], [10, 11, -1, 13], [3]]
        _run(e, src, dst)  # group 0 moves nothing: its blocks keep their bytes (checked)
    finally:
        e.close()


def test_a_source_rank_with_no_byte_of_the_request_still_serves_and_frees():
    """A group of one REPLICATE region staged from the first replica: a request of that group
    alone gives the other prefill rank a payload of no byte (no chunk); its pull is answered
    and both holds end done."""
    layers = LAYERS[:3] + (("conv", 3, Kind.REPLICATE, 1, 24, 1, torch.float32),)
    e = Grouped(2, 1, seed=13, layers=layers, modes={"conv": "staged"})
    try:
        src, dst = [[], [], [], [20]], [[], [], [], [3]]
        assert _run(e, src, dst) == [1]
        freed, deadline = [], time.monotonic() + 10
        while len(freed) < 2:
            assert time.monotonic() < deadline, freed
            for a in e.agents:
                a.progress()
            freed += [f.reason for p in e.pa for f in p.freed()]
        assert freed == ["done", "done"]
    finally:
        e.close()


def test_hold_and_fetch_refuse_bad_grouped_input_before_anything_moves():
    e = Grouped(1, 2, seed=9)
    try:
        p, d = e.pa[0], e.da[0]
        with pytest.raises(RequestRejectedError, match="2 group lists given, the regions span 3"):
            p.hold("r", SRC[:2])
        with pytest.raises(RequestRejectedError, match="block ids must be in"):
            p.hold("r", [[3], [99], []])
        assert not p.debug_state()["holds"]
        p.hold("r", SRC, consumer="D")
        stats = dict(d.stats)
        cases = [((SRC[:2], DST[:2]), "2 group lists given, the regions span 3"),
                 ((SRC, [[5], DST[1], DST[2]]), "group 0: request has 2 source block ids but 1"),
                 ((SRC, [DST[0], DST[1], [99]]), "group 2: destination block id 99"),
                 ((SRC, [[5, 5], DST[1], DST[2]]), "group 0: destination block ids repeat")]
        for (src, dst), match in cases:
            with pytest.raises(PlanError, match=match):
                d.fetch("r", "P", src, dst)
        for a in e.agents:
            a.progress()
        assert dict(d.stats) == stats and not d.results()  # nothing launched, posted or sent
        for q in e.da:  # the request itself is still whole
            q.fetch("r", "P", SRC, DST)
        got = e.drive()
        assert all(v[0].ok for v in got.values())
        e.check(SRC, DST)
    finally:
        e.close()


def test_source_refuses_forged_group_sizes_and_cross_group_reads():
    """The group sizes of a pull are untrusted: sizes that do not fit the ids or the plan, none for
    a grouped hold, or ids of one group read as another's, are refused before anything is packed."""
    e = Grouped(1, 1, seed=11)
    try:
        p, d = e.pa[0], e.da[0]
        p.hold("r", SRC, consumer="D")
        digest = d.plan_for("P").digest()
        ids = tuple(i for g in SRC for i in g)
        forged = [wire.Pull("x1", "r", 0, ids, 1, digest, groups=(1, 1, 1)),  # do not add up
                  wire.Pull("x2", "r", 0, ids, 1, digest, groups=(2, 6)),  # two groups of three
                  wire.Pull("x3", "r", 0, ids, 1, digest),  # none for a grouped request
                  wire.Pull("x4", "r", 0, (7, 8, 20), 1, digest, groups=(1, 1, 1))]  # 7 is group 1's, not 0's
        launches = p.stats["pack_launches"]
        for m in forged:  # sent as D's rank 0 would (its agent's notifications)
            d.transport.send_notif(p.transport.name, m.encode())
        for _ in range(50):
            for a in e.agents:
                a.progress()
        assert p.stats["pack_launches"] == launches and not p.debug_state()["serves"]
        d.fetch("r", "P", SRC, DST)  # the honest request still goes through
        assert e.drive()[0][0].ok
        e.check(SRC, DST)
    finally:
        e.close()


def test_grouped_hold_is_not_packed_ahead_and_its_lease_ends_it():
    e = Grouped(1, 2, seed=19, eager_bytes=1 << 20)
    try:
        p = e.pa[0]
        p.hold("early", SRC, consumer="D", lease_s=0.2)
        p.hold("r", SRC, consumer="D")
        freed, deadline = [], time.monotonic() + 10
        while "early" not in freed:
            assert time.monotonic() < deadline, freed
            for a in e.agents:
                a.progress()
            freed += [f.req_id for f in p.freed() if f.reason == "lease_expired"]
        assert p.packed_ahead("r") == 0 and "r" in p.debug_state()["holds"]
        for d in e.da:
            d.fetch("r", "P", SRC, DST)
        assert all(v[0].ok for v in e.drive().values())
        e.check(SRC, DST)
    finally:
        e.close()

