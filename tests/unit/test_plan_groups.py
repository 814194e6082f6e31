"""Requests per KV cache group (issue 32, point 1): the group on regions and the wire, the plan's
checks, the grouped payload layout and chunking, and grouped pack/unpack byte for byte."""

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

from kvtriton import ops
from kvtriton.errors import LaunchError, PlanError, ProtocolError, RegionError
from kvtriton.plan import ChunkGeometry, PairPlan, RequestPlan, Way, build_plan, compact_groups, group_lists
from kvtriton.protocol import wire
from kvtriton.regions import Region
from kvtriton.spec import MAX_GROUPS

HEADS = 6


def _regions(tp: int, rank: int, layout: str, gen: torch.Generator, nb: int = 16, block_size: int = 4,
             groups=(0, 1, 2), state_bs: int = 1) -> list[Region]:
    """swa (group 0), full (group 1), ssm (block_size 1, group 2) SPLIT by heads, conv REPLICATE (group 2)."""
    heads = HEADS // tp

    def rnd(*shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen,
                                                dtype=torch.uint8))
        return t

    def att(name, bs, hd, dtype, group, streams=2):
        shape = (nb, bs, heads, hd) if layout == "NHD" else (nb, heads, bs, hd)
        ts = [rnd(*shape, dtype=dtype) for _ in range(streams)]
        return Region.attention(name, ts[0], ts[1] if streams == 2 else None, layout=layout, block_size=bs,
                                total_heads=HEADS, group=group)

    return [att("swa", block_size, 8, torch.float16, groups[0]), att("full", block_size, 16, torch.bfloat16, groups[1]),
            att("ssm", state_bs, 32, torch.float32, groups[2], streams=1),
            Region.mla("conv", rnd(nb, state_bs, 24, dtype=torch.float32), block_size=state_bs, group=groups[2])]


# --------------------------------------------------------------------------- spec, regions, wire
def test_group_on_builders_and_wire_round_trip():
    gen = torch.Generator().manual_seed(0)
    regs = _regions(1, 0, "NHD", gen)
    assert [r.spec.group for r in regs] == [0, 1, 2, 2]
    specs = tuple(r.spec for r in regs)
    md = wire.RankMetadata("P", 0, 1, "P:0:x", b"md", "DRAM", 0, specs, tuple(() for _ in specs),
                           tuple(() for _ in specs), wire.StagingInfo(1 << 30, 4096, 16, 8192))
    back = wire.decode_metadata(wire.encode_metadata(md))
    assert [s.group for s in back.regions] == [0, 1, 2, 2]
    # older metadata (no group field) decodes as group 0; a group 0 region does not send the field
    d = msgpack.unpackb(wire.encode_metadata(md), raw=False)
    assert "group" not in d["regions"][0]
    for r in d["regions"]:
        r.pop("group", None)
    assert [s.group for s in wire.decode_metadata(msgpack.packb(d, use_bin_type=True)).regions] == [0] * 4
    d["regions"][0]["group"] = MAX_GROUPS
    with pytest.raises(ProtocolError, match="'group'"):
        wire.decode_metadata(msgpack.packb(d, use_bin_type=True))
    with pytest.raises(RegionError, match="group"):
        Region.mla("x", torch.zeros(4, 1, 8), block_size=1, group=-1)


def test_pull_groups_on_the_wire_are_bounded_and_absent_for_one_group():
    one = wire.Pull("x", "r", 0, (1, 2), 4, "p")
    assert b"groups" not in one.encode() and wire.decode_message(one.encode()) == one
    many = wire.Pull("x", "r", 0, (1, 2, 3), 4, "p", groups=(1, 0, 2))
    assert wire.decode_message(many.encode()) == many
    with pytest.raises(ProtocolError, match="groups"):
        wire.decode_message(wire.encode_message("Pull", xid="x", req="r", dst_rank=0, ids=[1], chunk_blocks=1,
                                                plan="p", tokens=0, tiles=[], way="staged",
                                                groups=[0] * (MAX_GROUPS + 1)))


# --------------------------------------------------------------------------- plan
def _specs(tp, rank, layout="NHD", seed=0, **kw):
    return [r.spec for r in _regions(tp, rank, layout, torch.Generator().manual_seed(seed), **kw)]


def test_plan_build_checks_groups():
    d, s = _specs(2, 0), _specs(1, 0)
    plan = build_plan(0, 2, d, 1, s)
    assert plan.groups == 3
    assert {seg.group for p in plan.staged for seg in p.segments} == {0, 1, 2}
    assert all(p.ways == (Way.STAGED,) for p in plan.staged)  # several groups: STAGED only (one-sided: not yet)
    bad = [dataclasses.replace(x, group=0) if x.name == "full" else x for x in s]
    with pytest.raises(PlanError, match=r"region 1 \('full'\).*group differs: local 1, remote 0"):
        build_plan(0, 2, d, 1, bad)
    with pytest.raises(PlanError, match="one-sided ways are supported for one group only"):
        build_plan(0, 2, d, 1, s, modes={"full": "read_unpack"})
    d8, s8 = _specs(2, 0, block_size=8, state_bs=8), _specs(1, 0, block_size=4, state_bs=4)
    with pytest.raises(PlanError, match="block-size change .* one group only"):
        build_plan(0, 2, d8, 1, s8)


