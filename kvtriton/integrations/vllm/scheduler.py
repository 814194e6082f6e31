"""The connector's scheduler side: which requests hold, load, abort; no tensors, no NIXL.

It speaks NixlConnector's proxy protocol, so a vLLM P/D proxy works unchanged:

* **Prefill** (``kv_producer``): a request carrying ``kv_transfer_params={"do_remote_decode":
  True}`` is tracked while it prefills. In the step whose forward completes its prompt, the
  step's messages tell every worker to **hold** its blocks (the workers place the hold right after
  that forward, so a decode may pull before the engine steps again). When the request finishes
  (length cap or stop) :meth:`SchedulerSide.request_finished` keeps its blocks (``delay_free``)
  and returns the params a decode request needs (:func:`remote_params`, with
  ``remote_num_tokens``, the prompt tokens its blocks hold, as NixlConnector 0.34 sends it); the next step
  **confirms** the hold, after which a worker reports the request in ``finished_sending`` once
  every consumer is done or the lease ends. A request that finishes any other way, or is
  preempted, has its hold **released** and is never reported. With several decode engines a
  router may name the one it chose in the prefill request's params (``decode_engine_id``,
  :func:`decode_engine_hint`): the hold is packed ahead for that engine's ranks.
* **Decode** (``kv_consumer``): a request carrying those params is loaded asynchronously: all its
  prompt tokens beyond the local prefix come from the prefill engine
  (``get_num_new_matched_tokens``; no more than ``remote_num_tokens`` when the params carry it,
  checked against the block ids), the blocks vLLM allocates are paired with the remote ones by
  position (``update_state_after_alloc``; when the prefill engine's ``remote_block_size`` differs
  from ours, both lists are the request's tokens in each engine's blocks and the load carries the
  token count, see :func:`kvtriton.plan.compact_tokens`), and the next step's messages carry the **load** to the
  workers. A request aborted while loading is **cancelled** on the workers, which still report it
  in ``finished_recving`` (vLLM frees its blocks then). A request is **announced** as queued when
  it arrives (``on_new_request``): it may wait for a slot or KV blocks longer than the prefill's
  lease, so the workers renew its holds until its load starts (:meth:`SchedulerSide._announce_queued`).

**Hybrid models** (vLLM's hybrid KV cache manager, HMA): a request has blocks in every KV cache
group (:class:`CacheGroup`), so holds, loads and ``remote_block_ids`` carry one list per group
(a list of lists, as NixlConnector sends them; an engine with one group keeps the flat list, and a
flat list from a peer is one group). A sliding-window group carries only the last
``cdiv(window, block) + 1`` blocks on both sides (the tokens the window can still reach), a
Mamba/GDN group the one block holding the request's running state. With a state group the
prefill stops one prompt token short and the decode loads ``prompt - 1`` tokens and computes the
last itself (:meth:`SchedulerSide.on_new_request`): the state after the whole prompt would
apply the last token twice when the decode computes it again.

Remote params are untrusted (they come through a proxy, and from any client of the decode's API):
:func:`parse_remote_params` checks every field, and the peer they name must be in
``allowed_peers`` (:class:`~kvtriton.protocol.allowlist.PeerAllowlist`) before any worker
connects to it; a request with bad or disallowed params is computed locally instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import KVTritonError
from ...plan import ceil_div
from ...protocol.allowlist import PeerAllowlist

if TYPE_CHECKING:
    from ..core import PrefillEngine

__all__ = ["SchedulerSide", "StepMessages", "LoadSpec", "RemoteSource", "CacheGroup", "cache_groups",
           "decode_engine_hint", "parse_remote_params", "ParamsError", "BlockIds"]

logger = logging.getLogger(__name__)

MAX_REMOTE_BLOCKS = 1 << 20  # a 1M-block request is ~16M tokens at block 16: far past any context
MAX_GROUPS = 64  # KV cache groups of one engine (vLLM makes a handful)
_MAX_LOGGED_PEERS = 1024  # refused peers logged once each; past this many, no more logs (bounded memory)


#: a request's blocks: one flat list (one KV cache group), or one list per group (hybrid models)
BlockIds = tuple[int, ...] | tuple[tuple[int, ...], ...]


class ParamsError(KVTritonError, ValueError):
    """A decode request's ``kv_transfer_params`` are malformed or do not fit this engine."""


