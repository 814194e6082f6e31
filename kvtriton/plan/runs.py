"""Runs: coalesced ranges of consecutive block ids, and the descriptors they make.

Pure (numpy). A *run* is a stretch of request positions whose block ids are consecutive (on one
side, or on both), so that its blocks lie back to back in a cache and move as one descriptor.
:func:`id_runs` and :func:`pair_runs` find them; :class:`Runs` is the one descriptor table every
coalesced move uses: DIRECT reads cache to cache (:func:`direct_runs`) and the one-sided ways'
reads between a cache and a staged chunk (:func:`tile_runs`); a payload's head slices cache to
cache when it travels DIRECT_SLICE (:func:`slice_runs`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..spec import RegionSpec
from .ids import SMALL_REQUEST
from .types import ChunkGeometry, Payload, TransferPlan, Way

__all__ = ["Runs", "BlockRows", "DirectGroup", "id_runs", "pair_runs", "run_count", "pair_run_count",
           "direct_runs", "direct_groups", "runs_of_groups",
           "direct_block_rows", "tile_runs", "slice_runs", "slice_columns", "runs_of_slices", "slice_block_rows",
           "slice_count", "slice_descriptor_count", "staged_descriptor_count"]

_EMPTY = np.zeros(0, np.int64)  # copied into results (callers may write theirs)


def id_runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths (int64) of the runs of consecutive ids in ``ids``.

    >>> [a.tolist() for a in id_runs(np.array([4, 5, 6, 9, 10, 2]))]
    [[0, 3, 5], [3, 2, 1]]
    """
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return _EMPTY.copy(), _EMPTY.copy()
    return _bounds(np.diff(ids) != 1, ids.size)


