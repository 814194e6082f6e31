"""Descriptors one decode rank posts for one request, counted once: kvtriton's by each way its
payloads may travel and by the ways the cost model chooses, and what vLLM's NixlConnector posts
for the same request (its formula lives here too, as the baseline beside them).

``kvtriton plan`` (:mod:`kvtriton.cli.plan`) and the sweep's ``descriptors`` section
(``bench/descriptors.py``) both report :func:`count_descriptors`; pure (numpy and the standard
library), like the rest of the planner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..spec import Kind, RegionSpec
from .cost import CostModel
from .runs import direct_runs
from .topology import split_sources
from .types import ChunkGeometry, TransferPlan, Way
from .ways import choose_way, way_descriptors

__all__ = ["PayloadCount", "DescriptorCount", "count_descriptors", "nixl_connector_descriptors"]


def nixl_connector_descriptors(num_sources: int, num_layers: int, num_blocks: int, kv_streams: int = 1) -> int:
    """The baseline: descriptors vLLM's NixlConnector posts per decode rank for one request,
    ``num_sources * kv_streams * num_layers * num_blocks``: one READ per (source rank, layer,
    block) of the decode rank's head slice, K and V of a block in one descriptor
    (``kv_streams=1``, vLLM 0.33), or one each (``kv_streams=2``). The planner never plans this
    path; it is here only to put kvtriton's counts beside it.

    >>> nixl_connector_descriptors(1, 80, 512)  # Llama-3-70B P4 -> D8, 8k tokens in 16-token blocks
    40960
    """
    return num_sources * kv_streams * num_layers * num_blocks


@dataclass(frozen=True)
class PayloadCount:
    """One staged payload (a source rank's part of the request): its chunks, the descriptors of
    every way it may travel, and the way the cost model chooses."""

    src_rank: int
    chunks: int
    ways: dict[Way, int]
    chosen: Way


@dataclass(frozen=True)
class DescriptorCount:
    """Descriptors of one request on one decode rank.

    ``staged``: the payloads' STAGED route, one READ per payload and chunk (what the plan's
    routes cost before a way is chosen per request); ``chosen``: the payloads by the ways the
    cost model chooses; ``direct``: the coalesced block runs of the DIRECT regions (moving
    ``direct_bytes``);
    ``nixl_connector`` / ``nixl_connector_kv_separate``: vLLM's NixlConnector for the same
    request, a block's K and V in one descriptor or one each."""

    payloads: tuple[PayloadCount, ...]
    staged: int
    chosen: int
    direct: int
    direct_bytes: int
    nixl_connector: int
    nixl_connector_kv_separate: int

    @property
    def route(self) -> int:
        """Every payload by its STAGED route, plus the direct runs."""
        return self.staged + self.direct

    @property
    def total(self) -> int:
        """Every payload by its chosen way, plus the direct runs."""
        return self.chosen + self.direct


def count_descriptors(plan: TransferPlan, src_specs: Sequence[RegionSpec], dst_specs: Sequence[RegionSpec],
                      src_ids: np.ndarray, dst_ids: np.ndarray, num_blocks: int, *,
                      cost: CostModel | None = None, chunk_bytes: int | None = None) -> DescriptorCount:
    """The descriptors ``plan``'s decode rank posts for a request of ``num_blocks`` blocks whose
    compacted ids are ``src_ids`` / ``dst_ids`` (:func:`~kvtriton.plan.compact_request`), in
    staging chunks of ``chunk_bytes`` (``None``: one chunk per payload); ``cost`` (default: the
    default model) chooses each payload's way.

    The baseline reads, per SPLIT region, the decode rank's heads from every source rank holding
    some of them, and each REPLICATE region from one source rank."""
    cost = cost or CostModel()
    runs = direct_runs(plan, src_specs, dst_specs, src_ids, dst_ids)
    payloads = []
    for read in plan.staged:
        chunks = 0 if num_blocks == 0 else (
            ChunkGeometry.fit(read.bytes_per_block, num_blocks, chunk_bytes).count if chunk_bytes else 1)
        ways = {way: way_descriptors(read, way, src_specs, dst_specs, src_ids, dst_ids, max(chunks, 1))
                for way in read.ways}
        chosen = choose_way(read, src_specs, dst_specs, src_ids, dst_ids, cost, chunks=max(chunks, 1))
        payloads.append(PayloadCount(read.src_rank, chunks, ways, chosen))
    packed = separate = 0
    for spec in dst_specs:
        k = (len(split_sources(plan.dst_rank, plan.dst_tp, plan.src_tp, spec.total_heads))
             if spec.kind is Kind.SPLIT else 1)
        packed += nixl_connector_descriptors(k, 1, num_blocks)
        separate += nixl_connector_descriptors(k, 1, num_blocks, 2 if spec.kind is Kind.SPLIT else 1)
    return DescriptorCount(
        payloads=tuple(payloads), staged=sum(p.chunks for p in payloads),
        chosen=sum(p.ways[p.chosen] for p in payloads), direct=len(runs), direct_bytes=int(runs.total_bytes),
        nixl_connector=packed, nixl_connector_kv_separate=separate)
