"""When the connector's worker side places a hold, in vLLM's call order (no vLLM needed: the
worker side is driven by hand over real NIXL in one process).

With speculative decoding vLLM calls ``get_finished`` right after the target forward, then runs
the drafter, which writes its own KV (an Eagle-3 MLA layer) into the very blocks being held, and
only then ``wait_for_save`` (``defer_finalize`` in vLLM's model runner). A hold placed before the
drafter lets an eager pack take the draft region's KV before it is written: the decode then loads
stale bytes, and the tokens cannot show it (the target verifies every draft token). Here the
draft region is forced STAGED and the hold names its consumer, so it is packed as soon as it is
placed; the decode's bytes must be the ones the drafter wrote.
"""

import time

import pytest
import torch

from kvtriton.agent import TransferAgent
from kvtriton.integrations.vllm.scheduler import StepMessages
from kvtriton.integrations.vllm.settings import TransferSettings, from_extra_config
from kvtriton.integrations.vllm.worker import WorkerSide
from kvtriton.regions import Region

BS, BLOCKS, HEADS, HEAD, LATENT = 4, 16, 2, 8, 24
HELD, LANDING = (3, 4, 5), (9, 10, 11)


def _regions(gen):
    """A GQA target layer (K||V per head row, as vLLM's 4-D view) and an MLA draft layer."""
    target = torch.randn(BLOCKS, HEADS, BS, 2 * HEAD, generator=gen)
    draft = torch.randn(BLOCKS, BS, LATENT, generator=gen)
    return [Region.attention("model.layers.0.self_attn.attn", k=target, layout="HND", block_size=BS,
                             total_heads=HEADS),
            Region.mla("model.layers.1.self_attn.attn", draft, block_size=BS)]


@pytest.fixture
def engines():
    gen = torch.Generator().manual_seed(19)
    settings = TransferSettings(consumer="D", modes="staged", impl="torch", staging_bytes=1 << 20,
                                 slot_bytes=1024, timeout_s=10.0)
    worker = WorkerSide(settings, engine_id="P", rank=0, tp_size=1, regions=_regions(gen), serve=False)
    dst_regions = _regions(gen)
    decode = TransferAgent("D", 0, 1, dst_regions, staging_bytes=1 << 20, slot_bytes=1024, timeout_s=10.0,
                           modes="staged", impl="torch", replicate_stripe=settings.agent_stripe)  # as the connector
    decode.start()
    try:
        worker.agent.add_remote(decode.metadata())
        decode.add_remote(worker.agent.metadata())
        yield worker, decode, dst_regions, gen
    finally:
        decode.close()
        worker.close()


def _wait_packed(worker, seconds=5.0):
    # packed_ahead counts packs that completed; eager_chunks counts chunks reserved, which the
    # background thread may still be packing (then a write right after races the pack: seen
    # under load as the negative control's stale region coming out fresh)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if worker.agent.packed_ahead("r") > 0:
            return True
        time.sleep(0.01)
    return False


def _load(worker, decode, dst_regions):
    decode.fetch("r", "P", HELD, LANDING)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        got = decode.results()
        if got:
            assert got[0].ok, got[0].error
            break
        time.sleep(0.01)
    else:
        raise TimeoutError("the load did not finish")
    same = []
    for src, dst in zip(worker.agent.regions, dst_regions):
        a, b = src.streams[0][list(HELD)], dst.streams[0][list(LANDING)]
        same.append(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    return same


def _drafter_writes(worker, gen):
    draft = worker.agent.regions[1].streams[0]
    draft[list(HELD)] = torch.randn(draft[list(HELD)].shape, generator=gen)


def test_hold_waits_for_the_drafter(engines):
    """vLLM's order with a drafter: get_finished, drafter, wait_for_save. Fails when get_finished
    places the hold (the draft region is packed stale)."""
    worker, decode, dst_regions, gen = engines
    worker.bind(StepMessages(holds={"r": HELD}))
    worker.start_loads()
    worker.finished()  # get_transfer_results: before the drafter ran
    held_early = "r" in worker.agent.debug_state()["holds"]
    if held_early:
        _wait_packed(worker)  # what an idle progress thread does meanwhile
    _drafter_writes(worker, gen)
    worker.after_forward()  # wait_for_save, deferred past the drafter
    worker.clear()
    assert _wait_packed(worker), "the hold was not packed ahead (the test would not exercise the hazard)"
    assert _load(worker, decode, dst_regions) == [True, True], "the decode's bytes are not the prefill's"
    assert not held_early, "held before the step's last writer ran"


def test_negative_control_a_write_after_the_hold_is_missed(engines):
    """The check above can fail: a region written after its hold was packed reaches the decode
    stale (the target region, written before, still matches)."""
    worker, decode, dst_regions, gen = engines
    worker.bind(StepMessages(holds={"r": HELD}))
    worker.after_forward()  # the hold, then a write to its blocks
    assert _wait_packed(worker)
    _drafter_writes(worker, gen)
    worker.clear()
    assert _load(worker, decode, dst_regions) == [True, False]


def test_modes_setting_reaches_the_agent_as_it_takes_it():
    from kvtriton.integrations.vllm.settings import SettingsError

    assert TransferSettings().agent_modes is None
    assert from_extra_config({"modes": "staged"}).agent_modes == "staged"
    assert from_extra_config({"modes": "a=staged,b=direct"}).agent_modes == {
        "a": "staged", "b": "direct"}
    for bad in ("a=", "=staged", "a=staged,b", "a=b=c"):
        with pytest.raises(SettingsError, match="modes"):
            from_extra_config({"modes": bad})
