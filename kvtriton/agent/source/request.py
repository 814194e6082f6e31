"""What one source rank sends one destination rank for one request: the per-request part of
the plan, made in one place for a pull, a push and a pack made ahead alike.

(The destination makes its own side of it; at merge both become one pure ``RequestPlan`` in
:mod:`kvtriton.plan`, and this function its source half.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ...errors import PlanError
from ...plan import ChunkGeometry, Payload, TokenMap, TransferPlan

__all__ = ["SourceRequest", "ids_digest", "request_plan"]


def ids_digest(ids: np.ndarray) -> str:
    """What an offer says about the block ids it packed (both sides hash int64 ids alike)."""
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int64).tobytes(), digest_size=12).hexdigest()


@dataclass(frozen=True, eq=False)
class SourceRequest:
    """One request from this rank to one destination rank, by one plan."""

    ids: np.ndarray  # the request's positions in this engine's blocks (held block ids, in order)
    tokens: TokenMap | None  # block sizes differ: the token map (its tiles are the staged positions)
    read: Payload | None  # this rank's staged payload to the destination (None: it sends none)
    runs: bool  # the plan reads DIRECT runs of these positions from this rank
    chunks: ChunkGeometry | None  # how the payload is cut into staging chunks (None: no payload)

    @property
    def positions(self) -> int:
        """Staged tiles (and DIRECT positions) of the request."""
        return self.tokens.num_tiles if self.tokens is not None else int(self.ids.size)

    @property
    def empty(self) -> bool:
        """This rank sends the destination nothing for it."""
        return self.read is None and not self.runs

    def digest(self) -> str:
        """:func:`ids_digest` of the positions (what an offer names)."""
        return ids_digest(self.ids)


def request_plan(plan: TransferPlan, rank: int, ids: np.ndarray, *, chunk_blocks: int | None = None,
                 chunk_bytes: int | None = None, tiles=(), num_tokens: int = 0, held: int = 0) -> SourceRequest:
    """The request of positions ``ids`` (this engine's block ids) from source rank ``rank`` under
    ``plan``: the token map when the engines' block sizes differ (``tiles``, ``num_tokens``: what
    the destination sent; ``held``: blocks of the hold), the payload this rank stages, whether it
    also sends DIRECT runs, and its chunks: of ``chunk_blocks`` blocks (what a pull names; the
    caller checks they fit its staging) or the widest that fit ``chunk_bytes`` (a pack made ahead
    guesses the destination's: the smaller of both sides' chunk sizes).

    Raises :class:`PlanError` for a token map that does not fit the hold or tiles sent with
    equal block sizes, :class:`~kvtriton.errors.StagingError` when one block does not fit
    ``chunk_bytes``."""
    ids = np.asarray(ids, dtype=np.int64)
    tokens = None
    if plan.maps_tokens:
        tokens = TokenMap.for_source(tiles, ids, num_tokens, plan.src_block_size, plan.dst_block_size, held)
    elif tiles or num_tokens:
        raise PlanError("tiles and a token count sent, but the engines' block sizes are equal")
    n = tokens.num_tiles if tokens is not None else int(ids.size)
    read = plan.payload(rank)
    chunks = None
    if read is not None and chunk_blocks is not None:
        chunks = ChunkGeometry(read.bytes_per_block, n, chunk_blocks)
    elif read is not None and chunk_bytes is not None:
        chunks = ChunkGeometry.fit(read.bytes_per_block, n, chunk_bytes)
    return SourceRequest(ids, tokens, read, rank in plan.direct_ranks(n), chunks)
