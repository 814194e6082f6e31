"""Head ownership across TP ranks, and which source ranks a destination rank reads from.

Pure Python: no torch, no devices, no NIXL.

With ``H`` KV heads and ``tp`` ranks, rank ``r`` owns

* heads ``[r*H/tp, (r+1)*H/tp)`` when ``H % tp == 0``, and
* the single head ``r*H//tp`` when ``tp % H == 0`` (each head replicated ``tp/H`` times).

A destination rank's heads are covered by intersecting its interval with the source ranks'
intervals, so any pair of valid TP sizes works (P2 -> D3 with 6 heads included), not only ratios
that divide each other. Where several source ranks hold the same heads, the choice is
deterministic and spreads destination ranks over the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import TopologyError

__all__ = ["head_range", "check_tp", "HeadSlice", "split_sources", "replicate_sources"]


def check_tp(tp: int, total_heads: int, what: str = "engine") -> None:
    """Raise :class:`TopologyError` unless ``tp`` ranks can shard ``total_heads`` heads."""
    if tp < 1 or total_heads < 1:
        raise TopologyError(f"{what}: tp={tp} and total_heads={total_heads} must both be >= 1")
    if total_heads % tp and tp % total_heads:
        raise TopologyError(
            f"{what}: tp={tp} cannot shard {total_heads} KV heads: expected tp to divide the "
            f"head count or the head count to divide tp"
        )


def head_range(rank: int, tp: int, total_heads: int) -> tuple[int, int]:
    """Global head interval ``[start, stop)`` owned by ``rank`` of a ``tp``-rank engine."""
    check_tp(tp, total_heads)
    if not 0 <= rank < tp:
        raise TopologyError(f"rank {rank} is out of range for tp={tp}")
    if total_heads % tp == 0:
        per = total_heads // tp
        return rank * per, (rank + 1) * per
    head = rank * total_heads // tp
    return head, head + 1


@dataclass(frozen=True)
class HeadSlice:
    """Heads a destination rank reads from one source rank.

    ``src_head`` and ``dst_head`` are *local* head indices (offsets inside the source's and the
    destination's shard); ``num_heads`` heads are read.
    """

    src_rank: int
    src_head: int
    dst_head: int
    num_heads: int


def split_sources(dst_rank: int, dst_tp: int, src_tp: int, total_heads: int) -> tuple[HeadSlice, ...]:
    """Head slices that cover destination ``dst_rank``'s heads, ordered by destination head.

    Each distinct source interval that overlaps the destination's is read from exactly one of
    the source ranks holding it. Among the destination ranks that need that interval, the k-th
    reads replica ``k % replicas``, so replicated source heads are read evenly.
    """
    d0, d1 = head_range(dst_rank, dst_tp, total_heads)
    intervals: dict[tuple[int, int], list[int]] = {}
    for r in range(src_tp):
        intervals.setdefault(head_range(r, src_tp, total_heads), []).append(r)
    slices = []
    for (s0, s1), replicas in sorted(intervals.items()):
        lo, hi = max(s0, d0), min(s1, d1)
        if lo >= hi:
            continue
        consumers = [
            r for r in range(dst_tp)
            if _overlaps(head_range(r, dst_tp, total_heads), (s0, s1))
        ]
        chosen = replicas[consumers.index(dst_rank) % len(replicas)]
        slices.append(HeadSlice(chosen, lo - s0, lo - d0, hi - lo))
    return tuple(slices)


def replicate_sources(dst_rank: int, dst_tp: int, src_tp: int, stripe: int | None = None) -> tuple[int, ...]:
    """Source ranks a destination rank reads a REPLICATE region from.

    Destination ranks are spread round-robin over the source replicas. With ``stripe > 1`` the
    destination splits its blocks over that many replicas; the default stripes over
    ``src_tp // dst_tp`` replicas so that every source rank serves when the source engine is
    larger than the destination engine.
    """
    if not 0 <= dst_rank < dst_tp or src_tp < 1:
        raise TopologyError(f"rank {dst_rank} is out of range for tp={dst_tp} (src tp={src_tp})")
    if stripe is None:
        stripe = max(1, src_tp // dst_tp)
    if stripe < 1:
        raise TopologyError(f"stripe must be >= 1, got {stripe}")
    ranks: list[int] = []
    for i in range(min(stripe, src_tp)):
        r = (dst_rank + i * dst_tp) % src_tp
        if r not in ranks:
            ranks.append(r)
    return tuple(ranks)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])
