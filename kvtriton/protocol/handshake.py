"""Metadata exchange over TCP: how two engines' ranks meet before NIXL can carry anything.

A source rank (prefill) runs a :class:`MetadataServer` on ``host:port``; a destination rank
(decode) calls :func:`exchange_metadata` with its own :meth:`TransferAgent.metadata
<kvtriton.agent.TransferAgent.metadata>` and gets the source rank's back. The server hands the
caller's metadata to a callback (typically :meth:`TransferAgent.add_remote
<kvtriton.agent.TransferAgent.add_remote>`, the validation gate) and answers with its own metadata,
or with the gate's error, so a decode rank learns *why* it was refused.

Frames: ``b"KVTH"``, a version byte, a kind byte, a big-endian u32 length, then the payload.
Nothing is unpickled; payloads are the agent's msgpack metadata (validated by the agent) or UTF-8
text. Every read and write has a deadline, frames are bounded (:data:`MAX_FRAME_BYTES`), and the
server serves a bounded number of connections at once, so a slow or hostile client costs only its
own connection.

Example
-------
::

    server = MetadataServer("127.0.0.1", 5710, prefill.metadata, prefill.add_remote)
    server.start()
    decode.add_remote(exchange_metadata("127.0.0.1", 5710, decode.metadata()))
    server.close()
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

from ..errors import KVTritonError, PeerDisconnectedError, ProtocolError, RequestRejectedError

__all__ = ["MetadataServer", "exchange_metadata", "MAX_FRAME_BYTES"]

logger = logging.getLogger(__name__)

MAGIC = b"KVTH"
VERSION = 1
_HEADER = struct.Struct(">4sBBI")  # magic, version, kind, payload length
_REQUEST, _REPLY_OK, _REPLY_ERROR = 1, 2, 3
#: Largest payload either side accepts (a model's metadata is tens of KiB; NIXL's part is small).
MAX_FRAME_BYTES = 16 << 20


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


def _read_frame(sock: socket.socket, deadline: float) -> tuple[int, bytes]:
    magic, version, kind, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"not a kvtriton handshake frame (magic {magic!r}, version {version}); "
                            f"expected {MAGIC!r} version {VERSION}")
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"handshake frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return kind, _recv_exact(sock, length, deadline)


def _write_frame(sock: socket.socket, kind: int, payload: bytes, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)
    sock.sendall(_HEADER.pack(MAGIC, VERSION, kind, len(payload)) + payload)


class MetadataServer:
    """Serves one rank's metadata on ``host:port`` and takes each caller's metadata.

    Parameters
    ----------
    metadata:        returns this rank's metadata bytes (called per connection).
    on_peer:         called with the caller's metadata bytes before answering; a
                     :class:`~kvtriton.errors.KVTritonError` it raises is sent back as the refusal.
    io_timeout_s:    a connection must deliver its request and take the answer within this time.
    max_connections: connections served at once; more are closed at once (a flood of slow
                     clients cannot starve the accept loop or grow threads without bound).

    ``port=0`` picks a free port (see :attr:`port`).
    """

    def __init__(self, host: str, port: int, metadata: Callable[[], bytes], on_peer: Callable[[bytes], object],
                 *, io_timeout_s: float = 5.0, max_connections: int = 8):
        self.host = host
        self._metadata, self._on_peer = metadata, on_peer
        self._io_timeout = float(io_timeout_s)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stop = threading.Event()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.2)  # the accept loop checks for close() this often
        self.port = self._sock.getsockname()[1]
        self._thread: threading.Thread | None = None
        self.stats = {"served": 0, "refused": 0, "failed": 0, "turned_away": 0}

    def start(self) -> MetadataServer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                            name=f"kvtriton-handshake:{self.port}")
            self._thread.start()
        return self

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                self.stats["turned_away"] += 1
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self._io_timeout
        try:
            with conn:
                kind, payload = _read_frame(conn, deadline)
                if kind != _REQUEST:
                    raise ProtocolError(f"expected a request frame, got kind {kind}")
                try:
                    self._on_peer(payload)
                except KVTritonError as e:
                    self.stats["refused"] += 1
                    _write_frame(conn, _REPLY_ERROR, f"{type(e).__name__}: {e}".encode()[:65536], deadline)
                    return
                _write_frame(conn, _REPLY_OK, self._metadata(), deadline)
                self.stats["served"] += 1
        except (OSError, ConnectionError, KVTritonError, struct.error) as e:
            self.stats["failed"] += 1
            logger.info("handshake connection on port %d failed: %s", self.port, e)
        finally:
            self._slots.release()

    def close(self) -> None:
        """Stop accepting; connections being served finish within ``io_timeout_s``."""
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def __enter__(self) -> MetadataServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def exchange_metadata(host: str, port: int, metadata: bytes, *, timeout_s: float = 5.0, attempts: int = 3,
                      backoff_s: float = 0.2) -> bytes:
    """Send our metadata to the :class:`MetadataServer` on ``host:port``; return its metadata.

    Each attempt must finish within ``timeout_s``; an unreachable or silent server is retried
    ``attempts`` times with a doubling ``backoff_s`` pause. Raises
    :class:`~kvtriton.errors.PeerDisconnectedError` when no attempt got an answer,
    :class:`~kvtriton.errors.RequestRejectedError` when the server refused our metadata (its
    reason is in the message; not retried), :class:`~kvtriton.errors.ProtocolError` for a reply
    that is not a handshake frame.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    last: Exception | None = None
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        deadline = time.monotonic() + timeout_s
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as sock:
                _write_frame(sock, _REQUEST, metadata, deadline)
                kind, payload = _read_frame(sock, deadline)
        except (OSError, ConnectionError, struct.error) as e:
            last = e
            continue
        if kind == _REPLY_OK:
            return payload
        if kind == _REPLY_ERROR:
            raise RequestRejectedError(f"{host}:{port} refused our metadata: "
                                       f"{payload.decode('utf-8', 'replace')}")
        raise ProtocolError(f"{host}:{port} answered with frame kind {kind}, expected {_REPLY_OK} or {_REPLY_ERROR}")
    raise PeerDisconnectedError(f"no metadata from {host}:{port} after {attempts} attempts "
                                f"({timeout_s} s each): {type(last).__name__}: {last}")
