"""Separate processes, real NIXL over UCX on 127.0.0.1: every decode rank's blocks are checked
byte for byte against the global heads its rank owns (kvtriton.testing.cluster)."""

import time

import pytest
import torch

from kvtriton.testing.cluster import Cluster, ClusterConfig
from kvtriton.testing.oracle import RegionModel

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl


def mixed(heads):
    # a SPLIT region, a REPLICATE (MLA) region and a SPLIT region of another dtype and head_dim
    return [RegionModel.gqa("attn.0", heads, 16), RegionModel.mla("mla.0", 24, torch.float16),
            RegionModel.gqa("attn.1", heads, 8, torch.float32)]


assert_all_ok = Cluster.check_outcomes


@pytest.mark.parametrize(
    "p_tp,d_tp,heads",
    [(1, 2, 4), (2, 1, 4), (2, 4, 4), (4, 2, 4), (2, 3, 6), (1, 4, 2)],
)
def test_hetero_tp_pull_and_push_byte_exact(p_tp, d_tp, heads):
    # Pool: 16 KiB per agent. 16 requests per mode are in flight at once (their payloads sum to
    # far more than the pool, so they queue and chunk), plus one request per mode larger than the
    # whole pool. NHD joint K/V on prefill, HND separate K/V on decode.
    cfg = ClusterConfig(models=mixed(heads), p_tp=p_tp, d_tp=d_tp, mode="both", block_size=4,
                        p_blocks=320, d_blocks=320, p_layout="NHD", p_storage="joint", d_layout="HND",
                        staging_bytes=16 << 10, slot_bytes=1024, timeout_s=20)
    with Cluster(cfg, start_timeout_s=180) as c:  # room for child start-up on a loaded host (beds building)
        small = c.requests(32, n_blocks=6)
        large = c.requests(2, n_blocks=64)
        reqs = small + large
        c.hold(reqs)
        c.fetch(reqs)
        report = c.wait(reqs, timeout_s=120)
        assert_all_ok(report, reqs)
        assert all(v is None for v in c.canary().values())  # nothing outside the blocks changed
        freed = c.wait_freed(len(reqs))
        assert all(sorted(f for f, _ in v) == sorted(r.req_id for r in reqs) for v in freed.values())
        for key in c.decode_ranks() + c.prefill_ranks():
            st = c.status(key)
            assert st["free_slots"] == st["num_slots"], f"{key} leaked staging"


def test_prefill_killed_mid_transfer_then_back():
    # 4 heads, P2 -> D2: D0 reads only from P0, D1 only from P1. P1 dies after announcing three
    # chunks; D1's requests must fail with a typed error within the timeout, D0's complete, and
    # D1 fetches them again from a restarted P1.
    timeout = 2.0
    cfg = ClusterConfig(models=[RegionModel.gqa("attn.0", 4, 16), RegionModel.gqa("attn.1", 4, 16)],
                        p_tp=2, d_tp=2, mode="pull", block_size=4, p_blocks=256, d_blocks=256,
                        staging_bytes=8 << 10, slot_bytes=1024, timeout_s=timeout,
                        modes="staged")  # chunks to die between (auto: whole-block runs read zero-copy)
    with Cluster(cfg, start_timeout_s=180) as c:  # room for child start-up on a loaded host (beds building)
        reqs = c.requests(6, n_blocks=32)  # 6 x 32 blocks x 1 KiB: many chunks each
        c.hold(reqs)
        c.kill_after(("P", 1), 3)
        t0 = time.monotonic()
        c.fetch(reqs)
        report = c.wait(reqs, timeout_s=60)
        assert time.monotonic() - t0 < 6 * timeout + 10, "failure detection took too long"
        assert not c.is_alive(("P", 1))
        assert_all_ok({0: report[0]}, reqs)
        errors = {o["error"] for o in report[1].values()}
        assert all(not o["ok"] for o in report[1].values())
        assert errors <= {"PeerDisconnectedError", "TransferTimeoutError", "RequestRejectedError"}, report[1]
        st = c.status(("D", 1))
        assert st["free_slots"] == st["num_slots"], "staging not reclaimed after the failure"
        assert c.status(("D", 1))["idle"]

        c.restart(("P", 1))
        c.hold(reqs, ranks=[("P", 1)])
        c.fetch(reqs, ranks=[("D", 1)])
        again = c.wait(reqs, timeout_s=60, ranks=[("D", 1)])
        assert_all_ok(again, reqs)
        assert all(v is None for v in c.canary().values())


def test_lease_expiry_releases_blocks_across_processes():
    cfg = ClusterConfig(models=[RegionModel.gqa("attn.0", 2, 8)], p_tp=2, d_tp=1, timeout_s=2)
    with Cluster(cfg, start_timeout_s=180) as c:  # room for child start-up on a loaded host (beds building)
        reqs = c.requests(3, n_blocks=2)
        c.hold(reqs, lease_s=0.2)
        freed = c.wait_freed(3, timeout_s=10)
        assert all(sorted(v) == sorted((r.req_id, "lease_expired") for r in reqs) for v in freed.values())
        c.fetch(reqs[:1])
        report = c.wait(reqs[:1], timeout_s=20)
        assert report[0][reqs[0].req_id]["error"] == "RequestRejectedError"
