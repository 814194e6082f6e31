"""Engine ids bound to certificates (issue 33: "a shared-secret member can claim an engine id
first"). With one shared secret, members are indistinguishable: whoever holds it may claim any
engine id. With mutual TLS and ``bind_engines=True``, a peer's metadata must claim an engine id
its certificate names as a ``kvtriton:engine/<id>`` URI SAN, checked on both sides of every
meeting, over real sockets (127.0.0.1), certificates made here with ``cryptography``."""

import datetime
import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from test_wire import sample_md  # tests/unit is on sys.path (pytest prepends it)

from kvtriton.errors import AuthenticationError, RequestRejectedError
from kvtriton.protocol import wire
from kvtriton.protocol.auth import ENGINE_URI, Credential, cert_engines
from kvtriton.protocol.handshake import MetadataServer, meet

SECRET = b"s" * 32


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path, key, cert) -> None:
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA and one certificate per member: ``who -> (cert, key)``; each names 127.0.0.1 and
    the engine ids given (none for ``unbound``)."""
    d = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("kvtriton-ca")).issuer_name(_name("kvtriton-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    _write(d / "ca", ca_key, ca)
    out = {"ca": str(d / "ca.pem")}
    for who, engines in (("P", ["P"]), ("D", ["D"]), ("member", ["M"]), ("unbound", []), ("both", ["P", "D"])):
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        sans += [x509.UniformResourceIdentifier(ENGINE_URI + e) for e in engines]
        cert = (x509.CertificateBuilder().subject_name(_name(who)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(d / who, key, cert)
        out[who] = (str(d / f"{who}.pem"), str(d / f"{who}.key"))
    return out


def cred(pki, who: str, *, bind: bool = True, secret: bool = False) -> Credential:
    cert, key = pki[who]
    return Credential(cert_file=cert, key_file=key, ca_file=pki["ca"], bind_engines=bind,
                      secret=SECRET if secret else None)


def md(engine: str) -> bytes:
    return wire.encode_metadata(sample_md(engine=engine, agent=f"{engine}:1:x"))


class Gate:
    def __init__(self):
        self.met: list[str] = []

    def __call__(self, meeting):
        self.met.append(wire.decode_metadata(meeting.metadata).engine)


def serve(pki, who: str, engine: str, gate: Gate, **kw) -> MetadataServer:
    return MetadataServer("127.0.0.1", 0, lambda: md(engine), on_meeting=gate, credential=cred(pki, who, **kw),
                          io_timeout_s=5.0).start()


@pytest.mark.parametrize("secret", [False, True])
def test_bound_engines_meet(pki, secret):
    gate = Gate()
    with serve(pki, "P", "P", gate, secret=secret) as server:
        got = meet("127.0.0.1", server.port, md("D"), credential=cred(pki, "D", secret=secret), timeout_s=5.0)
    assert wire.decode_metadata(got.metadata).engine == "P" and got.keys is not None
    assert gate.met == ["D"]


@pytest.mark.parametrize("secret", [False, True])
def test_a_member_claiming_another_engine_id_is_refused_by_the_server(pki, secret):
    """Before: any member with a CA-signed certificate (or the secret) was admitted as whatever
    engine id its metadata claimed, first come first bound. Now the claim must be in its cert."""
    gate = Gate()
    with serve(pki, "P", "P", gate, secret=secret) as server:
        for who in ("member", "unbound"):
            with pytest.raises(RequestRejectedError, match="claims engine 'D'.*certificate binds"):
                meet("127.0.0.1", server.port, md("D"), credential=cred(pki, who, secret=secret), timeout_s=5.0)
        assert server.stats["refused"] == 2 and gate.met == []  # refused before the gate's owner saw it
        meet("127.0.0.1", server.port, md("D"), credential=cred(pki, "D", secret=secret), timeout_s=5.0)
        meet("127.0.0.1", server.port, md("D"), credential=cred(pki, "both", secret=secret), timeout_s=5.0)
    assert gate.met == ["D", "D"]


def test_a_server_claiming_another_engine_id_is_refused_by_the_client(pki):
    gate = Gate()
    with serve(pki, "member", "P", gate) as server:  # a member's cert, serving as "P"
        with pytest.raises(AuthenticationError, match=r"127.0.0.1:\d+ claims engine 'P'.*binds M"):
            meet("127.0.0.1", server.port, md("D"), credential=cred(pki, "D"), timeout_s=5.0)


def test_without_binding_any_member_claims_any_engine_id(pki):
    """The default (no binding), as documented in docs/security.md: members are trusted with
    their claims; the secret alone cannot tell them apart."""
    gate = Gate()
    with serve(pki, "P", "P", gate, bind=False) as server:
        meet("127.0.0.1", server.port, md("D"), credential=cred(pki, "member", bind=False), timeout_s=5.0)
    assert gate.met == ["D"]


def test_binding_needs_tls_and_reads_only_engine_uris():
    with pytest.raises(AuthenticationError, match="bind_engines.*cert_file"):
        Credential(secret=SECRET, bind_engines=True)
    cert = {"subjectAltName": (("DNS", "kvtriton:engine/X"), ("URI", "kvtriton:engine/A"),
                               ("URI", "https://kvtriton:engine/B"), ("URI", "kvtriton:engine/"),
                               ("URI", "kvtriton:engine/C"))}
    assert cert_engines(cert) == {"A", "C"}
    assert cert_engines(None) == frozenset() and cert_engines({}) == frozenset()


def test_the_connector_setting(pki):
    from kvtriton.integrations.settings import SettingsError, TransferSettings

    cert, key = pki["D"]
    s = TransferSettings.from_mapping({"tls_cert_file": cert, "tls_key_file": key, "tls_ca_file": pki["ca"],
                                       "tls_bind_engines": True})
    assert s.credential().bind_engines
    with pytest.raises(SettingsError, match="tls_bind_engines"):
        TransferSettings.from_mapping({"tls_bind_engines": True})
