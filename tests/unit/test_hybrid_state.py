"""Mamba2 / Gated DeltaNet state through the planner and the kernels, byte for byte.

One model-global state per request (random bits) is sliced onto every source rank by plain
indexing written here (rank r holds x channels [r*X/T, (r+1)*X/T), then its B and C, whole when
n_groups == 1; its SSM heads), in vLLM's page: conv state, padding, SSM state, padding, one page
per block, inside one byte buffer with guard bands. The destination's buffers start as random
canary bytes; after the plan's staged payloads are packed and unpacked (and its DIRECT runs copied
as the READ would), every byte of every destination buffer must equal the canary except the
state parts of the destination's blocks, which must equal the reference slice of the global
state. Kernels run under the Triton interpreter (conftest).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvtriton import build_plan, ops
from kvtriton.errors import PlanError, RegionError, TopologyError
from kvtriton.hybrid import (
    GDNState,
    Mamba2State,
    StateModel,
    nixl_connector_conv_reads,
    state_regions,
    state_specs,
)
from kvtriton.plan import Route, direct_runs
from kvtriton.spec import Kind

GUARD = 64  # canary bytes before and after every buffer the kernels write
PAD_MID, PAD_TAIL = 8, 24  # bytes between the conv and the SSM state, and after the SSM state

M_G1 = Mamba2State(intermediate=24, n_groups=1, state_size=4, conv_kernel=4, num_heads=12, head_dim=2)
M_G2 = Mamba2State(intermediate=24, n_groups=2, state_size=4, conv_kernel=4, num_heads=12, head_dim=2)
M_G4 = Mamba2State(intermediate=24, n_groups=4, state_size=2, conv_kernel=4, num_heads=12, head_dim=2)
M_G6 = Mamba2State(intermediate=24, n_groups=6, state_size=2, conv_kernel=3, num_heads=12, head_dim=2)
GDN = GDNState(num_k_heads=12, num_v_heads=12, head_k_dim=2, head_v_dim=3, conv_kernel=4)


# ----------------------------------------------------------------------------- the reference
@dataclass
class GlobalState:
    """Requests' model-global state: conv sub-projections ``[R, channels, K-1]`` (in order) and
    SSM ``[R, heads, a, b]``."""

    parts: list[torch.Tensor]
    ssm: torch.Tensor


def _random(shape, dtype, gen) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape))
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen).view(dtype).view(*shape)


def global_state(model: StateModel, requests: int, conv_dtype, ssm_dtype, gen) -> GlobalState:
    k1 = model.conv_kernel - 1
    if isinstance(model, Mamba2State):
        widths = [model.intermediate, model.n_groups * model.state_size, model.n_groups * model.state_size]
        ssm = (model.num_heads, model.head_dim, model.state_size)
    else:
        key = model.num_k_heads * model.head_k_dim
        widths = [key, key, model.num_v_heads * model.head_v_dim]
        ssm = (model.num_v_heads, model.head_v_dim, model.head_k_dim)
    return GlobalState([_random((requests, w, k1), conv_dtype, gen) for w in widths],
                       _random((requests, *ssm), ssm_dtype, gen))


def rank_slice(model: StateModel, g: GlobalState, rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s conv row ``[R, channels, K-1]`` (DS order) and SSM ``[R, heads, a, b]``,
    sliced independently of kvtriton.hybrid: every part split evenly, except Mamba2's B and C
    when n_groups == 1 (a whole copy on every rank)."""
    pieces = []
    for i, part in enumerate(g.parts):
        whole = isinstance(model, Mamba2State) and model.n_groups == 1 and i > 0
        w = part.shape[1] if whole else part.shape[1] // tp
        lo = 0 if whole else rank * w
        pieces.append(part[:, lo:lo + w])
    h = g.ssm.shape[1] // tp
    return torch.cat(pieces, dim=1), g.ssm[:, rank * h:(rank + 1) * h]


@dataclass
class RankCache:
    """One rank's state cache: a guarded byte buffer of pages, its conv and SSM views."""

    buf: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor


