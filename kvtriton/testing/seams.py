"""Seams for tests: what a test injects into an agent that its public API does not take.

Tests observe an agent through :meth:`~kvtriton.agent.TransferAgent.debug_state`, ``stats`` and
the public API; what they must *inject* (a forged or dropped control message, a CUDA event
that completes when the test says so, a stand-in for the agent's CUDA stream on a CPU host)
goes through this module, so that it is the one place outside :mod:`kvtriton.agent` that knows
how the agent is built. Two kinds of seam:

* :class:`Wiretap` works on the agent's public ``transport`` only: it sees the control messages
  the agent receives, can hold them back and forges messages from it.
* The functions below reach behind the facade (one line each): :func:`set_hold_event`,
  :func:`set_fetch_event`, :func:`replace_lanes`, :func:`agent_lanes`, :func:`retire_chunks` and
  :func:`reap`. When
  the agent is recut, only these bodies change.

Nothing here is used by the library itself.
"""

from __future__ import annotations

from collections.abc import Callable

from ..protocol import wire

__all__ = ["Wiretap", "set_hold_event", "set_fetch_event", "replace_lanes", "agent_lanes", "retire_chunks", "reap"]


class Wiretap:
    """Listens on ``agent``'s transport: every control message the agent receives is decoded
    into :attr:`received` (in arrival order) before the agent handles it. With :meth:`hold`,
    received messages are kept back (the agent's ``progress()`` sees none) until
    :meth:`release`, which hands them all to the agent's next ``progress()`` at once.
    :meth:`close` (or leaving the ``with`` block) takes the tap off; what is held is then
    delivered first."""

    def __init__(self, agent):
        self.agent = agent
        self.transport = agent.transport
        self.received: list[wire.Message] = []
        self.held: dict[str, list[bytes]] = {}  # sender -> raw messages kept back
        self._holding = self._closed = False
        self._real = self.transport.poll_notifs  # the transport's own (bound) method
        self.transport.poll_notifs = self._poll

    # ------------------------------------------------------------------ observing
    def _poll(self) -> dict[str, list[bytes]]:
        new = self._real()
        for msgs in new.values():
            for raw in msgs:
                try:
                    self.received.append(wire.decode_message(raw))
                except Exception:  # noqa: BLE001 - a malformed message is the agent's to count
                    pass
        if self._holding:
            for sender, msgs in new.items():
                self.held.setdefault(sender, []).extend(msgs)
            return {}
        if not self.held:
            return new
        out, self.held = self.held, {}
        for sender, msgs in new.items():
            out.setdefault(sender, []).extend(msgs)
        if self._closed:
            self._uninstall()
        return out

    def seen(self, kind: type) -> list:
        """The received messages of type ``kind`` (a :mod:`kvtriton.protocol.wire` message class)."""
        return [m for m in self.received if isinstance(m, kind)]

    # ------------------------------------------------------------------ holding back
    def hold(self) -> None:
        """Keep received messages from the agent from now on (see :meth:`poll`)."""
        self._holding = True

    def poll(self) -> None:
        """Drive the transport (UCX needs it) and keep what arrived, while holding."""
        held = self._poll()
        for sender, msgs in held.items():  # not holding: nothing may be lost either
            self.held.setdefault(sender, []).extend(msgs)

    def release(self) -> None:
        """Stop holding: the agent's next ``progress()`` receives every held message."""
        self._holding = False

    # ------------------------------------------------------------------ forging
    def send(self, to, msg: wire.Message | bytes) -> None:
        """Send ``msg`` from the agent's transport to ``to`` (a TransferAgent, or a NIXL agent
        name), as if the agent had: a forged message, with no state of the sender changed."""
        name = to if isinstance(to, str) else to.transport.name
        self.transport.send_notif(name, msg if isinstance(msg, bytes) else msg.encode())

    def close(self) -> None:
        """Take the tap off (once what it holds was handed to the agent's next poll)."""
        self._holding, self._closed = False, True
        if not self.held:
            self._uninstall()

    def _uninstall(self) -> None:
        if self.transport.__dict__.get("poll_notifs") == self._poll:
            del self.transport.poll_notifs  # the class's method again

    def __enter__(self) -> Wiretap:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def set_hold_event(agent, req_id: str, event) -> None:
    """Make ``event`` (anything with ``query() -> bool``) the event after which held request
    ``req_id``'s blocks are final, as ``hold(after=event)`` does on a CUDA agent: DIRECT regions
    are offered or written only once it reports completion. For CPU tests (a CPU agent's ``hold``
    takes no event)."""
    agent._source.holds.held[req_id].ready = event


def set_fetch_event(agent, req_id: str, event) -> None:
    """Make ``event`` the one unpacks of fetch ``req_id`` are ordered after (``fetch(after=)``)."""
    agent._destination.fetches.by_req[req_id].ready = event


def replace_lanes(agent, lanes) -> None:
    """Run ``agent``'s packs and unpacks under ``lanes`` (an object with the interface of
    :class:`kvtriton.agent.device.Lanes`: ``launching(after)``, ``completion()``,
    ``on_device()``, ``synchronize()``, ``cuda``) instead of its own stream: every role reads it
    from the settings they share."""
    object.__setattr__(agent._s, "lanes", lanes)  # Settings is frozen; the roles share it


def agent_lanes(agent):
    """``agent``'s :class:`~kvtriton.agent.device.Lanes`: its device and the CUDA stream its packs
    and unpacks run on (to queue work exactly where the agent queues its own)."""
    return agent._s.lanes


def retire_chunks(agent, inflight: dict, not_before: float, on_free: Callable | None = None) -> None:
    """Hand staged chunks (``{index: kvtriton.agent.links.Chunk}``) to ``agent``'s retirement, as
    a transfer that ended early does: their slots return to the pool once nothing (a transfer, a
    kernel) can touch them and ``not_before`` (monotonic seconds) passed; see :func:`reap`."""
    agent._links.retire_chunks(inflight, not_before, on_free=on_free)


def reap(agent) -> None:
    """Finish what ``agent`` retired and may be finished now (``progress()`` does it too)."""
    agent._links.reap()
