"""Mamba2 and Gated DeltaNet state as kvtriton regions: the column maps of a hybrid model's state.

A Mamba/GDN layer keeps one state page per request (not per token): a conv state (the last
``conv_kernel - 1`` inputs of every conv channel) then an SSM temporal state, in one block of the
engine's cache. TP shards both, but not by one head map:

* the conv channels are the concatenation of sub-projections of unequal width, each sharded on
  its own (Mamba2 ``x | B | C``, GDN ``q | k | v``): rank ``r`` of ``T`` holds ``x`` channels
  ``[r*X/T, (r+1)*X/T)`` then its ``B`` and ``C`` channels. When ``n_groups == 1``, vLLM gives
  every rank a whole copy of ``B`` and ``C`` (``extra_groups_for_head_shards``), at any TP: those
  parts are REPLICATE; vLLM refuses ``n_groups > 1`` that TP does not divide, and so do we;
* the SSM state is sharded by heads (GDN: by value heads).

Each sub-projection is therefore its own region whose "heads" are its channels (``total_heads``
the sub-projection's global channels, ``local_heads`` a rank's), whose "tokens" are the
``conv_kernel - 1`` conv positions and whose head_dim is 1: vLLM's DS layout ``[block, channel,
K-1]`` is then HND and its SD layout ``[block, K-1, channel]`` NHD, so the planner's head map is
the column map and the kernels' NHD<->HND transform moves DS<->SD, both unchanged. head_dim 1 is
what lets the two layouts meet (in SD a channel's positions are not adjacent; a wider row would
exist in DS only, and the engines build their regions without knowing the peer's layout). The
SSM state is one region of block_size 1, heads = SSM heads, head_dim = a head's ``head_dim x
state`` elements. A block of every one of these regions is one request's state page (its block
stride is the page stride); every region is a view into the engine's per-layer tensors.

Pure geometry (standard library only): :class:`Mamba2State`, :class:`GDNState`,
:meth:`~Mamba2State.conv_parts`, :func:`state_specs` (the regions' specs without tensors, for
``kvtriton plan``) and :func:`nixl_connector_conv_reads` (the conv reads vLLM's NixlConnector
posts, for comparison and to show its ``n_groups == 1`` defect). :func:`state_regions` binds the
regions to an engine's tensors (it imports torch when called).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import RegionError, TopologyError
from .spec import DTYPE_ITEMSIZE, MAX_GROUPS, Kind, Layout, RegionSpec

if TYPE_CHECKING:
    import torch

    from .regions import Region

__all__ = ["CONV_LAYOUTS", "ConvPart", "Mamba2State", "GDNState", "StateModel", "ConvRead", "state_specs",
           "state_regions", "state_region_names", "nixl_connector_conv_reads"]

#: vLLM's conv state layouts (``VLLM_SSM_CONV_STATE_LAYOUT``): DS ``[channel, K-1]``, SD ``[K-1, channel]``
CONV_LAYOUTS = ("DS", "SD")
# the layout of a conv region's [block, token=position, head=channel, 1] view in each conv layout
_CONV_REGION_LAYOUT = {"DS": Layout.HND, "SD": Layout.NHD}


@dataclass(frozen=True)
class ConvPart:
    """One sub-projection of the conv channels on one rank.

    ``channels``: the rank's channels of it (its region's ``local_heads``); ``total``: the
    region's ``total_heads`` (the model's channels of it; for REPLICATE, ``channels``);
    ``kind``: SPLIT (sharded) or REPLICATE (a whole copy on every rank); ``offset``: its first
    channel in the rank's conv row."""

    name: str
    channels: int
    total: int
    kind: Kind
    offset: int


def _positive(owner: str, **values: int) -> None:
    for key, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise RegionError(f"{owner}: {key} must be a positive integer, got {v!r}")