def make_cache(model: StateModel, tp: int, num_blocks: int, layout: str, conv_dtype, ssm_dtype, gen,
               device: str = "cpu") -> RankCache:
    k1 = model.conv_kernel - 1
    conv_elems = sum(p.channels for p in model.conv_parts(tp)) * k1
    c_size = torch.empty((), dtype=conv_dtype).element_size()
    s_size = torch.empty((), dtype=ssm_dtype).element_size()
    heads = model.ssm_heads // tp
    a, b = model.ssm_shape
    conv_bytes = conv_elems * c_size
    ssm_off = conv_bytes + PAD_MID
    ssm_off += -ssm_off % s_size
    page = ssm_off + heads * a * b * s_size + PAD_TAIL
    page += -page % max(c_size, s_size)
    buf = torch.randint(0, 256, (2 * GUARD + num_blocks * page,), dtype=torch.uint8, generator=gen).to(device)
    pages = buf[GUARD:GUARD + num_blocks * page].view(num_blocks, page)
    width = conv_elems // k1
    conv = pages[:, :conv_bytes].view(conv_dtype)
    conv = conv.view(num_blocks, width, k1) if layout == "DS" else conv.view(num_blocks, k1, width)
    ssm = pages[:, ssm_off:ssm_off + heads * a * b * s_size].view(ssm_dtype).view(num_blocks, heads, a, b)
    return RankCache(buf, conv, ssm)


def write_state(cache: RankCache, layout: str, ids, conv_rows: torch.Tensor, ssm: torch.Tensor) -> None:
    """Request ``i``'s rank slice into page ``ids[i]`` (``conv_rows`` in DS order)."""
    for i, page in enumerate(ids):
        row = conv_rows[i].to(cache.conv.device)
        cache.conv[page] = row if layout == "DS" else row.transpose(0, 1)
        cache.ssm[page] = ssm[i].to(cache.ssm.device)


# ----------------------------------------------------------------------------- one transfer
def transfer(model: StateModel, src_tp: int, dst_tp: int, src_layout: str, dst_layout: str, conv_dtype, ssm_dtype,
             *, modes=None, seed=0, device: str = "cpu") -> dict[str, int]:
    """Move 3 requests' state P``src_tp`` -> D``dst_tp`` through the plan, check every destination
    byte; returns how many regions went each route (summed over destination ranks)."""
    gen = torch.Generator().manual_seed(seed)
    requests, src_blocks, dst_blocks = 3, 5, 6
    src_ids, dst_ids = np.array([3, 0, 4]), np.array([1, 5, 2])
    g = global_state(model, requests, conv_dtype, ssm_dtype, gen)
    src = []
    for r in range(src_tp):
        cache = make_cache(model, src_tp, src_blocks, src_layout, conv_dtype, ssm_dtype, gen, device)
        write_state(cache, src_layout, src_ids, *rank_slice(model, g, r, src_tp))
        src.append(cache)
    src_regions = [state_regions("l0", c.conv, c.ssm, model, tp_size=src_tp, conv_layout=src_layout) for c in src]
    src_before = [c.buf.clone() for c in src]
    routes: dict[str, int] = {}
    for d in range(dst_tp):
        cache = make_cache(model, dst_tp, dst_blocks, dst_layout, conv_dtype, ssm_dtype, gen, device)
        expected = _rebind(cache)
        write_state(expected, dst_layout, dst_ids, *rank_slice(model, g, d, dst_tp))
        dst_regions = state_regions("l0", cache.conv, cache.ssm, model, tp_size=dst_tp, conv_layout=dst_layout)
        plan = build_plan(d, dst_tp, [x.spec for x in dst_regions], src_tp, [x.spec for x in src_regions[0]],
                          modes=modes)
        for route in plan.routes:
            routes[route.value] = routes.get(route.value, 0) + 1
        for read in plan.staged:
            nbytes = read.payload_bytes(requests)
            staging = torch.full((nbytes + GUARD,), 0xA5, dtype=torch.uint8, device=device)
            offs = read.segment_offsets(requests)
            ops.pack(src_regions[read.src_rank], read.segments, offs, src_ids, staging)
            assert bool((staging[nbytes:] == 0xA5).all()), "pack wrote past the payload"
            ops.unpack(dst_regions, read.segments, offs, dst_ids, staging)
        if device != "cpu":
            torch.cuda.synchronize()
        runs = direct_runs(plan, {r: [x.spec for x in rs] for r, rs in enumerate(src_regions)},
                           [x.spec for x in dst_regions], src_ids, dst_ids)
        for rank, region, stream, s_off, d_off, n in zip(runs.src_rank, runs.region, runs.stream, runs.src_offset,
                                                          runs.dst_offset, runs.nbytes):
            # what the READ does: bytes at the source stream's address + s_off into ours + d_off
            s_t = src_regions[rank][region].streams[stream]
            d_t = dst_regions[region].streams[stream]
            s0 = s_t.data_ptr() - src[rank].buf.data_ptr() + int(s_off)
            d0 = d_t.data_ptr() - cache.buf.data_ptr() + int(d_off)
            cache.buf[d0:d0 + int(n)] = src[rank].buf[s0:s0 + int(n)]
        got, want = cache.buf, expected.buf
        if not torch.equal(got, want):
            bad = torch.nonzero(got != want).flatten()
            raise AssertionError(f"P{src_tp}->D{dst_tp} rank {d} ({src_layout}->{dst_layout}): {bad.numel()} bytes "
                                 f"differ, first at byte {int(bad[0])} (guard {GUARD}, routes "
                                 f"{[r.value for r in plan.routes]})")
    for before, c in zip(src_before, src):
        assert torch.equal(before, c.buf), "a source cache changed"
    return routes


