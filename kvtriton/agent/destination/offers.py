"""Offers a destination rank received: packs (or cache blocks) a source made ready for a
request before any pull (see :mod:`kvtriton.agent.source.eager`), kept until a fetch asks for them."""

from __future__ import annotations

from ...plan import OfferTerms, RequestPlan, ceil_div
from ...protocol import wire
from ..links import Links, Peer

MAX_OFFERS_PER_PEER = 1024  # offers kept per source rank (the oldest goes first)
MAX_FINISHED = 4096  # requests remembered as fetched (their later offers ignored), the oldest forgotten first


def _terms(offer: wire.Offer) -> OfferTerms:
    return OfferTerms(offer.plan, offer.ids, offer.num_blocks, offer.chunk_blocks, offer.runs)


class Offers:
    """Offers received, per source rank and request; each is taken by at most one fetch, or
    declined (the source frees it), or withdrawn by its source (a Reject naming it)."""

    def __init__(self, links: Links):
        self.links = links
        self.by_peer: dict[tuple[str, int], dict[str, wire.Offer]] = {}  # source rank -> req -> its offer
        self.finished: dict[tuple[str, str], None] = {}  # (engine, req) fetched here: see drop

    def keep(self, peer: Peer, m: wire.Offer) -> None:
        """Keep ``peer``'s offer ``m`` (a newer offer of the same request replaces it); one of a request
        fetched here already is ignored (:meth:`drop`)."""
        if (peer.md.engine, m.req) in self.finished:
            return
        mine = self.by_peer.setdefault(peer.key, {})
        mine.pop(m.req, None)
        if len(mine) >= MAX_OFFERS_PER_PEER:
            mine.pop(next(iter(mine)))  # the oldest: its source frees it with the hold
        mine[m.req] = m

    def has(self, engine: str, req: str) -> bool:
        """Whether some rank of ``engine`` offered ``req``."""
        return any(req in offers for (eng, _), offers in self.by_peer.items() if eng == engine)

    def of_request(self, peers: dict[int, Peer], req: str) -> tuple[set[int], dict[int, OfferTerms]]:
        """Of ``peers`` (by source rank), those that offered ``req`` packed (with slots), and the terms
        of those that offered its cache blocks (no slots: read_unpack or a cache read): one look per rank."""
        packed: set[int] = set()
        cache: dict[int, OfferTerms] = {}
        by_peer = self.by_peer
        for r, peer in peers.items():
            mine = by_peer.get(peer.key)
            offer = mine.get(req) if mine else None
            if offer is not None:
                if offer.slots:
                    packed.add(r)
                else:
                    cache[r] = _terms(offer)
        return packed, cache

    def withdraw(self, peer: Peer, xid: str) -> None:
        """``peer`` withdrew its offer ``xid`` (its hold ended, or we pulled instead)."""
        mine = self.by_peer.get(peer.key)
        if mine:
            for req in [r for r, o in mine.items() if o.xid == xid]:
                del mine[req]

    def drop(self, engine: str, req: str) -> None:
        """Forget every offer of ``req`` from ``engine``'s ranks, and ignore any that comes later: its
        fetch finished, so our Done ends the hold they were made from (a fetch of ``req`` again must
        pull, and be refused; one offer taken would READ blocks the source may be reusing). The last
        :data:`MAX_FINISHED` requests are remembered: an offer still on its way arrives well before."""
        for (eng, _), offers in self.by_peer.items():
            if eng == engine:
                offers.pop(req, None)
        self.finished[(engine, req)] = None
        if len(self.finished) > MAX_FINISHED:
            del self.finished[next(iter(self.finished))]

    def peer_lost(self, peer: Peer) -> None:
        self.by_peer.pop(peer.key, None)

    def take_packed(self, peer: Peer, req: str, rp: RequestPlan, src_rank: int, taken) -> wire.Offer | None:
        """``peer``'s offer of ``req`` when it is exactly ``src_rank``'s payload of ``rp`` (the
        same terms, slot runs inside the peer's staging), else None; ``taken(xid)``: whether a
        transfer id is in use here already. An offer that does not match is declined (the
        source frees it), or left to the pull that follows when it may hold a suffix of this
        request (see :mod:`kvtriton.agent.source.eager`)."""
        offer = self.by_peer.get(peer.key, {}).pop(req, None)
        if offer is None:
            return None
        p = rp.payloads.get(src_rank)
        want = rp.offer_terms(src_rank)
        ok = p is not None and want is not None and _terms(offer) == want and not taken(offer.xid) \
            and len(offer.slots) == 2 * p.chunks.count \
            and len(offer.digests) in (0, wire.DIGEST_BYTES * p.chunks.count)  # none, or one per chunk
        if ok and p is not None:
            st = peer.md.staging
            for c in range(p.chunks.count):
                slot, nslots = offer.slots[2 * c], offer.slots[2 * c + 1]
                ok = ok and nslots == ceil_div(p.chunks.nbytes(c), st.slot_bytes) and slot + nslots <= st.num_slots
        if not ok:
            # an offer of more blocks by our plan may hold a suffix we ask (a -1 prefix): our pull
            # lets the source take it over or withdraw it; any other is declined now
            if not (p is not None and offer.plan == rp.digest and offer.num_blocks > p.chunks.num_blocks):
                self.links.send(peer, wire.Abort(offer.xid), quiet=True)
            return None
        return offer

    def take_cache(self, peer: Peer, req: str, rp: RequestPlan, taken) -> wire.Offer | None:
        """``peer``'s read_unpack offer of ``req`` (no slots: READ its cache) when it is for
        ``rp``'s plan and ids, else None; any other offer is declined (the source frees it)."""
        offer = self.by_peer.get(peer.key, {}).pop(req, None)
        if offer is None:
            return None
        if offer.slots or taken(offer.xid) or not _terms(offer).same_blocks(rp.cache_offer_terms()):
            self.links.send(peer, wire.Abort(offer.xid), quiet=True)
            return None
        return offer

