"""A fetch's result comes when its bytes landed; its Done to the source goes in the next ``progress()``.

Why: the Done to each source rank and the fence it calls for were a third of a small fetch's host
time (``bench/fetch_phases.py``), and the engine waits for the result, not for them
(``Fetches.finish``). What must still hold: the source frees the blocks once the decode
progresses again (or closes), ``idle()`` is False until the Dones went, and a request fetched
again sends its last Done first, so the source never serves the new fetch from a hold that the old
Done then ends.
"""

import time

import numpy as np
import pytest

from kvtriton.errors import RequestRejectedError
from kvtriton.testing.oracle import check_destination

pytestmark = pytest.mark.nixl


def _until_result(e, agents, timeout_s: float = 10.0) -> list:
    """Progress ``agents`` (the decode's last in each round) until the decode has a result."""
    deadline = time.monotonic() + timeout_s
    while True:
        for a in agents:
            a.progress()
        got = e.da[0].results()
        if got:
            return got
        assert time.monotonic() < deadline, "no result"


def _freed(p, timeout_s: float) -> list[str]:
    """Progress the prefill alone up to ``timeout_s``; the requests it freed."""
    out, deadline = [], time.monotonic() + timeout_s
    while not out and time.monotonic() < deadline:
        p.progress()
        out += [f.req_id for f in p.freed()]
    return out


def test_the_result_comes_before_the_done_which_the_next_progress_sends(engines):
    e = engines(1, 1)
    p, d = e.pa[0], e.da[0]
    src, dst = np.array([9, 3, 4, 40, 41]), np.array([0, 7, 30, 2, 3])
    kv = e.request(src)
    p.hold("r", src)
    d.fetch("r", "P", src, dst)
    got = _until_result(e, [p, d])
    assert [r.ok for r in got] == [True], got
    check_destination(e.D[0], 0, 1, kv, dst, e.before[0])
    assert not d.idle()  # its Done is still to be sent
    assert _freed(p, 0.3) == []  # the source has not heard yet: the blocks stay held
    d.progress()  # sends it
    assert _freed(p, 5.0) == ["r"]
    assert d.idle()


def test_close_sends_the_dones_left(engines):
    e = engines(1, 1)
    p, d = e.pa[0], e.da[0]
    src, dst = np.array([5, 6, 7]), np.array([1, 2, 3])
    e.request(src)
    p.hold("r", src, lease_s=60)
    d.fetch("r", "P", src, dst)
    assert _until_result(e, [p, d])[0].ok
    d.close()  # no progress() in between: close sends the Done, the source frees now, not at the lease
    assert _freed(p, 5.0) == ["r"]


@pytest.mark.parametrize("progressed", [False, True], ids=["at-once", "after-a-progress"])
def test_a_request_fetched_again_after_its_result_is_refused(engines, progressed):
    """Its hold ended with the first fetch's Done: the second fetch is refused, never served from that
    hold. ``at-once`` (no progress in between): the old Done goes before the new pull, else the source
    would serve the pull from the hold the late Done then frees under the READ. Either way the source's
    offer of its cache blocks (made when the first pull bound the hold: a fetch of the same blocks
    READs them with no message) is dropped when the fetch finishes, else the second fetch READs
    blocks the source may have reused already (without it this READ succeeded)."""
    e = engines(1, 1)
    p, d = e.pa[0], e.da[0]
    src, dst = np.array([12, 13, 14]), np.array([20, 21, 22])
    e.request(src)
    p.hold("r", src)
    d.fetch("r", "P", src, dst)
    assert _until_result(e, [p, d])[0].ok
    if progressed:
        d.progress()  # the Done goes; the source's withdrawal of its offer is not back yet
    d.fetch("r", "P", src, dst)
    got = _until_result(e, [p, d])
    assert len(got) == 1 and not got[0].ok and isinstance(got[0].error, RequestRejectedError), got
    assert got[0].undefined_blocks == tuple(dst.tolist())
    assert _freed(p, 1.0) == ["r"]


def test_a_fetch_with_nothing_to_read_queues_no_done(engines):
    # every local block skipped (a full prefix hit): the result needs no progress(), so a caller may never
    # call it; its Done is handed to the transport with the fetch (nothing to hurry), not queued for a
    # progress that may never come (fetches like it would queue Dones without bound)
    e = engines(1, 1)
    p, d = e.pa[0], e.da[0]
    src = np.array([7, 8])
    kv = e.request(src)
    p.hold("r", src, lease_s=60, consumer="D")  # bound to D: its done alone ends the hold (no pull binds it)
    d.fetch("r", "P", src, np.array([-1, -1]))
    got = d.results()
    assert len(got) == 1 and got[0].ok and got[0].bytes == 0, got
    assert d.idle()  # nothing queued (without the send at the fetch: its Done)
    deadline = time.monotonic() + 5  # and it ends the hold (UCX sends once the decode's worker progresses)
    while "r" in p.debug_state()["holds"]:
        assert time.monotonic() < deadline, "the hold did not end: no Done came"
        d.progress()
        p.progress()
    check_destination(e.D[0], 0, 1, kv, np.array([-1, -1]), e.before[0])  # not a byte written
