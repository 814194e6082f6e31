"""vLLM's cache tensors as kvtriton regions (kvtriton.integrations.vllm.caches; no vLLM needed).

Caches are built the way vLLM lays them out (a backing tensor per group, physical order by the
layout's stride permutation over logical [L, B, H, N, C], per-layer [B, H, N, C] views, padded
block rows), moved between hetero-TP ranks through the plan and the torch repack, and checked
byte-exact against the global cache, with every untouched block compared too."""

import numpy as np
import pytest
import torch

from kvtriton.errors import RegionError
from kvtriton.integrations.vllm.caches import layer_sort_key, regions_from_vllm_caches
from kvtriton.plan import CostModel, head_range
from kvtriton.regions import Kind, Layout
from kvtriton.testing.oracle import local_transfer

# stride permutations of vllm/v1/kv_cache_layout.py: physical order of the logical axes L, B, H, N, C
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
L, B, N, C, H = 3, 12, 4, 16, 4  # layers, blocks, block_size, K||V content, global KV heads


def vllm_caches(layout: str, heads: int, *, pad: int = 0, mla_layers=(), gen=None) -> dict[str, torch.Tensor]:
    """Per-layer logical [B, heads, N, C] views of one backing tensor in ``layout``; ``pad`` extra
    elements after every block row (block-outermost layouts) or every page (layer-outermost)."""
    order = LAYOUTS[layout]
    sizes = (L, B, heads, N, C)
    phys_shape = [sizes[d] for d in order]
    # pad the second physical axis' stride: a block (or layer) row longer than its content
    row = int(np.prod(phys_shape[2:]))
    backing = torch.empty(phys_shape[0] * phys_shape[1] * (row + pad)).normal_(generator=gen)
    strides = [0] * 5
    strides[4] = 1
    for i in (3, 2):
        strides[i] = strides[i + 1] * phys_shape[i + 1]
    strides[1] = row + pad
    strides[0] = phys_shape[1] * (row + pad)
    phys = backing.as_strided(phys_shape, strides)
    logical = phys.permute([order.index(d) for d in range(5)])  # [L, B, H, N, C]
    caches = {f"model.layers.{i}.self_attn.attn": logical[i] for i in range(L)}
    for name in mla_layers:  # MLA: [B, N, C] of its own, identical on every rank
        caches[name] = torch.empty(B, N, 24).normal_(generator=gen)
    return caches


def global_cache(gen):
    return [torch.randn(B, H, N, C, generator=gen) for _ in range(L)], torch.randn(B, N, 24, generator=gen)


def load(caches, rank, tp, glob, mla_glob):
    h0, h1 = head_range(rank, tp, H)
    for i in range(L):
        caches[f"model.layers.{i}.self_attn.attn"].copy_(glob[i][:, h0:h1])
    if "mtp.mla" in caches:
        caches["mtp.mla"].copy_(mla_glob)


@pytest.mark.parametrize("p_layout,d_layout", [("LBHNC", "LBHNC"), ("LBNHC", "LBHNC"), ("BLHNC", "LBNHC"),
                                               ("BLNHC", "BHLNC"), ("LHBNC", "BLHNC")])
