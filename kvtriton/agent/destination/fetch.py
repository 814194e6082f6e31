"""One request a destination rank reads from one source engine, and its per-request plan."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import KVTritonError, PlanError
from ...plan import RequestPlan, TokenMap

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class Fetch:
    """One request this rank reads from one source engine."""

    req_id: str
    engine: str
    started: float
    timeout_s: float  # without progress for this long the fetch fails
    deadline: float
    request: RequestPlan  # made once, at fetch()
    parts: dict[int, Any] = field(default_factory=dict)  # by source rank: its Part (.parts imports this module)
    error: KVTritonError | None = None
    descriptors: int = 0
    nbytes: int = 0
    post_s: float = 0.0  # time spent in NIXL's post calls of its transfers (host side)
    renew_at: float = 0.0  # when the holds this fetch reads are renewed next
    ready: torch.cuda.Event | None = None  # the engine is done with the local blocks (unpacks wait)
    checked: tuple[int, int] | None = None  # the (source, destination) block counts its ids were checked below

    @property
    def src_ids(self) -> np.ndarray:
        return self.request.src_ids

    @property
    def dst_ids(self) -> np.ndarray:
        ids = self.request.dst_ids
        if ids is None:  # a fetch's request is the destination's (RequestPlan.for_fetch): it has them
            raise PlanError(f"fetch {self.req_id!r}: its request has no destination ids")
        return ids

    @property
    def tokens(self) -> TokenMap | None:
        return self.request.tokens

    def touch(self) -> None:
        """Progress was made: the silence deadline starts over."""
        self.deadline = time.monotonic() + self.timeout_s

    def posted(self, descriptors: int, nbytes: int) -> None:
        self.descriptors += descriptors
        self.nbytes += nbytes

    @contextmanager
    def posting(self, descriptors: int, nbytes: int) -> Iterator[None]:
        """Time the post of ``descriptors`` descriptors moving ``nbytes`` (counted once it returned)."""
        t0 = time.perf_counter()
        yield
        self.post_s += time.perf_counter() - t0
        self.posted(descriptors, nbytes)
