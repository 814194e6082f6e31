"""KV regions: what a paged KV tensor looks like, and how it moves (SPLIT or REPLICATE).

A *region* is one paged KV tensor (or K/V pair) with uniform geometry: one layer's cache, or a
group of layers sharing storage. It has one or more *streams* (K and V, or a single MLA latent),
each viewed as a 4-D tensor in the region's layout:

* ``NHD``: ``[num_blocks, block_size, num_heads, head_dim]`` (token-major inside a block)
* ``HND``: ``[num_blocks, num_heads, block_size, head_dim]`` (head-major inside a block)

Streams may be separate tensors or views into one joint tensor (``[num_blocks, 2, ...]`` or
``[2, num_blocks, ...]``); the block stride is whatever the tensor has (never assumed dense).
The innermost (``head_dim``) stride must be 1.

Some engines order a block's bytes otherwise behind that token-shaped view: vLLM's CPU
attention stores, per (block, head), K *dim-major* (``[head_dim_k, block_size]``, token
innermost) followed by V token-major (``[block_size, head_dim_v]``), inside a K‖V stream whose
logical rows are ``head_dim_k + head_dim_v`` wide. A stream's ``dim_major`` entry ``a`` says so
precisely: in an HND stream whose head tiles are dense (token stride = ``head_dim``), element
``d < a`` of token ``t`` lies at ``d * block_size + t`` of the head tile, element ``d >= a`` at
``a * block_size + t * (head_dim - a) + (d - a)``. ``a = 0`` (the default) is the plain
token-major tile. :func:`token_parts` gives the real per-token views of such a stream.

:class:`RegionSpec` is the pure, serialisable geometry (it travels in handshake metadata; it lives,
with :class:`Kind` and :class:`Layout`, in the torch-free :mod:`kvtriton.spec`, re-exported here);
:class:`Region` binds a spec to the rank's tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import RegionError
from .spec import MAX_GROUPS, Kind, Layout, RegionSpec, classify_layer

__all__ = ["Kind", "Layout", "RegionSpec", "Region", "classify_layer", "dtype_from_name", "token_parts"]


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises :class:`RegionError` for unknown names."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RegionError(f"unknown dtype name {name!r}")
    return dtype


@dataclass(frozen=True, eq=False)
class Region:
    """A :class:`RegionSpec` bound to this rank's tensors.

    ``streams[i]`` is a view (never a copy) of stream ``i`` in the region's layout:
    ``[num_blocks, block_size, local_heads, head_dim]`` for NHD,
    ``[num_blocks, local_heads, block_size, head_dim]`` for HND.
    """

    spec: RegionSpec
    streams: tuple[torch.Tensor, ...]

    # ------------------------------------------------------------------ builders
    @classmethod
    def attention(
        cls,
        name: str,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        kv: torch.Tensor | None = None,
        kv_dim: int = 1,
        layout: Layout | str = Layout.NHD,
        block_size: int,
        total_heads: int,
        kind: Kind | str = Kind.SPLIT,
        dim_major: Sequence[int] = (),
        group: int = 0,
    ) -> Region:
        """A GQA/MHA region: K and V as separate tensors, or one joint tensor.

        Parameters
        ----------
        k, v:        separate streams, each ``[num_blocks, block_size, heads, head_dim]`` (NHD)
                     or ``[num_blocks, heads, block_size, head_dim]`` (HND); V may have its own
                     head_dim.
        kv:          joint storage instead of ``k``/``v``: the NHD/HND shape with an extra
                     dimension of size 2 at ``kv_dim`` (0: ``[2, num_blocks, ...]``,
                     1: ``[num_blocks, 2, ...]``).
        block_size:  tokens per block (disambiguates NHD from HND shapes).
        total_heads: the model's KV heads for this layer (global, before TP sharding).
        dim_major:   per stream, the leading row elements the engine stores dim-major inside each
                     (block, head) tile (vLLM's CPU attention: ``(head_size,)`` for its K‖V
                     stream; HND with dense head tiles only; see :class:`RegionSpec`).
        group:       the engine's KV cache group of this layer (:attr:`RegionSpec.group`).

        Example
        -------
        >>> k = torch.zeros(64, 16, 2, 128, dtype=torch.bfloat16)  # 64 blocks, NHD, 2 local heads
        >>> r = Region.attention("layer.0", k, k.clone(), block_size=16, total_heads=8)
        >>> r.spec.local_heads, r.spec.num_streams
        (2, 2)
        """
        layout = _layout(name, layout)
        if kv is not None:
            if k is not None or v is not None:
                raise RegionError(f"region {name!r}: pass either kv= or k/v, not both")
            if kv_dim not in (0, 1) or kv.dim() != 5 or kv.shape[kv_dim] != 2:
                raise RegionError(
                    f"region {name!r}: joint kv must be 5-D with size 2 at kv_dim={kv_dim} "
                    f"(e.g. [num_blocks, 2, block_size, heads, head_dim]); got {tuple(kv.shape)}"
                )
            streams = (kv.select(kv_dim, 0), kv.select(kv_dim, 1))
        else:
            if k is None:
                raise RegionError(f"region {name!r}: no tensors given (k/v or kv=)")
            streams = (k,) if v is None else (k, v)
        return cls._build(name, Kind(kind), layout, streams, block_size, total_heads, dim_major, group)

    @classmethod
    def mla(cls, name: str, latent: torch.Tensor, *, block_size: int,
            kind: Kind | str = Kind.REPLICATE, group: int = 0) -> Region:
        """An MLA latent (or indexer) cache ``[num_blocks, block_size, head_dim]``, identical on
        every rank: one stream, one "head"; ``group``: its KV cache group (:attr:`RegionSpec.group`)."""
        if latent.dim() != 3:
            raise RegionError(
                f"region {name!r}: MLA cache must be [num_blocks, block_size, head_dim]; "
                f"got {tuple(latent.shape)}"
            )
        return cls._build(name, Kind(kind), Layout.NHD, (latent.unsqueeze(2),), block_size, 1, group=group)

    @classmethod
    def from_view(cls, name: str, view: torch.Tensor, *, kind: Kind | str, layout: Layout | str, block_size: int,
                  total_heads: int) -> Region:
        """A one-stream region given as its 4-D view in ``layout`` (checked as every builder's
        streams are): how :func:`kvtriton.hybrid.state_regions` binds a state part, whose "heads"
        are conv channels or SSM heads."""
        return cls._build(name, Kind(kind), _layout(name, layout), (view,), block_size, total_heads)

    @classmethod
    def _build(cls, name, kind, layout, streams: Sequence[torch.Tensor], block_size: int,
               total_heads: int, dim_major: Sequence[int] = (), group: int = 0) -> Region:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < MAX_GROUPS:
            raise RegionError(f"region {name!r}: group must be an int in [0, {MAX_GROUPS}), got {group!r}")
        first = streams[0]
        for i, t in enumerate(streams):
            if not isinstance(t, torch.Tensor):
                raise RegionError(f"region {name!r}: stream {i} is not a tensor")
            if t.dim() != 4:
                raise RegionError(
                    f"region {name!r}: stream {i} must be 4-D in layout {layout.value} "
                    f"({_shape_doc(layout)}); got {tuple(t.shape)}"
                )
            if t.dtype != first.dtype or t.device != first.device:
                raise RegionError(
                    f"region {name!r}: stream {i} is {t.dtype} on {t.device}, stream 0 is "
                    f"{first.dtype} on {first.device}; all streams must match"
                )
            if t.stride(-1) != 1:
                raise RegionError(
                    f"region {name!r}: stream {i} head_dim stride is {t.stride(-1)}, expected 1 "
                    "(kvtriton never makes a hidden contiguous copy of a cache)"
                )
        tok_dim, head_dim_ix = (1, 2) if layout is Layout.NHD else (2, 1)
        nb, heads = first.shape[0], first.shape[head_dim_ix]
        for i, t in enumerate(streams):
            expected = [nb, None, None, t.shape[3]]
            expected[tok_dim], expected[head_dim_ix] = block_size, heads
            if list(t.shape) != expected:
                raise RegionError(
                    f"region {name!r}: stream {i} has shape {tuple(t.shape)}, expected "
                    f"{tuple(expected)} for layout {layout.value} ({_shape_doc(layout)}) with "
                    f"block_size={block_size}"
                )
        if total_heads < 1 or heads < 1 or block_size < 1:
            raise RegionError(
                f"region {name!r}: block_size, heads and total_heads must be >= 1 "
                f"(got {block_size}, {heads}, {total_heads})"
            )
        if kind is Kind.REPLICATE and heads != total_heads:
            raise RegionError(
                f"region {name!r}: a REPLICATE region holds every head on every rank; "
                f"tensor has {heads} heads, total_heads={total_heads}"
            )
        if kind is Kind.SPLIT and heads > total_heads:
            raise RegionError(
                f"region {name!r}: tensor has {heads} local heads, more than total_heads="
                f"{total_heads}"
            )
        strides = tuple(
            (t.stride(0), t.stride(tok_dim), t.stride(head_dim_ix)) for t in streams
        )
        spec = RegionSpec(
            name=name, kind=kind, layout=layout, num_blocks=int(nb), block_size=int(block_size),
            total_heads=int(total_heads), local_heads=int(heads),
            head_dims=tuple(int(t.shape[3]) for t in streams),
            dtype=str(first.dtype).removeprefix("torch."), itemsize=first.element_size(),
            strides=strides, dim_major=tuple(int(a) for a in dim_major) if any(dim_major) else (),
            group=group,
        )
        problem = spec.dim_major_problem()
        if problem is not None:
            raise RegionError(f"region {name!r}: {problem}")
        return cls(spec=spec, streams=tuple(streams))

    # ------------------------------------------------------------------ views
    def nhd(self, stream: int) -> torch.Tensor:
        """Stream ``stream`` as a ``[num_blocks, block_size, heads, head_dim]`` view."""
        t = self.streams[stream]
        return t if self.spec.layout is Layout.NHD else t.transpose(1, 2)

    @property
    def device(self) -> torch.device:
        return self.streams[0].device


def token_parts(hnd: torch.Tensor, dim_major: int) -> list[tuple[int, torch.Tensor]]:
    """The tokens' real elements of an HND stream ``[blocks, heads, block_size, head_dim]``
    whose first ``dim_major`` row elements are stored dim-major per (block, head) tile.

    Returns ``[(d0, view)]``: each ``view`` is ``[blocks, block_size, heads, width]`` (NHD
    indexing) of row elements ``[d0, d0 + width)``; together they cover the row. ``dim_major=0``
    gives the plain view. Views share ``hnd``'s storage (no copy); the dim-major part's innermost
    stride is ``block_size``, so it cannot be reinterpreted as a wider dtype.
    """
    nhd = hnd.transpose(1, 2)
    if dim_major == 0:
        return [(0, nhd)]
    nb, heads, bs, hd = hnd.shape
    s_blk, s_head, s_tok, _ = hnd.stride()
    if bs > 1 and s_tok != hd:
        raise RegionError(f"a dim-major part needs dense head tiles (token stride {hd}); got {s_tok}")
    base = hnd.storage_offset()
    k = hnd.as_strided((nb, bs, heads, dim_major), (s_blk, 1, s_head, bs), base)
    rest = hd - dim_major
    if rest == 0:
        return [(0, k)]
    v = hnd.as_strided((nb, bs, heads, rest), (s_blk, rest, s_head, 1), base + dim_major * bs)
    return [(0, k), (dim_major, v)]


def _layout(name: str, layout: Layout | str) -> Layout:
    try:
        return Layout(layout.value if isinstance(layout, Layout) else str(layout).upper())
    except ValueError:
        raise RegionError(f"region {name!r}: unknown layout {layout!r}, expected NHD or HND") from None


def _shape_doc(layout: Layout) -> str:
    return ("[num_blocks, block_size, heads, head_dim]" if layout is Layout.NHD
            else "[num_blocks, heads, block_size, head_dim]")
