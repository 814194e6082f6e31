"""The cluster credential the handshake side channel checks before any metadata moves.

A rank's NIXL metadata is the key to its registered memory (whoever holds it can READ and WRITE
the cache and staging one-sidedly), so :mod:`.handshake` sends it only to a peer that proved the
credential every engine of the cluster was started with:

* a **shared secret**: HMAC-SHA256 challenge-response over fresh nonces from both sides; each
  proof binds the protocol version, the role that made it (``server``/``client``/``reply``), both
  nonces and the digest of the metadata it carries, so no proof can be replayed on another
  connection, reflected to the other role, or moved onto other metadata;
* and/or **mutual TLS** from certificate files (the standard :mod:`ssl` module; both sides present
  a certificate the cluster CA signed, ``CERT_REQUIRED`` both ways, the server's checked against
  the host name the caller dialled). TLS also keeps the metadata confidential on the wire.

With the secret, each meeting also derives **session keys** (:meth:`Credential.session_keys`:
HKDF-SHA256 over the secret, salted with both nonces, bound to the transcript's digest), so the
metadata travels sealed (ChaCha20-Poly1305, one key per direction): a relay that forwards the
bytes between two members learns nothing it can use, and cannot complete a meeting of its own.
The same derivation yields the pair's :class:`PairKeys` for messages after the meeting.

With mutual TLS, ``bind_engines=True`` also binds each engine id to certificates: a peer's
metadata must claim an engine id its certificate names as a URI subject alternative name
``kvtriton:engine/<id>`` (:data:`ENGINE_URI`), checked on both sides of every meeting
(:meth:`Credential.check_engine`). Without it, any member can claim any engine id first.

Primitives: the standard library's :mod:`hmac`, :mod:`secrets`, :mod:`ssl`, and the
``cryptography`` package's HKDF and ChaCha20-Poly1305 (no home-made constructions).

Example
-------
::

    cred = Credential.from_files(secret_file="/etc/kvtriton/secret")
    MetadataServer(host, port, agent.metadata, agent.add_remote, credential=cred)
    exchange_metadata(host, port, agent.metadata(), credential=cred)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import ssl
import stat
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import AuthenticationError

__all__ = ["Credential", "PairKeys", "SessionKeys", "seal", "unseal", "tls_pair_keys", "NONCE_BYTES", "PROOF_BYTES",
           "MIN_SECRET_BYTES", "SEAL_OVERHEAD"]

logger = logging.getLogger(__name__)

NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
#: a shorter secret is refused: it could be guessed offline from one observed proof
MIN_SECRET_BYTES = 16
#: how a certificate names an engine id it may claim (a URI subject alternative name)
ENGINE_URI = "kvtriton:engine/"
#: what :func:`seal` adds to a plaintext (the Poly1305 tag)
SEAL_OVERHEAD = 16
_KEY_BYTES = 32
#: each session key seals exactly one message per meeting (keys are fresh per connection: both
#: nonces salt them), so a constant AEAD nonce never repeats under one key
_SEAL_NONCE = bytes(12)


@dataclass(frozen=True)
class PairKeys:
    """The keys one side of a meeting keeps for the messages it exchanges with that peer later:
    ``send`` for what it sends, ``recv`` for what it receives (the peer holds them swapped);
    ``dialled``: this side dialled the meeting (see :meth:`.channel.PairChannel.rekey`). Fresh
    per meeting; unused by the handshake itself (the control messages' MACs, :mod:`.channel`)."""

    send: bytes
    recv: bytes
    dialled: bool = False

    def __repr__(self) -> str:  # never the keys
        return "PairKeys(<32-byte send key>, <32-byte recv key>)"


@dataclass(frozen=True)
class SessionKeys:
    """What one meeting derives for one side: the keys that seal the metadata each way, and the
    pair's :class:`PairKeys` for later."""

    seal_send: bytes
    seal_recv: bytes
    pair: PairKeys

    def __repr__(self) -> str:
        return "SessionKeys(<keys>)"


def seal(key: bytes, plaintext: bytes, label: bytes) -> bytes:
    """ChaCha20-Poly1305 of ``plaintext`` under ``key`` (one message per key, see
    :data:`_SEAL_NONCE`), with ``label`` as associated data (which frame of which protocol)."""
    return ChaCha20Poly1305(key).encrypt(_SEAL_NONCE, plaintext, label)


def unseal(key: bytes, sealed: bytes, label: bytes) -> bytes:
    """The plaintext :func:`seal` sealed; :class:`~kvtriton.errors.AuthenticationError` when the
    bytes were not sealed under ``key`` and ``label`` or were changed on the way."""
    try:
        return ChaCha20Poly1305(key).decrypt(_SEAL_NONCE, sealed, label)
    except InvalidTag:
        raise AuthenticationError("sealed handshake payload does not open under the session key "
                                  "(changed in transit, or sealed under another secret)") from None


def tls_pair_keys(seed: bytes, dialled: bool) -> PairKeys:
    """The pair keys of a meeting over mutual TLS alone: HKDF-SHA256 of a random ``seed`` the
    server sent inside the TLS channel (so only the two ends know it), one key each way."""
    if len(seed) != _KEY_BYTES:
        raise AuthenticationError(f"a TLS meeting's key seed must be {_KEY_BYTES} bytes, got {len(seed)}")
    okm = HKDF(algorithm=hashes.SHA256(), length=2 * _KEY_BYTES, salt=None,
               info=b"kvtriton-tls-pair|v2").derive(seed)
    c2s, s2c = okm[:_KEY_BYTES], okm[_KEY_BYTES:]
    return PairKeys(send=c2s, recv=s2c, dialled=True) if dialled else PairKeys(send=s2c, recv=c2s)


class Credential:
    """What this engine proves and demands on the side channel: a shared secret, mutual TLS, or
    both (TLS first, the secret's challenge-response inside it).

    Parameters
    ----------
    secret:    the cluster's shared secret (at least :data:`MIN_SECRET_BYTES` bytes).
    cert_file: this engine's certificate chain (PEM); with ``key_file`` and ``ca_file``.
    key_file:  its private key (PEM).
    ca_file:   the CA bundle that signs every engine of the cluster (PEM).
    bind_engines: with mutual TLS, a peer may claim only an engine id its certificate names
               (``kvtriton:engine/<id>`` URI SANs; :meth:`check_engine`).
    """

    def __init__(self, *, secret: bytes | None = None, cert_file: str | None = None, key_file: str | None = None,
                 ca_file: str | None = None, bind_engines: bool = False):
        tls = (cert_file, key_file, ca_file)
        if any(tls) and not all(tls):
            raise AuthenticationError(f"mutual TLS needs cert_file, key_file and ca_file together; got "
                                      f"cert_file={cert_file!r}, key_file={key_file!r}, ca_file={ca_file!r}")
        if secret is None and not any(tls):
            raise AuthenticationError("a credential needs a shared secret and/or TLS files (cert, key, CA)")
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES):
            raise AuthenticationError(f"the shared secret must be at least {MIN_SECRET_BYTES} bytes, got "
                                      f"{len(secret) if isinstance(secret, bytes) else type(secret).__name__}")
        if bind_engines and not all(tls):
            raise AuthenticationError("bind_engines binds engine ids to TLS certificates: it needs cert_file, "
                                      "key_file and ca_file (with a shared secret alone, members are "
                                      "indistinguishable)")
        self.bind_engines = bind_engines
        self._secret = secret
        self._tls: tuple[str, str, str] | None = (
            (cert_file, key_file, ca_file) if cert_file and key_file and ca_file else None)
        self._server_ctx: ssl.SSLContext | None = None
        self._client_ctx: ssl.SSLContext | None = None
        if self._tls is not None:  # load now: a bad file fails at start, not at the first handshake
            self._server_ctx, self._client_ctx = self._context(True), self._context(False)

    @classmethod
    def from_files(cls, *, secret_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                   ca_file: str | None = None, strict_modes: bool = True,
                   setting: str = "secret_file", bind_engines: bool = False) -> Credential | None:
        """The credential these files hold, or None when no file is named (None: no credential).

        ``secret_file`` given but empty, a file that holds nothing, or (with ``strict_modes``, as
        ssh does) a file that group or others may read is an
        :class:`~kvtriton.errors.AuthenticationError` naming ``setting`` (the operator's name for
        it), never a silent start without a credential. ``strict_modes=False`` only warns.
        """
        if secret_file is not None and not secret_file.strip():
            raise AuthenticationError(f"{setting} is set but empty: name the shared secret file, or unset it to run "
                                      f"without a secret (every client that reaches the port then gets the metadata)")
        if not (secret_file or cert_file or key_file or ca_file):
            return None
        secret = None
        if secret_file:
            try:
                with open(secret_file, "rb") as f:
                    mode = os.fstat(f.fileno()).st_mode  # the file we read, not whatever the path names later
                    secret = f.read(1 << 16).strip()  # a trailing newline from an editor is not part of it
            except OSError as e:
                raise AuthenticationError(f"{setting}: cannot read the shared secret file {secret_file!r}: {e}") \
                    from None
            if not stat.S_ISREG(mode):
                raise AuthenticationError(f"{setting}: the shared secret file {secret_file!r} is not a regular file")
            if mode & 0o077:
                if strict_modes:
                    raise AuthenticationError(
                        f"{setting}: the shared secret file {secret_file!r} is readable or writable by group or "
                        f"others (mode {mode & 0o777:o}); chmod 600 it, or allow it explicitly (strict modes off)")
                logger.warning("the shared secret file %s is readable by group or others (mode %o): expected 0600",
                               secret_file, mode & 0o777)
            if not secret:
                raise AuthenticationError(f"{setting}: the shared secret file {secret_file!r} is empty")
            if len(secret) < MIN_SECRET_BYTES:
                raise AuthenticationError(f"{setting}: the shared secret in {secret_file!r} has {len(secret)} bytes; "
                                          f"at least {MIN_SECRET_BYTES} are needed")
        return cls(secret=secret, cert_file=cert_file or None, key_file=key_file or None, ca_file=ca_file or None,
                   bind_engines=bind_engines)

    @property
    def has_secret(self) -> bool:
        return self._secret is not None

    @property
    def has_tls(self) -> bool:
        return self._tls is not None

    def __repr__(self) -> str:  # never the secret itself
        return (f"Credential(secret={'set' if self._secret else 'none'}, tls={'mutual' if self._tls else 'none'}"
                f"{', engines bound' if self.bind_engines else ''})")

    # ------------------------------------------------------------------ shared secret
    def proof(self, role: bytes, client_nonce: bytes, server_nonce: bytes, payload: bytes = b"",
              version: int = 1) -> bytes:
        """HMAC-SHA256 over the transcript: version, role, both nonces, the payload's digest."""
        if self._secret is None:
            raise AuthenticationError("this credential has no shared secret")
        transcript = b"|".join((b"kvtriton-handshake", b"v%d" % version, role, client_nonce, server_nonce,
                                hashlib.sha256(payload).digest()))
        return hmac.new(self._secret, transcript, hashlib.sha256).digest()

    def verify(self, proof: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes, payload: bytes = b"",
               version: int = 1) -> bool:
        """Whether ``proof`` is this transcript's (constant-time comparison)."""
        return hmac.compare_digest(proof, self.proof(role, client_nonce, server_nonce, payload, version))

    def session_keys(self, client: bool, client_nonce: bytes, server_nonce: bytes, transcript: bytes,
                     version: int) -> SessionKeys:
        """The keys of one meeting, for the client's side (``client=True``) or the server's.

        HKDF-SHA256 with the secret as input key material, both nonces as salt, and the version
        and the SHA-256 of the transcript so far (every frame both sides exchanged before the keys
        are used) as info; four independent 32-byte keys: the metadata seal each way and the
        pair's message keys each way. Another connection, version or transcript gives other keys.
        """
        if self._secret is None:
            raise AuthenticationError("this credential has no shared secret to derive session keys from")
        info = b"kvtriton-session|v%d|" % version + hashlib.sha256(transcript).digest()
        okm = HKDF(algorithm=hashes.SHA256(), length=4 * _KEY_BYTES, salt=client_nonce + server_nonce,
                   info=info).derive(self._secret)
        c2s, s2c, msg_c2s, msg_s2c = (okm[i:i + _KEY_BYTES] for i in range(0, 4 * _KEY_BYTES, _KEY_BYTES))
        if client:
            return SessionKeys(seal_send=c2s, seal_recv=s2c, pair=PairKeys(send=msg_c2s, recv=msg_s2c, dialled=True))
        return SessionKeys(seal_send=s2c, seal_recv=c2s, pair=PairKeys(send=msg_s2c, recv=msg_c2s))

    def derive_key(self, purpose: bytes) -> bytes:
        """A key for one other use of the secret (e.g. sealing control messages), derived as
        ``HMAC-SHA256(secret, "kvtriton-derive|" + purpose)``: never the secret itself, and no
        handshake proof (another label) is valid under it."""
        if self._secret is None:
            raise AuthenticationError("this credential has no shared secret to derive a key from")
        if not purpose:
            raise AuthenticationError("derive_key needs a non-empty purpose label")
        return hmac.new(self._secret, b"kvtriton-derive|" + purpose, hashlib.sha256).digest()

    # ------------------------------------------------------------------ mutual TLS
    def _context(self, server: bool) -> ssl.SSLContext:
        if self._tls is None:
            raise AuthenticationError("this credential has no TLS files")
        cert, key, ca = self._tls
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(cert, key)
            ctx.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as e:
            raise AuthenticationError(f"cannot load the TLS files (cert {cert!r}, key {key!r}, CA {ca!r}): {e}") \
                from None
        ctx.verify_mode = ssl.CERT_REQUIRED  # both ways: a client without a CA-signed certificate is refused
        if not server:
            ctx.check_hostname = True  # the server's certificate must name the host we dialled
        return ctx

    def server_context(self) -> ssl.SSLContext | None:
        return self._server_ctx

    def client_context(self) -> ssl.SSLContext | None:
        return self._client_ctx

    def check_engine(self, sock: object, metadata: bytes, who: str) -> None:
        """With ``bind_engines``: :class:`~kvtriton.errors.AuthenticationError` unless the engine
        id ``metadata`` claims is one the peer's verified certificate on ``sock`` names
        (:func:`cert_engines`); ``who`` names the peer in the message. Else nothing."""
        if not self.bind_engines:
            return
        from .wire import decode_metadata  # the wire format is the agent's; only this check reads it here

        claimed = decode_metadata(metadata).engine
        getpeercert = getattr(sock, "getpeercert", None)
        bound = cert_engines(getpeercert() if getpeercert is not None else None)
        if claimed not in bound:
            raise AuthenticationError(f"{who} claims engine {claimed!r}, but its certificate binds "
                                      f"{', '.join(sorted(bound)) or 'no engine id'} (URI SAN {ENGINE_URI}<id>)")


def cert_engines(cert: dict | None) -> frozenset[str]:
    """The engine ids a verified peer certificate (:meth:`ssl.SSLSocket.getpeercert`) names as
    ``kvtriton:engine/<id>`` URI subject alternative names."""
    sans = (cert or {}).get("subjectAltName", ())
    return frozenset(v[len(ENGINE_URI):] for k, v in sans if k == "URI" and v.startswith(ENGINE_URI)
                     and len(v) > len(ENGINE_URI))