def _divides(owner: str, tp: int, **counts: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TopologyError(f"{owner}: tp must be a positive integer, got {tp!r}")
    for key, n in counts.items():
        if n % tp:
            raise TopologyError(f"{owner}: tp={tp} does not divide {key}={n} (vLLM shards it evenly)")


def _parts(spec: Sequence[tuple[str, int, int, Kind]]) -> tuple[ConvPart, ...]:
    out, offset = [], 0
    for name, channels, total, kind in spec:
        out.append(ConvPart(name, channels, total, kind, offset))
        offset += channels
    return tuple(out)


@dataclass(frozen=True)
class Mamba2State:
    """A Mamba2 layer's state geometry, model-global (before TP): vLLM's ``MambaMixer2``.

    ``intermediate`` = ``num_heads * head_dim`` (the ``x`` channels), ``n_groups`` groups of
    ``state_size`` channels in each of ``B`` and ``C``, conv over ``conv_kernel`` positions; SSM
    state ``[num_heads, head_dim, state_size]``.

    >>> m = Mamba2State(intermediate=8192, n_groups=1, state_size=128, conv_kernel=4, num_heads=128, head_dim=64)
    >>> [(p.name, p.channels, p.kind.value, p.offset) for p in m.conv_parts(2)]   # B, C whole on every rank
    [('x', 4096, 'split', 0), ('B', 128, 'replicate', 4096), ('C', 128, 'replicate', 4224)]
    """

    intermediate: int
    n_groups: int
    state_size: int
    conv_kernel: int
    num_heads: int
    head_dim: int

    kind_name = "mamba2"
    sub_projections = ("x", "B", "C")

    def __post_init__(self) -> None:
        _positive("Mamba2State", intermediate=self.intermediate, n_groups=self.n_groups,
                  state_size=self.state_size, conv_kernel=self.conv_kernel, num_heads=self.num_heads,
                  head_dim=self.head_dim)
        if self.intermediate != self.num_heads * self.head_dim:
            raise RegionError(f"Mamba2State: intermediate {self.intermediate} != num_heads {self.num_heads} x "
                              f"head_dim {self.head_dim}")
        if self.conv_kernel < 2:
            raise RegionError(f"Mamba2State: conv_kernel {self.conv_kernel} keeps no conv state (needs >= 2)")

    def check_tp(self, tp: int) -> None:
        """:class:`TopologyError` unless vLLM runs this layer at ``tp``: heads divide, and
        ``n_groups`` divides or is 1 (``MambaMixer2``'s own check)."""
        _divides("Mamba2State", tp, num_heads=self.num_heads)
        if self.n_groups % tp and self.n_groups != 1:
            raise TopologyError(f"Mamba2State: tp={tp} does not divide n_groups={self.n_groups}, and vLLM replicates "
                                f"B and C only when n_groups == 1")

    def conv_parts(self, tp: int) -> tuple[ConvPart, ...]:
        """``x``, ``B``, ``C`` on a rank of a ``tp``-rank engine (``B``/``C`` REPLICATE when
        ``n_groups == 1``, at any TP, so both engines agree on the kind)."""
        self.check_tp(tp)
        bc = self.n_groups * self.state_size
        b_kind, b_local = (Kind.REPLICATE, bc) if self.n_groups == 1 else (Kind.SPLIT, bc // tp)
        return _parts((("x", self.intermediate // tp, self.intermediate, Kind.SPLIT),
                       ("B", b_local, bc if b_kind is Kind.SPLIT else b_local, b_kind),
                       ("C", b_local, bc if b_kind is Kind.SPLIT else b_local, b_kind)))

    @property
    def ssm_heads(self) -> int:
        return self.num_heads

    @property
    def ssm_shape(self) -> tuple[int, int]:
        """A head's SSM state ``(head_dim, state_size)``."""
        return self.head_dim, self.state_size


@dataclass(frozen=True)
class GDNState:
    """A Gated DeltaNet layer's state geometry, model-global (before TP): vLLM's GDN attention.

    conv channels ``q | k | v``: ``num_k_heads * head_k_dim`` each for q and k,
    ``num_v_heads * head_v_dim`` for v; SSM state ``[num_v_heads, head_v_dim, head_k_dim]``."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    kind_name = "gdn"
    sub_projections = ("q", "k", "v")

    def __post_init__(self) -> None:
        _positive("GDNState", num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads,
                  head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim, conv_kernel=self.conv_kernel)
        if self.conv_kernel < 2:
            raise RegionError(f"GDNState: conv_kernel {self.conv_kernel} keeps no conv state (needs >= 2)")

    def check_tp(self, tp: int) -> None:
        """:class:`TopologyError` unless ``tp`` divides the key and value heads."""
        _divides("GDNState", tp, num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads)

    def conv_parts(self, tp: int) -> tuple[ConvPart, ...]:
        """``q``, ``k``, ``v`` on a rank of a ``tp``-rank engine (all SPLIT)."""
        self.check_tp(tp)
        key, value = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        return _parts((("q", key // tp, key, Kind.SPLIT), ("k", key // tp, key, Kind.SPLIT),
                       ("v", value // tp, value, Kind.SPLIT)))

    @property
    def ssm_heads(self) -> int:
        return self.num_v_heads

    @property
    def ssm_shape(self) -> tuple[int, int]:
        """A head's SSM state ``(head_v_dim, head_k_dim)``."""
        return self.head_v_dim, self.head_k_dim


StateModel = Mamba2State | GDNState


def conv_dim(model: StateModel, tp: int) -> int:
    """Conv channels of one rank (the conv state's channel dimension)."""
    return sum(p.channels for p in model.conv_parts(tp))


def state_region_names(name: str, model: StateModel) -> list[str]:
    """The names :func:`state_regions` gives: ``name.x``, ``name.B``, ``name.C``, ``name.ssm`` (GDN ``q k v``)."""
    return [f"{name}.{p}" for p in model.sub_projections] + [f"{name}.ssm"]


def _conv_layout(conv_layout: str) -> str:
    key = str(conv_layout).upper()
    if key not in CONV_LAYOUTS:
        raise RegionError(f"conv_layout {conv_layout!r} is not one of {CONV_LAYOUTS}")
    return key


def _with_group(spec: RegionSpec, group: int) -> RegionSpec:
    """``spec`` in KV cache group ``group`` (the engine's group holding this layer's state)."""
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < MAX_GROUPS:
        raise RegionError(f"region {spec.name!r}: group must be an int in [0, {MAX_GROUPS}), got {group!r}")
    return dataclasses.replace(spec, group=group)


def state_specs(name: str, model: StateModel, *, rank: int, tp: int, num_blocks: int, conv_dtype: str,
                ssm_dtype: str, conv_layout: str = "SD", page_bytes: int | None = None,
                group: int = 0) -> list[RegionSpec]:
    """The specs :func:`state_regions` gives for rank ``rank`` of a ``tp``-rank engine, without
    tensors: vLLM's page (conv state then SSM state, ``page_bytes`` apart from block to block;
    default: the two back to back, unpadded). ``rank`` only checks range: every rank's geometry
    is the same.

    >>> g = GDNState(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4)
    >>> specs = state_specs("l0", g, rank=0, tp=2, num_blocks=8, conv_dtype="bfloat16", ssm_dtype="bfloat16")
    >>> [(s.name, s.block_size, s.local_heads, s.head_dims[0]) for s in specs]
    [('l0.q', 3, 1024, 1), ('l0.k', 3, 1024, 1), ('l0.v', 3, 2048, 1), ('l0.ssm', 1, 16, 16384)]
    """
    layout = _conv_layout(conv_layout)
    if not 0 <= rank < tp:
        raise TopologyError(f"rank {rank} is out of range for tp={tp}")
    for dt in (conv_dtype, ssm_dtype):
        if dt not in DTYPE_ITEMSIZE:
            raise RegionError(f"{name}: unknown dtype {dt!r}")
    c_size, s_size = DTYPE_ITEMSIZE[conv_dtype], DTYPE_ITEMSIZE[ssm_dtype]
    parts = model.conv_parts(tp)
    width = sum(p.channels for p in parts)
    k1 = model.conv_kernel - 1
    heads = model.ssm_heads // tp
    row = model.ssm_shape[0] * model.ssm_shape[1]
    conv_bytes, ssm_bytes = width * k1 * c_size, heads * row * s_size
    page = conv_bytes + ssm_bytes if page_bytes is None else page_bytes
    if page < conv_bytes + ssm_bytes or page % c_size or page % s_size:
        raise RegionError(f"{name}: page_bytes {page} cannot hold a {conv_bytes}-byte conv state and a "
                          f"{ssm_bytes}-byte SSM state in whole elements")
    out = []
    for p in parts:
        tok_head = (1, k1) if layout == "DS" else (width, 1)
        out.append(RegionSpec(f"{name}.{p.name}", p.kind, _CONV_REGION_LAYOUT[layout], num_blocks, k1, p.total,
                              p.channels, (1,), conv_dtype, c_size, ((page // c_size, *tok_head),)))
    out.append(RegionSpec(f"{name}.ssm", Kind.SPLIT, Layout.NHD, num_blocks, 1, model.ssm_heads, heads, (row,),
                          ssm_dtype, s_size, ((page // s_size, heads * row, row),)))
    return [_with_group(s, group) for s in out]


def state_regions(name: str, conv: torch.Tensor, ssm: torch.Tensor, model_state: StateModel, *, tp_size: int,
                  conv_layout: str = "SD", group: int = 0) -> list[Region]:
    """One layer's state as regions ``name.x``, ``name.B``, ``name.C``, ``name.ssm`` (GDN ``.q
    .k .v .ssm``), views of the engine's tensors (never copies), in KV cache group ``group``.

    ``conv``: the layer's conv state ``[num_blocks, conv_dim_local, K-1]`` (DS) or
    ``[num_blocks, K-1, conv_dim_local]`` (SD); ``ssm``: its SSM state ``[num_blocks,
    heads_local, a, b]`` (Mamba2 ``head_dim x state_size``, GDN ``head_v_dim x head_k_dim``),
    its two inner dims dense. Any block stride (vLLM's page stride). :class:`RegionError` when a
    shape does not match ``model_state`` at ``tp_size``; :class:`TopologyError` when vLLM would
    not run the layer at ``tp_size``.
    """
    from .regions import Region

    layout = _conv_layout(conv_layout)
    parts = model_state.conv_parts(tp_size)
    width, k1 = sum(p.channels for p in parts), model_state.conv_kernel - 1
    expected_conv = (width, k1) if layout == "DS" else (k1, width)
    if conv.dim() != 3 or tuple(conv.shape[1:]) != expected_conv:
        raise RegionError(f"{name}: conv state must be [num_blocks, {expected_conv[0]}, {expected_conv[1]}] in "
                          f"{layout} at tp={tp_size}; got {tuple(conv.shape)}")
    heads = model_state.ssm_heads // tp_size
    a, b = model_state.ssm_shape
    if ssm.dim() != 4 or tuple(ssm.shape[1:]) != (heads, a, b) or ssm.shape[0] != conv.shape[0]:
        raise RegionError(f"{name}: SSM state must be [{conv.shape[0]}, {heads}, {a}, {b}] at tp={tp_size}; "
                          f"got {tuple(ssm.shape)}")
    if ssm.stride(3) != 1 or ssm.stride(2) != b:
        raise RegionError(f"{name}: an SSM head's [{a}, {b}] state must be dense; strides {tuple(ssm.stride())}")
    regions = []
    for p in parts:
        if layout == "DS":
            view = conv[:, p.offset:p.offset + p.channels, :].unsqueeze(-1)  # [blocks, channel, position, 1]
        else:
            view = conv[:, :, p.offset:p.offset + p.channels].unsqueeze(-1)  # [blocks, position, channel, 1]
        regions.append(Region.from_view(f"{name}.{p.name}", view, kind=p.kind, layout=_CONV_REGION_LAYOUT[layout],
                                        block_size=k1, total_heads=p.total))
    nb, s0, s1 = ssm.shape[0], ssm.stride(0), ssm.stride(1)
    flat = ssm.as_strided((nb, 1, heads, a * b), (s0, heads * s1, s1, 1), ssm.storage_offset())
    regions.append(Region.from_view(f"{name}.ssm", flat, kind=Kind.SPLIT, layout=Layout.NHD, block_size=1,
                                    total_heads=model_state.ssm_heads))
    return [r if r.spec == (g := _with_group(r.spec, group)) else Region(g, r.streams) for r in regions]


# ----------------------------------------------------------------------------- NixlConnector's conv reads
@dataclass(frozen=True)
class ConvRead:
    """One conv read of vLLM's NixlConnector: ``nbytes`` at ``src_offset`` of source rank
    ``src_rank``'s conv state (one page) into ``dst_offset`` of the destination's."""

    part: str
    src_rank: int
    src_offset: int
    dst_offset: int
    nbytes: int


def nixl_connector_conv_reads(model: StateModel, src_tp: int, dst_tp: int, dst_rank: int,
                              conv_itemsize: int) -> list[ConvRead]:
    """The conv-state reads destination rank ``dst_rank`` posts per Mamba/GDN layer and request
    under vLLM's NixlConnector (0.33, ``ssm_conv_transfer_utils.py``: DS layout only, TP sizes
    that divide), reproduced byte for byte, defect included: ``derive_mamba_conv_split`` takes
    ``B``/``C`` as sharded by TP (``groups_ss // tp``) even when every rank holds a whole copy
    (``n_groups == 1``), and ``remote_conv_offsets`` steps ``rank * size`` into them, so at
    ``n_groups == 1`` and a TP pair other than 1 -> 1 some reads fall on other bytes (the next
    part, or the SSM state past the conv state). :class:`TopologyError` for a pair that does not
    divide (NixlConnector refuses it).

    The split is derived as vLLM derives it: from the destination's local shapes alone."""
    if src_tp % dst_tp and dst_tp % src_tp:
        raise TopologyError(f"NixlConnector moves Mamba state only between TP sizes that divide "
                            f"(P{src_tp} -> D{dst_tp})")
    k1 = model.conv_kernel - 1
    local_conv = conv_dim(model, dst_tp)
    if isinstance(model, Mamba2State):  # vLLM: intermediate from the SSM shape, B = C from the remainder
        x_local = model.intermediate // dst_tp
        groups_ss = (local_conv * dst_tp - model.intermediate) // 2
        dims = (x_local, groups_ss // dst_tp, groups_ss // dst_tp)
    else:  # GDN: V from the SSM shape, Q = K from the remainder
        v_local = model.num_v_heads // dst_tp * model.head_v_dim
        key_local = (local_conv - v_local) // 2
        dims = (key_local, key_local, v_local)
    sizes = [d * k1 * conv_itemsize for d in dims]
    local = [sum(sizes[:i]) for i in range(len(sizes))]
    out = []
    if dst_tp >= src_tp:  # tp_ratio >= 1: one source rank, this rank's slice of each part
        ratio = dst_tp // src_tp
        src, slot = dst_rank // ratio, dst_rank % ratio
        base = 0
        for part, size, dst_off in zip(model.sub_projections, sizes, local):
            out.append(ConvRead(part, src, base + slot * size, dst_off, size))
            base += size * ratio
    else:  # tp_ratio < 0: every source rank's whole part, each a 1/ratio of ours
        ratio = src_tp // dst_tp
        for i in range(ratio):
            base = 0
            for part, size, dst_off in zip(model.sub_projections, sizes, local):
                remote = size // ratio
                out.append(ConvRead(part, dst_rank * ratio + i, base, dst_off + i * remote, remote))
                base += remote
    return out

