"""A destination rank ignores offers of a request it has fetched already (``Offers.drop``).

Why: an offer of the source's cache blocks is READ with no message, and the fetch's Done ends the
hold it was made from. An offer still on its way when the fetch finished, taken by a fetch of the
same request again, would READ blocks the source may be reusing: that fetch must pull instead (and
is refused, ``tests/agent/test_done_after_result.py``).
"""

from types import SimpleNamespace

from kvtriton.agent.destination.offers import MAX_FINISHED, Offers
from kvtriton.protocol import wire


def _offer(req: str) -> wire.Offer:
    return wire.Offer(f"{req}|P:0>0!", req, "plan", "ids", 3, 1, ())


def test_an_offer_of_a_fetched_request_is_dropped_and_a_late_one_ignored():
    peer = SimpleNamespace(key=("P", 0), md=SimpleNamespace(engine="P"))
    other = SimpleNamespace(key=("Q", 0), md=SimpleNamespace(engine="Q"))
    offers = Offers(links=None)
    offers.keep(peer, _offer("r"))
    offers.keep(other, _offer("r"))  # another engine's request of the same name: not ours to drop
    assert offers.has("P", "r")
    offers.drop("P", "r")  # its fetch from P finished
    assert not offers.has("P", "r") and offers.has("Q", "r")
    offers.keep(peer, _offer("r"))  # arrived after the fetch finished
    assert not offers.has("P", "r")
    offers.keep(peer, _offer("s"))  # any other request still counts
    assert offers.has("P", "s")


def test_the_fetched_requests_remembered_are_bounded():
    peer = SimpleNamespace(key=("P", 0), md=SimpleNamespace(engine="P"))
    offers = Offers(links=None)
    offers.drop("P", "r")
    for i in range(MAX_FINISHED):  # as many fetched since: "r" is forgotten, the newest kept
        offers.drop("P", f"q{i}")
    assert len(offers.finished) == MAX_FINISHED
    offers.keep(peer, _offer("r"))
    assert offers.has("P", "r")
    offers.keep(peer, _offer(f"q{MAX_FINISHED - 1}"))
    assert not offers.has("P", f"q{MAX_FINISHED - 1}")
