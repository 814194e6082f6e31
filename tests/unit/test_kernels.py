"""Triton pack/unpack against the torch reference, byte for byte.

On a CPU machine the kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1
before anything is imported), which runs a few hundred programs/s: geometry is tiny there (block_size
3, head_dim 12, a handful of blocks) except in the dtype/head_dim test, which uses the real head
dims on 2 blocks. On a CUDA machine the same tests run with serving-sized blocks.

Every output is guarded: staging lives inside a larger canary-filled buffer, and whole cache
storages (padding included) are compared against the reference and against a snapshot outside
the (block, head) ranges an unpack may write. All data is random bits, never zeros, so a kernel
that writes nothing (or the wrong bytes) fails.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kvtriton import LaunchError, Layout, Region, Segment, build_plan, ops
from kvtriton.kernels import segment_table
from kvtriton.kernels._addressing import _row_offsets
from kvtriton.ops import heuristics, pack_reference, unpack_reference
from kvtriton.plan import Route
from kvtriton.testing.oracle import (
    RegionModel,
    check_destination,
    load_source,
    local_transfer,
    make_global_kv,
    make_rank_regions,
    snapshot,
)

ON_GPU = torch.cuda.is_available()
BS = 16 if ON_GPU else 3  # tokens per block (3: tiles of a non-power-of-two row count)
NB = 64 if ON_GPU else 6  # blocks per cache
HD = 128 if ON_GPU else 12  # head_dim of the layout/storage grid (12: masked row words)
GUARD = 64  # canary bytes on each side of a staging buffer (a multiple of 16: keeps alignment)
CANARY = 0xA5

LAYOUTS = ["NHD", "HND"]
# (storage, pad_blocks): pad > 0 makes every block stride larger than a block (non-contiguous)
STORAGES = [("separate", 0), ("joint", 0), ("joint0", 0), ("separate", 3), ("joint", 1)]
SLICE_POS = [0, 1, 2]  # head slice at the start / middle / end of the source (pack) or local block
DTYPES = [torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32]
HEAD_DIMS = [64, 80, 96, 128, 192, 576]


@pytest.fixture(autouse=True)
def _no_impl_override(monkeypatch):
    """KVTRITON_IMPL would silently turn impl='triton' into the reference under test."""
    monkeypatch.delenv("KVTRITON_IMPL", raising=False)


# --------------------------------------------------------------------------- helpers
def assert_bytes_equal(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    g, e = got.reshape(-1).view(torch.uint8).cpu(), expected.reshape(-1).view(torch.uint8).cpu()
    assert g.shape == e.shape, f"{what}: {g.numel()} bytes vs {e.numel()} expected"
    if not torch.equal(g, e):
        bad = torch.nonzero(g != e).flatten()
        raise AssertionError(f"{what}: {bad.numel()} of {g.numel()} bytes differ; first at {bad[:5].tolist()}")


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of the allocation under ``t`` (padding and other streams included)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def all_storages(regions) -> list[torch.Tensor]:
    seen, out = set(), []
    for r in regions:
        for t in r.streams:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                out.append(storage_bytes(t))
    return out


def guarded(nbytes: int, device, gen: torch.Generator, lead: int = GUARD):
    """(buffer, staging): ``nbytes`` of random staging at byte ``lead`` of a canary-filled buffer."""
    buf = torch.full((lead + nbytes + GUARD,), CANARY, dtype=torch.uint8)
    buf[lead:lead + nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    buf = buf.to(device)
    return buf, buf[lead:lead + nbytes]


def assert_canaries(buf: torch.Tensor, lead: int, nbytes: int) -> None:
    b = buf.cpu()
    for name, band in (("leading", b[:lead]), ("trailing", b[lead + nbytes:])):
        if not bool((band == CANARY).all()):
            bad = torch.nonzero(band != CANARY).flatten()
            raise AssertionError(f"{name} guard band overwritten at {bad[:5].tolist()}")


def regions_for(models, rank, tp, *, layout="NHD", storage="separate", pad=0, seed=0, device="cpu"):
    return make_rank_regions(models, rank, tp, NB, BS, layout=layout, storage=storage, pad_blocks=pad,
                             gen=torch.Generator().manual_seed(seed), device=device)


def pack_request(src_specs, dst_specs, src_rank, src_tp, dst_tp, n, modes=None):
    """Segments and offsets for one pack launch serving every destination rank that reads from
    ``src_rank``: each destination's payload at its own base, concatenated."""
    segs, offs, base = [], [], 0
    for d in range(dst_tp):
        read = build_plan(d, dst_tp, dst_specs, src_tp, src_specs, modes=modes).payload(src_rank)
        if read is None:
            continue
        segs += read.segments
        offs += read.segment_offsets(n, base).tolist()
        base += read.payload_bytes(n)
    return segs, np.asarray(offs, dtype=np.int64), base


