"""The block-size-change harness: two engines whose block sizes differ (the decode cache padded)."""

import torch

from kvtriton.testing.oracle import RegionModel
from kvtriton.testing.pair import EnginePair

MODELS = [RegionModel.gqa("l0", 4, 16), RegionModel.mla("mla", 24, torch.float16),
          RegionModel.gqa("l1", 4, 8, torch.float32)]


def Pair(p_tp, d_tp, p_bs, d_bs, mode, seed=0, models=MODELS, p_storage="joint", d_storage="separate",
         **agent_kw) -> EnginePair:
    """The two-engine harness with block sizes ``p_bs`` -> ``d_bs`` (the decode cache padded: its
    blocks are not contiguous), chunks of 4 KiB unless ``agent_kw`` says otherwise."""
    return EnginePair(p_tp, d_tp, models=models, mode=mode, seed=seed, block_size=p_bs, d_block_size=d_bs,
                      p_layout="HND" if p_storage == "vllm_cpu" else "NHD", p_storage=p_storage,
                      d_storage=d_storage, d_pad_blocks=1, **{"chunk_bytes": 4096, **agent_kw})

