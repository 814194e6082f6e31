"""Per request: what one request between two ranks moves, and which source ranks a destination
needs.

Pure (numpy). With equal block sizes a request is block pairs (:func:`~kvtriton.plan.ids.compact_request`,
per KV cache group: :mod:`kvtriton.plan.ids`); between engines whose block sizes differ it is a
token map (:mod:`kvtriton.plan.tokens`). :func:`required_source_ranks` says which source ranks a
destination connects to before any source metadata arrives.

A :class:`RequestPlan` is what one request between two ranks moves, made once (pure: numpy and
the standard library, over :mod:`kvtriton.plan`).

A :class:`~kvtriton.plan.TransferPlan` is made once per (destination rank, source engine), a
:class:`~kvtriton.plan.PairPlan` once per pair of ranks; a request adds block ids. A
:class:`RequestPlan` holds the rest (compacted ids or the token map, the source ranks sending
DIRECT runs, each payload's chunks and way, the digests an offer carries), for the three places
that need it: the destination at ``fetch()`` (:meth:`RequestPlan.for_fetch`: checks the ids,
chooses the ways), the source when a pull or push arrives (:meth:`RequestPlan.for_serve`, from
what the destination sent), and the source's eager packs before any pull
(:meth:`RequestPlan.for_hold`: every held block in order, the ways guessed).

Both sides of an offer describe it with :class:`OfferTerms`: the source sends the terms of
its pack, the destination compares them with the terms of its own request.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..errors import PlanError, StagingError
from ..spec import Kind, RegionSpec
from .ids import (
    IdsArg,
    compact_groups,
    compact_request,
    group_lists,
    one_list,
    wire_group_sizes,
)
from .pair import PairPlan, RunCounts
from .tokens import TokenMap, compact_tokens, source_positions
from .topology import replicate_sources, split_sources
from .types import ChunkGeometry, Payload, TransferPlan, Way

#: request sizes a caller's ``fitted`` memo keeps (RequestPlan.for_fetch); past it, it starts over
_MAX_FITTED = 256

__all__ = ["TokenMap", "compact_tokens", "source_positions", "compact_request", "required_source_ranks",
           "done_ranks", "meeting_ranks", "RequestPlan", "RequestPayload", "OfferTerms", "ids_digest"]

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


def done_ranks(
    src_rank: int,
    src_tp: int,
    specs: Sequence[RegionSpec],
    dst_tp: int,
    *,
    replicate_stripe: int | None = None,
) -> tuple[int, ...]:
    """Destination ranks whose ``done`` a source rank waits for before it frees a hold.

    Those that may read from it (:func:`required_source_ranks`); when none does (a replicated
    head another replica serves, e.g. 1 KV head at P2->D1), the one rank ``src_rank % dst_tp``,
    which meets this rank only to say it is done. Both engines compute it from what they share
    (kinds, global head counts, TP sizes, stripe), so a hold ends as soon as its last reader
    finished, never by lease because a rank that reads nothing from it stays silent."""
    if not 0 <= src_rank < src_tp:
        raise PlanError(f"source rank {src_rank} is out of range for tp={src_tp}")
    readers = tuple(d for d in range(dst_tp)
                    if src_rank in required_source_ranks(d, dst_tp, specs, src_tp, replicate_stripe=replicate_stripe))
    return readers or (src_rank % dst_tp,)


def meeting_ranks(
    dst_rank: int,
    dst_tp: int,
    dst_specs: Sequence[RegionSpec],
    src_tp: int,
    *,
    replicate_stripe: int | None = None,
) -> tuple[int, ...]:
    """Source ranks ``dst_rank`` connects to: those it may read from, and those no destination
    rank reads whose done it owes (:func:`done_ranks`)."""
    return tuple(r for r in range(src_tp)
                 if dst_rank in done_ranks(r, src_tp, dst_specs, dst_tp, replicate_stripe=replicate_stripe))


# ----------------------------------------------------------------- the per-request plan


def ids_digest(ids: np.ndarray) -> str:
    """What an offer says about the block ids it packed (both sides hash int64 ids alike)."""
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int64).tobytes(), digest_size=12).hexdigest()


class OfferTerms(NamedTuple):
    """What an offer (:class:`~kvtriton.protocol.wire.Offer`) claims, besides its slots: the plan's
    digest, the digest of the source ids, their count, the blocks per chunk and whether the
    offer also confirms DIRECT runs (1) or not (0). An offer is taken only when its terms equal
    those of the request the destination makes."""

    plan: str
    ids: str
    num_blocks: int
    chunk_blocks: int
    runs: int

    def same_blocks(self, other: OfferTerms) -> bool:
        """Same plan, same ids: what a read_unpack offer (no chunks, no slots) must match."""
        return (self.plan, self.ids, self.num_blocks) == (other.plan, other.ids, other.num_blocks)


@dataclass(frozen=True)
class RequestPayload:
    """One source rank's staged payload of one request: its segments (``read``) and how it is
    cut into staging chunks (``chunks``; ``chunks.num_blocks`` tiles, one per position)."""

    read: Payload
    chunks: ChunkGeometry

    @property
    def src_rank(self) -> int:
        return self.read.src_rank

    @property
    def nbytes(self) -> int:
        """Bytes of the whole payload (every chunk)."""
        g = self.chunks
        return self.read.payload_bytes(g.group_sizes if g.grouped else g.num_blocks)

    def refit(self, chunk_bytes: int) -> RequestPayload:
        """The same payload in the widest chunks of at most ``chunk_bytes`` (StagingError when
        one tile does not fit)."""
        g = self.chunks
        return RequestPayload(self.read, self.read.chunk_geometry(g.group_sizes or (g.num_blocks,), chunk_bytes))

    def segment_offsets(self, chunk: int, base: int = 0) -> np.ndarray:
        """Byte offset of each segment's first tile inside chunk ``chunk`` placed at ``base``."""
        if self.chunks.grouped:
            return self.read.segment_offsets(self.chunks.group_counts(chunk), base=base)
        lo, hi = self.chunks.bounds(chunk)
        return self.read.segment_offsets(hi - lo, base=base)

    def launch_groups(self, chunk: int) -> tuple[int, ...] | None:
        """What :func:`kvtriton.ops.pack`/``unpack`` take as ``groups`` for chunk ``chunk``: the
        positions of each KV cache group among the chunk's ids (``None``: one group)."""
        return self.chunks.group_counts(chunk) if self.chunks.grouped else None


