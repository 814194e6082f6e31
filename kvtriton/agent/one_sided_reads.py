"""The destination's one-sided staging (:mod:`kvtriton.one_sided`): choosing a payload's way
per request, taking a read_unpack offer, READing the source's cache blocks into staging
(READ_UNPACK) or announced chunks straight into the cache blocks (PACK_PLACE), and telling the
source when its cache is no longer read (RunsDone). A mixin of
:class:`~kvtriton.agent.destination.Destination`: it uses its settings, links, offers and parts."""

from __future__ import annotations

from .. import wire
from ..errors import ProtocolError
from ..one_sided import choose_way, tile_runs
from ..plan import ChunkGeometry, Mode, StagedRead, TransferPlan
from .device import event_done
from .links import Chunk, Flow, Peer
from .source.request import ids_digest


class OneSidedReads:
    """What :class:`~kvtriton.agent.destination.Destination` does for one-sided parts."""

    def _way(self, f: Fetch, read: StagedRead, peer: Peer, chunks: ChunkGeometry, runs: bool) -> Mode:
        """How ``read``'s payload travels for fetch ``f``: STAGED in push mode, else the cost
        model's choice for this request (an offer the source made means it is packed already)."""
        if self.s.flow is not Flow.PULL or f.tokens is not None:
            return Mode.STAGED
        offer = self.offers.get(peer.key, {}).get(f.req_id)
        packed = offer is not None and bool(offer.slots)  # an offer without slots: read_unpack, nothing packed
        return choose_way(read, peer.md.regions, self.s.specs, f.src_ids, f.dst_ids, self.s.cost,
                          chunks=chunks.count, packed=packed)

    def _runs_offer_for(self, peer: Peer, req: str, plan: TransferPlan, ids) -> wire.Offer | None:
        """``peer``'s read_unpack offer of ``req`` (no slots: READ my cache) when it is for this
        part's plan and ids, else None; any other offer is declined (the source frees it)."""
        offer = self.offers.get(peer.key, {}).pop(req, None)
        if offer is None:
            return None
        if (offer.slots or offer.xid in self.parts or offer.plan != plan.digest()
                or offer.num_blocks != ids.size or offer.ids != ids_digest(ids)):
            self.links.send(peer, wire.Abort(offer.xid), quiet=True)
            return None
        return offer

    def _place_announced(self, part: Part, peer: Peer) -> None:
        """PACK_PLACE: READ each announced chunk's tiles straight into our cache blocks, one
        descriptor per (segment, run of consecutive destination ids), once the engine is done
        with the blocks' previous contents (the NIC writes them without a stream)."""
        f = part.fetch
        while part.readies and event_done(f.ready):
            ready = part.readies.popleft()
            lo, hi = part.chunks.bounds(ready.chunk)
            runs = tile_runs(part.read, self.s.specs, f.dst_ids[lo:hi])
            if (runs.staging_offset + runs.nbytes > ready.nbytes).any():  # the plan's own sizes: a bug, not a peer
                raise ProtocolError(f"pack_place: chunk {ready.chunk} tiles exceed its {ready.nbytes} bytes")
            local = self.links.cache_addrs(self.links.addrs, self.links.spans, runs.region, runs.stream,
                                           runs.cache_offset, runs.nbytes, "this rank")
            st = peer.md.staging
            remote = st.addr + ready.slot * st.slot_bytes + runs.staging_offset
            ch = Chunk(ready.chunk, -1, 0, ready.nbytes, remote_slot=ready.slot)
            ch.lists = self.links.prep_pieces(peer, local, remote, runs.nbytes)
            part.inflight[ch.index] = ch
            ch.xfer = self.links.post_runs("READ", *ch.lists, len(runs), stat="one_sided_descriptors")
            f.descriptors += len(runs)
            f.nbytes += ready.nbytes

    def _read_source(self, part: Part, peer: Peer) -> None:
        """READ_UNPACK, after the source's RunsReady: READ the next chunks' tiles straight out of
        the source's cache blocks into our staging, where the packed payload would have put
        them, one descriptor per (segment, run of consecutive source ids)."""
        if part.way is not Mode.READ_UNPACK or not part.go:
            return
        f, pool = part.fetch, self.s.pool
        while part.next_read < part.n_chunks and len(part.inflight) < self.s.inflight:
            c = part.next_read
            nbytes = part.chunks.nbytes(c)
            slot = pool.alloc_bytes(nbytes)
            if slot is None:
                f.touch()  # our own staging is full: not the source's silence
                return
            ch = Chunk(c, slot, pool.slots_for(nbytes), nbytes)
            try:
                lo, hi = part.chunks.bounds(c)
                runs = tile_runs(part.read, peer.md.regions, f.src_ids[lo:hi])
                remote = self.links.cache_addrs(peer.md.addrs, peer.md.spans, runs.region, runs.stream,
                                                runs.cache_offset, runs.nbytes, peer.agent)
                ch.lists = self.links.prep_pieces(peer, pool.addr + pool.offset(slot) + runs.staging_offset, remote,
                                                  runs.nbytes)
            except BaseException:
                pool.free(slot, ch.nslots)
                raise
            part.inflight[c] = ch
            part.next_read += 1
            ch.xfer = self.links.post_runs("READ", *ch.lists, len(runs), stat="one_sided_descriptors")
            f.descriptors += len(runs)
            f.nbytes += nbytes

    def _maybe_runs_done(self, part: Part, peer: Peer) -> None:
        """Pull: once every READ of the source's cache (DIRECT runs, READ_UNPACK chunks) has
        landed, the source may let the blocks go: RunsDone."""
        if (part.reads_cache and part.go and not part.runs_done and not part.runs_pending
                and part.runs_xfer is None and (part.way is not Mode.READ_UNPACK or part.reads_landed == part.n_chunks)):
            part.runs_done = True
            self.links.send(peer, wire.RunsDone(part.xid), quiet=True)
