"""The global-head oracle: build sharded caches from one global KV, move them, check every byte.

Used by the tests, the benchmark and the multi-process cluster harness. A request's KV is a
*global* tensor per (region, stream): ``[n_blocks, block_size, total_heads, head_dim]`` of random
bits. Every source rank holds its heads of it at its own block ids; after a transfer every
destination block must equal the global heads its rank owns, and every byte outside the
destination blocks must be what it was before (canary check).

Between engines with different block sizes the global KV is per *token* instead
(``[num_tokens, total_heads, head_dim]``, :func:`make_global_tokens`): a source rank holds token
``t`` in block ``src_ids[t // Bs]`` at ``t % Bs`` (:func:`load_source_tokens`), and
:func:`check_destination_tokens` checks, block by block, that each wanted destination block
holds exactly its tokens below ``num_tokens`` and nothing else changed. Streams that store a
dim-major row part (``RegionSpec.dim_major``, vLLM's CPU cache: ``storage="vllm_cpu"``) are read
and written there through element indices computed from that definition (:func:`token_elements`),
independently of the views the library uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..ops.reference import pack_reference, unpack_reference
from ..plan import build_plan, compact_request, compact_tokens, direct_runs, head_range
from ..regions import Kind, Layout, Region

__all__ = [
    "RegionModel",
    "make_rank_regions",
    "random_bits",
    "make_global_kv",
    "load_source",
    "snapshot",
    "check_destination",
    "concat_global_kv",
    "local_transfer",
    "stream_bytes",
    "make_global_tokens",
    "load_source_tokens",
    "check_destination_tokens",
    "token_elements",
]


@dataclass(frozen=True)
class RegionModel:
    """A region of a model, independent of TP: what every engine's rank shards."""

    name: str
    kind: Kind
    total_heads: int
    head_dims: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def gqa(name: str, heads: int, head_dim: int, dtype=torch.bfloat16, v_head_dim: int | None = None):
        return RegionModel(name, Kind.SPLIT, heads, (head_dim, v_head_dim or head_dim), dtype)

    @staticmethod
    def mla(name: str, latent_dim: int, dtype=torch.bfloat16):
        return RegionModel(name, Kind.REPLICATE, 1, (latent_dim,), dtype)


