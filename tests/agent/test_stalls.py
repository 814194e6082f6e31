"""A stall of this process is not a peer's silence (:mod:`kvtriton.agent.stalls`).

A host frozen by its hypervisor (or starved of CPU) stops every process on it at once; its
monotonic clock runs on. Before, the first ``progress()`` after a freeze longer than
``timeout_s`` failed every fetch in flight for "no progress", though the source, frozen too, had
no chance to answer (the flaky P2->D3 real-engine test: the CI host froze for 30-64 s, the kernel
logged "workqueue lockup"). Here each agent's lock is held by another thread, as a frozen process
would hold it: both agents "freeze" for 2.5x ``timeout_s``, the destination resumes first, the
fetch still completes and its bytes are checked. A source frozen alone still fails the fetch at
``timeout_s``: the destination watched that silence.
"""

import time

import numpy as np
import pytest
from helpers.lock_holder import LockHolder

from kvtriton.errors import TransferTimeoutError
from kvtriton.testing.oracle import check_destination

pytestmark = pytest.mark.nixl
TIMEOUT_S = 1.0


def _results(agent, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = agent.results()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError("no result")


def test_a_host_frozen_longer_than_timeout_s_fails_no_fetch(engines):
    e = engines(1, 1, timeout_s=TIMEOUT_S)
    p, d = e.pa[0], e.da[0]
    src, dst = np.array([9, 3, 4, 40]), np.array([0, 7, 30, 2])
    kv = e.request(src)
    p.hold("r", src)
    p.start()
    d.start()
    source = LockHolder(p)  # the source stops before it sees the pull
    d.fetch("r", "P", src, dst)
    destination = LockHolder(d)  # then the destination: the whole host is frozen
    time.sleep(2.5 * TIMEOUT_S)
    destination.release()  # the destination runs first: nothing from the source yet
    time.sleep(0.3)
    source.release()
    got = _results(d)
    assert [(r.req_id, r.ok) for r in got] == [("r", True)], got
    check_destination(e.D[0], 0, 1, kv, dst, e.before[0])
    stalls = d.debug_state()["stalls"]
    assert stalls["count"] == 1 and stalls["seconds"] >= 2 * TIMEOUT_S, stalls


def test_a_source_frozen_alone_still_fails_the_fetch_at_timeout_s(engines):
    e = engines(1, 1, timeout_s=TIMEOUT_S)
    p, d = e.pa[0], e.da[0]
    src, dst = np.array([5, 6]), np.array([1, 2])
    e.request(src)
    p.hold("r", src)
    p.start()
    d.start()
    source = LockHolder(p)
    try:
        t0 = time.monotonic()
        d.fetch("r", "P", src, dst)
        got = _results(d, timeout_s=10 * TIMEOUT_S)
        waited = time.monotonic() - t0
    finally:
        source.release()
    assert [r.req_id for r in got] == ["r"] and not got[0].ok, got
    assert isinstance(got[0].error, TransferTimeoutError), got[0].error
    assert waited < 3 * TIMEOUT_S, waited
