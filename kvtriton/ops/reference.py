"""Torch reference pack/unpack: the oracle for the Triton kernels and the CPU execution path.

Both functions implement the staged wire format of :mod:`kvtriton.plan` exactly, with
vectorised ``index_select(out=)`` / ``index_put_`` over bit views (every dtype moves as a
same-width or wider integer, so fp8, bf16, fp16 and fp32 are all exact copies). Neither makes a
copy of a cache: head slices and layout changes are strided views.

Shapes (``n`` = len(block_ids)); the tile of segment ``s`` for position ``j`` lives at
``staging[offsets[s] + j * tile_bytes : ... + tile_bytes]`` and is
``[block_size, num_heads, head_dim]`` for an NHD destination, ``[num_heads, block_size, head_dim]``
for an HND destination.

Token-mapped requests (the engines' block sizes differ; ``tiles``/``num_tokens`` given): tile
``i`` is destination position ``tiles[i]``, its token ``t`` is read from (pack) or written to
(unpack) cache block ``block_ids[t // Bc]`` at token ``t % Bc`` (``Bc``: the cache's block size),
for ``t < num_tokens`` only. The row map is built once per launch; runs of ``gcd(Bc, block_size)``
tokens, contiguous on both sides, move as one ``index_select``/``index_copy_`` row each (single
token rows where the cache's rows are strided, advanced indexing where a token's heads are).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..plan import Segment
from ..regions import Layout, Region, token_parts
from .heuristics import INT_OF_WIDTH

__all__ = ["pack_reference", "unpack_reference"]

def pack_reference(
    regions: Sequence[Region],
    segments: Sequence[Segment],
    offsets: Sequence[int] | np.ndarray,
    block_ids: torch.Tensor | np.ndarray | Sequence[int],
    staging: torch.Tensor,
    *,
    tiles: torch.Tensor | np.ndarray | Sequence[int] | None = None,
    num_tokens: int | None = None,
) -> torch.Tensor:
    """Gather each segment's head slice of blocks ``block_ids`` into ``staging`` (uint8, 1-D).

    ``segments[s].src_head`` selects the heads in the source cache; tiles are written in
    ``segments[s].dst_layout``. Positions whose block id is -1 are skipped (their staging bytes
    are left as they were). Returns ``staging``. (With CUDA block ids, finding -1 positions
    synchronises; the Triton path does not.) With ``tiles``/``num_tokens``, ``block_ids`` are per
    source position and tiles gather tokens across source blocks (see the module docstring).
    """
    if tiles is not None:
        _mapped(True, regions, segments, offsets, block_ids, staging, tiles, num_tokens)
        return staging
    ids, pos = _ids(block_ids, staging.device)
    for seg, off in zip(segments, offsets):
        cache, index, staged, sel = _segment_views(regions[seg.region], seg, seg.src_head, seg.dst_layout,
                                                   ids, pos, staging, int(off))
        if sel is None:
            torch.index_select(cache, 0, index, out=staged)
        else:
            staged[sel] = cache.index_select(0, index[sel])
    return staging


def unpack_reference(
    regions: Sequence[Region],
    segments: Sequence[Segment],
    offsets: Sequence[int] | np.ndarray,
    block_ids: torch.Tensor | np.ndarray | Sequence[int],
    staging: torch.Tensor,
    *,
    tiles: torch.Tensor | np.ndarray | Sequence[int] | None = None,
    num_tokens: int | None = None,
) -> None:
    """Scatter tiles from ``staging`` into blocks ``block_ids`` of the local cache, at local head
    offset ``segments[s].dst_head``. Tiles are in the local layout. -1 positions are skipped.
    With ``tiles``/``num_tokens``, ``block_ids`` are per destination position and only tokens
    below ``num_tokens`` are written."""
    if tiles is not None:
        _mapped(False, regions, segments, offsets, block_ids, staging, tiles, num_tokens)
        return
    ids, pos = _ids(block_ids, staging.device)
    for seg, off in zip(segments, offsets):
        region = regions[seg.region]
        cache, index, staged, sel = _segment_views(region, seg, seg.dst_head, region.spec.layout,
                                                   ids, pos, staging, int(off))
        if sel is None:
            cache.index_copy_(0, index, staged)
        else:
            cache.index_copy_(0, index[sel], staged[sel])


def _mapped(pack: bool, regions, segments, offsets, block_ids, staging, tiles, num_tokens) -> None:
    """Token-mapped pack (``pack``) or unpack: one gather/scatter of (block, token) rows per segment."""
    device = staging.device
    ids, _ = _ids(block_ids, device)
    tiles = torch.as_tensor(np.asarray(tiles.cpu() if isinstance(tiles, torch.Tensor) else tiles, dtype=np.int64),
                            device=device)
    n = tiles.numel()
    maps: dict[tuple[int, int], _RowMap] = {}  # segments share the request: index math once per block-size pair
    groups: dict[tuple[int, int], list | None] = {}
    for seg, off in zip(segments, offsets):
        region = regions[seg.region]
        head = seg.src_head if pack else seg.dst_head
        cache_bs = seg.source_block_size if pack else seg.block_size
        bt, nh = seg.block_size, seg.num_heads
        m = maps.get((cache_bs, bt))
        if m is None:
            m = maps[(cache_bs, bt)] = _RowMap.build(ids, tiles, num_tokens, cache_bs, bt)
        cache_dm = region.spec.dim_major_of(seg.stream)
        if cache_dm or seg.dim_major:
            if (cache_bs, bt) not in groups:
                groups[(cache_bs, bt)] = _unit_groups(m, cache_bs, bt)
            _mapped_parts(pack, region, seg, head, cache_dm, staging[int(off):int(off) + n * seg.tile_bytes], n, m,
                          groups[(cache_bs, bt)], cache_bs)
            continue
        cache = region.nhd(seg.stream)[:, :, head:head + nh]
        cache_w, staged_w = _bit_views(cache, staging[int(off):int(off) + n * seg.tile_bytes], seg.row_bytes)
        if seg.dst_layout is Layout.NHD:
            staged = staged_w.view(n, bt, nh, -1)
        else:
            staged = staged_w.view(n, nh, bt, -1).transpose(1, 2)
        c_rows, s_rows = _rows(cache_w), _rows(staged)
        if c_rows is None or s_rows is None:  # heads of a token not contiguous on one side
            if (cache_bs, bt) not in groups:
                groups[(cache_bs, bt)] = _unit_groups(m, cache_bs, bt)
            units = groups[(cache_bs, bt)]
            if units is None:
                _indexed_copy(pack, cache_w, staged, m.c_row[m.row_sel], m.row_sel, cache_bs, bt)
                continue
            _copy_units(pack, cache_w, staged, units, m.g, cache_bs, bt)
            if m.rest_sel is not None:
                _indexed_copy(pack, cache_w, staged, m.c_row_rest, m.rest_sel, cache_bs, bt)
            continue
        if c_rows.stride(0) != c_rows.shape[1]:  # strided rows: a unit is no single range, copy rows
            every = m.row_sel.numel() == m.c_row.numel()
            _copy_rows(pack, c_rows, s_rows, m.c_row if every else m.c_row[m.row_sel], None if every else m.row_sel)
            continue
        _copy_rows(pack, _units(c_rows, m.g), _units(s_rows, m.g), m.c_unit, m.unit_sel)
        if m.c_row_rest is not None:  # set with rest_sel
            _copy_rows(pack, c_rows, s_rows, m.c_row_rest, m.rest_sel)


def _mapped_parts(pack: bool, region: Region, seg: Segment, head: int, cache_dm: int, flat: torch.Tensor, n: int,
                  m: _RowMap, groups: list | None, cache_bs: int) -> None:
    """Token-mapped copy of a segment whose cache or tiles store a dim-major row part
    (``RegionSpec.dim_major``): each row is cut where either side's order changes, and every piece
    moves between element views (a dim-major piece's innermost stride is the block size, so no
    wider word applies): whole units of ``g`` tokens by :func:`_unit_groups` (dim-0 gathers and
    scatters, ~3x faster than indexing single tokens), the rest of the rows one token each."""
    word = INT_OF_WIDTH[seg.itemsize]
    nh, bt = seg.num_heads, seg.block_size
    stream = region.streams[seg.stream].view(word)
    cache_parts = token_parts(stream, cache_dm) if cache_dm else [(0, stream if region.spec.layout is Layout.NHD
                                                                   else stream.transpose(1, 2))]
    staged = flat.view(word)
    if seg.dst_layout is Layout.NHD:
        staged_parts = [(0, staged.view(n, bt, nh, seg.head_dim))]
    else:
        staged_parts = token_parts(staged.view(n, nh, bt, seg.head_dim), seg.dim_major)
    cuts = sorted({0, cache_dm, seg.dim_major, seg.head_dim} - {seg.head_dim})
    rows: torch.Tensor | None  # None with sel
    sel: torch.Tensor | None
    if groups is None:
        rows, sel = m.c_row[m.row_sel], m.row_sel
    else:
        rows, sel = m.c_row_rest, m.rest_sel
    for lo, hi in zip(cuts, cuts[1:] + [seg.head_dim]):
        c0, c = max((p for p in cache_parts if p[0] <= lo), key=lambda p: p[0])
        s0, st = max((p for p in staged_parts if p[0] <= lo), key=lambda p: p[0])
        c, st = c[:, :, head:head + nh, lo - c0:hi - c0], st[..., lo - s0:hi - s0]
        if groups is not None:
            _copy_units(pack, c, st, groups, m.g, cache_bs, bt)
        if sel is not None and sel.numel():
            _indexed_copy(pack, c, st, rows, sel, cache_bs, bt)


def _copy_units(pack: bool, c: torch.Tensor, st: torch.Tensor, groups: list, g: int, cache_bs: int, bt: int) -> None:
    """Move whole ``g``-token units between ``[blocks, tokens, heads, width]`` views (any strides),
    one dim-0 gather and scatter per group of :func:`_unit_groups`."""
    cu = c.unflatten(1, (cache_bs // g, g))  # [blocks, units, g, heads, width]
    su = st.unflatten(1, (bt // g, g))
    # the cache's innermost axis last (a dim-major piece: the tokens), so gathers run along memory
    inner = sorted((2, 3, 4), key=lambda d: -cu.stride(d))
    cu, su = cu.permute(0, 1, *inner), su.permute(0, 1, *inner)
    cu, su = _widest(cu, su)
    for s_unit, c_unit, tiles, blocks in groups:
        if pack:
            su[:, s_unit].index_copy_(0, tiles, cu[:, c_unit].index_select(0, blocks))
        else:
            cu[:, c_unit].index_copy_(0, blocks, su[:, s_unit].index_select(0, tiles))


def _widest(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both views as the widest integer words their innermost axis allows (the same bits; a
    dim-major unit of ``g`` tokens is ``g * itemsize`` contiguous bytes on both sides)."""
    item = a.element_size()
    for width in (8, 4, 2):
        if width <= item or (a.shape[-1] * item) % width:
            continue
        try:
            return a.view(INT_OF_WIDTH[width]), b.view(INT_OF_WIDTH[width])
        except RuntimeError:  # an outer stride, or an offset, not divisible by the width
            continue
    return a, b


