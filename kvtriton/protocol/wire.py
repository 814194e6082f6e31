"""Handshake metadata and control messages: msgpack, versioned, schema-validated.

Everything a peer sends is untrusted. Decoding checks types, ranges and internal consistency
(a stream's declared span must hold ``num_blocks`` blocks at its strides; staging must hold its
slots) and raises :class:`~kvtriton.errors.ProtocolError` naming the field. No pickle anywhere.

Metadata (one per rank)::

    {v, fmt, engine, rank, tp, agent, agent_md, mem, dev, gen,
     regions: [{name, kind, layout, num_blocks, block_size, total_heads, local_heads,
                head_dims, dtype, itemsize, strides, addrs, spans}],
     staging: {addr, slot_bytes, num_slots, chunk_bytes},
     cost: {desc_us, pack_gbps, unpack_gbps, read_gbps, write_gbps, pass_us?, segment_us?}}   # optional

``gen`` (optional, 0 if absent): the registration generation; a restarted rank registers a higher
one, and replaces its old self only once that one is gone (:mod:`kvtriton.agent.peers`).

``cost`` is the rank's planning :class:`~kvtriton.plan.CostModel`: a source plans a decode rank's
transfers with the *decode rank's* model, so both sides choose the same modes even when their
own measurements differ.

Control messages ride on NIXL notifications: ``{v, t, ...}``; :func:`decode_message` turns
each into its own frozen dataclass (:data:`MESSAGE_TYPES`), whose fields are its schema. The tag
``t`` of every message is its class name (protocol version 2; version 1 spelled them as lowercase
words, sent ``RunsReady`` as ``"direct"`` and ``RunsDone`` as an ``ack`` of chunk -1, and is
refused)::

    decode -> prefill                       prefill -> decode
    "Pull"      pack this request           "Ready"     a packed chunk: READ it (pull)
    "Push"      pack and WRITE it to me     "Offer"     packed before any pull (eager)
    "Grant"     slots for a chunk (push)    "Data"      a chunk landed in the grant (push)
    "Ack"       a chunk is consumed (pull)  "RunsReady" DIRECT runs held (pull) / written (push)
    "RunsDone"  DIRECT runs read (pull)     "Reject"    the transfer failed here
    "Done"      finished with a request
    "Abort"     drop a transfer
    "Renew"     keep a hold for a lease
    either way: "Ping" are you there (a liveness check), "Pong" yes (same nonce)

With ``TransferAgent(integrity=True)`` a ``Ready``/``Data`` carries the chunk's digest and an
``Offer`` one per chunk (``digest``/``digests``: bytes, :data:`DIGEST_BYTES` each; empty or
absent: none). Metadata of a rank that registers only staging carries no cache address: every
region's ``addrs`` and ``spans`` are empty (in every region, or in none).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

import msgpack

from ..errors import ProtocolError, TopologyError
from ..plan import STAGED_LAYOUT_VERSION, CostModel, head_range
from ..spec import DTYPE_ITEMSIZE, MAX_GROUPS, Kind, Layout, RegionSpec

__all__ = [
    "PROTOCOL_VERSION", "RankMetadata", "StagingInfo", "encode_metadata", "decode_metadata", "Message", "Pull",
    "Push", "Grant", "Ack", "RunsDone", "Done", "Abort", "Renew", "Ready", "Offer", "Data", "RunsReady", "Reject",
    "Ping", "Pong", "MESSAGE_TYPES", "encode_message", "decode_message", "stream_span", "MAX_REQUEST_BLOCKS",
    "MAX_MESSAGE_BYTES", "DIGEST_BYTES",
]

PROTOCOL_VERSION = 2
_MAX_U64 = (1 << 64) - 1
# where a rank's cache and staging live (the transport's memory types)
_MEM_TYPES: dict[str, Literal["DRAM", "VRAM"]] = {"DRAM": "DRAM", "VRAM": "VRAM"}
# The largest request (in blocks, after dropping -1 positions) one fetch or hold may name: 128K
# blocks is 2M tokens at 16 tokens a block. It bounds what one ``pull`` costs a source's
# ``progress()`` (decoding, checking and indexing its ids); fetch() and hold() raise beyond it.
MAX_REQUEST_BLOCKS = 1 << 17
# A control message's largest encoding: a push of MAX_REQUEST_BLOCKS ids on both sides (9 bytes
# an id at most) plus its strings. Anything longer is rejected before msgpack looks at it.
MAX_MESSAGE_BYTES = 2 * 9 * MAX_REQUEST_BLOCKS + (16 << 10)
_MAX_IDS = MAX_REQUEST_BLOCKS
_MAX_MSG_INT = 1 << 48
_MAX_NAME = 1024  # engine, agent, request and transfer ids
DIGEST_BYTES = 32  # a staged chunk's digest (Ready, Data; Offer: one per chunk): blake2b-256, integrity=True
_MAX_REGIONS = 4096  # far beyond any model's layers (each region is validated: bound the work)


@dataclass(frozen=True)
class StagingInfo:
    addr: int
    slot_bytes: int
    num_slots: int
    chunk_bytes: int  # the largest chunk this rank packs or receives

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.num_slots


@dataclass(frozen=True)
class RankMetadata:
    """What one rank tells its peers about itself."""

    engine: str
    rank: int
    tp: int
    agent: str
    agent_md: bytes
    mem: Literal["DRAM", "VRAM"]
    dev: int
    regions: tuple[RegionSpec, ...]
    addrs: tuple[tuple[int, ...], ...]  # per region, per stream: address of element 0 (none: not registered)
    spans: tuple[tuple[int, ...], ...]  # per region, per stream: bytes from addr the peer may touch
    staging: StagingInfo
    # the settings both engines must share to plan alike: (name, canonical value) pairs
    planning: tuple[tuple[str, str], ...] = ()
    cost: CostModel | None = None  # the planning model this rank uses as a destination
    generation: int = 0  # registration generation: a restart registers with a higher one


_COST_MAX = 1e9  # us per descriptor or GB/s: far beyond any transport, still finite
_COST_LATER = frozenset({"pass_us", "segment_us", "pull_us"})  # models gained them later: older peers omit them


def stream_span(spec: RegionSpec, stream: int) -> int:
    """Bytes from a stream's first element to the end of its last one."""
    s_blk, s_tok, s_head = spec.strides[stream]
    last = (spec.num_blocks - 1) * s_blk + (spec.block_size - 1) * s_tok + (spec.local_heads - 1) * s_head
    return (last + spec.head_dims[stream]) * spec.itemsize