def unpack_request(dst_specs, src_specs, dst_rank, src_tp, dst_tp, n, modes=None):
    """Segments and offsets for one unpack launch assembling ``dst_rank``'s blocks from every
    source rank's payload (D < P: several sources per block)."""
    plan = build_plan(dst_rank, dst_tp, dst_specs, src_tp, src_specs, modes=modes)
    segs, offs, base = [], [], 0
    for read in plan.staged:
        segs += read.segments
        offs += read.segment_offsets(n, base).tolist()
        base += read.payload_bytes(n)
    return segs, np.asarray(offs, dtype=np.int64), base


def check_pack(src, segs, offs, ids, nbytes, device, gen, lead=GUARD):
    """ops.pack (Triton) and pack_reference on identical guarded staging: equal bytes, intact
    canaries, untouched source caches, and the reference really wrote something."""
    buf_t, st_t = guarded(nbytes, device, gen, lead)
    buf_r = buf_t.clone()
    st_r = buf_r[lead:lead + nbytes]
    before = [s.clone() for s in all_storages(src)]
    initial = st_r.clone()
    out = ops.pack(src, segs, offs, ids, st_t, impl="triton", pair_ids=ids)  # -1s: skipped on both sides
    assert out is st_t
    pack_reference(src, segs, offs, ids, st_r)
    assert_bytes_equal(buf_t, buf_r, "staging (Triton vs reference)")
    assert_canaries(buf_t, lead, nbytes)
    for b, a in zip(before, all_storages(src)):
        assert_bytes_equal(a, b, "source cache after pack")
    valid = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids) >= 0
    if valid.any() and segs:
        assert not torch.equal(st_r, initial), "vacuous case: the reference wrote nothing"
    return st_t


def check_unpack(make_dst, segs, offs, ids, nbytes, device, gen):
    """ops.unpack (Triton) vs unpack_reference on identical caches and staging: equal cache
    storages (padding included), untouched bytes outside the written (block, head) ranges,
    unchanged staging and canaries. Returns the Triton-unpacked regions."""
    dst_t, dst_r = make_dst(), make_dst()
    for a, b in zip(all_storages(dst_t), all_storages(dst_r)):
        assert_bytes_equal(a, b, "identical destination caches (test setup)")
    before = snapshot(dst_t)
    buf, st = guarded(nbytes, device, gen)
    buf_before = buf.clone()
    ops.unpack(dst_t, segs, offs, ids, st, impl="triton", pair_ids=ids)
    unpack_reference(dst_r, segs, offs, ids, st)
    for a, b in zip(all_storages(dst_t), all_storages(dst_r)):
        assert_bytes_equal(a, b, "destination cache storage (Triton vs reference)")
    assert_bytes_equal(buf, buf_before, "staging after unpack")
    ids_np = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64)
    blocks = torch.as_tensor(ids_np[ids_np >= 0])
    for ri, region in enumerate(dst_t):
        for j in range(region.spec.num_streams):
            got = region.nhd(j).view(torch.uint8).cpu()
            may_write = torch.zeros(got.shape[:3], dtype=torch.bool)
            for s in segs:
                if s.region == ri and s.stream == j:
                    may_write[blocks, :, s.dst_head:s.dst_head + s.num_heads] = True
            keep = ~may_write
            assert_bytes_equal(got[keep], before[ri][j].cpu()[keep],
                               f"region {ri} stream {j}: bytes outside the written blocks/heads")
            if blocks.numel() and may_write.any():
                assert not torch.equal(got[may_write], before[ri][j].cpu()[may_write]), "vacuous unpack"
    return dst_t


