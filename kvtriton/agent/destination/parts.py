"""What one source rank sends for one fetch: a part, one class per way its staged payload
travels (:mod:`kvtriton.plan.ways`), or a part of DIRECT runs only.

* :class:`StagedPart` (pull): the source packs and announces each chunk (Ready); we READ it
  into our staging, unpack it, and Ack it.
* :class:`PackPlacePart` (pull): the source packs and announces; we READ each chunk's tiles
  straight into our cache blocks (no unpack), and Ack it.
* :class:`ReadUnpackPart` (pull): after the source's RunsReady we READ its cache blocks into
  our staging and unpack (no pack, no Ready, no Ack).
* :class:`GrantedPart` (push): we grant a slot per chunk, the source WRITEs it (Data), we unpack.
* :class:`DirectPart`: zero copy only: DIRECT runs, and (pull) the payload's head slices when
  it travels DIRECT_SLICE, READ from the source's cache blocks straight into ours (no pass, no
  staging, no Ready, no Ack).

The zero-copy rows of a part (any class; :meth:`~kvtriton.plan.PairPlan.rows`: DIRECT runs, and
head slices) are its :class:`RunsTransfer`: one transfer per source rank. In pull, a part that
reads the source's cache (zero-copy rows or READ_UNPACK) holds a :class:`CacheLease`: it waits for
the source's RunsReady and ends with one RunsDone once every such READ has landed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import ProtocolError
from ...ops import unpack
from ...plan import BlockRows, ChunkGeometry, RequestPayload, Way, ceil_div, tile_runs
from ...protocol import wire
from ...transport import Xfer
from ..device import event_done
from ..integrity import verify
from ..links import Chunk, Links, Peer, RowsPost, Settings
from ..stats import DIRECT_WAY
from .fetch import Fetch


@dataclass(eq=False)
class RunsTransfer:
    """A part's zero-copy rows (its pair's :meth:`~kvtriton.plan.PairPlan.rows`: DIRECT runs, and
    the payload's head slices when it travels DIRECT_SLICE): pending until they landed (pull:
    our one READ; push: the source's WRITE, told by its RunsReady)."""

    rows: BlockRows
    direct: bool = True  # the rows include DIRECT runs (else the payload's head slices only)
    pending: bool = True
    xfer: Xfer | None = None  # pull: the READ of the rows
    post: RowsPost | None = None

    def read(self, links: Links, f: Fetch, peer: Peer) -> None:
        """Pull: READ this source rank's rows of ``f``, in one transfer."""
        post = links.prep_rows(peer, self.rows, f.src_ids, f.dst_ids, reading=True,
                               group_bounds=f.request.group_bounds, checked=f.checked)
        if post is None:
            self.pending = False
            return
        self.post = post
        t0 = time.perf_counter()  # what Fetch.posting times, without a context manager per READ
        self.xfer = links.post_rows("READ", post)
        f.post_s += time.perf_counter() - t0
        f.posted(post.count, post.nbytes)

    def poll(self, links: Links) -> None:
        if self.xfer is not None and self.post is not None and links.done(self.xfer):
            links.finished(self.xfer, links.release_post(self.post))
            self.xfer, self.pending = None, False

    def release(self, links: Links) -> None:
        if self.post is not None:
            if self.xfer is not None:
                links.retire(self.xfer, links.release_post(self.post))
            else:
                links.release_post(self.post)()
        self.post = None

    @property
    def landed(self) -> bool:
        return not self.pending and self.xfer is None


@dataclass(eq=False)
class CacheLease:
    """Pull: this part reads the source's cache blocks, which the source holds from its
    RunsReady (``go``) until our RunsDone (``done``)."""

    go: bool = False
    done: bool = False
    unsent: bool = False  # done, its RunsDone not sent yet (it may ride on the fetch's Done: see Destination.advance)


