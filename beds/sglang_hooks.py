"""Hooks of the SGLang test bed, inside the server's processes: they time and count what any
transfer backend does (kvtriton's, SGLang's own nixl) and, for the negative control, scramble the
source pages a sender is about to send. :mod:`.sglang_launch` installs them in every process of a
server (the launcher and the scheduler processes SGLang spawns), before SGLang makes a sender.

Nothing of SGLang's behaviour is changed unless ``scramble`` is asked for: the hooks wrap the
``__init__``, ``send`` and ``poll`` of every ``BaseKVSender``/``BaseKVReceiver`` subclass (defined
before or after install), the NIXL agent's transfer posts, and ``TransferAgent.__init__`` (to read
kvtriton's own counters), and write what they see, one JSON object per line, to
``$KVTRITON_SGLANG_BED_DIR/<pid>.jsonl``:

* ``{"event": "recv_init"|"recv_done"|"send"|"send_done", "room": R, "t": wall seconds, ...}``:
  a receiver made, its first terminal poll (``state`` ``success``/``failed``), a sender's
  ``send`` call (``pages``), its first terminal poll. ``time.time()`` is comparable across the
  processes of one host.
* ``{"event": "counters", "nixl_descriptors": n, "nixl_posts": n, "agent": {...}}``: cumulative in
  this process; ``nixl_*`` counts descriptors handed to NIXL by any backend (kvtriton's posts
  included), ``agent`` sums the stats of this process's TransferAgents (kvtriton only).

Env: ``KVTRITON_SGLANG_BED_DIR`` (required for any hook). The negative control is switched at run
time, without restarting the server: while the file ``$KVTRITON_SGLANG_BED_DIR/scramble`` exists
(its text: the KV pool's element dtype, e.g. ``float32``), a sender overwrites the pages it is
asked to send with noise in that dtype, seeded by the room, before sending them.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
import weakref

__all__ = ["install", "ENV_DIR", "SCRAMBLE_FILE"]

ENV_DIR = "KVTRITON_SGLANG_BED_DIR"
SCRAMBLE_FILE = "scramble"
_TERMINAL = {0: "failed", 4: "success"}  # sglang KVPoll.Failed / KVPoll.Success


class _Log:
    """This process's event file (appends are whole lines under a lock) and its counters."""

    def __init__(self, folder: str):
        self.scramble_path = os.path.join(folder, SCRAMBLE_FILE)
        self.path = os.path.join(folder, f"{os.getpid()}.jsonl")
        self.lock = threading.Lock()
        self.nixl = {"nixl_descriptors": 0, "nixl_posts": 0}
        self.agents: weakref.WeakSet = weakref.WeakSet()

    def write(self, event: str, **fields) -> None:
        line = json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **fields})
        with self.lock, open(self.path, "a") as f:
            f.write(line + "\n")

    def scramble_dtype(self) -> str | None:
        try:
            with open(self.scramble_path) as f:
                return f.read().strip() or None
        except OSError:
            return None

    def counters(self) -> None:
        agent: dict[str, int] = {}
        for a in list(self.agents):
            for k, v in a.stats.items():
                agent[k] = agent.get(k, 0) + int(v)
        self.write("counters", agent=agent, **self.nixl)


_LOG: _Log | None = None


def install() -> bool:
    """Install the hooks in this process when ``$KVTRITON_SGLANG_BED_DIR`` is set (once)."""
    global _LOG
    folder = os.environ.get(ENV_DIR)
    if not folder or _LOG is not None:
        return False
    _LOG = _Log(folder)
    _hook_nixl(_LOG)
    _hook_agents(_LOG)
    from sglang.srt.disaggregation.base.conn import BaseKVReceiver, BaseKVSender

    _hook_tree(BaseKVSender, lambda cls: _wrap_sender(cls, _LOG))
    _hook_tree(BaseKVReceiver, lambda cls: _wrap_receiver(cls, _LOG))
    return True


def _hook_tree(base, wrap) -> None:
    """``wrap`` every subclass of ``base`` there is now and every one defined later."""
    seen = []

    def walk(cls):
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                wrap(sub)
                walk(sub)

    walk(base)
    previous = base.__dict__.get("__init_subclass__")

    def init_subclass(cls, **kw):
        if previous is not None:
            previous.__func__(cls, **kw)
        if cls not in seen:
            seen.append(cls)
            wrap(cls)

    base.__init_subclass__ = classmethod(init_subclass)


