"""This rank's memory as NIXL knows it: the registration of its cache (unless only staging is
registered), its staging pool and the fence buffer, and the handshake metadata that describes
them to peers. Made at construction; dropped and made again around an engine's sleep
(:meth:`~kvtriton.agent.TransferAgent.unregister` / ``restore``), each time with metadata of a
newer generation."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..protocol import wire
from ..transport.fence import FENCE_BYTES
from ..transport.nixl import NixlTransport
from .addresses import slot_descs
from .links import Links
from .settings import Settings

__all__ = ["Registration"]


class Registration:
    """What one rank registered with NIXL, and the metadata peers meet it by."""

    def __init__(self, settings: Settings, links: Links, transport: NixlTransport):
        self.s, self.links, self.transport = settings, links, transport
        self.handle: Any = None  # the transport's registration; None while unregistered
        self.metadata = b""  # msgpack RankMetadata, built once per registration (see TransferAgent.metadata)
        self._fence: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.handle is not None

    def register(self) -> None:
        """Register cache, staging pool and fence, prepare the staging slots, build the metadata
        (NIXL's agent is asked for its metadata here, never from a handshake thread)."""
        links, pool = self.links, self.s.pool
        storages = {}
        for t in (t for r in self.s.regions for t in r.streams) if self.s.cache_registered else ():
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        descs = [(addr, n, links.dev) for addr, n in sorted(storages.items())]
        descs.append((pool.addr, pool.nbytes, links.dev))
        # what fences READ into (transport.fences): nothing of ours a peer's bytes may land in otherwise
        self._fence = torch.empty(FENCE_BYTES, dtype=torch.uint8, device=self.s.device)
        descs.append((self._fence.data_ptr(), FENCE_BYTES, links.dev))
        self.handle = self.transport.register(descs, links.mem)
        links.local_staging = self.transport.prep_local(
            slot_descs(pool.addr, pool.num_slots, pool.slot_bytes, links.dev), links.mem)
        self.transport.fences.arm(self._fence.data_ptr(), links.dev, links.mem)
        self.metadata = wire.encode_metadata(wire.RankMetadata(
            engine=self.s.engine_id, rank=self.s.rank, tp=self.s.tp, agent=self.transport.name,
            agent_md=self.transport.metadata(), mem=links.mem, dev=links.dev,
            regions=tuple(self.s.specs), addrs=links.exposed(links.addrs), spans=links.exposed(links.spans),
            staging=wire.StagingInfo(pool.addr, pool.slot_bytes, pool.num_slots, self.s.chunk_bytes),
            planning=self.s.planning(),
            cost=self.s.cost,
            generation=time.time_ns(),  # made once per registration: a restart or a restore registers a newer one
        ))

    def deregister(self) -> None:
        """Release the prepared staging and fence lists and the registration (the caller made
        sure nothing can touch the memory any more)."""
        for pl in (self.links.local_staging, self.transport.fences.disarm()):
            if pl is not None:
                self.transport.release_list(pl)
        self.links.local_staging = None
        self.transport.deregister(self.handle)
        self.handle = None
