"""Issue 35 on real vLLM engines (the CPU build 0.32, the test bed; nothing mocked): a decode
request queued longer than the prefill's lease still loads, and a prefill engine killed mid-load
costs the decode engine only a recompute of those requests, known in seconds, not at the 30 s
``timeout_s``. One P1->D1 pair for the module (:mod:`beds.vllm_faults`); the kill runs last.

Oracles: greedy tokens equal the decode engine computing each prompt itself, and the prompt
tokens the decode computed (counted from its scheduler's own outputs): at most 1 when the KV was
loaded, the whole prompt when it was recomputed."""

import pytest
from helpers.vllm_bed_python import vllm_bed_python

from beds.vllm_bed import close_all
from beds.vllm_faults import (
    LEASE_S,
    TIMEOUT_S,
    launch_pair,
    launch_victim,
    prefill,
    prefill_killed_mid_load,
    queued_past_lease,
    reference,
)

pytestmark = pytest.mark.vllm
VLLM_PY = vllm_bed_python()


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    p, d = launch_pair(VLLM_PY, model_dir, tmp_path_factory.mktemp("faults"))
    yield p, d
    close_all([p, d])


def _settle(engine, seconds=30):
    engine.call("drain", seconds=seconds, timeout_s=seconds + 30)
    state = engine.call("state")
    assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"], state
    assert state["staging_in_use"] and all(s == 0 for s in state["staging_in_use"]), state


def test_a_decode_request_queued_longer_than_the_lease_still_loads(pair, prompts):
    p, d = pair
    ref = reference(d, prompts[:2], "q-ref")
    got = queued_past_lease(p, d, prompts[:2], blocker=prompts[3], tag="q")
    assert got["queued_s"] is not None and got["queued_s"] > 1.5 * LEASE_S, got  # it did wait past the lease
    assert got["tokens"] == ref, got
    assert all(c <= 1 for c in got["prompt_computed"]), f"recomputed, its hold expired: {got}"
    _settle(p)  # the decode said done: every hold released
    _settle(d)


def test_prefill_killed_mid_load_is_recomputed_and_the_decode_keeps_serving(pair, prompts, model_dir, tmp_path):
    """A second prefill engine (nothing packed ahead: the loads wait on it) is killed mid-load;
    afterwards the decode still moves KV from the first one."""
    p, d = pair
    ref = reference(d, prompts, "k-ref")
    victim = launch_victim(VLLM_PY, model_dir, tmp_path)
    try:
        got = prefill_killed_mid_load(victim, d, prompts, tag="k")
    finally:
        victim.kill()
    assert got["warm_computed"] <= 1, got  # met and loaded before the kill
    assert got["decode_alive"], got
    assert got["tokens"] == ref, got  # load errors -> vLLM recomputed the blocks
    assert all(c == len(q) for c, q in zip(got["prompt_computed"], prompts)), got  # ... and really did
    typed = got["typed_s"]
    assert all(t is not None for t in typed), got
    # known by the lifeline: well before timeout_s (30 s), engine steps and a loaded host included
    assert max(typed) < TIMEOUT_S / 3, got
    assert got["log"] and "kv_load_failure_policy='recompute'" in got["log"][0], got
    # the decode engine serves the next requests: KV from the surviving prefill, nothing recomputed
    params = prefill(p, prompts[:2], "k-next-p")
    out = d.call("generate", requests=[{"id": f"k-next{i}", "prompt": q, "max_tokens": 8, "kv_transfer_params": kp}
                                       for i, (q, kp) in enumerate(zip(prompts[:2], params))])["outputs"]
    assert [o["tokens"] for o in out] == ref[:2] and all(o["prompt_computed"] <= 1 for o in out), out
    _settle(p)
    _settle(d)
