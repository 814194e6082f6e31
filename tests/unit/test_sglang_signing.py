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
from kvtriton.integrations.sglang.settings import control_signer
from kvtriton.protocol.auth import Credential, PairKeys
from kvtriton.protocol.channel import PairChannel
from kvtriton.protocol.handshake import MetadataServer, meet
from kvtriton.protocol.seal import SEAL_MAGIC, ControlSigner, zmq_keys
from kvtriton.testing.oracle import RegionModel, check_destination
from kvtriton.testing.pair import EnginePair

SECRET = secrets.token_bytes(32)


class Clock:
    """A hand-moved monotonic clock (s)."""

    def __init__(self, t_s: float = 1.7e9):
        self.t = t_s

    def mono(self) -> float:
        return self.t


class Rank:
    """A rank's signer with the engine and rank it is met as."""

    def __init__(self, engine: str, rank: int, **kw):
        self.engine, self.rank = engine, rank
        self.signer = ControlSigner(agent=f"{engine}:{rank}:{secrets.token_hex(4)}", **kw)
        self.agent = self.signer.agent


def meet_pair(dialler: Rank, answerer: Rank) -> tuple[PairKeys, PairKeys]:
    """What one meeting gives both sides (fresh keys each way), learned by both."""
    c2s, s2c = secrets.token_bytes(32), secrets.token_bytes(32)
    kd, ka = PairKeys(send=c2s, recv=s2c, dialled=True), PairKeys(send=s2c, recv=c2s)
    dialler.signer.learn(answerer.agent, answerer.engine, answerer.rank, kd)
    answerer.signer.learn(dialler.agent, dialler.engine, dialler.rank, ka)
    return kd, ka


def ready_frames() -> list[bytes]:
    rng = np.random.default_rng(7)
    return Ready(12, "sglang-prefill@h:1", 1, rng.integers(0, 500, 5),
                 (rng.integers(0, 256, 16, dtype=np.uint8).tobytes(),)).to_zmq()


def test_sealed_message_opens_with_its_frames_and_the_sender_its_meeting_proved():
    p, d = Rank("sglang-prefill@h:1", 1), Rank("sglang-decode@h:2", 0)
    meet_pair(d, p)
    frames = ready_frames()
    msg = p.signer.seal(frames, d.agent)
    assert len(msg) == len(frames) + 1 and msg[-1].startswith(SEAL_MAGIC)
    got = d.signer.open(msg)
    assert got.frames == frames and (got.engine, got.rank, got.agent) == (p.engine, 1, p.agent)
    assert Ready.from_zmq(got.frames, [16]).room == 12
    back = d.signer.seal(Want(12, d.engine, 0, "127.0.0.1", 9, 0).to_zmq(), p.agent)
    assert p.signer.open(back).engine == d.engine


def _tamper(msg: list[bytes], i: int, j: int) -> list[bytes]:
    out = list(msg)
    out[i] = out[i][:j] + bytes([out[i][j] ^ 1]) + out[i][j + 1:]
    return out


def _seal_field(msg, offset):  # flip one byte of the seal (lengths, names, envelope)
    return _tamper(msg, len(msg) - 1, offset)


