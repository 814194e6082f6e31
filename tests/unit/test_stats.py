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


def test_counters_are_attributes_not_names():
    """Counted by attribute (a typo is an AttributeError at once); names are only the report's."""
    s = Stats()
    s.offers_taken += 1
    s.one_sided_descriptors += 3
    s.packed(4)  # one pack launch of four chunks
    d = s.as_dict()
    assert s.offers_taken == 1 and d["one_sided_descriptors"] == 3 and d["eager_hits"] == 0
    assert (d["pack_launches"], d["packed_chunks"]) == (1, 4)
    with pytest.raises(TypeError):
        s["offers_taken"] += 1  # no counting by name any more
