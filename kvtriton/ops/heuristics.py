"""Launch heuristics of the pack/unpack kernels: word width, vector length and tile shape.

Everything here is a pure function of the geometry (no autotuning: a launch is deterministic, and
the interpreter cannot autotune), so :mod:`kvtriton.ops.launch` calls it per launch and the tests and
the benchmark call it directly.

Every dtype moves as integers of one *word* width (:data:`INT_OF_WIDTH`), the widest the
alignment of every address, stride, offset and row length of the launch allows; with 16-byte
alignment a thread moves two 8-byte words per access (``vec = 2``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import LaunchError
from ..plan import ceil_div

__all__ = ["INT_OF_WIDTH", "LaunchConfig", "alignment", "launch_config", "tile_config", "word_config"]

# The integer dtype of each word width: kernels, the reference and the benchmark move bits as these.
INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

MAX_ACCESS_BYTES = 16  # widest per-thread access (LDG.128 / STG.128)
TILE_BYTES = 8192  # bytes one program moves per inner iteration: 4 warps x 32 lanes x 4 x 16 B
MAX_BLOCK_W_BYTES = 1024  # widest inner row chunk; longer rows loop (576-dim bf16 MLA rows: 1152 B)
ITER_OVERHEAD_WORDS = 16  # cost of one more inner-loop trip, in lanes (address math, loop, mask)
BYTES_PER_WARP = 2048  # tile bytes per warp: 32 lanes x 4 accesses of 16 B in flight


class LaunchConfig(NamedTuple):
    """Constexpr geometry of one launch (see :func:`launch_config`)."""

    word_bytes: int  # every dtype is moved as integers of this width
    vec: int  # row starts/lengths are multiples of this many words (vec * word_bytes <= 16)
    align: int  # cache base addresses are multiples of this many bytes
    block_r: int  # rows per inner tile
    block_w: int  # words per inner tile row
    num_warps: int


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def alignment(lowbits: int) -> int:
    """The common byte alignment (a power of two, at most 16) of integers whose bitwise OR is
    ``lowbits``: addresses, strides, offsets and row lengths in bytes."""
    lowbits = int(lowbits)
    return MAX_ACCESS_BYTES if lowbits == 0 else min(MAX_ACCESS_BYTES, lowbits & -lowbits)


def word_config(align: int) -> tuple[int, int]:
    """Word width and vector length (in words) for a common byte alignment ``align``.

    8-byte words whenever everything is 8-byte aligned (fewest lanes, fewest address
    computations); otherwise the widest integer the alignment allows. Two words per access when
    the alignment reaches 16 bytes.
    """
    align = max(1, min(int(align), MAX_ACCESS_BYTES))
    word = min(align, 8)
    return word, align // word


def tile_config(max_rows: int, max_row_words: int, word_bytes: int, vec: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_W, num_warps)`` for tiles of up to ``max_rows`` rows of up to
    ``max_row_words`` words (``word_bytes`` each; rows are multiples of ``vec`` words).

    ``BLOCK_W`` (a power of two, at least ``vec``, at most 1 KiB of words) minimises the cost of
    one row, counted as ``iterations * (BLOCK_W + ITER_OVERHEAD_WORDS)``: a masked lane is
    cheaper than another trip through the loop, but not free. head_dim 128 bf16 rows
    (32 int64 words) take 32; 80-dim bf16 rows (20 words) take 32 with 12 masked lanes rather
    than 5 trips of 4; 576-dim bf16 MLA rows (144 words) take 3 trips of 64. ``BLOCK_R`` fills
    ~8 KiB per inner iteration without exceeding the tile's rows; one warp per 2 KiB of tile
    (each lane keeps four 16-byte accesses in flight), 1 to 8 warps.
    """
    if max_rows < 1 or max_row_words < 1 or word_bytes not in INT_OF_WIDTH or vec < 1:
        raise LaunchError(
            f"tile_config: need max_rows, max_row_words, vec >= 1 and word_bytes in 1/2/4/8; "
            f"got {max_rows}, {max_row_words}, {vec}, {word_bytes}"
        )
    rw = int(max_row_words)
    widest = max(vec, min(_next_pow2(rw), MAX_BLOCK_W_BYTES // word_bytes))
    best = (ceil_div(rw, widest) * (widest + ITER_OVERHEAD_WORDS), widest)  # (cost, BLOCK_W)
    bw = widest // 2
    while bw >= vec:
        cost = ceil_div(rw, bw) * (bw + ITER_OVERHEAD_WORDS)
        if cost < best[0]:
            best = (cost, bw)
        bw //= 2
    block_w = best[1]
    block_r = max(1, min(_next_pow2(max_rows), TILE_BYTES // (block_w * word_bytes)))
    num_warps = max(1, min(8, block_r * block_w * word_bytes // BYTES_PER_WARP))
    return block_r, block_w, num_warps


def launch_config(lowbits: int, max_rows: int, max_row_bytes: int) -> LaunchConfig:
    """The whole constexpr geometry of a launch whose addresses, strides, offsets and row lengths
    (bytes) OR to ``lowbits``, with tiles of up to ``max_rows`` rows of up to ``max_row_bytes``."""
    align = alignment(lowbits)
    word, vec = word_config(align)
    return LaunchConfig(word, vec, align, *tile_config(max_rows, max_row_bytes // word, word, vec))
