"""kvtriton's metrics in real vLLM engines, read where vLLM puts them: the Prometheus registry its
``PrometheusStatLogger`` fills (``LLM(disable_log_stats=False)``, the samples ``/metrics`` serves),
fed by vLLM's own KV-connector stats path (the workers' ``get_kv_connector_stats()``, the
executor's ``aggregate`` across ranks, the scheduler's stats, ``build_prom_metrics``).

P2 -> D1 on the tiny GQA Llama (float32, 2 layers, 2 KV heads of 32), every region STAGED on both
engines, so each request's values are known without kvtriton: each of the two prefill ranks sends
its head of every block as one staged chunk (one descriptor each: 2 per request), and the decode
receives every head of every block of the prompt (``blocks * 2 layers * K,V * 32 tokens * 2 heads
* 32 * 4 bytes``). Requests go one at a time and the registry is read before and after each, so
the values are checked per request, not only as sums; each transfer is also checked for tokens
and bytes (:meth:`~beds.vllm_pair.EnginePair.transfer`).
The failure case: a decode request naming a prefill request the prefill does not hold is
rejected (counted once, by kind), and the held request it should have read expires on each
prefill rank (one expired lease per rank).
"""

import math
import random
import time
from pathlib import Path

import pytest
from helpers.vllm_bed_python import vllm_bed_python
from helpers.vllm_versions import VersionChecks

from beds.vllm_bed import TinyLlama
from beds.vllm_pair import EnginePair

pytestmark = pytest.mark.vllm
VLLM_PY = vllm_bed_python()
ROOT = Path(__file__).resolve().parents[2]

BLOCK = 32
P_TP, D_TP = 2, 1
TINY = TinyLlama()
BLOCK_BYTES = TINY.layers * 2 * BLOCK * TINY.kv_heads * TINY.head_dim * 4  # float32, every head of one block
# the expired-lease case waits out the lease, then the quarantine of what was packed ahead (the
# prefill's timeout_s): short ones keep that wait to ~25 s, long enough for the P2->D1 transfers
# of the first case to read well inside the lease on a loaded 2-core host (the P1->D1 pair of
# test_vllm_connector.py reads inside a 6 s lease)
LEASE_S = 10.0
QUARANTINE_S = 15.0
EXTRA = {"modes": "staged"}  # equal on both engines (the plans' digests must agree)


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    pair = EnginePair(VLLM_PY, model_dir, tmp_path_factory.mktemp("metrics"), P_TP, D_TP, block_size=BLOCK,
                      p_extra={**EXTRA, "lease_s": LEASE_S, "timeout_s": QUARANTINE_S}, d_extra=EXTRA, log_stats=True)
    yield pair
    pair.close()


@pytest.fixture(scope="module")
def stats_checks(tmp_path_factory):
    """tests/engines/vllm_metrics_check.py under 0.32, 0.33 and 0.34, the three at once."""
    checks = VersionChecks(ROOT / "tests" / "engines" / "vllm_metrics_check.py", tmp_path_factory.mktemp("stats"))
    yield checks
    checks.close()


@pytest.mark.parametrize("version", ["0.32", "0.33", "0.34"])
def test_stats_classes_through_vllm(stats_checks, version):
    """vLLM's own KVConnectorProm / KVConnectorLogging build and feed ours (tests/engines/vllm_metrics_check.py),
    on the bed's vLLM (0.32) and on upstream 0.33 and 0.34 unpacked beside it."""
    rc, out, err = stats_checks.result(version)
    assert rc == 0 and f"ok {version}" in out, err[-3000:]


