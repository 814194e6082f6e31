"""Region specs on the meta device (geometry only) and the pieces prepared rows or runs name."""

import numpy as np
import torch

from kvtriton.plan import head_range
from kvtriton.regions import Layout, Region


def gqa_specs(layers, heads, head_dim, rank, tp, block_size, num_blocks=1024, layout=Layout.NHD,
              dtype=torch.bfloat16):
    h = head_range(rank, tp, heads)
    local = h[1] - h[0]
    shape = (num_blocks, block_size, local, head_dim) if layout is Layout.NHD else (
        num_blocks, local, block_size, head_dim)
    t = torch.empty(shape, dtype=dtype, device="meta")  # geometry only, no memory
    return [Region.attention(f"layer.{i}", t, t, layout=layout, block_size=block_size,
                             total_heads=heads).spec for i in range(layers)]


def mla_specs(rank, tp, block_size, num_blocks=64):
    t = torch.empty(num_blocks, block_size, 64, dtype=torch.bfloat16, device="meta")
    return [Region.mla("mla.0", t, block_size=block_size).spec]



def pieces_of_runs(runs, tile_of):
    """Every block's piece of ``runs``: a run of k blocks split into its k tiles."""
    out = []
    for region, stream, s_off, d_off, nbytes in zip(runs.region.tolist(), runs.stream.tolist(),
                                                    runs.src_offset.tolist(), runs.dst_offset.tolist(),
                                                    runs.nbytes.tolist()):
        tile = tile_of(region, stream, nbytes)
        out += [(region, stream, s_off + i * tile, d_off + i * tile, tile) for i in range(nbytes // tile)]
    return sorted(out)


def pieces_of_rows(rows, src_idx, dst_idx):
    """What each index pair of prepared rows names: row r's descriptor b is block b's range."""
    s_start = np.concatenate([[0], np.cumsum(rows.src_blocks)[:-1]])
    d_start = np.concatenate([[0], np.cumsum(rows.dst_blocks)[:-1]])
    out = []
    for si, di in zip(src_idx.tolist(), dst_idx.tolist()):
        r = int(np.searchsorted(s_start, si, side="right") - 1)
        assert int(np.searchsorted(d_start, di, side="right") - 1) == r  # a pair never crosses rows
        sb, db = si - s_start[r], di - d_start[r]
        out.append((int(rows.region[r]), int(rows.stream[r]), int(sb * rows.src_stride[r] + rows.src_offset[r]),
                    int(db * rows.dst_stride[r] + rows.dst_offset[r]), int(rows.tile[r])))
    return sorted(out)

