"""Issue 33, finding 7: a slowloris from several source addresses (127.0.0.2-5, each under the
per-source caps) does not keep honest handshakes out: the server's global worker budget evicts
the slowest served connection when every worker is taken and another waits
(kvtriton.protocol.workers). Real sockets on 127.0.0.x, bounded loops and timeouts."""

from __future__ import annotations

import secrets
import socket
import threading
import time

import pytest

from kvtriton.protocol.auth import Credential
from kvtriton.protocol.handshake import MetadataServer, exchange_metadata

ATTACKERS = [f"127.0.0.{i}" for i in range(2, 6)]
SLOW, QUEUED = 4, 8  # per address: trickling sockets, and more queued behind them


def _loopback_aliases_work() -> bool:
    try:
        with socket.socket() as s:
            s.bind((ATTACKERS[-1], 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _loopback_aliases_work(), reason="no 127.0.0.x source addresses here")


class Slowloris:
    """Every address keeps SLOW + QUEUED sockets open, each sending one byte of a HELLO header
    at a time (a byte every ``every_s``), and reconnects whatever the server closes."""

    def __init__(self, port: int, every_s: float = 0.4):
        self.port, self.every_s = port, every_s
        self.stop = threading.Event()
        self.connects = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _connect(self, src: str) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=1, source_address=(src, 0))
            s.sendall(b"K")
            self.connects += 1
            return s
        except OSError:
            return None

    def _run(self) -> None:
        socks = {(src, i): self._connect(src) for src in ATTACKERS for i in range(SLOW + QUEUED)}
        end = time.monotonic() + 60  # bounded, whatever the test does
        while not self.stop.wait(self.every_s) and time.monotonic() < end:
            for key, s in list(socks.items()):
                try:
                    if s is None:
                        raise OSError
                    s.sendall(b"V")
                except OSError:
                    if s is not None:
                        s.close()
                    socks[key] = self._connect(key[0])
        for s in socks.values():
            if s is not None:
                s.close()

    def __enter__(self) -> Slowloris:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self._thread.join(10)


@pytest.mark.parametrize("with_secret", [True, False])
def test_honest_handshakes_go_through_a_slowloris_from_four_addresses(with_secret):
    # before: 2-3 of 6 honest handshakes failed with PeerDisconnectedError, the others took 2-7 s
    cred = Credential(secret=secrets.token_bytes(32)) if with_secret else None
    smd = b"server-md-" + secrets.token_hex(8).encode()
    with MetadataServer("127.0.0.1", 0, lambda: smd, lambda md: None, credential=cred) as srv, \
            Slowloris(srv.port) as attack:
        time.sleep(1.0)  # every worker is taken by trickling sockets, more are queued
        times, failures = [], []
        for i in range(6):
            t0 = time.monotonic()
            try:
                got = exchange_metadata("127.0.0.1", srv.port, b"honest%d" % i, credential=cred, timeout_s=3,
                                        attempts=1)
                assert got == smd
                times.append(time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001 - counted and reported below
                failures.append(f"{type(e).__name__}: {e}")
            time.sleep(0.2)
        connects = attack.connects
    print(f"honest handshake times (s): {[round(t, 4) for t in times]}; evicted {srv.stats['evicted']}")
    assert not failures, (failures, times)
    assert max(times) < 2.0, times
    assert connects > len(ATTACKERS) * (SLOW + QUEUED)  # the attack kept going (its sockets were evicted)
    assert srv.stats["evicted"] >= 6
