"""The seal: a frame that proves who sent a multipart control message, to whom, and that it is new.

The SGLang backend's control messages travel on SGLang's ZMQ sockets, whose PULL ends take a
message from whoever reaches them. With a shared secret in the cluster credential, every control
message of ours (``WANT``, ``READY``, the ``STATUS``-tagged failures, ``KVT_ABORT``) carries one
more frame, the *seal* (version 2, issue 33 finding 9)::

    b"KVTS2" | time_ns (8) | counter (8) | rank (4) | len(engine) (2) | len(sender) (2) | len(receiver) (2)
             | engine | sender | receiver | MAC (32)

``sender`` and ``receiver`` are the two ranks' *incarnations*: each one's NIXL agent name, unique
per process (a restarted rank has a new one). ``MAC = HMAC-SHA256(key, label | tag | every frame |
the header's fields)`` with each variable piece length-prefixed (frames cannot be re-cut or
reordered into another valid message), under a key derived from the secret for this purpose only
(:meth:`Credential.derive_key`: a handshake proof is never a valid seal, nor the other way round).
The receiver checks the MAC (:func:`hmac.compare_digest`) before it parses anything of the
payload, then that the seal names *it* as the receiver (a message replayed to another rank, or to
a restart of this one, is refused), then the counter: each sender counts its seals from 1, and the
receiver keeps, per sender incarnation, the highest counter seen and which of the :data:`WINDOW`
below it were seen (each is accepted once; a sender's first message seen counts every lower one as
seen). No wall clock decides a replay, so one member's clock never gets another's messages
refused. The sender's clock is still checked loosely (``window_s`` either side of ours): it only
bounds how long a message stays usable if its sender's state was dropped (at most
``max_senders`` senders are remembered; the least recently heard goes first). Any failure is an
:class:`~kvtriton.errors.AuthenticationError`; a refused message changes nothing.

Every member holds the same key, so a member can still seal as another member: the seal keeps
non-members out and binds each message to one receiver and one use. Without a credential (dev
mode) messages go unsigned. A TLS-only credential cannot seal them (ZMQ's sockets there are
SGLang's, without TLS): the backend refuses it at start
(:func:`kvtriton.integrations.sglang.settings.control_signer`).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import AuthenticationError

__all__ = ["KEY_PURPOSE", "SEAL_MAGIC", "WINDOW", "ControlSigner", "Opened"]

KEY_PURPOSE = b"sglang-zmq-control-v1"
SEAL_MAGIC = b"KVTS2"
_HEAD = struct.Struct(">5sQQIHHH")  # magic, time_ns, counter, rank, len(engine), len(sender), len(receiver)
_MAC_BYTES = hashlib.sha256().digest_size
_MAX_NAME = 256
#: how far below a sender's highest counter a message may still arrive (each counter once)
WINDOW = 1024


@dataclass(frozen=True)
class Opened:
    """A verified message: its frames without the seal, and who sealed it (``agent``: its
    incarnation, the name a reply to it is sealed for)."""

    frames: list[bytes]
    engine: str
    rank: int
    agent: str = ""


class _Heard:
    """One sender incarnation's counters: the highest seen, and the window below it."""

    __slots__ = ("top", "seen")

    def __init__(self, counter: int):
        self.top, self.seen = counter, (1 << WINDOW) - 1  # everything at or below the first is spent

    def take(self, counter: int) -> None:
        if counter > self.top:
            shift = counter - self.top
            self.seen = ((self.seen << shift) | 1) & ((1 << WINDOW) - 1) if shift < WINDOW else 1
            self.top = counter
            return
        back = self.top - counter
        if back >= WINDOW or self.seen >> back & 1:
            raise AuthenticationError(f"a replayed message (counter {counter} of its sender was seen, or is more "
                                      f"than {WINDOW} behind {self.top})")
        self.seen |= 1 << back


def _ascii(name: str, what: str) -> bytes:
    raw = name.encode("ascii")
    if not 0 < len(raw) <= _MAX_NAME:
        raise AuthenticationError(f"{what} {name!r}: expected 1..{_MAX_NAME} ASCII characters")
    return raw