def random_ids(n: int, num_blocks: int, gen: torch.Generator, unique: bool) -> torch.Tensor:
    if unique:
        return torch.randperm(num_blocks, generator=gen)[:n]
    return torch.randint(0, num_blocks, (n,), generator=gen)


# --------------------------------------------------------------------------- layouts x storage x slices
@pytest.mark.parametrize("pos", SLICE_POS)
@pytest.mark.parametrize("storage,pad", STORAGES)
@pytest.mark.parametrize("dst_layout", LAYOUTS)
@pytest.mark.parametrize("src_layout", LAYOUTS)
def test_pack_layouts_storage_slices(src_layout, dst_layout, storage, pad, pos, device, gen):
    # 6 heads: source TP1 holds all 6, destination TP3 rank `pos` reads heads [2*pos, 2*pos+2).
    models = [RegionModel.gqa("l0", 6, HD, torch.bfloat16)]
    src = regions_for(models, 0, 1, layout=src_layout, storage=storage, pad=pad, device=device)
    dst_specs = [r.spec for r in regions_for(models, pos, 3, layout=dst_layout, device=device)]
    read = build_plan(pos, 3, dst_specs, 1, [r.spec for r in src]).staged[0]
    assert read.segments[0].src_head == 2 * pos
    n = 4
    ids = random_ids(n, NB, gen, unique=False)
    check_pack(src, read.segments, read.segment_offsets(n), ids, read.payload_bytes(n), device, gen)


@pytest.mark.parametrize("pos", SLICE_POS)
@pytest.mark.parametrize("storage,pad", STORAGES)
@pytest.mark.parametrize("dst_layout", LAYOUTS)
def test_unpack_layouts_storage_slices(dst_layout, storage, pad, pos, device, gen):
    # Source TP3 rank `pos` sends its 2 heads; the TP1 destination places them at head 2*pos.
    models = [RegionModel.gqa("l0", 6, HD, torch.bfloat16)]
    src_specs = [r.spec for r in regions_for(models, pos, 3, device=device)]

    def make_dst():
        return regions_for(models, 0, 1, layout=dst_layout, storage=storage, pad=pad, seed=7, device=device)

    read = build_plan(0, 1, [r.spec for r in make_dst()], 3, src_specs).payload(pos)
    assert read.segments[0].dst_head == 2 * pos
    n = 4
    ids = random_ids(n, NB, gen, unique=True)
    check_unpack(make_dst, read.segments, read.segment_offsets(n), ids, read.payload_bytes(n), device, gen)


# --------------------------------------------------------------------------- dtypes x head dims
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_dtypes_head_dims_round_trip(dtype, head_dim, device, gen):
    """Pack on a TP1 source, unpack on rank 1 of a TP2 destination (other layout), 2 blocks."""
    models = [RegionModel.gqa("l0", 2, head_dim, dtype)]
    src_layout, dst_layout = ("NHD", "HND") if HEAD_DIMS.index(head_dim) % 2 == 0 else ("HND", "NHD")
    src = regions_for(models, 0, 1, layout=src_layout, device=device)

    def make_dst():
        return regions_for(models, 1, 2, layout=dst_layout, seed=3, device=device)

    read = build_plan(1, 2, [r.spec for r in make_dst()], 1, [r.spec for r in src]).staged[0]
    n = 2
    src_ids, dst_ids = torch.tensor([NB - 1, 0]), torch.tensor([1, NB - 2])
    offs = read.segment_offsets(n)
    staging = check_pack(src, read.segments, offs, src_ids, read.payload_bytes(n), device, gen)
    # The staged bytes round-trip: unpack the packed payload and compare the heads directly.
    dst = make_dst()
    ops.unpack(dst, read.segments, offs, dst_ids, staging, impl="triton")
    for j in range(2):
        got = dst[0].nhd(j)[dst_ids.to(device)].view(torch.uint8)
        want = src[0].nhd(j)[src_ids.to(device), :, 1:2].view(torch.uint8)
        assert_bytes_equal(got, want, f"stream {j} after round trip")
    check_unpack(make_dst, read.segments, offs, dst_ids, read.payload_bytes(n), device, gen)


