"""Descriptor counts of the systems kvtriton is measured against (not kvtriton's own planning).

These formulas describe what other transfer paths post per decode rank for one request, so the
sweep can put kvtriton's counts (``kvtriton.plan.staged_descriptor_count`` and the DIRECT runs)
beside them: the baselines of docs/results.md and of the ``descriptors`` section of
``bench/sweep.py``. vLLM's NixlConnector formula is the library's
(:func:`kvtriton.plan.count.nixl_connector_descriptors`, which ``kvtriton plan`` prints too).
"""

from __future__ import annotations

from kvtriton.plan.count import nixl_connector_descriptors

__all__ = ["per_token_descriptor_count", "vllm_direct_descriptor_count"]

#: vLLM-style direct head-slice reads per decode rank: ``k * L * n`` with K and V packed per block
#: (``kv_streams=1``), ``k * 2 * L * n`` with K and V as separate streams
vllm_direct_descriptor_count = nixl_connector_descriptors


def per_token_descriptor_count(num_sources: int, num_layers: int, num_tokens: int) -> int:
    """One descriptor per (source, layer, K/V, token): the non-staged path for NHD caches,
    where a head slice is not contiguous inside a block (``2 * L * tokens`` per source)."""
    return num_sources * 2 * num_layers * num_tokens
