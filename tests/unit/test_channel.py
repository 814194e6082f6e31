"""Control messages sealed under a pair's keys (kvtriton.protocol.channel; issue 33, finding 3):
only the pair's other end can make one, each counter is accepted once, within a window."""

from __future__ import annotations

import secrets

import pytest

from kvtriton.protocol import wire
from kvtriton.protocol.auth import PairKeys, tls_pair_keys
from kvtriton.protocol.channel import WINDOW, MessageAuthError, PairChannel, sealed


def _pair(dialler: bool = True) -> tuple[PairChannel, PairChannel]:
    a, b = secrets.token_bytes(32), secrets.token_bytes(32)
    return PairChannel(PairKeys(a, b, dialled=dialler)), PairChannel(PairKeys(b, a, dialled=not dialler))


def test_a_sealed_message_opens_at_the_other_end_only_and_never_decodes_as_a_plain_message():
    d, p = _pair()
    raw = wire.Reject("x|D<0#0", "no").encode()
    env = d.seal(raw)
    assert sealed(env) and not sealed(raw)
    with pytest.raises(wire.ProtocolError):
        wire.decode_message(env)  # 0xc1 is never msgpack
    assert p.open(env) == raw
    with pytest.raises(MessageAuthError, match="does not verify"):
        d.open(p.seal(raw)[:-1] + b"\0")  # a changed tag
    with pytest.raises(MessageAuthError, match="does not hold"):
        _pair()[1].open(d.seal(raw))  # another pair's key: its session is unknown here
    with pytest.raises(MessageAuthError, match="plain"):
        p.open(raw)


def test_a_changed_byte_a_replay_and_a_reorder_past_the_window_are_refused():
    d, p = _pair()
    first = d.seal(b"\x81\xa1v\x02")
    changed = bytearray(d.seal(b"\x81\xa1v\x02"))
    changed[20] ^= 1
    with pytest.raises(MessageAuthError, match="does not verify"):
        p.open(bytes(changed))
    assert p.open(first)
    with pytest.raises(MessageAuthError, match="before"):
        p.open(first)  # a replay
    late = [d.seal(b"m%d" % i) for i in range(3)]
    assert p.open(late[2]) and p.open(late[0]) and p.open(late[1])  # out of order within the window: each once
    with pytest.raises(MessageAuthError, match="before"):
        p.open(late[0])
    old = d.seal(b"old")
    for _ in range(WINDOW):
        p.open(d.seal(b"new"))
    with pytest.raises(MessageAuthError, match="behind"):
        p.open(old)


def test_a_new_meeting_switches_keys_without_losing_a_message_either_way():
    d, p = _pair()
    assert p.open(d.seal(b"a")) == b"a" and d.open(p.seal(b"b")) == b"b"
    a2, b2 = secrets.token_bytes(32), secrets.token_bytes(32)
    p.rekey(PairKeys(b2, a2))  # the answering side learns the new keys first ...
    in_flight = p.seal(b"still old")  # ... and keeps sending under the old ones
    assert d.open(in_flight) == b"still old"
    d.rekey(PairKeys(a2, b2, dialled=True))  # the dialler switches at once
    assert p.open(d.seal(b"new")) == b"new"  # the answerer sees the new keys used: switches too
    assert d.open(p.seal(b"also new")) == b"also new"
    only_new = PairChannel(PairKeys(a2, b2, dialled=True))  # a dialler that dropped us and met us anew
    assert only_new.open(p.seal(b"y")) == b"y"


def test_tls_pair_keys_mirror_each_other():
    seed = secrets.token_bytes(32)
    c, s = tls_pair_keys(seed, True), tls_pair_keys(seed, False)
    assert c.send == s.recv and c.recv == s.send and c.send != c.recv and c.dialled and not s.dialled
    assert PairChannel(s).open(PairChannel(c).seal(b"hi")) == b"hi"