def encode_metadata(md: RankMetadata) -> bytes:
    regions = []
    for spec, addrs, spans in zip(md.regions, md.addrs, md.spans):
        regions.append(dict(
            name=spec.name, kind=spec.kind.value, layout=spec.layout.value,
            num_blocks=spec.num_blocks, block_size=spec.block_size, total_heads=spec.total_heads,
            local_heads=spec.local_heads, head_dims=list(spec.head_dims), dtype=spec.dtype,
            itemsize=spec.itemsize, strides=[list(s) for s in spec.strides],
            addrs=list(addrs), spans=list(spans), dim_major=list(spec.dim_major),
            **({"group": spec.group} if spec.group else {}),  # absent: group 0 (older peers' metadata)
        ))
    return msgpack.packb(dict(
        v=PROTOCOL_VERSION, fmt=STAGED_LAYOUT_VERSION, engine=md.engine, rank=md.rank, tp=md.tp,
        agent=md.agent, agent_md=md.agent_md, mem=md.mem, dev=md.dev, regions=regions,
        staging=dict(addr=md.staging.addr, slot_bytes=md.staging.slot_bytes,
                     num_slots=md.staging.num_slots, chunk_bytes=md.staging.chunk_bytes),
        planning=[list(p) for p in md.planning], gen=md.generation,
        **({} if md.cost is None else {"cost": md.cost.as_dict()}),
    ), use_bin_type=True)