# --------------------------------------------------------------------------- block ids
@pytest.mark.parametrize(
    "ids",
    [[3, 0, 3, 5], [5, -1, 0, -1], [-1, -1], [NB - 1, 2, 1, 0, 2]],
    ids=["duplicates", "padding", "all-padding", "unsorted-dup"],
)
@pytest.mark.parametrize("kind", ["int64", "int32", "numpy", "list"])
def test_pack_block_ids(ids, kind, device, gen):
    models = [RegionModel.gqa("l0", 4, HD, torch.float16)]
    src = regions_for(models, 1, 2, layout="HND", device=device)
    dst_specs = [r.spec for r in regions_for(models, 3, 4, device=device)]
    read = build_plan(3, 4, dst_specs, 2, [r.spec for r in src]).staged[0]
    n = len(ids)
    given = {"int64": torch.tensor(ids, device=device), "int32": torch.tensor(ids, dtype=torch.int32, device=device),
             "numpy": np.asarray(ids), "list": list(ids)}[kind]
    check_pack(src, read.segments, read.segment_offsets(n), given, read.payload_bytes(n), device, gen)


@pytest.mark.parametrize("ids", [[4, -1, 0, 2], [NB - 1, 0], [-1, 3, -1]], ids=["padding", "unsorted", "sparse"])
def test_unpack_block_ids(ids, device, gen):
    models = [RegionModel.gqa("l0", 4, HD, torch.float32)]

    def make_dst():
        return regions_for(models, 0, 2, layout="NHD", storage="joint", seed=5, device=device)

    src_specs = [r.spec for r in regions_for(models, 0, 4, device=device)]
    read = build_plan(0, 2, [r.spec for r in make_dst()], 4, src_specs).payload(0)
    n = len(ids)
    check_unpack(make_dst, read.segments, read.segment_offsets(n), torch.tensor(ids, dtype=torch.int32),
                 read.payload_bytes(n), device, gen)


def test_empty_requests(device, gen):
    models = [RegionModel.gqa("l0", 2, HD, torch.bfloat16)]
    src = regions_for(models, 0, 1, device=device)
    dst = regions_for(models, 1, 2, device=device, seed=1)
    read = build_plan(1, 2, [r.spec for r in dst], 1, [r.spec for r in src]).staged[0]
    buf, st = guarded(256, device, gen)
    buf0 = buf.clone()
    before = [s.clone() for s in all_storages(dst)]
    empty = torch.zeros(0, dtype=torch.int64)
    assert ops.pack(src, read.segments, read.segment_offsets(0), empty, st, impl="triton") is st
    assert ops.pack(src, [], [], torch.tensor([1, 2]), st, impl="triton") is st
    ops.unpack(dst, read.segments, read.segment_offsets(0), [], st, impl="triton")
    ops.unpack(dst, [], [], [0, 1], st, impl="triton")
    assert_bytes_equal(buf, buf0, "staging after empty requests")
    for b, a in zip(before, all_storages(dst)):
        assert_bytes_equal(a, b, "cache after empty requests")


