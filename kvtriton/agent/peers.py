"""Who may be a peer of this rank: admission, identity, bounds and expiry of the peer table.

:class:`PeerTable` decides what :meth:`TransferAgent.add_remote` does with a peer's metadata and
keeps the table honest afterwards: it alone enters peers in the table :class:`~.links.Links`
holds (``links.peers``, ``links.by_agent``), and decides which ones leave it (replaced, expired;
the facade's drop path fails their transfers and forgets them).

* **The gate.** Geometry, planning settings and staging are checked against ours before anything
  is prepared (:meth:`PeerTable.check`).
* **One agent, one rank.** A NIXL agent stands for one (engine, rank): an agent already in the
  table under another engine id or rank is refused (one agent registering 50 engine ids would
  shrink every honest engine's staging share to one chunk).
* **Identity pinned.** An (engine, rank) belongs to the agent that registered it. Its
  *registration generation* is counted here, per identity (1 for its first agent, +1 for each
  agent that took it over): the generation a peer sends (``RankMetadata.generation``) is never
  compared, so a registration at 2^64-1 locks nobody out and a restart whose clock stepped back
  is not refused (issue 33, finding 5; the sent value only says the peer speaks ``Ping``).
  Another agent claiming a live identity is refused unless the old agent is gone. "Gone" is
  decided by a liveness check: a ``Ping`` with a fresh nonce to the old agent (:meth:`probe`),
  and a wait of up to ``probe_s`` for its ``Pong`` of that nonce (messages it sent before, still
  in flight, prove nothing):

  - the ping cannot be sent (UCX reports the agent disconnected): gone, replaced;
  - it answers: alive, the newcomer is refused (a live peer is never replaced);
  - it does not answer: replaced when the newcomer authenticated (it proved the cluster
    credential, so it is one of us restarting); an unauthenticated newcomer only when the old
    agent had also been silent for ``timeout_s`` before the check.

  A replay of an older registration (an agent that held the identity before and was dropped or
  replaced: the last :data:`_FORMER_AGENTS` are remembered per identity) is refused. The same
  agent with a newer ``RankMetadata.generation`` registered its memory again
  (:meth:`~kvtriton.agent.TransferAgent.restore`): its old addresses and keys are dropped and the
  new ones connected (only when authenticated, under ``require_authenticated_peers``). Once
  dropped (replaced or expired), an (engine, rank) is free for its next agent.
* **Bounds.** At most ``max_peers`` ranks in the table and ``max_peer_engines`` engines: a
  registration beyond either is refused (the table was unbounded: 352 accepted).
* **Expiry.** A peer silent for a third of ``expiry_s`` is pinged (an idle honest peer answers
  from its progress loop); one silent for ``expiry_s``, or whose ping cannot be sent, is dropped:
  its transfers fail with :class:`~kvtriton.errors.PeerDisconnectedError` and the staging they
  kept returns to the pool (quarantined first, as after any failure). A peer whose metadata has
  no generation (an older kvtriton, protocol version 2 without ``Ping``) is never pinged nor
  expired: it would drop the pings as unknown and look silent. The protocol version stays 2
  (``gen`` is optional, ``Ping``/``Pong`` are sent only to peers that declared a generation).
* **What a refusal says.** With a credential configured (``require_authenticated_peers``), a
  peer added unauthenticated gets only "refused" (its errors keep their type); the full reason is
  logged here. Otherwise, and to authenticated peers, the reason is the full one.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from ..errors import IncompatibleRemoteError, KVTritonError, PeerDisconnectedError, PeerRefusedError
from ..plan import check_compatible
from ..protocol import wire
from .addresses import slot_descs
from .links import Links, Peer, logger
from .settings import Settings
from .stats import Stats

__all__ = ["MAX_PEERS", "MAX_PEER_ENGINES", "Admission", "PeerTable"]

MAX_PEERS = 256  # ranks one rank may know (32 engines of TP 8)
MAX_PEER_ENGINES = 64  # engines one rank may know
_PROBE_MAX_S = 2.0  # the longest a liveness check of a contested identity waits for an answer
_SCAN_S = 0.05  # expiry scans the table at most this often (progress() runs far more often)
_FORMER_AGENTS = 16  # agents remembered per identity after they left it (their replays are refused)


@dataclass
class _Pin:
    """Who an (engine, rank) belongs to: its current (or last) agent, the generation counted
    here (strictly increasing per identity, +1 per agent that took it), the agents before."""

    agent: str
    generation: int
    former: deque[str] = field(default_factory=lambda: deque(maxlen=_FORMER_AGENTS))


class Admission(enum.Enum):
    """What :meth:`PeerTable.admit` found for a registration."""

    KNOWN = "known"  # this very agent is in the table already: nothing to do
    NEW = "new"  # a free (engine, rank): connect it
    CONTESTED = "contested"  # a live agent holds the (engine, rank): probe it first
    #: this very agent, with a newer registration (it unregistered and restored its memory, e.g.
    #: across its engine's sleep): its old addresses and keys are dropped, the new ones connected
    REREGISTERED = "reregistered"


class PeerTable:
    """Admission and upkeep of one rank's peers (see the module docstring)."""

    def __init__(self, settings: Settings, links: Links, stats: Stats, *, max_peers: int = MAX_PEERS,
                 max_peer_engines: int = MAX_PEER_ENGINES, expiry_s: float | None = None):
        if int(max_peers) < 1 or int(max_peer_engines) < 1:
            raise ValueError(f"max_peers and max_peer_engines must be >= 1, got {max_peers}, {max_peer_engines}")
        self.s, self.links, self.stats = settings, links, stats
        self.max_peers, self.max_engines = int(max_peers), int(max_peer_engines)
        # default: well past any transfer's silence bound, so only a peer that is really gone goes
        self.expiry_s = float(expiry_s) if expiry_s is not None else max(4 * settings.timeout_s, 60.0)
        if not self.expiry_s > 0:
            raise ValueError(f"peer_expiry_s must be > 0, got {expiry_s!r}")
        self.probe_s = min(settings.timeout_s, _PROBE_MAX_S)
        # (engine, rank) -> its last accepted registration, live or dropped
        self.pins: OrderedDict[tuple[str, int], _Pin] = OrderedDict()
        self.nonce = 0
        self.next_scan = 0.0

    # ------------------------------------------------------------------ refusals
    def generic(self, authenticated: bool) -> bool:
        """Whether a refusal of a registration made with ``authenticated`` hides its reason."""
        return self.s.require_authenticated and not authenticated

    def outward(self, e: KVTritonError, authenticated: bool) -> KVTritonError:
        """The error a refused registration raises: ``e``, or, when the reason must stay here, an
        error of the same type saying only that the peer was refused."""
        if not self.generic(authenticated):
            return e
        logger.warning("registration refused (unauthenticated peer): %s", e)
        try:
            return type(e)(f"{self.s.name} refused the peer")
        except Exception:  # noqa: BLE001 - an error type whose constructor takes more
            return PeerRefusedError(f"{self.s.name} refused the peer")

    def _refuse(self, text: str) -> PeerRefusedError:
        self.stats.peers_refused += 1
        return PeerRefusedError(text)

    # ------------------------------------------------------------------ admission
    def check(self, md: wire.RankMetadata) -> None:
        """The validation gate: per region (count and order, kind, dtype, head_dim, block_size,
        head counts vs TP), staging slots and the planning settings both engines must share;
        :class:`~kvtriton.errors.IncompatibleRemoteError` naming the first difference."""
        if md.engine == self.s.engine_id:
            raise IncompatibleRemoteError(f"metadata is from this engine ({md.engine!r}), not a peer")
        known_tp = self.links.engine_tp.get(md.engine)
        if known_tp is not None and known_tp != md.tp:
            raise IncompatibleRemoteError(
                f"engine {md.engine!r}: rank {md.rank} says tp={md.tp}, earlier ranks said tp={known_tp}")
        check_compatible(self.s.specs, self.s.tp, md.regions, md.tp)
        ours, theirs = dict(self.s.planning()), dict(md.planning)
        for name in sorted(ours.keys() | theirs.keys()):
            if ours.get(name) != theirs.get(name):
                raise IncompatibleRemoteError(
                    f"engine {md.engine!r}: planning setting {name!r} is {theirs.get(name)!r}, ours is "
                    f"{ours.get(name)!r}; both engines must be built with the same {name}")
        if md.staging.slot_bytes != self.s.pool.slot_bytes:
            raise IncompatibleRemoteError(
                f"engine {md.engine!r}: staging slot_bytes {md.staging.slot_bytes} differs from ours "
                f"({self.s.pool.slot_bytes}); both engines must use the same slot size")

    def admit(self, md: wire.RankMetadata, authenticated: bool) -> Admission:
        """Whether ``md``'s agent may take its (engine, rank); raises
        :class:`~kvtriton.errors.PeerRefusedError` when it may not."""
        key, links = (md.engine, md.rank), self.links
        old = links.peers.get(key)
        if old is not None and old.agent == md.agent:
            if md.generation and old.md.generation and md.generation > old.md.generation and (
                    authenticated or not self.s.require_authenticated):
                return Admission.REREGISTERED  # the same agent registered its memory again (restore)
            old.authenticated = old.authenticated or authenticated  # met again, over a proven exchange
            return Admission.KNOWN
        other = links.by_agent.get(md.agent)
        if other is not None:
            raise self._refuse(f"agent {md.agent!r} is registered here as {other[0]}:{other[1]}; one NIXL agent "
                               f"stands for one engine rank, not also {md.engine}:{md.rank}")
        pin = self.pins.get(key)
        if pin is not None and (md.agent in pin.former or (old is None and md.agent == pin.agent)):
            raise self._refuse(f"{md.engine}:{md.rank}: agent {md.agent!r} held it before and left it: a stale or "
                               f"replayed registration, not newer than generation {pin.generation} here; a "
                               f"restarted rank registers with a new agent")
        if old is not None:
            return Admission.CONTESTED
        if len(links.peers) >= self.max_peers:
            raise self._refuse(f"{self.s.name} knows {len(links.peers)} peer ranks, its limit (max_peers)")
        engines = {p.md.engine for p in links.peers.values()}
        if md.engine not in engines and len(engines) >= self.max_engines:
            raise self._refuse(f"{self.s.name} knows {len(engines)} peer engines, its limit (max_peer_engines)")
        return Admission.NEW

    def probe(self, old: Peer) -> int | None:
        """Send ``old`` a liveness check; its nonce, or None when it cannot be sent (the agent
        is gone)."""
        self.nonce += 1
        try:
            self.links.send(old, wire.Ping(self.nonce))
        except PeerDisconnectedError:
            return None
        old.pinged = time.monotonic()
        return self.nonce

    def await_answer(self, old: Peer, nonce: int, lock: AbstractContextManager,
                     progress: Callable[[], object] | None) -> int | None:
        """Wait up to ``probe_s`` for ``old``'s answer to check ``nonce`` (the caller does not hold
        ``lock``, the agent's: answers arrive through ``progress()``, which this calls when given,
        i.e. when no progress thread runs), checking again every 0.1 s: UCX may take a moment to
        notice a closed agent, a send to it then fails. The nonce, or None once a check could
        not be sent (the agent is gone)."""
        deadline, again = time.monotonic() + self.probe_s, time.monotonic() + 0.1
        while not self.answered(old, nonce) and time.monotonic() < deadline:
            if progress is not None:
                progress()
            if time.monotonic() > again:
                with lock:
                    if self.probe(old) is None:
                        return None
                again = time.monotonic() + 0.1
            time.sleep(0.001)
        return nonce

    def answered(self, old: Peer, nonce: int) -> bool:
        """Whether ``old`` has answered the check of ``nonce`` (or a later one)."""
        return old.pong >= nonce

    def verdict(self, md: wire.RankMetadata, old: Peer, nonce: int | None, heard_before: float,
                authenticated: bool, drop: Callable[[Peer], None]) -> Admission:
        """After the liveness check ``nonce`` of ``old`` (None: it could not be sent;
        ``heard_before``: when ``old`` had last been heard before it): raises
        :class:`~kvtriton.errors.PeerRefusedError` when ``md`` may not replace it, else drops it
        (``drop``) and admits ``md`` again (NEW, or KNOWN: that agent registered meanwhile)."""
        who = f"{md.engine}:{md.rank}"
        if nonce is not None and self.links.peers.get(old.key) is old:
            if self.answered(old, nonce):
                raise self._refuse(f"{who} is registered to live agent {old.agent!r} (it answered a liveness "
                                   f"check); agent {md.agent!r} cannot take it over")
            if not authenticated and old.pinged - heard_before < self.s.timeout_s:
                raise self._refuse(f"{who} is registered to agent {old.agent!r}, heard from "
                                   f"{old.pinged - heard_before:.1f} s ago; an unauthenticated agent replaces it only "
                                   f"once it has been silent for timeout_s ({self.s.timeout_s} s)")
        if self.links.peers.get(old.key) is old:
            self.stats.peers_replaced += 1
            logger.warning("peer %s: agent %s replaced by its restart %s", who, old.agent, md.agent)
            drop(old)
        seen = self.admit(md, authenticated)
        if seen is Admission.CONTESTED:  # a third agent took it while the check waited
            raise self._refuse(f"{who} was registered to another agent while {md.agent!r} waited")
        return seen

    def connect(self, md: wire.RankMetadata, authenticated: bool) -> Peer:
        """Load ``md``'s NIXL agent, prepare its staging slots and enter it in the table."""
        transport = self.links.transport
        name = transport.add_remote(md.agent_md)
        if name != md.agent:
            transport.remove_remote(name)
            raise self._refuse(f"metadata names agent {md.agent!r} but its NIXL metadata is {name!r}")
        try:
            staging = transport.prep_remote(
                name, slot_descs(md.staging.addr, md.staging.num_slots, md.staging.slot_bytes, md.dev), md.mem)
        except BaseException:
            transport.remove_remote(name)
            raise
        peer = Peer(md, name, staging, authenticated=authenticated, heard=time.monotonic())
        self.links.add(peer)
        key = peer.key
        pin = self.pins.get(key)
        if pin is None:
            self.pins[key] = _Pin(md.agent, 1)
        elif pin.agent != md.agent:  # the same agent registering again is not a former one
            pin.former.append(pin.agent)
            pin.agent, pin.generation = md.agent, pin.generation + 1
        self.pins.move_to_end(key)
        while len(self.pins) > 4 * self.max_peers:  # forget the oldest dropped identities first
            stale = next((k for k in self.pins if k not in self.links.peers), None)
            if stale is None:
                break
            del self.pins[stale]
        return peer

    # ------------------------------------------------------------------ liveness
    def on_ping(self, peer: Peer, m: wire.Ping) -> None:
        self.links.send(peer, wire.Pong(m.nonce), quiet=True)

    def on_pong(self, peer: Peer, m: wire.Pong) -> None:
        # a nonce never sent proves nothing (it may be a guess at the next one): ignored
        if m.nonce <= self.nonce:
            peer.pong = max(peer.pong, m.nonce)

    def expire(self, now: float) -> list[Peer]:
        """Ping peers silent for a third of ``expiry_s``; the peers to drop: silent for
        ``expiry_s``, or unreachable."""
        if now < self.next_scan:
            return []
        self.next_scan = now + min(_SCAN_S, self.expiry_s / 10)
        gone, ping_after = [], self.expiry_s / 3
        for peer in list(self.links.peers.values()):
            if not peer.md.generation:
                continue  # an older kvtriton (no generation): it knows no Ping; never expired by silence
            silent = now - peer.heard
            if silent > self.expiry_s:
                gone.append(peer)
            elif silent > ping_after and now - peer.pinged > ping_after and self.probe(peer) is None:
                gone.append(peer)
        self.stats.peers_expired += len(gone)
        return gone
