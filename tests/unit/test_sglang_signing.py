"""The SGLang backend's sealed control messages and its inline progress (no SGLang needed)."""

import secrets
import shutil
import struct
import subprocess
import time

import numpy as np
import pytest

from kvtriton.errors import AuthenticationError
from kvtriton.integrations.sglang.inline import InlineProgress
from kvtriton.integrations.sglang.messages import STATUS_TAG, Ready, Want
from kvtriton.integrations.sglang.settings import UnsupportedSetupError, control_signer
from kvtriton.protocol.auth import Credential
from kvtriton.protocol.seal import KEY_PURPOSE, SEAL_MAGIC, ControlSigner
from kvtriton.testing.oracle import RegionModel, check_destination
from kvtriton.testing.pair import EnginePair

SECRET = secrets.token_bytes(32)


class Clock:
    """A hand-moved clock (both the wall clock in ns and the monotonic one in s)."""

    def __init__(self, t_s: float = 1.7e9):
        self.t = t_s

    def ns(self) -> int:
        return int(self.t * 1e9)

    def mono(self) -> float:
        return self.t


def signer(engine="sglang-prefill@h:1", rank=1, agent=None, secret=SECRET, clock=None, **kw) -> ControlSigner:
    clock = clock or Clock()
    key = Credential(secret=secret).derive_key(KEY_PURPOSE)
    return ControlSigner(key, engine, rank, agent=agent or f"{engine}:{rank}:{secrets.token_hex(4)}",
                         window_s=kw.pop("window_s", 20.0), clock=clock.ns, **kw)


def ready_frames() -> list[bytes]:
    rng = np.random.default_rng(7)
    return Ready(12, "sglang-prefill@h:1", 1, rng.integers(0, 500, 5),
                 (rng.integers(0, 256, 16, dtype=np.uint8).tobytes(),)).to_zmq()


def test_sealed_message_opens_with_its_frames_sender_and_incarnation():
    clock = Clock()
    a, b = signer(clock=clock), signer("sglang-decode@h:2", 0, clock=clock)
    frames = ready_frames()
    msg = a.seal(frames, b.agent)
    assert len(msg) == len(frames) + 1 and msg[-1].startswith(SEAL_MAGIC)
    got = b.open(msg)
    assert got.frames == frames and got.engine == "sglang-prefill@h:1" and got.rank == 1 and got.agent == a.agent
    assert Ready.from_zmq(got.frames, [16]).room == 12


def _tamper(msg: list[bytes], i: int, j: int) -> list[bytes]:
    out = list(msg)
    out[i] = out[i][:j] + bytes([out[i][j] ^ 1]) + out[i][j + 1:]
    return out


def _seal_field(msg, offset):  # flip one byte of the seal (time, counter, rank, names)
    return _tamper(msg, len(msg) - 1, offset)


@pytest.mark.parametrize("mutate, says", [
    (lambda m: _tamper(m, 4, 3), "MAC"),  # a page id changed
    (lambda m: _tamper(m, 5, 0), "MAC"),  # a metadata row changed
    (lambda m: [m[0], m[2], m[1], *m[3:]], "MAC"),  # frames reordered
    (lambda m: [m[0], m[1] + m[2][:1], m[2][1:], *m[3:]], "MAC"),  # frames re-cut at another boundary
    (lambda m: [STATUS_TAG, *m[1:]], "MAC"),  # another tag
    (lambda m: m[:-2] + m[-1:], "MAC"),  # a frame dropped
    (lambda m: _seal_field(m, 5), "MAC"),  # the sender's time
    (lambda m: _seal_field(m, 13), "MAC"),  # the counter
    (lambda m: _seal_field(m, 21), "MAC"),  # the sender's rank
    (lambda m: _seal_field(m, 31), "MAC"),  # the sender's engine name
    (lambda m: _seal_field(m, len(m[-1]) - 33), "MAC"),  # the receiver's name
    (lambda m: _seal_field(m, 30), "truncated"),  # a name's length
    (lambda m: m[:-1] + [m[-1][:-1]], "truncated"),  # MAC cut short
    (lambda m: m[:-1] + [m[-1][:20]], "not a kvtriton seal"),
    (lambda m: m[:-1], "not a kvtriton seal"),  # no seal at all: the last payload frame is not one
    (lambda m: m[:1], "unsigned"),
])
def test_tampered_messages_refused(mutate, says):
    clock = Clock()
    a, b = signer(clock=clock), signer("d", 0, clock=clock)
    msg = a.seal(ready_frames(), b.agent)
    with pytest.raises(AuthenticationError, match=says):
        b.open(mutate(list(msg)))
    b.open(list(msg))  # the untouched message opens: the mutation is what refused


