"""What every fetch from one source engine reads by, gathered once per engine.

A fetch needs the engine's plan, each source rank's peer and pair plan, the chunk cap of each
staged payload and the block counts its ids are checked below. None of it depends on the
request, and gathering it was a tenth of a small fetch's host time (``bench/fetch_phases.py``),
so it is kept per engine (:class:`EngineReads`) until the plan or a source rank's peer changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ...errors import PlanError
from ...plan import PairPlan, RequestPayload, TransferPlan
from ..links import Peer

#: source engines whose reads a destination keeps (more than any deployment reads from; the oldest goes)
MAX_ENGINES = 64


@dataclass(eq=False)
class EngineReads:
    """What every fetch from ``engine`` reads by, valid while :meth:`current`.

    ``peers`` and ``pairs``: per source rank of ``plan``, its peer and the
    :class:`~kvtriton.plan.PairPlan` it is read by; ``caps``: per source rank with a staged
    payload, the chunk cap it fits (the smaller of both sides' staging chunks); ``checked``: the
    (source, destination) block counts every id is checked below (the fewest blocks of any
    region of the source ranks read, and of ours); ``fitted``: each request size's payloads,
    fitted to ``caps`` (``RequestPlan.for_fetch``'s ``fitted``)."""

    engine: str
    plan: TransferPlan
    peers: dict[int, Peer]
    pairs: dict[int, PairPlan]
    caps: dict[int, int]
    checked: tuple[int, int]
    fitted: dict[tuple[int, ...], Mapping[int, RequestPayload]] = field(default_factory=dict)

    def current(self, plan: TransferPlan, table: dict[tuple[str, int], Peer]) -> bool:
        """Whether this is still what a fetch reads by: the same plan, and every source rank still
        the same peer in the peer ``table`` (a rank met again is a new :class:`Peer`, with new
        metadata: caps, pairs and block counts are made again from it)."""
        return plan is self.plan and all(table.get((self.engine, r)) is p for r, p in self.peers.items())

    @classmethod
    def gather(cls, engine: str, plan: TransferPlan, peers: dict[int, Peer], pairs: dict[int, PairPlan],
               chunk_bytes: int, dst_num_blocks: int) -> EngineReads:
        """``engine``'s reads by ``plan`` from ``peers`` (every source rank of the plan met) and
        their ``pairs``, this rank staging chunks of at most ``chunk_bytes``."""
        if not peers:
            raise PlanError(f"the plan reads nothing from engine {engine!r}: no source rank")
        caps = {s.src_rank: min(chunk_bytes, peers[s.src_rank].md.staging.chunk_bytes) for s in plan.staged}
        src_blocks = min((s.num_blocks for p in peers.values() for s in p.md.regions), default=0)
        return cls(engine, plan, peers, pairs, caps, (src_blocks, dst_num_blocks))
