"""What both integrations need from the library: the agent their settings make, and the meeting
of a prefill engine by a decode rank (no engine import).

* :func:`make_agent`: the one place an engine's :class:`~.settings.TransferSettings` become a
  :class:`~kvtriton.agent.TransferAgent`, so every setting an engine accepts reaches its agent
  (the cost model included: pinned, measured on this host, or the default).
* :class:`Meetings`: a decode rank meets each prefill engine once, on a thread of its own, before
  its first load. It connects to the prefill ranks the planner names
  (:func:`~kvtriton.plan.meeting_ranks`: those it reads from, plus those no decode rank reads
  that it tells when it is done, so every hold ends at its last reader's done) and checks who
  answered before NIXL connects to it. With the cluster credential an engine id is bound to the
  agents that proved it (the agent's peer table: a live rank is never replaced), and an address is
  only a route: a request naming a met engine at a new address meets it again there, where it
  must prove the credential as the agents it has: a new route never replaces one, even a silent
  one (a restart elsewhere is met once its old agents expired) (issue 33, finding 2: an
  address pin let a relayed first meeting lock the real address out). An address that answered
  without the credential is refused before any connection for ``_UNPROVEN_S``. Requests wait
  (parked) until the meeting ends; a failed meeting hands them back with the typed error, and the
  next request tries again. An engine whose meetings no request used for a while is forgotten
  (:meth:`Meetings.idle`: the caller drops its ranks, :meth:`~kvtriton.agent.TransferAgent.forget`),
  and met again on the next request naming it. What a rank's address is
  (vLLM: ``port + rank``; SGLang: its bootstrap's ``/route`` row) is the caller's ``locate``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..agent import TransferAgent
from ..errors import AuthenticationError, KVTritonError, ProtocolError, RequestRejectedError
from ..plan import CostModel, meeting_ranks, required_source_ranks
from ..protocol import wire
from ..protocol.allowlist import PeerAllowlist
from ..protocol.auth import Credential, PairKeys
from ..protocol.handshake import Meeting as HandshakeMeeting
from ..protocol.handshake import MetadataServer, meet
from ..regions import Region
from .settings import TransferSettings

__all__ = ["Meeting", "Meetings", "PrefillEngine", "RankAddress", "cost_model", "make_agent", "serve_metadata"]

logger = logging.getLogger(__name__)

_MAX_LOGGED_REFUSALS = 1024
_MAX_ROUTES = 16  # addresses remembered per engine
_UNPROVEN_S = 300.0  # an address that answered without the credential is not dialled again this long


def cost_model(settings: TransferSettings, device_type: str) -> CostModel:
    """The model ``cost_model`` names: pinned numbers, measured on this host and device (cached
    after the first time), or the default constants."""
    pinned = settings.pinned_cost()
    if pinned is not None:
        return pinned
    if settings.cost_model == "measured":
        from ..costmodel import load_or_measure

        return load_or_measure(device_type, settings.impl)
    return CostModel()


def make_agent(settings: TransferSettings, engine_id: str, rank: int, tp_size: int, regions: Sequence[Region],
               credential: Credential | None) -> TransferAgent:
    """The agent of one engine rank, with every agent setting of ``settings``; with a credential,
    it accepts only peers that proved it."""
    s = settings
    return TransferAgent(engine_id, rank, tp_size, regions, staging_bytes=s.staging_bytes, slot_bytes=s.slot_bytes,
                         flow=s.transfer_flow, chunk_bytes=s.chunk_bytes or None, inflight_chunks=s.inflight_chunks,
                         timeout_s=s.timeout_s, impl=s.impl, cost=cost_model(s, regions[0].device.type),
                         eager_guess=s.eager_guess, modes=s.agent_modes, replicate_stripe=s.agent_stripe,
                         require_authenticated_peers=credential is not None, register=s.register,
                         integrity=s.integrity)


def serve_metadata(agent: TransferAgent, credential: Credential | None, host: str, port: int, *,
                   io_timeout_s: float) -> MetadataServer:
    """A prefill rank's handshake server, started: it answers with ``agent``'s metadata and adds
    each caller's (with a credential, only callers that proved it get that far)."""
    def add_remote(meeting: HandshakeMeeting) -> str:  # with its pair keys: messages sealed both ways
        return agent.add_remote(meeting.metadata, authenticated=credential is not None, keys=meeting.keys)

    return MetadataServer(host, port, agent.metadata, on_meeting=add_remote, credential=credential,
                          io_timeout_s=io_timeout_s, on_kept=agent.add_lifeline).start()


