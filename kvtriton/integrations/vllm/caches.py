"""vLLM's KV cache tensors as kvtriton :class:`~kvtriton.regions.Region` s: views, never copies.

What ``register_kv_caches`` hands a connector, per attention layer (no vLLM import here):

* vLLM >= 0.26 (RFC #42082): a 4-D logical ``[num_blocks, heads, block_size, content]`` view with K
  and V of one (head, token) side by side in ``content`` (``head_size + head_size_v``). Its
  physical order is the group's layout: ``LBHNC`` (head-major blocks), ``LBNHC`` (token-major),
  or a block-outermost layout (``BLHNC``/``BLNHC``/``BHLNC``) where one block row holds every
  layer's page, so the block stride exceeds the page (padding is allowed too).
* Older releases: a 5-D ``[2, num_blocks, block_size, heads, head_size]`` (K/V outermost) or
  ``[num_blocks, 2, block_size, heads, head_size]`` tensor, physical order by its strides.
* MLA: ``[num_blocks, block_size, head_size]``, or the 4-D view with one head and key only.
* Mamba/GDN (hybrid models): a raw ``[num_blocks, 1, 1, page_bytes]`` int8 page view per layer
  (vLLM 0.32's CPU build; the layer unpacks it, :func:`state_views` the same way, from the group's
  ``MambaSpec.shapes``/``dtypes``), or a list ``[conv_state, ssm_state]``; one block per request
  (conv ``[num_blocks, conv_dim/TP, K-1]`` in vLLM's DS layout, ``[num_blocks, K-1, conv_dim/TP]``
  in SD; SSM ``[num_blocks, heads/TP, head_dim, state]``), every layer a view of the one backing
  allocation the attention layers view too. They become state regions
  (:func:`kvtriton.hybrid.state_regions`: one per conv sub-projection and one for the SSM state).

With vLLM's hybrid KV cache manager each layer belongs to a KV cache group; its regions carry the
group's index (``groups``), so a request's per-group block lists reach the right regions.

A K‖V row stays **one stream**: in a head-major cache one head of one block is then a single
contiguous tile (K and V together) instead of two strided halves. The layout given to kvtriton
is the *physical* one (read from the strides), so a head-major cache packs and unpacks as whole
tiles and homogeneous transfers can go zero-copy.

Example
-------
>>> import torch
>>> cache = torch.zeros(64, 2, 32, 2 * 64)                # [blocks, heads, block_size, K||V], LBHNC
>>> [r] = regions_from_vllm_caches({"model.layers.0.self_attn.attn": cache}, block_size=32,
...                                total_kv_heads=4)
>>> r.spec.layout.value, r.spec.local_heads, r.spec.head_dims, r.streams[0].data_ptr() == cache.data_ptr()
('HND', 2, (128,), True)
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import replace

import torch

from ...errors import RegionError
from ...regions import Kind, Layout, Region

__all__ = ["regions_from_vllm_caches", "layer_sort_key", "state_geometry", "state_views"]


def layer_sort_key(name: str) -> tuple:
    """Model order of layer names: ``...layers.10...`` after ``...layers.9...`` (numbers compare
    as numbers), so both engines list regions identically whatever order the dict has."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def regions_from_vllm_caches(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    block_size: int,
    total_kv_heads: int,
    mla_layers: Collection[str] = (),
    k_dim_major: bool = False,
    groups: Mapping[str, int] | None = None,
    state: object | None = None,
    tp_size: int = 1,
    conv_layout: str = "SD",
    state_pages: Mapping[str, tuple] | None = None,
    block_sizes: Mapping[str, int] | None = None,
) -> list[Region]:
    """One :class:`Region` per layer, in model order, viewing vLLM's own tensors.

    Parameters
    ----------
    kv_caches:      ``register_kv_caches``' argument: layer name -> cache tensor (shapes above).
    block_size:     tokens per block of the engine's cache.
    total_kv_heads: the model's KV heads (before TP sharding) for attention layers.
    mla_layers:     names of MLA (latent) layers: REPLICATE regions, key only.
    k_dim_major:    the attention backend fills each (block, head) tile of the 4-D view as
                    ``[K: head_size x block_size (dim-major) | V: block_size x head_size]`` (vLLM's
                    CPU attention, its CPU build's only GQA backend; the connector sets it for CPU
                    caches): the regions then say so (``RegionSpec.dim_major``), so whole blocks
                    move as tiles and a block-size change regroups the real tokens. Needs
                    head-major caches.
    groups:         layer name -> its KV cache group (vLLM's ``kv_cache_groups`` index); a layer
                    not named is in group 0 (an engine without hybrid groups).
    state:          the model's Mamba2/GDN geometry (:func:`state_geometry`) when some layers'
                    caches are ``[conv, ssm]`` state lists; ``tp_size`` and ``conv_layout``
                    (``"SD"``/``"DS"``, vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``) describe them.
    state_pages:    layer name -> ``(shapes, dtypes)`` of its ``MambaSpec``, for state layers
                    whose cache is a raw page view (:func:`state_views`).
    block_sizes:    layer name -> tokens per block of its group where it is not ``block_size``
                    (vLLM raises a hybrid model's attention block size to match its state pages).

    Raises :class:`~kvtriton.errors.RegionError` for a tensor of any other shape, naming the layer
    and the shapes accepted.
    """
    mla = set(mla_layers)
    unknown = mla - set(kv_caches)
    if unknown:
        raise RegionError(f"mla_layers names layers without a cache: {sorted(unknown)}")
    groups = groups or {}
    regions: list[Region] = []
    for name in sorted(kv_caches, key=layer_sort_key):
        t = kv_caches[name]
        group = int(groups.get(name, 0))
        if state_pages and name in state_pages:  # a Mamba/GDN layer's raw pages
            t = state_views(t, *state_pages[name])
        if isinstance(t, (list, tuple)):  # a Mamba/GDN layer: [conv state, SSM state]
            regions.extend(_state_regions(name, t, state, tp_size, conv_layout, group))
        elif name in mla:
            regions.append(_with_group(_mla_region(name, t, int((block_sizes or {}).get(name, block_size))), group))
        else:
            bs = int((block_sizes or {}).get(name, block_size))
            regions.append(_with_group(_attention_region(name, t, bs, total_kv_heads, k_dim_major), group))
    return regions


