"""The plan of one pair of ranks: what one source rank sends one destination rank, made once.

Pure (numpy). A :class:`~kvtriton.plan.TransferPlan` says what a destination rank reads from a
source engine; every request between one source rank and that destination then needs the same
geometry of the pair's caches: per staged payload its feasible ways, which segments coalesce
runs on either side, its head slices' rows and columns; per DIRECT region its groups and rows.
A :class:`PairPlan` computes all of it once, when the peer is added (vLLM's NIXL connector does
the same: a flat plan per remote engine at handshake, executors with no model branching; the
split follows FlashInfer's ``plan()`` / ``run()``), and a request only adds its block ids:
:class:`~kvtriton.plan.RequestPlan` chooses each payload's way through :meth:`PairPlan.choose_way`
and a part posts :meth:`PairPlan.rows`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import PlanError
from ..spec import RegionSpec
from .cost import CostModel
from .runs import (
    BlockRows,
    Runs,
    direct_block_rows,
    direct_groups,
    pair_run_count,
    run_count,
    runs_of_groups,
    runs_of_slices,
    slice_block_rows,
    slice_columns,
    tile_runs,
)
from .types import Payload, TransferPlan, Way
from .ways import cheapest_way, coalesces

__all__ = ["PairPlan"]


class PairPlan:
    """Everything source rank ``src_rank`` sends the destination rank of ``plan``, whatever the
    request: made once per (peer, source rank), immutable after.

    Parameters
    ----------
    plan : TransferPlan
        The destination rank's plan of the source engine (both sides compute the same one).
    src_rank : int
        The source rank of this pair.
    src_specs, dst_specs : Sequence[RegionSpec]
        The source rank's and the destination rank's region specs, one per region.
    cost : CostModel, optional
        The destination's model, by which a request's way is chosen (default :class:`CostModel`).

    Attributes
    ----------
    payload : Payload or None
        The staged payload ``src_rank`` sends (``None``: DIRECT runs only, or nothing).
    ways : tuple[Way, ...]
        How that payload may travel (``()`` without one).
    direct_rows : BlockRows
        The DIRECT and DIRECT_SLICE regions' rows this rank sends (zero rows: none), one per
        (region, stream).
    slice_rows : BlockRows or None
        The payload's head slices, one row per segment, when it may travel DIRECT_SLICE.

    Example
    -------
    >>> import numpy as np, torch
    >>> from kvtriton.plan import PairPlan, build_plan
    >>> from kvtriton.regions import Region
    >>> k = torch.zeros(8, 16, 4, 128, dtype=torch.bfloat16)       # P rank: 4 of 8 heads
    >>> kd = torch.zeros(8, 16, 2, 128, dtype=torch.bfloat16)      # D rank: 2 of 8 heads
    >>> p = Region.attention("l0", k, k.clone(), block_size=16, total_heads=8).spec
    >>> d = Region.attention("l0", kd, kd.clone(), block_size=16, total_heads=8).spec
    >>> plan = build_plan(3, 4, [d], 2, [p])    # P TP2 -> D TP4: D3 reads heads 2-3 of P1
    >>> pair = PairPlan(plan, 1, [p], [d])      # once, when P1 is added
    >>> [w.value for w in pair.ways], len(pair.direct_rows)
    (['staged', 'pack_place'], 0)
    >>> pair.choose_way(np.arange(4), np.arange(4), chunks=1).value   # per request: 4 ids in one run
    'pack_place'
    """

    __slots__ = ("plan", "src_rank", "src_specs", "dst_specs", "cost", "payload", "ways", "direct_rows",
                 "slice_rows", "_groups", "_slice_cols", "_coalesce", "_counts", "_rows",
                 "_chosen")

    def __init__(self, plan: TransferPlan, src_rank: int, src_specs: Sequence[RegionSpec],
                 dst_specs: Sequence[RegionSpec], cost: CostModel | None = None):
        self.plan, self.src_rank = plan, src_rank
        self.src_specs: tuple[RegionSpec, ...] = tuple(src_specs)
        self.dst_specs: tuple[RegionSpec, ...] = tuple(dst_specs)
        self.cost = cost if cost is not None else CostModel()
        self.payload: Payload | None = plan.payload(src_rank)
        self.ways: tuple[Way, ...] = self.payload.ways if self.payload is not None else ()
        self._groups = tuple(g for g in direct_groups(plan, self.src_specs, self.dst_specs)
                             if src_rank in g.src_ranks)
        self.direct_rows: BlockRows = direct_block_rows(plan, self.src_specs, self.dst_specs, src_rank)
        self._slice_cols: np.ndarray | None = None
        self.slice_rows: BlockRows | None = None
        self._coalesce: dict[Way, np.ndarray] = {}
        p = self.payload
        if p is not None:
            if Way.DIRECT_SLICE in p.ways:
                self._slice_cols = slice_columns(p, self.src_specs, self.dst_specs)
                self.slice_rows = slice_block_rows(p, self.src_specs, self.dst_specs, self._slice_cols)
            if Way.READ_UNPACK in p.ways:
                self._coalesce[Way.READ_UNPACK] = coalesces(p, self.src_specs)
            if Way.PACK_PLACE in p.ways:
                self._coalesce[Way.PACK_PLACE] = coalesces(p, self.dst_specs)
        # per way, what its descriptor count needs of the geometry: (segments whose runs merge
        # into one descriptor, segments): a request then only counts its runs
        self._counts: dict[Way, tuple[int, int]] = {w: (int(c.sum()), int(c.size)) for w, c in self._coalesce.items()}
        if self._slice_cols is not None:
            cols = self._slice_cols  # a slice that is the whole block, back to back on both sides, merges runs
            whole = (cols[:, 3] == cols[:, 2]) & (cols[:, 4] == cols[:, 2])
            self._counts[Way.DIRECT_SLICE] = (int(whole.sum()), len(cols))
        # the zero-copy rows a part posts in one transfer, by the way its payload travels
        self._rows: dict[Way, BlockRows] = {Way.STAGED: self.direct_rows}
        # the way chosen per (blocks, chunks, packed, each candidate way's descriptors): all the
        # choice depends on for this pair (choose_way)
        self._chosen: dict[tuple, Way] = {}
        if self.slice_rows is not None:
            self._rows[Way.DIRECT_SLICE] = BlockRows.concat(self.direct_rows, self.slice_rows)

    def __repr__(self) -> str:
        return (f"PairPlan(src_rank={self.src_rank}, dst_rank={self.plan.dst_rank}, "
                f"ways={[w.value for w in self.ways]}, direct_rows={len(self.direct_rows)})")

    # ------------------------------------------------------------------ zero copy
    def rows(self, way: Way = Way.STAGED) -> BlockRows:
        """The zero-copy rows of this pair's part of a request whose payload travels ``way``:
        the DIRECT rows, and the payload's head slices when ``way`` is DIRECT_SLICE (one table:
        one transfer). Any other way moves the payload through staging: the DIRECT rows only."""
        return self._rows.get(way, self.direct_rows)

    def direct_runs(self, src_ids: np.ndarray, dst_ids: np.ndarray,
                    group_bounds: Sequence[int] | None = None) -> Runs:
        """:func:`~kvtriton.plan.direct_runs` of this source rank for a compacted request."""
        return runs_of_groups(self._groups, src_ids, dst_ids, self.src_rank, group_bounds)

    def slice_runs(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> Runs:
        """:func:`~kvtriton.plan.slice_runs` of the payload for a compacted request."""
        return runs_of_slices(self.src_rank, self._slices(), src_ids, dst_ids)

    def tile_runs(self, ids: np.ndarray, way: Way) -> Runs:
        """:func:`~kvtriton.plan.tile_runs` of the payload by one-sided ``way`` (``ids``: the
        cache side's ids: the source's for READ_UNPACK, ours for PACK_PLACE)."""
        specs = self.src_specs if way is Way.READ_UNPACK else self.dst_specs
        return tile_runs(self._payload(), specs, ids, way)

    # ------------------------------------------------------------------ the way
    def way_descriptors(self, way: Way, src_ids: np.ndarray, dst_ids: np.ndarray, chunks: int = 1,
                        runs: RunCounts | None = None) -> int:
        """:func:`~kvtriton.plan.way_descriptors` of the payload, over the pair's geometry
        (``runs``: the request's run counts, when the caller has them for several pairs)."""
        if way is Way.STAGED:
            return chunks
        counts = self._counts.get(way)
        if counts is None:  # a way the payload may not travel: its geometry, once
            if way is Way.DIRECT_SLICE:
                cols = self._slices()
                whole = (cols[:, 3] == cols[:, 2]) & (cols[:, 4] == cols[:, 2])
                counts = (int(whole.sum()), len(cols))
            else:
                coal = coalesces(self._payload(), self.src_specs if way is Way.READ_UNPACK else self.dst_specs)
                counts = (int(coal.sum()), int(coal.size))
            self._counts[way] = counts
        merging, segments = counts
        if runs is None:
            runs = RunCounts(src_ids, dst_ids)
        if way is Way.DIRECT_SLICE:  # one per (segment, block), or per run on both sides where slices merge
            return merging * (runs.pairs if merging else 0) + (segments - merging) * runs.src.size
        # one-sided: one per (segment, run of the cache side's ids) where blocks lie back to back, a
        # chunk boundary splitting a run; else one per (segment, block)
        if way is Way.READ_UNPACK:
            n, cache_runs = runs.src.size, (runs.src_runs if merging else 0)
        else:
            n, cache_runs = runs.dst.size, (runs.dst_runs if merging else 0)
        return merging * (cache_runs + max(0, chunks - 1)) + (segments - merging) * n

    def choose_way(self, src_ids: np.ndarray, dst_ids: np.ndarray, *, chunks: int = 1, packed: bool = False,
                   runs: RunCounts | None = None, cache_offered: bool = False) -> Way:
        """:func:`~kvtriton.plan.choose_way` of the payload by the pair's cost model (``runs``:
        the request's run counts, found once for all its pairs). The choice is a function of
        the request's blocks, chunks, ``packed``, ``cache_offered`` and each candidate way's
        descriptor count only: made once per such key (the cost model's arithmetic is not redone
        for every request)."""
        read = self._payload()
        if len(read.ways) == 1:
            return read.ways[0]
        if runs is None:
            runs = RunCounts(src_ids, dst_ids)
        n = int(np.asarray(dst_ids).size)
        descs: dict[Way, int] = {way: self.way_descriptors(way, src_ids, dst_ids, chunks, runs) for way in read.ways
                 if way is not Way.STAGED and not (packed and way.reads_source_cache)}
        key = (n, chunks, packed, cache_offered, *descs.values())
        way = self._chosen.get(key)
        if way is None:
            way = cheapest_way(read, self.cost, n, chunks, packed, descs.__getitem__, cache_offered=cache_offered)
            if len(self._chosen) >= _MAX_CHOSEN:  # request shapes repeat; bound them anyway
                self._chosen.clear()
            self._chosen[key] = way
        return way

    def _payload(self) -> Payload:
        if self.payload is None:
            raise PlanError(f"source rank {self.src_rank} sends destination rank {self.plan.dst_rank} no payload")
        return self.payload

    def _slices(self) -> np.ndarray:
        if self._slice_cols is None:
            self._slice_cols = slice_columns(self._payload(), self.src_specs, self.dst_specs)
        return self._slice_cols


class RunCounts:
    """One request's run counts, each found once when first asked (numpy passes shared by every
    pair the request reads from): runs of the source's ids, of the destination's, and of both
    together (:func:`run_count`, :func:`pair_run_count`)."""

    __slots__ = ("src", "dst", "_src_runs", "_dst_runs", "_pairs")

    def __init__(self, src_ids: np.ndarray, dst_ids: np.ndarray):
        self.src = np.asarray(src_ids, dtype=np.int64)
        self.dst = np.asarray(dst_ids, dtype=np.int64)
        self._src_runs: int | None = None
        self._dst_runs: int | None = None
        self._pairs: int | None = None

    @property
    def src_runs(self) -> int:
        if self._src_runs is None:
            self._src_runs = run_count(self.src)
        return self._src_runs

    @property
    def dst_runs(self) -> int:
        if self._dst_runs is None:
            self._dst_runs = run_count(self.dst)
        return self._dst_runs

    @property
    def pairs(self) -> int:
        if self._pairs is None:
            self._pairs = pair_run_count(self.src, self.dst)
        return self._pairs


#: (blocks, chunks, packed, descriptors) keys a pair remembers its chosen way for
_MAX_CHOSEN = 1024
