"""Where things are in a rank's memory: its cache's declared addresses and spans per (region,
stream), flattened once for numpy gathers, and the descriptors of a staging pool's slots."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ProtocolError

__all__ = ["CacheTables", "StreamTable", "slot_descs"]


class StreamTable:
    """A per (region, stream) table of metadata (addresses or spans) flattened once, so a
    request looks up one entry per descriptor with one numpy gather."""

    def __init__(self, table: tuple[tuple[int, ...], ...]):
        self.flat = np.array([v for row in table for v in row], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum([len(row) for row in table])[:-1]]).astype(np.int64)

    def at(self, region: np.ndarray, stream: np.ndarray) -> np.ndarray:
        return self.flat[self.starts[region] + stream]


@dataclass(frozen=True)
class CacheTables:
    """One rank's cache as the metadata declares it: per (region, stream), the address of element
    0 (``addrs``) and the bytes from there that may be touched (``spans``)."""

    addrs: StreamTable
    spans: StreamTable

    @classmethod
    def of(cls, addrs: tuple[tuple[int, ...], ...], spans: tuple[tuple[int, ...], ...]) -> CacheTables:
        return cls(StreamTable(addrs), StreamTable(spans))

    def addresses(self, region: np.ndarray, stream: np.ndarray, offset: np.ndarray, nbytes: np.ndarray,
                  whose: str) -> np.ndarray:
        """Addresses of byte ranges ``[offset, offset + nbytes)`` of (region, stream) tensors;
        :class:`ProtocolError` when one falls outside its declared span (``whose`` names the
        rank that declared them: a peer's metadata is untrusted)."""
        if (offset < 0).any() or (offset + nbytes > self.spans.at(region, stream)).any():
            raise ProtocolError(f"one-sided pieces fall outside the regions {whose} declared")
        return self.addrs.at(region, stream) + offset


def slot_descs(addr: int, num_slots: int, slot_bytes: int, dev: int) -> np.ndarray:
    """One ``(addr, len, dev)`` descriptor per staging slot."""
    d = np.empty((num_slots, 3), dtype=np.int64)
    d[:, 0] = addr + np.arange(num_slots, dtype=np.int64) * slot_bytes
    d[:, 1] = slot_bytes
    d[:, 2] = dev
    return d
