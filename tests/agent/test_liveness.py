"""A peer's death known within a second, not at a timeout, and its restart served again (issue 35,
points 1 and 2), over real NIXL between processes on 127.0.0.1.

Each pair meets over a kept handshake connection, its *lifeline* (kvtriton.agent.lifelines):

* a prefill rank SIGKILLed while a decode's fetch waits on it (``timeout_s=30``): the fetch fails
  with ``PeerDisconnectedError`` within 1.5 s, in pull and push; the prefill restarted under the
  same engine id is met again and its next request arrives byte-exact, kill after kill;
* a decode rank SIGKILLed with a pull out (the prefill packed it into staging): the prefill's hold
  (``lease_s=30``) is freed as ``"consumer_lost"`` within 1.5 s and its staging is all free again;
  a decode restarted under the same id is served byte-exact;
* only the lifeline's own closure counts: a stranger's connection to the handshake port, opened
  and closed, changes nothing.

``KVT_LIVENESS_KILLS`` sets the kills per flow (default 2); the times are printed (``-s``)."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import time

import pytest
from helpers import lifeline_agents as la

from kvtriton.errors import PeerDisconnectedError
from kvtriton.integrations.core import serve_metadata
from kvtriton.protocol.handshake import meet
from kvtriton.testing.child import ChildProcess
from kvtriton.testing.oracle import check_destination, load_source

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

KILLS = int(os.environ.get("KVT_LIVENESS_KILLS", "2"))
BOUND_S = 1.5
SRC, DST = [3, 7, 11, 2], [5, 1, 9, 30]


def _drive(agent, until, timeout_s: float):
    """Progress ``agent`` until ``until()`` returns something true; that value (bounded)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        agent.progress()
        got = until()
        if got:
            return got
        time.sleep(0.0005)
    raise AssertionError(f"nothing after {timeout_s} s")


def _meet(agent, port: int) -> None:
    m = meet("127.0.0.1", port, agent.metadata(), timeout_s=10.0, keep=True)
    assert m.conn is not None, "the server did not keep the connection"
    agent.add_remote(m.metadata)
    assert agent.add_lifeline(m)


def _kill(child: ChildProcess) -> float:
    t0 = time.monotonic()
    os.kill(child.process.pid, signal.SIGKILL)
    return t0


@pytest.mark.parametrize("flow", ["pull", "push"])
def test_a_killed_source_fails_the_fetch_typed_within_a_second_and_its_restart_is_served(flow):
    d, d_regs = la.make_agent("D", 1, flow, timeout_s=30.0)
    times = []
    try:
        for i in range(KILLS):
            with ChildProcess(la.source, "P", 100 + i, flow, 30.0, name=f"P{i}") as p:
                _meet(d, p.ready(timeout_s=120))
                # the restarted prefill serves its next request byte-exact
                p.call("hold", f"ok{i}", SRC, 7 + i, "D")
                d.fetch(f"ok{i}", "P", SRC, DST)
                (r,) = _drive(d, d.results, 20.0)
                assert r.ok, r.error
                check_destination(d_regs, 0, 1, la.kv_of(7 + i, len(SRC)), DST)
                # a fetch in flight when the prefill dies: typed, within BOUND_S whatever timeout_s
                p.call("hold", f"dead{i}", SRC, 50 + i, "D")
                p.call("pause")
                # a subset of the held blocks: not what hold() offered (a cache read the decode would
                # take and finish without the prefill's Python), so it pulls and waits for the prefill
                d.fetch(f"dead{i}", "P", SRC[1:], DST[1:])
                end = time.monotonic() + 0.2
                while time.monotonic() < end:  # the pull (or grant) is out
                    d.progress()
                t0 = _kill(p)
                (r,) = _drive(d, d.results, 10.0)
                times.append(time.monotonic() - t0)
                assert not r.ok and isinstance(r.error, PeerDisconnectedError), r.error
                assert times[-1] < BOUND_S, f"typed error after {times[-1]:.3f} s"
                p.stop(5)
        if flow == "pull":  # push: the slots granted to the dead source stay quarantined for timeout_s
            _drive(d, d.idle, 10.0)
    finally:
        d.close()
    print(f"\n{flow}: SIGKILL to PeerDisconnectedError over {len(times)} kills: "
          f"p50 {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms")


