"""The planner's data: routes, ways, segments, payloads, chunk geometry and the plan itself.

Pure (numpy and the standard library). A region moves by a :class:`Route` (STAGED through
staging, or DIRECT cache to cache); the staged regions one source rank sends one destination
rank form that rank's :class:`Payload`, which travels by one :class:`Way` per request.

Staged payload layout, version :data:`STAGED_LAYOUT_VERSION` (the bytes a READ or WRITE moves;
the control messages have their own version): the payload one source rank sends one destination
rank for one request (or a chunk of it) is, in order, every staged (region, stream) segment in
plan order, and inside a segment every block in request order; each block is a
``block_size x num_heads x head_dim`` tile in the *destination's* layout. The tile of segment
``s`` for request position ``j`` of an ``n``-block payload starts at byte
``n * sum(tile_bytes[:s]) + j * tile_bytes[s]``.

Requests of several KV cache groups (:attr:`~kvtriton.spec.RegionSpec.group`; hybrid models):
a request's positions are the concatenation of its groups' lists in group order (``n_g``
positions of group ``g``), and a segment moves only the positions of its region's group. The
payload is the concatenation over groups, in group order, of the layout above for that group
alone: group ``g``'s section starts at ``sum(n_h * bytes_g(h) for h < g)`` (``bytes_g(h)``: the
tiles of group ``h``'s segments, per position), and inside it the tile of segment ``s`` (of
group ``g``) for the group's position ``j`` starts ``n_g * sum(tile_bytes of the group's segments
before s) + j * tile_bytes[s]`` further. A request of one group is exactly the layout above.
A chunk is a range of positions of the concatenated axis (:class:`ChunkGeometry`), laid out the
same way over the positions it holds.
"""

from __future__ import annotations

import enum
import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import StagingError
from ..spec import Layout

__all__ = ["STAGED_LAYOUT_VERSION", "ceil_div", "Route", "Way", "Segment", "Payload", "ChunkGeometry",
           "DirectRead", "TransferPlan"]

STAGED_LAYOUT_VERSION = 1


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers, exact at any size (no float rounding).

    >>> ceil_div(10_000, 4096), ceil_div(0, 7)
    (3, 0)
    """
    return -(-a // b)


class Route(str, enum.Enum):
    """How one region moves between a rank pair (chosen per region, once per plan)."""

    STAGED = "staged"  # in its source rank's payload, through registered staging (few large descriptors)
    DIRECT = "direct"  # zero-copy cache-to-cache, one descriptor per run of consecutive blocks
    # zero-copy cache-to-cache of a head slice that is one contiguous range inside a block on both sides
    # (head-major blocks: a whole source block into a head range of ours, or the reverse): one descriptor
    # per (source rank, stream, block), per run of blocks only where both ranges tile their blocks' runs
    DIRECT_SLICE = "direct_slice"

    @property
    def zero_copy(self) -> bool:
        """Whether the region moves cache to cache (DIRECT or DIRECT_SLICE)."""
        return self is not Route.STAGED


class Way(str, enum.Enum):
    """How one source rank's staged :class:`Payload` travels (chosen per request among
    :attr:`Payload.ways`; the payload's bytes are the same whichever way)."""

    STAGED = "staged"  # the source packs, one READ (or WRITE) per chunk, the destination unpacks
    # one-sided staging (pull only; see kvtriton.plan.ways): one of the two repack passes is a READ
    READ_UNPACK = "read_unpack"  # the source's tile is its whole cache block: READ runs into our staging, unpack
    PACK_PLACE = "pack_place"  # our tile is our whole cache block: source packs, READ it straight into our blocks
    # zero-copy: each segment's head slice READ from the source's cache blocks straight into ours (the
    # bytes and descriptors of Route.DIRECT_SLICE, one concept: chosen here per request, by its runs,
    # where a plan-time choice could not tell; see kvtriton.plan.ways)
    DIRECT_SLICE = "direct_slice"

    @property
    def reads_source_cache(self) -> bool:
        """Whether the reader READs the source's cache blocks (the source packs nothing and holds
        the blocks from its RunsReady, or slot-less offer, until the reader's RunsDone)."""
        return self in (Way.READ_UNPACK, Way.DIRECT_SLICE)


