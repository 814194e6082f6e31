import msgpack
import pytest
import torch

from kvtriton import wire
from kvtriton.errors import ProtocolError, StagingError
from kvtriton.regions import Region
from kvtriton.staging import StagingPool


def sample_md(**over) -> wire.RankMetadata:
    k = torch.zeros(8, 4, 2, 16, dtype=torch.float16)
    r = Region.attention("l0", k, k.clone(), block_size=4, total_heads=4)
    spans = tuple(wire.stream_span(r.spec, j) for j in range(2))
    md = dict(engine="P", rank=1, tp=2, agent="P:1:x", agent_md=b"\x00nixl", mem="DRAM", dev=0,
              regions=(r.spec,), addrs=((4096, 1 << 20),), spans=(spans,),
              staging=wire.StagingInfo(1 << 30, 4096, 16, 8192))
    md.update(over)
    return wire.RankMetadata(**md)


def test_metadata_round_trip():
    md = sample_md()
    assert wire.decode_metadata(wire.encode_metadata(md)) == md


def patched(**changes):
    d = msgpack.unpackb(wire.encode_metadata(sample_md()), raw=False)
    for path, value in changes.items():
        target = d
        *parents, leaf = path.split(".")
        for p in parents:
            target = target[int(p)] if isinstance(target, list) else target[p]
        target[leaf] = value
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize(
    "data,match",
    [
        (b"\xc1garbage", "not valid msgpack"),
        (wire.encode_metadata(sample_md())[:40], "not valid msgpack"),
        (msgpack.packb([1, 2]), "expected a map"),
        (patched(v=99), "protocol version 99"),
        (patched(fmt=7), "wire format 7"),
        (patched(rank=2), "'rank' = 2 is outside"),
        (patched(tp="2"), "'tp' must be int"),
        (patched(mem="HBM"), "mem must be DRAM or VRAM"),
        (patched(**{"staging.num_slots": 0}), "num_slots"),
        (patched(**{"staging.chunk_bytes": 1 << 20}), "exceeds the pool"),
        (patched(**{"regions.0.kind": "teleport"}), "region 0"),
        (patched(**{"regions.0.strides": [[1, 2, 3]]}), "2 triples"),
        (patched(**{"regions.0.spans": [64, 64]}), "declared span 64 bytes cannot hold 8 blocks"),
        (patched(**{"regions.0.addrs": [2**64 - 8, 0]}), "overflows"),
        (patched(**{"regions.0.head_dims": [16, -1]}), "head_dims"),
    ],
)
def test_bad_metadata_raises_protocol_error(data, match):
    with pytest.raises(ProtocolError, match=match):
        wire.decode_metadata(data)


def test_messages_validate_types():
    m = wire.decode_message(wire.encode_message("ack", xid="a", chunk=3))
    assert m == wire.Ack(xid="a", chunk=3)
    for raw, match in [
        (wire.encode_message("launch", xid="a"), "unknown type"),
        (wire.encode_message("ack", xid="a", chunk="3"), "'chunk' must be int"),
        (wire.encode_message("ack", xid="a"), "'chunk' must be int"),
        (wire.encode_message("pull", xid="a", req="r", dst_rank=0, ids=[1, "x"], chunk_blocks=1), "list of ints"),
        (msgpack.packb({"v": 0, "t": "ack"}), "version"),
        (b"\x93", "not valid msgpack"),
    ]:
        with pytest.raises(ProtocolError, match=match):
            wire.decode_message(raw)


def test_staging_pool_first_fit_runs():
    pool = StagingPool(8, 256)
    a = pool.alloc(3)
    b = pool.alloc(2)
    assert (a, b) == (0, 3)
    pool.free(a, 3)
    assert pool.alloc(4) is None  # three free slots at the front, no run of four
    assert pool.alloc(3) == 0  # reuses the freed run
    assert pool.alloc(3) == 5
    assert pool.alloc(1) is None  # full: callers queue
    assert pool.view(3, 300).numel() == 300 and pool.offset(3) == 768
    pool.free(0, 3)
    with pytest.raises(StagingError, match="not all allocated"):
        pool.free(0, 3)  # double free
    with pytest.raises(StagingError):
        pool.alloc(9)
    with pytest.raises(StagingError):
        StagingPool(4, 100)


def test_every_message_type_round_trips():
    msgs = [wire.Pull("x", "r", 0, (1, 2), 2, "p"), wire.Push("x", "r", 1, (1,), (3,), 1, "p"),
            wire.Grant("x", 0, 4, 2), wire.Ack("x", 0), wire.RunsDone("x"), wire.Done("r", 0, 2),
            wire.Abort("x"), wire.Renew("r", 1), wire.Ready("x", 1, 2, 3, 4), wire.Data("x", 1, 4), wire.RunsReady("x"),
            wire.Reject("x", "why")]
    assert {type(m) for m in msgs} == set(wire.MESSAGE_TYPES)
    for m in msgs:
        assert wire.decode_message(m.encode()) == m
    # the DIRECT runs' done travels as an ack of chunk -1 (the bytes peers already exchange)
    assert msgpack.unpackb(wire.RunsDone("x").encode()) == {"v": 1, "t": "ack", "xid": "x", "chunk": -1}