class Part:
    """The common state of a part: its transfer id, fetch, source rank, chunks in flight and
    consumed, DIRECT runs and lease of the source's cache; subclasses move the payload."""

    way = Way.STAGED  # what a pull names (a part without a payload, or a push, says staged)

    def __init__(self, s: Settings, links: Links, xid: str, fetch: Fetch, src_rank: int,
                 payload: RequestPayload | None, runs: RunsTransfer | None, lease: CacheLease | None):
        self.s, self.links = s, links
        self.xid, self.fetch, self.src_rank = xid, fetch, src_rank
        self.payload = payload
        self.runs = runs
        self.lease = lease
        self.offered = False  # the source offered this payload ahead: READ at once, no pull sent
        self.inflight: dict[int, Chunk] = {}  # chunk -> Chunk (READ or unpack in flight / granted)
        self.consumed: set[int] = set()  # chunks unpacked into (or placed in) the cache
        self.chunks_done = 0

    # ------------------------------------------------------------------ state
    @property
    def chunks(self) -> ChunkGeometry | None:
        return self.payload.chunks if self.payload is not None else None

    @property
    def n_chunks(self) -> int:
        return self.payload.chunks.count if self.payload is not None else 0

    @property
    def ways(self) -> tuple[str, ...]:
        """How this part's bytes travel, as :mod:`~kvtriton.agent.stats` labels them: its
        payload's way (a push's is staged), and ``"direct"`` when it has DIRECT runs."""
        payload = (self.way.value,) if self.payload is not None else ()
        return payload + ((DIRECT_WAY,) if self.runs is not None and self.runs.direct else ())

    @property
    def runs_pending(self) -> bool:
        return self.runs is not None and self.runs.pending

    @property
    def complete(self) -> bool:
        return (self.chunks_done == self.n_chunks and not self.runs_pending
                and (self.lease is None or self.lease.done))

    def defined(self, n: int) -> np.ndarray:
        """Which of the fetch's ``n`` positions received every byte this part sends."""
        got = np.ones(n, dtype=bool)
        if self.payload is not None:
            got[:] = False
            for c in self.consumed:
                lo, hi = self.payload.chunks.bounds(c)
                got[lo:hi] = True
        if self._reading_cache():
            got[:] = False  # the source's cache was being read: it may have let the blocks go meanwhile
        return got

    def _reading_cache(self) -> bool:
        return self.runs is not None and (self.runs.pending or self.runs.xfer is not None)

    # ------------------------------------------------------------------ messages
    def take_offer(self, offer: wire.Offer) -> None:
        """The source offered this part ahead (checked by :class:`~.offers.Offers`): no pull is
        sent; an offer with ``runs`` also confirmed our DIRECT runs (as RunsReady would)."""
        self.offered = True
        if self.lease is not None:
            self.lease.go = bool(offer.runs)
        self.links.stats.offers_taken += 1

    def on_ready(self, peer: Peer, m: wire.Ready) -> None:
        raise ProtocolError(f"ready for chunk {m.chunk} of {m.xid!r} is outside the transfer's "
                            f"{self.n_chunks} chunks")

    def on_data(self, peer: Peer, m: wire.Data) -> None:
        raise ProtocolError(f"data for chunk {m.chunk} that was not granted")

    def go_ahead(self, peer: Peer) -> None:
        """Pull: the source's RunsReady: it holds the blocks while we read them."""
        if self.lease is None or self.lease.go:
            raise ProtocolError(f"unexpected RunsReady for {self.xid!r}: nothing of the source's cache to read")
        self.lease.go = True
        self.fetch.touch()
        self.start_reads(peer)
        self.maybe_runs_done(peer)

    def runs_written(self) -> None:
        """Push: the source's RunsReady: it has written our cache with the DIRECT runs."""
        if self.runs is None or not self.runs.pending:
            raise ProtocolError(f"unexpected RunsReady for {self.xid!r}: no DIRECT runs pending")
        self.runs.pending = False

    # ------------------------------------------------------------------ progress
    def read_runs(self, peer: Peer) -> None:
        """Pull, once the source confirmed it holds the blocks: READ the DIRECT runs."""
        if self.runs is not None and self.runs.pending and self.runs.xfer is None:
            self.runs.read(self.links, self.fetch, peer)

    def start_reads(self, peer: Peer) -> None:
        """Pull, at the source's RunsReady: READ what comes from its cache."""
        self.read_runs(peer)

    def start_offered(self, peer: Peer) -> None:
        """An offered part, in its fetch: READ at once what the offer lets us (the DIRECT runs
        it confirmed, the chunks it announced, the cache blocks it holds for us), so a step's
        fetches post all their READs back to back: left to the next ``progress()``, a READ
        would follow the Done of a fetch finished there, and a READ posted after a message to
        its source waits for that source's progress (:mod:`kvtriton.transport.fence`)."""
        if self.lease is not None and self.lease.go:
            self.read_runs(peer)
        self._post(peer)

    def advance(self, peer: Peer) -> None:
        """Use what landed, post what can go, poll the DIRECT runs, release the source's cache
        (its RunsDone left for the caller: :meth:`send_runs_done`, or riding on the Done)."""
        self._use_finished(peer)
        self._post(peer)
        if self.runs is not None:
            self.runs.poll(self.links)
        self.maybe_runs_done(peer, defer=True)

    def _use_finished(self, peer: Peer) -> None:
        """A chunk whose transfer landed is used; a chunk whose unpack finished is consumed."""
        for ch in list(self.inflight.values()):
            if ch.xfer is not None:
                if not self.links.done(ch.xfer):
                    continue
                self.links.transport.release(ch.xfer)
                ch.xfer = None
                if ch.lists:
                    self.links.release_lists(*ch.lists)()
                    ch.lists = ()
                self.fetch.touch()
                self._landed(ch, peer)
                if ch.kernel is None:
                    continue
            if ch.kernel is not None and ch.kernel.done():
                self._consumed(ch, peer)

    def _landed(self, ch: Chunk, peer: Peer) -> None:
        """A chunk's transfer landed (only a part with a payload posts chunks)."""

    def _post(self, peer: Peer) -> None:
        """Post what this part's way posts next (nothing for DIRECT runs alone)."""

    def _cache_reads_landed(self) -> bool:
        return True

    def maybe_runs_done(self, peer: Peer, defer: bool = False) -> None:
        """Pull: once every READ of the source's cache has landed, it may let the blocks go
        (``defer``: told by the caller, :meth:`send_runs_done`, in the same call)."""
        lease = self.lease
        if lease is not None and lease.go and not lease.done and (self.runs is None or self.runs.landed) \
                and self._cache_reads_landed():
            lease.done = lease.unsent = True
            if not defer:
                self.send_runs_done(peer)

    def send_runs_done(self, peer: Peer) -> None:
        """Send the RunsDone :meth:`maybe_runs_done` left unsent, if any."""
        if self.lease is not None and self.lease.unsent:
            self.lease.unsent = False
            self.links.send(peer, wire.RunsDone(self.xid), quiet=True)

    def runs_done_riding(self) -> str:
        """The transfer id whose unsent RunsDone rides on the fetch's Done (now sent), or ``""``."""
        if self.lease is None or not self.lease.unsent:
            return ""
        self.lease.unsent = False
        return self.xid

    def _consumed(self, ch: Chunk, peer: Peer) -> None:
        self.fetch.touch()
        self.inflight.pop(ch.index, None)
        if ch.nslots:  # a pack-then-place chunk has no local slot
            self.s.pool.free(ch.slot, ch.nslots)
        self.chunks_done += 1
        self.consumed.add(ch.index)
        self._ack(ch, peer)

    def _ack(self, ch: Chunk, peer: Peer) -> None:
        """Tell the source a chunk it holds may go (only a packed payload's chunks are held)."""

    # ------------------------------------------------------------------ failure
    def release(self) -> None:
        """The fetch failed: reclaim our staging and release the prepared lists."""
        self.links.retire_chunks(self.inflight, self._reuse_after())
        if self.runs is not None:
            self.runs.release(self.links)

    def _reuse_after(self) -> float:
        return time.monotonic()


