"""The agent's progress on SGLang's scheduler thread (no SGLang import).

SGLang's scheduler polls every sender and receiver of a step (``poll()``) back to back in Python.
Meanwhile a background thread gets the interpreter only every ``sys.getswitchinterval()`` (5 ms),
once per protocol hop, so the agent's own progress thread alone would cost a transfer one such
wait per hop. :meth:`InlineProgress.step` runs from those polls: at most once per ``interval_s``
per manager (a step polls every room), it progresses the agent without blocking
(``progress(wait=False)`` returns at once when the background thread is in it, which will have
done the same) and hands the agent's results and freed holds to the role. The background threads
stay: they serve while the scheduler is idle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["InlineProgress"]


class InlineProgress:
    """``agent``: the rank's :class:`~kvtriton.agent.TransferAgent`; ``on_result`` / ``on_freed``:
    the role's handlers for ``agent.results()`` / ``agent.freed()`` (either may be None)."""

    def __init__(self, agent, *, on_result: Callable | None = None, on_freed: Callable | None = None,
                 interval_s: float = 0.0005, clock=time.monotonic):
        self.agent, self.on_result, self.on_freed = agent, on_result, on_freed
        self.interval_s, self._clock = interval_s, clock
        self._last = float("-inf")
        self._drain = threading.Lock()  # one drainer at a time: the scheduler's poll or the event loop
        self.steps = 0  # inline progress calls made (tests, stats)

    def step(self) -> None:
        """From the scheduler's poll: progress (rate-limited, non-blocking), then drain."""
        now = self._clock()
        if now - self._last < self.interval_s:
            return
        self._last = now
        self.steps += 1
        self.agent.progress(wait=False)
        self.drain(wait=False)

    def drain(self, wait: bool = True) -> None:
        """Hand what the agent finished to the role (the event loop calls it too)."""
        if not self._drain.acquire(blocking=wait):
            return
        try:
            if self.on_freed is not None:
                for f in self.agent.freed():
                    self.on_freed(f.req_id, f.reason)
            if self.on_result is not None:
                for r in self.agent.results():
                    self.on_result(r)
        finally:
            self._drain.release()
