"""Small agents over real NIXL for the peer-table tests: one GQA region (1 KiB a block at TP1),
8 KiB of staging in 1 KiB slots, the torch path; each keeps its regions on ``test_regions``."""

from __future__ import annotations

import torch

from kvtriton.agent import TransferAgent
from kvtriton.testing.oracle import RegionModel, load_source, make_global_kv, make_rank_regions
from kvtriton.testing.rogue import BS, PACKING_MODEL

MODELS = [RegionModel.gqa("l0", 4, 16)]
KW = dict(staging_bytes=8 << 10, slot_bytes=1024, impl="torch", cost=PACKING_MODEL)


class Agents:
    """``agents(engine, seed, rank=, tp=, **kw)`` makes an agent (``kw`` over :data:`KW`);
    :meth:`close` closes every one made."""

    def __init__(self) -> None:
        self.made: list[TransferAgent] = []

    def __call__(self, engine: str, seed: int, *, rank: int = 0, tp: int = 1, **kw) -> TransferAgent:
        regs = make_rank_regions(MODELS, rank, tp, 64, BS, gen=torch.Generator().manual_seed(seed))
        a = TransferAgent(engine, rank, tp, regs, **{**KW, **kw})
        a.test_regions = regs  # type: ignore[attr-defined]
        self.made.append(a)
        return a

    def close(self) -> None:
        for a in self.made:
            a.close()


def request_kv(p: TransferAgent, src, seed: int):
    """Fresh random KV of ``len(src)`` blocks, loaded into prefill ``p``'s blocks ``src``."""
    kv = make_global_kv(MODELS, len(src), BS, torch.Generator().manual_seed(seed))
    load_source(p.test_regions, 0, 1, kv, src)  # type: ignore[attr-defined]
    return kv
