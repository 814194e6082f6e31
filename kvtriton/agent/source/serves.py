"""The transfers a source rank serves: one per (request, destination rank), each packing its
chunks into local staging and announcing them (pull) or WRITing them into granted slots (push).

What a peer can take is bounded (every message is untrusted, even after a good handshake):

* **Staging.** Each peer engine may keep at most its fair share of the staging pool
  (:mod:`.share`): a peer that never acks pins only its share, so the others always progress.
* **Time.** A transfer waiting for staging has its silence deadline carried only by its own
  engine's progress (acks, grants, RunsDone), never by waiting.
* **Count.** At most :data:`MAX_SERVES_PER_PEER` transfers per peer rank; transfers are keyed by
  (peer, transfer id), so one peer cannot claim another's id.

A step reserves the chunks it can, then packs them all at its end (:mod:`.packing`): the chunks
of several destinations that read the same blocks (the decode ranks of one request) share one
launch, and a launch refused for one destination fails only that transfer.

One class per flow: :class:`PullServe` (announce each packed chunk, READ by the peer; DIRECT
runs read by the peer until its RunsDone; possibly offered ahead of the pull, :mod:`.eager`)
and :class:`PushServe` (WRITE each packed chunk into a granted slot; WRITE the DIRECT runs),
over :class:`Serve`, what both keep. :class:`Serves` owns the open transfers of a rank:
their messages, their steps, their offers and their end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ...errors import KVTritonError, ProtocolError
from ...plan import ChunkGeometry, OfferTerms, Payload, RequestPlan, TokenMap
from ...protocol import wire
from ..device import event_done
from ..integrity import seal
from ..links import Chunk, Flow, Links, Peer, RowsPost, logger
from ..settings import Settings
from ..stats import Stats
from .eager import Packed, suffix_chunks
from .holds import Hold, Holds
from .packing import PackBatch, PackJob
from .share import StagingShare

__all__ = ["MAX_SERVES_PER_PEER", "PullServe", "PushServe", "Serve", "Serves"]

MAX_SERVES_PER_PEER = 4096  # transfers one peer rank may have open on this rank at once


@dataclass(eq=False)
class Serve:
    """One (request, destination rank) transfer: what both flows keep."""

    flow: ClassVar[Flow]
    xid: str
    req_id: str
    peer: Peer
    read: Payload | None
    ids: np.ndarray
    chunks: ChunkGeometry | None  # None when this rank sends the destination no staged payload
    timeout_s: float
    deadline: float
    tokens: TokenMap | None = None  # block sizes differ: the request's token map (ids = its read_ids)
    ready: object = None  # the hold's event: packs wait for it on the device, DIRECT runs on the host
    next_chunk: int = 0
    acked: int = 0
    inflight: dict = field(default_factory=dict)  # chunk -> Chunk
    waiting_local: bool = False  # blocked on our own staging: not the peer's silence
    waiting_engine: bool = False  # blocked on the hold's event (the engine still writing the blocks)

    @property
    def n_chunks(self) -> int:
        return self.chunks.count if self.chunks is not None else 0

    @property
    def key(self) -> tuple[str, str]:
        return self.peer.agent, self.xid

    def touch(self) -> None:
        """Progress was made: the silence deadline starts over."""
        self.deadline = time.monotonic() + self.timeout_s

    @property
    def complete(self) -> bool:
        return self.acked == self.n_chunks and not self.inflight

    def advance(self, serves: Serves) -> None:
        """Send what was packed, then reserve the next chunks (packed at the end of the step)."""
        raise NotImplementedError

    def send_packed(self, serves: Serves) -> None:
        """Send the chunks whose pack finished."""
        raise NotImplementedError

    def ended(self, serves: Serves, told: bool, until: float) -> None:
        """The transfer was dropped (``told``: its peer may still be reading, slots quarantined
        ``until``): what its flow keeps besides its chunks goes."""


@dataclass(eq=False)
class PullServe(Serve):
    """A pull: each packed chunk is announced (``ready``) and READ by the peer, which acks it; the
    peer READs DIRECT runs from our cache until it sends RunsDone."""

    flow: ClassVar[Flow] = Flow.PULL
    runs_reader: bool = False  # the peer reads our cache directly until it sends RunsDone
    runs_announce: bool = False  # RunsReady not sent yet (the hold's event had not completed)
    offered: bool = False  # an eager pack offered ahead of the pull: nothing heard from the peer yet
    eager_slots: int = 0  # slots of the eager budget it keeps until it ends

    @property
    def complete(self) -> bool:
        return super().complete and not self.runs_reader

    def advance(self, serves: Serves) -> None:
        # announce every chunk whose pack finished, then reserve the next while staging allows
        self.waiting_local = self.waiting_engine = False
        if self.runs_announce:  # DIRECT runs: the peer reads the cache once the engine's writes are done
            if not event_done(self.ready):
                self.waiting_engine = True
            else:
                self.runs_announce = False
                serves.links.send(self.peer, wire.RunsReady(self.xid))
        self.send_packed(serves)
        while self.next_chunk < self.n_chunks and len(self.inflight) < serves.s.inflight:
            if serves.reserve(self, self.next_chunk) is None:
                self.waiting_local = True
                return  # staging full: wait for acks (here or of other transfers)
            self.next_chunk += 1

    def send_packed(self, serves: Serves) -> None:
        """A ``ready`` for every chunk whose pack finished."""
        for ch in self.inflight.values():
            if ch.kernel is not None and ch.kernel.done():
                ch.kernel = None
                serves.links.send(self.peer, wire.Ready(self.xid, ch.index, ch.slot, ch.nslots, ch.nbytes,
                                                        seal(serves.s, serves.stats, ch)))

    def ended(self, serves: Serves, told: bool, until: float) -> None:
        if self.runs_reader and told:  # the peer may still be reading our cache: keep the blocks a while
            serves.holds.keep_until(self.req_id, until)


@dataclass(eq=False)
class PushServe(Serve):
    """A push: each packed chunk is WRITten into a slot the peer granted; the DIRECT runs are
    WRITten straight into its cache."""

    flow: ClassVar[Flow] = Flow.PUSH
    grants: deque = field(default_factory=deque)  # Grant messages waiting for a local slot
    granted: set = field(default_factory=set)  # chunks the peer granted slots for
    runs: RowsPost | None = None  # the DIRECT runs to WRITE
    runs_xfer: object = None  # the WRITE of the DIRECT runs, until it completes

    @property
    def complete(self) -> bool:
        return super().complete and self.runs is None

    def advance(self, serves: Serves) -> None:
        links = serves.links
        if self.runs is not None and self.runs_xfer is None and event_done(self.ready):
            self.runs_xfer = links.post_rows("WRITE", self.runs, wire.RunsReady(self.xid))
        if self.runs_xfer is not None and links.done(self.runs_xfer):  # ERR raises: reject
            links.transport.release(self.runs_xfer)
            links.release_post(self.runs)()
            self.runs, self.runs_xfer = None, None
        self.waiting_local = False
        self.waiting_engine = self.runs is not None and self.runs_xfer is None  # the engine is still writing
        self.send_packed(serves)
        while self.grants and len(self.inflight) < serves.s.inflight:
            grant = self.grants[0]
            ch = serves.reserve(self, grant.chunk)
            if ch is None:
                self.waiting_local = True
                return
            self.grants.popleft()
            ch.remote_slot = grant.slot

    def send_packed(self, serves: Serves) -> None:
        """A landed WRITE frees its slots; a finished pack is written."""
        links = serves.links
        for chunk, ch in list(self.inflight.items()):
            if ch.xfer is not None:
                if links.done(ch.xfer):
                    links.transport.release(ch.xfer)
                    serves.share.free(self.peer.md.engine, ch)
                    del self.inflight[chunk]
                    self.acked += 1
            elif ch.kernel is not None and ch.kernel.done():
                ch.kernel = None
                ch.xfer = links.post_chunk("WRITE", ch, self.peer, wire.Data(self.xid, ch.index, ch.nbytes,
                                                                              seal(serves.s, serves.stats, ch)))

    def ended(self, serves: Serves, told: bool, until: float) -> None:
        if self.runs is not None:
            serves.links.retire(self.runs_xfer, serves.links.release_post(self.runs))
            self.runs, self.runs_xfer = None, None


def _offer(xid: str, req: str, terms: OfferTerms, slots: tuple[int, ...], digests: bytes = b"") -> wire.Offer:
    """The offer of transfer ``xid`` of ``req`` on ``terms`` (:class:`~kvtriton.plan.OfferTerms`);
    ``digests``: one per chunk with ``integrity=True`` (see :mod:`..integrity`)."""
    return wire.Offer(xid, req, terms.plan, terms.ids, terms.num_blocks, terms.chunk_blocks, slots, runs=terms.runs,
                      digests=digests)


def _offered(serve: Serve) -> bool:
    """An offer nothing was heard of yet (only a pull is ever offered)."""
    return isinstance(serve, PullServe) and serve.offered


class Serves:
    """The transfers a source rank serves, keyed by (peer agent, transfer id): nobody reaches
    another peer's. ``eager_returned(nslots)``: an offered transfer that ended gives its slots of
    the eager budget back."""

    def __init__(self, settings: Settings, links: Links, stats: Stats, holds: Holds, share: StagingShare,
                 batch: PackBatch, *, eager_returned: Callable[[int], None]):
        self.s, self.links, self.stats = settings, links, stats
        self.holds, self.share, self.batch = holds, share, batch
        self.eager_returned = eager_returned
        self.by_key: dict[tuple[str, str], Serve] = {}
        self.per_peer: dict[str, int] = {}  # open transfers per peer agent
        self.engine_progress: dict[str, float] = {}  # when each peer engine last made progress
        self.offered: dict[tuple[str, str], PullServe] = {}  # (peer agent, req) -> offered, untouched transfer

    # ------------------------------------------------------------------ the table
    def room(self, peer: Peer) -> bool:
        """Whether ``peer`` may open one more transfer."""
        return self.per_peer.get(peer.agent, 0) < MAX_SERVES_PER_PEER

    def serving(self, req_id: str) -> bool:
        return any(s.req_id == req_id for s in self.by_key.values())

    def pulled_or_pushed(self) -> set[str]:
        """Requests a transfer serves (an offer alone is not one: the lease rules it)."""
        return {s.req_id for s in self.by_key.values() if not _offered(s)}

    def of(self, peer: Peer, xid: str, flow: Flow, what: str) -> Serve:
        serve = self.by_key.get((peer.agent, xid))  # keyed by the sender: nobody reaches another's
        if serve is None or serve.peer is not peer or serve.flow is not flow:
            raise ProtocolError(f"{what} for unknown transfer {xid!r}")
        return serve

    def add(self, serve: Serve) -> None:
        self.by_key[serve.key] = serve
        self.per_peer[serve.peer.agent] = self.per_peer.get(serve.peer.agent, 0) + 1

    def _remove(self, serve: Serve) -> None:
        if self.by_key.pop(serve.key, None) is not None:
            if isinstance(serve, PullServe):
                if self.offered.get((serve.peer.agent, serve.req_id)) is serve:
                    del self.offered[(serve.peer.agent, serve.req_id)]
                self.eager_returned(serve.eager_slots)
            n = self.per_peer.pop(serve.peer.agent) - 1
            if n:
                self.per_peer[serve.peer.agent] = n

    def _progressed(self, serve: Serve) -> None:
        """The peer did something for ``serve``: its deadline, and its engine's queued transfers',
        start over."""
        serve.touch()
        self.engine_progress[serve.peer.md.engine] = time.monotonic()
        if _offered(serve):  # the peer took the offer: from now on its silence counts
            hold = self.holds.get(serve.req_id)
            if hold is not None and not self.holds.bind(hold, serve.peer):
                raise ProtocolError(f"{serve.xid!r}: {serve.req_id!r} is held for engine {hold.consumer!r}")
            self.stats.eager_offer_reads += 1
            serve.offered = False
            if self.offered.get((serve.peer.agent, serve.req_id)) is serve:
                del self.offered[(serve.peer.agent, serve.req_id)]

    # ------------------------------------------------------------------ messages
    def on_grant(self, peer: Peer, m: wire.Grant) -> None:
        serve = self.of(peer, m.xid, Flow.PUSH, "grant")
        if serve.read is None:
            raise ProtocolError(f"grant for unknown transfer {m.xid!r}")
        if m.chunk in serve.granted:
            raise ProtocolError(f"second grant for chunk {m.chunk} of {m.xid!r}")
        st = peer.md.staging
        if not (0 <= m.chunk < serve.n_chunks and 0 <= m.slot and m.nslots >= 1
                and m.slot + m.nslots <= st.num_slots):
            raise ProtocolError(f"grant {m.chunk}/{m.slot}+{m.nslots} is outside the peer's staging "
                                f"({st.num_slots} slots) or the transfer ({serve.n_chunks} chunks)")
        if m.nslots * st.slot_bytes < serve.chunks.nbytes(m.chunk):
            raise ProtocolError(f"grant of {m.nslots} slots is too small for chunk {m.chunk}")
        serve.granted.add(m.chunk)
        serve.grants.append(m)
        self._progressed(serve)

    def on_ack(self, peer: Peer, m: wire.Ack) -> None:
        serve = self.of(peer, m.xid, Flow.PULL, "ack")
        ch = serve.inflight.get(m.chunk)
        if ch is None or ch.kernel is not None:  # never announced: the peer cannot have read it
            raise ProtocolError(f"ack for chunk {m.chunk} that is not in flight")
        del serve.inflight[m.chunk]
        self.share.free(peer.md.engine, ch)
        serve.acked += 1
        self._progressed(serve)

    def on_runs_done(self, peer: Peer, m: wire.RunsDone) -> None:
        serve = self.of(peer, m.xid, Flow.PULL, "ack")
        if not serve.runs_reader:
            raise ProtocolError(f"RunsDone for {m.xid!r}, which has no DIRECT runs to read")
        serve.runs_reader = False
        self._progressed(serve)

    def on_abort(self, peer: Peer, m: wire.Abort) -> None:
        serve = self.by_key.get((peer.agent, m.xid))
        if serve is not None and serve.peer is peer:
            if _offered(serve):  # declined: the fetch asked something else
                self.stats.eager_misses += 1
            self.drop(serve)

    def transfer_failed(self, xid: str | None, peer: Peer, error: KVTritonError) -> None:
        """A message about transfer ``xid`` from ``peer`` could not be handled: drop it."""
        serve = self.by_key.get((peer.agent, xid)) if isinstance(xid, str) else None
        if serve is not None and serve.peer is peer:
            self.drop(serve, notify=f"bad message: {error}")

    # ------------------------------------------------------------------ progress
    def advance(self) -> list[Serve]:
        """One step of every transfer: send (announce or WRITE) what was packed and reserve the
        next chunks, queued in the pack batch (the caller launches it); returns the transfers
        that reserved chunks (:meth:`send_packed` sends them once packed)."""
        reserved = []
        for serve in list(self.by_key.values()):
            queued = len(self.batch.jobs)
            if not self._step(serve, serve.advance):
                continue
            if len(self.batch.jobs) > queued:
                reserved.append(serve)
            if serve.complete:
                self._remove(serve)
            elif serve.waiting_engine or _offered(serve):
                # our engine's own writes, or an offer the decode has not fetched yet: not the
                # peer's silence (the hold's bound still applies)
                serve.touch()
            elif serve.waiting_local:
                # queued behind staging: only its own engine's progress carries its deadline
                last = self.engine_progress.get(serve.peer.md.engine)
                if last is not None:
                    serve.deadline = max(serve.deadline, last + serve.timeout_s)
        return reserved

    def send_packed(self, reserved: list[Serve]) -> None:
        """After the batch launched: announce or WRITE what it packed for ``reserved``."""
        for serve in reserved:
            if self.by_key.get(serve.key) is serve:
                self._step(serve, serve.send_packed)

    def _step(self, serve: Serve, step: Callable[[Serves], None]) -> bool:
        """Run ``step(self)``; False when it failed (the transfer is dropped, its peer told)."""
        try:
            step(self)
        except KVTritonError as e:
            self._fail(serve, e)
            return False
        return True

    def _fail(self, serve: Serve, e: KVTritonError) -> None:
        """This side could not go on with ``serve``: drop it, its peer told."""
        logger.warning("transfer %s to %s failed: %s", serve.xid, serve.peer.agent, e)
        self.drop(serve, notify=f"source failed: {e}")

    def reserve(self, serve: Serve, chunk: int) -> Chunk | None:
        """Reserve local slots for chunk ``chunk`` of ``serve`` and queue its pack in this step's
        batch (None when staging is full)."""
        ch = self.share.reserve(serve.chunks.nbytes(chunk), serve.peer.md.engine, chunk, keep=serve.req_id)
        if ch is not None:
            serve.inflight[chunk] = ch
            self.batch.add(PackJob.for_chunk(
                serve.read, serve.chunks, ch, serve.ids, serve.tokens, serve.ready,
                alive=lambda: self.by_key.get(serve.key) is serve and serve.inflight.get(chunk) is ch,
                failed=lambda e: self._fail(serve, e)))
        return ch

    # ------------------------------------------------------------------ offers (see .eager)
    def offer(self, hold: Hold, packed: Packed) -> bool:
        """Announce an eager pack to its destination rank as a transfer of its own; False when
        the peer has no room for another transfer or the send fails."""
        peer = packed.peer
        xid = f"{hold.req_id}|{self.s.name}>{peer.md.rank}!"
        if (peer.agent, xid) in self.by_key or not self.room(peer):
            return False
        serve = PullServe(xid, hold.req_id, peer, packed.read, packed.ids, packed.chunks, self.s.timeout_s,
                          time.monotonic() + self.s.timeout_s, ready=hold.ready, offered=True,
                          eager_slots=packed.nslots, runs_reader=packed.runs)  # runs: held until RunsDone
        serve.inflight = dict(packed.inflight)
        serve.next_chunk = packed.chunks.count
        slots, digests = [], []
        for c in range(packed.chunks.count):
            ch = serve.inflight[c]
            ch.kernel = None  # completed: announced by the offer, not by a ready
            slots += [ch.slot, ch.nslots]
            digests.append(seal(self.s, self.stats, ch))
        terms = packed.request.offer_terms(packed.payload.src_rank)
        if terms is None:  # never: a pack is made only of a payload that fits, equal block sizes
            return False
        return self._send_offer(serve, _offer(xid, hold.req_id, terms, tuple(slots), b"".join(digests)))

    def offer_runs(self, hold: Hold, peer: Peer, request: RequestPlan) -> bool:
        """Offer ``peer`` to READ ``hold``'s blocks straight from our cache (read_unpack): an
        :class:`~kvtriton.protocol.wire.Offer` without slots, sent once the engine's writes are done, and
        a transfer that keeps the blocks until the reader's RunsDone (or the hold ends), as a
        pull's RunsReady would. Saves the pull's round trip to this process. ``request``: the
        hold's :meth:`RequestPlan.for_hold` (its terms are the offer's)."""
        xid = f"{hold.req_id}|{self.s.name}>{peer.md.rank}!"
        if (peer.agent, xid) in self.by_key or not self.room(peer):
            return False
        serve = PullServe(xid, hold.req_id, peer, None, hold.block_ids, None, self.s.timeout_s,
                          time.monotonic() + self.s.timeout_s, ready=hold.ready, offered=True, runs_reader=True)
        return self._send_offer(serve, _offer(xid, hold.req_id, request.cache_offer_terms(), ()))

    def _send_offer(self, serve: PullServe, offer: wire.Offer) -> bool:
        """Send ``offer`` and, once it is out, keep ``serve`` as the offered transfer."""
        try:
            self.links.send(serve.peer, offer)
        except KVTritonError:
            return False
        self.add(serve)
        self.offered[(serve.peer.agent, offer.req)] = serve
        self.stats.eager_offers += 1
        return True

    def take_offer(self, serve: PullServe, offered: PullServe) -> None:
        """``serve``, a pull, takes over the chunks of ``offered`` (its peer's offer of the same
        request) when they are its payload or the packed chunks of a suffix it asks (a -1 prefix,
        see :mod:`.eager`); the offer is withdrawn in any case."""
        got = None
        if not serve.inflight and serve.tokens is None and offered.read == serve.read and serve.chunks is not None:
            got = suffix_chunks(offered.ids, offered.chunks, offered.inflight, serve.ids, serve.chunks)
        # The pull comes from the very rank the offer was made to, so that rank is not reading the
        # offer: a destination part either takes an offer (and READs without a pull) or pulls,
        # never both, and a part that took it and failed aborts it before any later pull. Nothing
        # is quarantined here (that is for withdrawals a reader may not have seen yet).
        if not got or not got[0]:
            self.stats.eager_misses += 1
            self.drop(offered, notify=f"offer of {serve.req_id!r} withdrawn: a pull for something else arrived",
                      quarantine=False)
            return
        taken, before = got
        self.stats.eager_offer_pulls += 1
        freed = sum(ch.nslots for ch in before.values())  # the chunks before the suffix: not read either
        self.share.retire(offered.peer.md.engine, before, 0.0)
        serve.inflight, offered.inflight = taken, {}
        serve.next_chunk, serve.eager_slots, offered.eager_slots = serve.chunks.count, offered.eager_slots - freed, 0
        self.eager_returned(freed)
        self._remove(offered)
        for ch in serve.inflight.values():
            self.links.send(serve.peer, wire.Ready(serve.xid, ch.index, ch.slot, ch.nslots, ch.nbytes,
                                                   seal(self.s, self.stats, ch)), quiet=True)

    def withdraw_offers(self, req_id: str, engine: str) -> int:
        """Withdraw the offers of ``req_id`` to engines other than ``engine`` (it was bound to
        that one; the others may be reading them: quarantined); how many."""
        gone = [s for s in self.offered.values() if s.req_id == req_id and s.peer.md.engine != engine]
        for serve in gone:
            self.drop(serve, notify=f"offer of {req_id!r} withdrawn: the request went to engine {engine!r}")
        return len(gone)

    def offered_chunks(self, req_id: str) -> int:
        """Chunks of ``req_id`` offered and not taken yet."""
        return sum(s.n_chunks for s in self.offered.values() if s.req_id == req_id)

    # ------------------------------------------------------------------ ending transfers
    def drop(self, serve: Serve, notify: str | None = None, quarantine: bool | None = None) -> None:
        """Forget a transfer. With ``notify`` the peer is told (it fails the request or forgets
        the offer) and, unless ``quarantine`` is False (the peer is known not to be reading
        them), slots it may still be reading are quarantined for ``timeout_s`` before reuse, so
        a late READ never sees another request's bytes. Without ``notify`` the transfer ended
        cleanly or its peer is gone: nothing is quarantined."""
        self._remove(serve)
        if notify is not None:
            self.links.send(serve.peer, wire.Reject(serve.xid, self.links.reason(serve.peer, notify)), quiet=True)
        if quarantine is None:
            quarantine = notify is not None
        until = time.monotonic() + (self.s.timeout_s if quarantine else 0.0)
        # quarantined slots still count to the engine's share: dropping transfers gains it nothing
        self.share.retire(serve.peer.md.engine, serve.inflight, until)
        serve.ended(self, quarantine, until)  # a peer that may still read keeps the blocks too

    def drop_request(self, req_id: str, reason: str, finished_engine: str | None) -> None:
        """``req_id``'s hold ended: transfers to the engine that reported it done only have local
        completions left (e.g. a WRITE whose data already landed): they are retired quietly. Any
        other transfer of the request is told and its slots quarantined."""
        for serve in [s for s in self.by_key.values() if s.req_id == req_id]:
            if serve.peer.md.engine == finished_engine:
                self.drop(serve)
            else:
                self.drop(serve, notify=f"{req_id!r} was released ({reason})")

    def expire(self, now: float) -> None:
        for serve in list(self.by_key.values()):
            if now > serve.deadline:
                logger.warning("transfer %s: peer %s went silent; staging reclaimed", serve.xid, serve.peer.agent)
                self.drop(serve, notify="no progress from the destination before the deadline")

    def peer_lost(self, peer: Peer) -> None:
        for serve in [s for s in self.by_key.values() if s.peer is peer]:
            self.drop(serve)

    def close(self, reason: str) -> None:
        for serve in list(self.by_key.values()):
            self.links.send(serve.peer, wire.Reject(serve.xid, reason), quiet=True)
