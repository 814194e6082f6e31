"""What both roles of a rank share: the peer table, sending, posting and retiring transfers,
kernel completions, and the prepared descriptor lists of DIRECT runs (its settings are
:mod:`.settings`, its counters :mod:`.stats`, the addresses it checks :mod:`.addresses`; the
fences that keep a peer's endpoint flushed are the transport's, :mod:`kvtriton.transport.fence`)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import PeerDisconnectedError, ProtocolError, TransportError
from ..plan import BlockRows
from ..protocol import wire
from ..protocol.auth import PairKeys
from ..protocol.channel import MessageAuthError, PairChannel, sealed
from ..transport.nixl import MemType, NixlTransport, Op, PreppedList, Xfer, XferStatus
from .addresses import CacheTables
from .device import Completion
from .settings import Flow, Settings
from .stats import Stats

__all__ = ["Chunk", "Flow", "Links", "Peer", "RowsPost", "Settings", "logger"]

logger = logging.getLogger("kvtriton.agent")


@dataclass(eq=False)
class Peer:
    md: wire.RankMetadata
    agent: str
    staging: PreppedList  # over the peer's staging slots
    authenticated: bool = False  # its metadata came over an authenticated exchange (see .peers)
    heard: float = 0.0  # time.monotonic() of its last message (or of its registration)
    pinged: float = 0.0  # when it was last sent a liveness check
    pong: int = 0  # the nonce of the last liveness check it answered
    served_at: float = 0.0  # when this rank last accepted a transfer from it (see .source.eager)
    # met with a credential: every message each way is sealed under the pair's keys (protocol.channel)
    channel: PairChannel | None = field(default=None, repr=False)
    # prepared lists over both caches, by (rows, reading): kept until the peer is released (see Links.rows_lists)
    row_lists: dict = field(default_factory=dict, repr=False)

    @property
    def key(self) -> tuple[str, int]:
        return self.md.engine, self.md.rank

    @functools.cached_property
    def tables(self) -> CacheTables:
        """Its cache's declared addresses and spans, flattened once."""
        return CacheTables.of(self.md.addrs, self.md.spans)


@dataclass(eq=False)
class Chunk:
    """One staged chunk of a transfer, in a run of local slots."""

    index: int
    slot: int
    nslots: int
    nbytes: int
    xfer: Xfer | None = None  # in flight (READ or WRITE)
    kernel: Completion | None = None  # the pack/unpack launched on it, until its result is used
    remote_slot: int = -1
    lists: tuple = ()  # one-sided staging: the prepared (local, remote) lists its READ uses
    digest: bytes = b""  # integrity=True: the source's digest of the packed bytes (see .integrity)


@dataclass(frozen=True, eq=False)
class RowsPost:
    """One transfer of cache-to-cache rows (:class:`~kvtriton.plan.BlockRows`): the prepared
    lists (the peer's, kept by :meth:`Links.rows_lists`; ``owned``: made for this transfer alone,
    released with it), the index pairs, the descriptors they post once NIXL merged the pairs
    adjacent on both sides, and their bytes."""

    local: PreppedList
    remote: PreppedList
    local_idx: np.ndarray
    remote_idx: np.ndarray
    count: int
    nbytes: int
    owned: bool = False
    peer: Peer | None = None  # whose cache ``remote`` covers (a notification on the post is sealed for it)


#: prepared row lists a peer keeps (a plan's DIRECT rows, a payload's slice rows, per direction:
#: a handful); past it a transfer prepares its own and releases them (never evicts a list in use)
MAX_ROW_LISTS = 16