# --------------------------------------------------------------------------- several sources / destinations
@pytest.mark.parametrize("src_tp,dst_tp,heads", [(2, 4, 8), (2, 3, 6), (1, 4, 2)])
def test_pack_serves_every_destination_in_one_launch(src_tp, dst_tp, heads, device, gen):
    models = [RegionModel.gqa("a", heads, HD, torch.bfloat16), RegionModel.gqa("b", heads, HD, torch.float8_e4m3fn)]
    src = regions_for(models, src_tp - 1, src_tp, layout="NHD", storage="joint0", device=device)
    dst_specs = [r.spec for r in regions_for(models, 0, dst_tp, layout="HND", device=device)]
    n = 3
    segs, offs, nbytes = pack_request([r.spec for r in src], dst_specs, src_tp - 1, src_tp, dst_tp, n)
    assert len(segs) >= 4
    check_pack(src, segs, offs, random_ids(n, NB, gen, unique=False), nbytes, device, gen)


@pytest.mark.parametrize("src_tp,dst_tp,heads", [(4, 1, 4), (4, 2, 8), (2, 3, 6)])
def test_unpack_assembles_block_from_several_sources(src_tp, dst_tp, heads, device, gen):
    """D < P (and non-dividing P2 -> D3): one unpack launch writes each local block from every
    source's payload, each at its own staging offset and head offset."""
    models = [RegionModel.gqa("l0", heads, HD, torch.bfloat16)]
    src_specs = [r.spec for r in regions_for(models, 0, src_tp, device=device)]

    rank = dst_tp // 2  # P2 -> D3: rank 1 holds heads 2-3, split between P0 and P1

    def make_dst():
        return regions_for(models, rank, dst_tp, layout="HND", storage="joint", seed=11, device=device)

    n = 3
    segs, offs, nbytes = unpack_request([r.spec for r in make_dst()], src_specs, rank, src_tp, dst_tp, n)
    assert len({(s.dst_head, s.num_heads) for s in segs}) >= 2, "expected several sources per block"
    check_unpack(make_dst, segs, offs, random_ids(n, NB, gen, unique=True), nbytes, device, gen)


# --------------------------------------------------------------------------- word widths
@pytest.mark.parametrize(
    "dtype,pad,lead,word",
    [
        (torch.bfloat16, 0, GUARD, 8),  # aligned: 16-byte accesses of int64 words
        (torch.float32, 1, GUARD, 4),  # 36-byte token strides -> int32 words
        (torch.bfloat16, 3, GUARD, 2),  # 22-byte token strides -> int16 words
        (torch.float8_e4m3fn, 1, GUARD, 1),  # 9-byte token strides -> bytes
        (torch.bfloat16, 0, GUARD + 3, 1),  # staging at an odd address -> bytes
    ],
)
def test_word_width_follows_alignment(dtype, pad, lead, word, device, gen):
    # head_dim 8, HND source (token stride = padded row), one head per destination rank.
    models = [RegionModel.gqa("l0", 2, 8, dtype)]
    src = regions_for(models, 0, 1, layout="HND", pad=pad, device=device)

    def make_dst():
        return regions_for(models, 0, 2, layout="HND", pad=pad, seed=2, device=device)

    read = build_plan(0, 2, [r.spec for r in make_dst()], 1, [r.spec for r in src]).staged[0]
    n = 3
    offs, nbytes = read.segment_offsets(n), read.payload_bytes(n)
    buf, st = guarded(nbytes, device, gen, lead)
    ids = random_ids(n, NB, gen, unique=False)
    cfg = ops.launch_config_for("pack", src, read.segments, offs, ids, st)
    assert cfg.word_bytes == word
    assert cfg.word_bytes * cfg.vec == min(16, cfg.align)
    check_pack(src, read.segments, offs, ids, nbytes, device, gen, lead=lead)
    check_unpack(make_dst, read.segments, offs, random_ids(n, NB, gen, unique=True), nbytes, device, gen)