@dataclass(frozen=True)
class CacheGroup:
    """What the scheduler side knows of one of the engine's KV cache groups (vLLM's
    ``kv_cache_config.kv_cache_groups[i]``): which of a request's blocks carry its KV.

    ``window``: a sliding window's tokens (0: full attention); ``state``: a Mamba/GDN group, one
    block per request holds its running state; ``transfer``: False for a group vLLM >= 0.34 does
    not transfer (``kv_cache_config.transfer_group_ids``), which then carries no block."""

    block_size: int
    window: int = 0
    state: bool = False
    transfer: bool = True

    def clip(self, block_ids) -> tuple[int, ...]:
        """The blocks of ``block_ids`` (a request's, in order) that travel: a window's last
        ``cdiv(window, block_size) + 1`` (the window need not start on a block boundary), a
        state's last one, all of a full attention group's."""
        ids = tuple(int(b) for b in block_ids)
        if not self.transfer:
            return ()
        if self.state:
            return ids[-1:]
        if self.window:
            return ids[-(ceil_div(self.window, self.block_size) + 1):]
        return ids


def _flat(block_ids: BlockIds) -> tuple[int, ...]:
    """Every block id of a flat or per-group list, in order."""
    if block_ids and isinstance(block_ids[0], (tuple, list)):
        return tuple(int(b) for g in block_ids for b in g)  # type: ignore[union-attr,unused-ignore]
    return tuple(int(b) for b in block_ids)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RemoteSource:
    """Where a decode request's prompt KV is: a prefill engine, its handshake address, its blocks."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    request_id: str
    #: flat (one group) or one tuple per KV cache group (:data:`BlockIds`)
    block_ids: BlockIds
    block_size: int  # tokens per block of the prefill engine
    #: the prompt tokens the prefill computed into ``block_ids`` (``remote_num_tokens``, as
    #: NixlConnector 0.34 sends it), None when the params do not say (older senders)
    num_tokens: int | None = None

    @property
    def engine(self) -> PrefillEngine:
        """The prefill engine it names (untrusted: checked when met)."""
        from ..core import PrefillEngine  # the scheduler side never loads the agent

        return PrefillEngine(self.engine_id, self.host, self.port, self.tp_size)

    @property
    def grouped(self) -> bool:
        """True when the params carried one list per KV cache group (more than one group)."""
        return bool(self.block_ids) and isinstance(self.block_ids[0], tuple)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The block ids per KV cache group (a flat list is one group)."""
        return self.block_ids if self.grouped else (self.block_ids,)  # type: ignore[return-value]


@dataclass(frozen=True)
class LoadSpec:
    """One load for the workers: position ``j`` of ``remote_block_ids`` lands in
    ``local_block_ids[j]`` (-1: already local). ``report``: tell vLLM when it ends (False for a
    load that only tells the prefill engine it may free the blocks). ``num_tokens``: when the
    engines' block sizes differ, the request's tokens (each list in its engine's blocks; a local
    -1 skips that block's tokens), else None (whole blocks by position)."""

    req_id: str
    source: RemoteSource
    remote_block_ids: BlockIds
    local_block_ids: BlockIds
    report: bool = True
    num_tokens: int | None = None

    def local_blocks(self) -> tuple[int, ...]:
        """Every local block id of the load, all groups (-1 included)."""
        return _flat(self.local_block_ids)