def _rebind(cache: RankCache) -> RankCache:
    """A copy of ``cache``: its buffer cloned, its conv and SSM views over the clone."""
    clone = cache.buf.clone()

    def view(t: torch.Tensor) -> torch.Tensor:
        size = t.element_size()
        return torch.as_strided(clone.view(t.dtype), t.shape, t.stride(), (t.data_ptr() - cache.buf.data_ptr()) // size)

    return RankCache(clone, view(cache.conv), view(cache.ssm))


# ----------------------------------------------------------------------------- the matrix
LAYOUTS = [("DS", "DS"), ("SD", "SD"), ("DS", "SD"), ("SD", "DS")]
FP32, BF16 = torch.float32, torch.bfloat16
CASES = [
    ("mamba-g2", M_G2, 1, 2), ("mamba-g2", M_G2, 2, 1),
    ("mamba-g4", M_G4, 2, 4), ("mamba-g4", M_G4, 4, 2), ("mamba-g6", M_G6, 2, 3),
    ("mamba-g1", M_G1, 1, 2), ("mamba-g1", M_G1, 2, 1), ("mamba-g1", M_G1, 2, 4), ("mamba-g1", M_G1, 4, 2),
    ("mamba-g1", M_G1, 2, 3),
    ("gdn", GDN, 1, 2), ("gdn", GDN, 2, 1), ("gdn", GDN, 2, 4), ("gdn", GDN, 4, 2), ("gdn", GDN, 2, 3),
]


# every (model, pair) in two of the four layout pairs, so that each model meets all four across its pairs
MATRIX = [(*c, LAYOUTS[(i + k) % 4]) for i, c in enumerate(CASES) for k in (0, 2)]


@pytest.mark.parametrize("name,model,src_tp,dst_tp,layouts", MATRIX,
                         ids=[f"{m[0]}-P{m[2]}D{m[3]}-{m[4][0]}-{m[4][1]}" for m in MATRIX])
def test_state_moves_byte_exact(name, model, src_tp, dst_tp, layouts, device):
    transfer(model, src_tp, dst_tp, *layouts, FP32, FP32, device=device)


BF16_CASES = [c for c in CASES if c[2:] in ((1, 2), (2, 1), (2, 3))]


@pytest.mark.parametrize("layouts", [("DS", "DS"), ("SD", "DS")], ids=lambda x: f"{x[0]}-{x[1]}")
@pytest.mark.parametrize("name,model,src_tp,dst_tp", BF16_CASES, ids=[f"{c[0]}-P{c[2]}D{c[3]}" for c in BF16_CASES])
def test_bf16_conv_with_fp32_ssm(name, model, src_tp, dst_tp, layouts, device):
    """Nemotron-H: the conv state in the model's dtype, the SSM state in fp32."""
    transfer(model, src_tp, dst_tp, *layouts, BF16, FP32, seed=1, device=device)


def test_forced_staged_and_replicate_direct():
    """DS -> DS at n_groups 1: B and C are whole dense blocks on both sides, DIRECT by default;
    forced STAGED they come from one replica's payload; both byte-exact."""
    auto = transfer(M_G1, 2, 1, "DS", "DS", FP32, FP32)
    assert auto.get("direct", 0) == 2
    staged = transfer(M_G1, 2, 1, "DS", "DS", FP32, FP32, modes="staged")
    assert set(staged) == {"staged"}


# ----------------------------------------------------------------------------- geometry
def test_conv_parts_kinds_and_refusals():
    assert [(p.name, p.channels, p.kind) for p in M_G1.conv_parts(2)] == [
        ("x", 12, Kind.SPLIT), ("B", 4, Kind.REPLICATE), ("C", 4, Kind.REPLICATE)]
    assert [p.kind for p in M_G1.conv_parts(1)][1:] == [Kind.REPLICATE] * 2  # both engines agree at any TP
    assert [(p.name, p.channels, p.offset) for p in M_G2.conv_parts(2)] == [("x", 12, 0), ("B", 4, 12), ("C", 4, 16)]
    with pytest.raises(TopologyError, match="n_groups"):
        M_G2.conv_parts(4)
    with pytest.raises(TopologyError, match="num_heads"):
        M_G1.conv_parts(5)
    with pytest.raises(TopologyError):
        GDN.conv_parts(8)
    with pytest.raises(RegionError):
        Mamba2State(intermediate=10, n_groups=1, state_size=4, conv_kernel=4, num_heads=4, head_dim=2)


def test_regions_are_views_and_specs_match_the_pure_ones():
    gen = torch.Generator().manual_seed(0)
    for model in (M_G1, M_G2, GDN):
        for layout in ("DS", "SD"):
            c = make_cache(model, 2, 4, layout, BF16, FP32, gen)
            regions = state_regions("m", c.conv, c.ssm, model, tp_size=2, conv_layout=layout)
            assert [r.spec.name for r in regions] == [f"m.{p}" for p in model.sub_projections] + ["m.ssm"]
            for r in regions:
                assert r.streams[0].untyped_storage().data_ptr() == c.buf.untyped_storage().data_ptr()
            page = c.conv.stride(0) * c.conv.element_size()
            pure = state_specs("m", model, rank=1, tp=2, num_blocks=4, conv_dtype="bfloat16", ssm_dtype="float32",
                               conv_layout=layout, page_bytes=page)
            assert [r.spec for r in regions] == pure


def test_shape_mismatch_is_refused():
    gen = torch.Generator().manual_seed(0)
    c = make_cache(M_G2, 2, 4, "DS", FP32, FP32, gen)
    with pytest.raises(RegionError, match="conv state"):
        state_regions("m", c.conv, c.ssm, M_G2, tp_size=1, conv_layout="DS")
    with pytest.raises(RegionError, match="conv state"):
        state_regions("m", c.conv, c.ssm, M_G2, tp_size=2, conv_layout="SD")
    with pytest.raises(RegionError, match="conv_layout"):
        state_regions("m", c.conv, c.ssm, M_G2, tp_size=2, conv_layout="XY")


# ----------------------------------------------------------------------------- NixlConnector's defect
def _conv_page_bytes(model: StateModel, tp: int, g: GlobalState, rank: int) -> torch.Tensor:
    """Request 0's page on ``rank`` in DS: conv row then SSM state, as bytes (no padding: vLLM's
    NixlConnector addresses the SSM state right after the conv state)."""
    conv, ssm = rank_slice(model, g, rank, tp)
    return torch.cat([conv[0].contiguous().view(-1).view(torch.uint8), ssm[0].contiguous().view(-1).view(torch.uint8)])


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1)])
def test_nixl_connector_conv_offsets_read_wrong_bytes_at_n_groups_1(src_tp, dst_tp):
    """At n_groups 1, NixlConnector's conv offsets (``rank * size`` into B and C, B and C taken
    as halved) read other bytes than the destination's B and C; ours (the plan) are right
    (test_state_moves_byte_exact covers the same pairs byte for byte)."""
    gen = torch.Generator().manual_seed(7)
    g = global_state(M_G1, 1, FP32, FP32, gen)
    pages = [_conv_page_bytes(M_G1, src_tp, g, r) for r in range(src_tp)]
    wrong = {}
    for d in range(dst_tp):
        want = _conv_page_bytes(M_G1, dst_tp, g, d)
        got = want.clone()
        got[:] = 0
        for rd in nixl_connector_conv_reads(M_G1, src_tp, dst_tp, d, 4):
            src = pages[rd.src_rank]
            got[rd.dst_offset:rd.dst_offset + rd.nbytes] = src[rd.src_offset:rd.src_offset + rd.nbytes]
        for p in M_G1.conv_parts(dst_tp):
            lo, hi = p.offset * 3 * 4, (p.offset + p.channels) * 3 * 4
            wrong[(d, p.name)] = not torch.equal(got[lo:hi], want[lo:hi])
    assert not any(v for (d, part), v in wrong.items() if part == "x")  # x is sharded, and right
    assert any(v for (d, part), v in wrong.items() if part == "B")
    assert all(v for (d, part), v in wrong.items() if part == "C")
    transfer(M_G1, src_tp, dst_tp, "DS", "DS", FP32, FP32, seed=7)  # ours: every byte right


