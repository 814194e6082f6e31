"""The SGLang test bed's interpreter, for the SGLang test modules (one place for the rule)."""

import os
from pathlib import Path

import pytest

from beds import child_env

ROOT = Path(__file__).resolve().parents[2]  # the checkout (tests/helpers/ -> ..)


def sglang_bed_python() -> str:
    """``KVTRITON_SGLANG_PYTHON``, else the bed ``make sglang-bed`` builds. Missing: an error in
    CI (``make test`` builds the bed first, so these tests never skip there), elsewhere the
    calling test module is skipped."""
    py = os.environ.get("KVTRITON_SGLANG_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")
    if not Path(py).exists():
        if os.environ.get("CI"):
            raise RuntimeError(f"SGLang test bed missing: {py} (run `make sglang-bed`)")
        pytest.skip(f"no SGLang test bed at {py}: `make sglang-bed` builds it", allow_module_level=True)
    return py


def bed_env() -> dict:
    """The environment of a bed process: this checkout first on ``PYTHONPATH``, so the bed runs
    the code under test whichever checkout its editable kvtriton points at."""
    return child_env()
