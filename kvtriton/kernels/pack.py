"""Pack: gather the head slices of a request's blocks from a paged KV cache into staging.

One launch covers a whole request on one source rank: every staged (region, stream) segment,
for every destination rank being served (the segment list is the concatenation of the
destinations' segment lists, each with its own staging offset), and every block. Grid
``(n_blocks, n_segments)``; the copy itself is ``_copy._copy_tile`` in the cache -> staging
direction. A kernel of its own (not a shared one with a direction argument) so that profiles
name the op.
"""

import triton
import triton.language as tl

from ._copy import _copy_tile


@triton.jit
def _pack_kernel(
    staging_ptr,  # [staging_words] int8/16/32/64 words: written, tiles in the destination's layout
    seg_ptr,  # [n_segments, segment_table.NUM_FIELDS] int64: per-segment addresses and strides
    block_ids_ptr,  # [n_blocks] int32/int64: source block of request position j, -1 = skip
    tiles_ptr,  # TOKEN_MAP: [n_tiles] int64 destination position of tile j (else unused)
    num_tokens,  # TOKEN_MAP: the request's tokens; rows at or past it are not copied
    TOKEN_MAP: tl.constexpr,  # True: block sizes differ, the cache block is looked up per row
    BLOCK_R: tl.constexpr,  # rows per inner tile (power of two)
    BLOCK_W: tl.constexpr,  # words per inner tile row (power of two)
    VEC: tl.constexpr,  # every row start and row length is a multiple of VEC words
    ALIGN: tl.constexpr,  # every cache base address is a multiple of ALIGN bytes
):
    _copy_tile(staging_ptr, seg_ptr, block_ids_ptr, tiles_ptr, num_tokens, True, TOKEN_MAP,
               BLOCK_R, BLOCK_W, VEC, ALIGN)
