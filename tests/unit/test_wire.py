import msgpack
import numpy as np
import pytest
import torch

from kvtriton.errors import ProtocolError, StagingError
from kvtriton.protocol import wire
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
    m = wire.decode_message(wire.encode_message("Ack", xid="a", chunk=3))
    assert m == wire.Ack(xid="a", chunk=3)
    for raw, match in [
        (wire.encode_message("Launch", xid="a"), "unknown type"),
        (wire.encode_message("Ack", xid="a", chunk="3"), "'chunk' must be int"),
        (wire.encode_message("Ack", xid="a"), "'chunk' must be int"),
        (wire.encode_message("Pull", xid="a", req="r", dst_rank=0, ids=[1, "x"], chunk_blocks=1), "list of ints"),
        (wire.encode_message("Pull", xid="a", req="r", dst_rank=0, ids=[1, True], chunk_blocks=1), "list of ints"),
        (wire.encode_message("Pull", xid="a", req="r", dst_rank=0, ids=[1, 2.0], chunk_blocks=1), "list of ints"),
        (wire.encode_message("Pull", xid="a", req="r", dst_rank=0, ids=[3, -1], chunk_blocks=1), "list of ints"),
        (wire.encode_message("Pull", xid="a", req="r", dst_rank=0, ids=[1 << 48], chunk_blocks=1), "list of ints"),
        (msgpack.packb({"v": 0, "t": "Ack"}), "version"),
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
            wire.Abort("x"), wire.Renew("r", 1), wire.Ready("x", 1, 2, 3, 4),
            wire.Offer("x", "r", "p", "h", 3, 2, (0, 2, 2, 1)), wire.Data("x", 1, 4), wire.RunsReady("x"),
            wire.Reject("x", "why"), wire.Ping(7), wire.Pong(7)]
    assert {type(m) for m in msgs} == set(wire.MESSAGE_TYPES)
    for m in msgs:
        assert wire.decode_message(m.encode()) == m
    # every message travels under its class name (protocol version 2), RunsDone as itself
    assert msgpack.unpackb(wire.RunsDone("x").encode()) == {"v": 2, "t": "RunsDone", "xid": "x"}
    assert all(wire.decode_message(m.encode()).TYPE == type(m).__name__ for m in msgs)


# --------------------------------------------------------------------------- hardening
@pytest.mark.parametrize("v", [True, 2.0, "2", None, 1, 3])
def test_version_must_be_the_int_2(v):
    with pytest.raises(ProtocolError, match="protocol version"):
        wire.decode_message(msgpack.packb({"v": v, "t": "Abort", "xid": "x"}))
    with pytest.raises(ProtocolError, match="protocol version"):
        wire.decode_metadata(patched(v=v))


@pytest.mark.parametrize("data,match", [
    (patched(engine=""), "'engine' must be 1..1024"),
    (patched(agent=""), "'agent' must be 1..1024"),
    (patched(**{"regions.0.name": ""}), "'name' must be 1..1024"),
    (patched(**{"regions.0.strides": [[True, 0, 0], [0, 0, 0]]}), "strides must be non-negative integers"),
    (patched(planning=[["cost", 1]]), "planning"),
    (patched(planning=[["cost", "a"], ["cost", "b"]]), "twice"),
])
def test_metadata_rejects_bools_empty_names_and_bad_planning(data, match):
    with pytest.raises(ProtocolError, match=match):
        wire.decode_metadata(data)


# the least and (exclusive) greatest value of every int field of every message type
def _int_range(t, name):
    return wire._MIN_INT.get((t, name), 0), wire._MAX_MSG_INT


