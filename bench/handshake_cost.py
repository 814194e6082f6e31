"""What a handshake costs: one metadata exchange over TCP on 127.0.0.1, client and server in this
process, for each credential mode:

* ``none``: the plain exchange (REQUEST, OK);
* ``secret``: the shared secret's challenge-response (with handshake version 2: the session keys
  derived with HKDF and both metadata sealed with ChaCha20-Poly1305);
* ``mtls``: mutual TLS alone (needs the ``openssl`` CLI to make a throwaway CA);
* ``mtls+secret``: both.

Each handshake opens a new connection (as a decode meeting a prefill rank does) and carries
``--md-bytes`` of metadata each way (a model's metadata is tens of KiB). Timed from the connect to
the returned metadata; p50 (p20-p80) over ``--reps``, after ``--warmup`` untimed ones. The modes
are interleaved rep by rep. Runs against whichever kvtriton sits in the repository above this file
(so the same script times an older checkout).

Run alone: ``python bench/handshake_cost.py [--reps 200] [--md-bytes 32768]``.
"""

from __future__ import annotations

if not __package__:  # `python bench/handshake_cost.py`: run as `python -m bench.handshake_cost` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import argparse
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kvtriton.protocol.auth import Credential
from kvtriton.protocol.handshake import MetadataServer, exchange_metadata


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _pki(d: Path) -> dict[str, tuple[str, str]] | None:
    """A throwaway CA and a server and a client certificate for 127.0.0.1 (None: no openssl)."""
    if shutil.which("openssl") is None:
        return None
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=ca",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                               "extendedKeyUsage=serverAuth,clientAuth\n")
    out = {}
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", "ext.cnf", cwd=d)
        out[name] = (str(d / f"{name}.pem"), str(d / f"{name}.key"))
    out["ca"] = (str(d / "ca.pem"), "")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--md-bytes", type=int, default=32 << 10)
    args = ap.parse_args()
    secret = secrets.token_bytes(32)
    modes: dict[str, tuple[Credential | None, Credential | None]] = {
        "none": (None, None),
        "secret": (Credential(secret=secret), Credential(secret=secret)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        pki = _pki(Path(tmp))
        if pki is not None:
            ca = pki["ca"][0]

            def tls(who: str, with_secret: bool) -> Credential:
                return Credential(cert_file=pki[who][0], key_file=pki[who][1], ca_file=ca,
                                  secret=secret if with_secret else None)

            modes["mtls"] = (tls("server", False), tls("client", False))
            modes["mtls+secret"] = (tls("server", True), tls("client", True))
        server_md, client_md = secrets.token_bytes(args.md_bytes), secrets.token_bytes(args.md_bytes)
        servers = {name: MetadataServer("127.0.0.1", 0, lambda: server_md, lambda md: None, credential=s,
                                        max_connections=4).start()
                   for name, (s, _c) in modes.items()}
        times: dict[str, list[float]] = {name: [] for name in modes}
        try:
            for rep in range(args.warmup + args.reps):
                for name, (_s, c) in modes.items():
                    t0 = time.perf_counter()
                    got = exchange_metadata("127.0.0.1", servers[name].port, client_md, credential=c, timeout_s=5,
                                            attempts=1)
                    dt = time.perf_counter() - t0
                    assert got == server_md
                    if rep >= args.warmup:
                        times[name].append(dt)
        finally:
            for srv in servers.values():
                srv.close()
    def q(ts: list[float], f: float) -> float:
        return 1e3 * sorted(ts)[int(f * (len(ts) - 1))]

    base = q(times["none"], 0.5)
    print(f"handshake over 127.0.0.1, {args.md_bytes} B of metadata each way, {args.reps} reps "
          f"(git {_git()}):")
    print(f"{'mode':<12} {'ms p50':>8} {'p20':>8} {'p80':>8} {'/ none':>7}")
    for name, ts in times.items():
        print(f"{name:<12} {q(ts, 0.5):8.3f} {q(ts, 0.2):8.3f} {q(ts, 0.8):8.3f} {q(ts, 0.5) / base:6.2f}x")
    _crypto(secret, client_md, args.reps)


def _crypto(secret: bytes, md: bytes, reps: int) -> None:
    """The session keys and the seals alone, one side's share (handshake version 2 only)."""
    try:
        from kvtriton.protocol.auth import seal, unseal
    except ImportError:
        return  # an older checkout: no session keys
    cred, nonce = Credential(secret=secret), secrets.token_bytes(32)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        keys = cred.session_keys(True, nonce, nonce, b"transcript", 2)
        unseal(keys.seal_send, seal(keys.seal_send, md, b"l"), b"l")
        ts.append(time.perf_counter() - t0)
    ts.sort()
    print(f"of which HKDF + one seal and one open of {len(md)} B: {1e6 * ts[len(ts) // 2]:.0f} us p50")


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


if __name__ == "__main__":
    main()
