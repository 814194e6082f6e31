"""The one place a rank's plans are made.

A plan pairs one destination rank with one source engine; both engines must compute the same
one (a pull carries its digest, the source rejects another). The destination plans by its own
cost model, and its model travels in its metadata, so a source plans every transfer it serves a
peer by *that peer's* model: with ``cost_model: "measured"`` two hosts' models differ, and a
plan made with the source's own model would be another plan (DIRECT where the peer reads
STAGED, or the reverse). Serving, warming up and judging holds all ask :meth:`PlanBook.serving`,
keyed by (engine, rank, the peer's cost model): a rank that reconnects with another model is
planned again.

The plans this rank reads by (as a destination, one per source engine, by its own cost model)
are made and kept here too: :meth:`PlanBook.plan_reading` makes one when a peer's metadata is
added, :meth:`PlanBook.keep_reading` keeps it once the peer is connected, and a fetch asks
:meth:`PlanBook.read_by` (``TransferAgent.plan_for`` is that plan).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import IncompatibleRemoteError, KVTritonError, PlanError
from ..plan import CostModel, PairPlan, TransferPlan, Way, build_plan
from ..protocol import wire
from ..regions import RegionSpec
from .settings import Settings, one_sided_forced

__all__ = ["PlanBook"]


class PlanBook:
    """This rank's plans: those it serves its peers by, and those it reads from peers by."""

    def __init__(self, settings: Settings):
        self.s = settings
        self.served: dict[tuple[str, int, CostModel | None], TransferPlan] = {}  # (engine, rank, its model) -> plan
        self.reads: dict[str, TransferPlan] = {}  # source engine -> the plan this rank reads it by
        self.unreadable: dict[str, PlanError] = {}  # source engines a forced mode rules out reading from
        # the pairs' plans (PairPlan), one per peer rank: (engine, rank) -> the pair it is served by, and
        # (engine, source rank) -> the pair read by; each kept with the metadata it was made from (a peer
        # that registers again, with another cost model say, replaces its entry)
        self.served_pairs: dict[tuple[str, int], tuple[wire.RankMetadata, PairPlan]] = {}
        self.read_pairs: dict[tuple[str, int], tuple[wire.RankMetadata, PairPlan]] = {}
        self._own: TransferPlan | None = None

    def serving(self, md: wire.RankMetadata, rank: int | None = None) -> TransferPlan:
        """The plan of transfers from this rank to the rank ``md`` describes (or to rank
        ``rank`` of its engine, which shares its geometry), by ``md``'s cost model; made once
        per (engine, rank, model). Raises KVTritonError when the pair cannot be planned."""
        rank = md.rank if rank is None else rank
        key = (md.engine, rank, md.cost)
        plan = self.served.get(key)
        if plan is None:
            plan = self._build(rank, md.tp, md.regions, self.s.tp, self.s.specs, md.cost or self.s.cost)
            check_reach(plan, md, source=self.s.cache_registered, destination=bool(md.addrs and all(md.addrs)))
            self.served[key] = plan
        return plan

    def serving_pair(self, md: wire.RankMetadata) -> PairPlan:
        """The :class:`~kvtriton.plan.PairPlan` of this rank serving the rank ``md`` describes
        (:meth:`serving`'s plan, the peer's cost model choosing its ways): made once per peer.
        Raises KVTritonError when the pair cannot be planned."""
        key = (md.engine, md.rank)
        got = self.served_pairs.get(key)
        if got is not None and got[0] is md:
            return got[1]
        pair = PairPlan(self.serving(md), self.s.rank, self.s.specs, md.regions, md.cost or CostModel())
        self.served_pairs[key] = (md, pair)
        return pair

    def reading_pair(self, md: wire.RankMetadata) -> PairPlan:
        """The :class:`~kvtriton.plan.PairPlan` of this rank reading from the source rank ``md``
        describes, by the plan kept for its engine (:meth:`read_by`) and this rank's cost model:
        made once per peer (again when the peer or the engine's plan changed)."""
        key = (md.engine, md.rank)
        plan = self.read_by(md.engine)
        got = self.read_pairs.get(key)
        if got is not None and got[0] is md and got[1].plan is plan:
            return got[1]
        pair = PairPlan(plan, md.rank, md.regions, self.s.specs, self.s.cost)
        self.read_pairs[key] = (md, pair)
        return pair

    def reading(self, md: wire.RankMetadata) -> TransferPlan:
        """The plan this rank reads from ``md``'s engine by, by this rank's own cost model: the
        one kept for that engine, else a new one (kept by :meth:`keep_reading`). Raises
        KVTritonError."""
        plan = self.reads.get(md.engine)
        if plan is None:
            plan = self._build(self.s.rank, self.s.tp, self.s.specs, md.tp, md.regions, self.s.cost)
        check_reach(plan, md, source=bool(md.addrs and all(md.addrs)), destination=self.s.cache_registered)
        return plan

    def plan_reading(self, md: wire.RankMetadata) -> TransferPlan | PlanError:
        """:meth:`reading`, except that a forced one-sided mode is a property of one direction
        (read_unpack needs source ranks with no more heads than ours): when it rules out reading
        from the peer but not the peer reading from us (a prefill rank meeting its decode
        engine), the error is returned, for a fetch from that engine to raise."""
        try:
            return self.reading(md)
        except PlanError as e:
            if not one_sided_forced(self.s.modes):
                raise
            try:
                self.serving(md)
            except KVTritonError:
                raise e from None
            return e

    def keep_reading(self, engine: str, plan: TransferPlan | PlanError) -> None:
        """Keep what :meth:`plan_reading` gave for ``engine`` (its peer is connected now)."""
        if isinstance(plan, PlanError):
            self.unreadable[engine] = plan
        else:
            self.reads[engine] = plan

    def read_by(self, engine: str) -> TransferPlan:
        """The plan this rank reads from ``engine`` by: :class:`PlanError` when a forced mode
        rules it out, KeyError when the engine was never added."""
        plan = self.reads.get(engine)
        if plan is None and engine in self.unreadable:
            raise PlanError(f"cannot fetch from {engine!r}: {self.unreadable[engine]}")
        if plan is None:
            raise KeyError(f"unknown engine {engine!r}: add_remote() its ranks first")
        return plan

    def own_geometry(self) -> TransferPlan:
        """The plan of a peer with this rank's own geometry and model (same TP, same regions):
        what warmup compiles before any peer is known."""
        if self._own is None:
            s = self.s
            self._own = self._build(s.rank, s.tp, s.specs, s.tp, s.specs, s.cost)
        return self._own

    def _build(self, dst_rank: int, dst_tp: int, dst_specs: Sequence[RegionSpec], src_tp: int,
               src_specs: Sequence[RegionSpec], cost: CostModel) -> TransferPlan:
        return build_plan(dst_rank, dst_tp, dst_specs, src_tp, src_specs, modes=self.s.modes, cost=cost,
                          replicate_stripe=self.s.stripe)


