"""Torch reference pack/unpack: the oracle for the Triton kernels and the CPU execution path.

Both functions implement the staged wire format of :mod:`kvtriton.plan` exactly, with
vectorised ``index_select(out=)`` / ``index_put_`` over bit views (every dtype moves as a
same-width or wider integer, so fp8, bf16, fp16 and fp32 are all exact copies). Neither makes a
copy of a cache: head slices and layout changes are strided views.

Shapes (``n`` = len(block_ids)); the tile of segment ``s`` for position ``j`` lives at
``staging[offsets[s] + j * tile_bytes : ... + tile_bytes]`` and is
``[block_size, num_heads, head_dim]`` for an NHD destination, ``[num_heads, block_size, head_dim]``
for an HND destination.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .plan import Segment
from .regions import Layout, Region

__all__ = ["pack_reference", "unpack_reference"]

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_reference(
    regions: Sequence[Region],
    segments: Sequence[Segment],
    offsets: Sequence[int] | np.ndarray,
    block_ids: torch.Tensor | np.ndarray | Sequence[int],
    staging: torch.Tensor,
) -> torch.Tensor:
    """Gather each segment's head slice of blocks ``block_ids`` into ``staging`` (uint8, 1-D).

    ``segments[s].src_head`` selects the heads in the source cache; tiles are written in
    ``segments[s].dst_layout``. Positions whose block id is -1 are skipped (their staging bytes
    are left as they were). Returns ``staging``.
    """
    ids = _ids(block_ids, staging.device)
    n = ids.numel()
    valid = ids >= 0
    all_valid = bool(valid.all())
    pos = None if all_valid else torch.nonzero(valid).flatten()
    for seg, off in zip(segments, offsets):
        src = regions[seg.region].nhd(seg.stream)[:, :, seg.src_head:seg.src_head + seg.num_heads]
        if seg.dst_layout is Layout.HND:
            src = src.transpose(1, 2)
        dst = staging[int(off):int(off) + n * seg.tile_bytes]
        src_w, dst_w = _bit_views(src, dst, seg.row_bytes)
        dst_w = dst_w.view(n, *src_w.shape[1:])
        if all_valid:
            torch.index_select(src_w, 0, ids, out=dst_w)
        else:
            dst_w[pos] = src_w.index_select(0, ids[pos])
    return staging


def unpack_reference(
    regions: Sequence[Region],
    segments: Sequence[Segment],
    offsets: Sequence[int] | np.ndarray,
    block_ids: torch.Tensor | np.ndarray | Sequence[int],
    staging: torch.Tensor,
) -> None:
    """Scatter tiles from ``staging`` into blocks ``block_ids`` of the local cache, at local head
    offset ``segments[s].dst_head``. Tiles are in the local layout. -1 positions are skipped."""
    ids = _ids(block_ids, staging.device)
    n = ids.numel()
    valid = ids >= 0
    pos = None if bool(valid.all()) else torch.nonzero(valid).flatten()
    for seg, off in zip(segments, offsets):
        region = regions[seg.region]
        dst = region.nhd(seg.stream)[:, :, seg.dst_head:seg.dst_head + seg.num_heads]
        if region.spec.layout is Layout.HND:
            dst = dst.transpose(1, 2)
        src = staging[int(off):int(off) + n * seg.tile_bytes]
        dst_w, src_w = _bit_views(dst, src, seg.row_bytes)
        src_w = src_w.view(n, *dst_w.shape[1:])
        if pos is None:
            dst_w.index_put_((ids,), src_w)
        else:
            dst_w.index_put_((ids[pos],), src_w[pos])


def _ids(block_ids, device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(device=device, dtype=torch.int64)
    return torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=device)


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
            return cache.view(_INT_OF_WIDTH[item]).view(_INT_OF_WIDTH[width]), flat.view(
                _INT_OF_WIDTH[width]
            )
        except RuntimeError:  # strides or offsets not divisible by the width
            continue
    return cache.view(_INT_OF_WIDTH[item]).view(torch.uint8), flat
