"""Where an agent's kernels run, and how their completion and the engine's writes are ordered.

On CUDA an agent owns one stream on its own device (``Lanes.stream``). Every pack and unpack is
queued there, under the agent's device, whichever thread launches it (the engine's, or the
background progress thread, whose current device would otherwise be 0) and whatever stream is
current: the engine's compute stream never waits for a transfer, and a transfer never waits for
unrelated engine work. Ordering is explicit, by events:

* *engine -> pack / DIRECT read*: :meth:`TransferAgent.hold` takes the event (or stream) after
  which the held blocks are final; a pack makes the agent's stream wait for it on the device
  (``stream.wait_event``: no host wait), and a DIRECT region is announced to (pull) or written to
  (push) the peer only once the event has completed (the NIC reads the cache without a stream).
* *engine -> unpack*: :meth:`TransferAgent.fetch` takes the same kind of event, after which the
  engine no longer uses the local blocks' old contents (their previous request's kernels may still
  be queued); unpacks into them wait for it on the device.
* *pack / unpack -> everything after*: each launch records a :class:`Completion` on the agent's
  stream; the step that needs its bytes (announce or WRITE a staged chunk, free a slot, report a
  fetch's result) runs only once ``done()``. A fetch is reported in :meth:`TransferAgent.results`
  only after every unpack that wrote its blocks finished on the device, so the engine may use the
  blocks from any stream at once.

On CPU every kernel runs synchronously: nothing here does anything, completions are done at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["Completion", "Lanes", "event_done", "ready_event"]


class Completion:
    """A pack or unpack launched on this rank: an event recorded on the stream it was queued on
    (None on CPU, where the kernel already ran). The step that needs its bytes runs from one
    place: where :meth:`done` is polled."""

    def __init__(self, stream: torch.cuda.Stream | None):
        self._event = None
        if stream is not None:
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def done(self) -> bool:
        return self._event is None or self._event.query()


def event_done(event) -> bool:
    """True when ``event`` (a ``torch.cuda.Event``, or None for "nothing to wait for") completed."""
    return event is None or event.query()


def ready_event(device: torch.device, after) -> torch.cuda.Event | None:
    """The event after which the engine is done with some blocks, from what
    :meth:`TransferAgent.hold` or :meth:`TransferAgent.fetch` was given: a ``torch.cuda.Event``
    (used as it is), a ``torch.cuda.Stream`` (an event recorded on it now), or None (an event
    recorded now on the current stream of ``device``: the engine works on the stream current
    where it calls the agent). On a CPU agent: None.

    Raises ``ValueError`` on anything else, or on an event/stream given to a CPU agent.
    """
    if device.type != "cuda":
        if after is not None:
            raise ValueError(f"after= is for CUDA agents; this agent is on {device}, expected None")
        return None
    if isinstance(after, torch.cuda.Event):
        return after
    if after is None:
        after = torch.cuda.current_stream(device)
    if not isinstance(after, torch.cuda.Stream):
        raise ValueError(f"after= must be a torch.cuda.Event, a torch.cuda.Stream or None; "
                         f"got {type(after).__name__}")
    with torch.cuda.device(device):
        event = torch.cuda.Event()
        event.record(after)
    return event


class Lanes:
    """An agent's device and its own CUDA stream (both inert on CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    def on_device(self) -> contextlib.AbstractContextManager:
        """The agent's device current (UCX's and Triton's CUDA calls use the current context)."""
        return torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()

    @contextlib.contextmanager
    def launching(self, after=None) -> Iterator[None]:
        """Queue what runs inside on the agent's stream, under its device, after ``after`` (a
        ``torch.cuda.Event``; the stream waits for it on the device, the host does not).
        Temporaries allocated inside (block ids, segment tables) belong to that stream, so the
        caching allocator reuses them only after the kernels that read them."""
        stream = self.stream
        if stream is None:  # CPU: nothing to order
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            yield

    def completion(self) -> Completion:
        """A completion of everything queued on the agent's stream so far."""
        return Completion(self.stream)

    def synchronize(self) -> None:
        """Wait until the agent's stream is idle (close: its staging must not be freed under a
        kernel still writing it)."""
        if self.stream is not None:
            self.stream.synchronize()
