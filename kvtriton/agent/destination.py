"""The destination side of a rank: fetches and their parts, READ (pull) or grants (push),
unpack, acks, and each fetch's finish or failure."""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .. import wire
from ..errors import (
    KVTritonError,
    PlanError,
    ProtocolError,
    RequestAbortedError,
    RequestRejectedError,
    StagingError,
    TransferTimeoutError,
)
from ..ops import unpack
from ..plan import ChunkGeometry, Mode, StagedRead, TransferPlan, ceil_div, compact_request
from ..token_map import TokenMap, compact_tokens
from .links import Chunk, Flow, Links, Peer
from .one_sided_reads import OneSidedReads
from .settings import Settings
from .source.request import ids_digest

MAX_OFFERS_PER_PEER = 1024  # offers kept per source rank (the oldest goes first)


@dataclass(frozen=True)
class RequestResult:
    """Outcome of a :meth:`TransferAgent.fetch`: ``ok``, or ``error`` (a KVTritonError).

    ``undefined_blocks``: after a failure, the local block ids whose content is undefined (some
    source's bytes for them had not all landed, or may still land): recompute exactly those.
    Every other block of the request holds the transferred KV. Empty when ``ok``."""

    req_id: str
    ok: bool
    error: KVTritonError | None = None
    seconds: float = 0.0
    descriptors: int = 0
    bytes: int = 0
    undefined_blocks: tuple[int, ...] = ()


@dataclass(eq=False)
class Fetch:
    """One request this rank reads from one source engine."""

    req_id: str
    engine: str
    started: float
    timeout_s: float  # without progress for this long the fetch fails
    deadline: float
    src_ids: np.ndarray  # source ids sent (token map: TokenMap.read_ids)
    dst_ids: np.ndarray  # destination block per staged tile / DIRECT position
    tokens: TokenMap | None = None  # block sizes differ: the request's token map
    parts: dict = field(default_factory=dict)  # src_rank -> Part
    error: KVTritonError | None = None
    descriptors: int = 0
    nbytes: int = 0
    renew_at: float = 0.0  # when the holds this fetch reads are renewed next
    ready: object = None  # torch.cuda.Event: the engine is done with the local blocks (unpacks wait)

    def touch(self) -> None:
        """Progress was made: the silence deadline starts over."""
        self.deadline = time.monotonic() + self.timeout_s


@dataclass(eq=False)
class Part:
    """What one source rank sends for one fetch: staged chunks and/or DIRECT runs.

    ``way`` is how the staged chunks travel (:mod:`kvtriton.one_sided`): STAGED (the source
    packs, we READ each announced chunk into our staging and unpack), READ_UNPACK (after the
    source's RunsReady we READ its cache blocks into our staging and unpack; no pack, no Ready,
    no Ack) or PACK_PLACE (the source packs, we READ each announced chunk straight into our cache
    blocks; no unpack). A part that reads the source's cache (DIRECT runs or READ_UNPACK) waits
    for RunsReady and ends with one RunsDone once every such READ has landed."""

    xid: str
    fetch: Fetch
    src_rank: int
    read: StagedRead | None
    chunks: ChunkGeometry | None  # None when this source sends no staged payload
    runs_pending: bool  # DIRECT runs from this source have not landed yet
    chunks_done: int = 0
    next_grant: int = 0
    readies: deque = field(default_factory=deque)  # pull: Ready messages waiting for a local slot
    inflight: dict = field(default_factory=dict)  # chunk -> Chunk (READ or unpack in flight / granted)
    runs_xfer: object = None  # pull: the READ of the DIRECT runs
    runs_lists: tuple = ()
    announced: set = field(default_factory=set)  # pull: chunks a Ready arrived for
    consumed: set = field(default_factory=set)  # chunks unpacked into the cache
    offered: bool = False  # pull: the source offered this payload ahead: READ at once, no pull sent
    way: Mode = Mode.STAGED
    reads_cache: bool = False  # pull: we read the source's cache (DIRECT runs or READ_UNPACK)
    go: bool = False  # pull: the source's RunsReady arrived (it holds the blocks until RunsDone)
    next_read: int = 0  # READ_UNPACK: the next chunk to READ from the source's cache
    reads_landed: int = 0  # READ_UNPACK: chunks whose READ has landed
    runs_done: bool = False  # pull: RunsDone sent (nothing of the source's cache is read any more)

    @property
    def n_chunks(self) -> int:
        return self.chunks.count if self.chunks is not None else 0

    @property
    def complete(self) -> bool:
        return (self.chunks_done == self.n_chunks and not self.runs_pending
                and (not self.reads_cache or self.runs_done))