@dataclass(frozen=True)
class PrefillEngine:
    """A prefill engine as a request names it (untrusted until met). ``engine_id``: the id it
    must answer with, or None: whatever its first rank answers (the others must agree);
    ``host``, ``port``: the address the request names (vLLM: rank 0's handshake port; SGLang:
    the bootstrap server)."""

    engine_id: str | None
    host: str
    port: int
    tp: int

    @property
    def key(self) -> Hashable:
        """What meetings are kept by: the engine *and* its address, so a forged request's meeting
        never holds honest ones."""
        return (self.engine_id, self.host, self.port)

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class RankAddress:
    """Where a prefill rank serves its metadata, and what the caller keeps of it (``row``)."""

    host: str
    port: int
    row: Any = None


@dataclass
class Meeting:
    """One prefill engine at one address: met (``ready``) or being met."""

    target: PrefillEngine
    ready: bool = False
    engine: str = ""  # the id it answered with
    ranks: tuple[int, ...] = ()  # the prefill ranks met (meeting_ranks)
    reads: tuple[int, ...] = ()  # those this rank reads from (required_source_ranks)
    rows: dict[int, Any] = field(default_factory=dict)  # prefill rank -> RankAddress.row
    agents: dict[int, str] = field(default_factory=dict)  # prefill rank -> the NIXL agent name it proved
    keys: dict[int, PairKeys | None] = field(default_factory=dict, repr=False)  # prefill rank -> the pair's keys
    parked: dict[Hashable, Any] = field(default_factory=dict)  # requests waiting for it
    used: float = field(default_factory=time.monotonic)  # when a request last joined or asked for it