def test_wrong_key_and_other_purpose_refused():
    clock = Clock()
    b = signer("d", 0, agent="D:0:x", clock=clock)
    msg = signer(clock=clock).seal(ready_frames(), b.agent)
    with pytest.raises(AuthenticationError, match="MAC"):
        signer("d", 0, agent="D:0:x", secret=secrets.token_bytes(32), clock=clock).open(msg)
    cred = Credential(secret=SECRET)
    other = ControlSigner(cred.derive_key(b"another-use"), "p", 1, agent="P:1:y", window_s=20, clock=clock.ns)
    with pytest.raises(AuthenticationError, match="MAC"):
        b.open(other.seal(ready_frames(), b.agent))
    # the derived key is neither the secret nor a handshake proof's key
    assert cred.derive_key(KEY_PURPOSE) != SECRET and len(cred.derive_key(KEY_PURPOSE)) == 32
    with pytest.raises(AuthenticationError):
        Credential(secret=SECRET).derive_key(b"")


def test_a_want_replayed_to_another_prefill_rank_or_a_restarted_one_is_refused():
    # before (issue 33, finding 9): a seal named no receiver; a sealed WANT replayed to another
    # prefill rank, or to a restart of the same one within the window, was accepted
    clock = Clock()
    d = signer("sglang-decode@h:2", 0, clock=clock)
    p0, p1 = signer("sglang-prefill@h:1", 0, clock=clock), signer("sglang-prefill@h:1", 1, clock=clock)
    want = d.seal(Want(5, d.agent, 0, "127.0.0.1", 9, 0).to_zmq(), p0.agent)
    assert p0.open(want).agent == d.agent
    restarted = signer("sglang-prefill@h:1", 0, clock=clock)  # same engine and rank, a new run
    for other in (p1, restarted):
        with pytest.raises(AuthenticationError, match="another receiver"):
            other.open(list(want))


def test_a_replay_is_refused_by_its_senders_counter_within_a_bounded_memory():
    clock = Clock()
    a, b = signer(clock=clock), signer("d", 0, clock=clock, max_senders=4)
    first, second, third = (a.seal(ready_frames(), b.agent) for _ in range(3))
    b.open(first)
    with pytest.raises(AuthenticationError, match="replayed"):
        b.open(first)
    b.open(third)
    b.open(second)  # reordered within the window: each counter once
    with pytest.raises(AuthenticationError, match="replayed"):
        b.open(second)
    for _ in range(10):  # more senders than the bound: memory stays at it
        b.open(signer(clock=clock).seal(ready_frames(), b.agent))
        assert b.remembered() <= 4
    clock.t += 21.0  # a message whose sender's counters were dropped is still bounded by the clock window
    with pytest.raises(AuthenticationError, match="stale"):
        b.open(first)


def test_a_member_whose_clock_runs_ahead_gets_no_honest_message_refused():
    # before (issue 33, finding 9): a member 10 s ahead sending 65,537 messages moved the shared
    # replay floor past every honest sender's clock: honest messages were refused for ~10 s
    clock = Clock()
    b = signer("d", 0, clock=clock)
    ahead = signer("sglang-prefill@h:9", 0, clock=Clock(clock.t + 10.0))
    honest = signer(clock=clock)
    frames = [b"T", b"x"]
    for _ in range(65_537):
        b.open(ahead.seal(frames, b.agent))
    assert b.remembered() == 1
    for _ in range(3):
        assert b.open(honest.seal(frames, b.agent)).agent == honest.agent


def test_stale_and_future_messages_refused():
    clock = Clock()
    b = signer("d", 0, clock=clock, window_s=20.0)
    for skew, ok in ((-19.0, True), (19.0, True), (-21.0, False), (21.0, False)):  # the sender's clock
        msg = signer(clock=Clock(clock.t + skew)).seal(ready_frames(), b.agent)
        if ok:
            b.open(msg)
        else:
            with pytest.raises(AuthenticationError, match="stale"):
                b.open(msg)


