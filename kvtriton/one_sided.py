"""One-sided staging: a staged payload that skips one of its two repack passes.

Pure (numpy only), like :mod:`kvtriton.plan`. A staged payload (:class:`~kvtriton.plan.StagedRead`)
is, per segment and request position, one ``block_size x num_heads x head_dim`` tile in the
destination's layout. When such a tile is byte for byte one side's whole cache block, that side's
repack pass is a plain copy of the block, and a READ can do it instead:

* :data:`~kvtriton.plan.Mode.READ_UNPACK` (the source's tile is its whole block: the segment
  takes every head of the source rank, same in-block order, dense blocks; typical of P_TP > D_TP):
  the destination READs the source's cache blocks, coalesced into runs of consecutive source ids,
  into its *own* staging at the offsets the packed payload would have had, then runs the usual
  unpack. The source never packs: it only confirms it holds the blocks (``RunsReady``, as for
  DIRECT runs) and frees nothing until the reader says ``RunsDone``.
* :data:`~kvtriton.plan.Mode.PACK_PLACE` (the destination's tile is its whole block: the segment
  fills every head of the destination rank, dense blocks; typical of D_TP > P_TP): the source
  packs as for STAGED and announces each chunk; the destination READs the chunk's tiles straight
  into its cache blocks, one descriptor per run of consecutive destination ids, and skips unpack.

Both are pull-only: the reader is the one who saves the pass (a push variant would need the
source to know the destination's offsets and cache strides, which a push grant does not carry).

Choice (:func:`choose_way`): feasibility is static per plan (segment geometry,
:attr:`StagedRead.ways`); the choice is per (request, source rank) by the cost model with the
request's real descriptor counts (one per run of consecutive ids, per segment), since that is
what one-sided reads pay for and block runs are known only per request. One way per source
rank's payload, not per region: the pull carries one decision, the source either packs the
payload or does not (a per-segment mix would need per-segment announcements and a second
payload layout), the chunking stays one geometry, and the safety rule stays the DIRECT one
(the source's cache is read only between its RunsReady, or a slot-less offer, and our
RunsDone, while it holds the blocks). The choice is the destination's (its cost model, its
ids); the source only checks that the way named is one the plan allows.

Offers: with eager packing on, a hold whose consumer would read it by READ_UNPACK (forced, or
the consumer's model on the hold's ids) is offered without slots instead of packed, so a
fetch of exactly those blocks READs at once, with no pull to the source process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .plan import CostModel, Mode, StagedRead
from .regions import RegionSpec

__all__ = ["TileRuns", "tile_runs", "one_sided_descriptors", "choose_way"]


@dataclass(frozen=True)
class TileRuns:
    """The descriptors of one-sided staging for one chunk: parallel int64 arrays.

    ``cache_offset``: bytes from the start of (region, stream)'s tensor on the side whose cache
    blocks are read or written; ``staging_offset``: bytes from the start of the chunk's staged
    payload (the offset the packed payload gives that tile)."""

    region: np.ndarray
    stream: np.ndarray
    cache_offset: np.ndarray
    staging_offset: np.ndarray
    nbytes: np.ndarray = field(repr=False)

    def __len__(self) -> int:
        return int(self.nbytes.size)


def _runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths of the runs of consecutive ids."""
    if ids.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(ids) != 1) + 1]).astype(np.int64)
    return starts, np.diff(np.concatenate([starts, [ids.size]])).astype(np.int64)


def _coalesces(read: StagedRead, specs: Sequence[RegionSpec]) -> np.ndarray:
    """Per segment: consecutive blocks lie back to back in the cache (a run is one range)."""
    return np.array([specs[g.region].block_stride_bytes(g.stream) == g.tile_bytes for g in read.segments], bool)


def tile_runs(read: StagedRead, specs: Sequence[RegionSpec], ids: np.ndarray) -> TileRuns:
    """Descriptors that move ``read``'s payload for positions ``ids`` (one side's cache block id
    per position, none -1) between that side's cache and a staged chunk of ``ids.size``
    positions, one per (segment, run of consecutive ids) where consecutive blocks are back to
    back in the cache, else one per (segment, block). ``specs``: that side's region specs (the
    source's for READ_UNPACK, the destination's for PACK_PLACE)."""
    ids = np.asarray(ids, dtype=np.int64)
    n = ids.size
    segs = read.segments
    tiles = np.array([g.tile_bytes for g in segs], np.int64)
    seg_start = n * np.concatenate([[0], np.cumsum(tiles)[:-1]]).astype(np.int64)
    stride = np.array([specs[g.region].block_stride_bytes(g.stream) for g in segs], np.int64)
    region = np.array([g.region for g in segs], np.int64)
    stream = np.array([g.stream for g in segs], np.int64)
    coal = stride == tiles
    cols: list[list[np.ndarray]] = [[] for _ in range(5)]
    for sel, (starts, lengths) in ((coal, _runs(ids)), (~coal, (np.arange(n, dtype=np.int64), np.ones(n, np.int64)))):
        if not sel.any() or starts.size == 0:
            continue
        k = starts.size
        cols[0].append(np.repeat(region[sel], k))
        cols[1].append(np.repeat(stream[sel], k))
        cols[2].append((ids[starts][None, :] * stride[sel][:, None]).ravel())
        cols[3].append((seg_start[sel][:, None] + starts[None, :] * tiles[sel][:, None]).ravel())
        cols[4].append((lengths[None, :] * tiles[sel][:, None]).ravel())
    return TileRuns(*[np.concatenate(c) if c else np.zeros(0, np.int64) for c in cols])


def one_sided_descriptors(read: StagedRead, specs: Sequence[RegionSpec], ids: np.ndarray,
                          chunks: int = 1) -> int:
    """How many descriptors :func:`tile_runs` gives for ``ids`` cut into ``chunks`` chunks (a
    chunk boundary splits a run: at most one more descriptor per coalescing segment)."""
    ids = np.asarray(ids, dtype=np.int64)
    coal = _coalesces(read, specs)
    runs = _runs(ids)[0].size
    n_coal = int(coal.sum())
    return n_coal * (runs + max(0, chunks - 1)) + (coal.size - n_coal) * ids.size


def choose_way(read: StagedRead, src_specs: Sequence[RegionSpec], dst_specs: Sequence[RegionSpec],
               src_ids: np.ndarray, dst_ids: np.ndarray, cost: CostModel, *, chunks: int = 1,
               packed: bool = False) -> Mode:
    """The way this request's payload from ``read.src_rank`` travels: the cheapest of
    ``read.ways`` by ``cost`` for this request's descriptor counts (ties go to the earlier of
    STAGED, READ_UNPACK, PACK_PLACE). ``chunks``: the staged chunks of the payload.
    ``packed``: the source has packed it already (an offer), so READ_UNPACK would save nothing."""
    ways = read.ways
    if len(ways) == 1:
        return ways[0]
    nbytes = read.payload_bytes(int(np.asarray(dst_ids).size))
    best, best_us = Mode.STAGED, cost.staged_us(nbytes, chunks)
    for way in ways:
        if way is Mode.READ_UNPACK and not packed:
            us = cost.read_unpack_us(nbytes, one_sided_descriptors(read, src_specs, src_ids, chunks))
        elif way is Mode.PACK_PLACE:
            us = cost.pack_place_us(nbytes, one_sided_descriptors(read, dst_specs, dst_ids, chunks))
        else:
            continue
        if us < best_us:
            best, best_us = way, us
    return best