@dataclass(frozen=True)
class Segment:
    """One (region, stream) head slice inside a staged payload.

    ``src_head``/``dst_head`` are local head offsets on the source and destination rank;
    ``dst_layout`` is the tile layout on the wire (always the destination's layout).
    ``block_size`` is the tokens of a tile (the destination's block size); ``src_block_size``
    the source cache's block size when it differs (``None``: equal). ``dim_major``: the leading
    row elements the destination stores dim-major per (block, head) tile (HND only, see
    :class:`~kvtriton.spec.RegionSpec`); a staged tile is in exactly that order.
    """

    region: int
    stream: int
    src_head: int
    dst_head: int
    num_heads: int
    head_dim: int
    itemsize: int
    block_size: int
    dst_layout: Layout
    src_block_size: int | None = None
    dim_major: int = 0
    group: int = 0  # the region's KV cache group: the segment moves that group's positions only

    @property
    def source_block_size(self) -> int:
        """Tokens per block of the source cache (what pack reads)."""
        return self.block_size if self.src_block_size is None else self.src_block_size

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, head) row."""
        return self.head_dim * self.itemsize

    @property
    def tile_bytes(self) -> int:
        """Bytes of one block's tile of this segment."""
        return self.block_size * self.num_heads * self.row_bytes


@dataclass(frozen=True)
class Payload:
    """The staged payload one source rank sends this destination rank, per request.

    ``ways``: how it may travel, :data:`Way.STAGED` (pack, one READ per chunk, unpack) and the
    one-sided ways every segment allows (:data:`Way.READ_UNPACK`: each segment's tile is the
    source's whole cache block; :data:`Way.PACK_PLACE`: the destination's; :data:`Way.DIRECT_SLICE`:
    each segment's head slice is one range inside a block on both sides). A forced way leaves
    just that one. The destination chooses one per request (:func:`kvtriton.plan.choose_way`)
    and the pull names it; the payload's bytes are the same whichever way it travels."""

    src_rank: int
    segments: tuple[Segment, ...]
    ways: tuple[Way, ...] = (Way.STAGED,)

    # per-request callers read these for every chunk: computed once per plan (the plan is immutable)
    @functools.cached_property
    def bytes_per_block(self) -> int:
        """Payload bytes per moved block (every segment's tile)."""
        return sum(s.tile_bytes for s in self.segments)

    @functools.cached_property
    def _segment_starts(self) -> np.ndarray:
        tiles = np.array([s.tile_bytes for s in self.segments], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(tiles)[:-1]]).astype(np.int64)
        starts.setflags(write=False)
        return starts

    @functools.cached_property
    def group_bytes(self) -> tuple[int, ...]:
        """Per KV cache group ``0..max(segment.group)``, its segments' tile bytes per position
        (0 for a group with no segment in this payload)."""
        out = [0] * (1 + max((s.group for s in self.segments), default=0))
        for s in self.segments:
            out[s.group] += s.tile_bytes
        return tuple(out)

    @functools.cached_property
    def _grouped_starts(self) -> tuple[np.ndarray, np.ndarray]:
        """Per segment: its group, and its first tile's offset inside its group's section per
        position (the offsets of a one-group payload are :attr:`_segment_starts`)."""
        groups = np.array([s.group for s in self.segments], dtype=np.int64)
        starts = np.zeros(len(self.segments), dtype=np.int64)
        seen = [0] * len(self.group_bytes)
        for i, s in enumerate(self.segments):
            starts[i], seen[s.group] = seen[s.group], seen[s.group] + s.tile_bytes
        return groups, starts

    def payload_bytes(self, num_blocks: int | Sequence[int]) -> int:
        """Bytes of a payload of ``num_blocks`` positions (one count: that many in every group;
        a sequence: per group)."""
        if isinstance(num_blocks, (int, np.integer)):
            return int(num_blocks) * self.bytes_per_block
        return sum(int(n) * b for n, b in zip(num_blocks, self.group_bytes))

    def segment_offsets(self, num_blocks: int | Sequence[int], base: int = 0) -> np.ndarray:
        """Byte offset of each segment's first tile in a payload of ``num_blocks`` positions
        (int64): one count for a request of one group, or the positions of each group (the
        grouped layout of the module docstring; groups past the sequence have none)."""
        if isinstance(num_blocks, (int, np.integer)):
            return base + num_blocks * self._segment_starts
        gb = self.group_bytes
        counts = np.zeros(len(gb), dtype=np.int64)
        k = min(len(gb), len(num_blocks))
        counts[:k] = np.asarray(num_blocks, dtype=np.int64)[:k]
        sections = np.concatenate([[0], np.cumsum(counts * np.asarray(gb, dtype=np.int64))[:-1]])
        groups, starts = self._grouped_starts
        return base + sections[groups] + counts[groups] * starts

    def chunk_geometry(self, group_sizes: Sequence[int], chunk_bytes: int) -> ChunkGeometry:
        """The widest chunks of at most ``chunk_bytes`` for a request of ``group_sizes``
        positions per group (:meth:`ChunkGeometry.fit`; one group: today's geometry)."""
        if len(group_sizes) == 1:
            return ChunkGeometry.fit(self.bytes_per_block, int(group_sizes[0]), chunk_bytes)
        return ChunkGeometry.fit_groups(self._request_group_bytes(len(group_sizes)), group_sizes, chunk_bytes)

    def chunks_of(self, group_sizes: Sequence[int], blocks_per_chunk: int) -> ChunkGeometry:
        """The geometry a destination asked for (``blocks_per_chunk``, what the pull says) over
        ``group_sizes`` positions per group."""
        if len(group_sizes) == 1:
            return ChunkGeometry(self.bytes_per_block, int(group_sizes[0]), blocks_per_chunk)
        gb = self._request_group_bytes(len(group_sizes))
        return ChunkGeometry(max(gb), int(sum(group_sizes)), blocks_per_chunk, tuple(int(n) for n in group_sizes), gb)

    def _request_group_bytes(self, num_groups: int) -> tuple[int, ...]:
        gb = self.group_bytes
        if len(gb) > num_groups:
            raise StagingError(f"the payload has segments of group {len(gb) - 1}, the request {num_groups} groups")
        return gb + (0,) * (num_groups - len(gb))


