"""A request's block ids: checked, compacted, and per KV cache group
(:attr:`~kvtriton.spec.RegionSpec.group`).

Pure (numpy). ``hold``/``fetch`` take one flat list of ints (one list for every group, as for a
model of one group) or one list per group; :func:`group_lists` reads either, :func:`compact_groups`
checks and compacts a request group by group (the rules of
:func:`~kvtriton.plan.compact_request` in each) and concatenates the groups in group order, the
axis :class:`~kvtriton.plan.RequestPlan` and the staged layout (:mod:`kvtriton.plan.types`) use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import PlanError

__all__ = ["fragmented_ids", "IdsArg", "check_ids", "check_distinct", "compact_request", "compact_groups",
           "group_lists", "one_list", "wire_group_sizes"]

IdsArg = Sequence[int] | np.ndarray | Sequence[Sequence[int] | np.ndarray]


def fragmented_ids(num_blocks: int, run: int) -> np.ndarray:
    """Example block ids (``kvtriton plan``, hybrid models too): a request's ``num_blocks``
    positions in runs of ``run`` consecutive ids, one free block between runs (``run`` 0: one
    run); deterministic, so a plan explains the same way every time."""
    pos = np.arange(num_blocks, dtype=np.int64)
    return pos if run <= 0 else (pos // run) * (run + 1) + pos % run


def group_lists(block_ids: IdsArg, num_groups: int, what: str = "block ids") -> tuple[np.ndarray, ...]:
    """A request's block ids as one int64 array per KV cache group ``0..num_groups-1``.

    ``block_ids`` is a flat sequence of ints (one list for every group: every region moves
    those positions, as for a model of one group) or a sequence of per-group sequences, exactly
    ``num_groups`` of them (a group's list may be empty). :class:`PlanError` naming ``what`` on
    a wrong group count or entries that are not integers (nothing is checked against a cache here).

    >>> [a.tolist() for a in group_lists([[3, 4], [], [7]], 3)]
    [[3, 4], [], [7]]
    >>> [a.tolist() for a in group_lists([5, 6], 2)]
    [[5, 6], [5, 6]]
    """
    if isinstance(block_ids, np.ndarray) and block_ids.ndim <= 1 or _flat(block_ids):
        flat = _ints(block_ids, what)
        return (flat,) * num_groups
    lists = list(block_ids)
    if len(lists) != num_groups:
        raise PlanError(f"{what}: {len(lists)} group lists given, the regions span {num_groups} KV cache groups "
                        f"(one list per group 0..{num_groups - 1}, a group's list may be empty)")
    return tuple(_ints(x, f"{what} of group {g}") for g, x in enumerate(lists))


def _flat(ids: Any) -> bool:
    """Whether ``ids`` is one flat list of ints (an empty list is: one empty group)."""
    if type(ids) is list:  # the common case first (every request goes through here)
        return not ids or type(ids[0]) is int or isinstance(ids[0], np.integer)
    if isinstance(ids, np.ndarray):
        return ids.ndim <= 1
    if isinstance(ids, (str, bytes)):
        raise PlanError(f"block ids must be a sequence of ints or of per-group sequences, got {type(ids).__name__}")
    if not isinstance(ids, Sequence):  # e.g. a tensor: numpy decides
        return np.ndim(ids) <= 1
    return len(ids) == 0 or isinstance(ids[0], (int, np.integer))


def _ints(ids: Any, what: str) -> np.ndarray:
    try:
        a = np.asarray(ids)
    except (TypeError, ValueError) as e:
        raise PlanError(f"{what}: not a list of block ids ({e})") from None
    if a.size and (a.ndim != 1 or not np.issubdtype(a.dtype, np.integer)):
        raise PlanError(f"{what}: expected a flat list of integer block ids, got shape {a.shape} of {a.dtype}")
    return a.astype(np.int64, copy=False).reshape(-1)


def one_list(ids: IdsArg) -> Sequence[int] | np.ndarray:
    """The one list of a one-group request given flat or as ``[list]``."""
    if _flat(ids):
        return ids  # type: ignore[return-value]
    lists = list(ids)
    if len(lists) != 1:
        raise PlanError(f"{len(lists)} group lists given, the regions span one KV cache group")
    return lists[0]


def check_ids(src_block_ids: Sequence[int] | np.ndarray, dst_block_ids: Sequence[int] | np.ndarray,
               src_num_blocks: int, dst_num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    src = _as_int64(src_block_ids, copy=False)
    dst = _as_int64(dst_block_ids, copy=False)
    _lowest(src, src_num_blocks, "source")
    _lowest(dst, dst_num_blocks, "destination")
    return src, dst


def _as_int64(ids: Sequence[int] | np.ndarray, copy: bool) -> np.ndarray:
    """``ids`` as a flat int64 array (``copy``: always a new one, the caller's own to reuse). A
    list of ints, what engines hand over, converts item by item (``np.fromiter``, ~2x faster
    than ``np.array`` over a list; the same conversions and errors); anything else, or a list
    that is not flat, by numpy's general path."""
    if type(ids) is list:
        try:
            return np.fromiter(ids, dtype=np.int64, count=len(ids))
        except (TypeError, ValueError):
            pass  # nested lists (flattened below) or entries numpy must judge
    if copy:
        return np.array(ids, dtype=np.int64).reshape(-1)
    return np.asarray(ids, dtype=np.int64).reshape(-1)


#: a request of at most this many positions is checked on a Python list (``tolist`` and builtins): a
#: small fetch runs with its caches cold (a READ, or the engine's step, came before it), where each
#: numpy call costs a few microseconds, and these checks were a tenth of its host time
#: (bench/fetch_phases.py); above it numpy's passes are the cheaper (in a hot loop the two cost the
#: same at ~32 ids; at 64 the list path made bench/planning.py's 1k-token request 2.6 us slower)
SMALL_REQUEST = 32


def _lowest(ids: np.ndarray, num_blocks: int, name: str) -> int:
    """The lowest of ``ids`` (0 when empty), each checked in ``[-1, num_blocks)``: two reductions, no mask."""
    if not ids.size:
        return 0
    if ids.size <= SMALL_REQUEST:
        vals = ids.tolist()
        lo, hi = min(vals), max(vals)
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if lo < -1 or hi >= num_blocks:
        bad = (ids < -1) | (ids >= num_blocks)
        j = int(np.argmax(bad))
        raise PlanError(
            f"{name} block id {int(ids[j])} at position {j} is out of range: expected -1 "
            f"(skip) or 0..{num_blocks - 1}"
        )
    return lo


# a bitmap over the id space beats a sort (np.unique) unless the space dwarfs the ids
_BITMAP_SPAN = 64


def check_distinct(dst: np.ndarray, num_blocks: int | None = None) -> None:
    """:class:`PlanError` naming repeated ids of ``dst`` (ids in ``[0, num_blocks)``, checked).

    At most :data:`SMALL_REQUEST` ids: a set of their list. Else, with ``num_blocks`` given and not
    much larger than the ids, a bitmap counts distinct ids in O(ids + num_blocks) without sorting
    (a 128k-token request: ~10 us instead of ~400 us); else a sort."""
    if dst.size < 2:
        return
    if dst.size <= SMALL_REQUEST:
        if len(set(dst.tolist())) == dst.size:
            return
    elif num_blocks is not None and num_blocks <= _BITMAP_SPAN * dst.size + 4096:
        seen = np.zeros(num_blocks, dtype=np.bool_)
        seen[dst] = True
        if int(np.count_nonzero(seen)) == dst.size:
            return
    elif np.unique(dst).size == dst.size:
        return
    vals, counts = np.unique(dst, return_counts=True)
    raise PlanError(f"destination block ids repeat: {vals[counts > 1][:8].tolist()}")


def compact_request(
    src_block_ids: Sequence[int] | np.ndarray,
    dst_block_ids: Sequence[int] | np.ndarray,
    src_num_blocks: int,
    dst_num_blocks: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Check a request's block ids and drop positions that either side pads with -1.

    For engines with equal block sizes: position ``j`` of both lists holds the same tokens, and
    whole blocks move (a partial last block moves whole: the tokens past the request's end are
    whatever the source block holds). -1 on either side skips the position (the destination
    already has it, e.g. a prefix-cache hit, or the source does not hold it). With different
    block sizes use :func:`compact_tokens`.

    Returns int64 arrays of equal length. Raises :class:`PlanError` on length mismatch, ids out
    of ``[-1, num_blocks)``, or duplicate destination ids (two tiles would race for one block).
    """
    # fresh arrays: the caller may reuse its id arrays after this returns
    src = _as_int64(src_block_ids, copy=True)
    dst = _as_int64(dst_block_ids, copy=True)
    src_lo = _lowest(src, src_num_blocks, "source")
    dst_lo = _lowest(dst, dst_num_blocks, "destination")
    if src.shape != dst.shape:
        raise PlanError(f"request has {src.size} source block ids but {dst.size} destination ids")
    if src_lo < 0 or dst_lo < 0:  # a -1 somewhere (the lowest ids say so): drop those positions
        keep = (src >= 0) & (dst >= 0)
        src, dst = src[keep], dst[keep]
    check_distinct(dst, dst_num_blocks)
    return src, dst


def compact_groups(src_lists: Sequence[np.ndarray], dst_lists: Sequence[np.ndarray], src_num_blocks: int,
                   dst_num_blocks: int) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """:func:`compact_request` per KV cache group (the same rules in each: equal lengths, ids in
    range, -1 skips, destination ids distinct within the group), concatenated in group order;
    returns the ids and each group's compacted positions. :class:`PlanError` names the group."""
    src_parts, dst_parts, sizes = [], [], []
    for g, (s, d) in enumerate(zip(src_lists, dst_lists)):
        try:
            cs, cd = compact_request(s, d, src_num_blocks, dst_num_blocks)
        except PlanError as e:
            raise PlanError(f"group {g}: {e}") from None
        src_parts.append(cs)
        dst_parts.append(cd)
        sizes.append(int(cs.size))
    return np.concatenate(src_parts), np.concatenate(dst_parts), tuple(sizes)


def wire_group_sizes(plan_groups: int, groups: Sequence[int], n: int) -> tuple[int, ...]:
    """The group sizes a destination sent, checked against the plan and the ids (untrusted)."""
    if not groups:
        if plan_groups > 1:
            raise PlanError(f"the regions span {plan_groups} KV cache groups and the request names none")
        return (n,)
    sizes = tuple(int(x) for x in groups)
    if len(sizes) != plan_groups or any(x < 0 for x in sizes) or sum(sizes) != n:
        raise PlanError(f"group sizes {list(sizes)[:8]} do not fit {plan_groups} KV cache groups of {n} ids")
    return sizes
