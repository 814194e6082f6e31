"""``kvtriton plan`` for hybrid models: per KV cache group, what kvtriton posts against NixlConnector.

Pure planning (standard library and numpy, no torch): a hybrid model's cache is several KV cache
groups (vLLM's ``kv_cache_groups``): full attention (every block of the request), sliding window
(only the last ``cdiv(window, block) + 1`` blocks move), Mamba2 or Gated DeltaNet state (one state
page per request). The regions come from :mod:`kvtriton.hybrid` (state) and
:mod:`kvtriton.plan.models` (attention), the plan from :func:`~kvtriton.plan.build_plan` over all
of them; a request's staged part is one payload per source rank whatever its groups (HYBRID_CONTRACT
section 2), so kvtriton posts one descriptor per (source rank, chunk) plus the DIRECT runs of the
regions that go zero-copy. NixlConnector posts one read per (source rank, layer, block) of
attention (K and V together, or one each) and per (source rank, layer, sub-projection) of state:
x, B, C and SSM (GDN q, k, v, SSM), 4 per Mamba layer, DS layout only, and only between TP sizes
that divide (``ssm_conv_transfer_utils.py``); at ``n_groups == 1`` with TP > 1 on either side its
conv offsets read the wrong B/C bytes (:func:`kvtriton.hybrid.nixl_connector_conv_reads`).

Presets are ``config.json`` excerpts (:data:`HYBRID_PRESETS`): the published configs' numbers,
the keys this module reads and nothing else, parsed as a ``--model config.json`` would be.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import PlanError, RegionError, TopologyError
from ..hybrid import GDNState, Mamba2State, StateModel, nixl_connector_conv_reads, state_specs
from ..plan import CostModel, build_plan, ceil_div, direct_runs, split_sources
from ..plan.count import nixl_connector_descriptors
from ..plan.ids import fragmented_ids as block_ids
from ..plan.models import DTYPE_BYTES, LayerKV, ModelKV, rank_specs
from ..spec import Kind, Layout, RegionSpec

__all__ = ["HYBRID_PRESETS", "KVGroup", "HybridModel", "is_hybrid", "hybrid_from_config", "explain_hybrid",
           "format_hybrid"]

#: config.json excerpts of the published models (Hugging Face, the keys read here):
#: Qwen/Qwen3-Next-80B-A3B-Instruct: 48 layers, every 4th full attention (16 q / 2 KV heads x 256),
#:   the others Gated DeltaNet (16 key heads x 128, 32 value heads x 128, conv kernel 4), bf16;
#: nvidia/Nemotron-H-8B-Base-8K: 52 layers, pattern M-M-M-M*-...: 24 Mamba2 (128 heads x 64,
#:   n_groups 8, state 128, conv kernel 4), 4 attention (32 q / 8 KV heads x 128), 24 MLP, bf16
#:   (vLLM keeps its SSM state fp32: ``mamba_ssm_cache_dtype``);
#: openai/gpt-oss-120b: 36 layers alternating sliding (window 128) and full attention, 64 q / 8 KV
#:   heads x 64, bf16;
#: google/gemma-3-27b-it (text_config): 62 layers, every 6th full, the others sliding (window 1024),
#:   32 q / 16 KV heads x 128, bf16.
HYBRID_PRESETS: dict[str, dict] = {
    "Qwen3-Next-80B-A3B": {
        "num_hidden_layers": 48, "full_attention_interval": 4, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16"},
    "Nemotron-H-8B": {
        "num_hidden_layers": 52, "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "expand": 2, "torch_dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32"},
    "gpt-oss-120b": {
        "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "hidden_size": 2880, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18, "torch_dtype": "bfloat16"},
    "Gemma-3-27B": {
        "text_config": {"num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
                        "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024, "sliding_window_pattern": 6},
        "torch_dtype": "bfloat16"},
}

_SLIDING = {"sliding_attention", "local", "chunked_attention"}
_FULL = {"full_attention", "attention", "global"}
_LINEAR = {"linear_attention"}


@dataclass(frozen=True)
class KVGroup:
    """Layers of one kind of cache (vLLM may split a kind into several groups of equal size; the
    counts are the same). ``kind``: ``full``, ``sliding``, ``mamba2`` or ``gdn``."""

    kind: str
    layers: tuple[int, ...]
    window: int | None = None
    state: StateModel | None = None


@dataclass(frozen=True)
class HybridModel:
    name: str
    groups: tuple[KVGroup, ...]
    kv_heads: int
    head_dim: int
    dtype: str
    ssm_dtype: str

    def blocks(self, group: KVGroup, tokens: int, block_size: int) -> int:
        """Blocks of group ``group`` a request of ``tokens`` tokens moves."""
        n = ceil_div(tokens, block_size)
        if group.state is not None:
            return 1
        if group.window is not None:
            return min(n, ceil_div(group.window, block_size) + 1)
        return n


def is_hybrid(cfg: Mapping) -> bool:
    """Whether a parsed config describes a model this module plans (sliding window, Mamba2 or GDN layers)."""
    cfg = _text(cfg)
    types = cfg.get("layer_types") or []
    return bool(cfg.get("hybrid_override_pattern") or cfg.get("full_attention_interval")
                or cfg.get("sliding_window_pattern") or cfg.get("linear_num_key_heads")
                or (isinstance(types, list) and any(t in _SLIDING | _LINEAR for t in types)))


def _text(cfg: Mapping) -> Mapping:
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        return {**cfg["text_config"], **{k: cfg[k] for k in ("torch_dtype", "dtype") if k not in cfg["text_config"]
                                         and k in cfg}}
    return cfg


def _int(cfg: Mapping, key: str, name: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RegionError(f"{name}: {key} must be a positive integer, got {v!r}")
    return v


def _dtype(value: object, name: str) -> str:
    key = str(value).removeprefix("torch.").lower()
    if key not in DTYPE_BYTES:
        raise RegionError(f"{name}: unknown dtype {value!r}")
    return DTYPE_BYTES[key][0]


def hybrid_from_config(cfg: Mapping, name: str = "model") -> HybridModel:
    """A hybrid model's groups from a parsed ``config.json``: ``layer_types`` (sliding / full /
    linear attention), Gemma 3's ``sliding_window_pattern``, Qwen3-Next's
    ``full_attention_interval`` and ``linear_*`` keys, Nemotron-H's ``hybrid_override_pattern``
    (``M`` Mamba2, ``*`` attention, ``-``/``E`` no cache) and ``mamba_*`` keys."""
    cfg = _text(cfg)
    layers = _int(cfg, "num_hidden_layers", name)
    dtype = _dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16", name)
    heads = _int(cfg, "num_attention_heads", name)
    head_dim = cfg.get("head_dim") or cfg.get("attention_head_dim")
    head_dim = _int({"head_dim": head_dim}, "head_dim", name) if head_dim else _int(cfg, "hidden_size", name) // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    kinds: list[str]
    state: StateModel | None = None
    if cfg.get("hybrid_override_pattern"):
        pattern = str(cfg["hybrid_override_pattern"])
        if len(pattern) != layers:
            raise RegionError(f"{name}: hybrid_override_pattern has {len(pattern)} layers, num_hidden_layers {layers}")
        kinds = [{"M": "mamba2", "*": "full"}.get(c, "") for c in pattern]
        mh, md = _int(cfg, "mamba_num_heads", name), _int(cfg, "mamba_head_dim", name)
        state = Mamba2State(intermediate=mh * md, n_groups=_int(cfg, "n_groups", name),
                            state_size=_int(cfg, "ssm_state_size", name), conv_kernel=_int(cfg, "conv_kernel", name),
                            num_heads=mh, head_dim=md)
    else:
        types = cfg.get("layer_types")
        if not types and cfg.get("full_attention_interval"):
            every = _int(cfg, "full_attention_interval", name)
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
        if not types and cfg.get("sliding_window_pattern"):
            every = _int(cfg, "sliding_window_pattern", name)
            types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers:
            raise RegionError(f"{name}: layer_types must list num_hidden_layers ({layers}) entries")
        kinds = []
        for i, t in enumerate(types):
            if t in _FULL:
                kinds.append("full")
            elif t in _SLIDING:
                kinds.append("sliding")
            elif t in _LINEAR:
                kinds.append("gdn")
            else:
                raise RegionError(f"{name}: layer {i} is {t!r}: expected one of "
                                  f"{sorted(_FULL | _SLIDING | _LINEAR)}")
        if "gdn" in kinds:
            state = GDNState(num_k_heads=_int(cfg, "linear_num_key_heads", name),
                             num_v_heads=_int(cfg, "linear_num_value_heads", name),
                             head_k_dim=_int(cfg, "linear_key_head_dim", name),
                             head_v_dim=_int(cfg, "linear_value_head_dim", name),
                             conv_kernel=_int(cfg, "linear_conv_kernel_dim", name))
    window = cfg.get("sliding_window") if "sliding" in kinds else None
    if window is not None:
        window = _int(cfg, "sliding_window", name)
    groups = tuple(KVGroup(k, tuple(i for i, x in enumerate(kinds) if x == k),
                           window if k == "sliding" else None, state if k in ("mamba2", "gdn") else None)
                   for k in ("full", "sliding", "mamba2", "gdn") if k in kinds)
    ssm_dtype = _dtype(cfg.get("mamba_ssm_cache_dtype") or dtype, name)
    return HybridModel(name, groups, _int({"kv": kv_heads}, "kv", name), head_dim, dtype, ssm_dtype)


def _regions(model: HybridModel, rank: int, tp: int, num_blocks: int, block_size: int, layout: Layout,
             conv_layout: str) -> tuple[list[RegionSpec], list[int]]:
    """Every region of ``rank`` in layer order, and each one's group (index into ``model.groups``)."""
    by_layer: dict[int, int] = {i: g for g, grp in enumerate(model.groups) for i in grp.layers}
    specs: list[RegionSpec] = []
    group_of: list[int] = []
    size = DTYPE_BYTES[model.dtype][1]
    for i in sorted(by_layer):
        g = by_layer[i]
        grp = model.groups[g]
        if grp.state is not None:
            new = state_specs(f"layers.{i}", grp.state, rank=rank, tp=tp, num_blocks=num_blocks,
                              conv_dtype=model.dtype, ssm_dtype=model.ssm_dtype, conv_layout=conv_layout)
        else:
            layer = LayerKV(f"layers.{i}", Kind.SPLIT, model.kv_heads, (model.head_dim, model.head_dim), model.dtype,
                            size)
            new = rank_specs(ModelKV(model.name, (layer,)), rank, tp, num_blocks, block_size, layout)
        specs.extend(new)
        group_of.extend([g] * len(new))
    return specs, group_of


