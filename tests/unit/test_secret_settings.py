"""Issue 33, finding 10: an operator's credential mistakes fail at start, named, or are reported as
what they are on both sides of a handshake (real sockets on 127.0.0.1)."""

import logging
import secrets
import time

import pytest

from kvtriton.errors import AuthenticationError, KVTritonError
from kvtriton.integrations.vllm.settings import from_extra_config
from kvtriton.protocol.auth import Credential
from kvtriton.protocol.handshake import MetadataServer, exchange_metadata


def write_secret(tmp_path, mode=0o600, data=None):
    f = tmp_path / "secret"
    f.write_bytes(secrets.token_hex(32).encode() if data is None else data)
    f.chmod(mode)
    return str(f)


def test_empty_secret_path_is_an_error_naming_the_setting(tmp_path, monkeypatch):
    with pytest.raises(AuthenticationError, match="auth_secret_file is set but empty"):
        Credential.from_files(secret_file="", setting="auth_secret_file")
    with pytest.raises(KVTritonError, match=r"\['auth_secret_file'\] is set but empty"):
        from_extra_config({"auth_secret_file": ""})
    monkeypatch.setenv("KVTRITON_AUTH_SECRET_FILE", "")
    with pytest.raises(KVTritonError, match="KVTRITON_AUTH_SECRET_FILE is set but empty"):
        from_extra_config({})
    monkeypatch.delenv("KVTRITON_AUTH_SECRET_FILE")
    assert from_extra_config({}).credential() is None  # unset: no credential, as before


def test_empty_secret_value_is_an_error_naming_the_file(tmp_path):
    path = write_secret(tmp_path, data=b"\n")
    with pytest.raises(AuthenticationError, match=r"auth_secret_file.*is empty"):
        from_extra_config({"auth_secret_file": path}).credential()


def test_secret_file_readable_by_others_is_refused_unless_allowed(tmp_path, caplog):
    path = write_secret(tmp_path, mode=0o644)
    with pytest.raises(AuthenticationError, match="readable or writable by group or others"):
        Credential.from_files(secret_file=path)
    with pytest.raises(AuthenticationError, match=r"auth_secret_file.*mode 644"):
        from_extra_config({"auth_secret_file": path}).credential()
    with caplog.at_level(logging.WARNING):
        cred = from_extra_config({"auth_secret_file": path,
                                                    "auth_secret_strict_modes": False}).credential()
    assert cred is not None and cred.has_secret and "readable by group or others" in caplog.text
    assert Credential.from_files(secret_file=write_secret(tmp_path, mode=0o600)) is not None


def mismatches(srv: MetadataServer, want: int = 1, within_s: float = 2.0) -> int:
    """The server's mismatch count once it reaches ``want`` (its worker counts after it answered)."""
    deadline = time.monotonic() + within_s
    while srv.stats["mismatch"] < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return srv.stats["mismatch"]


@pytest.fixture
def cred():
    return Credential(secret=secrets.token_bytes(32))


def test_a_secret_on_the_client_only_is_a_mismatch_on_both_sides(cred):
    got = []
    with MetadataServer("127.0.0.1", 0, lambda: b"server-md", got.append) as srv:
        with pytest.raises(AuthenticationError, match="credential mismatch: it has no shared secret"):
            exchange_metadata("127.0.0.1", srv.port, b"client-md", credential=cred, timeout_s=2, attempts=1)
    assert got == [] and mismatches(srv) == 1


def test_a_secret_on_the_server_only_is_a_mismatch_on_both_sides(cred):
    got = []
    with MetadataServer("127.0.0.1", 0, lambda: b"server-md", got.append, credential=cred) as srv:
        with pytest.raises(AuthenticationError) as e:
            exchange_metadata("127.0.0.1", srv.port, b"client-md", timeout_s=2, attempts=1)
    # the client has no credential: it is told what it lacks, never that its credential was refused
    assert "credential mismatch" in str(e.value) and "we have none" in str(e.value)
    assert "did not accept our credential" not in str(e.value)
    assert got == [] and mismatches(srv) == 1


def test_two_different_secrets_are_a_mismatch_on_both_sides(cred):
    got = []
    with MetadataServer("127.0.0.1", 0, lambda: b"server-md", got.append, credential=cred) as srv:
        with pytest.raises(AuthenticationError, match="credential mismatch"):
            other = Credential(secret=secrets.token_bytes(32))
            exchange_metadata("127.0.0.1", srv.port, b"client-md", credential=other, timeout_s=2, attempts=1)
    assert got == [] and mismatches(srv) == 1
