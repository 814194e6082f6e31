"""Planning: the validation gate, the one parser of ``modes=``, and :func:`build_plan`.

Pure (numpy and the standard library). A :class:`~kvtriton.plan.TransferPlan` is built once per
(destination rank, source engine) at handshake; both sides compute it from the same metadata, so
the source knows what to pack for each destination. Block-size changes: the two engines may page
their caches with different block sizes (one per engine); the payload is then one tile per moved
*destination* position in the destination's paging (see :mod:`kvtriton.plan.request` for the
token maps), and every region is STAGED (DIRECT needs a run of blocks to be the same run of
tokens on both sides).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import IncompatibleRemoteError, PlanError
from ..spec import Kind, RegionSpec, num_groups
from .cost import CostModel
from .topology import HeadSlice, check_tp, head_range, replicate_sources, split_sources
from .types import DirectRead, Payload, Route, Segment, TransferPlan, Way
from .ways import head_range_problem, pack_place_problem, payload_ways, read_unpack_problem

__all__ = ["ForcedModes", "parse_modes", "check_compatible", "build_plan", "direct_slice_problem"]

# what `modes=` may force for a region, by value, in the order error messages list them
_FORCIBLE: dict[str, Route | Way] = {"staged": Way.STAGED, "direct": Route.DIRECT,
                                     "direct_slice": Route.DIRECT_SLICE,
                                     "read_unpack": Way.READ_UNPACK, "pack_place": Way.PACK_PLACE}
ModesArg = Route | Way | str | Mapping[str, Route | Way | str] | None
_DEFAULT_COST = CostModel()  # immutable: one shared default


@dataclass(frozen=True)
class ForcedModes:
    """What a ``modes=`` argument forces, parsed once (:func:`parse_modes`).

    ``every``: one mode for every region, or ``by_name``: one per region name (in the order
    given); neither: nothing forced. A forced mode is :data:`Route.DIRECT`,
    :data:`Route.DIRECT_SLICE` (REPLICATE regions forced to it go :data:`Route.DIRECT`) or a :class:`Way`
    (which implies :data:`Route.STAGED`; forcing ``"staged"`` is :data:`Way.STAGED`: pack, READ,
    unpack only)."""

    every: Route | Way | None = None
    by_name: tuple[tuple[str, Route | Way], ...] | None = None

    def for_regions(self, specs: Sequence[RegionSpec]) -> dict[str, Route | Way]:
        """Region name -> forced mode; :class:`PlanError` when a name is not one of ``specs``'."""
        if self.every is not None:
            return {s.name: self.every for s in specs}
        if self.by_name is None:
            return {}
        names = {s.name for s in specs}
        unknown = {n for n, _ in self.by_name} - names
        if unknown:
            raise PlanError(f"modes name unknown regions {sorted(unknown)}; regions are {sorted(names)}")
        return dict(self.by_name)

    def one_sided(self) -> list[str]:
        """The one-sided ways forced (pull only), by value, each once, in the order given."""
        values = [self.every] if self.every is not None else [m for _, m in self.by_name or ()]
        out: list[str] = []
        for m in values:
            if m in (Way.READ_UNPACK, Way.PACK_PLACE) and m.value not in out:
                out.append(m.value)
        return out

    def canonical(self) -> str:
        """The setting as one string both engines compare at handshake (``"all:auto"``,
        ``"all:direct"``, ``"l0=read_unpack,l1=staged"``; ``"none"`` for an empty mapping)."""
        if self.by_name is None:
            return "all:" + ("auto" if self.every is None else self.every.value)
        return ",".join(f"{k}={m.value}" for k, m in sorted(self.by_name)) or "none"


def _forcible(value: object, modes: object) -> Route | Way:
    """One forced mode of ``modes``: a :class:`Route`/:class:`Way` (or any enum member, by value) or its value."""
    if isinstance(value, (Route, Way)):
        if value is Way.DIRECT_SLICE:  # forced, a slice is the same for every request: the plan-time route
            return Route.DIRECT_SLICE
        return Way.STAGED if value is Route.STAGED else value  # forcing STAGED forces its only way
    key = getattr(value, "value", value)
    if isinstance(key, str) and key in _FORCIBLE:
        return _FORCIBLE[key]
    raise PlanError(f"unknown transfer mode in {modes!r}: expected one of {list(_FORCIBLE)}")