@pytest.mark.parametrize("mutate, says", [
    (lambda m: _tamper(m, 4, 3), "cover"),  # a page id changed
    (lambda m: _tamper(m, 5, 0), "cover"),  # a metadata row changed
    (lambda m: [m[0], m[2], m[1], *m[3:]], "cover"),  # frames reordered
    (lambda m: [m[0], m[1] + m[2][:1], m[2][1:], *m[3:]], "cover"),  # frames re-cut at another boundary
    (lambda m: [STATUS_TAG, *m[1:]], "cover"),  # another tag
    (lambda m: m[:-2] + m[-1:], "cover"),  # a frame dropped
    (lambda m: _seal_field(m, 10), "cover|never met"),  # the sender's name
    (lambda m: _seal_field(m, len(m[-1]) - 83), "another receiver"),  # the receiver's name
    (lambda m: _seal_field(m, len(m[-1]) - 70), "pair's key"),  # the envelope's counter
    (lambda m: _seal_field(m, len(m[-1]) - 75), "pair's key"),  # the envelope's session
    (lambda m: _seal_field(m, len(m[-1]) - 40), "cover"),  # the digest
    (lambda m: _seal_field(m, len(m[-1]) - 1), "pair's key"),  # the tag
    (lambda m: _seal_field(m, 6), "truncated"),  # a name's length
    (lambda m: m[:-1] + [m[-1][:-1]], "truncated"),  # the tag cut short
    (lambda m: m[:-1] + [m[-1][:20]], "not a kvtriton seal"),
    (lambda m: m[:-1], "not a kvtriton seal"),  # no seal at all: the last payload frame is not one
    (lambda m: m[:1], "unsigned"),
])
def test_tampered_messages_refused(mutate, says):
    p, d = Rank("p", 1), Rank("d", 0)
    meet_pair(d, p)
    msg = p.signer.seal(ready_frames(), d.agent)
    with pytest.raises(AuthenticationError, match=says):
        d.signer.open(mutate(list(msg)))
    d.signer.open(list(msg))  # the untouched message opens: the mutation is what refused


def test_a_member_cannot_seal_as_another_member():
    """Issue 33, finding 9's remnant. Before: every member held one key derived from the cluster
    secret, so a member sealed a WANT as another decode engine's rank (its name, its agent) and
    the prefill opened it as that rank's. Now each pair seals under its own meeting's keys: a
    member holds its pair keys with the prefill and not the victim's."""
    p, victim, member = Rank("sglang-prefill@h:1", 0), Rank("sglang-decode@v:1", 0), Rank("sglang-decode@m:1", 0)
    meet_pair(victim, p)
    mine, _ = meet_pair(member, p)
    want = Want(7, victim.engine, 0, "127.0.0.1", 9, 0).to_zmq()
    # 1. under the victim's name, with the keys the member has: the victim's pair key does not verify
    forger = ControlSigner(agent=victim.agent)
    forger.learn(p.agent, p.engine, p.rank, mine)
    with pytest.raises(AuthenticationError, match="pair's key"):
        p.signer.open(forger.seal(want, p.agent))
    # 2. under its own name: it opens as the member, whatever the payload says (the manager
    # compares the WANT's engine with this and refuses it)
    got = p.signer.open(member.signer.seal(want, p.agent))
    assert (got.engine, got.rank) == (member.engine, 0) != (Want.from_zmq(got.frames).engine, 0)
    # 3. a READY to a decode rank under a prefill's name, by a member the decode never met
    d = Rank("sglang-decode@h:2", 0)
    meet_pair(d, p)
    rogue_p = ControlSigner(agent=p.agent)
    rogue_p.learn(d.agent, d.engine, d.rank, PairKeys(send=secrets.token_bytes(32), recv=secrets.token_bytes(32)))
    with pytest.raises(AuthenticationError, match="pair's key"):
        d.signer.open(rogue_p.seal(ready_frames(), d.agent))
    # the real ones still open: nothing was recorded for the refused ones
    assert p.signer.open(victim.signer.seal(want, p.agent)).engine == victim.engine
    assert d.signer.open(p.signer.seal(ready_frames(), d.agent)).agent == p.agent


def test_a_rank_never_met_is_refused_and_nothing_is_sealed_for_one():
    p, d, stranger = Rank("p", 0), Rank("d", 0), Rank("s", 0)
    meet_pair(d, p)
    # the stranger seals for d under keys of its own choosing: d never met it
    stranger.signer.learn(d.agent, d.engine, d.rank, PairKeys(send=secrets.token_bytes(32),
                                                              recv=secrets.token_bytes(32)))
    with pytest.raises(AuthenticationError, match="never met"):
        d.signer.open(stranger.signer.seal(ready_frames(), d.agent))
    with pytest.raises(AuthenticationError, match="only for a rank met"):
        p.signer.seal(ready_frames(), stranger.agent)