def scrape(engine) -> dict:
    """``{(sample name, sorted labels without vLLM's model/engine labels): value}`` of kvtriton's
    metrics; every sample must carry vLLM's engine labels."""
    out = {}
    for s in engine.call("metrics", prefix="vllm:kvtriton_")["samples"]:
        labels = dict(s["labels"])
        assert labels.pop("engine") == "0" and "model_name" in labels, s
        labels.pop("model_name")
        out[(s["name"], tuple(sorted(labels.items())))] = s["value"]
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))), 0.0)


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def test_every_transfer_is_in_prometheus_with_its_bytes_and_descriptors(pair):
    rng = random.Random(11)
    lengths = (37, 100, 333)  # 2, 4 and 11 blocks
    empty = scrape(pair.decode)
    # the series exist before any transfer: dashboards see every way and failure kind at 0
    assert value(empty, "vllm:kvtriton_payloads_total", way="staged") == 0
    assert (("vllm:kvtriton_num_failed_transfers_total", (("kind", "rejected"),))) in empty
    before = empty
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(TINY.vocab) for _ in range(n)]
        res = pair.transfer([prompt], tag=f"m{i}")  # tokens, digests of every region, nothing recomputed
        after = scrape(pair.decode)
        d = delta(after, before)
        blocks = math.ceil(n / BLOCK)
        assert value(d, "vllm:kvtriton_xfer_time_seconds_count") == 1, d
        assert value(d, "vllm:kvtriton_post_time_seconds_count") == 1, d
        assert value(d, "vllm:kvtriton_bytes_transferred_count") == 1, d
        assert value(d, "vllm:kvtriton_bytes_transferred_sum") == blocks * BLOCK_BYTES, d
        assert value(d, "vllm:kvtriton_num_descriptors_sum") == P_TP, d  # one staged chunk per prefill rank
        assert value(d, "vllm:kvtriton_payloads_total", way="staged") == P_TP, d
        assert not any(k[0] == "vllm:kvtriton_payloads_total" and k[1] != (("way", "staged"),) for k in d), d
        assert not any(k[0] == "vllm:kvtriton_num_failed_transfers_total" for k in d), d
        # the bed's own count of this load (the worker's counters, read over collective_rpc) agrees
        assert (res["descriptors"], res["bytes"]) == (P_TP, blocks * BLOCK_BYTES), res
        # a transfer's time and post time are real durations, the post within the transfer
        t = value(d, "vllm:kvtriton_xfer_time_seconds_sum")
        post = value(d, "vllm:kvtriton_post_time_seconds_sum")
        assert 0 < post <= t < 60, d
        before = after
    total = delta(before, empty)
    n = len(lengths)
    assert value(total, "vllm:kvtriton_xfer_time_seconds_count") == n
    assert value(total, "vllm:kvtriton_num_descriptors_sum") == n * P_TP
    # every observation of 2 descriptors falls in the buckets from le=2 up, none below
    assert value(total, "vllm:kvtriton_num_descriptors_bucket", le="1.0") == 0
    assert value(total, "vllm:kvtriton_num_descriptors_bucket", le="2.0") == n
    blocks = sum(math.ceil(x / BLOCK) for x in lengths)
    assert value(total, "vllm:kvtriton_bytes_transferred_sum") == blocks * BLOCK_BYTES
    # the prefill's counters are its agents' (the eager packs served what the decode pulled)
    p_after = scrape(pair.prefill)
    agents = pair.prefill.call("agent_stats")["stats"]
    assert value(p_after, "vllm:kvtriton_eager_hits_total") == sum(a["eager_hits"] for a in agents), (p_after, agents)
    assert value(p_after, "vllm:kvtriton_num_refused_messages_total") == sum(a["refused"] for a in agents) == 0
    assert value(p_after, "vllm:kvtriton_num_expired_leases_total") == 0
    assert not any(k[0] == "vllm:kvtriton_num_failed_transfers_total" and v for k, v in after.items()), after


def test_a_rejected_load_and_the_expired_lease_are_counted(pair):
    rng = random.Random(12)
    prompt = [rng.randrange(TINY.vocab) for _ in range(70)]
    d0, p0 = scrape(pair.decode), scrape(pair.prefill)
    params = pair.prefill_requests([prompt], "f-p")
    # the decode names a request the prefill never held: every prefill rank rejects its pull
    forged = dict(params[0], remote_request_id="never-held")
    out = pair.decode_requests([prompt], [forged], "f-d")
    assert out[0]["prompt_computed"] >= len(prompt) - 1, out  # the decode recomputed it
    d = delta(scrape(pair.decode), d0)
    assert value(d, "vllm:kvtriton_num_failed_transfers_total", kind="rejected") == 1, d
    assert sum(v for k, v in d.items() if k[0] == "vllm:kvtriton_num_failed_transfers_total") == 1, d
    assert value(d, "vllm:kvtriton_xfer_time_seconds_count") == 0, d
    # the request actually held is never read: its lease ends on each prefill rank
    pair.prefill.call("drain", seconds=LEASE_S + 60, timeout_s=LEASE_S + 90)
    state = pair.prefill.call("state")
    assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"], state
    # what was packed ahead for the decode stays quarantined for timeout_s (QUARANTINE_S) after the
    # lease: the decode it was offered to might still READ it; then the staging is all back
    deadline = time.monotonic() + QUARANTINE_S + 60
    while any(pair.prefill.call("state")["staging_in_use"]):
        assert time.monotonic() < deadline, pair.prefill.call("state")
        time.sleep(1)
    p = delta(scrape(pair.prefill), p0)
    assert value(p, "vllm:kvtriton_num_expired_leases_total") == P_TP, p
    agents = pair.prefill.call("agent_stats")["stats"]
    assert sum(a["leases_expired"] for a in agents) == P_TP, agents
