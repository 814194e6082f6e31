"""The decode rank's part of the backend (no SGLang import: the manager passes its calls in).

* **Meeting** a prefill engine (once per bootstrap address, on a thread of its own:
  :class:`~kvtriton.integrations.core.Meetings`, as the vLLM worker meets one): it connects to the
  prefill ranks the planner names (:func:`~kvtriton.plan.meeting_ranks`: those it reads, any pair
  of TP sizes, not only SGLang's integer ratios, plus those no decode rank reads whose done it
  owes), each one's address from SGLang's bootstrap server (``/route``), its metadata from its
  handshake port, with the cluster credential when one is configured, and goes through the
  agent's validation gate. Rooms wait in ``Bootstrapping`` until it is done; a failed meeting
  fails them (typed) and the next request tries again.
* **A room**: ``WANT`` to each prefill rank it reads once SGLang allocated the pages; when every
  one of them sent ``READY`` (the same page ids from all), one ``fetch`` reads it; when it
  landed, the metadata rows are written at this rank's index and the room succeeds. A failed
  fetch fails the room with the typed error's name and message; an abort cancels the fetch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import KVTritonError, PeerDisconnectedError, ProtocolError
from ..core import Meeting, Meetings, PrefillEngine, RankAddress
from .messages import Ready, Want

__all__ = ["DecodeRole"]

logger = logging.getLogger(__name__)

#: meetings in progress at once (one thread each; more wait for a thread)
MEETING_THREADS = 4


def prefill_engine(addr: str, src_tp: int) -> PrefillEngine:
    """The prefill engine behind the bootstrap at ``addr`` (``host:port``); its id is what its
    first rank answers."""
    host, _, port = addr.rpartition(":")
    return PrefillEngine(None, host, int(port), src_tp)


@dataclass
class _Room:
    engine: PrefillEngine
    local_ids: np.ndarray | None = None
    aux_index: int | None = None
    readies: dict = field(default_factory=dict)  # prefill rank -> Ready
    fetching: bool = False


class DecodeRole:
    """Meetings and rooms of one decode rank. ``mgr``: the SGLang manager
    (``update_status``, ``record_failure``, ``send(ip, port, frames)``, ``route(addr, rank)`` ->
    the bootstrap's row for a prefill rank, ``local_ip``/``rank_port``); ``poll``: ``KVPoll``."""

    def __init__(self, mgr, agent, aux: list[torch.Tensor], settings, credential, *, poll,
                 handshake_port: Callable[[int, int], int]):
        self.mgr, self.agent, self.aux, self.settings, self.credential = mgr, agent, aux, settings, credential
        self.poll, self.handshake_port = poll, handshake_port
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()
        self.meetings = Meetings(agent, settings.agent, credential, locate=self._locate, on_met=self._met,
                                 on_failed=self._not_met, threads=MEETING_THREADS)

    # ------------------------------------------------------------------ meeting
    def begin(self, room_id: int, addr: str, src_tp: int) -> None:
        """A receiver's ``init``: Bootstrapping until the prefill engine at ``addr`` was met."""
        try:
            engine = prefill_engine(addr, src_tp)
        except ValueError as e:
            self._fail(room_id, ProtocolError(f"the bootstrap address {addr!r}: {e}"))
            return
        with self._lock:
            self._rooms[room_id] = _Room(engine)
        if self.meetings.join(engine, room_id, room_id) is not None:
            self.mgr.update_status(room_id, self.poll.WaitingForInput)

    def _locate(self, engine: PrefillEngine, rank: int) -> RankAddress:
        """A prefill rank's handshake address; the row kept is its ZMQ address (WANT, aborts)."""
        info = self.mgr.route(engine.where, rank)
        return RankAddress(info["rank_ip"], self.handshake_port(engine.port, rank),
                           {"rank_ip": info["rank_ip"], "rank_port": int(info["rank_port"])})

    def _met(self, meeting: Meeting, rooms: list[int]) -> None:
        for r, agent in meeting.agents.items():  # control messages with each rank met: under the pair's keys
            self.mgr.learn_pair(agent, meeting.engine, r, meeting.keys.get(r))
        for room in rooms:
            self.mgr.update_status(room, self.poll.WaitingForInput)

    def _not_met(self, meeting: Meeting, rooms: list[int], error: KVTritonError) -> None:
        for room in rooms:
            self._fail(room, error)

    def _meeting(self, room: _Room | None) -> Meeting | None:
        return self.meetings.met(room.engine.key) if room is not None else None

    def forget_engine(self, addr: str) -> None:
        """The prefill at ``addr`` is gone (SGLang's heartbeat): meet it again next time."""
        try:
            self.meetings.forget(prefill_engine(addr, 0).key)
        except ValueError:  # not an address: never met
            pass

    # ------------------------------------------------------------------ a room
    def want(self, room_id: int, page_ids, aux_index: int, decode_prefix_len: int) -> list[dict]:
        """``send_metadata``: ask each prefill rank of the plan for the room; returns their ZMQ rows."""
        with self._lock:
            room = self._rooms.get(room_id)
            meeting = self._meeting(room)
            if room is None or meeting is None:
                return []
            room.local_ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
            room.aux_index = int(aux_index)
            infos = [meeting.rows[r] for r in meeting.reads]
            for r, info in zip(meeting.reads, infos):  # seals to each are bound to the agent met (its run)
                self.mgr.learn_agent(info["rank_ip"], info["rank_port"], meeting.agents[r])
        msg = Want(room_id, self.agent.engine_id, self.agent.rank, self.mgr.local_ip, self.mgr.rank_port,
                   int(decode_prefix_len or 0)).to_zmq()
        for info in infos:
            self.mgr.send(info["rank_ip"], info["rank_port"], msg)
        return infos

    def on_ready(self, ready: Ready) -> None:
        with self._lock:
            room = self._rooms.get(ready.room)
            meeting = self._meeting(room)
            if room is None or meeting is None or room.local_ids is None or room.fetching:
                return
            if ready.engine != meeting.engine or ready.rank not in meeting.reads:
                logger.warning("READY for room %d from %r rank %d, which this room does not read: dropped",
                               ready.room, ready.engine, ready.rank)
                return
            room.readies[ready.rank] = ready
            if len(room.readies) < len(meeting.reads):
                return
            room.fetching = True
            first = room.readies[meeting.reads[0]]
            same = all(np.array_equal(r.page_ids, first.page_ids) for r in room.readies.values())
            local, engine = room.local_ids, meeting.engine
        if not same or len(first.page_ids) != len(local):
            counts = sorted(len(r.page_ids) for r in room.readies.values())
            self._fail(ready.room, ProtocolError(f"room {ready.room}: the prefill ranks announced {counts} page ids "
                                                 f"(equal lists expected), this rank allocated {len(local)} pages"))
            return
        try:
            self.agent.fetch(str(ready.room), engine, first.page_ids, local)
        except (KVTritonError, KeyError) as e:  # KeyError: its ranks were dropped since the meeting
            self._fail(ready.room, e if isinstance(e, KVTritonError) else PeerDisconnectedError(str(e)))

    def reads_from(self, room_id: int, engine: str, rank: int) -> bool:
        """Whether this room's ``WANT`` went to ``engine`` rank ``rank`` (a failure it may report)."""
        with self._lock:
            room = self._rooms.get(room_id)
            meeting = self._meeting(room)
            return meeting is not None and engine == meeting.engine and rank in meeting.reads

    def on_result(self, result) -> None:
        try:
            room_id = int(result.req_id)
        except ValueError:
            return
        with self._lock:
            room = self._rooms.get(room_id)
            meeting = self._meeting(room)
        if room is None:
            return
        if not result.ok:
            self._fail(room_id, result.error)
            return
        first = room.readies[meeting.reads[0]] if meeting is not None else next(iter(room.readies.values()))
        for buf, row in zip(self.aux, first.aux_rows):  # sizes checked when READY was parsed
            buf[room.aux_index].copy_(torch.frombuffer(bytearray(row), dtype=torch.uint8))
        self.mgr.update_status(room_id, self.poll.Success)

    def abort(self, room_id: int) -> None:
        with self._lock:
            room = self._rooms.get(room_id)
            fetching = room is not None and room.fetching
        if fetching:
            self.agent.abort(str(room_id))

    def forget(self, room_id: int) -> None:
        self.meetings.unpark(room_id)
        with self._lock:
            room = self._rooms.pop(room_id, None)
        if room is not None and room.fetching:
            self.agent.abort(str(room_id))  # a no-op once its result came

    def _fail(self, room_id: int, error: BaseException) -> None:
        if isinstance(error, PeerDisconnectedError):  # lost (its lifeline closed): met again next time
            with self._lock:
                room = self._rooms.get(room_id)
            if room is not None:
                self.meetings.forget(room.engine.key, met_only=True)
        self.mgr.record_failure(room_id, f"{type(error).__name__}: {error}")
        self.mgr.update_status(room_id, self.poll.Failed)

    def rooms(self) -> int:
        with self._lock:
            return len(self._rooms)

    def close(self) -> None:
        self.meetings.close()

