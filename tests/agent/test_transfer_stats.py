"""The agent's statistics as an exporter reads them (kvtriton.agent.stats): per-transfer records
(``RequestResult``: time, post time, descriptors, bytes, ways) checked against fresh transfers
whose bytes are compared with the oracle, counter deltas taken once each, failure kinds; and the
vLLM connector's window of them (kvtriton.integrations.vllm.stats, no vLLM needed)."""

import math

import numpy as np
import pytest
import torch

from kvtriton.agent import RequestResult
from kvtriton.agent.stats import FAILURE_KINDS, Stats, StatsCursor, failure_kind
from kvtriton.errors import (
    AuthenticationError,
    IncompatibleRemoteError,
    IntegrityError,
    KVTritonError,
    PeerDisconnectedError,
    PeerRefusedError,
    PlanError,
    ProtocolError,
    RequestAbortedError,
    RequestRejectedError,
    StagingError,
    TransferTimeoutError,
    TransportError,
)
from kvtriton.integrations.vllm import stats as window
from kvtriton.testing.oracle import RegionModel, check_destination
from kvtriton.testing.pair import EnginePair

SPLIT = [RegionModel.gqa("l0", 4, 16), RegionModel.gqa("l1", 4, 8, torch.float32)]
BLOCK = 4
# bytes of one block, every head of both regions, K and V: what a decode TP1 receives per block
BLOCK_BYTES = sum(m.total_heads * sum(m.head_dims) * BLOCK * torch.empty(0, dtype=m.dtype).element_size()
                  for m in SPLIT)


# ---------------------------------------------------------------------- per-transfer records
def _runs(src, dst) -> int:
    """Runs of positions consecutive on both sides (one DIRECT descriptor per run and stream)."""
    return 1 + sum(1 for j in range(1, len(src)) if not (src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1))


@pytest.mark.nixl
@pytest.mark.parametrize("p_tp,modes,layouts,ways", [
    (2, "staged", {}, (("staged", 2),)),
    (1, "direct", dict(p_layout="HND", d_layout="HND", p_storage="separate"), (("direct", 1),)),
])
def test_a_transfer_record_has_its_bytes_descriptors_ways_and_times(p_tp, modes, layouts, ways):
    pytest.importorskip("nixl")
    with EnginePair(p_tp, 1, models=SPLIT, modes=modes, block_size=BLOCK, seed=3, **layouts) as e:
        src, dst = np.array([9, 10, 11, 30, 4]), np.array([0, 1, 2, 3, 20])
        kv = e.request(src)  # fresh random bytes on every prefill rank
        before = e.before[0]
        for p in e.pa:
            p.hold("r", src)
        e.da[0].fetch("r", "P", src, dst)
        (res,) = e.drive(1)[0]
        assert res.ok, res
        check_destination(e.D[0], 0, 1, kv, dst, before)  # the record describes a transfer that happened
        assert res.bytes == len(src) * BLOCK_BYTES
        assert res.ways == ways
        if modes == "staged":  # the whole payload of each prefill rank fits one chunk
            assert res.descriptors == p_tp
        else:  # one descriptor per run of consecutive ids and per (region, K/V) stream
            assert res.descriptors == _runs(src, dst) * 2 * len(SPLIT)
        assert 0 < res.post_seconds <= res.seconds < 20


@pytest.mark.nixl
def test_a_failed_transfer_record_names_its_kind():
    pytest.importorskip("nixl")
    with EnginePair(2, 1, models=SPLIT, modes="staged", block_size=BLOCK, seed=4) as e:
        src, dst = np.array([1, 2]), np.array([5, 6])
        e.request(src)
        e.da[0].fetch("never-held", "P", src, dst)  # nothing held under this id: both ranks reject
        (res,) = e.drive(1)[0]
        assert not res.ok and failure_kind(res.error) == "rejected", res
        assert res.descriptors == 0 and res.bytes == 0


# ---------------------------------------------------------------------- counters and kinds
def test_counter_deltas_are_taken_once_each():
    s, cursor = Stats(), StatsCursor()
    assert cursor.take(s.as_dict()) == {}
    s.refused += 2
    s.eager_pull_hits += 1
    s.leases_expired += 1
    assert cursor.take(s.as_dict()) == {"refused": 2, "eager_pull_hits": 1, "eager_hits": 1, "leases_expired": 1}
    assert cursor.take(s.as_dict()) == {}  # nothing new: nothing reported twice
    s.refused += 1
    assert cursor.take(s.as_dict()) == {"refused": 1}


