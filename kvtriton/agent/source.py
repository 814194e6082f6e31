"""The source side of a rank: held requests (:mod:`.holds`), the transfers that serve them
(:mod:`.serves`: pack, the announcement (pull) or WRITE (push) of each chunk), packs made ahead
of the pull (:mod:`.eager`), and opening a transfer a destination asks for (here: the checks of
who may take what).

What a peer can take is bounded (every message is untrusted, even after a good handshake):
entitlement and the lease of holds are described in :mod:`.holds`; staging, time and count
bounds of transfers in :mod:`.serves`.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import KVTritonError, PlanError
from ..plan import ChunkGeometry, Mode, TokenMap, TransferPlan
from ..protocol import wire
from .eager import EagerPacks, ids_digest, suffix_chunks
from .holds import FreedRequest, Hold, SourceHolds
from .links import Flow, Links, Peer, Settings
from .packing import PackBatch
from .serves import MAX_SERVES_PER_PEER, Serve, SourceServes
from .streams import event_done

__all__ = ["Source", "FreedRequest", "Hold", "Serve", "MAX_SERVES_PER_PEER"]


class Source(SourceHolds, SourceServes):
    """Held requests of this rank and the transfers serving them."""

    def __init__(self, settings: Settings, links: Links):
        self.s, self.links = settings, links
        self.holds: dict[str, Hold] = {}
        self.serves: dict[tuple[str, str], Serve] = {}  # by (peer agent, transfer id)
        # per (engine, destination rank, its cost model): a rank that reconnects with another model
        # is planned again
        self.plans: dict[tuple, TransferPlan] = {}
        self.freed: list[FreedRequest] = []
        self.engine_slots: dict[str, int] = {}  # staging slots each peer engine's transfers keep
        self.engine_progress: dict[str, float] = {}  # when each peer engine last made progress
        self.peer_serves: dict[str, int] = {}  # open transfers per peer agent
        self.batch = PackBatch(settings, links.stats)  # chunks reserved in this step, packed at its end
        self.eager = EagerPacks(self, settings.eager_bytes)  # holds packed before their pull
        self.offered: dict[tuple[str, str], Serve] = {}  # (peer agent, req) -> offered, untouched transfer

    # ------------------------------------------------------------------ messages
    def on_pull(self, peer: Peer, m: wire.Pull) -> None:
        self._open(peer, m, Flow.PULL)

    def on_push(self, peer: Peer, m: wire.Push) -> None:
        self._open(peer, m, Flow.PUSH)

    def _open(self, peer: Peer, m: wire.Pull | wire.Push, flow: Flow) -> None:
        """Start serving a transfer the destination asked for, or reject it with the reason."""
        xid, req, me = m.xid, m.req, self.s.name

        def reject(reason: str) -> None:
            self.links.send(peer, wire.Reject(xid, reason), quiet=True)

        if (peer.agent, xid) in self.serves:
            return reject(f"transfer id {xid!r} is already in use")
        if flow is not self.s.flow:
            return reject(f"{me} runs in {self.s.flow.value} mode, got a {flow.value} request")
        hold = self.holds.get(req)
        if hold is None:
            return reject(f"request {req!r} is not held by {me} (never held, finished or lease expired)")
        if hold.consumer is not None and hold.consumer != peer.md.engine:
            self.links.stats["refused"] += 1
            return reject(f"request {req!r} is held by {me} for engine {hold.consumer!r}, not {peer.md.engine!r}")
        if self.peer_serves.get(peer.agent, 0) >= MAX_SERVES_PER_PEER:
            self.links.stats["refused"] += 1
            return reject(f"{peer.agent} already has {MAX_SERVES_PER_PEER} transfers open on {me}")
        ids = np.asarray(m.ids, dtype=np.int64)
        if ids.size == 0 or not np.isin(ids, hold.block_ids).all():
            return reject(f"block ids of {req!r} are not a subset of the {hold.block_ids.size} held blocks")
        dst_rank, eng = m.dst_rank, peer.md.engine
        if dst_rank != peer.md.rank:
            return reject(f"dst_rank {dst_rank} does not match the sender's rank {peer.md.rank}")
        try:
            plan = self.plan_for(peer)
        except KVTritonError as e:
            return reject(f"cannot plan for {eng}:{dst_rank}: {e}")
        if m.plan != plan.digest():
            return reject(f"{eng}:{dst_rank} planned this transfer differently from {me} "
                          "(modes, cost model or replicate stripe differ between the engines)")
        tokens = None
        n = ids.size  # staged tiles (and DIRECT positions)
        if plan.maps_tokens:
            try:
                tokens = TokenMap.for_source(m.tiles, ids, m.tokens, plan.src_block_size, plan.dst_block_size,
                                             hold.block_ids.size)
            except PlanError as e:
                return reject(f"token map of {req!r}: {e}")
            n = tokens.num_tiles
        elif m.tokens or m.tiles:
            return reject("tiles and a token count sent, but the engines' block sizes are equal")
        read = plan.staged_read(self.s.rank)
        has_runs = self.s.rank in plan.direct_ranks(n)
        if read is None and not has_runs:
            return reject(f"{me} has nothing to send to {eng}:{dst_rank}")
        way = m.way if flow is Flow.PULL else Mode.STAGED.value
        if read is not None and way not in {w.value for w in read.ways}:
            return reject(f"{eng}:{dst_rank} asks for way {way!r}; the plan allows {[w.value for w in read.ways]}")
        if read is None and way != Mode.STAGED.value:
            return reject(f"{me} sends {eng}:{dst_rank} no staged payload: way {way!r} is meaningless")
        if way == Mode.READ_UNPACK.value:  # the peer READs our cache blocks itself: nothing to pack
            if flow is not Flow.PULL or tokens is not None:
                return reject("read_unpack is a pull of equal block sizes only")
            read, has_runs = None, True
            self.eager.take(req, peer, plan.digest(), ids, None)  # a pack made ahead for it is not needed
        chunks = None
        if read is not None:
            chunks = ChunkGeometry(read.bytes_per_block, n, m.chunk_blocks)
            if not chunks.fits(self.s.chunk_bytes):
                return reject(f"chunk of {m.chunk_blocks} blocks does not fit staging chunks of "
                              f"{self.s.chunk_bytes} bytes")
        serve = Serve(xid, req, peer, flow, read, ids, chunks, self.s.timeout_s,
                      time.monotonic() + self.s.timeout_s, tokens=tokens, ready=hold.ready)
        if flow is Flow.PUSH:
            dst_ids = np.asarray(m.dst_ids, dtype=np.int64)
            nb = min(r.num_blocks for r in peer.md.regions)
            if dst_ids.size != n or (dst_ids.size and (dst_ids.min() < 0 or dst_ids.max() >= nb)) \
                    or np.unique(dst_ids).size != dst_ids.size:
                return reject(f"push: dst_ids must be {n} distinct ids in [0, {nb})")
            try:
                serve.runs = self.links.prep_runs(plan, peer, ids, dst_ids, reading=False)
            except KVTritonError as e:
                return reject(f"push: {e}")
        elif chunks is not None:  # packed ahead for exactly this pull: Ready goes out this progress()
            serve.inflight = self.eager.take(req, peer, plan.digest(), ids if tokens is None else None, chunks)
            serve.next_chunk = len(serve.inflight)
        offered = self.offered.get((peer.agent, req))
        if offered is not None and offered.offered:  # pulled instead of taken (late offer, or a suffix)
            self._take_offer(serve, offered)
        self._add(serve)
        self.bind(hold, eng)  # the first accepted transfer binds an unbound hold to its engine
        if flow is Flow.PULL and has_runs:
            # the blocks stay held (up to the hold's hard bound) until the reader sends RunsDone
            serve.runs_reader = True
            if not event_done(serve.ready):  # the engine is still writing them: _advance_pull sends it
                serve.runs_announce = True
                return
            try:
                self.links.send(peer, wire.RunsReady(xid))
            except KVTritonError:
                self.drop(serve)  # frees chunks it took from an eager pack too
                raise

    def _take_offer(self, serve: Serve, offered: Serve) -> None:
        """``serve``, a pull, takes over the chunks of ``offered`` (its peer's offer of the same
        request) when they are its payload or the packed chunks of a suffix it asks (a -1 prefix,
        see :mod:`.eager`); the offer is withdrawn in any case."""
        got = None
        if not serve.inflight and serve.tokens is None and offered.read == serve.read and serve.chunks is not None:
            got = suffix_chunks(offered.ids, offered.chunks, offered.inflight, serve.ids, serve.chunks)
        if not got or not got[0]:
            self.links.stats["eager_misses"] += 1
            self.drop(offered, notify=f"offer of {serve.req_id!r} withdrawn: a pull for something else arrived")
            return
        taken, before = got
        self.links.stats["eager_hits"] += 1
        # the chunks before the suffix were announced by the offer: quarantined like any withdrawn ready
        freed = sum(ch.nslots for ch in before.values())
        eng = offered.peer.md.engine
        self.links.retire_chunks(before, time.monotonic() + self.s.timeout_s, on_free=lambda ch: self.uncount(eng, ch))
        serve.inflight, offered.inflight = taken, {}
        serve.next_chunk, serve.eager_slots, offered.eager_slots = serve.chunks.count, offered.eager_slots - freed, 0
        self.eager.slots -= freed
        self._remove(offered)
        for ch in serve.inflight.values():
            self.links.send(serve.peer, wire.Ready(serve.xid, ch.index, ch.slot, ch.nslots, ch.nbytes), quiet=True)

    def plan_for(self, peer: Peer) -> TransferPlan:
        """The plan of ``peer``'s transfers from this rank, by the destination's cost model (a
        rank that reconnects with another model is planned again). Raises KVTritonError."""
        key = (peer.md.engine, peer.md.rank, peer.md.cost)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self.s.plan(peer.md.rank, peer.md.tp, peer.md.regions, self.s.tp,
                                                 self.s.specs, cost=peer.md.cost)
        return plan

    def offer(self, hold: Hold, packed) -> bool:
        """Announce an eager pack to its destination rank as a transfer of its own (see
        :mod:`.eager`); False when the peer has no room for another transfer or the send fails."""
        peer = packed.peer
        xid = f"{hold.req_id}|{self.s.name}>{peer.md.rank}!"
        if (peer.agent, xid) in self.serves or self.peer_serves.get(peer.agent, 0) >= MAX_SERVES_PER_PEER:
            return False
        serve = Serve(xid, hold.req_id, peer, Flow.PULL, packed.read, packed.ids, packed.chunks, self.s.timeout_s,
                      time.monotonic() + self.s.timeout_s, ready=hold.ready, offered=True,
                      eager_slots=packed.nslots, runs_reader=packed.runs)  # runs: held until RunsDone
        serve.inflight = dict(packed.inflight)
        serve.next_chunk = packed.chunks.count
        slots = []
        for c in range(packed.chunks.count):
            ch = serve.inflight[c]
            ch.kernel = None  # completed: announced by the offer, not by a ready
            slots += [ch.slot, ch.nslots]
        return self._send_offer(serve, wire.Offer(xid, hold.req_id, packed.digest, ids_digest(packed.ids),
                                                  int(packed.ids.size), packed.chunks.blocks_per_chunk,
                                                  tuple(slots), runs=int(packed.runs)))

    def _send_offer(self, serve: Serve, offer: wire.Offer) -> bool:
        """Send ``offer`` and, once it is out, keep ``serve`` as the offered transfer."""
        try:
            self.links.send(serve.peer, offer)
        except KVTritonError:
            return False
        self._add(serve)
        self.offered[(serve.peer.agent, offer.req)] = serve
        self.links.stats["eager_offers"] += 1
        return True

    def offer_runs(self, hold: Hold, peer: Peer, digest: str) -> bool:
        """Offer ``peer`` to READ ``hold``'s blocks straight from our cache (read_unpack; see
        :mod:`.eager`): an :class:`~kvtriton.wire.Offer` without slots, sent once the engine's
        writes are done, and a transfer that keeps the blocks until the reader's RunsDone (or the
        hold ends), as a pull's RunsReady would. Saves the pull's round trip to this process."""
        xid = f"{hold.req_id}|{self.s.name}>{peer.md.rank}!"
        if (peer.agent, xid) in self.serves or self.peer_serves.get(peer.agent, 0) >= MAX_SERVES_PER_PEER:
            return False
        serve = Serve(xid, hold.req_id, peer, Flow.PULL, None, hold.block_ids, None, self.s.timeout_s,
                      time.monotonic() + self.s.timeout_s, ready=hold.ready, offered=True, runs_reader=True)
        return self._send_offer(serve, wire.Offer(xid, hold.req_id, digest, ids_digest(hold.block_ids),
                                                  int(hold.block_ids.size), 1, ()))

    def expire(self, now: float) -> None:
        self.expire_serves(now)
        self.expire_holds(now)  # after: a transfer dropped above no longer keeps its hold

    def peer_lost(self, peer: Peer) -> None:
        self.eager.peer_lost(peer)
        for serve in [s for s in self.serves.values() if s.peer is peer]:
            self.drop(serve)

    def close(self, reason: str) -> None:
        for serve in list(self.serves.values()):
            self.links.send(serve.peer, wire.Reject(serve.xid, reason), quiet=True)