def decode_metadata(data: bytes) -> RankMetadata:
    """Parse and validate a peer's metadata; raises :class:`ProtocolError`."""
    d = _unpack(data, "metadata")
    _version(d, "metadata")
    if _get(d, "fmt", int, "metadata") != STAGED_LAYOUT_VERSION:
        raise ProtocolError(f"metadata: staged wire format {d['fmt']} is not supported (this side speaks "
                            f"{STAGED_LAYOUT_VERSION})")
    engine = _name(d, "engine", "metadata")
    tp = _int(d, "tp", "metadata", 1, 1 << 16)
    rank = _int(d, "rank", "metadata", 0, tp - 1)
    agent = _name(d, "agent", "metadata")
    agent_md = _get(d, "agent_md", bytes, "metadata")
    raw_mem = _get(d, "mem", str, "metadata")
    mem = _MEM_TYPES.get(raw_mem)
    if mem is None:
        raise ProtocolError(f"metadata: mem must be DRAM or VRAM, got {raw_mem!r}")
    dev = _int(d, "dev", "metadata", 0, 1 << 16)
    st = _get(d, "staging", dict, "metadata")
    staging = StagingInfo(_int(st, "addr", "staging", 0, _MAX_U64),
                          _int(st, "slot_bytes", "staging", 1, 1 << 40),
                          _int(st, "num_slots", "staging", 1, 1 << 24),
                          _int(st, "chunk_bytes", "staging", 1, 1 << 48))
    if staging.chunk_bytes > staging.nbytes:
        raise ProtocolError(f"staging: chunk_bytes {staging.chunk_bytes} exceeds the pool ({staging.nbytes})")
    if staging.slot_bytes % 256 or staging.chunk_bytes < staging.slot_bytes:
        raise ProtocolError(f"staging: slot_bytes {staging.slot_bytes} must be a multiple of 256 and chunk_bytes "
                            f"{staging.chunk_bytes} at least one slot (a chunk is a run of whole slots)")
    if staging.addr + staging.nbytes > _MAX_U64:
        raise ProtocolError("staging: addr + size overflows the address space")
    regions = _get(d, "regions", list, "metadata")
    if not 0 < len(regions) <= _MAX_REGIONS:
        raise ProtocolError(f"metadata: field 'regions' must list 1..{_MAX_REGIONS} regions, got {len(regions)}")
    specs, addrs, spans = [], [], []  # type: list[RegionSpec], list[tuple[int, ...]], list[tuple[int, ...]]
    for i, r in enumerate(regions):
        spec, a, sp = _region(r, f"region {i}", rank, tp)
        if specs and bool(a) != bool(addrs[0]):
            raise ProtocolError(f"region {i}: cache addresses in some regions only; expected them in every "
                                "region, or none in any")
        if any(s.name == spec.name for s in specs):
            raise ProtocolError(f"region {i}: field 'name' {spec.name!r:.80} names an earlier region too; "
                                "region names must be distinct")
        specs.append(spec)
        addrs.append(a)
        spans.append(sp)
    planning = _get(d, "planning", list, "metadata")
    if len(planning) > 16 or not all(isinstance(p, list) and len(p) == 2 and all(
            isinstance(x, str) and 0 < len(x) <= _MAX_NAME for x in p) for p in planning):
        raise ProtocolError("metadata: planning must be at most 16 [name, value] string pairs")
    if len({p[0] for p in planning}) != len(planning):
        raise ProtocolError("metadata: planning names a setting twice")
    gen = _int(d, "gen", "metadata", 0, _MAX_U64) if "gen" in d else 0
    return RankMetadata(engine, rank, tp, agent, agent_md, mem, dev, tuple(specs), tuple(addrs),
                        tuple(spans), staging, tuple(tuple(p) for p in planning), _cost(d), gen)


