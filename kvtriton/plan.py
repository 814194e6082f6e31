"""Transfer plans: what a destination rank reads, from whom, and where the bytes go.

Pure: numpy and dataclasses only (no torch devices, no NIXL). A :class:`TransferPlan` is built
once per (destination rank, source engine) at handshake by :func:`build_plan`; both sides compute
it from the same metadata, so the source knows what to pack for each destination. A request then
only adds block ids: :func:`compact_request` checks and aligns them, staged payload offsets are
closed-form (:meth:`StagedRead.segment_offsets`), a :class:`ChunkGeometry` cuts a payload into
staging chunks, and :func:`direct_runs` turns them into
coalesced zero-copy descriptors with vectorised numpy.

Staged payload layout, version :data:`STAGED_LAYOUT_VERSION` (the bytes a READ or WRITE moves;
the control messages have their own version, :data:`kvtriton.wire.PROTOCOL_VERSION`): the payload one source rank sends one
destination rank for one request (or a chunk of it) is, in order, every staged (region, stream)
segment in plan order, and inside a segment every block in request order; each block is a
``block_size x num_heads x head_dim`` tile in the *destination's* layout. The tile of segment
``s`` for request position ``j`` of an ``n``-block payload starts at byte
``n * sum(tile_bytes[:s]) + j * tile_bytes[s]``.

Block-size changes: the two engines may page their caches with different block sizes ``Bs``
(source) and ``Bd`` (destination), one block size per engine. A request is then a sequence of
``num_tokens`` tokens: source position ``j`` holds tokens ``[j*Bs, (j+1)*Bs)``, destination
position ``k`` tokens ``[k*Bd, (k+1)*Bd)``; the last block of either side may be partial. The
payload is still one tile per moved *destination* position, in the destination's paging and
layout (``Bd`` tokens per tile), so the receiver's unpack stays a tile scatter; the pack gathers
each tile's tokens from the one or several source blocks that hold them.
:func:`~kvtriton.token_map.compact_tokens` (re-exported here) checks and maps such a request (a
:class:`~kvtriton.token_map.TokenMap`); tokens at or past ``num_tokens`` are
never read nor written. DIRECT needs equal block sizes (a run of blocks is then a run of
tokens on both sides), so with differing block sizes every region is STAGED.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import operator
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from .errors import IncompatibleRemoteError, PlanError, StagingError
from .regions import Kind, Layout, RegionSpec
from .token_map import TokenMap, _check_distinct, _check_ids, compact_tokens, source_positions
from .topology import HeadSlice, check_tp, head_range, replicate_sources, split_sources

__all__ = [
    "STAGED_LAYOUT_VERSION",
    "ceil_div",
    "Mode",
    "STAGED_WAYS",
    "read_unpack_problem",
    "pack_place_problem",
    "CostModel",
    "Segment",
    "StagedRead",
    "ChunkGeometry",
    "DirectRead",
    "TransferPlan",
    "DirectRuns",
    "check_compatible",
    "build_plan",
    "required_source_ranks",
    "compact_request",
    "TokenMap",
    "compact_tokens",
    "source_positions",
    "direct_runs",
    "staged_descriptor_count",
    "vllm_direct_descriptor_count",
    "per_token_descriptor_count",
]

STAGED_LAYOUT_VERSION = 1


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers, exact at any size (no float rounding).

    >>> ceil_div(10_000, 4096), ceil_div(0, 7)
    (3, 0)
    """
    return -(-a // b)


class Mode(str, enum.Enum):
    """How one region moves between a rank pair."""

    STAGED = "staged"  # Triton/torch pack into registered staging, few large descriptors
    DIRECT = "direct"  # zero-copy cache-to-cache, one descriptor per run of consecutive blocks
    # one-sided staging (pull only; see kvtriton.one_sided): a source rank's whole payload
    READ_UNPACK = "read_unpack"  # the source's tile is its whole cache block: READ runs into our staging, unpack
    PACK_PLACE = "pack_place"  # our tile is our whole cache block: source packs, READ it straight into our blocks


# the modes a staged payload may travel by (chosen per request and source rank among StagedRead.ways)
STAGED_WAYS = (Mode.STAGED, Mode.READ_UNPACK, Mode.PACK_PLACE)


@dataclass(frozen=True)
class CostModel:
    """Direct-vs-staged decision for whole-block SPLIT regions, from numbers the planner is given.

    Direct costs ``desc_us`` per descriptor on top of the wire time; staged costs a pack and an
    unpack pass over the bytes (both move the same bytes over the wire, so the wire time cancels
    out of the choice). Direct wins once a descriptor carries more than
    ``desc_us / (1/pack_gbps + 1/unpack_gbps)`` bytes. The defaults are CPU values measured once
    by hand (NIXL 1.5.1 UCX/cma on a 2-core VM: 2.3 us per descriptor, ~10 GB/s torch repack);
    :func:`kvtriton.costmodel.load_or_measure` measures this host, transport and device instead
    (on a GPU the repack runs ~100x faster and the crossover moves to megabytes). The planner
    never measures: it only reads these numbers. ``read_gbps``/``write_gbps`` (the transport's
    one-descriptor bandwidth, pull and push) only feed the estimates :meth:`staged_us` and
    :meth:`direct_us`; ``source`` says where the numbers came from.
    """

    desc_us: float = 2.3
    pack_gbps: float = 10.0
    unpack_gbps: float = 10.0
    read_gbps: float = 8.0
    write_gbps: float = 8.0
    source: str = field(default="default (CPU, calibrated by hand)", compare=False)

    def crossover_bytes(self) -> float:
        return self.desc_us * 1e3 / (1.0 / self.pack_gbps + 1.0 / self.unpack_gbps)

    def prefers_direct(self, bytes_per_descriptor: int) -> bool:
        return bytes_per_descriptor >= self.crossover_bytes()

    def wire_us(self, nbytes: int, op: str = "READ") -> float:
        return nbytes / 1e3 / (self.read_gbps if op == "READ" else self.write_gbps)

    def staged_us(self, nbytes: int, descriptors: int = 1, op: str = "READ") -> float:
        """Estimated time of ``nbytes`` staged: pack + ``descriptors`` transfers + unpack."""
        return (nbytes / 1e3 * (1.0 / self.pack_gbps + 1.0 / self.unpack_gbps)
                + descriptors * self.desc_us + self.wire_us(nbytes, op))

    def direct_us(self, nbytes: int, descriptors: int, op: str = "READ") -> float:
        """Estimated time of ``nbytes`` moved zero-copy in ``descriptors`` pieces."""
        return descriptors * self.desc_us + self.wire_us(nbytes, op)

    def read_unpack_us(self, nbytes: int, descriptors: int) -> float:
        """Estimated time of ``nbytes`` READ from the source's cache in ``descriptors`` runs into
        local staging, then unpacked (no pack pass)."""
        return nbytes / 1e3 / self.unpack_gbps + descriptors * self.desc_us + self.wire_us(nbytes)

    def pack_place_us(self, nbytes: int, descriptors: int) -> float:
        """Estimated time of ``nbytes`` packed by the source, then READ from its staging straight
        into the local cache blocks in ``descriptors`` runs (no unpack pass)."""
        return nbytes / 1e3 / self.pack_gbps + descriptors * self.desc_us + self.wire_us(nbytes)

    def way_us(self, way: "Mode", nbytes: int, descriptors: int) -> float:
        """:meth:`staged_us`, :meth:`read_unpack_us` or :meth:`pack_place_us` by ``way``."""
        if way is Mode.READ_UNPACK:
            return self.read_unpack_us(nbytes, descriptors)
        if way is Mode.PACK_PLACE:
            return self.pack_place_us(nbytes, descriptors)
        return self.staged_us(nbytes, descriptors)

    def as_dict(self) -> dict:
        return dict(desc_us=self.desc_us, pack_gbps=self.pack_gbps, unpack_gbps=self.unpack_gbps,
                    read_gbps=self.read_gbps, write_gbps=self.write_gbps)


@dataclass(frozen=True)
class Segment:
    """One (region, stream) head slice inside a staged payload.

    ``src_head``/``dst_head`` are local head offsets on the source and destination rank;
    ``dst_layout`` is the tile layout on the wire (always the destination's layout).
    ``block_size`` is the tokens of a tile (the destination's block size); ``src_block_size``
    the source cache's block size when it differs (``None``: equal). ``dim_major``: the leading
    row elements the destination stores dim-major per (block, head) tile (HND only, see
    :class:`~kvtriton.regions.RegionSpec`); a staged tile is in exactly that order.
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

    @property
    def source_block_size(self) -> int:
        """Tokens per block of the source cache (what pack reads)."""
        return self.block_size if self.src_block_size is None else self.src_block_size

    @property
    def row_bytes(self) -> int:
        return self.head_dim * self.itemsize

    @property
    def tile_bytes(self) -> int:
        return self.block_size * self.num_heads * self.row_bytes


@dataclass(frozen=True)
class StagedRead:
    """The staged payload one source rank sends this destination rank, per request.

    ``ways``: how it may travel, :data:`Mode.STAGED` (pack, one READ per chunk, unpack) and the
    one-sided modes every segment allows (:data:`Mode.READ_UNPACK`: each segment's tile is the
    source's whole cache block; :data:`Mode.PACK_PLACE`: the destination's). A forced mode leaves
    just that one. The destination chooses one per request (:func:`kvtriton.one_sided.choose_way`)
    and the pull names it; the payload's bytes are the same whichever way it travels."""

    src_rank: int
    segments: tuple[Segment, ...]
    ways: tuple[Mode, ...] = (Mode.STAGED,)

    # per-request callers read these for every chunk: computed once per plan (the plan is immutable)
    @functools.cached_property
    def bytes_per_block(self) -> int:
        return sum(s.tile_bytes for s in self.segments)

    @functools.cached_property
    def _segment_starts(self) -> np.ndarray:
        tiles = np.array([s.tile_bytes for s in self.segments], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(tiles)[:-1]]).astype(np.int64)
        starts.setflags(write=False)
        return starts

    def payload_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block

    def segment_offsets(self, num_blocks: int, base: int = 0) -> np.ndarray:
        """Byte offset of each segment's first tile in an ``num_blocks``-block payload (int64)."""
        return base + num_blocks * self._segment_starts


