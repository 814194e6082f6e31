"""Where one small zero-copy fetch's host time goes, phase by phase, warm and cold.

:mod:`bench.fetch_host`'s case (P2 -> D1, 22 blocks, the holds offered ahead, the prefill ranks
progressed untimed between the decode's polls), each request timed at the boundaries of the
agent's own calls by wrapping them from outside (no stamp in the library): the offer taken in,
the request planned (``RequestPlan.for_fetch``), its parts made, its READs prepared and posted,
``fetch()`` returned, the ``progress()`` that finishes it and the result reported; then, in the
decode's next ``progress()``, the Done encoded and sent to each source rank and the fence posted
(``Fetches.finish`` leaves them there: the result does not wait for them). Medians per phase over ``--reps``
requests, with the caches warm and after an untimed 32 MiB copy (``--cold``: what a large READ
or an engine's forward pass leaves before the next fetch, see :mod:`bench.fetch_host`).

The phases to the result add up to kvtriton's row of ``fetch_host``, all of them to its
``kvtriton_all``; the floor's posts are that row's ``floor``. Each wrapper costs ~1 us, counted
in the phase it closes. Run alone:
``python bench/fetch_phases.py [--kind gqa] [--reps 200] [--cold]``.
"""

from __future__ import annotations

if not __package__:  # `python bench/fetch_phases.py`: run as `python -m bench.fetch_phases` (bench/_as_module.py)
    import _as_module

    _as_module.run_as_module(__file__)

import argparse
import functools
import time

import numpy as np
import torch

from bench import fetch_host  # bench/fetch_host.py

#: (phase that ends there, "start" or "end" of the wrapped call, module, attribute path), in the
#: order a request passes them: a boundary is stamped the first time its call is reached after the
#: previous boundary's (a request of two source ranks posts two READs and sends two Dones: the
#: first of each is its own phase, the second falls in the phase after it)
STAMPS = (
    ("messages taken", "end", "kvtriton.transport.nixl", "NixlTransport.poll_notifs"),
    ("planned", "end", "kvtriton.plan.request", "RequestPlan.for_fetch"),
    ("parts made", "start", "kvtriton.agent.destination.core", "Destination._start"),
    ("READ prepared", "start", "kvtriton.transport.nixl", "NixlTransport._post"),
    ("READ posted", "end", "kvtriton.transport.nixl", "NixlTransport._post"),
    ("all posted", "end", "kvtriton.agent.destination.core", "Destination._start"),
    ("fetch returned", "end", "kvtriton.agent.facade", "TransferAgent.fetch"),
    ("finish begun", "start", "kvtriton.agent.destination.fetches", "Fetches.finish"),
    ("finished", "end", "kvtriton.agent.destination.fetches", "Fetches.finish"),
    ("result taken", "end", "kvtriton.agent.facade", "TransferAgent.results"),
)
#: the boundary where the decode's next ``progress()`` begins (stamped by wrapping that agent's own
#: call: the prefill ranks progress in between, untimed), then that call's phases: the Dones of the
#: finished fetch and the fence (``Fetches.finish`` leaves them to it); the second Done falls in "fence posted"
NEXT = "next progress()"
AFTER = (
    ("Done encoded", "end", "kvtriton.protocol.wire", "Message.encode"),
    ("Done sent", "end", "kvtriton.transport.nixl", "NixlTransport.send_notif"),
    ("fence posted", "end", "kvtriton.transport.fence", "Fences.flush"),
)
_ORDER = {p: i for i, p in enumerate([p for p, *_ in STAMPS] + [NEXT] + [p for p, *_ in AFTER])}


class Stamps:
    """The times of one request's phase boundaries (``on``: between its fetch() and its result)."""

    def __init__(self):
        self.on, self.t0, self.at = False, 0.0, {}

    def begin(self) -> None:
        self.on, self.t0, self.at = True, time.perf_counter(), {}

    def mark(self, phase: str) -> None:
        if self.on and len(self.at) == _ORDER[phase]:  # the next boundary, not one passed or ahead
            self.at[phase] = time.perf_counter()


