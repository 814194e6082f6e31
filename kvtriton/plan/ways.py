"""Ways: how a staged payload travels, and the one-sided ways that skip a repack pass.

Pure (numpy). A staged payload (:class:`~kvtriton.plan.Payload`) is, per segment and request
position, one ``block_size x num_heads x head_dim`` tile in the destination's layout. When such a
tile is byte for byte one side's whole cache block, that side's repack pass is a plain copy of the
block, and a READ can do it instead:

* :data:`~kvtriton.plan.Way.READ_UNPACK` (the source's tile is its whole block: the segment
  takes every head of the source rank, same in-block order, dense blocks; typical of P_TP > D_TP):
  the destination READs the source's cache blocks, coalesced into runs of consecutive source ids,
  into its *own* staging at the offsets the packed payload would have had, then runs the usual
  unpack. The source never packs: it only confirms it holds the blocks (``RunsReady``, as for
  DIRECT runs) and frees nothing until the reader says ``RunsDone``.
* :data:`~kvtriton.plan.Way.PACK_PLACE` (the destination's tile is its whole block: the segment
  fills every head of the destination rank, dense blocks; typical of D_TP > P_TP): the source
  packs as for STAGED and announces each chunk; the destination READs the chunk's tiles straight
  into its cache blocks, one descriptor per run of consecutive destination ids, and skips unpack.

* :data:`~kvtriton.plan.Way.DIRECT_SLICE` (each segment's head slice is one contiguous range
  inside a block on both sides, :func:`direct_slice_way_problem`: head-major blocks): the
  destination READs the slices straight from the source's cache blocks into its own, one
  descriptor per (segment, block), per run where the slice is the whole block on both sides and
  both sides' ids run. No pass at all; the source packs nothing, as for READ_UNPACK. These are
  the bytes of :data:`~kvtriton.plan.Route.DIRECT_SLICE`, which the plan fixes for a region when
  a slice descriptor beats every repack whatever the runs; where it depends on the runs (a
  one-sided way with long runs can beat it, with none it cannot), the way is chosen here, per
  request.

All three are pull-only: the reader is the one who saves the pass (a push variant would need the
source to know the destination's offsets and cache strides, which a push grant does not carry).

Choice (:func:`choose_way`): feasibility is static per plan (segment geometry,
:attr:`Payload.ways`, from :func:`payload_ways`); the choice is per (request, source rank) by the
cost model with the request's real descriptor counts (one per run of consecutive ids, per
segment), since that is what one-sided reads pay for and block runs are known only per request.
One way per source rank's payload, not per region: the pull carries one decision, the source
either packs the payload or does not (a per-segment mix would need per-segment announcements and
a second payload layout), the chunking stays one geometry, and the safety rule stays the DIRECT
one (the source's cache is read only between its RunsReady, or a slot-less offer, and our
RunsDone, while it holds the blocks). The choice is the destination's (its cost model, its ids);
the source only checks that the way named is one the plan allows.

Offers: with eager packing on, a hold whose consumer would read it by READ_UNPACK (forced, or
the consumer's model on the hold's ids) is offered without slots instead of packed, so a
fetch of exactly those blocks READs at once, with no pull to the source process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..errors import PlanError
from ..spec import Layout, RegionSpec
from .cost import CostModel
from .runs import run_count, slice_descriptor_count
from .types import Payload, Segment, Way

__all__ = ["read_unpack_problem", "pack_place_problem", "direct_slice_way_problem", "head_range_problem",
           "payload_ways", "coalesces", "one_sided_descriptors", "one_sided_count", "way_descriptors", "choose_way",
           "cheapest_way"]


def _same_tile_order(spec: RegionSpec, seg: Segment) -> bool:
    return spec.layout == seg.dst_layout or seg.num_heads == 1 or seg.block_size == 1


def read_unpack_problem(seg: Segment, src: RegionSpec) -> str | None:
    """Why segment ``seg`` cannot be READ straight out of the source's cache blocks (``src``:
    the source's spec of its region), ``None`` when it can: the staged tile must be the source's
    whole block, byte for byte (all its heads, equal block size, the same in-block order, the
    block one contiguous range)."""
    where = f"region {seg.region} ({src.name!r}) stream {seg.stream}"
    if seg.src_block_size is not None:
        return f"{where}: block sizes differ ({seg.src_block_size} -> {seg.block_size})"
    if seg.src_head != 0 or seg.num_heads != src.local_heads:
        return (f"{where}: the destination takes heads [{seg.src_head}, {seg.src_head + seg.num_heads}) of the "
                f"source rank's {src.local_heads}, not the whole block")
    if not _same_tile_order(src, seg):
        return f"{where}: the source stores {src.layout.value}, the tile is {seg.dst_layout.value}"
    if not src.block_is_dense(seg.stream):
        return f"{where}: a source block is not one contiguous range (strides {src.strides[seg.stream]})"
    return None


def pack_place_problem(seg: Segment, dst: RegionSpec) -> str | None:
    """Why segment ``seg``'s staged tiles cannot be READ straight into the destination's cache
    blocks (``dst``: its spec), ``None`` when they can: the tile must be the destination's whole
    block (all its heads, equal block size, the block one contiguous range)."""
    where = f"region {seg.region} ({dst.name!r}) stream {seg.stream}"
    if seg.src_block_size is not None:
        return f"{where}: block sizes differ ({seg.src_block_size} -> {seg.block_size})"
    if seg.dst_head != 0 or seg.num_heads != dst.local_heads:
        return (f"{where}: the tile fills heads [{seg.dst_head}, {seg.dst_head + seg.num_heads}) of the "
                f"destination's {dst.local_heads}, not the whole block")
    if not dst.block_is_dense(seg.stream):
        return f"{where}: a destination block is not one contiguous range (strides {dst.strides[seg.stream]})"
    return None


def head_range_problem(x: RegionSpec, stream: int, num_heads: int, side: str) -> str | None:
    """Why ``num_heads`` adjacent heads of one block of ``x``'s ``stream`` are not one contiguous
    byte range (``None``: they are, wherever the range starts)."""
    _, s_tok, s_head = x.strides[stream]
    d, bs = x.head_dims[stream], x.block_size
    if x.layout is Layout.HND:
        ok = (bs == 1 or s_tok == d) and (num_heads == 1 or s_head == bs * d)
    else:  # token-major: heads of one token are adjacent, so only a whole block's heads (or one token) tile
        ok = (num_heads == 1 or s_head == d) and (bs == 1 or (num_heads == x.local_heads and s_tok == num_heads * d))
    if ok:
        return None
    return (f"on the {side} ({x.layout.value}, strides {x.strides[stream]} of stream {stream}) {num_heads} of "
            f"{x.local_heads} heads of a {bs}-token block are not one contiguous range")


def direct_slice_way_problem(seg: Segment, src: RegionSpec, dst: RegionSpec) -> str | None:
    """Why segment ``seg``'s head slice cannot be READ from the source's cache blocks straight into
    ours (``src``/``dst``: both sides' specs of its region), ``None`` when it can: equal block
    sizes, the same byte order inside the slice (same layout, one head or one token), and the
    slice one contiguous range inside a block on both sides (:func:`head_range_problem`)."""
    where = f"region {seg.region} ({dst.name!r}) stream {seg.stream}"
    if seg.src_block_size is not None:
        return f"{where}: block sizes differ ({seg.src_block_size} -> {seg.block_size})"
    if not _same_tile_order(src, seg):
        return f"{where}: the source stores {src.layout.value}, we store {seg.dst_layout.value}"
    problem = (head_range_problem(src, seg.stream, seg.num_heads, "source")
               or head_range_problem(dst, seg.stream, seg.num_heads, "destination"))
    return None if problem is None else f"{where}: {problem}"


def payload_ways(src_rank: int, segs: Sequence[Segment], forced_way: Mapping[int, Way],
                 src_specs: Sequence[RegionSpec], dst_specs: Sequence[RegionSpec]) -> tuple[Way, ...]:
    """The ways source rank ``src_rank``'s payload may travel: one forced way (every region in it
    that forces one must force the same, and it must be possible), else STAGED and every
    one-sided way all its segments allow. One way per payload keeps the protocol to one
    choice per (request, source rank). ``forced_way``: region -> the way ``modes=`` forced."""
    problems = {Way.STAGED: None,
                Way.READ_UNPACK: next((p for g in segs if (p := read_unpack_problem(g, src_specs[g.region]))), None),
                Way.PACK_PLACE: next((p for g in segs if (p := pack_place_problem(g, dst_specs[g.region]))), None),
                Way.DIRECT_SLICE: next((p for g in segs if (p := direct_slice_way_problem(g, src_specs[g.region],
                                                                                          dst_specs[g.region]))), None)}
    wanted = {forced_way[g.region] for g in segs if g.region in forced_way}
    if len(wanted) > 1:
        names = sorted({dst_specs[g.region].name for g in segs if g.region in forced_way})
        raise PlanError(f"regions {names} force different modes {sorted(w.value for w in wanted)} but all come from "
                        f"source rank {src_rank} in one payload, which travels one way per request; force one mode "
                        f"for every region read from that rank")
    if wanted:
        way = wanted.pop()
        if problems[way] is not None:
            raise PlanError(f"{way.value} from source rank {src_rank} is not possible: {problems[way]}; "
                            f"use staged")
        return (way,)
    return tuple(w for w in Way if problems[w] is None)


def coalesces(read: Payload, specs: Sequence[RegionSpec]) -> np.ndarray:
    """Per segment of ``read`` (bool, read-only): consecutive blocks lie back to back in the
    cache ``specs`` describes (a run is one range). Python per segment (Llama-70B's 160: ~70 us):
    a :class:`~kvtriton.plan.PairPlan` computes it once per pair, a request then pays none."""
    out = np.array([specs[g.region].block_stride_bytes(g.stream) == g.tile_bytes for g in read.segments], bool)
    out.setflags(write=False)
    return out


def one_sided_descriptors(read: Payload, specs: Sequence[RegionSpec], ids: np.ndarray,
                          chunks: int = 1) -> int:
    """How many descriptors :func:`~kvtriton.plan.tile_runs` gives for ``ids`` cut into
    ``chunks`` chunks (a chunk boundary splits a run: at most one more descriptor per
    coalescing segment)."""
    return one_sided_count(coalesces(read, specs), ids, chunks)


def one_sided_count(coal: np.ndarray, ids: np.ndarray, chunks: int = 1) -> int:
    """:func:`one_sided_descriptors` over a payload's :func:`coalesces` of the cache side."""
    ids = np.asarray(ids, dtype=np.int64)
    runs = run_count(ids)
    n_coal = int(coal.sum())
    return n_coal * (runs + max(0, chunks - 1)) + (coal.size - n_coal) * ids.size


def way_descriptors(read: Payload, way: Way, src_specs: Sequence[RegionSpec], dst_specs: Sequence[RegionSpec],
                    src_ids: np.ndarray, dst_ids: np.ndarray, chunks: int = 1) -> int:
    """Descriptors ``read``'s payload costs this request by ``way``: one per chunk (STAGED), one
    per segment and run of the cache side's ids (READ_UNPACK: the source's, PACK_PLACE: ours;
    :func:`one_sided_descriptors`), one per segment and block, or per run on both sides where a
    slice is the whole block (DIRECT_SLICE)."""
    if way is Way.READ_UNPACK:
        return one_sided_descriptors(read, src_specs, src_ids, chunks)
    if way is Way.PACK_PLACE:
        return one_sided_descriptors(read, dst_specs, dst_ids, chunks)
    if way is Way.DIRECT_SLICE:
        return slice_descriptor_count(read, src_specs, dst_specs, src_ids, dst_ids)
    return chunks


def choose_way(read: Payload, src_specs: Sequence[RegionSpec], dst_specs: Sequence[RegionSpec],
               src_ids: np.ndarray, dst_ids: np.ndarray, cost: CostModel, *, chunks: int = 1,
               packed: bool = False, cache_offered: bool = False) -> Way:
    """The way this request's payload from ``read.src_rank`` travels: the cheapest of
    ``read.ways`` by ``cost`` for this request's descriptor counts (:func:`way_descriptors`;
    ties go to the earlier of STAGED, READ_UNPACK, PACK_PLACE, DIRECT_SLICE). ``chunks``: the
    staged chunks of the payload. ``packed``: the source has packed it already (an offer), so
    the ways that read its cache instead would save nothing. ``cache_offered``: the source offered
    its cache blocks for this request, so the ways that read them start at once and the others
    pay a pull's round trip first (``cost.pull_us``). The agents choose through
    :meth:`~kvtriton.plan.PairPlan.choose_way` (the same choice over geometry computed once
    per pair); this computes the geometry on every call."""
    return cheapest_way(read, cost, int(np.asarray(dst_ids).size), chunks, packed,
                        lambda way: way_descriptors(read, way, src_specs, dst_specs, src_ids, dst_ids, chunks),
                        cache_offered=cache_offered)


def cheapest_way(read: Payload, cost: CostModel, num_blocks: int, chunks: int, packed: bool,
                 descriptors: Callable[[Way], int], *, cache_offered: bool = False) -> Way:
    """:func:`choose_way` given ``descriptors(way)``, what the request costs by each one-sided way."""
    ways = read.ways
    if len(ways) == 1:
        return ways[0]
    nbytes = read.payload_bytes(num_blocks)
    segments = len(read.segments)
    # an offer of the source's cache in hand: a way reading it goes now, any other pulls first
    pull = cost.pull_us if cache_offered and not packed else 0.0
    best, best_us = Way.STAGED, cost.staged_us(nbytes, chunks, segments=segments) + pull
    for way in ways:
        if way is Way.STAGED or (packed and way.reads_source_cache):
            continue
        us = cost.way_us(way, nbytes, descriptors(way), segments=segments, chunks=chunks)
        us += 0.0 if way.reads_source_cache else pull
        if us < best_us:
            best, best_us = way, us
    return best
