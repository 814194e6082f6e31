"""2 prefill x 2 decode engines over real NIXL, one prefill rank SIGKILLed under requests (issue 35):
every request of the surviving prefill loads byte-exact, the dead one's fail typed (with the
lifelines, :class:`PeerDisconnectedError` within 1.5 s although ``timeout_s`` is 30), and no
rank left alive keeps a hold, a fetch or a staging slot once settled."""

from __future__ import annotations

import time

import pytest

from kvtriton.testing.faults import BedConfig, FaultBed

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

BOUND_S = 1.5


def test_a_killed_prefill_rank_loses_no_request_of_the_survivors():
    cfg = BedConfig(tp=1, timeout_s=30.0, lease_s=30.0)
    with FaultBed(cfg) as bed:
        pairs = [(p, d) for p in bed.prefills for d in bed.decodes]
        warm = [r for p, d in pairs for r in bed.new_requests(p, d, 2)]
        bed.submit(warm)
        bed.wait([r.req_id for r in warm], timeout_s=30)
        assert not [r.req_id for r in warm if bed.lost(r.req_id)], {r.req_id: bed.outcomes[r.req_id] for r in warm}

        victim = ("P0", 0)
        bed.call(victim, "pause")  # its pulls stay unanswered: they are in flight when it dies
        wave = [r for p, d in pairs for r in bed.new_requests(p, d, 2)]
        bed.submit(wave)
        time.sleep(0.3)
        t_kill = bed.kill(victim)
        after = [r for d in bed.decodes for r in bed.new_requests("P1", d, 2)]  # the stream goes on
        bed.submit(after)
        bed.wait([r.req_id for r in wave + after], timeout_s=40)

        survivors = [r for r in wave + after if r.prefill != "P0"]
        assert not [r.req_id for r in survivors if bed.lost(r.req_id)], \
            {r.req_id: bed.outcomes[r.req_id] for r in survivors if bed.lost(r.req_id)}
        wrong = [o.mismatch for q in bed.outcomes.values() for o in q.values() if o.mismatch]
        assert not wrong, wrong
        for r in (r for r in wave if r.prefill == "P0"):
            for o in bed.outcomes[r.req_id].values():
                assert not o.ok and o.error == "PeerDisconnectedError", (r.req_id, o)
                assert o.t_end - t_kill < BOUND_S, f"{r.req_id}: typed error {o.t_end - t_kill:.3f} s after the kill"

        leaks = bed.leaks(timeout_s=20)
        assert all(not (v["holds"] or v["fetches_in_flight"] or v["staging_taken"]) for v in leaks.values()), leaks
