"""The connector's worker side against forged ``kv_transfer_params`` (issue 18), over real NIXL.

Two :class:`~kvtriton.integrations.vllm.worker.WorkerSide` ranks (a prefill serving its handshake
port, a decode) in this process, driven with the step messages vLLM's scheduler side would send;
no vLLM import. A rogue listener at the forged address records every connection and byte: "refused
before any connection" means it saw none. Every load that succeeds is checked byte for byte
against the prefill's blocks (fresh random data); every refused one must report its blocks as
load errors (vLLM recomputes them).
"""

import secrets
import socket
import time

import pytest
from helpers.connector_bed import BS, Bed
from helpers.handshake import RogueListener  # a listener without the secret

from kvtriton.integrations.vllm.scheduler import LoadSpec, RemoteSource, SchedulerSide, StepMessages
from kvtriton.integrations.vllm.settings import SettingsError, from_extra_config
from kvtriton.protocol.allowlist import AllowlistError, PeerAllowlist

pytestmark = pytest.mark.nixl


@pytest.fixture
def secret_file(tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(secrets.token_hex(32).encode())
    f.chmod(0o600)
    return str(f)


@pytest.fixture
def bed_factory(gen):
    beds = []

    def make(**kw):
        beds.append(Bed(gen, **kw))
        return beds[-1]

    yield make
    for b in beds:
        b.close()


def test_params_outside_allowed_peers_are_refused_before_any_connection(bed_factory):
    rogue = RogueListener()
    try:
        bed = bed_factory(d_extra={"allowed_peers": ["10.9.9.9", "127.0.0.1:1"]})
        bed.hold("r1", [3, 7])
        done, errors = bed.load("r1", [3, 7], [0, 5], port=rogue.port)
        assert done and errors == {0, 5}
        assert rogue.connections == 0 and bed.decode.stats["refused_peer"] == 1
        assert bed.decode.stats["failed"] == 1 and bed.decode.stats["loads"] == 0  # a refusal is a failed load
        # and the scheduler side computes such a request locally in the first place
        sched = SchedulerSide(engine_id="D", host="127.0.0.1", port=1, tp_size=1, block_size=BS,
                              allowed_peers=PeerAllowlist(["127.0.0.1:1"]))

        class Req:
            request_id, num_prompt_tokens = "q", 8
            kv_transfer_params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1",
                                  "remote_port": rogue.port, "tp_size": 1, "remote_request_id": "r1",
                                  "remote_block_ids": [3, 7], "remote_block_size": BS}

        assert sched.get_num_new_matched_tokens(Req(), 0) == (0, False)
        assert Req.kv_transfer_params["do_remote_prefill"] is False and sched.stats["disallowed"] == 1
    finally:
        rogue.close()
    assert rogue.connections == 0


def test_allowed_peer_loads_the_right_bytes(bed_factory, secret_file):
    bed = bed_factory(p_extra={"auth_secret_file": secret_file},
                      d_extra={"auth_secret_file": secret_file, "allowed_peers": ["127.0.0.0/8", "engine:P"]})
    bed.hold("r1", [3, 7, 2])
    done, errors = bed.load("r1", [3, 7, 2], [0, 5, 9])
    assert done and not errors
    bed.assert_landed([3, 7, 2], [0, 5, 9])


def test_a_met_engine_named_at_a_rogue_address_is_refused_there(bed_factory, secret_file, monkeypatch):
    # the rogue is dialled once (a new route must prove the engine: issue 33, finding 2), learns no
    # metadata, and is not dialled again
    monkeypatch.setenv("KVTRITON_AUTH_SECRET_FILE", secret_file)  # the environment default, both engines
    bed = bed_factory()
    assert bed.decode.credential is not None and bed.prefill.credential is not None
    bed.hold("r1", [1, 2])
    assert bed.load("r1", [1, 2], [3, 4]) == (True, set())
    bed.assert_landed([1, 2], [3, 4])
    rogue = RogueListener()
    try:
        for _ in range(2):
            bed.hold("r2", [5, 6])
            done, errors = bed.load("r2", [5, 6], [7, 8], port=rogue.port)
            assert done and errors == {7, 8}
        assert rogue.connections == 1 and b"agent" not in rogue.received
    finally:
        rogue.close()
    assert bed.load("r2", [5, 6], [7, 8]) == (True, set())  # the honest address still works
    bed.assert_landed([5, 6], [7, 8])


