"""The connector's worker side: one :class:`~kvtriton.agent.TransferAgent` per rank, the
handshake side channel, and the translation of agent events into vLLM's terms.

* Both roles run the agent's background progress thread, so a prefill rank answers pulls while
  its engine is busy (or idle) and a decode rank's READs and unpacks go on between steps.
* A prefill rank serves its metadata on ``port + rank`` (:class:`~kvtriton.protocol.handshake.MetadataServer`);
  a caller's metadata goes through the agent's validation gate before anything is prepared.
* A decode rank meets a prefill engine lazily, on its first load, in a background thread
  (:class:`~kvtriton.integrations.core.Meetings`: which ranks, identity, pinning; the address a
  request names is untrusted and must be in ``allowed_peers``). Loads wait for it; a handshake
  that fails fails them, and the next request tries again. At most :data:`MAX_MEETINGS` run at
  once (a silent address delays only the loads that named it); a load refused before any
  connection, or past the cap, is recomputed. A load that timed out meets its engine again.
* A failed load is still reported in ``finished_recving``, and its local blocks in
  ``get_block_ids_with_load_errors`` (with several KV cache groups, whose block ids are unique
  only within a group, the request in ``failed_recving`` instead; vLLM then recomputes them, with
  ``kv_load_failure_policy="recompute"``; with ``"fail"`` it ends the request without tokens, as
  the log line says). A lost prefill engine is met again on its next request.
* A request queued in the engine (announced by the scheduler side) has its holds renewed by the
  agent every ``lease_s / 6`` until its load starts, for at most ``max_queued_s``.
* xPyD (several engines of each role behind a router): a decode rank meets only the prefill
  ranks its loads read from (:func:`~kvtriton.plan.meeting_ranks`), a prefill engine's death
  fails only the loads from it, and an engine none of its loads used for ``forget_idle_s`` is
  forgotten on both sides (:meth:`WorkerSide.forget_idle`). A prefill rank packs a hold ahead
  for the decode engine the router named (``decode_engine_id``, a hint that binds nothing).
* On CUDA the agent moves blocks on its own stream; holds carry an event of the engine's stream
  (packs and DIRECT reads wait for it); a load is finished only once its unpacks completed.

No vLLM import: the connector passes plain values in.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch

from ...errors import KVTritonError, PeerDisconnectedError, RequestRejectedError, TransferTimeoutError
from ...protocol.handshake import MetadataServer
from ...regions import Region
from ..core import Meeting, Meetings, PrefillEngine, RankAddress, make_agent, serve_metadata
from .scheduler import LoadSpec, RemoteSource, StepMessages
from .settings import SettingsError, TransferSettings
from .stats import WorkerStats, count_result

__all__ = ["WorkerSide"]

logger = logging.getLogger(__name__)

#: handshakes in flight at once (one thread each); a load that needs another is recomputed
MAX_MEETINGS = 8
#: an idle step's pause between polls of its loads (a sleep: the agent's thread gets the GIL)
_IDLE_POLL_S = 50e-6
#: the longest pause between two looks for idle prefill engines (forget_idle_s)
_FORGET_SCAN_S = 1.0


def _rank_address(engine: PrefillEngine, rank: int) -> RankAddress:
    """Rank ``rank`` of a prefill engine serves its metadata on ``port + rank``."""
    return RankAddress(engine.host, engine.port + rank)


class WorkerSide:
    """Worker-side state of one rank. Thread-safe: the engine thread calls the step methods, the
    handshake thread completes meetings, the agent's own thread moves data."""

    def __init__(self, settings: TransferSettings, *, engine_id: str, rank: int, tp_size: int,
                 regions: Sequence[Region], serve: bool, failure_policy: str = "recompute"):
        self.settings, self.engine_id, self.rank, self.tp_size = settings, engine_id, rank, tp_size
        #: vLLM's ``kv_load_failure_policy``: what becomes of a request whose load failed (the log says it)
        self.failure_policy = failure_policy
        s = settings
        if s.consumer and s.consumer == engine_id:
            raise SettingsError(f"kv_connector_extra_config['consumer'] = {s.consumer!r} is this engine's own id: "
                                f"expected the id of the decode engine that reads this engine's holds")
        self.credential = s.credential()  # files read now: a bad one fails at start
        allowed = s.peer_allowlist()
        self.agent = make_agent(s, engine_id, rank, tp_size, regions, self.credential)
        self.server: MetadataServer | None = None
        try:
            if serve:
                self.server = serve_metadata(self.agent, self.credential, s.host, s.port + rank,
                                             io_timeout_s=s.handshake_timeout_s)
        except BaseException:
            self.agent.close()
            raise
        self.agent.start(s.progress_interval_s)
        self._lock = threading.Lock()
        self.meetings = Meetings(self.agent, s, self.credential, locate=_rank_address, on_met=self._met,
                                 on_failed=self._not_met, threads=MAX_MEETINGS, max_meetings=MAX_MEETINGS,
                                 allowed=allowed)
        self._active: dict[str, LoadSpec] = {}  # fetch issued, by our request id
        self._by_remote: dict[str, str] = {}  # the agent knows a fetch by the prefill's request id
        self._cancelled: set[str] = set()
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()  # requests whose load failed, not yet reported (failed_recving)
        self._confirmed: set[str] = set()  # holds the scheduler kept blocks for (delay_free)
        self._freed: set[str] = set()  # holds the agent freed, not yet reported
        self._msgs: StepMessages | None = None
        #: loads this rank finished well, the descriptors they posted, the bytes they moved, the loads
        #: that failed (each way: fetch, meeting, refusal), and those refused before any connection
        #: (Meetings.refusal)
        self.stats = {"loads": 0, "descriptors": 0, "bytes": 0, "failed": 0, "refused_peer": 0}
        self.window = WorkerStats()  # what vLLM's stats path takes each step (take_stats)
        self._applied = self._started = False
        self._next_forget_scan = 0.0

    # ------------------------------------------------------------------ per step
    def bind(self, msgs: StepMessages) -> None:
        self._msgs, self._applied, self._started = msgs, False, False

    def start_loads(self) -> None:
        """This step's cancels and loads; once per step (vLLM may call start_load_kv twice)."""
        msgs = self._msgs
        if msgs is None or self._started:
            return
        self._started = True
        for rid in msgs.cancels:
            self._cancel(rid)
        for source in msgs.queued.values():
            self._renew_queued(source)
        # the step's READs posted back to back (why: TransferAgent.batch); never waiting for the agent's
        # own thread: while it holds the agent, the loads are deferred to it (kvtriton.agent.destination.deferred)
        with self.agent.batch(wait=False):
            for load in msgs.loads.values():
                self._load(load, wait=False)
        if msgs.loads:  # post what can be posted now, on this thread (see finished)
            self.agent.progress(wait=False)

    def after_forward(self) -> None:
        """Holds, confirms and releases, once every writer of this step's held blocks ran: from
        ``wait_for_save`` (backstop: ``clear``), never ``get_finished``, which vLLM calls before
        the drafter (an Eagle-3 MLA layer in the same blocks) wrote its KV: an earlier hold would
        let an eager pack take the draft KV unwritten. Idempotent per step."""
        msgs = self._msgs
        if msgs is None or self._applied:
            return
        self._applied = True
        for rid in msgs.releases:
            self.agent.release(rid)
            with self._lock:
                self._confirmed.discard(rid)
                self._freed.discard(rid)
        # the forward and the drafter that wrote these blocks are on the engine's stream: packs wait
        after = self._cache_written() if msgs.holds else None
        for rid, ids in msgs.holds.items():
            try:
                self.agent.hold(rid, ids, lease_s=self.settings.lease_s, consumer=self.settings.consumer or None,
                                after=after, pack_for=msgs.pack_for.get(rid))
            except KVTritonError as e:  # a hold vLLM cannot have asked for; never fatal to the engine
                logger.error("hold of %s failed: %s", rid, e)
        with self._lock:
            self._confirmed |= msgs.confirms

    def _cache_written(self):
        """An event on the engine's current stream of the cache's device (None on CPU)."""
        if self.agent.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.agent.device))
        return event

    def finished(self) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)`` since the last call; places no hold
        (:meth:`after_forward`). It progresses the agent first, on the engine's thread: an engine
        stepping back to back leaves the agent's thread the interpreter only every 5 ms."""
        self.agent.progress(wait=False)
        for f in self.agent.freed():
            with self._lock:
                self._freed.add(f.req_id)
        results = self.agent.results()
        msgs = self._msgs
        if msgs is not None and msgs.idle and self.settings.idle_wait_s > 0:
            results = self._await_loads(results, time.monotonic() + self.settings.idle_wait_s)
        for r in results:
            count_result(self.stats, r)
            if r.ok:  # a failure is counted by its load (_finish_load), with the loads refused before any fetch
                self.window.transfer(r)
            logger.debug("load of %s: %s in %.1f ms, %d descriptors, %d bytes", r.req_id,
                         "ok" if r.ok else f"failed ({r.error})", 1e3 * r.seconds, r.descriptors, r.bytes)
            self._result(r.req_id, r.error, None if r.ok else r.undefined_blocks)
        self.forget_idle()
        with self._lock:
            sending = self._freed & self._confirmed
            self._freed -= sending
            self._confirmed -= sending
            recving, self._recving = self._recving, set()
        return sending, recving

    def _await_loads(self, results: list, deadline: float) -> list:
        """``results`` and those of the loads in flight that finish before ``deadline``: an idle
        step (no forward) has nothing else to do, and a load it reports now reaches the
        scheduler a step sooner. Loads still waiting for a handshake are not waited for."""
        while time.monotonic() < deadline:
            done = {r.req_id for r in results}
            with self._lock:
                pending = any(remote not in done for remote in self._by_remote)
            if not pending:
                break
            time.sleep(_IDLE_POLL_S)
            self.agent.progress(wait=False)
            results = results + self.agent.results()
        return results

    def take_stats(self) -> dict | None:
        """This rank's statistics since the previous call (:mod:`.stats`), None when nothing moved."""
        return self.window.take(self.agent.stats)

    def failed_loads(self) -> set[str]:
        """Requests whose load failed since the last call (each also in ``finished_recving``)."""
        with self._lock:
            out, self._failed = self._failed, set()
        return out

    def load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def clear(self) -> None:
        self.after_forward()
        self._msgs = None

    # ------------------------------------------------------------------ loads
    def _load(self, load: LoadSpec, wait: bool = True) -> None:
        engine = load.source.engine
        refused = self.meetings.refusal(engine)
        if refused is not None:  # computed locally
            with self._lock:
                self.stats["refused_peer"] += 1
            self._finish_load(load, refused)
        elif self.meetings.join(engine, load.req_id, load) is not None:  # else it waits for the meeting
            self._fetch(load, wait=wait)

    def _renew_queued(self, source: RemoteSource) -> None:
        """A request waits in the engine's queue: the agent renews its holds on ``source``'s
        ranks every ``lease_s / 6`` until its load starts, for at most ``max_queued_s``
        (:meth:`TransferAgent.queued`). An engine not met yet is met now, so the renewals reach
        it (nothing waits for that meeting; a refused engine is neither met nor renewed)."""
        s, engine = self.settings, source.engine
        if s.max_queued_s <= 0 or self.meetings.refusal(engine) is not None:
            return
        self.agent.queued(source.request_id, source.engine_id, max_wait_s=s.max_queued_s, renew_s=s.lease_s / 6)
        if self.meetings.met(engine.key) is None:
            # parked under a tuple: never a vLLM request id (loads parked under those, cancels unpark them)
            self.meetings.join(engine, ("queued", source.request_id), None)

    def _fetch(self, load: LoadSpec, again: bool = False, wait: bool = True) -> None:
        """Fetch ``load``; ``wait=False`` (the engine's thread): deferred while the agent's thread holds the
        agent (an engine not met still raises KeyError at once: met again below; other errors in its results)."""
        with self._lock:
            duplicate = load.source.request_id in self._by_remote
            if not duplicate:
                self._active[load.req_id] = load
                self._by_remote[load.source.request_id] = load.req_id
        if duplicate:  # a proxy sent two decode requests for one prefill: the first one loads
            self._finish_load(load, RequestRejectedError(
                f"prefill request {load.source.request_id!r} is already being loaded by another request"))
            return
        try:
            self.agent.fetch(load.source.request_id, load.source.engine_id, load.remote_block_ids,
                             load.local_block_ids, num_tokens=load.num_tokens, wait=wait)
        except KeyError as e:  # met, but its ranks were dropped since (died, restarted): meet it again
            with self._lock:
                self._by_remote.pop(load.source.request_id, None)
                self._active.pop(load.req_id, None)
            if again:  # met just now and still missing: recomputed, and met again on the next load
                self._finish_load(load, PeerDisconnectedError(f"{load.source.engine_id} is not connected: {e}"))
                return
            self.meetings.forget(load.source.engine.key, met_only=True)
            if self.meetings.join(load.source.engine, load.req_id, load) is not None:  # else parked: _met fetches
                self._fetch(load, again=True)
        except KVTritonError as e:
            self._result(load.source.request_id, e)

    def _cancel(self, rid: str) -> None:
        parked = self.meetings.unpark(rid)
        with self._lock:
            if parked is not None:  # never started: done at once
                if parked.report:
                    self._recving.add(rid)
                return
            load = self._active.get(rid)
            if load is None:
                return
            self._cancelled.add(rid)
        self.agent.abort(load.source.request_id)  # its result arrives through results()

    def _result(self, remote_req_id: str, error: BaseException | None,
                undefined: Sequence[int] | None = None) -> None:
        with self._lock:
            rid = self._by_remote.pop(remote_req_id, None)
            load = self._active.pop(rid, None) if rid is not None else None
            cancelled = rid in self._cancelled
            self._cancelled.discard(rid)
        if load is not None:
            self._finish_load(load, None if cancelled else error, undefined)

    def _finish_load(self, load: LoadSpec, error: BaseException | None,
                     undefined: Sequence[int] | None = None) -> None:
        """``undefined``: the local blocks a failed fetch names (the others landed); None: all."""
        if error is not None:
            self.window.failed(error)
        with self._lock:
            if error is not None:
                self.stats["failed"] += 1  # every failed load: a fetch's, a refused peer's, a failed meeting's
                logger.warning("load of %s from %s failed, %s: %s", load.req_id, load.source.engine_id,
                               self._fate(load), error)
                if load.report:
                    blocks = load.local_blocks() if undefined is None else undefined
                    self._load_errors.update(b for b in blocks if b >= 0)
                    self._failed.add(load.req_id)
            if load.report:
                self._recving.add(load.req_id)
        if isinstance(error, (PeerDisconnectedError, TransferTimeoutError)):
            # a lost or silent engine (restarted, say) is met again on its next load
            self.meetings.forget(load.source.engine.key, met_only=True)

    def _fate(self, load: LoadSpec) -> str:
        """What vLLM does with a request whose load failed, as its ``kv_load_failure_policy`` says."""
        if not load.report:
            return "nothing waits for it (the prefill frees its blocks at its lease)"
        if self.failure_policy == "recompute":
            return "its blocks will be recomputed (kv_load_failure_policy='recompute')"
        return (f"vLLM fails the request, no tokens (kv_load_failure_policy={self.failure_policy!r}; "
                f"'recompute' computes its prompt instead)")

    # ------------------------------------------------------------------ meetings (their thread)
    def _met(self, meeting: Meeting, parked: list[LoadSpec | None]) -> None:
        for load in parked:
            if load is not None:  # None: a queued request's meeting ahead of its load
                self._fetch(load, again=True)  # met just now: a rank missing again is not met a third time

    def _not_met(self, meeting: Meeting, parked: list[LoadSpec | None], error: KVTritonError) -> None:
        for load in parked:
            if load is not None:
                self._finish_load(load, error)

    # ------------------------------------------------------------------ xPyD: idle engines
    def forget_idle(self) -> list[str]:
        """Forget the prefill engines none of this rank's loads used for ``forget_idle_s``
        (looked at most every second, on the engine's steps): their meetings go, their ranks
        are dropped from the agent (NIXL state, peer table; their lifelines closed, so they drop
        this rank too), and a later request naming one meets it again. Returns their ids."""
        idle_s, now = self.settings.forget_idle_s, time.monotonic()
        if idle_s <= 0 or now < self._next_forget_scan:
            return []
        self._next_forget_scan = now + min(_FORGET_SCAN_S, idle_s / 4)
        with self._lock:
            busy = {load.source.engine_id for load in self._active.values()}
        engines = self.meetings.idle(idle_s, busy)
        for engine in engines:
            logger.info("prefill engine %s unused for %.0f s: forgotten (%d ranks dropped); met again when a "
                        "request names it", engine, idle_s, self.agent.forget(engine))
        return engines

    # ------------------------------------------------------------------ sleep and wake (vLLM >= 0.33)
    def unregister(self) -> None:
        """``unregister_kv_caches``: loads in flight fail (recomputed), holds go back to vLLM,
        engines met are met again after :meth:`restore` (:meth:`TransferAgent.unregister`)."""
        self.agent.unregister()
        self.meetings.forget_all()

    def restore(self) -> None:
        """``restore_kv_caches``: registered again; the handshake serves the newer metadata."""
        self.agent.restore()

    # ------------------------------------------------------------------ teardown
    def staging_in_use(self) -> int:
        """Staging slots allocated now (0 once everything settled): a leak check for tests."""
        pool = self.agent.pool
        return pool.num_slots - pool.free_slots

    def close(self) -> None:
        self.meetings.close()
        if self.server is not None:
            self.server.close()
        self.agent.close()

