"""The staging a source rank lends each peer engine: its fair share, reserving chunks within
it, and quarantine (slots a peer may still read are retired, not freed, and keep counting).

Each peer engine may keep at most its fair share of the staging pool (the pool divided by the
connected engines, at least one chunk): a peer that never acks pins only its share, so the
others always progress. Packs made ahead (:mod:`.eager`) are a guess: a real pull that needs
the staging evicts them first (``evict``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..links import Chunk, Links
from ..settings import Settings

__all__ = ["StagingShare"]


class StagingShare:
    """Staging slots per peer engine, against the pool."""

    def __init__(self, settings: Settings, links: Links, evict: Callable[[str | None, str | None], bool]):
        self.s, self.links = settings, links
        self.evict = evict  # (engine or None: any, request to keep): free the oldest eager pack; False: none
        self.engine_slots: dict[str, int] = {}  # staging slots each peer engine's transfers keep

    def used(self, engine: str) -> int:
        return self.engine_slots.get(engine, 0)

    def limit(self) -> int:
        """Staging slots one peer engine may keep: the pool divided by the connected engines,
        at least one largest chunk."""
        engines = {p.md.engine for p in self.links.peers.values()}
        return max(self.s.pool.slots_for(self.s.chunk_bytes), self.s.pool.num_slots // max(1, len(engines)))

    def room_for_offers(self, engine: str) -> bool:
        """Whether ``engine`` may keep one more offered pack: offered packs always leave its lazy
        pulls ``inflight`` chunks of its share."""
        reserve = self.s.inflight * self.s.pool.slots_for(self.s.chunk_bytes)
        return self.used(engine) <= self.limit() - reserve

    def reserve(self, nbytes: int, engine: str, chunk: int, evict: bool = True,
                keep: str | None = None) -> Chunk | None:
        """Fresh local slots for chunk ``chunk`` of ``nbytes`` for ``engine``, counted to its
        share; nothing is packed into them yet (see :mod:`.packing`). None when its share or the
        pool is full. With ``evict``, eager packs of requests other than ``keep`` give way first
        (a pull is real, they are a guess)."""
        pool, need = self.s.pool, self.s.pool.slots_for(nbytes)
        while self.used(engine) + need > self.limit():
            # this engine has its share: a peer that never acks pins no more
            if not (evict and self.evict(engine, keep)):
                return None
        slot = pool.alloc_bytes(nbytes)
        while slot is None and evict and self.evict(None, keep):
            slot = pool.alloc_bytes(nbytes)
        if slot is None:
            return None
        self.engine_slots[engine] = self.used(engine) + need
        return Chunk(chunk, slot, need, nbytes)

    def free(self, engine: str, ch: Chunk) -> None:
        """``ch``'s slots are free again (nothing can read or write them any more)."""
        self.s.pool.free(ch.slot, ch.nslots)
        self.uncount(engine, ch)

    def uncount(self, engine: str, ch: Chunk) -> None:
        self.engine_slots[engine] -= ch.nslots

    def retire(self, engine: str, inflight: dict[int, Chunk], not_before: float) -> None:
        """Retire the chunks of a transfer or pack that ended early and empty ``inflight``: their
        slots return to the pool once nothing can move bytes into or out of them and
        ``not_before`` passed (quarantine); until then they still count to ``engine``'s share,
        so dropping transfers gains a peer nothing."""
        self.links.retire_chunks(inflight, not_before, on_free=lambda ch: self.uncount(engine, ch))
