"""The prefill rank's part of the backend (no SGLang import: the manager passes its calls in).

A request (SGLang's *room*) goes: a decode rank's ``WANT`` names the decode engine and where to
answer; SGLang's sender hands the room's page ids chunk by chunk (``add_transfer_request``); at
the last chunk the pages are held by this rank's :class:`~kvtriton.agent.TransferAgent` for that
decode engine only, and ``READY`` (the ids and the request's metadata rows) goes to every decode
rank that asked, or asks later. The room succeeds when every rank of the decode engine is done
(``freed()`` says ``"done"``); a lease that ran out, an abort or a refused hold fails it, with the
reason, and the decode ranks are told.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import KVTritonError, RequestRejectedError
from .messages import Ready, Want

__all__ = ["MAX_ROOMS", "PrefillRole"]

logger = logging.getLogger(__name__)

#: rooms a rank keeps open at once (a WANT beyond it is refused): bounds what the socket can fill
MAX_ROOMS = 1 << 16


@dataclass
class _Room:
    consumer: str | None = None
    readers: dict = field(default_factory=dict)  # (engine, rank) -> (ip, port)
    chunks: list = field(default_factory=list)  # (start, ids) as SGLang sent them
    ready: Ready | None = None  # once held
    done: bool = False


class PrefillRole:
    """Holds and announces the rooms of one prefill rank.

    ``mgr`` is the SGLang manager: ``update_status(room, status)``, ``record_failure(room, why)``,
    ``failure_reason(room)``, ``send(ip, port, frames)``, ``tell_failed(room, why, targets)`` (a
    status message to those decode ranks only), ``set_decode_prefix_len(room, n)``; ``poll`` is
    SGLang's ``KVPoll``."""

    def __init__(self, mgr, agent, aux: list[torch.Tensor], *, lease_s: float, poll):
        self.mgr, self.agent, self.aux, self.lease_s, self.poll = mgr, agent, aux, lease_s, poll
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ from the decode
    def on_want(self, want: Want) -> None:
        send_now: Ready | None = None
        with self._lock:
            room = self._rooms.get(want.room)
            if room is None and len(self._rooms) >= MAX_ROOMS:
                refused = f"{MAX_ROOMS} rooms are open on this rank"
            else:
                room = room or self._rooms.setdefault(want.room, _Room())
                if room.consumer is None:
                    room.consumer = want.engine
                refused = (None if room.consumer == want.engine else
                           f"room {want.room} is held for decode engine {room.consumer!r}, not {want.engine!r}")
            if refused is None:
                room.readers[(want.engine, want.rank)] = (want.ip, want.port)
                send_now = room.ready
        if refused is not None:
            logger.warning("WANT refused: %s", refused)
            self.mgr.tell_failed(want.room, f"RequestRejectedError: {refused}", [(want.ip, want.port)])
            return
        self.mgr.set_decode_prefix_len(want.room, want.decode_prefix_len)
        self.mgr.update_status(want.room, self.poll.WaitingForInput)
        if send_now is not None:  # a decode rank that asked after the hold
            self.mgr.send(want.ip, want.port, send_now.to_zmq())

    def consumer(self, room_id: int) -> str | None:
        """The decode engine room ``room_id`` is held for (its first WANT), if any."""
        with self._lock:
            room = self._rooms.get(room_id)
            return room.consumer if room is not None else None

    def on_abort(self, room_id: int) -> None:
        with self._lock:
            room = self._rooms.get(room_id)
        if room is None or room.done:
            return
        self.agent.release(str(room_id))
        self.mgr.record_failure(room_id, "RequestAbortedError: aborted by the decode")
        self.mgr.update_status(room_id, self.poll.Failed)

    # ------------------------------------------------------------------ from SGLang's sender
    def add_chunk(self, room_id: int, page_ids, start: int, last: bool, aux_index: int | None,
                  current_status: Callable[[], int | None]) -> None:
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.ready is not None:
                return  # no decode asked (a status already failed it), or a chunk after the last
            room.chunks.append((start, np.asarray(page_ids, dtype=np.int64).reshape(-1)))
            if not last:
                return
            chunks = sorted(room.chunks, key=lambda c: c[0])
            ids = np.concatenate([c[1] for c in chunks]) if chunks else np.zeros(0, np.int64)
            consumer = room.consumer
        if current_status() == self.poll.Failed:
            return
        try:
            if aux_index is None:
                raise RequestRejectedError(f"room {room_id}: the last chunk came without a metadata row")
            rows = tuple(bytes(buf[aux_index].numpy().tobytes()) for buf in self.aux)
            self.agent.hold(str(room_id), ids, lease_s=self.lease_s, consumer=consumer)
        except (KVTritonError, IndexError, ValueError) as e:
            self.mgr.record_failure(room_id, f"{type(e).__name__}: {e}")
            self._conclude_failed(room_id)
            return
        ready = Ready(room_id, self.agent.engine_id, self.agent.rank, ids, rows)
        with self._lock:
            room.ready = ready
            readers = list(room.readers.values())
        self.mgr.update_status(room_id, self.poll.Transferring)
        for ip, port in readers:
            self.mgr.send(ip, port, ready.to_zmq())

    # ------------------------------------------------------------------ from the agent
    def on_freed(self, req_id: str, reason: str) -> None:
        try:
            room_id = int(req_id)
        except ValueError:
            return
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return
            room.done = True
        if reason == "done":
            self.mgr.update_status(room_id, self.poll.Success)
            return
        if reason == "lease_expired":
            self.mgr.record_failure(room_id, f"TransferTimeoutError: the decode engine did not read room {room_id} "
                                             f"within its lease ({self.lease_s} s)")
        self._conclude_failed(room_id)

    def _conclude_failed(self, room_id: int) -> None:
        with self._lock:
            room = self._rooms.get(room_id)
            targets = list(room.readers.values()) if room else []
        self.mgr.update_status(room_id, self.poll.Failed)
        self.mgr.tell_failed(room_id, self.mgr.failure_reason(room_id), targets)

    # ------------------------------------------------------------------ teardown
    def forget(self, room_id: int) -> None:
        """SGLang cleared the room: a hold not done yet is released (its blocks go back to SGLang)."""
        with self._lock:
            room = self._rooms.pop(room_id, None)
        if room is not None and room.ready is not None and not room.done:
            self.agent.release(str(room_id))

    def rooms(self) -> int:
        with self._lock:
            return len(self._rooms)
