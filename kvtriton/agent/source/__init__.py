"""The source side of a rank, composed of parts that own their state:

* :class:`~.holds.Holds`: held requests, their consumer, done, renew, the lease, freed requests;
* :class:`~.share.StagingShare`: the staging each peer engine may keep, reserving and quarantine;
* :class:`~.serves.Serves`: the open transfers, their messages, steps and end; one class per
  flow (:class:`~.flows.PullServe`, :class:`~.flows.PushServe`), each accepting its own requests;
* :class:`~.offers.Offers`: the transfers offered ahead of a pull, one home for an offer's state;
* :class:`~.eager.EagerPacks`: packs made ahead of the pull (given what it needs, no way back
  to the Source);
* :class:`~.packing.PackBatch`: the chunks of one step packed in as few launches as possible.

The :class:`Source` wires them and keeps what crosses them: opening a transfer a destination
asks for (here: the checks of who may take what, giving an :class:`~.admission.Admitted` transfer
or a :class:`~.admission.Rejection`; then its flow's class accepts it), a hold's end (its
transfers and packs go), expiry. Plans come from the rank's :class:`~..plan_book.PlanBook` (by the destination's cost
model); the per-request part of a plan is a :class:`~kvtriton.plan.RequestPlan`, made once
per request on this side: :meth:`RequestPlan.for_serve` when a pull or push arrives
(:meth:`Source.open`), :meth:`RequestPlan.for_hold` for a pack made ahead (:mod:`.eager`).

What a peer can take is bounded (every message is untrusted, even after a good handshake):
entitlement and the lease of holds are described in :mod:`.holds`; staging, time and count
bounds of transfers in :mod:`.serves` and :mod:`.share`.
"""

from __future__ import annotations

import time

import numpy as np

from ...errors import KVTritonError, PlanError, RequestRejectedError
from ...plan import RequestPayload, RequestPlan, TransferPlan, Way, group_lists
from ...protocol import wire
from ...spec import num_groups
from ..links import Flow, Links, Peer
from ..plan_book import PlanBook
from ..settings import Settings
from ..stats import Stats
from .admission import Admitted, Rejection
from .eager import EagerPacks
from .flows import Asked, PullServe, PushServe, Serve
from .holds import FreedRequest, Hold, Holds
from .packing import PackBatch
from .serves import MAX_SERVES_PER_PEER, Serves
from .share import StagingShare

__all__ = ["MAX_SERVES_PER_PEER", "FreedRequest", "Hold", "PullServe", "PushServe", "Serve", "Source"]


