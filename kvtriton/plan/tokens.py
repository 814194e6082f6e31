"""Token maps: a request between engines whose block sizes differ, mapped token by token.

Pure (numpy). Source position ``j`` holds tokens ``[j*Bs, (j+1)*Bs)``, destination position ``k``
tokens ``[k*Bd, (k+1)*Bd)``; the staged payload carries one tile per moved destination position
(see :mod:`kvtriton.plan.types` for the wire format). :func:`compact_tokens` checks a request's
ids on the destination and builds its :class:`TokenMap`; :meth:`TokenMap.for_source` rebuilds the
same map on the source from what the destination sends (tiles, token count, the source ids read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from .ids import check_distinct, check_ids
from .types import ceil_div

__all__ = ["TokenMap", "compact_tokens", "source_positions"]


@dataclass(frozen=True)
class TokenMap:
    """A request between engines with different block sizes, mapped token by token.

    ``src_ids[j]`` is the source block of tokens ``[j*Bs, (j+1)*Bs)`` (-1: not read),
    ``dst_ids[k]`` the destination block of tokens ``[k*Bd, (k+1)*Bd)`` (-1: not written), for
    the ``ceil(num_tokens / B)`` positions of each side; ``tiles`` are the destination positions
    that move, ascending: staged tile ``i`` is destination position ``tiles[i]``. Tokens at or
    past ``num_tokens`` are never read nor written. On the source side ``dst_ids`` is ``None``
    (it learns only the tiles, see :meth:`for_source`).
    """

    src_block_size: int
    dst_block_size: int
    num_tokens: int
    src_ids: np.ndarray
    dst_ids: np.ndarray | None
    tiles: np.ndarray

    @property
    def num_tiles(self) -> int:
        return int(self.tiles.size)

    @property
    def read_ids(self) -> np.ndarray:
        """Source block ids that are read, in position order (what the wire carries)."""
        return self.src_ids[self.src_ids >= 0]

    @property
    def tile_dst_ids(self) -> np.ndarray:
        """Destination block of each staged tile (the destination's map only)."""
        if self.dst_ids is None:
            raise PlanError("a source-side token map has no destination ids (see TokenMap.for_source)")
        return self.dst_ids[self.tiles]

    @classmethod
    def for_source(cls, tiles: Sequence[int], read_ids: Sequence[int] | np.ndarray, num_tokens: int,
                   src_block_size: int, dst_block_size: int, max_src_positions: int) -> TokenMap:
        """The source side's map, rebuilt from what a destination sends: the tiles, the token
        count and the source ids of :func:`source_positions` (in order). :class:`PlanError` when
        they do not fit together or reach past ``max_src_positions`` source blocks (the held
        request's length; a peer's message is untrusted, and sizes what is allocated here)."""
        tiles_a = np.asarray(tiles, dtype=np.int64).reshape(-1)
        read = np.asarray(read_ids, dtype=np.int64).reshape(-1)
        if num_tokens < 1 or tiles_a.size == 0:
            raise PlanError(f"a token-mapped request needs num_tokens >= 1 and tiles; got {num_tokens} "
                            f"tokens, {tiles_a.size} tiles")
        if (tiles_a < 0).any() or (np.diff(tiles_a) <= 0).any() or int(tiles_a[-1]) * dst_block_size >= num_tokens:
            raise PlanError(f"tiles must be ascending destination positions below ceil({num_tokens} / "
                            f"{dst_block_size}); got {tiles_a[:8].tolist()}...")
        # tokens past the last tile are never read: only they may reach past the held blocks
        num_tokens = min(int(num_tokens), (int(tiles_a[-1]) + 1) * dst_block_size)
        if ceil_div(num_tokens, src_block_size) > max_src_positions:
            raise PlanError(f"tiles up to position {int(tiles_a[-1])} of {dst_block_size} tokens reach source "
                            f"position {ceil_div(num_tokens, src_block_size) - 1}, past the {max_src_positions} "
                            "blocks held")
        pos = source_positions(tiles_a, num_tokens, src_block_size, dst_block_size)
        if read.size != pos.size or (read < 0).any():
            raise PlanError(f"{tiles_a.size} tiles of {dst_block_size} tokens read {pos.size} source blocks of "
                            f"{src_block_size}; got {read.size} source ids")
        src = np.full(ceil_div(num_tokens, src_block_size), -1, dtype=np.int64)
        src[pos] = read
        return cls(src_block_size, dst_block_size, num_tokens, src, None, tiles_a)


def source_positions(tiles: np.ndarray, num_tokens: int, src_block_size: int, dst_block_size: int) -> np.ndarray:
    """Source positions (ascending) holding the first ``num_tokens`` tokens of destination
    positions ``tiles``: tile ``k`` needs ``[k*Bd // Bs, ceil(min((k+1)*Bd, T) / Bs))``.

    >>> source_positions(np.array([1, 2]), 40, 16, 12).tolist()   # tokens 12..35
    [0, 1, 2]
    """
    n_src = ceil_div(num_tokens, src_block_size)
    tiles = np.asarray(tiles, dtype=np.int64)
    if tiles.size == 0:
        return np.zeros(0, dtype=np.int64)
    lo = tiles * dst_block_size // src_block_size
    hi = -(-np.minimum((tiles + 1) * dst_block_size, num_tokens) // src_block_size)  # ceil_div, elementwise
    cover = np.zeros(n_src + 1, dtype=np.int64)
    np.add.at(cover, lo, 1)
    np.add.at(cover, hi, -1)
    return np.flatnonzero(np.cumsum(cover)[:n_src] > 0).astype(np.int64)


def compact_tokens(
    src_block_ids: Sequence[int] | np.ndarray,
    dst_block_ids: Sequence[int] | np.ndarray,
    src_num_blocks: int,
    dst_num_blocks: int,
    src_block_size: int,
    dst_block_size: int,
    num_tokens: int | None = None,
) -> TokenMap:
    """Check and map a request between engines with different block sizes ``Bs`` and ``Bd``.

    The id contract: source position ``j`` holds tokens ``[j*Bs, (j+1)*Bs)``, destination
    position ``k`` tokens ``[k*Bd, (k+1)*Bd)``, of a request of ``num_tokens`` tokens (default:
    as many as both id lists cover, ``min(len(src)*Bs, len(dst)*Bd)``); ids past
    ``ceil(num_tokens / B)`` are ignored. A destination -1 skips that block's tokens (the
    destination has them, e.g. a prefix-cache hit; a -1 prefix may end anywhere, even inside a
    source block). A source -1 means the source does not hold those tokens: allowed only where
    no wanted destination block needs them (e.g. a source -1 prefix must lie inside the
    destination's -1 prefix, in whole tokens). Only tokens below ``num_tokens`` move.

    Raises :class:`PlanError` on ids out of ``[-1, num_blocks)``, too few ids for
    ``num_tokens``, repeated destination ids, or a wanted destination block that needs a
    source block given as -1 (naming both positions).

    >>> m = compact_tokens([7, 8, 9], [-1, 4], 16, 16, 16, 24, num_tokens=40)
    >>> m.tiles.tolist(), m.src_ids.tolist(), m.tile_dst_ids.tolist()
    ([1], [-1, 8, 9], [4])
    """
    if min(src_block_size, dst_block_size) < 1:
        raise PlanError(f"block sizes must be >= 1; got source {src_block_size}, destination {dst_block_size}")
    src, dst = check_ids(src_block_ids, dst_block_ids, src_num_blocks, dst_num_blocks)
    cover = min(src.size * src_block_size, dst.size * dst_block_size)
    if num_tokens is None:
        num_tokens = cover
    if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0 or num_tokens > cover:
        raise PlanError(
            f"num_tokens={num_tokens!r} does not fit the ids: {src.size} source blocks of {src_block_size} "
            f"and {dst.size} destination blocks of {dst_block_size} cover {cover} tokens"
        )
    num_tokens = int(num_tokens)
    src = src[:ceil_div(num_tokens, src_block_size)]
    dst = dst[:ceil_div(num_tokens, dst_block_size)]
    tiles = np.flatnonzero(dst >= 0).astype(np.int64)
    check_distinct(dst[tiles], dst_num_blocks)
    needed = np.zeros(src.size, dtype=bool)
    needed[source_positions(tiles, num_tokens, src_block_size, dst_block_size)] = True
    missing = needed & (src < 0)
    if missing.any():
        j = int(np.argmax(missing))
        k = int(tiles[np.argmax((tiles * dst_block_size < (j + 1) * src_block_size)
                                & ((tiles + 1) * dst_block_size > j * src_block_size))])
        raise PlanError(
            f"destination block at position {k} (tokens [{k * dst_block_size}, {(k + 1) * dst_block_size})) "
            f"needs source position {j} (tokens [{j * src_block_size}, {(j + 1) * src_block_size})), which is "
            "-1: a source -1 must only cover tokens no wanted destination block holds"
        )
    return TokenMap(src_block_size, dst_block_size, num_tokens, np.where(needed, src, -1), dst, tiles)
