"""Unpack: scatter staged tiles into the local paged KV cache (the inverse of ``pack``).

One launch covers every staged segment of a request on one destination rank, including
segments from several source ranks (D < P: each source's head slice lands at its own head
offset inside the same local block, each read from its own staging offset). Grid
``(n_blocks, n_segments)``; the copy itself is ``_copy._copy_tile`` in the staging -> cache
direction. Two programs never write the same cache word as long as block ids do not repeat and
head slices of one (region, stream) do not overlap (the launcher checks both).
"""

import triton
import triton.language as tl

from ._copy import _copy_tile


@triton.jit
def _unpack_kernel(
    staging_ptr,  # [staging_words] int8/16/32/64 words: read, tiles in the local layout
    seg_ptr,  # [n_segments, segment_table.NUM_FIELDS] int64: per-segment addresses and strides
    block_ids_ptr,  # [n_blocks] int32/int64: local block of request position j, -1 = skip
    tiles_ptr,  # TOKEN_MAP: [n_tiles] int64 destination position of tile j (else unused)
    num_tokens,  # TOKEN_MAP: the request's tokens; rows at or past it are not copied
    TOKEN_MAP: tl.constexpr,  # True: block sizes differ, the cache block is looked up per row
    BLOCK_R: tl.constexpr,  # rows per inner tile (power of two)
    BLOCK_W: tl.constexpr,  # words per inner tile row (power of two)
    VEC: tl.constexpr,  # every row start and row length is a multiple of VEC words
    ALIGN: tl.constexpr,  # every cache base address is a multiple of ALIGN bytes
):
    _copy_tile(staging_ptr, seg_ptr, block_ids_ptr, tiles_ptr, num_tokens, False, TOKEN_MAP,
               BLOCK_R, BLOCK_W, VEC, ALIGN)