def parse_modes(modes: ModesArg | ForcedModes) -> ForcedModes:
    """The one parser of a ``modes=`` argument (``build_plan``, the agent's one-sided check
    and its handshake settings all read it through here): ``None`` (nothing forced), one mode
    for every region (a :class:`Route`, :class:`Way` or its value: ``"staged"``, ``"direct"``,
    ``"direct_slice"``, ``"read_unpack"``, ``"pack_place"``) or a mapping region name -> mode. :class:`PlanError`
    on an unknown mode; region names are checked against the regions by
    :meth:`ForcedModes.for_regions`.

    >>> parse_modes({"l1": "direct", "l0": "read_unpack"}).canonical()
    'l0=read_unpack,l1=direct'
    >>> parse_modes("pack_place").one_sided(), parse_modes(None).canonical()
    (['pack_place'], 'all:auto')
    """
    if isinstance(modes, ForcedModes):
        return modes
    if modes is None:
        return ForcedModes()
    if isinstance(modes, str):
        return ForcedModes(every=_forcible(modes, modes))
    if isinstance(modes, Mapping):
        return ForcedModes(by_name=tuple((str(k), _forcible(v, modes)) for k, v in modes.items()))
    raise PlanError(f"modes must be a mode or a mapping region name -> mode, got {modes!r}")


def check_compatible(
    dst_specs: Sequence[RegionSpec], dst_tp: int, src_specs: Sequence[RegionSpec], src_tp: int
) -> None:
    """Raise :class:`IncompatibleRemoteError` naming the first region that cannot be paired.

    Checks region count and order (names), kind, dtype, stream count, head_dim per stream,
    global head counts and that both TP sizes shard them, and that each side's local head count
    is what its TP size implies. Layouts may differ (the staged path converts), and so may block
    sizes, any pair, as long as each engine pages every region with one block size (a request's
    block ids are shared by all regions, so they must mean the same tokens in every region).
    """
    if len(dst_specs) != len(src_specs):
        raise IncompatibleRemoteError(
            f"region count differs: local has {len(dst_specs)} ({[s.name for s in dst_specs]}), "
            f"remote has {len(src_specs)} ({[s.name for s in src_specs]})"
        )
    for i, (d, s) in enumerate(zip(dst_specs, src_specs)):
        where = f"region {i} ({d.name!r})"

        def mismatch(what: str, local: object, remote: object, where: str = where) -> IncompatibleRemoteError:
            return IncompatibleRemoteError(f"{where}: {what} differs: local {local!r}, remote {remote!r}")

        if d.name != s.name:
            raise mismatch("name (regions must be listed in the same order)", d.name, s.name)
        if d.kind != s.kind:
            raise mismatch("kind", d.kind.value, s.kind.value)
        if d.dtype != s.dtype or d.itemsize != s.itemsize:
            raise mismatch("dtype", d.dtype, s.dtype)
        if d.head_dims != s.head_dims:
            raise mismatch("head_dim per stream", d.head_dims, s.head_dims)
        if d.total_heads != s.total_heads:
            raise mismatch("total KV heads", d.total_heads, s.total_heads)
        if d.kind is Kind.SPLIT:
            for side, tp, spec in (("local", dst_tp, d), ("remote", src_tp, s)):
                try:
                    check_tp(tp, spec.total_heads, f"{where} on the {side} engine")
                except Exception as e:
                    raise IncompatibleRemoteError(str(e)) from None
                expected = head_range(0, tp, spec.total_heads)
                if spec.local_heads != expected[1] - expected[0]:
                    raise IncompatibleRemoteError(
                        f"{where}: {side} rank holds {spec.local_heads} heads, but tp={tp} with "
                        f"{spec.total_heads} heads gives {expected[1] - expected[0]} per rank"
                    )
        elif d.local_heads != s.local_heads:
            raise mismatch("heads of a REPLICATE region", d.local_heads, s.local_heads)
    resized = any(d.block_size != s.block_size for d, s in zip(dst_specs, src_specs))
    for i, (d, s) in enumerate(zip(dst_specs, src_specs)):
        for side, spec in (("local", d), ("remote", s)):
            problem = spec.dim_major_problem()
            if problem is not None:
                raise IncompatibleRemoteError(f"region {i} ({d.name!r}) on the {side} engine: {problem}")
        if not resized and any(d.dim_major_of(j) != s.dim_major_of(j) for j in range(d.num_streams)):
            # whole blocks move as opaque tiles: both must order a block's bytes alike
            raise IncompatibleRemoteError(
                f"region {i} ({d.name!r}): the in-block order differs (dim-major row elements per stream: "
                f"local {[d.dim_major_of(j) for j in range(d.num_streams)]}, remote "
                f"{[s.dim_major_of(j) for j in range(s.num_streams)]}) and the block sizes are equal "
                f"({d.block_size}): whole blocks cannot be reordered; expected the same order on both engines"
            )
    if resized:
        for side, specs in (("local", dst_specs), ("remote", src_specs)):
            sizes = {x.block_size for x in specs}
            if len(sizes) > 1:
                per_region = {x.name: x.block_size for x in specs}
                raise IncompatibleRemoteError(
                    f"block_size differs between the engines (local {dst_specs[0].block_size}, remote "
                    f"{src_specs[0].block_size} in region 0) and the {side} engine pages its regions with "
                    f"several block sizes {per_region}: a block-size change needs one block size per engine"
                )


