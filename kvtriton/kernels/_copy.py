"""The one body of the pack and unpack kernels: copy one tile between the paged cache and staging.

Pack gathers ``cache -> staging`` and unpack scatters ``staging -> cache``; the address math of
both sides is the same (``_addressing``), only the direction differs, and it is a constexpr, so
each kernel compiles to a straight copy loop with no branch on it.

Program ``(j, s)`` copies tile ``j`` of segment ``s``::

    blk = block_ids[j]                        # -1: padding, the program copies nothing
    for every row r < block_size * num_heads of segment s, every word w < row_words:
        cache word   cache_addr + blk * c_blk + tok(r) * c_tok + head(r) * c_head + w
        staging word stg_off + j * stg_s_tile + tok(r) * stg_s_tok + head(r) * stg_s_head + w

with ``tok(r) = r // num_heads``, ``head(r) = r % num_heads``.

Token-mapped launches (``TOKEN_MAP``: the engines' block sizes differ) look the cache block up
per row instead: tile ``j`` is destination position ``k = tiles[j]``, so its token ``tok`` is
request token ``t = k * block_size + tok``, which lives in cache block ``block_ids[t // Bc]`` at
token ``t % Bc`` (``Bc``: the cache's block size, ``CACHE_BLOCK_SIZE``; ``block_ids`` indexed by
the cache's positions). Rows with ``t >= num_tokens`` or a -1 block are not copied. Pack thus
gathers one destination tile from one or several source blocks, and unpack (``Bc`` = the tile's
block size) writes the tile's tokens below ``num_tokens`` only. The cache layout is in the cache
strides and the staged layout (NHD or HND, independent of the cache's) in the staging strides, so
the kernels hold no layout logic. Rows are copied ``BLOCK_R`` at a time as ``[BLOCK_R, BLOCK_W]``
word tiles; every row start and row length is a multiple of ``VEC`` words and every cache address
of ``ALIGN`` bytes (the launcher checks both), which lets the compiler emit ``VEC * WORD_BYTES``-
byte (16-byte where possible) accesses on both sides.
"""

import triton
import triton.language as tl

from . import segment_table as col
from ._addressing import _row_offsets, _segment_row, _vec_multiple


@triton.jit
def _copy_tile(
    staging_ptr,  # [staging_words] int8/16/32/64 words: the payloads, tiles in the staged layout
    seg_ptr,  # [n_segments, segment_table.NUM_FIELDS] int64: per-segment addresses and strides
    block_ids_ptr,  # [n_blocks] int32/int64: cache block of request (token map: cache) position j, -1 = skip
    tiles_ptr,  # TOKEN_MAP: [n_tiles] int64 destination position of tile j (else unused)
    num_tokens,  # TOKEN_MAP: tokens of the request; rows at or past it are not copied (else unused)
    PACK: tl.constexpr,  # True: cache -> staging (pack); False: staging -> cache (unpack)
    TOKEN_MAP: tl.constexpr,  # True: the cache block is looked up per row (block sizes differ)
    BLOCK_R: tl.constexpr,  # rows per inner tile (power of two)
    BLOCK_W: tl.constexpr,  # words per inner tile row (power of two)
    VEC: tl.constexpr,  # every row start and row length is a multiple of VEC words
    ALIGN: tl.constexpr,  # every cache base address is a multiple of ALIGN bytes
):
    j = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    if TOKEN_MAP:
        _copy_mapped_tile(staging_ptr, seg_ptr, block_ids_ptr, tiles_ptr, num_tokens, j, s, PACK, BLOCK_R, BLOCK_W,
                          VEC, ALIGN)
    else:
        _copy_block_tile(staging_ptr, seg_ptr, block_ids_ptr, j, s, PACK, BLOCK_R, BLOCK_W, VEC, ALIGN)


