"""The handshake server's workers: who is served now, and who gives up its worker when all are
taken (issue 33, finding 7).

A connection that spoke gets a worker thread, at most ``max_connections`` at once and
``max_per_source`` from one address. A slowloris from several addresses (each sending a byte now
and then, each under the per-source cap) could hold every worker until its frame deadline and keep
honest handshakes waiting or failing. So the budget is global: when every worker is taken and a
connection is waiting, the **slowest** connection served for at least ``min_age_s`` (the fewest
bytes received per second since its worker started) is evicted: its worker stops at its next
read (its socket is shut down) and the waiting one takes the worker; waiting connections are
served the most buffered bytes first (a whole frame before a trickle). An honest handshake moves a
few hundred bytes in a millisecond or so; a trickle of bytes never outruns it.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter

__all__ = ["Served", "Workers", "buffered"]


class Served:
    """One connection as its worker reads and writes it (the socket, or the TLS socket over it),
    counting the bytes that arrived. :meth:`evict` shuts the socket down under its worker: its
    read in progress ends at once (end of stream)."""

    def __init__(self, sock: socket.socket, src: str):
        self.sock, self.src = sock, src
        self.fd = sock.fileno()  # the TLS socket that replaces ``sock`` keeps this descriptor
        self.started = time.monotonic()
        self.received = 0
        self.evicted = False

    def settimeout(self, seconds: float) -> None:
        self.sock.settimeout(seconds)

    def recv(self, n: int) -> bytes:
        data = self.sock.recv(n)
        self.received += len(data)
        return data

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def rate(self, now: float) -> float:
        """Bytes received per second since its worker started."""
        return self.received / max(now - self.started, 1e-6)

    def evict(self) -> None:
        """Shut the connection down (both ways) through a duplicate of its descriptor: safe from
        another thread, and the worker's own socket object stays its to close. Called under the
        server's lock, while the worker has not given the connection back (not closed it)."""
        self.evicted = True
        try:
            with socket.socket(fileno=os.dup(self.fd)) as dup:
                dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone


class Workers:
    """Who is served now, by source address (the caller holds its lock around every call)."""

    def __init__(self, max_connections: int, max_per_source: int, min_age_s: float = 0.1):
        self.max, self.max_per_source, self.min_age_s = max_connections, max_per_source, min_age_s
        self.by_source: Counter[str] = Counter()
        self.served: set[Served] = set()

    def full(self) -> bool:
        return len(self.served) >= self.max

    def may_take(self, src: str) -> bool:
        """Whether a connection from ``src`` would get a worker once one is free (per-source cap)."""
        return self.by_source[src] < self.max_per_source

    def take(self, sock: socket.socket, src: str) -> Served:
        s = Served(sock, src)
        self.served.add(s)
        self.by_source[src] += 1
        return s

    def give_back(self, s: Served) -> None:
        if s in self.served:
            self.served.discard(s)
            self.by_source[s.src] -= 1
            if self.by_source[s.src] <= 0:
                del self.by_source[s.src]

    def evict_slowest(self) -> Served | None:
        """Evict the slowest connection served for at least ``min_age_s`` (none evicted yet):
        it gives its worker back once its worker sees it (at its next read)."""
        now = time.monotonic()
        old = [s for s in self.served if not s.evicted and now - s.started >= self.min_age_s]
        if not old:
            return None
        slowest = min(old, key=lambda s: s.rate(now))
        slowest.evict()
        return slowest

    def evicting(self) -> bool:
        """Whether an evicted connection still holds its worker (its worker is about to notice)."""
        return any(s.evicted for s in self.served)


def buffered(sock: socket.socket) -> int:
    """Bytes a non-blocking socket has waiting, up to 4 KiB (peeked: nothing is consumed)."""
    try:
        return len(sock.recv(4096, socket.MSG_PEEK))
    except (BlockingIOError, InterruptedError, OSError):
        return 0