class ControlSigner:
    """Seals this rank's control messages and opens its peers' (one per manager).

    ``key``: the derived key (:meth:`Credential.derive_key` of :data:`KEY_PURPOSE`); ``engine``,
    ``rank``: this rank, bound into each seal; ``agent``: this rank's incarnation (its NIXL agent
    name), which its seals name as the sender and the seals it opens must name as the receiver;
    ``window_s``: how far a sender's clock may be from ours; ``max_senders``: sender incarnations
    remembered."""

    def __init__(self, key: bytes, engine: str, rank: int, *, agent: str, window_s: float, max_senders: int = 4096,
                 clock=time.time_ns):
        if len(key) < 16:
            raise AuthenticationError(f"a control-message key of {len(key)} bytes: expected at least 16")
        if not 0 <= rank < 1 << 32:
            raise AuthenticationError(f"rank {rank}: expected a rank below 2**32")
        if window_s <= 0 or max_senders < 1:
            raise AuthenticationError(f"window_s={window_s}, max_senders={max_senders}: expected both positive")
        self._key, self._engine, self._rank = key, _ascii(engine, "engine"), rank
        self.agent = agent
        self._me = _ascii(agent, "agent")
        self.window_ns = int(window_s * 1e9)
        self.max_senders = max_senders
        self._clock = clock
        self._counter = 0
        self._heard: OrderedDict[bytes, _Heard] = OrderedDict()  # sender incarnation -> its counters, LRU
        self._lock = threading.Lock()

    def _mac(self, frames: list[bytes], head: bytes, names: bytes) -> bytes:
        h = hmac.new(self._key, KEY_PURPOSE, hashlib.sha256)
        h.update(struct.pack(">I", len(frames)))
        for f in frames:
            h.update(struct.pack(">Q", len(f)))
            h.update(f)
        h.update(head + names)  # the header holds every name's length: the names cannot be re-cut
        return h.digest()

    def seal(self, frames: list[bytes], to: str) -> list[bytes]:
        """``frames`` (tag first) with the seal frame appended, for the rank whose incarnation
        (NIXL agent name) is ``to``."""
        frames = [bytes(f) for f in frames]
        receiver = _ascii(to, "receiver")
        with self._lock:
            self._counter += 1
            counter = self._counter
        head = _HEAD.pack(SEAL_MAGIC, self._clock(), counter, self._rank, len(self._engine), len(self._me),
                          len(receiver))
        names = self._engine + self._me + receiver
        return frames + [head + names + self._mac(frames, head, names)]

    def open(self, msg: list[bytes]) -> Opened:
        """The verified frames and sender of ``msg``, or :class:`AuthenticationError`."""
        if len(msg) < 2:
            raise AuthenticationError(f"an unsigned control message ({len(msg)} frames, no seal)")
        seal, frames = bytes(msg[-1]), [bytes(f) for f in msg[:-1]]
        if len(seal) < _HEAD.size + _MAC_BYTES or seal[:5] != SEAL_MAGIC:
            raise AuthenticationError(f"the last frame ({len(seal)} bytes) is not a kvtriton seal of version 2")
        _, sent_ns, counter, rank, n_eng, n_from, n_to = _HEAD.unpack_from(seal)
        n = n_eng + n_from + n_to
        if len(seal) != _HEAD.size + n + _MAC_BYTES or not all(0 < x <= _MAX_NAME for x in (n_eng, n_from, n_to)):
            raise AuthenticationError(f"a seal of {len(seal)} bytes for names of {n_eng}, {n_from} and {n_to} bytes "
                                      f"(truncated or padded)")
        head, names = seal[:_HEAD.size], seal[_HEAD.size:_HEAD.size + n]
        if not hmac.compare_digest(seal[_HEAD.size + n:], self._mac(frames, head, names)):
            raise AuthenticationError("the seal's MAC does not match (another key, or a changed frame or sender)")
        engine, sender, receiver = names[:n_eng], names[n_eng:n_eng + n_from], names[n_eng + n_from:]
        if receiver != self._me:
            raise AuthenticationError("a message sealed for another receiver (another rank, or an earlier run of "
                                      "this one)")
        now = self._clock()
        if abs(now - sent_ns) > self.window_ns:
            raise AuthenticationError(f"a stale message: sent {(now - sent_ns) / 1e9:.1f} s ago (its clock), outside "
                                      f"the {self.window_ns / 1e9:.0f} s window (replayed, or the clocks differ)")
        if counter == 0:
            raise AuthenticationError("a seal with counter 0")
        with self._lock:
            heard = self._heard.get(sender)
            if heard is None:
                self._heard[sender] = _Heard(counter)
                while len(self._heard) > self.max_senders:
                    self._heard.popitem(last=False)
            else:
                heard.take(counter)
                self._heard.move_to_end(sender)
        return Opened(frames, engine.decode("ascii", errors="replace"), rank, sender.decode("ascii", errors="replace"))

    def remembered(self) -> int:
        """Sender incarnations whose counters are kept."""
        with self._lock:
            return len(self._heard)
