"""The per-request plan: what one request between two ranks moves, made once (pure: numpy and
the standard library, over :mod:`kvtriton.plan` and :mod:`kvtriton.token_map`).

A :class:`~kvtriton.plan.TransferPlan` is made once per (destination rank, source engine); a
request adds block ids. Before this module each role derived the rest itself (compacted ids or
the token map, the source ranks sending DIRECT runs, each staged payload's chunk geometry, the
digests an offer carries). A :class:`RequestPlan` holds all of it, for the three places that
need it:

* the destination, at ``fetch()``: :meth:`RequestPlan.for_fetch` checks and compacts the ids
  (or maps tokens), fits each payload to the chunk cap of its source rank;
* the source, when a pull or push arrives: :meth:`RequestPlan.for_serve` rebuilds the same
  request from what the destination sent (ids, tiles, token count, blocks per chunk), so the
  source checks the pull against it;
* the source's eager packs, before any pull: :meth:`RequestPlan.for_hold` assumes the
  destination asks every held block in order (what it packs ahead and offers).

Both sides of an offer describe it with :class:`OfferTerms`: the source sends the terms of
its pack, the destination compares them with the terms of its own request.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvtriton.errors import PlanError, StagingError
from kvtriton.plan import ChunkGeometry, StagedRead, TransferPlan, compact_request
from kvtriton.token_map import TokenMap, compact_tokens

__all__ = ["OfferTerms", "RequestPayload", "RequestPlan", "ids_digest"]


def ids_digest(ids: np.ndarray) -> str:
    """What an offer says about the block ids it packed (both sides hash int64 ids alike)."""
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int64).tobytes(), digest_size=12).hexdigest()


class OfferTerms(NamedTuple):
    """What an offer (:class:`~kvtriton.wire.Offer`) claims, besides its slots: the plan's
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

    read: StagedRead
    chunks: ChunkGeometry

    @property
    def src_rank(self) -> int:
        return self.read.src_rank

    @property
    def nbytes(self) -> int:
        """Bytes of the whole payload (every chunk)."""
        return self.read.payload_bytes(self.chunks.num_blocks)

    def refit(self, chunk_bytes: int) -> RequestPayload:
        """The same payload in the widest chunks of at most ``chunk_bytes`` (StagingError when
        one tile does not fit)."""
        return RequestPayload(self.read, ChunkGeometry.fit(self.read.bytes_per_block, self.chunks.num_blocks,
                                                           chunk_bytes))

    def segment_offsets(self, chunk: int, base: int = 0) -> np.ndarray:
        """Byte offset of each segment's first tile inside chunk ``chunk`` placed at ``base``."""
        lo, hi = self.chunks.bounds(chunk)
        return self.read.segment_offsets(hi - lo, base=base)


def _caps(chunk_bytes: int | Mapping[int, int], rank: int) -> int:
    return chunk_bytes if isinstance(chunk_bytes, int) else chunk_bytes[rank]


