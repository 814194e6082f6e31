"""KVTritonConnector inside real vLLM engines (the test bed: ``make vllm-bed``; nothing mocked).

Each engine is a child process running vLLM (the CPU build 0.32) on a tiny random-weight GQA Llama
made here; kvtriton moves the prompt KV from a prefill engine to a decode engine over real NIXL.
Oracles: the decode's greedy tokens equal the same engine computing the prompt itself, **and** the
decode computed at most one prompt token per request (counted from the scheduler's own outputs),
so a connector that silently recomputes cannot pass; a negative control (the prefill's blocks
overwritten before the load) must change the tokens, so the KV really travelled.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.vllm_bed_python import vllm_bed_python
from helpers.vllm_engines import MAX_TOKENS, Pair  # the model_dir and prompts fixtures: conftest.py
from helpers.vllm_versions import VersionChecks

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent  # the scripts the bed runs live beside this module
pytestmark = pytest.mark.vllm
VLLM_PY = vllm_bed_python()

# timeouts: the bed's (tests/helpers/vllm_engines.py), sized for a host that starves an engine for a minute


def transfer_and_check(pair, prompts, tag):
    ref = pair.reference(prompts, tag=f"{tag}-ref")
    params = pair.prefill_requests(prompts, f"{tag}-p")
    out = pair.decode_requests(prompts, params, f"{tag}-d")
    got = [o["tokens"] for o in out]
    computed = [o["prompt_computed"] for o in out]
    assert got == ref, f"decode tokens differ from one engine: {got} vs {ref}"
    assert all(c <= 1 for c in computed), f"decode recomputed prompt tokens: {computed}"
    pair.settle(pair.prefill)  # every hold was released once the decode ranks were done
    pair.settle(pair.decode)
    return ref, params


@pytest.fixture(scope="module")
def pair_1_1(model_dir, tmp_path_factory):
    pair = Pair(model_dir, tmp_path_factory.mktemp("p1d1"), 1, 1)
    yield pair
    pair.close()


@pytest.fixture(scope="module")
def pair_short_lease(model_dir, tmp_path_factory):
    """P1->D1 whose prefill keeps an unfetched request's blocks 6 s (the decode renews queued holds
    every second): for the tests of holds that end by their lease. The transfers of the other
    tests run under the bed's lease (180 s), which a host starving an engine for seconds does not
    outlast (a slow first meeting once outlasted a 6 s lease)."""
    pair = Pair(model_dir, tmp_path_factory.mktemp("p1d1-lease"), 1, 1, p_extra={"lease_s": 6.0},
                d_extra={"lease_s": 6.0})
    yield pair
    pair.close()


@pytest.fixture(scope="module")
def scheduler_checks(tmp_path_factory):
    """tests/engines/vllm_scheduler_check.py under 0.32, 0.33 and 0.34, the three at once."""
    checks = VersionChecks(HERE / "vllm_scheduler_check.py", tmp_path_factory.mktemp("scheduler-checks"))
    yield checks
    checks.close()


def test_scheduler_side_on_vllm_032(scheduler_checks):
    rc, out, err = scheduler_checks.result("0.32")
    assert rc == 0 and "ok 0.32" in out, err[-3000:]


@pytest.mark.parametrize("version", ["0.33", "0.34"])
def test_scheduler_side_on_upstream_vllm(scheduler_checks, version):
    """The same check against upstream vLLM's own classes, unpacked beside the bed (never run as an engine)."""
    rc, out, err = scheduler_checks.result(version)
    assert rc == 0 and f"ok {version}" in out, err[-3000:]


def test_p1_d1_tokens_identical_and_nothing_recomputed(pair_1_1, prompts):
    transfer_and_check(pair_1_1, prompts, "a")


def test_unfetched_prefill_is_released_when_its_lease_ends(pair_short_lease, prompts):
    pair = pair_short_lease
    pair.prefill_requests(prompts[:2], "lease")
    state = pair.prefill.call("state")
    assert state["free_blocks"] < state["total_blocks"]  # kept for a decode that never comes
    t0 = time.monotonic()
    pair.settle(pair.prefill, seconds=40)  # lease_s=6: vLLM gets the blocks back after it
    assert time.monotonic() - t0 > 3