def _nixl(model: HybridModel, grp: KVGroup, d: int, p_tp: int, d_tp: int, blocks: int) -> tuple[int | None, int]:
    """NixlConnector's descriptors for one group (``None``: it does not move this group at this
    pair), and with K and V separate."""
    if grp.state is not None:
        if p_tp % d_tp and d_tp % p_tp:
            return None, 0
        sources = max(1, p_tp // d_tp)
        per = len(nixl_connector_conv_reads(grp.state, p_tp, d_tp, d, 1)) // sources + 1  # 3 conv parts + SSM
        n = sources * per * len(grp.layers)
        return n, n
    k = len(split_sources(d, d_tp, p_tp, model.kv_heads))
    return (nixl_connector_descriptors(k, len(grp.layers), blocks),
            nixl_connector_descriptors(k, len(grp.layers), blocks, 2))


def explain_hybrid(model: HybridModel, prefill_tp: int, decode_tp: int, *, block_size: int = 16,
                   tokens: int = 8192, layout: Layout | str = Layout.HND, conv_layout: str = "SD",
                   cost: CostModel | None = None, run: int = 8, chunk_bytes: int | None = None,
                   ranks: list[int] | None = None) -> dict:
    """The report of a hybrid model: per decode rank and KV cache group, blocks, bytes, kvtriton's
    descriptors and NixlConnector's; kvtriton's whole request: one staged descriptor per (source
    rank, chunk) plus the DIRECT runs. Raises the planner's typed errors."""
    cost = cost or CostModel()
    layout = Layout(layout)
    for what, v in (("tokens", tokens), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"{what} must be a positive integer, got {v!r}")
    for grp in model.groups:
        if grp.state is not None:
            for engine, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
                try:
                    grp.state.check_tp(tp)
                except TopologyError as e:
                    raise TopologyError(f"{engine} engine: {e}") from None
    if ranks is not None and any(not 0 <= r < decode_tp for r in ranks):
        raise PlanError(f"decode ranks {ranks} are out of range for decode TP {decode_tp}")

    n_all = ceil_div(tokens, block_size)
    num_blocks = int(block_ids(n_all, run)[-1]) + 1
    src, group_of = _regions(model, 0, prefill_tp, num_blocks, block_size, layout, conv_layout)
    out_ranks = []
    for d in range(decode_tp) if ranks is None else ranks:
        dst, _ = _regions(model, d, decode_tp, num_blocks, block_size, layout, conv_layout)
        plan = build_plan(d, decode_tp, dst, prefill_tp, src, cost=cost)
        per_source: dict[int, int] = {}
        for read in plan.staged:
            for seg in read.segments:
                n = model.blocks(model.groups[group_of[seg.region]], tokens, block_size)
                per_source[read.src_rank] = per_source.get(read.src_rank, 0) + n * seg.tile_bytes
        groups: list[dict[str, Any]] = []
        direct_total = 0
        for g, grp in enumerate(model.groups):
            n = model.blocks(grp, tokens, block_size)
            ids = block_ids(n, run)
            mine = {i for i, x in enumerate(group_of) if x == g}
            sub = dataclasses.replace(plan, direct=tuple(dr for dr in plan.direct if dr.region in mine))
            direct = len(direct_runs(sub, src, dst, ids, ids)) if sub.direct else 0
            direct_total += direct
            nbytes = sum(n * dst[i].tile_bytes(j, dst[i].local_heads) for i in mine for j in range(dst[i].num_streams))
            nixl, nixl_kv = _nixl(model, grp, d, prefill_tp, decode_tp, n)
            groups.append(dict(kind=grp.kind, layers=len(grp.layers), window=grp.window, blocks=n, bytes=nbytes,
                               regions=len(mine), direct_regions=len(sub.direct), direct_descriptors=direct,
                               nixl_connector=nixl, nixl_connector_kv_separate=nixl_kv))
        staged = sum(ceil_div(b, chunk_bytes) if chunk_bytes else 1 for b in per_source.values())
        supported = all(x["nixl_connector"] is not None for x in groups)
        out_ranks.append(dict(
            decode_rank=d, groups=groups, sources=sorted(per_source),
            kvtriton=dict(staged_descriptors=staged, direct_descriptors=direct_total,
                          descriptors=staged + direct_total, staged_bytes=sum(per_source.values()),
                          bytes=sum(x["bytes"] for x in groups)),
            nixl_connector=dict(supported=supported,
                                descriptors=sum(x["nixl_connector"] or 0 for x in groups),
                                descriptors_kv_separate=sum(x["nixl_connector_kv_separate"] for x in groups))))
    return dict(model=model.name, prefill_tp=prefill_tp, decode_tp=decode_tp, block_size=block_size, tokens=tokens,
                layout=layout.value, conv_layout=conv_layout, dtype=model.dtype, ssm_dtype=model.ssm_dtype, run=run,
                chunk_bytes=chunk_bytes, note=nixl_n_groups_1_note(model, prefill_tp, decode_tp), ranks=out_ranks)


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} B"


