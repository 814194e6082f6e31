"""What can be checked of the GPU lane without a GPU: the width of the kernels' compiled global
accesses (Triton compiles for sm_90 on any machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
