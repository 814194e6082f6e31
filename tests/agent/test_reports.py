"""An engine's per-step questions (``results()``, ``freed()``) never wait for the agent's lock.

Why: the agent's progress thread holds the lock while it works, and on a busy host that thread
can be descheduled holding it; an engine that asked under the lock then stalled its whole step
for as long (get_transfer_results took 19-32 ms in the loaded real-engine cells). Here another
thread holds each agent's lock while the results and the freed hold are asked for: they come
back at once, and the bytes the fetch moved are checked against the oracle.
"""

import time

import numpy as np
import pytest
from helpers.lock_holder import LockHolder

from kvtriton.testing.oracle import check_destination

pytestmark = pytest.mark.nixl


def _progress_until(agents, done, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        for a in agents:
            a.progress()


def test_results_and_freed_are_taken_while_another_thread_holds_the_lock(engines):
    e = engines(1, 1)
    p, d = e.pa[0], e.da[0]
    src, dst = np.array([9, 3, 4, 40]), np.array([0, 7, 30, 2])
    kv = e.request(src)
    p.hold("r", src)
    d.fetch("r", "P", src, dst)
    _progress_until(e.agents, lambda: not d.debug_state()["fetches"])  # finished, not taken yet
    holder = LockHolder(d)
    try:
        t0 = time.monotonic()
        got = d.results()
        assert time.monotonic() - t0 < 1.0
    finally:
        holder.release()
    assert [(r.req_id, r.ok) for r in got] == [("r", True)], got
    assert d.results() == []  # taken once
    check_destination(e.D[0], 0, 1, kv, dst, e.before[0])

    _progress_until(e.agents, lambda: "r" not in p.debug_state()["holds"])  # the Done ended the hold
    holder = LockHolder(p)
    try:
        t0 = time.monotonic()
        freed = p.freed()
        assert time.monotonic() - t0 < 1.0
    finally:
        holder.release()
    assert [(f.req_id, f.reason) for f in freed] == [("r", "done")]
    assert p.freed() == []