class Links:
    """The peer table and everything that talks to the transport on behalf of both roles."""

    def __init__(self, settings: Settings, transport: NixlTransport, stats: Stats):
        self.s = settings
        self.transport = transport
        self.stats = stats
        self.mem: MemType = "VRAM" if settings.device.type == "cuda" else "DRAM"
        self.dev = settings.device.index or 0
        self.peers: dict[tuple[str, int], Peer] = {}
        self.by_agent: dict[str, tuple[str, int]] = {}
        self.engine_tp: dict[str, int] = {}
        # transfers to finish before their memory is reused, slots retired but not free yet:
        # (transfer, cleanup, not before, pack/unpack completion)
        self.zombies: list[tuple[Xfer | None, Callable[[], None], float, Completion | None]] = []
        self.dead: list[Peer] = []
        self.addrs = tuple(tuple(t.data_ptr() for t in r.streams) for r in settings.regions)
        self.spans = tuple(tuple(wire.stream_span(r.spec, j) for j in range(r.spec.num_streams))
                           for r in settings.regions)
        self.tables = CacheTables.of(self.addrs, self.spans)
        self.local_staging: PreppedList | None = None  # over our slots, once registered

    def exposed(self, per_stream: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        """What the metadata tells peers of our cache (addresses or spans, per region and stream):
        nothing (an empty tuple per region) when only staging is registered (``register="staging"``)."""
        return per_stream if self.s.cache_registered else tuple(() for _ in per_stream)

    # ------------------------------------------------------------------ peer table
    def add(self, peer: Peer) -> None:
        self.peers[peer.key] = peer
        self.by_agent[peer.agent] = peer.key
        self.engine_tp[peer.md.engine] = peer.md.tp
        self.transport.fences.add(peer.agent, peer.md.staging.addr, peer.md.dev, peer.md.mem)

    def trusted(self, peer: Peer) -> bool:
        """Whether ``peer`` may be trusted beyond what names it: bind an unbound hold, receive a
        guess, read full refusal reasons. Everyone, unless a credential is configured."""
        return peer.authenticated or not self.s.require_authenticated

    def reason(self, peer: Peer, text: str) -> str:
        """What a refusal tells ``peer``: the reason for a trusted one; an untrusted one learns
        only that it was refused (the reason is logged here)."""
        if self.trusted(peer):
            return text
        logger.info("refusal to untrusted %s: %s", peer.agent, text)
        return f"refused by {self.s.name}"

    def sender(self, agent: str) -> Peer | None:
        key = self.by_agent.get(agent)
        return None if key is None else self.peers[key]

    def keyed(self, peer: Peer, keys: PairKeys | None) -> None:
        """``peer`` was met (again) with a credential that gave the pair ``keys``: from now on
        every message to and from it is sealed (:mod:`kvtriton.protocol.channel`). None (met
        without keys) changes nothing: a peer's keys are never dropped for an unkeyed meeting."""
        if keys is None:
            return
        if peer.channel is None:
            peer.channel = PairChannel(keys)
        else:
            peer.channel.rekey(keys)

    def open(self, agent: str, raw: bytes) -> bytes | None:
        """The message a notification from ``agent`` carries, or None (counted, logged): an
        unknown agent; or, from a peer we hold pair keys with, a message not sealed under them,
        a replay or one reordered too far; or a sealed message from a peer we hold none with.
        Checked as it arrives, before anything reads the message (:class:`.inbox.Inbox`)."""
        peer = self.sender(agent)
        if peer is None:
            self.stats.bad_messages += 1
            logger.warning("message from unknown agent %r dropped", agent)
            return None
        try:
            if peer.channel is not None:
                return peer.channel.open(raw)
            if sealed(raw):
                raise MessageAuthError("a sealed message from a peer this rank holds no pair key with")
            return raw
        except MessageAuthError as e:
            self.stats.bad_messages += 1
            self.stats.forged_messages += 1
            logger.warning("message from %s refused: %s", agent, e)
            return None

    @staticmethod
    def wrap(peer: Peer, msg: wire.Message | None) -> bytes:
        """The bytes of ``msg`` as ``peer`` receives them: sealed when we hold pair keys with it."""
        if msg is None:
            return b""
        raw = msg.encode()
        return raw if peer.channel is None else peer.channel.seal(raw)

    def engine_peers(self, engine: str) -> list[Peer]:
        """Every connected rank of ``engine`` (ranks not connected yet or dropped are missing)."""
        return [p for r in range(self.engine_tp.get(engine, 0)) if (p := self.peers.get((engine, r)))]

    def forget(self, peer: Peer) -> None:
        """Drop a peer; its NIXL state is released once no transfer uses it any more."""
        fence = self.transport.fences.forget(peer.agent)
        if fence is not None:
            self.retire(fence, lambda: None)
        self.peers.pop(peer.key, None)
        self.by_agent.pop(peer.agent, None)
        self.dead.append(peer)
        self.reap()

    def send(self, peer: Peer, msg: wire.Message, quiet: bool = False) -> None:
        """Notify ``peer``; ``quiet`` for best-effort messages whose loss the peer survives."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("-> %s %r", peer.agent, msg)
        try:
            self.transport.send_notif(peer.agent, self.wrap(peer, msg))
        except TransportError as e:
            if quiet:
                logger.info("notification to %s lost: %s", peer.agent, e)
                return
            raise PeerDisconnectedError(f"{peer.md.engine}:{peer.md.rank} unreachable: {e}") from e

    # ------------------------------------------------------------------ transfers
    def post_chunk(self, op: Op, ch: Chunk, peer: Peer, notif: wire.Message | None = None) -> Xfer:
        """READ or WRITE one staged chunk: its local slot run against ``ch.remote_slot``'s."""
        if self.local_staging is None:
            raise TransportError(f"{self.s.name}: staging is not registered yet")
        idx = np.arange(ch.nslots)
        xfer = self.transport.post(op, self.local_staging, ch.slot + idx, peer.staging, ch.remote_slot + idx,
                                   self.wrap(peer, notif))
        self.stats.staged_descriptors += 1
        return xfer

    def post_pieces(self, op: Op, local, remote, count: int) -> Xfer:
        """READ or WRITE the ``count`` one-sided pieces of :meth:`prep_pieces` (counted as
        ``one_sided_descriptors``)."""
        idx = np.arange(count)
        xfer = self.transport.post(op, local, idx, remote, idx, b"")
        self.stats.one_sided_descriptors += count
        return xfer

    def prep_pieces(self, peer: Peer, local_addr: np.ndarray, remote_addr: np.ndarray, nbytes: np.ndarray):
        """Prepared (local, remote) lists of byte ranges paired one to one (callers bound them)."""
        local = np.stack([local_addr, nbytes, np.full_like(nbytes, self.dev)], axis=1)
        remote = np.stack([remote_addr, nbytes, np.full_like(nbytes, peer.md.dev)], axis=1)
        return self._prep(peer, local, remote)

    def _prep(self, peer: Peer, local: np.ndarray, remote: np.ndarray) -> tuple[PreppedList, PreppedList]:
        """Prepared lists over our ``local`` descriptors and ``peer``'s ``remote`` ones (both or neither)."""
        ll = self.transport.prep_local(local, self.mem)
        try:
            return ll, self.transport.prep_remote(peer.agent, remote, peer.md.mem)
        except BaseException:
            self.transport.release_list(ll)
            raise

    def done(self, xfer: Xfer) -> bool:
        st = self.transport.poll(xfer)
        if st is XferStatus.ERR:
            raise TransportError(f"{xfer.op} with {xfer.remote!r} failed")
        return st is XferStatus.DONE

    def retire(self, xfer: Xfer | None, cleanup: Callable[[], None], not_before: float = 0.0,
               kernel: Completion | None = None) -> None:
        """Abort ``xfer`` (if any) and run ``cleanup`` once it can no longer touch our memory,
        ``not_before`` has passed and ``kernel`` (a pack/unpack still running on the agent's
        stream into or out of the slots) has completed; until then its slots stay allocated."""
        self.zombies.append((xfer, cleanup, not_before, kernel))
        self.reap()

    def retire_chunks(self, inflight: dict[int, Chunk], not_before: float,
                      on_free: Callable[[Chunk], None] | None = None) -> None:
        """Retire every chunk of a transfer that ended early and empty ``inflight``: their slots
        return to the pool (then ``on_free(chunk)`` runs) once nothing can move bytes into or out
        of them any more."""
        pool = self.s.pool

        def free(ch: Chunk) -> None:
            self.release_lists(*ch.lists)()
            if ch.nslots:  # a pack-then-place READ has no local slot
                pool.free(ch.slot, ch.nslots)
            if on_free is not None:
                on_free(ch)

        for ch in inflight.values():
            self.retire(ch.xfer, functools.partial(free, ch), not_before=not_before, kernel=ch.kernel)
        inflight.clear()

    def finished(self, xfer: Xfer, cleanup: Callable[[], None]) -> None:
        """A transfer seen done (:meth:`done`): release it and run ``cleanup`` now (what
        :meth:`retire` would do at its next reap, without queueing it or polling it again)."""
        try:
            self.transport.release(xfer)
        except TransportError:
            pass
        cleanup()

    def reap(self) -> None:
        """Finish retired transfers: wait for (or abort) them, then run their cleanup; release
        dead peers no transfer uses any more."""
        if not self.zombies and not self.dead:  # every progress() call: nothing retired, nobody gone
            return
        keep, now = [], time.monotonic()
        for xfer, cleanup, not_before, kernel in self.zombies:
            if xfer is not None:
                try:
                    busy = self.transport.poll(xfer) is XferStatus.PROC
                except TransportError:
                    busy = False  # the peer is gone: nothing will move any more
                if busy:
                    try:
                        self.transport.release(xfer)  # aborts if UCX can
                        xfer, busy = None, False
                    except TransportError:
                        pass
                if busy:
                    keep.append((xfer, cleanup, not_before, kernel))
                    continue
                if xfer is not None:
                    try:
                        self.transport.release(xfer)
                    except TransportError:
                        pass
            if now < not_before or (kernel is not None and not kernel.done()):
                keep.append((None, cleanup, not_before, kernel))
                continue
            cleanup()
        self.zombies = keep
        busy_with = {getattr(z[0], "remote", None) for z in keep if z[0] is not None}
        for peer in [p for p in self.dead if p.agent not in busy_with]:
            self.dead.remove(peer)
            releases = [functools.partial(self.transport.release_list, lists[0]) for lists in peer.row_lists.values()]
            peer.row_lists.clear()  # their remote halves go with the peer's agent
            releases.append(functools.partial(self.transport.release_list, peer.staging))
            if peer.agent not in self.by_agent:  # else its agent registered again and is a peer anew
                releases.append(functools.partial(self.transport.remove_remote, peer.agent))
            for release in releases:
                try:
                    release()
                except TransportError:
                    pass

    def settle(self, timeout_s: float) -> None:
        """Drive UCX until every retired transfer has settled (aborted or finished), at most
        ``timeout_s``: before the memory they touch is deregistered."""
        deadline = time.monotonic() + timeout_s
        while any(x is not None for x, *_ in self.zombies) and time.monotonic() < deadline:
            self.transport.poll_notifs()  # notifications arriving now are dropped: every peer is gone
            self.reap()

    def release_lists(self, *lists: PreppedList) -> Callable[[], None]:
        """A cleanup that releases prepared lists (best effort: a failure only leaks a handle)."""
        def cb() -> None:
            for pl in lists:
                try:
                    self.transport.release_list(pl)
                except TransportError as e:  # pragma: no cover - best effort
                    logger.warning("release of a prepared list failed: %s", e)
        return cb

    # ------------------------------------------------------------------ cache-to-cache rows
    def rows_lists(self, peer: Peer, rows: BlockRows, *, reading: bool) -> tuple[PreppedList, PreppedList, bool]:
        """``(local list, remote list, owned)`` prepared over ``rows`` between our cache and
        ``peer``'s (``reading``: we hold the destination side), one strided row per side and row
        (prepared in ~0.1 ms whatever the caches' size). Made once per peer, rows and direction
        and kept until the peer is released (``owned`` False), so a request posts indices only,
        as vLLM's NixlConnector does; past :data:`MAX_ROW_LISTS` per peer made for the caller
        alone (``owned``: release them with the transfer).

        Every row is bounds-checked on both sides against what each declared (``ProtocolError``
        when the peer's falls outside: its metadata is untrusted): its last block's range must
        end inside the stream's span."""
        key = (rows.key, reading)
        got = peer.row_lists.get(key)
        if got is not None:
            return got[0], got[1], False
        region, stream = rows.region, rows.stream
        src, dst = (peer.tables, self.tables) if reading else (self.tables, peer.tables)
        sides = []
        for tables, off, stride, blocks, whose in ((src, rows.src_offset, rows.src_stride, rows.src_blocks, "source"),
                                                   (dst, rows.dst_offset, rows.dst_stride, rows.dst_blocks,
                                                    "destination")):
            end = off + (blocks - 1) * stride + rows.tile
            if (off < 0).any() or (blocks < 1).any() or (end > tables.spans.at(region, stream)).any():
                raise ProtocolError(f"direct rows fall outside the regions the {whose} declared "
                                    f"({peer.agent} is the {'source' if reading else 'destination'})")
            sides.append(np.stack([tables.addrs.at(region, stream) + off, rows.tile,
                                   np.full_like(off, self.dev if tables is self.tables else peer.md.dev),
                                   stride, blocks], axis=1))
        local, remote = (sides[1], sides[0]) if reading else (sides[0], sides[1])
        ll, rl = self._prep(peer, local, remote)
        owned = len(peer.row_lists) >= MAX_ROW_LISTS
        if not owned:
            peer.row_lists[key] = (ll, rl)
        return ll, rl, owned

    def prep_rows(self, peer: Peer, rows: BlockRows, src_ids: np.ndarray, dst_ids: np.ndarray, *,
                  reading: bool, group_bounds: Sequence[int] | None = None,
                  checked: tuple[int, int] | None = None) -> RowsPost | None:
        """What ``rows`` (a pair's zero-copy rows, :meth:`~kvtriton.plan.PairPlan.rows`) move
        between us and ``peer`` for a compacted request (``src_ids`` / ``dst_ids``: the source's
        and the destination's block per position), prepared for one transfer; None when
        nothing. ``reading``: we are the destination (pull); else we are the source writing.
        ``group_bounds``: the request's KV cache groups (:meth:`BlockRows.select`). ``checked``:
        the bounds the caller checked the (source, destination) ids against, each in ``[0, bound)``
        (a fetch's own ids): no second pass over them where the rows hold at least as many blocks."""
        src_ids, dst_ids = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
        s_idx, d_idx, count, nbytes = rows.select(src_ids, dst_ids, group_bounds)
        if not s_idx.size:
            return None
        # callers checked the ids against both caches; an index past its row would name another row's block
        bounds = (None, None) if checked is None else checked
        for ids, blocks, side, bound in ((src_ids, rows.num_blocks[0], "source", bounds[0]),
                                         (dst_ids, rows.num_blocks[1], "destination", bounds[1])):
            if (bound is None or bound > blocks) and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= blocks):
                raise ProtocolError(f"{side} block ids outside [0, {blocks}) for direct rows")
        ll, rl, owned = self.rows_lists(peer, rows, reading=reading)
        local_idx, remote_idx = (d_idx, s_idx) if reading else (s_idx, d_idx)
        return RowsPost(ll, rl, local_idx, remote_idx, count, nbytes, owned, peer)

    def post_rows(self, op: Op, rp: RowsPost, notif: wire.Message | None = None) -> Xfer:
        """READ or WRITE what :meth:`prep_rows` prepared: one transfer of a source rank's
        zero-copy rows, DIRECT runs and head slices alike (counted as ``direct_descriptors``)."""
        raw = b""
        if notif is not None:
            if rp.peer is None:
                raise TransportError("a notification on a post needs the peer it goes to")
            raw = self.wrap(rp.peer, notif)
        xfer = self.transport.post(op, rp.local, rp.local_idx, rp.remote, rp.remote_idx, raw)
        self.stats.direct_descriptors += rp.count
        return xfer

    def release_post(self, rp: RowsPost) -> Callable[[], None]:
        """A cleanup for a transfer of ``rp``: releases its lists if they were its own."""
        return self.release_lists(rp.local, rp.remote) if rp.owned else (lambda: None)
