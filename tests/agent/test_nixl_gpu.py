"""The agent over VRAM: NIXL registration of CUDA memory, and prefill/decode processes on one GPU
moving KV cache to each other over UCX (``cuda_ipc`` between the processes), pull and push,
every received block byte-checked against the global KV and every other byte against a snapshot
(:mod:`kvtriton.testing.cluster` with ``device="cuda"``).

They skip without a CUDA device, and without NIXL (the lent GPU machine has none: carry the
trimmed bundle that ``scripts/nixl_bundle.py`` builds; ``bench/gpu_check.sh`` installs it).
UCX is set up for device memory here unless the environment already says otherwise:
``UCX_TLS`` names the CUDA transports (plus shared memory and TCP for the notifications), and
``UCX_MODULE_DIR`` points at the UCX modules bundled in NIXL's wheel (``nixl_cu*.libs/ucx``,
where ``libuct_cuda`` lives), so no system UCX is picked up by mistake.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtriton.testing.cluster import Cluster, ClusterConfig
from kvtriton.testing.oracle import RegionModel

pytest.importorskip("nixl", reason="NIXL is not installed: pip install 'kvtriton[nixl]', or on a machine without "
                                   "network carry the bundle of scripts/nixl_bundle.py (see README, GPU)")
pytestmark = [pytest.mark.gpu, pytest.mark.nixl]

UCX_TLS = "cuda_ipc,cuda_copy,sm,self,tcp"


def ucx_module_dir() -> Path | None:
    """The UCX modules shipped in NIXL's CUDA wheel (``nixl_cuNN.libs/ucx``), or None."""
    for major in (torch.version.cuda or "").split(".")[:1] + ["13", "12"]:
        spec = importlib.util.find_spec(f"nixl_cu{major}") if major else None
        if spec is not None and spec.origin:
            d = Path(spec.origin).parent.parent / f"nixl_cu{major}.libs" / "ucx"
            if any(d.glob("libuct_cuda.so*")):
                return d
    return None


@pytest.fixture(scope="module", autouse=True)
def ucx_for_vram():
    if not torch.cuda.is_available():
        yield  # every test here is skipped by the gpu marker
        return
    mods = ucx_module_dir()
    if mods is None:
        pytest.skip("the installed NIXL has no UCX CUDA module (nixl_cu*.libs/ucx/libuct_cuda.so*): "
                    "VRAM cannot move between processes")
    saved = {k: os.environ.get(k) for k in ("UCX_TLS", "UCX_MODULE_DIR")}
    os.environ.setdefault("UCX_TLS", UCX_TLS)
    os.environ.setdefault("UCX_MODULE_DIR", str(mods))
    print(f"UCX_TLS={os.environ['UCX_TLS']} UCX_MODULE_DIR={os.environ['UCX_MODULE_DIR']}")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_vram_registration():
    """A CUDA buffer registers as VRAM on its device, its descriptors prepare, and all of it is
    released again."""
    from kvtriton.transport.nixl import NixlTransport

    dev = torch.cuda.current_device()
    buf = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    with NixlTransport("vram-check") as t:
        reg = t.register([buf], "VRAM")
        descs = np.array([[buf.data_ptr() + i * (1 << 20), 1 << 20, dev] for i in range(4)], dtype=np.int64)
        pl = t.prep_local(descs, "VRAM")
        t.release_list(pl)
        t.deregister(reg)


def models():
    # a SPLIT region (staged when TP differs), an MLA region (REPLICATE: DIRECT runs read or
    # written straight from the cache) and a SPLIT region of another dtype and head_dim
    return [RegionModel.gqa("attn.0", 8, 128), RegionModel.mla("mla.0", 576),
            RegionModel.gqa("attn.1", 4, 64, torch.float32)]


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1)])
def test_two_processes_on_one_gpu_pull_and_push(p_tp, d_tp):
    """Prefill and decode ranks in separate processes, caches and staging in VRAM, the Triton
    kernels on the agents' streams (compiled by warmup before the first request), pull and push
    requests in flight together; byte-exact, nothing outside the received blocks changed, every
    hold freed."""
    cfg = ClusterConfig(models=models(), p_tp=p_tp, d_tp=d_tp, mode="both", block_size=16, p_blocks=96,
                        d_blocks=96, p_layout="NHD", d_layout="HND", staging_bytes=8 << 20, slot_bytes=64 << 10,
                        timeout_s=30, impl="auto", device="cuda", warmup=True)
    with Cluster(cfg, start_timeout_s=120) as c:
        reqs = c.requests(8, n_blocks=5) + c.requests(2, n_blocks=20)
        c.transfer_exact(reqs)
