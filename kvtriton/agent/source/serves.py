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

One class per flow (:mod:`.flows`: :class:`~.flows.PullServe`, :class:`~.flows.PushServe`),
each accepting its own requests and stepping its own transfers. :class:`Serves` owns the open
transfers of a rank: their table, their messages, their steps and their end; its
:class:`~.offers.Offers` the transfers offered ahead of a pull.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from ...errors import KVTritonError, ProtocolError
from ...protocol import wire
from ..links import Chunk, Links, Peer, logger
from ..settings import Settings
from ..stats import Stats
from .flows import PullServe, PushServe, Serve, TakePacked
from .holds import Holds
from .offers import Offers
from .packing import PackBatch, PackJob
from .share import StagingShare

__all__ = ["MAX_SERVES_PER_PEER", "PullServe", "PushServe", "Serve", "Serves"]

MAX_SERVES_PER_PEER = 4096  # transfers one peer rank may have open on this rank at once

Flowing = TypeVar("Flowing", PullServe, PushServe)


class Serves:
    """The transfers a source rank serves, keyed by (peer agent, transfer id): nobody reaches
    another peer's. ``take_packed(req, peer, digest, ids, chunks)``: the chunks packed ahead for
    exactly that pull (:meth:`~.eager.EagerPacks.take`); ``eager_returned(nslots)``: an offered
    transfer that ended gives its slots of the eager budget back."""

    def __init__(self, settings: Settings, links: Links, stats: Stats, holds: Holds, share: StagingShare,
                 batch: PackBatch, *, take_packed: TakePacked, eager_returned: Callable[[int], None]):
        self.s, self.links, self.stats = settings, links, stats
        self.holds, self.share, self.batch = holds, share, batch
        self.take_packed = take_packed
        self.by_key: dict[tuple[str, str], Serve] = {}
        self.per_peer: dict[str, int] = {}  # open transfers per peer agent
        self.engine_progress: dict[str, float] = {}  # when each peer engine last made progress
        self.offers = Offers(settings, stats, self, eager_returned=eager_returned)

    # ------------------------------------------------------------------ the table
    def room(self, peer: Peer) -> bool:
        """Whether ``peer`` may open one more transfer."""
        return self.per_peer.get(peer.agent, 0) < MAX_SERVES_PER_PEER

    def serving(self, req_id: str) -> bool:
        return any(s.req_id == req_id for s in self.by_key.values())

    def pulled_or_pushed(self) -> set[str]:
        """Requests a transfer serves (an offer alone is not one: the lease rules it)."""
        return {s.req_id for s in self.by_key.values() if not self.offers.offered(s)}

    def of(self, peer: Peer, xid: str, flow: type[Flowing], what: str) -> Flowing:
        """``peer``'s transfer ``xid`` of ``flow`` (raises when there is none)."""
        serve = self.by_key.get((peer.agent, xid))  # keyed by the sender: nobody reaches another's
        if not isinstance(serve, flow) or serve.peer is not peer:
            raise ProtocolError(f"{what} for unknown transfer {xid!r}")
        return serve

    def add(self, serve: Serve) -> None:
        self.by_key[serve.key] = serve
        self.per_peer[serve.peer.agent] = self.per_peer.get(serve.peer.agent, 0) + 1

    def remove(self, serve: Serve) -> None:
        """Take ``serve`` out of the table (its chunks are the caller's)."""
        if self.by_key.pop(serve.key, None) is not None:
            self.offers.ended(serve)
            n = self.per_peer.pop(serve.peer.agent) - 1
            if n:
                self.per_peer[serve.peer.agent] = n

    def _progressed(self, serve: Serve) -> None:
        """The peer did something for ``serve``: its deadline, and its engine's queued transfers',
        start over."""
        serve.touch()
        self.engine_progress[serve.peer.md.engine] = time.monotonic()
        if self.offers.offered(serve):  # the peer took the offer: from now on its silence counts
            self.offers.read(serve)

    # ------------------------------------------------------------------ messages
    def on_grant(self, peer: Peer, m: wire.Grant) -> None:
        serve = self.of(peer, m.xid, PushServe, "grant")
        chunks = serve.chunks
        if serve.read is None or chunks is None:
            raise ProtocolError(f"grant for unknown transfer {m.xid!r}")
        if m.chunk in serve.granted:
            raise ProtocolError(f"second grant for chunk {m.chunk} of {m.xid!r}")
        st = peer.md.staging
        if not (0 <= m.chunk < serve.n_chunks and 0 <= m.slot and m.nslots >= 1
                and m.slot + m.nslots <= st.num_slots):
            raise ProtocolError(f"grant {m.chunk}/{m.slot}+{m.nslots} is outside the peer's staging "
                                f"({st.num_slots} slots) or the transfer ({serve.n_chunks} chunks)")
        if m.nslots * st.slot_bytes < chunks.nbytes(m.chunk):
            raise ProtocolError(f"grant of {m.nslots} slots is too small for chunk {m.chunk}")
        serve.granted.add(m.chunk)
        serve.grants.append(m)
        self._progressed(serve)

    def on_ack(self, peer: Peer, m: wire.Ack) -> None:
        serve = self.of(peer, m.xid, PullServe, "ack")
        ch = serve.inflight.get(m.chunk)
        if ch is None or ch.kernel is not None:  # never announced: the peer cannot have read it
            raise ProtocolError(f"ack for chunk {m.chunk} that is not in flight")
        del serve.inflight[m.chunk]
        self.share.free(peer.md.engine, ch)
        serve.acked += 1
        self._progressed(serve)

    def on_runs_done(self, peer: Peer, m: wire.RunsDone) -> None:
        serve = self.of(peer, m.xid, PullServe, "ack")
        if not serve.runs_reader:
            raise ProtocolError(f"RunsDone for {m.xid!r}, which has no DIRECT runs to read")
        serve.runs_reader = False
        self._progressed(serve)

    def on_abort(self, peer: Peer, m: wire.Abort) -> None:
        serve = self.by_key.get((peer.agent, m.xid))
        if serve is not None and serve.peer is peer:
            self.offers.declined(serve)
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
                self.remove(serve)
            elif serve.waiting_engine or self.offers.offered(serve):
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
        read, chunks = serve.read, serve.chunks
        if read is None or chunks is None:  # never: only a staged payload has chunks to reserve
            raise KVTritonError(f"transfer {serve.xid!r} has no staged payload to pack")
        ch = self.share.reserve(chunks.nbytes(chunk), serve.peer.md.engine, chunk, keep=serve.req_id)
        if ch is not None:
            serve.inflight[chunk] = ch
            self.batch.add(PackJob.for_chunk(
                read, chunks, ch, serve.ids, serve.tokens, serve.ready,
                alive=lambda: self.by_key.get(serve.key) is serve and serve.inflight.get(chunk) is ch,
                failed=lambda e: self._fail(serve, e)))
        return ch

    # ------------------------------------------------------------------ ending transfers
    def drop(self, serve: Serve, notify: str | None = None, quarantine: bool | None = None) -> None:
        """Forget a transfer. With ``notify`` the peer is told (it fails the request or forgets
        the offer) and, unless ``quarantine`` is False (the peer is known not to be reading
        them), slots it may still be reading are quarantined for ``timeout_s`` before reuse, so
        a late READ never sees another request's bytes. Without ``notify`` the transfer ended
        cleanly or its peer is gone: nothing is quarantined."""
        self.remove(serve)
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

    def shift(self, seconds: float) -> None:
        """Every silence deadline later by ``seconds`` (this process stalled: :mod:`..stalls`)."""
        for serve in self.by_key.values():
            serve.deadline += seconds
        for engine in self.engine_progress:
            self.engine_progress[engine] += seconds

    def peer_lost(self, peer: Peer) -> None:
        for serve in [s for s in self.by_key.values() if s.peer is peer]:
            self.drop(serve)

    def close(self, reason: str) -> None:
        for serve in list(self.by_key.values()):
            self.links.send(serve.peer, wire.Reject(serve.xid, reason), quiet=True)
