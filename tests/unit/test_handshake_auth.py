"""The authenticated, bounded handshake side channel (issue 18), over real sockets on 127.0.0.1.

A rank's metadata opens its registered memory to one-sided NIXL access, so every test here checks
the bytes a party without the credential received: never a byte of the other side's metadata
(each side's metadata carries a random marker the checks look for).
"""

import os
import secrets
import shutil
import socket
import subprocess
import time

import pytest
from helpers.handshake import CHALLENGE, HEADER, HELLO, PROVE, RogueListener, recv_all

from kvtriton.errors import AuthenticationError, KVTritonError, PeerDisconnectedError, RequestRejectedError
from kvtriton.protocol.auth import NONCE_BYTES, PROOF_BYTES, Credential
from kvtriton.protocol.handshake import VERSION, MetadataServer, exchange_metadata, meet


def marker() -> bytes:
    return b"MD-" + secrets.token_hex(16).encode()


class Peer:
    """The server's callback: records the metadata of every caller it was handed."""

    def __init__(self):
        self.got: list[bytes] = []

    def __call__(self, md: bytes):
        self.got.append(md)


def serve(credential, server_md, **kw):
    peer = Peer()
    return MetadataServer("127.0.0.1", 0, lambda: server_md, peer, credential=credential, **kw), peer


@pytest.fixture
def secret_cred():
    return Credential(secret=secrets.token_bytes(32))


# ---------------------------------------------------------------------------------- shared secret
def test_secret_round_trip_and_both_proofs_checked(secret_cred):
    smd, cmd = marker() * 100, marker()
    srv, peer = serve(secret_cred, smd)
    with srv:
        assert exchange_metadata("127.0.0.1", srv.port, cmd, credential=secret_cred, timeout_s=3) == smd
    assert peer.got == [cmd] and srv.stats["served"] == 1


def test_raw_tcp_client_gets_no_metadata_bytes(secret_cred):
    smd = marker()
    srv, peer = serve(secret_cred, smd, first_bytes_timeout_s=0.5)
    with srv:
        # silent: closed at the first-bytes deadline, nothing sent
        with socket.create_connection(("127.0.0.1", srv.port)) as c:
            t0 = time.monotonic()
            assert recv_all(c) == b""
            assert time.monotonic() - t0 < 2.5
        # today's plain request with its metadata: the generic refusal and nothing else
        with socket.create_connection(("127.0.0.1", srv.port)) as c:
            c.sendall(HEADER.pack(b"KVTH", VERSION, 1, 9) + b"client-md")
            got = recv_all(c)
        assert got == HEADER.pack(b"KVTH", VERSION, 3, 7) + b"refused"
        # junk
        with socket.create_connection(("127.0.0.1", srv.port)) as c:
            c.sendall(b"GET / HTTP/1.1\r\n\r\n")
            assert recv_all(c) == b""
    assert peer.got == [] and srv.stats["served"] == 0
    assert srv.stats["unauthenticated"] >= 2


def test_forged_proof_is_refused_generically(secret_cred):
    """A client that sends a HELLO gets a challenge (nonce + the server's proof, never metadata);
    a made-up proof then gets the generic refusal, its metadata never reaches the callback."""
    smd = marker()
    srv, peer = serve(secret_cred, smd)
    with srv, socket.create_connection(("127.0.0.1", srv.port)) as c:
        c.sendall(HEADER.pack(b"KVTH", VERSION, HELLO, NONCE_BYTES) + secrets.token_bytes(NONCE_BYTES))
        c.settimeout(3)
        head = c.recv(HEADER.size, socket.MSG_WAITALL)
        assert HEADER.unpack(head)[2:] == (CHALLENGE, NONCE_BYTES + PROOF_BYTES)
        challenge = c.recv(NONCE_BYTES + PROOF_BYTES, socket.MSG_WAITALL)
        assert smd not in challenge
        forged = secrets.token_bytes(PROOF_BYTES) + b"client-md"
        c.sendall(HEADER.pack(b"KVTH", VERSION, PROVE, len(forged)) + forged)
        assert recv_all(c) == HEADER.pack(b"KVTH", VERSION, 3, 7) + b"refused"
    assert peer.got == [] and srv.stats["unauthenticated"] == 1


