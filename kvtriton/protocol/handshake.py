"""Metadata exchange over TCP: how two engines' ranks meet before NIXL can carry anything.

A source rank (prefill) runs a :class:`MetadataServer` on ``host:port``; a destination rank
(decode) calls :func:`exchange_metadata` with its own :meth:`TransferAgent.metadata
<kvtriton.agent.TransferAgent.metadata>` and gets the source rank's back. The server hands the
caller's metadata to a callback (typically :meth:`TransferAgent.add_remote
<kvtriton.agent.TransferAgent.add_remote>`, the validation gate) and answers with its own metadata,
or with the gate's error, so a decode rank learns *why* it was refused.

A rank's metadata opens its registered memory to one-sided NIXL READs and WRITEs, so with a
:class:`~kvtriton.protocol.auth.Credential` neither side sends metadata before the other proved
it (mutual TLS, then or instead the shared secret's challenge-response)::

    client                                      server
    HELLO(client nonce)                 ->
                                        <-      CHALLENGE(server nonce, server proof)
    [client checks the server's proof; a listener without the secret gets nothing more]
    PROVE(client proof, client metadata) ->
    [server checks the client's proof; a client without it gets a generic refusal]
                                        <-      PROVEN(reply proof, server metadata) or ERROR(reason)

Each proof binds the version, its role, both nonces and the metadata it carries
(:meth:`Credential.proof <kvtriton.protocol.auth.Credential.proof>`). Without a credential the
exchange is the plain one (REQUEST, then OK or ERROR), and one warning is logged.

Frames: ``b"KVTH"``, a version byte, a kind byte, a big-endian u32 length, then the payload.
Nothing is unpickled; payloads are the agent's msgpack metadata (validated by the agent) or UTF-8
text. Every read and write has a deadline, frames are bounded (:data:`MAX_FRAME_BYTES`).

The server is bounded: one thread watches every accepted connection that has not spoken yet
(an idle socket costs a file descriptor, never a worker); a connection must deliver its first
bytes within ``first_bytes_timeout_s`` and finish within ``io_timeout_s``; at most
``max_pending_per_source`` silent connections per source address and ``max_pending`` in all are
kept (the oldest is dropped for a new one, so a flood of idle sockets cannot lock the port); and
at most ``max_connections`` (``max_active_per_source`` per address) are served at once.

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
import secrets
import selectors
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

from ..errors import AuthenticationError, KVTritonError, PeerDisconnectedError, ProtocolError, RequestRejectedError
from .auth import NONCE_BYTES, PROOF_BYTES, Credential

__all__ = ["MetadataServer", "exchange_metadata", "MAX_FRAME_BYTES"]

logger = logging.getLogger(__name__)

MAGIC = b"KVTH"
VERSION = 1
_HEADER = struct.Struct(">4sBBI")  # magic, version, kind, payload length
_REQUEST, _REPLY_OK, _REPLY_ERROR = 1, 2, 3
_HELLO, _CHALLENGE, _PROVE, _PROVEN = 4, 5, 6, 7
#: all an unauthenticated client ever learns: no geometry, no reason
_REFUSED = b"refused"
#: Largest payload either side accepts (a model's metadata is tens of KiB; NIXL's part is small).
MAX_FRAME_BYTES = 16 << 20
_warned_client = False


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


def _read_frame(sock: socket.socket, deadline: float, header_deadline: float | None = None) -> tuple[int, bytes]:
    header = _recv_exact(sock, _HEADER.size, deadline if header_deadline is None else min(deadline, header_deadline))
    magic, version, kind, length = _HEADER.unpack(header)
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


def _tls_handshake(sock: ssl.SSLSocket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)
    sock.do_handshake()


class _Refused(Exception):
    """Internal: this connection gets the generic refusal and nothing else."""


class MetadataServer:
    """Serves one rank's metadata on ``host:port`` and takes each caller's metadata.

    Parameters
    ----------
    metadata:        returns this rank's metadata bytes (called per connection).
    on_peer:         called with the caller's metadata bytes before answering; a
                     :class:`~kvtriton.errors.KVTritonError` it raises is sent back as the refusal.
                     With a credential it is called only for callers that proved it.
    credential:      the cluster :class:`~kvtriton.protocol.auth.Credential` callers must prove;
                     None: anyone who reaches the port gets the metadata (a warning at start).
    io_timeout_s:    a connection must finish its whole exchange within this time.
    first_bytes_timeout_s: ... and deliver its first bytes (TLS handshake and first frame header
                     included) within this time from its accept.
    max_connections: connections served at once (a worker thread each);
    max_active_per_source: ... of them from one source address.
    max_pending:     silent connections watched at once (the oldest is dropped for a new one);
    max_pending_per_source: ... of them from one source address.

    ``port=0`` picks a free port (see :attr:`port`).
    """

    def __init__(self, host: str, port: int, metadata: Callable[[], bytes], on_peer: Callable[[bytes], object],
                 *, credential: Credential | None = None, io_timeout_s: float = 5.0,
                 first_bytes_timeout_s: float = 2.0, max_connections: int = 8, max_active_per_source: int = 4,
                 max_pending: int = 256, max_pending_per_source: int = 32):
        for name, v in (("max_connections", max_connections), ("max_active_per_source", max_active_per_source),
                        ("max_pending", max_pending), ("max_pending_per_source", max_pending_per_source)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.host = host
        self._metadata, self._on_peer = metadata, on_peer
        self._credential = credential
        self._io_timeout = float(io_timeout_s)
        self._first_timeout = min(float(first_bytes_timeout_s), self._io_timeout)
        self._max_active, self._max_active_src = max_connections, max_active_per_source
        self._max_pending, self._max_pending_src = max_pending, max_pending_per_source
        self._lock = threading.Lock()
        self._active: Counter[str] = Counter()  # served now, by source address
        self._stop = threading.Event()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._thread: threading.Thread | None = None
        #: served, refused (by the gate, to an authenticated caller), unauthenticated (generic
        #: refusal or silence), failed (I/O or protocol), turned_away (dropped unserved: idle past
        #: the first-bytes deadline, or evicted for a newer connection)
        self.stats = {"served": 0, "refused": 0, "unauthenticated": 0, "failed": 0, "turned_away": 0}

    def start(self) -> MetadataServer:
        if self._thread is None:
            if self._credential is None:
                logger.warning("kvtriton handshake on %s:%d has no credential: any client that reaches it gets "
                               "this rank's metadata, and with it one-sided access to its registered memory "
                               "(set a shared secret and/or mutual TLS)", self.host, self.port)
            self._thread = threading.Thread(target=self._watch, daemon=True, name=f"kvtriton-handshake:{self.port}")
            self._thread.start()
        return self

    # ------------------------------------------------------------------ the watcher thread
    def _watch(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        pending: dict[socket.socket, tuple[str, float]] = {}  # silent or waiting for a worker; oldest first
        ready: list[socket.socket] = []  # spoke, waiting for a worker slot
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(0.05):
                    if key.data is None:
                        self._accept(sel, pending, ready)
                    else:
                        sel.unregister(key.fileobj)
                        ready.append(key.fileobj)  # type: ignore[arg-type]
                self._dispatch(pending, ready)
                now = time.monotonic()
                for conn, (_, accepted) in list(pending.items()):
                    if now - accepted > self._first_timeout:
                        self._drop(sel, pending, ready, conn)
        except OSError:
            pass  # the listening socket was closed
        finally:
            for conn in list(pending):
                self._drop(sel, pending, ready, conn, count=False)
            sel.close()

    def _accept(self, sel, pending, ready) -> None:
        for _ in range(64):  # a burst at most per pass, so dispatch and expiry keep running
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            src = str(addr[0])
            same = [c for c, (s, _) in pending.items() if s == src]
            if len(same) >= self._max_pending_src:
                self._drop(sel, pending, ready, same[0])
            if len(pending) >= self._max_pending:
                self._drop(sel, pending, ready, next(iter(pending)))
            conn.setblocking(False)
            pending[conn] = (src, time.monotonic())
            sel.register(conn, selectors.EVENT_READ, src)

    def _drop(self, sel, pending, ready, conn, count: bool = True) -> None:
        pending.pop(conn, None)
        if conn in ready:
            ready.remove(conn)
        else:
            try:
                sel.unregister(conn)
            except (KeyError, ValueError):
                pass
        conn.close()
        if count:
            self.stats["turned_away"] += 1

    def _dispatch(self, pending, ready) -> None:
        for conn in list(ready):
            src, accepted = pending[conn]
            with self._lock:
                if sum(self._active.values()) >= self._max_active:
                    return
                if self._active[src] >= self._max_active_src:
                    continue
                self._active[src] += 1
            ready.remove(conn)
            del pending[conn]
            conn.setblocking(True)
            threading.Thread(target=self._serve, args=(conn, src, accepted), daemon=True,
                             name=f"kvtriton-handshake:{self.port}:{src}").start()

    # ------------------------------------------------------------------ one connection (worker thread)
    def _serve(self, conn: socket.socket, src: str, accepted: float) -> None:
        first, deadline = accepted + self._first_timeout, accepted + self._io_timeout
        cred = self._credential
        try:
            try:
                ctx = cred.server_context() if cred is not None else None
                if ctx is not None:
                    conn = ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                    _tls_handshake(conn, first)
                if cred is not None and cred.has_secret:
                    self._serve_secret(conn, cred, first, deadline)
                else:
                    self._serve_plain(conn, first, deadline)
            finally:
                conn.close()
        except _Refused:
            self.stats["unauthenticated"] += 1
            logger.info("handshake from %s on port %d: did not prove the credential", src, self.port)
        except ssl.SSLError as e:
            self.stats["unauthenticated"] += 1
            logger.info("handshake from %s on port %d: TLS refused: %s", src, self.port, e)
        except (OSError, ConnectionError, KVTritonError, struct.error) as e:
            self.stats["failed"] += 1
            logger.info("handshake connection from %s on port %d failed: %s", src, self.port, e)
        finally:
            with self._lock:
                self._active[src] -= 1
                if self._active[src] <= 0:
                    del self._active[src]

    def _refuse(self, conn: socket.socket, deadline: float) -> None:
        try:
            _write_frame(conn, _REPLY_ERROR, _REFUSED, deadline)
        except (OSError, TimeoutError):
            pass
        raise _Refused()

    def _answer(self, conn: socket.socket, payload: bytes, deadline: float, ok_kind: int,
                sign: Callable[[bytes], bytes] = lambda md: b"") -> None:
        try:
            self._on_peer(payload)
        except KVTritonError as e:  # the caller proved the credential (or none is configured): it may know why
            self.stats["refused"] += 1
            _write_frame(conn, _REPLY_ERROR, f"{type(e).__name__}: {e}".encode()[:65536], deadline)
            return
        md = self._metadata()
        _write_frame(conn, ok_kind, sign(md) + md, deadline)
        self.stats["served"] += 1

    def _serve_plain(self, conn: socket.socket, first: float, deadline: float) -> None:
        kind, payload = _read_frame(conn, deadline, first)
        if kind != _REQUEST:
            if self._credential is not None:  # TLS only: the caller proved itself, but speaks another protocol
                self._refuse(conn, deadline)
            raise ProtocolError(f"expected a request frame, got kind {kind}")
        self._answer(conn, payload, deadline, _REPLY_OK)

    def _serve_secret(self, conn: socket.socket, cred: Credential, first: float, deadline: float) -> None:
        try:
            kind, client_nonce = _read_frame(conn, deadline, first)
        except ProtocolError:
            raise _Refused() from None  # not our protocol at all: silence
        if kind != _HELLO or len(client_nonce) != NONCE_BYTES:
            self._refuse(conn, deadline)  # e.g. a plain request: its metadata is dropped unread
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        _write_frame(conn, _CHALLENGE, server_nonce + cred.proof(b"server", client_nonce, server_nonce), deadline)
        kind, payload = _read_frame(conn, deadline)
        if kind != _PROVE or len(payload) < PROOF_BYTES:
            self._refuse(conn, deadline)
        proof, md = payload[:PROOF_BYTES], payload[PROOF_BYTES:]
        if not cred.verify(proof, b"client", client_nonce, server_nonce, md):
            self._refuse(conn, deadline)
        self._answer(conn, md, deadline, _PROVEN, lambda own: cred.proof(b"reply", client_nonce, server_nonce, own))

    def close(self) -> None:
        """Stop accepting; connections being served finish within ``io_timeout_s``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> MetadataServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _exchange_once(sock: socket.socket, host: str, port: int, metadata: bytes, credential: Credential | None,
                   deadline: float) -> bytes:
    """One attempt on a connected socket; raises what :func:`exchange_metadata` documents."""
    if credential is None or not credential.has_secret:
        _write_frame(sock, _REQUEST, metadata, deadline)
        kind, payload = _read_frame(sock, deadline)
        if kind == _REPLY_OK:
            return payload
        ok = _REPLY_OK
    else:
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        _write_frame(sock, _HELLO, client_nonce, deadline)
        kind, payload = _read_frame(sock, deadline)
        if kind != _CHALLENGE or len(payload) != NONCE_BYTES + PROOF_BYTES:
            raise AuthenticationError(f"{host}:{port} did not answer the credential challenge (frame kind {kind}); "
                                      f"our metadata was not sent")
        server_nonce, proof = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
        if not credential.verify(proof, b"server", client_nonce, server_nonce):
            raise AuthenticationError(f"{host}:{port} did not prove the cluster secret; our metadata was not sent")
        _write_frame(sock, _PROVE, credential.proof(b"client", client_nonce, server_nonce, metadata) + metadata,
                     deadline)
        kind, payload = _read_frame(sock, deadline)
        if kind == _PROVEN:
            proof, md = payload[:PROOF_BYTES], payload[PROOF_BYTES:]
            if len(proof) != PROOF_BYTES or not credential.verify(proof, b"reply", client_nonce, server_nonce, md):
                raise AuthenticationError(f"{host}:{port} answered with metadata that does not carry its proof")
            return md
        ok = _PROVEN
    if kind == _REPLY_ERROR:
        if payload == _REFUSED:
            raise AuthenticationError(f"{host}:{port} refused us: it did not accept our credential")
        raise RequestRejectedError(f"{host}:{port} refused our metadata: {payload.decode('utf-8', 'replace')}")
    raise ProtocolError(f"{host}:{port} answered with frame kind {kind}, expected {ok} or {_REPLY_ERROR}")