def test_sender_identity_bound():
    """A rank's seal names it: a peer cannot pass its message off as another rank's (the seal's
    rank/engine are in the MAC, checked above), and the payload must name the same sender
    (the manager compares them: this is what it compares)."""
    clock = Clock()
    p = signer("p", 0, clock=clock)
    msg = signer("sglang-decode@x:1", 2, clock=clock).seal(Want(5, "sglang-decode@y:9", 0, "127.0.0.1", 9, 0).to_zmq(),
                                                          p.agent)
    got = p.open(msg)
    want = Want.from_zmq(got.frames)
    assert (want.engine, want.rank) != (got.engine, got.rank)
    assert (got.engine, got.rank) == ("sglang-decode@x:1", 2)


def _self_signed(d):
    if shutil.which("openssl") is None:
        raise RuntimeError("this test needs the openssl CLI to make a certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", "k.pem", "-out", "c.pem", "-days", "1", "-subj", "/CN=kvtriton-test"],
                   cwd=d, check=True, capture_output=True, timeout=60)
    return str(d / "c.pem"), str(d / "k.pem")


def test_control_signer_per_credential(tmp_path):
    assert control_signer(None, "e", 0, agent="e:0:a", handshake_timeout_s=5.0) is None  # dev mode: unsigned
    s = control_signer(Credential(secret=SECRET), "e", 0, agent="e:0:a", handshake_timeout_s=5.0)
    assert isinstance(s, ControlSigner) and s.window_ns == 30 * 10**9 and s.agent == "e:0:a"
    cert, key = _self_signed(tmp_path)
    tls_only = Credential(cert_file=cert, key_file=key, ca_file=cert)
    with pytest.raises(UnsupportedSetupError, match="auth_secret_file.*TLS alone is not enough"):
        control_signer(tls_only, "e", 0, agent="e:0:a", handshake_timeout_s=5.0)
    both = Credential(cert_file=cert, key_file=key, ca_file=cert, secret=SECRET)
    assert control_signer(both, "e", 0, agent="e:0:a", handshake_timeout_s=20.0).window_ns == 80 * 10**9


def test_seal_layout():
    """The seal's header is what the module documents (a peer in another language can build it)."""
    clock = Clock()
    seal = signer("eng", 3, agent="ag", clock=clock).seal([b"T", b"x"], "rcv")[-1]
    magic, t, counter, rank, n_eng, n_from, n_to = struct.unpack_from(">5sQQIHHH", seal)
    assert (magic, t, counter, rank, n_eng, n_from, n_to) == (SEAL_MAGIC, clock.ns(), 1, 3, 3, 2, 3)
    assert seal[31:39] == b"engagrcv" and len(seal) == 31 + 8 + 32


# ------------------------------------------------------------------ inline progress
def test_poll_path_progresses_the_agent():
    """With no background progress thread, the scheduler's polls (InlineProgress.step) move a
    transfer to its end and hand the result to the role; without them it does not move."""
    with EnginePair(1, 1, models=[RegionModel.gqa("l0", 2, 16)], seed=5) as e:
        src, dst = np.array([3, 7, 1]), np.array([2, 0, 5])
        kv = e.request(src)
        results, freed = [], []
        dec = InlineProgress(e.da[0], on_result=results.append, interval_s=0.0)
        pre = InlineProgress(e.pa[0], on_freed=lambda rid, why: freed.append((rid, why)), interval_s=0.0)
        e.pa[0].hold("r", src)
        e.da[0].fetch("r", "P", src, dst)
        for _ in range(50):  # the control: draining alone (no progress) moves nothing
            dec.drain()
            pre.drain()
        assert results == [] and e.da[0].debug_state()["fetches"]
        deadline = time.monotonic() + 60  # bounded; under load a transfer takes well under that
        while not (results and freed) and time.monotonic() < deadline:
            dec.step()
            pre.step()
        assert len(results) == 1 and results[0].ok and results[0].req_id == "r", results
        assert freed == [("r", "done")]
        assert dec.steps > 0 and pre.steps > 0
        check_destination(e.D[0], 0, 1, kv, dst, e.before[0])


def test_inline_step_rate_limited():
    calls = []

    class Agent:
        def progress(self, wait=True):
            calls.append(wait)
            return True

        def results(self):
            return []

        def freed(self):
            return []

    t = Clock(0.0)
    p = InlineProgress(Agent(), on_result=lambda r: None, interval_s=0.0005, clock=t.mono)
    for _ in range(10):  # one scheduler step polling ten rooms
        p.step()
    t.t += 0.001
    p.step()
    assert calls == [False, False]  # once per interval, never blocking

