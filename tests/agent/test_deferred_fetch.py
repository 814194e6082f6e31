"""A fetch the engine asks for never waits for the agent's own thread (``fetch(wait=False)``).

Why: the engine's thread issues a step's loads while the agent's progress thread may be inside
``progress()`` holding the agent's lock; on a loaded host that thread can be descheduled there,
and the engine's ``start_load_kv`` waited for it (9-13 ms in the sweep's real-engine cells, 37 ms
with two busy neighbours). Here another thread holds the decode agent's lock (as that thread
would) while fetches are asked with ``wait=False``: they return at once, are started by the next
thread to hold the lock, land byte for byte against the oracle (the caller's id arrays reused
meanwhile), and a deferred fetch's errors come through ``results()``.
"""

import time

import numpy as np
import pytest
import torch
from helpers.lock_holder import LockHolder

from kvtriton.errors import PeerDisconnectedError, PlanError, RequestAbortedError, TransportError
from kvtriton.testing.oracle import check_destination, snapshot

pytestmark = pytest.mark.nixl


def _by_req(got: dict) -> dict:
    return {r.req_id: r for r in got[0]}


def _asked_while_held(d, *fetches) -> None:
    """Each ``(args, kw)`` fetched with ``wait=False`` while another thread holds ``d``'s lock: none waits."""
    holder = LockHolder(d)
    try:
        t0 = time.monotonic()
        for args in fetches:
            d.fetch(*args, wait=False)
        assert time.monotonic() - t0 < 1.0  # none waited for the lock
        assert d.results() == []  # nothing started, nothing failed yet
    finally:
        holder.release()


def test_a_fetch_asked_while_another_thread_holds_the_agent_is_deferred_and_lands(engines):
    e = engines(1, 1)
    p, d = e.pa[0], e.da[0]
    src, dst = np.array([9, 3, 4, 40]), np.array([0, 7, 30, 2])
    src2, dst2 = [11, 12], [20, 21]
    kv = e.request(np.concatenate([src, src2]))
    want_dst = np.concatenate([dst, dst2])
    p.hold("r", src)
    p.hold("r2", np.array(src2))
    _asked_while_held(d, ("r", "P", src, dst))
    assert d.stats["deferred_fetches"] == 1
    src[:], dst[:] = 0, 1  # the caller reuses its arrays: the deferred fetch kept copies
    # the lock is free now: the next fetch takes it, starts the deferred one first, then its own
    d.fetch("r2", "P", src2, dst2, wait=False)
    assert d.stats["deferred_fetches"] == 1
    got = _by_req(e.drive(2))
    assert got["r"].ok and got["r2"].ok, got
    check_destination(e.D[0], 0, 1, kv, want_dst, e.before[0])


def test_deferred_fetches_are_started_together_by_the_next_progress(engines):
    e = engines(1, 1)
    p, d = e.pa[0], e.da[0]
    src, dst = np.array([5, 6, 60, 1, 33]), np.array([40, 3, 12, 13, 47])
    kv = e.request(src)
    p.hold("a", src[:3])
    p.hold("b", src[3:])
    holder = LockHolder(d)
    try:
        t0 = time.monotonic()
        with d.batch(wait=False) as held:  # the engine's step: it never waits either
            assert held is False
            d.fetch("a", "P", src[:3], dst[:3], wait=False)
            d.fetch("b", "P", src[3:], dst[3:], wait=False)
        assert time.monotonic() - t0 < 1.0
    finally:
        holder.release()
    assert d.stats["deferred_fetches"] == 2
    d.progress()  # starts both, back to back, before anything else of the call
    assert d.debug_state()["fetches"], "the deferred fetches did not start in progress()"
    got = _by_req(e.drive(2))
    assert got["a"].ok and got["b"].ok, got
    check_destination(e.D[0], 0, 1, kv, dst, e.before[0])
    with d.batch(wait=False) as held:  # nobody else holds it: held, fetches start at once
        assert held is True


def test_a_deferred_fetch_that_fails_reports_why_with_every_local_block_undefined(engines):
    e = engines(1, 1)
    d = e.da[0]
    _asked_while_held(d, ("bad", "P", [0, 1, 2], [5, 48, -1]))  # 48: past the decode's 48 blocks
    bad = _by_req(e.drive(1))["bad"]
    assert not bad.ok and isinstance(bad.error, PlanError), bad
    assert "out of range" in str(bad.error)
    assert bad.undefined_blocks == (5,)  # the ids the decode has: 48 is none of its blocks, -1 skips
    _asked_while_held(d, ("lost", "P", [1], [2]))
    d.forget("P")  # the prefill's ranks dropped (their lifeline closed, say) after the fetch was kept
    lost = _by_req(e.drive(1))["lost"]
    assert not lost.ok and isinstance(lost.error, PeerDisconnectedError) and "'P'" in str(lost.error), lost
    assert lost.undefined_blocks == (2,)
    for was, now in zip(e.before[0], snapshot(e.D[0])):  # nothing was written
        assert all(torch.equal(x, y) for x, y in zip(was, now))


def test_bad_ids_asked_with_the_agent_free_raise_at_once_as_ever(engines):
    d = engines(1, 1).da[0]
    with pytest.raises(PlanError, match="out of range"):
        d.fetch("bad", "P", [0], [48], wait=False)
    assert d.stats["deferred_fetches"] == 0 and d.results() == []


def test_an_engine_not_met_raises_at_once_even_while_another_thread_holds_the_agent(engines):
    """So its caller meets it again for the same request (the vLLM worker does, on this KeyError)."""
    e = engines(1, 1)
    d = e.da[0]
    holder = LockHolder(d)
    try:
        with pytest.raises(KeyError, match="'Q'"):  # never added
            d.fetch("ghost", "Q", [1], [2], wait=False)
        assert d.stats["deferred_fetches"] == 0 and d.results() == []
    finally:
        holder.release()
    d.forget("P")  # its ranks dropped: met no more
    holder = LockHolder(d)
    try:
        with pytest.raises(KeyError, match="no metadata yet for ranks"):
            d.fetch("gone", "P", [1], [2], wait=False)
        assert d.stats["deferred_fetches"] == 0
    finally:
        holder.release()


def test_a_deferred_fetch_aborted_before_it_started_posts_nothing(engines):
    e = engines(1, 1)
    p, d = e.pa[0], e.da[0]
    src = np.array([3, 4])
    e.request(src)
    p.hold("r", src)
    _asked_while_held(d, ("r", "P", src, [10, 11]))
    assert d.abort("r")
    got = d.results()
    assert [(r.req_id, type(r.error)) for r in got] == [("r", RequestAbortedError)]
    assert got[0].undefined_blocks == (10, 11)
    e.settle(0.2)
    assert d.results() == [] and d.stats["direct_descriptors"] == d.stats["staged_descriptors"] == 0
    assert d.idle()


def test_deferred_fetches_fail_typed_when_the_agent_closes_first(engines):
    e = engines(1, 1)
    d = e.da[0]
    _asked_while_held(d, ("r", "P", [1, 2], [3, 4]))
    assert not d.idle()  # a deferred fetch is work in flight
    d.close()
    got = d.results()
    assert [(r.req_id, r.ok, type(r.error)) for r in got] == [("r", False, TransportError)]
    assert got[0].undefined_blocks == (3, 4)