def exchange_metadata(host: str, port: int, metadata: bytes, *, credential: Credential | None = None,
                      timeout_s: float = 5.0, attempts: int = 3, backoff_s: float = 0.2) -> bytes:
    """Send our metadata to the :class:`MetadataServer` on ``host:port``; return its metadata.

    With a ``credential`` the server must prove it (TLS certificate and/or the secret's proof)
    before our metadata leaves, and we prove it in turn; without one, a warning is logged once.
    Each attempt must finish within ``timeout_s``; an unreachable or silent server is retried
    ``attempts`` times with a doubling ``backoff_s`` pause. Raises
    :class:`~kvtriton.errors.PeerDisconnectedError` when no attempt got an answer,
    :class:`~kvtriton.errors.AuthenticationError` when either side's proof failed (not retried),
    :class:`~kvtriton.errors.RequestRejectedError` when the server refused our metadata (its
    reason is in the message; not retried), :class:`~kvtriton.errors.ProtocolError` for a reply
    that is not a handshake frame.
    """
    global _warned_client
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    if credential is None and not _warned_client:
        _warned_client = True
        logger.warning("kvtriton handshakes are sent without a credential: our metadata goes to whoever listens "
                       "at the address a request names (set a shared secret and/or mutual TLS)")
    ctx = credential.client_context() if credential is not None else None
    last: Exception | None = None
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        deadline = time.monotonic() + timeout_s
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as raw:
                if ctx is None:
                    return _exchange_once(raw, host, port, metadata, credential, deadline)
                with ctx.wrap_socket(raw, server_hostname=host, do_handshake_on_connect=False) as sock:
                    _tls_handshake(sock, deadline)
                    return _exchange_once(sock, host, port, metadata, credential, deadline)
        except ssl.SSLCertVerificationError as e:
            raise AuthenticationError(f"{host}:{port} presented a certificate we do not trust: {e.verify_message}; "
                                      f"our metadata was not sent") from None
        except ssl.SSLError as e:  # the server refused our certificate, or speaks no TLS
            last = AuthenticationError(f"TLS with {host}:{port} failed: {e}")
            continue
        except (OSError, ConnectionError, struct.error) as e:
            last = e
            continue
    if isinstance(last, AuthenticationError):
        raise last
    raise PeerDisconnectedError(f"no metadata from {host}:{port} after {attempts} attempts "
                                f"({timeout_s} s each): {type(last).__name__}: {last}")
