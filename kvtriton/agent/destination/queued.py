"""Requests a decode engine has queued but not fetched yet: their holds are renewed meanwhile.

A decode request can wait in its engine's queue longer than the prefill's lease (an engine
starting up on a loaded host took 89 s for its first load; the holds of the next requests
expired at 30 s). :meth:`TransferAgent.queued <kvtriton.agent.TransferAgent.queued>` names such a
request and its source engine; until its :meth:`~kvtriton.agent.TransferAgent.fetch` starts
(whose own renewals take over), its :meth:`~kvtriton.agent.TransferAgent.abort`, or ``max_wait_s``
passes, every connected rank of that engine is sent a ``Renew`` of it every
``renew_interval_s``, or the interval the caller gives (the vLLM connector: ``lease_s / 6``, as
vLLM's NixlConnector heartbeats its queued requests). Bounded: at
most :data:`MAX_QUEUED` requests (the oldest is dropped for a new one), one ``Renew`` per rank
and request per interval. A source honours a
renewal only from the hold's consumer engine, or, while the hold is unbound, from a rank it
offered the request to (:mod:`kvtriton.agent.source.holds`): a hold that must outlive a long
queue names its ``consumer`` (then it is packed ahead too).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from ...protocol import wire
from ..links import Links

__all__ = ["MAX_QUEUED", "Queued"]

#: requests one rank renews while they wait in its engine's queue
MAX_QUEUED = 4096


@dataclass
class _Waiting:
    engine: str
    until: float  # renewed no longer than this
    every: float  # seconds between its renewals
    renew_at: float = 0.0


class Queued:
    """The queued requests of one decode rank (see the module docstring)."""

    def __init__(self, rank: int, renew_s: float, links: Links):
        self.rank, self.renew_s, self.links = rank, float(renew_s), links
        self.by_req: OrderedDict[str, _Waiting] = OrderedDict()

    def __len__(self) -> int:
        return len(self.by_req)

    def add(self, req_id: str, engine: str, max_wait_s: float, renew_s: float | None = None) -> None:
        """Renew ``req_id``'s holds on ``engine`` from the next step on, every ``renew_s`` (None:
        the agent's ``renew_interval_s``), for at most ``max_wait_s``."""
        self.by_req.pop(req_id, None)
        every = self.renew_s if renew_s is None else max(float(renew_s), 0.0)
        self.by_req[req_id] = _Waiting(engine, time.monotonic() + max_wait_s, every)
        while len(self.by_req) > MAX_QUEUED:
            self.by_req.popitem(last=False)

    def drop(self, req_id: str) -> bool:
        """``req_id`` is fetched (its fetch renews from now on) or no longer wanted."""
        return self.by_req.pop(req_id, None) is not None

    def advance(self, now: float) -> None:
        """Send the renewals that are due; forget those past their bound."""
        for req_id, w in list(self.by_req.items()):
            if now > w.until:
                del self.by_req[req_id]
            elif now >= w.renew_at:
                w.renew_at = now + w.every
                for peer in self.links.engine_peers(w.engine):
                    self.links.send(peer, wire.Renew(req_id, self.rank), quiet=True)
