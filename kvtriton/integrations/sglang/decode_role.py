"""The decode rank's part of the backend (no SGLang import: the manager passes its calls in).

* **Meeting** a prefill engine (once per bootstrap address, on a thread of its own): the prefill
  ranks this rank reads are the planner's (:func:`~kvtriton.plan.required_source_ranks`: any pair
  of TP sizes, not only SGLang's integer ratios); it connects to every prefill rank (each one's
  hold ends only once every decode rank said done), each one's address from SGLang's
  bootstrap server (``/route``), its metadata from its handshake port, with the cluster
  credential when one is configured, and goes through the agent's validation gate. Rooms wait
  in ``Bootstrapping`` until it is done; a failed meeting fails them (typed) and the next
  request tries again.
* **A room**: ``WANT`` to each of those prefill ranks once SGLang allocated the pages; when every
  one of them sent ``READY`` (the same page ids from all), one ``fetch`` reads it; when it
  landed, the metadata rows are written at this rank's index and the room succeeds. A failed
  fetch fails the room with the typed error's name and message; an abort cancels the fetch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import KVTritonError, ProtocolError
from ...plan import required_source_ranks
from ...protocol import wire
from ...protocol.handshake import exchange_metadata
from .messages import Ready, Want

__all__ = ["DecodeRole"]

logger = logging.getLogger(__name__)


@dataclass
class _Meeting:
    src_tp: int
    ranks: tuple = ()
    ready: bool = False
    engine: str = ""
    rank_infos: dict = field(default_factory=dict)  # prefill rank -> {"rank_ip", "rank_port"}
    rooms: set = field(default_factory=set)  # waiting for it


@dataclass
class _Room:
    addr: str
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
        self._meetings: dict[str, _Meeting] = {}
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"kvtriton-sgl-meet-{agent.rank}")

    # ------------------------------------------------------------------ meeting
    def begin(self, room_id: int, addr: str, src_tp: int) -> None:
        """A receiver's ``init``: Bootstrapping until the prefill engine at ``addr`` was met."""
        with self._lock:
            self._rooms[room_id] = _Room(addr)
            meeting = self._meetings.get(addr)
            if meeting is None:
                meeting = self._meetings[addr] = _Meeting(src_tp)
                self._pool.submit(self._meet, addr, meeting)
            ready = meeting.ready
            if not ready:
                meeting.rooms.add(room_id)
        if ready:
            self.mgr.update_status(room_id, self.poll.WaitingForInput)

    def _meet(self, addr: str, meeting: _Meeting) -> None:
        s = self.settings.agent
        try:
            host, _, port = addr.rpartition(":")
            bootstrap_port = int(port)
            ranks = required_source_ranks(self.agent.rank, self.agent.tp, self.agent.specs, meeting.src_tp)
            infos, engine = {}, None
            # every prefill rank, not only those read: a hold ends when each decode rank reported
            # done, and a rank reports it to the ranks it is connected to (P2->D3: decode rank 0
            # reads only prefill rank 0, yet prefill rank 1's hold waits for its done too)
            for r in range(meeting.src_tp):
                info = self.mgr.route(addr, r)
                md = exchange_metadata(info["rank_ip"], self.handshake_port(bootstrap_port, r), self.agent.metadata(),
                                       credential=self.credential, timeout_s=s.handshake_timeout_s,
                                       attempts=s.handshake_attempts)
                got = wire.decode_metadata(md)
                if got.rank != r or got.tp != meeting.src_tp or (engine is not None and got.engine != engine):
                    raise ProtocolError(f"{info['rank_ip']}:{self.handshake_port(bootstrap_port, r)} serves "
                                        f"{got.engine!r} rank {got.rank} of tp={got.tp}; the bootstrap at {addr} "
                                        f"names rank {r} of tp={meeting.src_tp}")
                engine = got.engine
                self.agent.add_remote(md, authenticated=self.credential is not None)
                infos[r] = {"rank_ip": info["rank_ip"], "rank_port": int(info["rank_port"])}
        except (KVTritonError, KeyError, ValueError, OSError) as e:
            why = e if isinstance(e, KVTritonError) else ProtocolError(f"{type(e).__name__}: {e}")
            logger.warning("meeting the prefill engine at %s failed: %s", addr, why)
            with self._lock:
                self._meetings.pop(addr, None)
                rooms = list(meeting.rooms)
            for room in rooms:
                self._fail(room, why)
            return
        with self._lock:
            meeting.ranks, meeting.engine, meeting.ready = tuple(ranks), engine, True
            meeting.rank_infos = {r: infos[r] for r in ranks}
            rooms, meeting.rooms = list(meeting.rooms), set()
        for room in rooms:
            self.mgr.update_status(room, self.poll.WaitingForInput)

    def bootstrap_infos(self, addr: str) -> list[dict]:
        """The prefill ranks' ZMQ addresses this rank talks to (SGLang's abort notifies them)."""
        with self._lock:
            m = self._meetings.get(addr)
            return list(m.rank_infos.values()) if m is not None and m.ready else []

    def forget_engine(self, addr: str) -> None:
        """The prefill at ``addr`` is gone (SGLang's heartbeat): meet it again next time."""
        with self._lock:
            self._meetings.pop(addr, None)

    # ------------------------------------------------------------------ a room
    def want(self, room_id: int, page_ids, aux_index: int, decode_prefix_len: int) -> list[dict]:
        """``send_metadata``: ask each prefill rank of the plan for the room; returns their ZMQ rows."""
        with self._lock:
            room = self._rooms.get(room_id)
            meeting = self._meetings.get(room.addr) if room is not None else None
            if room is None or meeting is None or not meeting.ready:
                return []
            room.local_ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
            room.aux_index = int(aux_index)
            infos = [meeting.rank_infos[r] for r in meeting.ranks]
        msg = Want(room_id, self.agent.engine_id, self.agent.rank, self.mgr.local_ip, self.mgr.rank_port,
                   int(decode_prefix_len or 0)).to_zmq()
        for info in infos:
            self.mgr.send(info["rank_ip"], info["rank_port"], msg)
        return infos

    def on_ready(self, ready: Ready) -> None:
        with self._lock:
            room = self._rooms.get(ready.room)
            meeting = self._meetings.get(room.addr) if room is not None else None
            if room is None or meeting is None or room.local_ids is None or room.fetching:
                return
            if ready.engine != meeting.engine or ready.rank not in meeting.ranks:
                logger.warning("READY for room %d from %r rank %d, which this room does not read: dropped",
                               ready.room, ready.engine, ready.rank)
                return
            room.readies[ready.rank] = ready
            if len(room.readies) < len(meeting.ranks):
                return
            room.fetching = True
            first = room.readies[meeting.ranks[0]]
            same = all(np.array_equal(r.page_ids, first.page_ids) for r in room.readies.values())
            local, engine = room.local_ids, meeting.engine
        if not same or len(first.page_ids) != len(local):
            counts = sorted(len(r.page_ids) for r in room.readies.values())
            self._fail(ready.room, ProtocolError(f"room {ready.room}: the prefill ranks announced {counts} page ids "
                                                 f"(equal lists expected), this rank allocated {len(local)} pages"))
            return
        try:
            self.agent.fetch(str(ready.room), engine, first.page_ids, local)
        except (KVTritonError, KeyError) as e:
            self._fail(ready.room, e if isinstance(e, KVTritonError) else ProtocolError(str(e)))

    def reads_from(self, room_id: int, engine: str, rank: int) -> bool:
        """Whether this room's ``WANT`` went to ``engine`` rank ``rank`` (a failure it may report)."""
        with self._lock:
            room = self._rooms.get(room_id)
            meeting = self._meetings.get(room.addr) if room is not None else None
            return meeting is not None and meeting.ready and engine == meeting.engine and rank in meeting.ranks

    def on_result(self, result) -> None:
        try:
            room_id = int(result.req_id)
        except ValueError:
            return
        with self._lock:
            room = self._rooms.get(room_id)
            meeting = self._meetings.get(room.addr) if room is not None else None
        if room is None:
            return
        if not result.ok:
            self._fail(room_id, result.error)
            return
        first = room.readies[meeting.ranks[0]] if meeting is not None else next(iter(room.readies.values()))
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
        with self._lock:
            room = self._rooms.pop(room_id, None)
            if room is not None:
                m = self._meetings.get(room.addr)
                if m is not None:
                    m.rooms.discard(room_id)
        if room is not None and room.fetching:
            self.agent.abort(str(room_id))  # a no-op once its result came

    def _fail(self, room_id: int, error: BaseException) -> None:
        self.mgr.record_failure(room_id, f"{type(error).__name__}: {error}")
        self.mgr.update_status(room_id, self.poll.Failed)

    def rooms(self) -> int:
        with self._lock:
            return len(self._rooms)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