def state_views(pages: torch.Tensor, shapes, dtypes) -> list[torch.Tensor]:
    """A Mamba/GDN layer's states (conv, SSM) as views of its raw ``[num_blocks, 1, 1, page_bytes]``
    int8 page view: each block's bytes hold the states one after the other, each of ``shape`` and
    ``dtype`` (``MambaSpec.shapes``/``dtypes``), as vLLM's Mamba layers unpack them
    (``MambaBase.bind_kv_cache``). Views, never copies."""
    if pages.dim() != 4 or pages.shape[1:3] != (1, 1) or pages.element_size() != 1:
        raise RegionError(f"a state page view must be [num_blocks, 1, 1, page_bytes] of bytes; got "
                          f"{tuple(pages.shape)} {pages.dtype}")
    flat = pages.flatten(1)
    out, offset = [], 0
    for shape, dtype in zip(shapes, dtypes):
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset + n > flat.shape[1]:
            raise RegionError(f"states {list(shapes)} of {list(dtypes)} do not fit a {flat.shape[1]}-byte page")
        out.append(flat[:, offset:offset + n].view(dtype).view(-1, *shape))
        offset += n
    return out


def state_geometry(hf_config):
    """The model-global state geometry of a Mamba2 or Gated DeltaNet hybrid from its Hugging Face
    config (:class:`kvtriton.hybrid.Mamba2State` / :class:`~kvtriton.hybrid.GDNState`); raises
    :class:`RegionError` for a model whose state kvtriton does not describe."""
    from ...hybrid import GDNState, Mamba2State

    c = hf_config
    if getattr(c, "linear_num_value_heads", None):  # Qwen3-Next / Qwen3.5: Gated DeltaNet
        return GDNState(num_k_heads=int(c.linear_num_key_heads), num_v_heads=int(c.linear_num_value_heads),
                        head_k_dim=int(c.linear_key_head_dim), head_v_dim=int(c.linear_value_head_dim),
                        conv_kernel=int(c.linear_conv_kernel_dim))
    # Nemotron-H / Granite-4 spell them mamba_num_heads..., Falcon-H1 mamba_n_heads...
    heads = _first(c, "mamba_num_heads", "mamba_n_heads")
    n_groups = _first(c, "n_groups", "mamba_n_groups")
    if heads and n_groups:
        head_dim = int(_first(c, "mamba_head_dim", "mamba_d_head"))
        return Mamba2State(intermediate=int(heads) * head_dim, n_groups=int(n_groups),
                           state_size=int(_first(c, "ssm_state_size", "mamba_d_state")),
                           conv_kernel=int(_first(c, "conv_kernel", "mamba_d_conv")), num_heads=int(heads),
                           head_dim=head_dim)
    raise RegionError(f"{type(c).__name__}: kvtriton knows the state of Mamba2 (Nemotron-H, Falcon-H1, Granite-4) "
                      "and Gated DeltaNet (Qwen3-Next) layers; this config names neither (mamba_num_heads and "
                      "n_groups, or linear_num_value_heads)")