def test_a_want_replayed_to_another_prefill_rank_or_a_restarted_one_is_refused():
    d = Rank("sglang-decode@h:2", 0)
    p0, p1 = Rank("sglang-prefill@h:1", 0), Rank("sglang-prefill@h:1", 1)
    meet_pair(d, p0)
    meet_pair(d, p1)
    want = d.signer.seal(Want(5, d.engine, 0, "127.0.0.1", 9, 0).to_zmq(), p0.agent)
    assert p0.signer.open(want).agent == d.agent
    restarted = Rank("sglang-prefill@h:1", 0)  # same engine and rank, a new run, met again
    meet_pair(d, restarted)
    for other in (p1, restarted):
        with pytest.raises(AuthenticationError, match="another receiver"):
            other.signer.open(list(want))


def test_a_replay_is_refused_by_the_pairs_counter_within_a_bounded_memory():
    p, d = Rank("p", 0), Rank("d", 0, max_peers=4)
    meet_pair(d, p)
    first, second, third = (p.signer.seal(ready_frames(), d.agent) for _ in range(3))
    d.signer.open(first)
    with pytest.raises(AuthenticationError, match="before"):
        d.signer.open(first)
    d.signer.open(third)
    d.signer.open(second)  # reordered within the window: each counter once
    with pytest.raises(AuthenticationError, match="before"):
        d.signer.open(second)
    for _ in range(10):  # more peers than the bound: memory stays at it, the least recent goes
        meet_pair(d, Rank("q", 0))
        assert d.signer.remembered() <= 4
    with pytest.raises(AuthenticationError, match="never met"):  # p was dropped: met again, new keys
        d.signer.open(p.signer.seal(ready_frames(), d.agent))


def test_no_wall_clock_decides():
    """Counters only: a pair's messages open however far apart the two clocks are, and a flood
    from one member changes nothing for another (finding 9: a shared wall-clock floor did)."""
    d, member, honest = Rank("d", 0), Rank("p", 9), Rank("p", 1)
    meet_pair(d, member)
    meet_pair(d, honest)
    for _ in range(5000):
        d.signer.open(member.signer.seal([b"T", b"x"], d.agent))
    for _ in range(3):
        assert d.signer.open(honest.signer.seal([b"T", b"x"], d.agent)).agent == honest.agent


def test_a_new_meeting_rekeys_as_the_nixl_channel_does():
    p, d = Rank("p", 0), Rank("d", 0)
    meet_pair(d, p)
    old = p.signer.seal(ready_frames(), d.agent)
    meet_pair(d, p)  # met again (a new route): the dialler seals under the new keys at once
    d.signer.open(old)  # still received under the previous keys
    p.signer.open(d.signer.seal([b"T", b"w"], p.agent))  # the answerer hears the new keys...
    d.signer.open(p.signer.seal(ready_frames(), d.agent))  # ...and answers under them
    with pytest.raises(AuthenticationError, match="met as"):  # an agent name keeps its identity
        d.signer.learn(p.agent, "another-engine", 0, PairKeys(send=bytes(32), recv=bytes(32)))


def test_the_zmq_keys_are_not_the_nixl_channels():
    kd = PairKeys(send=secrets.token_bytes(32), recv=secrets.token_bytes(32), dialled=True)
    z = zmq_keys(kd)
    assert {z.send, z.recv}.isdisjoint({kd.send, kd.recv}) and z.dialled
    p, d = Rank("p", 0), Rank("d", 0)
    d.signer.learn(p.agent, p.engine, 0, kd)
    nixl = PairChannel(PairKeys(send=kd.recv, recv=kd.send))  # p's NIXL channel with d
    msg = ready_frames()
    seal = ControlSigner(agent=p.agent)
    seal.learn(d.agent, d.engine, 0, PairKeys(send=kd.recv, recv=kd.send))
    sealed = seal.seal(msg, d.agent)
    d.signer.open(list(sealed))
    with pytest.raises(Exception, match="tag|key"):  # a seal's envelope is no NIXL message of the pair
        PairChannel(kd).open(sealed[-1][-82:])
    fake = list(sealed)
    fake[-1] = fake[-1][:-82] + nixl.seal(fake[-1][-64:-32])  # the same digest under the NIXL key
    with pytest.raises(AuthenticationError, match="pair's key"):
        d.signer.open(fake)