class Source:
    """Held requests of this rank and the transfers serving them."""

    def __init__(self, settings: Settings, links: Links, plans: PlanBook, stats: Stats):
        self.s, self.links, self.plans, self.stats = settings, links, plans, stats
        # the parts ask each other only through the callbacks given here
        self.holds = Holds(settings.rank, settings.timeout_s, links, plans, stats,
                           on_bound=lambda req, engine: self.eager.bound(req, engine))
        self.share = StagingShare(settings, links, evict=lambda engine, keep: self.eager.evict(engine, keep))
        self.batch = PackBatch(settings, stats)  # chunks reserved in this step, packed at its end
        self.serves = Serves(settings, links, stats, self.holds, self.share, self.batch,
                             take_packed=lambda *pull: self.eager.take(*pull),
                             eager_returned=lambda nslots: self.eager.returned(nslots))
        offers = self.serves.offers
        self.eager = EagerPacks(settings, links, stats, self.holds, plans, self.share, self.batch,
                                serving=self.serves.serving, offer=offers.pack, offer_runs=offers.cache,
                                withdraw_offers=offers.withdraw)

    # ------------------------------------------------------------------ holds
    def held_lists(self, req_id: str, block_ids) -> tuple[np.ndarray, ...]:
        """The held ids of each KV cache group of ``hold(req_id, block_ids)`` (a flat list holds
        those blocks in every group; else one list per group), -1 dropped; checked before
        anything is held: :class:`RequestRejectedError` on a wrong group count, ids outside
        ``[-1, num_blocks)`` or more than :data:`wire.MAX_REQUEST_BLOCKS` held in all."""
        try:
            lists = group_lists(block_ids, num_groups(self.s.specs), f"hold {req_id!r}")
        except PlanError as e:
            raise RequestRejectedError(str(e)) from None
        nb = min(s.num_blocks for s in self.s.specs)
        for g, ids in enumerate(lists):
            if ids.size and (ids.min() < -1 or ids.max() >= nb):
                where = f" group {g}:" if len(lists) > 1 else ""
                raise RequestRejectedError(f"hold {req_id!r}:{where} block ids must be in [-1, {nb}) (-1: not held), "
                                           f"got [{ids.min()}, {ids.max()}]")
        lists = tuple(ids[ids >= 0] for ids in lists)
        total = sum(ids.size for ids in lists)
        if total > wire.MAX_REQUEST_BLOCKS:
            raise RequestRejectedError(f"hold {req_id!r}: {total} blocks is more than a request may have "
                                       f"(kvtriton.protocol.wire.MAX_REQUEST_BLOCKS = {wire.MAX_REQUEST_BLOCKS})")
        return lists

    def hold(self, req_id: str, lists: tuple[np.ndarray, ...], lease_s: float, consumer: str | None,
             ready=None, pack_for: str | None = None) -> None:
        """Hold ``lists`` (:meth:`held_lists`). A hold of several KV cache groups keeps each
        group's ids (a pull reads a subset of them per group) and is not packed ahead (yet)."""
        self.eager.release(req_id)  # a hold placed again: what was packed for the old one is stale
        hold = self.holds.place(req_id, lists[0] if len(lists) == 1 else np.concatenate(lists), lease_s, consumer,
                                ready)
        hold.pack_for = pack_for
        if len(lists) > 1:
            hold.groups = lists
        else:
            self.eager.placed(hold)

    def release(self, req_id: str) -> bool:
        hold = self.holds.get(req_id)
        if hold is None:
            return False
        self._end_hold(hold, "released")
        return True

    def take_freed(self) -> list[FreedRequest]:
        """Freed holds not taken yet; needs no lock (a kept one is reported by :meth:`expire`,
        under it, once its keep passed)."""
        return self.holds.take_freed()

    def release_kept(self, now: float) -> None:
        """Report the ended holds whose keep passed by ``now`` (under the agent's lock)."""
        self.holds.release_kept(now)

    def packed_ahead(self, req_id: str) -> int:
        """Chunks of ``req_id`` packed ahead whose pack has completed (offered ones included)."""
        return self.eager.ready_chunks(req_id) + self.serves.offers.chunks(req_id)

    def busy(self) -> bool:
        """Something is held or served (or an ended hold is not reported freed yet)."""
        return bool(self.serves.by_key or self.holds.held or self.holds.kept)

    def _end_hold(self, hold: Hold, reason: str, finished_engine: str | None = None) -> None:
        """Free a held request: its packs go, its transfers are dropped (see
        :meth:`~.serves.Serves.drop_request`), then the hold ends: last, so a dropped reader of
        its blocks that may still be READing them keeps them first (:meth:`~.holds.Holds.keep_until`,
        a no-op once the hold is gone) and they are reported free only ``timeout_s`` later."""
        self.eager.release(hold.req_id)
        self.serves.drop_request(hold.req_id, reason, finished_engine)
        self.holds.end(hold, reason)

    def on_done(self, peer: Peer, m: wire.Done) -> None:
        hold = self.holds.on_done(peer, m)
        if hold is not None:
            self._end_hold(hold, "done", finished_engine=peer.md.engine)

    def on_renew(self, peer: Peer, m: wire.Renew) -> None:
        self.holds.on_renew(peer, m, offered=self.serves.offers.made_to(peer, m.req))

    # ------------------------------------------------------------------ messages of open transfers
    def on_grant(self, peer: Peer, m: wire.Grant) -> None:
        self.serves.on_grant(peer, m)

    def on_ack(self, peer: Peer, m: wire.Ack) -> None:
        self.serves.on_ack(peer, m)

    def on_runs_done(self, peer: Peer, m: wire.RunsDone) -> None:
        self.serves.on_runs_done(peer, m)

    def on_abort(self, peer: Peer, m: wire.Abort) -> None:
        self.serves.on_abort(peer, m)

    # ------------------------------------------------------------------ opening a transfer
    def on_pull(self, peer: Peer, m: wire.Pull) -> None:
        self.open(peer, m, PullServe)

    def on_push(self, peer: Peer, m: wire.Push) -> None:
        self.open(peer, m, PushServe)

    def open(self, peer: Peer, m: Asked, flow: type[Serve[Asked]]) -> None:
        """Start serving a transfer the destination asked for, or reject it with the reason: the
        source's checks (:meth:`_admit`), then its flow's own (:meth:`~.flows.Serve.accept`)."""
        try:
            admitted = self._admit(peer, m, flow.flow)
            serve = flow.accept(m, peer, admitted, self.serves)
        except Rejection as no:
            if no.refused:
                self.stats.refused += 1
            self.links.send(peer, wire.Reject(m.xid, self.links.reason(peer, no.reason)), quiet=True)
            return
        self.serves.offers.asked(serve)  # an untouched offer of the request to that rank: taken over or withdrawn
        self.serves.add(serve)
        self.holds.bind(admitted.hold, peer)  # the first accepted transfer binds an unbound hold to its engine
        peer.served_at = time.monotonic()  # an engine that reads from us is not idle (see .eager.guess)
        serve.opened(self.serves)

    def _admit(self, peer: Peer, m: wire.Pull | wire.Push, flow: Flow) -> Admitted:
        """Every check of the source, in the order their reasons are reported: who may take
        what (:meth:`_entitled`), the request against the plan both engines share
        (:meth:`_request`), the way its bytes travel (:meth:`_way`); raises :class:`Rejection`."""
        hold = self._entitled(peer, m, flow)
        ids = np.asarray(m.ids, dtype=np.int64)
        if ids.size == 0 or not np.isin(ids, hold.block_ids).all():
            raise Rejection(f"block ids of {m.req!r} are not a subset of the {hold.block_ids.size} held blocks")
        plan, r = self._request(peer, m, hold, ids)
        bounds = r.group_bounds
        if bounds is not None and not all(np.isin(ids[lo:hi], held).all()
                                          for lo, hi, held in zip(bounds, bounds[1:], hold.groups)):
            raise Rejection(f"block ids of {m.req!r} are not a subset of the held blocks of their KV cache group")
        payload, runs = r.payload(self.s.rank), r.sends_runs(self.s.rank)
        if payload is None and not runs:
            raise Rejection(f"{self.s.name} has nothing to send to {peer.md.engine}:{m.dst_rank}")
        if self._way(peer, m, r, payload).reads_source_cache:  # the peer READs our cache blocks itself
            return Admitted(hold, plan, r, ids, None, None, runs=True, reads_cache=True)
        if payload is None:
            return Admitted(hold, plan, r, ids, None, None, runs=runs, reads_cache=False)
        if not payload.chunks.fits(self.s.chunk_bytes):
            raise Rejection(f"chunk of {m.chunk_blocks} blocks does not fit staging chunks of "
                            f"{self.s.chunk_bytes} bytes")
        return Admitted(hold, plan, r, ids, payload.read, payload.chunks, runs=runs, reads_cache=False)

    def _entitled(self, peer: Peer, m: wire.Pull | wire.Push, flow: Flow) -> Hold:
        """The hold ``peer`` may open transfer ``m`` of: a fresh transfer id, this rank's flow, a
        held request bound to the peer's engine (or bindable by it), room for one more transfer."""
        me, req = self.s.name, m.req
        if (peer.agent, m.xid) in self.serves.by_key:
            raise Rejection(f"transfer id {m.xid!r} is already in use")
        if flow is not self.s.flow:
            raise Rejection(f"{me} runs in {self.s.flow.value} mode, got a {flow.value} request")
        hold = self.holds.get(req)
        if hold is None:
            raise Rejection(f"request {req!r} is not held by {me} (never held, finished or lease expired)")
        if hold.consumer is not None and hold.consumer != peer.md.engine:
            raise Rejection(f"request {req!r} is held by {me} for engine {hold.consumer!r}, not {peer.md.engine!r}",
                            refused=True)
        if hold.consumer is None and not self.links.trusted(peer):  # trust on first use, authenticated only
            raise Rejection(f"request {req!r} is not bound to an engine yet and {peer.agent} did not authenticate: "
                            "an unbound hold binds only to an authenticated engine", refused=True)
        if not self.serves.room(peer):
            raise Rejection(f"{peer.agent} already has {MAX_SERVES_PER_PEER} transfers open on {me}", refused=True)
        return hold

    def _request(self, peer: Peer, m: wire.Pull | wire.Push, hold: Hold,
                 ids: np.ndarray) -> tuple[TransferPlan, RequestPlan]:
        """The plan this rank serves ``peer`` by, checked against the one the peer planned ``m``
        with, and this side's plan of the request, made once: what the transfer is checked
        against and served by."""
        dst_rank, eng = m.dst_rank, peer.md.engine
        if dst_rank != peer.md.rank:
            raise Rejection(f"dst_rank {dst_rank} does not match the sender's rank {peer.md.rank}")
        try:
            plan = self.plans.serving(peer.md)
        except KVTritonError as e:
            raise Rejection(f"cannot plan for {eng}:{dst_rank}: {e}") from e
        if m.plan != plan.digest():
            raise Rejection(f"{eng}:{dst_rank} planned this transfer differently from {self.s.name} "
                            "(modes, cost model or replicate stripe differ between the engines)")
        if not plan.maps_tokens and (m.tiles or m.tokens):
            raise Rejection("tiles and a token count sent, but the engines' block sizes are equal")
        if len(m.groups) > 1 and len(hold.groups) != len(m.groups):
            raise Rejection(f"{m.req!r} names {len(m.groups)} KV cache groups, the hold has {max(1, len(hold.groups))}")
        try:
            r = RequestPlan.for_serve(plan, self.s.rank, ids, held_blocks=hold.block_ids.size,
                                      chunk_blocks=m.chunk_blocks, num_tokens=m.tokens, tiles=m.tiles,
                                      pair=self.plans.serving_pair(peer.md), groups=m.groups)
        except PlanError as e:
            raise Rejection(f"token map of {m.req!r}: {e}" if plan.maps_tokens else str(e)) from e
        return plan, r

    def _way(self, peer: Peer, m: wire.Pull | wire.Push, r: RequestPlan, payload: RequestPayload | None) -> Way:
        """The way this rank's payload travels: the one the pull asks (among those the plan
        allows), staged for a push."""
        target = f"{peer.md.engine}:{m.dst_rank}"
        read = payload.read if payload is not None else None
        way = m.way if isinstance(m, wire.Pull) else Way.STAGED.value
        if read is not None and way not in {w.value for w in read.ways}:
            raise Rejection(f"{target} asks for way {way!r}; the plan allows {[w.value for w in read.ways]}")
        if read is None and way != Way.STAGED.value:
            raise Rejection(f"{self.s.name} sends {target} no staged payload: way {way!r} is meaningless")
        if Way(way).reads_source_cache and (not isinstance(m, wire.Pull) or r.tokens is not None):
            raise Rejection(f"{way} is a pull of equal block sizes only")
        return Way(way)

    # ------------------------------------------------------------------ progress
    def advance(self) -> None:
        """One step: eager packs, then every transfer (announce or WRITE what was packed,
        reserve the next chunks), then pack every chunk reserved in this step in as few
        launches as their block ids allow (:mod:`.packing`: several decode ranks of one request,
        one launch) and announce or WRITE what that packed."""
        eager = self.eager
        if not (self.serves.by_key or eager.pending or eager.runs_offers or eager.unoffered or self.batch.jobs):
            return  # nothing to move (a decode rank's every call: it holds and serves nothing)
        reserved: list[Serve] = []
        try:
            self.eager.advance()
            reserved = self.serves.advance()
        finally:
            self.batch.launch()  # nothing reserved is left unpacked, whatever raised above
        self.serves.send_packed(reserved)

    def expire(self, now: float) -> None:
        self.serves.expire(now)
        self.holds.release_kept(now)
        # after: a transfer dropped above no longer keeps its hold
        for hold in self.holds.expired(now, self.serves.pulled_or_pushed()):
            self.stats.leases_expired += 1
            self._end_hold(hold, "lease_expired")

    def shift(self, seconds: float) -> None:
        self.serves.shift(seconds)
        self.holds.shift(seconds)

    def peer_lost(self, peer: Peer) -> None:
        self.eager.peer_lost(peer)
        self.serves.peer_lost(peer)

    def consumer_lost(self, peer: Peer) -> None:
        """``peer`` died (or expired): the holds still waiting for its done end now, not by lease."""
        for hold in self.holds.left_by(peer):
            self._end_hold(hold, "consumer_lost")

    def transfer_failed(self, xid: str | None, peer: Peer, error: KVTritonError) -> None:
        self.serves.transfer_failed(xid, peer, error)

    def close(self, reason: str) -> None:
        self.serves.close(reason)