def _region(r: Any, where: str, rank: int, tp: int) -> tuple[RegionSpec, tuple[int, ...], tuple[int, ...]]:
    """A region's spec, addresses and spans; each field checked alone, with the others and ``rank``/``tp``."""
    if not isinstance(r, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(r).__name__}")
    try:
        kind, layout = Kind(_get(r, "kind", str, where)), Layout(_get(r, "layout", str, where))
    except ValueError as e:
        raise ProtocolError(f"{where}: {e}") from None
    head_dims = tuple(_int_list(r, "head_dims", where, 1, 1 << 20, max_len=8))
    n_streams = len(head_dims)
    if n_streams == 0:
        raise ProtocolError(f"{where}: no streams")
    strides_raw = _get(r, "strides", list, where)
    if len(strides_raw) != n_streams or not all(isinstance(s, list) and len(s) == 3 for s in strides_raw):
        raise ProtocolError(f"{where}: strides must be {n_streams} triples (block, token, head)")
    strides = []
    for s in strides_raw:
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << 48) for x in s):
            raise ProtocolError(f"{where}: strides must be non-negative integers, got {s}")
        strides.append(tuple(s))
    dtype = _get(r, "dtype", str, where)
    if dtype not in DTYPE_ITEMSIZE:
        raise ProtocolError(f"{where}: field 'dtype' {dtype!r:.80} is not a dtype name (expected one of "
                            f"kvtriton.spec.DTYPE_ITEMSIZE, e.g. 'bfloat16')")
    spec = RegionSpec(
        name=_name(r, "name", where), kind=kind, layout=layout,
        num_blocks=_int(r, "num_blocks", where, 1, 1 << 40),
        block_size=_int(r, "block_size", where, 1, 1 << 20),
        total_heads=_int(r, "total_heads", where, 1, 1 << 16),
        local_heads=_int(r, "local_heads", where, 1, 1 << 16),
        head_dims=head_dims, dtype=dtype,
        itemsize=_int(r, "itemsize", where, 1, 16), strides=tuple(strides),
        dim_major=_dim_major(r, where, n_streams),
        group=_int(r, "group", where, 0, MAX_GROUPS - 1) if "group" in r else 0,
    )
    where = f"{where} ({spec.name!r:.80})"
    if spec.itemsize != DTYPE_ITEMSIZE[dtype]:
        raise ProtocolError(f"{where}: field 'itemsize' {spec.itemsize} is not {dtype}'s ({DTYPE_ITEMSIZE[dtype]})")
    _check_heads(spec, where, rank, tp)
    for j, (s_blk, s_tok, s_head) in enumerate(spec.strides):
        # a zero stride over more than one element folds distinct blocks/tokens/heads onto the same bytes
        for name, stride, extent in (("block", s_blk, spec.num_blocks), ("token", s_tok, spec.block_size),
                                     ("head", s_head, spec.local_heads)):
            if stride == 0 and extent > 1:
                raise ProtocolError(f"{where} stream {j}: field 'strides' has {name} stride 0 over {extent} "
                                    f"{name}s (they would share their bytes)")
    problem = spec.dim_major_problem()
    if problem is not None:
        raise ProtocolError(f"{where}: {problem}")
    a = tuple(_int_list(r, "addrs", where, 0, _MAX_U64, max_len=n_streams))
    sp = tuple(_int_list(r, "spans", where, 1, 1 << 48, max_len=n_streams))
    if (a or sp) and (len(a) != n_streams or len(sp) != n_streams):  # none: only staging is registered
        raise ProtocolError(f"{where}: need one address and one span per stream ({n_streams}), or none")
    for j in range(len(a)):
        need = stream_span(spec, j)
        if sp[j] < need:
            raise ProtocolError(f"{where} stream {j}: declared span {sp[j]} bytes cannot hold "
                                f"{spec.num_blocks} blocks at strides {spec.strides[j]} (needs {need})")
        if a[j] + sp[j] > _MAX_U64:
            raise ProtocolError(f"{where} stream {j}: address + span overflows")
    return spec, a, sp


def _check_heads(spec: RegionSpec, where: str, rank: int, tp: int) -> None:
    """Head counts consistent with each other and with the rank: never more than the model has; a
    REPLICATE region holds all of them, a SPLIT one the shard ``rank`` of ``tp`` owns."""
    if spec.local_heads > spec.total_heads or (spec.kind is Kind.REPLICATE and spec.local_heads != spec.total_heads):
        raise ProtocolError(f"{where}: field 'local_heads' {spec.local_heads} exceeds total_heads {spec.total_heads}"
                            if spec.local_heads > spec.total_heads else f"{where}: field 'local_heads' "
                            f"{spec.local_heads} of a replicate region must equal total_heads {spec.total_heads}")
    if spec.kind is Kind.REPLICATE:
        return
    try:
        lo, hi = head_range(rank, tp, spec.total_heads)
    except TopologyError as e:
        raise ProtocolError(f"{where}: field 'total_heads': {e}") from None
    if spec.local_heads != hi - lo:
        raise ProtocolError(f"{where}: field 'local_heads' {spec.local_heads} is not the {hi - lo} heads rank "
                            f"{rank} of tp={tp} holds of {spec.total_heads}")


def _cost(d: dict) -> CostModel | None:
    """The optional cost model: every field a finite positive number below :data:`_COST_MAX`; the
    fields models gained later (:data:`_COST_LATER`) take the default when a peer sends none."""
    if "cost" not in d:
        return None
    c = _get(d, "cost", dict, "metadata")
    vals = {}
    for key, default in CostModel().as_dict().items():
        v = c.get(key, default if key in _COST_LATER else None)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < _COST_MAX:
            raise ProtocolError(f"metadata: cost.{key} must be a number in (0, {_COST_MAX:g}), got {v!r}")
        vals[key] = float(v)
    return CostModel(**vals, source="peer metadata")


