"""The vLLM bed's debugging aids for an engine process (:mod:`.vllm_bed` turns them on from its
environment): ``KVTRITON_BED_WATCHDOG=1`` logs any kvtriton thread stuck in one place and any
stall of the whole process; ``KVTRITON_BED_TRACE=1`` logs every call vLLM makes into
KVTritonConnector."""

from __future__ import annotations

import sys
import time

__all__ = ["watch_agent_threads", "trace_connector_calls"]


def watch_agent_threads(stuck_s: float = 2.0) -> None:
    """Log the stack of any kvtriton thread that stays in one place (outside its idle wait) for
    ``stuck_s``, and any gap in this watchdog's own ticks (the whole process stalled)."""
    import threading
    import traceback

    def watch():
        last_tick, seen = time.monotonic(), {}
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            if now - last_tick > stuck_s:
                print(f"[watchdog] process stalled {now - last_tick:.1f} s", file=sys.stderr, flush=True)
            last_tick = now
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if not names.get(ident, "").startswith("kvtriton"):
                    continue
                where = (frame.f_code.co_filename, frame.f_lineno)
                if frame.f_code.co_name in ("wait", "accept", "_worker"):  # idle by design
                    seen.pop(ident, None)
                    continue
                first = seen.setdefault(ident, (where, now))
                if first[0] != where:
                    seen[ident] = (where, now)
                elif now - first[1] > stuck_s:
                    print(f"[watchdog] {names[ident]} stuck {now - first[1]:.1f} s at:\n"
                          + "".join(traceback.format_stack(frame)), file=sys.stderr, flush=True)
                    seen[ident] = (where, now)

    threading.Thread(target=watch, daemon=True, name="bed-watchdog").start()


def trace_connector_calls() -> None:
    """Log every call vLLM makes into KVTritonConnector (``KVTRITON_BED_TRACE=1``): the call order
    a real engine makes, as the connector sees it."""
    import functools
    import logging

    from kvtriton.integrations.vllm import connector as mod

    log = logging.getLogger("kvtriton.trace")
    cls = mod.KVTritonConnector
    for name, fn in list(vars(cls).items()):
        if name.startswith("_") and name != "__init__" or not callable(fn):
            continue

        def wrap(fn=fn, name=name):
            @functools.wraps(fn)
            def traced(self, *a, **kw):
                role = getattr(getattr(self, "role", None), "name", "?")
                log.info("call %s.%s", role, name)
                return fn(self, *a, **kw)
            return traced

        setattr(cls, name, wrap())
