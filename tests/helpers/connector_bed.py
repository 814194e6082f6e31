"""Two vLLM connector worker sides (a prefill serving its handshake port, a decode) in this
process over real NIXL, driven with the step messages vLLM's scheduler side would send; no vLLM."""

import time

import torch

from beds.vllm_bed import free_port_range
from kvtriton import Region
from kvtriton.integrations.vllm.scheduler import LoadSpec, RemoteSource, StepMessages
from kvtriton.integrations.vllm.settings import from_extra_config
from kvtriton.integrations.vllm.worker import WorkerSide

BLOCKS, HEADS, BS, DIM = 16, 2, 4, 32


COMMON = {"host": "127.0.0.1", "staging_bytes": 1 << 20, "slot_bytes": 4096, "timeout_s": 3.0,
          "handshake_timeout_s": 1.0, "handshake_attempts": 1}


def regions(gen, fill: bool):
    k = torch.randn(BLOCKS, HEADS, BS, DIM, generator=gen) if fill else torch.zeros(BLOCKS, HEADS, BS, DIM)
    return [Region.attention("l0", k, layout="HND", block_size=BS, total_heads=HEADS)]


class Bed:
    def __init__(self, gen, p_extra=None, d_extra=None, engine="P"):
        self.port = free_port_range(1)
        self.gen, self.engine, self.p_extra = gen, engine, p_extra or {}
        self.prefill = self._prefill()
        self.d_regions = regions(gen, fill=False)
        self.decode = WorkerSide(from_extra_config({**COMMON, **(d_extra or {})}), engine_id="D",
                                 rank=0, tp_size=1, regions=self.d_regions, serve=False)
        self._n = 0

    def _prefill(self):
        self.p_regions = regions(self.gen, fill=True)
        return WorkerSide(from_extra_config({**COMMON, "port": self.port, **self.p_extra}),
                          engine_id=self.engine, rank=0, tp_size=1, regions=self.p_regions, serve=True)

    def restart_prefill(self):
        self.prefill.close()
        self.prefill = self._prefill()

    def hold(self, rid, blocks):
        self.prefill.bind(StepMessages(holds={rid: tuple(blocks)}))
        self.prefill.after_forward()

    def load(self, rid, remote, local, host="127.0.0.1", port=None, engine=None, seconds=10.0):
        """Issue one load; returns (finished, load error blocks)."""
        self._n += 1
        req = f"d{self._n}"
        src = RemoteSource(engine or self.engine, host, port or self.port, 1, rid, tuple(remote), BS)
        self.decode.bind(StepMessages(loads={req: LoadSpec(req, src, tuple(remote), tuple(local))}))
        self.decode.start_loads()
        self.decode.clear()
        errors: set[int] = set()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            _, recving = self.decode.finished()
            errors |= self.decode.load_errors()
            if req in recving:
                return True, errors
            time.sleep(0.01)
        return False, errors

    def assert_landed(self, remote, local):
        src, dst = self.p_regions[0].streams[0], self.d_regions[0].streams[0]
        for s, t in zip(remote, local):
            assert torch.equal(dst[t].view(torch.uint8), src[s].view(torch.uint8)), (s, t)

    def close(self):
        self.decode.close()
        self.prefill.close()

