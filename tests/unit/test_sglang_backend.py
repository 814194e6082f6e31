"""The SGLang backend's pieces that need no SGLang: settings and the ZMQ messages' checks."""

import json

import numpy as np
import pytest

from kvtriton.errors import ProtocolError
from kvtriton.integrations.sglang.messages import READY_TAG, Abort, Ready, Want
from kvtriton.integrations.sglang.settings import ENV, BackendSettings, SettingsError


def test_settings_defaults_and_ports():
    s = BackendSettings.from_env({})
    assert s.handshake_port_offset == 1 and s.agent.credential() is None
    assert s.handshake_port(8998, 0) == 8999 and s.handshake_port(8998, 2) == 9001


@pytest.mark.parametrize("values, says", [
    ({"no_such_key": 1}, "unknown keys"),
    ({"host": "10.0.0.1"}, "decided by SGLang"),
    ({"kv_cache_layout": "LBHNC"}, "decided by SGLang"),
    ({"handshake_port_offset": 0}, "handshake_port_offset"),
    ({"handshake_port_offset": True}, "handshake_port_offset"),
    ({"timeout_s": -1}, "timeout_s"),
])
def test_settings_refused(values, says):
    with pytest.raises(SettingsError, match=says) as e:
        BackendSettings.from_mapping(values)
    assert "kv_connector_extra_config" not in str(e.value)


def test_settings_from_env_json_and_file(tmp_path):
    cfg = {"timeout_s": 5.0, "handshake_port_offset": 7}
    assert BackendSettings.from_env({ENV: json.dumps(cfg)}).handshake_port(100, 1) == 108
    f = tmp_path / "cfg.json"
    f.write_text(json.dumps(cfg))
    assert BackendSettings.from_env({ENV: f"@{f}"}).agent.timeout_s == 5.0
    with pytest.raises(SettingsError, match="JSON"):
        BackendSettings.from_env({ENV: "{not json"})
    with pytest.raises(SettingsError, match="cannot be read"):
        BackendSettings.from_env({ENV: f"@{tmp_path / 'missing.json'}"})


def test_settings_secret_from_environment(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)  # a secret file others can read is refused
    import os

    old = os.environ.get("KVTRITON_AUTH_SECRET_FILE")
    os.environ["KVTRITON_AUTH_SECRET_FILE"] = str(secret)
    try:
        assert BackendSettings.from_env({}).agent.credential() is not None
    finally:
        if old is None:
            del os.environ["KVTRITON_AUTH_SECRET_FILE"]
        else:
            os.environ["KVTRITON_AUTH_SECRET_FILE"] = old


def test_messages_round_trip():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1000, size=9)
    rows = (rng.integers(0, 256, 16, dtype=np.uint8).tobytes(), rng.integers(0, 256, 40, dtype=np.uint8).tobytes())
    r = Ready.from_zmq(Ready(2**63 + 5, "sglang-prefill@h:1", 1, ids, rows).to_zmq(), [16, 40])
    assert r.room == 2**63 + 5 and r.rank == 1 and np.array_equal(r.page_ids, ids) and r.aux_rows == rows
    w = Want(7, "sglang-decode@h:2", 2, "127.0.0.1", 5555, 3)
    assert Want.from_zmq(w.to_zmq()) == w


@pytest.mark.parametrize("mutate, says", [
    (lambda m: m[:-1], "frames"),
    (lambda m: m[:4] + [m[4][:-3]] + m[5:], "multiple of 8"),
    (lambda m: m[:5] + [m[5] + b"x"], "metadata row 0"),
    (lambda m: m[:4] + [np.array([-1], "<i8").tobytes()] + m[5:], "negative"),
    (lambda m: [m[0], b"room"] + m[2:], "integer"),
    (lambda m: m[:2] + [b"\xff"] + m[3:], "ASCII"),
])
def test_ready_refused(mutate, says):
    good = Ready(1, "e", 0, np.arange(3), (b"a" * 8,)).to_zmq()
    assert good[0] == READY_TAG
    Ready.from_zmq(good, [8])  # the unmutated message parses: the checks below are what refuses
    with pytest.raises(ProtocolError, match=says):
        Ready.from_zmq(mutate(list(good)), [8])


def test_want_refused():
    good = Want(1, "e", 0, "127.0.0.1", 5, 0).to_zmq()
    for bad in (good[:-1], good[:5] + [b"0"] + good[6:], good[:3] + [b"-1"] + good[4:]):
        with pytest.raises(ProtocolError):
            Want.from_zmq(bad)


def test_abort_round_trip_and_refused():
    a = Abort(2**64 - 1, "sglang-decode@h:2", 3)
    assert Abort.from_zmq(a.to_zmq()) == a
    good = a.to_zmq()
    for bad in (good[:-1], [b"ABORT", *good[1:]], good[:1] + [b"x"] + good[2:], good[:3] + [b"70000"]):
        with pytest.raises(ProtocolError):
            Abort.from_zmq(bad)


def test_hybrid_state_pools_are_refused_naming_what_is_missing():
    """SGLang's hybrid pools (issue 32): the backend's refusal says, per state type, what it would
    need, and where hybrid models do move (vLLM's connector)."""
    from kvtriton.integrations.sglang.settings import hybrid_missing

    said = hybrid_missing(["mamba", "swa", "mamba", "qsa_pending"])
    assert said.count("mamba:") == 1 and "conv sub-projections" in said and "SSM state by heads" in said
    assert "swa: a sliding-window pool" in said and "qsa_pending: a state pool kvtriton has no region for" in said
    assert "docs/vllm.md" in said
