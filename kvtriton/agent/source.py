"""The source side of a rank: held requests and the transfers that serve them, pack, the
announcement (pull) or WRITE (push) of each chunk, and releasing holds."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .. import wire
from ..errors import KVTritonError, ProtocolError
from ..ops import pack
from ..plan import ChunkGeometry, StagedRead, TransferPlan
from .links import Chunk, Completion, Flow, Links, Peer, Settings, logger


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
    deadline: float
    done_from: set = field(default_factory=set)


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

    @property
    def n_chunks(self) -> int:
        return self.chunks.count if self.chunks is not None else 0

    @property
    def complete(self) -> bool:
        return (self.acked == self.n_chunks and self.runs is None and not self.inflight
                and not self.runs_reader)

    def touch(self) -> None:
        """Progress was made: the silence deadline starts over."""
        self.deadline = time.monotonic() + self.timeout_s


class Source:
    """Held requests of this rank and the transfers serving them."""

    def __init__(self, settings: Settings, links: Links):
        self.s, self.links = settings, links
        self.holds: dict[str, Hold] = {}
        self.serves: dict[str, Serve] = {}
        # per (engine, destination rank, its cost model): a rank that reconnects with another model
        # is planned again
        self.plans: dict[tuple, TransferPlan] = {}
        self.freed: list[FreedRequest] = []

    # ------------------------------------------------------------------ holds
    def hold(self, req_id: str, block_ids: np.ndarray, lease_s: float) -> None:
        self.holds[req_id] = Hold(req_id, block_ids, time.monotonic() + lease_s)

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

        if xid in self.serves:
            return reject(f"transfer id {xid!r} is already in use")
        if flow is not self.s.flow:
            return reject(f"{me} runs in {self.s.flow.value} mode, got a {flow.value} request")
        hold = self.holds.get(req)
        if hold is None:
            return reject(f"request {req!r} is not held by {me} (never held, finished or lease expired)")
        ids = np.asarray(m.ids, dtype=np.int64)
        if ids.size == 0 or not np.isin(ids, hold.block_ids).all():
            return reject(f"block ids of {req!r} are not a subset of the {hold.block_ids.size} held blocks")
        dst_rank, eng = m.dst_rank, peer.md.engine
        if dst_rank != peer.md.rank:
            return reject(f"dst_rank {dst_rank} does not match the sender's rank {peer.md.rank}")
        plan = self.plans.get((eng, dst_rank, peer.md.cost))
        if plan is None:
            try:
                plan = self.s.plan(dst_rank, peer.md.tp, peer.md.regions, self.s.tp, self.s.specs,
                                   cost=peer.md.cost)  # the destination's model decides
            except KVTritonError as e:
                return reject(f"cannot plan for {eng}:{dst_rank}: {e}")
            self.plans[(eng, dst_rank, peer.md.cost)] = plan
        if m.plan != plan.digest():
            return reject(f"{eng}:{dst_rank} planned this transfer differently from {me} "
                          "(modes, cost model or replicate stripe differ between the engines)")
        read = plan.staged_read(self.s.rank)
        has_runs = self.s.rank in plan.direct_ranks(ids.size)
        if read is None and not has_runs:
            return reject(f"{me} has nothing to send to {eng}:{dst_rank}")
        chunks = None
        if read is not None:
            chunks = ChunkGeometry(read.bytes_per_block, ids.size, m.chunk_blocks)
            if not chunks.fits(self.s.chunk_bytes):
                return reject(f"chunk of {m.chunk_blocks} blocks does not fit staging chunks of "
                              f"{self.s.chunk_bytes} bytes")
        serve = Serve(xid, req, peer, flow, read, ids, chunks, self.s.timeout_s,
                      time.monotonic() + self.s.timeout_s)
        if flow is Flow.PUSH:
            dst_ids = np.asarray(m.dst_ids, dtype=np.int64)
            nb = min(r.num_blocks for r in peer.md.regions)
            if dst_ids.size != ids.size or (dst_ids.size and (dst_ids.min() < 0 or dst_ids.max() >= nb)) \
                    or np.unique(dst_ids).size != dst_ids.size:
                return reject(f"push: dst_ids must be {ids.size} distinct ids in [0, {nb})")
            try:
                serve.runs = self.links.prep_runs(plan, peer, ids, dst_ids, reading=False)
            except KVTritonError as e:
                return reject(f"push: {e}")
        self.serves[xid] = serve
        if flow is Flow.PULL and has_runs:
            # the blocks stay held (no lease expiry) until the reader sends RunsDone
            serve.runs_reader = True
            try:
                self.links.send(peer, wire.RunsReady(xid))
            except KVTritonError:
                del self.serves[xid]
                raise

    def _serve_from(self, peer: Peer, xid: str, flow: Flow, what: str) -> Serve:
        serve = self.serves.get(xid)
        if serve is None or serve.peer is not peer or serve.flow is not flow:
            raise ProtocolError(f"{what} for unknown transfer {xid!r}")
        return serve

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
        serve.touch()

    def on_ack(self, peer: Peer, m: wire.Ack) -> None:
        serve = self._serve_from(peer, m.xid, Flow.PULL, "ack")
        serve.touch()
        ch = serve.inflight.pop(m.chunk, None)
        if ch is None:
            raise ProtocolError(f"ack for chunk {m.chunk} that is not in flight")
        self.s.pool.free(ch.slot, ch.nslots)
        serve.acked += 1

    def on_runs_done(self, peer: Peer, m: wire.RunsDone) -> None:
        serve = self._serve_from(peer, m.xid, Flow.PULL, "ack")
        serve.touch()
        if not serve.runs_reader:
            raise ProtocolError(f"RunsDone for {m.xid!r}, which has no DIRECT runs to read")
        serve.runs_reader = False

    def on_done(self, peer: Peer, m: wire.Done) -> None:
        hold = self.holds.get(m.req)
        if hold is None:
            return  # already freed (lease) or never held: nothing to do
        if m.dst_rank != peer.md.rank or m.dst_tp != peer.md.tp:
            raise ProtocolError(f"done from {peer.agent} names rank {m.dst_rank}/{m.dst_tp}")
        hold.done_from.add(peer.key)
        if sum(1 for e, _ in hold.done_from if e == peer.md.engine) >= peer.md.tp:
            self._release_hold(hold, "done", finished_engine=peer.md.engine)

    def on_abort(self, peer: Peer, m: wire.Abort) -> None:
        serve = self.serves.get(m.xid)
        if serve is not None and serve.peer is peer:
            self.drop(serve)

    def transfer_failed(self, xid: str | None, peer: Peer, error: KVTritonError) -> None:
        """A message about transfer ``xid`` from ``peer`` could not be handled: drop it."""
        serve = self.serves.get(xid) if isinstance(xid, str) else None
        if serve is not None and serve.peer is peer:
            self.drop(serve, notify=f"bad message: {error}")

    # ------------------------------------------------------------------ progress
    def advance(self) -> None:
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
                del self.serves[serve.xid]
            elif serve.waiting_local:
                serve.touch()

    def _advance_pull(self, serve: Serve) -> None:
        # announce every chunk whose pack finished, then pack the next while staging allows
        serve.waiting_local = False
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
        if serve.runs is not None and serve.runs_xfer is None:
            local, remote, count, _ = serve.runs
            serve.runs_xfer = self.links.post_runs("WRITE", local, remote, count, wire.RunsReady(serve.xid))
        if serve.runs_xfer is not None and self.links.done(serve.runs_xfer):  # ERR raises: reject
            self.links.transport.release(serve.runs_xfer)
            self.links.release_lists(*serve.runs[:2])()
            serve.runs, serve.runs_xfer = None, None
        serve.waiting_local = False
        while True:
            # a landed WRITE frees its slots; a finished pack is written
            for chunk, ch in list(serve.inflight.items()):
                if ch.xfer is not None:
                    if self.links.done(ch.xfer):
                        self.links.transport.release(ch.xfer)
                        self.s.pool.free(ch.slot, ch.nslots)
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
        """Pack chunk ``chunk`` into fresh local slots (None when staging is full)."""
        nbytes = serve.chunks.nbytes(chunk)
        pool = self.s.pool
        slot = pool.alloc_bytes(nbytes)
        if slot is None:
            return None
        lo, hi = serve.chunks.bounds(chunk)
        offs = serve.read.segment_offsets(hi - lo, base=pool.offset(slot))
        pack(self.s.regions, serve.read.segments, offs, serve.ids[lo:hi], pool.tensor, impl=self.s.impl)
        ch = Chunk(chunk, slot, pool.slots_for(nbytes), nbytes, kernel=Completion(self.s.device))
        serve.inflight[chunk] = ch
        return ch

    # ------------------------------------------------------------------ ending transfers
    def drop(self, serve: Serve, notify: str | None = None) -> None:
        """Forget a transfer. With ``notify`` the peer is told (it fails the request) and slots it
        may still be reading are quarantined for ``timeout_s`` before reuse, so a late READ never
        sees another request's bytes."""
        self.serves.pop(serve.xid, None)
        if notify is not None:
            self.links.send(serve.peer, wire.Reject(serve.xid, notify), quiet=True)
        until = time.monotonic() + (self.s.timeout_s if notify is not None else 0.0)
        self.links.retire_chunks(serve.inflight, until)
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
        serving = {s.req_id for s in self.serves.values()}
        for hold in list(self.holds.values()):
            # a transfer in progress keeps its blocks (it has its own silence deadline)
            if now > hold.deadline and hold.req_id not in serving:
                self._release_hold(hold, "lease_expired")

    def peer_lost(self, peer: Peer) -> None:
        for serve in [s for s in self.serves.values() if s.peer is peer]:
            self.drop(serve)

    def close(self, reason: str) -> None:
        for serve in list(self.serves.values()):
            self.links.send(serve.peer, wire.Reject(serve.xid, reason), quiet=True)