def test_real_handshake_keys_bind_each_pair(tmp_path):
    """Over the real handshake (the shared secret, 127.0.0.1): the keys each meeting gives the
    prefill and its decode callers seal between them, and a member that met the same prefill
    with the same secret cannot seal as another."""
    learned = {}
    p = Rank("sglang-prefill@h:1", 0)

    def on_meeting(m):
        name = m.metadata.decode()
        p.signer.learn(name, name.split(":")[0], 0, m.keys)
        learned[name] = True
        return name

    cred = Credential(secret=SECRET)
    with MetadataServer("127.0.0.1", 0, lambda: p.agent.encode(), on_meeting=on_meeting, credential=cred,
                        io_timeout_s=5.0).start() as server:
        ranks = {}
        for who in ("victim", "member"):
            r = Rank(f"sglang-decode@{who}", 0)
            m = meet("127.0.0.1", server.port, r.agent.encode(), credential=cred, timeout_s=5.0)
            assert m.metadata == p.agent.encode() and m.keys is not None
            r.signer.learn(p.agent, p.engine, 0, m.keys)
            ranks[who] = (r, m.keys)
    victim, member = ranks["victim"][0], ranks["member"][0]
    assert set(learned) == {victim.agent, member.agent}
    want = Want(3, victim.engine, 0, "127.0.0.1", 9, 0).to_zmq()
    assert p.signer.open(victim.signer.seal(want, p.agent)).engine == victim.engine
    forger = ControlSigner(agent=victim.agent)
    forger.learn(p.agent, p.engine, 0, ranks["member"][1])
    with pytest.raises(AuthenticationError, match="pair's key"):
        p.signer.open(forger.seal(want, p.agent))
    assert victim.signer.open(p.signer.seal(ready_frames(), victim.agent)).engine == p.engine


def _self_signed(d):
    if shutil.which("openssl") is None:
        raise RuntimeError("this test needs the openssl CLI to make a certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", "k.pem", "-out", "c.pem", "-days", "1", "-subj", "/CN=kvtriton-test"],
                   cwd=d, check=True, capture_output=True, timeout=60)
    return str(d / "c.pem"), str(d / "k.pem")


def test_control_signer_per_credential(tmp_path):
    assert control_signer(None, agent="e:0:a") is None  # dev mode: unsealed
    s = control_signer(Credential(secret=SECRET), agent="e:0:a")
    assert isinstance(s, ControlSigner) and s.agent == "e:0:a" and s.remembered() == 0
    cert, key = _self_signed(tmp_path)
    tls_only = Credential(cert_file=cert, key_file=key, ca_file=cert)  # TLS meetings give pair keys too
    assert isinstance(control_signer(tls_only, agent="e:0:a"), ControlSigner)
    both = Credential(cert_file=cert, key_file=key, ca_file=cert, secret=SECRET)
    assert control_signer(both, agent="e:0:a") is not None


def test_seal_layout():
    """The seal is what the module documents (a peer in another language can build it)."""
    p, d = Rank("eng", 3), Rank("rcv", 0)
    meet_pair(d, p)
    seal = p.signer.seal([b"T", b"x"], d.agent)[-1]
    magic, n_from, n_to = struct.unpack_from(">5sHH", seal)
    assert (magic, n_from, n_to) == (SEAL_MAGIC, len(p.agent), len(d.agent))
    names = seal[9:9 + n_from + n_to]
    assert names == (p.agent + d.agent).encode()
    envelope = seal[9 + n_from + n_to:]
    assert len(envelope) == 2 + 8 + 8 + 32 + 32 and envelope[:2] == b"\xc1\x01"
    assert struct.unpack_from(">Q", envelope, 10)[0] == 1  # the pair's first message


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

