"""Several prefill and decode engines in processes over real NIXL on 127.0.0.1, for fault
scenarios: ranks SIGKILLed under a stream of requests and restarted under the same engine id
(bench/faults.py, tests/agent/test_faults.py; issue 35).

Every rank is its own process (:mod:`kvtriton.testing.child`) with one pull agent over a small
CPU cache (one GQA region, the torch path, staging in small slots and a planning model that
packs, so every request goes through staging). A prefill rank serves its metadata on a handshake
port; a decode rank meets every prefill rank over a kept connection, its *lifeline*
(:mod:`kvtriton.agent.lifelines`), as a serving decode does. A request names one prefill and
one decode engine; its KV is fresh random data rebuilt from the request's seed in every process,
so each decode rank checks every request it loads byte for byte (``view(torch.uint8)``,
:func:`~kvtriton.testing.oracle.check_destination`) against that independent reference.

:class:`FaultBed` is the parent's side: start, meet, hold, fetch, collect outcomes, pause, kill,
restart and look for leaks, every wait bounded, every child reaped when it exits (a killed
child included), whatever happened.
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from collections.abc import Collection
from dataclasses import dataclass, field

from .child import AgentChild, ChildProcess

__all__ = ["BedConfig", "FaultBed", "Request", "Outcome"]


@dataclass(frozen=True)
class BedConfig:
    p_engines: int = 2
    d_engines: int = 2
    tp: int = 2
    blocks: int = 128  # cache blocks per rank
    blocks_per_request: int = 4
    timeout_s: float = 30.0  # each agent's fetch timeout: a death must be known long before it
    lease_s: float = 30.0
    staging_bytes: int = 16 << 10
    slot_bytes: int = 1024
    seed: int = 0
    d_tp: int | None = None  # the decode engines' TP (None: ``tp``, as the prefill engines')
    secret: bytes | None = None  # the cluster's shared secret: every meeting proves it, messages sealed per pair

    def tp_of(self, role: str) -> int:
        return self.d_tp if role == "D" and self.d_tp is not None else self.tp


@dataclass(frozen=True)
class Request:
    req_id: str
    seed: int
    prefill: str  # engine ids
    decode: str
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]


@dataclass
class Outcome:
    """One decode rank's end of one request: ``t_end`` is ``time.monotonic()`` in that rank's
    process when its result came (CLOCK_MONOTONIC: comparable across processes of this host)."""

    ok: bool
    error: str | None
    msg: str | None
    t_end: float
    mismatch: str | None = None


def _models():
    from .oracle import RegionModel

    return [RegionModel.gqa("l0", 4, 16)]


BLOCK_SIZE = 4


def _kv(req_seed: int, n_blocks: int):
    import torch

    from .oracle import make_global_kv

    return make_global_kv(_models(), n_blocks, BLOCK_SIZE, torch.Generator().manual_seed(req_seed))


# --------------------------------------------------------------------------- child process
def _rank_child(conn, role: str, engine: str, rank: int, cfg: BedConfig) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(1)
    me = _Rank(role, engine, rank, cfg)
    child = AgentChild(conn, [me.agent], me.commands(), step=me.step, busy=me.busy, busy_sleep_s=0.0002,
                       errors=(Exception,))
    try:
        child.ready(me.port)
        child.run()
    finally:
        if me.server is not None:
            me.server.close()


class _Rank:
    """One rank in its child process: its cache and agent, a handshake server (prefill) or the
    meetings it made (decode), the fetches it runs and their outcomes."""

    def __init__(self, role: str, engine: str, rank: int, cfg: BedConfig):
        import torch

        from ..agent import TransferAgent
        from ..integrations.core import serve_metadata
        from ..protocol.auth import Credential
        from .oracle import make_rank_regions
        from .rogue import PACKING_MODEL

        self.role, self.engine, self.rank, self.cfg, self.tp = role, engine, rank, cfg, cfg.tp_of(role)
        self.credential = Credential(secret=cfg.secret) if cfg.secret is not None else None
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + zlib.crc32(engine.encode()) % 1000 * 31 + rank)
        self.regions = make_rank_regions(_models(), rank, self.tp, cfg.blocks, BLOCK_SIZE, gen=gen)
        self.agent = TransferAgent(engine, rank, self.tp, self.regions, flow="pull", staging_bytes=cfg.staging_bytes,
                                   slot_bytes=cfg.slot_bytes, timeout_s=cfg.timeout_s, impl="torch",
                                   cost=PACKING_MODEL, require_authenticated_peers=self.credential is not None)
        self.server = None
        self.port: int | None = None
        if role == "P":
            self.server = serve_metadata(self.agent, self.credential, "127.0.0.1", 0, io_timeout_s=5.0)
            self.port = self.server.port
        self.paused = False
        self.requests: dict[str, Request] = {}
        self.ended: list[tuple[str, Outcome]] = []
        self.freed: list[tuple[str, str, float]] = []

    def commands(self) -> dict:
        return {"meet": self.meet, "hold": self.hold, "fetch": self.fetch, "pause": self.pause,
                "results": self.results, "freed_holds": self.freed_holds, "leaks": self.leaks}

    def busy(self) -> bool:
        return not self.paused and not self.agent.idle()

    def meet(self, ports: list[int]) -> list[str]:
        """Meet each prefill rank at ``ports`` over a kept connection (its lifeline)."""
        from ..protocol.handshake import meet

        met = []
        for port in ports:
            m = meet("127.0.0.1", port, self.agent.metadata(), credential=self.credential, timeout_s=10.0, keep=True)
            met.append(self.agent.add_remote(m.metadata, authenticated=self.credential is not None, keys=m.keys))
            if m.conn is not None:
                self.agent.add_lifeline(m)
        return met

    def hold(self, reqs: list[Request]) -> None:
        from .oracle import load_source

        for r in reqs:
            load_source(self.regions, self.rank, self.tp, _kv(r.seed, len(r.src_ids)), list(r.src_ids))
            self.agent.hold(r.req_id, list(r.src_ids), lease_s=self.cfg.lease_s, consumer=r.decode)

    def fetch(self, reqs: list[Request], then_pause: bool = False) -> None:
        """Start each fetch; ``then_pause``: progress once (the pulls go out), then stop
        progressing (nothing read, no result taken), like a rank stuck or about to die."""
        from ..errors import KVTritonError

        for r in reqs:
            self.requests[r.req_id] = r
            try:
                self.agent.fetch(r.req_id, r.prefill, list(r.src_ids), list(r.dst_ids))
            except KVTritonError as e:  # refused at once (its source engine already dropped)
                self.ended.append((r.req_id, Outcome(False, type(e).__name__, str(e), time.monotonic())))
        if then_pause:
            self.agent.progress()
            self.paused = True

    def pause(self) -> None:
        self.paused = True

    def results(self) -> list[tuple[str, Outcome]]:
        out, self.ended = self.ended, []
        return out

    def freed_holds(self) -> list[tuple[str, str, float]]:
        out, self.freed = self.freed, []
        return out

    def leaks(self) -> dict:
        pool = self.agent.pool
        return dict(holds=len(self.agent.debug_state()["holds"]), fetches_in_flight=not self.agent.idle(),
                    staging_taken=pool.num_slots - pool.free_slots)

    def step(self) -> None:
        from .oracle import check_destination

        if self.paused:
            return
        self.agent.progress()
        now = time.monotonic()
        for res in self.agent.results():
            out = Outcome(res.ok, type(res.error).__name__ if res.error else None,
                          str(res.error) if res.error else None, now)
            if res.ok:
                r = self.requests[res.req_id]
                try:
                    check_destination(self.regions, self.rank, self.tp, _kv(r.seed, len(r.dst_ids)),
                                      list(r.dst_ids))
                except AssertionError as e:
                    out.mismatch = f"{res.req_id}: {e}"
            self.requests.pop(res.req_id, None)
            self.ended.append((res.req_id, out))
        self.freed.extend((f.req_id, f.reason, now) for f in self.agent.freed())


# --------------------------------------------------------------------------- parent
@dataclass
class _Blocks:
    """One engine's free cache blocks (each rank holds the same ids): a request's blocks are
    given back once it ended well everywhere, and kept out of use otherwise (a hold of a failed
    request may still be readable on a surviving rank until it ends)."""

    free: list[int] = field(default_factory=list)

    def take(self, n: int) -> tuple[int, ...]:
        if len(self.free) < n:
            raise RuntimeError(f"out of cache blocks ({len(self.free)} free, {n} wanted)")
        out, self.free = self.free[:n], self.free[n:]
        return tuple(out)


class FaultBed:
    """The parent: ``p_engines`` prefill and ``d_engines`` decode engines of ``tp`` ranks each,
    every rank a child process; a context manager (every child reaped on exit)."""

    def __init__(self, cfg: BedConfig, start_timeout_s: float = 120.0):
        import numpy as np

        self.cfg = cfg
        self.start_timeout_s = start_timeout_s
        self.prefills = [f"P{i}" for i in range(cfg.p_engines)]
        self.decodes = [f"D{i}" for i in range(cfg.d_engines)]
        self.procs: dict[tuple[str, int], ChildProcess] = {}
        self.ports: dict[tuple[str, int], int] = {}
        self.dead: set[tuple[str, int]] = set()
        rng = np.random.default_rng(cfg.seed)
        self.blocks = {e: _Blocks([int(b) for b in rng.permutation(cfg.blocks)]) for e in self.prefills + self.decodes}
        self.outcomes: dict[str, dict[int, Outcome]] = {}  # req -> decode rank -> its outcome
        self.requests: dict[str, Request] = {}
        self.freed: dict[tuple[str, int], list[tuple[str, str, float]]] = {}
        self.started_s = 0.0  # the last restart's process start, in seconds
        self._next = 0

    # ------------------------------------------------------------------ processes
    def __enter__(self) -> FaultBed:
        try:
            for e in self.prefills + self.decodes:
                for key in self.ranks(e):
                    self._spawn(*key)
            for key in list(self.procs):
                self._ready(key)
            for e in self.decodes:
                for key in self.ranks(e):
                    self.meet(key)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, engine: str, rank: int) -> None:
        role = "P" if engine in self.prefills else "D"
        self.procs[(engine, rank)] = ChildProcess(_rank_child, role, engine, rank, self.cfg, name=f"{engine}:{rank}")

    def _ready(self, key) -> None:
        port = self.procs[key].ready(self.start_timeout_s)
        if port is not None:
            self.ports[key] = port

    def call(self, key, cmd: str, *args, timeout_s: float = 30.0):
        return self.procs[key].call(cmd, *args, timeout_s=timeout_s)

    def meet(self, key) -> None:
        """Decode rank ``key`` meets every live prefill rank (again: a restarted one included)."""
        ports = [p for k, p in self.ports.items() if k not in self.dead]
        self.call(key, "meet", ports, timeout_s=60.0)

    def kill(self, key) -> float:
        """SIGKILL rank ``key``; the monotonic time just before."""
        proc = self.procs[key]
        pid = proc.process.pid
        if pid is None:  # never started: nothing of ours to kill (and never signal pid 0, our group)
            raise RuntimeError(f"{key} has no process")
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        proc.process.join(5)
        self.dead.add(key)
        self.ports.pop(key, None)
        return t0

    def restart(self, key) -> float:
        """A fresh process for ``key`` under the same engine id and rank; a restarted prefill rank
        is met by every decode rank, a restarted decode rank meets every prefill rank. Returns
        the seconds until it was built and met (its process start included)."""
        t0 = time.monotonic()
        self.procs.pop(key).stop(0.0)
        self.dead.discard(key)
        self._spawn(*key)
        self._ready(key)
        self.started_s = time.monotonic() - t0  # the process start alone (the rest: meetings)
        if key[0] in self.prefills:
            for d in self.decodes:
                for dk in self.ranks(d):
                    if dk not in self.dead:
                        self.call(dk, "meet", [self.ports[key]], timeout_s=60.0)
        else:
            self.meet(key)
        return time.monotonic() - t0

    def close(self) -> None:
        for child in self.procs.values():
            child.request_exit()
        deadline = time.monotonic() + 5
        for child in self.procs.values():
            child.stop(deadline - time.monotonic())
        self.procs.clear()

    # ------------------------------------------------------------------ requests
    def ranks(self, engine: str) -> list[tuple[str, int]]:
        return [(engine, r) for r in range(self.cfg.tp_of("P" if engine in self.prefills else "D"))]

    def new_requests(self, prefill: str, decode: str, count: int) -> list[Request]:
        n = self.cfg.blocks_per_request
        out = []
        for _ in range(count):
            i = self._next
            self._next += 1
            out.append(Request(f"r{i}", self.cfg.seed * 1_000_003 + i, prefill, decode,
                               self.blocks[prefill].take(n), self.blocks[decode].take(n)))
        return out

    def submit(self, reqs: list[Request], *, pause_after: tuple[str, int] | None = None) -> None:
        """Hold ``reqs`` on their prefill engine's live ranks and fetch them on their decode
        engine's live ranks (``pause_after``: that decode rank pauses once its pulls are out)."""
        for r in reqs:
            self.requests[r.req_id] = r
            self.outcomes[r.req_id] = {}
        for p in {r.prefill for r in reqs}:
            for key in self.ranks(p):
                if key not in self.dead:
                    self.call(key, "hold", [r for r in reqs if r.prefill == p])
        for d in {r.decode for r in reqs}:
            for key in self.ranks(d):
                if key not in self.dead:
                    self.call(key, "fetch", [r for r in reqs if r.decode == d], key == pause_after)

    def poll(self) -> None:
        """Collect every live rank's outcomes and freed holds; recycle blocks of requests that
        ended well on every rank of their decode engine."""
        for key in list(self.procs):
            if key in self.dead:
                continue
            if key[0] in self.decodes:
                for req_id, out in self.call(key, "results"):
                    self.outcomes[req_id][key[1]] = out
                    r = self.requests[req_id]
                    got = self.outcomes[req_id]
                    if len(got) == len(self.ranks(r.decode)) and all(o.ok and o.mismatch is None for o in got.values()):
                        self.blocks[r.prefill].free.extend(r.src_ids)
                        self.blocks[r.decode].free.extend(r.dst_ids)
            else:
                self.freed.setdefault(key, []).extend(self.call(key, "freed_holds"))

    def ended(self, req_id: str, dead_decodes: Collection[tuple[str, int]] = ()) -> bool:
        """Every decode rank that is to report ``req_id`` did (a dead decode rank's never will)."""
        r = self.requests[req_id]
        want = {k[1] for k in self.ranks(r.decode) if k not in dead_decodes}
        return want <= set(self.outcomes[req_id])

    def wait(self, req_ids, timeout_s: float, dead_decodes: Collection[tuple[str, int]] = ()) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            left = [q for q in req_ids if not self.ended(q, dead_decodes)]
            if not left:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(left)} requests without an outcome after {timeout_s} s: {left[:5]}")
            time.sleep(0.02)

    def lost(self, req_id: str) -> bool:
        """Whether ``req_id`` failed on some decode rank that reported it (wrong bytes count too)."""
        return any(not o.ok or o.mismatch is not None for o in self.outcomes[req_id].values())

    def leaks(self, timeout_s: float = 20.0) -> dict[tuple[str, int], dict]:
        """Each live rank's holds, fetches in flight and staging slots taken once they settled
        (bounded: what is still there after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            got = {k: self.call(k, "leaks") for k in self.procs if k not in self.dead}
            if all(not (v["holds"] or v["fetches_in_flight"] or v["staging_taken"]) for v in got.values()):
                return got
            if time.monotonic() > deadline:
                return got
            time.sleep(0.05)