def test_group_lists_and_compact_groups():
    assert [a.tolist() for a in group_lists(np.array([1, 2]), 2)] == [[1, 2], [1, 2]]
    with pytest.raises(PlanError, match="2 group lists given, the regions span 3"):
        group_lists([[1], [2]], 3)
    src, dst, sizes = compact_groups(group_lists([[1, -1, 3], [], [4]], 3), group_lists([[5, 6, 7], [], [-1]], 3),
                                     8, 8)
    assert (src.tolist(), dst.tolist(), sizes) == ([1, 3], [5, 7], (2, 0, 0))
    with pytest.raises(PlanError, match="group 1: request has 2 source block ids but 1"):
        compact_groups(group_lists([[1], [2, 3], []], 3), group_lists([[1], [2], []], 3), 8, 8)
    with pytest.raises(PlanError, match="group 2: destination block id 9"):
        compact_groups(group_lists([[1], [2], [3]], 3), group_lists([[1], [2], [9]], 3), 8, 8)


@pytest.mark.parametrize("chunk_bytes", [700, 1100, 5000, 1 << 20])
def test_grouped_chunks_cover_the_request_within_the_cap(chunk_bytes):
    g = ChunkGeometry.fit_groups((384, 0, 640, 96), (3, 5, 4, 1), chunk_bytes)
    assert g.bounds(0)[0] == 0 and g.bounds(g.count - 1)[1] == 13
    assert all(g.bounds(i)[1] == g.bounds(i + 1)[0] for i in range(g.count - 1))
    assert all(0 < g.nbytes(i) <= chunk_bytes for i in range(g.count))
    assert sum(g.nbytes(i) for i in range(g.count)) == 3 * 384 + 4 * 640 + 96
    assert g.fits(chunk_bytes)
    # the source rebuilds the same geometry from blocks_per_chunk alone
    again = ChunkGeometry(g.bytes_per_block, 13, g.blocks_per_chunk, g.group_sizes, g.group_bytes)
    assert [again.bounds(i) for i in range(again.count)] == [g.bounds(i) for i in range(g.count)]
    assert ChunkGeometry.fit_groups((384, 0), (0, 4), chunk_bytes).count == 0  # no byte: no chunk


def test_one_group_request_is_todays_bytes():
    d, s = _specs(2, 0, groups=(0, 0, 0)), _specs(1, 0, groups=(0, 0, 0))
    plan = build_plan(0, 2, d, 1, s)
    rp = RequestPlan.for_fetch(plan, [3, 4, 5], [7, 8, 9], src_num_blocks=16, dst_num_blocks=16, chunk_bytes=1 << 20)
    nested = RequestPlan.for_fetch(plan, [[3, 4, 5]], [[7, 8, 9]], src_num_blocks=16, dst_num_blocks=16,
                                   chunk_bytes=1 << 20)
    p = rp.payload(0)
    assert rp.groups == (3,) and rp.group_bounds is None and rp.wire_groups() == {}
    assert p.chunks == nested.payload(0).chunks and not p.chunks.grouped
    assert p.segment_offsets(0).tolist() == p.read.segment_offsets(3).tolist() == \
        p.read.segment_offsets([3]).tolist()
    assert p.launch_groups(0) is None


def test_grouped_request_plan_and_serve_side():
    d, s = _specs(2, 1), _specs(1, 0)
    plan = build_plan(1, 2, d, 1, s)
    pairs = {r: PairPlan(plan, r, s, d) for r in plan.source_ranks}
    src, dst = [[3, 4], [7, 8, 9], [11]], [[5, 6], [10, 11, 12], [2]]
    rp = RequestPlan.for_fetch(plan, src, dst, src_num_blocks=16, dst_num_blocks=16, chunk_bytes=1000, pairs=pairs)
    assert rp.groups == (2, 3, 1) and rp.group_bounds == (0, 2, 5, 6)
    assert rp.src_ids.tolist() == [3, 4, 7, 8, 9, 11] and all(w.value == "staged" for w in rp.ways.values())
    p = rp.payload(0)
    assert p.chunks.count > 1 and p.nbytes == p.read.payload_bytes((2, 3, 1))
    # the source derives the same chunks from the pull
    served = RequestPlan.for_serve(plan, 0, rp.src_ids, held_blocks=6, chunk_blocks=p.chunks.blocks_per_chunk,
                                   groups=rp.groups)
    sp = served.payload(0)
    assert [sp.chunks.bounds(i) for i in range(sp.chunks.count)] == [p.chunks.bounds(i) for i in range(p.chunks.count)]
    for bad in ((), (2, 3), (2, 3, 2), (7, -1, 0)):
        with pytest.raises(PlanError):
            RequestPlan.for_serve(plan, 0, rp.src_ids, held_blocks=6, chunk_blocks=1, groups=bad)
    # DIRECT (the REPLICATE conv, group 2) moves its group's position only
    runs = pairs[0].direct_runs(rp.src_ids, rp.dst_ids, rp.group_bounds)
    conv = d[3]
    assert runs.src_offset.tolist() == [11 * s[3].block_stride_bytes(0)]
    assert runs.dst_offset.tolist() == [2 * conv.block_stride_bytes(0)]
    rows = pairs[0].rows()
    s_idx, d_idx, count, nbytes = rows.select(rp.src_ids, rp.dst_ids, rp.group_bounds)
    assert (s_idx.tolist(), d_idx.tolist(), count) == ([11], [2], 1)


