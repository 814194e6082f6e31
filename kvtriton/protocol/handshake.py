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
    [both derive the session keys: HKDF(secret, both nonces, the transcript so far)]
    PROVE(client proof, sealed client metadata) ->
    [server checks the client's proof and opens the seal; a client without it gets a generic refusal]
                                        <-      PROVEN(reply proof, sealed server metadata)
                                                or SEALED_ERROR(proof, sealed reason)

Each proof binds the version, its role, both nonces and the sealed bytes it carries
(:meth:`Credential.proof <kvtriton.protocol.auth.Credential.proof>`). The metadata is sealed
(ChaCha20-Poly1305) under keys derived from the secret, both nonces and the transcript
(:meth:`Credential.session_keys <kvtriton.protocol.auth.Credential.session_keys>`, one key per
direction): a relay that forwards the bytes between two members sees no metadata, and without
the secret it can neither open a seal nor make one. :func:`meet` and ``on_meeting`` also return
the pair's message keys (:class:`~kvtriton.protocol.auth.PairKeys`; the control messages are
sealed under them, :mod:`.channel`). With TLS alone, TLS keeps the metadata confidential, and the
server's OK carries a random seed for the pair keys inside TLS (``auth.tls_pair_keys``). Without
a credential the exchange is the plain one (REQUEST, then OK or ERROR), and one warning is
logged. A credential on one side only, or two different secrets, is reported as a credential mismatch on both sides.

Frames: ``b"KVTH"``, a version byte, a kind byte, a big-endian u32 length, then the payload.
Nothing is unpickled; payloads are the agent's msgpack metadata (validated by the agent) or UTF-8
text. Every read and write has a deadline; every frame must arrive whole within
``frame_timeout_s``; each kind has its own size cap, checked from the header before the body is
read (a HELLO is 32 bytes; metadata at most :data:`MAX_FRAME_BYTES`).

The server is bounded: one thread watches every accepted connection that has not spoken yet
(an idle socket costs a file descriptor, never a worker); a connection must deliver its first
bytes within ``first_bytes_timeout_s`` and finish within ``io_timeout_s``; at most
``max_pending_per_source`` silent connections per source address and ``max_pending`` in all are
kept (the oldest is dropped for a new one, so a flood of idle sockets cannot lock the port); and
at most ``max_connections`` (``max_active_per_source`` per address) are served at once; when all
are taken and another connection waits, the slowest served one is evicted (:mod:`.workers`).

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
from collections.abc import Callable
from typing import NoReturn

from ..errors import AuthenticationError, KVTritonError, PeerDisconnectedError, ProtocolError, RequestRejectedError
from .auth import NONCE_BYTES, PROOF_BYTES, SEAL_OVERHEAD, Credential, seal, tls_pair_keys, unseal
from .frames import VERSION, Meeting
from .frames import Stream as _Stream
from .frames import UnexpectedFrame as _UnexpectedFrame
from .frames import frame as _frame
from .frames import read_frame as _read_frame
from .frames import tls_handshake as _tls_handshake
from .frames import write_frame as _write_frame
from .workers import Served, Workers, buffered

__all__ = ["MetadataServer", "Meeting", "meet", "exchange_metadata", "MAX_FRAME_BYTES", "VERSION"]

logger = logging.getLogger(__name__)

_REQUEST, _REPLY_OK, _REPLY_ERROR = 1, 2, 3
_HELLO, _CHALLENGE, _PROVE, _PROVEN, _SEALED_ERROR = 4, 5, 6, 7, 8
#: mutual TLS without the secret: OK with a random seed for the pair keys first (inside TLS)
_REPLY_KEYED = 9
#: after a successful meeting: the client asks to keep the connection as the pair's lifeline, the
#: server agrees (an older peer on either side closes instead, and nothing is kept)
_KEEP, _KEPT = 10, 11
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
_warned_client = False


class _Refused(Exception):
    """Internal: this connection gets the generic refusal and nothing else."""

    def __init__(self, mismatch: str = ""):
        super().__init__(mismatch)
        self.mismatch = mismatch