# --------------------------------------------------------------------------- control messages
# Each message type is a frozen dataclass; its annotations are the schema decode_message checks
# (ints are range-checked again by the receiver, which knows the bounds: slot counts, block
# counts, chunk counts). ``TYPE``, the ``t`` it travels under, is its class name.
@dataclass(frozen=True)
class Message:
    """Base of every control message: ``encode()`` gives the bytes a notification carries."""

    TYPE: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # the tag is the class name, set in one place so that no message travels under another
        cls.TYPE = cls.__name__

    def encode(self) -> bytes:  # a dataclass: its fields, in order (empty optional fields stay off the wire)
        return encode_message(self.TYPE, **{k: v for k, v in vars(self).items() if k not in _OFF_WHEN_EMPTY or v})


# decode -> prefill ------------------------------------------------------------
@dataclass(frozen=True)
class Pull(Message):
    """Pack this request for me; I READ each chunk you announce."""

    xid: str
    req: str
    dst_rank: int
    ids: tuple[int, ...]
    chunk_blocks: int
    plan: str
    tokens: int = 0  # block sizes differ: the request's tokens (0: block pairs); see plan.TokenMap
    tiles: tuple[int, ...] = ()  # block sizes differ: destination positions staged; ids = TokenMap.read_ids
    # how the staged payload travels (a plan.Way of Payload.ways): "read_unpack": do not pack,
    # answer RunsReady and keep the blocks until RunsDone (I READ them from your cache)
    way: str = "staged"
    groups: tuple[int, ...] = ()  # ids per KV cache group, in group order (RequestPlan.groups); (): one group


@dataclass(frozen=True)
class Push(Message):
    """Pack this request and WRITE it into the slots I grant, DIRECT runs into ``dst_ids``."""

    xid: str
    req: str
    dst_rank: int
    ids: tuple[int, ...]
    dst_ids: tuple[int, ...]
    chunk_blocks: int
    plan: str
    tokens: int = 0  # as in Pull
    tiles: tuple[int, ...] = ()
    groups: tuple[int, ...] = ()  # as in Pull


@dataclass(frozen=True)
class Grant(Message):
    """Push: chunk ``chunk`` may be written into my slots ``[slot, slot + nslots)``."""

    xid: str
    chunk: int
    slot: int
    nslots: int


@dataclass(frozen=True)
class Ack(Message):
    """Pull: chunk ``chunk`` is consumed; its slots may be reused."""

    xid: str
    chunk: int


@dataclass(frozen=True)
class RunsDone(Message):
    """Pull: I finished READing the DIRECT runs straight from your cache (you may stop holding
    the blocks for me)."""

    xid: str


@dataclass(frozen=True)
class Done(Message):
    """To every prefill rank of the engine: this consumer is finished with the request. ``runs_done``:
    a transfer whose RunsDone rides on it (one notification, not two), handled as that RunsDone first
    (absent: none; an older receiver ignores it: its hold ends by this done, or its lease)."""

    req: str
    dst_rank: int
    dst_tp: int
    runs_done: str = ""


@dataclass(frozen=True)
class Abort(Message):
    """Drop a transfer's staging (the request failed on the decode side)."""

    xid: str


@dataclass(frozen=True)
class Renew(Message):
    """To every prefill rank of the engine, while a fetch of ``req`` is outstanding: keep its
    hold for another lease (honoured only from the hold's consumer engine, or a rank holding an
    offer of it while it is unbound)."""

    req: str
    dst_rank: int


# prefill -> decode ------------------------------------------------------------
@dataclass(frozen=True)
class Ready(Message):
    """Pull: chunk ``chunk`` is packed in my slots ``[slot, slot + nslots)``: READ it."""

    xid: str
    chunk: int
    slot: int
    nslots: int
    nbytes: int
    digest: bytes = b""  # integrity=True: DIGEST_BYTES of blake2b over the packed bytes; else empty