def _first(config, *names):
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)


def _state_regions(name: str, tensors, state, tp_size: int, conv_layout: str, group: int) -> list[Region]:
    if state is None or len(tensors) != 2:
        raise RegionError(f"layer {name!r}: a state cache of {len(tensors)} tensors "
                          f"{[tuple(t.shape) for t in tensors]}; kvtriton moves Mamba2/GDN states "
                          "([conv, ssm]) of a model whose geometry it knows (state_geometry)")
    from ...hybrid import state_regions

    conv, ssm = tensors
    return state_regions(name, conv, ssm, state, tp_size=tp_size, conv_layout=conv_layout, group=group)


def _with_group(region: Region, group: int) -> Region:
    """``region`` in KV cache group ``group`` (``RegionSpec.group``)."""
    if group == 0:
        return region
    return Region(spec=replace(region.spec, group=group), streams=region.streams)  # RegionSpec.group (#32)


def _attention_region(name: str, t: torch.Tensor, block_size: int, total_heads: int, k_dim_major: bool) -> Region:
    if t.dim() == 4:  # [B, H, N, C]: K||V packed in C
        if t.shape[2] != block_size:
            raise RegionError(f"layer {name!r}: cache {tuple(t.shape)} is not [num_blocks, heads, block_size="
                              f"{block_size}, head_size + head_size_v]")
        # vLLM's CPU attention splits a head tile in halves (K and V of equal size)
        dim_major = (t.shape[3] // 2,) if k_dim_major else ()
        if _head_major(t.stride(1), t.stride(2), t.shape[1], t.shape[2]):
            return Region.attention(name, t, layout=Layout.HND, block_size=block_size, total_heads=total_heads,
                                    dim_major=dim_major)
        if dim_major:
            raise RegionError(f"layer {name!r}: cache {tuple(t.shape)} with strides {t.stride()} is not head-major, "
                              "but k_dim_major needs contiguous (block, head) tiles (as vLLM's CPU attention has)")
        return Region.attention(name, t.transpose(1, 2), layout=Layout.NHD, block_size=block_size,
                                total_heads=total_heads)
    if t.dim() == 5 and 2 in (t.shape[0], t.shape[1]):  # [2, B, N, H, D] or [B, 2, N, H, D]
        # K/V outermost when that axis is 2 and strides over the blocks (num_blocks == 2 is ambiguous by shape)
        kv_dim = 0 if t.shape[0] == 2 and (t.shape[1] != 2 or t.stride(0) > t.stride(1)) else 1
        if t.shape[2] != block_size:
            raise RegionError(f"layer {name!r}: cache {tuple(t.shape)} is neither [2, num_blocks, block_size, heads, "
                              f"head_size] nor [num_blocks, 2, block_size, heads, head_size] with "
                              f"block_size={block_size}")
        if _head_major(t.stride(3), t.stride(2), t.shape[3], t.shape[2]):
            return Region.attention(name, kv=t.transpose(2, 3), kv_dim=kv_dim, layout=Layout.HND,
                                    block_size=block_size, total_heads=total_heads)
        return Region.attention(name, kv=t, kv_dim=kv_dim, layout=Layout.NHD, block_size=block_size,
                                total_heads=total_heads)
    raise RegionError(f"layer {name!r}: cache of shape {tuple(t.shape)} is not a vLLM attention cache: expected "
                      "[num_blocks, heads, block_size, head_size + head_size_v] or a 5-D K/V tensor "
                      "[2, num_blocks, block_size, heads, head_size] / [num_blocks, 2, block_size, heads, head_size]")


def _mla_region(name: str, t: torch.Tensor, block_size: int) -> Region:
    if t.dim() == 3:  # [B, N, C]
        return Region.mla(name, t, block_size=block_size)
    if t.dim() == 4 and t.shape[1] == 1:  # [B, 1, N, C]: one latent "head", key only
        return Region.attention(name, t, layout=Layout.HND, block_size=block_size, total_heads=1,
                                kind=Kind.REPLICATE)
    raise RegionError(f"MLA layer {name!r}: cache of shape {tuple(t.shape)} is neither [num_blocks, block_size, "
                      "head_size] nor [num_blocks, 1, block_size, head_size]")


def _head_major(head_stride: int, token_stride: int, heads: int, tokens: int) -> bool:
    """True when heads are outer to tokens inside a block (a size-1 axis has no order)."""
    if heads == 1:
        return True
    if tokens == 1:
        return False
    return head_stride > token_stride