def _wrap(stamps: Stamps, phase: str, where: str, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kw):
        if where == "start":
            stamps.mark(phase)
        out = fn(*args, **kw)
        if where == "end":
            stamps.mark(phase)
        return out
    return wrapped


def install(stamps: Stamps):
    """Wrap every :data:`STAMPS` call site (classmethods and staticmethods keep their kind); returns
    the function that puts the originals back. Every site is found before any is wrapped: one that
    is gone raises (``KeyError``/``AttributeError`` naming it) with nothing changed."""
    import importlib

    sites = []
    for phase, where, module, path in STAMPS + AFTER:
        owner = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        sites.append((owner, name, raw, phase, where))
    for owner, name, _, phase, where in sites:  # a call stamped at start and end is wrapped twice
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        if isinstance(raw, (classmethod, staticmethod)):
            setattr(owner, name, type(raw)(_wrap(stamps, phase, where, raw.__func__)))
        else:
            setattr(owner, name, _wrap(stamps, phase, where, raw))

    def uninstall() -> None:
        for owner, name, raw, _, _ in reversed(sites):  # the last one put back is the first original
            setattr(owner, name, raw)
    return uninstall


def run_phases(kind: str = "gqa", reps: int = 200, cold: bool = False) -> list[tuple[str, float, float]]:
    """(phase, median us, p80 us) of one request of ``kind``, phases in the order they end."""
    torch.set_num_threads(1)
    fetch_host.arm_cold(cold)
    case = fetch_host.Case(kind, seed=11)
    uninstall = None
    try:
        for _ in range(5):
            case.fetch_ms()
        stamps = Stamps()
        uninstall = install(stamps)
        fetch, progress = case.d.fetch, case.d.progress
        case.d.fetch = lambda *a, **kw: (stamps.begin(), fetch(*a, **kw))[1]  # the request's clock starts here
        case.d.progress = lambda *a, **kw: (stamps.mark(NEXT), progress(*a, **kw))[1]
        rows = []
        for _ in range(reps):
            case.fetch_ms()
            stamps.on = False
            rows.append(dict(stamps.at, start=stamps.t0))
    finally:
        if uninstall is not None:
            uninstall()
        case.close()
        fetch_host.arm_cold(False)
    seen = ["start", *_ORDER]
    rows = [r for r in rows if len(r) == len(seen)]  # every boundary passed (a poll before the READ landed: one fewer)
    if not rows:
        raise RuntimeError("fetch_phases: no request passed every boundary")
    times = np.array([[r[p] for p in seen] for r in rows])
    steps = np.diff(times, axis=1) * 1e6
    return [(p, float(np.median(steps[:, i])), float(np.percentile(steps[:, i], 80))) for i, p in enumerate(seen[1:])
            if p != NEXT]  # the prefill ranks' progress in between: not the decode's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=fetch_host.CASES, default="gqa")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--cold", action="store_true", help="evict the caches before each request (fetch_host --cold)")
    args = ap.parse_args()
    phases = run_phases(args.kind, args.reps, args.cold)
    print(f"fetch_phases {args.kind} ({'cold' if args.cold else 'warm'} caches), us since the previous boundary:")
    to_result = len(STAMPS)
    for i, (phase, med, p80) in enumerate(phases):
        if i == to_result:
            print(f"  {'to the result':<16} {sum(m for _, m, _ in phases[:i]):8.1f}\n  then in the next progress():")
        print(f"  {phase:<16} {med:8.1f}  (p80 {p80:.1f})")
    print(f"  {'after the result':<16} {sum(m for _, m, _ in phases[to_result:]):8.1f}")
    print(f"  {'total':<16} {sum(m for _, m, _ in phases):8.1f}")


if __name__ == "__main__":
    main()