@dataclass(frozen=True)
class Offer(Message):
    """Pull, before the pull: request ``req`` is packed for you (``num_blocks`` held blocks in
    order, ``ids`` their digest, chunks of ``chunk_blocks`` by plan ``plan``) in my slot runs
    ``slots`` (slot, nslots per chunk). A fetch asking exactly that READs them as transfer
    ``xid`` (acks as after a ``Ready``) without sending a pull; a ``Reject`` of ``xid`` withdraws it.
    ``runs`` 1: the plan also reads DIRECT runs from me, and this is their ``RunsReady`` too (I
    hold the blocks, the engine's writes are done: READ them, then ``RunsDone``); 0: none."""

    xid: str
    req: str
    plan: str
    ids: str
    num_blocks: int
    chunk_blocks: int
    slots: tuple[int, ...]
    runs: int = 0
    digests: bytes = b""  # integrity=True: DIGEST_BYTES per chunk, in chunk order (as Ready's); else empty


@dataclass(frozen=True)
class Data(Message):
    """Push: chunk ``chunk`` has landed in the granted slots (rides on the WRITE)."""

    xid: str
    chunk: int
    nbytes: int
    digest: bytes = b""  # as in Ready


@dataclass(frozen=True)
class RunsReady(Message):
    """The DIRECT runs: pull: I hold the blocks, READ them from my cache; push: I have written
    them into yours."""

    xid: str


@dataclass(frozen=True)
class Reject(Message):
    """The transfer failed on my side: fail the request."""

    xid: str
    reason: str


# either way -------------------------------------------------------------------
@dataclass(frozen=True)
class Ping(Message):
    """Are you there? A liveness check (:mod:`kvtriton.agent.peers`): answer ``Pong(nonce)``."""

    nonce: int


@dataclass(frozen=True)
class Pong(Message):
    """The answer to ``Ping(nonce)``."""

    nonce: int


MESSAGE_TYPES: tuple[type[Message], ...] = (Pull, Push, Grant, Ack, RunsDone, Done, Abort, Renew, Ready, Offer,
                                             Data, RunsReady, Reject, Ping, Pong)
# the least value of an int field (default 0): counts of slots and bytes are >= 1, a tp >= 1;
# upper bounds are the receiver's (it knows them)
_MIN_INT = {("Ready", "nslots"): 1, ("Ready", "nbytes"): 1, ("Grant", "nslots"): 1, ("Data", "nbytes"): 1,
            ("Done", "dst_tp"): 1, ("Offer", "num_blocks"): 1, ("Offer", "chunk_blocks"): 1}
_MAX_LIST = {"groups": MAX_GROUPS}  # group sizes: absent for one group (decoded as ()), at most MAX_GROUPS
# fields off the wire when empty (one group; no RunsDone riding on a Done); present, checked as any other
_OFF_WHEN_EMPTY = frozenset({"groups", "runs_done"})
# annotation of a message field -> the type msgpack decodes it to (tuples travel as arrays)
_WIRE_TYPES: dict[str, type[Any]] = {"str": str, "int": int, "tuple[int, ...]": list, "bytes": bytes}
# t -> (class, [(field, wire type)]); the annotations are strings (``from __future__ import annotations``)
_SCHEMA: dict[str, tuple[type[Message], list[tuple[str, type[Any]]]]] = {
    cls.TYPE: (cls, [(f.name, _WIRE_TYPES[str(f.type)]) for f in fields(cls)])
    for cls in MESSAGE_TYPES
}