def _valid_body(t, rng):
    _, schema = wire._SCHEMA[t]
    body = {}
    for name, typ in schema:
        if typ is int:
            lo, hi = _int_range(t, name)
            body[name] = int(rng.choice([lo, lo + 1, int(rng.integers(lo, 1 << 20)), hi - 1]))
        elif typ is list:
            body[name] = [int(x) for x in rng.integers(0, 1 << 40, size=int(rng.integers(0, 6)))]
        elif typ is bytes:  # integrity digests: none, or DIGEST_BYTES each (an Offer: one per chunk)
            n = int(rng.integers(0, 4 if t == "Offer" else 2)) * wire.DIGEST_BYTES
            body[name] = rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()
        else:
            body[name] = "".join(rng.choice(list("abc|<#:é"), size=int(rng.integers(1, 12))))
    return body


_WRONG = [None, True, False, 1.5, "7", b"\x01", [1], {"a": 1}, -(1 << 63), 1 << 63]


def _invalid_body(t, rng):
    """A message body that breaks exactly one rule (the decoder must refuse it)."""
    body = _valid_body(t, rng)
    _, schema = wire._SCHEMA[t]
    name, typ = schema[int(rng.integers(len(schema)))]
    how = int(rng.integers(5))
    if how == 0 and typ is not bytes:  # a digest may be absent (none sent)
        del body[name]
    elif how == 1:  # a value of another type (bools and floats are not ints, ints not strings)
        body[name] = next(w for w in rng.permutation(np.array(_WRONG, dtype=object)) if type(w) is not typ)
    elif how == 2 and typ is int:
        lo, hi = _int_range(t, name)
        body[name] = int(rng.choice([lo - 1, lo - 2, hi, hi + 5]))
    elif how == 2 and typ is bytes:
        body[name] = b"\1" * (wire.DIGEST_BYTES + 1)
    elif how == 3 and typ is list:
        body[name] = list(body[name]) + [rng.choice(np.array([-1, True, 1.0, "1", None, 1 << 48], dtype=object))]
    elif typ is str:
        body[name] = "" if how != 4 else "x" * 1025
    else:
        body = {**body, "v": rng.choice(np.array([True, 2.0, 0, 1, "2"], dtype=object))}
    return body


def test_fuzz_message_decoder():
    """12,000 seeded inputs: valid messages decode to what was sent, every input breaking one
    rule, every truncation and every random byte string raises ProtocolError (nothing else)."""
    rng = np.random.default_rng(1234)
    types = sorted(wire._SCHEMA)
    counts = {"valid": 0, "invalid": 0, "truncated": 0, "random": 0}
    untyped, accepted_invalid = [], []

    def decode(raw):
        try:
            return wire.decode_message(raw), None
        except ProtocolError as e:
            return None, e
        except Exception as e:  # noqa: BLE001 - the point of the test
            untyped.append((raw[:60], repr(e)))
            return None, e

    for i in range(12_000):
        t = types[i % len(types)]
        kind = ("valid", "invalid", "invalid", "truncated", "random")[i % 5]
        counts[kind] += 1
        if kind == "valid":
            body = _valid_body(t, rng)
            m, err = decode(wire.encode_message(t, **body))
            assert err is None, (t, body, err)
            cls = wire._SCHEMA[t][0]
            assert m == cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in body.items()})
            continue
        if kind == "invalid":
            raw = msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": t, **_invalid_body(t, rng)}, use_bin_type=True)
        elif kind == "truncated":
            full = wire.encode_message(t, **_valid_body(t, rng))
            raw = full[:int(rng.integers(0, len(full)))]
        else:
            raw = rng.bytes(int(rng.integers(0, 64)))
        m, err = decode(raw)
        if m is not None and kind != "random":
            accepted_invalid.append((kind, raw))
        if m is not None and kind == "random":  # a random buffer that is a valid message: must round-trip
            assert wire.decode_message(m.encode()) == m
    assert untyped == [] and accepted_invalid == []
    assert sum(counts.values()) >= 10_000