@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (4, 2), (1, 1)])
@pytest.mark.parametrize("pad", [0, 8])
def test_vllm_layouts_move_byte_exact(gen, p_layout, d_layout, p_tp, d_tp, pad):
    glob, mla_glob = global_cache(gen)
    mla = ("mtp.mla",)
    p_caches = [vllm_caches(p_layout, H // p_tp, pad=pad, mla_layers=mla, gen=gen) for _ in range(p_tp)]
    d_caches = [vllm_caches(d_layout, H // d_tp, pad=pad, mla_layers=mla, gen=gen) for _ in range(d_tp)]
    for r, c in enumerate(p_caches):
        load(c, r, p_tp, glob, mla_glob)
    before = [{k: v.clone() for k, v in c.items()} for c in d_caches]
    kw = dict(block_size=N, total_kv_heads=H, mla_layers=mla)
    p_regions = [regions_from_vllm_caches(c, **kw) for c in p_caches]
    d_regions = [regions_from_vllm_caches(c, **kw) for c in d_caches]
    src, dst = np.array([3, 9, 0, 4]), np.array([7, 2, 11, -1])  # -1: a block the decode has
    local_transfer(p_regions, d_regions, src, dst)
    for r, c in enumerate(d_caches):
        h0, h1 = head_range(r, d_tp, H)
        for i in range(L):
            got = c[f"model.layers.{i}.self_attn.attn"]
            want = before[r][f"model.layers.{i}.self_attn.attn"].clone()
            for s, d in zip(src, dst):
                if d >= 0:
                    want[d] = glob[i][s, h0:h1]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (r, i)
        want_mla = before[r]["mtp.mla"].clone()
        for s, d in zip(src, dst):
            if d >= 0:
                want_mla[d] = mla_glob[s]
        assert torch.equal(c["mtp.mla"].view(torch.uint8), want_mla.view(torch.uint8))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_regions_view_the_cache_without_copies(gen, layout):
    caches = vllm_caches(layout, 2, pad=4, mla_layers=("mtp.mla",), gen=gen)
    regions = regions_from_vllm_caches(caches, block_size=N, total_kv_heads=H, mla_layers=("mtp.mla",))
    assert [r.spec.name for r in regions] == sorted(caches, key=layer_sort_key)
    for r in regions:
        t = caches[r.spec.name]
        assert r.streams[0].untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        assert r.spec.num_streams == 1  # K||V stays one stream
        if r.spec.name == "mtp.mla":
            assert r.spec.kind is Kind.REPLICATE and r.spec.local_heads == 1
        else:
            # the physical order inside a block decides the layout kvtriton sees
            head_major = LAYOUTS[layout].index(2) < LAYOUTS[layout].index(3)
            assert r.spec.layout is (Layout.HND if head_major else Layout.NHD)
            assert r.spec.head_dims == (C,) and r.spec.local_heads == 2


def test_layer_order_is_numeric():
    names = ["model.layers.10.attn", "model.layers.2.attn", "model.layers.1.attn"]
    assert sorted(names, key=layer_sort_key) == ["model.layers.1.attn", "model.layers.2.attn", "model.layers.10.attn"]


def test_legacy_five_d_caches(gen):
    # [2, B, N, H, D] (K/V outermost) and [B, 2, N, H, D] (blocks first), token-major inside a block
    kv_outer = torch.randn(2, B, N, 2, 8, generator=gen)
    blocks_first = torch.randn(B, 2, N, 2, 8, generator=gen)
    for t, kv_dim in ((kv_outer, 0), (blocks_first, 1)):
        [r] = regions_from_vllm_caches({"l0": t}, block_size=N, total_kv_heads=4)
        assert r.spec.num_streams == 2 and r.spec.layout is Layout.NHD
        assert torch.equal(r.streams[1], t.select(kv_dim, 1))


def test_bad_caches_raise_region_errors():
    with pytest.raises(RegionError, match="block_size=4"):
        regions_from_vllm_caches({"l0": torch.zeros(B, 2, 5, C)}, block_size=N, total_kv_heads=4)
    with pytest.raises(RegionError, match="not a vLLM attention cache"):
        regions_from_vllm_caches({"l0": torch.zeros(B, 2, N)}, block_size=N, total_kv_heads=4)
    with pytest.raises(RegionError, match="without a cache"):
        regions_from_vllm_caches({"l0": torch.zeros(B, 2, N, C)}, block_size=N, total_kv_heads=4, mla_layers=["x"])
    with pytest.raises(RegionError, match="MLA layer"):
        regions_from_vllm_caches({"m": torch.zeros(B, 2, N, C)}, block_size=N, total_kv_heads=4, mla_layers=["m"])


def test_settings_are_checked():
    from kvtriton.integrations.vllm.settings import SettingsError, from_extra_config

    s = from_extra_config({"port": 6000, "lease_s": 5, "mode": "push"})
    assert s.port == 6000 and s.lease_s == 5.0 and s.mode == "push" and s.cost_model == "default"
    assert from_extra_config({"cost_model": "measured"}).cost_model == "measured"
    assert s.pinned_cost() is None and from_extra_config({"cost_model": "measured"}).pinned_cost() \
        is None
    pinned = from_extra_config({"cost_model": "desc_us=1.5, pass_us=90"}).pinned_cost()
    assert (pinned.desc_us, pinned.pass_us, pinned.pack_gbps) == (1.5, 90.0, CostModel().pack_gbps)
    assert pinned.source.startswith("pinned")
    assert from_extra_config({}).consumer == ""  # holds bound to the first engine that asks
    assert from_extra_config({"consumer": "decode-0"}).consumer == "decode-0"
    assert s.eager_guess and not from_extra_config({"eager_guess": False}).eager_guess
    assert (s.register, s.integrity) == ("all", False)
    assert (s.idle_wait_s, s.replicate_stripe, s.agent_stripe) == (0.002, 1, 1)  # one replica, as NixlConnector
    assert from_extra_config({"replicate_stripe": 0}).agent_stripe is None  # every replica
    hardened = from_extra_config({"register": "staging", "integrity": True})
    assert (hardened.register, hardened.integrity) == ("staging", True)
    for bad, match in (({"consumer": 3}, "must be str"), ({"eager_guess": 0}, "must be bool"),
                       ({"prot": 1}, "unknown keys"), ({"port": "6000"}, "must be int"), ({"port": 0}, "TCP port"),
                       ({"mode": "both"}, "pull"), ({"lease_s": 0}, "> 0"), ({"staging_bytes": True}, "must be int"),
                       ({"cost_model": "guess"}, "'default', 'measured'"), ({"register": "cache"}, "'staging'"),
                       ({"cost_model": "desc_us=0"}, "not a number in"), ({"cost_model": "desc_us=x"}, "not a number"),
                       ({"cost_model": "desc_us=inf"}, "not a number"), ({"cost_model": "speed=3"}, "not one of"),
                       ({"cost_model": "desc_us=1,desc_us=2"}, "twice"),
                       ({"integrity": 1}, "must be bool"), ({"idle_wait_s": -0.001}, "0 to 0.1 seconds"),
                       ({"idle_wait_s": 1}, "0 to 0.1 seconds"), ({"idle_wait_s": float("nan")}, "0 to 0.1"),
                       ({"replicate_stripe": -1}, ">= 0"), ({"replicate_stripe": 1.0}, "must be int")):
        with pytest.raises(SettingsError, match=match):
            from_extra_config(bad)


def test_remote_params_are_checked():
    from kvtriton.integrations.vllm.scheduler import ParamsError, parse_remote_params, remote_params

    good = remote_params("P", "127.0.0.1", 6000, 2, 16, "req-1", [3, 4])
    src = parse_remote_params(good, 16)
    assert (src.engine_id, src.port, src.tp_size, src.block_ids) == ("P", 6000, 2, (3, 4))
    assert parse_remote_params({**good, "remote_block_ids": [[3, 4]]}, 16).block_ids == (3, 4)  # one group
    for field, value in (("remote_port", 70000), ("remote_port", True), ("tp_size", 0), ("remote_engine_id", ""),
                         ("remote_block_ids", [1, -2]), ("remote_block_ids", "12"), ("remote_request_id", None),
                         ("remote_block_size", 0), ("remote_block_size", "32")):
        with pytest.raises(ParamsError):
            parse_remote_params({**good, field: value}, 16)
    assert parse_remote_params({**good, "remote_block_size": 32}, 16).block_size == 32  # a block-size change


def test_remote_num_tokens_sent_by_the_prefill_and_honoured_by_the_decode():
    """vLLM 0.34's proxy protocol: the prefill's params carry ``remote_num_tokens`` (the prompt
    tokens its held blocks hold); the decode loads no more than that, and refuses a count its
    block ids cannot hold (computed locally)."""
    from types import SimpleNamespace

    from kvtriton.integrations.vllm.scheduler import ParamsError, SchedulerSide, parse_remote_params

    p = SchedulerSide(engine_id="P", host="127.0.0.1", port=6000, tp_size=1, block_size=16)
    preq = SimpleNamespace(request_id="p1", kv_transfer_params={"do_remote_decode": True}, num_prompt_tokens=40,
                           status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
    p.get_num_new_matched_tokens(preq, 0)
    p._prefills["p1"].held = True  # the step that completed its prompt placed the hold
    delay, params = p.request_finished(preq, [4, 5, 6])
    assert delay and params["remote_num_tokens"] == 40 and params["remote_block_ids"] == [4, 5, 6]
    assert parse_remote_params(params, 16).num_tokens == 40
    assert parse_remote_params({k: v for k, v in params.items() if k != "remote_num_tokens"}, 16).num_tokens is None

    d = SchedulerSide(engine_id="D", host="127.0.0.1", port=1, tp_size=1, block_size=16)

    def matched(n_prompt, extra, computed=0):
        req = SimpleNamespace(request_id="d", kv_transfer_params={**params, **extra}, num_prompt_tokens=n_prompt)
        return d.get_num_new_matched_tokens(req, computed)

    assert matched(40, {}) == (40, True)
    assert matched(40, {"remote_num_tokens": 33}) == (33, True)  # fewer than the prompt: only those
    assert matched(40, {"remote_num_tokens": 33}, computed=16) == (17, True)
    assert matched(40, {"remote_num_tokens": 0}) == (0, False)  # nothing computed remotely: all local
    assert matched(40, {"remote_num_tokens": None}) == (40, True)  # not said: what the blocks hold
    for bad in (49, -1, True, "40", 40.0):  # 3 blocks of 16 hold at most 48 tokens
        with pytest.raises(ParamsError, match="remote_num_tokens"):
            parse_remote_params({**params, "remote_num_tokens": bad}, 16)
        assert matched(40, {"remote_num_tokens": bad}) == (0, False)  # computed locally


def test_cpu_attention_caches_are_described_as_k_dim_major(gen):
    caches = vllm_caches("LBHNC", 2, pad=0, mla_layers=("mtp.mla",), gen=gen)
    regions = regions_from_vllm_caches(caches, block_size=N, total_kv_heads=H, mla_layers=("mtp.mla",),
                                       k_dim_major=True)
    for r in regions:
        want = () if r.spec.name == "mtp.mla" else (r.spec.head_dims[0] // 2,)
        assert r.spec.dim_major == want
    nhd = vllm_caches("LBNHC", 2, pad=0, gen=gen)
    with pytest.raises(RegionError, match="not head-major, but k_dim_major"):
        regions_from_vllm_caches(nhd, block_size=N, total_kv_heads=H, k_dim_major=True)


def test_connector_flow_and_its_old_name_mode():
    from kvtriton.integrations.vllm.settings import SettingsError, from_extra_config

    assert from_extra_config({}).transfer_flow == "pull"
    assert from_extra_config({"flow": "push"}).transfer_flow == "push"
    assert from_extra_config({"mode": "push"}).transfer_flow == "push"
    with pytest.raises(SettingsError, match="old name of 'flow'"):
        from_extra_config({"flow": "pull", "mode": "push"})
    with pytest.raises(SettingsError, match="'pull' or 'push'"):
        from_extra_config({"flow": "both"})
