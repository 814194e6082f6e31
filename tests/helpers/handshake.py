"""The handshake's frames as a test sees them on the socket, and a listener without the secret."""

import secrets
import socket
import struct
import threading
import time

from kvtriton.protocol.auth import NONCE_BYTES, PROOF_BYTES
from kvtriton.protocol.handshake import VERSION

HEADER = struct.Struct(">4sBBI")


HELLO, CHALLENGE, PROVE = 4, 5, 6


def recv_all(sock: socket.socket, seconds: float = 3.0) -> bytes:
    """Everything the other side sends until it closes (bounded)."""
    out, deadline = bytearray(), time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


def frames_of(data: bytes) -> list[tuple[int, bytes]]:
    """``data`` read as whole handshake frames: (kind, payload) each; a ValueError for bytes that
    are not frames of this version, or a frame cut short."""
    out, at = [], 0
    while at < len(data):
        if len(data) - at < HEADER.size:
            raise ValueError(f"{len(data) - at} trailing bytes, not a frame header: {data[at:]!r}")
        magic, version, kind, length = HEADER.unpack_from(data, at)
        if magic != b"KVTH" or version != VERSION or at + HEADER.size + length > len(data):
            raise ValueError(f"not a whole frame of version {VERSION} at byte {at}: {data[at:at + 64]!r}")
        out.append((kind, data[at + HEADER.size:at + HEADER.size + length]))
        at += HEADER.size + length
    return out


class RogueListener:
    """A listener without the secret: records every byte it receives, answers a HELLO with a
    made-up challenge (what an impostor at a forged address would do)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(1)
                try:
                    self.received += conn.recv(HEADER.size + NONCE_BYTES, socket.MSG_WAITALL)
                    conn.sendall(HEADER.pack(b"KVTH", VERSION, CHALLENGE, NONCE_BYTES + PROOF_BYTES)
                                 + secrets.token_bytes(NONCE_BYTES + PROOF_BYTES))
                    self.received += recv_all(conn, 5.0)
                except OSError:
                    pass

    def close(self):
        self._stop = True
        self.thread.join(2)
        self.sock.close()

