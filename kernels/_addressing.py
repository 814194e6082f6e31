"""Address math shared by the pack and unpack kernels (and by the overflow probe in the tests).

Everything is counted in *words*: the launcher views every dtype as one integer type of
``WORD_BYTES`` bytes (1, 2, 4 or 8), so a (token, head) row of ``head_dim`` elements is
``row_words = head_dim * itemsize / WORD_BYTES`` words and the kernels only move bits.

A *tile* is one block's ``block_size x num_heads`` rows of one (region, stream) head slice. Its
rows are enumerated token-major, ``r = tok * num_heads + head``, whatever the memory layout;
a layout is nothing but a pair of strides:

    word offset of row r of tile t = t * s_tile + (r // num_heads) * s_tok + (r % num_heads) * s_head

* cache side:   ``t`` = block id, ``(s_tile, s_tok, s_head)`` = the stream's (block, token, head)
  strides, with the head-slice start already folded into the base address;
* staging side: ``t`` = request position j, ``s_tile`` = tile words and, for a tile in layout
  NHD ``(s_tok, s_head) = (num_heads * row_words, row_words)``,
  HND ``(s_tok, s_head) = (row_words, block_size * row_words)``.

Per-segment table (``int64 [n_segments, SEGMENT_FIELDS]``, built by ``kvtriton.ops``): one row
per (region, stream, head slice[, destination]) with the fields named in :data:`SEGMENT_FIELDS`
in that order. ``cache_addr`` is an absolute byte address (regions are separate tensors, not one
allocation); every other field is in words, except ``num_heads``/``block_size`` (counts).

Every product is formed in int64: block ids and table entries are cast with ``.to(tl.int64)``
before they meet a stride (the interpreter ignores ``tl.int64`` annotations, and a block id of
2^20 times a block stride of 2^16 words already wraps in int32).
"""

import triton
import triton.language as tl

SEGMENT_FIELDS = (
    "cache_addr",  # bytes: address of (block 0, token 0, first head of the slice, dim 0)
    "cache_s_blk",  # words between consecutive blocks of the stream
    "cache_s_tok",  # words between consecutive tokens inside a block
    "cache_s_head",  # words between consecutive heads inside a block
    "stg_off",  # words from the staging base to the segment's first tile
    "stg_s_tile",  # words per tile (= block_size * num_heads * row_words)
    "stg_s_tok",  # words between tokens inside a staged tile
    "stg_s_head",  # words between heads inside a staged tile
    "num_heads",  # heads in the slice
    "block_size",  # tokens per block
    "row_words",  # words per (token, head) row
)
NUM_SEGMENT_FIELDS = len(SEGMENT_FIELDS)


@triton.jit
def _row_offsets(tile, rows, num_heads, s_tile, s_tok, s_head):
    """Word offsets of rows ``rows`` (token-major row indices, int32 vector) of tile ``tile``.

    The row split into (token, head) is done in int32 (rows of one tile are few); every
    product with a stride is int64.
    """
    tok = rows // num_heads.to(tl.int32)
    head = rows - tok * num_heads.to(tl.int32)
    return (
        tile.to(tl.int64) * s_tile.to(tl.int64)
        + tok.to(tl.int64) * s_tok.to(tl.int64)
        + head.to(tl.int64) * s_head.to(tl.int64)
    )


@triton.jit
def _load_segment(seg_ptr, s, NUM_FIELDS: tl.constexpr):
    """Row ``s`` of the segment table, each field as an int64 scalar (order: SEGMENT_FIELDS)."""
    row = seg_ptr + s.to(tl.int64) * NUM_FIELDS
    cache_addr = tl.load(row + 0).to(tl.int64)
    c_blk = tl.load(row + 1).to(tl.int64)
    c_tok = tl.load(row + 2).to(tl.int64)
    c_head = tl.load(row + 3).to(tl.int64)
    stg_off = tl.load(row + 4).to(tl.int64)
    t_tile = tl.load(row + 5).to(tl.int64)
    t_tok = tl.load(row + 6).to(tl.int64)
    t_head = tl.load(row + 7).to(tl.int64)
    num_heads = tl.load(row + 8).to(tl.int64)
    block_size = tl.load(row + 9).to(tl.int64)
    row_words = tl.load(row + 10).to(tl.int64)
    return (cache_addr, c_blk, c_tok, c_head, stg_off, t_tile, t_tok, t_head, num_heads,
            block_size, row_words)

