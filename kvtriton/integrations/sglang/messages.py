"""The backend's control messages on SGLang's ZMQ sockets (no SGLang import), and their checks.

Both roles already own a ZMQ PULL socket (``CommonKVManager.server_socket``) whose address the
bootstrap publishes (prefill) or a message carries (decode). Two messages of ours ride on them;
every frame is ASCII or raw bytes, checked before use (a peer on the socket is untrusted):

* ``WANT`` (decode rank -> each prefill rank it reads): ``room, engine, rank, ip, port,
  decode_prefix_len``: this decode rank will fetch ``room`` and wants its ``READY`` there.
* ``READY`` (prefill rank -> every decode rank that asked): ``room, engine, rank, page ids
  (int64 bytes), aux row 0, aux row 1, ...``: the room's pages are held for the decode engine,
  and these are the request's metadata rows (SGLang's ``MetadataBuffers`` at the prefill's
  ``aux_index``), which the decode writes at its own index once its fetch landed.

Failures travel as SGLang's own status message (``CommonKVManager.send_kv_status_message``),
tagged :data:`STATUS_TAG`, with a reason. With a cluster secret every one of these is sealed
(:mod:`kvtriton.protocol.seal`), and a decode's abort travels as ``KVT_ABORT`` (``room, engine, rank``: sealed,
unlike SGLang's own ``ABORT``, which the prefill then refuses).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ProtocolError
from ...protocol.wire import MAX_REQUEST_BLOCKS

__all__ = ["ABORT_SEALED_TAG", "READY_TAG", "STATUS_TAG", "WANT_TAG", "Abort", "Ready", "Want"]

WANT_TAG = b"KVT_WANT"
READY_TAG = b"KVT_READY"
STATUS_TAG = b"KVT_STATUS"
ABORT_SEALED_TAG = b"KVT_ABORT"
_MAX_NAME = 256
_MAX_AUX_ROW = 64 << 20


def _int(frame: bytes, what: str, lo: int, hi: int) -> int:
    try:
        value = int(frame.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(f"{what}: expected an integer, got {frame[:40]!r}") from None
    if not lo <= value <= hi:
        raise ProtocolError(f"{what} = {value}: expected {lo}..{hi}")
    return value


def _name(frame: bytes, what: str) -> str:
    try:
        value = frame.decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError(f"{what}: expected ASCII, got {frame[:40]!r}") from None
    if not 0 < len(value) <= _MAX_NAME:
        raise ProtocolError(f"{what}: expected 1..{_MAX_NAME} characters, got {len(value)}")
    return value


@dataclass(frozen=True)
class Want:
    room: int
    engine: str
    rank: int
    ip: str
    port: int
    decode_prefix_len: int

    def to_zmq(self) -> list[bytes]:
        return [WANT_TAG, str(self.room).encode(), self.engine.encode("ascii"), str(self.rank).encode(),
                self.ip.encode("ascii"), str(self.port).encode(), str(self.decode_prefix_len).encode()]

    @classmethod
    def from_zmq(cls, msg: list[bytes]) -> Want:
        if len(msg) != 7 or msg[0] != WANT_TAG:
            raise ProtocolError(f"WANT: expected 7 frames, got {len(msg)}")
        return cls(_int(msg[1], "WANT room", 0, 2**64 - 1), _name(msg[2], "WANT engine"),
                   _int(msg[3], "WANT rank", 0, 1 << 16), _name(msg[4], "WANT ip"), _int(msg[5], "WANT port", 1, 65535),
                   _int(msg[6], "WANT decode_prefix_len", 0, 1 << 40))


@dataclass(frozen=True)
class Abort:
    """A decode rank gives up ``room`` (sent sealed instead of SGLang's ``ABORT``)."""

    room: int
    engine: str
    rank: int

    def to_zmq(self) -> list[bytes]:
        return [ABORT_SEALED_TAG, str(self.room).encode(), self.engine.encode("ascii"), str(self.rank).encode()]

    @classmethod
    def from_zmq(cls, msg: list[bytes]) -> Abort:
        if len(msg) != 4 or msg[0] != ABORT_SEALED_TAG:
            raise ProtocolError(f"KVT_ABORT: expected 4 frames, got {len(msg)}")
        return cls(_int(msg[1], "KVT_ABORT room", 0, 2**64 - 1), _name(msg[2], "KVT_ABORT engine"),
                   _int(msg[3], "KVT_ABORT rank", 0, 1 << 16))


@dataclass(frozen=True)
class Ready:
    room: int
    engine: str
    rank: int
    page_ids: np.ndarray
    aux_rows: tuple[bytes, ...]

    def to_zmq(self) -> list[bytes]:
        return [READY_TAG, str(self.room).encode(), self.engine.encode("ascii"), str(self.rank).encode(),
                np.ascontiguousarray(self.page_ids, dtype="<i8").tobytes(), *self.aux_rows]

    @classmethod
    def from_zmq(cls, msg: list[bytes], aux_item_lens: list[int]) -> Ready:
        """Parsed and checked against this rank's metadata buffers (one row of each, exact sizes)."""
        if len(msg) != 5 + len(aux_item_lens) or msg[0] != READY_TAG:
            raise ProtocolError(f"READY: expected {5 + len(aux_item_lens)} frames (ids and {len(aux_item_lens)} "
                                f"metadata rows), got {len(msg)}: the engines' metadata buffers differ "
                                f"(--disaggregation-enable-kv-checksum, SGLANG_ENABLE_DISAGG_SAMPLING_MASK or the "
                                f"DSA top-k buffer set on one side only?)")
        ids = msg[4]
        if len(ids) % 8 or len(ids) // 8 > MAX_REQUEST_BLOCKS:
            raise ProtocolError(f"READY page ids: {len(ids)} bytes, expected a multiple of 8 and at most "
                                f"{MAX_REQUEST_BLOCKS} pages")
        rows = tuple(msg[5:])
        for i, (row, want) in enumerate(zip(rows, aux_item_lens)):
            if len(row) != want or want > _MAX_AUX_ROW:
                raise ProtocolError(f"READY metadata row {i}: {len(row)} bytes, expected {want}")
        page_ids = np.frombuffer(ids, dtype="<i8").astype(np.int64)
        if page_ids.size and page_ids.min() < 0:
            raise ProtocolError("READY page ids: negative id")
        return cls(_int(msg[1], "READY room", 0, 2**64 - 1), _name(msg[2], "READY engine"),
                   _int(msg[3], "READY rank", 0, 1 << 16), page_ids, rows)