def _block_sizes(dst_specs: Sequence[RegionSpec], src_specs: Sequence[RegionSpec]) -> tuple[int | None, int | None]:
    """``(source, destination)`` block sizes when they differ (one per engine), else ``(None, None)``."""
    if not dst_specs or all(d.block_size == s.block_size for d, s in zip(dst_specs, src_specs)):
        return None, None
    return src_specs[0].block_size, dst_specs[0].block_size


def build_plan(
    dst_rank: int,
    dst_tp: int,
    dst_specs: Sequence[RegionSpec],
    src_tp: int,
    src_specs: Sequence[RegionSpec],
    *,
    modes: ModesArg | ForcedModes = None,
    cost: CostModel = _DEFAULT_COST,
    replicate_stripe: int | None = None,
) -> TransferPlan:
    """Plan what ``dst_rank`` (of a ``dst_tp`` engine) reads from a ``src_tp`` engine.

    ``modes`` forces a mode for every region or per region name (a mapping; see
    :func:`parse_modes`); otherwise REPLICATE regions go DIRECT (zero-copy), SPLIT regions go
    STAGED unless the slice
    is a whole block in the same layout and the cost model prefers DIRECT. A forced DIRECT that
    is impossible (partial heads, other layout, non-dense blocks, different block sizes) raises
    :class:`PlanError`. A STAGED region travels in its source rank's payload, whose way
    (:attr:`Payload.ways`: STAGED, or the one-sided READ_UNPACK / PACK_PLACE where every
    segment allows it) the destination chooses per request; forcing READ_UNPACK or PACK_PLACE
    (``plan.modes[i]`` is then that way) leaves only that way and raises :class:`PlanError` naming
    the segment when impossible, or when regions of one source rank's payload force different
    ways; forcing STAGED leaves only the pack-READ-unpack way. With different block sizes every
    region is STAGED (REPLICATE ones from their first replica) and each segment's tiles are
    ``dst block_size`` tokens gathered from ``src_block_size``-token source blocks.

    DIRECT_SLICE (:data:`Route.DIRECT_SLICE`, ``modes="direct_slice"``): a SPLIT region whose
    head slice from each source rank is one contiguous range inside a block on both sides
    (:func:`direct_slice_problem`: head-major blocks, a whole source block into a head range of
    ours when P > D, a head range of the source's into our whole block when D > P, both partial
    when neither divides) moves zero-copy, one descriptor per (source rank, stream, block), or
    per run where both ranges tile their runs (the whole block). Auto picks it when each such
    descriptor costs less than repacking its bytes by the cheapest feasible way
    (:meth:`CostModel.direct_slice_wins`); forced where impossible it raises :class:`PlanError`
    saying why. A REPLICATE region forced to it goes DIRECT (its slice is the whole block).

    Example
    -------
    >>> import torch
    >>> from kvtriton.regions import Region
    >>> k = torch.zeros(8, 16, 4, 128, dtype=torch.bfloat16)       # P rank: 4 of 8 heads
    >>> kd = torch.zeros(8, 16, 2, 128, dtype=torch.bfloat16)      # D rank: 2 of 8 heads
    >>> p = Region.attention("l0", k, k.clone(), block_size=16, total_heads=8).spec
    >>> d = Region.attention("l0", kd, kd.clone(), block_size=16, total_heads=8).spec
    >>> plan = build_plan(3, 4, [d], 2, [p])    # P TP2 -> D TP4: D3 reads heads 2-3 of P1
    >>> [(s.src_rank, s.segments[0].src_head, s.segments[0].num_heads) for s in plan.staged]
    [(1, 2, 2)]
    """
    if not 0 <= dst_rank < dst_tp:
        raise PlanError(f"destination rank {dst_rank} is out of range for tp={dst_tp}")
    check_compatible(dst_specs, dst_tp, src_specs, src_tp)
    src_bs, dst_bs = _block_sizes(dst_specs, src_specs)
    forced = parse_modes(modes).for_regions(dst_specs)
    grouped = _check_groups(dst_specs, src_specs, src_bs is not None, forced)
    forced_way: dict[int, Way] = {}  # region -> the staged way forced for it
    routes: list[Route] = []
    per_source: dict[int, list[Segment]] = {}
    direct: list[DirectRead] = []
    for i, (d, s) in enumerate(zip(dst_specs, src_specs)):
        sources: tuple[int, ...] = ()
        slices: tuple[HeadSlice, ...] | None = None
        if d.kind is Kind.REPLICATE:
            sources = replicate_sources(dst_rank, dst_tp, src_tp, replicate_stripe)
        else:
            slices = split_sources(dst_rank, dst_tp, src_tp, d.total_heads)
        whole = _direct_possible(d, s, slices)
        sliced = None if slices is None else direct_slice_problem(d, s, slices)
        want = forced.get(d.name)
        if isinstance(want, Way):
            route = Route.STAGED
            forced_way[i] = want
        elif want is Route.DIRECT or (want is Route.DIRECT_SLICE and slices is None):
            route = Route.DIRECT  # a REPLICATE region forced to direct_slice: its slice is the whole block
        elif want is Route.DIRECT_SLICE:
            route = Route.DIRECT_SLICE
            if sliced is not None:
                raise PlanError(f"region {i} ({d.name!r}): direct_slice is not possible: {sliced}; use STAGED")
        elif d.kind is Kind.REPLICATE:  # auto: DIRECT when possible and cheaper, else STAGED (way chosen per request)
            route = Route.DIRECT if whole else Route.STAGED
        else:
            per_desc = min(d.tile_bytes(j, d.local_heads) for j in range(d.num_streams))
            if whole and cost.prefers_direct(per_desc):
                route = Route.DIRECT
            elif not whole and sliced is None and slices is not None and _slice_wins(i, d, s, slices, src_bs, cost):
                route = Route.DIRECT_SLICE
            else:
                route = Route.STAGED
        if route is Route.DIRECT and not whole:
            feasible_slice = slices is not None and sliced is None
            hint = "; use direct_slice (one range per block) or STAGED" if feasible_slice else "; use STAGED"
            raise PlanError(
                f"region {i} ({d.name!r}): DIRECT needs whole blocks of equal block_size with equal "
                f"layout and dense blocks on both sides (local {d.layout.value} {d.local_heads} heads "
                f"block_size {d.block_size}, remote {s.layout.value} {s.local_heads} heads block_size "
                f"{s.block_size}){hint}"
            )
        routes.append(route)
        if route is Route.DIRECT:
            direct.append(DirectRead(i, sources if slices is None else (slices[0].src_rank,), group=d.group))
            continue
        if route is Route.DIRECT_SLICE and slices is not None:  # (a REPLICATE region went DIRECT above)
            direct.append(DirectRead(i, tuple(sl.src_rank for sl in slices),
                                     tuple((sl.src_head, sl.dst_head, sl.num_heads) for sl in slices), d.group))
            continue
        if slices is None:  # staged REPLICATE: every head from the first replica
            slices = (HeadSlice(sources[0], 0, 0, d.local_heads),)
        for sl in slices:
            per_source.setdefault(sl.src_rank, []).extend(
                Segment(i, j, sl.src_head, sl.dst_head, sl.num_heads, d.head_dims[j], d.itemsize,
                        d.block_size, d.layout, src_bs, d.dim_major_of(j), d.group)
                for j in range(d.num_streams)
            )
    # several groups: the one-sided ways are for requests of one group only (yet): STAGED
    staged = tuple(Payload(r, tuple(segs), (Way.STAGED,) if grouped else
                           payload_ways(r, segs, forced_way, src_specs, dst_specs))
                   for r, segs in sorted(per_source.items()))
    return TransferPlan(dst_rank, dst_tp, src_tp, tuple(routes), staged, tuple(direct), src_bs, dst_bs,
                        forced=tuple(forced_way.get(i) for i in range(len(routes))), groups=num_groups(dst_specs))