@dataclass(frozen=True)
class ChunkGeometry:
    """How a staged payload of ``num_blocks`` blocks is cut into staging chunks.

    Chunk ``i`` holds request positions ``bounds(i)`` (``blocks_per_chunk`` of them, fewer in
    the last chunk) and is ``nbytes(i)`` bytes of staging; both sides of a transfer derive
    the same geometry from the ``blocks_per_chunk`` the destination sends.

    >>> g = ChunkGeometry(bytes_per_block=1000, num_blocks=10, blocks_per_chunk=4)
    >>> g.count, g.bounds(2), g.nbytes(2)
    (3, (8, 10), 2000)
    >>> ChunkGeometry.fit(bytes_per_block=1000, num_blocks=10, chunk_bytes=4096).blocks_per_chunk
    4
    """

    bytes_per_block: int
    num_blocks: int
    blocks_per_chunk: int

    @classmethod
    def fit(cls, bytes_per_block: int, num_blocks: int, chunk_bytes: int) -> "ChunkGeometry":
        """The widest chunks that fit ``chunk_bytes``; :class:`StagingError` when one block
        does not fit (staging is too small for this payload, whatever the request)."""
        if bytes_per_block > chunk_bytes:
            raise StagingError(f"one block needs {bytes_per_block} staging bytes, more than a chunk "
                               f"({chunk_bytes} bytes)")
        return cls(bytes_per_block, num_blocks, min(num_blocks, chunk_bytes // bytes_per_block))

    def fits(self, chunk_bytes: int) -> bool:
        """Whether every chunk is at least one block and at most ``chunk_bytes`` bytes."""
        return self.blocks_per_chunk >= 1 and self.blocks_per_chunk * self.bytes_per_block <= chunk_bytes

    @property
    def count(self) -> int:
        return ceil_div(self.num_blocks, self.blocks_per_chunk) if self.num_blocks else 0

    def bounds(self, chunk: int) -> tuple[int, int]:
        """Request positions ``[lo, hi)`` that chunk ``chunk`` carries."""
        lo = chunk * self.blocks_per_chunk
        return lo, min(self.num_blocks, lo + self.blocks_per_chunk)

    def nbytes(self, chunk: int) -> int:
        lo, hi = self.bounds(chunk)
        return (hi - lo) * self.bytes_per_block


@dataclass(frozen=True)
class DirectRead:
    """A region moved zero-copy; blocks are striped over ``src_ranks`` in request order."""

    region: int
    src_ranks: tuple[int, ...]


@dataclass(frozen=True)
class TransferPlan:
    """Everything destination rank ``dst_rank`` reads from one source engine.

    ``modes[i]`` is region ``i``'s mode; ``staged`` has one entry per source rank that sends a
    staged payload (sorted by rank); ``direct`` one entry per DIRECT region.
    ``src_block_size``/``dst_block_size`` are the engines' block sizes when they differ (a
    request is then mapped token by token: :func:`compact_tokens`), ``None`` when every region
    has equal block sizes on both sides (a request is then block pairs: :func:`compact_request`).
    """

    dst_rank: int
    dst_tp: int
    src_tp: int
    modes: tuple[Mode, ...]
    staged: tuple[StagedRead, ...]
    direct: tuple[DirectRead, ...]
    src_block_size: int | None = None
    dst_block_size: int | None = None

    @property
    def maps_tokens(self) -> bool:
        """True when the block sizes differ: requests are :class:`TokenMap` s, not block pairs."""
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
        return hashlib.sha1(repr((self.dst_rank, self.dst_tp, self.src_tp, self.modes, self.staged,
                                  self.direct, self.src_block_size, self.dst_block_size)).encode()).hexdigest()[:16]

    def direct_ranks(self, num_blocks: int) -> set[int]:
        """Source ranks that send DIRECT runs for a request of ``num_blocks`` blocks (a stripe
        wider than the request leaves the last replicas without blocks)."""
        ranks: set[int] = set()
        if num_blocks > 0:
            for d in self.direct:
                ranks.update(d.src_ranks[:num_blocks])
        return ranks

    def staged_read(self, src_rank: int) -> StagedRead | None:
        for s in self.staged:
            if s.src_rank == src_rank:
                return s
        return None


# --------------------------------------------------------------------------- validation gate
def check_compatible(
    dst_specs: Sequence[RegionSpec], dst_tp: int, src_specs: Sequence[RegionSpec], src_tp: int
) -> None:
    """Raise :class:`IncompatibleRemoteError` naming the first region that cannot be paired.

    Checks region count and order (names), kind, dtype, stream count, head_dim per stream,
    global head counts and that both TP sizes shard them, and that each side's local head count
    is what its TP size implies. Layouts may differ (the staged path converts), and so may block
    sizes, any pair, as long as each engine pages every region with one block size (a request's
    block ids are shared by all regions, so they must mean the same tokens in every region).
    """
    if len(dst_specs) != len(src_specs):
        raise IncompatibleRemoteError(
            f"region count differs: local has {len(dst_specs)} ({[s.name for s in dst_specs]}), "
            f"remote has {len(src_specs)} ({[s.name for s in src_specs]})"
        )
    for i, (d, s) in enumerate(zip(dst_specs, src_specs)):
        where = f"region {i} ({d.name!r})"

        def mismatch(what: str, local, remote) -> IncompatibleRemoteError:
            return IncompatibleRemoteError(f"{where}: {what} differs: local {local!r}, remote {remote!r}")

        if d.name != s.name:
            raise mismatch("name (regions must be listed in the same order)", d.name, s.name)
        if d.kind != s.kind:
            raise mismatch("kind", d.kind.value, s.kind.value)
        if d.dtype != s.dtype or d.itemsize != s.itemsize:
            raise mismatch("dtype", d.dtype, s.dtype)
        if d.head_dims != s.head_dims:
            raise mismatch("head_dim per stream", d.head_dims, s.head_dims)
        if d.total_heads != s.total_heads:
            raise mismatch("total KV heads", d.total_heads, s.total_heads)
        if d.kind is Kind.SPLIT:
            for side, tp, spec in (("local", dst_tp, d), ("remote", src_tp, s)):
                try:
                    check_tp(tp, spec.total_heads, f"{where} on the {side} engine")
                except Exception as e:
                    raise IncompatibleRemoteError(str(e)) from None
                expected = head_range(0, tp, spec.total_heads)
                if spec.local_heads != expected[1] - expected[0]:
                    raise IncompatibleRemoteError(
                        f"{where}: {side} rank holds {spec.local_heads} heads, but tp={tp} with "
                        f"{spec.total_heads} heads gives {expected[1] - expected[0]} per rank"
                    )
        elif d.local_heads != s.local_heads:
            raise mismatch("heads of a REPLICATE region", d.local_heads, s.local_heads)
    resized = any(d.block_size != s.block_size for d, s in zip(dst_specs, src_specs))
    for i, (d, s) in enumerate(zip(dst_specs, src_specs)):
        for side, spec in (("local", d), ("remote", s)):
            problem = spec.dim_major_problem()
            if problem is not None:
                raise IncompatibleRemoteError(f"region {i} ({d.name!r}) on the {side} engine: {problem}")
        if not resized and any(d.dim_major_of(j) != s.dim_major_of(j) for j in range(d.num_streams)):
            # whole blocks move as opaque tiles: both must order a block's bytes alike
            raise IncompatibleRemoteError(
                f"region {i} ({d.name!r}): the in-block order differs (dim-major row elements per stream: "
                f"local {[d.dim_major_of(j) for j in range(d.num_streams)]}, remote "
                f"{[s.dim_major_of(j) for j in range(s.num_streams)]}) and the block sizes are equal "
                f"({d.block_size}): whole blocks cannot be reordered; expected the same order on both engines"
            )
    if resized:
        for side, specs in (("local", dst_specs), ("remote", src_specs)):
            sizes = {x.block_size for x in specs}
            if len(sizes) > 1:
                per_region = {x.name: x.block_size for x in specs}
                raise IncompatibleRemoteError(
                    f"block_size differs between the engines (local {dst_specs[0].block_size}, remote "
                    f"{src_specs[0].block_size} in region 0) and the {side} engine pages its regions with "
                    f"several block sizes {per_region}: a block-size change needs one block size per engine"
                )


def _block_sizes(dst_specs: Sequence[RegionSpec], src_specs: Sequence[RegionSpec]) -> tuple[int | None, int | None]:
    """``(source, destination)`` block sizes when they differ (one per engine), else ``(None, None)``."""
    if not dst_specs or all(d.block_size == s.block_size for d, s in zip(dst_specs, src_specs)):
        return None, None
    return src_specs[0].block_size, dst_specs[0].block_size


# --------------------------------------------------------------------------- planning
def build_plan(
    dst_rank: int,
    dst_tp: int,
    dst_specs: Sequence[RegionSpec],
    src_tp: int,
    src_specs: Sequence[RegionSpec],
    *,
    modes: Mode | str | Mapping[str, Mode | str] | None = None,
    cost: CostModel = CostModel(),
    replicate_stripe: int | None = None,
) -> TransferPlan:
    """Plan what ``dst_rank`` (of a ``dst_tp`` engine) reads from a ``src_tp`` engine.

    ``modes`` forces a mode for every region (a :class:`Mode`) or per region name (a mapping);
    otherwise REPLICATE regions go DIRECT (zero-copy), SPLIT regions go STAGED unless the slice
    is a whole block in the same layout and the cost model prefers DIRECT. A forced DIRECT that
    is impossible (partial heads, other layout, non-dense blocks, different block sizes) raises
    :class:`PlanError`. A STAGED region travels in its source rank's payload, whose way
    (:attr:`StagedRead.ways`: STAGED, or the one-sided READ_UNPACK / PACK_PLACE where every
    segment allows it) the destination chooses per request; forcing READ_UNPACK or PACK_PLACE
    (``modes[i]`` is then that mode) leaves only that way and raises :class:`PlanError` naming
    the segment when impossible, or when regions of one source rank's payload force different
    ways; forcing STAGED leaves only the pack-READ-unpack way. With different block sizes every region is STAGED (REPLICATE ones from
    their first replica) and each segment's tiles are ``dst block_size`` tokens gathered from
    ``src_block_size``-token source blocks.

    Example
    -------
    >>> import torch
    >>> from kvtriton.regions import Region
    >>> k = torch.zeros(8, 16, 4, 128, dtype=torch.bfloat16)       # P rank: 4 of 8 heads
    >>> kd = torch.zeros(8, 16, 2, 128, dtype=torch.bfloat16)      # D rank: 2 of 8 heads
    >>> p = Region.attention("l0", k, k.clone(), block_size=16, total_heads=8).spec
    >>> d = Region.attention("l0", kd, kd.clone(), block_size=16, total_heads=8).spec
    >>> plan = build_plan(3, 4, [d], 2, [p])    # P TP2 -> D TP4: D3 reads heads 2-3 of P1
    >>> [(s.src_rank, s.segments[0].src_head, s.segments[0].num_heads) for s in plan.staged]
    [(1, 2, 2)]
    """
    if not 0 <= dst_rank < dst_tp:
        raise PlanError(f"destination rank {dst_rank} is out of range for tp={dst_tp}")
    check_compatible(dst_specs, dst_tp, src_specs, src_tp)
    src_bs, dst_bs = _block_sizes(dst_specs, src_specs)
    forced = _forced_modes(modes, dst_specs)
    forced_way: dict[int, Mode] = {}  # region -> the staged way forced for it
    region_modes: list[Mode] = []
    per_source: dict[int, list[Segment]] = {}
    direct: list[DirectRead] = []
    for i, (d, s) in enumerate(zip(dst_specs, src_specs)):
        if d.kind is Kind.REPLICATE:
            sources = replicate_sources(dst_rank, dst_tp, src_tp, replicate_stripe)
            slices = None
        else:
            slices = split_sources(dst_rank, dst_tp, src_tp, d.total_heads)
            sources = None
        whole = _direct_possible(d, s, slices)
        mode = forced.get(d.name)
        if mode is None:  # auto: DIRECT when possible and cheaper, else STAGED (its way chosen per request)
            if d.kind is Kind.REPLICATE:
                mode = Mode.DIRECT if whole else Mode.STAGED
            else:
                per_desc = min(d.tile_bytes(j, d.local_heads) for j in range(d.num_streams))
                mode = Mode.DIRECT if whole and cost.prefers_direct(per_desc) else Mode.STAGED
        if forced.get(d.name) in STAGED_WAYS:
            forced_way[i] = mode  # else auto: the way is chosen per request among the feasible ones
        if mode is Mode.DIRECT and not whole:
            raise PlanError(
                f"region {i} ({d.name!r}): DIRECT needs whole blocks of equal block_size with equal "
                f"layout and dense blocks on both sides (local {d.layout.value} {d.local_heads} heads "
                f"block_size {d.block_size}, remote {s.layout.value} {s.local_heads} heads block_size "
                f"{s.block_size}); use STAGED"
            )
        region_modes.append(mode)
        if mode is Mode.DIRECT:
            direct.append(DirectRead(i, sources if sources is not None else (slices[0].src_rank,)))
            continue
        if slices is None:  # staged REPLICATE: every head from the first replica
            slices = (HeadSlice(sources[0], 0, 0, d.local_heads),)
        for sl in slices:
            per_source.setdefault(sl.src_rank, []).extend(
                Segment(i, j, sl.src_head, sl.dst_head, sl.num_heads, d.head_dims[j], d.itemsize,
                        d.block_size, d.layout, src_bs, d.dim_major_of(j))
                for j in range(d.num_streams)
            )
    staged = tuple(StagedRead(r, tuple(segs), _ways(r, segs, forced_way, src_specs, dst_specs))
                   for r, segs in sorted(per_source.items()))
    return TransferPlan(dst_rank, dst_tp, src_tp, tuple(region_modes), staged, tuple(direct), src_bs, dst_bs)


def _ways(src_rank: int, segs: Sequence[Segment], forced_way: Mapping[int, Mode],
          src_specs: Sequence[RegionSpec], dst_specs: Sequence[RegionSpec]) -> tuple[Mode, ...]:
    """The ways source rank ``src_rank``'s payload may travel: one forced way (every region in it
    that forces one must force the same, and it must be possible), else STAGED and every
    one-sided way all its segments allow. One way per payload keeps the protocol to one
    choice per (request, source rank)."""
    problems = {Mode.STAGED: None,
                Mode.READ_UNPACK: next((p for g in segs if (p := read_unpack_problem(g, src_specs[g.region]))), None),
                Mode.PACK_PLACE: next((p for g in segs if (p := pack_place_problem(g, dst_specs[g.region]))), None)}
    wanted = {forced_way[g.region] for g in segs if g.region in forced_way}
    if len(wanted) > 1:
        names = sorted({dst_specs[g.region].name for g in segs if g.region in forced_way})
        raise PlanError(f"regions {names} force different modes {sorted(w.value for w in wanted)} but all come from "
                        f"source rank {src_rank} in one payload, which travels one way per request; force one mode "
                        f"for every region read from that rank")
    if wanted:
        way = wanted.pop()
        if problems[way] is not None:
            raise PlanError(f"{way.value} from source rank {src_rank} is not possible: {problems[way]}; "
                            f"use staged")
        return (way,)
    return tuple(w for w in STAGED_WAYS if problems[w] is None)


def _same_tile_order(spec: RegionSpec, seg: Segment) -> bool:
    return spec.layout == seg.dst_layout or seg.num_heads == 1 or seg.block_size == 1


def read_unpack_problem(seg: Segment, src: RegionSpec) -> str | None:
    """Why segment ``seg`` cannot be READ straight out of the source's cache blocks (``src``:
    the source's spec of its region), ``None`` when it can: the staged tile must be the source's
    whole block, byte for byte (all its heads, equal block size, the same in-block order, the
    block one contiguous range)."""
    where = f"region {seg.region} ({src.name!r}) stream {seg.stream}"
    if seg.src_block_size is not None:
        return f"{where}: block sizes differ ({seg.src_block_size} -> {seg.block_size})"
    if seg.src_head != 0 or seg.num_heads != src.local_heads:
        return (f"{where}: the destination takes heads [{seg.src_head}, {seg.src_head + seg.num_heads}) of the "
                f"source rank's {src.local_heads}, not the whole block")
    if not _same_tile_order(src, seg):
        return f"{where}: the source stores {src.layout.value}, the tile is {seg.dst_layout.value}"
    if not src.block_is_dense(seg.stream):
        return f"{where}: a source block is not one contiguous range (strides {src.strides[seg.stream]})"
    return None


def pack_place_problem(seg: Segment, dst: RegionSpec) -> str | None:
    """Why segment ``seg``'s staged tiles cannot be READ straight into the destination's cache
    blocks (``dst``: its spec), ``None`` when they can: the tile must be the destination's whole
    block (all its heads, equal block size, the block one contiguous range)."""
    where = f"region {seg.region} ({dst.name!r}) stream {seg.stream}"
    if seg.src_block_size is not None:
        return f"{where}: block sizes differ ({seg.src_block_size} -> {seg.block_size})"
    if seg.dst_head != 0 or seg.num_heads != dst.local_heads:
        return (f"{where}: the tile fills heads [{seg.dst_head}, {seg.dst_head + seg.num_heads}) of the "
                f"destination's {dst.local_heads}, not the whole block")
    if not dst.block_is_dense(seg.stream):
        return f"{where}: a destination block is not one contiguous range (strides {dst.strides[seg.stream]})"
    return None


def _forced_modes(modes, specs: Sequence[RegionSpec]) -> dict[str, Mode]:
    if modes is None:
        return {}
    try:
        if isinstance(modes, (Mode, str)):
            return {s.name: Mode(modes) for s in specs}
        names = {s.name for s in specs}
        unknown = set(modes) - names
        if unknown:
            raise PlanError(f"modes name unknown regions {sorted(unknown)}; regions are {sorted(names)}")
        return {name: Mode(m) for name, m in modes.items()}
    except ValueError as e:
        if isinstance(e, PlanError):
            raise
        raise PlanError(f"unknown transfer mode in {modes!r}: expected one of "
                       f"{[m.value for m in Mode]}") from None


def _direct_possible(d: RegionSpec, s: RegionSpec, slices) -> bool:
    """Whole-block zero-copy needs: the slice is the whole block on both sides, the same byte
    order inside a block, every block one contiguous range on both sides, and blocks of equal
    size (so that a run of blocks is the same run of tokens on both sides)."""
    if d.block_size != s.block_size:
        return False
    if slices is not None:
        if len(slices) != 1 or slices[0].num_heads != d.local_heads or d.local_heads != s.local_heads:
            return False
    same_order = d.layout == s.layout or d.local_heads == 1 or d.block_size == 1
    dense = all(d.block_is_dense(j) and s.block_is_dense(j) for j in range(d.num_streams))
    return same_order and dense


def required_source_ranks(
    dst_rank: int,
    dst_tp: int,
    dst_specs: Sequence[RegionSpec],
    src_tp: int,
    *,
    replicate_stripe: int | None = None,
) -> tuple[int, ...]:
    """Source ranks ``dst_rank`` may read from, known *before* any source metadata arrives.

    Which ranks serve a destination depends only on each region's kind and global head count,
    which both engines share (the validation gate checks it), so a destination connects to
    these ranks and no others. It equals :attr:`TransferPlan.source_ranks` of the plan that
    :func:`build_plan` makes later, except that a REPLICATE region the plan sends STAGED reads
    only the first of its replicas (this returns all of them).
    """
    if not 0 <= dst_rank < dst_tp:
        raise PlanError(f"destination rank {dst_rank} is out of range for tp={dst_tp}")
    ranks: set[int] = set()
    for d in dst_specs:
        if d.kind is Kind.REPLICATE:
            ranks.update(replicate_sources(dst_rank, dst_tp, src_tp, replicate_stripe))
        else:
            ranks.update(sl.src_rank for sl in split_sources(dst_rank, dst_tp, src_tp, d.total_heads))
    return tuple(sorted(ranks))


# --------------------------------------------------------------------------- per request
def compact_request(
    src_block_ids: Sequence[int] | np.ndarray,
    dst_block_ids: Sequence[int] | np.ndarray,
    src_num_blocks: int,
    dst_num_blocks: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Check a request's block ids and drop positions that either side pads with -1.

    For engines with equal block sizes: position ``j`` of both lists holds the same tokens, and
    whole blocks move (a partial last block moves whole: the tokens past the request's end are
    whatever the source block holds). -1 on either side skips the position (the destination
    already has it, e.g. a prefix-cache hit, or the source does not hold it). With different
    block sizes use :func:`compact_tokens`.

    Returns int64 arrays of equal length. Raises :class:`PlanError` on length mismatch, ids out
    of ``[-1, num_blocks)``, or duplicate destination ids (two tiles would race for one block).
    """
    src, dst = _check_ids(src_block_ids, dst_block_ids, src_num_blocks, dst_num_blocks)
    if src.shape != dst.shape:
        raise PlanError(f"request has {src.size} source block ids but {dst.size} destination ids")
    keep = (src >= 0) & (dst >= 0)
    # copies either way: the caller may reuse its id arrays after this returns
    src, dst = (src[keep], dst[keep]) if not keep.all() else (src.copy(), dst.copy())
    _check_distinct(dst, dst_num_blocks)
    return src, dst


@dataclass(frozen=True)
class DirectRuns:
    """Zero-copy descriptors of one request: parallel int64 arrays, one entry per descriptor.

    Offsets are bytes from the start of (rank, region, stream)'s tensor: ``src_offset`` on
    ``src_rank``, ``dst_offset`` on the destination.
    """

    src_rank: np.ndarray
    region: np.ndarray
    stream: np.ndarray
    src_offset: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray = field(repr=False)

    def __len__(self) -> int:
        return int(self.nbytes.size)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


def direct_runs(
    plan: TransferPlan,
    src_specs: Sequence[RegionSpec] | Mapping[int, Sequence[RegionSpec]],
    dst_specs: Sequence[RegionSpec],
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
) -> DirectRuns:
    """Coalesced descriptors for every DIRECT region of a compacted request.

    Blocks of a region are split over its ``src_ranks`` in contiguous parts of the request (so
    runs stay long). Consecutive ids on *both* sides merge into one descriptor when both
    tensors store consecutive blocks back to back. ``src_specs`` may be one list for all source
    ranks or a mapping rank -> list when strides differ between ranks. Entries are ordered by
    region, then source rank, then stream.

    Cost: regions are grouped by geometry once per (plan, spec lists) (:func:`_direct_groups`);
    a request then finds its runs once per group with numpy and repeats them for the group's
    regions (DeepSeek-V3's 61 MLA layers are one group), so the Python work is per group, not
    per region or block; what remains is linear in the descriptors returned.
    """
    n = src_ids.size
    src_ids = np.asarray(src_ids, dtype=np.int64)
    dst_ids = np.asarray(dst_ids, dtype=np.int64)
    blocks: list[list[np.ndarray]] = []  # per group: its six columns
    for group in _direct_groups(plan, src_specs, dst_specs):
        parts = _split_bounds(n, len(group.src_ranks))
        base: list[list[np.ndarray]] = [[] for _ in range(5)]
        for rank, (lo, hi), streams in zip(group.src_ranks, parts, group.streams):
            if hi == lo:
                continue
            sid, did = src_ids[lo:hi], dst_ids[lo:hi]
            merged = None
            for j, (block_bytes, s_stride, d_stride) in enumerate(streams):
                if s_stride == block_bytes and d_stride == block_bytes:
                    if merged is None:  # the same runs for every stream that coalesces
                        brk = (sid[1:] != sid[:-1] + 1) | (did[1:] != did[:-1] + 1)
                        starts = np.empty(int(np.count_nonzero(brk)) + 1, dtype=np.int64)
                        starts[0] = 0
                        starts[1:] = np.flatnonzero(brk) + 1
                        ends = np.empty_like(starts)
                        ends[:-1] = starts[1:]
                        ends[-1] = sid.size
                        merged = starts, ends - starts
                    starts, lengths = merged
                else:
                    starts = np.arange(sid.size, dtype=np.int64)
                    lengths = np.ones(sid.size, dtype=np.int64)
                k = starts.size
                base[0].append(np.full(k, rank, dtype=np.int64))
                base[1].append(np.full(k, j, dtype=np.int64))
                base[2].append(sid[starts] * s_stride)
                base[3].append(did[starts] * d_stride)
                base[4].append(lengths * block_bytes)
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
        return DirectRuns(*(np.zeros(0, np.int64) for _ in range(6)))
    arrays = [np.concatenate([b[i] for b in blocks]) if len(blocks) > 1 else blocks[0][i] for i in range(6)]
    if len(blocks) > 1 and (np.diff(arrays[1]) < 0).any():  # groups interleave: back to region order
        order = np.argsort(arrays[1], kind="stable")
        arrays = [a[order] for a in arrays]
    return DirectRuns(*arrays)


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
class _DirectGroup:
    """DIRECT regions whose runs are byte-for-byte alike: the same source ranks, and per rank and
    stream the same ``(block bytes, source block stride, destination block stride)``."""

    src_ranks: tuple[int, ...]
    streams: tuple[tuple[tuple[int, int, int], ...], ...]  # per src rank, per stream
    regions: tuple[int, ...]


_GROUP_CACHE_ENTRIES = 8


def _direct_groups(plan: TransferPlan, src_specs, dst_specs) -> tuple[_DirectGroup, ...]:
    """The plan's DIRECT regions grouped by geometry, memoised on the plan per spec lists.

    A cache entry keeps the spec objects it was computed from and is used only while the lists
    passed hold the very same (immutable) :class:`RegionSpec` objects: an identity check per
    region, much cheaper than reading each spec's geometry again."""
    mapping = isinstance(src_specs, Mapping)
    cache = plan.__dict__.setdefault("_direct_group_cache", {})
    ranks = cache.get("ranks")
    if ranks is None:
        ranks = cache["ranks"] = tuple(sorted({r for d in plan.direct for r in d.src_ranks}))
    lists = tuple(src_specs[r] for r in ranks) if mapping else (src_specs,)
    key = (mapping, ranks if mapping else (), tuple(map(id, lists)), id(dst_specs))
    hit = cache.get(key)
    if hit is not None:
        snap_src, snap_dst, groups = hit
        if _same_objects(snap_dst, dst_specs) and all(_same_objects(a, b) for a, b in zip(snap_src, lists)):
            return groups
    by_key: dict[tuple, list[int]] = {}
    for dr in plan.direct:
        d = dst_specs[dr.region]
        per_rank = []
        for rank in dr.src_ranks:
            s = (src_specs[rank] if mapping else src_specs)[dr.region]
            per_rank.append(tuple((d.tile_bytes(j, d.local_heads), s.block_stride_bytes(j), d.block_stride_bytes(j))
                                  for j in range(d.num_streams)))
        by_key.setdefault((dr.src_ranks, tuple(per_rank)), []).append(dr.region)
    groups = tuple(_DirectGroup(k[0], k[1], tuple(v)) for k, v in by_key.items())
    if len(cache) > _GROUP_CACHE_ENTRIES:  # list(): a snapshot, safe if another thread plans too
        cache.pop(next(k for k in list(cache) if k != "ranks"), None)
    cache[key] = (tuple(tuple(x) for x in lists), tuple(dst_specs), groups)
    return groups


def _same_objects(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


# --------------------------------------------------------------------------- descriptor counts
def staged_descriptor_count(plan: TransferPlan, num_blocks: int, chunk_bytes: int | None = None) -> int:
    """Descriptors one destination rank posts for the staged part of a request: one per
    (source rank, chunk)."""
    if num_blocks == 0:
        return 0
    if chunk_bytes is None:
        return len(plan.staged)
    return sum(ChunkGeometry.fit(r.bytes_per_block, num_blocks, chunk_bytes).count for r in plan.staged)


def vllm_direct_descriptor_count(num_sources: int, num_layers: int, num_blocks: int, kv_streams: int = 1) -> int:
    """vLLM-style direct head-slice reads per decode rank: ``k * L * n`` with K and V packed per
    block (``kv_streams=1``), ``k * 2 * L * n`` with K and V as separate streams."""
    return num_sources * kv_streams * num_layers * num_blocks


def per_token_descriptor_count(num_sources: int, num_layers: int, num_tokens: int) -> int:
    """One descriptor per (source, layer, K/V, token): the non-staged path for NHD caches,
    where a head slice is not contiguous inside a block (``2 * L * tokens`` per source)."""
    return num_sources * 2 * num_layers * num_tokens
