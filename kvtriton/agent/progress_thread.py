"""The agent's background progress loop (:meth:`~kvtriton.agent.TransferAgent.start`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

__all__ = ["ProgressThread"]

logger = logging.getLogger("kvtriton.agent")


class ProgressThread:
    """Calls ``progress`` every ``interval_s`` on a daemon thread until :meth:`stop`; an exception is
    logged and the loop goes on (the error is per request where it matters). ``device``: a CUDA
    device made current on the thread first (UCX and Triton calls need its context), or None."""

    def __init__(self, name: str, progress: Callable[[], object], device: torch.device | None = None):
        self.name, self._progress, self._device = name, progress, device
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, interval_s: float) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name=self.name, daemon=True)
        self._thread.start()

    def _loop(self, interval_s: float) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)
        while not self._stop.is_set():
            try:
                self._progress()
            except Exception:
                logger.exception("kvtriton progress thread")
            self._stop.wait(interval_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and wait up to ``timeout_s`` for its last call to return."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=timeout_s)
            self._thread = None
