"""Descriptor counts of the systems kvtriton is measured against (not kvtriton's own planning).

These formulas describe what other transfer paths post per decode rank for one request, so the
sweep can put kvtriton's counts (``kvtriton.plan.staged_descriptor_count`` and the DIRECT runs)
beside them. They live in bench/ because the planner never plans these paths; they are the
baselines of docs/results.md and of the ``descriptors`` section of ``bench/sweep.py``.
Pure arithmetic: importable as ``bench.baselines`` (tests) and as ``baselines`` (bench scripts).
"""

from __future__ import annotations

__all__ = ["per_token_descriptor_count", "vllm_direct_descriptor_count"]


def vllm_direct_descriptor_count(num_sources: int, num_layers: int, num_blocks: int, kv_streams: int = 1) -> int:
    """vLLM-style direct head-slice reads per decode rank: ``k * L * n`` with K and V packed per
    block (``kv_streams=1``), ``k * 2 * L * n`` with K and V as separate streams."""
    return num_sources * kv_streams * num_layers * num_blocks


def per_token_descriptor_count(num_sources: int, num_layers: int, num_tokens: int) -> int:
    """One descriptor per (source, layer, K/V, token): the non-staged path for NHD caches,
    where a head slice is not contiguous inside a block (``2 * L * tokens`` per source)."""
    return num_sources * 2 * num_layers * num_tokens
