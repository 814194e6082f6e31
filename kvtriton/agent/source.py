"""The source side of a rank: held requests and the transfers that serve them, pack, the
announcement (pull) or WRITE (push) of each chunk, and releasing holds.

What a peer can take is bounded (every message is untrusted, even after a good handshake):

* **Entitlement.** A hold has one consumer engine: the one named at ``hold(consumer=...)``, or
  else the first engine whose ``pull``/``push`` this rank accepts for it (trust on first use).
  Only that engine's ranks may read it, report it ``done`` or ``renew`` its lease. A replica no
  rank of an engine reads (e.g. an MLA replica its stripe skips) binds to the first engine that
  reports it done, since nothing else will ever reach it; name the consumer to close even that.
* **Staging.** Each peer engine may keep at most its fair share of the staging pool (the pool
  divided by the connected engines, at least one chunk): a peer that never acks pins only its
  share, so the others always progress.
* **Time.** A transfer waiting for staging has its silence deadline carried only by its own
  engine's progress (acks, grants, RunsDone), never by waiting; a hold lives at most its lease
  (renewed by its consumer) plus ``timeout_s``, whatever its transfers do.
* **Count.** At most :data:`MAX_SERVES_PER_PEER` transfers per peer rank; transfers are keyed by
  (peer, transfer id), so one peer cannot claim another's id.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .. import wire
from ..errors import KVTritonError, PlanError, ProtocolError, RequestRejectedError
from ..ops import pack
from ..plan import ChunkGeometry, Mode, StagedRead, TransferPlan
from ..token_map import TokenMap
from .eager import EagerPacks, ids_digest
from .links import Chunk, Flow, Links, Peer, Settings, logger
from .streams import event_done

MAX_SERVES_PER_PEER = 4096  # transfers one peer rank may have open on this rank at once


@dataclass(frozen=True)
class FreedRequest:
    """A held request whose blocks the prefill side may reuse: ``reason`` is ``"done"`` (every
    consumer finished), ``"lease_expired"`` or ``"released"`` (:meth:`TransferAgent.release`)."""

    req_id: str
    reason: str


@dataclass(eq=False)
class Hold:
    """One held request."""

    req_id: str
    block_ids: np.ndarray
    lease_s: float
    deadline: float  # end of the lease: a renewal from the consumer moves it
    consumer: str | None = None  # the engine entitled to it (None: the first whose pull is accepted)
    done_from: set = field(default_factory=set)  # (engine, rank) of every done received
    ready: object = None  # torch.cuda.Event after which the engine's blocks are final (None: they are)


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


class Source:
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
        self.eager = EagerPacks(self, settings.eager_bytes)  # holds packed before their pull
        self.offered: dict[tuple[str, str], Serve] = {}  # (peer agent, req) -> offered, untouched transfer

    # ------------------------------------------------------------------ holds
    def hold(self, req_id: str, block_ids: np.ndarray, lease_s: float, consumer: str | None, ready=None) -> None:
        self.eager.release(req_id)  # a hold placed again: what was packed for the old one is stale
        hold = self.holds[req_id] = Hold(req_id, block_ids, lease_s, time.monotonic() + lease_s, consumer,
                                         ready=ready)
        self.eager.placed(hold)

    def serving(self, req_id: str) -> bool:
        return any(s.req_id == req_id for s in self.serves.values())

    def release(self, req_id: str) -> bool:
        hold = self.holds.get(req_id)
        if hold is None:
            return False
        self._release_hold(hold, "released")
        return True

    def take_freed(self) -> list[FreedRequest]:
        out, self.freed = self.freed, []
        return out

    def _release_hold(self, hold: Hold, reason: str, finished_engine: str | None = None) -> None:
        """Free a held request. Transfers to the engine that reported it done only have local
        completions left (e.g. a WRITE whose data already landed): they are retired quietly.
        Any other transfer of the request is told and its slots quarantined."""
        self.holds.pop(hold.req_id, None)
        self.eager.release(hold.req_id)
        for serve in [s for s in self.serves.values() if s.req_id == hold.req_id]:
            if serve.peer.md.engine == finished_engine:
                self.drop(serve)
            else:
                self.drop(serve, notify=f"{hold.req_id!r} was released ({reason})")
        self.freed.append(FreedRequest(hold.req_id, reason))

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
        if offered is not None and offered.offered:  # pulled instead of taken (e.g. the offer was late)
            if serve.inflight or not (offered.read == read and offered.chunks == chunks and tokens is None
                                      and np.array_equal(offered.ids, ids)):
                self.links.stats["eager_misses"] += 1
                self.drop(offered, notify=f"offer of {req!r} withdrawn: a pull for something else arrived")
            else:  # exactly the offered payload: this transfer takes it over and announces it
                self.links.stats["eager_hits"] += 1
                serve.inflight, offered.inflight = offered.inflight, {}
                serve.next_chunk, serve.eager_slots, offered.eager_slots = chunks.count, offered.eager_slots, 0
                self._remove(offered)
                for ch in serve.inflight.values():
                    self.links.send(peer, wire.Ready(xid, ch.index, ch.slot, ch.nslots, ch.nbytes), quiet=True)
        self._add(serve)
        hold.consumer = eng  # the first accepted transfer binds an unbound hold to its engine
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
                      eager_slots=packed.nslots)
        serve.inflight = dict(packed.inflight)
        serve.next_chunk = packed.chunks.count
        slots = []
        for c in range(packed.chunks.count):
            ch = serve.inflight[c]
            ch.kernel = None  # completed: announced by the offer, not by a ready
            slots += [ch.slot, ch.nslots]
        try:
            self.links.send(peer, wire.Offer(xid, hold.req_id, packed.digest, ids_digest(packed.ids),
                                             int(packed.ids.size), packed.chunks.blocks_per_chunk, tuple(slots)))
        except KVTritonError:
            return False
        self._add(serve)
        self.offered[(peer.agent, hold.req_id)] = serve
        self.links.stats["eager_offers"] += 1
        return True

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

    def _reads_from_me(self, peer: Peer, nblocks: int) -> bool:
        """Whether any rank of ``peer``'s engine reads from this rank for a request of ``nblocks``."""
        for d in range(peer.md.tp):
            plan = self.plans.get((peer.md.engine, d))
            if plan is None:
                try:
                    plan = self.s.plan(d, peer.md.tp, peer.md.regions, self.s.tp, self.s.specs)
                except KVTritonError:
                    return True  # unplannable: never a reason to release anything
                self.plans[(peer.md.engine, d)] = plan
            if plan.staged_read(self.s.rank) is not None or self.s.rank in plan.direct_ranks(nblocks):
                return True
        return False

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

    def on_done(self, peer: Peer, m: wire.Done) -> None:
        hold = self.holds.get(m.req)
        if hold is None:
            return  # already freed (lease) or never held: nothing to do
        if m.dst_rank != peer.md.rank or m.dst_tp != peer.md.tp:
            raise ProtocolError(f"done from {peer.agent} names rank {m.dst_rank}/{m.dst_tp}")
        eng = peer.md.engine
        if hold.consumer is None and not self._reads_from_me(peer, hold.block_ids.size):
            hold.consumer = eng  # a replica this engine skips: its done is all that will come
        if hold.consumer is not None and hold.consumer != eng:
            self.links.stats["refused"] += 1
            raise ProtocolError(f"done for {m.req!r} from {peer.agent}: {self.s.name} holds it for "
                                f"engine {hold.consumer!r}")
        # an unbound hold records it too: a rank may finish before its sibling's pull binds us
        hold.done_from.add(peer.key)
        if hold.consumer == eng and sum(1 for e, _ in hold.done_from if e == eng) >= peer.md.tp:
            self._release_hold(hold, "done", finished_engine=eng)

    def on_renew(self, peer: Peer, m: wire.Renew) -> None:
        """The consumer still wants the request: the lease starts over. From anyone else it is
        ignored (counted as refused): renewal never keeps alive what the sender may not read."""
        hold = self.holds.get(m.req)
        if m.dst_rank != peer.md.rank:
            raise ProtocolError(f"renew from {peer.agent} names rank {m.dst_rank}")
        if hold is None:
            return
        if hold.consumer != peer.md.engine:
            self.links.stats["refused"] += 1
            return
        hold.deadline = max(hold.deadline, time.monotonic() + hold.lease_s)

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
        self.eager.advance()
        for serve in list(self.serves.values()):
            try:
                if serve.flow is Flow.PULL:
                    self._advance_pull(serve)
                else:
                    self._advance_push(serve)
            except KVTritonError as e:
                logger.warning("transfer %s to %s failed: %s", serve.xid, serve.peer.agent, e)
                self.drop(serve, notify=f"source failed: {e}")
                continue
            if serve.complete:
                self._remove(serve)
            elif serve.waiting_engine or serve.offered:
                # our engine's own writes, or an offer the decode has not fetched yet: not the
                # peer's silence (the hold's bound still applies)
                serve.touch()  # our engine's own writes, not the peer's silence (the hold's bound still applies)
            elif serve.waiting_local:
                # queued behind staging: only its own engine's progress carries its deadline
                last = self.engine_progress.get(serve.peer.md.engine)
                if last is not None:
                    serve.deadline = max(serve.deadline, last + serve.timeout_s)

    def _advance_pull(self, serve: Serve) -> None:
        # announce every chunk whose pack finished, then pack the next while staging allows
        serve.waiting_local = serve.waiting_engine = False
        if serve.runs_announce:  # DIRECT runs: the peer reads the cache once the engine's writes are done
            if not event_done(serve.ready):
                serve.waiting_engine = True
            else:
                serve.runs_announce = False
                self.links.send(serve.peer, wire.RunsReady(serve.xid))
        while True:
            for ch in serve.inflight.values():
                if ch.kernel is not None and ch.kernel.done():
                    ch.kernel = None
                    self.links.send(serve.peer, wire.Ready(serve.xid, ch.index, ch.slot, ch.nslots, ch.nbytes))
            if not (serve.next_chunk < serve.n_chunks and len(serve.inflight) < self.s.inflight):
                return
            if self._pack(serve, serve.next_chunk) is None:
                serve.waiting_local = True
                return  # staging full: wait for acks (here or of other transfers)
            serve.next_chunk += 1

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
        while True:
            # a landed WRITE frees its slots; a finished pack is written
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
            if not (serve.grants and len(serve.inflight) < self.s.inflight):
                return
            grant = serve.grants[0]
            ch = self._pack(serve, grant.chunk)
            if ch is None:
                serve.waiting_local = True
                return
            serve.grants.popleft()
            ch.remote_slot = grant.slot

    def _pack(self, serve: Serve, chunk: int) -> Chunk | None:
        """Pack chunk ``chunk`` of ``serve`` into fresh local slots (None when staging is full)."""
        ch = self.pack_chunk(serve.read, serve.chunks, serve.ids, serve.tokens, serve.ready, serve.peer.md.engine,
                             chunk, keep=serve.req_id)
        if ch is not None:
            serve.inflight[chunk] = ch
        return ch

    def pack_chunk(self, read: StagedRead, chunks: ChunkGeometry, ids: np.ndarray, tokens: TokenMap | None,
                   ready, eng: str, chunk: int, evict: bool = True, keep: str | None = None) -> Chunk | None:
        """Pack chunk ``chunk`` for engine ``eng`` into fresh local slots, after ``ready``
        (None when its share or the pool is full). With ``evict``, eager packs of requests other
        than ``keep`` give way first (a pull is real, they are a guess)."""
        nbytes = chunks.nbytes(chunk)
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
        lo, hi = chunks.bounds(chunk)
        offs = read.segment_offsets(hi - lo, base=pool.offset(slot))
        with self.s.lanes.launching(after=ready):  # after the engine's writes, on our stream
            if tokens is None:
                pack(self.s.regions, read.segments, offs, ids[lo:hi], pool.tensor, impl=self.s.impl)
            else:
                pack(self.s.regions, read.segments, offs, tokens.src_ids, pool.tensor,
                     impl=self.s.impl, tiles=tokens.tiles[lo:hi], num_tokens=tokens.num_tokens)
        ch = Chunk(chunk, slot, need, nbytes, kernel=self.s.lanes.completion())
        self.engine_slots[eng] = self.engine_slots.get(eng, 0) + need
        return ch

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

    def expire(self, now: float) -> None:
        for serve in list(self.serves.values()):
            if now > serve.deadline:
                logger.warning("transfer %s: peer %s went silent; staging reclaimed", serve.xid, serve.peer.agent)
                self.drop(serve, notify="no progress from the destination before the deadline")
        serving = {s.req_id for s in self.serves.values() if not s.offered}  # an offer alone: the lease rules
        for hold in list(self.holds.values()):
            # a transfer in progress keeps its blocks (it has its own silence deadline), but never
            # past the lease plus timeout_s: then the hold goes whatever its transfers do
            if now > hold.deadline and (hold.req_id not in serving or now > hold.deadline + self.s.timeout_s):
                self._release_hold(hold, "lease_expired")

    def peer_lost(self, peer: Peer) -> None:
        self.eager.peer_lost(peer)
        for serve in [s for s in self.serves.values() if s.peer is peer]:
            self.drop(serve)

    def close(self, reason: str) -> None:
        for serve in list(self.serves.values()):
            self.links.send(serve.peer, wire.Reject(serve.xid, reason), quiet=True)
