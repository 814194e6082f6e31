"""Model presets, TP pairs and block-id patterns of the sweep (KV geometry only). Every benchmark
that needs a model or a request shape takes it from here; the presets are the library's table
(:data:`kvtriton.plan.models.PRESETS`, what ``kvtriton plan --model`` takes), each region given
the torch dtype the timing runs allocate."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtriton.plan import ceil_div, head_range
from kvtriton.plan.models import PRESETS as MODELS
from kvtriton.plan.models import ModelKV
from kvtriton.regions import Kind, Layout, Region, RegionSpec
from kvtriton.testing.oracle import RegionModel


@dataclass(frozen=True)
class Preset:
    name: str
    regions: tuple[RegionModel, ...]

    @property
    def split_layers(self) -> int:
        return sum(1 for r in self.regions if r.kind is Kind.SPLIT)

    @property
    def replicate_layers(self) -> int:
        return len(self.regions) - self.split_layers

    def truncated(self, layers: int) -> Preset:
        """The first ``layers`` regions plus the first region of any kind they lack, so a mixed
        cache stays mixed (timing runs must fit a small machine)."""
        head = list(self.regions[:layers])
        kinds = {r.kind for r in head}
        extra = []
        for r in self.regions[layers:]:
            if r.kind not in kinds:
                kinds.add(r.kind)
                extra.append(r)
        return Preset(self.name, tuple(head + extra))

    @classmethod
    def of(cls, model: ModelKV) -> Preset:
        """The library's model with each region's dtype as torch's."""
        return cls(model.name, tuple(RegionModel(x.name, x.kind, x.total_heads, x.head_dims, getattr(torch, x.dtype))
                                     for x in model.layers))


def specs_for(preset: Preset, rank: int, tp: int, num_blocks: int, block_size: int,
              layout: Layout = Layout.HND) -> list[RegionSpec]:
    """Region specs of one rank, built on the meta device (geometry only, no memory)."""
    out = []
    for m in preset.regions:
        if m.kind is Kind.REPLICATE:
            t = torch.empty(num_blocks, block_size, m.head_dims[0], dtype=m.dtype, device="meta")
            out.append(Region.mla(m.name, t, block_size=block_size).spec)
            continue
        h0, h1 = head_range(rank, tp, m.total_heads)
        shape = ((num_blocks, block_size, h1 - h0, m.head_dims[0]) if layout is Layout.NHD
                 else (num_blocks, h1 - h0, block_size, m.head_dims[0]))
        t = torch.empty(shape, dtype=m.dtype, device="meta")
        out.append(Region.attention(m.name, t, t, layout=layout, block_size=block_size,
                                    total_heads=m.total_heads).spec)
    return out


def _gqa(prefix, layers, heads, head_dim, dtype=torch.bfloat16):
    return tuple(RegionModel.gqa(f"{prefix}.{i}", heads, head_dim, dtype) for i in range(layers))


def _mla(prefix, layers, dim=576, dtype=torch.bfloat16):
    return tuple(RegionModel.mla(f"{prefix}.{i}", dim, dtype) for i in range(layers))


# the library's table (kvtriton/plan/models.py), one place for the models' numbers
PRESETS = {name: Preset.of(model) for name, model in MODELS.items()}

# (prefill TP, decode TP)
TP_PAIRS = [(1, 2), (2, 1), (4, 8), (8, 4), (2, 3), (8, 16)]
BLOCK_SIZES = [16, 64]
TOKENS = 8192


def fragmented_block_ids(n: int, num_blocks: int, run: int, seed: int) -> np.ndarray:
    """Block ids as a paged allocator hands them out after some churn: runs of ``run``
    consecutive blocks at shuffled places."""
    rng = np.random.default_rng(seed)
    starts = rng.permutation(num_blocks // run)[: ceil_div(n, run)] * run
    return (starts[:, None] + np.arange(run)[None, :]).reshape(-1)[:n]


#: the tiny models bench/pd_vllm.py runs on real engines, one per ``--model`` kind, as presets (the
#: engines run fp32): (preset, block size the engines use, prompt tokens). The sweep's descriptors
#: section plans one request of each (no engines), for ours against NixlConnector's count per kind.
PD_MODEL_KINDS = {
    "llama": (Preset("pd_vllm llama", _gqa("layers", 2, 2, 32, torch.float32)), 32, 333),
    "deepseek": (Preset("pd_vllm deepseek", _mla("layers", 2, dtype=torch.float32)), 16, 333),
    "llama+mla-draft": (Preset("pd_vllm llama+mla-draft", _gqa("layers", 2, 2, 32, torch.float32)
                               + _mla("draft", 1, dtype=torch.float32)), 16, 333),
}
#: the TP pairs of pd_vllm's model-kind rows
PD_KIND_PAIRS = [(2, 1), (1, 2)]
