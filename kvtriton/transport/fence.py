"""Fences: the transport's workaround for UCX endpoint flushes that wait on a peer's progress.

NIXL completes a transfer with an endpoint flush, and where UCX carries messages on a lane without
remote completion (TCP: this host's only one besides CMA), a flush after any message waits for the
peer's worker to answer. A READ posted later would then wait for the peer's next progress (its
agent's thread, up to its progress interval; a prefill engine's GIL on top) even with the bytes
already copied at the post. A fence pays that wait between requests instead: after messages to a
peer, one READ of :data:`FENCE_BYTES` at the start of the peer's staging (into a fence buffer of
ours, nothing else touched), in the background; the next READ then completes at its post (a small
load in one engine step). (The first two READs from a peer's cache still wait for it: UCX wires
that up then.) One fence per peer at a time, and one transfer per peer for all its fences: made at
its first, posted again for every later one (no request made and released per fence).

Only peers we post transfers to are fenced (:attr:`Fence.initiator`: a decode's sources in pull, a
prefill's destinations in push): a fence is itself a transfer, and one posted by the side that only
messages (a prefill after its offer) made the *other* side's next READ wait for this side's
progress, the very wait fences remove.

The transport marks its own sends and posts (:meth:`Fences.sent`, :meth:`Fences.posted`); its
user names the peers that may be fenced (:meth:`Fences.add`, :meth:`Fences.forget`), gives the
buffer fences land in (:meth:`Fences.arm`) and calls :meth:`Fences.flush` once per progress call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import TransportError
from .handles import MemType, Op, PreppedList, Xfer, XferStatus

__all__ = ["FENCE_BYTES", "Fence", "Fences"]

logger = logging.getLogger(__name__)

#: bytes a fence READs
FENCE_BYTES = 64


@dataclass(eq=False)
class Fence:
    """One peer's fencing: where its staging starts, and what was sent and posted to it."""

    addr: int  # the peer's staging start, what its fences READ
    dev: int
    mem: MemType
    unflushed: bool = False  # a message was sent to it since its endpoint was last fenced
    initiator: bool = False  # a transfer (READ or WRITE) was posted to it: only such peers are fenced
    xfer: Xfer | None = None  # its fence READ, made at the first fence and posted again for every later one
    inflight: bool = False  # ``xfer`` was posted and has not been seen landed
    remote: PreppedList | None = None  # FENCE_BYTES at its staging's start, prepared at its first fence
    count: int = 0  # fences posted to it


class Posting(Protocol):
    """What fences need of their transport (:class:`~.nixl.NixlTransport`'s calls)."""

    def prep_local(self, descs: np.ndarray, mem_type: MemType) -> PreppedList: ...
    def prep_remote(self, agent_name: str, descs: np.ndarray, mem_type: MemType) -> PreppedList: ...
    def post(self, op: Op, local: PreppedList, local_idx: Sequence[int] | np.ndarray, remote: PreppedList,
             remote_idx: Sequence[int] | np.ndarray, notif: bytes = b"") -> Xfer: ...
    def repost(self, x: Xfer, notif: bytes | None = None) -> XferStatus: ...
    def poll(self, x: Xfer) -> XferStatus: ...
    def release(self, x: Xfer) -> None: ...


class Fences:
    """The fences of one :class:`~.nixl.NixlTransport`, one :class:`Fence` per peer agent named
    by :meth:`add` (see the module docstring)."""

    def __init__(self, transport: Posting) -> None:
        self._transport = transport
        self._local: PreppedList | None = None  # our buffer fences READ into, once armed
        self.peers: dict[str, Fence] = {}

    def arm(self, addr: int, dev: int, mem: MemType) -> None:
        """Start fencing, READing into our :data:`FENCE_BYTES` at ``addr`` (registered memory
        that nothing else uses: a peer's bytes land there)."""
        self._local = self._transport.prep_local(np.array([[addr, FENCE_BYTES, dev]], dtype=np.int64), mem)

    def disarm(self) -> PreppedList | None:
        """Stop fencing (our buffer is about to be deregistered): every peer's fence transfer is
        released (made from the list over our buffer); that list, for the caller to release.
        :meth:`arm` starts again."""
        for fence in self.peers.values():
            self._drop(fence)
        local, self._local = self._local, None
        return local

    def add(self, agent: str, staging_addr: int, dev: int, mem: MemType) -> None:
        """Fence ``agent`` from now on, READing at ``staging_addr`` (its staging's start)."""
        old = self.peers.get(agent)
        if old is not None:  # registered again: its old fence transfer is of no use any more
            self._drop(old)
        self.peers[agent] = Fence(staging_addr, dev, mem)

    def forget(self, agent: str) -> Xfer | None:
        """Stop fencing ``agent``; its fence transfer (in flight or landed), for the caller to
        retire (its prepared list goes with the agent's other lists at ``remove_remote``)."""
        fence = self.peers.pop(agent, None)
        return None if fence is None else fence.xfer

    def _drop(self, fence: Fence) -> None:
        """Release ``fence``'s transfer, best effort (one still in flight may not abort: a handle leaks)."""
        if fence.xfer is not None:
            try:
                self._transport.release(fence.xfer)
            except TransportError:
                pass
            fence.xfer, fence.inflight = None, False

    def sent(self, agent: str) -> None:
        """A message went to ``agent``: its endpoint needs a fence."""
        fence = self.peers.get(agent)
        if fence is not None:
            fence.unflushed = True

    def posted(self, agent: str) -> None:
        """A transfer was posted to ``agent``: it is one to fence."""
        fence = self.peers.get(agent)
        if fence is not None:
            fence.initiator = True

    def state(self, agent: str) -> dict[str, int | bool]:
        """``agent``'s fencing for debug output: fences posted, one in flight, messages since."""
        fence = self.peers.get(agent)
        if fence is None:
            return {"fences": 0, "fencing": False, "unflushed": False}
        return {"fences": fence.count, "fencing": fence.inflight, "unflushed": fence.unflushed}

    def flush(self) -> None:
        """Note the fences that landed; post one to every peer we initiate transfers to that was
        sent a message since its last fence (its transfer posted again after the first;
        failures are logged: the peer's own transfers fail where they are used)."""
        if self._local is None:
            return
        transport = self._transport
        for agent, fence in self.peers.items():
            if fence.inflight and fence.xfer is not None:
                try:
                    if transport.poll(fence.xfer) is XferStatus.PROC:
                        continue
                except TransportError:
                    self._drop(fence)  # the peer is gone: its transfers fail where they are used
                fence.inflight = False
            if not (fence.unflushed and fence.initiator):
                continue
            fence.unflushed = False
            try:
                if fence.xfer is None:
                    if fence.remote is None:
                        at = np.array([[fence.addr, FENCE_BYTES, fence.dev]], dtype=np.int64)
                        fence.remote = transport.prep_remote(agent, at, fence.mem)
                    fence.xfer = transport.post("READ", self._local, _FIRST, fence.remote, _FIRST)
                else:
                    transport.repost(fence.xfer)
                fence.inflight = True
                fence.count += 1
            except TransportError as e:
                logger.info("fence to %s not posted: %s", agent, e)
                self._drop(fence)  # the next fence makes a fresh transfer


#: the one descriptor of a fence's lists
_FIRST = np.zeros(1, dtype=np.int64)