# --------------------------------------------------------------------------- mixed SPLIT + REPLICATE
@pytest.mark.parametrize("modes", [None, "staged"])
def test_mixed_split_and_replicate_cache(modes, device, gen):
    """A GQA target with an MLA draft: by default the MLA region moves DIRECT, so pack never
    stages it and unpack never touches it; forced STAGED, it goes through the kernels too."""
    models = [RegionModel.gqa("gqa", 4, HD, torch.bfloat16), RegionModel.mla("mla", 2 * HD)]
    src = regions_for(models, 0, 2, device=device)

    def make_dst():
        return regions_for(models, 1, 4, layout="HND", seed=4, device=device)

    dst_specs = [r.spec for r in make_dst()]
    plan = build_plan(1, 4, dst_specs, 2, [r.spec for r in src], modes=modes)
    want = Route.STAGED if modes else Route.DIRECT
    assert plan.modes[1] is want
    n = 3
    segs, offs, nbytes = unpack_request(dst_specs, [r.spec for r in src], 1, 2, 4, n, modes=modes)
    assert any(s.region == 1 for s in segs) == (modes == "staged")
    src_segs, src_offs, src_bytes = pack_request([r.spec for r in src], dst_specs, 0, 2, 4, n, modes=modes)
    check_pack(src, src_segs, src_offs, random_ids(n, NB, gen, unique=False), src_bytes, device, gen)
    dst = check_unpack(make_dst, segs, offs, random_ids(n, NB, gen, unique=True), nbytes, device, gen)
    if modes is None:  # check_unpack already proved the DIRECT region unchanged; say so explicitly
        assert not any(s.region == 1 for s in segs)
    assert dst[1].spec.kind.value == "replicate"


# --------------------------------------------------------------------------- end to end
def _on_device_pack(regions, segs, offs, ids, staging):
    """local_transfer allocates CPU staging; stage on the regions' device and copy back."""
    dev = regions[0].device
    st = torch.empty_like(staging, device=dev)
    ops.pack(regions, segs, offs, ids, st, impl="triton")
    staging.copy_(st.cpu())
    return staging


def _on_device_unpack(regions, segs, offs, ids, staging):
    ops.unpack(regions, segs, offs, ids, staging.to(regions[0].device), impl="triton")


@pytest.mark.parametrize(
    "src_tp,dst_tp,src_layout,dst_layout",
    [(1, 2, "NHD", "HND"), (4, 2, "HND", "NHD"), (2, 3, "NHD", "NHD")],
)
def test_end_to_end_local_transfer(src_tp, dst_tp, src_layout, dst_layout, device, gen):
    heads = 6 if 3 in (src_tp, dst_tp) else 4
    models = [RegionModel.gqa("l0", heads, HD, torch.bfloat16), RegionModel.mla("mla", HD)]
    srcs = [regions_for(models, r, src_tp, layout=src_layout, seed=20 + r, device=device) for r in range(src_tp)]
    dsts = [regions_for(models, r, dst_tp, layout=dst_layout, seed=40 + r, device=device) for r in range(dst_tp)]
    n = 3
    global_kv = make_global_kv(models, n, BS, gen)
    src_ids = [NB - 1, 0, 2]
    dst_ids = [1, NB - 2, 3]
    for r, regs in enumerate(srcs):
        load_source(regs, r, src_tp, global_kv, src_ids)
    before = [snapshot(regs) for regs in dsts]
    stats = local_transfer(srcs, dsts, src_ids, dst_ids, pack=_on_device_pack, unpack=_on_device_unpack)
    assert stats["staged_descs"] > 0
    for r, regs in enumerate(dsts):
        check_destination(regs, r, dst_tp, global_kv, dst_ids, before[r])


# --------------------------------------------------------------------------- int64 address math
@triton.jit
def _row_offsets_probe(
    out_ptr,  # [BLOCK] int64: word offsets computed by _row_offsets
    tiles_ptr,  # [BLOCK] int32: block ids
    rows_ptr,  # [BLOCK] int32: token-major row indices
    num_heads, s_tile, s_tok, s_head,
    BLOCK: tl.constexpr,
):
    i = tl.arange(0, BLOCK)
    tiles = tl.load(tiles_ptr + i)
    rows = tl.load(rows_ptr + i)
    tl.store(out_ptr + i, _row_offsets(tiles, rows, num_heads, s_tile, s_tok, s_head, 1))


