"""The seal: a frame that proves which met rank sent a multipart control message, to whom, and that it is new.

The SGLang backend's control messages travel on SGLang's ZMQ sockets, whose PULL ends take a
message from whoever reaches them. With a cluster credential, every control message of ours
(``WANT``, ``READY``, the ``STATUS``-tagged failures, ``KVT_ABORT``) carries one more frame, the
*seal* (version 3, issue 33 finding 9)::

    b"KVTS3" | len(sender) (2) | len(receiver) (2) | sender | receiver | envelope

``sender`` and ``receiver`` are the two ranks' *incarnations*: each one's NIXL agent name, unique
per process (a restarted rank has a new one). The ``envelope`` is a :mod:`.channel` envelope (a
per-direction counter, HMAC-SHA256) of the SHA-256 of every frame (length-prefixed: frames
cannot be re-cut or reordered into another valid message) and both names, under keys of *this
pair only*: each direction's key of the pair's handshake (:class:`~.auth.PairKeys`, fresh per
meeting, with the shared secret or over mutual TLS) through HMAC-SHA256 with a label of this
use, so a seal is never a valid NIXL control message nor the other way round
(:func:`zmq_keys`). A rank seals only for a rank it met (or that met it) and opens only what a
rank it met sealed for it: a member that holds the cluster secret can no longer seal as another
member, because it does not hold that member's pair keys with us. The receiver checks, before it
parses anything of the payload: the sender is a rank it met, the seal names *it* as the receiver,
the digest matches the frames, the tag verifies under that pair's key, and the counter is new
(each pair's direction counts from 1; a window of :data:`WINDOW` below the highest seen, each
counter once: no wall clock decides a replay). A new meeting of the same two ranks rekeys the
pair as :meth:`.channel.PairChannel.rekey` does. The sender's engine id and rank are the ones its
meeting proved (its metadata), never what the message says. Any failure is an
:class:`~kvtriton.errors.AuthenticationError`; a refused message changes nothing. At most
``max_peers`` pairs are kept (the least recently met or heard goes first; it is met again).

Without a credential (dev mode) messages go unsealed.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import AuthenticationError
from .auth import PairKeys
from .channel import TAG_BYTES, WINDOW, MessageAuthError, PairChannel

__all__ = ["SEAL_MAGIC", "WINDOW", "ControlSigner", "Opened", "zmq_keys"]

SEAL_MAGIC = b"KVTS3"
_LABEL = b"kvtriton-sglang-zmq-control|v3"
_HEAD = struct.Struct(">5sHH")  # magic, len(sender), len(receiver)
_ENVELOPE = struct.Struct(">2s8sQ").size + hashlib.sha256().digest_size + TAG_BYTES  # channel head, digest, tag
_MAX_NAME = 256


@dataclass(frozen=True)
class Opened:
    """A verified message: its frames without the seal, and who sealed it: the ``engine`` and
    ``rank`` its meeting proved, ``agent`` its incarnation (the name a reply to it is sealed for)."""

    frames: list[bytes]
    engine: str
    rank: int
    agent: str = ""


def zmq_keys(keys: PairKeys) -> PairKeys:
    """The pair's keys for sealed ZMQ control messages: each direction's handshake key through
    HMAC-SHA256 with this use's label (never the key that seals the pair's NIXL messages)."""
    return PairKeys(send=hmac.digest(keys.send, _LABEL, "sha256"), recv=hmac.digest(keys.recv, _LABEL, "sha256"),
                    dialled=keys.dialled)


def _ascii(name: str, what: str) -> bytes:
    raw = name.encode("ascii")
    if not 0 < len(raw) <= _MAX_NAME:
        raise AuthenticationError(f"{what} {name!r}: expected 1..{_MAX_NAME} ASCII characters")
    return raw


def _digest(frames: list[bytes], names: bytes) -> bytes:
    h = hashlib.sha256(_LABEL)
    h.update(struct.pack(">I", len(frames)))
    for f in frames:
        h.update(struct.pack(">Q", len(f)))
        h.update(f)
    h.update(names)  # preceded in the seal by both lengths: the names cannot be re-cut
    return h.digest()


class _Pair:
    __slots__ = ("engine", "rank", "channel")

    def __init__(self, engine: str, rank: int, channel: PairChannel):
        self.engine, self.rank, self.channel = engine, rank, channel


class ControlSigner:
    """Seals this rank's control messages and opens its peers' (one per manager), under the keys
    of each pair met (:meth:`learn`). ``agent``: this rank's incarnation (its NIXL agent name),
    which its seals name as the sender and the seals it opens must name as the receiver;
    ``max_peers``: pairs kept. Thread-safe."""

    def __init__(self, *, agent: str, max_peers: int = 4096):
        if max_peers < 1:
            raise AuthenticationError(f"max_peers={max_peers}: expected at least 1")
        self.agent = agent
        self._me = _ascii(agent, "agent")
        self.max_peers = max_peers
        self._pairs: OrderedDict[bytes, _Pair] = OrderedDict()  # peer incarnation -> its pair, LRU
        self._lock = threading.Lock()

    def learn(self, agent: str, engine: str, rank: int, keys: PairKeys) -> None:
        """A meeting with ``agent`` (engine ``engine``, rank ``rank``, as its metadata proved)
        gave ``keys`` (this side's :class:`PairKeys`): seal for it and open its messages under
        them from now on. The same agent met again rekeys the pair (new keys each way, as the
        pair's NIXL messages do); an agent name never changes its engine or rank."""
        name = _ascii(agent, "peer agent")
        ours = zmq_keys(keys)
        with self._lock:
            pair = self._pairs.get(name)
            if pair is None:
                self._pairs[name] = _Pair(engine, rank, PairChannel(ours))
                while len(self._pairs) > self.max_peers:
                    self._pairs.popitem(last=False)
                return
            if (pair.engine, pair.rank) != (engine, rank):
                raise AuthenticationError(f"agent {agent!r} met as {engine!r} rank {rank}, but it was met as "
                                          f"{pair.engine!r} rank {pair.rank}")
            pair.channel.rekey(ours)
            self._pairs.move_to_end(name)

    def seal(self, frames: list[bytes], to: str) -> list[bytes]:
        """``frames`` (tag first) with the seal frame appended, for the rank whose incarnation
        (NIXL agent name) is ``to``; :class:`AuthenticationError` when no meeting gave us keys
        with it."""
        frames = [bytes(f) for f in frames]
        receiver = _ascii(to, "receiver")
        names = self._me + receiver
        digest = _digest(frames, names)
        with self._lock:
            pair = self._pairs.get(receiver)
            if pair is None:
                raise AuthenticationError(f"no pair keys with {to!r}: a message is sealed only for a rank met")
            try:
                envelope = pair.channel.seal(digest)
            except MessageAuthError as e:
                raise AuthenticationError(str(e)) from None
        return frames + [_HEAD.pack(SEAL_MAGIC, len(self._me), len(receiver)) + names + envelope]

    def open(self, msg: list[bytes]) -> Opened:
        """The verified frames and sender of ``msg``, or :class:`AuthenticationError`."""
        if len(msg) < 2:
            raise AuthenticationError(f"an unsigned control message ({len(msg)} frames, no seal)")
        seal, frames = bytes(msg[-1]), [bytes(f) for f in msg[:-1]]
        if len(seal) < _HEAD.size + _ENVELOPE or seal[:5] != SEAL_MAGIC:
            raise AuthenticationError(f"the last frame ({len(seal)} bytes) is not a kvtriton seal of version 3")
        _, n_from, n_to = _HEAD.unpack_from(seal)
        n = n_from + n_to
        if len(seal) != _HEAD.size + n + _ENVELOPE or not all(0 < x <= _MAX_NAME for x in (n_from, n_to)):
            raise AuthenticationError(f"a seal of {len(seal)} bytes for names of {n_from} and {n_to} bytes "
                                      f"(truncated or padded)")
        names = seal[_HEAD.size:_HEAD.size + n]
        sender, receiver, envelope = names[:n_from], names[n_from:], seal[_HEAD.size + n:]
        if receiver != self._me:
            raise AuthenticationError("a message sealed for another receiver (another rank, or an earlier run of "
                                      "this one)")
        if envelope[-TAG_BYTES - 32:-TAG_BYTES] != _digest(frames, names):
            raise AuthenticationError("the seal does not cover these frames (a changed, dropped or re-cut frame)")
        with self._lock:
            pair = self._pairs.get(sender)
            if pair is None:
                raise AuthenticationError("a message from a rank this one never met (no pair keys with its sender)")
            try:
                pair.channel.open(envelope)
            except MessageAuthError as e:
                raise AuthenticationError(f"the seal does not verify under the pair's key, or a replay: {e}") \
                    from None
            self._pairs.move_to_end(sender)
            engine, rank = pair.engine, pair.rank
        return Opened(frames, engine, rank, sender.decode("ascii", errors="replace"))

    def remembered(self) -> int:
        """Pairs whose keys and counters are kept."""
        with self._lock:
            return len(self._pairs)
