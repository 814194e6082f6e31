"""The connector's worker side across vLLM's sleep and wake (``unregister_kv_caches`` /
``restore_kv_caches``, vLLM >= 0.33), two worker sides over real NIXL and the real handshake, no
vLLM: a load in flight when the decode sleeps fails and its blocks are recomputed; a hold when
the prefill sleeps is released to vLLM; after the prefill wakes, the decode (holding its old
keys) fails one load typed, meets it again and loads fresh random data byte-exact."""

import pytest
import torch
from helpers.connector_bed import Bed

from kvtriton.integrations.vllm.scheduler import StepMessages

pytestmark = pytest.mark.nixl


def test_prefill_sleeps_and_wakes_and_the_decode_meets_it_again(gen):
    bed = Bed(gen)
    try:
        bed.hold("r1", [3, 7, 8])  # the load reads a subset: not the cache read hold() offered, so it pulls
        assert bed.load("r1", [3, 7], [0, 5]) == (True, set())
        bed.assert_landed([3, 7], [0, 5])
        bed.prefill.bind(StepMessages(holds={"r2": (1, 2)}, confirms={"r2"}))  # kept for a decode
        bed.prefill.after_forward()
        bed.prefill.unregister()  # vLLM's sleep
        bed.prefill.unregister()
        sending, _ = bed.prefill.finished()
        assert "r2" in sending  # the held blocks go back to vLLM
        bed.prefill.restore()  # wake; fresh KV in the same memory
        src = bed.p_regions[0].streams[0]
        src.copy_(torch.randn(src.shape, generator=gen))
        bed.hold("r3", [4, 9])
        done, errors = bed.load("r3", [4, 9], [1, 2])  # the decode still holds the old keys
        assert done
        if errors:  # failed typed (no answer from the rank that forgot it): recomputed; met again next
            assert errors == {1, 2}
            bed.hold("r4", [4, 9])
            assert bed.load("r4", [4, 9], [1, 2]) == (True, set())
        bed.assert_landed([4, 9], [1, 2])
        assert bed.decode.staging_in_use() == 0
    finally:
        bed.close()


def test_decode_sleeps_with_a_load_in_flight(gen, monkeypatch):
    # without NIXL's progress thread, so the load is still in flight when the decode sleeps: with it,
    # the READ may land first and the load ends ok (also right, but not the case under test)
    monkeypatch.setenv("KVTRITON_NIXL_PROGRESS_THREAD", "0")
    bed = Bed(gen, d_extra={"progress_interval_s": 3600.0})  # the load waits for our steps
    try:
        bed.hold("r0", [1])
        assert bed.load("r0", [1], [1]) == (True, set())  # met
        bed.hold("r1", [3, 7, 8])  # the load reads a subset: not the cache read hold() offered, so it pulls
        from kvtriton.integrations.vllm.scheduler import LoadSpec, RemoteSource

        src = RemoteSource(bed.engine, "127.0.0.1", bed.port, 1, "r1", (3, 7), 4)
        bed.decode.bind(StepMessages(loads={"w": LoadSpec("w", src, (3, 7), (0, 5))}))
        bed.decode.start_loads()
        bed.decode.clear()
        bed.decode.unregister()
        _, recving = bed.decode.finished()
        assert "w" in recving and bed.decode.load_errors() == {0, 5}  # recomputed by vLLM
        bed.decode.restore()
        gen_src = bed.p_regions[0].streams[0]
        gen_src.copy_(torch.randn(gen_src.shape, generator=gen))
        bed.hold("r2", [4, 9])
        assert bed.load("r2", [4, 9], [2, 6], seconds=20.0) == (True, set())  # met again: the prefill refreshes
        bed.assert_landed([4, 9], [2, 6])
    finally:
        bed.close()