def test_fuzz_metadata_decoder():
    """3,000 seeded single-field corruptions of valid metadata: each raises ProtocolError."""
    rng = np.random.default_rng(99)
    good = msgpack.unpackb(wire.encode_metadata(sample_md(planning=(("cost", "c"), ("modes", "m")))), raw=False)
    paths = [("v",), ("fmt",), ("engine",), ("rank",), ("tp",), ("agent",), ("agent_md",), ("mem",), ("dev",),
             ("staging", "addr"), ("staging", "slot_bytes"), ("staging", "num_slots"), ("staging", "chunk_bytes"),
             ("regions", 0, "name"), ("regions", 0, "num_blocks"), ("regions", 0, "block_size"),
             ("regions", 0, "strides"), ("regions", 0, "addrs"), ("regions", 0, "spans"), ("regions", 0, "itemsize"),
             ("regions", 0, "head_dims"), ("regions", 0, "kind"), ("planning",)]
    bad_values = [None, True, 1.5, "", -1, [], {}, [True], [-5], (1 << 64) - 1, b""]
    untyped, accepted = [], []
    for i in range(3_000):
        d = msgpack.unpackb(msgpack.packb(good), raw=False)
        path = paths[i % len(paths)]
        target = d
        for p in path[:-1]:
            target = target[p]
        value = bad_values[int(rng.integers(len(bad_values)))]
        if i % 7 == 0:
            del target[path[-1]]
        else:
            # a value that is wrong for that field (a few fields accept some of the list: skip those)
            if path[-1] == "agent_md" and value == b"" or path[-1] == "planning" and value == []:
                continue  # accepted values for those fields
            target[path[-1]] = value
        try:
            wire.decode_metadata(msgpack.packb(d, use_bin_type=True))
            accepted.append((path, value))
        except ProtocolError:
            pass
        except Exception as e:  # noqa: BLE001
            untyped.append((path, value, repr(e)))
    assert untyped == [] and accepted == []


def _md_dict(**over):
    d = msgpack.unpackb(wire.encode_metadata(sample_md(**over)), raw=False)
    return d


def _mla_md():
    from kvtriton.regions import Region as R

    lat = torch.zeros(8, 4, 32, dtype=torch.bfloat16)
    r = R.mla("m0", lat, block_size=4)
    return sample_md(regions=(r.spec,), addrs=((4096,),), spans=((wire.stream_span(r.spec, 0),),))


@pytest.mark.parametrize("case,mutate,match", [
    ("dtype not a dtype", lambda d: d["regions"][0].update(dtype="float17"), "'dtype' 'float17' is not a dtype"),
    ("dtype a torch attribute", lambda d: d["regions"][0].update(dtype="Tensor"), "is not a dtype"),
    ("itemsize not the dtype's", lambda d: d["regions"][0].update(itemsize=4), r"'itemsize' 4 is not float16's \(2\)"),
    ("itemsize 1 for float16", lambda d: d["regions"][0].update(itemsize=1), "'itemsize' 1"),
    ("local_heads > total_heads", lambda d: d["regions"][0].update(local_heads=8), "'local_heads' 8 exceeds total"),
    ("local_heads not rank's shard", lambda d: d["regions"][0].update(local_heads=1), "'local_heads' 1 is not the 2"),
    ("total_heads tp cannot shard", lambda d: d["regions"][0].update(total_heads=3, local_heads=1), "'total_heads'"),
    ("duplicate region names", lambda d: d["regions"].append(dict(d["regions"][0])), "names an earlier region"),
    ("no regions", lambda d: d.update(regions=[]), "1..4096 regions"),
    ("zero block stride", lambda d: d["regions"][0].update(strides=[[0, 32, 16], [0, 32, 16]]), "block stride 0"),
    ("zero head stride", lambda d: d["regions"][0].update(strides=[[256, 32, 0], [256, 32, 0]]), "head stride 0"),
    ("slot not a multiple of 256", lambda d: d["staging"].update(slot_bytes=1000, chunk_bytes=2000), "multiple of 256"),
    ("chunk smaller than a slot", lambda d: d["staging"].update(chunk_bytes=100), "at least one slot"),
    ("gen not an int", lambda d: d.update(gen="1"), "'gen' must be int"),
    ("gen negative", lambda d: d.update(gen=-1), "'gen' = -1"),
])
def test_decode_metadata_rejects_inconsistent_specs(case, mutate, match):
    # before: each of these decoded fine and only the validation gate (or nothing) caught it later
    d = _md_dict()
    mutate(d)
    with pytest.raises(ProtocolError, match=match):
        wire.decode_metadata(msgpack.packb(d, use_bin_type=True))


