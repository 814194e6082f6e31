"""What an agent reports to its engine (finished fetches, freed holds): recorded under the agent's
lock, taken without it.

An engine asks every step (``results()``, ``freed()``), and the agent's progress thread holds the
lock while it works; a thread descheduled while holding it (a busy host) would stall the engine's
step for as long. ``collections.deque``'s ``append`` and ``popleft`` are atomic under the GIL, so
taking never needs the lock: each item reaches exactly one taker, in the order it was recorded.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

__all__ = ["Reports"]

T = TypeVar("T")


class Reports(Generic[T]):
    """Items recorded in order (under the agent's lock) and taken in that order (without it).

    >>> r = Reports[int]()
    >>> r.add(1); r.add(2)
    >>> r.take(), r.take()
    ([1, 2], [])
    """

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: deque[T] = deque()

    def add(self, item: T) -> None:
        self._items.append(item)

    def take(self) -> list[T]:
        """Every item recorded and not taken yet, oldest first (never one twice, whatever the threads)."""
        out: list[T] = []
        pop = self._items.popleft
        while True:
            try:
                out.append(pop())
            except IndexError:
                return out

    def __len__(self) -> int:
        return len(self._items)
