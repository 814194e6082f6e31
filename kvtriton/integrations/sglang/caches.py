"""SGLang's KV pool as kvtriton regions (no SGLang import): views over the pool's memory.

SGLang hands a transfer backend its pool as raw buffers (``KVArgs``): ``kv_data_ptrs`` is every
layer's K buffer, then every layer's V buffer, each a token-major ``[size + page, heads,
head_dim]`` tensor (row 0.. a padding page), ``kv_item_lens`` the bytes of one page of a layer.
A page is a block, so page id ``p`` is block ``p`` of a ``[num_pages, page, heads, row]`` view
(NHD). The views alias SGLang's memory (nothing is copied; SGLang keeps the pool alive for the
process) and are bytes (``uint8``): the kernels move bits, so the element type only has to
match between engines, which the bootstrap already checks (``kv_cache_dtype``).

The metadata rows (``aux_data_ptrs``: CPU tensors ``[max_requests, ...]``) are viewed the same
way, one ``[rows, item_len]`` byte view per buffer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from ...regions import Region
from .settings import UnsupportedSetupError

__all__ = ["byte_view", "kv_regions", "local_heads", "aux_views"]


class _CudaBuffer:
    """A CUDA allocation described by ``__cuda_array_interface__`` (a view, owns nothing)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def byte_view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A ``uint8`` tensor over ``nbytes`` at ``ptr`` on ``device``: SGLang's memory, not a copy."""
    if nbytes <= 0 or ptr == 0:
        raise UnsupportedSetupError(f"an SGLang KV buffer at {ptr:#x} of {nbytes} bytes: expected a non-empty buffer")
    if device.type == "cuda":
        with torch.cuda.device(device):
            return torch.as_tensor(_CudaBuffer(ptr, nbytes), device=device)
    if device.type != "cpu":
        raise UnsupportedSetupError(f"KV buffers on {device.type}: expected cpu or cuda")
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def local_heads(total_heads: int, tp: int) -> int:
    """KV heads of one rank as SGLang's MHA pool holds them (replicated when ``tp > heads``)."""
    return max(1, total_heads // tp)


def kv_regions(ptrs: Sequence[int], data_lens: Sequence[int], item_lens: Sequence[int], *, page_size: int,
               heads: int, total_heads: int, device: torch.device) -> list[Region]:
    """One SPLIT region per layer over the K and V buffers SGLang registered (K of every layer,
    then V of every layer, as ``get_contiguous_buf_infos`` lists them)."""
    n = len(ptrs)
    if n == 0 or n % 2 or not len(data_lens) == len(item_lens) == n:
        raise UnsupportedSetupError(f"SGLang listed {n} KV buffers ({len(data_lens)} lengths, {len(item_lens)} page "
                                    f"sizes): expected K and V of every layer (an even, equal count)")
    layers = n // 2
    regions = []
    for layer in range(layers):
        views = []
        for i in (layer, layers + layer):
            item, nbytes = int(item_lens[i]), int(data_lens[i])
            if item <= 0 or nbytes % item or item % (page_size * heads):
                raise UnsupportedSetupError(
                    f"KV buffer {i} (layer {layer}): {nbytes} bytes in pages of {item} bytes; expected whole pages "
                    f"of {page_size} tokens x {heads} heads (a token-major MHA pool)")
            row = item // (page_size * heads)
            views.append(byte_view(int(ptrs[i]), nbytes, device).view(nbytes // item, page_size, heads, row))
        regions.append(Region.attention(f"layer.{layer}", views[0], views[1], layout="NHD", block_size=page_size,
                                        total_heads=total_heads))
    return regions


def aux_views(ptrs: Sequence[int], data_lens: Sequence[int], item_lens: Sequence[int]) -> list[torch.Tensor]:
    """``[rows, item_len]`` byte views of SGLang's metadata buffers (CPU)."""
    out = []
    for ptr, nbytes, item in zip(ptrs, data_lens, item_lens):
        nbytes, item = int(nbytes), int(item)
        if item <= 0 or nbytes % item:
            raise UnsupportedSetupError(f"a metadata buffer of {nbytes} bytes in rows of {item}: expected whole rows")
        out.append(byte_view(int(ptr), nbytes, torch.device("cpu")).view(nbytes // item, item))
    return out
