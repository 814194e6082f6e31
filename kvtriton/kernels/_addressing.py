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

Per-segment table (``int64 [n_segments, segment_table.NUM_FIELDS]``, built by ``kvtriton.ops``): one
row per (region, stream, head slice[, destination]), its columns named in ``segment_table``.

Every product is formed in int64: block ids (int32 or int64) and row indices are cast with
``.to(tl.int64)`` before they meet a stride, and table entries are int64 (the interpreter ignores
``tl.int64`` annotations, and a block id of 2^20 times a block stride of 2^16 words already wraps
in int32).
"""

import triton
import triton.language as tl

from . import segment_table as col


@triton.jit
def _vec_multiple(x, VEC: tl.constexpr):
    """``x`` (an int64 known to be a multiple of ``VEC``, the launcher checks it) in a form the
    compiler can prove is one. ``tl.multiple_of`` on a scalar, or on the result of an inlined
    call, is dropped by Triton 3.6 (8-byte instead of 16-byte accesses in the sm_90 PTX); the
    divisibility of a product by a constant survives in every version. VEC is a power of two, so
    this is two shifts on a loop-invariant scalar."""
    return (x // VEC) * VEC


@triton.jit
def _row_offsets(tile, rows, num_heads, s_tile, s_tok, s_head, VEC: tl.constexpr):
    """Word offsets of rows ``rows`` (token-major row indices, int32 vector) of tile ``tile``;
    every stride is a multiple of ``VEC`` words, and so is every offset.

    The row split into (token, head) is done in int32 (rows of one tile are few); every
    product with a stride is int64.
    """
    tok = rows // num_heads.to(tl.int32)
    head = rows - tok * num_heads.to(tl.int32)
    return (
        tile.to(tl.int64) * _vec_multiple(s_tile.to(tl.int64), VEC)
        + tok.to(tl.int64) * _vec_multiple(s_tok.to(tl.int64), VEC)
        + head.to(tl.int64) * _vec_multiple(s_head.to(tl.int64), VEC)
    )


@triton.jit
def _segment_row(seg_ptr, s):
    """Pointer to row ``s`` of the segment table (its fields at ``+ segment_table.<COLUMN>``)."""
    return seg_ptr + s.to(tl.int64) * col.NUM_FIELDS