def _check_groups(dst_specs: Sequence[RegionSpec], src_specs: Sequence[RegionSpec], resized: bool,
                  forced: Mapping[str, Route | Way]) -> bool:
    """Whether the regions span several KV cache groups; :class:`PlanError` when the engines
    disagree on a region's group, or when several groups meet what only one-group requests
    support yet (a block-size change, a forced one-sided way)."""
    for i, (d, s) in enumerate(zip(dst_specs, src_specs)):
        if d.group != s.group:
            raise PlanError(f"region {i} ({d.name!r}): KV cache group differs: local {d.group}, remote {s.group} "
                            "(both engines must put a region in the same group)")
    groups = num_groups(dst_specs)
    if groups == 1:
        return False
    if resized:
        raise PlanError(f"the engines' block sizes differ and the regions span {groups} KV cache groups: a "
                        "block-size change (token map) is supported for one group only (not yet for several)")
    one_sided = sorted(n for n, m in forced.items() if m is Way.READ_UNPACK or m is Way.PACK_PLACE)
    if one_sided:
        raise PlanError(f"regions {one_sided} force a one-sided way ({forced[one_sided[0]].value}), but the regions "
                        f"span {groups} KV cache groups: the one-sided ways are supported for one group only (not "
                        "yet for several); use staged")
    return True


