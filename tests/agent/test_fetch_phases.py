"""``bench/fetch_phases.py``, the phase-by-phase host time of one small fetch: it stamps the agent's
own calls from outside, so a renamed or moved call breaks it; this runs it (real agents over NIXL,
a few requests) with the caches warm and evicted (``bench/fetch_host.py --cold``)."""

import pytest

from bench import fetch_host, fetch_phases


@pytest.mark.parametrize("cold", [False, True])
def test_every_phase_is_reached_in_order(cold):
    phases = fetch_phases.run_phases("gqa", reps=6, cold=cold)
    # to the result, then the decode's next progress(): its Dones and the fence (Fetches.finish)
    assert [p for p, _, _ in phases] == [p for p, *_ in fetch_phases.STAMPS + fetch_phases.AFTER]
    assert all(med > 0 and p80 >= med for _, med, p80 in phases), phases
    # the two source ranks' READs are posted inside fetch(), which then only returns
    posted = dict((p, med) for p, med, _ in phases)
    assert posted["READ posted"] > posted["fetch returned"], phases
    assert fetch_host._cold == []  # the copy's buffers are dropped again


def test_stamps_come_off_and_a_call_that_is_gone_changes_nothing(monkeypatch):
    from kvtriton.agent.destination.fetches import Fetches
    from kvtriton.plan.request import RequestPlan

    finish, for_fetch = Fetches.finish, RequestPlan.__dict__["for_fetch"]
    fetch_phases.install(fetch_phases.Stamps())()  # wrapped, then unwrapped
    assert Fetches.finish is finish and RequestPlan.__dict__["for_fetch"] is for_fetch
    monkeypatch.setattr(fetch_phases, "STAMPS", fetch_phases.STAMPS + (
        ("renamed", "end", "kvtriton.agent.destination.fetches", "Fetches.no_such_call"),))
    with pytest.raises(KeyError, match="no_such_call"):
        fetch_phases.install(fetch_phases.Stamps())
    assert Fetches.finish is finish  # found missing before anything was wrapped
