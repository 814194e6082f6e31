"""Hybrid models P/D through kvtriton on real engines (issue 32; vLLM's CPU build, ``make vllm-bed``),
with vLLM's hybrid KV cache manager on (the connector is ``SupportsHMA``).

One pair per model kind, together covering P2->D1, P1->D2 and a pair that does not divide:

* Gemma-3 (sliding window 48 + full attention, 2 KV cache groups) at P2->D1: the window group
  carries only its last ``cdiv(48, 32) + 1`` = 3 blocks on both sides;
* Nemotron-H (Mamba2 + attention, 3 groups), ``n_groups`` 2 at P1->D2 in vLLM's DS conv layout;
* Nemotron-H with ``n_groups`` 1 at P2->D3 (does not divide; every rank of both engines holds B
  and C whole, as vLLM's ``extra_groups_for_head_shards`` makes them): SD conv layout;
* Qwen3-Next (Gated DeltaNet + attention, bf16) at P2->D1.

Each: the prefill's params are one block list per group (a list of lists), with a state group
``remote_num_tokens`` = prompt - 1 (the decode computes the last token on the state it loaded);
a negative control (the prefill's blocks in every group overwritten before the load: the byte
oracle tells the loaded bytes from the digests taken before); then tokens identical to one
engine and **every group's bytes** equal per region, conv sub-projection (x/B/C, q/k/v) and SSM
head (:class:`beds.vllm_hybrid.HybridPair`, on vLLM's own tensors, not kvtriton's regions).
Tokens alone miss a wrong B/C read.

Needs ``RegionSpec.group`` and per-group ``hold``/``fetch`` (issue 32, ``group``) and
``kvtriton.hybrid.state_regions`` (``state``): without them a hybrid engine's workers refuse to
register their caches. The scheduler-side bookkeeping is tested without engines in
tests/unit/test_vllm_hybrid_scheduler.py and tests/engines/vllm_scheduler_check.py.
"""

import json
import random
import subprocess

import pytest
from helpers.vllm_bed_python import vllm_bed_python

from beds import child_env
from beds.vllm_hybrid import HybridPair

pytestmark = pytest.mark.vllm
VLLM_PY = vllm_bed_python()
LENGTHS = (77, 130)  # 130 tokens = 5 blocks of 32, of which a 48-token window reaches the last 3
BLOCK = 32

CASES = [  # id, model kind, its options, P TP, D TP, conv layout
    ("gemma3-p2d1", "gemma3", {}, 2, 1, None),
    ("nemotronh-ng2-p1d2-DS", "nemotronh", {"n_groups": 2}, 1, 2, "DS"),
    ("nemotronh-ng1-p2d3-SD", "nemotronh", {"n_groups": 1}, 2, 3, "SD"),
    ("qwen3next-p2d1", "qwen3next", {}, 2, 1, None),
]


