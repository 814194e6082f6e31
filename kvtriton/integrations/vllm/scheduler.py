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
  preempted, has its hold **released** and is never reported.
* **Decode** (``kv_consumer``): a request carrying those params is loaded asynchronously: all its
  prompt tokens beyond the local prefix come from the prefill engine
  (``get_num_new_matched_tokens``; no more than ``remote_num_tokens`` when the params carry it,
  checked against the block ids), the blocks vLLM allocates are paired with the remote ones by
  position (``update_state_after_alloc``; when the prefill engine's ``remote_block_size`` differs
  from ours, both lists are the request's tokens in each engine's blocks and the load carries the
  token count, see :func:`kvtriton.plan.compact_tokens`), and the next step's messages carry the **load** to the
  workers. A request aborted while loading is **cancelled** on the workers, which still report it
  in ``finished_recving`` (vLLM frees its blocks then).

Remote params are untrusted (they come through a proxy, and from any client of the decode's API):
:func:`parse_remote_params` checks every field, and the peer they name must be in
``allowed_peers`` (:class:`~kvtriton.protocol.allowlist.PeerAllowlist`) before any worker
connects to it; a request with bad or disallowed params is computed locally instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import KVTritonError
from ...plan import ceil_div
from ...protocol.allowlist import PeerAllowlist

if TYPE_CHECKING:
    from ..core import PrefillEngine

__all__ = ["SchedulerSide", "StepMessages", "LoadSpec", "RemoteSource", "parse_remote_params", "ParamsError"]

logger = logging.getLogger(__name__)

MAX_REMOTE_BLOCKS = 1 << 20  # a 1M-block request is ~16M tokens at block 16: far past any context
_MAX_LOGGED_PEERS = 1024  # refused peers logged once each; past this many, no more logs (bounded memory)


class ParamsError(KVTritonError, ValueError):
    """A decode request's ``kv_transfer_params`` are malformed or do not fit this engine."""


@dataclass(frozen=True)
class RemoteSource:
    """Where a decode request's prompt KV is: a prefill engine, its handshake address, its blocks."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    request_id: str
    block_ids: tuple[int, ...]
    block_size: int  # tokens per block of the prefill engine
    #: the prompt tokens the prefill computed into ``block_ids`` (``remote_num_tokens``, as
    #: NixlConnector 0.34 sends it), None when the params do not say (older senders)
    num_tokens: int | None = None

    @property
    def engine(self) -> PrefillEngine:
        """The prefill engine it names (untrusted: checked when met)."""
        from ..core import PrefillEngine  # the scheduler side never loads the agent

        return PrefillEngine(self.engine_id, self.host, self.port, self.tp_size)


@dataclass(frozen=True)
class LoadSpec:
    """One load for the workers: position ``j`` of ``remote_block_ids`` lands in
    ``local_block_ids[j]`` (-1: already local). ``report``: tell vLLM when it ends (False for a
    load that only tells the prefill engine it may free the blocks). ``num_tokens``: when the
    engines' block sizes differ, the request's tokens (each list in its engine's blocks; a local
    -1 skips that block's tokens), else None (whole blocks by position)."""

    req_id: str
    source: RemoteSource
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    report: bool = True
    num_tokens: int | None = None


@dataclass
class StepMessages:
    """What the scheduler tells every worker in one step."""

    loads: dict[str, LoadSpec] = field(default_factory=dict)
    cancels: set[str] = field(default_factory=set)
    holds: dict[str, tuple[int, ...]] = field(default_factory=dict)
    confirms: set[str] = field(default_factory=set)
    releases: set[str] = field(default_factory=set)
    #: no tokens scheduled this step (no forward runs): the workers may wait for their loads
    idle: bool = False


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
    ids = params.get("remote_block_ids")
    if isinstance(ids, (list, tuple)) and len(ids) == 1 and isinstance(ids[0], (list, tuple)):
        ids = ids[0]  # one KV cache group, as HMA-aware engines send it
    if not isinstance(ids, (list, tuple)) or len(ids) > MAX_REMOTE_BLOCKS or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
        raise ParamsError(f"kv_transfer_params['remote_block_ids'] = {ids!r:.80}: expected a list of at most "
                          f"{MAX_REMOTE_BLOCKS} block ids >= 0")
    remote_bs = block_size if params.get("remote_block_size") is None else get(
        "remote_block_size", int, lambda v: 0 < v <= 1 << 20, "the prefill engine's block size (1..2**20)")
    num_tokens = None if params.get("remote_num_tokens") is None else get(
        "remote_num_tokens", int, lambda v: 0 <= v <= len(ids) * remote_bs,
        f"the prefill's token count, at most what its {len(ids)} blocks of {remote_bs} hold")
    return RemoteSource(engine, host, port, tp, req, tuple(ids), remote_bs, num_tokens)


def remote_params(engine_id: str, host: str, port: int, tp_size: int, block_size: int, req_id: str,
                  block_ids, num_tokens: int | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` a finished prefill returns for its decode request;
    ``remote_num_tokens``: the prompt tokens its held blocks hold (a decode on NixlConnector 0.34
    declines a pull between different block sizes without it; None: not sent, as before 0.34)."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
              "remote_host": host, "remote_port": port, "tp_size": tp_size, "remote_block_size": block_size,
              "remote_request_id": req_id, "remote_block_ids": [int(b) for b in block_ids]}
    if num_tokens is not None:
        params["remote_num_tokens"] = int(num_tokens)
    return params


@dataclass
class _Prefill:
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    held: bool = False


class SchedulerSide:
    """Scheduler-side state of one engine (see the module docstring for the protocol).

    ``request`` objects are vLLM's (``request_id``, ``kv_transfer_params``, ``num_prompt_tokens``,
    ``status``); ``scheduler_output`` is vLLM's ``SchedulerOutput``; both are read duck-typed.
    """

    def __init__(self, *, engine_id: str, host: str, port: int, tp_size: int, block_size: int,
                 allowed_peers: PeerAllowlist | None = None):
        self.engine_id, self.host, self.port = engine_id, host, port
        self.tp_size, self.block_size = tp_size, block_size
        self._allowed = allowed_peers if allowed_peers is not None and not allowed_peers.empty else None
        self._logged_peers: set[tuple[str, str, int]] = set()
        #: decode requests computed locally because their params named a peer outside allowed_peers
        self.stats = {"disallowed": 0}
        self._prefills: dict[str, _Prefill] = {}
        self._wanted: dict[str, tuple[RemoteSource, int]] = {}  # decode: source, local prefix tokens
        self._loading: set[str] = set()
        self._next = StepMessages()

    # ------------------------------------------------------------------ both roles
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if params.get("do_remote_decode") and rid not in self._prefills:
            self._prefills[rid] = _Prefill(int(request.num_prompt_tokens))
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
        self._wanted[rid] = (source, num_computed_tokens)
        # the prefill computed every prompt token (as many as remote_num_tokens says, when it
        # says); all but the local prefix come from it
        remote_tokens = len(source.block_ids) * source.block_size
        if source.num_tokens is not None:
            remote_tokens = source.num_tokens
        count = min(int(request.num_prompt_tokens), remote_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if not params.get("do_remote_prefill") or rid not in self._wanted:
            return
        params["do_remote_prefill"] = False  # one load per request, even when called again
        source, local_tokens = self._wanted.pop(rid)
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

    def build_messages(self, scheduler_output) -> StepMessages:
        """This step's messages; the state for the next step starts empty."""
        msgs, self._next = self._next, StepMessages()
        msgs.idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        if self._prefills:
            self._track_prefills(scheduler_output, msgs)
        return msgs

    def update_connector_output(self, connector_output) -> None:
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._loading.discard(rid)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        params = request.kv_transfer_params or {}
        self._wanted.pop(rid, None)
        if rid in self._loading:  # aborted while loading: cancel; workers report it when stopped
            self._loading.discard(rid)
            self._next.cancels.add(rid)
            return False, None
        if params.get("do_remote_prefill"):
            # finished before it was ever scheduled: only tell the prefill engine to free its blocks
            try:
                source = parse_remote_params(params, self.block_size)
                if self._allows(source):
                    self._next.loads[rid] = LoadSpec(rid, source, source.block_ids, (-1,) * len(source.block_ids),
                                                     report=False)
            except ParamsError:
                pass
            params["do_remote_prefill"] = False
            return False, None
        prefill = self._prefills.pop(rid, None)
        if prefill is None:
            return False, None
        status = getattr(request.status, "name", str(request.status))
        if prefill.held and block_ids and status in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"):
            self._next.confirms.add(rid)
            tokens = min(prefill.num_prompt_tokens, len(block_ids) * self.block_size)
            return True, remote_params(self.engine_id, self.host, self.port, self.tp_size, self.block_size, rid,
                                       block_ids, tokens)
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
                p.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            p = self._prefills.get(rid)
            if p is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                p.block_ids = list(new_ids[0]) if rid in resumed else p.block_ids + list(new_ids[0])
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
                msgs.holds[rid] = tuple(p.block_ids)
                msgs.releases.discard(rid)
