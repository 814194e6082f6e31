"""Issue 35, point 4, in the vLLM connector: a decode request waiting in its engine's queue keeps
the prefill's holds alive (the scheduler side announces it, the worker side's agent renews it
every ``lease_s / 6`` for at most ``max_queued_s``), and a failed load's log line says what
vLLM's ``kv_load_failure_policy`` makes of the request.

The worker tests run two connector worker sides over real NIXL (:mod:`helpers.connector_bed`);
the bytes loaded are compared with the prefill's own random blocks."""

import logging
import time
from types import SimpleNamespace

import pytest
from helpers.connector_bed import BS, Bed

from kvtriton.integrations.vllm.scheduler import RemoteSource, SchedulerSide, StepMessages
from kvtriton.integrations.vllm.settings import SettingsError, from_extra_config
from kvtriton.protocol.allowlist import PeerAllowlist

LEASE_S = 1.0


def _queue(bed: Bed, req: str, remote_req: str, blocks) -> None:
    """One step whose messages name ``req`` as queued (the scheduler side's ``on_new_request``)."""
    src = RemoteSource(bed.engine, "127.0.0.1", bed.port, 1, remote_req, tuple(blocks), BS)
    bed.decode.bind(StepMessages(queued={req: src}))
    bed.decode.start_loads()
    bed.decode.clear()


def _wait(bed: Bed, seconds: float) -> None:
    """Engine steps with nothing to do for ``seconds`` (the agents' own threads renew and expire)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        bed.decode.finished()
        bed.prefill.finished()
        time.sleep(0.02)


def test_a_queued_request_loads_after_waiting_longer_than_the_lease(gen):
    """Held for the decode engine with a 1 s lease; the decode announces one request queued (before
    it ever met the prefill: the announcement meets it) and waits 3 s: that one loads byte-exact,
    the hold of a request nobody announced expired meanwhile (its load fails, recomputed)."""
    bed = Bed(gen, p_extra={"lease_s": LEASE_S, "consumer": "D"}, d_extra={"lease_s": LEASE_S})
    try:
        bed.hold("waits", [3, 7, 8, 2])
        bed.hold("forgotten", [1, 5])
        _queue(bed, "d-waits", "waits", [3, 7, 8, 2])
        _wait(bed, 3 * LEASE_S)
        done, errors = bed.load("waits", [3, 7, 8, 2], [0, 5, 6, 9], seconds=20.0)
        assert done and not errors
        bed.assert_landed([3, 7, 8, 2], [0, 5, 6, 9])
        done, errors = bed.load("forgotten", [1, 5], [10, 11], seconds=20.0)
        assert done and errors == {10, 11}  # its lease ended: not held any more
    finally:
        bed.close()


@pytest.mark.parametrize("max_queued_s", [0.0, 1.0])
def test_renewals_of_a_queued_request_stop_at_max_queued_s(gen, max_queued_s):
    """``max_queued_s`` bounds how long a queued request is kept (0: not at all): past it and the
    lease, its hold ends and its load fails (recomputed)."""
    bed = Bed(gen, p_extra={"lease_s": LEASE_S, "consumer": "D"},
              d_extra={"lease_s": LEASE_S, "max_queued_s": max_queued_s})
    try:
        assert bed.load("warm", [0], [0], seconds=20.0)[0]  # met before: renewals could reach it at once
        bed.hold("waits", [3, 7])
        _queue(bed, "d-waits", "waits", [3, 7])
        _wait(bed, max_queued_s + 2.5 * LEASE_S)
        done, errors = bed.load("waits", [3, 7], [5, 6], seconds=20.0)
        assert done and errors == {5, 6}
    finally:
        bed.close()


@pytest.mark.parametrize("policy,said", [
    ("recompute", "its blocks will be recomputed (kv_load_failure_policy='recompute')"),
    ("fail", "vLLM fails the request, no tokens (kv_load_failure_policy='fail'"),
])
def test_a_failed_load_logs_what_vllm_does_with_the_request(gen, caplog, policy, said):
    bed = Bed(gen)
    try:
        bed.decode.failure_policy = policy  # what the connector reads from vLLM's kv_transfer_config
        with caplog.at_level(logging.WARNING, logger="kvtriton.integrations.vllm.worker"):
            done, errors = bed.load("never-held", [1, 2], [3, 4], seconds=20.0)
        assert done and errors == {3, 4}
        lines = [r.getMessage() for r in caplog.records if "never-held" in r.getMessage()
                 or "failed" in r.getMessage()]
        assert any(said in line for line in lines), lines
        assert not any("recomputed" in line for line in lines) or policy == "recompute", lines
    finally:
        bed.close()


# ---------------------------------------------------------------------------- the scheduler side
def _params(**over):
    p = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "10.0.0.1", "remote_port": 5710,
         "tp_size": 1, "remote_request_id": "p-1", "remote_block_ids": [4, 5, 6], "remote_block_size": 16}
    return {**p, **over}


def _request(rid, params):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, num_prompt_tokens=40,
                           prompt_token_ids=list(range(40)), status=SimpleNamespace(name="FINISHED_ABORTED"))


def _out():
    return SimpleNamespace(total_num_scheduled_tokens=0, scheduled_new_reqs=[],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[]))


def test_the_scheduler_side_announces_each_queued_request_once():
    s = SchedulerSide(engine_id="D", host="127.0.0.1", port=5800, tp_size=1, block_size=16,
                      allowed_peers=PeerAllowlist(["10.0.0.0/8"]))
    s.on_new_request(_request("a", _params()))
    s.on_new_request(_request("bad", _params(remote_port="x")))  # computed locally: nothing to renew
    s.on_new_request(_request("far", _params(remote_host="192.168.1.1")))  # outside allowed_peers
    s.on_new_request(_request("gone", _params(remote_request_id="p-gone")))
    s.request_finished(_request("gone", _params(remote_request_id="p-gone")), [])  # aborted before a step
    s.on_new_request(_request("local", {"do_remote_decode": True}))  # a prefill request
    msgs = s.build_messages(_out())
    assert set(msgs.queued) == {"a"}
    src = msgs.queued["a"]
    assert (src.engine_id, src.host, src.port, src.request_id) == ("P", "10.0.0.1", 5710, "p-1")
    assert not s.build_messages(_out()).queued  # once: the agent renews it from then on


def test_a_request_loading_in_the_step_it_arrives_is_not_announced():
    s = SchedulerSide(engine_id="D", host="127.0.0.1", port=5800, tp_size=1, block_size=16)
    req = _request("a", _params())
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],))
    s.update_state_after_alloc(req, blocks, 40)
    msgs = s.build_messages(_out())
    assert set(msgs.loads) == {"a"} and not msgs.queued


@pytest.mark.parametrize("bad", [-1.0, float("nan"), 1e9, "10"])
def test_max_queued_s_is_checked(bad):
    with pytest.raises(SettingsError, match="max_queued_s"):
        from_extra_config({"max_queued_s": bad})
