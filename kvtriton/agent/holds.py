"""The holds of a source rank: which requests' blocks it keeps, for whom, and until when.

* **Entitlement.** A hold has one consumer engine: the one named at ``hold(consumer=...)``, or
  else the first engine whose ``pull``/``push`` this rank accepts for it, or whose first ack
  (or RunsDone) of an offer made before any binding arrives (trust on first use; an eager
  pack guessed for an engine binds nothing by itself, see :mod:`.eager`).
  Only that engine's ranks may read it, report it ``done`` or ``renew`` its lease. A replica no
  rank of an engine reads (e.g. an MLA replica its stripe skips) binds to the first engine that
  reports it done, since nothing else will ever reach it; name the consumer to close even that.
* **Time.** A hold lives at most its lease (renewed by its consumer) plus ``timeout_s``, whatever
  its transfers do.

:class:`SourceHolds` is the part of :class:`~.source.Source` that keeps them; the state it uses
(``holds``, ``freed``, ``serves``, ``plans``, ``eager``) is created by ``Source.__init__``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import KVTritonError, ProtocolError
from ..protocol import wire
from .links import Peer


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


class SourceHolds:
    """Held requests of a source rank: placing, releasing, done and renew from the consumer,
    and the lease (a mixin of :class:`~.source.Source`)."""

    def hold(self, req_id: str, block_ids: np.ndarray, lease_s: float, consumer: str | None, ready=None) -> None:
        self.eager.release(req_id)  # a hold placed again: what was packed for the old one is stale
        hold = self.holds[req_id] = Hold(req_id, block_ids, lease_s, time.monotonic() + lease_s, consumer,
                                         ready=ready)
        self.eager.placed(hold)

    def bind(self, hold: Hold, engine: str) -> bool:
        """Bind ``hold`` to ``engine`` if it is unbound (what was packed or offered for another
        engine goes); whether ``engine`` is its consumer now."""
        if hold.consumer is None:
            hold.consumer = engine
            self.eager.bound(hold.req_id, engine)
        return hold.consumer == engine

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

    def on_done(self, peer: Peer, m: wire.Done) -> None:
        hold = self.holds.get(m.req)
        if hold is None:
            return  # already freed (lease) or never held: nothing to do
        if m.dst_rank != peer.md.rank or m.dst_tp != peer.md.tp:
            raise ProtocolError(f"done from {peer.agent} names rank {m.dst_rank}/{m.dst_tp}")
        eng = peer.md.engine
        if hold.consumer is None and not self._reads_from_me(peer, hold.block_ids.size):
            self.bind(hold, eng)  # a replica this engine skips: its done is all that will come
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
        ignored (counted as refused): renewal never keeps alive what the sender may not read
        (a peer holding an offer of an unbound hold may read it)."""
        hold = self.holds.get(m.req)
        if m.dst_rank != peer.md.rank:
            raise ProtocolError(f"renew from {peer.agent} names rank {m.dst_rank}")
        if hold is None:
            return
        # an unbound hold offered to this peer: it may be reading the offer, not acked yet (that
        # binds); its renewal keeps the lease as a pull's would, and binds nothing
        offered = hold.consumer is None and (peer.agent, m.req) in self.offered
        if hold.consumer != peer.md.engine and not offered:
            self.links.stats["refused"] += 1
            return
        hold.deadline = max(hold.deadline, time.monotonic() + hold.lease_s)

    def expire_holds(self, now: float) -> None:
        serving = {s.req_id for s in self.serves.values() if not s.offered}  # an offer alone: the lease rules
        for hold in list(self.holds.values()):
            # a transfer in progress keeps its blocks (it has its own silence deadline), but never
            # past the lease plus timeout_s: then the hold goes whatever its transfers do
            if now > hold.deadline and (hold.req_id not in serving or now > hold.deadline + self.s.timeout_s):
                self._release_hold(hold, "lease_expired")