@dataclass(frozen=True, eq=False)
class RequestPlan:
    """Everything one request between a destination rank and a source engine moves.

    ``src_ids``: the source block ids read, in order (what the wire carries; with a token map,
    :attr:`TokenMap.read_ids`). ``dst_ids``: the destination block of each staged tile and
    DIRECT position (``None`` on the source, which never learns them). ``tokens``: the token
    map when the engines' block sizes differ, else None. ``num_tiles``: staged tiles (and
    DIRECT positions) per source rank. ``payloads``: per source rank with a staged payload that
    fits its chunk cap; ``unfit``: per source rank whose payload does not fit, the reason.
    Make one with :meth:`for_fetch`, :meth:`for_serve` or :meth:`for_hold`."""

    plan: TransferPlan
    src_ids: np.ndarray
    dst_ids: np.ndarray | None
    tokens: TokenMap | None
    num_tiles: int
    payloads: Mapping[int, RequestPayload]
    unfit: Mapping[int, StagingError]

    # ------------------------------------------------------------------ makers
    @classmethod
    def for_fetch(cls, plan: TransferPlan, src_block_ids: Sequence[int] | np.ndarray,
                  dst_block_ids: Sequence[int] | np.ndarray, *, src_num_blocks: int, dst_num_blocks: int,
                  chunk_bytes: int | Mapping[int, int], num_tokens: int | None = None) -> RequestPlan:
        """The destination's request: ids checked and compacted (-1 on either side drops the
        position), or mapped token by token when the block sizes differ; each staged payload
        fitted to ``chunk_bytes`` (one cap, or one per source rank: the smaller of both sides'
        staging chunks). Raises :class:`PlanError` on bad ids; a payload that does not fit is
        kept in :attr:`unfit` (the request fails when that rank's payload is asked for)."""
        tokens = None
        if plan.maps_tokens:
            tokens = compact_tokens(src_block_ids, dst_block_ids, src_num_blocks, dst_num_blocks,
                                    plan.src_block_size, plan.dst_block_size, num_tokens)
            src, dst = tokens.read_ids, tokens.tile_dst_ids
        else:
            src, dst = compact_request(src_block_ids, dst_block_ids, src_num_blocks, dst_num_blocks)
        return cls._make(plan, src, dst, tokens, int(dst.size),
                         lambda read, n: ChunkGeometry.fit(read.bytes_per_block, n, _caps(chunk_bytes, read.src_rank)))

    @classmethod
    def for_serve(cls, plan: TransferPlan, src_rank: int, read_ids: Sequence[int] | np.ndarray, *,
                  held_blocks: int, chunk_blocks: int, num_tokens: int = 0,
                  tiles: Sequence[int] = ()) -> RequestPlan:
        """The source's view of a request a destination asked for: ``read_ids`` (the source ids
        it sent), and with a token map its ``tiles`` and ``num_tokens`` (checked against the
        ``held_blocks`` of the hold: :class:`PlanError` when they do not fit). The payload of
        ``src_rank`` is cut in the ``chunk_blocks`` the destination asked (checking them against
        this side's staging is :meth:`ChunkGeometry.fits`). A token count or tiles sent for a
        plan of equal block sizes is the caller's to refuse (they are ignored here)."""
        ids = np.asarray(read_ids, dtype=np.int64).reshape(-1)
        tokens = None
        n = int(ids.size)
        if plan.maps_tokens:
            tokens = TokenMap.for_source(tiles, ids, num_tokens, plan.src_block_size, plan.dst_block_size,
                                         held_blocks)
            n = tokens.num_tiles
        payloads = {}
        read = plan.staged_read(src_rank)
        if read is not None:
            payloads[src_rank] = RequestPayload(read, ChunkGeometry(read.bytes_per_block, n, chunk_blocks))
        return cls(plan, ids, None, tokens, n, payloads, {})

    @classmethod
    def for_hold(cls, plan: TransferPlan, block_ids: np.ndarray, *,
                 chunk_bytes: int | Mapping[int, int]) -> RequestPlan:
        """The request a source guesses before any pull (eager packs): every held block, in
        order, each position its own tile (the destination's ids are not known). Only for
        plans of equal block sizes (:class:`PlanError` otherwise: a token map's tiles depend on
        the destination's ids)."""
        if plan.maps_tokens:
            raise PlanError("a token-mapped request cannot be planned before the destination's ids are known")
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        return cls._make(plan, ids, None, None, int(ids.size),
                         lambda read, n: ChunkGeometry.fit(read.bytes_per_block, n, _caps(chunk_bytes, read.src_rank)))

    @classmethod
    def _make(cls, plan: TransferPlan, src: np.ndarray, dst: np.ndarray | None, tokens: TokenMap | None, n: int,
              fit) -> RequestPlan:
        payloads: dict[int, RequestPayload] = {}
        unfit: dict[int, StagingError] = {}
        for read in plan.staged:
            try:
                payloads[read.src_rank] = RequestPayload(read, fit(read, n))
            except StagingError as e:
                unfit[read.src_rank] = e
        return cls(plan, src, dst, tokens, n, payloads, unfit)

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
    def direct_ranks(self) -> frozenset[int]:
        """Source ranks sending DIRECT runs for this request (none when it moves nothing)."""
        return frozenset(self.plan.direct_ranks(self.num_tiles))

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
        no chunks (``chunk_blocks`` 1) and no DIRECT runs claimed."""
        return OfferTerms(self.digest, self.ids_digest, int(self.src_ids.size), 1, 0)