@pytest.mark.parametrize(
    "num_heads,s_tile,s_tok,s_head",
    [
        (8, 65536, 1024, 128),  # 64 KiB-word blocks: block 2^20 is 2^36 words in
        (4, 2**31 + 64, 512, 128),  # a block stride that itself exceeds int32
        (2, 3 * 2**20 + 5, 2**20 + 1, 2**19),  # odd strides, token stride x token > 2^31
    ],
)
def test_row_offsets_are_int64(num_heads, s_tile, s_tok, s_head, device):
    """The kernels' shared address helper on block ids ~2^20-2^30 and strides whose products
    exceed 2^31, against Python ints. Ids arrive as int32 (as a planner may pass them) and
    strides as small scalars (int32 in the interpreter): only the helper's casts keep it exact."""
    block = 16
    tiles = [2**20, 2**20 + 7, 2**30, 2**31 - 1, 0, 1, 12345, 2**24 + 3] * 2
    rows = [0, 1, 2, 3, 4, 5, 7, 2047] * 2
    rows = [r % (num_heads * 4096) for r in rows]
    out = torch.zeros(block, dtype=torch.int64, device=device)
    _row_offsets_probe[(1,)](out, torch.tensor(tiles, dtype=torch.int32, device=device),
                             torch.tensor(rows, dtype=torch.int32, device=device),
                             num_heads, s_tile, s_tok, s_head, BLOCK=block)
    want = [t * s_tile + (r // num_heads) * s_tok + (r % num_heads) * s_head for t, r in zip(tiles, rows)]
    assert max(want) > 2**31
    assert out.cpu().tolist() == want


# --------------------------------------------------------------------------- launch configuration
@pytest.mark.parametrize("max_rows", [1, 2, 16, 128, 1000])
@pytest.mark.parametrize("row_words", [1, 2, 10, 16, 20, 32, 72, 144, 288])
@pytest.mark.parametrize("word,vec", [(8, 2), (8, 1), (4, 1), (2, 1), (1, 1)])
def test_launch_config_invariants(max_rows, row_words, word, vec):
    if row_words % vec:
        pytest.skip("rows are a multiple of vec words by construction")
    block_r, block_w, warps = heuristics.tile_config(max_rows, row_words, word, vec)
    for v in (block_r, block_w, warps):
        assert v >= 1 and v & (v - 1) == 0, (block_r, block_w, warps)
    assert vec <= block_w <= max(vec, 1024 // word)
    assert block_r <= triton.next_power_of_2(max_rows)
    assert block_r * block_w * word <= 8192 or block_r == 1
    assert 1 <= warps <= 8
    # never more than 50% of a row's lanes masked unless the row is narrower than a vector
    padded = -(-row_words // block_w) * block_w
    assert padded < 2 * row_words or block_w == vec


def test_launch_config_typical_geometries():
    # Llama-style head_dim 128 bf16 (256 B rows = 32 int64 words), 16 tokens x 1 head.
    assert heuristics.tile_config(16, 32, 8, 2) == (16, 32, 2)
    # 8 heads x 16 tokens: 8 KiB inner tiles, 4 warps.
    assert heuristics.tile_config(128, 32, 8, 2) == (32, 32, 4)
    # 576-dim bf16 MLA rows (144 words) loop over 64-word chunks rather than masking 256.
    assert heuristics.tile_config(16, 144, 8, 2)[1] == 64
    assert heuristics.word_config(16) == (8, 2)
    assert heuristics.word_config(8) == (8, 1)
    assert heuristics.word_config(4) == (4, 1)
    assert heuristics.word_config(1) == (1, 1)
    with pytest.raises(LaunchError):
        heuristics.tile_config(0, 32, 8, 2)


# --------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_cuda_launch_does_not_synchronize(gen):
    """pack/unpack with CPU or device ids queue work without a host sync (sync debug mode)."""
    device = "cuda"
    models = [RegionModel.gqa("l0", 8, 128, torch.bfloat16)]
    src = make_rank_regions(models, 0, 1, 64, 16, gen=gen, device=device)
    dst = make_rank_regions(models, 1, 2, 64, 16, layout="HND", gen=gen, device=device)
    read = build_plan(1, 2, [r.spec for r in dst], 1, [r.spec for r in src]).staged[0]
    n = 8
    staging = torch.empty(read.payload_bytes(n), dtype=torch.uint8, device=device)
    offs = read.segment_offsets(n)
    for ids in ([1, 5, 9, 2, 0, 3, 4, 7], torch.arange(n, device=device)):  # warm up (compile) first
        ops.pack(src, read.segments, offs, ids, staging)
        ops.unpack(dst, read.segments, offs, ids, staging)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ids in ([1, 5, 9, 2, 0, 3, 4, 7], torch.arange(n, device=device)):
            ops.pack(src, read.segments, offs, ids, staging)
            ops.unpack(dst, read.segments, offs, ids, staging)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.slow
def test_large_cache_over_2_31_elements():
    """A real cache of more than 2^31 elements (4.3 GB bf16): blocks near the end round-trip."""
    device = "cuda"
    nb, bs, heads, hd = 65600, 16, 8, 128  # 65600 blocks x 2 streams x 16384 = 2.15e9 elements
    kv = torch.empty(nb, 2, bs, heads, hd, dtype=torch.bfloat16, device=device)
    assert kv.numel() > 2**31
    region = Region.attention("big", kv=kv, block_size=bs, total_heads=16)
    src_ids = torch.tensor([nb - 1, 65536, 70, nb - 3], device=device)
    dst_ids = torch.tensor([5, nb - 2, 65537, 65599 - 10], device=device)
    written = torch.cat([src_ids, dst_ids])
    kv.view(torch.int16)[written] = torch.randint(-2**15, 2**15, (written.numel(), 2, bs, heads, hd),
                                                  dtype=torch.int16, device=device)
    segs = tuple(Segment(0, k, 2, 2, 4, hd, 2, bs, Layout.HND) for k in range(2))
    n = src_ids.numel()
    tile = segs[0].tile_bytes
    offs = np.array([0, n * tile])
    st_t = torch.empty(2 * n * tile, dtype=torch.uint8, device=device)
    st_r = torch.empty_like(st_t)
    ops.pack([region], segs, offs, src_ids, st_t, impl="triton")
    pack_reference([region], segs, offs, src_ids, st_r)
    assert_bytes_equal(st_t, st_r, "staging from a >2^31-element cache")
    # Unpack needs tiles in the local (NHD) layout.
    segs_nhd = tuple(dataclasses.replace(s, dst_layout=Layout.NHD) for s in segs)
    ops.pack([region], segs_nhd, offs, src_ids, st_t, impl="triton")
    neighbours = torch.tensor([4, 6, nb - 1, nb - 3], device=device)  # not in dst_ids
    before = kv[neighbours].clone()
    ops.unpack([region], segs_nhd, offs, dst_ids, st_t, impl="triton")
    torch.cuda.synchronize()
    for k in range(2):
        got = kv[dst_ids, k, :, 2:6].view(torch.uint8)
        want = kv[src_ids, k, :, 2:6].view(torch.uint8)
        assert_bytes_equal(got, want, f"stream {k} after round trip")
    assert_bytes_equal(kv[neighbours], before, "neighbouring blocks")


def test_segment_table_columns_are_named_once():
    """Every column of the kernels' segment table has one index, the indices are 0..NUM_FIELDS-1,
    and everything but the cache address and the three counts is converted to words."""
    cols = {k: v for k, v in vars(segment_table).items() if k.isupper() and isinstance(v, int) and k != "NUM_FIELDS"}
    assert sorted(cols.values()) == list(range(segment_table.NUM_FIELDS))
    counts_and_address = {segment_table.CACHE_ADDR, segment_table.NUM_HEADS, segment_table.BLOCK_SIZE,
                          segment_table.CACHE_BLOCK_SIZE}
    assert set(segment_table.WORD_COLUMNS) == set(cols.values()) - counts_and_address