_MAX_UNIT_GROUPS = 64  # (tile unit, cache unit) pairs worth one gather each; beyond, tokens one by one


def _unit_groups(m: _RowMap, cache_bs: int, bt: int) -> list | None:
    """The map's whole ``g``-token units grouped by (unit slot in the tile, unit slot in the cache
    block): ``[(s_unit, c_unit, tiles, blocks)]``, so that each group moves as one dim-0 gather;
    ``None`` when there would be more than :data:`_MAX_UNIT_GROUPS` groups (``Bs * Bd / g**2``)."""
    per_tile, per_block = bt // m.g, cache_bs // m.g
    if per_tile * per_block > _MAX_UNIT_GROUPS:
        return None
    staged_unit = (torch.arange(m.c_unit.numel(), device=m.c_unit.device) if m.unit_sel is None else m.unit_sel)
    tile, s_slot = torch.div(staged_unit, per_tile, rounding_mode="floor"), staged_unit % per_tile
    block, c_slot = torch.div(m.c_unit, per_block, rounding_mode="floor"), m.c_unit % per_block
    key = s_slot * per_block + c_slot
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=per_tile * per_block).tolist()
    out, start = [], 0
    for k, count in enumerate(counts):
        if count:
            idx = order[start:start + count]
            out.append((k // per_block, k % per_block, tile[idx], block[idx]))
            start += count
    return out


@dataclass(frozen=True)
class _RowMap:
    """Where the rows of ``n`` tiles of ``bt`` tokens live in a cache of ``Bc``-token blocks.

    Both block sizes are multiples of ``g = gcd(Bc, bt)``, and so is every boundary between cache
    blocks and tiles: runs of g tokens ("units") are contiguous on both sides and move as one.
    ``unit_sel``/``rest_sel``: staged units / rows to move (``None`` = all units / no rows); the
    rows of a partly valid unit (the request's end) move one by one.
    """

    g: int
    c_row: torch.Tensor  # [n * bt] cache row of each tile row (garbage where not moved)
    row_sel: torch.Tensor  # tile rows that move
    c_unit: torch.Tensor  # cache unit of each moved staged unit
    unit_sel: torch.Tensor | None
    c_row_rest: torch.Tensor | None
    rest_sel: torch.Tensor | None

    @classmethod
    def build(cls, ids: torch.Tensor, tiles: torch.Tensor, num_tokens: int, cache_bs: int, bt: int) -> _RowMap:
        tok = (tiles[:, None] * bt + _token_offsets(bt, tiles.device)).reshape(-1)  # request token of each row
        pos = torch.div(tok, cache_bs, rounding_mode="floor")
        ok = (tok < num_tokens) & (pos < ids.numel())
        blk = torch.where(ok, ids[pos.clamp(max=max(ids.numel() - 1, 0))], -1)
        ok &= blk >= 0
        c_row = blk * cache_bs + (tok - pos * cache_bs)
        g = math.gcd(cache_bs, bt)
        unit_ok = ok.view(-1, g).all(1)
        every = bool(unit_ok.all())
        unit_sel = None if every else torch.nonzero(unit_ok).flatten()
        c_unit = torch.div(c_row.view(-1, g)[:, 0], g, rounding_mode="floor")
        if unit_sel is not None:
            c_unit = c_unit[unit_sel]
        rest_sel = c_row_rest = None
        if not every:
            rest = ok & ~unit_ok.repeat_interleave(g)
            if bool(rest.any()):
                rest_sel = torch.nonzero(rest).flatten()
                c_row_rest = c_row[rest_sel]
        return cls(g, c_row, torch.nonzero(ok).flatten(), c_unit, unit_sel, c_row_rest, rest_sel)


def _units(rows: torch.Tensor, g: int) -> torch.Tensor:
    """``[rows, words]`` as ``[rows / g, g, words]`` (runs of g rows)."""
    r, w = rows.shape
    s = rows.stride(0)
    return rows.as_strided((r // g, g, w), (g * s, s, 1))


def _copy_rows(pack: bool, c_rows: torch.Tensor, s_rows: torch.Tensor, c_index: torch.Tensor,
               sel: torch.Tensor | None) -> None:
    """Staged row ``sel[i]`` (``i`` when ``sel`` is None) <-> cache row ``c_index[i]``."""
    if sel is not None and sel.numel() == 0:
        return
    if pack:
        if sel is None and s_rows.is_contiguous():
            torch.index_select(c_rows, 0, c_index, out=s_rows)
        elif sel is None:
            s_rows.copy_(c_rows.index_select(0, c_index))
        else:
            s_rows.index_copy_(0, sel, c_rows.index_select(0, c_index))
    else:
        c_rows.index_copy_(0, c_index, s_rows if sel is None else s_rows.index_select(0, sel))


def _rows(view: torch.Tensor) -> torch.Tensor | None:
    """A ``[blocks, tokens, heads, words]`` view as ``[blocks * tokens, heads * words]`` rows, when
    the heads of a token are contiguous and blocks are evenly spaced token rows; else ``None``."""
    nb, bs, h, w = view.shape
    s_blk, s_tok, s_head, _ = view.stride()
    if (h > 1 and s_head != w) or (bs > 1 and nb > 1 and s_blk != bs * s_tok):
        return None
    return view.as_strided((nb * bs, h * w), (s_tok if bs > 1 else s_blk, 1))


def _indexed_copy(pack: bool, cache_w, staged, c_row, sel, cache_bs: int, bt: int) -> None:
    """The general case: (block, token) advanced indexing on both sides."""
    s_row = torch.arange(staged.shape[0] * bt, device=staged.device) if sel is None else sel
    c_blk, c_tok = torch.div(c_row, cache_bs, rounding_mode="floor"), c_row % cache_bs
    s_tile, s_tok = torch.div(s_row, bt, rounding_mode="floor"), s_row % bt
    if pack:
        staged[s_tile, s_tok] = cache_w[c_blk, c_tok]
    else:
        cache_w[c_blk, c_tok] = staged[s_tile, s_tok]


def _segment_views(region: Region, seg: Segment, head: int, tile_layout: Layout, ids: torch.Tensor,
                   pos: torch.Tensor | None, staging: torch.Tensor, off: int):
    """The bit views one segment moves between: ``(cache, index, staged, sel)`` such that
    ``staged`` row ``i`` is ``cache`` row ``index[i]`` (``sel``: the rows to move, ``None`` =
    all). Rows are (block, token) rows when the tile is token-major and that is contiguous per
    row (see :func:`_token_rows`), else whole tiles per block."""
    n = ids.numel()
    cache = region.nhd(seg.stream)[:, :, head:head + seg.num_heads]
    # an HND tile of one head is token-major too: same bytes as NHD
    token_major = tile_layout is Layout.NHD or seg.num_heads == 1
    if not token_major:
        cache = cache.transpose(1, 2)
    cache_w, staged_w = _bit_views(cache, staging[off:off + n * seg.tile_bytes], seg.row_bytes)
    rows = _token_rows(cache_w) if token_major else None
    if rows is not None:  # (block, token) rows of contiguous heads: one memcpy per row
        sel = None if pos is None else _row_ids(pos, seg.block_size)
        return rows, _row_ids(ids, seg.block_size), staged_w.view(n * seg.block_size, -1), sel
    return cache_w, ids, staged_w.view(n, *cache_w.shape[1:]), pos


def _token_rows(view: torch.Tensor) -> torch.Tensor | None:
    """A ``[blocks, tokens, heads, words]`` view as ``[blocks * tokens, heads * words]`` rows, when
    a block's tile is not contiguous but the heads of a token are, and a block is ``tokens``
    evenly spaced rows; else ``None``.

    Torch then copies one contiguous row per index, ~2x faster than a strided 4-D tile gather
    (measured: 16 MiB of 1-of-2-head slices, 2.9 vs 5.5 ms on one core).
    """
    nb, bs, h, w = view.shape
    s_blk, s_tok, s_head, _ = view.stride()
    if h > 1 and s_head != w:
        return None
    if bs == 1 or s_tok == h * w:
        return None  # a block's tile is already contiguous: one memcpy per block is better
    if s_blk != bs * s_tok:
        return None
    return view.as_strided((nb * bs, h * w), (s_tok, 1))


@functools.cache
def _token_offsets(block_size: int, device: torch.device) -> torch.Tensor:
    return torch.arange(block_size, device=device)


def _row_ids(ids: torch.Tensor, block_size: int) -> torch.Tensor:
    return (ids[:, None] * block_size + _token_offsets(block_size, ids.device)).reshape(-1)


def _ids(block_ids, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block ids as int64 on ``device``, and the positions to copy (``None`` = all of them)."""
    if isinstance(block_ids, torch.Tensor):
        ids = block_ids.to(device=device, dtype=torch.int64)
    else:
        ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64).reshape(-1), device=device)
    valid = ids >= 0
    if bool(valid.all()):
        return ids, None
    return ids, torch.nonzero(valid).flatten()


def _bit_views(cache: torch.Tensor, flat: torch.Tensor, row_bytes: int):
    """View a cache slice and a uint8 staging range as the widest integer both allow.

    Wider words make ``index_select`` several times faster than byte copies; every width moves
    the same bits.
    """
    item = cache.element_size()
    for width in (8, 4, 2):
        if row_bytes % width:
            continue
        try:
            return cache.view(INT_OF_WIDTH[item]).view(INT_OF_WIDTH[width]), flat.view(
                INT_OF_WIDTH[width]
            )
        except RuntimeError:  # strides or offsets not divisible by the width
            continue
    return cache.view(INT_OF_WIDTH[item]).view(torch.uint8), flat
