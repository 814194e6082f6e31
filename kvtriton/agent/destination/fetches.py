"""A destination rank's fetches: each request in flight, its parts by transfer id, and the
results of those that ended (finished, or failed with the blocks left undefined)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from ...errors import KVTritonError, ProtocolError, TransferTimeoutError
from ...protocol import wire
from ..links import Links, Peer
from ..reports import Reports
from .fetch import Fetch
from .offers import Offers
from .parts import Part


@dataclass(frozen=True)
class RequestResult:
    """Outcome of a :meth:`TransferAgent.fetch`: ``ok``, or ``error`` (a KVTritonError).

    ``undefined_blocks``: after a failure, the local block ids whose content is undefined (some
    source's bytes for them had not all landed, or may still land): recompute exactly those.
    Every other block of the request holds the transferred KV. Empty when ``ok``.

    The per-transfer record of :mod:`kvtriton.agent.stats`: ``seconds`` from ``fetch()`` to the
    KV loaded (or the failure), ``descriptors`` and ``bytes`` posted, ``post_seconds`` spent in
    NIXL's post calls, ``ways``: ``((way, source-rank payloads), ...)``, sorted."""

    req_id: str
    ok: bool
    error: KVTritonError | None = None
    seconds: float = 0.0
    descriptors: int = 0
    bytes: int = 0
    undefined_blocks: tuple[int, ...] = ()
    post_seconds: float = 0.0
    ways: tuple[tuple[str, int], ...] = ()


class Fetches:
    """The fetches in flight (by request), their parts (by transfer id) and the results not
    taken yet. Ending a fetch records its result and tells its sources (a finish: in the next
    ``progress()``, :meth:`finish`)."""

    def __init__(self, name: str, rank: int, tp: int, links: Links, offers: Offers):
        self.name, self.rank, self.tp, self.links, self.offers = name, rank, tp, links, offers
        self.by_req: dict[str, Fetch] = {}
        self.parts: dict[str, Part] = {}  # by transfer id
        self.results: Reports[RequestResult] = Reports()  # taken without the agent's lock (.reports)
        #: the Done of each finished fetch to each rank of its source engine, sent by :meth:`send_dones`
        #: in the next ``progress()``: a fetch's result is reported when its bytes landed, not after
        #: its messages (why: :meth:`finish`)
        self.dones: list[tuple[Peer, wire.Done]] = []
        self._xid = itertools.count()

    def __len__(self) -> int:
        return len(self.by_req)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.by_req

    def new_xid(self, req_id: str, src_rank: int) -> str:
        """A fresh transfer id for ``src_rank``'s part of ``req_id``; never one in use (a
        source's offer may have squatted the next one: a part is never overwritten)."""
        xid = f"{req_id}|{self.name}<{src_rank}#{next(self._xid)}"
        while xid in self.parts:
            xid = f"{req_id}|{self.name}<{src_rank}#{next(self._xid)}"
        return xid

    def add(self, f: Fetch) -> None:
        self.by_req[f.req_id] = f

    def add_part(self, part: Part) -> None:
        """Index ``part`` by its transfer id (an offered part goes by the source's id: its messages use it)."""
        part.fetch.parts[part.src_rank] = part
        self.parts[part.xid] = part

    def part_from(self, peer: Peer, xid: str) -> Part:
        """The part ``xid`` that ``peer`` sends; ProtocolError when there is none."""
        part = self.parts.get(xid)
        if part is None or (part.fetch.engine, part.src_rank) != peer.key:
            raise ProtocolError(f"message for unknown transfer {xid!r}")
        return part

    def part_of(self, peer: Peer, xid) -> Part | None:
        """The part ``xid`` from ``peer``, or None (no error: the caller fails or ignores)."""
        part = self.parts.get(xid) if isinstance(xid, str) else None
        if part is not None and (part.fetch.engine, part.src_rank) == peer.key:
            return part
        return None

    def take_results(self) -> list[RequestResult]:
        """The results recorded and not taken yet; needs no lock (:mod:`..reports`)."""
        return self.results.take()

    # ------------------------------------------------------------------ ending
    def maybe_finish(self, f: Fetch) -> None:
        if f.error is None and all(p.complete for p in f.parts.values()) and f.req_id in self.by_req:
            self.finish(f)

    def _forget(self, f: Fetch) -> None:
        self.by_req.pop(f.req_id, None)
        for part in f.parts.values():
            self.parts.pop(part.xid, None)

    def finish(self, f: Fetch) -> None:
        """``f`` landed: its result now, its Dones queued for :meth:`send_dones`. Every rank of the
        source engine learns this consumer is done (skipped replicas too); a part's RunsDone not
        sent yet rides on its rank's Done (one notification, not two). Why not at once: the Dones
        and the fence they call for (:mod:`kvtriton.transport.fence`) are a third of a small fetch's
        host time here, and the engine waits for the result, not for them; the source frees the
        blocks one ``progress()`` later."""
        self._forget(f)
        self.offers.drop(f.engine, f.req_id)  # made from the hold our Done ends: never READ again
        self.results.add(RequestResult(f.req_id, True, None, time.monotonic() - f.started,
                                       f.descriptors, f.nbytes, post_seconds=f.post_s, ways=_ways(f)))
        for peer in self.links.engine_peers(f.engine):
            part = f.parts.get(peer.md.rank)
            riding = part.runs_done_riding() if part is not None else ""
            self.dones.append((peer, wire.Done(f.req_id, self.rank, self.tp, riding)))

    def send_dones(self, req_id: str | None = None) -> None:
        """Send the queued Dones (``req_id``: only when one of them is that request's, e.g. before it
        is fetched again: its Done must reach the source before the new fetch's messages). A peer
        dropped or met again since gets none: its holds ended with it."""
        if not self.dones or (req_id is not None and all(m.req != req_id for _, m in self.dones)):
            return
        dones, self.dones = self.dones, []
        for peer, msg in dones:
            if self.links.peers.get(peer.key) is peer:
                self.links.send(peer, msg, quiet=True)

    def fail(self, f: Fetch, error: KVTritonError) -> None:
        if f.error is not None:
            return
        f.error = error
        self._forget(f)
        for part in f.parts.values():
            peer = self.links.peers.get((f.engine, part.src_rank))
            if peer is not None:
                self.links.send(peer, wire.Abort(part.xid), quiet=True)
            part.release()
        self.results.add(RequestResult(f.req_id, False, error, time.monotonic() - f.started,
                                       f.descriptors, f.nbytes, _undefined_blocks(f), f.post_s, _ways(f)))

    def refused(self, req_id: str, error: KVTritonError, undefined: tuple[int, ...]) -> None:
        """The result of a fetch that failed before it started (a deferred one: :mod:`.deferred`)."""
        self.results.add(RequestResult(req_id, False, error, undefined_blocks=undefined))

    def expire(self, now: float) -> None:
        for f in list(self.by_req.values()):
            if now > f.deadline:
                waiting = sorted(r for r, p in f.parts.items() if not p.complete)
                self.fail(f, TransferTimeoutError(
                    f"fetch {f.req_id!r} from {f.engine!r} made no progress for {f.timeout_s} s; waiting on "
                    f"source ranks {waiting}"))

    def shift(self, seconds: float) -> None:
        """Every silence deadline later by ``seconds`` (this process stalled: :mod:`..stalls`)."""
        for f in self.by_req.values():
            f.deadline += seconds

    def peer_lost(self, peer: Peer, error: KVTritonError) -> None:
        for f in list(self.by_req.values()):
            if f.engine == peer.md.engine and peer.md.rank in f.parts:
                self.fail(f, error)

    def fail_all(self, error: KVTritonError) -> None:
        for f in list(self.by_req.values()):
            self.fail(f, error)


def _ways(f: Fetch) -> tuple[tuple[str, int], ...]:
    """How many of ``f``'s source-rank payloads travelled each way (DIRECT runs as one)."""
    n: dict[str, int] = {}
    for part in f.parts.values():
        for way in part.ways:
            n[way] = n.get(way, 0) + 1
    return tuple(sorted(n.items()))


def _undefined_blocks(f: Fetch) -> tuple[int, ...]:
    """Local blocks of a failed fetch that did not receive every source's bytes: a block is
    defined only when each part has unpacked the chunk holding it and landed its DIRECT runs."""
    n = f.dst_ids.size
    defined = np.ones(n, dtype=bool)
    for part in f.parts.values():
        defined &= part.defined(n)
    if not f.parts:
        defined[:] = False
    return tuple(int(b) for b in f.dst_ids[~defined])
