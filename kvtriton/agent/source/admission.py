"""What the checks of a transfer a destination asks for give (:meth:`~kvtriton.agent.source.Source.open`):
an :class:`Admitted` transfer, or a :class:`Rejection` whose reason goes back to the peer.

The checks themselves are the :class:`~kvtriton.agent.source.Source`'s (who may take what: the
hold, the peer's entitlement, the plan both engines share); what each flow checks of its own
(a push's destination ids, say) is its class's (:meth:`~.flows.Serve.accept`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...plan import ChunkGeometry, Payload, RequestPlan, TransferPlan
from .holds import Hold

__all__ = ["Admitted", "Rejection"]


class Rejection(Exception):
    """A transfer this rank will not serve: ``reason`` is sent to the peer in a Reject;
    ``refused``: counted in ``Stats.refused`` (the peer asked what it may not have)."""

    def __init__(self, reason: str, *, refused: bool = False):
        super().__init__(reason)
        self.reason, self.refused = reason, refused


@dataclass(frozen=True, eq=False)
class Admitted:
    """A transfer that passed every check of the source: what it is served by."""

    hold: Hold
    plan: TransferPlan  # the plan this rank serves the peer by (its cost model)
    request: RequestPlan  # this side's plan of the request, made once (RequestPlan.for_serve)
    ids: np.ndarray  # the held block ids the peer asked, as it sent them
    read: Payload | None  # the staged payload this rank packs; None: none (or the peer READs our cache)
    chunks: ChunkGeometry | None  # how ``read`` is cut into staging chunks
    runs: bool  # the peer READs (pull) or we WRITE (push) rows of our cache: DIRECT runs or cache blocks
    reads_cache: bool  # the way READs our cache blocks themselves (read_unpack, direct_slice): nothing to pack