@dataclass
class StepMessages:
    """What the scheduler tells every worker in one step."""

    loads: dict[str, LoadSpec] = field(default_factory=dict)
    cancels: set[str] = field(default_factory=set)
    holds: dict[str, BlockIds] = field(default_factory=dict)
    confirms: set[str] = field(default_factory=set)
    releases: set[str] = field(default_factory=set)
    #: held requests whose prefill params named the decode engine to pack them ahead for
    #: (``decode_engine_id``, see :func:`decode_engine_hint`)
    pack_for: dict[str, str] = field(default_factory=dict)
    #: no tokens scheduled this step (no forward runs): the workers may wait for their loads
    idle: bool = False
    #: decode requests new in the engine's queue, not loading yet: the workers renew the
    #: prefill's holds of each until its load starts (:meth:`SchedulerSide.on_new_request`)
    queued: dict[str, RemoteSource] = field(default_factory=dict)


def cache_groups(kv_cache_config) -> tuple[CacheGroup, ...]:
    """The scheduler side's view of vLLM's KV cache groups: block size, sliding window, state
    (Mamba/GDN: ``MambaSpec``), and whether vLLM >= 0.34 transfers the group. Empty: no config
    (an engine without HMA: one group, the scheduler side assumes it)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    transfer = getattr(kv_cache_config, "transfer_group_ids", None)
    out = []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        specs = list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]  # UniformTypeKVCacheSpecs
        names = {type(s).__name__ for s in specs}
        window = max((int(getattr(s, "sliding_window", 0) or 0) for s in specs
                      if "SlidingWindow" in type(s).__name__), default=0)
        out.append(CacheGroup(block_size=int(spec.block_size), window=window,
                              state=any("Mamba" in n for n in names),
                              transfer=transfer is None or i in tuple(transfer)))
    return tuple(out)


def parse_remote_params(params: Mapping[str, Any], block_size: int) -> RemoteSource:
    """Check a decode request's ``kv_transfer_params``; raise :class:`ParamsError` naming the field."""

    def get(name: str, kind: type, ok=lambda v: True, expected: str = ""):
        v = params.get(name)
        if not isinstance(v, kind) or isinstance(v, bool) or not ok(v):
            raise ParamsError(f"kv_transfer_params[{name!r}] = {v!r:.80}: expected {expected or kind.__name__}")
        return v

    engine = get("remote_engine_id", str, lambda v: 0 < len(v) <= 256, "a non-empty engine id")
    host = get("remote_host", str, lambda v: 0 < len(v) <= 255, "a host name or address")
    port = get("remote_port", int, lambda v: 0 < v < 65536, "a TCP port")
    tp = get("tp_size", int, lambda v: 0 < v <= 4096, "the prefill engine's TP size (1..4096)")
    req = get("remote_request_id", str, lambda v: 0 < len(v) <= 512, "the prefill request id")
    raw = params.get("remote_block_ids")
    if isinstance(raw, (list, tuple)) and len(raw) == 1 and isinstance(raw[0], (list, tuple)):
        raw = raw[0]  # one KV cache group, as HMA-aware engines send it
    grouped = isinstance(raw, (list, tuple)) and bool(raw) and all(isinstance(g, (list, tuple)) for g in raw)
    groups = list(raw) if grouped else [raw]  # type: ignore[arg-type]
    if not isinstance(raw, (list, tuple)) or len(groups) > MAX_GROUPS or sum(
            len(g) if isinstance(g, (list, tuple)) else 0 for g in groups) > MAX_REMOTE_BLOCKS or not all(
            isinstance(g, (list, tuple)) and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in g)
            for g in groups):
        raise ParamsError(f"kv_transfer_params['remote_block_ids'] = {raw!r:.80}: expected a list of at most "
                          f"{MAX_REMOTE_BLOCKS} block ids >= 0, or one such list per KV cache group (at most "
                          f"{MAX_GROUPS})")
    ids: BlockIds = (tuple(tuple(g) for g in groups) if grouped else tuple(raw))  # type: ignore[arg-type]
    remote_bs = block_size if params.get("remote_block_size") is None else get(
        "remote_block_size", int, lambda v: 0 < v <= 1 << 20, "the prefill engine's block size (1..2**20)")
    # a group's blocks hold at most this many tokens (a window's or a state's hold fewer blocks)
    longest = max(len(g) for g in groups if isinstance(g, (list, tuple)))
    num_tokens = None if params.get("remote_num_tokens") is None else get(
        "remote_num_tokens", int, lambda v: 0 <= v <= longest * remote_bs,
        f"the prefill's token count, at most what its {longest} blocks of {remote_bs} hold")
    return RemoteSource(engine, host, port, tp, req, ids, remote_bs, num_tokens)


