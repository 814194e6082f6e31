"""Another thread holding an agent's lock, as a descheduled or frozen process would hold it."""

import threading


class LockHolder:
    """Holds ``agent``'s lock (``agent.batch()``) from another thread until :meth:`release`: its
    progress thread, and every call that takes the lock, wait meanwhile."""

    def __init__(self, agent):
        self._got, self._go = threading.Event(), threading.Event()
        self._t = threading.Thread(target=self._run, args=(agent,), daemon=True)
        self._t.start()
        if not self._got.wait(5):
            raise RuntimeError("could not take the agent's lock")

    def _run(self, agent):
        with agent.batch():
            self._got.set()
            self._go.wait(30)

    def release(self):
        self._go.set()
        self._t.join(5)
