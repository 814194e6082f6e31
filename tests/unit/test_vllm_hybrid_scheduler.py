"""The vLLM connector's scheduler side with hybrid KV cache groups (issue 32), on fake requests
and scheduler outputs: per-group block ids in holds, params and loads, sliding-window clipping on
both sides, the Mamba backoff (the prefill stops one prompt token short, the decode loads
``prompt - 1`` tokens), flat lists from single-group peers, and the groups read from a
``kv_cache_config``. No vLLM import (the real engines: tests/engines/test_vllm_hybrid.py)."""

from types import SimpleNamespace

import pytest

from kvtriton.integrations.vllm.scheduler import (
    CacheGroup,
    ParamsError,
    SchedulerSide,
    cache_groups,
    parse_remote_params,
)

BS = 32
SW = CacheGroup(BS, window=48)  # cdiv(48, 32) + 1 = 3 blocks travel
FULL = CacheGroup(BS)
STATE = CacheGroup(4096, state=True)


def side(engine, groups):
    return SchedulerSide(engine_id=engine, host="127.0.0.1", port=6000, tp_size=2, block_size=BS, groups=groups)


def prefill_request(rid, n):
    tokens = list(range(n))
    return SimpleNamespace(request_id=rid, kv_transfer_params={"do_remote_decode": True}, num_prompt_tokens=n,
                           prompt_token_ids=tokens, _all_token_ids=list(tokens), max_tokens=8,
                           status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))


def schedule(sched, rid, block_ids, n_scheduled):
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=block_ids, num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={rid: n_scheduled}, total_num_scheduled_tokens=n_scheduled, preempted_req_ids=set())
    return sched.build_messages(out)


def blocks(*groups):
    """vLLM's KVCacheBlocks duck: per group, blocks with ids (0: the null block)."""
    return SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, is_null=b == 0) for b in g] for g in groups])


def test_sliding_window_group_is_clipped_on_both_sides():
    p = side("P", (SW, FULL))
    req = prefill_request("r", 100)  # 4 blocks of 32; the window reaches back into block 1
    p.on_new_request(req)
    assert req.num_prompt_tokens == 100  # no state group: no backoff
    assert p.get_num_new_matched_tokens(req, 0) == (0, False)
    msgs = schedule(p, "r", ([11, 12, 13, 14], [21, 22, 23, 24]), 100)
    assert msgs.holds == {"r": ((12, 13, 14), (21, 22, 23, 24))}
    # by request_finished_all_groups vLLM nulled the out-of-window block
    delay, params = p.request_finished(req, ([0, 12, 13, 14], [21, 22, 23, 24]))
    assert delay and params["remote_block_ids"] == [[12, 13, 14], [21, 22, 23, 24]]
    assert params["remote_num_tokens"] == 100

    d = side("D", (SW, FULL))
    dreq = SimpleNamespace(request_id="d", kv_transfer_params=dict(params), num_prompt_tokens=100)
    assert d.get_num_new_matched_tokens(dreq, 0) == (100, True)
    d.update_state_after_alloc(dreq, blocks([0, 42, 43, 44], [51, 52, 53, 54]), 100)
    load = d.build_messages(SimpleNamespace(total_num_scheduled_tokens=0)).loads["d"]
    assert load.remote_block_ids == ((12, 13, 14), (21, 22, 23, 24))
    assert load.local_block_ids == ((42, 43, 44), (51, 52, 53, 54))
    assert load.local_blocks() == (42, 43, 44, 51, 52, 53, 54)


def test_state_groups_back_off_one_prompt_token():
    """Nemotron-H's groups: two Mamba groups and an attention group. The prefill computes
    ``prompt - 1`` tokens (the decode computes the last on the state it loads); one block per
    state group travels."""
    groups = (STATE, FULL, STATE)
    p = side("P", groups)
    req = prefill_request("r", 65)
    p.on_new_request(req)
    p.on_new_request(req)  # once per request, whatever vLLM calls again
    got = (req.num_prompt_tokens, len(req.prompt_token_ids), len(req._all_token_ids), req.max_tokens)
    assert got == (64, 64, 64, 1)
    assert req.kv_transfer_params["_p_side_truncated"]
    p.get_num_new_matched_tokens(req, 0)
    msgs = schedule(p, "r", ([7], [1, 2], [9]), 64)
    assert msgs.holds == {"r": ((7,), (1, 2), (9,))}
    delay, params = p.request_finished(req, ([7], [1, 2], [9]))
    assert delay and params["remote_block_ids"] == [[7], [1, 2], [9]] and params["remote_num_tokens"] == 64

    d = side("D", groups)
    dreq = SimpleNamespace(request_id="d", kv_transfer_params=dict(params), num_prompt_tokens=65)
    assert d.get_num_new_matched_tokens(dreq, 0) == (64, True)  # prompt - 1: the decode computes the last
    d.update_state_after_alloc(dreq, blocks([3], [5, 6], [8]), 64)
    load = d.build_messages(SimpleNamespace(total_num_scheduled_tokens=0)).loads["d"]
    assert (load.remote_block_ids, load.local_block_ids) == (((7,), (1, 2), (9,)), ((3,), (5, 6), (8,)))
    # a decode of a model without a state group does not back off
    assert side("D", (SW, FULL)).backoff == 0 and d.backoff == 1