def test_abort_mid_load_frees_everything(pair_short_lease, prompts):
    pair = pair_short_lease
    params = pair.prefill_requests(prompts[:2], "ab-p")
    pair.prefill.signal(signal.SIGSTOP)  # a prefill that stops answering mid-transfer
    try:
        pair.decode.call("submit", requests=[
            {"id": f"ab-d{i}", "prompt": p, "max_tokens": MAX_TOKENS, "kv_transfer_params": kp}
            for i, (p, kp) in enumerate(zip(prompts[:2], params))], steps=3)
        state = pair.decode.call("state")
        assert state["requests"] == 2 and state["free_blocks"] < state["total_blocks"]  # waiting for KV
        pair.decode.call("abort", ids=["ab-d0", "ab-d1"])
        pair.settle(pair.decode, seconds=20)  # cancelled loads reported; blocks and staging back
    finally:
        pair.prefill.signal(signal.SIGCONT)
    pair.settle(pair.prefill, seconds=40)  # its holds end by lease (nobody will say done)
    # both engines still serve: a fresh transfer works
    transfer_and_check(pair, prompts[:2], "after-abort")


def test_prefill_killed_before_load_is_recomputed(pair_1_1, prompts):
    pair = pair_1_1
    ref = pair.reference(prompts, tag="kill-ref")
    params = pair.prefill_requests(prompts, "kill-p")
    pair.prefill.kill()  # SIGKILL after request_finished, before the decode loads
    out = pair.decode_requests(prompts, params, "kill-d")
    assert [o["tokens"] for o in out] == ref  # load errors -> vLLM recomputed the blocks
    assert all(o["prompt_computed"] > 1 for o in out)  # ... and really did
    pair.settle(pair.decode)


#: a planning model under which these small requests are packed (a pass costs its bytes only, 10 GB/s
#: both ways: the default before a pass's fixed cost was priced), for the tests of eager packing; with
#: the default model they are read from the prefill's cache blocks (direct_slice), nothing packed
PACKING = {"cost_model": "unpack_gbps=10,pass_us=0.01,segment_us=0.01"}


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_hetero_tp_tokens_identical_and_negative_control(model_dir, tmp_path, prompts, p_tp, d_tp):
    pair = Pair(model_dir, tmp_path, p_tp, d_tp, p_extra=PACKING, d_extra=PACKING)
    try:
        # negative control first: overwrite the prefill's blocks before the decode loads them. It
        # runs while the decode has not connected yet, so nothing was packed at hold time (an eager
        # pack would carry the KV as it was when held, not as scrambled)
        ref = pair.reference(prompts, tag="neg-ref")
        params = pair.prefill_requests(prompts, "neg-p")
        blocks = sorted({b for p in params for b in p["remote_block_ids"]})
        scrambled = pair.prefill.call("scramble", block_ids=blocks)["scrambled"]
        assert all(n == 2 * len(blocks) for n in scrambled), scrambled  # 2 layers on every rank
        out = pair.decode_requests(prompts, params, "neg-d")
        assert [o["tokens"] for o in out] != ref, "tokens did not change with the KV overwritten"
        assert all(o["prompt_computed"] <= 1 for o in out)
        pair.settle(pair.prefill)
        assert not any(s["eager_guessed"] for s in pair.prefill.call("transfer_stats")["stats"])
        # the decode is now the only engine connected: the connector's holds (no consumer named)
        # are packed and offered to it ahead of its loads, and the tokens are those of one engine
        transfer_and_check(pair, prompts, "h")
        stats = pair.prefill.call("transfer_stats")["stats"]
        assert all(s["eager_guessed"] > 0 and s["eager_hits"] > 0 for s in stats), stats
    finally:
        pair.close()


