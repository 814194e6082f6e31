"""The transfers a source rank serves: one per (request, destination rank), each packing its
chunks into local staging and announcing them (pull) or WRITing them into granted slots (push).

What a peer can take is bounded (every message is untrusted, even after a good handshake):

* **Staging.** Each peer engine may keep at most its fair share of the staging pool (the pool
  divided by the connected engines, at least one chunk): a peer that never acks pins only its
  share, so the others always progress.
* **Time.** A transfer waiting for staging has its silence deadline carried only by its own
  engine's progress (acks, grants, RunsDone), never by waiting.
* **Count.** At most :data:`MAX_SERVES_PER_PEER` transfers per peer rank; transfers are keyed by
  (peer, transfer id), so one peer cannot claim another's id.

A step reserves the chunks it can, then packs them all at its end (:mod:`.packing`): the chunks
of several destinations that read the same blocks (the decode ranks of one request) share one
launch, and a launch refused for one destination fails only that transfer.

:class:`SourceServes` is the part of :class:`~.source.Source` that runs them; the state it uses
(``serves``, ``engine_slots``, ``engine_progress``, ``peer_serves``, ``offered``, ``eager``,
``holds``) is created by ``Source.__init__``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..errors import KVTritonError, ProtocolError
from ..plan import ChunkGeometry, StagedRead, TokenMap
from ..protocol import wire
from .links import Chunk, Flow, Peer, logger
from .packing import PackJob
from .streams import event_done

MAX_SERVES_PER_PEER = 4096  # transfers one peer rank may have open on this rank at once


@dataclass(eq=False)
class Serve:
    """One (request, destination rank) transfer."""

    xid: str
    req_id: str
    peer: Peer
    flow: Flow
    read: StagedRead | None
    ids: np.ndarray
    chunks: ChunkGeometry | None  # None when this rank sends the destination no staged payload
    timeout_s: float
    deadline: float
    next_chunk: int = 0
    acked: int = 0
    inflight: dict = field(default_factory=dict)  # chunk -> Chunk
    grants: deque = field(default_factory=deque)  # push: Grant messages waiting for a local slot
    granted: set = field(default_factory=set)  # push: chunks the peer granted slots for
    runs: tuple | None = None  # push: (local list, remote list, count, nbytes) of DIRECT runs to WRITE
    runs_xfer: object = None  # push: the WRITE of the DIRECT runs, until it completes
    runs_reader: bool = False  # pull: the peer reads our cache directly until it sends RunsDone
    waiting_local: bool = False  # blocked on our own staging: not the peer's silence
    waiting_engine: bool = False  # blocked on the hold's event (the engine still writing the blocks)
    tokens: TokenMap | None = None  # block sizes differ: the request's token map (ids = its read_ids)
    ready: object = None  # the hold's event: packs wait for it on the device, DIRECT runs on the host
    runs_announce: bool = False  # pull: RunsReady not sent yet (the hold's event had not completed)
    offered: bool = False  # an eager pack offered ahead of the pull: nothing heard from the peer yet
    eager_slots: int = 0  # slots of the eager budget it keeps until it ends

    @property
    def n_chunks(self) -> int:
        return self.chunks.count if self.chunks is not None else 0

    @property
    def complete(self) -> bool:
        return (self.acked == self.n_chunks and self.runs is None and not self.inflight
                and not self.runs_reader)

    @property
    def key(self) -> tuple[str, str]:
        return self.peer.agent, self.xid

    def touch(self) -> None:
        """Progress was made: the silence deadline starts over."""
        self.deadline = time.monotonic() + self.timeout_s


class SourceServes:
    """Transfers served by a source rank: their messages, progress, packing and ending (a mixin
    of :class:`~.source.Source`)."""

    def _serve_from(self, peer: Peer, xid: str, flow: Flow, what: str) -> Serve:
        serve = self.serves.get((peer.agent, xid))  # keyed by the sender: nobody reaches another's
        if serve is None or serve.peer is not peer or serve.flow is not flow:
            raise ProtocolError(f"{what} for unknown transfer {xid!r}")
        return serve

    def _add(self, serve: Serve) -> None:
        self.serves[serve.key] = serve
        self.peer_serves[serve.peer.agent] = self.peer_serves.get(serve.peer.agent, 0) + 1

    def _remove(self, serve: Serve) -> None:
        if self.serves.pop(serve.key, None) is not None:
            if self.offered.get((serve.peer.agent, serve.req_id)) is serve:
                del self.offered[(serve.peer.agent, serve.req_id)]
            self.eager.slots -= serve.eager_slots
            n = self.peer_serves.pop(serve.peer.agent) - 1
            if n:
                self.peer_serves[serve.peer.agent] = n

    def _progressed(self, serve: Serve) -> None:
        """The peer did something for ``serve``: its deadline, and its engine's queued transfers',
        start over."""
        serve.touch()
        self.engine_progress[serve.peer.md.engine] = time.monotonic()
        if serve.offered:  # the peer took the offer: from now on its silence counts
            hold = self.holds.get(serve.req_id)
            if hold is not None and not self.bind(hold, serve.peer.md.engine):
                raise ProtocolError(f"{serve.xid!r}: {serve.req_id!r} is held for engine {hold.consumer!r}")
            self.links.stats["eager_hits"] += 1
            serve.offered = False
            if self.offered.get((serve.peer.agent, serve.req_id)) is serve:
                del self.offered[(serve.peer.agent, serve.req_id)]

    def _free(self, serve: Serve, ch: Chunk) -> None:
        self.s.pool.free(ch.slot, ch.nslots)
        self.uncount(serve.peer.md.engine, ch)

    def uncount(self, engine: str, ch: Chunk) -> None:
        self.engine_slots[engine] -= ch.nslots

    def share(self) -> int:
        """Staging slots one peer engine may keep: the pool divided by the connected engines,
        at least one largest chunk."""
        engines = {p.md.engine for p in self.links.peers.values()}
        return max(self.s.pool.slots_for(self.s.chunk_bytes), self.s.pool.num_slots // max(1, len(engines)))

    def on_grant(self, peer: Peer, m: wire.Grant) -> None:
        serve = self._serve_from(peer, m.xid, Flow.PUSH, "grant")
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
        serve = self._serve_from(peer, m.xid, Flow.PULL, "ack")
        ch = serve.inflight.get(m.chunk)
        if ch is None or ch.kernel is not None:  # never announced: the peer cannot have read it
            raise ProtocolError(f"ack for chunk {m.chunk} that is not in flight")
        del serve.inflight[m.chunk]
        self._free(serve, ch)
        serve.acked += 1
        self._progressed(serve)

    def on_runs_done(self, peer: Peer, m: wire.RunsDone) -> None:
        serve = self._serve_from(peer, m.xid, Flow.PULL, "ack")
        if not serve.runs_reader:
            raise ProtocolError(f"RunsDone for {m.xid!r}, which has no DIRECT runs to read")
        serve.runs_reader = False
        self._progressed(serve)

    def on_abort(self, peer: Peer, m: wire.Abort) -> None:
        serve = self.serves.get((peer.agent, m.xid))
        if serve is not None and serve.peer is peer:
            if serve.offered:  # declined: the fetch asked something else
                self.links.stats["eager_misses"] += 1
            self.drop(serve)

    def transfer_failed(self, xid: str | None, peer: Peer, error: KVTritonError) -> None:
        """A message about transfer ``xid`` from ``peer`` could not be handled: drop it."""
        serve = self.serves.get((peer.agent, xid)) if isinstance(xid, str) else None
        if serve is not None and serve.peer is peer:
            self.drop(serve, notify=f"bad message: {error}")

    # ------------------------------------------------------------------ progress
    def advance(self) -> None:
        """One step of every transfer: announce (pull) or WRITE (push) what was packed, reserve
        the next chunks, then pack every chunk reserved in this step in as few launches as their
        block ids allow (:mod:`.packing`: several decode ranks of one request, one launch) and
        announce or WRITE what that packed."""
        reserved = []  # transfers with chunks reserved in this step
        try:
            self.eager.advance()
            for serve in list(self.serves.values()):
                queued = len(self.batch.jobs)
                if not self._step(serve, self._advance_pull if serve.flow is Flow.PULL else self._advance_push):
                    continue
                if len(self.batch.jobs) > queued:
                    reserved.append(serve)
                if serve.complete:
                    self._remove(serve)
                elif serve.waiting_engine or serve.offered:
                    # our engine's own writes, or an offer the decode has not fetched yet: not the
                    # peer's silence (the hold's bound still applies)
                    serve.touch()
                elif serve.waiting_local:
                    # queued behind staging: only its own engine's progress carries its deadline
                    last = self.engine_progress.get(serve.peer.md.engine)
                    if last is not None:
                        serve.deadline = max(serve.deadline, last + serve.timeout_s)
        finally:
            self.batch.launch()  # nothing reserved is left unpacked, whatever raised above
        for serve in reserved:
            if self.serves.get(serve.key) is serve:
                self._step(serve, self._announce if serve.flow is Flow.PULL else self._write)

    def _step(self, serve: Serve, step) -> bool:
        """Run ``step(serve)``; False when it failed (the transfer is dropped, its peer told)."""
        try:
            step(serve)
        except KVTritonError as e:
            self._fail(serve, e)
            return False
        return True

    def _fail(self, serve: Serve, e: KVTritonError) -> None:
        """This side could not go on with ``serve``: drop it, its peer told."""
        logger.warning("transfer %s to %s failed: %s", serve.xid, serve.peer.agent, e)
        self.drop(serve, notify=f"source failed: {e}")

    def _advance_pull(self, serve: Serve) -> None:
        # announce every chunk whose pack finished, then reserve the next while staging allows
        serve.waiting_local = serve.waiting_engine = False
        if serve.runs_announce:  # DIRECT runs: the peer reads the cache once the engine's writes are done
            if not event_done(serve.ready):
                serve.waiting_engine = True
            else:
                serve.runs_announce = False
                self.links.send(serve.peer, wire.RunsReady(serve.xid))
        self._announce(serve)
        while serve.next_chunk < serve.n_chunks and len(serve.inflight) < self.s.inflight:
            if self._reserve(serve, serve.next_chunk) is None:
                serve.waiting_local = True
                return  # staging full: wait for acks (here or of other transfers)
            serve.next_chunk += 1

    def _announce(self, serve: Serve) -> None:
        """Pull: a ``ready`` for every chunk whose pack finished."""
        for ch in serve.inflight.values():
            if ch.kernel is not None and ch.kernel.done():
                ch.kernel = None
                self.links.send(serve.peer, wire.Ready(serve.xid, ch.index, ch.slot, ch.nslots, ch.nbytes))

    def _advance_push(self, serve: Serve) -> None:
        if serve.runs is not None and serve.runs_xfer is None and event_done(serve.ready):
            local, remote, count, _ = serve.runs
            serve.runs_xfer = self.links.post_runs("WRITE", local, remote, count, wire.RunsReady(serve.xid))
        if serve.runs_xfer is not None and self.links.done(serve.runs_xfer):  # ERR raises: reject
            self.links.transport.release(serve.runs_xfer)
            self.links.release_lists(*serve.runs[:2])()
            serve.runs, serve.runs_xfer = None, None
        serve.waiting_local = False
        serve.waiting_engine = serve.runs is not None and serve.runs_xfer is None  # the engine is still writing
        self._write(serve)
        while serve.grants and len(serve.inflight) < self.s.inflight:
            grant = serve.grants[0]
            ch = self._reserve(serve, grant.chunk)
            if ch is None:
                serve.waiting_local = True
                return
            serve.grants.popleft()
            ch.remote_slot = grant.slot

    def _write(self, serve: Serve) -> None:
        """Push: a landed WRITE frees its slots; a finished pack is written."""
        for chunk, ch in list(serve.inflight.items()):
            if ch.xfer is not None:
                if self.links.done(ch.xfer):
                    self.links.transport.release(ch.xfer)
                    self._free(serve, ch)
                    del serve.inflight[chunk]
                    serve.acked += 1
            elif ch.kernel is not None and ch.kernel.done():
                ch.kernel = None
                ch.xfer = self.links.post_chunk("WRITE", ch, serve.peer, wire.Data(serve.xid, ch.index, ch.nbytes))

    def _reserve(self, serve: Serve, chunk: int) -> Chunk | None:
        """Reserve local slots for chunk ``chunk`` of ``serve`` and queue its pack in this step's
        batch (None when staging is full)."""
        ch = self.reserve_chunk(serve.chunks.nbytes(chunk), serve.peer.md.engine, chunk, keep=serve.req_id)
        if ch is not None:
            serve.inflight[chunk] = ch
            self.batch.add(PackJob.for_chunk(
                serve.read, serve.chunks, ch, serve.ids, serve.tokens, serve.ready,
                alive=lambda: self.serves.get(serve.key) is serve and serve.inflight.get(chunk) is ch,
                failed=lambda e: self._fail(serve, e)))
        return ch

    def reserve_chunk(self, nbytes: int, eng: str, chunk: int, evict: bool = True,
                      keep: str | None = None) -> Chunk | None:
        """Fresh local slots for chunk ``chunk`` of ``nbytes`` for engine ``eng``, counted to its
        share; nothing is packed into them yet (see :mod:`.packing`). None when its share or the
        pool is full. With ``evict``, eager packs of requests other than ``keep`` give way first
        (a pull is real, they are a guess)."""
        pool, need = self.s.pool, self.s.pool.slots_for(nbytes)
        while self.engine_slots.get(eng, 0) + need > self.share():
            # this engine has its share: a peer that never acks pins no more
            if not (evict and self.eager.evict(eng, keep)):
                return None
        slot = pool.alloc_bytes(nbytes)
        while slot is None and evict and self.eager.evict(None, keep):
            slot = pool.alloc_bytes(nbytes)
        if slot is None:
            return None
        self.engine_slots[eng] = self.engine_slots.get(eng, 0) + need
        return Chunk(chunk, slot, need, nbytes)

    # ------------------------------------------------------------------ ending transfers
    def drop(self, serve: Serve, notify: str | None = None) -> None:
        """Forget a transfer. With ``notify`` the peer is told (it fails the request) and slots it
        may still be reading are quarantined for ``timeout_s`` before reuse, so a late READ never
        sees another request's bytes."""
        self._remove(serve)
        if notify is not None:
            self.links.send(serve.peer, wire.Reject(serve.xid, notify), quiet=True)
        until = time.monotonic() + (self.s.timeout_s if notify is not None else 0.0)
        # quarantined slots still count to the engine's share: dropping transfers gains it nothing
        eng = serve.peer.md.engine
        self.links.retire_chunks(serve.inflight, until, on_free=lambda ch: self.uncount(eng, ch))
        if serve.runs is not None:
            self.links.retire(serve.runs_xfer, self.links.release_lists(*serve.runs[:2]))
            serve.runs, serve.runs_xfer = None, None
        if serve.runs_reader and notify is not None:
            # the peer may still be reading our cache: keep the blocks a while longer
            hold = self.holds.get(serve.req_id)
            if hold is not None:
                hold.deadline = max(hold.deadline, until)

    def expire_serves(self, now: float) -> None:
        for serve in list(self.serves.values()):
            if now > serve.deadline:
                logger.warning("transfer %s: peer %s went silent; staging reclaimed", serve.xid, serve.peer.agent)
                self.drop(serve, notify="no progress from the destination before the deadline")