# --------------------------------------------------------------------------- ops
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("counts", [(2, 3, 1), (0, 3, 1), (2, 0, 0)])
def test_grouped_pack_unpack_byte_exact_with_canaries(impl, counts):
    gen = torch.Generator().manual_seed(1)
    src_regs, dst_regs = _regions(1, 0, "NHD", gen), _regions(2, 1, "HND", gen)
    d, s = [r.spec for r in dst_regs], [r.spec for r in src_regs]
    plan = build_plan(1, 2, d, 1, s)
    read = plan.staged[0]
    all_src, all_dst = [[3, 4], [7, 8, 9], [11]], [[5, 6], [10, 11, 12], [2]]
    src_l = [a[:n] for a, n in zip(all_src, counts)]
    dst_l = [a[:n] for a, n in zip(all_dst, counts)]
    src_ids = torch.tensor([i for g in src_l for i in g], dtype=torch.int64)
    dst_ids = torch.tensor([i for g in dst_l for i in g], dtype=torch.int64)
    nbytes = read.payload_bytes(counts)
    staging = torch.full((nbytes + 64,), 0xA5, dtype=torch.uint8)  # canary after the payload
    offs = read.segment_offsets(counts, base=0)
    ops.pack(src_regs, read.segments, offs, src_ids, staging, impl=impl, groups=counts)
    assert bool((staging[nbytes:] == 0xA5).all())
    # independent reference of the staged bytes: the grouped layout of kvtriton.plan.types
    want, heads = [], slice(3, 6)  # D rank 1 of 2 holds global heads 3..5; P1 holds all 6
    for g in range(3):
        for seg in (x for x in read.segments if x.group == g):
            reg = src_regs[seg.region]
            for b in src_l[g]:
                tile = reg.nhd(seg.stream)[b]
                tile = tile if reg.spec.kind.value == "replicate" else tile[:, heads]
                if d[seg.region].layout.value == "HND":
                    tile = tile.transpose(0, 1)
                want.append(tile.contiguous().view(torch.uint8).reshape(-1))
    assert torch.equal(staging[:nbytes], torch.cat(want) if want else staging[:0])
    before = [[t.clone() for t in r.streams] for r in dst_regs]
    ops.unpack(dst_regs, read.segments, offs, dst_ids, staging, impl=impl, groups=counts)
    staged = {seg.region for seg in read.segments}  # (the REPLICATE conv moves DIRECT: not by ops)
    for i, r in enumerate(dst_regs):
        g = r.spec.group
        moved = dict(zip(dst_l[g], src_l[g])) if i in staged else {}
        for j in range(r.spec.num_streams):
            for b in range(r.spec.num_blocks):
                got = r.nhd(j)[b]
                if b in moved:
                    exp = src_regs[i].nhd(j)[moved[b]]
                    exp = exp if r.spec.kind.value == "replicate" else exp[:, heads]
                else:  # untouched: a region never writes another group's positions
                    exp = before[i][j][b].transpose(0, 1) if r.spec.layout.value == "HND" else before[i][j][b]
                assert torch.equal(got.contiguous().view(torch.uint8), exp.contiguous().view(torch.uint8)), \
                    (r.spec.name, j, b)


def test_grouped_ops_errors_launch_nothing():
    gen = torch.Generator().manual_seed(2)
    src_regs, dst_regs = _regions(1, 0, "NHD", gen), _regions(2, 1, "HND", gen)
    read = build_plan(1, 2, [r.spec for r in dst_regs], 1, [r.spec for r in src_regs]).staged[0]
    staging = torch.full((read.payload_bytes((2, 3, 1)),), 7, dtype=torch.uint8)
    offs = read.segment_offsets((2, 3, 1))
    ids = torch.tensor([3, 4, 7, 8, 9, 11])
    for groups, match in (((2, 4), "group 2"), ((2, 3, 2), "add up"), ((3, 3, -1), "non-negative")):
        with pytest.raises(LaunchError, match=match):
            ops.pack(src_regs, read.segments, offs, ids, staging, impl="torch", groups=groups)
    bad_ids = torch.tensor([3, 4, 7, 8, 9, 99])  # the last group's id is out of range: no group is packed
    with pytest.raises(LaunchError):
        ops.pack(src_regs, read.segments, offs, bad_ids, staging, impl="torch", groups=(2, 3, 1))
    assert bool((staging == 7).all())
