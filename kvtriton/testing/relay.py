"""A TCP relay that only forwards bytes, and keeps a copy of everything it forwarded.

What an attacker without the cluster credential does when a forged ``kv_transfer_params``
points a decode at it (issue 33, finding 1): it listens on its own address, connects each caller
to the real prefill's handshake port, and forwards both ways unchanged. It never needs the secret
for the two real ranks to meet through it; what it can then *use* is whatever it can read in
what it forwarded. :meth:`ByteRelay.frames` parses the recorded streams as handshake frames, the
way such a relay would look for metadata. Nothing here is used by the library itself.

Example
-------
::

    with ByteRelay("127.0.0.1", server.port) as relay:
        exchange_metadata("127.0.0.1", relay.port, md, credential=cred)
    relay.to_server, relay.to_client  # every byte each way
"""

from __future__ import annotations

import socket
import struct
import threading

__all__ = ["ByteRelay"]

_HEADER = struct.Struct(">4sBBI")


class ByteRelay:
    """Listens on ``(host, 0)`` and forwards each connection to ``(target_host, target_port)``.

    ``to_server`` and ``to_client`` hold every byte forwarded each way, over all connections."""

    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1"):
        self._target = (target_host, target_port)
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.1)
        self.port = self._sock.getsockname()[1]
        self.to_server = bytearray()
        self.to_client = bytearray()
        self.connections = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, daemon=True, name=f"relay:{self.port}")
        self._accepter.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self._target, timeout=2)
            except OSError:
                client.close()
                continue
            self.connections += 1
            for src, dst, log in ((client, server, self.to_server), (server, client, self.to_client)):
                th = threading.Thread(target=self._pump, args=(src, dst, log), daemon=True)
                th.start()
                self._threads.append(th)

    def _pump(self, src: socket.socket, dst: socket.socket, log: bytearray) -> None:
        src.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    chunk = src.recv(1 << 16)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                with self._lock:
                    log += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):  # one side closed: close both, as a relay would
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @staticmethod
    def frames(stream: bytes) -> list[tuple[int, bytes]]:
        """The handshake frames (kind, payload) in a recorded stream, as far as it parses."""
        out, i = [], 0
        while i + _HEADER.size <= len(stream):
            magic, _version, kind, length = _HEADER.unpack_from(stream, i)
            if magic != b"KVTH" or i + _HEADER.size + length > len(stream):
                break
            out.append((kind, bytes(stream[i + _HEADER.size:i + _HEADER.size + length])))
            i += _HEADER.size + length
        return out

    def close(self) -> None:
        self._stop.set()
        self._accepter.join(2)
        for th in self._threads:
            th.join(2)
        self._sock.close()

    def __enter__(self) -> ByteRelay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