def _own(cls, name: str):
    """``cls``'s own ``name`` (not inherited: each class in a chain is wrapped once), or None."""
    fn = cls.__dict__.get(name)
    return fn if callable(fn) and not getattr(fn, "_bed_hook", False) else None


def _mark(fn):
    fn._bed_hook = True
    return fn


def _wrap_sender(cls, log: _Log) -> None:
    init, send, poll = _own(cls, "__init__"), _own(cls, "send"), _own(cls, "poll")
    if send is not None:
        def hooked_send(self, kv_indices, *a, **kw):
            if not getattr(self, "_bed_in_send", False):  # a subclass calling super().send()
                self._bed_in_send = True
                try:
                    pages = [int(p) for p in kv_indices]
                    scramble = log.scramble_dtype()
                    if scramble:
                        _scramble_pages(self, pages, scramble)
                    log.write("send", room=_room(self), pages=len(pages), scrambled=bool(scramble),
                              cls=type(self).__name__)
                    return send(self, kv_indices, *a, **kw)
                finally:
                    self._bed_in_send = False
            return send(self, kv_indices, *a, **kw)
        cls.send = _mark(hooked_send)
    if poll is not None:
        cls.poll = _mark(_terminal_poll(poll, log, "send_done"))
    del init


def _wrap_receiver(cls, log: _Log) -> None:
    init, poll = _own(cls, "__init__"), _own(cls, "poll")
    if init is not None:
        def hooked_init(self, *a, **kw):
            out = init(self, *a, **kw)
            if not getattr(self, "_bed_seen", False):
                self._bed_seen = True
                log.write("recv_init", room=_room(self), cls=type(self).__name__)
            return out
        cls.__init__ = _mark(hooked_init)
    if poll is not None:
        cls.poll = _mark(_terminal_poll(poll, log, "recv_done"))


def _terminal_poll(poll, log: _Log, event: str):
    def hooked_poll(self, *a, **kw):
        state = poll(self, *a, **kw)
        name = _TERMINAL.get(int(state)) if state is not None else None
        if name and not getattr(self, "_bed_done", False):
            self._bed_done = True
            log.write(event, room=_room(self), state=name, cls=type(self).__name__)
            log.counters()
        return state
    return hooked_poll


def _room(obj):
    room = getattr(obj, "bootstrap_room", None)
    return int(room) if room is not None else None


def _scramble_pages(sender, pages: list[int], dtype: str) -> None:
    """Overwrite ``pages`` of every KV buffer the sender's manager registered (not the metadata
    rows) with noise seeded by the room: what the decode then loads is not what the prefill
    computed, so its tokens must change if the KV really travelled."""
    import torch

    args = sender.kv_mgr.kv_args
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    g = torch.Generator().manual_seed(_room(sender) or 0)
    for ptr, length, item in zip(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens):
        for p in pages:
            if (p + 1) * item > length:
                continue
            raw = (ctypes.c_uint8 * item).from_address(int(ptr) + p * item)
            view = torch.frombuffer(raw, dtype=torch.uint8).view(dt)
            view.copy_(torch.randn(view.shape, generator=g).to(dt) * 10)


def _hook_nixl(log: _Log) -> None:
    """Count the descriptors every backend hands NIXL to transfer (both ways of posting)."""
    try:
        from nixl._api import nixl_agent
    except ImportError:
        return
    init_xfer, prepped = nixl_agent.initialize_xfer, nixl_agent.make_prepped_xfer
    if getattr(init_xfer, "_bed_hook", False):
        return

    def counting_init(self, operation, local_descs, *a, **kw):
        log.nixl["nixl_posts"] += 1
        log.nixl["nixl_descriptors"] += int(local_descs.descCount())
        return init_xfer(self, operation, local_descs, *a, **kw)

    def counting_prepped(self, operation, local_side, local_indices, *a, **kw):
        log.nixl["nixl_posts"] += 1
        log.nixl["nixl_descriptors"] += len(local_indices)
        return prepped(self, operation, local_side, local_indices, *a, **kw)

    nixl_agent.initialize_xfer, nixl_agent.make_prepped_xfer = _mark(counting_init), _mark(counting_prepped)


def _hook_agents(log: _Log) -> None:
    """Remember this process's TransferAgents, to report their stats with each terminal poll."""
    try:
        from kvtriton.agent.facade import TransferAgent
    except ImportError:
        return
    init = TransferAgent.__init__
    if getattr(init, "_bed_hook", False):
        return

    def remembering_init(self, *a, **kw):
        init(self, *a, **kw)
        log.agents.add(self)

    TransferAgent.__init__ = _mark(remembering_init)
