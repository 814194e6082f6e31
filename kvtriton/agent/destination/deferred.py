"""Fetches asked for while another thread held the agent: started by the next thread to hold it.

The engine's thread asks for a step's loads while the agent's own progress thread may be inside
:meth:`~kvtriton.agent.TransferAgent.progress`, holding the agent's lock; on a loaded host that
thread can be descheduled there, and an engine waiting for the lock stalled its whole step for as
long (9-13 ms in the sweep's real-engine cells, 37 ms with two busy neighbours). With
``fetch(..., wait=False)`` such a fetch is kept here instead, in order, its id lists copied (the
caller may reuse its own), and the next ``progress()`` (any thread's) or ``fetch()`` that holds
the lock starts every kept fetch first, back to back, before any Done of that call. An engine
(or one of its ranks) not met still raises ``KeyError`` at once, so a caller meets it again for
the same request (:meth:`.core.Destination.met`, read without the lock); a kept fetch's other
errors (bad ids, a rank dropped since) come through
:meth:`~kvtriton.agent.TransferAgent.results`, with every local block undefined.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["DeferredFetch", "Deferred", "held_if_free", "local_blocks"]


@dataclass(frozen=True)
class DeferredFetch:
    """One :meth:`~kvtriton.agent.TransferAgent.fetch` as it was asked (ids copied)."""

    req_id: str
    engine: str
    remote_block_ids: Any
    local_block_ids: Any
    timeout_s: float | None
    num_tokens: int | None
    ready: Any  # the engine's event (CUDA) or None

    @classmethod
    def of(cls, req_id: str, engine: str, remote_block_ids: Any, local_block_ids: Any, timeout_s: float | None,
           num_tokens: int | None, ready: Any) -> DeferredFetch:
        return cls(req_id, engine, _copy(remote_block_ids), _copy(local_block_ids), timeout_s, num_tokens, ready)


class Deferred:
    """The deferred fetches of one rank, oldest first."""

    def __init__(self) -> None:
        self._q: deque[DeferredFetch] = deque()  # appended by any thread, taken under the agent's lock

    def __len__(self) -> int:
        return len(self._q)

    def add(self, d: DeferredFetch) -> None:
        self._q.append(d)

    def take(self) -> DeferredFetch | None:
        """The oldest, or None (asked on every progress(): no exception when empty)."""
        return self._q.popleft() if self._q else None

    def drop(self, req_id: str) -> DeferredFetch | None:
        """Remove the deferred fetch of ``req_id`` (aborted before it started), or None."""
        for d in list(self._q):
            if d.req_id == req_id:
                self._q.remove(d)
                return d
        return None


@contextmanager
def held_if_free(lock: threading.RLock) -> Iterator[bool]:
    """Hold ``lock`` for the block if no other thread holds it (yields whether it does):
    ``TransferAgent.batch(wait=False)``, whose fetches are deferred when it does not."""
    held = lock.acquire(blocking=False)
    try:
        yield held
    finally:
        if held:
            lock.release()


def local_blocks(ids: Any, num_blocks: int) -> tuple[int, ...]:
    """Every local block id of a fetch's ``local_block_ids`` (one list, or one per KV cache
    group) that names one of this rank's ``num_blocks`` blocks: what a fetch that never started
    leaves undefined (-1 skips a position; an id past the cache is no block of ours)."""
    try:
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError):  # one list per group, of different lengths
        try:
            flat = np.concatenate([np.asarray(g, dtype=np.int64).reshape(-1) for g in ids])
        except (TypeError, ValueError):
            return ()
    return tuple(int(b) for b in flat if 0 <= b < num_blocks)


def _copy(ids: Any) -> Any:
    if isinstance(ids, (np.ndarray, torch.Tensor)):
        return ids.copy() if isinstance(ids, np.ndarray) else ids.clone()
    if isinstance(ids, (list, tuple)):
        if ids and isinstance(ids[0], (list, tuple, np.ndarray)):  # one list per KV cache group
            return [_copy(g) for g in ids]
        return list(ids)
    return ids