class DirectPart(Part):
    """A source rank whose part is zero copy only, one READ (pull) of its rows: DIRECT runs
    (no staged payload), and the payload's head slices when it travels DIRECT_SLICE (chosen for
    this request): once the source confirmed it holds the blocks (RunsReady, or a slot-less
    offer) and the engine is done with our blocks' previous contents, every row READ from the
    source's cache blocks straight into ours (over lists prepared once per peer); nothing is
    packed, staged or unpacked. The payload, when there is one, only says what the pull names
    (its way and blocks per chunk). RunsDone once the READ landed."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        if self.payload is not None:  # its head slices: read from the source's cache
            self.way = Way.DIRECT_SLICE
            if self.lease is None:
                self.lease = CacheLease()

    @property
    def n_chunks(self) -> int:
        return 0  # nothing chunked: every position lands with the one READ

    def defined(self, n: int) -> np.ndarray:
        return np.full(n, not self._reading_cache(), dtype=bool)

    def _reading_cache(self) -> bool:
        return super()._reading_cache() or (self.payload is not None and self.lease is not None
                                            and not self.lease.done)

    def take_offer(self, offer: wire.Offer) -> None:
        """Pull: the source offered its cache blocks (no slots, sent once the engine's writes
        were done): it holds them for us until our RunsDone, as after a RunsReady. READ now."""
        super().take_offer(offer)
        if self.lease is not None and not offer.slots:
            self.lease.go = True

    def on_ready(self, peer: Peer, m: wire.Ready) -> None:
        if self.payload is None:
            super().on_ready(peer, m)
        raise ProtocolError(f"ready for {m.xid!r}, which reads the source's cache ({self.way.value}): "
                            "nothing is packed")

    def read_runs(self, peer: Peer) -> None:
        # head slices land in our blocks without a stream: only once the engine is done with them
        if self.payload is None or event_done(self.fetch.ready):
            super().read_runs(peer)

    def _post(self, peer: Peer) -> None:
        if self.lease is not None and self.lease.go:
            self.read_runs(peer)


class PayloadPart(Part):
    """A part with a staged payload (the ways below differ in how its chunks travel)."""

    payload: RequestPayload

    def _landed(self, ch: Chunk, peer: Peer) -> None:
        """A chunk's READ landed in our staging: unpack it."""
        self._unpack(ch)

    def _unpack(self, ch: Chunk) -> None:
        s, f, p = self.s, self.fetch, self.payload
        lo, hi = p.chunks.bounds(ch.index)
        offs = p.segment_offsets(ch.index, base=s.pool.offset(ch.slot))
        tokens = f.tokens
        with s.lanes.launching(after=f.ready):
            if tokens is None:
                unpack(s.regions, p.read.segments, offs, f.dst_ids[lo:hi], s.pool.tensor, impl=s.impl,
                       groups=p.launch_groups(ch.index))
            else:
                if tokens.dst_ids is None:  # the destination's token map has them (TokenMap.for_source has not)
                    raise ProtocolError(f"fetch {f.req_id!r}: a token map without destination ids")
                unpack(s.regions, p.read.segments, offs, tokens.dst_ids, s.pool.tensor, impl=s.impl,
                       tiles=tokens.tiles[lo:hi], num_tokens=tokens.num_tokens)
        ch.kernel = s.lanes.completion()  # the fetch is reported only once it is done



