"""The planner: what a destination rank reads, from whom, and where the bytes go.

Pure: numpy and the standard library only (plus :mod:`kvtriton.errors` and the torch-free
:mod:`kvtriton.spec`); no torch, no devices, no NIXL. Modules, in dependency order:

* :mod:`~kvtriton.plan.types`: :class:`Route` (per region: STAGED or DIRECT), :class:`Way` (per
  payload and request: STAGED, READ_UNPACK, PACK_PLACE), :class:`Segment`, :class:`Payload`,
  :class:`ChunkGeometry`, :class:`TransferPlan`, the staged wire layout and :func:`ceil_div`;
* :mod:`~kvtriton.plan.cost`: the :class:`CostModel` choices are made by;
* :mod:`~kvtriton.plan.topology`: head ownership and which source ranks hold which heads;
* :mod:`~kvtriton.plan.runs`: :class:`Runs`, the one descriptor table of coalesced block-id runs
  (DIRECT and one-sided), and descriptor counts;
* :mod:`~kvtriton.plan.ways`: one-sided feasibility and the per-request choice of a way;
* :mod:`~kvtriton.plan.pair`: :class:`PairPlan`, the geometry of one (source rank,
  destination rank) pair every request between them needs, made once when the peer is added;
* :mod:`~kvtriton.plan.ids`: a request's block ids checked and compacted, per KV cache group
  (one list per group, concatenated in group order);
* :mod:`~kvtriton.plan.request`: the per-request plan (:class:`RequestPlan`), token maps between
  block sizes, and the source ranks a destination needs;
* :mod:`~kvtriton.plan.build`: the validation gate, the one parser of ``modes=`` and
  :func:`build_plan`.
"""

from __future__ import annotations

from collections.abc import Iterator

from .build import ForcedModes, ModesArg, build_plan, check_compatible, direct_slice_problem, parse_modes
from .cost import CostModel
from .ids import compact_groups, compact_request, group_lists, one_list
from .pair import PairPlan
from .request import (
    OfferTerms,
    RequestPayload,
    RequestPlan,
    TokenMap,
    compact_tokens,
    done_ranks,
    ids_digest,
    meeting_ranks,
    required_source_ranks,
    source_positions,
)
from .runs import (
    BlockRows,
    Runs,
    direct_block_rows,
    direct_runs,
    id_runs,
    pair_runs,
    slice_block_rows,
    slice_descriptor_count,
    slice_runs,
    staged_descriptor_count,
    tile_runs,
)
from .topology import HeadSlice, check_tp, head_range, replicate_sources, split_sources
from .types import (
    STAGED_LAYOUT_VERSION,
    ChunkGeometry,
    DirectRead,
    Payload,
    Route,
    Segment,
    TransferPlan,
    Way,
    ceil_div,
)
from .ways import (
    choose_way,
    direct_slice_way_problem,
    one_sided_descriptors,
    pack_place_problem,
    payload_ways,
    read_unpack_problem,
    way_descriptors,
)

__all__ = [
    "STAGED_LAYOUT_VERSION", "ceil_div", "Route", "Way", "Segment", "Payload", "ChunkGeometry", "DirectRead",
    "TransferPlan", "CostModel", "PairPlan", "Runs", "BlockRows", "id_runs",
    "pair_runs", "direct_runs", "direct_block_rows",
    "tile_runs", "slice_runs", "slice_block_rows", "slice_descriptor_count", "staged_descriptor_count",
    "read_unpack_problem", "pack_place_problem",
    "direct_slice_way_problem", "payload_ways", "one_sided_descriptors", "way_descriptors", "choose_way", "TokenMap",
    "compact_tokens", "compact_request", "source_positions",
    "required_source_ranks", "done_ranks", "meeting_ranks", "RequestPlan", "RequestPayload", "OfferTerms", "ids_digest",
    "group_lists", "one_list", "compact_groups",
    "HeadSlice", "check_tp", "head_range", "replicate_sources", "split_sources",
    "ForcedModes", "ModesArg", "parse_modes", "check_compatible", "build_plan", "direct_slice_problem",
    # release 0.1's public names, kept for one release (nothing in kvtriton uses them)
    "Mode", "StagedRead",
]


# ----------------------------------------------------------------- release 0.1's names, for one release
# Users of 0.1 may say Mode (in `modes=`) or StagedRead. `Mode` was one enum for the region's route
# and the payload's way; here it is a namespace over Route and Way
# whose members ARE theirs, so `plan.modes[i] is Mode.DIRECT` and `way is Mode.READ_UNPACK` keep
# holding, `Mode("staged")` still parses, and isinstance(x, Mode) accepts a Route or a Way.
class _ModeNames(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, (Route, Way))

    def __call__(cls, value: object) -> Route | Way:
        for m in _ModeNames.__iter__(cls):
            if m == value:
                return m
        raise ValueError(f"{value!r} is not a valid Mode")

    def __iter__(cls) -> Iterator[Route | Way]:
        return iter((Route.STAGED, Route.DIRECT, Way.READ_UNPACK, Way.PACK_PLACE))


class Mode(metaclass=_ModeNames):
    """Release 0.1's name for a region's :class:`Route` or a payload's :class:`Way` (kept for one
    release; ``modes=`` takes Route and Way members or their strings)."""

    STAGED = Route.STAGED
    DIRECT = Route.DIRECT
    READ_UNPACK = Way.READ_UNPACK
    PACK_PLACE = Way.PACK_PLACE


StagedRead = Payload  # release 0.1's name of Payload
