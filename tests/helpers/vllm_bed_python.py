"""The vLLM test bed's interpreter, for the real-engine test modules (one place for the rule)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the checkout (tests/helpers/ -> ..)


def vllm_bed_python() -> str:
    """``KVTRITON_VLLM_PYTHON``, else the bed ``make vllm-bed`` builds. Missing: an error in CI
    (``make test`` builds the bed first, so these tests never skip there), elsewhere the calling
    test module is skipped."""
    py = os.environ.get("KVTRITON_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(py).exists():
        if os.environ.get("CI"):
            raise RuntimeError(f"vLLM test bed missing: {py} (run `make vllm-bed`)")
        pytest.skip(f"no vLLM test bed at {py}: `make vllm-bed` builds it", allow_module_level=True)
    return py
