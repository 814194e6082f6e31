"""TransferAgent: the API serving code calls, one per rank (shaped like a KV connector's worker).

A prefill rank ``hold()``s a request's blocks; a decode rank ``fetch()``es them. Everything moves
when somebody calls :meth:`TransferAgent.progress` (non-blocking; call it from the engine's step
loop, or start the optional background thread with :meth:`TransferAgent.start`).

Pull (default): the decode rank sends ``pull`` to each source rank of its plan; the source packs
a chunk of its staged payload into a staging slot run and answers ``ready``; the decode rank READs
it (one descriptor), unpacks it into its cache and answers ``ack`` so the source reuses the slots
for the next chunk (two chunks in flight per transfer: pack i+1 while i is on the wire). DIRECT
regions are READ straight from the source's cache in coalesced block runs, once the source has
confirmed (``direct``) that it holds those blocks; a held request cannot expire while a transfer
is reading it (the transfer has its own silence deadline). When everything has
landed the decode rank sends ``done`` to *every* rank of the source engine (replicas it skipped
included), and each source rank frees the request once all decode ranks are done or its lease
expires.

Push: the decode rank sends ``push`` and ``grant``s staging slots of its own; the source packs and
WRITEs each chunk into the granted slots with a ``data`` notification, and WRITEs DIRECT regions
straight into the decode rank's cache (``direct`` notification).

Failures are per request: a dead peer, a rejection or a deadline makes :meth:`results` report a
typed error for that request only; staging is reclaimed, other requests go on.

Example
-------
Two ranks in one process (real NIXL over UCX; in production each rank is its own process)::

    import numpy as np, torch
    from kvtriton import Region
    from kvtriton.agent import TransferAgent

    def cache(heads):
        k = torch.randn(32, 16, heads, 64, dtype=torch.bfloat16)
        return [Region.attention("layer.0", k, torch.randn_like(k), block_size=16, total_heads=4)]

    prefill = TransferAgent("P", rank=0, tp=1, regions=cache(4), staging_bytes=4 << 20)
    decode = TransferAgent("D", rank=0, tp=2, regions=cache(2), staging_bytes=4 << 20)
    decode.add_remote(prefill.metadata()); prefill.add_remote(decode.metadata())
    prefill.hold("req-1", block_ids=[3, 4, 5], lease_s=30)
    decode.fetch("req-1", "P", remote_block_ids=[3, 4, 5], local_block_ids=[0, 1, 2])
    while not (res := decode.results()):
        prefill.progress(); decode.progress()
    assert res[0].ok
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from . import wire
from .errors import (
    IncompatibleRemoteError,
    KVTritonError,
    PeerDisconnectedError,
    ProtocolError,
    RequestAbortedError,
    RequestRejectedError,
    StagingError,
    TransferTimeoutError,
    TransportError,
)
from .ops import pack, unpack
from .plan import (
    CostModel,
    Mode,
    StagedRead,
    TransferPlan,
    build_plan,
    check_compatible,
    compact_request,
    direct_runs,
)
from .regions import Region
from .staging import StagingPool
from .transport.nixl import XferStatus

__all__ = ["TransferAgent", "RequestResult", "FreedRequest"]

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class RequestResult:
    """Outcome of a :meth:`TransferAgent.fetch`: ``ok``, or ``error`` (a KVTritonError)."""

    req_id: str
    ok: bool
    error: KVTritonError | None = None
    seconds: float = 0.0
    descriptors: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class FreedRequest:
    """A held request whose blocks the prefill side may reuse: ``reason`` is ``"done"`` (every
    consumer finished), ``"lease_expired"`` or ``"released"`` (:meth:`TransferAgent.release`)."""

    req_id: str
    reason: str


# --------------------------------------------------------------------------- internal state
@dataclass(eq=False)
class _Peer:
    md: wire.RankMetadata
    agent: str
    staging: object  # PreppedList over the peer's staging slots


@dataclass(eq=False)
class _Chunk:
    index: int
    slot: int
    nslots: int
    nbytes: int
    xfer: object = None  # transport Xfer
    event: object = None  # torch.cuda.Event of a pack/unpack in flight
    remote_slot: int = -1


@dataclass(eq=False)
class _Fetch:  # decode side: one request
    req_id: str
    engine: str
    started: float
    timeout_s: float  # without progress for this long the fetch fails
    deadline: float
    src_ids: np.ndarray
    dst_ids: np.ndarray
    parts: dict = field(default_factory=dict)  # src_rank -> _Part
    error: KVTritonError | None = None
    descriptors: int = 0
    nbytes: int = 0


@dataclass(eq=False)
class _Part:  # decode side: what one source rank sends for one request
    xid: str
    fetch: _Fetch
    src_rank: int
    read: StagedRead | None
    chunk_blocks: int
    n_chunks: int
    direct_pending: bool
    chunks_done: int = 0
    next_grant: int = 0
    readies: deque = field(default_factory=deque)  # pull: ready messages waiting for a local slot
    inflight: dict = field(default_factory=dict)  # chunk -> _Chunk (READ or unpack in flight / granted)
    direct_xfer: object = None
    direct_lists: tuple = ()
    announced: set = field(default_factory=set)  # pull: chunks a 'ready' arrived for

    @property
    def complete(self) -> bool:
        return self.chunks_done == self.n_chunks and not self.direct_pending


@dataclass(eq=False)
class _Serve:  # source side: one (request, destination rank) transfer
    xid: str
    req_id: str
    peer: _Peer
    mode: str
    read: StagedRead | None
    ids: np.ndarray
    chunk_blocks: int
    n_chunks: int
    deadline: float
    next_chunk: int = 0
    acked: int = 0
    inflight: dict = field(default_factory=dict)  # chunk -> _Chunk
    grants: deque = field(default_factory=deque)  # push: (chunk, slot, nslots) granted by the peer
    direct: tuple | None = None  # push: (local list, remote list, count, nbytes) to WRITE
    direct_reading: bool = False  # pull: the peer reads our cache directly until it acks chunk -1
    direct_xfer: object = None  # push: the WRITE of the direct runs, until it completes
    granted: set = field(default_factory=set)  # push: chunks the peer granted slots for
    waiting_local: bool = False  # blocked on our own staging: not the peer's silence

    @property
    def complete(self) -> bool:
        return (self.acked == self.n_chunks and self.direct is None and not self.inflight
                and not self.direct_reading)


@dataclass(eq=False)
class _Hold:  # source side: one held request
    req_id: str
    block_ids: np.ndarray
    deadline: float
    done_from: set = field(default_factory=set)


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
    mode:          ``"pull"`` (decode READs) or ``"push"`` (prefill WRITEs); both sides must agree.
    timeout_s:     a fetch fails after this long without progress; a source reclaims
                   staging from a peer silent this long.
    modes:         force STAGED/DIRECT for all regions or per region name (see
                   :func:`~kvtriton.plan.build_plan`).
    transport:     a ready :class:`~kvtriton.transport.nixl.NixlTransport` (default: a new
                   one named ``"{engine_id}:{rank}:{random}"``).
    """

    def __init__(
        self,
        engine_id: str,
        rank: int,
        tp: int,
        regions: Sequence[Region],
        *,
        staging_bytes: int = 64 << 20,
        slot_bytes: int = 256 << 10,
        mode: str = "pull",
        chunk_bytes: int | None = None,
        inflight_chunks: int = 2,
        timeout_s: float = 30.0,
        modes: Mode | str | Mapping[str, Mode | str] | None = None,
        cost: CostModel = CostModel(),
        replicate_stripe: int | None = None,
        transport=None,
        impl: str = "auto",
    ):
        if mode not in ("pull", "push"):
            raise ValueError(f"mode must be 'pull' or 'push', got {mode!r}")
        if not regions:
            raise ValueError("a TransferAgent needs at least one region")
        devices = {r.device for r in regions}
        if len(devices) != 1:
            raise ValueError(f"all regions must be on one device, got {sorted(map(str, devices))}")
        self.engine_id, self.rank, self.tp, self.mode = engine_id, rank, tp, mode
        self.regions = list(regions)
        self.specs = [r.spec for r in self.regions]
        self.device = devices.pop()
        self.timeout_s = float(timeout_s)
        self._modes, self._cost, self._stripe, self._impl = modes, cost, replicate_stripe, impl
        self._mem = "VRAM" if self.device.type == "cuda" else "DRAM"
        self._dev = self.device.index or 0
        # validate our own geometry against our own TP once (a bad shard fails here, not later)
        check_compatible(self.specs, tp, self.specs, tp)

        slot_bytes = int(slot_bytes)
        self.pool = StagingPool(max(1, staging_bytes // slot_bytes), slot_bytes, self.device)
        if inflight_chunks < 1:
            raise ValueError(f"inflight_chunks must be >= 1, got {inflight_chunks}")
        self._inflight = int(inflight_chunks)
        # default: a quarter of the pool, so two transfers can each keep two chunks in flight
        default_chunk = max(1, self.pool.num_slots // 4) * slot_bytes
        self.chunk_bytes = min(self.pool.nbytes, int(chunk_bytes or default_chunk))
        if self.chunk_bytes < slot_bytes:
            raise ValueError(f"chunk_bytes {self.chunk_bytes} is smaller than one slot ({slot_bytes})")
        if transport is None:
            from .transport.nixl import NixlTransport

            transport = NixlTransport(f"{engine_id}:{rank}:{uuid.uuid4().hex[:8]}")
        self.transport = transport
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._regs = []
        try:
            self._register()
        except BaseException:
            self.transport.close()
            raise

        self._peers: dict[tuple[str, int], _Peer] = {}
        self._by_agent: dict[str, tuple[str, int]] = {}
        self._engine_tp: dict[str, int] = {}
        self._plans: dict[str, TransferPlan] = {}  # as destination, per source engine
        self._serve_plans: dict[tuple[str, int], TransferPlan] = {}  # as source, per (engine, dst rank)
        self._fetches: dict[str, _Fetch] = {}
        self._parts: dict[str, _Part] = {}
        self._serves: dict[str, _Serve] = {}
        self._holds: dict[str, _Hold] = {}
        self._results: list[RequestResult] = []
        self._freed: list[FreedRequest] = []
        # transfers to finish before their memory is reused: (xfer, cleanup, abort?, not_before)
        self._zombies: list[tuple[object, Callable[[], None], bool, float]] = []
        self._dead_peers: list[_Peer] = []
        self._xid = itertools.count()
        self.stats = {"bad_messages": 0, "staged_descriptors": 0, "direct_descriptors": 0}

    # ------------------------------------------------------------------ setup
    def _register(self) -> None:
        storages = {}
        for r in self.regions:
            for t in r.streams:
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        descs = [(addr, n, self._dev) for addr, n in sorted(storages.items())]
        descs.append((self.pool.addr, self.pool.nbytes, self._dev))
        self._regs.append(self.transport.register(descs, self._mem))
        self._addrs = tuple(tuple(t.data_ptr() for t in r.streams) for r in self.regions)
        self._spans = tuple(tuple(wire.stream_span(r.spec, j) for j in range(r.spec.num_streams))
                            for r in self.regions)
        self._local_staging = self.transport.prep_local(self._slot_descs(self.pool.addr, self.pool.num_slots,
                                                                         self.pool.slot_bytes, self._dev),
                                                        self._mem)

    @staticmethod
    def _slot_descs(addr: int, num_slots: int, slot_bytes: int, dev: int) -> np.ndarray:
        d = np.empty((num_slots, 3), dtype=np.int64)
        d[:, 0] = addr + np.arange(num_slots, dtype=np.int64) * slot_bytes
        d[:, 1] = slot_bytes
        d[:, 2] = dev
        return d

    def metadata(self) -> bytes:
        """This rank's handshake metadata (msgpack bytes) for :meth:`add_remote` on peers."""
        return wire.encode_metadata(wire.RankMetadata(
            engine=self.engine_id, rank=self.rank, tp=self.tp, agent=self.transport.name,
            agent_md=self.transport.metadata(), mem=self._mem, dev=self._dev,
            regions=tuple(self.specs), addrs=self._addrs, spans=self._spans,
            staging=wire.StagingInfo(self.pool.addr, self.pool.slot_bytes, self.pool.num_slots, self.chunk_bytes),
        ))

    def add_remote(self, metadata: bytes) -> str:
        """Validate a peer rank's metadata and connect to it; returns its engine id.

        Runs the validation gate per region (count and order, kind, dtype, head_dim, block_size,
        head counts vs TP) and checks staging compatibility, raising
        :class:`~kvtriton.errors.IncompatibleRemoteError` / :class:`~kvtriton.errors.ProtocolError`
        before anything is prepared. A peer that reappears (same engine and rank, new agent)
        replaces the old one; transfers in flight with the old one fail with
        :class:`~kvtriton.errors.PeerDisconnectedError`.
        """
        md = wire.decode_metadata(metadata)
        if md.engine == self.engine_id:
            raise IncompatibleRemoteError(f"metadata is from this engine ({md.engine!r}), not a peer")
        known_tp = self._engine_tp.get(md.engine)
        if known_tp is not None and known_tp != md.tp:
            raise IncompatibleRemoteError(
                f"engine {md.engine!r}: rank {md.rank} says tp={md.tp}, earlier ranks said tp={known_tp}")
        check_compatible(self.specs, self.tp, md.regions, md.tp)
        if md.staging.slot_bytes != self.pool.slot_bytes:
            raise IncompatibleRemoteError(
                f"engine {md.engine!r}: staging slot_bytes {md.staging.slot_bytes} differs from ours "
                f"({self.pool.slot_bytes}); both engines must use the same slot size")
        if md.mem != self._mem and self._mem == "VRAM":
            logger.info("peer %s:%d stages in %s, we in %s", md.engine, md.rank, md.mem, self._mem)
        with self._lock:
            # build the plan first: a mismatch raises before anything is prepared
            plan = self._plans.get(md.engine) or build_plan(
                self.rank, self.tp, self.specs, md.tp, md.regions, modes=self._modes, cost=self._cost,
                replicate_stripe=self._stripe)
            old = self._peers.get((md.engine, md.rank))
            if old is not None and old.agent != md.agent:
                self._drop_peer(old, PeerDisconnectedError(
                    f"peer {md.engine}:{md.rank} was replaced by a new agent ({md.agent})"))
            elif old is not None:
                return md.engine
            name = self.transport.add_remote(md.agent_md)
            if name != md.agent:
                self.transport.remove_remote(name)
                raise ProtocolError(f"metadata names agent {md.agent!r} but its NIXL metadata is {name!r}")
            try:
                staging = self.transport.prep_remote(
                    name, self._slot_descs(md.staging.addr, md.staging.num_slots, md.staging.slot_bytes,
                                           md.dev), md.mem)
            except BaseException:
                self.transport.remove_remote(name)
                raise
            peer = _Peer(md, name, staging)
            self._peers[(md.engine, md.rank)] = peer
            self._by_agent[name] = (md.engine, md.rank)
            self._engine_tp[md.engine] = md.tp
            self._plans[md.engine] = plan
            return md.engine

    def plan_for(self, engine_id: str) -> TransferPlan:
        """The plan this rank uses to read from ``engine_id`` (after :meth:`add_remote`)."""
        return self._plans[engine_id]

    # ------------------------------------------------------------------ prefill side
    def hold(self, req_id: str, block_ids: Sequence[int], lease_s: float = 30.0) -> None:
        """Keep a finished prefill's blocks readable until every decode rank that fetches it is
        done, or ``lease_s`` passes; then :meth:`freed` reports it."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        nb = min(s.num_blocks for s in self.specs)
        if ids.size and (ids.min() < 0 or ids.max() >= nb):
            raise RequestRejectedError(f"hold {req_id!r}: block ids must be in [0, {nb}), got "
                                       f"[{ids.min()}, {ids.max()}]")
        with self._lock:
            self._holds[req_id] = _Hold(req_id, ids, time.monotonic() + lease_s)

    def release(self, req_id: str) -> bool:
        """Drop a hold before its consumers are done (the engine aborted the request, or needs
        the blocks back). Transfers reading it are told (their fetch fails with
        :class:`~kvtriton.errors.RequestRejectedError` at once, not at a timeout) and the staging
        slots they may still read are quarantined; :meth:`freed` reports it as ``"released"``.
        Returns False when ``req_id`` is not held (never held, or already freed)."""
        with self._lock:
            hold = self._holds.get(req_id)
            if hold is None:
                return False
            self._release_hold(hold, "released")
            return True

    def freed(self) -> list[FreedRequest]:
        """Held requests whose blocks may be reused now (drained on each call)."""
        with self._lock:
            out, self._freed = self._freed, []
            return out

    # ------------------------------------------------------------------ decode side
    def fetch(
        self,
        req_id: str,
        remote_engine_id: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout_s: float | None = None,
    ) -> None:
        """Start reading a request's KV from ``remote_engine_id`` into ``local_block_ids``.

        Position ``j`` of ``remote_block_ids`` lands in ``local_block_ids[j]``; -1 on either side
        skips the position (e.g. a prefix already cached). Raises at once on bad ids or an
        unknown engine (:class:`~kvtriton.errors.PlanError`, ``KeyError``); everything later is
        reported by :meth:`results`. After a failed fetch the local blocks hold undefined bytes;
        in push mode a WRITE the source had already posted may still land in them for up to
        ``timeout_s`` (kvtriton's own staging slots are quarantined for that long).
        """
        if not isinstance(req_id, str) or not 0 < len(req_id) <= 512:
            raise ValueError(f"req_id must be a non-empty string of at most 512 characters, got {req_id!r:.80}")
        with self._lock:
            if req_id in self._fetches:
                raise RequestRejectedError(f"fetch {req_id!r} is already in flight")
            plan = self._plans.get(remote_engine_id)
            if plan is None:
                raise KeyError(f"unknown engine {remote_engine_id!r}: add_remote() its ranks first")
            missing = [r for r in plan.source_ranks if (remote_engine_id, r) not in self._peers]
            if missing:
                raise KeyError(f"engine {remote_engine_id!r}: no metadata yet for ranks {missing}")
            src_specs = next(p.md.regions for (e, _), p in self._peers.items() if e == remote_engine_id)
            s_ids, d_ids = compact_request(remote_block_ids, local_block_ids,
                                           min(s.num_blocks for s in src_specs),
                                           min(s.num_blocks for s in self.specs))
            now = time.monotonic()
            timeout = timeout_s or self.timeout_s
            f = _Fetch(req_id, remote_engine_id, now, timeout, now + timeout, s_ids, d_ids)
            self._fetches[req_id] = f
            if s_ids.size == 0:
                self._finish(f)
                return
            direct_ranks = plan.direct_ranks(s_ids.size)
            for src_rank in sorted({s.src_rank for s in plan.staged} | direct_ranks):
                read = plan.staged_read(src_rank)
                peer = self._peers[(remote_engine_id, src_rank)]
                if read is not None:
                    cap, remote_cap = self.chunk_bytes, peer.md.staging.chunk_bytes
                    chunk_blocks = min(s_ids.size, min(cap, remote_cap) // read.bytes_per_block)
                    if chunk_blocks < 1:
                        self._fail(f, StagingError(
                            f"one block from {remote_engine_id}:{src_rank} needs {read.bytes_per_block} "
                            f"staging bytes, more than a chunk ({min(cap, remote_cap)} bytes)"))
                        return
                    n_chunks = -(-s_ids.size // chunk_blocks)
                else:
                    chunk_blocks, n_chunks = 0, 0
                xid = f"{req_id}|{self.engine_id}:{self.rank}<{src_rank}#{next(self._xid)}"
                part = _Part(xid, f, src_rank, read, chunk_blocks, n_chunks, src_rank in direct_ranks)
                f.parts[src_rank] = part
                self._parts[xid] = part
            try:
                self._start_parts(f, plan)
            except KVTritonError as e:
                self._fail(f, e)

    def abort(self, req_id: str) -> bool:
        """Cancel a fetch in flight: its source ranks are told, staging it holds is reclaimed
        (a slot a peer may still WRITE into is quarantined first), and :meth:`results` reports it
        with :class:`~kvtriton.errors.RequestAbortedError`. Its local blocks hold undefined
        bytes afterwards. Returns False when no fetch of ``req_id`` is in flight."""
        with self._lock:
            f = self._fetches.get(req_id)
            if f is None:
                return False
            self._fail(f, RequestAbortedError(f"fetch {req_id!r} from {f.engine!r} was aborted"))
            return True

    def results(self) -> list[RequestResult]:
        """Finished fetches since the last call: ``ok`` or a typed ``error``."""
        with self._lock:
            out, self._results = self._results, []
            return out

    def _start_parts(self, f: _Fetch, plan: TransferPlan) -> None:
        for part in f.parts.values():
            peer = self._peers[(f.engine, part.src_rank)]
            if self.mode == "push":
                msg = wire.encode_message(
                    "push", xid=part.xid, req=f.req_id, dst_rank=self.rank, ids=f.src_ids.tolist(),
                    dst_ids=f.dst_ids.tolist(), chunk_blocks=part.chunk_blocks, plan=plan.digest())
                self._send(peer, msg)
                continue
            # direct regions are read only after the source confirms it holds the blocks
            msg = wire.encode_message("pull", xid=part.xid, req=f.req_id, dst_rank=self.rank,
                                      ids=f.src_ids.tolist(), chunk_blocks=part.chunk_blocks, plan=plan.digest())
            self._send(peer, msg)

    # ------------------------------------------------------------------ progress
    def progress(self) -> None:
        """Do whatever can be done now without blocking: handle messages, pack, post, poll,
        unpack, expire. Call it often (every engine step, or let :meth:`start` do it)."""
        with self._lock:
            if self._closed:
                return
            for sender, msgs in self.transport.poll_notifs().items():
                for raw in msgs:
                    self._on_message(sender, raw)
            self._advance_serves()
            self._advance_parts()
            self._reap_zombies()
            self._expire()

    def start(self, interval_s: float = 0.0005) -> None:
        """Run :meth:`progress` on a background thread until :meth:`close`."""
        if self._thread is not None:
            return

        def loop():
            while not self._stop.is_set():
                try:
                    self.progress()
                except Exception:  # keep serving; the error is per request where it matters
                    logger.exception("kvtriton progress thread")
                self._stop.wait(interval_s)

        self._thread = threading.Thread(target=loop, name=f"kvtriton-{self.engine_id}:{self.rank}", daemon=True)
        self._thread.start()

    def idle(self) -> bool:
        """True when nothing is in flight or held."""
        with self._lock:
            return not (self._fetches or self._serves or self._holds or self._zombies)

    # ------------------------------------------------------------------ messages
    def _on_message(self, sender: str, raw: bytes) -> None:
        key = self._by_agent.get(sender)
        if key is None:
            self.stats["bad_messages"] += 1
            logger.warning("message from unknown agent %r dropped", sender)
            return
        peer = self._peers[key]
        m = None
        try:
            m = wire.decode_message(raw)
            getattr(self, f"_on_{m['t']}")(peer, m)
        except Exception as e:  # noqa: BLE001 - a peer must never be able to stop progress()
            if not isinstance(e, KVTritonError):
                e = ProtocolError(f"message from {sender} could not be handled: {type(e).__name__}: {e}")
            if isinstance(e, ProtocolError):
                self.stats["bad_messages"] += 1
            logger.warning("message from %s failed: %s", sender, e)
            xid = m.get("xid") if isinstance(m, dict) else None
            part = self._parts.get(xid) if isinstance(xid, str) else None
            if part is not None and (part.fetch.engine, part.src_rank) == (peer.md.engine, peer.md.rank):
                self._fail(part.fetch, e)
            serve = self._serves.get(xid) if isinstance(xid, str) else None
            if serve is not None and serve.peer is peer:
                self._drop_serve(serve, notify=f"bad message: {e}")

    # source side ------------------------------------------------------
    def _on_pull(self, peer: _Peer, m: dict) -> None:
        self._new_serve(peer, m, "pull")

    def _on_push(self, peer: _Peer, m: dict) -> None:
        self._new_serve(peer, m, "push")

    def _new_serve(self, peer: _Peer, m: dict, mode: str) -> None:
        xid, req = m["xid"], m["req"]

        def reject(reason: str) -> None:
            self._send(peer, wire.encode_message("reject", xid=xid, reason=reason), quiet=True)

        if xid in self._serves:
            return reject(f"transfer id {xid!r} is already in use")

        if mode != self.mode:
            return reject(f"{self.engine_id}:{self.rank} runs in {self.mode} mode, got a {mode} request")
        hold = self._holds.get(req)
        if hold is None:
            return reject(f"request {req!r} is not held by {self.engine_id}:{self.rank} (never held, "
                          "finished or lease expired)")
        ids = np.asarray(m["ids"], dtype=np.int64)
        if ids.size == 0 or not np.isin(ids, hold.block_ids).all():
            return reject(f"block ids of {req!r} are not a subset of the {hold.block_ids.size} held blocks")
        dst_rank, eng = m["dst_rank"], peer.md.engine
        if dst_rank != peer.md.rank:
            return reject(f"dst_rank {dst_rank} does not match the sender's rank {peer.md.rank}")
        plan = self._serve_plans.get((eng, dst_rank))
        if plan is None:
            try:
                plan = build_plan(dst_rank, peer.md.tp, peer.md.regions, self.tp, self.specs,
                                  modes=self._modes, cost=self._cost, replicate_stripe=self._stripe)
            except KVTritonError as e:
                return reject(f"cannot plan for {eng}:{dst_rank}: {e}")
            self._serve_plans[(eng, dst_rank)] = plan
        if m["plan"] != plan.digest():
            return reject(f"{eng}:{dst_rank} planned this transfer differently from {self.engine_id}:{self.rank} "
                          "(modes, cost model or replicate stripe differ between the engines)")
        read = plan.staged_read(self.rank)
        has_direct = self.rank in plan.direct_ranks(ids.size)
        if read is None and not has_direct:
            return reject(f"{self.engine_id}:{self.rank} has nothing to send to {eng}:{dst_rank}")
        chunk_blocks = m["chunk_blocks"]
        if read is not None:
            cap = self.chunk_bytes
            if not 1 <= chunk_blocks or chunk_blocks * read.bytes_per_block > cap:
                return reject(f"chunk of {chunk_blocks} blocks does not fit staging chunks of {cap} bytes")
            n_chunks = -(-ids.size // chunk_blocks)
        else:
            n_chunks = 0
        serve = _Serve(xid, req, peer, mode, read, ids, chunk_blocks, n_chunks,
                       time.monotonic() + self.timeout_s)
        if mode == "push":
            dst_ids = np.asarray(m["dst_ids"], dtype=np.int64)
            nb = min(r.num_blocks for r in peer.md.regions)
            if dst_ids.size != ids.size or (dst_ids.size and (dst_ids.min() < 0 or dst_ids.max() >= nb)) \
                    or np.unique(dst_ids).size != dst_ids.size:
                return reject(f"push: dst_ids must be {ids.size} distinct ids in [0, {nb})")
            try:
                serve.direct = self._prep_direct(plan, peer, ids, dst_ids, reading=False)
            except KVTritonError as e:
                return reject(f"push: {e}")
        self._serves[xid] = serve
        if mode == "pull" and has_direct:
            # the blocks stay held (no lease expiry) until the reader acks chunk -1
            serve.direct_reading = True
            try:
                self._send(peer, wire.encode_message("direct", xid=xid))
            except KVTritonError:
                del self._serves[xid]
                raise

    def _on_grant(self, peer: _Peer, m: dict) -> None:
        serve = self._serves.get(m["xid"])
        if serve is None or serve.peer is not peer or serve.read is None or serve.mode != "push":
            raise ProtocolError(f"grant for unknown transfer {m['xid']!r}")
        chunk, slot, nslots = m["chunk"], m["slot"], m["nslots"]
        if chunk in serve.granted:
            raise ProtocolError(f"second grant for chunk {chunk} of {m['xid']!r}")
        st = peer.md.staging
        if not (0 <= chunk < serve.n_chunks and 0 <= slot and nslots >= 1 and slot + nslots <= st.num_slots):
            raise ProtocolError(f"grant {chunk}/{slot}+{nslots} is outside the peer's staging "
                                f"({st.num_slots} slots) or the transfer ({serve.n_chunks} chunks)")
        if nslots * st.slot_bytes < self._chunk_bytes(serve.read, serve.ids.size, serve.chunk_blocks, chunk):
            raise ProtocolError(f"grant of {nslots} slots is too small for chunk {chunk}")
        serve.granted.add(chunk)
        serve.grants.append((chunk, slot, nslots))
        serve.deadline = time.monotonic() + self.timeout_s

    def _on_ack(self, peer: _Peer, m: dict) -> None:
        serve = self._serves.get(m["xid"])
        if serve is None or serve.peer is not peer or serve.mode != "pull":
            raise ProtocolError(f"ack for unknown transfer {m['xid']!r}")
        serve.deadline = time.monotonic() + self.timeout_s
        if m["chunk"] == -1:  # the peer finished reading our cache directly
            if not serve.direct_reading:
                raise ProtocolError(f"direct ack for {m['xid']!r}, which has no direct reads")
            serve.direct_reading = False
            return
        ch = serve.inflight.pop(m["chunk"], None)
        if ch is None:
            raise ProtocolError(f"ack for chunk {m['chunk']} that is not in flight")
        self.pool.free(ch.slot, ch.nslots)
        serve.acked += 1
        serve.deadline = time.monotonic() + self.timeout_s

    def _on_done(self, peer: _Peer, m: dict) -> None:
        hold = self._holds.get(m["req"])
        if hold is None:
            return  # already freed (lease) or never held: nothing to do
        if m["dst_rank"] != peer.md.rank or m["dst_tp"] != peer.md.tp:
            raise ProtocolError(f"done from {peer.agent} names rank {m['dst_rank']}/{m['dst_tp']}")
        hold.done_from.add((peer.md.engine, peer.md.rank))
        if sum(1 for e, _ in hold.done_from if e == peer.md.engine) >= peer.md.tp:
            self._release_hold(hold, "done", finished_engine=peer.md.engine)

    def _on_abort(self, peer: _Peer, m: dict) -> None:
        serve = self._serves.get(m["xid"])
        if serve is not None and serve.peer is peer:
            self._drop_serve(serve)

    # decode side ------------------------------------------------------
    def _part_from(self, peer: _Peer, xid: str) -> _Part:
        part = self._parts.get(xid)
        if part is None or (part.fetch.engine, part.src_rank) != (peer.md.engine, peer.md.rank):
            raise ProtocolError(f"message for unknown transfer {xid!r}")
        return part

    def _on_ready(self, peer: _Peer, m: dict) -> None:
        part = self._part_from(peer, m["xid"])
        chunk, slot, nslots, nbytes = m["chunk"], m["slot"], m["nslots"], m["nbytes"]
        st = peer.md.staging
        if self.mode != "pull" or chunk in part.announced:
            raise ProtocolError(f"ready for chunk {chunk} of {m['xid']!r} is unexpected (duplicate or push mode)")
        expect = self._chunk_bytes(part.read, part.fetch.src_ids.size, part.chunk_blocks, chunk) \
            if part.read is not None and 0 <= chunk < part.n_chunks else -1
        if nbytes != expect or not (0 <= slot and slot + nslots <= st.num_slots) or \
                nslots != -(-nbytes // st.slot_bytes):
            raise ProtocolError(f"ready {chunk}: {nbytes} bytes in slots [{slot}, {slot + nslots}) does not "
                                f"match the plan ({expect} bytes) or the peer's {st.num_slots} slots")
        part.announced.add(chunk)
        part.readies.append((chunk, slot, nslots, nbytes))
        part.fetch.deadline = time.monotonic() + part.fetch.timeout_s

    def _on_data(self, peer: _Peer, m: dict) -> None:
        part = self._part_from(peer, m["xid"])
        ch = part.inflight.get(m["chunk"]) if self.mode == "push" else None
        if ch is None or ch.xfer is not None or ch.event is not None:
            raise ProtocolError(f"data for chunk {m['chunk']} that was not granted")
        if m["nbytes"] != ch.nbytes:
            raise ProtocolError(f"data for chunk {m['chunk']}: {m['nbytes']} bytes, expected {ch.nbytes}")
        self._unpack_chunk(part, ch)

    def _on_direct(self, peer: _Peer, m: dict) -> None:
        part = self._part_from(peer, m["xid"])
        if not part.direct_pending or part.direct_xfer is not None:
            raise ProtocolError(f"unexpected 'direct' for {m['xid']!r}")
        if self.mode == "pull":  # go-ahead: the source holds the blocks while we read them
            self._post_direct_read(part.fetch, self._plans[part.fetch.engine], part, peer)
        else:  # push: the source has written our cache
            part.direct_pending = False
            self._maybe_finish(part.fetch)

    def _on_reject(self, peer: _Peer, m: dict) -> None:
        part = self._parts.get(m["xid"])
        if part is not None and (part.fetch.engine, part.src_rank) == (peer.md.engine, peer.md.rank):
            self._fail(part.fetch, RequestRejectedError(
                f"{peer.md.engine}:{peer.md.rank} rejected {part.fetch.req_id!r}: {m['reason']}"))

    # ------------------------------------------------------------------ source work
    def _chunk_bytes(self, read: StagedRead, n: int, chunk_blocks: int, chunk: int) -> int:
        lo = chunk * chunk_blocks
        return read.payload_bytes(min(n, lo + chunk_blocks) - lo)

    def _pack_chunk(self, serve: _Serve, chunk: int, slot: int, nslots: int) -> _Chunk:
        lo = chunk * serve.chunk_blocks
        hi = min(serve.ids.size, lo + serve.chunk_blocks)
        read = serve.read
        nbytes = read.payload_bytes(hi - lo)
        offs = read.segment_offsets(hi - lo, base=self.pool.offset(slot))
        pack(self.regions, read.segments, offs, serve.ids[lo:hi], self.pool.tensor, impl=self._impl)
        return _Chunk(chunk, slot, nslots, nbytes, event=self._record())

    def _advance_serves(self) -> None:
        for serve in list(self._serves.values()):
            try:
                if serve.mode == "pull":
                    self._advance_pull_serve(serve)
                else:
                    self._advance_push_serve(serve)
            except KVTritonError as e:
                logger.warning("transfer %s to %s failed: %s", serve.xid, serve.peer.agent, e)
                self._drop_serve(serve, notify=f"source failed: {e}")
                continue
            if serve.complete:
                del self._serves[serve.xid]
            elif serve.waiting_local:
                serve.deadline = time.monotonic() + self.timeout_s

    def _advance_pull_serve(self, serve: _Serve) -> None:
        # chunks whose pack finished are announced; then pack more while slots allow
        for ch in serve.inflight.values():
            if ch.event is not None and _event_done(ch.event):
                ch.event = None
                self._send(serve.peer, wire.encode_message(
                    "ready", xid=serve.xid, chunk=ch.index, slot=ch.slot, nslots=ch.nslots, nbytes=ch.nbytes))
        serve.waiting_local = False
        while serve.next_chunk < serve.n_chunks and len(serve.inflight) < self._inflight:
            nbytes = self._chunk_bytes(serve.read, serve.ids.size, serve.chunk_blocks, serve.next_chunk)
            slot = self.pool.alloc_bytes(nbytes)
            if slot is None:
                serve.waiting_local = True
                return  # staging full: wait for acks (here or of other transfers)
            ch = self._pack_chunk(serve, serve.next_chunk, slot, self.pool.slots_for(nbytes))
            serve.inflight[ch.index] = ch
            serve.next_chunk += 1
            if ch.event is None:
                self._send(serve.peer, wire.encode_message(
                    "ready", xid=serve.xid, chunk=ch.index, slot=ch.slot, nslots=ch.nslots, nbytes=ch.nbytes))

    def _advance_push_serve(self, serve: _Serve) -> None:
        if serve.direct is not None and serve.direct_xfer is None:
            local, remote, count, _ = serve.direct
            idx = np.arange(count)
            serve.direct_xfer = self.transport.post("WRITE", local, idx, remote, idx,
                                                    wire.encode_message("direct", xid=serve.xid))
            self.stats["direct_descriptors"] += count
        if serve.direct_xfer is not None and self._done(serve.direct_xfer):  # ERR raises: reject
            self.transport.release(serve.direct_xfer)
            self._release_lists_cb(*serve.direct[:2])()
            serve.direct, serve.direct_xfer = None, None
        # writes in flight: free local slots once done
        for chunk, ch in list(serve.inflight.items()):
            if ch.xfer is not None and self._done(ch.xfer):
                self.transport.release(ch.xfer)
                self.pool.free(ch.slot, ch.nslots)
                del serve.inflight[chunk]
                serve.acked += 1
            elif ch.xfer is None and ch.event is not None and _event_done(ch.event):
                ch.event = None
                self._post_write(serve, ch)
        serve.waiting_local = False
        while serve.grants and len(serve.inflight) < self._inflight:
            chunk, rslot, rnslots = serve.grants[0]
            nbytes = self._chunk_bytes(serve.read, serve.ids.size, serve.chunk_blocks, chunk)
            slot = self.pool.alloc_bytes(nbytes)
            if slot is None:
                serve.waiting_local = True
                return
            serve.grants.popleft()
            ch = self._pack_chunk(serve, chunk, slot, self.pool.slots_for(nbytes))
            ch.remote_slot = rslot
            serve.inflight[chunk] = ch
            if ch.event is None:
                self._post_write(serve, ch)

    def _post_write(self, serve: _Serve, ch: _Chunk) -> None:
        idx = np.arange(ch.nslots)
        ch.xfer = self.transport.post("WRITE", self._local_staging, ch.slot + idx, serve.peer.staging,
                                      ch.remote_slot + idx,
                                      wire.encode_message("data", xid=serve.xid, chunk=ch.index, nbytes=ch.nbytes))
        self.stats["staged_descriptors"] += 1

    def _drop_serve(self, serve: _Serve, notify: str | None = None) -> None:
        """Forget a transfer. With ``notify`` the peer is told (it fails the request) and slots it
        may still be reading are quarantined for ``timeout_s`` before reuse, so a late READ never
        sees another request's bytes."""
        self._serves.pop(serve.xid, None)
        if notify is not None:
            self._send(serve.peer, wire.encode_message("reject", xid=serve.xid, reason=notify), quiet=True)
        until = time.monotonic() + (self.timeout_s if notify is not None else 0.0)
        for ch in serve.inflight.values():
            self._retire(ch.xfer, lambda ch=ch: self.pool.free(ch.slot, ch.nslots), not_before=until)
        serve.inflight.clear()
        if serve.direct is not None:
            self._retire(serve.direct_xfer, self._release_lists_cb(*serve.direct[:2]))
            serve.direct, serve.direct_xfer = None, None
        if serve.direct_reading and notify is not None:
            # the peer may still be reading our cache: keep the blocks a while longer
            hold = self._holds.get(serve.req_id)
            if hold is not None:
                hold.deadline = max(hold.deadline, until)

    def _release_hold(self, hold: _Hold, reason: str, finished_engine: str | None = None) -> None:
        """Free a held request. Transfers to the engine that reported it done only have local
        completions left (e.g. a WRITE whose data already landed): they are retired quietly.
        Any other transfer of the request is told and its slots quarantined."""
        self._holds.pop(hold.req_id, None)
        for serve in [s for s in self._serves.values() if s.req_id == hold.req_id]:
            if serve.peer.md.engine == finished_engine:
                self._drop_serve(serve)
            else:
                self._drop_serve(serve, notify=f"{hold.req_id!r} was released ({reason})")
        self._freed.append(FreedRequest(hold.req_id, reason))

    # ------------------------------------------------------------------ decode work
    def _advance_parts(self) -> None:
        for f in list(self._fetches.values()):
            if f.error is not None:
                continue
            try:
                for part in list(f.parts.values()):
                    if self.mode == "pull":
                        self._advance_pull_part(part)
                    else:
                        self._advance_push_part(part)
                    if part.direct_xfer is not None and self._done(part.direct_xfer):
                        self._retire(part.direct_xfer, self._release_lists_cb(*part.direct_lists))
                        part.direct_xfer, part.direct_pending = None, False
                        peer = self._peers[(f.engine, part.src_rank)]
                        self._send(peer, wire.encode_message("ack", xid=part.xid, chunk=-1), quiet=True)
                self._maybe_finish(f)
            except KVTritonError as e:
                self._fail(f, e)

    def _advance_pull_part(self, part: _Part) -> None:
        peer = self._peers[(part.fetch.engine, part.src_rank)]
        for chunk, ch in list(part.inflight.items()):
            if ch.event is not None:
                if _event_done(ch.event):
                    self._chunk_consumed(part, ch, peer)
            elif ch.xfer is not None and self._done(ch.xfer):
                self.transport.release(ch.xfer)
                ch.xfer = None
                self._unpack_chunk(part, ch)
        while part.readies:
            chunk, rslot, nslots, nbytes = part.readies[0]
            slot = self.pool.alloc(nslots)
            if slot is None:
                part.fetch.deadline = time.monotonic() + part.fetch.timeout_s  # our staging is full
                return
            part.readies.popleft()
            ch = _Chunk(chunk, slot, nslots, nbytes, remote_slot=rslot)
            idx = np.arange(nslots)
            part.inflight[chunk] = ch
            ch.xfer = self.transport.post("READ", self._local_staging, slot + idx, peer.staging, rslot + idx)
            part.fetch.descriptors += 1
            part.fetch.nbytes += nbytes
            self.stats["staged_descriptors"] += 1

    def _advance_push_part(self, part: _Part) -> None:
        peer = self._peers[(part.fetch.engine, part.src_rank)]
        for ch in list(part.inflight.values()):
            if ch.event is not None and _event_done(ch.event):
                self._chunk_consumed(part, ch, peer)
        while part.read is not None and part.next_grant < part.n_chunks and len(part.inflight) < self._inflight:
            nbytes = self._chunk_bytes(part.read, part.fetch.src_ids.size, part.chunk_blocks, part.next_grant)
            slot = self.pool.alloc_bytes(nbytes)
            if slot is None:
                return
            ch = _Chunk(part.next_grant, slot, self.pool.slots_for(nbytes), nbytes)
            part.inflight[ch.index] = ch
            part.next_grant += 1
            self._send(peer, wire.encode_message("grant", xid=part.xid, chunk=ch.index, slot=slot, nslots=ch.nslots))
            part.fetch.descriptors += 1
            part.fetch.nbytes += nbytes

    def _unpack_chunk(self, part: _Part, ch: _Chunk) -> None:
        lo = ch.index * part.chunk_blocks
        hi = min(part.fetch.dst_ids.size, lo + part.chunk_blocks)
        offs = part.read.segment_offsets(hi - lo, base=self.pool.offset(ch.slot))
        unpack(self.regions, part.read.segments, offs, part.fetch.dst_ids[lo:hi], self.pool.tensor, impl=self._impl)
        ch.event = self._record()
        if ch.event is None:
            self._chunk_consumed(part, ch, self._peers[(part.fetch.engine, part.src_rank)])

    def _chunk_consumed(self, part: _Part, ch: _Chunk, peer: _Peer) -> None:
        part.fetch.deadline = time.monotonic() + part.fetch.timeout_s
        part.inflight.pop(ch.index, None)
        self.pool.free(ch.slot, ch.nslots)
        part.chunks_done += 1
        if self.mode == "pull":
            self._send(peer, wire.encode_message("ack", xid=part.xid, chunk=ch.index), quiet=True)

    # ------------------------------------------------------------------ direct regions
    def _prep_direct(self, plan: TransferPlan, peer: _Peer, src_ids, dst_ids, *, reading: bool):
        """Prepared local/remote lists for the DIRECT runs between us and ``peer``.

        ``reading``: we are the destination (pull); else we are the source writing to ``peer``.
        Every remote range is bounds-checked against what the peer declared.
        """
        # runs for every replica of the stripe; only this pair's are kept. All ranks of one engine
        # share geometry (each rank's was checked at add_remote), so one spec list serves them all.
        src_specs = peer.md.regions if reading else self.specs
        by_rank = {r: src_specs for d in plan.direct for r in d.src_ranks}
        if reading:
            runs = direct_runs(plan, by_rank, self.specs, src_ids, dst_ids)
            keep = runs.src_rank == peer.md.rank
        else:
            runs = direct_runs(plan, by_rank, peer.md.regions, src_ids, dst_ids)
            keep = runs.src_rank == self.rank
        if not keep.any():
            return None
        region, stream, nb = runs.region[keep], runs.stream[keep], runs.nbytes[keep]
        r_off, l_off = (runs.src_offset[keep], runs.dst_offset[keep]) if reading else \
            (runs.dst_offset[keep], runs.src_offset[keep])
        r_addr, r_span = _gather(peer.md.addrs, region, stream), _gather(peer.md.spans, region, stream)
        l_addr, l_span = _gather(self._addrs, region, stream), _gather(self._spans, region, stream)
        if (r_off + nb > r_span).any() or (l_off + nb > l_span).any():
            raise ProtocolError(f"direct runs fall outside the regions {peer.agent} declared")
        local = np.stack([l_addr + l_off, nb, np.full_like(nb, self._dev)], axis=1)
        remote = np.stack([r_addr + r_off, nb, np.full_like(nb, peer.md.dev)], axis=1)
        ll = self.transport.prep_local(local, self._mem)
        try:
            rl = self.transport.prep_remote(peer.agent, remote, peer.md.mem)
        except BaseException:
            self.transport.release_list(ll)
            raise
        return ll, rl, int(nb.size), int(nb.sum())

    def _post_direct_read(self, f: _Fetch, plan: TransferPlan, part: _Part, peer: _Peer) -> None:
        prepped = self._prep_direct(plan, peer, f.src_ids, f.dst_ids, reading=True)
        if prepped is None:
            part.direct_pending = False
            return
        local, remote, count, nbytes = prepped
        part.direct_lists = (local, remote)
        idx = np.arange(count)
        part.direct_xfer = self.transport.post("READ", local, idx, remote, idx)
        f.descriptors += count
        f.nbytes += nbytes
        self.stats["direct_descriptors"] += count

    def _release_lists_cb(self, *lists):
        def cb():
            for pl in lists:
                try:
                    self.transport.release_list(pl)
                except TransportError as e:  # pragma: no cover - best effort
                    logger.warning("release of a prepared list failed: %s", e)
        return cb

    # ------------------------------------------------------------------ completion, failure
    def _maybe_finish(self, f: _Fetch) -> None:
        if f.error is None and all(p.complete for p in f.parts.values()) and f.req_id in self._fetches:
            self._finish(f)

    def _finish(self, f: _Fetch) -> None:
        self._fetches.pop(f.req_id, None)
        for part in f.parts.values():
            self._parts.pop(part.xid, None)
        # every rank of the source engine learns this consumer is done (skipped replicas too)
        tp = self._engine_tp.get(f.engine, 0)
        for r in range(tp):
            peer = self._peers.get((f.engine, r))
            if peer is not None:
                self._send(peer, wire.encode_message("done", req=f.req_id, dst_rank=self.rank, dst_tp=self.tp),
                           quiet=True)
        self._results.append(RequestResult(f.req_id, True, None, time.monotonic() - f.started,
                                           f.descriptors, f.nbytes))

    def _fail(self, f: _Fetch, error: KVTritonError) -> None:
        if f.error is not None:
            return
        f.error = error
        self._fetches.pop(f.req_id, None)
        for part in f.parts.values():
            self._parts.pop(part.xid, None)
            peer = self._peers.get((f.engine, part.src_rank))
            if peer is not None:
                self._send(peer, wire.encode_message("abort", xid=part.xid), quiet=True)
            # a granted slot (push) may still receive the peer's WRITE: keep it out of use for a while
            until = time.monotonic() + (self.timeout_s if self.mode == "push" else 0.0)
            for ch in part.inflight.values():
                self._retire(ch.xfer, lambda ch=ch: self.pool.free(ch.slot, ch.nslots), not_before=until)
            part.inflight.clear()
            part.readies.clear()
            if part.direct_xfer is not None:
                self._retire(part.direct_xfer, self._release_lists_cb(*part.direct_lists))
            elif part.direct_lists:
                self._release_lists_cb(*part.direct_lists)()
        self._results.append(RequestResult(f.req_id, False, error, time.monotonic() - f.started,
                                           f.descriptors, f.nbytes))

    def _retire(self, xfer, cleanup: Callable[[], None], not_before: float = 0.0) -> None:
        """Abort ``xfer`` (if any) and run ``cleanup`` once it can no longer touch our memory
        and ``not_before`` has passed; until then its slots stay allocated."""
        self._zombies.append((xfer, cleanup, True, not_before))
        self._reap_zombies()

    def _reap_zombies(self) -> None:
        """Finish parked transfers: wait for (or abort) them, then run their cleanup."""
        keep, now = [], time.monotonic()
        for xfer, cleanup, abort, not_before in self._zombies:
            if xfer is not None:
                try:
                    busy = self.transport.poll(xfer) is XferStatus.PROC
                except TransportError:
                    busy = False  # the peer is gone: nothing will move any more
                if busy and abort:
                    try:
                        self.transport.release(xfer)  # aborts if UCX can
                        xfer, busy = None, False
                    except TransportError:
                        pass
                if busy:
                    keep.append((xfer, cleanup, abort, not_before))
                    continue
                if xfer is not None:
                    try:
                        self.transport.release(xfer)
                    except TransportError:
                        pass
            if now < not_before:
                keep.append((None, cleanup, abort, not_before))
                continue
            cleanup()
        self._zombies = keep
        busy_with = {getattr(z[0], "remote", None) for z in keep if z[0] is not None}
        for peer in [p for p in self._dead_peers if p.agent not in busy_with]:
            self._dead_peers.remove(peer)
            for release in (lambda: self.transport.release_list(peer.staging),
                            lambda: self.transport.remove_remote(peer.agent)):
                try:
                    release()
                except TransportError:
                    pass

    def _expire(self) -> None:
        now = time.monotonic()
        for f in list(self._fetches.values()):
            if now > f.deadline:
                waiting = sorted(r for r, p in f.parts.items() if not p.complete)
                self._fail(f, TransferTimeoutError(
                    f"fetch {f.req_id!r} from {f.engine!r} made no progress for {f.timeout_s} s; waiting on "
                    f"source ranks {waiting}"))
        for serve in list(self._serves.values()):
            if now > serve.deadline:
                logger.warning("transfer %s: peer %s went silent; staging reclaimed", serve.xid, serve.peer.agent)
                self._drop_serve(serve, notify="no progress from the destination before the deadline")
        serving = {s.req_id for s in self._serves.values()}
        for hold in list(self._holds.values()):
            # a transfer in progress keeps its blocks (it has its own silence deadline)
            if now > hold.deadline and hold.req_id not in serving:
                self._release_hold(hold, "lease_expired")

    def _send(self, peer: _Peer, msg: bytes, quiet: bool = False) -> None:
        try:
            self.transport.send_notif(peer.agent, msg)
        except TransportError as e:
            if quiet:
                logger.info("notification to %s lost: %s", peer.agent, e)
                return
            raise PeerDisconnectedError(f"{peer.md.engine}:{peer.md.rank} unreachable: {e}") from e

    def _drop_peer(self, peer: _Peer, error: KVTritonError) -> None:
        for f in list(self._fetches.values()):
            if f.engine == peer.md.engine and peer.md.rank in f.parts:
                self._fail(f, error)
        for serve in [s for s in self._serves.values() if s.peer is peer]:
            self._drop_serve(serve)
        self._peers.pop((peer.md.engine, peer.md.rank), None)
        self._by_agent.pop(peer.agent, None)
        self._dead_peers.append(peer)  # released by _reap_zombies once no transfer uses it
        self._reap_zombies()

    def _done(self, xfer) -> bool:
        st = self.transport.poll(xfer)
        if st is XferStatus.ERR:
            raise TransportError(f"{xfer.op} with {xfer.remote!r} failed")
        return st is XferStatus.DONE

    def _record(self):
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop the progress thread, release every NIXL handle and registration. Idempotent."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            if self._closed:
                return
            for f in list(self._fetches.values()):
                self._fail(f, TransportError(f"{self.engine_id}:{self.rank} was closed"))
            for serve in list(self._serves.values()):
                self._send(serve.peer, wire.encode_message("reject", xid=serve.xid, reason="source closed"),
                           quiet=True)
            self._closed = True
            self.transport.close()

    def __enter__(self) -> "TransferAgent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _gather(table: tuple[tuple[int, ...], ...], region: np.ndarray, stream: np.ndarray) -> np.ndarray:
    flat = np.array([v for row in table for v in row], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum([len(row) for row in table])[:-1]]).astype(np.int64)
    return flat[starts[region] + stream]


def _event_done(ev) -> bool:
    return ev is None or ev.query()