def test_flat_lists_are_one_group_and_group_counts_must_match():
    one = side("D", ())
    flat = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "h", "remote_port": 1, "tp_size": 1,
            "remote_request_id": "r", "remote_block_ids": [4, 5], "remote_block_size": BS}
    req = SimpleNamespace(request_id="d", kv_transfer_params=dict(flat), num_prompt_tokens=64)
    assert one.get_num_new_matched_tokens(req, 0) == (64, True)  # a flat list: one group, as before
    nested = {**flat, "remote_block_ids": [[4, 5]]}
    req = SimpleNamespace(request_id="d2", kv_transfer_params=dict(nested), num_prompt_tokens=64)
    assert one.get_num_new_matched_tokens(req, 0) == (64, True)
    hybrid = side("D", (SW, FULL))
    for ids in ([4, 5], [[4], [5], [6]]):  # one group, three groups: not this engine's two
        req = SimpleNamespace(request_id="d3", kv_transfer_params={**flat, "remote_block_ids": ids},
                              num_prompt_tokens=64)
        assert hybrid.get_num_new_matched_tokens(req, 0) == (0, False)  # computed locally
        assert req.kv_transfer_params["do_remote_prefill"] is False


def test_per_group_params_are_checked():
    good = {"remote_engine_id": "P", "remote_host": "h", "remote_port": 1, "tp_size": 1, "remote_request_id": "r",
            "remote_block_ids": [[1, 2, 3], [4], []], "remote_num_tokens": 96}
    src = parse_remote_params(good, BS)
    assert src.grouped and src.groups == ((1, 2, 3), (4,), ())
    for ids in ([[1], [-2]], [[1], 2], [[1], ["x"]], [[True]], [[1]] * 65):
        with pytest.raises(ParamsError, match="remote_block_ids"):
            parse_remote_params({**good, "remote_block_ids": ids}, BS)
    with pytest.raises(ParamsError, match="remote_num_tokens"):  # more than the longest group holds
        parse_remote_params({**good, "remote_num_tokens": 97}, BS)


class SlidingWindowSpec(SimpleNamespace):
    pass


class FullAttentionSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def test_groups_from_a_kv_cache_config():
    def group(spec, *names):
        return SimpleNamespace(kv_cache_spec=spec, layer_names=list(names))

    config = SimpleNamespace(kv_cache_groups=[
        group(MambaSpec(block_size=2048), "l0", "l3"), group(FullAttentionSpec(block_size=64), "l1"),
        group(SlidingWindowSpec(block_size=64, sliding_window=100), "l2")], transfer_group_ids=(0, 1))
    assert cache_groups(config) == (CacheGroup(2048, state=True), CacheGroup(64),
                                    CacheGroup(64, window=100, transfer=False))
    assert cache_groups(None) == ()
    assert CacheGroup(64, window=100).clip(range(10)) == (7, 8, 9)  # cdiv(100, 64) + 1
    assert CacheGroup(64, window=100, transfer=False).clip(range(10)) == ()


def test_state_pages_unpack_as_vllm_does():
    """A Mamba layer's raw page view (vLLM 0.32 CPU: ``[blocks, 1, 1, page]`` int8 in the one
    backing buffer) unpacks into conv and SSM views of the same bytes, as the layer's
    ``bind_kv_cache`` does: conv first, then SSM, each in its dtype; the rest is padding."""
    import torch

    from kvtriton.errors import RegionError
    from kvtriton.integrations.vllm.caches import state_views

    buf = torch.zeros(3 * 1000 + 64, dtype=torch.int8)
    pages = buf[64:].view(3, 1, 1, 1000)  # a layer's offset in the shared buffer, page 1000 bytes
    conv, ssm = state_views(pages, ((40, 3), (2, 4, 8)), (torch.float32, torch.float32))
    assert conv.shape == (3, 40, 3) and ssm.shape == (3, 2, 4, 8)
    assert conv.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # views, no copy
    ssm[1].fill_(1.5)
    start = 64 + 1000 + 40 * 3 * 4
    assert torch.equal(buf[start:start + 256].view(torch.float32), torch.full((64,), 1.5))
    with pytest.raises(RegionError, match="do not fit"):
        state_views(pages, ((40, 3), (8, 4, 8)), (torch.float32, torch.float32))