def encode_message(t: str, **body: Any) -> bytes:
    """Bytes of a message of type ``t`` (no checks: the receiver validates). Use
    :meth:`Message.encode`; this spelling lets tests forge what a broken peer would send."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": t, **body}, use_bin_type=True)


def decode_message(data: bytes) -> Message:
    """Parse a control message into its dataclass; checks version, type, field types and each
    int's least value (indices >= 0, counts >= 1). Raises :class:`ProtocolError`."""
    if isinstance(data, (bytes, bytearray, memoryview)) and len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message: {len(data)} bytes is more than the {MAX_MESSAGE_BYTES} a message may have")
    d = _unpack(data, "message")
    _version(d, "message")
    t = d.get("t")
    if not isinstance(t, str) or t not in _SCHEMA:
        raise ProtocolError(f"message: unknown type {t!r:.80}")
    cls, schema = _SCHEMA[t]
    values: dict[str, Any] = {}
    for name, typ in schema:
        # a digest may be absent (a peer without integrity), and group sizes (a request of one group)
        v = d.get(name, b"" if typ is bytes else [] if name in _MAX_LIST else "" if name in _OFF_WHEN_EMPTY else None)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise ProtocolError(f"message {t!r}: field {name!r} must be {typ.__name__}, got {v!r:.80}")
        # every int a peer sends is a count, index or size far below 2**48
        if typ is int:
            lo = _MIN_INT.get((t, name), 0)
            if not lo <= v < _MAX_MSG_INT:
                raise ProtocolError(f"message {t!r}: field {name!r} = {v} is outside [{lo}, 2**48)")
        if typ is list:
            if len(v) > _MAX_LIST.get(name, _MAX_IDS):
                raise ProtocolError(f"message {t!r}: field {name!r} has {len(v)} entries, more than the "
                                    f"{_MAX_LIST.get(name, _MAX_IDS)} allowed (MAX_REQUEST_BLOCKS, MAX_GROUPS)")
            # C-level passes (half the time of a per-element generator at 8k ids); bools are not ints here
            if v and (set(map(type, v)) != {int} or min(v) < 0 or max(v) >= _MAX_MSG_INT):
                raise ProtocolError(f"message {t!r}: field {name!r} must be a list of ints in [0, 2**48)")
            v = tuple(v)
        if typ is str and not (0 < len(v) <= _MAX_NAME or (not v and name not in d)):  # "": only when absent
            raise ProtocolError(f"message {t!r}: field {name!r} must be 1..{_MAX_NAME} characters")
        if typ is bytes and (len(v) % DIGEST_BYTES or len(v) > DIGEST_BYTES * (_MAX_IDS if t == "Offer" else 1)):
            raise ProtocolError(f"message {t!r}: field {name!r} has {len(v)} bytes, not 0 or {DIGEST_BYTES} a chunk")
        values[name] = v
    return cls(**values)


# --------------------------------------------------------------------------- helpers
def _unpack(data: bytes, what: str) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what}: expected bytes, got {type(data).__name__}")
    try:
        # the limits bound what a hostile buffer can make msgpack allocate before any check runs
        d = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, max_array_len=2 * _MAX_IDS,
                            max_map_len=64, max_str_len=1 << 20, max_bin_len=64 << 20, max_ext_len=0)
    except Exception as e:  # msgpack raises several types on truncated/garbage input
        raise ProtocolError(f"{what}: not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise ProtocolError(f"{what}: expected a map at the top level, got {type(d).__name__}")
    return d


def _version(d: dict, what: str) -> None:
    v = d.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:  # True == 1 == 1.0: the type must be int
        # a version-1 peer's tags differ (see the module docstring): name it, so the fix is plain
        older = " (a kvtriton peer of version 1: upgrade it)" if type(v) is int and v == 1 else ""
        raise ProtocolError(f"{what}: protocol version {v!r} is not supported (expected {PROTOCOL_VERSION}){older}")


def _get(d: dict, key: str, typ: type, where: str):
    if key not in d:
        raise ProtocolError(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise ProtocolError(f"{where}: field {key!r} must be {typ.__name__}, got {type(v).__name__}")
    return v


def _name(d: dict, key: str, where: str) -> str:
    v = _get(d, key, str, where)
    if not 0 < len(v) <= _MAX_NAME:
        raise ProtocolError(f"{where}: field {key!r} must be 1..{_MAX_NAME} characters, got {len(v)}")
    return v


def _int(d: dict, key: str, where: str, lo: int, hi: int) -> int:
    v = _get(d, key, int, where)
    if not lo <= v <= hi:
        raise ProtocolError(f"{where}: field {key!r} = {v} is outside [{lo}, {hi}]")
    return v


def _int_list(d: dict, key: str, where: str, lo: int, hi: int, max_len: int) -> list[int]:
    v = _get(d, key, list, where)
    if len(v) > max_len or not all(isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi for x in v):
        raise ProtocolError(f"{where}: field {key!r} must be at most {max_len} integers in [{lo}, {hi}]")
    return v


def _dim_major(r: dict, where: str, n_streams: int) -> tuple[int, ...]:
    """A region's ``dim_major`` (normalised: ``()`` when no stream has a dim-major part)."""
    if "dim_major" not in r:
        return ()
    v = tuple(_int_list(r, "dim_major", where, 0, 1 << 20, max_len=n_streams))
    return v if any(v) else ()
