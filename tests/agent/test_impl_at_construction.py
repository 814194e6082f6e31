"""An agent decides its repack implementation when it is made, not in its first request.

Why: ``impl="auto"`` (the connectors' default) asks whether Triton's kernels were decorated under
the interpreter, and the first answer imports Triton and decorates them. Asked by the first
repack, that import ran inside the engine's first load that travelled a repacking way: 16-22 ms
in vLLM's decode worker (``bench/pd_vllm.py``'s first 8-in-flight cell, every load of that step
waiting on it, where its repeats took 7-16 ms). A name that is no implementation fails at
construction too, with a typed error, before any NIXL agent exists.
"""

import os
import subprocess
import sys

import pytest
import torch

from kvtriton.agent import TransferAgent
from kvtriton.errors import LaunchError
from kvtriton.regions import Region

pytestmark = pytest.mark.nixl  # the second test's agent is a real one


def _regions() -> list[Region]:
    k = torch.randn(8, 16, 2, 64, generator=torch.Generator().manual_seed(0))
    return [Region.attention("layer0", k, k.clone(), block_size=16, layout="NHD", total_heads=2)]


def test_an_unknown_impl_fails_at_construction():
    with pytest.raises(LaunchError, match=r"impl='cuda' is not a known implementation"):
        TransferAgent("E", 0, 1, _regions(), impl="cuda", staging_bytes=1 << 20)


# a fresh interpreter, without the interpreter flag: this process decorated the kernels long ago
_CHILD = """
import sys, torch
from kvtriton.agent import TransferAgent
from kvtriton.regions import Region
k = torch.randn(8, 16, 2, 64)
before = "kvtriton.kernels.pack" in sys.modules
a = TransferAgent("E", 0, 1, [Region.attention("layer0", k, k.clone(), block_size=16, layout="NHD", total_heads=2)],
                  staging_bytes=1 << 20)
after = "kvtriton.kernels.pack" in sys.modules
a.close()
print(before, after)
"""


def test_auto_imports_the_kernels_when_the_agent_is_made():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVTRITON_IMPL")}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout


_NO_TRITON = """
import sys, torch
sys.modules["triton"] = None  # Triton cannot be imported
from kvtriton.agent import TransferAgent
from kvtriton.ops.launch import resolve_impl
from kvtriton.regions import Region
k = torch.randn(8, 16, 2, 64)
a = TransferAgent("E", 0, 1, [Region.attention("layer0", k, k.clone(), block_size=16, layout="NHD", total_heads=2)],
                  staging_bytes=1 << 20)
a.close()
print(resolve_impl("auto", torch.device("cpu")))
"""


def test_an_agent_that_repacks_on_the_torch_path_needs_no_triton():
    """Deciding at construction must not make Triton a condition of constructing: ``"auto"`` on CPU
    runs the torch path, which never needed it (a zero-copy-only agent never repacks at all)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVTRITON_IMPL")}
    out = subprocess.run([sys.executable, "-c", _NO_TRITON], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "torch", out.stdout
