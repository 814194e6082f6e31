"""One agent child process: a command loop over a pipe, and the parent's handle on it.

A child process owns one or more :class:`~kvtriton.agent.TransferAgent` s (a prefill or decode
rank of :mod:`kvtriton.testing.cluster`, the prefill side of a benchmark) and answers short
commands from its parent. What the commands are is the caller's: a ``{command: handler}`` table,
each handler called with the message's arguments. The loop is this module's:

* the child says ``("ready", info)`` once it is built (:meth:`AgentChild.ready`: e.g. the
  agents' metadata), then answers every ``(command, *args)`` with ``("ok", handler(*args))``, or
  ``("err", "ErrorType: message")`` when the handler raised one of ``errors`` (default
  :class:`~kvtriton.errors.KVTritonError`) or the command is unknown; ``("exit",)`` is answered
  and ends the loop, and so does the parent closing the pipe;
* between messages it runs ``step()`` (default: ``progress()`` every agent), waiting at most
  ``idle_wait_s`` for the next message while nothing is busy and not at all while something is;
* whatever happens, every agent and the pipe are closed when the loop ends.

:class:`ChildProcess` is the parent's side: it spawns ``target(conn, *args)`` (``target`` builds
its agents and an :class:`AgentChild`), waits for ``ready``, makes calls with timeouts (a child
that died or went silent raises at once, never hangs the parent) and always stops the process.

Example (the child's target must be importable: ``spawn`` starts a fresh interpreter)::

    def prefill(conn, regions_seed):
        agent = TransferAgent("P", 0, 1, make_regions(regions_seed))
        child = AgentChild(conn, [agent], {"add_remote": agent.add_remote,
                                           "hold": lambda req, ids: agent.hold(req, ids)})
        child.ready(agent.metadata())
        child.run()

    with ChildProcess(prefill, 7, name="P0") as p:
        decode.add_remote(p.ready(timeout_s=60))
        p.call("add_remote", decode.metadata())
        p.call("hold", "r", [1, 2, 3])
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import KVTritonError

__all__ = ["AgentChild", "ChildProcess"]


class AgentChild:
    """The command loop of one agent child process (see the module docstring).

    ``agents``: closed when the loop ends; ``step`` (default: ``progress()`` each) runs between
    messages; ``busy()`` (default: some agent is not ``idle()``) decides whether the loop waits
    ``idle_wait_s`` for a message or only looks, and whether it sleeps ``busy_sleep_s`` after a
    step (0: never; on a small shared host a short sleep leaves the peer process the core)."""

    def __init__(self, conn, agents: Iterable, commands: Mapping[str, Callable[..., Any]], *,
                 step: Callable[[], None] | None = None, busy: Callable[[], bool] | None = None,
                 idle_wait_s: float = 0.002, busy_sleep_s: float = 0.0,
                 errors: tuple[type[BaseException], ...] = (KVTritonError,)):
        self.conn = conn
        self.agents = list(agents)
        self.commands: dict[str, Callable[..., Any]] = {"exit": self._exit, **commands}
        self.step = step or self._progress
        self.busy = busy or (lambda: not all(a.idle() for a in self.agents))
        self.idle_wait_s, self.busy_sleep_s, self.errors = idle_wait_s, busy_sleep_s, errors
        self._done = False

    def _progress(self) -> None:
        for a in self.agents:
            a.progress()

    def _exit(self) -> None:
        self._done = True

    def ready(self, info: Any) -> None:
        """Tell the parent this child is built; ``info`` (picklable) is what :meth:`ChildProcess.ready` returns."""
        self.conn.send(("ready", info))

    def _answer(self, msg) -> None:
        cmd, *args = msg
        handler = self.commands.get(cmd)
        if handler is None:
            self.conn.send(("err", f"KeyError: unknown command {cmd!r} (known: {sorted(self.commands)})"))
            return
        try:
            value = handler(*args)
        except self.errors as e:
            self.conn.send(("err", f"{type(e).__name__}: {e}"))
            return
        self.conn.send(("ok", value))

    def run(self) -> None:
        """Answer commands and step until ``exit`` (or the parent hangs up); then close everything."""
        try:
            while not self._done:
                busy = self.busy()
                if self.conn.poll(0 if busy else self.idle_wait_s):
                    try:
                        msg = self.conn.recv()
                    except EOFError:
                        break
                    self._answer(msg)
                    if self._done:
                        break
                self.step()
                if busy and self.busy_sleep_s:
                    time.sleep(self.busy_sleep_s)
        finally:
            for a in self.agents:
                a.close()
            self.conn.close()


class ChildProcess:
    """The parent's handle on one child process, ``target(conn, *args)`` started with ``spawn``
    (``name`` labels it in errors and in the process list)."""

    def __init__(self, target: Callable[..., None], *args, name: str = "child"):
        self.name = name
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True, name=f"kvtriton-{name}")
        self.process.start()
        self._exit_sent = False
        child.close()  # ours is the other end: the child's exit shows as EOF here

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def recv(self, timeout_s: float | None = 30.0, expect: str = "ok") -> Any:
        """The value of the child's next message, which must be tagged ``expect``; raises
        ``RuntimeError`` on an ``err`` reply or a dead child, ``TimeoutError`` after ``timeout_s``
        (None: no limit while the child lives)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.conn.poll(0.05):
            if not self.process.is_alive():
                raise RuntimeError(f"{self.name} died (exit code {self.process.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not answer within {timeout_s} s")
        try:
            tag, value = self.conn.recv()
        except EOFError:  # it closed the pipe on its way out
            self.process.join(1)
            raise RuntimeError(f"{self.name} died (exit code {self.process.exitcode})") from None
        if tag == "err":
            raise RuntimeError(f"{self.name}: {value}")
        if tag != expect:
            raise RuntimeError(f"{self.name}: expected {expect!r}, got {tag!r}")
        return value

    def ready(self, timeout_s: float | None = 120.0) -> Any:
        """Wait for the child's ``ready`` and return its ``info``."""
        return self.recv(timeout_s, expect="ready")

    def call(self, cmd: str, *args, timeout_s: float | None = 30.0) -> Any:
        """Run ``cmd`` in the child; its handler's return value (see :meth:`recv` for errors)."""
        self.conn.send((cmd, *args))
        return self.recv(timeout_s)

    def request_exit(self) -> None:
        """Ask the child to stop, once (best effort: it may be gone already)."""
        try:
            if self.process.is_alive() and not self._exit_sent:
                self._exit_sent = True
                self.conn.send(("exit",))
        except (OSError, BrokenPipeError):
            pass

    def stop(self, timeout_s: float = 5.0) -> None:
        """Wait up to ``timeout_s`` for the child to end, then kill it; close the pipe."""
        self.process.join(max(0.0, timeout_s))
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """:meth:`request_exit`, then :meth:`stop`."""
        self.request_exit()
        self.stop(timeout_s)

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
