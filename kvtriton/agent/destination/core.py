"""The destination side of a rank, composed: :class:`~.fetches.Fetches` (the requests in
flight, their parts, their results) and :class:`~.offers.Offers` (what sources offered ahead);
the plans it reads by (one per source engine) are the rank's :class:`~..plan_book.PlanBook`'s.
A fetch's :class:`~kvtriton.plan.RequestPlan` is made once, in :meth:`Destination.fetch`; each
source rank's part is one class per way (:mod:`.parts`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from ...errors import (
    KVTritonError,
    PeerDisconnectedError,
    PlanError,
    ProtocolError,
    RequestAbortedError,
    RequestRejectedError,
    StagingError,
)
from ...plan import RequestPlan, TransferPlan, Way
from ...plan.ids import IdsArg
from ...protocol import wire
from ..links import Flow, Links, Peer, Settings
from ..plan_book import PlanBook
from .deferred import Deferred, DeferredFetch, local_blocks
from .fetch import Fetch
from .fetches import Fetches, RequestResult
from .offers import Offers
from .parts import (
    CacheLease,
    DirectPart,
    GrantedPart,
    PackPlacePart,
    Part,
    ReadUnpackPart,
    RunsTransfer,
    StagedPart,
)
from .queued import Queued
from .reading import MAX_ENGINES, EngineReads

_PULL_PARTS: dict[Way, type[Part]] = {Way.STAGED: StagedPart, Way.READ_UNPACK: ReadUnpackPart,
                                       Way.PACK_PLACE: PackPlacePart, Way.DIRECT_SLICE: DirectPart}


class Destination:
    """Fetches in flight on this rank; the plans they read by come from ``plans`` (the rank's
    :class:`~..plan_book.PlanBook`, one per source engine)."""

    def __init__(self, settings: Settings, links: Links, plans: PlanBook):
        self.s, self.links, self.plans = settings, links, plans
        self.offers = Offers(links)
        self.fetches = Fetches(settings.name, settings.rank, settings.tp, links, self.offers)
        self.queued = Queued(settings.rank, settings.renew_s, links)  # waiting in the engine's queue: renewed
        self.deferred = Deferred()  # asked while another thread held the agent (.deferred)
        self._reads: dict[str, EngineReads] = {}  # by source engine: what its fetches read by (.reading)

    # ------------------------------------------------------------------ requests
    def fetch(self, req_id: str, engine: str, remote_block_ids: IdsArg, local_block_ids: IdsArg,
              timeout_s: float | None, num_tokens: int | None = None, ready=None) -> None:
        """Start reading ``req_id`` from ``engine`` (see :meth:`TransferAgent.fetch`)."""
        if req_id in self.fetches:
            raise RequestRejectedError(f"fetch {req_id!r} is already in flight")
        self.fetches.send_dones(req_id)  # fetched again: the last fetch's Done goes first
        self.queued.drop(req_id)  # from now on its fetch renews its holds
        reads = self.reads(engine)
        checked = reads.checked
        # the way of each payload is chosen in the request's plan (an offer the source made means
        # it is packed already, or that its cache blocks are ours to read with no pull)
        packed, cache_offers = self.offers.of_request(reads.peers, req_id)
        rp = RequestPlan.for_fetch(reads.plan, remote_block_ids, local_block_ids,
                                   src_num_blocks=checked[0], dst_num_blocks=checked[1],
                                   chunk_bytes=reads.caps, num_tokens=num_tokens, pairs=reads.pairs,
                                   fitted=reads.fitted, packed=packed, cache_offers=cache_offers,
                                   push=self.s.flow is Flow.PUSH)
        blocks = max(rp.src_ids.size, rp.num_tiles)  # num_tiles: the destination ids
        if blocks > wire.MAX_REQUEST_BLOCKS:
            raise PlanError(f"fetch {req_id!r}: {blocks} blocks is more than a request may "
                            f"have (kvtriton.protocol.wire.MAX_REQUEST_BLOCKS = {wire.MAX_REQUEST_BLOCKS}); split it")
        now = time.monotonic()
        timeout = timeout_s or self.s.timeout_s
        f = Fetch(req_id, engine, now, timeout, now + timeout, rp, renew_at=now + self.s.renew_s, ready=ready,
                  checked=checked)
        self.fetches.add(f)
        if rp.num_tiles == 0:  # nothing to read (a full prefix hit): no READ to hurry, so its Dones go now, not
            self.fetches.finish(f)  # queued for a progress() this result never needs (a caller that never calls
            self.fetches.send_dones()  # it would queue them without bound)
            return
        for src_rank in rp.source_ranks:
            try:
                part = self._part(f, self.links.peers[(engine, src_rank)], src_rank)
            except StagingError as e:
                self.fetches.fail(f, StagingError(f"{engine}:{src_rank}: {e}"))
                return
            self.fetches.add_part(part)
        try:
            self._start(f)
        except KVTritonError as e:
            self.fetches.fail(f, e)

    def reads(self, engine: str) -> EngineReads:
        """What every fetch from ``engine`` reads by (:class:`~.reading.EngineReads`), gathered
        again when its plan or a source rank's peer changed; ``KeyError`` or ``PlanError`` as
        :meth:`met`."""
        got = self._reads.get(engine)
        if got is not None and got.current(self.plans.read_by(engine), self.links.peers):
            return got
        plan = self.met(engine)
        peers = {r: self.links.peers[(engine, r)] for r in plan.source_ranks}
        got = EngineReads.gather(engine, plan, peers, {r: self.plans.reading_pair(p.md) for r, p in peers.items()},
                                 self.s.chunk_bytes, self._num_blocks)
        if len(self._reads) >= MAX_ENGINES:  # engines met and gone: the oldest goes (made again if asked)
            self._reads.pop(next(iter(self._reads)))
        self._reads[engine] = got
        return got

    def met(self, engine: str) -> TransferPlan:
        """The plan this rank reads ``engine`` by, every source rank of it met: ``KeyError`` (a rank
        not met, or the engine never added) or ``PlanError`` otherwise. Reads dictionaries only, so
        a fetch about to be deferred asks it without the agent's lock: a caller meets an engine again
        on this ``KeyError`` (a rank dropped after the fetch was kept fails it as a lost peer)."""
        plan = self.plans.read_by(engine)
        missing = [r for r in plan.source_ranks if (engine, r) not in self.links.peers]
        if missing:
            raise KeyError(f"engine {engine!r}: no metadata yet for ranks {missing}")
        return plan

    @property
    def _num_blocks(self) -> int:
        """The fewest blocks of any of this rank's regions: every local id must be below."""
        return min(s.num_blocks for s in self.s.specs)

    def defer(self, d: DeferredFetch) -> None:
        """Keep a fetch asked while another thread held the agent (:meth:`start_deferred` starts it);
        an engine not met raises ``KeyError`` (or ``PlanError``) at once, as :meth:`fetch` does."""
        self.met(d.engine)
        self.deferred.add(d)
        self.links.stats.deferred_fetches += 1

    def start_deferred(self, check: Callable[[str], None]) -> None:
        """Start every deferred fetch, oldest first (``check(what)``: the agent's own refusals,
        e.g. unregistered memory); what :meth:`fetch` would raise becomes the fetch's failed
        result, every local block undefined (:mod:`.deferred`)."""
        while (d := self.deferred.take()) is not None:
            try:
                check(f"fetch {d.req_id!r}")
                self.fetch(d.req_id, d.engine, d.remote_block_ids, d.local_block_ids, d.timeout_s, d.num_tokens,
                           d.ready)
            except Exception as e:  # noqa: BLE001 - every deferred fetch gets its result, whatever stopped it
                if isinstance(e, KeyError):  # the engine, or some of its ranks, not (or no longer) met
                    e = PeerDisconnectedError(f"fetch {d.req_id!r}: {e.args[0] if e.args else e}")
                elif isinstance(e, (TypeError, ValueError)) and not isinstance(e, KVTritonError):  # ids numpy refused
                    e = PlanError(f"fetch {d.req_id!r}: {type(e).__name__}: {e}")
                elif not isinstance(e, KVTritonError):
                    e = KVTritonError(f"fetch {d.req_id!r} could not start: {type(e).__name__}: {e}")
                self.fetches.refused(d.req_id, e, local_blocks(d.local_block_ids, self._num_blocks))

    def _part(self, f: Fetch, peer: Peer, src_rank: int) -> Part:
        """``src_rank``'s part of ``f``: the class of the way its payload travels (chosen in the
        request's plan), taking the source's offer when it is exactly this part. Its zero-copy
        rows (DIRECT runs, and the payload's head slices when it travels DIRECT_SLICE) are one
        :class:`RunsTransfer`: one READ."""
        rp, pull = f.request, self.s.flow is Flow.PULL
        payload = rp.payload(src_rank)  # StagingError: it does not fit a chunk
        way = rp.way(src_rank)
        if payload is None:
            cls: type[Part] = DirectPart
        elif not pull:
            cls = GrantedPart
        else:
            cls = _PULL_PARTS[way]
            if cls is ReadUnpackPart:  # nothing in the source's staging: our chunks only
                payload = payload.refit(self.s.chunk_bytes)
        direct = rp.sends_runs(src_rank)
        rows = rp.pairs[src_rank].rows(way if pull else Way.STAGED)
        runs = RunsTransfer(rows, direct) if direct or (cls is DirectPart and payload is not None) else None
        taken = self.fetches.parts.__contains__
        if way.reads_source_cache and pull or (cls is DirectPart and pull and runs is not None):  # they read the cache
            offer = self.offers.take_cache(peer, f.req_id, rp, taken)
        else:
            offer = self.offers.take_packed(peer, f.req_id, rp, src_rank, taken)
        lease = CacheLease() if pull and runs is not None else None
        xid = offer.xid if offer else self.fetches.new_xid(f.req_id, src_rank)  # an offered part: the source's id
        part = cls(self.s, self.links, xid, f, src_rank, payload, runs, lease)
        if offer is not None:
            part.take_offer(offer)
        return part

    def _start(self, f: Fetch) -> None:
        """Ask each source rank for its part (an offered part asks nothing)."""
        rp = f.request
        ids: tuple[int, ...] | None = None  # what a pull or push names: only when one is sent
        for part in f.parts.values():
            peer = self.links.peers[(f.engine, part.src_rank)]
            if part.offered:  # nothing to ask: its acks (RunsDone) tell the source we took the offer
                part.start_offered(peer)  # its READs now, before any message of this step (Part.start_offered)
                continue
            chunk_blocks = part.payload.chunks.blocks_per_chunk if part.payload is not None else 0
            if ids is None:
                ids = tuple(rp.src_ids.tolist())
            tok = rp.wire_tokens()
            msg: wire.Message
            if self.s.flow is Flow.PUSH:
                msg = wire.Push(part.xid, f.req_id, self.s.rank, ids, tuple(f.dst_ids.tolist()), chunk_blocks,
                                rp.digest, **tok, **rp.wire_groups())
            else:  # DIRECT runs (and the ways reading its cache) wait for the source to confirm it holds the blocks
                msg = wire.Pull(part.xid, f.req_id, self.s.rank, ids, chunk_blocks, rp.digest, **tok,
                                way=part.way.value, **rp.wire_groups())
            self.links.send(peer, msg)

    def abort(self, req_id: str) -> bool:
        self.queued.drop(req_id)
        d = self.deferred.drop(req_id)
        if d is not None:  # never started: nothing posted, every local block as it was (undefined to the caller)
            self.fetches.refused(req_id, RequestAbortedError(f"fetch {req_id!r} from {d.engine!r} was aborted"),
                                 local_blocks(d.local_block_ids, self._num_blocks))
            return True
        f = self.fetches.by_req.get(req_id)
        if f is None:
            return False
        self.fetches.fail(f, RequestAbortedError(f"fetch {req_id!r} from {f.engine!r} was aborted"))
        return True

    def take_results(self) -> list[RequestResult]:
        return self.fetches.take_results()

    # ------------------------------------------------------------------ messages
    def on_offer(self, peer: Peer, m: wire.Offer) -> None:
        """Keep a source's offer until a fetch asks for it (checked then, against the fetch)."""
        if self.s.flow is not Flow.PULL:
            raise ProtocolError("offer received in push mode")
        self.offers.keep(peer, m)

    def on_ready(self, peer: Peer, m: wire.Ready) -> None:
        part = self.fetches.part_from(peer, m.xid)
        if self.s.flow is not Flow.PULL:
            raise ProtocolError(f"ready for chunk {m.chunk} of {m.xid!r} is unexpected (duplicate or push mode)")
        part.on_ready(peer, m)

    def on_data(self, peer: Peer, m: wire.Data) -> None:
        self.fetches.part_from(peer, m.xid).on_data(peer, m)

    def on_runs_ready(self, peer: Peer, m: wire.RunsReady) -> None:
        part = self.fetches.part_from(peer, m.xid)
        if self.s.flow is Flow.PULL:  # go-ahead: the source holds the blocks while we read them
            part.go_ahead(peer)
        else:  # push: the source has written our cache
            part.runs_written()
            self.fetches.maybe_finish(part.fetch)

    def on_reject(self, peer: Peer, m: wire.Reject) -> None:
        part = self.fetches.part_of(peer, m.xid)
        self.offers.withdraw(peer, m.xid)  # an offer withdrawn (its hold ended, or we pulled instead)
        if part is not None:
            self.fetches.fail(part.fetch, RequestRejectedError(
                f"{peer.md.engine}:{peer.md.rank} rejected {part.fetch.req_id!r}: {m.reason}"))

    def transfer_failed(self, xid: str | None, peer: Peer, error: KVTritonError) -> None:
        """A message about transfer ``xid`` from ``peer`` could not be handled: fail its fetch."""
        part = self.fetches.part_of(peer, xid)
        if part is not None:
            self.fetches.fail(part.fetch, error)

    # ------------------------------------------------------------------ progress
    def busy(self) -> bool:
        """Fetches in flight or deferred, or Dones not sent yet."""
        return bool(self.fetches or self.deferred or self.fetches.dones)

    def advance(self) -> None:
        """Send the Dones of fetches finished before this call (:meth:`Fetches.finish`), renew the holds
        of fetches still outstanding, move every part along, finish or fail."""
        self.fetches.send_dones()
        now = time.monotonic()
        self.queued.advance(now)
        for f in list(self.fetches.by_req.values()):
            if f.error is not None:
                continue
            if now >= f.renew_at:  # still outstanding: keep the sources' holds alive
                f.renew_at = now + self.s.renew_s
                for part in f.parts.values():
                    self.links.send(self.links.peers[(f.engine, part.src_rank)],
                                    wire.Renew(f.req_id, self.s.rank), quiet=True)
            try:
                for part in list(f.parts.values()):
                    part.advance(self.links.peers[(f.engine, part.src_rank)])
                self.fetches.maybe_finish(f)  # a finished fetch's Done carries each part's RunsDone
            except KVTritonError as e:
                self._send_runs_done(f)
                self.fetches.fail(f, e)
            else:
                self._send_runs_done(f)

    def _send_runs_done(self, f: Fetch) -> None:
        """The RunsDone the parts of ``f`` left unsent in this call (none when its Done carried them)."""
        for part in f.parts.values():
            peer = self.links.peers.get((f.engine, part.src_rank))
            if peer is not None:
                part.send_runs_done(peer)

    def expire(self, now: float) -> None:
        self.fetches.expire(now)

    def shift(self, seconds: float) -> None:
        self.fetches.shift(seconds)

    def peer_lost(self, peer: Peer, error: KVTritonError) -> None:
        self._reads.pop(peer.md.engine, None)
        self.offers.peer_lost(peer)
        self.fetches.peer_lost(peer, error)

    def fail_all(self, error: KVTritonError) -> None:
        self.fetches.send_dones()  # the fetches that finished well: their sources may free the blocks
        self.fetches.fail_all(error)
        while (d := self.deferred.take()) is not None:
            self.fetches.refused(d.req_id, error, local_blocks(d.local_block_ids, self._num_blocks))
