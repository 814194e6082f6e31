"""Hybrid caches in the pure planner and ``kvtriton plan``: state regions beside attention regions
(per-region block sizes), the presets' groups, and the descriptor counts against NixlConnector's.
No torch here (the planner and the CLI never import it)."""

from __future__ import annotations

import json

import pytest

from kvtriton.cli import main
from kvtriton.cli.hybrid_plan import HYBRID_PRESETS, explain_hybrid, hybrid_from_config, is_hybrid
from kvtriton.errors import IncompatibleRemoteError, TopologyError
from kvtriton.hybrid import GDNState, Mamba2State, state_specs
from kvtriton.plan import Route, build_plan
from kvtriton.plan.models import LayerKV, ModelKV, rank_specs
from kvtriton.spec import Kind

NEMO = Mamba2State(intermediate=8192, n_groups=8, state_size=128, conv_kernel=4, num_heads=128, head_dim=64)


def _engine(rank: int, tp: int, block: int, conv_layout: str = "SD"):
    attn = rank_specs(ModelKV("m", (LayerKV("attn.0", Kind.SPLIT, 8, (128, 128), "bfloat16", 2),)), rank, tp, 64,
                      block)
    return attn + state_specs("mamba.0", NEMO, rank=rank, tp=tp, num_blocks=64, conv_dtype="bfloat16",
                              ssm_dtype="float32", conv_layout=conv_layout, page_bytes=1 << 23)


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_state_regions_plan_beside_attention(src_tp, dst_tp):
    """Per-region block sizes (16-token attention, 3-position conv, 1-slot SSM), equal on both
    engines: one plan, every source rank's staged segments in one payload."""
    src = _engine(0, src_tp, 16)
    for d in range(dst_tp):
        plan = build_plan(d, dst_tp, _engine(d, dst_tp, 16, "DS"), src_tp, src, modes="staged")
        assert plan.src_block_size is None  # no token map: every region keeps its block size
        regions = {g.region for p in plan.staged for g in p.segments}
        assert regions == set(range(5))
        for p in plan.staged:
            assert {g.block_size for g in p.segments} <= {16, 3, 1}


def test_attention_block_size_change_with_state_is_refused_typed():
    with pytest.raises(IncompatibleRemoteError, match="several block sizes"):
        build_plan(0, 1, _engine(0, 1, 32), 1, _engine(0, 1, 16))


def test_replicate_b_c_are_whole_blocks_direct_in_ds_only():
    g1 = Mamba2State(intermediate=8192, n_groups=1, state_size=128, conv_kernel=4, num_heads=128, head_dim=64)

    def specs(rank, tp, layout):
        return state_specs("m", g1, rank=rank, tp=tp, num_blocks=8, conv_dtype="bfloat16", ssm_dtype="float32",
                           conv_layout=layout)

    assert build_plan(1, 2, specs(1, 2, "DS"), 1, specs(0, 1, "DS")).routes[1:3] == (Route.DIRECT, Route.DIRECT)
    # in SD a rank's B is a strided run per position: staged, in the payload
    assert build_plan(1, 2, specs(1, 2, "SD"), 1, specs(0, 1, "SD")).routes[1:3] == (Route.STAGED, Route.STAGED)


def test_presets_groups():
    groups = {name: [(g.kind, len(g.layers), g.window) for g in hybrid_from_config(cfg, name).groups]
              for name, cfg in HYBRID_PRESETS.items()}
    assert groups == {
        "Qwen3-Next-80B-A3B": [("full", 12, None), ("gdn", 36, None)],
        "Nemotron-H-8B": [("full", 4, None), ("mamba2", 24, None)],
        "gpt-oss-120b": [("full", 18, None), ("sliding", 18, 128)],
        "Gemma-3-27B": [("full", 10, None), ("sliding", 52, 1024)],
    }
    qwen = hybrid_from_config(HYBRID_PRESETS["Qwen3-Next-80B-A3B"]).groups[1].state
    assert qwen == GDNState(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4)
    assert hybrid_from_config(HYBRID_PRESETS["Nemotron-H-8B"]).groups[1].state == NEMO
    assert all(is_hybrid(cfg) for cfg in HYBRID_PRESETS.values())
    assert not is_hybrid({"num_hidden_layers": 2, "num_attention_heads": 8})


def test_counts_against_nixl_connector():
    nemo = hybrid_from_config(HYBRID_PRESETS["Nemotron-H-8B"], "nemo")
    rep = explain_hybrid(nemo, 1, 2, tokens=8192, block_size=16, run=0)
    r = rep["ranks"][0]
    full, mamba = r["groups"]
    assert (full["blocks"], mamba["blocks"]) == (512, 1)
    assert full["nixl_connector"] == 4 * 512 and mamba["nixl_connector"] == 4 * 24  # x, B, C, SSM per layer
    assert r["kvtriton"]["staged_descriptors"] == 1  # one source rank, one payload for every group
    rep = explain_hybrid(nemo, 2, 1, tokens=8192, block_size=16, run=0)
    r = rep["ranks"][0]
    assert r["groups"][0]["nixl_connector"] == 2 * 4 * 512 and r["groups"][1]["nixl_connector"] == 2 * 4 * 24
    assert r["kvtriton"]["staged_descriptors"] == 2
    oss = explain_hybrid(hybrid_from_config(HYBRID_PRESETS["gpt-oss-120b"]), 2, 4, tokens=8192, run=0)
    sliding = oss["ranks"][0]["groups"][1]
    assert sliding["blocks"] == 128 // 16 + 1 and sliding["nixl_connector"] == 18 * 9


def test_non_dividing_pair_and_n_groups_1():
    cfg = {"num_hidden_layers": 4, "hybrid_override_pattern": "M*M-", "num_attention_heads": 12,
           "num_key_value_heads": 6, "head_dim": 64, "mamba_num_heads": 12, "mamba_head_dim": 16, "n_groups": 1,
           "ssm_state_size": 16, "conv_kernel": 4, "torch_dtype": "bfloat16"}
    rep = explain_hybrid(hybrid_from_config(cfg, "tiny"), 2, 3, tokens=512, run=0)
    r = rep["ranks"][1]
    assert r["groups"][1]["nixl_connector"] is None and not r["nixl_connector"]["supported"]
    assert "B/C" in rep["note"]
    with pytest.raises(TopologyError, match="n_groups"):
        explain_hybrid(hybrid_from_config({**cfg, "n_groups": 2}, "tiny"), 2, 3, tokens=512)


def test_cli_presets_and_config(tmp_path, capsys):
    for name in HYBRID_PRESETS:
        assert main(["plan", "--model", name, "--prefill-tp", "2", "--decode-tp", "1", "--cost", "default"]) == 0
        assert "NixlConnector" in capsys.readouterr().out
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HYBRID_PRESETS["Qwen3-Next-80B-A3B"]))
    assert main(["plan", "--model", str(path), "--prefill-tp", "1", "--decode-tp", "2", "--cost", "default",
                 "--json", "--conv-layout", "DS"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["conv_layout"] == "DS" and [g["kind"] for g in rep["ranks"][0]["groups"]] == ["full", "gdn"]
    assert main(["plan", "--model", "Nemotron-H-8B", "--prefill-tp", "3", "--decode-tp", "1", "--cost",
                 "default"]) == 2