def _direct_possible(d: RegionSpec, s: RegionSpec, slices: tuple[HeadSlice, ...] | None) -> bool:
    """Whole-block zero-copy needs: the slice is the whole block on both sides, the same byte
    order inside a block, every block one contiguous range on both sides, and blocks of equal
    size (so that a run of blocks is the same run of tokens on both sides)."""
    if d.block_size != s.block_size:
        return False
    if slices is not None:
        if len(slices) != 1 or slices[0].num_heads != d.local_heads or d.local_heads != s.local_heads:
            return False
    same_order = d.layout == s.layout or d.local_heads == 1 or d.block_size == 1
    dense = all(d.block_is_dense(j) and s.block_is_dense(j) for j in range(d.num_streams))
    return same_order and dense


def direct_slice_problem(d: RegionSpec, s: RegionSpec, slices: Sequence[HeadSlice]) -> str | None:
    """Why SPLIT region ``d`` (ours; ``s`` the source's spec) cannot move by
    :data:`~kvtriton.plan.Route.DIRECT_SLICE`, ``None`` when it can: equal block sizes (a run of
    blocks is the same run of tokens on both sides), and for every source rank's slice and
    stream, its heads one contiguous range inside a block on both sides, the same byte order
    inside that range (same layout, or one head, or one token: a dim-major part is per (block,
    head) tile, so whole-head tiles keep it, and both sides order it alike at equal block sizes)."""
    if d.block_size != s.block_size:
        return f"block sizes differ ({s.block_size} -> {d.block_size}): a block is not the same tokens on both sides"
    for sl in slices:
        n = sl.num_heads
        if not (d.layout == s.layout or n == 1 or d.block_size == 1):
            return (f"source rank {sl.src_rank}: the source stores {s.layout.value}, we store {d.layout.value}: "
                    f"{n} heads are not in the same order inside a block")
        for j in range(d.num_streams):
            problem = head_range_problem(s, j, n, "source") or head_range_problem(d, j, n, "destination")
            if problem is not None:
                return f"source rank {sl.src_rank}: {problem}"
    return None


def _slice_wins(region: int, d: RegionSpec, s: RegionSpec, slices: Sequence[HeadSlice], src_bs: int | None,
                cost: CostModel) -> bool:
    """Auto choice of DIRECT_SLICE for a feasible region: its descriptors (one per slice, stream
    and block: a partial slice never coalesces across blocks) are each cheaper than repacking
    their bytes by the cheapest way the region's segments allow, that way's runs counted free
    (its best case), so the choice holds for every request whatever its block runs."""
    segs = [Segment(region, j, sl.src_head, sl.dst_head, sl.num_heads, d.head_dims[j],
                    d.itemsize, d.block_size, d.layout, src_bs, d.dim_major_of(j))
            for sl in slices for j in range(d.num_streams)]
    read_unpack = all(read_unpack_problem(g, s) is None for g in segs)
    pack_place = all(pack_place_problem(g, d) is None for g in segs)
    per_desc = min(g.tile_bytes for g in segs)
    return cost.direct_slice_wins(per_desc, read_unpack=read_unpack, pack_place=pack_place)
