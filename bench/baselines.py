"""Descriptor counts of other systems' transfer paths, the baselines our staged counts are set against.

They describe vLLM's NixlConnector and a per-token path, not anything kvtriton does, so they live
with the benchmarks rather than in the planner (:func:`kvtriton.plan.staged_descriptor_count` is ours).
"""

from __future__ import annotations

__all__ = ["vllm_direct_descriptor_count", "per_token_descriptor_count"]


def vllm_direct_descriptor_count(num_sources: int, num_layers: int, num_blocks: int, kv_streams: int = 1) -> int:
    """vLLM-style direct head-slice reads per decode rank: ``k * L * n`` with K and V packed per
    block (``kv_streams=1``), ``k * 2 * L * n`` with K and V as separate streams."""
    return num_sources * kv_streams * num_layers * num_blocks


def per_token_descriptor_count(num_sources: int, num_layers: int, num_tokens: int) -> int:
    """One descriptor per (source, layer, K/V, token): the non-staged path for NHD caches,
    where a head slice is not contiguous inside a block (``2 * L * tokens`` per source)."""
    return num_sources * 2 * num_layers * num_tokens