@triton.jit
def _copy_block_tile(staging_ptr, seg_ptr, block_ids_ptr, j, s, PACK: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_W: tl.constexpr, VEC: tl.constexpr, ALIGN: tl.constexpr):
    """Tile ``j`` of segment ``s``: a whole cache block (equal block sizes)."""
    # The block id and the table row are independent loads, both issued before the branch on the
    # id: one memory round trip per tile instead of two dependent ones.
    blk = tl.load(block_ids_ptr + j).to(tl.int64)
    seg_row = _segment_row(seg_ptr, s)
    cache_addr = tl.load(seg_row + col.CACHE_ADDR)
    c_blk = tl.load(seg_row + col.CACHE_S_BLK)
    c_tok = tl.load(seg_row + col.CACHE_S_TOK)
    c_head = tl.load(seg_row + col.CACHE_S_HEAD)
    stg_off = tl.load(seg_row + col.STG_OFF)
    t_tile = tl.load(seg_row + col.STG_S_TILE)
    t_tok = tl.load(seg_row + col.STG_S_TOK)
    t_head = tl.load(seg_row + col.STG_S_HEAD)
    num_heads = tl.load(seg_row + col.NUM_HEADS)
    block_size = tl.load(seg_row + col.BLOCK_SIZE)
    row_words = tl.load(seg_row + col.ROW_WORDS)
    if blk >= 0:  # -1: a padding position; its staging bytes (pack) or cache (unpack) stay as they were
        # Hint the pointer, not the integer: a hint on the int64 does not survive the cast (checked
        # in the sm_90 PTX: 8-byte instead of 16-byte cache accesses).
        cache_ptr = tl.multiple_of(cache_addr.to(staging_ptr.dtype), ALIGN)
        stg_off = _vec_multiple(stg_off, VEC)
        row_words = _vec_multiple(row_words, VEC)  # a column mask of unknown divisibility blocks vectors
        n_rows = (block_size * num_heads).to(tl.int32)
        cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_W), BLOCK_W), BLOCK_W)
        for r0 in range(0, n_rows, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            row_ok = rows < n_rows
            in_cache = cache_ptr + _row_offsets(blk, rows, num_heads, c_blk, c_tok, c_head, VEC)
            in_staging = staging_ptr + stg_off + _row_offsets(j, rows, num_heads, t_tile, t_tok, t_head, VEC)
            _copy_rows(in_cache, in_staging, row_ok, row_words, cols, PACK, BLOCK_W)


@triton.jit
def _copy_mapped_tile(staging_ptr, seg_ptr, block_ids_ptr, tiles_ptr, num_tokens, j, s, PACK: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, VEC: tl.constexpr, ALIGN: tl.constexpr):
    """Tile ``j`` of segment ``s`` of a token-mapped launch (see the module docstring)."""
    k = tl.load(tiles_ptr + j).to(tl.int64)
    seg_row = _segment_row(seg_ptr, s)
    cache_addr = tl.load(seg_row + col.CACHE_ADDR)
    c_blk = _vec_multiple(tl.load(seg_row + col.CACHE_S_BLK).to(tl.int64), VEC)
    c_tok = _vec_multiple(tl.load(seg_row + col.CACHE_S_TOK).to(tl.int64), VEC)
    c_head = _vec_multiple(tl.load(seg_row + col.CACHE_S_HEAD).to(tl.int64), VEC)
    stg_off = _vec_multiple(tl.load(seg_row + col.STG_OFF), VEC)
    t_tile = tl.load(seg_row + col.STG_S_TILE)
    t_tok = tl.load(seg_row + col.STG_S_TOK)
    t_head = tl.load(seg_row + col.STG_S_HEAD)
    num_heads = tl.load(seg_row + col.NUM_HEADS)
    block_size = tl.load(seg_row + col.BLOCK_SIZE)
    row_words = _vec_multiple(tl.load(seg_row + col.ROW_WORDS), VEC)
    c_bs = tl.load(seg_row + col.CACHE_BLOCK_SIZE).to(tl.int64)
    cache_ptr = tl.multiple_of(cache_addr.to(staging_ptr.dtype), ALIGN)
    first = k * block_size.to(tl.int64)  # request token of the tile's first row
    n_rows = (block_size * num_heads).to(tl.int32)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_W), BLOCK_W), BLOCK_W)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        tok = rows // num_heads.to(tl.int32)
        head = rows - tok * num_heads.to(tl.int32)
        t = first + tok.to(tl.int64)
        row_ok = (rows < n_rows) & (t < num_tokens)
        pos = t // c_bs
        blk = tl.load(block_ids_ptr + pos, mask=row_ok, other=-1).to(tl.int64)
        row_ok = row_ok & (blk >= 0)
        in_cache = cache_ptr + (blk * c_blk + (t - pos * c_bs) * c_tok + head.to(tl.int64) * c_head)
        in_staging = staging_ptr + stg_off + _row_offsets(j, rows, num_heads, t_tile, t_tok, t_head, VEC)
        _copy_rows(in_cache, in_staging, row_ok, row_words, cols, PACK, BLOCK_W)


@triton.jit
def _copy_rows(in_cache, in_staging, row_ok, row_words, cols, PACK: tl.constexpr, BLOCK_W: tl.constexpr):
    """Copy ``[BLOCK_R]`` rows of ``row_words`` words between ``in_cache`` and ``in_staging`` (row
    start pointers), ``BLOCK_W`` words at a time; rows where ``row_ok`` is false are not touched."""
    if PACK:
        src, dst = in_cache, in_staging
    else:
        src, dst = in_staging, in_cache
    for w0 in range(0, row_words, BLOCK_W):
        w = w0 + cols
        mask = row_ok[:, None] & (w < row_words)[None, :]
        tl.store(dst[:, None] + w[None, :], tl.load(src[:, None] + w[None, :], mask=mask), mask=mask)
