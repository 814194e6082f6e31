import pytest
import torch

from kvtriton.errors import RegionError
from kvtriton.regions import Kind, Layout, Region, classify_layer


def kv(*shape, dtype=torch.bfloat16):
    return torch.randint(-100, 100, shape).to(dtype)


def test_attention_separate_nhd_spec():
    k, v = kv(10, 16, 2, 128), kv(10, 16, 2, 64)
    r = Region.attention("l0", k, v, block_size=16, total_heads=8)
    s = r.spec
    assert (s.kind, s.layout, s.num_blocks, s.block_size, s.local_heads, s.total_heads) == (
        Kind.SPLIT, Layout.NHD, 10, 16, 2, 8)
    assert s.head_dims == (128, 64) and s.dtype == "bfloat16" and s.itemsize == 2
    assert s.strides == ((16 * 2 * 128, 2 * 128, 128), (16 * 2 * 64, 2 * 64, 64))
    assert s.block_is_dense(0) and s.block_is_dense(1)
    assert r.streams[0].data_ptr() == k.data_ptr()  # a view, never a copy


@pytest.mark.parametrize("kv_dim", [0, 1])
def test_attention_joint_hnd(kv_dim):
    shape = [6, 4, 8, 32]
    shape.insert(kv_dim, 2)
    t = kv(*shape)
    r = Region.attention("l0", kv=t, kv_dim=kv_dim, layout="hnd", block_size=8, total_heads=4)
    assert r.spec.layout is Layout.HND and r.spec.local_heads == 4 and r.spec.num_streams == 2
    assert r.streams[1].data_ptr() == t.select(kv_dim, 1).data_ptr()
    # [nb, 2, ...] interleaves K and V per block: blocks are dense but not back to back
    assert r.spec.strides[0][0] == (2 * 4 * 8 * 32 if kv_dim == 1 else 4 * 8 * 32)
    assert r.nhd(0).shape == (6, 8, 4, 32)


def test_mla_region():
    lat = kv(12, 16, 576)
    r = Region.mla("mla", lat, block_size=16)
    assert r.spec.kind is Kind.REPLICATE and r.spec.local_heads == 1 and r.spec.head_dims == (576,)
    assert r.spec.block_is_dense(0)


@pytest.mark.parametrize(
    "build,match",
    [
        # declared HND, but the tensor is NHD: block_size sits at the wrong dimension
        (lambda: Region.attention("x", kv(4, 16, 2, 8), layout="HND", block_size=16, total_heads=2),
         r"region 'x'.*expected \(4, 16, 16, 8\).*HND"),
        (lambda: Region.attention("x", kv(4, 16, 8), block_size=16, total_heads=2), "must be 4-D"),
        (lambda: Region.attention("x", kv(4, 16, 2, 8), kv(4, 16, 4, 8), block_size=16, total_heads=8),
         r"stream 1 has shape \(4, 16, 4, 8\), expected \(4, 16, 2, 8\)"),
        (lambda: Region.attention("x", kv(4, 16, 2, 8), kv(4, 16, 2, 8, dtype=torch.float16),
                                  block_size=16, total_heads=2), "all streams must match"),
        (lambda: Region.attention("x", kv(4, 16, 8, 2).transpose(2, 3), block_size=16, total_heads=2),
         "head_dim stride"),
        (lambda: Region.attention("x", kv=kv(4, 3, 16, 2, 8), block_size=16, total_heads=2), "size 2 at kv_dim"),
        (lambda: Region.attention("x", kv(4, 16, 4, 8), block_size=16, total_heads=2), "more than total_heads"),
        (lambda: Region.attention("x", kv(4, 16, 2, 8), layout="XYZ", block_size=16, total_heads=2), "unknown layout"),
        (lambda: Region.mla("m", kv(4, 16, 2, 8), block_size=16), r"\[num_blocks, block_size, head_dim\]"),
        (lambda: Region.attention("x", kv(4, 16, 2, 8), block_size=16, total_heads=4, kind="replicate"),
         "REPLICATE region holds every head"),
    ],
)
def test_bad_regions_raise_typed_errors(build, match):
    with pytest.raises(RegionError, match=match):
        build()


def test_classify_layer():
    assert classify_layer("GQA") is Kind.SPLIT and classify_layer("mla") is Kind.REPLICATE
    with pytest.raises(RegionError, match="unknown layer type"):
        classify_layer("mamba")