def decode_engine_hint(params: Mapping[str, Any], own_engine_id: str) -> str | None:
    """The decode engine a prefill request's ``kv_transfer_params`` name in ``decode_engine_id``
    (a router sets it when it has chosen the decode engine: the prefill packs the request ahead
    for that engine's ranks, :meth:`~kvtriton.agent.TransferAgent.hold`'s ``pack_for``), or None:
    absent, malformed (not a string of 1 to 256 printable characters) or this engine's own id,
    ignored as if absent. Untrusted: a hint only, it binds the hold to nothing (a named engine
    this rank is not connected to means the hold is served when pulled, as without eager packs)."""
    v = params.get("decode_engine_id")
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= 256 or not v.isprintable() or v == own_engine_id:
        logger.debug("kv_transfer_params['decode_engine_id'] = %.80r ignored: expected another engine's id", v)
        return None
    return v


def remote_params(engine_id: str, host: str, port: int, tp_size: int, block_size: int, req_id: str,
                  block_ids, num_tokens: int | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` a finished prefill returns for its decode request (``block_ids``
    flat, or one list per KV cache group: sent as a list of lists);
    ``remote_num_tokens``: the prompt tokens its held blocks hold (a decode on NixlConnector 0.34
    declines a pull between different block sizes without it; None: not sent, as before 0.34)."""
    grouped = bool(block_ids) and isinstance(block_ids[0], (tuple, list))
    ids = [[int(b) for b in g] for g in block_ids] if grouped else [int(b) for b in block_ids]
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
              "remote_host": host, "remote_port": port, "tp_size": tp_size, "remote_block_size": block_size,
              "remote_request_id": req_id, "remote_block_ids": ids}
    if num_tokens is not None:
        params["remote_num_tokens"] = int(num_tokens)
    return params


@dataclass
class _Prefill:
    num_prompt_tokens: int
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    held: bool = False
    pack_for: str | None = None  # the decode engine the router named (decode_engine_hint)


class SchedulerSide:
    """Scheduler-side state of one engine (see the module docstring for the protocol).

    ``request`` objects are vLLM's (``request_id``, ``kv_transfer_params``, ``num_prompt_tokens``,
    ``status``); ``scheduler_output`` is vLLM's ``SchedulerOutput``; both are read duck-typed.
    """

    def __init__(self, *, engine_id: str, host: str, port: int, tp_size: int, block_size: int,
                 allowed_peers: PeerAllowlist | None = None, groups: Sequence[CacheGroup] = ()):
        self.engine_id, self.host, self.port = engine_id, host, port
        self.tp_size, self.block_size = tp_size, block_size
        #: the engine's KV cache groups (none given: one full attention group of ``block_size``)
        self.groups = tuple(groups) or (CacheGroup(block_size),)
        if len(self.groups) > 1:  # a hybrid's attention block (vLLM raises it to match state pages)
            self.block_size = next((g.block_size for g in self.groups if not g.state), block_size)
        #: prompt tokens the decode computes itself: 1 with a state group (see the module docstring)
        self.backoff = 1 if any(g.state for g in self.groups) else 0
        self._allowed = allowed_peers if allowed_peers is not None and not allowed_peers.empty else None
        self._logged_peers: set[tuple[str, str, int]] = set()
        #: decode requests computed locally because their params named a peer outside allowed_peers
        self.stats = {"disallowed": 0}
        self._prefills: dict[str, _Prefill] = {}
        self._wanted: dict[str, tuple[RemoteSource, int]] = {}  # decode: source, local prefix tokens
        self._loading: set[str] = set()
        self._next = StepMessages()

    @property
    def hybrid(self) -> bool:
        """More than one KV cache group: block ids travel one list per group."""
        return len(self.groups) > 1

    def _per_group(self, block_ids) -> BlockIds:
        """vLLM's block ids of a request (one list per group, or a flat list when HMA is off)
        clipped to what travels: one tuple per group when hybrid, else flat."""
        lists = list(block_ids) if block_ids and isinstance(block_ids[0], (list, tuple)) else [block_ids]
        if len(lists) != len(self.groups):
            raise ParamsError(f"{len(lists)} block lists for {len(self.groups)} KV cache groups")
        clipped = tuple(g.clip(ids) for g, ids in zip(self.groups, lists))
        return clipped if self.hybrid else clipped[0]

    def _prompt_tokens(self, block_ids: BlockIds, prompt: int) -> int:
        """The prompt tokens a prefill's held blocks hold: ``prompt``, no more than its full
        attention groups' blocks hold."""
        lists: tuple = block_ids if self.hybrid else (block_ids,)
        caps = [len(ids) * g.block_size for g, ids in zip(self.groups, lists)
                if not g.state and not g.window and g.transfer]
        return min([prompt, *caps])

    # ------------------------------------------------------------------ both roles
    def on_new_request(self, request) -> None:
        """A decode request queued with valid params is announced to the workers (their agents
        renew its holds on the prefill while it waits: :meth:`_announce_queued`). A prefill
        request of an engine with a state group stops one prompt token short (its decode computes
        that token on the state the prefill leaves, see the module docstring).
        The same cut as NixlConnector's (``_truncate_request_for_prefill``), once per request."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            self._announce_queued(request.request_id, params)
        if not (self.backoff and params and params.get("do_remote_decode")) or params.get("_p_side_truncated"):
            return
        if request.num_prompt_tokens <= self.backoff or getattr(request, "prompt_token_ids", None) is None:
            return
        del request.prompt_token_ids[-self.backoff:]
        del request._all_token_ids[-self.backoff:]
        request.num_prompt_tokens -= self.backoff
        request.max_tokens = 1
        params["_p_side_truncated"] = True

    def _announce_queued(self, rid: str, params: Mapping[str, Any]) -> None:
        """A decode request just entered the engine's queue: it may wait there (for a running
        slot, for KV blocks) longer than the prefill's lease, so the next step's messages name it
        and the workers keep its holds alive until its load starts. Bad or disallowed params are
        dealt with (and logged) when it is scheduled; here they only announce nothing."""
        try:
            source = parse_remote_params(params, self.block_size)
        except ParamsError:
            return
        if self._allowed is None or self._allowed.allows(source.engine_id, source.host, source.port):
            self._next.queued[rid] = source

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if params.get("do_remote_decode") and rid not in self._prefills:
            self._prefills[rid] = _Prefill(int(request.num_prompt_tokens),
                                           pack_for=decode_engine_hint(params, self.engine_id))
        if not params.get("do_remote_prefill"):
            return 0, False
        try:
            source = parse_remote_params(params, self.block_size)
        except ParamsError as e:
            logger.warning("request %s: %s; computing its prompt locally", rid, e)
            params["do_remote_prefill"] = False
            return 0, False
        if not self._allows(source):
            params["do_remote_prefill"] = False
            return 0, False
        if len(source.groups) != len(self.groups) or (self.hybrid and source.block_size != self.block_size):
            logger.warning("request %s: the prefill sent blocks of %d KV cache groups of %d tokens, this engine "
                           "has %d groups of %d; computing its prompt locally", rid, len(source.groups),
                           source.block_size, len(self.groups), self.block_size)
            params["do_remote_prefill"] = False
            return 0, False
        self._wanted[rid] = (source, num_computed_tokens)
        # the prefill computed every prompt token (as many as remote_num_tokens says, when it
        # says; with a state group all but the last); all but the local prefix come from it
        remote_tokens = len(source.groups[0]) * source.block_size
        if source.num_tokens is not None:
            remote_tokens = source.num_tokens
        prompt = int(request.num_prompt_tokens)
        if self.backoff and prompt > self.backoff:
            prompt -= self.backoff
        count = min(prompt, remote_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if not params.get("do_remote_prefill") or rid not in self._wanted:
            return
        params["do_remote_prefill"] = False  # one load per request, even when called again
        source, local_tokens = self._wanted.pop(rid)
        if self.hybrid:
            self._hybrid_load(rid, source, blocks, local_tokens, num_external_tokens)
            return
        remote = source.block_ids
        if num_external_tokens > 0 and source.block_size != self.block_size:
            # different pagings: both lists hold the same tokens, each in its engine's blocks
            local = list(blocks.get_block_ids()[0])
            tokens = min(local_tokens + num_external_tokens, len(remote) * source.block_size,
                         len(local) * self.block_size)
            n_local = ceil_div(tokens, self.block_size)
            skip = min(n_local, local_tokens // self.block_size)  # blocks vLLM already has (prefix cache)
            ids = [-1] * skip + local[skip:n_local]
            self._next.loads[rid] = LoadSpec(rid, source, remote[:ceil_div(tokens, source.block_size)], tuple(ids),
                                             num_tokens=tokens)
            self._loading.add(rid)
        elif num_external_tokens > 0:
            local = list(blocks.get_block_ids()[0])
            n = min(len(local), len(remote))
            skip = min(n, local_tokens // self.block_size)  # blocks vLLM already has (prefix cache)
            ids = [-1] * skip + local[skip:n]
            self._next.loads[rid] = LoadSpec(rid, source, remote[:n], tuple(ids))
            self._loading.add(rid)
        else:  # the prompt is all local: nothing to read, but the prefill may free its blocks
            self._next.loads[rid] = LoadSpec(rid, source, remote, (-1,) * len(remote), report=False)

    def _hybrid_load(self, rid: str, source: RemoteSource, blocks, local_tokens: int, num_external: int) -> None:
        """A decode load with one list per KV cache group (same block size on both engines):
        each group's travelling blocks (:meth:`CacheGroup.clip`) paired by position from the
        end; a full attention group's prefix blocks vLLM already has are skipped (-1)."""
        if num_external <= 0:  # the prompt is all local: the prefill may free its blocks
            self._next.loads[rid] = LoadSpec(rid, source, source.groups,
                                             tuple((-1,) * len(g) for g in source.groups), report=False)
            return
        per_group = getattr(blocks, "blocks", None)  # KVCacheBlock lists: null blocks (out of window) are -1
        local_all = ([[-1 if b.is_null else b.block_id for b in g] for g in per_group] if per_group is not None
                     else blocks.get_block_ids())
        remote_ids: list[tuple[int, ...]] = []
        local_ids: list[tuple[int, ...]] = []
        tokens = local_tokens + num_external
        for g, local, remote in zip(self.groups, local_all, source.groups):
            if g.state or g.window:
                ours = g.clip([b for b in local if b >= 0])
                n = min(len(ours), len(remote))
                remote_ids.append(tuple(remote[len(remote) - n:]))
                local_ids.append(ours[len(ours) - n:])
                continue
            n = min(len(local), len(remote), ceil_div(tokens, g.block_size))
            skip = min(n, local_tokens // g.block_size)  # blocks vLLM already has (prefix cache)
            remote_ids.append(tuple(remote[:n]))
            local_ids.append((-1,) * skip + tuple(local[skip:n]))
        self._next.loads[rid] = LoadSpec(rid, source, tuple(remote_ids), tuple(local_ids))
        self._loading.add(rid)

    def build_messages(self, scheduler_output) -> StepMessages:
        """This step's messages; the state for the next step starts empty."""
        msgs, self._next = self._next, StepMessages()
        msgs.idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        for rid in msgs.loads:  # loading in this very step: its fetch renews its holds
            msgs.queued.pop(rid, None)
        if self._prefills:
            self._track_prefills(scheduler_output, msgs)
        return msgs

    def update_connector_output(self, connector_output) -> None:
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._loading.discard(rid)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's blocks, flat (HMA off) or one list per group (HMA,
        ``request_finished_all_groups``; a sliding window's out-of-window blocks already nulled)."""
        rid = request.request_id
        params = request.kv_transfer_params or {}
        self._wanted.pop(rid, None)
        self._next.queued.pop(rid, None)  # gone before any step announced it
        if rid in self._loading:  # aborted while loading: cancel; workers report it when stopped
            self._loading.discard(rid)
            self._next.cancels.add(rid)
            return False, None
        if params.get("do_remote_prefill"):
            # finished before it was ever scheduled: only tell the prefill engine to free its blocks
            try:
                source = parse_remote_params(params, self.block_size)
                if self._allows(source):
                    local: BlockIds = (tuple((-1,) * len(g) for g in source.groups) if source.grouped
                                   else (-1,) * len(source.groups[0]))
                    self._next.loads[rid] = LoadSpec(rid, source, source.block_ids, local, report=False)
            except ParamsError:
                pass
            params["do_remote_prefill"] = False
            return False, None
        prefill = self._prefills.pop(rid, None)
        if prefill is None:
            return False, None
        status = getattr(request.status, "name", str(request.status))
        if prefill.held and _flat(block_ids) and status in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"):
            self._next.confirms.add(rid)
            ids = self._per_group(block_ids)  # a window's and a state's travelling blocks only
            tokens = self._prompt_tokens(ids, prefill.num_prompt_tokens)
            return True, remote_params(self.engine_id, self.host, self.port, self.tp_size, self.block_size, rid,
                                       ids, tokens)
        if prefill.held:
            self._next.releases.add(rid)
        return False, None

    def _allows(self, source: RemoteSource) -> bool:
        """Whether ``allowed_peers`` lets a worker meet the peer these params name (logged once per peer)."""
        if self._allowed is None or self._allowed.allows(source.engine_id, source.host, source.port):
            return True
        self.stats["disallowed"] += 1
        peer = (source.engine_id, source.host, source.port)
        if peer not in self._logged_peers and len(self._logged_peers) < _MAX_LOGGED_PEERS:
            self._logged_peers.add(peer)
            logger.warning("kv_transfer_params name engine %r at %s:%d, which allowed_peers does not list; "
                           "computing such requests locally", source.engine_id, source.host, source.port)
        return False

    # ------------------------------------------------------------------ prefill bookkeeping
    def _track_prefills(self, out, msgs: StepMessages) -> None:
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            p = self._prefills.get(new.req_id)
            if p is not None:
                p.block_ids = [list(g) for g in new.block_ids]
                computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            p = self._prefills.get(rid)
            if p is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                p.block_ids = ([list(g) for g in new_ids] if rid in resumed or not p.block_ids
                               else [old + list(g) for old, g in zip(p.block_ids, new_ids)])
            computed[rid] = cached.num_computed_tokens[i]
        for rid in getattr(out, "preempted_req_ids", None) or ():
            p = self._prefills.get(rid)
            if p is not None and p.held:  # its blocks go back to the pool: nobody may read them now
                p.held = False
                msgs.releases.add(rid)
        for rid, n_before in computed.items():
            p = self._prefills[rid]
            if not p.held and n_before + out.num_scheduled_tokens.get(rid, 0) >= p.num_prompt_tokens:
                p.held = True  # this step's forward completes the prompt: hold right after it
                msgs.holds[rid] = self._per_group(p.block_ids if self.hybrid else p.block_ids[0])
                if p.pack_for is not None:
                    msgs.pack_for[rid] = p.pack_for
                msgs.releases.discard(rid)
