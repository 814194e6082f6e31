"""TP pairs vLLM's own NixlConnector refuses, on real engines (vLLM's CPU build, ``make vllm-bed``).

* 6 KV heads at P2->D3: 3 is not a multiple of 2, so each decode rank's heads come from parts
  of both prefill ranks. kvtriton: tokens identical to one engine, every head's bytes equal, a
  negative control. NixlConnector: its handshake asserts ("Local tensor parallel size 3 is not
  divisible by remote tensor parallel size 2") and its loads fail (vLLM recomputes them).
* 1 KV head at P2->D1: fewer KV heads than prefill ranks, so vLLM replicates the head on both
  prefill ranks; the decode takes it from one of them.

A TP3 engine needs a vocabulary vLLM pads to a multiple of 3 (576 = 3 x 192; 512 fails with "512
is not divisible by 3").
"""

import json
import random
import subprocess

import pytest
from helpers.vllm_bed_python import vllm_bed_python

from beds import child_env
from beds.vllm_pair import EnginePair

pytestmark = pytest.mark.vllm
VLLM_PY = vllm_bed_python()

LENGTHS = (37, 100, 170)
SIX_HEADS = {"kv_heads": 6, "heads": 12, "head_dim": 32, "hidden": 192, "vocab": 576}  # CPU attention: head 32+
ONE_HEAD = {"kv_heads": 1, "heads": 4, "head_dim": 32, "hidden": 128}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``models(name, options)``: the Llama of ``options``, written once per module (the six-head
    model serves both connectors' P2->D3)."""
    made = {}

    def model(name, options):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            subprocess.run([VLLM_PY, "-m", "beds.vllm_models", "llama", str(made[name]), json.dumps(options)],
                           check=True, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=child_env())
        return made[name]
    return model


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(23)
    return [[rng.randrange(512) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("name,options,p_tp,d_tp", [("six-heads", SIX_HEADS, 2, 3), ("one-head", ONE_HEAD, 2, 1)])
def test_kvtriton_moves_pairs_vllm_refuses(models, tmp_path, prompts, name, options, p_tp, d_tp):
    model = models(name, options)
    # not every decode rank reads every prefill rank here, yet every hold must end at its last
    # reader's done (issue 19), never by the lease (P_EXTRA's 180 s)
    pair = EnginePair(VLLM_PY, model, tmp_path, p_tp, d_tp)
    try:
        ref = pair.reference(prompts, "ref")
        left = pair.negative_control(prompts, ref)  # a failed first round's holds end by their lease
        res = pair.transfer(prompts, ref)
        heads = res["digests"]["heads"]
        expired = [s["leases_expired"] for s in pair.prefill.call("agent_stats")["stats"]]
        print(f"{name} P{p_tp}->D{d_tp}: tokens identical {res['identical']}/{res['n']}, prompt tokens computed "
              f"{res['prompt_computed']}, regions byte-equal {res['digests']['regions']} ({heads} heads), "
              f"descriptors {res['descriptors']}, holds ended by lease {expired}")
        assert all(n == options["kv_heads"] for n in heads.values()), heads  # every global head checked
        # the holds of a control round whose loads all failed (this host starved an engine past its
        # timeouts) end by the lease, maybe before this count: never more than those per rank
        assert all(n <= left for n in expired) if left else expired == [0] * p_tp, (expired, left)
    finally:
        pair.close()


def test_nixl_connector_refuses_p2_d3(models, tmp_path, prompts):
    """The same P2->D3 through vLLM's NixlConnector: the decode's handshake asserts on the TP
    ratio and its loads fail, so vLLM recomputes every prompt (the outcome kvtriton changes)."""
    model = models("six-heads", SIX_HEADS)
    pair = EnginePair(VLLM_PY, model, tmp_path, 2, 3, connector="nixl")
    try:
        params = pair.prefill_requests(prompts[:1], "p")
        try:
            out = pair.decode_requests(prompts[:1], params, "d", timeout_s=90)
            computed = [o["prompt_computed"] for o in out]
        except (RuntimeError, TimeoutError) as e:  # the engine gave up on the request
            computed, out = [str(e)[:200]], []
        log = pair.decode.log_path.read_text()
        print(f"NixlConnector P2->D3: prompt tokens computed {computed}")
        assert "is not divisible by remote tensor parallel size" in log, log[-3000:]
        assert all(isinstance(c, str) or c == len(prompts[0]) for c in computed), computed
    finally:
        pair.close()
