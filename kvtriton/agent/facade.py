"""TransferAgent: the public API over the two roles of a rank (see :mod:`kvtriton.agent`).

The facade owns what is not one role's: the constructor, the handshake, the progress loop, the
table from message type to handler, the paths that cross roles (a dead peer, expiry, sleep) and
``close``; the registration is :mod:`.registration`, the inbox :mod:`.inbox`. The rest is the
source's (:mod:`.source`) or the destination's (:mod:`.destination`), over :mod:`.links`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..errors import KVTritonError, PeerDisconnectedError, ProtocolError, TransportError, UnregisteredError
from ..plan import CostModel, ModesArg, TransferPlan
from ..protocol import wire
from ..protocol.auth import PairKeys
from ..regions import Region
from . import debug
from .destination import Destination, RequestResult
from .destination.deferred import DeferredFetch, held_if_free
from .device import ready_event
from .inbox import Inbox
from .links import Links, Peer, logger
from .peers import MAX_PEER_BLOCKS, MAX_PEER_ENGINES, MAX_PEER_SLOTS, MAX_PEERS, Admission, PeerTable
from .plan_book import PlanBook
from .progress_thread import ProgressThread
from .registration import Registration
from .settings import make_settings
from .source import FreedRequest, Source
from .stalls import Stalls
from .stats import Stats
from .warmup import own_reads, peer_reads, warm

__all__ = ["TransferAgent"]

_DEFAULT_COST = CostModel()  # frozen: one instance serves every agent that keeps the default
_EXPIRE_EVERY_S = 0.002  # deadlines, leases and lifelines are looked at most this often


class TransferAgent:
    """One rank's KV transfer endpoint (prefill side, decode side, or both).

    Parameters
    ----------
    engine_id:     name of this engine (every rank of one engine uses the same id).
    rank, tp:      this rank and the engine's TP size.
    regions:       this rank's :class:`~kvtriton.regions.Region` list, in the model's order
                   (identical names and order on every engine).
    staging_bytes: size of the registered staging pool; requests larger than what fits are
                   chunked and pipelined, and work waits when it is full.
    slot_bytes:    staging slot size (a multiple of 256; equal on both engines). A chunk is a run
                   of slots moved as one descriptor.
    chunk_bytes:   largest chunk (default: a quarter of the pool); a transfer uses the smaller of
                   both sides' values.
    inflight_chunks: chunks of one transfer in flight at once (pack i+1 while i is on the wire).
    flow:          ``"pull"`` (decode READs) or ``"push"`` (prefill WRITEs); both agree (old name: ``mode``).
    timeout_s:     a fetch fails after this long without progress; a source reclaims
                   staging from a peer silent this long.
    modes:         force STAGED/DIRECT/READ_UNPACK/PACK_PLACE for all regions or per region
                   name (see :func:`~kvtriton.plan.build_plan`; the one-sided READ_UNPACK and
                   PACK_PLACE are pull-only: with ``flow="push"`` they raise ``PlanError``). ``modes``, ``cost`` and
                   ``replicate_stripe`` must be equal on both engines (checked at :meth:`add_remote`).
    renew_interval_s: while a fetch is outstanding, the holds it reads are renewed this often
                   (a source's lease should be well above it).
    transport:     a ready :class:`~kvtriton.transport.nixl.NixlTransport` (default: a new
                   one named ``"{engine_id}:{rank}:{random}"``).
    eager_bytes:   staging that packs made ahead of their pull may keep, all holds together (default:
                   half the pool; 0 disables): a :meth:`hold` naming its ``consumer`` is packed in the
                   next :meth:`progress` for that engine's connected ranks that read from this one, so
                   the pull finds the data in place (:mod:`kvtriton.agent.source.eager`). Pull only.
    eager_guess:   a hold without a ``consumer`` is packed ahead for the only peer engine connected,
                   else the only one that read from this rank lately (a guess: it binds nothing, and
                   another engine's pull frees the pack). Default True; False: named holds only.
    require_authenticated_peers: a cluster credential is configured: only peers added with
                   ``add_remote(..., authenticated=True)`` are trusted. An unauthenticated peer reads
                   only holds that name its engine; it never binds an unbound hold, is never guessed,
                   never stands for a rank of an engine that registered authenticated (see
                   :mod:`kvtriton.agent.peers`), and its refusals say only "refused" (the reason is
                   logged here). Default False: every peer is trusted.
    max_peers, max_peer_engines: bounds of the peer table (ranks, engines); a registration
                   beyond either raises :class:`~kvtriton.errors.PeerRefusedError`.
    peer_expiry_s: a peer silent this long (pinged at a third of it) is dropped: its transfers fail,
                   its staging returns. Default ``max(4 * timeout_s, 60)``. A peer met over a
                   kept connection is dropped as soon as it closes (:meth:`add_lifeline`).
    max_peer_slots, max_peer_blocks: the most staging slots, and cache blocks in one region, a
                   peer's metadata may declare (never below this rank's own): more raises
                   :class:`~kvtriton.errors.PeerRefusedError` naming the setting, before any lock.
    register:      ``"all"`` (default) registers cache and staging with NIXL; ``"staging"`` only
                   the staging pool (no cache address in the metadata, every region STAGED).
    integrity:     digest each staged chunk after its pack, check it before unpack (a mismatch:
                   :class:`~kvtriton.errors.IntegrityError`; every region STAGED). Both options: equal on both engines,
                   ``PlanError`` with forced DIRECT/one-sided modes (docs/security.md, :mod:`kvtriton.agent.integrity`).
    warmup:        compile the kernels this rank will launch before its first request: a peer of its own
                   geometry's now, each new peer's in :meth:`add_remote` (:meth:`warmup`). Default False.

    On CUDA the agent queues its packs and unpacks on a stream of its own, on the regions' device,
    with that device current in every call; :meth:`hold` orders them after the engine's cache writes.
    """

    def __init__(
        self,
        engine_id: str, rank: int, tp: int,
        regions: Sequence[Region],
        *,
        staging_bytes: int = 64 << 20,
        slot_bytes: int = 256 << 10,
        flow: str | None = None,
        mode: str | None = None,
        chunk_bytes: int | None = None,
        inflight_chunks: int = 2,
        timeout_s: float = 30.0,
        modes: ModesArg = None,
        cost: CostModel = _DEFAULT_COST,
        replicate_stripe: int | None = None,
        renew_interval_s: float = 1.0,
        transport=None,
        impl: str = "auto",
        warmup: bool = False,
        eager_bytes: int | None = None,
        eager_guess: bool = True,
        register: str = "all",
        integrity: bool = False,
        require_authenticated_peers: bool = False,
        max_peers: int = MAX_PEERS,
        max_peer_engines: int = MAX_PEER_ENGINES,
        peer_expiry_s: float | None = None,
        max_peer_slots: int = MAX_PEER_SLOTS,
        max_peer_blocks: int = MAX_PEER_BLOCKS,
    ):
        self._s = settings = make_settings(  # the one copy of this rank's configuration
            engine_id=engine_id, rank=rank, tp=tp, regions=regions, staging_bytes=staging_bytes,
            slot_bytes=slot_bytes, flow=flow, mode=mode, chunk_bytes=chunk_bytes, inflight_chunks=inflight_chunks,
            timeout_s=timeout_s, modes=modes, cost=cost, replicate_stripe=replicate_stripe,
            renew_interval_s=renew_interval_s, impl=impl, eager_bytes=eager_bytes, eager_guess=eager_guess,
            require_authenticated_peers=require_authenticated_peers, register=register, integrity=integrity)
        if transport is None:
            from ..transport.nixl import NixlTransport

            with settings.lanes.on_device():
                transport = NixlTransport(f"{engine_id}:{rank}:{uuid.uuid4().hex[:8]}")
        self.transport = transport
        self._lock = threading.RLock()
        self._thread = ProgressThread(f"kvtriton-{engine_id}:{rank}", self.progress,
                                      settings.device if settings.lanes.cuda else None)
        self._closed, self._expire_at, self._stalls = False, 0.0, Stalls(f"{engine_id}:{rank}")
        self._stats = Stats()  # one counter per event (see .stats)
        self._warmed: set = set()  # (op, LaunchConfig) compiled by warmup()
        self._warm_peers = bool(warmup)
        self._links = Links(settings, transport, self._stats)
        self._inbox = Inbox(self._stats, self._links.open)  # received and opened, not handled yet, per sender
        self._plans = PlanBook(settings)  # every plan this rank serves or reads by
        self._registration = Registration(settings, self._links, transport)
        self._peers = PeerTable(settings, self._links, self._stats, max_peers=max_peers,
                                max_peer_engines=max_peer_engines, expiry_s=peer_expiry_s,
                                max_peer_slots=max_peer_slots, max_peer_blocks=max_peer_blocks)
        try:
            with self._s.lanes.on_device():  # UCX registers VRAM in the current CUDA context
                self._registration.register()
        except BaseException:
            self.transport.close()
            raise
        self._source = Source(settings, self._links, self._plans, self._stats)
        self._destination = Destination(settings, self._links, self._plans)
        self._handlers: dict[type[wire.Message], Callable[[Peer, Any], object]] = {
            wire.Pull: self._source.on_pull,
            wire.Push: self._source.on_push,
            wire.Grant: self._source.on_grant,
            wire.Ack: self._source.on_ack,
            wire.RunsDone: self._source.on_runs_done,
            wire.Done: self._source.on_done,
            wire.Abort: self._source.on_abort,
            wire.Renew: self._source.on_renew,
            wire.Ready: self._destination.on_ready,
            wire.Offer: self._destination.on_offer,
            wire.Data: self._destination.on_data,
            wire.RunsReady: self._destination.on_runs_ready,
            wire.Reject: self._destination.on_reject,
            wire.Ping: self._peers.on_ping,
            wire.Pong: self._peers.on_pong,
        }
        if warmup:
            try:
                self.warmup(peers=False)
            except BaseException:
                self.close()
                raise

    # -------------------------------------------- configuration: read from the one Settings (as in earlier releases)
    engine_id = property(lambda self: self._s.engine_id, doc="This engine's id.")
    rank = property(lambda self: self._s.rank, doc="This rank.")
    tp = property(lambda self: self._s.tp, doc="The engine's TP size.")
    flow = property(lambda self: self._s.flow.value, doc='``"pull"`` or ``"push"``.')
    mode = flow  # the old name of flow, kept for one release
    regions = property(lambda self: list(self._s.regions), doc="This rank's regions, in the model's order.")
    specs = property(lambda self: list(self._s.specs), doc="The regions' specs.")
    device = property(lambda self: self._s.device, doc="The regions' device.")
    pool = property(lambda self: self._s.pool, doc="The registered staging pool.")
    chunk_bytes = property(lambda self: self._s.chunk_bytes, doc="The largest chunk this rank packs or receives.")
    timeout_s = property(lambda self: self._s.timeout_s, doc="Silence after which a transfer fails.")

    @property
    def stats(self) -> dict[str, int]:
        """This rank's counters, one per event (:class:`~kvtriton.agent.stats.Stats`; a copy)."""
        return self._stats.as_dict()

    # ------------------------------------------------------------------ setup
    def metadata(self) -> bytes:
        """This rank's handshake metadata (msgpack bytes) for :meth:`add_remote` on peers; built once
        (asking NIXL from a handshake thread while progress drives UCX left notifications stuck)."""
        return self._registration.metadata

    def add_remote(self, metadata: bytes, *, authenticated: bool = False, takeover: bool = True,
                   keys: PairKeys | None = None) -> str:
        """Validate a peer rank's metadata and connect to it; returns its engine id.

        Runs the validation gate per region (count and order, kind, dtype, head_dim, block_size,
        head counts vs TP) and checks staging compatibility and the planning settings (forced
        modes, replicate stripe: both engines must plan alike; the cost model may differ, a
        source plans a destination's transfers with the model in its metadata), raising
        :class:`~kvtriton.errors.IncompatibleRemoteError` / :class:`~kvtriton.errors.ProtocolError`
        before anything is prepared. ``authenticated``: the caller says ``metadata`` came over an
        exchange that proved the cluster credential (see ``require_authenticated_peers``).

        Identity (:mod:`kvtriton.agent.peers`): an (engine, rank) is pinned to the agent that
        registered it; another agent claiming it (a restart) replaces it once the old one is gone
        (its lifeline closed, or it failed a liveness check of up to ``min(timeout_s, 2)`` s). A live
        peer is never replaced: :class:`~kvtriton.errors.PeerRefusedError`, as for an agent standing
        for another rank, a stale generation, or a full table (``max_peers``, ``max_peer_engines``).
        ``takeover=False``: another agent holding the (engine, rank) is refused at once, never
        checked nor replaced (the caller met it at an address the engine has not proven itself on).
        ``keys``: the meeting's pair keys; every message with the peer is sealed (:mod:`..protocol.channel`).
        """
        peers = self._peers
        try:
            md = wire.decode_metadata(metadata)
            peers.check(md)
            with self._lock, self._s.lanes.on_device():
                self._check_registered("meet a peer")
                # build the plan first: a mismatch raises before anything is prepared
                plan = self._plans.plan_reading(md)  # the kept one, else a new one
                for p in peers.untrusted_of(md, authenticated):  # the credential outranks them
                    self._drop_peer(p, PeerDisconnectedError(f"peer {p.md.engine}:{p.md.rank} was replaced by an "
                                                             f"authenticated agent of its engine"))
                seen = peers.admit(md, authenticated, takeover)
                if seen is Admission.REREGISTERED:  # its old keys go with the old peer
                    old = self._links.peers[(md.engine, md.rank)]
                    self._drop_peer(old, PeerDisconnectedError(
                        f"peer {md.engine}:{md.rank} registered its memory again; transfers it had are over"))
                    return self._connect(md, plan, authenticated, keys)
                if seen is not Admission.CONTESTED:
                    return self._connect(md, plan, authenticated, keys, known=seen is Admission.KNOWN)
                old = self._links.peers[(md.engine, md.rank)]  # a live agent holds it: is it still there?
                heard, nonce = old.heard, peers.probe(old)
            if nonce is not None:  # outside the lock: the answer comes through progress()
                nonce = peers.await_answer(old, nonce, self._lock, None if self._thread.running else self.progress)
            with self._lock, self._s.lanes.on_device():
                def drop(p: Peer) -> None:
                    self._drop_peer(p, PeerDisconnectedError(f"peer {p.md.engine}:{p.md.rank} was replaced by "
                                                             f"its restart ({md.agent})"))

                known = peers.verdict(md, old, nonce, heard, authenticated, drop) is Admission.KNOWN
                return self._connect(md, plan, authenticated, keys, known=known)  # known: it registered meanwhile
        except KVTritonError as e:
            if peers.generic(authenticated):
                raise peers.outward(e, authenticated) from None
            raise

    def _connect(self, md: wire.RankMetadata, plan, authenticated: bool, keys: PairKeys | None, known=False) -> str:
        peer = self._links.peers[md.engine, md.rank] if known else self._peers.connect(md, authenticated)
        self._links.keyed(peer, keys)  # met with a credential: messages sealed both ways (known: new keys)
        if known:
            return md.engine
        self._plans.keep_reading(md.engine, plan)
        if self._warm_peers:  # compiles under the lock: progress() waits, once per new shape
            try:
                warm(self._s, peer_reads(self._plans, [peer]), self._warmed)
            except KVTritonError as e:  # the peer is connected; its first request will compile
                logger.warning("warmup for %s:%d failed: %s", md.engine, md.rank, e)
        return md.engine

    def warmup(self, peers: bool = True) -> list:
        """Compile now the kernels this rank will launch (0.5-2 s each on a GPU, never inside
        :meth:`progress`): a peer of its own geometry's, with ``peers`` every connected peer's,
        both roles; run with block ids -1 (no byte changes). Returns the ``(op, LaunchConfig)``
        pairs compiled (none under torch); ``warmup=True`` does it at construction and per peer."""
        with self._lock, self._s.lanes.on_device():
            reads = own_reads(self._plans) + (
                peer_reads(self._plans, self._links.peers.values()) if peers else [])
            return warm(self._s, reads, self._warmed)

    def add_lifeline(self, meeting) -> bool:
        """Watch ``meeting.conn`` (a kept :class:`~kvtriton.protocol.handshake.Meeting` whose metadata was
        added) as that peer's lifeline: its closure drops the peer at once (:mod:`.lifelines`). False: closed unused."""
        with self._lock:
            return self._peers.lifeline(wire.decode_metadata(meeting.metadata), meeting.conn)

    def forget(self, engine_id: str) -> int:
        """Drop every rank of peer engine ``engine_id`` (its connector forgot it, idle): its transfers fail,
        its lifelines close (it drops this rank too), either may meet the other again (:meth:`.PeerTable.part`)."""
        with self._lock, self._s.lanes.on_device():
            parted = self._peers.part(engine_id)
            for peer in parted:
                self._drop_peer(peer, PeerDisconnectedError(f"{self._s.name} forgot idle engine {engine_id!r}"))
                self._source.consumer_lost(peer)
            return len(parted)

    def plan_for(self, engine_id: str) -> TransferPlan:
        """The plan this rank uses to read from ``engine_id`` (after :meth:`add_remote`)."""
        return self._plans.reads[engine_id]

    debug_state = debug.debug_state  # a plain snapshot for tests (schema: kvtriton.agent.debug)
    # ------------------------------------------------------------------ prefill side
    def hold(self, req_id: str, block_ids: Sequence[int] | Sequence[Sequence[int]], lease_s: float = 30.0,
             consumer: str | None = None, after=None, pack_for: str | None = None) -> None:
        """Keep a finished prefill's blocks readable until every rank of the consumer engine is
        done, or the lease runs out; then :meth:`freed` reports it.

        ``block_ids``: the request's blocks in order, in this engine's block size whatever the
        decode's; -1 marks a position that is not held (as in :meth:`fetch`: a prefix the decode
        already has), so the list a connector gets from its engine can be passed as is. A fetch may
        read any subset of the held blocks. Regions of several KV cache groups (``RegionSpec.group``):
        one list per group 0..G-1 (a group's may be empty; a flat list holds those blocks in every
        group); such holds are not packed ahead.
        ``consumer``: the decode engine id entitled to read it; None binds the hold to the first
        engine whose transfer this rank accepts (trust on first use: name it when known).
        Only the consumer's ranks may read it, report it done or renew it.
        Naming it also lets this rank pack the blocks for that engine's ranks ahead of their pull
        (``eager_bytes``; it assumes the pull reads every held block in order, or a suffix of whole
        chunks), or offer them from this call when a rank reads them from this cache; unnamed, for
        the only connected engine if exactly one is (``eager_guess``; binding nothing), or for
        ``pack_for`` (a hint, as unbinding; an engine not connected: served when asked).
        ``lease_s``: the hold is freed this long after it was placed or last renewed (a decode
        agent renews the holds of its outstanding fetches, see ``renew_interval_s``); transfers
        in progress keep it at most ``timeout_s`` longer.
        Raises :class:`~kvtriton.errors.RequestRejectedError` on ids outside ``[-1, num_blocks)``, a
        wrong group count or more than :data:`kvtriton.protocol.wire.MAX_REQUEST_BLOCKS` held blocks.

        ``after`` (CUDA agents): when the blocks are final (the engine's cache writes done): a
        ``torch.cuda.Event`` recorded after its last write, a ``torch.cuda.Stream`` (an event is
        recorded on it now), or None: an event recorded now on the agent device's current stream
        (where the engine writes its cache when it calls ``hold`` there). Packs wait for it on the
        device (the host does not); DIRECT regions are offered to a reader (pull) or written to a
        peer (push) once it completed. CPU agents: None (anything else raises ``ValueError``)."""
        ids = self._source.held_lists(req_id, block_ids)  # checked: RequestRejectedError
        if not float(lease_s) > 0:
            raise ValueError(f"hold {req_id!r}: lease_s must be > 0, got {lease_s!r}")
        if consumer is not None and (not isinstance(consumer, str) or not consumer or consumer == self.engine_id):
            raise ValueError(f"hold {req_id!r}: consumer must be another engine's id, got {consumer!r}")
        ready = ready_event(self.device, after)
        with self._lock, self._s.lanes.on_device():
            self._check_registered(f"hold {req_id!r}")
            self._source.hold(req_id, ids, float(lease_s), consumer, ready, pack_for)

    def packed_ahead(self, req_id: str) -> int:
        """Chunks of held ``req_id`` packed ahead of their pull, pack completed (0: e.g. its consumer
        not connected, unnamed and not the only engine connected, or beyond ``eager_bytes``)."""
        with self._lock, self._s.lanes.on_device():
            return self._source.packed_ahead(req_id)

    def release(self, req_id: str) -> bool:
        """Drop a hold before its consumers are done (the engine aborted the request, or needs the
        blocks back). Transfers reading it are told (their fetch fails at once, RequestRejectedError);
        staging slots and cache blocks they may still READ are kept ``timeout_s``, then :meth:`freed`
        reports it as ``"released"``. False when ``req_id`` is not held (never held, or already freed)."""
        with self._lock, self._s.lanes.on_device():
            return self._source.release(req_id)

    def freed(self) -> list[FreedRequest]:
        """Held requests whose blocks may be reused now (drained on each call; a kept hold once
        :meth:`progress` saw its keep pass). Never waits for the agent's lock (:mod:`.reports`)."""
        return self._source.take_freed()

    # ------------------------------------------------------------------ decode side
    def fetch(
        self,
        req_id: str,
        remote_engine_id: str,
        remote_block_ids: Sequence[int] | Sequence[Sequence[int]],
        local_block_ids: Sequence[int] | Sequence[Sequence[int]],
        timeout_s: float | None = None,
        *,
        num_tokens: int | None = None,
        after=None,
        wait: bool = True,
    ) -> None:
        """Start reading a request's KV from ``remote_engine_id`` into ``local_block_ids``.

        Equal block sizes: position ``j`` of ``remote_block_ids`` lands in ``local_block_ids[j]``
        (whole blocks); -1 on either side skips the position (e.g. a prefix already cached).
        Different block sizes (the plan's ``maps_tokens``): each engine's blocks of one sequence of
        ``num_tokens`` tokens (default: what both lists cover): remote ``j`` holds tokens
        ``[j*Bs, (j+1)*Bs)``, local ``k`` ``[k*Bd, (k+1)*Bd)``; a local -1 skips those, a remote -1
        only tokens no wanted local block holds; tokens from ``num_tokens`` on are not written
        (:func:`kvtriton.plan.tokens.compact_tokens`).
        KV cache groups: one list per group on each side, per-group lengths equal
        (:meth:`~kvtriton.plan.RequestPlan.for_fetch`). Raises at once on bad ids or an unknown
        engine (:class:`~kvtriton.errors.PlanError`, ``KeyError``); the rest goes to
        :meth:`results`. After a failed fetch the local blocks hold undefined bytes
        (push: a WRITE already posted may land in them for up to ``timeout_s``).

        ``after`` (CUDA agents; as in :meth:`hold`): when the engine is done with the local blocks'
        previous contents; unpacks wait for it on the device, DIRECT regions (NIC writes) do not.

        ``wait=False`` (the engine's thread): while another thread holds the agent, defer the fetch to the next
        holder (:mod:`.destination.deferred`); an engine not met raises at once, other errors: :meth:`results`."""
        if not isinstance(req_id, str) or not 0 < len(req_id) <= 512:
            raise ValueError(f"req_id must be a non-empty string of at most 512 characters, got {req_id!r:.80}")
        ready = ready_event(self.device, after)
        if not self._lock.acquire(blocking=wait):
            self._destination.defer(DeferredFetch.of(req_id, remote_engine_id, remote_block_ids, local_block_ids,
                                                     timeout_s, num_tokens, ready))
            return
        try:
            with self._s.lanes.on_device():
                self._check_registered(f"fetch {req_id!r}")
                try:  # an offer already here is taken (no pull's round trip); a failure is progress()'s
                    self._handle_messages()
                except Exception as e:  # noqa: BLE001 - never this fetch's: it goes on without the offer
                    logger.warning("fetch %r: messages not taken in first: %s", req_id, e)
                self._destination.start_deferred(self._check_registered)  # asked before this one: first
                self._destination.fetch(req_id, remote_engine_id, remote_block_ids, local_block_ids, timeout_s,
                                        num_tokens, ready)
        finally:
            self._lock.release()

    def batch(self, wait: bool = True) -> AbstractContextManager:
        """``with agent.batch():`` no :meth:`progress` (its thread's included) until the block ends, so a step's
        fetches post their READs back to back: a load finishing in between messages its source, and a READ posted
        after a message completes only at that source's next progress (UCX flush, :mod:`kvtriton.transport.fence`).
        ``wait=False``: never wait; while another thread holds the agent, ``fetch(wait=False)`` defers."""
        return self._lock if wait else held_if_free(self._lock)

    def queued(self, req_id: str, remote_engine_id: str, max_wait_s: float = 600.0,
               renew_s: float | None = None) -> None:
        """``req_id`` is queued by the engine to fetch from ``remote_engine_id``: its holds there are renewed every
        ``renew_s`` (None: ``renew_interval_s``) until :meth:`fetch`, :meth:`abort` or ``max_wait_s`` (.destination)."""
        with self._lock:
            self._destination.queued.add(req_id, remote_engine_id, float(max_wait_s), renew_s)

    def has_offer(self, remote_engine_id: str, req_id: str) -> bool:
        """Whether a rank of ``remote_engine_id`` offered ``req_id`` (packed ahead, or its cache
        blocks): a :meth:`fetch` of every held block then READs at once, no pull."""
        with self._lock, self._s.lanes.on_device():
            return self._destination.offers.has(remote_engine_id, req_id)

    def abort(self, req_id: str) -> bool:
        """Cancel a fetch in flight: its source ranks are told, staging it holds is reclaimed (a slot a peer may still
        WRITE into is quarantined first), :meth:`results` reports it with :class:`~kvtriton.errors.RequestAbortedError`;
        its blocks hold undefined bytes. False: none in flight."""
        with self._lock, self._s.lanes.on_device():
            return self._destination.abort(req_id)

    def results(self) -> list[RequestResult]:
        """Finished fetches since the last call: ``ok`` or a typed ``error`` (takes no lock: :mod:`.reports`)."""
        return self._destination.take_results()

    # ------------------------------------------------------------------ progress
    def progress(self, wait: bool = True) -> bool:
        """Do whatever can be done now without blocking: handle messages, pack, post, poll, unpack,
        expire. Call it often (every engine step, or :meth:`start`). ``wait=False``: return at once
        (False) when another thread progresses this agent (or in :meth:`batch`). True: it progressed."""
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            with self._s.lanes.on_device():
                if self._closed:
                    return True
                self._stalls.check(time.monotonic(), self._peers, self._destination, self._source)  # see .stalls
                self._handle_messages()
                self._destination.start_deferred(self._check_registered)  # before any Done of this call
                self._source.advance()
                self._destination.advance()
                self.transport.fences.flush()
                self._links.reap()
                self._expire()
            return True
        finally:
            self._lock.release()

    def start(self, interval_s: float = 0.0005) -> None:
        """Run :meth:`progress` on a background thread until :meth:`close`."""
        if not self._thread.running:
            self._stalls.watch(interval_s)  # progress() runs every interval_s from now: a far longer gap is a stall
            self._thread.start(interval_s)

    def idle(self) -> bool:
        """True when nothing is in flight, held, or left to send (a finished fetch's Dones)."""
        with self._lock, self._s.lanes.on_device():
            return not (self._destination.busy() or self._source.busy()
                        or self._links.zombies or self._inbox)

    def _handle_messages(self) -> None:
        self._inbox.add(self.transport.poll_notifs())
        for sender, raw in self._inbox.drain():
            self._on_message(sender, raw)

    def _on_message(self, sender: str, raw: bytes, m: wire.Message | None = None) -> None:
        peer = self._links.sender(sender)  # its message was opened under its pair key (or plain) on arrival
        if peer is None:  # dropped since
            return
        peer.heard = time.monotonic()
        try:
            if m is None:
                m = wire.decode_message(raw)
                if isinstance(m, wire.Done) and m.runs_done:  # a RunsDone riding on it: first, as its own
                    self._on_message(sender, raw, wire.RunsDone(m.runs_done))
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("<- %s %r", sender, m)
            self._handlers[type(m)](peer, m)
        except Exception as e:  # noqa: BLE001 - a peer must never be able to stop progress()
            if not isinstance(e, KVTritonError):
                e = ProtocolError(f"message from {sender} could not be handled: {type(e).__name__}: {e}")
            if isinstance(e, ProtocolError):
                self._stats.bad_messages += 1
            logger.warning("message from %s failed: %s", sender, e)
            xid = getattr(m, "xid", None)
            self._destination.transfer_failed(xid, peer, e)
            self._source.transfer_failed(xid, peer, e)

    # ------------------------------------------------------------------ across roles
    def _expire(self) -> None:
        now = time.monotonic()
        if now < self._expire_at:  # deadlines are coarse: a progress() spinning on a READ skips this
            return
        self._expire_at = now + _EXPIRE_EVERY_S
        for peer, error in self._peers.expire(now):  # died (its lifeline closed) or went silent
            logger.warning("peer %s:%d (%s) dropped: %s", *peer.key, peer.agent, error)
            self._drop_peer(peer, error)  # its transfers fail, its staging returns
            self._source.consumer_lost(peer)  # the holds it alone still had to read end now, not at their lease
        self._destination.expire(now)
        self._source.expire(now)

    def _drop_peer(self, peer: Peer, error: KVTritonError) -> None:
        self._destination.peer_lost(peer, error)
        self._source.peer_lost(peer)
        self._links.forget(peer)

    # ------------------------------------------------------------------ registration (sleep and wake)
    def unregister(self) -> None:
        """Drop this rank's NIXL registration (:mod:`.registration`) before its engine frees or remaps
        that memory (vLLM's sleep). Fetches in flight fail with :class:`~kvtriton.errors.UnregisteredError`,
        holds are released (:meth:`freed`), every peer is forgotten and unpinned (it meets this rank again
        after :meth:`restore`). Until then :meth:`hold`, :meth:`fetch`, :meth:`add_remote` raise it."""
        with self._lock, self._s.lanes.on_device():
            if self._closed or not self._registration.active:
                return
            why = f"{self._s.name} unregistered its memory (its engine sleeps); meet it again once restored"
            self._destination.fail_all(UnregisteredError(why))
            for req_id in list(self._source.holds.held):
                self._source.release(req_id)
            for peer in list(self._links.peers.values()):
                self._drop_peer(peer, PeerDisconnectedError(why))
                self._peers.pins.pop(peer.key, None)  # forgotten by us, not replaced: it may come back
            self._s.lanes.synchronize()  # no pack or unpack still reads or writes the memory
            self._links.settle(self._s.timeout_s)
            self._registration.deregister()
            self._source.release_kept(math.inf)  # kept holds: no reader can reach their blocks now

    def restore(self) -> None:
        """Register the same regions again after :meth:`unregister` (vLLM keeps their addresses), with metadata
        of a newer generation: a peer meeting it again swaps its old keys (``Admission.REREGISTERED``)."""
        with self._lock, self._s.lanes.on_device():
            if self._closed:
                raise TransportError(f"{self._s.name} is closed")
            if not self._registration.active:
                self._registration.register()

    registered = property(lambda self: self._registration.active, doc="False between unregister() and restore().")

    def _check_registered(self, what: str) -> None:
        if not self._registration.active and not self._closed:
            raise UnregisteredError(f"{self._s.name} cannot {what}: its memory is unregistered (restore() first)")

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop the progress thread, release every NIXL handle and registration. Idempotent."""
        self._thread.stop()
        with self._lock, self._s.lanes.on_device():
            if self._closed:
                return
            self._destination.fail_all(TransportError(f"{self.engine_id}:{self.rank} was closed"))
            self._source.close("source closed")
            self._peers.lifelines.close()  # its peers learn at once that this rank is gone
            self._closed = True
            self._s.lanes.synchronize()  # no kernel may still write staging once it is released
            self.transport.close()

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