def test_every_error_has_its_own_kind_and_the_most_derived_wins():
    cases = {TransferTimeoutError: "timeout", PeerDisconnectedError: "peer_lost", TransportError: "transport",
             RequestRejectedError: "rejected", RequestAbortedError: "aborted", IntegrityError: "integrity",
             AuthenticationError: "authentication", PeerRefusedError: "peer_refused",
             IncompatibleRemoteError: "incompatible", ProtocolError: "protocol", StagingError: "staging",
             PlanError: "plan", KVTritonError: "other", ValueError: "other"}
    assert {cls: failure_kind(cls("x")) for cls in cases} == cases
    assert set(cases.values()) == set(FAILURE_KINDS)


# ---------------------------------------------------------------------- the connector's window
def _ok(i, descriptors=2, nbytes=4096, ways=(("staged", 2),)):
    return RequestResult(f"r{i}", True, seconds=0.01 * (i + 1), descriptors=descriptors, bytes=nbytes,
                         post_seconds=0.001, ways=ways)


def test_a_window_drains_what_accrued_since_the_last_take():
    w = window.WorkerStats()
    assert w.take({}) is None
    w.transfer(_ok(0))
    w.transfer(_ok(1, 7, 100, (("direct", 1), ("read_unpack", 1))))
    w.failed(TransferTimeoutError("silent"))
    d = w.take({"eager_hits": 3, "refused": 1, "bad_messages": 0})
    assert d["num_descriptors"] == [2, 7] and d["bytes_transferred"] == [4096, 100]
    assert d["transfer_duration"] == [0.01, 0.02] and d["post_duration"] == [0.001, 0.001]
    assert d["ways"] == {"staged": 2, "direct": 1, "read_unpack": 1}
    assert d["failures"] == {"timeout": 1}
    assert d["events"] == {"eager_hits": 3, "refused_messages": 1}
    assert w.take({"eager_hits": 3, "refused": 1}) is None  # the same counters again: nothing new
    w.failed(RequestRejectedError("no"))
    assert w.take({"eager_hits": 5, "refused": 1}) == {**window.empty(), "failures": {"rejected": 1},
                                                        "events": {"eager_hits": 2}}


def test_a_window_is_bounded():
    w = window.WorkerStats()
    for i in range(window.MAX_RECORDS + 5):
        w.transfer(_ok(i))
    d = w.take({})
    assert len(d["transfer_duration"]) == window.MAX_RECORDS and d["events"] == {"records_dropped": 5}
    merged = window.merge(window.merge(window.empty(), d), d)  # two ranks' full windows
    assert len(merged["num_descriptors"]) == window.MAX_RECORDS
    assert merged["events"]["records_dropped"] == 5 + 5 + window.MAX_RECORDS


def test_ranks_merge_and_reduce_to_one_summary():
    a, b = window.WorkerStats(), window.WorkerStats()
    a.transfer(_ok(0, 2, 2 << 20))
    b.transfer(_ok(1, 4, 4 << 20))
    b.failed(PeerDisconnectedError("gone"))
    merged = window.merge(a.take({}), b.take({"leases_expired": 2}))
    r = window.reduce(merged)
    assert r["Num successful transfers"] == 2 and r["Avg number of descriptors"] == 3.0
    assert r["Avg MB per transfer"] == 3.0 and r["Throughput (MB/s)"] == pytest.approx(6 / 0.03, rel=1e-3)
    assert r["Avg xfer time (ms)"] == 15.0 and r["P90 xfer time (ms)"] == 20.0
    assert r["Num failed transfers"] == 1 and r["Failed peer_lost"] == 1 and r["leases_expired"] == 2
    assert r["Payloads staged"] == 4
    only_failures = window.reduce({**window.empty(), "failures": {"timeout": 2}})
    assert only_failures == {"Num successful transfers": 0, "Num failed transfers": 2, "Failed timeout": 2}


@pytest.mark.parametrize("junk", [
    None, 3, "x", [], {"transfer_duration": "abc"},
    {"transfer_duration": [1.0], "post_duration": [1.0], "bytes_transferred": [-5], "num_descriptors": [1]},
    {"transfer_duration": [math.nan], "post_duration": [0.0], "bytes_transferred": [1], "num_descriptors": [1]},
    {"transfer_duration": [True], "post_duration": [0.0], "bytes_transferred": [1], "num_descriptors": [1]},
    {"ways": {"staged": -1, "": 2, "x" * 65: 1, 3: 1, "direct": 1.5, "read_unpack": True}},
    {"failures": [1, 2], "events": "many"},
])
def test_a_damaged_payload_is_dropped_never_raised_on(junk):
    assert window.is_empty(window.from_payload(junk))


def test_a_payload_round_trips():
    w = window.WorkerStats()
    w.transfer(_ok(0))
    w.failed(IntegrityError("digest"))
    d = w.take({"leases_expired": 1})
    assert window.from_payload(d) == d
