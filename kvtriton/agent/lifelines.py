"""Lifelines: a peer's death known at once, from the connection its meeting was made over.

A meeting (:mod:`kvtriton.protocol.handshake`) may leave its TCP connection open
(``meet(..., keep=True)`` against a server with ``on_kept``): the *lifeline* of that pair of
ranks. Nothing travels on it. When either process dies (SIGKILL, a crash, ``close``), its kernel
closes the socket and the other side reads EOF or a reset at once: that is the death signal, with
no heartbeat of ours and nothing sent while idle. A host that vanishes without closing anything is
found by TCP keepalive (:data:`KEEPALIVE`: a few seconds, one empty probe per idle period), and
else by the peer table's expiry (:mod:`.peers`).

Trust: a lifeline is entered only for a peer in the table, by the connection that carried its
meeting (authenticated when a credential is configured), and only its own closure counts: a
stranger cannot make us think a peer died, short of tearing down that TCP connection on path
(docs/security.md). One lifeline per peer identity (engine, rank): a second one for the same
agent is closed unused (the first stays: both sides keep the older one), one for a new agent
(a restart) replaces the old. Bounded: at most ``limit`` lifelines; past it those whose agent
left the table are closed first (see :meth:`Lifelines.prune`).

:class:`Lifelines` watches them on a thread of its own that sleeps in ``select`` and only
records closures; the agent's ``progress()`` takes them (:meth:`Lifelines.lost`) and drops
those peers.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import ssl
import threading
from collections import deque
from collections.abc import Callable
from typing import cast

__all__ = ["KEEPALIVE", "Lifelines"]

logger = logging.getLogger("kvtriton.agent")

#: TCP keepalive of a lifeline (seconds idle before the first probe, between probes, probes):
#: a host gone without a FIN or reset is known within about ``idle + interval * count`` seconds
KEEPALIVE = (2, 1, 2)
_READ = 4096  # bytes read from a readable lifeline (EOF, a reset, or a peer breaking the protocol)

Key = tuple[str, int]


def _keepalive(conn: socket.socket) -> None:
    idle, interval, count = KEEPALIVE
    with contextlib.suppress(OSError, AttributeError):  # best effort: not every platform has them
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)


class Lifelines:
    """The lifelines of one rank's peers, by peer identity (see the module docstring)."""

    def __init__(self, name: str, limit: int):
        self.name, self.limit = name, int(limit)
        self._lock = threading.Lock()
        self._by_key: dict[Key, tuple[str, socket.socket]] = {}
        self._adds: list[tuple[Key, str, socket.socket]] = []  # to register on the watcher's thread
        self._drops: list[socket.socket] = []  # to unregister and close there
        self._lost: deque[tuple[Key, str]] = deque()  # closed by the peer's side: (identity, agent)
        self._sel: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._by_key)

    def watch(self, key: Key, agent: str, conn: socket.socket) -> bool:
        """Watch ``conn`` as the lifeline of peer ``key`` (engine, rank) whose agent is ``agent``;
        False when it was closed unused instead (this agent has one already, or we are closed)."""
        with self._lock:
            old = self._by_key.get(key)
            if self._closed or (old is not None and old[0] == agent):
                conn.close()
                return False
            if old is not None:  # a restart's lifeline replaces its old agent's
                self._drops.append(old[1])
            conn.setblocking(False)
            _keepalive(conn)
            self._by_key[key] = (agent, conn)
            self._adds.append((key, agent, conn))
            self._start()
        self._wake()
        return True

    def lost(self) -> list[tuple[Key, str]]:
        """The lifelines the peer's side closed since the last call: ``(identity, agent)``."""
        out = []
        while self._lost:
            out.append(self._lost.popleft())
        return out

    def release(self, key: Key) -> None:
        """Close peer ``key``'s lifeline from this side (this rank forgot that peer: it reads EOF
        and drops this rank in turn); not reported by :meth:`lost`."""
        with self._lock:
            mine = self._by_key.pop(key, None)
            if mine is not None:
                self._drops.append(mine[1])
        self._wake()

    def prune(self, live: Callable[[Key, str], bool]) -> None:
        """Past ``limit`` lifelines, close those whose peer is not ``live`` (dropped from the
        table: expired or replaced while its process still runs), oldest first."""
        with self._lock:
            extra = len(self._by_key) - self.limit
            for key in [k for k, (agent, _) in self._by_key.items() if not live(k, agent)][:max(extra, 0)]:
                self._drops.append(self._by_key.pop(key)[1])
        self._wake()

    def close(self) -> None:
        """Close every lifeline (the peers read EOF: this rank is gone) and stop the watcher."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        self._wake()
        if thread is not None:
            thread.join(timeout=2)
        with self._lock:
            for _, conn in self._by_key.values():
                conn.close()
            for conn in self._drops:
                conn.close()
            self._by_key.clear()
            self._adds.clear()
            self._drops.clear()
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        if self._sel is not None:
            self._sel.close()

    # ------------------------------------------------------------------ the watcher thread
    def _start(self) -> None:  # under the lock
        if self._thread is not None:
            return
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._watch, args=(self._sel, self._wake_r), daemon=True,
                                        name=f"kvtriton-lifelines-{self.name}")
        self._thread.start()

    def _wake(self) -> None:
        w = self._wake_w
        if w is not None:
            with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
                w.send(b"\0")

    def _watch(self, sel: selectors.BaseSelector, wake: socket.socket) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                adds, self._adds = self._adds, []
                drops, self._drops = self._drops, []
            for conn in drops:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    sel.unregister(conn)
                conn.close()
            for key, agent, conn in adds:
                if conn.fileno() >= 0:
                    sel.register(conn, selectors.EVENT_READ, (key, agent))
            for sk, _ in sel.select(timeout=None):
                if sk.data is None:
                    with contextlib.suppress(OSError):
                        wake.recv(_READ)
                    continue
                conn = cast(socket.socket, sk.fileobj)  # registered as one above
                if self._open(conn):
                    continue
                key, agent = sk.data
                with contextlib.suppress(KeyError, ValueError, OSError):
                    sel.unregister(conn)
                conn.close()
                with self._lock:
                    mine = self._by_key.get(key)
                    if mine is not None and mine[1] is conn:
                        del self._by_key[key]
                        self._lost.append((key, agent))

    @staticmethod
    def _open(conn: socket.socket) -> bool:
        """Whether ``conn``, readable now, is still a lifeline. Nothing travels on one: a peer that
        writes to it breaks the protocol and is taken as gone (only its own transfers fail), rather
        than keeping this thread busy reading whatever it sends."""
        try:
            conn.recv(_READ)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return True  # TLS records with no data (e.g. a session ticket): still open
        except OSError:
            return False
        return False  # EOF, or bytes a peer should not have written