def format_hybrid(rep: dict) -> str:
    """The hybrid report as text, one table per decode rank."""
    state = any(g["kind"] in ("mamba2", "gdn") for r in rep["ranks"] for g in r["groups"])
    out = [f"kvtriton plan: {rep['model']} (hybrid), P{rep['prefill_tp']} -> D{rep['decode_tp']}, "
           f"{rep['tokens']:,} tokens, attention block {rep['block_size']} ({rep['layout']}), {rep['dtype']}"
           + (f", conv state {rep['conv_layout']}, SSM state {rep['ssm_dtype']}" if state else "")]
    if state:
        out.append("  (vLLM raises the attention block size of a Mamba/GDN hybrid so an attention page holds a "
                   "state page: give the engine's with --block-size)")
    for r in rep["ranks"]:
        out.append("")
        out.append(f"decode rank {r['decode_rank']} (reads P{', P'.join(map(str, r['sources']))}):")
        out.append(f"  {'group':<10}{'layers':>7}{'blocks':>8}{'bytes':>14}{'kvtriton direct':>17}"
                   f"{'NixlConnector':>15}")
        for g in r["groups"]:
            kind = g["kind"] + (f" {g['window']}" if g["window"] else "")
            nixl = "unsupported" if g["nixl_connector"] is None else f"{g['nixl_connector']:,}"
            out.append(f"  {kind:<10}{g['layers']:>7}{g['blocks']:>8,}{_size(g['bytes']):>14}"
                       f"{g['direct_descriptors']:>17,}{nixl:>15}")
        k, v = r["kvtriton"], r["nixl_connector"]
        out.append(f"  kvtriton: {k['staged_descriptors']:,} staged descriptor{'s' * (k['staged_descriptors'] != 1)} "
                   f"(one per source rank{' and chunk' if rep['chunk_bytes'] else ''}, every group in one payload) + "
                   f"{k['direct_descriptors']:,} direct = {k['descriptors']:,}; {_size(k['bytes'])}")
        line = (f"  vLLM NixlConnector: {v['descriptors']:,} descriptors (per source rank, layer and block; "
                f"{v['descriptors_kv_separate']:,} with K and V separate"
                + ("; state: x, B, C and SSM per layer)" if state else ")"))
        if not v["supported"]:
            line += (f"; it does not move Mamba/GDN state between P{rep['prefill_tp']} and D{rep['decode_tp']} "
                     "(TP sizes must divide)")
        out.append(line)
    if rep.get("note"):
        out.append("")
        out.append(f"note: {rep['note']}")
    return "\n".join(out)


