"""The two-engine agent harness over real NIXL with the models most agent tests use (the
``engines`` fixture of ``tests/conftest.py`` builds it)."""

import torch

from kvtriton.testing.oracle import RegionModel
from kvtriton.testing.pair import EnginePair

MODELS = [RegionModel.gqa("l0", 4, 16), RegionModel.mla("mla", 24, torch.float16),
          RegionModel.gqa("l1", 4, 8, torch.float32)]


def Engines(p_tp, d_tp, *, models=MODELS, **kw) -> EnginePair:
    """The two-engine harness (:class:`kvtriton.testing.pair.EnginePair`), these models by default."""
    return EnginePair(p_tp, d_tp, models=models, **kw)

