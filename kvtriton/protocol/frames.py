"""The frames of the handshake side channel (:mod:`kvtriton.protocol.handshake`): their header,
kinds and size caps, reading and writing them under deadlines, and what a meeting leaves
(:class:`Meeting`). ``b"KVTH"``, a version byte, a kind byte, a big-endian u32 length, then the
payload; each kind has its own cap, checked from the header before the body is read."""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ProtocolError
from .auth import PairKeys

__all__ = ["MAGIC", "MAX_FRAME_BYTES", "VERSION", "Meeting"]

MAGIC = b"KVTH"
#: 2: metadata sealed under session keys (issue 33); a version-1 peer is refused as another protocol
VERSION = 2
_HEADER = struct.Struct(">4sBBI")  # magic, version, kind, payload length
_REQUEST, _REPLY_OK, _REPLY_ERROR = 1, 2, 3
_HELLO, _CHALLENGE, _PROVE, _PROVEN, _SEALED_ERROR = 4, 5, 6, 7, 8
#: after a successful meeting: the client asks to keep the connection as the pair's lifeline, the
#: server agrees (an older peer on either side closes instead, and nothing is kept)
_KEEP, _KEPT = 9, 10
#: all an unauthenticated client ever learns: no geometry, no reason
_REFUSED = b"refused"
#: what a server without a secret answers a HELLO, and a client whose secret differs tells the
#: server: a credential mismatch is reported as such on both sides (it reveals nothing else)
_NO_SECRET = b"credential mismatch: this server has no shared secret"
_OTHER_SECRET = b"credential mismatch: the server's proof does not verify under our secret"
#: Largest payload either side accepts (a model's metadata is tens of KiB; NIXL's part is small).
MAX_FRAME_BYTES = 16 << 20
#: largest refusal reason (the gate's message, truncated)
_MAX_REASON_BYTES = 1 << 16
#: the seal labels: which frame of which protocol (associated data of each seal)
_SEAL_PROVE = b"kvtriton-handshake|v%d|prove" % VERSION
_SEAL_PROVEN = b"kvtriton-handshake|v%d|proven" % VERSION
_SEAL_REFUSAL = b"kvtriton-handshake|v%d|refusal" % VERSION


@dataclass(frozen=True)
class Meeting:
    """What one side learned from a meeting: the peer's ``metadata``, and the pair's message
    keys (None without a shared secret: TLS alone or no credential). ``conn``: the meeting's
    own connection, kept open as the pair's *lifeline* (``meet(..., keep=True)`` against a
    server with ``on_kept``; else None): nothing travels on it, and its closure (EOF or reset,
    at once when the peer's process dies) tells that the peer is gone. Only this connection,
    the one that carried the authenticated exchange, can say so (see
    :meth:`kvtriton.agent.TransferAgent.add_lifeline`); its owner closes it."""

    metadata: bytes
    keys: PairKeys | None = None
    conn: socket.socket | None = field(default=None, compare=False, repr=False)


class _UnexpectedFrame(ProtocolError):
    """A frame whose kind is not expected here, or longer than its kind allows: refused from its
    header alone, its body never read."""

    def __init__(self, kind: int, length: int, why: str):
        super().__init__(why)
        self.kind, self.length = kind, length


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _read_frame(sock: socket.socket, deadline: float, caps: Mapping[int, int],
                header_deadline: float | None = None) -> tuple[int, bytes]:
    """One frame, whole by ``deadline`` (its header by ``header_deadline`` too). ``caps`` maps
    each kind expected here to its largest payload: any other kind, or a longer payload, is
    :class:`_UnexpectedFrame` from the header alone (an unauthenticated HELLO is 32 bytes, not
    16 MiB read before anyone looks at it)."""
    header = _recv_exact(sock, _HEADER.size, deadline if header_deadline is None else min(deadline, header_deadline))
    magic, version, kind, length = _HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"not a kvtriton handshake frame of this version (magic {magic!r}, version {version}); "
                            f"expected {MAGIC!r} version {VERSION}")
    if kind not in caps:
        raise _UnexpectedFrame(kind, length, f"unexpected handshake frame kind {kind} (expected {sorted(caps)})")
    if length > caps[kind]:
        raise _UnexpectedFrame(kind, length, f"handshake frame kind {kind} of {length} bytes exceeds its "
                                             f"{caps[kind]}-byte limit")
    return kind, _recv_exact(sock, length, deadline)


def _frame(kind: int, payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, kind, len(payload)) + payload


def _write_frame(sock: socket.socket, kind: int, payload: bytes, deadline: float) -> bytes:
    """Send one frame; returns its bytes (for the transcript)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)
    data = _frame(kind, payload)
    sock.sendall(data)
    return data


def _tls_handshake(sock: ssl.SSLSocket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)
    sock.do_handshake()