def test_nixl_connector_conv_offsets_are_right_when_groups_shard():
    """The reproduction is faithful where NixlConnector works: n_groups 2, P1->D2 and P2->D1."""
    gen = torch.Generator().manual_seed(3)
    g = global_state(M_G2, 1, FP32, FP32, gen)
    for src_tp, dst_tp in ((1, 2), (2, 1), (2, 2)):
        pages = [_conv_page_bytes(M_G2, src_tp, g, r) for r in range(src_tp)]
        for d in range(dst_tp):
            want = _conv_page_bytes(M_G2, dst_tp, g, d)
            conv_bytes = sum(p.channels for p in M_G2.conv_parts(dst_tp)) * 3 * 4
            got = torch.zeros_like(want)
            for rd in nixl_connector_conv_reads(M_G2, src_tp, dst_tp, d, 4):
                src = pages[rd.src_rank]
                got[rd.dst_offset:rd.dst_offset + rd.nbytes] = src[rd.src_offset:rd.src_offset + rd.nbytes]
            assert torch.equal(got[:conv_bytes], want[:conv_bytes])
    with pytest.raises(TopologyError, match="divide"):
        nixl_connector_conv_reads(M_G6, 2, 3, 0, 4)


def test_direct_route_is_a_whole_replicate_block():
    """The plan's DIRECT read of B at n_groups 1 (DS on both sides) is one whole page part."""
    specs = state_specs("l", M_G1, rank=0, tp=2, num_blocks=4, conv_dtype="float32", ssm_dtype="float32",
                        conv_layout="DS")
    dst = state_specs("l", M_G1, rank=0, tp=4, num_blocks=4, conv_dtype="float32", ssm_dtype="float32",
                      conv_layout="DS")
    plan = build_plan(0, 4, dst, 2, specs)
    assert [r for r in plan.routes] == [Route.STAGED, Route.DIRECT, Route.DIRECT, Route.STAGED]


def test_direct_slice_state_in_ds_and_refused_in_sd():
    """DS keeps a rank's channels of one part, and an SSM head range, one range per page: forced
    DIRECT_SLICE moves every region zero-copy, byte-exact. In SD a channel range is strided per
    position: refused, typed."""
    routes = transfer(M_G2, 1, 2, "DS", "DS", FP32, FP32, modes="direct_slice", seed=5)
    assert set(routes) == {"direct_slice"}
    routes = transfer(M_G1, 1, 2, "DS", "DS", FP32, FP32, modes="direct_slice", seed=5)
    assert routes == {"direct_slice": 4, "direct": 4}  # x and SSM sliced; whole B and C per rank
    specs = [state_specs("l", M_G2, rank=r, tp=t, num_blocks=4, conv_dtype="float32", ssm_dtype="float32",
                         conv_layout="SD") for r, t in ((0, 1), (0, 2))]
    with pytest.raises(PlanError, match="direct_slice is not possible"):
        build_plan(0, 2, specs[1], 1, specs[0], modes="direct_slice")
