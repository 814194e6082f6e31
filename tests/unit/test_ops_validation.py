"""Every LaunchError path of ops.pack / ops.unpack, and the impl dispatch.

Each error test starts from a valid request, breaks one thing, and checks three facts: a
LaunchError whose message names the problem, nothing launched (neither the Triton launcher nor
the reference was called), and every staging and cache byte unchanged.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvtriton import LaunchError, Layout, Region, Segment, build_plan, ops
from kvtriton.ops import launch as ops_launch
from kvtriton.ops import validate as ops_validate
from kvtriton.testing.oracle import RegionModel, make_rank_regions

NB, BS, HD = 6, 2, 8
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# On a CUDA machine every check runs against device tensors, and `pytest -m gpu` (the GPU lane,
# bench/gpu_check.sh) selects this file; elsewhere it runs unmarked on the CPU.
pytestmark = [pytest.mark.gpu] if DEV == "cuda" else []


@pytest.fixture(autouse=True)
def _no_impl_override(monkeypatch):
    monkeypatch.delenv("KVTRITON_IMPL", raising=False)


@pytest.fixture
def calls(monkeypatch):
    """Record every launch and reference call (they still run)."""
    seen: list[str] = []
    real_launch, real_pack, real_unpack = ops_launch._launch, ops_launch.pack_reference, ops_launch.unpack_reference

    def launch(op, *a, **k):
        seen.append(f"triton-{op}")
        return real_launch(op, *a, **k)

    def pack_ref(*a, **k):
        seen.append("torch-pack")
        return real_pack(*a, **k)

    def unpack_ref(*a, **k):
        seen.append("torch-unpack")
        return real_unpack(*a, **k)

    monkeypatch.setattr(ops_launch, "_launch", launch)
    monkeypatch.setattr(ops_launch, "pack_reference", pack_ref)
    monkeypatch.setattr(ops_launch, "unpack_reference", unpack_ref)
    return seen


class Case:
    """A valid pack request (source TP1 -> destination rank 1 of TP2) and its unpack twin."""

    def __init__(self, device=DEV):
        g = torch.Generator().manual_seed(0)
        models = [RegionModel.gqa("l0", 2, HD, torch.bfloat16), RegionModel.gqa("l1", 2, HD, torch.float32)]
        self.src = make_rank_regions(models, 0, 1, NB, BS, gen=g, device=device)
        self.dst = make_rank_regions(models, 1, 2, NB, BS, layout="HND", gen=g, device=device)
        read = build_plan(1, 2, [r.spec for r in self.dst], 1, [r.spec for r in self.src]).staged[0]
        self.n = 3
        self.segments = list(read.segments)
        self.offsets = read.segment_offsets(self.n)
        self.ids = torch.tensor([4, 0, 2])
        self.nbytes = read.payload_bytes(self.n)
        self.staging = torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, generator=g).to(device)

    def args(self, op, **over):
        a = dict(regions=self.src if op == "pack" else self.dst, segments=self.segments, offsets=self.offsets,
                 block_ids=self.ids, staging=self.staging)
        a.update(over)
        return a

    def state(self):
        out = [self.staging.clone()]
        for regs in (self.src, self.dst):
            for r in regs:
                out += [t.view(torch.uint8).clone() for t in r.streams]
        return out


@pytest.fixture
def case():
    return Case()


OPS = {"pack": ops.pack, "unpack": ops.unpack}


def expect_error(case, calls, op, match, impl="triton", also_torch=True, **over):
    before = case.state()
    a = case.args(op, **over)
    with pytest.raises(LaunchError, match=match):
        OPS[op](a["regions"], a["segments"], a["offsets"], a["block_ids"], a["staging"], impl=impl)
    assert calls == [], f"launched despite the error: {calls}"
    for x, y in zip(before, case.state()):
        assert torch.equal(x, y), "bytes changed on an invalid call"
    if not also_torch:
        return
    # The same request through the reference path fails the same way (validation precedes dispatch).
    with pytest.raises(LaunchError, match=match):
        OPS[op](a["regions"], a["segments"], a["offsets"], a["block_ids"], a["staging"], impl="torch")
    assert calls == []


def seg(case, i=0, **changes):
    segs = list(case.segments)
    segs[i] = dataclasses.replace(segs[i], **changes)
    return segs


BOTH = pytest.mark.parametrize("op", ["pack", "unpack"])


# --------------------------------------------------------------------------- positive controls
@BOTH
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_valid_request_launches(case, calls, op, impl):
    a = case.args(op)
    OPS[op](a["regions"], a["segments"], a["offsets"], a["block_ids"], a["staging"], impl=impl)
    assert calls == [f"{impl}-{op}"]


# --------------------------------------------------------------------------- staging
@BOTH
def test_staging_not_a_tensor(case, calls, op):
    expect_error(case, calls, op, "staging must be a torch.Tensor", staging=bytearray(16))


@BOTH
@pytest.mark.parametrize(
    "make",
    [lambda s: s.view(torch.int8), lambda s: s[: s.numel() // 4 * 4].view(-1, 4), lambda s: s[::2]],
    ids=["dtype", "2-D", "strided"],
)
def test_staging_not_contiguous_1d_uint8(case, calls, op, make):
    expect_error(case, calls, op, "contiguous 1-D uint8", staging=make(case.staging))


@BOTH
def test_staging_too_small(case, calls, op):
    expect_error(case, calls, op, r"staging holds \d+ bytes, but segment 3 needs bytes \[384, 576\) for 3 blocks",
                 staging=case.staging[: case.nbytes - 1])


@BOTH
def test_staging_on_another_device(case, calls, op):
    meta = torch.empty(case.nbytes, dtype=torch.uint8, device="meta")
    expect_error(case, calls, op, f"stream 0 is on {DEV}.*, staging is on meta", staging=meta)


# --------------------------------------------------------------------------- regions
@BOTH
def test_regions_not_a_sequence(case, calls, op):
    expect_error(case, calls, op, "regions must be a sequence of Region", regions=case.src[0])


@BOTH
def test_region_not_a_region(case, calls, op):
    expect_error(case, calls, op, r"regions\[1\] must be a Region", regions=[case.src[0], "l1"])


@BOTH
def test_stream_head_dim_stride_not_1(case, calls, op):
    regs = case.src if op == "pack" else case.dst
    t = regs[0].streams[0]
    wide = torch.zeros(*t.shape[:3], 2 * HD, dtype=t.dtype, device=t.device)[..., ::2]
    broken = Region(spec=regs[0].spec, streams=(wide, regs[0].streams[1]))
    expect_error(case, calls, op, "head_dim stride 1", regions=[broken, regs[1]])


# --------------------------------------------------------------------------- segments and offsets
@BOTH
def test_segments_not_a_sequence(case, calls, op):
    expect_error(case, calls, op, "segments must be a sequence of Segment", segments=case.segments[0])


@BOTH
def test_segment_not_a_segment(case, calls, op):
    segs = list(case.segments)
    segs[1] = (0, 1)
    expect_error(case, calls, op, r"segments\[1\] must be a Segment", segments=segs)


@BOTH
@pytest.mark.parametrize(
    "offsets,match",
    [
        (lambda o: o[:-1], "3 offsets for 4 segments"),
        (lambda o: o.astype(np.float64), "offsets must be a 1-D sequence of integers"),
        (lambda o: o.reshape(2, 2), "offsets must be a 1-D sequence of integers"),
        (lambda o: o - 16, "offset of segment 0 is -16"),
        (lambda o: torch.zeros(len(o), dtype=torch.int64, device="meta"), "offsets are a tensor on meta"),
    ],
    ids=["count", "float", "2-D", "negative", "device-tensor"],
)
def test_bad_offsets(case, calls, op, offsets, match):
    expect_error(case, calls, op, match, offsets=offsets(case.offsets))


@BOTH
def test_too_many_segments(case, calls, op):
    many = [case.segments[0]] * 65536
    expect_error(case, calls, op, "65536 segments in one launch", segments=many, offsets=np.zeros(65536, np.int64))


@BOTH
@pytest.mark.parametrize(
    "change,match",
    [
        (dict(region=2), "region index out of range"),
        (dict(region=-1), "region index out of range"),
        (dict(stream=2), "stream index out of range"),
        (dict(itemsize=4), "itemsize 4 B does not match the region's dtype torch.bfloat16"),
        (dict(head_dim=HD * 2), f"head_dim {HD * 2} does not match the region's {HD}"),
        (dict(block_size=BS + 1), f"block_size {BS + 1} does not match the region's {BS}"),
        (dict(num_heads=0), "not inside the region's"),
        (dict(dst_layout="HND"), "dst_layout must be a Layout"),
    ],
    ids=["region", "region-negative", "stream", "itemsize", "head_dim", "block_size", "num_heads", "layout-type"],
)
def test_segment_does_not_match_region(case, calls, op, change, match):
    expect_error(case, calls, op, match, segments=seg(case, **change))


def test_pack_source_heads_out_of_range(case, calls):
    # The source holds 2 heads: a slice [1, 3) runs past them.
    expect_error(case, calls, "pack", r"src heads \[1, 3\) are not inside the region's 2 local heads",
                 segments=seg(case, src_head=1, num_heads=2))
    expect_error(case, calls, "pack", r"src heads \[-1, 0\)", segments=seg(case, src_head=-1))


def test_unpack_destination_heads_out_of_range(case, calls):
    # The destination holds 1 head: dst_head 1 is past it (src_head is irrelevant to unpack).
    expect_error(case, calls, "unpack", r"dst heads \[1, 2\) are not inside the region's 1 local heads",
                 segments=seg(case, dst_head=1))


def test_unpack_layout_differs_from_region(case, calls):
    expect_error(case, calls, "unpack", "staged tiles are NHD but the local region is HND",
                 segments=seg(case, dst_layout=Layout.NHD))


def test_pack_overlapping_tiles(case, calls):
    offs = case.offsets.copy()
    offs[1] = offs[0] + 8  # segment 1 starts inside segment 0's tiles
    expect_error(case, calls, "pack", r"staging ranges of segments 0 .* and 1 .* overlap", offsets=offs)


def test_unpack_overlapping_heads(case, calls):
    dup = list(case.segments) + [case.segments[0]]
    offs = np.append(case.offsets, case.offsets[0])
    expect_error(case, calls, "unpack", r"segments 0 and 4 both write heads \[0, 1\) of region 0 stream 0",
                 segments=dup, offsets=offs)


# --------------------------------------------------------------------------- block ids
@BOTH
@pytest.mark.parametrize(
    "ids,match",
    [
        (torch.tensor([1.0, 2.0, 3.0]), "block ids must be int32 or int64; got torch.float32"),
        (torch.tensor([1, 2, 3], dtype=torch.int16), "block ids must be int32 or int64; got torch.int16"),
        (np.array([1.0, 2.0, 3.0]), "block ids must be integers; got float64"),
        (torch.tensor([[1, 2, 3]]), r"block ids must be 1-D .* got shape \(1, 3\)"),
        (torch.tensor([1, -2, 3]), r"block id -2 at position 1 is out of range: expected -1 \(skip\) or 0..5"),
        (torch.tensor([1, 2, NB]), f"block id {NB} at position 2 is out of range"),
        ([0, NB + 7, 1], f"block id {NB + 7} at position 1 is out of range"),
        (torch.empty(3, dtype=torch.int64, device="meta"), "block ids are on meta, staging is on"),
    ],
    ids=["float", "int16", "numpy-float", "2-D", "below-minus-1", "past-end", "list-past-end", "device"],
)
def test_bad_block_ids(case, calls, op, ids, match):
    expect_error(case, calls, op, match, block_ids=ids)


def test_unpack_rejects_duplicate_ids(case, calls):
    expect_error(case, calls, "unpack", r"block ids repeat \[2\]", block_ids=torch.tensor([2, -1, 2]))


def test_pack_accepts_duplicate_and_padding_ids(case, calls):
    src, dst = torch.tensor([2, -1, 2]), torch.tensor([-1, -1, 2])
    ops.pack(case.src, case.segments, case.offsets, src, case.staging, impl="triton", pair_ids=dst)
    ops.unpack(case.dst, case.segments, case.offsets, dst, case.staging, impl="triton", pair_ids=src)
    assert calls == ["triton-pack", "triton-unpack"]


@BOTH
def test_minus_one_needs_the_other_sides_ids(case, calls, op):
    # pack skipping position 1 while unpack writes it would put stale staging bytes in a block
    expect_error(case, calls, op, r"block id -1 at position 1 without pair_ids", block_ids=torch.tensor([4, -1, 2]))


@BOTH
def test_pair_ids_of_another_length(case, calls, op):
    before = case.state()
    a = case.args(op)
    with pytest.raises(LaunchError, match="pair_ids has 2 positions, block_ids 3"):
        OPS[op](a["regions"], a["segments"], a["offsets"], a["block_ids"], a["staging"], pair_ids=[1, 2])
    assert calls == [] and all(torch.equal(x, y) for x, y in zip(before, case.state()))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_a_position_either_side_skips_is_skipped_by_both(case, impl):
    # position 0: only the source skips it; 1: only the destination; 2: neither
    src, dst = [-1, 3, 1], [5, -1, 0]
    st = case.staging
    st_before = st.clone()
    ops.pack(case.src, case.segments, case.offsets, src, st, impl=impl, pair_ids=dst)
    tile0 = [slice(int(o), int(o) + s.tile_bytes) for o, s in zip(case.offsets, case.segments)]
    assert all(torch.equal(st[t], st_before[t]) for t in tile0)  # position 0 left as it was
    before = [t.view(torch.uint8).clone() for r in case.dst for t in r.streams]
    ops.unpack(case.dst, case.segments, case.offsets, dst, st, impl=impl, pair_ids=src)
    after = [t.view(torch.uint8) for r in case.dst for t in r.streams]
    for b, x in zip(before, after):
        assert torch.equal(b[5], x[5])  # the stale tile of position 0 never reached block 5
        assert torch.equal(b[1:5], x[1:5])
    assert any(not torch.equal(b[0], x[0]) for b, x in zip(before, after))  # position 2 landed


# --------------------------------------------------------------------------- impl / dispatch
@BOTH
def test_unknown_impl(case, calls, op):
    expect_error(case, calls, op, r"impl='cuda' is not a known implementation", impl="cuda", also_torch=False)


@BOTH
def test_unknown_env_impl(case, calls, op, monkeypatch):
    monkeypatch.setenv("KVTRITON_IMPL", "fast")
    before = case.state()
    a = case.args(op)
    with pytest.raises(LaunchError, match="KVTRITON_IMPL='fast' is not a known implementation"):
        OPS[op](a["regions"], a["segments"], a["offsets"], a["block_ids"], a["staging"])
    assert calls == []
    assert all(torch.equal(x, y) for x, y in zip(before, case.state()))


@BOTH
def test_triton_on_cpu_needs_the_interpreter(calls, op, monkeypatch):
    monkeypatch.setattr(ops_launch, "_interpreting", lambda: False)
    expect_error(Case("cpu"), calls, op, "needs the Triton interpreter: set TRITON_INTERPRET=1", impl="triton",
                 also_torch=False)


def test_resolve_impl_table(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(ops_launch, "_interpreting", lambda: True)
    assert ops_launch.resolve_impl("auto", cpu) == "triton"
    assert ops_launch.resolve_impl("torch", cpu) == "torch"
    assert ops_launch.resolve_impl("auto", cuda) == "torch"  # interpreted kernels cannot touch device memory
    with pytest.raises(LaunchError, match="decorated under TRITON_INTERPRET=1"):
        ops_launch.resolve_impl("triton", cuda)
    monkeypatch.setattr(ops_launch, "_interpreting", lambda: False)
    assert ops_launch.resolve_impl("auto", cpu) == "torch"
    assert ops_launch.resolve_impl("auto", cuda) == "triton"
    assert ops_launch.resolve_impl("triton", cuda) == "triton"
    monkeypatch.setenv("KVTRITON_IMPL", "torch")
    assert ops_launch.resolve_impl("triton", cuda) == "torch"  # the environment overrides the keyword
    monkeypatch.setenv("KVTRITON_IMPL", " Triton ")
    assert ops_launch.resolve_impl("torch", cuda) == "triton"


@pytest.mark.parametrize("env,impl,want", [("torch", "triton", "torch"), ("triton", "torch", "triton"),
                                           ("", "auto", "triton"), ("auto", "torch", "triton")])
def test_env_overrides_keyword(case, calls, monkeypatch, env, impl, want):
    monkeypatch.setenv("KVTRITON_IMPL", env)
    ops.pack(case.src, case.segments, case.offsets, case.ids, case.staging, impl=impl)
    assert calls == [f"{want}-pack"]


def test_empty_requests_launch_nothing(case, calls):
    before = case.state()
    empty = torch.zeros(0, dtype=torch.int64)
    assert ops.pack(case.src, case.segments, case.offsets, empty, case.staging) is case.staging
    ops.unpack(case.dst, [], [], case.ids, case.staging)
    assert calls == []
    assert all(torch.equal(x, y) for x, y in zip(before, case.state()))


def test_segment_constructed_by_hand_is_accepted(case, calls):
    """Segments need not come from the planner: any consistent head slice works."""
    s = Segment(region=0, stream=1, src_head=1, dst_head=0, num_heads=1, head_dim=HD, itemsize=2,
                block_size=BS, dst_layout=Layout.HND)
    staging = torch.zeros(case.n * s.tile_bytes, dtype=torch.uint8, device=DEV)
    ops.pack(case.src, [s], [0], case.ids, staging, impl="triton")
    want = case.src[0].streams[1][case.ids.to(DEV)][:, :, 1:2].transpose(1, 2).contiguous().view(torch.uint8)
    assert torch.equal(staging, want.reshape(-1))


# --------------------------------------------------------------------------- per-plan cache
def test_tuple_segments_are_checked_once(case, calls, monkeypatch):
    """Tuples of segments (immutable, as the planner returns them) are validated once per
    (op, segments, regions); per-request checks still run on every call."""
    built = []
    real = ops_validate._build_static
    monkeypatch.setattr(ops_validate, "_build_static", lambda *a: built.append(a[0]) or real(*a))
    segs = tuple(case.segments)
    for _ in range(3):
        ops.pack(case.src, segs, case.offsets, case.ids, case.staging, impl="triton")
    assert built == ["pack"]
    ops.unpack(case.dst, segs, case.offsets, case.ids, case.staging, impl="triton")
    assert built == ["pack", "unpack"]
    # A cache hit still checks the request: ids, offsets and staging.
    before = case.state()
    with pytest.raises(LaunchError, match="out of range"):
        ops.pack(case.src, segs, case.offsets, [0, NB, 1], case.staging, impl="triton")
    with pytest.raises(LaunchError, match="staging holds"):
        ops.pack(case.src, segs, case.offsets, case.ids, case.staging[:-1], impl="triton")
    with pytest.raises(LaunchError, match="staging is on meta"):
        ops.pack(case.src, segs, case.offsets, case.ids, torch.empty(case.nbytes, dtype=torch.uint8,
                                                                       device="meta"))
    assert all(torch.equal(x, y) for x, y in zip(before, case.state()))
    assert built == ["pack", "unpack"]
    # Other region objects (same geometry, other memory) miss.
    other = Case()
    ops.pack(other.src, segs, other.offsets, other.ids, other.staging, impl="triton")
    assert built == ["pack", "unpack", "pack"]


def test_cache_does_not_keep_caches_alive(case):
    import gc
    import weakref

    segs = tuple(case.segments)
    ops.pack(case.src, segs, case.offsets, case.ids, case.staging, impl="torch")
    probe = weakref.ref(case.src[0])
    case.src = None
    gc.collect()
    assert probe() is None, "the launcher's cache holds a Region alive"