@dataclass(frozen=True)
class ChunkGeometry:
    """How a staged payload of ``num_blocks`` positions is cut into staging chunks.

    Chunk ``i`` holds request positions ``bounds(i)`` and is ``nbytes(i)`` bytes of staging;
    both sides of a transfer derive the same geometry from the ``blocks_per_chunk`` the
    destination sends. One group: every position is ``bytes_per_block`` bytes and a chunk is
    ``blocks_per_chunk`` positions (fewer in the last chunk). Several groups (``group_sizes``
    positions per group, ``group_bytes`` bytes per position of each): ``bytes_per_block`` is the
    widest group's, a chunk holds at most ``blocks_per_chunk * bytes_per_block`` bytes, and
    chunks are cut greedily in position order (a group of 0 bytes costs nothing; a request that
    moves no byte has no chunk).

    >>> g = ChunkGeometry(bytes_per_block=1000, num_blocks=10, blocks_per_chunk=4)
    >>> g.count, g.bounds(2), g.nbytes(2)
    (3, (8, 10), 2000)
    >>> ChunkGeometry.fit(bytes_per_block=1000, num_blocks=10, chunk_bytes=4096).blocks_per_chunk
    4
    >>> h = ChunkGeometry.fit_groups((1000, 500), (3, 4), chunk_bytes=2048)
    >>> h.count, [h.bounds(i) for i in range(h.count)], [h.group_counts(i) for i in range(h.count)]
    (3, [(0, 2), (2, 5), (5, 7)], [(2, 0), (1, 2), (0, 2)])
    """

    bytes_per_block: int
    num_blocks: int
    blocks_per_chunk: int
    group_sizes: tuple[int, ...] = ()  # positions per group (): one group of num_blocks
    group_bytes: tuple[int, ...] = ()  # bytes per position of each group (): bytes_per_block

    @classmethod
    def fit(cls, bytes_per_block: int, num_blocks: int, chunk_bytes: int) -> ChunkGeometry:
        """The widest chunks that fit ``chunk_bytes``; :class:`StagingError` when one block
        does not fit (staging is too small for this payload, whatever the request)."""
        if bytes_per_block > chunk_bytes:
            raise StagingError(f"one block needs {bytes_per_block} staging bytes, more than a chunk "
                               f"({chunk_bytes} bytes)")
        return cls(bytes_per_block, num_blocks, min(num_blocks, chunk_bytes // bytes_per_block))

    @classmethod
    def fit_groups(cls, group_bytes: Sequence[int], group_sizes: Sequence[int], chunk_bytes: int) -> ChunkGeometry:
        """:meth:`fit` for a request of several groups (``group_sizes`` positions per group,
        ``group_bytes`` bytes per position of each)."""
        widest = max(group_bytes)
        if widest > chunk_bytes:
            raise StagingError(f"one block needs {widest} staging bytes, more than a chunk ({chunk_bytes} bytes)")
        n = int(sum(group_sizes))
        return cls(widest, n, max(1, min(n, chunk_bytes // max(1, widest))), tuple(int(x) for x in group_sizes),
                   tuple(int(b) for b in group_bytes))

    @property
    def grouped(self) -> bool:
        """Whether the request has several groups (positions of unequal bytes)."""
        return len(self.group_sizes) > 1

    def fits(self, chunk_bytes: int) -> bool:
        """Whether every chunk is at least one block and at most ``chunk_bytes`` bytes."""
        return self.blocks_per_chunk >= 1 and self.blocks_per_chunk * self.bytes_per_block <= chunk_bytes

    @functools.cached_property
    def _cuts(self) -> tuple[int, ...]:
        """Several groups: the first position of each chunk, then ``num_blocks`` (greedy, in order)."""
        limit = self.blocks_per_chunk * self.bytes_per_block
        if limit <= 0 or not any(n * b for n, b in zip(self.group_sizes, self.group_bytes)):
            return (0,)
        ends = np.cumsum(self.group_sizes).tolist()
        cuts, pos, g, budget = [0], 0, 0, limit
        while pos < self.num_blocks:
            while g < len(ends) and pos >= ends[g]:
                g += 1
            b = self.group_bytes[g]
            take = ends[g] - pos if b == 0 else min(ends[g] - pos, budget // b)
            if take == 0:  # this chunk is full
                cuts.append(pos)
                budget = limit
                continue
            pos += take
            budget -= take * b
        cuts.append(self.num_blocks)
        return tuple(cuts)

    @property
    def count(self) -> int:
        """How many chunks."""
        if self.grouped:
            return len(self._cuts) - 1
        return ceil_div(self.num_blocks, self.blocks_per_chunk) if self.num_blocks else 0

    def bounds(self, chunk: int) -> tuple[int, int]:
        """Request positions ``[lo, hi)`` that chunk ``chunk`` carries."""
        if self.grouped:
            return self._cuts[chunk], self._cuts[chunk + 1]
        lo = chunk * self.blocks_per_chunk
        return lo, min(self.num_blocks, lo + self.blocks_per_chunk)

    def group_counts(self, chunk: int) -> tuple[int, ...]:
        """Positions of each group that chunk ``chunk`` carries (one group: its positions)."""
        lo, hi = self.bounds(chunk)
        if not self.grouped:
            return (hi - lo,)
        out, start = [], 0
        for n in self.group_sizes:
            out.append(max(0, min(hi, start + n) - max(lo, start)))
            start += n
        return tuple(out)

    def nbytes(self, chunk: int) -> int:
        """Staging bytes of chunk ``chunk``."""
        if self.grouped:
            return sum(n * b for n, b in zip(self.group_counts(chunk), self.group_bytes))
        lo, hi = self.bounds(chunk)
        return (hi - lo) * self.bytes_per_block


@dataclass(frozen=True)
class DirectRead:
    """A region moved zero-copy. Without ``heads`` (:data:`Route.DIRECT`) its blocks are whole on
    both sides and striped over ``src_ranks`` in request order (REPLICATE replicas; one rank for
    SPLIT). With ``heads`` (:data:`Route.DIRECT_SLICE`), one ``(src_head, dst_head, num_heads)``
    per entry of ``src_ranks``: every one of them sends every block's head slice, read from its
    local heads ``[src_head, src_head + num_heads)`` into ours from ``dst_head``, each one
    contiguous range inside a block on both sides."""

    region: int
    src_ranks: tuple[int, ...]
    heads: tuple[tuple[int, int, int], ...] = ()
    group: int = 0  # the region's KV cache group: it moves that group's positions only

    @property
    def sliced(self) -> bool:
        """True for a DIRECT_SLICE read (every source rank sends every block)."""
        return bool(self.heads)

    def ranks_for(self, num_blocks: int) -> tuple[int, ...]:
        """Source ranks that send runs for a request of ``num_blocks`` blocks (a stripe wider
        than the request leaves the last replicas without blocks)."""
        if num_blocks <= 0:
            return ()
        return self.src_ranks if self.sliced else self.src_ranks[:num_blocks]


@dataclass(frozen=True)
class TransferPlan:
    """Everything destination rank ``dst_rank`` reads from one source engine.

    ``routes[i]`` is region ``i``'s route and ``forced[i]`` the way ``modes=`` forced for it
    (``None``: not forced); ``staged`` has one :class:`Payload` per source rank that sends one
    (sorted by rank); ``direct`` one entry per DIRECT region.
    ``src_block_size``/``dst_block_size`` are the engines' block sizes when they differ (a
    request is then mapped token by token: :func:`~kvtriton.plan.compact_tokens`), ``None`` when
    every region has equal block sizes on both sides (a request is then block pairs:
    :func:`~kvtriton.plan.compact_request`). ``groups``: the KV cache groups the regions span (a
    request brings one id list per group; :class:`~kvtriton.plan.RequestPlan`).
    """

    dst_rank: int
    dst_tp: int
    src_tp: int
    routes: tuple[Route, ...]
    staged: tuple[Payload, ...]
    direct: tuple[DirectRead, ...]
    src_block_size: int | None = None
    dst_block_size: int | None = None
    forced: tuple[Way | None, ...] = ()
    groups: int = 1  # the engines' KV cache groups (1 + max RegionSpec.group): a request's id lists

    @property
    def modes(self) -> tuple[Route | Way, ...]:
        """Per region, what ``modes=`` would force to get this plan: :data:`Route.DIRECT` or
        :data:`Route.DIRECT_SLICE`, the one-sided :class:`Way` forced for it, or :data:`Route.STAGED`."""
        forced = self.forced or (None,) * len(self.routes)
        return tuple(w if r is Route.STAGED and w is not None and w is not Way.STAGED else r
                     for r, w in zip(self.routes, forced))

    @property
    def maps_tokens(self) -> bool:
        """True when the block sizes differ: requests are token maps, not block pairs."""
        return self.src_block_size is not None

    @property
    def source_ranks(self) -> tuple[int, ...]:
        """Every source rank this destination reads from (staged or direct)."""
        ranks = {s.src_rank for s in self.staged}
        for d in self.direct:
            ranks.update(d.src_ranks)
        return tuple(sorted(ranks))

    def digest(self) -> str:
        """A short fingerprint of the plan; both engines must compute the same one (equal
        modes, cost model and stripe settings), which the protocol checks per transfer."""
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:  # every request sends it: hashed once (a repr of 160 segments is ~0.4 ms)
        return hashlib.sha1(repr((self.dst_rank, self.dst_tp, self.src_tp, self.routes, self.forced, self.staged,
                                  self.direct, self.src_block_size, self.dst_block_size)).encode()).hexdigest()[:16]

    def direct_ranks(self, num_blocks: int | Sequence[int]) -> set[int]:
        """Source ranks that send DIRECT runs for a request of ``num_blocks`` blocks (one count,
        or per KV cache group; a stripe wider than the request leaves the last replicas without
        blocks)."""
        ranks: set[int] = set()
        if isinstance(num_blocks, (int, np.integer)):
            for d in self.direct:
                ranks.update(d.ranks_for(num_blocks))
            return ranks
        for d in self.direct:
            ranks.update(d.ranks_for(int(num_blocks[d.group]) if d.group < len(num_blocks) else 0))
        return ranks

    def payload(self, src_rank: int) -> Payload | None:
        """The payload ``src_rank`` sends, ``None`` when it sends none."""
        for s in self.staged:
            if s.src_rank == src_rank:
                return s
        return None

    # old name, removed after the merge
    staged_read = payload
