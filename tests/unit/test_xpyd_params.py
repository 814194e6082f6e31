"""The vLLM connector's xPyD and DP inputs, without engines (issue 35, points 3 and 5):

* ``decode_engine_id`` in a prefill request's ``kv_transfer_params`` (a router's choice of
  decode engine, untrusted): a well-formed id reaches the workers with the hold
  (``StepMessages.pack_for``); anything else is ignored as if absent.
* DP: each DP rank's engine id and handshake port range (``vllm/dp.py``), with vLLM's own
  config classes when its test bed is there (a child process), duck-typed otherwise.
* ``forget_idle_s``: checked like every setting.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtriton.integrations.vllm.dp import dp_identity, dp_settings
from kvtriton.integrations.vllm.scheduler import SchedulerSide, decode_engine_hint
from kvtriton.integrations.vllm.settings import SettingsError, from_extra_config


def _held(params: dict) -> dict[str, str]:
    """The ``pack_for`` of the step that holds a prefill request carrying ``params``."""
    sched = SchedulerSide(engine_id="P", host="127.0.0.1", port=5710, tp_size=1, block_size=4)
    req = SimpleNamespace(request_id="r", kv_transfer_params={"do_remote_decode": True, **params},
                          num_prompt_tokens=8)
    sched.get_num_new_matched_tokens(req, 0)
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r", block_ids=([1, 2],), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={"r": 8}, total_num_scheduled_tokens=8, preempted_req_ids=set())
    msgs = sched.build_messages(out)
    assert msgs.holds == {"r": (1, 2)}
    return msgs.pack_for


def test_a_router_named_decode_engine_reaches_the_hold():
    assert _held({"decode_engine_id": "decode-3_dp1"}) == {"r": "decode-3_dp1"}
    assert _held({}) == {}  # without it: as before (the agent's guess, or the consumer setting)


@pytest.mark.parametrize("bad", [7, True, "", "x" * 257, "a\nb", ["D"], {"id": "D"}, "P"],
                         ids=["int", "bool", "empty", "long", "control", "list", "dict", "own-id"])
def test_a_malformed_decode_engine_id_is_ignored(bad):
    assert decode_engine_hint({"decode_engine_id": bad}, "P") is None
    assert _held({"decode_engine_id": bad}) == {}


def test_dp_ranks_get_their_own_engine_ids_and_port_ranges():
    one = SimpleNamespace(data_parallel_index=0, data_parallel_size=1, data_parallel_rank=0)
    assert dp_identity("P", 5710, 4, one) == ("P", 5710)  # no DP: unchanged
    # a dense model's DP rank 2 (vLLM resets data_parallel_size and _rank, keeps the index)
    dense = SimpleNamespace(data_parallel_index=2, data_parallel_size=1, data_parallel_rank=0)
    assert dp_identity("P_dp2", 5710, 4, dense) == ("P_dp2", 5718)  # vLLM's suffix kept, not doubled
    assert dp_identity("P", 5710, 4, dense) == ("P_dp2", 5718)  # added when vLLM did not
    older = SimpleNamespace(data_parallel_size=2, data_parallel_rank=1)  # no data_parallel_index
    assert dp_identity("P", 5710, 2, older) == ("P_dp1", 5712)
    ports = {dp_identity("P", 5710, 4, SimpleNamespace(data_parallel_index=d, data_parallel_size=4))[1] + r
             for d in range(4) for r in range(4)}
    assert ports == set(range(5710, 5726))  # 16 ranks, 16 ports, none shared
    settings, engine = dp_settings(from_extra_config({"port": 5710}), "P", 4, dense)
    assert (settings.port, engine) == (5718, "P_dp2")
    with pytest.raises(SettingsError, match="past 65535"):
        dp_settings(from_extra_config({"port": 65530}), "P", 4, dense)


def test_forget_idle_s_is_checked():
    assert from_extra_config({}).forget_idle_s == 600.0
    assert from_extra_config({"forget_idle_s": 0}).forget_idle_s == 0
    for bad in (-1.0, float("nan"), "600"):
        with pytest.raises(SettingsError, match="forget_idle_s"):
            from_extra_config({"forget_idle_s": bad})
