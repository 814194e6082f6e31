"""StagingPool: one registered slab carved into equal slots.

The slab is registered with NIXL once and prepared as a dense descriptor list with one entry per
slot, on this side and on every peer. A chunk occupies a run of consecutive slots, so posting it
is a run of consecutive indices that ``make_prepped_xfer`` merges into a single descriptor.
Allocation is first-fit over runs; a full pool returns ``None`` and the caller queues the work
(nothing fails because staging is busy).
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import StagingError
from .plan import ceil_div

__all__ = ["StagingPool"]


class StagingPool:
    """``num_slots`` slots of ``slot_bytes`` bytes in one uint8 tensor on ``device``.

    Example
    -------
    >>> pool = StagingPool(num_slots=8, slot_bytes=4096)
    >>> a = pool.alloc_bytes(10_000)     # 3 slots
    >>> pool.view(a, 10_000).numel(), pool.free_slots
    (10000, 5)
    >>> pool.free(a, 3); pool.free_slots
    8
    """

    def __init__(self, num_slots: int, slot_bytes: int, device: str | torch.device = "cpu"):
        if num_slots < 1 or slot_bytes < 1:
            raise StagingError(f"staging needs >= 1 slot of >= 1 byte, got {num_slots} x {slot_bytes}")
        # 256-byte aligned slots keep every chunk start aligned for 16-byte vector accesses.
        if slot_bytes % 256:
            raise StagingError(f"slot_bytes must be a multiple of 256, got {slot_bytes}")
        self.num_slots = int(num_slots)
        self.slot_bytes = int(slot_bytes)
        self.tensor = torch.empty(self.num_slots * self.slot_bytes, dtype=torch.uint8, device=device)
        self._used = np.zeros(self.num_slots, dtype=bool)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def addr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def free_slots(self) -> int:
        return int(self.num_slots - self._used.sum())

    def slots_for(self, nbytes: int) -> int:
        return max(1, ceil_div(nbytes, self.slot_bytes))

    def alloc(self, nslots: int) -> int | None:
        """First slot of a free run of ``nslots`` consecutive slots, or ``None`` when none is free."""
        if not 1 <= nslots <= self.num_slots:
            raise StagingError(f"cannot allocate {nslots} slots from a pool of {self.num_slots}")
        free = ~self._used
        if nslots == 1:
            idx = np.flatnonzero(free)
            start = int(idx[0]) if idx.size else None
        else:
            # windows of nslots consecutive free slots: cumulative sums of the free mask
            c = np.concatenate([[0], np.cumsum(free)])
            ok = np.flatnonzero(c[nslots:] - c[:-nslots] == nslots)
            start = int(ok[0]) if ok.size else None
        if start is not None:
            self._used[start:start + nslots] = True
        return start

    def alloc_bytes(self, nbytes: int) -> int | None:
        return self.alloc(self.slots_for(nbytes))

    def free(self, slot: int, nslots: int) -> None:
        if not (0 <= slot and slot + nslots <= self.num_slots) or not self._used[slot:slot + nslots].all():
            raise StagingError(f"freeing slots [{slot}, {slot + nslots}) that are not all allocated")
        self._used[slot:slot + nslots] = False

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        off = self.offset(slot)
        return self.tensor[off:off + nbytes]
