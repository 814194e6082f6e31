"""Connector worker sides for the xPyD and DP tests (tests/agent/test_xpyd.py): prefill engines
in this process or in a child process a test can SIGKILL, one decode, and a driver issuing loads
as vLLM's scheduler side would; the geometry of :mod:`helpers.connector_bed`. A child's target
must be importable: ``spawn`` starts a fresh interpreter."""

from __future__ import annotations

import time

import torch

from kvtriton import Region
from kvtriton.integrations.vllm.scheduler import LoadSpec, RemoteSource, StepMessages
from kvtriton.integrations.vllm.settings import from_extra_config
from kvtriton.integrations.vllm.worker import WorkerSide
from kvtriton.testing.child import AgentChild

from .connector_bed import BLOCKS, BS, DIM, HEADS
from .connector_bed import COMMON as BED

#: the connector bed's settings, with room for a first transfer on a loaded 2-core host (a rank's
#: death is known from its lifeline, whatever these say)
COMMON = {**BED, "timeout_s": 20.0, "handshake_timeout_s": 5.0}

__all__ = ["BS", "COMMON", "drive", "hold", "landed", "prefill_child", "prefill_regions", "source", "worker"]


def prefill_regions(seed: int, rank: int = 0, tp: int = 1, fill: bool = True) -> list[Region]:
    """Rank ``rank`` of ``tp`` of an engine whose global KV is random from ``seed`` (zeros: a
    decode); the same bytes in any process."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(BLOCKS, HEADS, BS, DIM, generator=gen) if fill else torch.zeros(BLOCKS, HEADS, BS, DIM)
    per = HEADS // tp
    return [Region.attention("l0", k[:, rank * per:(rank + 1) * per].contiguous(), layout="HND", block_size=BS,
                             total_heads=HEADS)]


def worker(engine: str, extra: dict | None = None, *, rank: int = 0, tp: int = 1, seed: int | None = None,
           serve: bool = False) -> tuple[WorkerSide, list[Region]]:
    """A worker side (a prefill when ``serve``) and its regions; ``seed``: its KV (None: zeros)."""
    regs = prefill_regions(seed if seed is not None else 0, rank, tp, fill=seed is not None)
    return WorkerSide(from_extra_config({**COMMON, **(extra or {})}), engine_id=engine, rank=rank, tp_size=tp,
                      regions=regs, serve=serve), regs


def hold(prefill: WorkerSide, rid: str, blocks, pack_for: str | None = None) -> None:
    msgs = StepMessages(holds={rid: tuple(blocks)}, pack_for={rid: pack_for} if pack_for else {})
    prefill.bind(msgs)
    prefill.after_forward()


def source(engine: str, port: int, rid: str, blocks, tp: int = 1) -> RemoteSource:
    return RemoteSource(engine, "127.0.0.1", port, tp, rid, tuple(blocks), BS)


def drive(decode: WorkerSide, loads: dict[str, tuple[RemoteSource, tuple[int, ...]]],
          seconds: float = 20.0) -> dict[str, tuple[set[int], float]]:
    """Issue ``loads`` (decode request -> (its source, its local blocks)) in one step, then step
    until each finished; per request its load error blocks and the seconds it took."""
    msgs = StepMessages(loads={req: LoadSpec(req, src, src.block_ids, tuple(local))
                               for req, (src, local) in loads.items()})
    t0 = time.monotonic()
    decode.bind(msgs)
    decode.start_loads()
    decode.clear()
    out: dict[str, tuple[set[int], float]] = {}
    errors: set[int] = set()
    while len(out) < len(loads):
        assert time.monotonic() - t0 < seconds, f"loads not finished in {seconds} s: {set(loads) - set(out)}"
        _, recving = decode.finished()
        errors |= decode.load_errors()
        for req in recving:
            local = set(loads[req][1])
            out[req] = (errors & local, time.monotonic() - t0)
        time.sleep(0.005)
    return out


def landed(decode_regions: list[Region], seed: int, remote, local) -> bool:
    """Whether the decode's blocks ``local`` hold, byte for byte, the blocks ``remote`` of the
    prefill engine whose KV is random from ``seed`` (every head)."""
    src = prefill_regions(seed)[0].streams[0]
    dst = decode_regions[0].streams[0]
    return all(torch.equal(dst[t].view(torch.uint8), src[s].view(torch.uint8)) for s, t in zip(remote, local))


def prefill_child(conn, engine: str, port: int, seed: int, extra: dict) -> None:
    """A TP1 prefill worker side serving ``port`` with KV from ``seed``; ``ready`` gives its
    port. Command: ``hold(rid, blocks)``. Its agent progresses on its own thread."""
    prefill, _ = worker(engine, {"port": port, **extra}, seed=seed, serve=True)
    child = AgentChild(conn, [prefill.agent], {"hold": lambda rid, blocks: hold(prefill, rid, blocks)},
                       step=lambda: None, busy=lambda: False, idle_wait_s=0.05, errors=(Exception,))
    child.ready(port)
    try:
        child.run()
    finally:
        prefill.close()