def test_wrong_secret_client_is_refused_and_sends_nothing(secret_cred):
    smd, cmd = marker(), marker()
    srv, peer = serve(secret_cred, smd)
    with srv:
        with pytest.raises(AuthenticationError, match="did not prove"):
            exchange_metadata("127.0.0.1", srv.port, cmd, credential=Credential(secret=secrets.token_bytes(32)),
                              timeout_s=3)
        # and a client with no credential at all: refused, generically; it says what it lacks
        with pytest.raises(AuthenticationError, match="credential mismatch: it requires a cluster credential and "
                                                      "we have none"):
            exchange_metadata("127.0.0.1", srv.port, cmd, timeout_s=3, attempts=1)
    assert peer.got == [] and srv.stats["served"] == 0


def test_listener_without_the_secret_never_gets_our_metadata(secret_cred):
    cmd = marker()
    rogue = RogueListener()
    try:
        with pytest.raises(AuthenticationError, match="did not prove the cluster secret"):
            exchange_metadata("127.0.0.1", rogue.port, cmd, credential=secret_cred, timeout_s=2)
    finally:
        rogue.close()
    assert rogue.connections == 1 and cmd not in rogue.received
    # the HELLO (a fresh nonce), then the fixed mismatch notice, and nothing else
    assert len(rogue.received) == HEADER.size + NONCE_BYTES + HEADER.size + len(
        b"credential mismatch: the server's proof does not verify under our secret")
    # a server of this version that has no credential: our HELLO is not its protocol; nothing sent
    plain, peer = serve(None, marker())
    with plain:
        with pytest.raises((PeerDisconnectedError, AuthenticationError)):
            exchange_metadata("127.0.0.1", plain.port, cmd, credential=secret_cred, timeout_s=1, attempts=2,
                              backoff_s=0.01)
    assert peer.got == []


def test_proofs_bind_role_nonces_and_payload(secret_cred):
    cn, sn = secrets.token_bytes(NONCE_BYTES), secrets.token_bytes(NONCE_BYTES)
    p = secret_cred.proof(b"client", cn, sn, b"md")
    assert secret_cred.verify(p, b"client", cn, sn, b"md")
    for other in ((b"server", cn, sn, b"md"), (b"client", sn, cn, b"md"), (b"client", cn, sn, b"md2"),
                  (b"client", secrets.token_bytes(NONCE_BYTES), sn, b"md")):
        assert not secret_cred.verify(p, *other)
    assert not secret_cred.verify(p, b"client", cn, sn, b"md", version=2)
    known = b"k" * 32
    assert "secret=set" in repr(Credential(secret=known)) and "k" * 8 not in repr(Credential(secret=known))


def test_credential_refuses_weak_or_partial_input(tmp_path):
    with pytest.raises(AuthenticationError, match="at least 16 bytes"):
        Credential(secret=b"short")
    with pytest.raises(AuthenticationError, match="together"):
        Credential(cert_file="a.pem")
    with pytest.raises(AuthenticationError, match="cannot read"):
        Credential.from_files(secret_file=str(tmp_path / "missing"))
    f = tmp_path / "secret"
    f.write_bytes(secrets.token_hex(16).encode() + b"\n")
    f.chmod(0o600)
    a, b = Credential.from_files(secret_file=str(f)), Credential(secret=f.read_bytes().strip())
    cn = sn = bytes(NONCE_BYTES)
    assert a.proof(b"client", cn, sn) == b.proof(b"client", cn, sn)  # the trailing newline is not the secret
    assert Credential.from_files() is None