class AnnouncedPart(PayloadPart):
    """Pull, a packed payload (staged or pack_place): the source's Ready of each chunk (or its
    offer announcing them all) is kept until a local slot (or the cache blocks) can take its
    READ; each chunk is acked once used, so the source may reuse its slots."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.readies: deque[wire.Ready] = deque()
        self.announced: set[int] = set()

    def on_ready(self, peer: Peer, m: wire.Ready) -> None:
        st = peer.md.staging
        if m.chunk in self.announced:
            raise ProtocolError(f"ready for chunk {m.chunk} of {m.xid!r} is unexpected (duplicate or push mode)")
        if not 0 <= m.chunk < self.n_chunks:
            raise ProtocolError(f"ready for chunk {m.chunk} of {m.xid!r} is outside the transfer's "
                                f"{self.n_chunks} chunks")
        expect = self.payload.chunks.nbytes(m.chunk)
        if m.nbytes != expect or not (0 <= m.slot and m.slot + m.nslots <= st.num_slots) or \
                m.nslots != ceil_div(m.nbytes, st.slot_bytes):
            raise ProtocolError(f"ready {m.chunk}: {m.nbytes} bytes in slots [{m.slot}, {m.slot + m.nslots}) does "
                                f"not match the plan ({expect} bytes) or the peer's {st.num_slots} slots")
        self.announced.add(m.chunk)
        self.readies.append(m)
        self.fetch.touch()

    def take_offer(self, offer: wire.Offer) -> None:
        """The source's offer announced every chunk at once (slot runs checked by the offers):
        the payload is in its staging already, READ it now."""
        super().take_offer(offer)
        chunks = self.payload.chunks
        n = wire.DIGEST_BYTES
        for c in range(chunks.count):
            self.readies.append(wire.Ready(self.xid, c, offer.slots[2 * c], offer.slots[2 * c + 1], chunks.nbytes(c),
                                           offer.digests[c * n:(c + 1) * n]))
            self.announced.add(c)

    def _ack(self, ch: Chunk, peer: Peer) -> None:
        self.links.send(peer, wire.Ack(self.xid, ch.index), quiet=True)

    def release(self) -> None:
        super().release()
        self.readies.clear()


class StagedPart(AnnouncedPart):
    """Pull, STAGED: READ each announced chunk into our staging, unpack, Ack."""

    way = Way.STAGED

    def _post(self, peer: Peer) -> None:
        readies, f = self.readies, self.fetch
        while readies:
            ready = readies[0]
            slot = self.s.pool.alloc(ready.nslots)
            if slot is None:
                f.touch()  # our own staging is full: not the source's silence
                return
            readies.popleft()
            ch = Chunk(ready.chunk, slot, ready.nslots, ready.nbytes, remote_slot=ready.slot, digest=ready.digest)
            self.inflight[ch.index] = ch
            with f.posting(1, ready.nbytes):
                ch.xfer = self.links.post_chunk("READ", ch, peer)

    def _landed(self, ch: Chunk, peer: Peer) -> None:
        verify(self.s, self.links.stats, ch, f"{self.fetch.req_id!r} from {peer.md.engine}:{peer.md.rank}")
        self._unpack(ch)



class PackPlacePart(AnnouncedPart):
    """Pull, PACK_PLACE: READ each announced chunk's tiles straight into our cache blocks, one
    descriptor per (segment, run of consecutive destination ids), then Ack; nothing to unpack."""

    way = Way.PACK_PLACE

    def _post(self, peer: Peer) -> None:
        # only once the engine is done with the blocks' previous contents (the NIC writes them
        # without a stream)
        f, readies, links = self.fetch, self.readies, self.links
        while readies and event_done(f.ready):
            ready = readies.popleft()
            lo, hi = self.payload.chunks.bounds(ready.chunk)
            runs = tile_runs(self.payload.read, self.s.specs, f.dst_ids[lo:hi])
            if (runs.staging_offset + runs.nbytes > ready.nbytes).any():  # the plan's own sizes: a bug, not a peer
                raise ProtocolError(f"pack_place: chunk {ready.chunk} tiles exceed its {ready.nbytes} bytes")
            local = links.tables.addresses(runs.region, runs.stream, runs.cache_offset, runs.nbytes,
                                           "this rank")
            st = peer.md.staging
            remote = st.addr + ready.slot * st.slot_bytes + runs.staging_offset
            ch = Chunk(ready.chunk, -1, 0, ready.nbytes, remote_slot=ready.slot)
            ll, rl = ch.lists = links.prep_pieces(peer, local, remote, runs.nbytes)
            self.inflight[ch.index] = ch
            with f.posting(len(runs), ready.nbytes):
                ch.xfer = links.post_pieces("READ", ll, rl, len(runs))

    def _landed(self, ch: Chunk, peer: Peer) -> None:
        self._consumed(ch, peer)  # the READ placed the tiles in our cache: nothing to unpack



class ReadUnpackPart(PayloadPart):
    """Pull, READ_UNPACK: after the source's RunsReady (or its slot-less offer), READ the next
    chunks' tiles straight out of its cache blocks into our staging, where the packed payload
    would have put them (one descriptor per segment and run of consecutive source ids), and
    unpack; RunsDone once every READ landed. The source packs nothing and holds the blocks from
    its RunsReady (or slot-less offer) until our RunsDone, so the part always holds a
    :class:`CacheLease` and refuses any Ready."""

    way = Way.READ_UNPACK
    lease: CacheLease

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        if self.lease is None:  # whether or not it has DIRECT runs: it reads the source's cache
            self.lease = CacheLease()
        self.next_read = 0  # the next chunk to READ from the source's cache
        self.reads_landed = 0  # chunks whose READ has landed

    def take_offer(self, offer: wire.Offer) -> None:
        super().take_offer(offer)
        self.lease.go = True  # a slot-less offer: the source holds the blocks for us, read now

    def on_ready(self, peer: Peer, m: wire.Ready) -> None:
        raise ProtocolError(f"ready for {m.xid!r}, which reads the source's cache ({self.way.value}): "
                            "nothing is packed")

    def start_reads(self, peer: Peer) -> None:
        super().start_reads(peer)
        self._post(peer)

    def _reading_cache(self) -> bool:
        return super()._reading_cache() or not self.lease.done

    def _post(self, peer: Peer) -> None:
        if not self.lease.go:
            return
        f, pool, chunks = self.fetch, self.s.pool, self.payload.chunks
        while self.next_read < chunks.count and len(self.inflight) < self.s.inflight:
            c = self.next_read
            nbytes = chunks.nbytes(c)
            slot = pool.alloc_bytes(nbytes)
            if slot is None:
                f.touch()  # our own staging is full: not the source's silence
                return
            ch = Chunk(c, slot, pool.slots_for(nbytes), nbytes)
            try:
                lo, hi = chunks.bounds(c)
                runs = tile_runs(self.payload.read, peer.md.regions, f.src_ids[lo:hi])
                remote = peer.tables.addresses(runs.region, runs.stream, runs.cache_offset,
                                               runs.nbytes, peer.agent)
                ll, rl = ch.lists = self.links.prep_pieces(
                    peer, pool.addr + pool.offset(slot) + runs.staging_offset, remote, runs.nbytes)
            except BaseException:
                pool.free(slot, ch.nslots)
                raise
            self.inflight[c] = ch
            self.next_read += 1
            with f.posting(len(runs), nbytes):
                ch.xfer = self.links.post_pieces("READ", ll, rl, len(runs))

    def _landed(self, ch: Chunk, peer: Peer) -> None:
        self.reads_landed += 1
        self._unpack(ch)

    def _cache_reads_landed(self) -> bool:
        return self.reads_landed == self.n_chunks


class GrantedPart(PayloadPart):
    """Push: grant a local slot per chunk (up to the in-flight bound); the source WRITEs the
    chunk into it and says Data; unpack."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.next_grant = 0

    def on_data(self, peer: Peer, m: wire.Data) -> None:
        ch = self.inflight.get(m.chunk)
        if ch is None or ch.xfer is not None or ch.kernel is not None:
            raise ProtocolError(f"data for chunk {m.chunk} that was not granted")
        if m.nbytes != ch.nbytes:
            raise ProtocolError(f"data for chunk {m.chunk}: {m.nbytes} bytes, expected {ch.nbytes}")
        ch.digest = m.digest
        verify(self.s, self.links.stats, ch, f"{self.fetch.req_id!r} from {peer.md.engine}:{peer.md.rank}")
        self._unpack(ch)

    def _post(self, peer: Peer) -> None:
        chunks, pool = self.payload.chunks, self.s.pool
        while self.next_grant < chunks.count and len(self.inflight) < self.s.inflight:
            nbytes = chunks.nbytes(self.next_grant)
            slot = pool.alloc_bytes(nbytes)
            if slot is None:
                return
            ch = Chunk(self.next_grant, slot, pool.slots_for(nbytes), nbytes)
            self.inflight[ch.index] = ch
            self.next_grant += 1
            self.links.send(peer, wire.Grant(self.xid, ch.index, slot, ch.nslots))
            self.fetch.posted(1, nbytes)

    def _reuse_after(self) -> float:
        # a granted slot may still receive the peer's WRITE: keep it out of use for a while
        return time.monotonic() + self.s.timeout_s