def test_a_killed_destination_frees_its_holds_and_staging_within_a_second_and_its_restart_is_served():
    p, p_regs = la.make_agent("P", 2, "pull", timeout_s=30.0)
    server = serve_metadata(p, None, "127.0.0.1", 0, io_timeout_s=5.0)
    times = []
    try:
        for i in range(KILLS):
            with ChildProcess(la.destination, "D", 200 + i, "pull", 30.0, server.port, name=f"D{i}") as d:
                assert d.ready(timeout_s=120) == "P"
                kv = la.kv_of(60 + i, len(SRC))
                load_source(p_regs, 0, 1, kv, SRC)
                p.hold(f"ok{i}", SRC, lease_s=30.0, consumer="D")
                d.call("fetch", f"ok{i}", "P", SRC, DST)
                got = _drive(p, lambda: d.call("results"), 20.0)
                assert got == [(f"ok{i}", True, "NoneType")], got
                assert d.call("check", 60 + i, DST)  # the restarted decode is served byte-exact
                _drive(p, p.freed, 10.0)
                # a pull out, packed into staging, never read: then the decode dies
                load_source(p_regs, 0, 1, la.kv_of(90 + i, len(SRC)), SRC)
                p.hold(f"dead{i}", SRC, lease_s=30.0, consumer="D")
                d.call("fetch_and_pause", f"dead{i}", "P", SRC, DST)
                _drive(p, lambda: p.pool.free_slots < p.pool.num_slots, 10.0)
                t0 = _kill(d)
                freed = _drive(p, p.freed, 10.0)
                _drive(p, lambda: p.pool.free_slots == p.pool.num_slots, BOUND_S)
                times.append(time.monotonic() - t0)
                assert [(f.req_id, f.reason) for f in freed] == [(f"dead{i}", "consumer_lost")]
                assert times[-1] < BOUND_S, f"freed after {times[-1]:.3f} s"
                d.stop(5)
        assert p.stats["peers_disconnected"] == KILLS
    finally:
        server.close()
        p.close()
    print(f"\nkilled decode: SIGKILL to hold and staging freed over {len(times)} kills: "
          f"p50 {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms")


def test_only_the_lifeline_closing_counts():
    """A stranger that connects to the handshake port and hangs up (or speaks garbage) drops
    nobody: the decode met over its own kept connection stays, and is served."""
    p, p_regs = la.make_agent("P", 3, "pull", timeout_s=30.0)
    d, d_regs = la.make_agent("D", 4, "pull", timeout_s=30.0)
    server = serve_metadata(p, None, "127.0.0.1", 0, io_timeout_s=5.0)
    try:
        _meet(d, server.port)
        for payload in (b"", b"KVTH\x02\x09\x00\x00\x00\x00", b"garbage"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=2) as s:
                s.sendall(payload)
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            p.progress()
            d.progress()
        assert p.stats["peers_disconnected"] == 0 and d.stats["peers_disconnected"] == 0
        kv = la.kv_of(5, len(SRC))
        load_source(p_regs, 0, 1, kv, SRC)
        p.hold("r", SRC, lease_s=30.0, consumer="D")
        d.fetch("r", "P", SRC, DST)

        def done():
            p.progress()
            return d.results()

        (r,) = _drive(d, done, 20.0)
        assert r.ok, r.error
        check_destination(d_regs, 0, 1, kv, DST)
        # and a closing agent is seen as gone by its peer at once
        p_close = time.monotonic()
        p.close()
        _drive(d, lambda: d.stats["peers_disconnected"], 2.0)
        assert time.monotonic() - p_close < BOUND_S
    finally:
        server.close()
        p.close()
        d.close()


def test_a_queued_request_keeps_its_hold_past_the_lease_until_fetched():
    """Point 4 at the agent level: a request waiting in the decode engine's queue (``queued``)
    keeps its hold (lease 1 s) for 3 s, then loads byte-exact; one not queued expires. (A 0.5 s
    lease lost a renewal 0.1 s apart on a host loaded by two suites at once.)"""
    p, p_regs = la.make_agent("P", 5, "pull", timeout_s=30.0)
    d, d_regs = la.make_agent("D", 6, "pull", timeout_s=30.0, renew_interval_s=0.1)
    server = serve_metadata(p, None, "127.0.0.1", 0, io_timeout_s=5.0)
    try:
        _meet(d, server.port)
        kv = la.kv_of(11, len(SRC))
        load_source(p_regs, 0, 1, kv, SRC)
        p.hold("waits", SRC, lease_s=1.0, consumer="D")
        p.hold("forgotten", [20, 21], lease_s=1.0, consumer="D")
        d.queued("waits", "P", max_wait_s=30.0)
        freed = []
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            p.progress()
            d.progress()
            freed += [(f.req_id, f.reason) for f in p.freed()]
            time.sleep(0.001)
        assert freed == [("forgotten", "lease_expired")]
        d.fetch("waits", "P", SRC, DST)

        def done():
            p.progress()
            return d.results()

        (r,) = _drive(d, done, 20.0)
        assert r.ok, r.error
        check_destination(d_regs, 0, 1, kv, DST)
    finally:
        server.close()
        p.close()
        d.close()
