"""Agent child processes for the liveness tests (tests/agent/test_liveness.py): one small rank
over real NIXL (the peer-table tests' geometry, :mod:`tests.helpers.peer_agents`), met over a
kept handshake connection, that a test can pause (it stops progressing, like a rank stuck or
about to die) and SIGKILL. Targets must be importable: ``spawn`` starts a fresh interpreter."""

from __future__ import annotations

import torch

from kvtriton.agent import TransferAgent
from kvtriton.integrations.core import serve_metadata
from kvtriton.protocol.handshake import meet
from kvtriton.testing.child import AgentChild
from kvtriton.testing.oracle import check_destination, load_source, make_global_kv, make_rank_regions
from kvtriton.testing.rogue import BS

from .peer_agents import KW, MODELS


def kv_of(seed: int, n: int):
    """The global KV of a request of ``n`` blocks (both processes rebuild it from ``seed``)."""
    return make_global_kv(MODELS, n, BS, torch.Generator().manual_seed(seed))


def make_agent(engine: str, seed: int, flow: str, timeout_s: float, **kw) -> tuple[TransferAgent, list]:
    regs = make_rank_regions(MODELS, 0, 1, 64, BS, gen=torch.Generator().manual_seed(seed))
    return TransferAgent(engine, 0, 1, regs, flow=flow, timeout_s=timeout_s, **{**KW, **kw}), regs


class _Paused:
    def __init__(self, agent: TransferAgent):
        self.agent, self.paused = agent, False

    def step(self) -> None:
        if not self.paused:
            self.agent.progress()

    def pause(self) -> None:
        self.paused = True


def source(conn, engine: str, seed: int, flow: str, timeout_s: float) -> None:
    """A prefill rank serving its metadata (keeping each caller's connection as its lifeline);
    ``ready`` gives its handshake port. Commands: ``hold(req, src_ids, kv_seed, consumer)``,
    ``pause()``, ``freed()``."""
    agent, regs = make_agent(engine, seed, flow, timeout_s)
    server = serve_metadata(agent, None, "127.0.0.1", 0, io_timeout_s=5.0)
    paused = _Paused(agent)

    def hold(req: str, src: list[int], kv_seed: int, consumer: str | None) -> None:
        load_source(regs, 0, 1, kv_of(kv_seed, len(src)), src)
        agent.hold(req, src, lease_s=30.0, consumer=consumer)

    child = AgentChild(conn, [agent], {"hold": hold, "pause": paused.pause,
                                       "freed": lambda: [(f.req_id, f.reason) for f in agent.freed()]},
                       step=paused.step, busy=lambda: not paused.paused and not agent.idle(), errors=(Exception,))
    child.ready(server.port)
    try:
        child.run()
    finally:
        server.close()


def destination(conn, engine: str, seed: int, flow: str, timeout_s: float, port: int) -> None:
    """A decode rank that meets the prefill rank at ``port`` (keeping the connection as its
    lifeline); ``ready`` gives the engine id it met. Commands: ``fetch(req, engine, src, dst)``,
    ``fetch_and_pause(...)`` (the same, then it stops progressing: its pull is out, never read),
    ``results()`` (``(req, ok, error type)`` of the fetches ended), ``check(kv_seed, dst)``."""
    agent, regs = make_agent(engine, seed, flow, timeout_s)
    m = meet("127.0.0.1", port, agent.metadata(), timeout_s=10.0, keep=True)
    met = agent.add_remote(m.metadata)
    agent.add_lifeline(m)
    paused = _Paused(agent)
    ended: list[tuple[str, bool, str]] = []

    def fetch(req: str, remote: str, src: list[int], dst: list[int]) -> None:
        agent.fetch(req, remote, src, dst)

    def fetch_and_pause(*args) -> None:
        fetch(*args)
        agent.progress()
        paused.pause()

    def results() -> list[tuple[str, bool, str]]:
        ended.extend((r.req_id, r.ok, type(r.error).__name__) for r in agent.results())
        out = list(ended)
        ended.clear()
        return out

    def check(kv_seed: int, dst: list[int]) -> bool:
        check_destination(regs, 0, 1, kv_of(kv_seed, len(dst)), dst)
        return True

    child = AgentChild(conn, [agent], {"fetch": fetch, "fetch_and_pause": fetch_and_pause, "results": results,
                                       "check": check},
                       step=paused.step, busy=lambda: not paused.paused and not agent.idle(), errors=(Exception,))
    child.ready(met)
    child.run()