def test_named_consumer_packs_ahead_and_moves_the_kv(model_dir, tmp_path, prompts):
    """A prefill that names its decode engine (``consumer``) packs each finished request before
    the pull and offers it: tokens stay identical, nothing is recomputed, staging all comes back."""
    pair = Pair(model_dir, tmp_path, 2, 1, p_extra={"consumer": "decode-tp1", **PACKING}, d_extra=PACKING)
    try:
        transfer_and_check(pair, prompts[:1], "warm")  # the decode meets the prefill: packs need its ranks
        transfer_and_check(pair, prompts, "e")
        p_stats = pair.prefill.call("agent_stats")["stats"]
        d_stats = pair.decode.call("agent_stats")["stats"]
        assert sum(s["eager_chunks"] for s in p_stats) > 0, p_stats
        assert sum(s["eager_hits"] for s in p_stats) + sum(s["offers_taken"] for s in d_stats) > 0, (p_stats, d_stats)
        assert sum(s["refused"] + s["bad_messages"] for s in p_stats + d_stats) == 0, (p_stats, d_stats)
    finally:
        pair.close()


@pytest.mark.parametrize("p_tp,d_tp,p_block,d_block", [(2, 1, 32, 64), (1, 1, 64, 32)])
def test_block_size_change_moves_the_kv(model_dir, tmp_path, prompts, p_tp, d_tp, p_block, d_block):
    # the engines page their caches with different block sizes. vLLM's CPU attention keeps K
    # dim-major inside a block ([head_size, block_size] per head, see the probe below); the
    # connector says so (RegionSpec.dim_major) and the pack regroups the real tokens into the
    # decode's blocks: tokens identical to one engine, at most one prompt token computed.
    pair = Pair(model_dir, tmp_path, p_tp, d_tp, p_block=p_block, d_block=d_block)
    try:
        _, params = transfer_and_check(pair, prompts, "bs")
        assert all(p["remote_block_size"] == p_block for p in params)
    finally:
        pair.close()


CPU_K_PROBE = """
import torch, vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
for bs in (32, 64):
    kv = torch.zeros(2, 1, bs, 2 * 32)                      # [blocks, heads, block_size, K||V]
    k_cache, v_cache = kv.view(2, 1, 2 * bs, 32).chunk(2, dim=2)   # how cpu_attn.py splits it
    key = torch.arange(bs * 32, dtype=torch.float32).view(bs, 1, 32)
    torch.ops._C.cpu_attn_reshape_and_cache(key, -key, k_cache, v_cache, torch.arange(bs) + bs, "vec")
    assert torch.equal(kv[1, 0].reshape(-1)[:bs * 32], key[:, 0].t().reshape(-1))   # K: [head_size, block_size]
    assert torch.equal(kv[1, 0].reshape(-1)[bs * 32:], -key.reshape(-1))           # V: [block_size, head_size]
print("ok")
"""


def test_vllm_cpu_attention_keeps_k_dim_major_inside_a_block():
    """What the connector's k_dim_major describes: the CPU build's cache keeps K dim-major per block."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([VLLM_PY, "-c", CPU_K_PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_staging_only_and_integrity_move_the_kv(model_dir, tmp_path, prompts):
    """Both engines with ``register: staging`` (only staging registered with NIXL, every region
    STAGED) and ``integrity: true`` (each chunk digested after its pack and checked before
    unpack): tokens identical to one engine, nothing recomputed, every chunk checked, none failed."""
    hardened = {"register": "staging", "integrity": True}
    pair = Pair(model_dir, tmp_path, 2, 1, p_extra=hardened, d_extra=hardened)
    try:
        transfer_and_check(pair, prompts, "iso")
        p_stats = pair.prefill.call("agent_stats")["stats"]
        d_stats = pair.decode.call("agent_stats")["stats"]
        assert all(s["digested_chunks"] > 0 for s in p_stats + d_stats), (p_stats, d_stats)
        assert sum(s["integrity_failures"] + s["direct_descriptors"] + s["one_sided_descriptors"]
                   for s in d_stats) == 0, d_stats
    finally:
        pair.close()
