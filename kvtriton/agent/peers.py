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
  replaced: the last :data:`_FORMER_AGENTS` are remembered per identity) is refused; the agent
  that held it last and was dropped (expired while its engine slept) is taken back with a
  registration newer than its last one here, met authenticated. The same
  agent with a newer ``RankMetadata.generation`` registered its memory again
  (:meth:`~kvtriton.agent.TransferAgent.restore`): its old addresses and keys are dropped and the
  new ones connected (only when authenticated, under ``require_authenticated_peers``). Once
  dropped (replaced or expired), an (engine, rank) is free for its next agent.
* **Authenticated engines stay theirs** (issue 33, finding 4). With a credential configured
  (``require_authenticated_peers``), an engine any of whose ranks registered authenticated, live
  or since dropped (its pins remember it), is closed to unauthenticated agents: they are refused
  for every rank of it, before any liveness check, so none replaces a stalled or expired rank, nor
  stands next to one and reads the holds named for the engine. The other way round, an
  authenticated registration drops the engine's unauthenticated ranks at once
  (:meth:`untrusted_of`): whoever came first without the credential locks nobody out.
* **Bounds.** At most ``max_peers`` ranks in the table and ``max_peer_engines`` engines: a
  registration beyond either is refused (the table was unbounded: 352 accepted). A peer's sizes
  are bounded before the agent's lock is taken and before any descriptor is built
  (:meth:`PeerTable.check`, issue 33, finding 6): at most ``max_peer_slots`` staging slots (each
  becomes a prepared descriptor: 2^24 of them held the lock 2-25 s) and ``max_peer_blocks`` cache
  blocks per region, each never below this rank's own; its regions must be ours, one for one.
* **Expiry.** A peer silent for a third of ``expiry_s`` is pinged (an idle honest peer answers
  from its progress loop); one silent for ``expiry_s``, or whose ping cannot be sent, is dropped:
  its transfers fail with :class:`~kvtriton.errors.PeerDisconnectedError` and the staging they
  kept returns to the pool (quarantined first, as after any failure). A peer whose metadata has
  no generation (an older kvtriton, protocol version 2 without ``Ping``) is never pinged nor
  expired: it would drop the pings as unknown and look silent. The protocol version stays 2
  (``gen`` is optional, ``Ping``/``Pong`` are sent only to peers that declared a generation).
