"""The source side of a rank, composed of parts that own their state:

* :class:`~.holds.Holds`: held requests, their consumer, done, renew, the lease, freed requests;
* :class:`~.share.StagingShare`: the staging each peer engine may keep, reserving and quarantine;
* :class:`~.serves.Serves`: the open transfers, one class per flow (:class:`~.serves.PullServe`,
  :class:`~.serves.PushServe`), their steps, offers and end;
* :class:`~.eager.EagerPacks`: packs made ahead of the pull (given what it needs, no way back
  to the Source);
* :class:`~.packing.PackBatch`: the chunks of one step packed in as few launches as possible.

The :class:`Source` wires them and keeps what crosses them: opening a transfer a destination
asks for (here: the checks of who may take what), a hold's end (its transfers and packs go),
expiry. Plans come from the rank's :class:`~..plan_book.PlanBook` (by the destination's cost
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

from ...errors import KVTritonError, PlanError
from ...plan import RequestPlan, Way
from ...protocol import wire
from ..device import event_done
from ..links import Flow, Links, Peer
from ..plan_book import PlanBook
from ..settings import Settings
from ..stats import Stats
from .eager import EagerPacks
from .holds import FreedRequest, Hold, Holds
from .packing import PackBatch
from .serves import MAX_SERVES_PER_PEER, PullServe, PushServe, Serve, Serves
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
                             eager_returned=lambda nslots: self.eager.returned(nslots))
        self.eager = EagerPacks(settings, links, stats, self.holds, plans, self.share, self.batch,
                                serving=self.serves.serving, offer=self.serves.offer,
                                offer_runs=self.serves.offer_runs, withdraw_offers=self.serves.withdraw_offers)

    # ------------------------------------------------------------------ holds
    def hold(self, req_id: str, block_ids: np.ndarray, lease_s: float, consumer: str | None, ready=None) -> None:
        self.eager.release(req_id)  # a hold placed again: what was packed for the old one is stale
        self.eager.placed(self.holds.place(req_id, block_ids, lease_s, consumer, ready))

    def release(self, req_id: str) -> bool:
        hold = self.holds.get(req_id)
        if hold is None:
            return False
        self._end_hold(hold, "released")
        return True

    def take_freed(self) -> list[FreedRequest]:
        return self.holds.take_freed()

    def packed_ahead(self, req_id: str) -> int:
        """Chunks of ``req_id`` packed ahead whose pack has completed (offered ones included)."""
        return self.eager.ready_chunks(req_id) + self.serves.offered_chunks(req_id)

    def busy(self) -> bool:
        """Something is held or served."""
        return bool(self.serves.by_key or self.holds.held)

    def _end_hold(self, hold: Hold, reason: str, finished_engine: str | None = None) -> None:
        """Free a held request: its packs go, its transfers are dropped (see
        :meth:`~.serves.Serves.drop_request`)."""
        self.holds.end(hold, reason)
        self.eager.release(hold.req_id)
        self.serves.drop_request(hold.req_id, reason, finished_engine)

    def on_done(self, peer: Peer, m: wire.Done) -> None:
        hold = self.holds.on_done(peer, m)
        if hold is not None:
            self._end_hold(hold, "done", finished_engine=peer.md.engine)

    def on_renew(self, peer: Peer, m: wire.Renew) -> None:
        self.holds.on_renew(peer, m, offered=(peer.agent, m.req) in self.serves.offered)

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
        self.open(peer, m, Flow.PULL)

    def on_push(self, peer: Peer, m: wire.Push) -> None:
        self.open(peer, m, Flow.PUSH)

    def open(self, peer: Peer, m: wire.Pull | wire.Push, flow: Flow) -> None:
        """Start serving a transfer the destination asked for, or reject it with the reason."""
        xid, req, me = m.xid, m.req, self.s.name

        def reject(reason: str) -> None:
            self.links.send(peer, wire.Reject(xid, self.links.reason(peer, reason)), quiet=True)

        if (peer.agent, xid) in self.serves.by_key:
            return reject(f"transfer id {xid!r} is already in use")
        if flow is not self.s.flow:
            return reject(f"{me} runs in {self.s.flow.value} mode, got a {flow.value} request")
        hold = self.holds.get(req)
        if hold is None:
            return reject(f"request {req!r} is not held by {me} (never held, finished or lease expired)")
        if hold.consumer is not None and hold.consumer != peer.md.engine:
            self.stats.refused += 1
            return reject(f"request {req!r} is held by {me} for engine {hold.consumer!r}, not {peer.md.engine!r}")
        if hold.consumer is None and not self.links.trusted(peer):
            self.stats.refused += 1  # trust on first use, among authenticated engines only
            return reject(f"request {req!r} is not bound to an engine yet and {peer.agent} did not authenticate: "
                          "an unbound hold binds only to an authenticated engine")
        if not self.serves.room(peer):
            self.stats.refused += 1
            return reject(f"{peer.agent} already has {MAX_SERVES_PER_PEER} transfers open on {me}")
        ids = np.asarray(m.ids, dtype=np.int64)
        if ids.size == 0 or not np.isin(ids, hold.block_ids).all():
            return reject(f"block ids of {req!r} are not a subset of the {hold.block_ids.size} held blocks")
        dst_rank, eng = m.dst_rank, peer.md.engine
        if dst_rank != peer.md.rank:
            return reject(f"dst_rank {dst_rank} does not match the sender's rank {peer.md.rank}")
        try:
            plan = self.plans.serving(peer.md)
        except KVTritonError as e:
            return reject(f"cannot plan for {eng}:{dst_rank}: {e}")
        if m.plan != plan.digest():
            return reject(f"{eng}:{dst_rank} planned this transfer differently from {me} "
                          "(modes, cost model or replicate stripe differ between the engines)")
        if not plan.maps_tokens and (m.tiles or m.tokens):
            return reject("tiles and a token count sent, but the engines' block sizes are equal")
        try:  # this side's plan of the request, made once: what the pull is checked against and served by
            r = RequestPlan.for_serve(plan, self.s.rank, ids, held_blocks=hold.block_ids.size,
                                      chunk_blocks=m.chunk_blocks, num_tokens=m.tokens, tiles=m.tiles)
        except PlanError as e:
            return reject(f"token map of {req!r}: {e}" if plan.maps_tokens else str(e))
        payload, has_runs = r.payload(self.s.rank), r.sends_runs(self.s.rank)
        if payload is None and not has_runs:
            return reject(f"{me} has nothing to send to {eng}:{dst_rank}")
        read, chunks = (payload.read, payload.chunks) if payload is not None else (None, None)
        way = m.way if flow is Flow.PULL else Way.STAGED.value
        if read is not None and way not in {w.value for w in read.ways}:
            return reject(f"{eng}:{dst_rank} asks for way {way!r}; the plan allows {[w.value for w in read.ways]}")
        if read is None and way != Way.STAGED.value:
            return reject(f"{me} sends {eng}:{dst_rank} no staged payload: way {way!r} is meaningless")
        if Way(way).reads_source_cache:  # the peer READs our cache blocks itself: nothing to pack
            if flow is not Flow.PULL or r.tokens is not None:
                return reject(f"{way} is a pull of equal block sizes only")
            read, chunks, has_runs = None, None, True
            self.eager.take(req, peer, r.digest, ids, None)  # a pack made ahead for it is not needed
        if chunks is not None and not chunks.fits(self.s.chunk_bytes):
            return reject(f"chunk of {m.chunk_blocks} blocks does not fit staging chunks of "
                          f"{self.s.chunk_bytes} bytes")
        cls = PullServe if flow is Flow.PULL else PushServe
        serve = cls(xid, req, peer, read, r.src_ids, chunks, self.s.timeout_s, time.monotonic() + self.s.timeout_s,
                    tokens=r.tokens, ready=hold.ready)
        if isinstance(serve, PushServe):
            n = r.num_tiles
            dst_ids = np.asarray(m.dst_ids, dtype=np.int64)
            nb = min(s.num_blocks for s in peer.md.regions)
            if dst_ids.size != n or (dst_ids.size and (dst_ids.min() < 0 or dst_ids.max() >= nb)) \
                    or np.unique(dst_ids).size != dst_ids.size:
                return reject(f"push: dst_ids must be {n} distinct ids in [0, {nb})")
            try:
                rows = self.plans.serving_pair(peer.md).rows()  # DIRECT runs: a push's payload is staged
                serve.runs = self.links.prep_rows(peer, rows, ids, dst_ids, reading=False)
            except KVTritonError as e:
                return reject(f"push: {e}")
        elif chunks is not None:  # packed ahead for exactly this pull: Ready goes out this progress()
            serve.inflight = self.eager.take(req, peer, r.digest, ids if r.tokens is None else None, chunks)
            serve.next_chunk = len(serve.inflight)
        offered = self.serves.offered.get((peer.agent, req))
        if isinstance(serve, PullServe) and offered is not None and offered.offered:
            self.serves.take_offer(serve, offered)  # pulled instead of taken (late offer, or a suffix)
        self.serves.add(serve)
        self.holds.bind(hold, peer)  # the first accepted transfer binds an unbound hold to its engine
        peer.served_at = time.monotonic()  # an engine that reads from us is not idle (see .eager.guess)
        if isinstance(serve, PullServe) and has_runs:
            # the blocks stay held (up to the hold's hard bound) until the reader sends RunsDone
            serve.runs_reader = True
            if not event_done(serve.ready):  # the engine is still writing them: the serve's step sends it
                serve.runs_announce = True
                return
            try:
                self.links.send(peer, wire.RunsReady(xid))
            except KVTritonError:
                self.serves.drop(serve)  # frees chunks it took from an eager pack too
                raise

    # ------------------------------------------------------------------ progress
    def advance(self) -> None:
        """One step: eager packs, then every transfer (announce or WRITE what was packed,
        reserve the next chunks), then pack every chunk reserved in this step in as few
        launches as their block ids allow (:mod:`.packing`: several decode ranks of one request,
        one launch) and announce or WRITE what that packed."""
        reserved: list[Serve] = []
        try:
            self.eager.advance()
            reserved = self.serves.advance()
        finally:
            self.batch.launch()  # nothing reserved is left unpacked, whatever raised above
        self.serves.send_packed(reserved)

    def expire(self, now: float) -> None:
        self.serves.expire(now)
        # after: a transfer dropped above no longer keeps its hold
        for hold in self.holds.expired(now, self.serves.pulled_or_pushed()):
            self.stats.leases_expired += 1
            self._end_hold(hold, "lease_expired")

    def peer_lost(self, peer: Peer) -> None:
        self.eager.peer_lost(peer)
        self.serves.peer_lost(peer)

    def transfer_failed(self, xid: str | None, peer: Peer, error: KVTritonError) -> None:
        self.serves.transfer_failed(xid, peer, error)

    def close(self, reason: str) -> None:
        self.serves.close(reason)
