"""The holds of a source rank: which requests' blocks it keeps, for whom, and until when.

* **Entitlement.** A hold has one consumer engine: the one named at ``hold(consumer=...)``, or
  else the first engine whose ``pull``/``push`` this rank accepts for it, or whose first ack
  (or RunsDone) of an offer made before any binding arrives (trust on first use; an eager
  pack guessed for an engine binds nothing by itself, see :mod:`.eager`). With a credential
  configured (``require_authenticated_peers``) only an authenticated engine binds an unbound
  hold: the first pull of an unauthenticated one is refused, whoever comes first.
  Only that engine's ranks may read it, report it ``done`` or ``renew`` its lease. A replica no
  rank of an engine reads (e.g. an MLA replica its stripe skips) binds to the first engine that
  reports it done, since nothing else will ever reach it; name the consumer to close even that.
  Whether an engine reads from this rank is judged by the plans this rank serves it by (the
  engine's own cost model: :class:`~..plan_book.PlanBook`).
* **Done.** A hold ends when every consumer rank that reads this rank reported done
  (:func:`~kvtriton.plan.done_ranks`, from what both engines share: a rank that reads nothing
  from here never connects, and one no rank reads hears from the rank the plan names).
* **Time.** A hold lives at most its lease (renewed by its consumer) plus ``timeout_s``, whatever
  its transfers do.

:class:`Holds` owns the held requests and the freed ones; what a hold's end does to the
transfers serving it is the :class:`~kvtriton.agent.source.Source`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ...errors import KVTritonError, ProtocolError
from ...plan import done_ranks
from ...protocol import wire
from ..links import Links, Peer
from ..plan_book import PlanBook
from ..reports import Reports
from ..stats import Stats

if TYPE_CHECKING:
    import torch

__all__ = ["FreedRequest", "Hold", "Holds"]


@dataclass(frozen=True)
class FreedRequest:
    """A held request whose blocks the prefill side may reuse: ``reason`` is ``"done"`` (every
    consumer finished), ``"lease_expired"``, ``"released"`` (:meth:`TransferAgent.release`) or
    ``"consumer_lost"`` (a consumer rank it waited for died: its lifeline closed, or it expired)."""

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
    done_from: set[tuple[str, int]] = field(default_factory=set)  # (engine, rank) of every done received
    ready: torch.cuda.Event | None = None  # after it the engine's blocks are final (None: they are)
    groups: tuple[np.ndarray, ...] = ()  # several KV cache groups: each group's held ids (block_ids: all)
    pack_for: str | None = None  # unbound: the engine to pack it ahead for instead of a guess (binds nothing)
    keep: float = 0.0  # the blocks are not reported free before this (a withdrawn reader may still READ them)


class Holds:
    """The held requests of a source rank: placing, binding, done and renew from the consumer,
    the lease, and the requests freed since the caller last asked."""

    def __init__(self, rank: int, timeout_s: float, links: Links, plans: PlanBook, stats: Stats,
                 on_bound: Callable[[str, str], None]):
        self.rank, self.timeout_s = rank, timeout_s
        self.links, self.plans, self.stats = links, plans, stats
        self.on_bound = on_bound  # (req, engine): a hold was bound (what was packed for others goes)
        self.held: dict[str, Hold] = {}
        self.freed: Reports[FreedRequest] = Reports()  # taken without the agent's lock (..reports)
        self.kept: list[tuple[float, FreedRequest]] = []  # ended, reported once their blocks' keep passed
        self._done_ranks: dict[int, frozenset[int]] = {}  # consumer tp -> its ranks a hold waits for

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.held

    def get(self, req_id: str) -> Hold | None:
        return self.held.get(req_id)

    def place(self, req_id: str, block_ids: np.ndarray, lease_s: float, consumer: str | None,
              ready: torch.cuda.Event | None) -> Hold:
        hold = self.held[req_id] = Hold(req_id, block_ids, lease_s, time.monotonic() + lease_s, consumer,
                                        ready=ready)
        return hold

    def bind(self, hold: Hold, peer: Peer) -> bool:
        """Bind ``hold`` to ``peer``'s engine if it is unbound and ``peer`` may bind it (trusted:
        :meth:`~..links.Links.trusted`); whether that engine is its consumer now."""
        engine = peer.md.engine
        if hold.consumer is None:
            if not self.links.trusted(peer):
                return False
            hold.consumer = engine
            self.on_bound(hold.req_id, engine)
        return hold.consumer == engine

    def end(self, hold: Hold, reason: str) -> None:
        """``hold`` is no longer held: reported by :meth:`take_freed` with ``reason``, once its
        ``keep`` has passed (:meth:`keep_until`)."""
        self.held.pop(hold.req_id, None)
        freed = FreedRequest(hold.req_id, reason)
        if hold.keep > time.monotonic():
            self.kept.append((hold.keep, freed))
        else:
            self.freed.add(freed)

    def release_kept(self, now: float) -> None:
        """Report the ended holds whose keep has passed (under the agent's lock)."""
        if self.kept:
            for until, f in self.kept:
                if until <= now:
                    self.freed.add(f)
            self.kept = [(until, f) for until, f in self.kept if until > now]

    def shift(self, seconds: float) -> None:
        """Every lease and keep later by ``seconds`` (this process stalled: :mod:`..stalls`)."""
        for hold in self.held.values():
            hold.deadline += seconds
            if hold.keep:  # 0.0: none
                hold.keep += seconds
        self.kept = [(until + seconds, f) for until, f in self.kept]

    def take_freed(self) -> list[FreedRequest]:
        """The freed holds reported and not taken yet; needs no lock (:mod:`..reports`)."""
        return self.freed.take()

    def keep_until(self, req_id: str, until: float) -> None:
        """Keep ``req_id``'s blocks at least until ``until``: a reader told to stop (a withdrawn
        offer of the cache blocks, a dropped transfer reading them) may still be reading them.
        The lease lasts that long, and a hold that ends sooner (its consumer done) is reported
        freed only then."""
        hold = self.held.get(req_id)
        if hold is not None:
            hold.deadline = max(hold.deadline, until)
            hold.keep = max(hold.keep, until)

    def _reads_from_me(self, peer: Peer, nblocks: int) -> bool:
        """Whether any rank of ``peer``'s engine reads from this rank for a request of
        ``nblocks``, by the plans this rank serves them by (each rank's own metadata when it is
        connected, else the sender's: one engine shares geometry and, as far as we know, model)."""
        for d in range(peer.md.tp):
            md = getattr(self.links.peers.get((peer.md.engine, d)), "md", None)
            try:
                plan = self.plans.serving(md or peer.md, rank=d)
            except KVTritonError:
                return True  # unplannable: never a reason to release anything
            if plan.payload(self.rank) is not None or self.rank in plan.direct_ranks(nblocks):
                return True
        return False

    def on_done(self, peer: Peer, m: wire.Done) -> Hold | None:
        """Record ``peer``'s done; the hold to free (every rank of its consumer that reads this
        rank is done, see :meth:`_waits_for`), or None."""
        hold = self.held.get(m.req)
        if hold is None:
            return None  # already freed (lease) or never held: nothing to do
        if m.dst_rank != peer.md.rank or m.dst_tp != peer.md.tp:
            raise ProtocolError(f"done from {peer.agent} names rank {m.dst_rank}/{m.dst_tp}")
        eng = peer.md.engine
        if hold.consumer is None and not self._reads_from_me(peer, hold.block_ids.size):
            self.bind(hold, peer)  # a replica this engine skips: its done is all that will come
        if hold.consumer is not None and hold.consumer != eng:
            self.stats.refused += 1
            raise ProtocolError(f"done for {m.req!r} from {peer.agent}: {self.links.s.name} holds it for "
                                f"engine {hold.consumer!r}")
        # an unbound hold records it too: a rank may finish before its sibling's pull binds us
        hold.done_from.add(peer.key)
        if hold.consumer == eng and self._waits_for(peer.md.tp) <= {r for e, r in hold.done_from if e == eng}:
            return hold
        return None

    def left_by(self, peer: Peer) -> list[Hold]:
        """The holds of ``peer``'s engine still waiting for ``peer``'s done: it is gone, so they
        would end only by their lease."""
        if peer.md.rank not in self._waits_for(peer.md.tp):
            return []
        return [h for h in self.held.values() if h.consumer == peer.md.engine and peer.key not in h.done_from]

    def _waits_for(self, dst_tp: int) -> frozenset[int]:
        """The ranks of a ``dst_tp`` consumer whose done ends a hold here: those that read from
        this rank (a rank that reads nothing never connects, so waiting for it would end every
        hold by lease), see :func:`~kvtriton.plan.done_ranks`."""
        ranks = self._done_ranks.get(dst_tp)
        if ranks is None:
            s = self.plans.s
            ranks = self._done_ranks[dst_tp] = frozenset(done_ranks(self.rank, s.tp, s.specs, dst_tp,
                                                                    replicate_stripe=s.stripe))
        return ranks

    def on_renew(self, peer: Peer, m: wire.Renew, offered: bool) -> None:
        """The consumer still wants the request: the lease starts over. From anyone else it is
        ignored (counted as refused): renewal never keeps alive what the sender may not read.
        ``offered``: ``peer`` holds an offer of the request (an unbound hold offered to it: it may
        be reading the offer, not acked yet (that binds); its renewal keeps the lease as a pull's
        would, and binds nothing)."""
        hold = self.held.get(m.req)
        if m.dst_rank != peer.md.rank:
            raise ProtocolError(f"renew from {peer.agent} names rank {m.dst_rank}")
        if hold is None:
            return
        if hold.consumer != peer.md.engine and not (hold.consumer is None and offered):
            self.stats.refused += 1
            return
        hold.deadline = max(hold.deadline, time.monotonic() + hold.lease_s)

    def expired(self, now: float, serving: set[str]) -> list[Hold]:
        """Holds past their lease: a transfer in progress (of a request in ``serving``) keeps its
        blocks (it has its own silence deadline), but never past the lease plus ``timeout_s``."""
        return [hold for hold in self.held.values()
                if now > hold.deadline and (hold.req_id not in serving or now > hold.deadline + self.timeout_s)]