* **Lifelines.** A peer met over a kept connection (:mod:`.lifelines`) is dropped as soon as
  that connection closes (its process died): its transfers fail with
  :class:`~kvtriton.errors.PeerDisconnectedError` within a ``progress()`` of the closure,
  whatever ``timeout_s``, and (the facade's) the holds only it still had to read end. Only the
  lifeline of the agent in the table counts: one of a replaced agent changes nothing.
* **Parting.** A rank that forgets an idle engine (:meth:`PeerTable.part`, the vLLM connector's
  ``forget_idle_s``) drops its ranks and closes their lifelines; they drop it in turn. Both
  sides mark the pin *parted* (a closed lifeline looks the same as a death; so does a peer
  dropped for silence, which may be a live one past a stall of its host), and the same agent
  met again later with a registration no older than its last one, authenticated (or with no
  credential configured), is taken back: a replaced agent stays refused (``former``), and a
  dead agent's replay reaches no live process.
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
from .lifelines import Lifelines
from .links import Links, Peer, logger
from .settings import Settings
from .stats import Stats

__all__ = ["MAX_PEERS", "MAX_PEER_BLOCKS", "MAX_PEER_ENGINES", "MAX_PEER_SLOTS", "Admission", "PeerTable"]

MAX_PEERS = 256  # ranks one rank may know (32 engines of TP 8)
MAX_PEER_ENGINES = 64  # engines one rank may know
MAX_PEER_SLOTS = 1 << 16  # a peer's staging slots (16 GiB of 256 KiB slots; ~10 ms of descriptors)
MAX_PEER_BLOCKS = 1 << 24  # a peer region's cache blocks (256 M tokens at 16 a block)
_PROBE_MAX_S = 2.0  # the longest a liveness check of a contested identity waits for an answer
_SCAN_S = 0.05  # expiry scans the table at most this often (progress() runs far more often)
_FORMER_AGENTS = 16  # agents remembered per identity after they left it (their replays are refused)


@dataclass
class _Pin:
    """Who an (engine, rank) belongs to: its current (or last) agent, the generation counted
    here (strictly increasing per identity, +1 per agent that took it), the agents before."""

    agent: str
    generation: int
    authenticated: bool = False  # an agent of this identity proved the credential (see sealed)
    #: the ``RankMetadata.generation`` its current agent last registered with: compared only with
    #: that same agent's next claim (a restore after it was dropped must be newer than this)
    registered: int = 0
    former: deque[str] = field(default_factory=lambda: deque(maxlen=_FORMER_AGENTS))
    #: the pair parted while both lived, or so it looked: its lifeline closed, it went silent past
    #: the expiry, or this rank forgot the engine (idle, :meth:`PeerTable.part`); the same agent may
    #: come back (:meth:`PeerTable.admit`)
    parted: bool = False


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
                 max_peer_engines: int = MAX_PEER_ENGINES, expiry_s: float | None = None,
                 max_peer_slots: int = MAX_PEER_SLOTS, max_peer_blocks: int = MAX_PEER_BLOCKS):
        if min(int(max_peers), int(max_peer_engines), int(max_peer_slots), int(max_peer_blocks)) < 1:
            raise ValueError(f"max_peers, max_peer_engines, max_peer_slots and max_peer_blocks must be >= 1, got "
                             f"{max_peers}, {max_peer_engines}, {max_peer_slots}, {max_peer_blocks}")
        self.s, self.links, self.stats = settings, links, stats
        self.max_peers, self.max_engines = int(max_peers), int(max_peer_engines)
        # never below our own: an engine built like this one is always admitted
        self.max_slots = max(int(max_peer_slots), settings.pool.num_slots)
        self.max_blocks = max(int(max_peer_blocks), *(s.num_blocks for s in settings.specs))
        # default: well past any transfer's silence bound, so only a peer that is really gone goes
        self.expiry_s = float(expiry_s) if expiry_s is not None else max(4 * settings.timeout_s, 60.0)
        if not self.expiry_s > 0:
            raise ValueError(f"peer_expiry_s must be > 0, got {expiry_s!r}")
        self.probe_s = min(settings.timeout_s, _PROBE_MAX_S)
        # (engine, rank) -> its last accepted registration, live or dropped
        self.pins: OrderedDict[tuple[str, int], _Pin] = OrderedDict()
        self.nonce = 0
        self.next_scan = 0.0
        self.lifelines = Lifelines(settings.name, limit=self.max_peers)

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
        :class:`~kvtriton.errors.IncompatibleRemoteError` naming the first difference. First the
        sizes (:class:`~kvtriton.errors.PeerRefusedError` naming the limit): the caller holds no
        lock yet and nothing is built from them."""
        if md.staging.num_slots > self.max_slots:
            raise self._refuse(f"engine {md.engine!r}: {md.staging.num_slots} staging slots is more than "
                               f"{self.s.name} accepts of a peer (max_peer_slots = {self.max_slots})")
        blocks = max(r.num_blocks for r in md.regions)
        if blocks > self.max_blocks:
            raise self._refuse(f"engine {md.engine!r}: {blocks} cache blocks in a region is more than "
                               f"{self.s.name} accepts of a peer (max_peer_blocks = {self.max_blocks})")
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

    def admit(self, md: wire.RankMetadata, authenticated: bool, takeover: bool = True) -> Admission:
        """Whether ``md``'s agent may take its (engine, rank); raises
        :class:`~kvtriton.errors.PeerRefusedError` when it may not. ``takeover=False``: another
        agent holding it is never checked nor replaced (a route the engine has not proven itself
        on may reach only the agents it already has)."""
        key, links = (md.engine, md.rank), self.links
        old = links.peers.get(key)
        if old is not None and old.agent == md.agent:
            if md.generation and old.md.generation and md.generation > old.md.generation and (
                    authenticated or not self.s.require_authenticated):
                return Admission.REREGISTERED  # the same agent registered its memory again (restore)
            old.authenticated = old.authenticated or authenticated  # met again, over a proven exchange
            if authenticated:
                self.pins[key].authenticated = True
            return Admission.KNOWN
        other = links.by_agent.get(md.agent)
        if other is not None:
            raise self._refuse(f"agent {md.agent!r} is registered here as {other[0]}:{other[1]}; one NIXL agent "
                               f"stands for one engine rank, not also {md.engine}:{md.rank}")
        if self.generic(authenticated) and self.sealed(md.engine):
            raise self._refuse(f"engine {md.engine!r} registered authenticated here; an unauthenticated agent "
                               f"({md.agent!r}) stands for none of its ranks")
        pin = self.pins.get(key)
        if pin is not None and old is None and md.agent == pin.agent and (
                self._restored(md, pin, authenticated) or self._back(md, pin, authenticated)):
            pass  # dropped while it slept (expired) or once the pair parted, back with the same or a newer registration
        elif pin is not None and (md.agent in pin.former or (old is None and md.agent == pin.agent)):
            raise self._refuse(f"{md.engine}:{md.rank}: agent {md.agent!r} held it before and left it: a stale or "
                               f"replayed registration, not newer than generation {pin.generation} here; a "
                               f"restarted rank registers with a new agent")
        if old is not None:
            if not takeover:
                raise self._refuse(f"{md.engine}:{md.rank} is registered to agent {old.agent!r}; agent {md.agent!r}, "
                                   f"met at an address the engine has not proven itself on, does not replace it")
            return Admission.CONTESTED
        if len(links.peers) >= self.max_peers:
            raise self._refuse(f"{self.s.name} knows {len(links.peers)} peer ranks, its limit (max_peers)")
        engines = {p.md.engine for p in links.peers.values()}
        if md.engine not in engines and len(engines) >= self.max_engines:
            raise self._refuse(f"{self.s.name} knows {len(engines)} peer engines, its limit (max_peer_engines)")
        return Admission.NEW

    def _restored(self, md: wire.RankMetadata, pin: _Pin, authenticated: bool) -> bool:
        """Whether the agent that held ``pin`` and was dropped comes back with a newer registration of
        its own (:meth:`~kvtriton.agent.TransferAgent.restore` after a peer expired it): over an
        authenticated meeting (or with no credential configured), and newer than the last one it
        registered here, so a replay of a registration it had before stays refused."""
        return bool(md.generation and pin.registered and md.generation > pin.registered
                    and (authenticated or not self.s.require_authenticated))

    def _back(self, md: wire.RankMetadata, pin: _Pin, authenticated: bool) -> bool:
        """Whether the agent that held ``pin`` comes back after the pair parted (its lifeline
        closed, it was dropped for silence, or this rank forgot its idle engine): a live agent that was forgotten, not a
        replaced one (those are in ``former``); a dead agent's replay reaches nobody. Its
        registration no older than the last one here, met authenticated (or no credential)."""
        return pin.parted and md.generation >= pin.registered and (authenticated or not self.s.require_authenticated)

    def part(self, engine: str) -> list[Peer]:
        """The ranks of ``engine`` to drop as this rank forgets it (idle, the connector's
        ``forget_idle_s``): their lifelines are closed (that engine drops this rank in turn, its
        table and NIXL state freed too) and their pins marked parted, so either side meets the
        other again on a later request."""
        out = [p for p in self.links.peers.values() if p.md.engine == engine]
        for p in out:
            self.lifelines.release(p.key)
            pin = self.pins.get(p.key)
            if pin is not None:
                pin.parted = True
        return out

    def sealed(self, engine: str) -> bool:
        """Whether ``engine`` is closed to unauthenticated agents: one of its ranks registered
        authenticated (its pin remembers it after the agent left)."""
        return any(pin.authenticated for (e, _), pin in self.pins.items() if e == engine)

    def untrusted_of(self, md: wire.RankMetadata, authenticated: bool) -> list[Peer]:
        """The ranks of ``md``'s engine its registration made with ``authenticated`` drops before
        it is admitted: with a credential configured, an authenticated one drops every
        unauthenticated rank of its engine (they would read its holds, or keep its identity from
        it) but its own agent, which it proves now (:meth:`admit` marks it authenticated)."""
        if not (self.s.require_authenticated and authenticated):
            return []
        out = [p for p in self.links.peers.values()
               if p.md.engine == md.engine and not p.authenticated and p.agent != md.agent]
        self.stats.peers_replaced += len(out)
        return out

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
            self.pins[key] = pin = _Pin(md.agent, 1)
        elif pin.agent != md.agent:  # the same agent registering again is not a former one
            pin.former.append(pin.agent)
            pin.agent, pin.generation = md.agent, pin.generation + 1
        pin.authenticated = pin.authenticated or authenticated
        pin.registered, pin.parted = md.generation, False
        self.pins.move_to_end(key)
        while len(self.pins) > 4 * self.max_peers:  # forget the oldest dropped identities, unauthenticated first
            dropped = [k for k in self.pins if k not in self.links.peers]
            stale = next((k for k in dropped if not self.pins[k].authenticated), dropped[0] if dropped else None)
            if stale is None:
                break
            del self.pins[stale]
        return peer

    # ------------------------------------------------------------------ liveness
    def lifeline(self, md: wire.RankMetadata, conn) -> bool:
        """Watch ``conn``, the kept connection ``md``'s meeting was made over, as that peer's
        lifeline; closed at once (False) when its agent is not in the table (refused, replaced)."""
        if self.links.by_agent.get(md.agent) != (md.engine, md.rank):
            conn.close()
            return False
        return self.lifelines.watch((md.engine, md.rank), md.agent, conn)

    def shift(self, seconds: float) -> None:
        """Every peer heard from ``seconds`` later (this process stalled: :mod:`.stalls`): only
        silence we watched counts."""
        for peer in self.links.peers.values():
            peer.heard += seconds
            peer.pinged += seconds

    def on_ping(self, peer: Peer, m: wire.Ping) -> None:
        self.links.send(peer, wire.Pong(m.nonce), quiet=True)

    def on_pong(self, peer: Peer, m: wire.Pong) -> None:
        # a nonce never sent proves nothing (it may be a guess at the next one): ignored
        if m.nonce <= self.nonce:
            peer.pong = max(peer.pong, m.nonce)

    def expire(self, now: float) -> list[tuple[Peer, KVTritonError]]:
        """The peers to drop, with why: their lifeline closed (looked at on every call), silent
        for ``expiry_s`` or unreachable (peers silent for a third of it are pinged)."""
        out: list[tuple[Peer, KVTritonError]] = []
        for key, agent in self.lifelines.lost():
            peer = self.links.peers.get(key)
            if peer is not None and peer.agent == agent:
                self.stats.peers_disconnected += 1
                if key in self.pins:  # dead (a restart is a new agent), or it forgot us: see part
                    self.pins[key].parted = True
                out.append((peer, PeerDisconnectedError(
                    f"peer {key[0]}:{key[1]} ({agent}) is gone: the connection it met {self.s.name} over closed")))
        if now < self.next_scan:
            return out
        self.next_scan = now + min(_SCAN_S, self.expiry_s / 10)
        gone, ping_after = [], self.expiry_s / 3
        for peer in list(self.links.peers.values()):
            if not peer.md.generation or any(p is peer for p, _ in out):
                continue  # an older kvtriton (no generation): it knows no Ping; never expired by silence
            silent = now - peer.heard
            if silent > self.expiry_s:
                gone.append(peer)
            elif silent > ping_after and now - peer.pinged > ping_after and self.probe(peer) is None:
                gone.append(peer)
        self.stats.peers_expired += len(gone)
        for peer in gone:  # dead, or alive past a stall: like a closed lifeline, it may meet us again (see _back)
            if peer.key in self.pins:
                self.pins[peer.key].parted = True
        self.lifelines.prune(lambda key, agent: self.links.by_agent.get(agent) == key)
        return out + [(p, PeerDisconnectedError(f"peer {p.md.engine}:{p.md.rank} stopped answering (silent past "
                                                f"{self.expiry_s} s, or unreachable)")) for p in gone]
