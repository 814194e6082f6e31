"""The seed's case on real engines: a GQA Llama target with an Eagle-3 MLA draft
(``Eagle3DeepseekV2ForCausalLM``, one MLA layer) in **one** KV cache group (vLLM PR #44583), moved
by KVTritonConnector at P2->D1 and P1->D2 on vLLM's CPU build (``make vllm-bed``).

kvtriton classifies the group per region: the target's layers SPLIT by KV head, the draft's
latent REPLICATE. Tokens cannot validate the draft's KV (the target verifies every draft token),
so every region's bytes are compared (per-region digests). Every region is forced STAGED and the
prefill names its decode engine, so each hold is packed the moment it is placed: the drafter
writes its KV after the target forward, and a hold placed before it (``get_finished``) would ship
a stale draft region; the digests catch that.

vLLM CPU refuses this model twice (no common kernel block size of its CPU attention and MLA
backends; the MLA metadata checking the target's head size): the bed relaxes both declarations
(:mod:`beds.vllm_patches`); GPU backends need none of it for the block size.
"""

import json
import random
import subprocess

import pytest
from helpers.engine_matrix import cases
from helpers.vllm_bed_python import vllm_bed_python

from beds import child_env
from beds.vllm_pair import EnginePair

pytestmark = pytest.mark.vllm
VLLM_PY = vllm_bed_python()

BLOCK = 16
LENGTHS = (37, 100, 170)
PATCHES = ("cpu-attention-block-16", "mla-metadata-target-head-size")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("eagle3-mla")
    for kind, path in (("llama", target), ("eagle3-mla", draft)):
        subprocess.run([VLLM_PY, "-m", "beds.vllm_models", kind, str(path), "{}"], check=True,
                       timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
    return target, draft


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(29)
    return [[rng.randrange(512) for _ in range(n)] for n in LENGTHS]


def options(draft):
    return {"attention_config": {"backend": "CPU_MLA"}, "compilation_config": {"custom_ops": ["-rotary_embedding"]},
            "speculative_config": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2,
                                   "attention_backend": "CPU_MLA"}}  # the draft chooses its own


# One direction of each test in CI, the other in the benchmark (bench/vllm_matrix.py runs both):
# CI runs this cache P2->D1 here and P1->D2 below, each with the negative control and every
# region's bytes; the hold-time pack hazard lives on the prefill (two ranks packing here), and
# the per-request slice way is checked byte-exact both ways over real NIXL in
# tests/agent/test_direct_slice.py.
@pytest.mark.parametrize("p_tp,d_tp", cases([(2, 1)], [(1, 2)]))
def test_gqa_target_with_mla_draft(models, tmp_path, prompts, p_tp, d_tp):
    target, draft = models
    pair = EnginePair(VLLM_PY, target, tmp_path, p_tp, d_tp, block_size=BLOCK, engine_options=options(draft),
                      patches=PATCHES, p_extra={"consumer": f"decode-tp{d_tp}", "modes": "staged"},
                      d_extra={"modes": "staged"})
    try:
        ref = pair.reference(prompts, "ref")
        pair.negative_control(prompts, ref)  # before the decode met the prefill: nothing packed ahead
        res = pair.transfer(prompts, ref)
        kinds = res["digests"]["kinds"]
        print(f"GQA+MLA-draft P{p_tp}->D{d_tp}: tokens identical {res['identical']}/{res['n']}, prompt tokens "
              f"computed {res['prompt_computed']}, regions byte-equal {res['digests']['regions']} "
              f"({json.dumps(kinds)}), descriptors {res['descriptors']}")
        assert sorted(kinds.values()) == ["replicate", "split", "split"], kinds  # 2 target layers + the draft's
        stats = pair.prefill.call("agent_stats")["stats"]
        assert sum(s["eager_chunks"] for s in stats) > 0, stats  # packed at hold time: the hazard was exercised
    finally:
        pair.close()


#: a model under which every request's target payload travels by the per-request direct_slice way:
#: a descriptor (1 us) dearer than repacking its 2 KiB in both passes (pack 10, unpack 5 GB/s: 0.6 us),
#: so the plan cannot fix the slice route, and a pass's fixed cost (300 us) far above a request's
#: slices (at most 11 blocks x 4 segments x 1 us), so each request takes them
SLICE_PER_REQUEST = "desc_us=1.0,pack_gbps=10,unpack_gbps=5,pass_us=300"


@pytest.mark.parametrize("p_tp,d_tp", cases([(1, 2)], [(2, 1)]))
def test_mla_draft_with_the_target_sliced_per_request(models, tmp_path, prompts, p_tp, d_tp):
    """The same cache with the ways chosen per request (auto modes): the decode READs each target
    layer's head slices from the prefill's cache blocks straight into its own (DirectPart, the
    hold offering its cache), the draft's latent DIRECT; every region's bytes compared. The negative
    control first: overwriting the prefill's blocks before the load must change the tokens (nothing
    is packed ahead on this way)."""
    target, draft = models
    pair = EnginePair(VLLM_PY, target, tmp_path, p_tp, d_tp, block_size=BLOCK, engine_options=options(draft),
                      patches=PATCHES, p_extra={"consumer": f"decode-tp{d_tp}", "cost_model": SLICE_PER_REQUEST},
                      d_extra={"cost_model": SLICE_PER_REQUEST})
    try:
        ref = pair.reference(prompts, "ref")
        pair.negative_control(prompts, ref)
        before = pair.decode.call("agent_stats")["stats"]
        loads_before = pair.decode.call("transfer_stats")["stats"]
        res = pair.transfer(prompts, ref)
        after = pair.decode.call("agent_stats")["stats"]
        loads_after = pair.decode.call("transfer_stats")["stats"]
        kinds = res["digests"]["kinds"]
        # payloads by way: the loads' records (the agent counts descriptors, slices among the zero-copy ones)
        sliced = sum(a.get("payloads_direct_slice", 0) - b.get("payloads_direct_slice", 0)
                     for a, b in zip(loads_after, loads_before))
        print(f"GQA+MLA-draft per request P{p_tp}->D{d_tp}: tokens identical {res['identical']}/{res['n']}, "
              f"regions byte-equal {res['digests']['regions']} ({json.dumps(kinds)}), slice payloads {sliced}, "
              f"descriptors {res['descriptors']}")
        assert sorted(kinds.values()) == ["replicate", "split", "split"], kinds
        # every request's target payload from every source rank went the slice way
        assert sliced == len(prompts) * max(1, p_tp // d_tp) * d_tp, (sliced, after)
        assert sum(a["staged_descriptors"] - b["staged_descriptors"] for a, b in zip(after, before)) == 0, after
    finally:
        pair.close()
