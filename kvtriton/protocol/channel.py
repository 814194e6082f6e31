"""Control messages between two members, sealed under their pair's keys (issue 33, finding 3).

A NIXL notification names its sender's agent, but nothing proves that name: whoever holds a
rank's NIXL metadata (every member it met) can send it notifications under another agent's
name. Two ranks that met with a credential share a :class:`~kvtriton.protocol.auth.PairKeys`
(one key each way, fresh per meeting), so each control message between them travels in an
envelope::

    b"\\xc1\\x01" | session (8 bytes) | counter (u64, big-endian) | message | tag (32 bytes)

``tag`` is HMAC-SHA256 under the sending direction's key over everything before it; ``session``
names the key (a digest of it, so a receiver that kept two keys knows which one to check);
``counter`` counts the direction's messages from 1. The receiver refuses, before anything reads
the message: a plain message from a peer it holds keys with, an envelope whose tag does not
verify under that peer's key (another agent's name, another pair, a changed byte), a counter seen
before (a replay) and a counter more than :data:`WINDOW` below the highest seen (reordered too far).
NIXL may deliver one direction's notifications out of order (a notification riding on a WRITE
is sent once the WRITE completes; a plain one is sent at once), so counters within the window
may arrive in any order, each once. ``0xc1`` is never a msgpack byte: a plain message is never
mistaken for an envelope.

The integrity digests a ``Ready``, ``Offer`` or ``Data`` carries (``integrity=True``) are inside
the tagged message: a digest is then the source's word under the pair's key, not a hash anyone
can match.

A new meeting of the same two agents (a new route) gives new keys: :meth:`PairChannel.rekey`. The
side that dialled switches to them at once; the side that answered keeps sending under the old
ones until a message under the new ones arrives (the dialler installs its keys only after the
meeting ends, so it could not read them sooner). Each side keeps receiving under both.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from ..errors import ProtocolError
from .auth import PairKeys

__all__ = ["PairChannel", "MessageAuthError", "MARKER", "TAG_BYTES", "WINDOW", "sealed"]

MARKER = b"\xc1\x01"  # 0xc1 is never used by msgpack, 0x01 the envelope's version
_HEAD = struct.Struct(">2s8sQ")  # marker, session, counter
TAG_BYTES = 32
#: how far below the highest counter seen a message may still arrive (each counter once)
WINDOW = 1024
_MAX_COUNTER = (1 << 64) - 1


class MessageAuthError(ProtocolError):
    """A control message not sealed under the sender's pair key, a replay, or one too old."""


def sealed(data: bytes) -> bool:
    """Whether ``data`` is an envelope (not a plain msgpack message)."""
    return bytes(data[:2]) == MARKER


def _session(key: bytes) -> bytes:
    return hashlib.sha256(b"kvtriton-msg-session|" + key).digest()[:8]


class _Receiving:
    """One receiving key and its window of counters seen."""

    __slots__ = ("key", "session", "top", "seen")

    def __init__(self, key: bytes):
        self.key, self.session = key, _session(key)
        self.top = 0  # the highest counter accepted
        self.seen = 0  # bit i: counter top - i was accepted

    def check(self, counter: int) -> None:
        if counter == 0:
            raise MessageAuthError("sealed message with counter 0")
        if counter <= self.top:
            back = self.top - counter
            if back >= WINDOW:
                raise MessageAuthError(f"sealed message {counter} is more than {WINDOW} behind {self.top} "
                                       f"(reordered too far, or replayed)")
            if self.seen >> back & 1:
                raise MessageAuthError(f"sealed message {counter} was received before (a replay)")

    def accept(self, counter: int) -> None:
        if counter > self.top:
            shift = counter - self.top
            self.seen = ((self.seen << shift) | 1) & ((1 << WINDOW) - 1) if shift < WINDOW else 1
            self.top = counter
        else:
            self.seen |= 1 << (self.top - counter)


class _Sending:
    __slots__ = ("key", "session", "counter")

    def __init__(self, key: bytes):
        self.key, self.session, self.counter = key, _session(key), 0


class PairChannel:
    """One side's sealing state with one peer: the sending key and counter, the receiving keys
    (the current meeting's and up to two before) and their windows. Not thread-safe (the agent's
    lock covers it)."""

    def __init__(self, keys: PairKeys):
        self._send = _Sending(keys.send)
        self._next: _Sending | None = None  # answered a new meeting: sent under once the peer uses it
        self._recv = [_Receiving(keys.recv)]

    def __repr__(self) -> str:  # never the keys
        return f"PairChannel(sent={self._send.counter}, receiving={len(self._recv)})"

    def rekey(self, keys: PairKeys) -> None:
        """The same peer met again: receive under the new keys too, send under them now (we
        dialled) or once the peer does (we answered)."""
        if any(r.key == keys.recv for r in self._recv):
            return  # the same meeting told twice
        # three: answering twice before the peer spoke, we may still send under the first keys
        self._recv = [_Receiving(keys.recv), *self._recv[:2]]
        if keys.dialled:
            self._send, self._next = _Sending(keys.send), None
        else:
            self._next = _Sending(keys.send)

    def seal(self, message: bytes) -> bytes:
        s = self._send
        if s.counter >= _MAX_COUNTER:  # 2**64 messages: never in practice
            raise MessageAuthError("the pair's message counter is exhausted; meet the peer again")
        s.counter += 1
        head = _HEAD.pack(MARKER, s.session, s.counter)
        return head + message + hmac.digest(s.key, head + message, "sha256")

    def open(self, data: bytes) -> bytes:
        """The message inside ``data``; :class:`MessageAuthError` when it is not sealed under
        this peer's key, was received before, or is too old. Nothing is recorded for a refused one."""
        data = bytes(data)
        if len(data) < _HEAD.size + TAG_BYTES or not sealed(data):
            raise MessageAuthError("a plain control message from a peer that holds a pair key (messages "
                                   "between members who met with a credential are sealed)")
        _, session, counter = _HEAD.unpack_from(data)
        body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
        r = next((r for r in self._recv if r.session == session), None)
        if r is None:
            raise MessageAuthError("a sealed message under a key this pair does not hold")
        if not hmac.compare_digest(tag, hmac.digest(r.key, body, "sha256")):
            raise MessageAuthError("a sealed message whose tag does not verify under the pair's key")
        r.check(counter)
        r.accept(counter)
        if r is self._recv[0] and self._next is not None:  # the peer uses the new meeting's keys: so do we
            self._send, self._next = self._next, None
        return body[_HEAD.size:]
