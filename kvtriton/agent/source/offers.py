"""The offers of a source rank: an eager pack (or the cache blocks themselves) announced to a
destination rank ahead of its pull, as a transfer of its own (why and when: :mod:`.eager`).

:class:`Offers` is the one home of an offer's state and its life:

* **made** (:meth:`Offers.pack`, :meth:`Offers.cache`): the Offer went out; the transfer is
  *untouched*, nothing heard from its peer yet (its silence is not counted, the lease rules);
* **read** (:meth:`Offers.read`): its first ack or RunsDone; from then on a pull like any other
  (and it binds the hold, see :meth:`~.holds.Holds.bind`);
* **pulled** (:meth:`Offers.asked`): a pull of the same request from the same rank takes its
  chunks over, or it is withdrawn;
* **declined** (:meth:`Offers.declined`: the peer aborts it) or **withdrawn**
  (:meth:`Offers.withdraw`: the hold went to another engine);
* **ended** (:meth:`Offers.ended`): whatever it became, the transfer that came of it gives the
  slots of the eager budget it kept back (``eager_returned``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ...errors import KVTritonError, ProtocolError
from ...plan import OfferTerms, RequestPlan
from ...protocol import wire
from ..integrity import seal
from ..links import Peer
from ..settings import Settings
from ..stats import Stats
from .eager import Packed, suffix_chunks
from .flows import PullServe, Serve, Serving
from .holds import Hold

__all__ = ["Offers"]


def _offer(xid: str, req: str, terms: OfferTerms, slots: tuple[int, ...], digests: bytes = b"") -> wire.Offer:
    """The offer of transfer ``xid`` of ``req`` on ``terms`` (:class:`~kvtriton.plan.OfferTerms`);
    ``digests``: one per chunk with ``integrity=True`` (see :mod:`..integrity`)."""
    return wire.Offer(xid, req, terms.plan, terms.ids, terms.num_blocks, terms.chunk_blocks, slots, runs=terms.runs,
                      digests=digests)


class Offers:
    """The offers of one source rank, made as transfers of ``serves`` (which owns them as it
    owns every transfer). ``eager_returned(nslots)``: slots of the eager budget are free again."""

    def __init__(self, settings: Settings, stats: Stats, serves: Serving, *,
                 eager_returned: Callable[[int], None]):
        self.s, self.stats, self.serves = settings, stats, serves
        self.eager_returned = eager_returned
        self.untouched: dict[tuple[str, str], PullServe] = {}  # (peer agent, req) -> offered, nothing heard yet
        self.budget: dict[Serve, int] = {}  # transfer that came of an offer -> eager budget slots it keeps

    # ------------------------------------------------------------------ what is offered
    def offered(self, serve: Serve) -> bool:
        """``serve`` is an offer nothing was heard of yet."""
        return self.untouched.get((serve.peer.agent, serve.req_id)) is serve

    def made_to(self, peer: Peer, req_id: str) -> bool:
        """``peer`` holds an untouched offer of ``req_id``."""
        return (peer.agent, req_id) in self.untouched

    def chunks(self, req_id: str) -> int:
        """Chunks of ``req_id`` offered and not taken yet."""
        return sum(s.n_chunks for s in self.untouched.values() if s.req_id == req_id)

    # ------------------------------------------------------------------ made
    def pack(self, hold: Hold, packed: Packed) -> bool:
        """Announce an eager pack to its destination rank as a transfer of its own; False when
        the peer has no room for another transfer or the send fails."""
        peer = packed.peer
        xid = self._xid(hold, peer)
        if xid is None:
            return False
        serve = PullServe(xid, hold.req_id, peer, packed.read, packed.ids, packed.chunks, self.s.timeout_s,
                          time.monotonic() + self.s.timeout_s, ready=hold.ready,
                          runs_reader=packed.runs)  # runs: held until RunsDone
        serve.inflight = dict(packed.inflight)
        serve.next_chunk = packed.chunks.count
        slots, digests = [], []
        for c in range(packed.chunks.count):
            ch = serve.inflight[c]
            ch.kernel = None  # completed: announced by the offer, not by a ready
            slots += [ch.slot, ch.nslots]
            digests.append(seal(self.s, self.stats, ch))
        terms = packed.request.offer_terms(packed.payload.src_rank)
        if terms is None:  # never: a pack is made only of a payload that fits, equal block sizes
            return False
        return self._send(serve, _offer(xid, hold.req_id, terms, tuple(slots), b"".join(digests)), packed.nslots)

    def cache(self, hold: Hold, peer: Peer, request: RequestPlan) -> bool:
        """Offer ``peer`` to READ ``hold``'s blocks straight from our cache (read_unpack): an
        :class:`~kvtriton.protocol.wire.Offer` without slots, sent once the engine's writes are done, and
        a transfer that keeps the blocks until the reader's RunsDone (or the hold ends), as a
        pull's RunsReady would. Saves the pull's round trip to this process. ``request``: the
        hold's :meth:`RequestPlan.for_hold` (its terms are the offer's)."""
        xid = self._xid(hold, peer)
        if xid is None:
            return False
        serve = PullServe(xid, hold.req_id, peer, None, hold.block_ids, None, self.s.timeout_s,
                          time.monotonic() + self.s.timeout_s, ready=hold.ready, runs_reader=True)
        return self._send(serve, _offer(xid, hold.req_id, request.cache_offer_terms(), ()), 0)

    def _xid(self, hold: Hold, peer: Peer) -> str | None:
        """The transfer id of an offer of ``hold`` to ``peer`` (one per request and rank); None
        when it is in use or the peer has no room for another transfer."""
        xid = f"{hold.req_id}|{self.s.name}>{peer.md.rank}!"
        if (peer.agent, xid) in self.serves.by_key or not self.serves.room(peer):
            return None
        return xid

    def _send(self, serve: PullServe, offer: wire.Offer, nslots: int) -> bool:
        """Send ``offer`` and, once it is out, keep ``serve`` as the offered transfer, keeping
        ``nslots`` of the eager budget."""
        try:
            self.serves.links.send(serve.peer, offer)
        except KVTritonError:
            return False
        self.serves.add(serve)
        self.untouched[(serve.peer.agent, offer.req)] = serve
        self.budget[serve] = nslots
        self.stats.eager_offers += 1
        return True

    # ------------------------------------------------------------------ what became of it
    def read(self, serve: Serve) -> None:
        """The peer took the offer ``serve`` (its first ack or RunsDone): from now on its silence
        counts; the hold binds to its engine (raises when it is held for another)."""
        holds = self.serves.holds
        hold = holds.get(serve.req_id)
        if hold is not None and not holds.bind(hold, serve.peer):
            raise ProtocolError(f"{serve.xid!r}: {serve.req_id!r} is held for engine {hold.consumer!r}")
        self.stats.eager_offer_reads += 1
        self.untouched.pop((serve.peer.agent, serve.req_id), None)

    def asked(self, serve: Serve) -> None:
        """``serve``, a transfer being accepted (a pull: only a pull rank offers), takes over the
        chunks of its peer's untouched offer of the same request when they are its payload or
        the packed chunks of a suffix it asks (a -1 prefix, see :mod:`.eager`); the offer is
        withdrawn in any case."""
        offered = self.untouched.get((serve.peer.agent, serve.req_id))
        if offered is None:
            return
        got = None
        if not serve.inflight and serve.tokens is None and offered.read == serve.read \
                and serve.chunks is not None and offered.chunks is not None:
            got = suffix_chunks(offered.ids, offered.chunks, offered.inflight, serve.ids, serve.chunks)
        # The pull comes from the very rank the offer was made to, so that rank is not reading the
        # offer: a destination part either takes an offer (and READs without a pull) or pulls,
        # never both, and a part that took it and failed aborts it before any later pull. Nothing
        # is quarantined here (that is for withdrawals a reader may not have seen yet).
        if not got or not got[0] or serve.chunks is None:
            self.stats.eager_misses += 1
            self.serves.drop(offered, notify=f"offer of {serve.req_id!r} withdrawn: a pull for something else arrived",
                             quarantine=False)
            return
        taken, before = got
        self.stats.eager_offer_pulls += 1
        freed = sum(ch.nslots for ch in before.values())  # the chunks before the suffix: not read either
        self.serves.share.retire(offered.peer.md.engine, before, 0.0)
        serve.inflight, offered.inflight = taken, {}
        serve.next_chunk = serve.chunks.count
        self.budget[serve] = self.budget.pop(offered, 0) - freed
        self.eager_returned(freed)
        self.serves.remove(offered)
        for ch in serve.inflight.values():
            self.serves.links.send(serve.peer, wire.Ready(serve.xid, ch.index, ch.slot, ch.nslots, ch.nbytes,
                                                          seal(self.s, self.stats, ch)), quiet=True)

    def declined(self, serve: Serve) -> None:
        """The peer aborted ``serve``: an untouched offer was declined (the fetch asked something
        else)."""
        if self.offered(serve):
            self.stats.eager_misses += 1

    def withdraw(self, req_id: str, engine: str) -> int:
        """Withdraw the offers of ``req_id`` to engines other than ``engine`` (it was bound to
        that one; the others may be reading them: quarantined); how many."""
        gone = [s for s in self.untouched.values() if s.req_id == req_id and s.peer.md.engine != engine]
        for serve in gone:
            self.serves.drop(serve, notify=f"offer of {req_id!r} withdrawn: the request went to engine {engine!r}")
        return len(gone)

    def ended(self, serve: Serve) -> None:
        """``serve`` left the table: an untouched offer is one no more, and the eager budget slots
        it kept are free again."""
        if self.offered(serve):
            del self.untouched[(serve.peer.agent, serve.req_id)]
        self.eager_returned(self.budget.pop(serve, 0))
