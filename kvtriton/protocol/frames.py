"""The handshake's frames on the wire: ``b"KVTH"``, a version byte, a kind byte, a big-endian u32
length, then the payload (:mod:`.handshake` says which kinds travel when); and what a meeting
leaves (:class:`Meeting`). Each read has a
deadline and a size cap per kind, checked from the header before the body is read."""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ProtocolError
from .auth import PairKeys
from .workers import Served

MAGIC = b"KVTH"
#: 2: metadata sealed under session keys (issue 33); a version-1 peer is refused as another protocol
VERSION = 2
HEADER = struct.Struct(">4sBBI")  # magic, version, kind, payload length

#: what frames are read from and written to: a socket, or a served connection (.workers.Served)
Stream = socket.socket | Served


@dataclass(frozen=True)
class Meeting:
    """What one side learned from a meeting: the peer's ``metadata``, and the pair's message
    keys (None without a credential). ``conn``: the meeting's own connection, kept open as the
    pair's *lifeline* (``meet(..., keep=True)`` against a server with ``on_kept``; else None):
    nothing travels on it, and its closure (EOF or reset, at once when the peer's process dies)
    tells that the peer is gone. Only this connection, the one that carried the authenticated
    exchange, can say so (see :meth:`kvtriton.agent.TransferAgent.add_lifeline`); its owner
    closes it."""

    metadata: bytes
    keys: PairKeys | None = None
    conn: socket.socket | None = field(default=None, compare=False, repr=False)


class UnexpectedFrame(ProtocolError):
    """A frame whose kind is not expected here, or longer than its kind allows: refused from its
    header alone, its body never read."""

    def __init__(self, kind: int, length: int, why: str):
        super().__init__(why)
        self.kind, self.length = kind, length


def _left(deadline: float) -> float:
    """Seconds to wait on the socket before ``deadline``; 0 once it passed: then the call takes
    only what is there now, without waiting (see :func:`recv_exact`)."""
    return max(deadline - time.monotonic(), 0.0)


def recv_exact(sock: Stream, n: int, deadline: float) -> bytes:
    """``n`` bytes by ``deadline``. Past the deadline, bytes already buffered are still taken
    (without waiting): a deadline judges the peer's slowness, and after this process was frozen
    (a starved host: docs/operations.md, "Host notes") the peer's frame may have been sitting
    here all along. Only a read that would have to wait fails. What is taken stays bounded by
    ``n`` (the caller's cap)."""
    buf = bytearray()
    while len(buf) < n:
        left = _left(deadline)
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except (TimeoutError, BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise TimeoutError("deadline passed") from None
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_frame(sock: Stream, deadline: float, caps: Mapping[int, int],
                header_deadline: float | None = None) -> tuple[int, bytes]:
    """One frame, whole by ``deadline`` (its header by ``header_deadline`` too). ``caps`` maps
    each kind expected here to its largest payload: any other kind, or a longer payload, is
    :class:`UnexpectedFrame` from the header alone (an unauthenticated HELLO is 32 bytes, not
    16 MiB read before anyone looks at it)."""
    header = recv_exact(sock, HEADER.size, deadline if header_deadline is None else min(deadline, header_deadline))
    magic, version, kind, length = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"not a kvtriton handshake frame of this version (magic {magic!r}, version {version}); "
                            f"expected {MAGIC!r} version {VERSION}")
    if kind not in caps:
        raise UnexpectedFrame(kind, length, f"unexpected handshake frame kind {kind} (expected {sorted(caps)})")
    if length > caps[kind]:
        raise UnexpectedFrame(kind, length, f"handshake frame kind {kind} of {length} bytes exceeds its "
                                             f"{caps[kind]}-byte limit")
    return kind, recv_exact(sock, length, deadline)


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, len(payload)) + payload


def write_frame(sock: Stream, kind: int, payload: bytes, deadline: float) -> bytes:
    """Send one frame; returns its bytes (for the transcript). Past ``deadline`` it is still
    sent if the socket takes it without waiting (a handshake frame fits its send buffer)."""
    sock.settimeout(_left(deadline))
    data = frame(kind, payload)
    try:
        sock.sendall(data)
    except (TimeoutError, BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
        raise TimeoutError("deadline passed") from None
    return data


def tls_handshake(sock: ssl.SSLSocket, deadline: float) -> None:
    """TLS's handshake by ``deadline`` (past it, only as far as it goes without waiting)."""
    sock.settimeout(_left(deadline))
    try:
        sock.do_handshake()
    except (TimeoutError, BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
        raise TimeoutError("deadline passed") from None
