"""Pack: gather the head slices of a request's blocks from a paged KV cache into staging.

One launch covers a whole request on one source rank: every staged (region, stream) segment,
for every destination rank being served (the segment list is the concatenation of the
destinations' segment lists, each with its own staging offset), and every block.

Grid ``(n_blocks, n_segments)``; program ``(j, s)`` copies one tile::

    blk = block_ids[j]                        # -1: padding, the program returns
    for every row r < block_size * num_heads of segment s, every word w < row_words:
        staging[stg_off + j * stg_s_tile + tok(r) * stg_s_tok + head(r) * stg_s_head + w]
            = cache_s[blk * c_blk + tok(r) * c_tok + head(r) * c_head + w]

with ``tok(r) = r // num_heads``, ``head(r) = r % num_heads`` (see ``_addressing``). The source
layout is in the cache strides and the destination layout (NHD or HND, independent of the
source's) in the staging strides, so the kernel holds no layout logic. Rows are copied
``BLOCK_R`` at a time as ``[BLOCK_R, BLOCK_W]`` word tiles; every row start is a multiple of
``VEC`` words and every cache address of ``ALIGN`` bytes (the launcher checks both), which
lets the compiler emit ``VEC * WORD_BYTES``-byte (16-byte where possible) accesses.
"""

import triton
import triton.language as tl

from ._addressing import _load_segment, _row_offsets


@triton.jit
def _pack_kernel(
    staging_ptr,  # [staging_words] int8/16/32/64 words: the payloads, tiles in the dst layout
    seg_ptr,  # [n_segments, NUM_FIELDS] int64: per-segment addresses and strides (_addressing)
    block_ids_ptr,  # [n_blocks] int32/int64: source block of request position j, -1 = skip
    NUM_FIELDS: tl.constexpr,  # columns of the segment table
    BLOCK_R: tl.constexpr,  # rows per inner tile (power of two)
    BLOCK_W: tl.constexpr,  # words per inner tile row (power of two)
    VEC: tl.constexpr,  # every row start and row length is a multiple of VEC words
    ALIGN: tl.constexpr,  # every cache base address is a multiple of ALIGN bytes
):
    j = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    blk = tl.load(block_ids_ptr + j).to(tl.int64)
    if blk < 0:  # padding position: nothing to gather, staging bytes are left as they were
        return
    (cache_addr, c_blk, c_tok, c_head, stg_off, t_tile, t_tok, t_head, num_heads, block_size,
     row_words) = _load_segment(seg_ptr, s, NUM_FIELDS)
    # Hint the pointer, not the integer: a hint on the int64 does not survive the cast (checked
    # in the sm_90 PTX: 8-byte instead of 16-byte cache accesses).
    cache_ptr = tl.multiple_of(cache_addr.to(staging_ptr.dtype), ALIGN)
    row_words = tl.multiple_of(row_words, VEC)  # without it the column mask blocks vectorisation
    n_rows = (block_size * num_heads).to(tl.int32)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_W), BLOCK_W), BLOCK_W)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        src = tl.multiple_of(_row_offsets(blk, rows, num_heads, c_blk, c_tok, c_head), VEC)
        dst = stg_off + _row_offsets(j, rows, num_heads, t_tile, t_tok, t_head)
        dst = tl.multiple_of(dst, VEC)
        for w0 in range(0, row_words, BLOCK_W):
            w = w0 + cols
            mask = row_ok[:, None] & (w < row_words)[None, :]
            words = tl.load(cache_ptr + src[:, None] + w[None, :], mask=mask)
            tl.store(staging_ptr + dst[:, None] + w[None, :], words, mask=mask)