def _caps(chunk_bytes: int | Mapping[int, int], rank: int) -> int:
    return chunk_bytes if isinstance(chunk_bytes, int) else chunk_bytes[rank]


@dataclass(frozen=True, eq=False)
class RequestPlan:
    """Everything one request between a destination rank and a source engine moves, and how.

    Made once per request and side: :meth:`for_fetch` (the destination, which chooses the
    ways), :meth:`for_serve` (the source, from what the destination sent), :meth:`for_hold`
    (the source's guess before any pull).

    Attributes
    ----------
    plan : TransferPlan
        The pair's plan (every source rank of the engine).
    src_ids : np.ndarray
        ``int64 [n_read]``: the source block ids read, in order (what the wire carries; with a
        token map, :attr:`TokenMap.read_ids`).
    dst_ids : np.ndarray or None
        ``int64 [num_tiles]``: the destination block of each staged tile and DIRECT position
        (``None`` on the source, which never learns them).
    tokens, num_tiles : TokenMap or None, int
        The token map when the engines' block sizes differ; staged tiles (and DIRECT positions).
    payloads, unfit : Mapping[int, RequestPayload], Mapping[int, StagingError]
        Per source rank, its staged payload that fits its chunk cap, or why it does not.
    pairs : Mapping[int, PairPlan]
        Per source rank, the pair's plan the request was made over (``{}``: none given).
    ways : Mapping[int, Way]
        Per source rank with a payload, how it travels for this request (the destination's
        choice; on the source, the way the pull named; ``{}`` when no pair was given).
    guessed : bool
        The ids and ways are the source's guess (:meth:`for_hold`), not a destination's request.
    groups : tuple[int, ...]
        Positions of each KV cache group (``plan.groups`` of them): :attr:`src_ids` and
        :attr:`dst_ids` are the groups' compacted lists concatenated in group order
        (:attr:`group_bounds`); one group: ``(num_tiles,)``. A region of group ``g`` moves only
        its group's positions; the payload layout is :mod:`kvtriton.plan.types`'s.

    Example
    -------
    >>> import torch
    >>> from kvtriton.plan import PairPlan, RequestPlan, build_plan
    >>> from kvtriton.regions import Region
    >>> k = torch.zeros(8, 16, 4, 128, dtype=torch.bfloat16)       # P rank: 4 of 8 heads
    >>> kd = torch.zeros(8, 16, 2, 128, dtype=torch.bfloat16)      # D rank: 2 of 8 heads
    >>> p = Region.attention("l0", k, k.clone(), block_size=16, total_heads=8).spec
    >>> d = Region.attention("l0", kd, kd.clone(), block_size=16, total_heads=8).spec
    >>> plan = build_plan(3, 4, [d], 2, [p])
    >>> pairs = {1: PairPlan(plan, 1, [p], [d])}
    >>> rp = RequestPlan.for_fetch(plan, [5, 6, 7], [0, -1, 2], src_num_blocks=8, dst_num_blocks=8,
    ...                            chunk_bytes=1 << 20, pairs=pairs)
    >>> rp.src_ids.tolist(), rp.dst_ids.tolist(), rp.payload(1).chunks.count, rp.ways[1].value
    ([5, 7], [0, 2], 1, 'pack_place')
    """

    plan: TransferPlan
    src_ids: np.ndarray
    dst_ids: np.ndarray | None
    tokens: TokenMap | None
    num_tiles: int
    payloads: Mapping[int, RequestPayload]
    unfit: Mapping[int, StagingError]
    pairs: Mapping[int, PairPlan] = field(default_factory=dict)
    ways: Mapping[int, Way] = field(default_factory=dict)
    guessed: bool = False
    groups: tuple[int, ...] = ()

    # ------------------------------------------------------------------ makers
    @classmethod
    def for_fetch(cls, plan: TransferPlan, src_block_ids: IdsArg, dst_block_ids: IdsArg, *,
                  src_num_blocks: int, dst_num_blocks: int,
                  chunk_bytes: int | Mapping[int, int], num_tokens: int | None = None,
                  pairs: Mapping[int, PairPlan] | None = None, packed: Collection[int] = (),
                  cache_offers: Mapping[int, OfferTerms] | None = None, push: bool = False,
                  fitted: MutableMapping[tuple[int, ...], Mapping[int, RequestPayload]] | None = None) -> RequestPlan:
        """The destination's request: ids checked and compacted (-1 on either side drops the
        position), or mapped token by token when the block sizes differ; each staged payload
        fitted to ``chunk_bytes`` (one cap, or one per source rank: the smaller of both sides'
        staging chunks). Raises :class:`PlanError` on bad ids; a payload that does not fit is
        kept in :attr:`unfit` (the request fails when that rank's payload is asked for).

        With ``pairs`` (per source rank, its :class:`PairPlan`) each payload's way is chosen
        here, the one place it is (:attr:`ways`): STAGED for a ``push`` or a token map, else the
        pair's cost model's choice for these ids (:meth:`PairPlan.choose_way`; ``packed``: the
        source ranks that offered their payload packed already; ``cache_offers``: per source rank,
        the terms of its offer of its cache blocks, which the ways reading them take with no pull
        when they are this request's blocks, :meth:`OfferTerms.same_blocks`).

        ``fitted``: the payloads of earlier requests of this ``plan`` and ``chunk_bytes``, by their
        group sizes (a caller's memo, kept per plan and caps: a request of a size seen before
        reuses them, each payload immutable; a size whose payloads do not all fit is not kept).

        Several KV cache groups (``plan.groups > 1``): the ids are one list per group
        (:func:`group_lists`; a flat list stands for every group), compacted per group
        (:func:`compact_groups`); every payload then travels STAGED (the one-sided ways and
        token maps are for one group only, yet)."""
        tokens = None
        if plan.groups > 1:
            src_l = group_lists(src_block_ids, plan.groups, "remote block ids")
            dst_l = group_lists(dst_block_ids, plan.groups, "local block ids")
            src, dst, groups = compact_groups(src_l, dst_l, src_num_blocks, dst_num_blocks)
        elif plan.maps_tokens:
            bs, bd = _block_sizes(plan)
            tokens = compact_tokens(one_list(src_block_ids), one_list(dst_block_ids), src_num_blocks, dst_num_blocks,
                                    bs, bd, num_tokens)
            src, dst = tokens.read_ids, tokens.tile_dst_ids
            groups = (int(dst.size),)
        else:
            src, dst = compact_request(one_list(src_block_ids), one_list(dst_block_ids), src_num_blocks, dst_num_blocks)
            groups = (int(dst.size),)
        rp = cls._make(plan, src, dst, tokens, groups,
                       lambda read, g: read.chunk_geometry(g, _caps(chunk_bytes, read.src_rank)), pairs or {},
                       fitted=fitted)
        if pairs is not None:
            staged = push or tokens is not None or plan.groups > 1
            runs = RunCounts(src, dst)  # one request: its run counts found once for every pair
            cached = {r for r, t in cache_offers.items() if t.same_blocks(rp.cache_offer_terms())} if cache_offers \
                else set()
            object.__setattr__(rp, "ways", rp._choose(lambda r, p: Way.STAGED if staged else pairs[r].choose_way(
                src, dst, chunks=p.chunks.count, packed=r in packed, runs=runs, cache_offered=r in cached)))
        return rp

    @classmethod
    def for_serve(cls, plan: TransferPlan, src_rank: int, read_ids: Sequence[int] | np.ndarray, *,
                  held_blocks: int, chunk_blocks: int, num_tokens: int = 0,
                  tiles: Sequence[int] = (), pair: PairPlan | None = None, way: Way = Way.STAGED,
                  groups: Sequence[int] = ()) -> RequestPlan:
        """The source's view of a request a destination asked for: ``read_ids`` (the source ids
        it sent), and with a token map its ``tiles`` and ``num_tokens`` (checked against the
        ``held_blocks`` of the hold: :class:`PlanError` when they do not fit). The payload of
        ``src_rank`` is cut in the ``chunk_blocks`` the destination asked (checking them against
        this side's staging is :meth:`ChunkGeometry.fits`), and travels the ``way`` it named
        (checking it against the plan is the caller's). A token count or tiles sent for a
        plan of equal block sizes is the caller's to refuse (they are ignored here). ``groups``:
        the positions of each KV cache group the destination sent (``()``: one group);
        :class:`PlanError` unless the plan's group count of them adds up to the ids."""
        ids = np.asarray(read_ids, dtype=np.int64).reshape(-1)
        tokens = None
        n = int(ids.size)
        sizes = wire_group_sizes(plan.groups, groups, n)
        if plan.maps_tokens:
            bs, bd = _block_sizes(plan)
            tokens = TokenMap.for_source(tiles, ids, num_tokens, bs, bd, held_blocks)
            n = tokens.num_tiles
            sizes = (n,)
        payloads = {}
        read = plan.payload(src_rank)
        if read is not None:
            payloads[src_rank] = RequestPayload(read, read.chunks_of(sizes, chunk_blocks))
        return cls(plan, ids, None, tokens, n, payloads, {}, {} if pair is None else {src_rank: pair},
                   {src_rank: way} if read is not None else {}, groups=sizes)

    @classmethod
    def for_hold(cls, plan: TransferPlan, block_ids: np.ndarray, *, chunk_bytes: int | Mapping[int, int],
                 pairs: Mapping[int, PairPlan] | None = None,
                 dst_ids: np.ndarray | None = None) -> RequestPlan:
        """The request a source guesses before any pull (eager packs): every held block, in
        order, each position its own tile. With ``pairs`` each payload's way is guessed by the
        same choice a fetch makes (:meth:`PairPlan.choose_way`, the destination's cost model),
        over ``dst_ids``, the destination blocks the hold is for when known; unknown (``None``),
        the destination's ids are taken to run as ours do (our ids stand in for them: a wrong
        guess costs one declined offer). :attr:`guessed` is set. Only for plans of equal block
        sizes and one KV cache group (:class:`PlanError` otherwise: a token map's tiles depend on the
        destination's ids; grouped holds are not packed ahead, yet)."""
        if plan.maps_tokens:
            raise PlanError("a token-mapped request cannot be planned before the destination's ids are known")
        if plan.groups > 1:
            raise PlanError("a request of several KV cache groups is not planned before its pull (yet)")
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        guess = ids if dst_ids is None else np.asarray(dst_ids, dtype=np.int64).reshape(-1)
        rp = cls._make(plan, ids, None, None, (int(ids.size),),
                       lambda read, g: read.chunk_geometry(g, _caps(chunk_bytes, read.src_rank)),
                       pairs or {}, guessed=True)
        if pairs is not None:
            runs = RunCounts(ids, guess)
            object.__setattr__(rp, "ways", rp._choose(
                lambda r, p: pairs[r].choose_way(ids, guess, chunks=p.chunks.count, runs=runs)))
        return rp

    @classmethod
    def _make(cls, plan: TransferPlan, src: np.ndarray, dst: np.ndarray | None, tokens: TokenMap | None,
              groups: tuple[int, ...], fit: Callable[[Payload, tuple[int, ...]], ChunkGeometry],
              pairs: Mapping[int, PairPlan], guessed: bool = False,
              fitted: MutableMapping[tuple[int, ...], Mapping[int, RequestPayload]] | None = None) -> RequestPlan:
        unfit: dict[int, StagingError] = {}
        payloads = fitted.get(groups) if fitted is not None else None
        if payloads is None:
            made: dict[int, RequestPayload] = {}
            for read in plan.staged:
                try:
                    made[read.src_rank] = RequestPayload(read, fit(read, groups))
                except StagingError as e:
                    unfit[read.src_rank] = e
            if fitted is not None and not unfit:
                if len(fitted) >= _MAX_FITTED:  # request sizes repeat; bound them anyway
                    fitted.clear()
                fitted[groups] = made
            payloads = made
        return cls(plan, src, dst, tokens, sum(groups), payloads, unfit, pairs, {}, guessed, groups)

    def _choose(self, choose: Callable[[int, RequestPayload], Way]) -> dict[int, Way]:
        """Per source rank whose payload fits and whose pair is known, ``choose(rank, payload)``."""
        return {r: choose(r, p) for r, p in self.payloads.items() if r in self.pairs}

    def way(self, src_rank: int) -> Way:
        """How ``src_rank``'s payload travels for this request (STAGED when not chosen)."""
        return self.ways.get(src_rank, Way.STAGED)

    # ------------------------------------------------------------------ what it moves
    @property
    def digest(self) -> str:
        """The plan's digest (every pull, push and offer carries it)."""
        return self.plan.digest()

    @functools.cached_property
    def ids_digest(self) -> str:
        """The digest of :attr:`src_ids` an offer of this request carries."""
        return ids_digest(self.src_ids)

    @functools.cached_property
    def group_bounds(self) -> tuple[int, ...] | None:
        """Several KV cache groups: group ``g``'s positions are ``[b[g], b[g + 1])`` of the
        concatenated ids; ``None`` for one group (every position)."""
        if len(self.groups) <= 1:
            return None
        return (0, *itertools.accumulate(self.groups))

    def wire_groups(self) -> dict:
        """The group sizes of a pull or push (``groups``); {} for one group (the wire as before)."""
        return {"groups": self.groups} if len(self.groups) > 1 else {}

    @functools.cached_property
    def direct_ranks(self) -> frozenset[int]:
        """Source ranks sending DIRECT runs for this request (none when it moves nothing)."""
        return frozenset(self.plan.direct_ranks(self.groups if len(self.groups) > 1 else self.num_tiles))

    @functools.cached_property
    def source_ranks(self) -> tuple[int, ...]:
        """Every source rank this request reads from (staged payload and/or DIRECT runs), sorted."""
        return tuple(sorted({s.src_rank for s in self.plan.staged} | self.direct_ranks))

    def sends_runs(self, src_rank: int) -> bool:
        """Whether ``src_rank`` sends DIRECT runs for this request."""
        return src_rank in self.direct_ranks

    def payload(self, src_rank: int) -> RequestPayload | None:
        """``src_rank``'s staged payload, None when it sends none; raises the
        :class:`StagingError` of a payload that does not fit its chunk cap."""
        if src_rank in self.unfit:
            raise self.unfit[src_rank]
        return self.payloads.get(src_rank)

    def wire_tokens(self) -> dict:
        """The token map's fields of a pull or push (``tokens``, ``tiles``); {} without one."""
        if self.tokens is None:
            return {}
        return {"tokens": self.tokens.num_tokens, "tiles": tuple(self.tokens.tiles.tolist())}

    def offer_terms(self, src_rank: int) -> OfferTerms | None:
        """The terms of an offer of ``src_rank``'s packed payload for exactly this request;
        None when it has no payload that fits, or the request maps tokens (never offered)."""
        p = self.payloads.get(src_rank)
        if p is None or self.tokens is not None:
            return None
        return OfferTerms(self.digest, self.ids_digest, p.chunks.num_blocks, p.chunks.blocks_per_chunk,
                          int(self.sends_runs(src_rank)))

    def cache_offer_terms(self) -> OfferTerms:
        """The terms of a read_unpack offer (READ the source's cache blocks) of this request:
        no chunks (``chunk_blocks`` 1) and no DIRECT runs claimed (made once: every source rank's
        offer is checked against them, twice)."""
        return self._cache_terms

    @functools.cached_property
    def _cache_terms(self) -> OfferTerms:
        return OfferTerms(self.digest, self.ids_digest, int(self.src_ids.size), 1, 0)


def _block_sizes(plan: TransferPlan) -> tuple[int, int]:
    """A token-mapping plan's (source, destination) block sizes (a plan maps tokens only when
    both engines page every region with one block size each)."""
    bs, bd = plan.src_block_size, plan.dst_block_size
    if bs is None or bd is None:
        raise PlanError("the plan maps tokens but does not know both engines' block sizes")
    return bs, bd