# ---------------------------------------------------------------------------------- bounded server
@pytest.mark.parametrize("with_secret", [False, True])
def test_idle_sockets_do_not_block_honest_handshakes(secret_cred, with_secret):
    cred = secret_cred if with_secret else None
    smd = marker()
    srv, peer = serve(cred, smd, first_bytes_timeout_s=1.0, io_timeout_s=3.0)
    with srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(16)]
        try:
            time.sleep(0.2)
            t0 = time.monotonic()
            ok = 0
            for i in range(5):
                ok += exchange_metadata("127.0.0.1", srv.port, b"honest%d" % i, credential=cred, timeout_s=2,
                                        attempts=1) == smd
            elapsed = time.monotonic() - t0
        finally:
            for s in idle:
                s.close()
    assert ok == 5 and elapsed < 2.0, (ok, elapsed)
    assert peer.got == [b"honest%d" % i for i in range(5)]


def test_per_source_cap_drops_the_oldest_idle_socket(secret_cred):
    srv, _ = serve(secret_cred, marker(), max_pending_per_source=4, first_bytes_timeout_s=5.0)
    with srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(10)]
        try:
            deadline = time.monotonic() + 3
            while srv.stats["turned_away"] < 6 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert srv.stats["turned_away"] == 6  # 10 idle, 4 kept
            # the oldest ones were dropped: they read EOF at once
            idle[0].settimeout(1)
            assert idle[0].recv(1) == b""
            assert exchange_metadata("127.0.0.1", srv.port, b"x", credential=secret_cred, timeout_s=2, attempts=1)
        finally:
            for s in idle:
                s.close()


def test_a_slow_caller_does_not_delay_another(secret_cred):
    """A caller that sent one byte holds a worker only until its first-bytes deadline, and never
    the others' (each connection has its own thread)."""
    srv, _ = serve(secret_cred, b"md", first_bytes_timeout_s=1.5)
    with srv:
        slow = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
        try:
            for s in slow:
                s.sendall(b"K")
            time.sleep(0.1)
            t0 = time.monotonic()
            assert exchange_metadata("127.0.0.1", srv.port, b"x", credential=secret_cred, timeout_s=2,
                                     attempts=1) == b"md"
            assert time.monotonic() - t0 < 1.0
        finally:
            for s in slow:
                s.close()


# ---------------------------------------------------------------------------------- mutual TLS
def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _issue(d, ca: str, name: str):
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                               "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", "ext.cnf", cwd=d)
    return str(d / f"{name}.pem"), str(d / f"{name}.key")


def _ca(d, name: str):
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    return str(d / f"{name}.pem")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        raise RuntimeError("the mutual TLS tests need the openssl CLI to make their certificates")
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = _ca(d, "cluster-ca"), _ca(d, "other-ca")
    return {"ca": ca, "other_ca": other_ca, "server": _issue(d, "cluster-ca", "server"),
            "client": _issue(d, "cluster-ca", "client"), "stranger": _issue(d, "other-ca", "stranger")}


def tls(pki, who: str, ca: str = "ca", secret: bytes | None = None) -> Credential:
    cert, key = pki[who]
    return Credential(cert_file=cert, key_file=key, ca_file=pki[ca], secret=secret)


@pytest.mark.parametrize("with_secret", [False, True])
def test_mutual_tls_round_trip(pki, with_secret):
    secret = secrets.token_bytes(32) if with_secret else None
    smd, cmd = marker(), marker()
    srv, peer = serve(tls(pki, "server", secret=secret), smd)
    with srv:
        assert exchange_metadata("127.0.0.1", srv.port, cmd, credential=tls(pki, "client", secret=secret),
                                 timeout_s=3) == smd
    assert peer.got == [cmd]


