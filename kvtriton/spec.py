"""Region geometry without tensors: :class:`Kind`, :class:`Layout` and :class:`RegionSpec`.

Pure (standard library only): the planner (:mod:`kvtriton.plan`) and the wire format read region
geometry from here, so neither needs torch. :mod:`kvtriton.regions` binds a spec to a rank's
tensors (:class:`~kvtriton.regions.Region`) and re-exports these names; see its docstring for the
layouts and the dim-major rows a spec describes. ``dtype`` is a name (``"bfloat16"``) with its
``itemsize``: only :mod:`kvtriton.regions` turns a name into a torch dtype.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import RegionError

__all__ = ["DTYPE_ITEMSIZE", "MAX_GROUPS", "Kind", "Layout", "RegionSpec", "classify_layer", "num_groups"]

# KV cache groups a model may have (vLLM's hybrid models have a handful; the bound keeps a peer's
# metadata and messages small)
MAX_GROUPS = 64


class Kind(str, enum.Enum):
    """How a region is distributed over the TP ranks of an engine."""

    SPLIT = "split"  # KV heads sharded across ranks (GQA/MHA, sliding window)
    REPLICATE = "replicate"  # identical on every rank (MLA latent, indexer caches)


class Layout(str, enum.Enum):
    """Order of tokens and heads inside one block."""

    NHD = "NHD"  # [block, token, head, dim]
    HND = "HND"  # [block, head, token, dim]


# Every dtype name a region may declare (torch's spelling, as kvtriton.regions writes it) and its
# itemsize: a peer's metadata naming anything else,
# or another width, is refused at decode (kvtriton.protocol.wire)
# (tests/unit/test_wire.py checks the table against torch).
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "uint64": 8, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
}

# Layer types as serving frameworks name them; anything else must be classified explicitly.
_LAYER_KINDS = {
    "attention": Kind.SPLIT,
    "mha": Kind.SPLIT,
    "gqa": Kind.SPLIT,
    "mqa": Kind.SPLIT,
    "sliding_window": Kind.SPLIT,
    "mla": Kind.REPLICATE,
    "indexer": Kind.REPLICATE,
    "replicated": Kind.REPLICATE,
}


def classify_layer(layer_type: str) -> Kind:
    """Map a layer's attention type (``"gqa"``, ``"mla"``, ...) to its transfer kind."""
    try:
        return _LAYER_KINDS[layer_type.lower()]
    except KeyError:
        raise RegionError(
            f"unknown layer type {layer_type!r}: expected one of {sorted(_LAYER_KINDS)}"
        ) from None


@dataclass(frozen=True)
class RegionSpec:
    """Geometry of one region on one rank: pure data, no tensors.

    Attributes
    ----------
    name:        region name; both engines must list regions in the same order with equal names.
    kind:        :class:`Kind`.
    layout:      :class:`Layout` of every stream of this region on this rank.
    num_blocks:  blocks in this rank's cache (may differ between engines).
    block_size:  tokens per block.
    total_heads: KV heads of the whole model for this region (global; 1 for an MLA latent).
    local_heads: heads held by this rank (``total_heads`` for REPLICATE).
    head_dims:   elements per head row, one entry per stream (K and V may differ).
    dtype:       dtype name (torch's spelling), e.g. ``"bfloat16"``; kernels move bits, so any width works.
    itemsize:    bytes per element.
    strides:     per stream, element strides ``(block, token, head)`` of the logical
                 ``[block, token, head, dim]`` indexing (the dim stride is 1).
    dim_major:   per stream, how many leading elements of a token's row the engine stores
                 dim-major at the start of each (block, head) tile (see :mod:`kvtriton.regions`;
                 vLLM's CPU attention: ``head_size``, its K). ``()`` = 0 for every stream (plain
                 token-major rows). Whole blocks move as opaque tiles either way; a block-size
                 change regroups the real tokens.
    group:       the engine's KV cache group this region belongs to (vLLM's
                 ``kv_cache_config.kv_cache_groups`` index; 0 for a model of one group). A
                 request brings one list of block ids per group and a region moves only its
                 group's positions; both engines must agree on it per region.
    """

    name: str
    kind: Kind
    layout: Layout
    num_blocks: int
    block_size: int
    total_heads: int
    local_heads: int
    head_dims: tuple[int, ...]
    dtype: str
    itemsize: int
    strides: tuple[tuple[int, int, int], ...]
    dim_major: tuple[int, ...] = ()
    group: int = 0

    @property
    def num_streams(self) -> int:
        return len(self.head_dims)

    @property
    def token_major(self) -> bool:
        """True when every stream's logical rows are the tokens' real rows (no dim-major part)."""
        return not any(self.dim_major)

    def dim_major_of(self, stream: int) -> int:
        """Leading elements of a row of ``stream`` stored dim-major (0: token-major)."""
        return self.dim_major[stream] if self.dim_major else 0

    def dim_major_problem(self) -> str | None:
        """Why ``dim_major`` does not describe this geometry (``None``: it does)."""
        if self.dim_major and len(self.dim_major) != self.num_streams:
            return f"dim_major has {len(self.dim_major)} entries for {self.num_streams} streams"
        for j in range(self.num_streams):
            a = self.dim_major_of(j)
            if a == 0:
                continue
            if not 0 < a <= self.head_dims[j]:
                return f"stream {j}: dim_major {a} is not in [0, head_dim={self.head_dims[j]}]"
            if self.layout is not Layout.HND or (self.block_size > 1 and self.strides[j][1] != self.head_dims[j]):
                return (f"stream {j}: a dim-major part needs an HND stream with dense head tiles (token stride = "
                        f"head_dim {self.head_dims[j]}); got {self.layout.value}, token stride {self.strides[j][1]}")
        return None

    def row_bytes(self, stream: int) -> int:
        """Bytes of one (token, head) row of ``stream``."""
        return self.head_dims[stream] * self.itemsize

    def tile_bytes(self, stream: int, num_heads: int) -> int:
        """Bytes of one block's ``block_size x num_heads x head_dim`` tile of ``stream``."""
        return self.block_size * num_heads * self.row_bytes(stream)

    def block_is_dense(self, stream: int) -> bool:
        """True when one block of ``stream`` is a single contiguous byte range."""
        _, s_tok, s_head = self.strides[stream]
        d = self.head_dims[stream]
        if self.layout is Layout.NHD:
            return (self.local_heads == 1 or s_head == d) and (
                self.block_size == 1 or s_tok == self.local_heads * d
            )
        return (self.block_size == 1 or s_tok == d) and (
            self.local_heads == 1 or s_head == self.block_size * d
        )

    def block_stride_bytes(self, stream: int) -> int:
        return self.strides[stream][0] * self.itemsize


def num_groups(specs: Sequence[RegionSpec]) -> int:
    """The KV cache groups a rank's regions span: ``1 + max(spec.group)`` (1 with no regions)."""
    return 1 + max((s.group for s in specs), default=0)