def pair_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths of the runs consecutive on *both* sides (equal-length id lists)."""
    if src_ids.size == 0:
        return _EMPTY.copy(), _EMPTY.copy()
    return _bounds((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1), src_ids.size)


def run_count(ids: np.ndarray) -> int:
    """How many runs :func:`id_runs` finds in ``ids`` (int64), without building them: what a
    request's descriptor counts need (two numpy passes, not five).

    >>> run_count(np.array([4, 5, 6, 9, 10, 2]))
    3
    """
    n = ids.size
    if n < 2:
        return int(n)
    if n <= SMALL_REQUEST:  # a small request's ids as a list: see kvtriton.plan.ids.SMALL_REQUEST
        v = ids.tolist()
        return sum(b - a != 1 for a, b in zip(v, v[1:])) + 1
    return int(np.count_nonzero(ids[1:] - ids[:-1] != 1)) + 1


def pair_run_count(src_ids: np.ndarray, dst_ids: np.ndarray) -> int:
    """How many runs :func:`pair_runs` finds (consecutive on both sides; int64 lists of equal
    length), without building them.

    >>> pair_run_count(np.array([4, 5, 6, 9]), np.array([0, 1, 7, 8]))
    3
    """
    n = src_ids.size
    if n < 2:
        return int(n)
    if n <= SMALL_REQUEST:
        s, d = src_ids.tolist(), dst_ids.tolist()
        return sum(s[i + 1] - s[i] != 1 or d[i + 1] - d[i] != 1 for i in range(n - 1)) + 1
    return int(np.count_nonzero((src_ids[1:] - src_ids[:-1] != 1) | (dst_ids[1:] - dst_ids[:-1] != 1))) + 1


def _bounds(breaks: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    starts = np.empty(int(np.count_nonzero(breaks)) + 1, dtype=np.int64)
    starts[0] = 0
    starts[1:] = np.flatnonzero(breaks) + 1
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = n
    return starts, ends - starts


@dataclass(frozen=True)
class Runs:
    """Coalesced descriptors of one request (or chunk): parallel int64 arrays, one entry each.

    Each entry moves ``nbytes`` of (``region``, ``stream``) read at ``src_offset`` and landing at
    ``dst_offset`` (bytes, in the direction of a pull's READ). ``ends`` says what each offset
    indexes: ``("cache", "cache")`` for DIRECT (``src_rank``'s and the destination's tensor of
    that region and stream), ``("cache", "staging")`` for READ_UNPACK (the source's cache, the
    destination's staged chunk) and ``("staging", "cache")`` for PACK_PLACE (the source's staged
    chunk, the destination's cache); staging offsets count from the start of the chunk's payload.
    """

    src_rank: np.ndarray
    region: np.ndarray
    stream: np.ndarray
    src_offset: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray = field(repr=False)
    ends: tuple[str, str] = ("cache", "cache")

    def __len__(self) -> int:
        return int(self.nbytes.size)

    @property
    def total_bytes(self) -> int:
        """Bytes every descriptor moves together."""
        return int(self.nbytes.sum())

    @property
    def cache_offset(self) -> np.ndarray:
        """One-sided runs: the offsets into the cache whose blocks are read or written."""
        return self.src_offset if self.ends[0] == "cache" else self.dst_offset

    @property
    def staging_offset(self) -> np.ndarray:
        """One-sided runs: the offsets into the staged chunk (where the packed payload has each tile)."""
        return self.dst_offset if self.ends[0] == "cache" else self.src_offset


def direct_runs(
    plan: TransferPlan,
    src_specs: Sequence[RegionSpec] | Mapping[int, Sequence[RegionSpec]],
    dst_specs: Sequence[RegionSpec],
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    src_rank: int | None = None,
    group_bounds: Sequence[int] | None = None,
) -> Runs:
    """Coalesced descriptors for every DIRECT and DIRECT_SLICE region of a compacted request
    (only those ``src_rank`` sends, when given: what one pair of ranks posts); a region of KV
    cache group ``g`` moves positions ``[group_bounds[g], group_bounds[g + 1])`` only (``None``:
    one group).

    Blocks of a DIRECT region are split over its ``src_ranks`` in contiguous parts of the request
    (so runs stay long); a DIRECT_SLICE region's source ranks each send their head slice of every
    block, one descriptor per block (a partial slice is one range inside a block, never across
    blocks). Consecutive ids on *both* sides merge into one descriptor when both
    tensors store consecutive blocks back to back. ``src_specs`` may be one list for all source
    ranks or a mapping rank -> list when strides differ between ranks. Entries are ordered by
    region, then source rank, then stream.

    Cost: regions are grouped by geometry (:func:`direct_groups`; a
    :class:`~kvtriton.plan.PairPlan` does it once per pair of ranks); a request then finds its
    runs once per group with numpy and repeats them for the group's regions (DeepSeek-V3's 61
    MLA layers are one group), so the Python work is per group, not
    per region or block; what remains is linear in the descriptors returned.
    """
    return runs_of_groups(direct_groups(plan, src_specs, dst_specs), src_ids, dst_ids, src_rank, group_bounds)


def runs_of_groups(groups: Sequence[DirectGroup], src_ids: np.ndarray, dst_ids: np.ndarray,
                   src_rank: int | None = None, group_bounds: Sequence[int] | None = None) -> Runs:
    """:func:`direct_runs` over groups found already (:func:`direct_groups`); ``group_bounds``
    as in :meth:`BlockRows.select` (a request of several KV cache groups)."""
    src_ids = np.asarray(src_ids, dtype=np.int64)
    dst_ids = np.asarray(dst_ids, dtype=np.int64)
    blocks: list[list[np.ndarray]] = []  # per group: its six columns
    for group in groups:
        g0, g1 = _group_range(group_bounds, group.group, src_ids.size)
        n = g1 - g0
        # a stripe splits the request over the replicas; a DIRECT_SLICE region's ranks each send every block
        parts = [(0, n)] * len(group.src_ranks) if group.sliced else _split_bounds(n, len(group.src_ranks))
        parts = [(g0 + lo, g0 + hi) for lo, hi in parts]
        base: list[list[np.ndarray]] = [[] for _ in range(5)]
        for rank, (lo, hi), streams in zip(group.src_ranks, parts, group.streams):
            if hi == lo or (src_rank is not None and rank != src_rank):
                continue
            sid, did = src_ids[lo:hi], dst_ids[lo:hi]
            merged = singles = None
            for j, (span, s_stride, d_stride, s_off, d_off) in enumerate(streams):
                # a run is one range only when the moved range tiles consecutive blocks on both sides
                if s_stride == span and d_stride == span:
                    if merged is None:  # the same runs for every stream that coalesces
                        merged = pair_runs(sid, did)
                    starts, lengths = merged
                else:
                    if singles is None:
                        singles = (np.arange(sid.size, dtype=np.int64), np.ones(sid.size, dtype=np.int64))
                    starts, lengths = singles
                k = starts.size
                base[0].append(np.full(k, rank, dtype=np.int64))
                base[1].append(np.full(k, j, dtype=np.int64))
                base[2].append(sid[starts] * s_stride + s_off)
                base[3].append(did[starts] * d_stride + d_off)
                base[4].append(lengths * span)
        if not base[0]:
            continue
        cols = [np.concatenate(c) for c in base]
        k, r = cols[0].size, len(group.regions)
        out = np.empty((6, r, k), dtype=np.int64)  # region-major: each region repeats the group's runs
        out[0] = cols[0]
        out[1] = np.asarray(group.regions, dtype=np.int64)[:, None]
        for i in range(1, 5):
            out[i + 1] = cols[i]
        blocks.append(list(out.reshape(6, r * k)))
    if not blocks:
        e = _EMPTY
        return Runs(e.copy(), e.copy(), e.copy(), e.copy(), e.copy(), e.copy())
    arrays = [np.concatenate([b[i] for b in blocks]) if len(blocks) > 1 else blocks[0][i] for i in range(6)]
    if len(blocks) > 1 and (np.diff(arrays[1]) < 0).any():  # groups interleave: back to region order
        order = np.argsort(arrays[1], kind="stable")
        arrays = [a[order] for a in arrays]
    ranks, region, stream, src_offset, dst_offset, nbytes = arrays
    return Runs(ranks, region, stream, src_offset, dst_offset, nbytes)


def _split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each of ``parts`` contiguous parts of ``range(n)``, as ``np.array_split``."""
    q, r = divmod(n, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + q + (1 if i < r else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


@dataclass(frozen=True)
class DirectGroup:
    """DIRECT (or DIRECT_SLICE) regions whose runs are byte-for-byte alike: the same source ranks,
    and per rank and stream the same ``(bytes per block, source block stride, destination block
    stride, source offset in a block, destination offset in a block)``. ``sliced``: every rank
    sends every block (DIRECT_SLICE), else the request is striped over them."""

    src_ranks: tuple[int, ...]
    streams: tuple[tuple[tuple[int, int, int, int, int], ...], ...]  # per src rank, per stream
    regions: tuple[int, ...]
    sliced: bool = False
    group: int = 0  # the regions' KV cache group


def direct_groups(plan: TransferPlan, src_specs: Sequence[RegionSpec] | Mapping[int, Sequence[RegionSpec]],
                  dst_specs: Sequence[RegionSpec]) -> tuple[DirectGroup, ...]:
    """The plan's DIRECT regions grouped by geometry (:class:`DirectGroup`): what
    :func:`direct_runs` finds runs for, once per group. Computed on every call: a
    :class:`~kvtriton.plan.PairPlan` computes it once per pair of ranks and keeps it."""
    ranks = tuple(sorted({r for d in plan.direct for r in d.src_ranks}))
    if isinstance(src_specs, Mapping):
        by_rank: Mapping[int, Sequence[RegionSpec]] | None = src_specs
        lists: tuple[Sequence[RegionSpec], ...] = tuple(src_specs[r] for r in ranks)
    else:
        by_rank, lists = None, (src_specs,)
    by_key: dict[tuple, list[int]] = {}
    for dr in plan.direct:
        d = dst_specs[dr.region]
        per_rank = []
        for k, rank in enumerate(dr.src_ranks):
            s = (by_rank[rank] if by_rank is not None else lists[0])[dr.region]
            # whole blocks, or (DIRECT_SLICE) heads [h_s, h_s + nh) of theirs at [h_d, h_d + nh) of ours: the
            # slice's validation (direct_slice_problem) made each one range starting at its first head's row
            h_s, h_d, nh = dr.heads[k] if dr.sliced else (0, 0, d.local_heads)
            per_rank.append(tuple((d.tile_bytes(j, nh), s.block_stride_bytes(j), d.block_stride_bytes(j),
                                   h_s * s.strides[j][2] * s.itemsize, h_d * d.strides[j][2] * d.itemsize)
                                  for j in range(d.num_streams)))
        by_key.setdefault((dr.src_ranks, tuple(per_rank), dr.sliced, dr.group), []).append(dr.region)
    groups = tuple(DirectGroup(k[0], k[1], tuple(v), k[2], k[3]) for k, v in by_key.items())
    return groups


@dataclass(frozen=True, eq=False)
class BlockRows:
    """Cache-to-cache moves between one source rank and us in index form, for prepared lists.

    Row ``i`` is one range of ``tile[i]`` bytes at ``src_offset[i]`` inside every block of
    (``region[i]``, ``stream[i]``) on the source (blocks ``src_stride[i]`` bytes apart,
    ``src_blocks[i]`` of them) and at ``dst_offset[i]`` inside every block of ours: one strided
    descriptor row per side, descriptor ``b`` of the row being block ``b``'s range. Prepared once
    per (peer, rows), a request then only names indices, ``row start + block id`` on each side
    (:meth:`select`); NIXL merges pairs adjacent on both sides, which are :func:`direct_runs`'s
    runs. A row reads the positions of its stripe share ``part`` of ``parts``
    (:func:`direct_runs` splits a request over replicas the same way), or every position when
    ``parts`` is 0 (a head slice: every source rank sends every block), among the positions of
    its region's KV cache group ``group`` (a request of several groups: :meth:`select`).

    ``key``: the rows' content, what a prepared list is kept under."""

    region: np.ndarray
    stream: np.ndarray
    tile: np.ndarray
    src_offset: np.ndarray
    dst_offset: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray
    src_blocks: np.ndarray
    dst_blocks: np.ndarray
    part: np.ndarray
    parts: np.ndarray
    group: np.ndarray  # the row's KV cache group: it reads that group's positions of a request

    def __len__(self) -> int:
        return int(self.tile.size)

    @classmethod
    def concat(cls, *rows: BlockRows) -> BlockRows:
        """Every row of ``rows``, in order: one table a transfer posts at once (a source rank's
        DIRECT rows and its payload's slice rows: one READ)."""
        rows = tuple(r for r in rows if len(r))
        if len(rows) == 1:
            return rows[0]
        out = []
        for f in dataclasses.fields(cls):
            col = np.concatenate([getattr(r, f.name) for r in rows]) if rows else _EMPTY.copy()
            col.setflags(write=False)
            out.append(col)
        return cls(*out)

    @functools.cached_property
    def key(self) -> bytes:
        return b"".join(np.ascontiguousarray(getattr(self, f.name)).tobytes() for f in dataclasses.fields(self))

    @functools.cached_property
    def _starts(self) -> tuple[np.ndarray, np.ndarray]:
        return _starts_of(self.src_blocks), _starts_of(self.dst_blocks)

    @functools.cached_property
    def _contiguous(self) -> np.ndarray:
        """Per row: consecutive blocks' ranges lie back to back on both sides (runs merge)."""
        return (self.src_stride == self.tile) & (self.dst_stride == self.tile)

    @functools.cached_property
    def _groups(self) -> tuple[tuple[int, int, int, np.ndarray, np.ndarray, int, int, int], ...]:
        """Per (stripe share ``(part, parts)``, KV cache group): its rows' starts (columns), how
        many of them merge runs, how many rows, their bytes per block; what :meth:`select` needs, once."""
        s_start, d_start = self._starts
        groups = []
        for part, parts, group in dict.fromkeys(zip(self.part.tolist(), self.parts.tolist(), self.group.tolist())):
            rows = np.flatnonzero((self.part == part) & (self.parts == parts) & (self.group == group))
            groups.append((part, parts, group, s_start[rows][:, None], d_start[rows][:, None],
                           int(self._contiguous[rows].sum()), int(rows.size), int(self.tile[rows].sum())))
        return tuple(groups)

    @functools.cached_property
    def num_blocks(self) -> tuple[int, int]:
        """The fewest blocks of any row, source and destination: every block id must be below."""
        return int(self.src_blocks.min()), int(self.dst_blocks.min())

    def select(self, src_ids: np.ndarray, dst_ids: np.ndarray,
               group_bounds: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray, int, int]:
        """``(src_idx, dst_idx, descriptors, nbytes)`` of a compacted request: the index pairs
        into the rows' prepared lists (row by row, positions in order), how many descriptors
        they post once pairs adjacent on both sides merge, and the bytes they move.
        ``group_bounds``: a request of several KV cache groups, group ``g``'s positions being
        ``[group_bounds[g], group_bounds[g + 1])`` (``None``: one group, every position)."""
        src_ids = np.asarray(src_ids, dtype=np.int64)
        dst_ids = np.asarray(dst_ids, dtype=np.int64)
        s_cols: list[np.ndarray] = []
        d_cols: list[np.ndarray] = []
        descriptors = nbytes = 0
        for part, parts, group, s_start, d_start, merged, rows, tile in self._groups:
            g0, g1 = _group_range(group_bounds, group, src_ids.size)
            n = g1 - g0
            lo, hi = (0, n) if parts == 0 else _split_bounds(n, parts)[part]
            if hi == lo:
                continue
            sid, did = src_ids[g0 + lo:g0 + hi], dst_ids[g0 + lo:g0 + hi]
            s_cols.append((s_start + sid).ravel())
            d_cols.append((d_start + did).ravel())
            if merged:  # runs consecutive on both sides: one descriptor each once NIXL merges them
                descriptors += merged * pair_run_count(sid, did)
            descriptors += (rows - merged) * sid.size
            nbytes += tile * sid.size
        if not s_cols:
            return _EMPTY.copy(), _EMPTY.copy(), 0, 0
        if len(s_cols) == 1:
            return s_cols[0], d_cols[0], descriptors, nbytes
        return np.concatenate(s_cols), np.concatenate(d_cols), descriptors, nbytes


def _group_range(group_bounds: Sequence[int] | None, group: int, n: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` of ``group`` in a request of ``n`` positions (``None``: one group)."""
    if group_bounds is None:
        return 0, n
    if group + 1 >= len(group_bounds):
        return n, n
    return int(group_bounds[group]), int(group_bounds[group + 1])


def _starts_of(blocks: np.ndarray) -> np.ndarray:
    starts = np.zeros(blocks.size, dtype=np.int64)
    np.cumsum(blocks[:-1], out=starts[1:])
    return starts


def _block_rows(rows: Sequence[tuple[int, ...]]) -> BlockRows:
    cols = np.array(rows, dtype=np.int64).reshape(-1, 12).T
    for c in cols:
        c.setflags(write=False)
    return BlockRows(*cols)


def direct_block_rows(plan: TransferPlan, src_specs: Sequence[RegionSpec], dst_specs: Sequence[RegionSpec],
                      src_rank: int) -> BlockRows:
    """The rows (:class:`BlockRows`) of the plan's DIRECT and DIRECT_SLICE regions that
    ``src_rank`` sends: per region and stream, whole blocks or its head slice; a striped
    region's row reads the rank's share of each request. Row order is :func:`direct_runs`'s
    (region, then stream), so :meth:`BlockRows.select` names the same descriptors it lists.
    Computed on every call (a :class:`~kvtriton.plan.PairPlan` keeps its pair's)."""
    rows = []
    for dr in plan.direct:
        if src_rank not in dr.src_ranks:
            continue
        k = dr.src_ranks.index(src_rank)
        sp, d = src_specs[dr.region], dst_specs[dr.region]
        h_s, h_d, nh = dr.heads[k] if dr.sliced else (0, 0, d.local_heads)
        part, parts = (0, 0) if dr.sliced else (k, len(dr.src_ranks))
        for j in range(d.num_streams):
            rows.append((dr.region, j, d.tile_bytes(j, nh), h_s * sp.strides[j][2] * sp.itemsize,
                         h_d * d.strides[j][2] * d.itemsize, sp.block_stride_bytes(j), d.block_stride_bytes(j),
                         sp.num_blocks, d.num_blocks, part, parts, dr.group))
    return _block_rows(rows)


def slice_block_rows(read: Payload, src_specs: Sequence[RegionSpec], dst_specs: Sequence[RegionSpec],
                     cols: np.ndarray | None = None) -> BlockRows:
    """The rows (:class:`BlockRows`) of ``read``'s payload moved DIRECT_SLICE: one per segment,
    its head slice of every block, every position (:func:`slice_runs`'s descriptors, in its
    order). ``cols``: its :func:`slice_columns`, when known."""
    if cols is None:
        cols = slice_columns(read, src_specs, dst_specs)
    rows = [(r, j, tile, s_off, d_off, s_stride, d_stride, src_specs[r].num_blocks, dst_specs[r].num_blocks, 0, 0,
             dst_specs[r].group) for r, j, tile, s_stride, d_stride, s_off, d_off in cols.tolist()]
    return _block_rows(rows)


def tile_runs(read: Payload, specs: Sequence[RegionSpec], ids: np.ndarray, way: Way = Way.READ_UNPACK) -> Runs:
    """Descriptors that move ``read``'s payload for positions ``ids`` (one side's cache block id
    per position, none -1) between that side's cache and a staged chunk of ``ids.size``
    positions, one per (segment, run of consecutive ids) where consecutive blocks are back to
    back in the cache, else one per (segment, block). ``specs``: that side's region specs (the
    source's for ``way`` READ_UNPACK, the destination's for PACK_PLACE), and ``way`` which end
    of the READ the cache is (:attr:`Runs.ends`)."""
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
    singles = (np.arange(n, dtype=np.int64), np.ones(n, np.int64))
    for sel, (starts, lengths) in ((coal, id_runs(ids)), (~coal, singles)):
        if not sel.any() or starts.size == 0:
            continue
        k = starts.size
        cols[0].append(np.repeat(region[sel], k))
        cols[1].append(np.repeat(stream[sel], k))
        cols[2].append((ids[starts][None, :] * stride[sel][:, None]).ravel())
        cols[3].append((seg_start[sel][:, None] + starts[None, :] * tiles[sel][:, None]).ravel())
        cols[4].append((lengths[None, :] * tiles[sel][:, None]).ravel())
    region_c, stream_c, cache_off, staging_off, nbytes = (np.concatenate(c) if c else _EMPTY.copy() for c in cols)
    src_rank = np.full(nbytes.size, read.src_rank, dtype=np.int64)
    if way is Way.PACK_PLACE:
        return Runs(src_rank, region_c, stream_c, staging_off, cache_off, nbytes, ("staging", "cache"))
    return Runs(src_rank, region_c, stream_c, cache_off, staging_off, nbytes, ("cache", "staging"))


def slice_columns(read: Payload, src_specs: Sequence[RegionSpec], dst_specs: Sequence[RegionSpec]) -> np.ndarray:
    """Per segment of ``read`` (rows, int64, read-only): region, stream, tile bytes, source block
    stride, our block stride, the slice's offset inside a source block, inside ours. The slice's
    validation (:func:`~kvtriton.plan.direct_slice_way_problem`) made each one range from its
    first head's row. Python per segment (Llama-70B's 160 segments: ~1 ms): a
    :class:`~kvtriton.plan.PairPlan` computes it once per pair, a request then pays none."""
    rows = []
    for g in read.segments:
        sp, d = src_specs[g.region], dst_specs[g.region]
        j = g.stream
        rows.append((g.region, j, g.tile_bytes, sp.block_stride_bytes(j), d.block_stride_bytes(j),
                     g.src_head * sp.strides[j][2] * sp.itemsize, g.dst_head * d.strides[j][2] * d.itemsize))
    cols = np.array(rows, np.int64).reshape(-1, 7)
    cols.setflags(write=False)
    return cols


def _whole_slices(cols: np.ndarray) -> np.ndarray:
    """Per segment: its slice is the whole block, back to back with the next one, on both sides."""
    return (cols[:, 3] == cols[:, 2]) & (cols[:, 4] == cols[:, 2])


def slice_descriptor_count(read: Payload, src_specs: Sequence[RegionSpec], dst_specs: Sequence[RegionSpec],
                           src_ids: np.ndarray, dst_ids: np.ndarray) -> int:
    """How many descriptors :func:`slice_runs` gives for this request (without building them)."""
    return slice_count(slice_columns(read, src_specs, dst_specs), src_ids, dst_ids)


def slice_count(cols: np.ndarray, src_ids: np.ndarray, dst_ids: np.ndarray) -> int:
    """:func:`slice_descriptor_count` over a payload's :func:`slice_columns`."""
    n = int(np.asarray(src_ids).size)
    k = int(_whole_slices(cols).sum())
    runs = pair_run_count(np.asarray(src_ids, np.int64), np.asarray(dst_ids, np.int64)) if k else 0
    return k * runs + (len(cols) - k) * n


def slice_runs(read: Payload, src_specs: Sequence[RegionSpec], dst_specs: Sequence[RegionSpec],
               src_ids: np.ndarray, dst_ids: np.ndarray) -> Runs:
    """Descriptors that move ``read``'s payload DIRECT_SLICE for a compacted request: each
    segment's head slice from the source's cache block ``src_ids[i]`` to ours ``dst_ids[i]``
    (``ends`` ``("cache", "cache")``), one per (segment, block), or per run consecutive on both
    sides where the slice is the whole block and blocks lie back to back on both sides.
    Entries are ordered by segment, then position. One numpy pass per kind of segment (whole
    or partial slices), whatever the number of segments."""
    return runs_of_slices(read.src_rank, slice_columns(read, src_specs, dst_specs), src_ids, dst_ids)


def runs_of_slices(src_rank: int, cols: np.ndarray, src_ids: np.ndarray, dst_ids: np.ndarray) -> Runs:
    """:func:`slice_runs` over a payload's :func:`slice_columns` (``src_rank``: who sends it)."""
    src_ids = np.asarray(src_ids, dtype=np.int64)
    dst_ids = np.asarray(dst_ids, dtype=np.int64)
    n = src_ids.size
    whole = _whole_slices(cols)
    singles = (np.arange(n, dtype=np.int64), np.ones(n, np.int64))
    out: list[list[np.ndarray]] = [[] for _ in range(6)]
    for sel, (starts, lengths) in ((whole, pair_runs(src_ids, dst_ids) if whole.any() else singles),
                                   (~whole, singles)):
        c = cols[sel]
        if c.shape[0] == 0 or starts.size == 0:
            continue
        k = starts.size
        out[0].append(np.repeat(np.flatnonzero(sel), k))  # the segment: for the order below
        out[1].append(np.repeat(c[:, 0], k))
        out[2].append(np.repeat(c[:, 1], k))
        out[3].append((src_ids[starts][None, :] * c[:, 3:4] + c[:, 5:6]).ravel())
        out[4].append((dst_ids[starts][None, :] * c[:, 4:5] + c[:, 6:7]).ravel())
        out[5].append((lengths[None, :] * c[:, 2:3]).ravel())
    if not out[0]:
        e = _EMPTY
        return Runs(e.copy(), e.copy(), e.copy(), e.copy(), e.copy(), e.copy())
    seg, region, stream, src_off, dst_off, nbytes = (np.concatenate(c) for c in out)
    if len(out[0]) > 1:  # whole and partial slices both: back to segment order
        order = np.argsort(seg, kind="stable")
        region, stream, src_off, dst_off, nbytes = (a[order] for a in (region, stream, src_off, dst_off, nbytes))
    return Runs(np.full(nbytes.size, src_rank, np.int64), region, stream, src_off, dst_off, nbytes)


def staged_descriptor_count(plan: TransferPlan, num_blocks: int, chunk_bytes: int | None = None) -> int:
    """Descriptors one destination rank posts for the staged part of a request: one per
    (source rank, chunk)."""
    if num_blocks == 0:
        return 0
    if chunk_bytes is None:
        return len(plan.staged)
    return sum(ChunkGeometry.fit(r.bytes_per_block, num_blocks, chunk_bytes).count for r in plan.staged)