class Meetings:
    """The meetings of one decode rank with prefill engines. Thread-safe.

    ``locate(target, rank)``: a prefill rank's :class:`RankAddress`; ``on_met(meeting, parked)``
    and ``on_failed(meeting, parked, error)`` are called (without the lock) with the requests
    parked on a meeting when it ends; ``max_meetings``: meetings in progress at once (a request
    needing another is refused), None: no cap; ``allowed``: the engines a request may name
    (refused before any connection), None: any."""

    def __init__(self, agent: TransferAgent, settings: TransferSettings, credential: Credential | None, *,
                 locate: Callable[[PrefillEngine, int], RankAddress],
                 on_met: Callable[[Meeting, list[Any]], None],
                 on_failed: Callable[[Meeting, list[Any], KVTritonError], None],
                 threads: int, max_meetings: int | None = None, allowed: PeerAllowlist | None = None):
        self.agent, self.settings, self.credential = agent, settings, credential
        self.locate, self.on_met, self.on_failed = locate, on_met, on_failed
        self.max_meetings, self.allowed = max_meetings, allowed
        self._lock = threading.Lock()
        self._meetings: dict[Hashable, Meeting] = {}
        self._unproven: dict[str, float] = {}  # address -> until when it is refused (see _UNPROVEN_S)
        self._routes: dict[str, list[str]] = {}  # engine id -> the addresses it proved itself at (credential)
        self._refused: set[Hashable] = set()  # refused targets, logged once each
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"kvtriton-meet-{agent.rank}")

    # ------------------------------------------------------------------ requests
    def refusal(self, target: PrefillEngine) -> KVTritonError | None:
        """Why a request naming ``target`` must not connect anywhere (an engine outside
        ``allowed``, an address that answered without the credential lately, too many meetings in progress),
        or None. A refusal is logged once per engine and address (a flood must not flood the log)."""
        why = self._refusal(target)
        if why is not None:
            with self._lock:
                first = target.key not in self._refused and len(self._refused) < _MAX_LOGGED_REFUSALS
                self._refused.add(target.key)
            if first:
                logger.warning("a request naming %r at %s refused before any connection: %s", target.engine_id,
                               target.where, why)
        return why

    def _refusal(self, target: PrefillEngine) -> KVTritonError | None:
        if self.allowed is not None and not self.allowed.allows(target.engine_id or "", target.host, target.port):
            return RequestRejectedError(f"engine {target.engine_id!r} at {target.where} is not in allowed_peers")
        with self._lock:
            until = self._unproven.get(target.where)
            if until is not None and time.monotonic() < until:
                return AuthenticationError(f"{target.where} answered without the cluster credential; a request "
                                           f"naming engine {target.engine_id!r} there is refused for a while")
            if (self.max_meetings is not None and target.key not in self._meetings
                    and sum(not m.ready for m in self._meetings.values()) >= self.max_meetings):
                return RequestRejectedError(f"{self.max_meetings} handshakes are in flight; engine "
                                            f"{target.engine_id!r} at {target.where} is met on a later request")
        return None

    def join(self, target: PrefillEngine, request: Hashable, parked: Any) -> Meeting | None:
        """The meeting with ``target`` if it is met; else None, with ``parked`` waiting for it
        under ``request`` (a meeting is started if none is in progress)."""
        with self._lock:
            meeting = self._meetings.get(target.key)
            if meeting is None:
                meeting = self._meetings[target.key] = Meeting(target)
                self._pool.submit(self._meet, meeting)
            meeting.used = time.monotonic()
            if meeting.ready:
                return meeting
            meeting.parked[request] = parked
            return None

    def met(self, key: Hashable) -> Meeting | None:
        with self._lock:
            meeting = self._meetings.get(key)
            if meeting is None or not meeting.ready:
                return None
            meeting.used = time.monotonic()
            return meeting

    def idle(self, idle_s: float, busy: set[str]) -> list[str]:
        """The engines met whose every meeting is done, waited for by no request and unused for
        ``idle_s`` seconds, but those in ``busy`` (engine ids with loads in flight); their
        meetings are dropped here (the next request naming one meets it again), the caller
        forgets their ranks. A decode meets many prefill engines over time behind a router:
        without this each stays connected, on both sides, until it dies."""
        now = time.monotonic()
        with self._lock:
            engines: dict[str, list[Hashable]] = {}
            wanted: set[str] = set()
            for key, m in self._meetings.items():
                engine = m.engine or m.target.engine_id or ""
                engines.setdefault(engine, []).append(key)
                if not m.ready or m.parked or now - m.used < idle_s or engine in busy or not engine:
                    wanted.add(engine)
            out = [e for e in engines if e not in wanted]
            for engine in out:
                for key in engines[engine]:
                    del self._meetings[key]
            return out

    def unpark(self, request: Hashable) -> Any:
        """The request parked under ``request`` (no longer waiting), or None."""
        with self._lock:
            for meeting in self._meetings.values():
                if request in meeting.parked:
                    return meeting.parked.pop(request)
        return None

    def forget(self, key: Hashable, *, met_only: bool = False) -> None:
        """Meet the engine at ``key`` again next time (it was lost); ``met_only``: unless its
        meeting is still in progress."""
        with self._lock:
            meeting = self._meetings.get(key)
            if meeting is not None and (meeting.ready or not met_only):
                del self._meetings[key]

    def forget_all(self) -> None:
        """Meet every engine again next time (this rank re-registered: they hold its old keys);
        meetings in progress finish and are kept (they exchange the metadata of now)."""
        with self._lock:
            for key in [k for k, m in self._meetings.items() if m.ready]:
                del self._meetings[key]

    # ------------------------------------------------------------------ the meeting (a thread of the pool)
    def _meet(self, meeting: Meeting) -> None:
        target, s = meeting.target, self.settings
        agent = self.agent
        try:
            stripe = s.agent_stripe
            ranks = meeting_ranks(agent.rank, agent.tp, agent.specs, target.tp, replicate_stripe=stripe)
            reads = required_source_ranks(agent.rank, agent.tp, agent.specs, target.tp, replicate_stripe=stripe)
            engine, rows, agents, keys = target.engine_id, {}, {}, {}
            for r in ranks:
                at = self.locate(target, r)
                # the connection stays open as the pair's lifeline: its closure is the rank's death
                kept = meet(at.host, at.port, agent.metadata(), credential=self.credential,
                            timeout_s=s.handshake_timeout_s, attempts=s.handshake_attempts, keep=True)
                try:
                    # who answered, checked before NIXL connects to it (the address came from a request)
                    got = wire.decode_metadata(kept.metadata)
                    if (got.engine, got.rank, got.tp) != (engine or got.engine, r, target.tp):
                        raise ProtocolError(f"{at.host}:{at.port} serves {got.engine!r} rank {got.rank} of "
                                            f"tp={got.tp}; the request names {engine or target.where!r} rank {r} "
                                            f"of tp={target.tp}")
                    engine = got.engine
                    # a new route reaches only the agents the engine has: it never replaces one
                    agent.add_remote(kept.metadata, authenticated=self.credential is not None,
                                     takeover=self._proven(engine, target.where), keys=kept.keys)
                except BaseException:
                    if kept.conn is not None:  # the server drops us as it reads EOF
                        kept.conn.close()
                    raise
                if kept.conn is not None:  # watched from now on
                    agent.add_lifeline(kept)
                rows[r], agents[r], keys[r] = at.row, got.agent, kept.keys
        except KVTritonError as e:
            self._failed(meeting, e)
            return
        except Exception as e:  # noqa: BLE001 - a meeting must never kill the rank
            if not isinstance(e, (KeyError, ValueError, OSError)):
                logger.exception("meeting %s at %s", target.engine_id, target.where)
            self._failed(meeting, ProtocolError(f"handshake failed: {type(e).__name__}: {e}"))
            return
        with self._lock:  # (forgotten meanwhile: its parked requests go on; the next ones meet again)
            if self.credential is not None and engine is not None:
                routes = self._routes.setdefault(engine, [])
                if target.where not in routes:
                    routes.append(target.where)
                    del routes[:-_MAX_ROUTES]
                while len(self._routes) > _MAX_LOGGED_REFUSALS:
                    del self._routes[next(iter(self._routes))]
            meeting.engine, meeting.ranks, meeting.reads, meeting.rows = engine or "", ranks, reads, rows
            meeting.agents, meeting.keys = agents, keys
            meeting.ready = True
            parked, meeting.parked = list(meeting.parked.values()), {}
        self.on_met(meeting, parked)

    def _proven(self, engine: str, where: str) -> bool:
        """Whether ``engine`` has proven itself at ``where`` (or was never met: its first meeting
        may take over a silent old agent, as a restart does)."""
        with self._lock:
            routes = self._routes.get(engine)
            return self.credential is None or routes is None or where in routes

    def _failed(self, meeting: Meeting, error: KVTritonError) -> None:
        logger.warning("handshake with %s at %s failed: %s", meeting.target.engine_id or "the prefill engine",
                       meeting.target.where, error)
        with self._lock:
            if self.credential is not None and isinstance(error, AuthenticationError):
                self._unproven[meeting.target.where] = time.monotonic() + _UNPROVEN_S
                while len(self._unproven) > _MAX_LOGGED_REFUSALS:
                    del self._unproven[next(iter(self._unproven))]
            if self._meetings.get(meeting.target.key) is meeting:
                del self._meetings[meeting.target.key]
            parked, meeting.parked = list(meeting.parked.values()), {}
        self.on_failed(meeting, parked, error)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
