"""What can be checked of the GPU lane without a GPU: the width of the kernels' compiled global
accesses (Triton compiles for sm_90 on any machine), and bench/gpu_check.sh's dry run.

The same PTX check runs in ``make test`` under the oldest Triton we check (.venv-triton36), and on
the GPU machine as step 3 of gpu_check.sh.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVTRITON_IMPL")}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset
    return {**env, **extra}


def test_kernels_compile_to_16_byte_accesses():
    """Both kernels, compiled for sm_90, copy with 16-byte loads and stores on the cache and the
    staging side. A dropped or misplaced alignment hint compiles fine and runs correctly, just at a
    fraction of the bandwidth."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "ptx_check.py")], env=_env(), capture_output=True,
                         text=True, timeout=300)
    if res.returncode == 2:
        pytest.skip(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "_pack_kernel" in res.stdout and "_unpack_kernel" in res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a dry run needs a machine without CUDA")
def test_gpu_check_dry_run(tmp_path):
    """gpu_check.sh without a GPU: versions, the no-index install and the PTX check run and pass,
    then it stops with 'no CUDA device' and exit status 2, its logs under $OUT."""
    res = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, capture_output=True, text=True,
                         env=_env(OUT=str(tmp_path), PY=sys.executable, PIP_NO_INDEX="1"), timeout=400)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "no CUDA device" in out.strip().splitlines()[-1], out
    status = (tmp_path / "status.txt").read_text()
    for step in ("versions", "install", "ptx"):
        assert f"[{step}] ok" in status, status
    assert "[tests]" not in status and "[sweep]" not in status
    log = (tmp_path / "gpu_check.log").read_text()
    assert f"torch {torch.__version__}" in log and "kvtriton from" in log and "ptx_check: Triton" in log
