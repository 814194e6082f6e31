"""Eager packing: a hold is packed for its consumer engine (named, or guessed: see below) before
its pull arrives.

Why: a lazy staged pull needs the source process scheduled between the Pull and the data
being in place (pull -> pack -> ready); on a busy host every such wake-up costs a scheduling
delay. When :meth:`TransferAgent.hold` names the consumer and this rank already knows that
engine's ranks (their metadata was added), the source packs each destination rank's staged
payload in the next ``progress()``, into staging reserved for the hold, so the Pull is
answered with Ready at once (data already in place).

What is packed is a guess at what the destination will ask: every held block, in the hold's
order, cut into the chunks the destination derives (:meth:`ChunkGeometry.fit` over the
smaller of both sides' ``chunk_bytes``; the destination's travels in its metadata). A Pull that
asks anything else (a subset of the blocks other than a suffix of whole chunks, see the -1
prefix below; another chunk size, another plan, a reconnected peer) frees the packed chunks
and is served lazily.

Offers: once every chunk of a destination rank's pack has completed, the pack is offered to
that rank (:class:`~kvtriton.protocol.wire.Offer`: a ``ready`` ahead of the pull) as a transfer of its
own; a fetch that asks exactly that READs it without a round trip to this process (on a busy
host, the wake-up saved). When the plan also reads DIRECT runs from this rank, the offer is
sent only once the hold's event has completed and says so (``runs``): it is then their
``runs_ready`` too (the confirmation that this rank holds the blocks), and the offered
transfer keeps them held until the reader's ``runs_done``, as a pulled one does. A rank whose
plan sends the consumer DIRECT runs only (whole blocks or head slices, no staged payload), or
whose payload the consumer reads from our cache (read_unpack, direct_slice), has nothing to
pack: it offers the cache blocks (no slots), from ``hold()`` itself when the hold's event has
completed (else in the first ``progress()`` after), the offer confirming the runs, so a fetch
made right after the hold READs them with no pull either. An offered pack is
announced: it is no longer evicted, lives until acked or until the hold ends (then its slots are
quarantined for ``timeout_s``, as after any ``ready``), and a pull of the same request from that
rank takes it over or withdraws it (no quarantine then: that rank pulled, so it is not reading
the offer). Offered packs keep at most the consumer's share less ``inflight_chunks``
chunks, so the engine's lazy pulls always have staging.

Bounds: packed chunks count toward the consumer engine's staging share (never more than it);
all eager packs together stay within ``eager_bytes``; a hold that does not fit is simply served
lazily. A pull that needs staging evicts eager packs not yet asked for (they are a guess; a pull
is real). Only the named consumer's rank whose plan was packed can take a pack: the pull's
entitlement checks (:meth:`~kvtriton.agent.source.Source.open`) run first, and the pack is keyed by the peer object.

Guessing (``eager_guess``, default on): a hold without a consumer is packed, and offered, for
the only peer engine connected to this rank, when exactly one is (1P1D: the vLLM connector's
holds, whose prefill does not know its decode), or else for the only one that read from this
rank lately (:meth:`EagerPacks.guess`: an engine that connects and stays idle does not turn
the guess off). With a credential configured only authenticated engines are guessed (and only
their authenticated ranks offered to): a pack offered is readable by its receiver. The guess
binds nothing: the hold still binds to the first engine whose transfer this rank accepts (a
pull, or the first ack or RunsDone of an offer, see :meth:`~.holds.Holds.bind`), and binding
frees whatever was packed for another engine and withdraws its offers (quarantined for
``timeout_s``, as any withdrawn ``ready``; a withdrawn offer of the cache blocks keeps the
hold's blocks that long: its end is reported by ``freed()`` only then, :meth:`~.holds.Holds.end`);
an offer's acks from an engine the hold is no longer open to are refused (the transfer is
gone). With two or more engines connected nothing is guessed: a guess between them could pin
one engine's packs in staging the other needs, and naming the consumer is the way to pack
for one of several; or ``hold(pack_for=...)`` names the engine instead of the guess (a
router's word, the vLLM connector's ``decode_engine_id``: untrusted, so it binds nothing
either; an engine not connected means lazy). A guessed pack is bounded like a named one (the guessed
engine's share, ``eager_bytes``), so an engine that is alone and never takes its offers pins
at most that, and only until the hold binds elsewhere or ends.

A prefix the decode already has (-1 destination ids at the start of a fetch, e.g. a
prefix-cache hit) makes the pull ask a suffix of the held blocks. Inside a chunk the staged
format is segment-major (every region-stream's tiles of the chunk's blocks in turn), so a
block range of a chunk is not a byte range of it: a suffix is served from the pack (offered
or not) exactly when it starts on a packed chunk boundary and the pull's chunks are the packed
ones from there on (:func:`suffix_chunks`); the chunks before it are freed. Any other prefix
is a miss (served lazily). An offered pack is not READ at once for a suffix: the decode does
not decline it (no abort) and pulls, and the pull takes it over (one round trip, no pack).
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ...errors import KVTritonError, StagingError
from ...plan import ChunkGeometry, Payload, RequestPayload, RequestPlan
from ..device import event_done
from ..links import Chunk, Flow, Links, Peer, logger
from ..plan_book import PlanBook
from ..settings import Settings
from ..stats import Stats
from .holds import Hold, Holds
from .packing import PackBatch, PackJob
from .share import StagingShare

__all__ = ["EagerPacks", "Packed", "suffix_chunks"]


def suffix_chunks(packed_ids: np.ndarray, packed: ChunkGeometry, inflight: dict[int, Chunk], ids: np.ndarray,
                  chunks: ChunkGeometry) -> tuple[dict[int, Chunk], dict[int, Chunk]] | None:
    """Match a pull of ``ids`` cut into ``chunks`` with chunks ``inflight`` (chunk -> Chunk) packed
    for ``packed_ids`` cut into ``packed``: when ``ids`` is a suffix of ``packed_ids`` starting on
    a packed chunk boundary and every chunk of the pull is a packed chunk (same positions, hence
    the same bytes), returns (the packed chunks the pull takes, renumbered as its chunks; the
    packed chunks before the suffix), else None. The whole list is the suffix that skips nothing."""
    n, skip = ids.size, packed_ids.size - ids.size
    bpc = packed.blocks_per_chunk
    if n == 0 or skip < 0 or skip % bpc or chunks.bytes_per_block != packed.bytes_per_block:
        return None
    first = skip // bpc
    if first + chunks.count != packed.count:
        return None
    for j in range(chunks.count):
        lo, hi = chunks.bounds(j)
        if packed.bounds(first + j) != (skip + lo, skip + hi):
            return None
    if not np.array_equal(packed_ids[skip:], ids):
        return None
    taken = {}
    for c in sorted(inflight):
        if c >= first:
            ch = inflight[c]
            ch.index = c - first  # the pull's chunk number: its Ready and acks use it
            taken[ch.index] = ch
    return taken, {c: ch for c, ch in inflight.items() if c < first}


@dataclass(eq=False)
class Packed:
    """The chunks packed ahead for one destination rank of a hold's consumer."""

    peer: Peer
    request: RequestPlan  # what was assumed (RequestPlan.for_hold): every held block, in order
    payload: RequestPayload  # this rank's payload of it, in the widest chunks that fit both sides
    inflight: dict[int, Chunk] = field(default_factory=dict)  # chunks 0..k-1, by number

    @property
    def digest(self) -> str:
        """The plan they were packed by."""
        return self.request.digest

    @property
    def ids(self) -> np.ndarray:
        return self.request.src_ids

    @property
    def chunks(self) -> ChunkGeometry:
        return self.payload.chunks

    @property
    def read(self) -> Payload:
        return self.payload.read

    @property
    def runs(self) -> bool:
        """The plan also reads DIRECT runs from this rank (the offer confirms them)."""
        return self.request.sends_runs(self.payload.src_rank)

    @property
    def nslots(self) -> int:
        return sum(ch.nslots for ch in self.inflight.values())