def check_reach(plan: TransferPlan, md: wire.RankMetadata, *, source: bool, destination: bool) -> None:
    """Refuse a plan that would reach a cache NIXL does not expose (``register="staging"``, see
    docs/security.md): a DIRECT region and a DIRECT_SLICE way touch both caches, a READ_UNPACK way
    the source's, a PACK_PLACE way the destination's. ``source``/``destination``: whether that side's cache is
    registered (for the peer: whether its metadata carries cache addresses).
    :class:`~kvtriton.errors.IncompatibleRemoteError` naming the option and what needed it."""
    needs = []
    for i, route in enumerate(plan.routes):
        if route.zero_copy:
            needs.append((f"region {i} is {route.value}", True, True))
    for payload in plan.staged:
        if Way.READ_UNPACK in payload.ways:
            needs.append((f"source rank {payload.src_rank}'s payload may travel read_unpack", True, False))
        if Way.PACK_PLACE in payload.ways:
            needs.append((f"source rank {payload.src_rank}'s payload may travel pack_place", False, True))
        if Way.DIRECT_SLICE in payload.ways:
            needs.append((f"source rank {payload.src_rank}'s payload may travel direct_slice", True, True))
    for what, src, dst in needs:
        for side, needed, exposed in (("source", src, source), ("destination", dst, destination)):
            if needed and not exposed:
                raise IncompatibleRemoteError(
                    f"engine {md.engine!r} rank {md.rank}: {what}, which reaches the {side}'s cache, but that "
                    f"cache is not registered (register='staging'); expected both engines built with the same "
                    f"register= (with 'staging' every region is STAGED)")
