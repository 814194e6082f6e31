"""A model's KV geometry without weights or tensors: what each layer keeps in the paged cache.

Pure (standard library only, plus the torch-free :mod:`kvtriton.spec`). A :class:`ModelKV` is one
:class:`LayerKV` per cached region (its kind, global KV heads, head_dim per stream, dtype), read
from a Hugging Face ``config.json`` (:func:`from_hf_config`: no network, no weights) or named
(:data:`PRESETS`, the sweep's models, the same geometry as ``bench/presets.py``), and turned
into one rank's :class:`~kvtriton.spec.RegionSpec` list (:func:`rank_specs`) for
:func:`~kvtriton.plan.build_plan`. ``kvtriton plan`` (:mod:`kvtriton.cli`) explains a plan from
these; nothing in the agent or the connector reads them (they plan from real tensors).

What a config maps to (vLLM's cache for the same model):

* GQA/MHA: ``num_key_value_heads`` (default ``num_attention_heads``; a per-layer list is
  honoured) heads of ``head_dim`` (default ``hidden_size // num_attention_heads``), K and V as
  two streams, SPLIT over the TP ranks; ``layer_types`` may mix sliding and full attention (same
  geometry); a layer type without a paged KV cache (linear attention, Mamba) is refused.
* MLA (``kv_lora_rank``): one latent of ``kv_lora_rank + qk_rope_head_dim`` elements per token,
  REPLICATE; with ``index_head_dim`` (DeepSeek-V3.2's indexer) a second REPLICATE region per
  layer, uint8, ``index_head_dim`` fp8 values plus a 4-byte scale per 128 of them.
* Multimodal configs hold the language model's keys under ``text_config``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import RegionError
from ..spec import Kind, Layout, RegionSpec
from .topology import head_range

__all__ = ["LayerKV", "ModelKV", "PRESETS", "DTYPE_BYTES", "from_hf_config", "load_model", "rank_specs"]

# dtype names as configs spell them -> (torch's spelling, bytes per element)
DTYPE_BYTES: dict[str, tuple[str, int]] = {
    "bfloat16": ("bfloat16", 2), "float16": ("float16", 2), "half": ("float16", 2),
    "float32": ("float32", 4), "float": ("float32", 4),
    "float8_e4m3fn": ("float8_e4m3fn", 1), "float8_e5m2": ("float8_e5m2", 1), "fp8": ("float8_e4m3fn", 1),
    "uint8": ("uint8", 1), "int8": ("int8", 1),
}
# attention layer types of `layer_types` (transformers' spelling) whose KV is a paged cache
_ATTENTION_TYPES = {"full_attention", "sliding_attention", "attention", "chunked_attention", "global", "local"}
_INDEXER_QUANT_BLOCK = 128  # DeepSeek-V3.2 indexer: one fp32 scale per 128 fp8 values


@dataclass(frozen=True)
class LayerKV:
    """One cached region of a model, independent of TP (what every engine's rank shards)."""

    name: str
    kind: Kind
    total_heads: int
    head_dims: tuple[int, ...]
    dtype: str
    itemsize: int


@dataclass(frozen=True)
class ModelKV:
    """A model's cached regions, in the order both engines list them."""

    name: str
    layers: tuple[LayerKV, ...]

    def count(self, kind: Kind) -> int:
        return sum(1 for x in self.layers if x.kind is kind)


def _dtype(name: object, what: str) -> tuple[str, int]:
    key = str(name).removeprefix("torch.").lower()
    if key not in DTYPE_BYTES:
        raise RegionError(f"{what}: unknown dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def _gqa(prefix: str, layers: int, heads: int, head_dim: int, dtype: str = "bfloat16") -> tuple[LayerKV, ...]:
    name, size = _dtype(dtype, prefix)
    return tuple(LayerKV(f"{prefix}.{i}", Kind.SPLIT, heads, (head_dim, head_dim), name, size) for i in range(layers))


def _mla(prefix: str, layers: int, dim: int = 576, dtype: str = "bfloat16") -> tuple[LayerKV, ...]:
    name, size = _dtype(dtype, prefix)
    return tuple(LayerKV(f"{prefix}.{i}", Kind.REPLICATE, 1, (dim,), name, size) for i in range(layers))


# the sweep's models (bench/presets.py: KV geometry from the public configs)
PRESETS: dict[str, ModelKV] = {
    "llama3-8b": ModelKV("llama3-8b", _gqa("layers", 32, 8, 128)),
    "llama3-70b": ModelKV("llama3-70b", _gqa("layers", 80, 8, 128)),
    "qwen2.5-7b": ModelKV("qwen2.5-7b", _gqa("layers", 28, 4, 128)),  # 4 KV heads: TP8 replicates each twice
    "deepseek-v3": ModelKV("deepseek-v3", _mla("layers", 61)),  # latent 512 + rope 64, identical on every rank
    "llama3-8b+mla-draft": ModelKV("llama3-8b+mla-draft", _gqa("layers", 32, 8, 128) + _mla("draft", 1)),
}


def _positive(cfg: Mapping, key: str, what: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RegionError(f"{what}: {key} must be a positive integer, got {v!r}")
    return v


def from_hf_config(cfg: Mapping, name: str = "model", dtype: str | None = None) -> ModelKV:
    """The cached regions of the model a Hugging Face ``config.json`` (parsed) describes; see the
    module docstring for what maps to what. ``dtype`` overrides the config's (the KV cache dtype,
    e.g. ``"float8_e4m3fn"``). :class:`RegionError` names the key that is missing or wrong.

    >>> m = from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 64, "num_key_value_heads": 8,
    ...                     "hidden_size": 8192, "torch_dtype": "bfloat16"})
    >>> m.layers[0].total_heads, m.layers[0].head_dims, m.layers[0].itemsize
    (8, (128, 128), 2)
    """
    if not isinstance(cfg, Mapping):
        raise RegionError(f"{name}: a config must be a JSON object, got {type(cfg).__name__}")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg["text_config"], **{k: cfg[k] for k in ("torch_dtype", "dtype") if k in cfg
                                        and k not in cfg["text_config"]}}
    layers = _positive(cfg, "num_hidden_layers", name)
    dt_name, size = _dtype(dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16", name)
    if cfg.get("kv_lora_rank"):
        latent = _positive(cfg, "kv_lora_rank", name) + _positive(cfg, "qk_rope_head_dim", name)
        out: list[LayerKV] = []
        index_dim = cfg.get("index_head_dim")
        if index_dim is not None:
            index_dim = _positive(cfg, "index_head_dim", name)
        for i in range(layers):
            out.append(LayerKV(f"layers.{i}", Kind.REPLICATE, 1, (latent,), dt_name, size))
            if index_dim:
                scales = max(1, index_dim // _INDEXER_QUANT_BLOCK) * 4
                out.append(LayerKV(f"layers.{i}.indexer", Kind.REPLICATE, 1, (index_dim + scales,), "uint8", 1))
        return ModelKV(name, tuple(out))
    heads = _positive(cfg, "num_attention_heads", name)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        hidden = _positive(cfg, "hidden_size", name)
        if hidden % heads:
            raise RegionError(f"{name}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                              f"and no head_dim is given")
        head_dim = hidden // heads
    else:
        head_dim = _positive(cfg, "head_dim", name)
    kv = cfg.get("num_key_value_heads", heads)
    kv_per_layer: Sequence[object] = kv if isinstance(kv, list) else [kv] * layers
    if len(kv_per_layer) != layers:
        raise RegionError(f"{name}: num_key_value_heads lists {len(kv_per_layer)} layers, "
                          f"num_hidden_layers is {layers}")
    types = cfg.get("layer_types") or ["full_attention"] * layers
    if not isinstance(types, list) or len(types) != layers:
        raise RegionError(f"{name}: layer_types must list num_hidden_layers ({layers}) entries, got {types!r}")
    out = []
    for i, (t, h) in enumerate(zip(types, kv_per_layer)):
        if t not in _ATTENTION_TYPES:
            raise RegionError(f"{name}: layer {i} is {t!r}, which keeps no paged KV cache; kvtriton plans "
                              f"attention KV only (layer types {sorted(_ATTENTION_TYPES)})")
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise RegionError(f"{name}: layer {i}: num_key_value_heads must be a positive integer, got {h!r}")
        out.append(LayerKV(f"layers.{i}", Kind.SPLIT, h, (head_dim, head_dim), dt_name, size))
    return ModelKV(name, tuple(out))


def load_model(path_or_preset: str, dtype: str | None = None) -> ModelKV:
    """A preset by name, else a ``config.json`` (or a directory holding one). Reads one local
    file; :class:`RegionError` when it is neither, or does not parse."""
    import json
    import os

    if path_or_preset in PRESETS and not os.path.exists(path_or_preset):
        model = PRESETS[path_or_preset]
        if dtype is None:
            return model
        name, size = _dtype(dtype, model.name)
        return ModelKV(model.name, tuple(LayerKV(x.name, x.kind, x.total_heads, x.head_dims, name, size)
                                         for x in model.layers))
    path = os.path.join(path_or_preset, "config.json") if os.path.isdir(path_or_preset) else path_or_preset
    if not os.path.isfile(path):
        raise RegionError(f"{path_or_preset!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json "
                          f"or a directory holding one")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise RegionError(f"{path}: cannot read a JSON config: {e}") from None
    label = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    return from_hf_config(cfg, label, dtype)


def rank_specs(model: ModelKV, rank: int, tp: int, num_blocks: int, block_size: int,
               layout: Layout | str = Layout.HND) -> list[RegionSpec]:
    """Region specs of ``rank`` of a ``tp``-rank engine: dense blocks, K and V as separate
    streams (SPLIT regions in ``layout``; REPLICATE ones ``[block, token, dim]``, as
    :meth:`~kvtriton.regions.Region.mla` makes them). :class:`~kvtriton.errors.TopologyError`
    when ``tp`` cannot shard a region's heads."""
    layout = Layout(layout)
    out = []
    for x in model.layers:
        if x.kind is Kind.REPLICATE:
            d = x.head_dims[0]
            out.append(RegionSpec(x.name, x.kind, Layout.NHD, num_blocks, block_size, 1, 1, x.head_dims, x.dtype,
                                  x.itemsize, ((block_size * d, d, d),)))
            continue
        h0, h1 = head_range(rank, tp, x.total_heads)
        h = h1 - h0
        strides = tuple((block_size * h * d, h * d, d) if layout is Layout.NHD
                        else (h * block_size * d, d, block_size * d) for d in x.head_dims)
        out.append(RegionSpec(x.name, x.kind, layout, num_blocks, block_size, x.total_heads, h, x.head_dims, x.dtype,
                              x.itemsize, strides))
    return out
