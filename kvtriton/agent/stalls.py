"""A stall of this process is not a peer's silence.

The agent's deadlines (a fetch's silence, a serve's, a peer's, a hold's lease) are read on the
monotonic clock. When this whole process stops running, a host frozen by its hypervisor, a VM
migrated, a machine starved of CPU, that clock runs on, and at the first ``progress()`` after it
every deadline spanning the stall has passed: a healthy peer that was frozen with us (the same
host) or whose answer is waiting in our queue would be failed for silence we did not watch.

With the background progress thread (:meth:`kvtriton.agent.TransferAgent.start`), ``progress()``
runs every ``interval_s`` (half a millisecond by default). A gap longer than :data:`STALL_S`
(or 20 intervals, if longer) between two calls means this process did not run: :class:`Stalls` reports it and the agent
moves every pending deadline later by the gap before it looks at any (only time it watched
counts). Without the thread the caller decides how often to progress, so nothing is taken for a
stall. Keeps (how long a released hold's blocks stay unreused for a READ that may be in flight)
move too: later is the safe side.
"""

from __future__ import annotations

import logging
from typing import Protocol

__all__ = ["STALL_S", "Stalls"]

logger = logging.getLogger("kvtriton.agent")

#: a gap between two ``progress()`` calls this long, with the progress thread running, is a stall
STALL_S = 1.0


class Shiftable(Protocol):
    def shift(self, seconds: float) -> None: ...


class Stalls:
    """The gaps in one agent's progress (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self.stall_s: float | None = None  # set by watch() when the agent's progress thread starts
        self.last: float | None = None
        self.count = 0
        self.seconds = 0.0

    def watch(self, interval_s: float) -> None:
        """The progress thread runs every ``interval_s`` from now: a gap far past it is a stall."""
        self.stall_s = max(STALL_S, 20 * interval_s)

    def check(self, now: float, *parts: Shiftable) -> float:
        """Called on every ``progress()``: after a stall, each of ``parts`` moves its deadlines
        later by its length. Returns that length (0.0: no stall)."""
        last, self.last = self.last, now
        if self.stall_s is None or last is None or now - last <= self.stall_s:
            return 0.0
        gap = now - last
        self.count += 1
        self.seconds += gap
        logger.warning("kvtriton %s did not run for %.1f s (host frozen or starved of CPU): its deadlines move "
                       "by as much", self.name, gap)
        for part in parts:
            part.shift(gap)
        return gap
