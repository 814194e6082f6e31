"""The segment table's columns, each named once: ``kvtriton.ops`` writes rows by these names and
the kernels read them by the same names (``row + segment_table.STG_OFF``).

One int64 row per (region, stream, head slice[, destination]) of a launch. ``CACHE_ADDR`` is an
absolute byte address (regions are separate tensors, not one allocation); ``NUM_HEADS``,
``BLOCK_SIZE`` and ``CACHE_BLOCK_SIZE`` are counts; every other column is in words of the
launch's word width.

A module of plain ints rather than a class: a module is one of the few globals a
``@triton.jit`` function may read, in every Triton version we support.
"""

CACHE_ADDR = 0  # bytes: address of (block 0, token 0, first head of the slice, dim 0)
CACHE_S_BLK = 1  # words between consecutive blocks of the stream
CACHE_S_TOK = 2  # words between consecutive tokens inside a block
CACHE_S_HEAD = 3  # words between consecutive heads inside a block
STG_OFF = 4  # words from the staging base to the segment's first tile
STG_S_TILE = 5  # words per tile (= block_size * num_heads * row_words)
STG_S_TOK = 6  # words between tokens inside a staged tile
STG_S_HEAD = 7  # words between heads inside a staged tile
NUM_HEADS = 8  # heads in the slice
BLOCK_SIZE = 9  # tokens per staged tile (the destination's block size)
ROW_WORDS = 10  # words per (token, head) row
CACHE_BLOCK_SIZE = 11  # tokens per block of the cache this launch reads or writes (token-mapped launches)
NUM_FIELDS = 12  # columns per row

# Columns counted in words: the launcher fills them in bytes and divides once the width is known.
WORD_COLUMNS = (CACHE_S_BLK, CACHE_S_TOK, CACHE_S_HEAD, STG_OFF, STG_S_TILE, STG_S_TOK, STG_S_HEAD, ROW_WORDS)
