"""The agent's counters (kvtriton.agent.stats): one per event, reported under the names the
tests and benches read."""

import pytest

from kvtriton.agent.stats import Stats

REPORTED = {"bad_messages", "refused", "staged_descriptors", "direct_descriptors", "one_sided_descriptors",
            "eager_chunks", "eager_hits", "eager_misses", "eager_evicted", "eager_offers", "eager_guessed",
            "offers_taken", "pack_launches", "packed_chunks"}


def test_every_counter_reported_before_is_still_reported():
    assert REPORTED <= set(Stats().as_dict())
    assert all(v == 0 for v in Stats().as_dict().values())


def test_the_three_kinds_of_eager_hit_are_counted_apart_and_summed_as_before():
    s = Stats()
    s.eager_pull_hits += 1  # a pull found its pack ready
    s.eager_offer_pulls += 2  # pulls took over offered chunks
    s.eager_offer_reads += 4  # offers read without a pull
    d = s.as_dict()
    assert (d["eager_pull_hits"], d["eager_offer_pulls"], d["eager_offer_reads"]) == (1, 2, 4)
    assert d["eager_hits"] == 7


def test_counting_by_name():
    s = Stats()
    s["offers_taken"] += 1
    s.count("one_sided_descriptors", 3)
    assert s.offers_taken == 1 and s["one_sided_descriptors"] == 3 and s["eager_hits"] == 0
    with pytest.raises(KeyError):
        s["no_such_counter"] += 1
    with pytest.raises(KeyError):
        s["eager_hits"] = 1  # a sum, not a counter