def load_hybrid(path_or_preset: str) -> HybridModel | None:
    """The hybrid model a preset names or a config.json describes; ``None`` when it is not hybrid
    (plain ``kvtriton plan`` handles it)."""
    import json
    import os

    if path_or_preset in HYBRID_PRESETS and not os.path.exists(path_or_preset):
        return hybrid_from_config(HYBRID_PRESETS[path_or_preset], path_or_preset)
    path = os.path.join(path_or_preset, "config.json") if os.path.isdir(path_or_preset) else path_or_preset
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None  # plain kvtriton plan reports it
    if not isinstance(cfg, Mapping) or not is_hybrid(cfg):
        return None
    label = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    return hybrid_from_config(cfg, label)


def nixl_n_groups_1_note(model: HybridModel, p_tp: int, d_tp: int) -> str | None:
    """The NixlConnector defect where it applies (Mamba2, ``n_groups == 1``, TP > 1 on a side)."""
    for grp in model.groups:
        if isinstance(grp.state, Mamba2State) and grp.state.n_groups == 1 and max(p_tp, d_tp) > 1:
            return ("NixlConnector reads wrong B/C bytes here: n_groups 1 gives every rank a whole B and C, its "
                    "offsets assume them sharded (kvtriton.hybrid.nixl_connector_conv_reads)")
    return None

