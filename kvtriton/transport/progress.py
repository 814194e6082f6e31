"""NIXL's own progress thread, made to sleep on UCX's events instead of spinning.

Why a READ's source must progress at all: NIXL completes a READ with an endpoint flush, and after a
message on the endpoint (our Done, a RunsDone) the flush waits for the *source's* worker to answer
over TCP, this host's only lane for messages (UCX's shared-memory lanes lack the peer-failure
handling NIXL asks for; the bytes themselves move one-sided over ``cma``). Measured here: a READ
posted 10 ms after a notification to a source whose Python never calls into NIXL did not complete
in 1 s (10 of 10); with the source's NIXL progress thread on, it completed in 0.14-0.3 ms
(``bench/results/concurrency/concurrency.md``; ``bench/step_loads.py --steps``). A Python progress
thread in an engine process (the GIL, a core shared with the engine's workers) answers late, and
every load posted meanwhile waits for it.

NIXL's thread polls the UCX worker's event fd with ``poll()`` and a timeout of ``pthrDelay``
(rounded up to ms). Its Python API hard-codes ``pthrDelay = 0``: a zero timeout, a busy loop that
took 2.2 of 3 s of CPU idle here (what vLLM's NixlConnector runs with). :func:`make_agent` builds
the agent with a timeout of ``wait_us`` instead: the thread sleeps until UCX has an event (a message
or a flush answer arriving), 0.002 s of CPU per 3 s idle at 100 ms. The timeout only bounds how late
event-less work is progressed by the thread; the caller's own polls progress its worker as before
(NIXL's status check drives the worker), so transports without events (GPU copies) are unaffected.

``nixl_agent`` exposes no way to pass ``pthrDelay``, so the agent is built with NIXL's config class
swapped for a subclass that substitutes ours, under a lock, and restored at once. If a NIXL release
stops setting ``pthrDelay`` there (the hook is never called), the spinning thread is not kept: the
agent is rebuilt without it and the caller is told (make_agent's second value False), falling back to Python
progress.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ..errors import TransportError

__all__ = ["ENV", "PROGRESS_WAIT_US", "make_agent", "thread_wanted"]

logger = logging.getLogger(__name__)

#: the progress thread's poll() timeout between UCX events (µs; NIXL rounds up to ms)
PROGRESS_WAIT_US = 100_000
#: environment switch: ``0`` runs agents without NIXL's progress thread (progress from Python only)
ENV = "KVTRITON_NIXL_PROGRESS_THREAD"

_config_lock = threading.Lock()  # the config class swap is process-wide


def thread_wanted(progress_thread: bool | None) -> bool:
    """``progress_thread`` as given, or from :data:`ENV` (on unless it says 0/false/no/off)."""
    if progress_thread is not None:
        return bool(progress_thread)
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def make_agent(api: Any, name: str, conf: Any, wait_us: int) -> tuple[Any, bool]:
    """``api.nixl_agent(name, conf)`` whose progress thread (if ``conf`` enables it) waits on UCX
    events up to ``wait_us`` between wake-ups. Returns the agent and whether its thread is on."""
    if not conf.enable_pthread:
        return api.nixl_agent(name, conf), False
    if not isinstance(wait_us, int) or not 1_000 <= wait_us <= 10_000_000:
        raise TransportError(f"progress wait must be an int of µs in 1,000..10,000,000, got {wait_us!r}")
    bindings = api.nixlBind
    base = bindings.nixlAgentConfig
    applied: list[int] = []

    class _EventWaitConfig(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: object) -> None:
            if key == "pthrDelay":  # nixl_agent sets 0 (spin); ours sleeps on events
                value = wait_us
                applied.append(wait_us)
            super().__setattr__(key, value)

    with _config_lock:
        bindings.nixlAgentConfig = _EventWaitConfig
        try:
            agent = api.nixl_agent(name, conf)
        finally:
            bindings.nixlAgentConfig = base
    if applied:
        return agent, True
    logger.warning("NIXL agent %r: could not set its progress thread's wait (this NIXL's API changed);"
                   " running without the thread rather than with one that spins a core", name)
    del agent
    conf.enable_pthread = False
    return api.nixl_agent(name, conf), False