def test_replicate_local_heads_must_equal_total():
    md = _mla_md()
    assert wire.decode_metadata(wire.encode_metadata(md)) == md
    d = msgpack.unpackb(wire.encode_metadata(md), raw=False)
    d["regions"][0].update(total_heads=2)
    with pytest.raises(ProtocolError, match="replicate region must equal total_heads 2"):
        wire.decode_metadata(msgpack.packb(d, use_bin_type=True))


def test_generation_round_trips_and_defaults_to_zero():
    md = sample_md(generation=1_764_000_000_000_000_000)
    assert wire.decode_metadata(wire.encode_metadata(md)).generation == md.generation
    d = msgpack.unpackb(wire.encode_metadata(md), raw=False)
    del d["gen"]  # an older peer
    assert wire.decode_metadata(msgpack.packb(d, use_bin_type=True)).generation == 0


def test_dtype_table_matches_torch():
    from kvtriton.regions import dtype_from_name
    from kvtriton.spec import DTYPE_ITEMSIZE

    for name, size in DTYPE_ITEMSIZE.items():
        assert dtype_from_name(name).itemsize == size, name
    for name in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8", "int8"):
        t = torch.zeros(8, 4, 2, 16, dtype=getattr(torch, name))
        r = Region.attention("l0", t, t.clone(), block_size=4, total_heads=4)
        spans = tuple(wire.stream_span(r.spec, j) for j in range(2))
        md = sample_md(regions=(r.spec,), spans=(spans,))
        assert wire.decode_metadata(wire.encode_metadata(md)) == md  # every dtype a cache uses decodes


def test_fuzz_inconsistent_region_fields():
    """2,000 seeded corruptions of the fields decode_metadata now checks against each other: each
    raises ProtocolError (never another exception, never accepted)."""
    rng = np.random.default_rng(18)
    choices = {"dtype": ["float17", "torch.float16", "Tensor", "bfloat", "FLOAT16", "int128", " float16"],
               "itemsize": [1, 3, 4, 8, 16],
               "local_heads": [1, 3, 4, 5, 8, 1 << 16],
               "total_heads": [3, 5, 7, 1 << 16],
               "name": ["l0"]}
    untyped, accepted = [], []
    for i in range(2_000):
        d = _md_dict()
        field = list(choices)[i % len(choices)]
        value = choices[field][int(rng.integers(len(choices[field])))]
        if field == "name":  # a second region with the same name
            d["regions"].append(dict(d["regions"][0]))
        else:
            d["regions"][0][field] = value
        try:
            wire.decode_metadata(msgpack.packb(d, use_bin_type=True))
            accepted.append((field, value))
        except ProtocolError:
            pass
        except Exception as e:  # noqa: BLE001
            untyped.append((field, value, repr(e)))
    assert untyped == [] and accepted == []


def test_a_runs_done_rides_on_a_done_only_when_named():
    """Done.runs_done: off the wire when empty (an older peer's Done decodes as none riding), a
    transfer id of 1..1024 characters when present; an empty or non-string one is malformed."""
    assert "runs_done" not in msgpack.unpackb(wire.Done("r", 0, 2).encode())
    assert wire.decode_message(wire.encode_message("Done", req="r", dst_rank=0, dst_tp=2)) == wire.Done("r", 0, 2)
    assert wire.decode_message(wire.Done("r", 0, 2, "r|D<0#1").encode()).runs_done == "r|D<0#1"
    for bad in ("", 7, b"x", "x" * 1025, None):
        with pytest.raises(ProtocolError, match="runs_done"):
            wire.decode_message(wire.encode_message("Done", req="r", dst_rank=0, dst_tp=2, runs_done=bad))