class Destination(OneSidedReads):
    """Fetches in flight on this rank and the plans they read by (one per source engine)."""

    def __init__(self, settings: Settings, links: Links):
        self.s, self.links = settings, links
        self.plans: dict[str, TransferPlan] = {}  # per source engine
        self.unplannable: dict[str, PlanError] = {}  # engines a forced mode rules out reading from
        self.fetches: dict[str, Fetch] = {}
        self.parts: dict[str, Part] = {}  # by transfer id
        self.results: list[RequestResult] = []
        self._xid = itertools.count()
        self.offers: dict[tuple[str, int], dict[str, wire.Offer]] = {}  # source rank -> req -> its offer

    # ------------------------------------------------------------------ requests
    def fetch(self, req_id: str, engine: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
              timeout_s: float | None, num_tokens: int | None = None, ready=None) -> None:
        if req_id in self.fetches:
            raise RequestRejectedError(f"fetch {req_id!r} is already in flight")
        plan = self.plans.get(engine)
        if plan is None and engine in self.unplannable:
            raise PlanError(f"cannot fetch from {engine!r}: {self.unplannable[engine]}")
        if plan is None:
            raise KeyError(f"unknown engine {engine!r}: add_remote() its ranks first")
        missing = [r for r in plan.source_ranks if (engine, r) not in self.links.peers]
        if missing:
            raise KeyError(f"engine {engine!r}: no metadata yet for ranks {missing}")
        src_specs = self.links.engine_peers(engine)[0].md.regions
        src_nb, dst_nb = min(s.num_blocks for s in src_specs), min(s.num_blocks for s in self.s.specs)
        tokens = None
        if plan.maps_tokens:
            tokens = compact_tokens(remote_block_ids, local_block_ids, src_nb, dst_nb, plan.src_block_size,
                                    plan.dst_block_size, num_tokens)
            s_ids, d_ids = tokens.read_ids, tokens.tile_dst_ids
        else:
            s_ids, d_ids = compact_request(remote_block_ids, local_block_ids, src_nb, dst_nb)
        if max(s_ids.size, d_ids.size) > wire.MAX_REQUEST_BLOCKS:
            raise PlanError(f"fetch {req_id!r}: {max(s_ids.size, d_ids.size)} blocks is more than a request may "
                            f"have (kvtriton.wire.MAX_REQUEST_BLOCKS = {wire.MAX_REQUEST_BLOCKS}); split it")
        n = d_ids.size  # staged tiles (and DIRECT positions) per source
        now = time.monotonic()
        timeout = timeout_s or self.s.timeout_s
        f = Fetch(req_id, engine, now, timeout, now + timeout, s_ids, d_ids, tokens, renew_at=now + self.s.renew_s,
                  ready=ready)
        self.fetches[req_id] = f
        if n == 0:
            self._finish(f)
            return
        runs_ranks = plan.direct_ranks(n)
        for src_rank in sorted({s.src_rank for s in plan.staged} | runs_ranks):
            read = plan.staged_read(src_rank)
            peer = self.links.peers[(engine, src_rank)]
            chunks, way = None, Mode.STAGED
            if read is not None:
                try:
                    chunks = ChunkGeometry.fit(read.bytes_per_block, n,
                                               min(self.s.chunk_bytes, peer.md.staging.chunk_bytes))
                    way = self._way(f, read, peer, chunks, src_rank in runs_ranks)
                    if way is Mode.READ_UNPACK:  # nothing in the source's staging: our chunks only
                        chunks = ChunkGeometry.fit(read.bytes_per_block, n, self.s.chunk_bytes)
                except StagingError as e:
                    self.fail(f, StagingError(f"{engine}:{src_rank}: {e}"))
                    return
            xid = f"{req_id}|{self.s.name}<{src_rank}#{next(self._xid)}"
            while xid in self.parts:  # squatted by a source's offer id: never overwrite a part
                xid = f"{req_id}|{self.s.name}<{src_rank}#{next(self._xid)}"
            reads_cache = self.s.flow is Flow.PULL and (src_rank in runs_ranks or way is Mode.READ_UNPACK)
            if way is Mode.READ_UNPACK:
                offer = self._runs_offer_for(peer, req_id, plan, s_ids)
            else:
                offer = self._offer_for(peer, req_id, plan, s_ids if tokens is None else None, chunks,
                                        src_rank in runs_ranks)
            part = Part(offer.xid if offer else xid, f, src_rank, read, chunks, src_rank in runs_ranks, way=way,
                        reads_cache=reads_cache)
            if offer is not None and way is Mode.READ_UNPACK:  # the source holds the blocks for us: read now
                part.offered = part.go = True
                self.links.stats["offers_taken"] += 1
            elif offer is not None:  # the payload is in the source's staging already: READ it now
                part.offered = True
                part.go = bool(offer.runs)  # runs=1: the offer also confirmed our DIRECT runs (RunsReady)
                for c in range(chunks.count):
                    slot, nslots = offer.slots[2 * c], offer.slots[2 * c + 1]
                    part.readies.append(wire.Ready(part.xid, c, slot, nslots, chunks.nbytes(c)))
                    part.announced.add(c)
                self.links.stats["offers_taken"] += 1
            f.parts[src_rank] = part
            self.parts[part.xid] = part  # an offered part goes by the source's id: its messages use it
        try:
            self._start(f, plan)
        except KVTritonError as e:
            self.fail(f, e)

    def _start(self, f: Fetch, plan: TransferPlan) -> None:
        ids = tuple(f.src_ids.tolist())
        tok = {} if f.tokens is None else {"tokens": f.tokens.num_tokens, "tiles": tuple(f.tokens.tiles.tolist())}
        for part in f.parts.values():
            peer = self.links.peers[(f.engine, part.src_rank)]
            if part.offered:  # nothing to ask: its acks (RunsDone) tell the source we took the offer
                if part.go and part.runs_pending:  # the source confirmed the blocks: READ the runs now
                    self._read_runs(part, peer)
                continue
            chunk_blocks = part.chunks.blocks_per_chunk if part.chunks is not None else 0
            if self.s.flow is Flow.PUSH:
                msg = wire.Push(part.xid, f.req_id, self.s.rank, ids, tuple(f.dst_ids.tolist()), chunk_blocks,
                                plan.digest(), **tok)
            else:  # DIRECT runs (and READ_UNPACK) are read only after the source confirms it holds the blocks
                msg = wire.Pull(part.xid, f.req_id, self.s.rank, ids, chunk_blocks, plan.digest(), **tok,
                                way=part.way.value)
            self.links.send(peer, msg)

    def abort(self, req_id: str) -> bool:
        f = self.fetches.get(req_id)
        if f is None:
            return False
        self.fail(f, RequestAbortedError(f"fetch {req_id!r} from {f.engine!r} was aborted"))
        return True

    def take_results(self) -> list[RequestResult]:
        out, self.results = self.results, []
        return out

    # ------------------------------------------------------------------ offers
    def on_offer(self, peer: Peer, m: wire.Offer) -> None:
        """Keep a source's offer until a fetch asks for it (checked then, against the fetch)."""
        if self.s.flow is not Flow.PULL:
            raise ProtocolError("offer received in push mode")
        mine = self.offers.setdefault(peer.key, {})
        mine.pop(m.req, None)
        if len(mine) >= MAX_OFFERS_PER_PEER:
            mine.pop(next(iter(mine)))  # the oldest: its source frees it with the hold
        mine[m.req] = m

    def _offer_for(self, peer: Peer, req: str, plan: TransferPlan, ids, chunks: ChunkGeometry | None,
                   runs: bool) -> wire.Offer | None:
        """``peer``'s offer of ``req`` when it is exactly this part's payload (same plan, ids and
        chunks, slot runs inside the peer's staging, DIRECT runs confirmed when it has any), else None; an offer that
        does not match is declined (the source frees it), or left to the pull that follows when
        it may hold a suffix of this part (see :mod:`.eager`)."""
        offer = self.offers.get(peer.key, {}).pop(req, None)
        if offer is None:
            return None
        st = peer.md.staging
        ok = (chunks is not None and ids is not None and offer.runs == int(runs) and offer.xid not in self.parts
              and offer.plan == plan.digest() and offer.num_blocks == chunks.num_blocks
              and offer.chunk_blocks == chunks.blocks_per_chunk and len(offer.slots) == 2 * chunks.count
              and offer.ids == ids_digest(ids))
        if ok:
            for c in range(chunks.count):
                slot, nslots = offer.slots[2 * c], offer.slots[2 * c + 1]
                ok = ok and nslots == ceil_div(chunks.nbytes(c), st.slot_bytes) and slot + nslots <= st.num_slots
        if not ok:
            # an offer of more blocks by our plan may hold a suffix we ask (a -1 prefix): our pull
            # lets the source take it over or withdraw it; any other is declined now
            if not (chunks is not None and offer.plan == plan.digest() and offer.num_blocks > chunks.num_blocks):
                self.links.send(peer, wire.Abort(offer.xid), quiet=True)
            return None
        return offer

    # ------------------------------------------------------------------ messages
    def _part_from(self, peer: Peer, xid: str) -> Part:
        part = self.parts.get(xid)
        if part is None or (part.fetch.engine, part.src_rank) != peer.key:
            raise ProtocolError(f"message for unknown transfer {xid!r}")
        return part

    def on_ready(self, peer: Peer, m: wire.Ready) -> None:
        part = self._part_from(peer, m.xid)
        st = peer.md.staging
        if part.way is Mode.READ_UNPACK:
            raise ProtocolError(f"ready for {m.xid!r}, which reads the source's cache (read_unpack): nothing is packed")
        if self.s.flow is not Flow.PULL or m.chunk in part.announced:
            raise ProtocolError(f"ready for chunk {m.chunk} of {m.xid!r} is unexpected (duplicate or push mode)")
        if not 0 <= m.chunk < part.n_chunks:
            raise ProtocolError(f"ready for chunk {m.chunk} of {m.xid!r} is outside the transfer's "
                                f"{part.n_chunks} chunks")
        expect = part.chunks.nbytes(m.chunk)
        if m.nbytes != expect or not (0 <= m.slot and m.slot + m.nslots <= st.num_slots) or \
                m.nslots != ceil_div(m.nbytes, st.slot_bytes):
            raise ProtocolError(f"ready {m.chunk}: {m.nbytes} bytes in slots [{m.slot}, {m.slot + m.nslots}) does "
                                f"not match the plan ({expect} bytes) or the peer's {st.num_slots} slots")
        part.announced.add(m.chunk)
        part.readies.append(m)
        part.fetch.touch()

    def on_data(self, peer: Peer, m: wire.Data) -> None:
        part = self._part_from(peer, m.xid)
        ch = part.inflight.get(m.chunk) if self.s.flow is Flow.PUSH else None
        if ch is None or ch.xfer is not None or ch.kernel is not None:
            raise ProtocolError(f"data for chunk {m.chunk} that was not granted")
        if m.nbytes != ch.nbytes:
            raise ProtocolError(f"data for chunk {m.chunk}: {m.nbytes} bytes, expected {ch.nbytes}")
        self._unpack(part, ch)

    def on_runs_ready(self, peer: Peer, m: wire.RunsReady) -> None:
        part = self._part_from(peer, m.xid)
        if self.s.flow is Flow.PULL:  # go-ahead: the source holds the blocks while we read them
            if not part.reads_cache or part.go:
                raise ProtocolError(f"unexpected RunsReady for {m.xid!r}: nothing of the source's cache to read")
            part.go = True
            part.fetch.touch()
            if part.runs_pending:
                self._read_runs(part, peer)
            self._read_source(part, peer)
            self._maybe_runs_done(part, peer)
        elif not part.runs_pending:
            raise ProtocolError(f"unexpected RunsReady for {m.xid!r}: no DIRECT runs pending")
        else:  # push: the source has written our cache
            part.runs_pending = False
            self._maybe_finish(part.fetch)

    def on_reject(self, peer: Peer, m: wire.Reject) -> None:
        part = self.parts.get(m.xid)
        mine = self.offers.get(peer.key)
        if mine:  # an offer withdrawn (its hold ended, or we pulled instead)
            for req in [r for r, o in mine.items() if o.xid == m.xid]:
                del mine[req]
        if part is not None and (part.fetch.engine, part.src_rank) == peer.key:
            self.fail(part.fetch, RequestRejectedError(
                f"{peer.md.engine}:{peer.md.rank} rejected {part.fetch.req_id!r}: {m.reason}"))

    def transfer_failed(self, xid: str | None, peer: Peer, error: KVTritonError) -> None:
        """A message about transfer ``xid`` from ``peer`` could not be handled: fail its fetch."""
        part = self.parts.get(xid) if isinstance(xid, str) else None
        if part is not None and (part.fetch.engine, part.src_rank) == peer.key:
            self.fail(part.fetch, error)

    # ------------------------------------------------------------------ progress
    def advance(self) -> None:
        now = time.monotonic()
        for f in list(self.fetches.values()):
            if f.error is not None:
                continue
            if now >= f.renew_at:  # still outstanding: keep the sources' holds alive
                f.renew_at = now + self.s.renew_s
                for part in f.parts.values():
                    self.links.send(self.links.peers[(f.engine, part.src_rank)],
                                    wire.Renew(f.req_id, self.s.rank), quiet=True)
            try:
                for part in list(f.parts.values()):
                    peer = self.links.peers[(f.engine, part.src_rank)]
                    self._use_finished(part, peer)
                    if self.s.flow is Flow.PULL:
                        self._read_announced(part, peer)
                        self._read_source(part, peer)
                    else:
                        self._grant(part, peer)
                    if part.runs_xfer is not None and self.links.done(part.runs_xfer):
                        self.links.retire(part.runs_xfer, self.links.release_lists(*part.runs_lists))
                        part.runs_xfer, part.runs_pending = None, False
                    self._maybe_runs_done(part, peer)
                self._maybe_finish(f)
            except KVTritonError as e:
                self.fail(f, e)

    def _use_finished(self, part: Part, peer: Peer) -> None:
        """A chunk whose READ landed is unpacked; a chunk whose unpack finished is consumed."""
        for ch in list(part.inflight.values()):
            if ch.xfer is not None:
                if not self.links.done(ch.xfer):
                    continue
                self.links.transport.release(ch.xfer)
                ch.xfer = None
                if ch.lists:
                    self.links.release_lists(*ch.lists)()
                    ch.lists = ()
                part.fetch.touch()
                if part.way is Mode.PACK_PLACE:  # the READ placed the tiles in our cache: nothing to unpack
                    self._consumed(part, ch, peer)
                    continue
                if part.way is Mode.READ_UNPACK:
                    part.reads_landed += 1
                self._unpack(part, ch)
            if ch.kernel is not None and ch.kernel.done():
                self._consumed(part, ch, peer)

    def _read_announced(self, part: Part, peer: Peer) -> None:
        if part.way is Mode.PACK_PLACE:
            return self._place_announced(part, peer)
        while part.readies:
            ready = part.readies[0]
            slot = self.s.pool.alloc(ready.nslots)
            if slot is None:
                part.fetch.touch()  # our own staging is full: not the source's silence
                return
            part.readies.popleft()
            ch = Chunk(ready.chunk, slot, ready.nslots, ready.nbytes, remote_slot=ready.slot)
            part.inflight[ch.index] = ch
            ch.xfer = self.links.post_chunk("READ", ch, peer)
            part.fetch.descriptors += 1
            part.fetch.nbytes += ready.nbytes

    def _grant(self, part: Part, peer: Peer) -> None:
        while part.next_grant < part.n_chunks and len(part.inflight) < self.s.inflight:
            nbytes = part.chunks.nbytes(part.next_grant)
            slot = self.s.pool.alloc_bytes(nbytes)
            if slot is None:
                return
            ch = Chunk(part.next_grant, slot, self.s.pool.slots_for(nbytes), nbytes)
            part.inflight[ch.index] = ch
            part.next_grant += 1
            self.links.send(peer, wire.Grant(part.xid, ch.index, slot, ch.nslots))
            part.fetch.descriptors += 1
            part.fetch.nbytes += nbytes

    def _unpack(self, part: Part, ch: Chunk) -> None:
        lo, hi = part.chunks.bounds(ch.index)
        offs = part.read.segment_offsets(hi - lo, base=self.s.pool.offset(ch.slot))
        tokens = part.fetch.tokens
        with self.s.lanes.launching(after=part.fetch.ready):
            if tokens is None:
                unpack(self.s.regions, part.read.segments, offs, part.fetch.dst_ids[lo:hi], self.s.pool.tensor,
                       impl=self.s.impl)
            else:
                unpack(self.s.regions, part.read.segments, offs, tokens.dst_ids, self.s.pool.tensor,
                       impl=self.s.impl, tiles=tokens.tiles[lo:hi], num_tokens=tokens.num_tokens)
        ch.kernel = self.s.lanes.completion()  # the fetch is reported only once it is done

    def _consumed(self, part: Part, ch: Chunk, peer: Peer) -> None:
        part.fetch.touch()
        part.inflight.pop(ch.index, None)
        if ch.nslots:  # a pack-then-place chunk has no local slot
            self.s.pool.free(ch.slot, ch.nslots)
        part.chunks_done += 1
        part.consumed.add(ch.index)
        if self.s.flow is Flow.PULL and part.way is not Mode.READ_UNPACK:  # the source holds the chunk: ack it
            self.links.send(peer, wire.Ack(part.xid, ch.index), quiet=True)

    def _read_runs(self, part: Part, peer: Peer) -> None:
        f = part.fetch
        prepped = self.links.prep_runs(self.plans[f.engine], peer, f.src_ids, f.dst_ids, reading=True)
        if prepped is None:
            part.runs_pending = False
            return
        local, remote, count, nbytes = prepped
        part.runs_lists = (local, remote)
        part.runs_xfer = self.links.post_runs("READ", local, remote, count)
        f.descriptors += count
        f.nbytes += nbytes

    # ------------------------------------------------------------------ finish, fail
    def _maybe_finish(self, f: Fetch) -> None:
        if f.error is None and all(p.complete for p in f.parts.values()) and f.req_id in self.fetches:
            self._finish(f)

    def _forget(self, f: Fetch) -> None:
        self.fetches.pop(f.req_id, None)
        for part in f.parts.values():
            self.parts.pop(part.xid, None)

    def _finish(self, f: Fetch) -> None:
        self._forget(f)
        # every rank of the source engine learns this consumer is done (skipped replicas too)
        for peer in self.links.engine_peers(f.engine):
            self.links.send(peer, wire.Done(f.req_id, self.s.rank, self.s.tp), quiet=True)
        self.results.append(RequestResult(f.req_id, True, None, time.monotonic() - f.started,
                                          f.descriptors, f.nbytes))

    def fail(self, f: Fetch, error: KVTritonError) -> None:
        if f.error is not None:
            return
        f.error = error
        self._forget(f)
        for part in f.parts.values():
            peer = self.links.peers.get((f.engine, part.src_rank))
            if peer is not None:
                self.links.send(peer, wire.Abort(part.xid), quiet=True)
            # a granted slot (push) may still receive the peer's WRITE: keep it out of use for a while
            self.links.retire_chunks(part.inflight, time.monotonic() + (
                self.s.timeout_s if self.s.flow is Flow.PUSH else 0.0))
            part.readies.clear()
            if part.runs_xfer is not None:
                self.links.retire(part.runs_xfer, self.links.release_lists(*part.runs_lists))
            elif part.runs_lists:
                self.links.release_lists(*part.runs_lists)()
        self.results.append(RequestResult(f.req_id, False, error, time.monotonic() - f.started,
                                          f.descriptors, f.nbytes, _undefined_blocks(f)))

    def expire(self, now: float) -> None:
        for f in list(self.fetches.values()):
            if now > f.deadline:
                waiting = sorted(r for r, p in f.parts.items() if not p.complete)
                self.fail(f, TransferTimeoutError(
                    f"fetch {f.req_id!r} from {f.engine!r} made no progress for {f.timeout_s} s; waiting on "
                    f"source ranks {waiting}"))

    def peer_lost(self, peer: Peer, error: KVTritonError) -> None:
        self.offers.pop(peer.key, None)
        for f in list(self.fetches.values()):
            if f.engine == peer.md.engine and peer.md.rank in f.parts:
                self.fail(f, error)

    def fail_all(self, error: KVTritonError) -> None:
        for f in list(self.fetches.values()):
            self.fail(f, error)


def _undefined_blocks(f: Fetch) -> tuple[int, ...]:
    """Local blocks of a failed fetch that did not receive every source's bytes: a block is
    defined only when each part has unpacked the chunk holding it and landed its DIRECT runs."""
    defined = np.ones(f.dst_ids.size, dtype=bool)
    for part in f.parts.values():
        got = np.zeros(f.dst_ids.size, dtype=bool) if part.chunks is not None else np.ones(f.dst_ids.size, bool)
        for c in part.consumed:
            lo, hi = part.chunks.bounds(c)
            got[lo:hi] = True
        if part.runs_pending or part.runs_xfer is not None or (part.way is Mode.READ_UNPACK and not part.runs_done):
            got[:] = False  # the source's cache was being read: it may have let the blocks go meanwhile
        defined &= got
    if not f.parts:
        defined[:] = False
    return tuple(int(b) for b in f.dst_ids[~defined])