class MetadataServer:
    """Serves one rank's metadata on ``host:port`` and takes each caller's metadata.

    Parameters
    ----------
    metadata:        returns this rank's metadata bytes (called per connection).
    on_peer:         called with the caller's metadata bytes before answering; a
                     :class:`~kvtriton.errors.KVTritonError` it raises is sent back as the refusal.
                     With a credential it is called only for callers that proved it.
    on_meeting:      instead of ``on_peer``: called with the :class:`Meeting` (the caller's
                     metadata and the pair's message keys).
    credential:      the cluster :class:`~kvtriton.protocol.auth.Credential` callers must prove;
                     None: anyone who reaches the port gets the metadata (a warning at start).
    io_timeout_s:    a connection must finish its whole exchange within this time.
    first_bytes_timeout_s: ... and deliver its first bytes (TLS handshake and first frame header
                     included) within this time from its accept.
    frame_timeout_s: every frame must arrive whole within this time from the start of its read
                     (a HELLO trickled a byte at a time is dropped, not waited for).
    max_connections: connections served at once (a worker thread each);
    max_active_per_source: ... of them from one source address.
    max_pending:     silent connections watched at once (the oldest is dropped for a new one);
    max_pending_per_source: ... of them from one source address.
    on_kept:         called with the :class:`Meeting` (its ``conn`` set) of a caller that asked
                     to keep its connection after it was served (``meet(..., keep=True)``): the
                     connection is then the callee's, no longer counted here nor closed by the
                     server. None: such a caller is told no (its connection closes as before).

    ``port=0`` picks a free port (see :attr:`port`).
    """

    def __init__(self, host: str, port: int, metadata: Callable[[], bytes],
                 on_peer: Callable[[bytes], object] | None = None, *, on_meeting: Callable[[Meeting], object] | None
                 = None, credential: Credential | None = None, io_timeout_s: float = 5.0,
                 first_bytes_timeout_s: float = 2.0, frame_timeout_s: float = 2.0, max_connections: int = 8,
                 max_active_per_source: int = 4, max_pending: int = 256, max_pending_per_source: int = 32,
                 on_kept: Callable[[Meeting], object] | None = None):
        if (on_peer is None) == (on_meeting is None):
            raise ValueError("give exactly one of on_peer and on_meeting")
        for name, v in (("max_connections", max_connections), ("max_active_per_source", max_active_per_source),
                        ("max_pending", max_pending), ("max_pending_per_source", max_pending_per_source)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.host = host
        self._metadata = metadata
        self._on_meeting: Callable[[Meeting], object] = (
            on_meeting if on_meeting is not None else (lambda m: on_peer(m.metadata)))  # type: ignore[misc]
        self._credential = credential
        self._on_kept = on_kept
        self._io_timeout = float(io_timeout_s)
        self._first_timeout = min(float(first_bytes_timeout_s), self._io_timeout)
        self._frame_timeout = min(float(frame_timeout_s), self._io_timeout)
        if self._frame_timeout <= 0:
            raise ValueError(f"frame_timeout_s must be > 0, got {frame_timeout_s}")
        self._workers = Workers(max_connections, max_active_per_source)  # served now (see .workers)
        self._max_pending, self._max_pending_src = max_pending, max_pending_per_source
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._thread: threading.Thread | None = None
        #: served, refused (by the gate, to an authenticated caller), unauthenticated (generic
        #: refusal or silence), mismatch (of those, a caller whose credential differs from ours:
        #: none, another secret, a secret where we have none), failed (I/O or protocol),
        #: turned_away (dropped unserved: idle past the first-bytes deadline, or evicted),
        #: evicted (served, but the slowest while every worker was taken and one waited: see .workers)
        self.stats = {"served": 0, "refused": 0, "unauthenticated": 0, "mismatch": 0, "failed": 0,
                      "turned_away": 0, "evicted": 0, "kept": 0}

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
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see meet()
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
        if count:  # counted before it closes, as a served connection's outcome is
            self.stats["turned_away"] += 1
        conn.close()

    def _dispatch(self, pending, ready) -> None:
        ready.sort(key=buffered, reverse=True)  # a whole frame waiting before a trickle
        for conn in list(ready):
            src, accepted = pending[conn]
            with self._lock:
                workers = self._workers
                if not workers.may_take(src):
                    continue
                if workers.full():  # the slowest gives its worker up (one at a time) to this one
                    if not workers.evicting() and workers.evict_slowest() is not None:
                        self.stats["evicted"] += 1
                    return
                served = workers.take(conn, src)
            ready.remove(conn)
            del pending[conn]
            conn.setblocking(True)
            threading.Thread(target=self._serve, args=(served, accepted), daemon=True,
                             name=f"kvtriton-handshake:{self.port}:{src}").start()

    # ------------------------------------------------------------------ one connection (worker thread)
    def _serve(self, conn: Served, accepted: float) -> None:
        first, deadline = accepted + self._first_timeout, accepted + self._io_timeout
        cred, src, kept = self._credential, conn.src, False
        try:  # the outcome is counted before the socket closes: a client that saw its end sees it counted
            try:
                ctx = cred.server_context() if cred is not None else None
                if ctx is not None:
                    conn.sock = ctx.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
                    _tls_handshake(conn.sock, first)
                if cred is not None and cred.has_secret:
                    served = self._serve_secret(conn, cred, first, deadline)
                else:
                    served = self._serve_plain(conn, src, first, deadline)
                kept = served is not None and self._keep(conn, served, deadline)  # then the lifeline's owner has it
            except _Refused as e:
                self.stats["unauthenticated"] += 1
                if e.mismatch:
                    self.stats["mismatch"] += 1
                    logger.warning("handshake from %s on port %d: credential mismatch: %s", src, self.port,
                                   e.mismatch)
                else:
                    logger.info("handshake from %s on port %d: did not prove the credential", src, self.port)
            except ssl.SSLError as e:
                self.stats["unauthenticated"] += 1
                logger.info("handshake from %s on port %d: TLS refused: %s", src, self.port, e)
            except (OSError, ConnectionError, KVTritonError, struct.error) as e:
                if not conn.evicted:
                    self.stats["failed"] += 1
                logger.info("handshake connection from %s on port %d failed%s: %s", src, self.port,
                            " (evicted: the slowest while every worker was taken)" if conn.evicted else "", e)
        finally:
            with self._lock:  # given back before it is closed: an eviction never touches a closed socket
                self._workers.give_back(conn)
            if not kept:
                conn.sock.close()

    def _keep(self, conn: Served, served: Meeting, deadline: float) -> bool:
        """After a served meeting: whether the caller asked to keep the connection and
        ``on_kept`` took it. An older caller closes at once (EOF): nothing is kept."""
        try:
            _read_frame(conn, self._frame_deadline(deadline), {_KEEP: 0})
        except (OSError, ConnectionError, TimeoutError, ProtocolError):
            return False
        if self._on_kept is None or conn.evicted:
            return False  # closed: the caller sees no KEPT and keeps nothing
        _write_frame(conn, _KEPT, b"", deadline)
        conn.sock.settimeout(None)
        self._on_kept(Meeting(served.metadata, served.keys, conn.sock))
        self.stats["kept"] += 1
        return True

    def _frame_deadline(self, deadline: float) -> float:
        return min(deadline, time.monotonic() + self._frame_timeout)

    def _refuse(self, conn: _Stream, deadline: float, mismatch: str = "") -> NoReturn:
        try:
            _write_frame(conn, _REPLY_ERROR, _REFUSED, deadline)
        except (OSError, TimeoutError):
            pass
        raise _Refused(mismatch)

    def _gate(self, meeting: Meeting, conn: _Stream) -> bytes | None:
        """The gate's verdict on an authenticated (or credential-less) caller: None to serve it,
        or the refusal reason it may know (UTF-8, within the reason's cap)."""
        try:
            if self._credential is not None:  # bind_engines: the engine id its certificate names
                self._credential.check_engine(getattr(conn, "sock", conn), meeting.metadata, "the caller")
            self._on_meeting(meeting)
        except KVTritonError as e:
            self.stats["refused"] += 1
            return f"{type(e).__name__}: {e}".encode()[:_MAX_REASON_BYTES]
        return None

    def _serve_plain(self, conn: _Stream, src: str, first: float, deadline: float) -> Meeting | None:
        try:
            kind, payload = _read_frame(conn, self._frame_deadline(deadline),
                                        {_REQUEST: MAX_FRAME_BYTES, _HELLO: NONCE_BYTES}, first)
        except _UnexpectedFrame:
            if self._credential is not None:  # TLS only: the caller proved itself, but speaks another protocol
                self._refuse(conn, deadline)
            raise
        if kind == _HELLO:  # the caller has a shared secret and we have none: say so, both sides
            _write_frame(conn, _REPLY_ERROR, _NO_SECRET, deadline)
            raise _Refused("it has a shared secret and this server has none")
        # over mutual TLS the pair gets keys for its messages too, from a seed only TLS carries
        seed = secrets.token_bytes(32) if self._credential is not None else b""
        meeting = Meeting(payload, tls_pair_keys(seed, False) if seed else None)
        reason = self._gate(meeting, conn)
        if reason is not None:
            _write_frame(conn, _REPLY_ERROR, reason, deadline)
            return None
        _write_frame(conn, _REPLY_KEYED if seed else _REPLY_OK, seed + self._metadata(), deadline)
        self.stats["served"] += 1
        return meeting

    def _serve_secret(self, conn: _Stream, cred: Credential, first: float, deadline: float) -> Meeting | None:
        try:
            kind, client_nonce = _read_frame(conn, self._frame_deadline(deadline), {_HELLO: NONCE_BYTES}, first)
        except _UnexpectedFrame as e:  # e.g. a plain request: refused from its header, its metadata never read
            self._refuse(conn, deadline,
                         "it sent a plain request (it has no shared secret)" if e.kind == _REQUEST else "")
        except ProtocolError:
            raise _Refused() from None  # not our protocol (or version) at all: silence
        if len(client_nonce) != NONCE_BYTES:
            self._refuse(conn, deadline)
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        hello = _frame(_HELLO, client_nonce)
        challenge = _write_frame(conn, _CHALLENGE,
                                 server_nonce + cred.proof(b"server", client_nonce, server_nonce, version=VERSION),
                                 deadline)
        try:
            kind, payload = _read_frame(conn, self._frame_deadline(deadline), {
                _PROVE: PROOF_BYTES + SEAL_OVERHEAD + MAX_FRAME_BYTES, _REPLY_ERROR: len(_OTHER_SECRET)})
        except _UnexpectedFrame:
            self._refuse(conn, deadline)
        if kind == _REPLY_ERROR:  # the client could not verify our proof: it holds another secret
            raise _Refused("its secret differs from ours (our proof did not verify)"
                           if payload == _OTHER_SECRET else "")
        if len(payload) < PROOF_BYTES + SEAL_OVERHEAD:
            self._refuse(conn, deadline)
        proof, sealed = payload[:PROOF_BYTES], payload[PROOF_BYTES:]
        if not cred.verify(proof, b"client", client_nonce, server_nonce, sealed, VERSION):
            self._refuse(conn, deadline)
        keys = cred.session_keys(False, client_nonce, server_nonce, hello + challenge, VERSION)
        try:
            md = unseal(keys.seal_recv, sealed, _SEAL_PROVE)
        except AuthenticationError:
            self._refuse(conn, deadline)
        meeting = Meeting(md, keys.pair)
        reason = self._gate(meeting, conn)
        if reason is not None:  # sealed: only the authenticated caller reads why
            out = seal(keys.seal_send, reason, _SEAL_REFUSAL)
            _write_frame(conn, _SEALED_ERROR,
                         cred.proof(b"refusal", client_nonce, server_nonce, out, VERSION) + out, deadline)
            return None
        out = seal(keys.seal_send, self._metadata(), _SEAL_PROVEN)
        _write_frame(conn, _PROVEN, cred.proof(b"reply", client_nonce, server_nonce, out, VERSION) + out, deadline)
        self.stats["served"] += 1
        return meeting

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


def _exchange_plain(sock: socket.socket, host: str, port: int, metadata: bytes, credential: Credential | None,
                    deadline: float) -> Meeting:
    _write_frame(sock, _REQUEST, metadata, deadline)
    caps = {_REPLY_OK: MAX_FRAME_BYTES, _REPLY_ERROR: _MAX_REASON_BYTES}
    if credential is not None:  # over mutual TLS (the secret takes the other path): the pair's key seed
        caps[_REPLY_KEYED] = 32 + MAX_FRAME_BYTES
    kind, payload = _read_frame(sock, deadline, caps)
    if kind == _REPLY_OK:
        return Meeting(payload)
    if kind == _REPLY_KEYED:
        if len(payload) < 32:
            raise ProtocolError(f"{host}:{port} sent a keyed reply without its key seed")
        return Meeting(payload[32:], tls_pair_keys(payload[:32], True))
    if payload == _REFUSED:
        if credential is None:  # we have nothing it could have refused: say what is missing
            raise AuthenticationError(f"{host}:{port} refused us: credential mismatch: it requires a cluster "
                                      f"credential and we have none (set the shared secret and/or TLS files)")
        # TLS alone passed (else we would not be here): it wants the shared secret too
        raise AuthenticationError(f"{host}:{port} refused us: credential mismatch: it requires a shared secret and "
                                  f"we have none (TLS only)")
    raise RequestRejectedError(f"{host}:{port} refused our metadata: {payload.decode('utf-8', 'replace')}")


def _exchange_secret(sock: socket.socket, host: str, port: int, metadata: bytes, credential: Credential,
                     deadline: float) -> Meeting:
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    hello = _write_frame(sock, _HELLO, client_nonce, deadline)
    try:
        kind, payload = _read_frame(sock, deadline, {_CHALLENGE: NONCE_BYTES + PROOF_BYTES,
                                                     _REPLY_ERROR: len(_NO_SECRET)})
    except _UnexpectedFrame as e:
        raise AuthenticationError(f"{host}:{port} did not answer the credential challenge (frame kind {e.kind}); "
                                  f"our metadata was not sent") from None
    if kind == _REPLY_ERROR:
        if payload == _NO_SECRET:
            raise AuthenticationError(f"{host}:{port} refused us: credential mismatch: it has no shared secret "
                                      f"and we have one; our metadata was not sent")
        raise AuthenticationError(f"{host}:{port} refused our credential challenge; our metadata was not sent")
    if len(payload) != NONCE_BYTES + PROOF_BYTES:
        raise AuthenticationError(f"{host}:{port} sent a malformed challenge; our metadata was not sent")
    server_nonce, proof = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
    if not credential.verify(proof, b"server", client_nonce, server_nonce, version=VERSION):
        try:  # tell it why we leave (fixed bytes, nothing of ours): the mismatch reads as such on both sides
            _write_frame(sock, _REPLY_ERROR, _OTHER_SECRET, deadline)
        except (OSError, TimeoutError):
            pass
        raise AuthenticationError(f"{host}:{port} did not prove the cluster secret (credential mismatch: another "
                                  f"secret, or not a member); our metadata was not sent")
    keys = credential.session_keys(True, client_nonce, server_nonce, hello + _frame(_CHALLENGE, payload), VERSION)
    out = seal(keys.seal_send, metadata, _SEAL_PROVE)
    _write_frame(sock, _PROVE, credential.proof(b"client", client_nonce, server_nonce, out, VERSION) + out, deadline)
    kind, payload = _read_frame(sock, deadline, {_PROVEN: PROOF_BYTES + SEAL_OVERHEAD + MAX_FRAME_BYTES,
                                                 _SEALED_ERROR: PROOF_BYTES + SEAL_OVERHEAD + _MAX_REASON_BYTES,
                                                 _REPLY_ERROR: len(_REFUSED)})
    if kind == _REPLY_ERROR:
        raise AuthenticationError(f"{host}:{port} refused us: it did not accept our credential")
    proof, sealed = payload[:PROOF_BYTES], payload[PROOF_BYTES:]
    role, label = (b"reply", _SEAL_PROVEN) if kind == _PROVEN else (b"refusal", _SEAL_REFUSAL)
    if len(proof) != PROOF_BYTES or not credential.verify(proof, role, client_nonce, server_nonce, sealed, VERSION):
        raise AuthenticationError(f"{host}:{port} answered with a payload that does not carry its proof")
    plain = unseal(keys.seal_recv, sealed, label)
    if kind == _SEALED_ERROR:
        raise RequestRejectedError(f"{host}:{port} refused our metadata: {plain.decode('utf-8', 'replace')}")
    return Meeting(plain, keys.pair)


def _exchange_once(sock: socket.socket, host: str, port: int, metadata: bytes, credential: Credential | None,
                   deadline: float) -> Meeting:
    """One attempt on a connected socket; raises what :func:`meet` documents."""
    try:
        if credential is None or not credential.has_secret:
            return _exchange_plain(sock, host, port, metadata, credential, deadline)
        return _exchange_secret(sock, host, port, metadata, credential, deadline)
    except _UnexpectedFrame as e:
        raise ProtocolError(f"{host}:{port} answered with {e}") from None


def exchange_metadata(host: str, port: int, metadata: bytes, *, credential: Credential | None = None,
                      timeout_s: float = 5.0, attempts: int = 3, backoff_s: float = 0.2) -> bytes:
    """The server's metadata from :func:`meet` (same arguments, same errors)."""
    return meet(host, port, metadata, credential=credential, timeout_s=timeout_s, attempts=attempts,
                backoff_s=backoff_s).metadata


def _ask_keep(sock: socket.socket, deadline: float) -> bool:
    """Ask the server to keep this connection as the pair's lifeline; whether it agreed (an
    older server, or one without ``on_kept``, closes instead)."""
    try:
        _write_frame(sock, _KEEP, b"", deadline)
        _read_frame(sock, deadline, {_KEPT: 0})
    except (OSError, ConnectionError, TimeoutError, ProtocolError):
        return False
    sock.settimeout(None)
    return True


def meet(host: str, port: int, metadata: bytes, *, credential: Credential | None = None,
         timeout_s: float = 5.0, attempts: int = 3, backoff_s: float = 0.2, keep: bool = False) -> Meeting:
    """Send our metadata to the :class:`MetadataServer` on ``host:port``; return its metadata and
    the pair's keys (a :class:`Meeting`).

    With a ``credential`` the server must prove it (TLS certificate and/or the secret's proof)
    before our metadata leaves, and we prove it in turn; with the secret both metadata travel
    sealed under the meeting's session keys. Without one, a warning is logged once.
    Each attempt must finish within ``timeout_s``; an unreachable or silent server is retried
    ``attempts`` times with a doubling ``backoff_s`` pause. Raises
    :class:`~kvtriton.errors.PeerDisconnectedError` when no attempt got an answer,
    :class:`~kvtriton.errors.AuthenticationError` when either side's proof failed or the two
    credentials differ (the message says "credential mismatch"; not retried),
    :class:`~kvtriton.errors.RequestRejectedError` when the server refused our metadata (its
    reason is in the message; not retried), :class:`~kvtriton.errors.ProtocolError` for a reply
    that is not a handshake frame of this version.

    ``keep``: after a successful meeting, ask the server to keep the connection as the pair's
    lifeline; when it agrees, :attr:`Meeting.conn` is that connection (the caller's to watch and
    close), else None (an older server: nothing is kept, the meeting stands).
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
                # small frames, each waited for: Nagle's wait for the peer's delayed ACK cost
                # ~40 ms a round with TLS and the secret together
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock = raw
                if ctx is not None:
                    sock = ctx.wrap_socket(raw, server_hostname=host, do_handshake_on_connect=False)
                try:
                    if ctx is not None:
                        _tls_handshake(sock, deadline)  # type: ignore[arg-type]
                    met = _exchange_once(sock, host, port, metadata, credential, deadline)
                    if credential is not None:  # bind_engines: it claims an engine id its certificate names
                        credential.check_engine(sock, met.metadata, f"{host}:{port}")
                    if keep and _ask_keep(sock, deadline):
                        kept = sock if ctx is not None else socket.socket(fileno=raw.detach())
                        sock = None  # type: ignore[assignment]
                        return Meeting(met.metadata, met.keys, kept)
                    return met
                finally:
                    if sock is not None and sock is not raw:
                        sock.close()
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
