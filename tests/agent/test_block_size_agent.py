"""Block-size changes through the TransferAgent over real NIXL (UCX): in one process (pull and
push, hetero TP, -1 prefixes, partial last blocks, chunking) and in separate processes (one
cluster per direction). Every byte is checked against the per-token oracle, canaries included."""

import time

import numpy as np
import pytest
import torch
from helpers.block_size_pair import MODELS, Pair

from kvtriton.errors import PlanError
from kvtriton.protocol import wire
from kvtriton.regions import Kind
from kvtriton.testing.cluster import Cluster, ClusterConfig
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination_tokens,
    load_source_tokens,
    make_global_tokens,
    snapshot,
)
from kvtriton.testing.seams import Wiretap

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

# vLLM's CPU cache: one K||V stream per layer, K dim-major per (block, head) tile
CPU_MODELS = [RegionModel("l0", Kind.SPLIT, 4, (32,), torch.float32), RegionModel.mla("mla", 24, torch.float16),
              RegionModel("l1", Kind.SPLIT, 4, (16,), torch.bfloat16)]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("p_tp,d_tp,p_bs,d_bs", [(1, 2, 4, 6), (2, 1, 8, 4), (2, 2, 3, 5)])
def test_agent_moves_tokens_across_block_sizes(mode, p_tp, d_tp, p_bs, d_bs):
    _move_and_check(Pair(p_tp, d_tp, p_bs, d_bs, mode), p_tp, d_tp, p_bs, d_bs)


@pytest.mark.parametrize("p_bs,d_bs", [(4, 6), (8, 4)])
def test_warmup_covers_token_mapped_launches(p_bs, d_bs):
    """warmup=True: add_remote warms the token-mapped pack/unpack variants (the kernels under the
    interpreter, with tiles= and num_tokens=) without a byte moving, then a request is exact."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter path")
    e = Pair(1, 2, p_bs, d_bs, "pull", impl="auto", warmup=True)
    try:
        assert e.pa[0].debug_state()["warmed"] and all(d.debug_state()["warmed"] for d in e.da)
        assert all(torch.equal(x, y) for r in range(2) for a, b in zip(e.before[r], snapshot(e.D[r]))
                   for x, y in zip(a, b))
    except BaseException:
        e.close()
        raise
    _move_and_check(e, 1, 2, p_bs, d_bs)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("p_tp,d_tp,p_bs,d_bs", [(2, 1, 4, 8), (1, 2, 8, 6)])
def test_agent_moves_dim_major_tokens_across_block_sizes(mode, p_tp, d_tp, p_bs, d_bs):
    """vLLM's CPU cache on both sides (K dim-major per block): impl='auto' (Triton under the
    interpreter here) runs the torch path for these token maps, warm-up included."""
    e = Pair(p_tp, d_tp, p_bs, d_bs, mode, models=CPU_MODELS, p_storage="vllm_cpu", d_storage="vllm_cpu",
             impl="auto", warmup=True)
    assert e.P[0][0].spec.dim_major == (16,) and e.D[0][0].spec.dim_major == (16,)
    _move_and_check(e, p_tp, d_tp, p_bs, d_bs)


def _move_and_check(e, p_tp, d_tp, p_bs, d_bs):
    try:
        assert e.da[0].plan_for("P").maps_tokens
        n_tok = 37  # partial last block on both sides
        src = np.random.default_rng(1).permutation(64)[:-(-n_tok // p_bs)]
        dst = np.random.default_rng(2).permutation(48)[:-(-n_tok // d_bs)]
        dst[0] = -1  # a prefix the decode side already has
        tokens = make_global_tokens(e.models, n_tok, e.gen)
        for r, regs in enumerate(e.P):
            load_source_tokens(regs, r, p_tp, tokens, src)
        for p in e.pa:
            p.hold("r", src)
        for d in e.da:
            d.fetch("r", "P", src, dst, num_tokens=n_tok)
        got = e.drive(1)
        assert all(v[0].ok for v in got.values()), got
        assert all(v[0].descriptors > 1 for v in got.values())  # chunked: 4 KiB chunks
        for r in range(d_tp):
            check_destination_tokens(e.D[r], r, d_tp, tokens, dst, e.before[r])
        with pytest.raises(PlanError, match="needs source position"):
            bad = src.copy()
            bad[-1] = -1
            e.da[0].fetch("r2", "P", bad, dst, num_tokens=n_tok)
    finally:
        e.close()


def test_source_rejects_a_token_map_that_does_not_add_up():
    e = Pair(1, 1, 4, 8, "pull")
    try:
        src = np.arange(4)
        for p in e.pa:
            p.hold("r", src)
        plan = e.da[0].plan_for("P")
        tap = Wiretap(e.da[0])
        # three source ids where tiles [0, 1] of 16 tokens read four
        tap.send(e.pa[0], wire.Pull("x|1", "r", 0, (0, 1, 2), 1, plan.digest(), 16, (0, 1)))
        deadline = time.monotonic() + 5
        seen = []
        while not seen and time.monotonic() < deadline:
            for a in e.pa + e.da:
                a.progress()
            seen = [m.reason for m in tap.seen(wire.Reject)]
        assert seen and "token map" in seen[0] and "source ids" in seen[0], seen
    finally:
        e.close()


@pytest.mark.parametrize("p_bs,d_bs,cpu_cache", [(4, 8, False), (8, 4, False), (4, 8, True), (8, 4, True)])
def test_cluster_block_size_change_byte_exact(p_bs, d_bs, cpu_cache):
    storage = dict(p_storage="vllm_cpu", d_storage="vllm_cpu") if cpu_cache else dict(p_storage="joint")
    cfg = ClusterConfig(models=CPU_MODELS if cpu_cache else MODELS, p_tp=2, d_tp=4, mode="both", block_size=p_bs,
                        d_block_size=d_bs, p_blocks=256, d_blocks=256, p_layout="NHD", d_layout="HND",
                        staging_bytes=16 << 10, slot_bytes=1024, timeout_s=20, **storage)
    with Cluster(cfg, start_timeout_s=180) as c:  # room for child start-up on a loaded host (beds building)
        reqs = c.requests(8, num_tokens=23) + c.requests(2, num_tokens=150)
        freed = c.transfer_exact(reqs)
        assert all(len(v) == len(reqs) for v in freed.values())
