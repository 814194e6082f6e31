"""Issue 33, finding 8: before authentication, a handshake frame is capped by its kind from its
header (a HELLO is 32 bytes; nobody's 16 MiB is read first), and every frame must arrive whole
within its deadline (real sockets on 127.0.0.1)."""

import secrets
import socket
import struct
import threading
import time

import pytest

from kvtriton.errors import AuthenticationError
from kvtriton.protocol.auth import NONCE_BYTES, Credential
from kvtriton.protocol.handshake import VERSION, MetadataServer, exchange_metadata

HEADER = struct.Struct(">4sBBI")
REQUEST, HELLO, CHALLENGE = 1, 4, 5


def answer_within(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
    """What the server sends until it closes, and when it closed (inf: still open at ``seconds``)."""
    out, t0 = bytearray(), time.monotonic()
    sock.settimeout(seconds)
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            return bytes(out), float("inf")
        except ConnectionResetError:
            return bytes(out), time.monotonic() - t0
        if not chunk:
            return bytes(out), time.monotonic() - t0
        out += chunk


@pytest.fixture
def server():
    got = []
    cred = Credential(secret=secrets.token_bytes(32))
    srv = MetadataServer("127.0.0.1", 0, lambda: b"server-md", got.append, credential=cred, io_timeout_s=4.0,
                         first_bytes_timeout_s=1.0, frame_timeout_s=0.5)
    with srv:
        yield srv, got, cred


@pytest.mark.parametrize("kind, length", [(HELLO, 16 << 20), (HELLO, NONCE_BYTES + 1), (REQUEST, 1 << 20)])
def test_an_oversized_first_frame_is_refused_from_its_header(server, kind, length):
    srv, got, cred = server
    with socket.create_connection(("127.0.0.1", srv.port)) as c:
        c.sendall(HEADER.pack(b"KVTH", VERSION, kind, length))  # the header only: no body follows
        reply, closed = answer_within(c, 2.0)
    # refused at once (the generic refusal), not after waiting for a body it will never read
    assert closed < 0.5 and reply == HEADER.pack(b"KVTH", VERSION, 3, 7) + b"refused"
    assert got == [] and srv.stats["served"] == 0


def test_a_trickled_hello_is_dropped_at_the_frame_deadline(server):
    srv, got, cred = server
    with socket.create_connection(("127.0.0.1", srv.port)) as c:
        c.sendall(HEADER.pack(b"KVTH", VERSION, HELLO, NONCE_BYTES))
        t0 = time.monotonic()
        try:
            for b in secrets.token_bytes(NONCE_BYTES):  # 32 bytes over ~1.6 s: within io_timeout_s
                c.sendall(bytes([b]))
                time.sleep(0.05)
        except OSError:
            pass  # the server gave up on us
        reply, _ = answer_within(c, 1.0)
        assert time.monotonic() - t0 < 3.0
    assert not reply.startswith(HEADER.pack(b"KVTH", VERSION, CHALLENGE, 64))  # never challenged
    assert srv.stats["served"] == 0 and srv.stats["failed"] + srv.stats["unauthenticated"] == 1
    # an honest client is served as before
    assert exchange_metadata("127.0.0.1", srv.port, b"client-md", credential=cred, timeout_s=2) \
        == b"server-md"


def test_a_client_refuses_an_oversized_challenge_from_its_header():
    """A listener that answers our HELLO with a 16 MiB 'challenge' is refused from the header:
    we neither wait for nor read its body."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def rogue():
        conn, _ = lsock.accept()
        with conn:
            conn.recv(HEADER.size + NONCE_BYTES, socket.MSG_WAITALL)
            conn.sendall(HEADER.pack(b"KVTH", VERSION, CHALLENGE, 16 << 20))
            time.sleep(3)

    th = threading.Thread(target=rogue, daemon=True)
    th.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(AuthenticationError, match="did not answer the credential challenge"):
            exchange_metadata("127.0.0.1", lsock.getsockname()[1], b"client-md",
                              credential=Credential(secret=secrets.token_bytes(32)), timeout_s=2.5, attempts=1)
        assert time.monotonic() - t0 < 1.0
    finally:
        lsock.close()


def test_a_passed_deadline_still_takes_a_frame_already_buffered():
    """A process frozen past its deadline (a starved host) wakes to find the peer's frame waiting:
    the deadline judges the peer, so a buffered frame is read, and a frame still to come is not
    waited for (TimeoutError at once). Writing past the deadline goes as far as the socket takes
    without waiting."""
    from kvtriton.protocol.frames import read_frame, write_frame

    a, b = socket.socketpair()
    with a, b:
        past = time.monotonic() - 10.0
        nonce = secrets.token_bytes(NONCE_BYTES)
        assert write_frame(b, HELLO, nonce, past) == HEADER.pack(b"KVTH", VERSION, HELLO, NONCE_BYTES) + nonce
        assert read_frame(a, past, {HELLO: NONCE_BYTES}) == (HELLO, nonce)
        b.sendall(HEADER.pack(b"KVTH", VERSION, HELLO, NONCE_BYTES) + nonce[:5])  # a frame cut short
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            read_frame(a, past, {HELLO: NONCE_BYTES})
        with pytest.raises(TimeoutError):  # nothing there at all
            read_frame(a, past, {HELLO: NONCE_BYTES})
        assert time.monotonic() - t0 < 1.0
