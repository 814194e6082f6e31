"""Checks of :func:`~kvtriton.ops.pack` / :func:`~kvtriton.ops.unpack` arguments: every one
raises a :class:`~kvtriton.errors.LaunchError` that names the argument, before anything is
launched or written.

:func:`validate` turns the arguments into a :class:`Checked` request: the per-plan part
(:class:`Static`: segment geometry, addresses in bytes, alignment) is checked once per tuple of
segments and region objects and cached; the per-request part (ids, offsets, tiles, staging size)
is checked on every call.

No check synchronises a device: block-id range (and, for unpack, uniqueness) is checked when the
ids are given on the CPU (tensor, numpy array or list); ids already on a CUDA device are trusted,
because the planner (:func:`kvtriton.plan.compact_request`) validated them when it produced them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import LaunchError
from ..kernels import segment_table as col
from ..plan import Segment
from ..regions import Layout, Region

__all__ = ["Checked", "Static", "validate"]

_MAX_GRID_Y = 65535  # CUDA limit of grid dimension 1 (segments)
# Columns whose alignment bounds the word width: the cache address and everything in words.
_ALIGN_COLUMNS = (col.CACHE_ADDR, *col.WORD_COLUMNS)


@dataclass(frozen=True)
class Static:
    """What one (op, regions, segments) triple implies, independent of the request: checked
    once, then reused while the caller passes the same segment tuple and region objects."""

    regions: tuple  # weak references (a cache must not keep KV caches alive); hits compare identities
    segments: tuple  # the caller's tuple itself, so that its id is not reused while cached
    data_ptrs: tuple[int, ...]  # every stream's address (a tensor re-pointed by set_() misses)
    device: torch.device | None  # the streams' device, None when they are not on one device
    rows: np.ndarray  # int64 [n_segments, segment_table.NUM_FIELDS] in bytes; STG_OFF column is 0
    tile_bytes: np.ndarray  # int64 [n_segments]
    lowbits: int  # OR of every static address, stride and row length (alignment)
    num_blocks: int | None  # fewest blocks among the regions the segments touch
    maps_tokens: bool  # some segment's cache block size differs from its tile's (pack across block sizes)
    cache_block_size: int  # fewest tokens per block among the caches the segments touch
    tile_block_size: int  # most tokens per staged tile among the segments
    dim_major: bool  # some cache or staged tile stores a dim-major row part (RegionSpec.dim_major)


@dataclass(frozen=True)
class Checked:
    static: Static
    offsets: np.ndarray  # int64 [n_segments]
    ids: torch.Tensor  # int32/int64 [n] (token map: [cache positions]), contiguous, on the staging device
    n: int  # tiles per segment
    tiles: torch.Tensor | None  # token map: int64 [n] destination position of each tile, on the staging device
    num_tokens: int  # token map: the request's tokens (0 otherwise)


_STATIC_CACHE: dict[tuple, Static] = {}
_STATIC_CACHE_SIZE = 64  # plans (x pack/unpack) a process keeps checked; oldest evicted first
_STATIC_LOCK = threading.Lock()


def validate(op: str, regions, segments, offsets, block_ids, staging, pair_ids=None, tiles=None,
              num_tokens=None) -> Checked:
    if not isinstance(staging, torch.Tensor):
        raise LaunchError(f"{op}: staging must be a torch.Tensor (1-D uint8); got {type(staging).__name__}")
    if staging.dtype != torch.uint8 or staging.dim() != 1 or (staging.numel() > 1 and staging.stride(0) != 1):
        raise LaunchError(
            f"{op}: staging must be a contiguous 1-D uint8 tensor; got dtype {staging.dtype}, "
            f"shape {tuple(staging.shape)}, strides {tuple(staging.stride())}"
        )
    device = staging.device
    if isinstance(regions, Region) or not isinstance(regions, Sequence):
        raise LaunchError(f"{op}: regions must be a sequence of Region; got {type(regions).__name__}")
    if isinstance(segments, Segment) or not isinstance(segments, Sequence):
        raise LaunchError(f"{op}: segments must be a sequence of Segment; got {type(segments).__name__}")
    n_seg = len(segments)
    offs = _offsets(op, offsets, n_seg)
    if n_seg > _MAX_GRID_Y:
        raise LaunchError(f"{op}: {n_seg} segments in one launch; expected at most {_MAX_GRID_Y}")
    static = _static(op, regions, segments)
    if static.device != device:
        for i, r in enumerate(regions):
            for k, t in enumerate(r.streams):
                if t.device != device:
                    raise LaunchError(
                        f"{op}: region {i} ({r.spec.name!r}) stream {k} is on {t.device}, staging is "
                        f"on {device}: expected every tensor on one device"
                    )
    if pair_ids is not None and tiles is not None:
        raise LaunchError(f"{op}: pair_ids= and tiles= do not combine: a token-mapped request's ids "
                          "already say which positions are read (kvtriton.plan.TokenMap)")
    # a token-mapped list's -1 positions are the map's own (validated with tiles below)
    ids = _block_ids(op, block_ids, device, static.num_blocks,
                     paired=pair_ids is not None or tiles is not None)
    if pair_ids is not None:
        # a position either side skips is skipped here too: both calls then agree on every tile
        pair = _block_ids(f"{op} pair_ids", pair_ids, device, None, paired=True)
        if pair.numel() != ids.numel():
            raise LaunchError(f"{op}: pair_ids has {pair.numel()} positions, block_ids {ids.numel()}: "
                              "expected the other side's list for the same request positions")
        ids = torch.where(pair < 0, torch.full_like(ids, -1), ids)
    n = int(ids.numel())
    tiles_t, n_tok = None, 0
    if tiles is not None or num_tokens is not None:
        tiles_t, n_tok = _tiles(op, tiles, num_tokens, n, static, device)
        n = int(tiles_t.numel())
    elif static.maps_tokens:
        raise LaunchError(
            f"{op}: the segments gather {static.tile_block_size}-token tiles from caches of "
            f"{static.cache_block_size}-token blocks: pass tiles= and num_tokens= (a token-mapped request, "
            "kvtriton.plan.TokenMap)"
        )
    if n and n_seg:
        ends = offs + n * static.tile_bytes
        too_big = ends > staging.numel()
        if too_big.any():
            s = int(np.argmax(too_big))
            raise LaunchError(
                f"{op}: staging holds {staging.numel()} bytes, but segment {s} needs bytes "
                f"[{int(offs[s])}, {int(ends[s])}) for {n} blocks of {int(static.tile_bytes[s])}-byte tiles"
            )
        if op == "pack":
            _check_disjoint_tiles(offs, ends)
    return Checked(static, offs, ids, n, tiles_t, n_tok)


def _static(op: str, regions, segments) -> Static:
    """Per-segment checks and addressing, cached for tuples of segments (immutable, like the
    planner's ``Payload.segments``): a launch serving 8 destinations of an 80-layer model
    has 1280 segments, and checking them costs milliseconds of Python."""
    for i, r in enumerate(regions):
        if not isinstance(r, Region):
            raise LaunchError(f"{op}: regions[{i}] must be a Region; got {type(r).__name__}")
    cacheable = isinstance(segments, tuple)
    if cacheable:
        key = (op, id(segments), tuple(map(id, regions)))
        with _STATIC_LOCK:
            hit = _STATIC_CACHE.get(key)
        if (hit is not None and hit.segments is segments
                and all(ref() is r for ref, r in zip(hit.regions, regions))
                and hit.data_ptrs == tuple(t.data_ptr() for r in regions for t in r.streams)):
            return hit
    static = _build_static(op, regions, segments)
    if cacheable:
        with _STATIC_LOCK:
            if len(_STATIC_CACHE) >= _STATIC_CACHE_SIZE:
                _STATIC_CACHE.pop(next(iter(_STATIC_CACHE)))
            _STATIC_CACHE[key] = static
    return static


def _build_static(op: str, regions, segments) -> Static:
    side = "src" if op == "pack" else "dst"
    n_seg = len(segments)
    rows = np.zeros((n_seg, col.NUM_FIELDS), dtype=np.int64)
    tile_bytes = np.zeros(n_seg, dtype=np.int64)
    min_blocks = None
    any_dim_major = False
    for s, seg in enumerate(segments):
        if not isinstance(seg, Segment):
            raise LaunchError(f"{op}: segments[{s}] must be a Segment; got {type(seg).__name__}")
        where = f"{op}: segment {s} (region {seg.region}, stream {seg.stream})"
        if not 0 <= seg.region < len(regions):
            raise LaunchError(f"{where}: region index out of range: expected 0..{len(regions) - 1}")
        region = regions[seg.region]
        if not 0 <= seg.stream < len(region.streams):
            raise LaunchError(
                f"{where}: stream index out of range: region {region.spec.name!r} has "
                f"{len(region.streams)} stream(s)"
            )
        t = region.nhd(seg.stream)  # [num_blocks, block_size, heads, head_dim]
        if t.dim() != 4 or t.stride(-1) != 1:
            raise LaunchError(
                f"{where}: stream must be a 4-D view with head_dim stride 1; got shape "
                f"{tuple(t.shape)}, strides {tuple(t.stride())}"
            )
        nb, bs, heads, hd = t.shape
        item = t.element_size()
        if seg.itemsize != item:
            raise LaunchError(
                f"{where}: segment itemsize {seg.itemsize} B does not match the region's dtype "
                f"{t.dtype} ({item} B)"
            )
        if seg.head_dim != hd:
            raise LaunchError(f"{where}: segment head_dim {seg.head_dim} does not match the region's {hd}")
        cache_bs = seg.source_block_size if op == "pack" else seg.block_size
        if cache_bs != bs:
            which = "src_block_size" if op == "pack" and seg.src_block_size is not None else "block_size"
            raise LaunchError(f"{where}: segment {which} {cache_bs} does not match the region's {bs}")
        h0 = seg.src_head if op == "pack" else seg.dst_head
        nh = seg.num_heads
        if nh < 1 or h0 < 0 or h0 + nh > heads:
            raise LaunchError(
                f"{where}: {side} heads [{h0}, {h0 + nh}) are not inside the region's "
                f"{heads} local heads: expected 0 <= {side}_head and {side}_head + num_heads <= {heads}, "
                "num_heads >= 1"
            )
        if not isinstance(seg.dst_layout, Layout):
            raise LaunchError(f"{where}: dst_layout must be a Layout; got {seg.dst_layout!r}")
        if op == "unpack" and seg.dst_layout is not region.spec.layout:
            raise LaunchError(
                f"{where}: staged tiles are {seg.dst_layout.value} but the local region is "
                f"{region.spec.layout.value}: unpack expects tiles in the local layout"
            )
        cache_dm = region.spec.dim_major_of(seg.stream)
        if not 0 <= seg.dim_major <= hd or (seg.dim_major and seg.dst_layout is not Layout.HND):
            raise LaunchError(f"{where}: dim_major {seg.dim_major} needs 0 <= dim_major <= head_dim {hd} and HND "
                              f"tiles (got {seg.dst_layout.value})")
        if seg.dim_major != cache_dm and (op == "unpack" or cache_bs == seg.block_size):
            raise LaunchError(
                f"{where}: staged tiles store {seg.dim_major} row elements dim-major, the {side} cache "
                f"{cache_dm}: " + ("unpack expects tiles in the local in-block order" if op == "unpack" else
                                   "whole-block tiles keep the cache's in-block order")
            )
        any_dim_major = any_dim_major or bool(cache_dm or seg.dim_major)
        # Addressing (bytes; converted to words once the word width is known).
        rb = seg.row_bytes
        s_blk, s_tok, s_head = t.stride(0) * item, t.stride(1) * item, t.stride(2) * item
        tbs = seg.block_size  # tokens per staged tile (the cache's, unless pack changes block size)
        t_tok, t_head = (nh * rb, rb) if seg.dst_layout is Layout.NHD else (rb, tbs * rb)
        # Strides of extent-1 dimensions never move an address: zero them so that an odd stride
        # there (e.g. of an unsqueezed MLA head) does not narrow the word width.
        if bs == 1:
            s_tok = 0
        if tbs == 1:
            t_tok = 0
        if nh == 1:
            s_head = t_head = 0
        if nb == 1:
            s_blk = 0
        row = rows[s]
        row[col.CACHE_ADDR] = t.data_ptr() + h0 * t.stride(2) * item
        row[col.CACHE_S_BLK], row[col.CACHE_S_TOK], row[col.CACHE_S_HEAD] = s_blk, s_tok, s_head
        row[col.STG_S_TILE], row[col.STG_S_TOK], row[col.STG_S_HEAD] = seg.tile_bytes, t_tok, t_head
        row[col.NUM_HEADS], row[col.BLOCK_SIZE], row[col.ROW_WORDS] = nh, tbs, rb
        row[col.CACHE_BLOCK_SIZE] = bs
        tile_bytes[s] = seg.tile_bytes
        min_blocks = nb if min_blocks is None else min(min_blocks, nb)
    if op == "unpack":
        _check_disjoint_heads(segments)
    lowbits = int(np.bitwise_or.reduce(rows[:, _ALIGN_COLUMNS], axis=None, initial=0))
    devices = {t.device for r in regions for t in r.streams}
    return Static(
        regions=tuple(weakref.ref(r) for r in regions), segments=tuple(segments),
        data_ptrs=tuple(t.data_ptr() for r in regions for t in r.streams),
        device=devices.pop() if len(devices) == 1 else None,
        rows=rows, tile_bytes=tile_bytes, lowbits=lowbits, num_blocks=min_blocks,
        maps_tokens=bool((rows[:, col.CACHE_BLOCK_SIZE] != rows[:, col.BLOCK_SIZE]).any()),
        cache_block_size=int(rows[:, col.CACHE_BLOCK_SIZE].min(initial=1 << 62)),
        tile_block_size=int(rows[:, col.BLOCK_SIZE].max(initial=0)),
        dim_major=any_dim_major,
    )


def _offsets(op: str, offsets, n_seg: int) -> np.ndarray:
    if isinstance(offsets, torch.Tensor):
        if offsets.device.type != "cpu":
            raise LaunchError(
                f"{op}: offsets are a tensor on {offsets.device}: expected host integers (numpy, "
                "list or CPU tensor); reading device memory here would synchronise"
            )
        offsets = offsets.detach().numpy()
    arr = np.asarray(offsets)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise LaunchError(
            f"{op}: offsets must be a 1-D sequence of integers (bytes); got {arr.dtype} with shape {arr.shape}"
        )
    if arr.size != n_seg:
        raise LaunchError(f"{op}: {arr.size} offsets for {n_seg} segments: expected one byte offset per segment")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        s = int(np.argmax(arr < 0))
        raise LaunchError(f"{op}: offset of segment {s} is {int(arr[s])}: expected a byte offset >= 0")
    return arr


def _block_ids(op: str, block_ids, device: torch.device, num_blocks: int | None, paired: bool = True) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        ids = block_ids
        if ids.dtype not in (torch.int32, torch.int64):
            raise LaunchError(f"{op}: block ids must be int32 or int64; got {ids.dtype}")
    else:
        arr = np.asarray(block_ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise LaunchError(f"{op}: block ids must be integers; got {arr.dtype}")
        ids = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
    if ids.dim() != 1:
        raise LaunchError(f"{op}: block ids must be 1-D (one id per request position); got shape {tuple(ids.shape)}")
    if ids.device.type == "cpu":
        if ids.numel() and num_blocks is not None:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < -1 or hi >= num_blocks:
                bad = (ids < -1) | (ids >= num_blocks)
                j = int(torch.nonzero(bad)[0, 0])
                raise LaunchError(
                    f"{op}: block id {int(ids[j])} at position {j} is out of range: expected -1 "
                    f"(skip) or 0..{num_blocks - 1}"
                )
        if op == "unpack" and ids.numel() > 1:
            valid = ids[ids >= 0]
            uniq, counts = torch.unique(valid, return_counts=True)
            if uniq.numel() != valid.numel():
                raise LaunchError(
                    f"{op}: block ids repeat {uniq[counts > 1][:8].tolist()}: two tiles would race "
                    "for one block; expected distinct ids (or -1)"
                )
        if not paired and ids.numel() and bool((ids < 0).any()):
            # one list alone cannot say what the other side does at this position: a pack that
            # skips it leaves a stale tile that an unpack without -1 there would write into a block
            j = int(torch.nonzero(ids < 0)[0, 0])
            raise LaunchError(
                f"{op}: block id -1 at position {j} without pair_ids: pass the other side's ids as "
                "pair_ids= to both pack and unpack (a position either side skips is skipped), or drop "
                "padded positions from both lists with kvtriton.plan.compact_request"
            )
        if device.type != "cpu":
            ids = ids.contiguous().pin_memory().to(device, non_blocking=True)
    elif ids.device != device:
        raise LaunchError(
            f"{op}: block ids are on {ids.device}, staging is on {device}: expected the same device or CPU"
        )
    return ids.contiguous()


def _tiles(op: str, tiles, num_tokens, n_ids: int, static: Static, device: torch.device) -> tuple[torch.Tensor, int]:
    """Check a token-mapped request's tiles (destination positions, host integers) and token
    count against the cache positions ``block_ids`` covers; the tiles on ``device``."""
    if tiles is None or num_tokens is None:
        raise LaunchError(f"{op}: a token-mapped request needs both tiles= and num_tokens=")
    if isinstance(tiles, torch.Tensor):
        if tiles.device.type != "cpu":
            raise LaunchError(f"{op}: tiles are on {tiles.device}: expected host integers (numpy, list or CPU tensor)")
        tiles = tiles.numpy()
    arr = np.asarray(tiles)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise LaunchError(f"{op}: tiles must be a 1-D sequence of integers; got {arr.dtype} with shape {arr.shape}")
    if isinstance(num_tokens, (bool, np.bool_)) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise LaunchError(f"{op}: num_tokens must be an integer >= 0; got {num_tokens!r}")
    t = int(num_tokens)
    arr = arr.astype(np.int64)
    if arr.size:
        if arr[0] < 0 or (np.diff(arr) <= 0).any() or int(arr[-1]) * static.tile_block_size >= t:
            raise LaunchError(
                f"{op}: tiles must be ascending destination positions k >= 0 with k * {static.tile_block_size} < "
                f"num_tokens={t}; got {arr[:8].tolist()}{'...' if arr.size > 8 else ''}"
            )
        if t > n_ids * static.cache_block_size:
            raise LaunchError(
                f"{op}: {n_ids} block ids of {static.cache_block_size} tokens cover {n_ids * static.cache_block_size} "
                f"tokens, fewer than num_tokens={t}: expected one id per cache position of the request"
            )
    out = torch.from_numpy(np.ascontiguousarray(arr))
    if device.type != "cpu":
        out = out.pin_memory().to(device, non_blocking=True)
    return out, t


def _check_disjoint_tiles(starts: np.ndarray, ends: np.ndarray) -> None:
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    clash = s[1:] < e[:-1]
    if clash.any():
        k = int(np.argmax(clash))
        a, b = int(order[k]), int(order[k + 1])
        raise LaunchError(
            f"pack: staging ranges of segments {a} [{int(starts[a])}, {int(ends[a])}) and {b} "
            f"[{int(starts[b])}, {int(ends[b])}) overlap: expected disjoint tiles"
        )


def _check_disjoint_heads(segments: Sequence[Segment]) -> None:
    by_stream: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for s, seg in enumerate(segments):
        by_stream.setdefault((seg.region, seg.stream), []).append((seg.dst_head, seg.dst_head + seg.num_heads, s))
    for (region, stream), spans in by_stream.items():
        spans.sort()
        for (_, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
            if b0 < a1:
                raise LaunchError(
                    f"unpack: segments {a} and {b} both write heads [{b0}, {min(a1, b1)}) of region "
                    f"{region} stream {stream}: expected disjoint head slices"
                )
