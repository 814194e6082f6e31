"""Messages received from peers and not handled yet, per sender, and the share of them one
:meth:`~kvtriton.agent.TransferAgent.progress` call handles: a flood from one peer neither
stalls the call nor starves the others. Each is opened as it arrives (``opener``: the sender's
pair seal, :meth:`.links.Links.open`), so forged messages under a peer's name never take a place
in its queue."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence

from .stats import Stats

__all__ = ["Inbox"]


class Inbox:
    """Per-sender queues of raw notifications, drained round-robin under a byte budget."""

    #: one drain handles at most this many bytes of messages (at least one message), each
    #: counted with a fixed overhead (so at most ~512 small ones)
    BUDGET_BYTES = 1 << 20
    OVERHEAD_BYTES = 2048
    #: messages that may wait per sender; the excess is dropped unread and counted as bad
    MAX_PER_SENDER = 1 << 14

    def __init__(self, stats: Stats, opener: Callable[[str, bytes], bytes | None] | None = None):
        self.stats = stats
        self.opener = opener  # (sender, raw) -> the message, or None: refused (counted by it)
        self.queues: dict[str, deque[bytes]] = {}

    def __bool__(self) -> bool:
        return bool(self.queues)

    def add(self, notifs: Mapping[str, Sequence[bytes]]) -> None:
        for sender, msgs in notifs.items():
            for raw in msgs:
                opened = raw if self.opener is None else self.opener(sender, raw)
                if opened is None:
                    continue  # a queue only for a sender with a message to handle (drain pops each)
                q = self.queues.setdefault(sender, deque())
                if len(q) >= self.MAX_PER_SENDER:
                    self.stats.bad_messages += 1  # flooding: dropped unread
                    continue
                q.append(opened)

    def drain(self) -> Iterator[tuple[str, bytes]]:
        """``(sender, raw message)`` pairs, one sender after the other, until the budget is spent."""
        budget = self.BUDGET_BYTES
        while self.queues and budget > 0:
            for sender in list(self.queues):
                q = self.queues[sender]
                raw = q.popleft()
                if not q:
                    del self.queues[sender]
                budget -= len(raw) + self.OVERHEAD_BYTES
                yield sender, raw
                if budget <= 0:
                    break