def random_bits(shape, dtype: torch.dtype, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Fresh random bytes reinterpreted as ``dtype`` (NaN patterns included: compare bytes)."""
    item = torch.empty(0, dtype=dtype).element_size()
    n = int(np.prod(shape)) * item
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(*shape).to(device)


def make_rank_regions(
    models: Sequence[RegionModel],
    rank: int,
    tp: int,
    num_blocks: int,
    block_size: int,
    *,
    layout: Layout | str = Layout.NHD,
    storage: str = "separate",
    gen: torch.Generator,
    device="cpu",
    pad_blocks: int = 0,
) -> list[Region]:
    """Allocate (random-filled) cache tensors for ``rank`` of a ``tp``-rank engine.

    ``storage``: ``"separate"`` (K and V tensors), ``"joint"`` (``[num_blocks, 2, ...]``) or
    ``"joint0"`` (``[2, num_blocks, ...]``) or ``"vllm_cpu"`` (each single-stream SPLIT region is an
    HND K‖V stream whose first half of a row, K, is stored dim-major per (block, head) tile, as
    vLLM's CPU attention does; other regions as ``"separate"``). ``pad_blocks`` > 0 makes block
    strides larger than a block (a non-contiguous cache: every stream is a slice of a wider allocation).
    """
    layout = Layout(layout)
    regions = []
    for m in models:
        if m.kind is Kind.REPLICATE:
            d = m.head_dims[0]
            base = random_bits((num_blocks, block_size, d + pad_blocks), m.dtype, gen, device)
            regions.append(Region.mla(m.name, base[..., :d], block_size=block_size))
            continue
        h0, h1 = head_range(rank, tp, m.total_heads)
        heads = h1 - h0

        def shape(d, heads=heads):
            inner = (block_size, heads, d) if layout is Layout.NHD else (heads, block_size, d)
            return inner

        if storage == "vllm_cpu" and len(m.head_dims) == 1:
            c = m.head_dims[0]
            flat = random_bits((num_blocks, heads * block_size * c + pad_blocks), m.dtype, gen, device)
            t = flat[:, :heads * block_size * c].unflatten(1, (heads, block_size, c))
            regions.append(Region.attention(m.name, t, layout=Layout.HND, block_size=block_size,
                                            total_heads=m.total_heads, dim_major=(c // 2,)))
            continue
        if storage in ("separate", "vllm_cpu") or len(m.head_dims) != 2 or m.head_dims[0] != m.head_dims[1]:
            streams = []
            for d in m.head_dims:
                t = random_bits((num_blocks, *shape(d + pad_blocks)), m.dtype, gen, device)
                streams.append(t[..., :d])
            regions.append(Region.attention(m.name, *streams, layout=layout, block_size=block_size,
                                            total_heads=m.total_heads))
        else:
            d = m.head_dims[0]
            kv_dim = 0 if storage == "joint0" else 1
            full = [num_blocks, *shape(d + pad_blocks)]
            full.insert(kv_dim, 2)
            t = random_bits(tuple(full), m.dtype, gen, device)[..., :d]
            regions.append(Region.attention(m.name, kv=t, kv_dim=kv_dim, layout=layout,
                                            block_size=block_size, total_heads=m.total_heads))
    return regions


def make_global_kv(models: Sequence[RegionModel], n_blocks: int, block_size: int,
                   gen: torch.Generator) -> list[list[torch.Tensor]]:
    """Per region, per stream: ``[n_blocks, block_size, total_heads, head_dim]`` random bits."""
    return [
        [random_bits((n_blocks, block_size, m.total_heads, d), m.dtype, gen) for d in m.head_dims]
        for m in models
    ]


def _heads(region: Region, rank: int, tp: int) -> tuple[int, int]:
    if region.spec.kind is Kind.REPLICATE:
        return 0, region.spec.local_heads
    return head_range(rank, tp, region.spec.total_heads)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def load_source(regions: Sequence[Region], rank: int, tp: int, global_kv, block_ids) -> None:
    """Write this rank's heads of the global KV into blocks ``block_ids`` (position j <- block j;
    -1: position j is padding and goes nowhere; as an index it would hit the last block)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    keep = torch.as_tensor(np.flatnonzero(ids >= 0))
    ids_t = torch.as_tensor(ids[ids >= 0])
    for region, streams in zip(regions, global_kv):
        h0, h1 = _heads(region, rank, tp)
        for j, g in enumerate(streams):
            if region.spec.dim_major_of(j):  # write the tokens' real elements
                elems, idx = token_elements(region, j)
                elems[idx[ids_t]] = g[keep][:, :, h0:h1].to(elems.device).view(elems.dtype)
                continue
            view = _bytes(region.nhd(j))
            view[ids_t] = _bytes(g[keep][:, :, h0:h1].to(view.device))


def snapshot(regions: Sequence[Region]) -> list[list[torch.Tensor]]:
    """A byte copy of every stream (the canary reference for untouched blocks), per (block,
    token, head, byte) of the tokens' real elements (:func:`_token_bytes`)."""
    return [[_token_bytes(region, j).clone() for j in range(region.spec.num_streams)] for region in regions]


def token_elements(region: Region, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(elements, index)``: the stream's whole storage as a flat tensor of same-width integers,
    and ``index[block, token, head, d]`` (int64) the element holding that value, computed from the
    spec's definition (strides, and the ``dim_major`` in-block order) rather than from views."""
    spec, t = region.spec, region.streams[stream]
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[spec.itemsize]
    elems = torch.empty(0, dtype=word, device=t.device).set_(t.untyped_storage())
    s_blk, s_tok, s_head = spec.strides[stream]
    bs, hd, a = spec.block_size, spec.head_dims[stream], spec.dim_major_of(stream)
    blk = torch.arange(spec.num_blocks)[:, None, None, None]
    tok = torch.arange(bs)[None, :, None, None]
    head = torch.arange(spec.local_heads)[None, None, :, None]
    d = torch.arange(hd)[None, None, None, :]
    start = t.storage_offset() + blk * s_blk + head * s_head
    if a == 0:
        return elems, start + tok * s_tok + d
    return elems, start + torch.where(d < a, d * bs + tok, a * bs + tok * (hd - a) + (d - a))


def _token_bytes(region: Region, stream: int) -> torch.Tensor:
    """``[blocks, block_size, heads, row bytes]`` uint8 copy (dim-major streams) or view of the
    tokens' real rows."""
    if not region.spec.dim_major_of(stream):
        return _bytes(region.nhd(stream))
    elems, idx = token_elements(region, stream)
    return elems[idx.to(elems.device)].view(torch.uint8)


def check_destination(regions: Sequence[Region], rank: int, tp: int, global_kv, block_ids,
                      before=None) -> None:
    """Raise AssertionError (with coordinates) unless blocks ``block_ids`` hold exactly the global
    heads ``rank`` owns and, when ``before`` (a :func:`snapshot`) is given, every other byte
    equals ``before``. Position ``j`` of ``global_kv`` belongs in ``block_ids[j]`` (-1: none)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    keep = ids >= 0
    pos = torch.as_tensor(np.flatnonzero(keep))
    ids_t = torch.as_tensor(ids[keep])
    for i, (region, streams) in enumerate(zip(regions, global_kv)):
        h0, h1 = _heads(region, rank, tp)
        for j, g in enumerate(streams):
            got = _token_bytes(region, j).cpu()
            want = _bytes(g[pos][:, :, h0:h1])
            if before is None:
                got, expected = got[ids_t], want
            else:
                expected = before[i][j].cpu().clone()
                expected[ids_t] = want
            if not torch.equal(got, expected):
                bad = torch.nonzero(got != expected)
                where = "(block, token, head, byte)" if before is not None else "(position, token, head, byte)"
                raise AssertionError(
                    f"rank {rank} region {region.spec.name!r} stream {j}: {bad.shape[0]} bytes "
                    f"differ; first {where}: {bad[:5].tolist()}"
                )


def make_global_tokens(models: Sequence[RegionModel], num_tokens: int,
                       gen: torch.Generator) -> list[list[torch.Tensor]]:
    """Per region, per stream: ``[num_tokens, total_heads, head_dim]`` random bits."""
    return [[random_bits((num_tokens, m.total_heads, d), m.dtype, gen) for d in m.head_dims] for m in models]


def load_source_tokens(regions: Sequence[Region], rank: int, tp: int, global_tokens, block_ids) -> None:
    """Write this rank's heads of token ``t`` into block ``block_ids[t // block_size]`` at
    ``t % block_size`` (-1: that block's tokens are not held; the rest of a partial last block
    keeps its bytes)."""
    for region, streams in zip(regions, global_tokens):
        h0, h1 = _heads(region, rank, tp)
        bs = region.spec.block_size
        for j, g in enumerate(streams):
            if region.spec.dim_major_of(j):
                elems, idx = token_elements(region, j)
                for p, b in enumerate(np.asarray(block_ids, dtype=np.int64).tolist()):
                    part = g[p * bs:(p + 1) * bs, h0:h1]
                    if b >= 0 and part.shape[0]:
                        elems[idx[b, :part.shape[0]]] = part.to(elems.device).view(elems.dtype)
                continue
            view = _bytes(region.nhd(j))
            for p, b in enumerate(np.asarray(block_ids, dtype=np.int64).tolist()):
                part = g[p * bs:(p + 1) * bs, h0:h1]
                if b >= 0 and part.shape[0]:
                    view[b, :part.shape[0]] = _bytes(part.to(view.device))


def check_destination_tokens(regions: Sequence[Region], rank: int, tp: int, global_tokens, block_ids,
                             before=None, *, more: Sequence = ()) -> None:
    """Raise AssertionError unless block ``block_ids[k]`` (k >= 0) holds this rank's heads of tokens
    ``[k*Bd, (k+1)*Bd)`` below the request's end (``len(global_tokens)``) and, when ``before`` (a
    :func:`snapshot`) is given, every other byte of every stream equals it, the tail of a partial
    last block included. ``more``: further ``(global_tokens, block_ids)`` requests, applied in order."""
    reqs = [(global_tokens, block_ids), *more]
    for i, region in enumerate(regions):
        h0, h1 = _heads(region, rank, tp)
        bs = region.spec.block_size
        for j in range(region.spec.num_streams):
            got = _token_bytes(region, j).cpu()
            expected = (before[i][j] if before is not None else got).cpu().clone()
            mask = torch.zeros(got.shape[:2], dtype=torch.bool)
            for tokens, ids in reqs:
                g = tokens[i][j]
                for k, b in enumerate(np.asarray(ids, dtype=np.int64).tolist()):
                    part = g[k * bs:(k + 1) * bs, h0:h1]
                    if b >= 0 and part.shape[0]:
                        expected[b, :part.shape[0]] = _bytes(part)
                        mask[b, :part.shape[0]] = True
            if before is None:  # only the request's rows
                got, expected = got[mask], expected[mask]
            if not torch.equal(got, expected):
                bad = torch.nonzero(got != expected)
                raise AssertionError(
                    f"rank {rank} region {region.spec.name!r} stream {j}: {bad.shape[0]} bytes differ; "
                    f"first (block, token, head, byte): {bad[:5].tolist()}"
                )


def concat_global_kv(kvs: Sequence) -> list[list[torch.Tensor]]:
    """Several requests' global KV as one, in order (to check them against their joined ids)."""
    return [[torch.cat([kv[i][j] for kv in kvs]) for j in range(len(kvs[0][i]))] for i in range(len(kvs[0]))]


def stream_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the storage under ``t``, starting at ``t``'s first element (what a
    NIXL registration of the stream would cover; byte offsets of :class:`~kvtriton.plan.Runs` index it)."""
    storage = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return storage[t.storage_offset() * t.element_size():]


PackFn = Callable[..., torch.Tensor]


def local_transfer(
    src_ranks: Sequence[Sequence[Region]],
    dst_ranks: Sequence[Sequence[Region]],
    src_ids,
    dst_ids,
    *,
    modes=None,
    pack: PackFn = pack_reference,
    unpack: Callable[..., None] = unpack_reference,
    chunk_bytes: int | None = None,
    num_tokens: int | None = None,
) -> dict[str, int]:
    """Move one request from every source rank to every destination rank in this process,
    exactly as the NIXL path routes it (staged payloads per plan, direct runs as byte copies).
    When the block sizes differ, the request is token-mapped (``num_tokens``: see
    :func:`kvtriton.plan.compact_tokens`) and ``pack``/``unpack`` get ``tiles=``/``num_tokens=``.

    Returns counters: staged descriptors, direct descriptors, staged bytes, direct bytes.
    """
    src_tp, dst_tp = len(src_ranks), len(dst_ranks)
    src_specs = {r: [x.spec for x in regs] for r, regs in enumerate(src_ranks)}
    stats = {"staged_descs": 0, "direct_descs": 0, "staged_bytes": 0, "direct_bytes": 0}
    for d, dst_regions in enumerate(dst_ranks):
        dst_specs = [x.spec for x in dst_regions]
        plan = build_plan(d, dst_tp, dst_specs, src_tp, src_specs[0], modes=modes)
        if plan.maps_tokens:
            m = compact_tokens(src_ids, dst_ids, src_specs[0][0].num_blocks, dst_specs[0].num_blocks,
                               plan.src_block_size, plan.dst_block_size, num_tokens)
            n = m.num_tiles
        else:
            s_ids, d_ids = compact_request(src_ids, dst_ids, src_specs[0][0].num_blocks,
                                           dst_specs[0].num_blocks)
            n = s_ids.size
        for read in plan.staged:
            per_chunk = max(1, n if chunk_bytes is None else chunk_bytes // read.bytes_per_block)
            for c0 in range(0, n, per_chunk):
                c1 = min(n, c0 + per_chunk)
                staging = torch.empty(read.payload_bytes(c1 - c0), dtype=torch.uint8)
                offs = read.segment_offsets(c1 - c0)
                if plan.maps_tokens:
                    tiles = m.tiles[c0:c1]
                    pack(src_ranks[read.src_rank], read.segments, offs, torch.as_tensor(m.src_ids), staging,
                         tiles=tiles, num_tokens=m.num_tokens)
                    unpack(dst_regions, read.segments, offs, torch.as_tensor(m.dst_ids), staging,
                           tiles=tiles, num_tokens=m.num_tokens)
                else:
                    pack(src_ranks[read.src_rank], read.segments, offs, torch.as_tensor(s_ids[c0:c1]), staging)
                    unpack(dst_regions, read.segments, offs, torch.as_tensor(d_ids[c0:c1]), staging)
                stats["staged_descs"] += 1
                stats["staged_bytes"] += staging.numel()
        if plan.direct:
            runs = direct_runs(plan, src_specs, dst_specs, s_ids, d_ids)
            for k in range(len(runs)):
                src = stream_bytes(src_ranks[int(runs.src_rank[k])][int(runs.region[k])].streams[int(runs.stream[k])])
                dst = stream_bytes(dst_regions[int(runs.region[k])].streams[int(runs.stream[k])])
                so, do, nb = int(runs.src_offset[k]), int(runs.dst_offset[k]), int(runs.nbytes[k])
                dst[do:do + nb].copy_(src[so:so + nb])
            stats["direct_descs"] += len(runs)
            stats["direct_bytes"] += runs.total_bytes
    return stats

