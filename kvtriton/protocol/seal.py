"""The seal: a frame that proves who sent a multipart control message, and that it is fresh.

The SGLang backend's control messages travel on SGLang's ZMQ sockets, whose PULL ends take a
message from whoever reaches them. With a shared secret in the cluster credential, every control
message of ours (``WANT``, ``READY``, the ``STATUS``-tagged failures, ``KVT_ABORT``) carries one
more frame, the *seal*::

    b"KVTS1" | time_ns (8, big-endian) | nonce (16) | rank (4) | len(engine) (2) | engine | MAC (32)

``MAC = HMAC-SHA256(key, label | tag | every frame | engine | rank | time | nonce)`` with each
variable piece length-prefixed (frames cannot be re-cut or reordered into another valid message),
under a key derived from the secret for this purpose only (:meth:`Credential.derive_key`: a
handshake proof is never a valid seal, nor the other way round). The receiver checks the MAC
(:func:`hmac.compare_digest`) before it parses anything of the payload, then freshness (the
sender's clock within ``window_s`` of ours) and replay (each nonce once; remembered for twice the
window, at most ``max_nonces``: when full, the oldest is dropped and nothing older than it is
accepted any more, so memory is bounded and no replay gets through). Any failure is an
:class:`~kvtriton.errors.AuthenticationError`; a refused message changes nothing.

Without a credential (dev mode) messages go unsigned. A TLS-only credential cannot seal them
(ZMQ's sockets there are SGLang's, without TLS): the backend refuses it at start
(:func:`kvtriton.integrations.sglang.settings.control_signer`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass

from ..errors import AuthenticationError

__all__ = ["KEY_PURPOSE", "SEAL_MAGIC", "ControlSigner", "Opened"]

KEY_PURPOSE = b"sglang-zmq-control-v1"
SEAL_MAGIC = b"KVTS1"
_HEAD = struct.Struct(">5sQ16sIH")  # magic, time_ns, nonce, rank, len(engine)
_MAC_BYTES = hashlib.sha256().digest_size
_MAX_ENGINE = 256


@dataclass(frozen=True)
class Opened:
    """A verified message: its frames without the seal, and who sealed it."""

    frames: list[bytes]
    engine: str
    rank: int


class ControlSigner:
    """Seals this rank's control messages and opens its peers' (one per manager).

    ``key``: the derived key (:meth:`Credential.derive_key` of :data:`KEY_PURPOSE`); ``engine``,
    ``rank``: this rank, bound into each seal; ``window_s``: the freshness window (either side of
    our clock); ``max_nonces``: the bound on remembered nonces."""

    def __init__(self, key: bytes, engine: str, rank: int, *, window_s: float, max_nonces: int = 1 << 16,
                 clock=time.time_ns, monotonic=time.monotonic):
        if len(key) < 16:
            raise AuthenticationError(f"a control-message key of {len(key)} bytes: expected at least 16")
        raw = engine.encode("ascii")
        if not 0 < len(raw) <= _MAX_ENGINE or not 0 <= rank < 1 << 32:
            raise AuthenticationError(f"engine {engine!r} rank {rank}: expected 1..{_MAX_ENGINE} ASCII characters "
                                      f"and a rank below 2**32")
        if window_s <= 0 or max_nonces < 1:
            raise AuthenticationError(f"window_s={window_s}, max_nonces={max_nonces}: expected both positive")
        self._key, self._engine, self._rank = key, raw, rank
        self.window_ns = int(window_s * 1e9)
        self.max_nonces = max_nonces
        self._clock, self._monotonic = clock, monotonic
        self._seen: dict[bytes, None] = {}
        self._order: deque[tuple[float, bytes, int]] = deque()  # (forget at, nonce, sender time), arrival order
        self._floor_ns = -1  # sender times at or below it are refused (raised when a nonce is dropped early)
        self._lock = threading.Lock()

    def _mac(self, frames: list[bytes], engine: bytes, rank: int, time_ns: int, nonce: bytes) -> bytes:
        h = hmac.new(self._key, KEY_PURPOSE, hashlib.sha256)
        h.update(struct.pack(">I", len(frames)))
        for f in frames:
            h.update(struct.pack(">Q", len(f)))
            h.update(f)
        h.update(struct.pack(">H", len(engine)) + engine + struct.pack(">IQ", rank, time_ns) + nonce)
        return h.digest()

    def seal(self, frames: list[bytes]) -> list[bytes]:
        """``frames`` (tag first) with the seal frame appended."""
        frames = [bytes(f) for f in frames]
        now, nonce = self._clock(), secrets.token_bytes(16)
        head = _HEAD.pack(SEAL_MAGIC, now, nonce, self._rank, len(self._engine))
        return frames + [head + self._engine + self._mac(frames, self._engine, self._rank, now, nonce)]

    def open(self, msg: list[bytes]) -> Opened:
        """The verified frames and sender of ``msg``, or :class:`AuthenticationError`."""
        if len(msg) < 2:
            raise AuthenticationError(f"an unsigned control message ({len(msg)} frames, no seal)")
        seal, frames = bytes(msg[-1]), [bytes(f) for f in msg[:-1]]
        if len(seal) < _HEAD.size + _MAC_BYTES or seal[:5] != SEAL_MAGIC:
            raise AuthenticationError(f"the last frame ({len(seal)} bytes) is not a kvtriton seal")
        _, sent_ns, nonce, rank, n = _HEAD.unpack_from(seal)
        if len(seal) != _HEAD.size + n + _MAC_BYTES or not 0 < n <= _MAX_ENGINE:
            raise AuthenticationError(f"a seal of {len(seal)} bytes for an engine name of {n}: expected "
                                      f"{_HEAD.size + n + _MAC_BYTES} (truncated or padded)")
        engine = seal[_HEAD.size:_HEAD.size + n]
        if not hmac.compare_digest(seal[_HEAD.size + n:], self._mac(frames, engine, rank, sent_ns, nonce)):
            raise AuthenticationError("the seal's MAC does not match (another key, or a changed frame or sender)")
        now = self._clock()
        if abs(now - sent_ns) > self.window_ns:
            raise AuthenticationError(f"a stale message: sent {(now - sent_ns) / 1e9:.1f} s ago (its clock), outside "
                                      f"the {self.window_ns / 1e9:.0f} s window (replayed, or the clocks differ)")
        with self._lock:
            self._forget_old()
            if nonce in self._seen:
                raise AuthenticationError("a replayed message (its nonce was seen)")
            if sent_ns <= self._floor_ns:
                raise AuthenticationError("a message older than the nonces this rank still remembers (the replay "
                                          "set was full)")
            self._seen[nonce] = None
            # a replay arriving 2 windows after the original is outside the window (see the module doc)
            self._order.append((self._monotonic() + 2 * self.window_ns / 1e9, nonce, sent_ns))
            while len(self._order) > self.max_nonces:
                _, old, old_ns = self._order.popleft()
                del self._seen[old]
                self._floor_ns = max(self._floor_ns, old_ns)
        return Opened(frames, engine.decode("ascii", errors="replace"), rank)

    def _forget_old(self) -> None:
        now = self._monotonic()
        while self._order and self._order[0][0] <= now:
            del self._seen[self._order.popleft()[1]]

    def remembered(self) -> int:
        with self._lock:
            return len(self._seen)