@pytest.mark.parametrize("with_secret", [False, True])
def test_mutual_tls_meetings_give_the_pair_mirrored_message_keys(pki, with_secret):
    # issue 33, finding 3: TLS alone gives pair keys too (a seed sent inside TLS), so the
    # control messages are sealed there as well; each meeting its own
    secret = secrets.token_bytes(32) if with_secret else None
    met = []
    with MetadataServer("127.0.0.1", 0, marker, on_meeting=met.append, credential=tls(pki, "server", secret=secret)) \
            as srv:
        first = meet("127.0.0.1", srv.port, marker(), credential=tls(pki, "client", secret=secret), timeout_s=3)
        second = meet("127.0.0.1", srv.port, marker(), credential=tls(pki, "client", secret=secret), timeout_s=3)
    for mine, theirs in ((first, met[0]), (second, met[1])):
        assert mine.keys is not None and theirs.keys is not None
        assert (mine.keys.send, mine.keys.recv) == (theirs.keys.recv, theirs.keys.send)
        assert mine.keys.dialled and not theirs.keys.dialled
    assert first.keys.send != second.keys.send  # type: ignore[union-attr]


def test_a_secret_on_one_side_of_mutual_tls_is_a_mismatch_on_both_sides(pki):
    """Both sides pass TLS; only one holds the secret: each side says credential mismatch."""
    secret = secrets.token_bytes(32)
    for server_secret, client_secret, text in ((secret, None, "requires a shared secret and we have none"),
                                               (None, secret, "it has no shared secret and we have one")):
        srv, peer = serve(tls(pki, "server", secret=server_secret), marker())
        with srv:
            with pytest.raises(AuthenticationError, match=f"credential mismatch: .*{text}"):
                exchange_metadata("127.0.0.1", srv.port, marker(), credential=tls(pki, "client", secret=client_secret),
                                  timeout_s=3, attempts=1)
            deadline = time.monotonic() + 2  # the server counts after it answered
            while srv.stats["mismatch"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert peer.got == [] and srv.stats["mismatch"] == 1


def test_mutual_tls_refuses_a_client_of_another_ca_or_none(pki):
    srv, peer = serve(tls(pki, "server"), marker())
    with srv:
        # its certificate is not the cluster's: the server ends TLS before any frame
        with pytest.raises(AuthenticationError):
            exchange_metadata("127.0.0.1", srv.port, marker(), credential=tls(pki, "stranger", ca="ca"),
                              timeout_s=2, attempts=1)
        # no TLS at all: a plain request is not even read as a frame
        with pytest.raises((PeerDisconnectedError, KVTritonError)):
            exchange_metadata("127.0.0.1", srv.port, marker(), timeout_s=2, attempts=1)
    assert peer.got == [] and srv.stats["served"] == 0


def test_mutual_tls_client_refuses_a_server_of_another_ca(pki):
    srv, peer = serve(tls(pki, "stranger", ca="ca"), marker())
    with srv:
        with pytest.raises(AuthenticationError, match="do not trust"):
            exchange_metadata("127.0.0.1", srv.port, marker(), credential=tls(pki, "client"), timeout_s=2)
    assert peer.got == []


def test_gate_refusal_reaches_an_authenticated_caller(secret_cred):
    def refuse(md):
        raise RequestRejectedError("region 3: dtype differs")

    with MetadataServer("127.0.0.1", 0, lambda: b"md", refuse, credential=secret_cred) as srv:
        with pytest.raises(RequestRejectedError, match="dtype differs"):
            exchange_metadata("127.0.0.1", srv.port, b"x", credential=secret_cred, timeout_s=2)


def test_handshake_latency_figure(secret_cred, pki):
    """Prints the median handshake time without a credential, with the secret, with mutual TLS
    (a figure, not a bound: each must finish well within its deadline)."""
    rows = {}
    for name, scred, ccred in (("none", None, None), ("secret", secret_cred, secret_cred),
                               ("mtls", tls(pki, "server"), tls(pki, "client"))):
        srv, _ = serve(scred, b"m" * 2048)
        with srv:
            times = []
            for _ in range(int(os.environ.get("KVTRITON_HS_LOOPS", "30"))):
                t0 = time.perf_counter()
                exchange_metadata("127.0.0.1", srv.port, b"c" * 2048, credential=ccred, timeout_s=3, attempts=1)
                times.append(time.perf_counter() - t0)
        times.sort()
        rows[name] = 1e3 * times[len(times) // 2]
        assert rows[name] < 1000
    print("handshake median ms:", {k: round(v, 2) for k, v in rows.items()})
