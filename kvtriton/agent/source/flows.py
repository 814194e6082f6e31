"""One class per flow of the transfers a source rank serves, each accepting its own requests:

* :class:`PullServe`: each packed chunk is announced (``ready``) and READ by the peer; DIRECT
  runs (or the cache blocks themselves) are READ by the peer until its RunsDone. Accepting a
  pull takes what was packed or offered ahead of it (:mod:`.eager`, :mod:`.offers`).
* :class:`PushServe`: each packed chunk is WRITten into a slot the peer granted; the DIRECT runs
  are WRITten into its cache. Accepting a push checks the destination ids and prepares the runs.

Over :class:`Serve`, what both keep. :class:`~.serves.Serves` owns the open transfers; a flow's
steps are given it (``serves``, typed as :class:`Serving`: what they ask of it) for links,
staging and the pack batch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, TypeVar

import numpy as np

from ...errors import KVTritonError
from ...plan import ChunkGeometry, Payload, TokenMap
from ...protocol import wire
from ...transport.handles import Xfer
from ..device import event_done
from ..integrity import seal
from ..links import Chunk, Flow, Links, Peer, RowsPost
from ..settings import Settings
from ..stats import Stats
from .admission import Admitted, Rejection
from .holds import Holds
from .share import StagingShare

if TYPE_CHECKING:
    import torch

__all__ = ["PullServe", "PushServe", "Serve", "Serving", "TakePacked"]

# (request, peer, plan digest, ids asked or None, chunks asked or None) -> the chunks packed ahead it takes
TakePacked = Callable[[str, Peer, str, "np.ndarray | None", "ChunkGeometry | None"], dict[int, Chunk]]


class Serving(Protocol):
    """What the transfers' steps (and the offers, :mod:`.offers`) ask of the rank serving them:
    its :class:`~.serves.Serves`, described here so that the flows need not import the table."""

    s: Settings
    links: Links
    stats: Stats
    holds: Holds
    share: StagingShare
    by_key: dict[tuple[str, str], Serve]
    take_packed: TakePacked

    def room(self, peer: Peer) -> bool: ...

    def add(self, serve: Serve) -> None: ...

    def remove(self, serve: Serve) -> None: ...

    def reserve(self, serve: Serve, chunk: int) -> Chunk | None: ...

    def drop(self, serve: Serve, notify: str | None = None, quarantine: bool | None = None) -> None: ...


# the message a flow's transfers are asked by: a pull, or a push
Asked = TypeVar("Asked", wire.Pull, wire.Push)


@dataclass(eq=False)
class Serve(Generic[Asked]):
    """One (request, destination rank) transfer: what both flows keep."""

    flow: ClassVar[Flow]
    xid: str
    req_id: str
    peer: Peer
    read: Payload | None
    ids: np.ndarray
    chunks: ChunkGeometry | None  # None when this rank sends the destination no staged payload
    timeout_s: float
    deadline: float
    tokens: TokenMap | None = None  # block sizes differ: the request's token map (ids = its read_ids)
    ready: torch.cuda.Event | None = None  # the hold's: packs wait for it on the device, DIRECT runs on the host
    next_chunk: int = 0
    acked: int = 0
    inflight: dict[int, Chunk] = field(default_factory=dict)  # by chunk number
    waiting_local: bool = False  # blocked on our own staging: not the peer's silence
    waiting_engine: bool = False  # blocked on the hold's event (the engine still writing the blocks)

    @classmethod
    def accept(cls, m: Asked, peer: Peer, admitted: Admitted, serves: Serving) -> Serve[Asked]:
        """The transfer ``m`` asks, which passed the source's checks, set up for its flow; raises
        :class:`~.admission.Rejection` when what its flow checks refuses it."""
        raise NotImplementedError

    def opened(self, serves: Serving) -> None:
        """It is served now (added, its hold bound): what its flow does at once."""

    @property
    def n_chunks(self) -> int:
        return self.chunks.count if self.chunks is not None else 0

    @property
    def key(self) -> tuple[str, str]:
        return self.peer.agent, self.xid

    def touch(self) -> None:
        """Progress was made: the silence deadline starts over."""
        self.deadline = time.monotonic() + self.timeout_s

    @property
    def complete(self) -> bool:
        return self.acked == self.n_chunks and not self.inflight

    def advance(self, serves: Serving) -> None:
        """Send what was packed, then reserve the next chunks (packed at the end of the step)."""
        raise NotImplementedError

    def send_packed(self, serves: Serving) -> None:
        """Send the chunks whose pack finished."""
        raise NotImplementedError

    def ended(self, serves: Serving, told: bool, until: float) -> None:
        """The transfer was dropped (``told``: its peer may still be reading, slots quarantined
        ``until``): what its flow keeps besides its chunks goes."""


@dataclass(eq=False)
class PullServe(Serve[wire.Pull]):
    """A pull: each packed chunk is announced (``ready``) and READ by the peer, which acks it; the
    peer READs DIRECT runs from our cache until it sends RunsDone."""

    flow: ClassVar[Flow] = Flow.PULL
    runs_reader: bool = False  # the peer reads our cache directly until it sends RunsDone
    runs_announce: bool = False  # RunsReady not sent yet (the hold's event had not completed)

    @classmethod
    def accept(cls, m: wire.Pull, peer: Peer, admitted: Admitted, serves: Serving) -> PullServe:
        """A pull takes what was packed ahead for exactly it (its Ready goes out this progress();
        one that reads our cache needs no pack: it is freed)."""
        r, timeout_s = admitted.request, serves.s.timeout_s
        serve = cls(m.xid, m.req, peer, admitted.read, r.src_ids, admitted.chunks, timeout_s,
                    time.monotonic() + timeout_s, tokens=r.tokens, ready=admitted.hold.ready,
                    runs_reader=admitted.runs)  # the blocks stay held (up to the hold's bound) until RunsDone
        if admitted.reads_cache or admitted.chunks is not None:
            ids = admitted.ids if r.tokens is None else None  # a token-mapped pull is never packed ahead
            serve.inflight = serves.take_packed(m.req, peer, r.digest, ids, admitted.chunks)
            serve.next_chunk = len(serve.inflight)
        return serve

    def opened(self, serves: Serving) -> None:
        if not self.runs_reader:
            return
        if not event_done(self.ready):  # the engine is still writing them: the serve's step sends it
            self.runs_announce = True
            return
        try:
            serves.links.send(self.peer, wire.RunsReady(self.xid))
        except KVTritonError:
            serves.drop(self)  # frees chunks it took from an eager pack too
            raise

    @property
    def complete(self) -> bool:
        return super().complete and not self.runs_reader

    def advance(self, serves: Serving) -> None:
        # announce every chunk whose pack finished, then reserve the next while staging allows
        self.waiting_local = self.waiting_engine = False
        if self.runs_announce:  # DIRECT runs: the peer reads the cache once the engine's writes are done
            if not event_done(self.ready):
                self.waiting_engine = True
            else:
                self.runs_announce = False
                serves.links.send(self.peer, wire.RunsReady(self.xid))
        self.send_packed(serves)
        while self.next_chunk < self.n_chunks and len(self.inflight) < serves.s.inflight:
            if serves.reserve(self, self.next_chunk) is None:
                self.waiting_local = True
                return  # staging full: wait for acks (here or of other transfers)
            self.next_chunk += 1

    def send_packed(self, serves: Serving) -> None:
        """A ``ready`` for every chunk whose pack finished."""
        for ch in self.inflight.values():
            if ch.kernel is not None and ch.kernel.done():
                ch.kernel = None
                serves.links.send(self.peer, wire.Ready(self.xid, ch.index, ch.slot, ch.nslots, ch.nbytes,
                                                        seal(serves.s, serves.stats, ch)))

    def ended(self, serves: Serving, told: bool, until: float) -> None:
        if self.runs_reader and told:  # the peer may still be reading our cache: keep the blocks a while
            serves.holds.keep_until(self.req_id, until)


@dataclass(eq=False)
class PushServe(Serve[wire.Push]):
    """A push: each packed chunk is WRITten into a slot the peer granted; the DIRECT runs are
    WRITten straight into its cache."""

    flow: ClassVar[Flow] = Flow.PUSH
    grants: deque[wire.Grant] = field(default_factory=deque)  # waiting for a local slot
    granted: set[int] = field(default_factory=set)  # chunks the peer granted slots for
    runs: RowsPost | None = None  # the DIRECT runs to WRITE
    runs_xfer: Xfer | None = None  # the WRITE of the DIRECT runs, until it completes

    @classmethod
    def accept(cls, m: wire.Push, peer: Peer, admitted: Admitted, serves: Serving) -> PushServe:
        """A push names the destination block of every tile; its DIRECT runs are prepared here."""
        r = admitted.request
        n, nb = r.num_tiles, min(s.num_blocks for s in peer.md.regions)
        dst_ids = np.asarray(m.dst_ids, dtype=np.int64)
        if dst_ids.size != n or (dst_ids.size and (dst_ids.min() < 0 or dst_ids.max() >= nb)) \
                or np.unique(dst_ids).size != dst_ids.size:
            raise Rejection(f"push: dst_ids must be {n} distinct ids in [0, {nb})")
        try:
            rows = r.pairs[serves.s.rank].rows()  # the DIRECT rows: a push's payload is staged
            runs = serves.links.prep_rows(peer, rows, admitted.ids, dst_ids, reading=False,
                                          group_bounds=r.group_bounds)
        except KVTritonError as e:
            raise Rejection(f"push: {e}") from e
        timeout_s = serves.s.timeout_s
        return cls(m.xid, m.req, peer, admitted.read, r.src_ids, admitted.chunks, timeout_s,
                   time.monotonic() + timeout_s, tokens=r.tokens, ready=admitted.hold.ready, runs=runs)

    @property
    def complete(self) -> bool:
        return super().complete and self.runs is None

    def advance(self, serves: Serving) -> None:
        links, runs = serves.links, self.runs
        if runs is not None and self.runs_xfer is None and event_done(self.ready):
            self.runs_xfer = links.post_rows("WRITE", runs, wire.RunsReady(self.xid))
        if runs is not None and self.runs_xfer is not None and links.done(self.runs_xfer):  # ERR raises: reject
            links.transport.release(self.runs_xfer)
            links.release_post(runs)()
            self.runs, self.runs_xfer = None, None
        self.waiting_local = False
        self.waiting_engine = self.runs is not None and self.runs_xfer is None  # the engine is still writing
        self.send_packed(serves)
        while self.grants and len(self.inflight) < serves.s.inflight:
            grant = self.grants[0]
            ch = serves.reserve(self, grant.chunk)
            if ch is None:
                self.waiting_local = True
                return
            self.grants.popleft()
            ch.remote_slot = grant.slot

    def send_packed(self, serves: Serving) -> None:
        """A landed WRITE frees its slots; a finished pack is written."""
        links = serves.links
        for chunk, ch in list(self.inflight.items()):
            if ch.xfer is not None:
                if links.done(ch.xfer):
                    links.transport.release(ch.xfer)
                    serves.share.free(self.peer.md.engine, ch)
                    del self.inflight[chunk]
                    self.acked += 1
            elif ch.kernel is not None and ch.kernel.done():
                ch.kernel = None
                ch.xfer = links.post_chunk("WRITE", ch, self.peer, wire.Data(self.xid, ch.index, ch.nbytes,
                                                                              seal(serves.s, serves.stats, ch)))

    def ended(self, serves: Serving, told: bool, until: float) -> None:
        if self.runs is not None:
            serves.links.retire(self.runs_xfer, serves.links.release_post(self.runs))
            self.runs, self.runs_xfer = None, None