def test_a_forged_first_request_does_not_poison_later_loads(bed_factory, secret_file):
    bed = bed_factory(p_extra={"auth_secret_file": secret_file}, d_extra={"auth_secret_file": secret_file})
    rogue = RogueListener()
    try:
        bed.hold("r1", [3, 4])
        done, errors = bed.load("r1", [3, 4], [0, 1], port=rogue.port)  # the real engine id, a rogue address
        assert done and errors == {0, 1}
        assert bed.decode.stats["failed"] == 1  # a meeting that failed fails its load, counted as such
        assert rogue.connections == 1 and b"agent" not in rogue.received  # only our HELLO: no metadata
        # frame header + nonce, then the fixed credential-mismatch notice (header + text)
        assert len(rogue.received) == 8 + 2 + 32 + 10 + len(b"credential mismatch: the server's proof does not "
                                                             b"verify under our secret")
    finally:
        rogue.close()
    for i, (remote, local) in enumerate((([3, 4], [0, 1]), ([8, 9], [10, 11]), ([12], [13]))):
        if i:
            bed.hold(f"h{i}", remote)
        assert bed.load("r1" if not i else f"h{i}", remote, local) == (True, set())
        bed.assert_landed(remote, local)
    assert (bed.decode.stats["loads"], bed.decode.stats["failed"]) == (3, 1)


def test_silent_addresses_do_not_delay_an_honest_first_handshake(bed_factory):
    silent = [socket.create_server(("127.0.0.1", 0)) for _ in range(4)]  # accept into the backlog, never answer
    try:
        bed = bed_factory(d_extra={"handshake_timeout_s": 3.0})
        for i, s in enumerate(silent):  # four bad engine ids first, each at a silent address
            bed.decode.bind(StepMessages(loads={f"bad{i}": LoadSpec(
                f"bad{i}", RemoteSource(f"bad{i}", "127.0.0.1", s.getsockname()[1], 1, "x", (1,), BS), (1,), (2,))}))
            bed.decode.start_loads()
            bed.decode.clear()
        bed.hold("r1", [3, 7])
        t0 = time.monotonic()
        done, errors = bed.load("r1", [3, 7], [0, 5])
        elapsed = time.monotonic() - t0
        assert done and not errors and elapsed < 2.0, elapsed
        bed.assert_landed([3, 7], [0, 5])
    finally:
        for s in silent:
            s.close()


def test_a_restarted_engine_is_met_again_on_the_next_load(bed_factory, secret_file):
    bed = bed_factory(p_extra={"auth_secret_file": secret_file}, d_extra={"auth_secret_file": secret_file})
    bed.hold("r1", [1, 2])
    assert bed.load("r1", [1, 2], [3, 4]) == (True, set())
    bed.restart_prefill()  # same engine id and address, a new agent with new data
    bed.hold("r2", [5, 6])
    # the old agent's lifeline closed with it: the decode dropped it and meets the new one for this load
    assert bed.load("r2", [5, 6], [7, 8]) == (True, set())
    bed.assert_landed([5, 6], [7, 8])
    bed.hold("r3", [9, 10])
    assert bed.load("r3", [9, 10], [11, 12]) == (True, set())  # met again: the new agent's bytes
    bed.assert_landed([9, 10], [11, 12])


def test_settings_refuse_bad_trust_keys(tmp_path):
    with pytest.raises(SettingsError, match="allowed_peers"):
        from_extra_config({"allowed_peers": ["10.0.0.0/33"]})
    with pytest.raises(SettingsError, match="tls_cert_file"):
        from_extra_config({"tls_cert_file": "a.pem"})
    with pytest.raises(SettingsError, match="must be tuple"):
        from_extra_config({"allowed_peers": "127.0.0.1"})
    assert from_extra_config({}).credential() is None


def test_allowlist_entries():
    a = PeerAllowlist(["10.0.0.0/24", "[::1]:5710", "prefill.svc", "192.168.1.5:80"])
    assert a.allows("x", "10.0.0.200", 1) and not a.allows("x", "10.0.1.1", 1)
    assert a.allows("x", "::1", 5710) and not a.allows("x", "::1", 5711)
    assert a.allows("x", "PREFILL.svc", 9) and not a.allows("x", "prefill.svc.evil", 9)
    assert a.allows("x", "192.168.1.5", 80) and not a.allows("x", "192.168.1.5", 81)
    assert not a.allows("x", "localhost", 5710)  # names are never resolved
    e = PeerAllowlist(["engine:P"])
    assert e.allows("P", "anywhere", 1) and not e.allows("Q", "anywhere", 1)
    assert PeerAllowlist([]).empty and PeerAllowlist([]).allows("any", "1.2.3.4", 5)
    for bad in ("", "engine:", "10.0.0.0/99", "host:0", "host:x", "[::1]x"):
        with pytest.raises(AllowlistError):
            PeerAllowlist([bad])