class LetGo(enum.Enum):
    """Why a pack leaves the table of packs not offered yet (:meth:`EagerPacks._let_go`)."""

    OFFERED = "offered"  # announced: its offered transfer owns it, its slots stay in the budget until it ends
    TAKEN = "taken"  # a pull takes its chunks (or frees them, a miss): they leave the budget
    FREED = "freed"  # never announced, so nobody reads it: its slots are retired (once its pack ran)


class EagerPacks:
    """The eager packs of one source rank, per hold and destination rank, in placement order
    (the oldest is evicted first). What it needs of the rest of the source comes in as objects
    it only asks (holds, the plan book, the staging share, the pack batch) and as callbacks:
    ``serving(req)`` (a transfer serves ``req`` already), ``offer(hold, packed)`` and
    ``offer_runs(hold, peer, request)`` (announce a pack, or the cache blocks, as a transfer of
    its own: False when that could not be done), ``withdraw_offers(req, engine)`` (the offers of
    ``req`` to engines other than ``engine`` go; returns how many)."""

    def __init__(self, settings: Settings, links: Links, stats: Stats, holds: Holds, plans: PlanBook,
                 share: StagingShare, batch: PackBatch, *, serving: Callable[[str], bool],
                 offer: Callable[[Hold, Packed], bool], offer_runs: Callable[[Hold, Peer, RequestPlan], bool],
                 withdraw_offers: Callable[[str, str], int]):
        self.s, self.links, self.stats = settings, links, stats
        self.holds, self.plans, self.share, self.batch = holds, plans, share, batch
        self.serving, self.offer, self.offer_runs, self.withdraw_offers = serving, offer, offer_runs, withdraw_offers
        pool = settings.pool
        self.budget_slots = settings.eager_bytes // pool.slot_bytes if settings.eager_bytes > 0 else 0
        self.slots = 0  # slots all eager packs keep (offered ones too, until their transfer ends)
        self.packs: OrderedDict[str, dict[int, Packed]] = OrderedDict()  # req -> dst rank -> Packed
        # holds placed since the last progress(), with the ranks to pack them for
        self.pending: list[tuple[Hold, list[tuple[Peer, RequestPlan, RequestPayload]]]] = []
        self.unoffered: list[tuple[str, int]] = []  # (req, dst rank) packed in full, not offered yet
        self.runs_offers: list[tuple[str, Peer, RequestPlan]] = []  # (req, peer, request): read_unpack, unoffered

    def returned(self, nslots: int) -> None:
        """Slots of the eager budget an offered transfer kept are free again."""
        self.slots -= nslots

    # ------------------------------------------------------------------ placing
    def placed(self, hold: Hold) -> None:
        """``hold`` was placed: decide, for each rank of its consumer (named, or guessed now),
        whether that rank reads our cache (offered at once, or once the hold's event completed)
        or a pack (packed in the next ``progress()``)."""
        if not (self.budget_slots and self.s.flow is Flow.PULL
                and (hold.consumer is not None or hold.pack_for is not None or self.s.eager_guess)):
            return
        ids = hold.block_ids
        engine = hold.consumer or (hold.pack_for if hold.pack_for is not None else self.guess())
        if ids.size == 0 or engine is None:
            return
        to_pack: list[tuple[Peer, RequestPlan, RequestPayload]] = []
        offered = False  # a cache offer went out (or waits for the hold's event)
        for peer in self.links.engine_peers(engine):
            if hold.consumer is None and not self.links.trusted(peer):
                continue  # a guess goes to authenticated ranks only (a named consumer was chosen)
            try:  # a guess: whatever it cannot plan is served when asked (hold() itself never fails for it)
                plan = self.plans.serving(peer.md)
                if plan.maps_tokens:
                    continue  # token maps: the tiles depend on the decode's ids
                # the chunks the destination derives (the smaller of both sides' chunk sizes); the ways
                # guessed by the destination's own choice (its cost model, in the chunks it derives)
                request = RequestPlan.for_hold(plan, ids,
                                               chunk_bytes=min(self.s.chunk_bytes, peer.md.staging.chunk_bytes),
                                               pairs={self.s.rank: self.plans.serving_pair(peer.md)})
            except KVTritonError:
                continue
            if plan.payload(self.s.rank) is None:
                # DIRECT runs only (whole blocks or head slices): nothing to pack; offering the
                # cache blocks confirms them as RunsReady would, so the fetch READs with no pull
                if request.sends_runs(self.s.rank):
                    offered = self._offer_cache(hold, peer, request) or offered
                continue
            try:
                payload = request.payload(self.s.rank)
            except StagingError:
                continue
            if payload is None:  # never: the plan has this rank's payload (above)
                continue
            if self._read_from_cache(request, payload, peer):  # nothing to pack: offer our cache blocks instead
                offered = self._offer_cache(hold, peer, request) or offered
            else:
                to_pack.append((peer, request, payload))
        if to_pack:
            self.pending.append((hold, to_pack))  # counted as guessed once packed (_pack_hold)
        elif hold.consumer is None and offered:
            self.stats.eager_guessed += 1

    def _offer_cache(self, hold: Hold, peer: Peer, request: RequestPlan) -> bool:
        """Offer ``peer`` our cache blocks of ``hold`` now, from :meth:`TransferAgent.hold` (a
        fetch that comes right after finds the offer: no pull's round trip), or once the hold's
        event completed (the engine still writes them). A guessed engine may be offered too: if
        another engine binds the hold, the offer is withdrawn and the hold's blocks are kept
        ``timeout_s`` after that, as a withdrawn pack's slots are (:meth:`~.holds.Holds.keep_until`),
        so a READ of the guess never sees reused blocks. Whether it went out or waits for the event."""
        if event_done(hold.ready):
            return self.offer_runs(hold, peer, request)
        self.runs_offers.append((hold.req_id, peer, request))
        return True

    def guess(self) -> str | None:
        """The engine a hold without a consumer is packed for: the only trusted peer engine
        connected, else the only one of them that had a transfer accepted in the last
        ``10 * timeout_s`` (an idle engine does not turn the guess off), else None."""
        last: dict[str, float] = {}  # trusted engine -> when one of its ranks last read from us
        for p in self.links.peers.values():
            if self.links.trusted(p):
                last[p.md.engine] = max(last.get(p.md.engine, 0.0), p.served_at)
        if len(last) == 1:
            return next(iter(last))
        since = time.monotonic() - 10 * self.s.timeout_s
        active = [e for e, t in last.items() if t and t > since]
        return active[0] if len(active) == 1 else None

    def advance(self) -> None:
        pending, self.pending = self.pending, []
        for placed, to_pack in pending:
            if self.holds.get(placed.req_id) is placed and placed.req_id not in self.packs \
                    and not self.serving(placed.req_id):
                self._pack_hold(placed, to_pack)
        self.batch.launch()  # before anything below looks at the packs' completions
        waiting_runs = []
        for req, peer, request in self.runs_offers:
            hold = self.holds.get(req)
            if hold is None or self.links.peers.get(peer.key) is not peer:
                continue  # the hold ended or the peer went meanwhile
            if not event_done(hold.ready):  # the engine still writes the blocks: not readable yet
                waiting_runs.append((req, peer, request))
                continue
            self.offer_runs(hold, peer, request)
        self.runs_offers = waiting_runs
        waiting = []
        for req, rank in self.unoffered:
            packed = self.packs.get(req, {}).get(rank)
            if packed is None:
                continue  # taken, freed or evicted meanwhile
            hold = self.holds.get(req)
            if not all(ch.kernel is None or ch.kernel.done() for ch in packed.inflight.values()) or \
                    (packed.runs and hold is not None and not event_done(hold.ready)):
                waiting.append((req, rank))  # DIRECT runs: offered once the engine's writes are done
                continue
            if not self.share.room_for_offers(packed.peer.md.engine):
                continue  # offered packs would leave the engine's lazy pulls no staging: stays evictable
            if hold is not None and hold.consumer in (None, packed.peer.md.engine) and self.offer(hold, packed):
                self._let_go(req, rank, LetGo.OFFERED)
        self.unoffered = waiting

    def _pack_hold(self, hold: Hold, to_pack: list[tuple[Peer, RequestPlan, RequestPayload]]) -> None:
        """Pack ``hold`` for the ranks :meth:`placed` chose (each with its guessed request and
        payload), within their engine's share and ``eager_bytes``."""
        out: dict[int, Packed] = {}  # listed below once one rank's pack reserved chunks
        for peer, request, payload in to_pack:
            if self.links.peers.get(peer.key) is not peer:
                continue  # the peer went (or reconnected) since the hold was placed
            packed = Packed(peer, request, payload)
            chunks = payload.chunks
            for c in range(chunks.count):
                need = self.s.pool.slots_for(chunks.nbytes(c))
                if self.slots + need > self.budget_slots:
                    break
                ch = self.share.reserve(chunks.nbytes(c), peer.md.engine, c, evict=False)
                if ch is None:
                    break  # the engine's share or the pool is full: the rest goes lazily
                packed.inflight[c] = ch
                self.slots += ch.nslots
                self._queue(hold, packed, ch)
            if packed.inflight:
                out[peer.md.rank] = packed
                self.packs[hold.req_id] = out
                if len(packed.inflight) == chunks.count:
                    self.unoffered.append((hold.req_id, peer.md.rank))
                self.stats.eager_chunks += len(packed.inflight)
        if out and hold.consumer is None:
            self.stats.eager_guessed += 1

    def _queue(self, hold: Hold, packed: Packed, ch: Chunk) -> None:
        """Queue the pack of ``ch`` in the source's batch: launched with the other destination
        ranks' chunks of the same blocks, once every pending hold has reserved its chunks."""
        req, rank = hold.req_id, packed.peer.md.rank
        self.batch.add(PackJob.for_chunk(
            packed.read, packed.chunks, ch, packed.ids, None, hold.ready,
            alive=lambda: self.packs.get(req, {}).get(rank) is packed and packed.inflight.get(ch.index) is ch,
            failed=lambda e: self._pack_failed(req, rank, packed, e)))

    def _pack_failed(self, req: str, rank: int, packed: Packed, e: KVTritonError) -> None:
        """The launcher refused a chunk of ``packed``: the whole pack goes (served lazily)."""
        logger.warning("eager pack of %s for %s failed: %s", req, packed.peer.agent, e)
        if self.packs.get(req, {}).get(rank) is packed:
            self._let_go(req, rank, LetGo.FREED)

    def _read_from_cache(self, request: RequestPlan, payload: RequestPayload, peer: Peer) -> bool:
        """Whether ``peer`` will most likely READ this payload straight from our cache
        (read_unpack or direct_slice): the way the hold's guessed request chose for it
        (:meth:`RequestPlan.for_hold`: forced, or what its cost model picks for these ids; a
        wrong guess costs one declined offer)."""
        return request.way(self.s.rank).reads_source_cache

    # ------------------------------------------------------------------ using
    def take(self, req: str, peer: Peer, digest: str, ids: np.ndarray | None,
             chunks: ChunkGeometry | None) -> dict[int, Chunk]:
        """The chunks packed for ``peer``'s pull of ``req`` when they are exactly what it asks, or
        the packed chunks of a suffix it asks (:func:`suffix_chunks`; the others are freed): then
        they leave the eager budget and belong to the transfer, renumbered as its chunks. Else {}
        (a pack for this rank that does not match is freed). ``ids`` None: a token-mapped pull
        (never packed ahead)."""
        packed = self._let_go(req, peer.md.rank, LetGo.TAKEN)
        if packed is None:
            return {}
        got = None
        if packed.peer is peer and packed.digest == digest and chunks is not None and ids is not None:
            got = suffix_chunks(packed.ids, packed.chunks, packed.inflight, ids, chunks)
        if got is None or not got[0]:
            self.stats.eager_misses += 1
            self._free(packed)
            return {}
        taken, before = got
        self.stats.eager_pull_hits += 1
        self.share.retire(packed.peer.md.engine, before, 0.0)
        return taken

    def ready_chunks(self, req: str) -> int:
        """Chunks of ``req`` packed ahead, not offered yet, whose pack has completed."""
        return sum(1 for p in self.packs.get(req, {}).values() for ch in p.inflight.values()
                   if ch.kernel is None or ch.kernel.done())

    # ------------------------------------------------------------------ freeing
    def release(self, req: str) -> None:
        """The hold went (released, expired, done): its packs are freed (never announced, so
        no peer can be reading them)."""
        for rank in list(self.packs.get(req, {})):
            self._let_go(req, rank, LetGo.FREED)

    def peer_lost(self, peer: Peer) -> None:
        for req in list(self.packs):
            packed = self.packs[req].get(peer.md.rank)
            if packed is not None and packed.peer is peer:
                self._let_go(req, peer.md.rank, LetGo.FREED)

    def evict(self, engine: str | None, keep: str | None) -> bool:
        """Free the oldest pack (of ``engine``, or any) not of request ``keep``, so a real pull
        gets the staging; False when there is none."""
        for req, by_rank in self.packs.items():
            if req == keep:
                continue
            for rank, packed in by_rank.items():
                if engine is None or packed.peer.md.engine == engine:
                    self.stats.eager_evicted += 1
                    self._let_go(req, rank, LetGo.FREED)
                    return True
        return False

    def bound(self, req: str, engine: str) -> None:
        """Hold ``req`` was bound to ``engine``: what was packed for another engine (a guess) is
        freed, and its offers are withdrawn (that engine may be reading them: quarantined)."""
        for rank, packed in list(self.packs.get(req, {}).items()):
            if packed.peer.md.engine != engine:
                self.stats.eager_misses += 1
                self._let_go(req, rank, LetGo.FREED)
        self.stats.eager_misses += self.withdraw_offers(req, engine)

    def _let_go(self, req: str, rank: int, why: LetGo) -> Packed | None:
        """The one way a pack leaves the table: the pack of ``req`` for destination rank ``rank``
        (None when there is none) is unlisted (and its request with it when it was the last),
        then what ``why`` says is done with its slots."""
        by_rank = self.packs.get(req)
        packed = by_rank.pop(rank, None) if by_rank is not None else None
        if by_rank is not None and not by_rank:
            del self.packs[req]
        if packed is None or why is LetGo.OFFERED:
            return packed
        self.slots -= packed.nslots
        if why is LetGo.FREED:
            self._free(packed)
        return packed

    def _free(self, packed: Packed) -> None:
        # a pack still running on our stream keeps its slots until it completes: an unpack or a
        # peer's WRITE into them would not be ordered after it
        self.share.retire(packed.peer.md.engine, packed.inflight, 0.0)