def _model(tmp_path_factory, kind, options):
    path = tmp_path_factory.mktemp(kind)
    subprocess.run([VLLM_PY, "-m", "beds.vllm_models", kind, str(path), json.dumps(options)], check=True, timeout=600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
    return path


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(32)
    return [[rng.randrange(500) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("kind,options,p_tp,d_tp,layout", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hybrid_pd_tokens_and_every_group_bytes(tmp_path_factory, tmp_path, prompts, kind, options, p_tp, d_tp,
                                                layout):
    model = _model(tmp_path_factory, kind, options)
    pair = HybridPair(VLLM_PY, model, tmp_path, kind, p_tp, d_tp, conv_layout=layout, block_size=BLOCK)
    try:
        ref = pair.reference(prompts, "ref")
        neg = pair.negative_control(prompts)
        res = pair.transfer(prompts, ref)
        params = res["params"]
        state = kind != "gemma3"
        for p, kp in zip(prompts, params):
            ids = kp["remote_block_ids"]
            assert isinstance(ids, list) and all(isinstance(g, list) for g in ids) and len(ids) >= 2, kp
            assert kp["remote_num_tokens"] == len(p) - (1 if state else 0), kp  # the Mamba/GDN backoff
            if kind == "gemma3":  # [sliding window, full]: the window's last cdiv(48, 32) + 1 blocks
                n = kp["remote_num_tokens"]
                assert [len(g) for g in ids] == [min(3, -(-n // BLOCK)), -(-n // BLOCK)], ids
            else:  # a state group carries one block
                assert sorted(len(g) for g in ids)[0] == 1, ids
        keys = res["digests"]["keys"]
        print(f"{kind} {options} P{p_tp}->D{d_tp} {layout or ''}: tokens identical {res['identical']}/{res['n']}, "
              f"prompt tokens computed {res['prompt_computed']}, regions byte-equal {res['digests']['regions']} "
              f"({keys}); negative control: the oracle caught {neg['caught']}/{len(prompts)} overwritten loads, "
              f"tokens {'changed' if neg['tokens'] != ref else 'unchanged'}")
        if kind == "nemotronh":  # every SSM head, every B/C group, every x head checked
            heads = 12
            for region, n in keys.items():
                part = region.rsplit(".", 1)[-1]
                want = {"x": heads, "ssm": heads, "B": options["n_groups"], "C": options["n_groups"]}.get(part)
                assert want is None or n == want, (region, n, want)
            assert any(r.endswith(".B") for r in keys) and any(r.endswith(".ssm") for r in keys), keys
        if kind == "qwen3next":
            assert {r.rsplit(".", 1)[-1] for r in keys} >= {"q", "k", "v", "ssm"}, keys
    finally:
        pair.close()


NIXL_OFFSETS = r"""
import json
from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import MambaConvSplitInfo
# Nemotron-H-tiny, n_groups 1: x = 12 heads x 16 = 192 channels, B = C = one group x state 16;
# DS conv pages [channels, K-1 = 3] fp32: channel c of a page starts at byte c * 3 * 4
ROW = 3 * 4
def columns(offsets):
    return [(o // ROW, n // ROW) for o, n in offsets]
out = {}
# P1 -> D2: the prefill's page is x[0:192] | B[192:208] | C[208:224]; a decode rank holds half of x
# and B, C whole (vLLM's extra_groups_for_head_shards), so its local dims are (96, 16, 16)
d = MambaConvSplitInfo(conv_rows=3, local_proj_dims=(96, 16, 16), conv_dtype_size=4, ssm_sizes=(128 * ROW, 0))
out["p1d2"] = [columns(d.remote_conv_offsets(r, 2)) for r in (0, 1)]
# P2 -> D1: a prefill rank's page is x[96] | B[16] | C[16]; the decode holds (192, 16, 16)
d = MambaConvSplitInfo(conv_rows=3, local_proj_dims=(192, 16, 16), conv_dtype_size=4, ssm_sizes=(224 * ROW, 0))
out["p2d1"] = columns(d.remote_conv_offsets(0, -2))
print(json.dumps(out))
"""


def test_nixl_connector_offsets_miss_replicated_b_c():
    """Why the byte oracle checks B and C per group: with ``n_groups`` 1 every rank holds B and C
    whole, but NixlConnector's ``remote_conv_offsets`` (vLLM's own code, this bed's version) takes
    them as split like x. Its (first channel, channels) per sub-projection against the prefill
    page's real ones: x is right, B and C are other bytes (C, the SSM state past the conv state,
    half a group). kvtriton's column maps read B and C whole from one replica (test above)."""
    out = subprocess.run([VLLM_PY, "-c", NIXL_OFFSETS], capture_output=True, text=True, timeout=600, env=child_env())
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    right_p1d2 = [[(96 * r, 96), (192, 16), (208, 16)] for r in (0, 1)]
    nixl_p1d2 = [[tuple(x) for x in rank] for rank in got["p1d2"]]
    print(f"P1->D2 NixlConnector {nixl_p1d2} vs real {right_p1d2}; P2->D1 NixlConnector {got['p2d1']} "
          "vs real [(0, 96), (96, 16), (112, 16)] per prefill rank")
    assert [rank[0] for rank in nixl_p1d2] == [rank[0] for rank in right_p1d2]  # x: right
    assert nixl_p1d2[0][1] == (192, 16)  # rank 0's B: right
    assert nixl_p1d2[1][1] == (208, 16)  # rank 1's B: the prefill's C
    assert [rank[2][0] for rank in nixl_p1d2] == [224, 240]  # C: past the conv state (the SSM state's bytes)
    assert [tuple(x) for x in got["p2d1"]] == [(0, 96), (96, 8), (104, 8)]  # half of B, then half of B as C
