"""The real-engine cases CI leaves to the benchmark (``tests/helpers/engine_matrix.py``): runs the
vLLM engine test modules with every case of their matrix (``KVTRITON_ENGINE_MATRIX=full``), the
same test functions and oracles as CI, CI's cases included. Today: the other direction of each
of ``tests/engines/test_vllm_mixed_cache.py``'s two tests (the GQA target with its MLA draft,
staged at P1->D2, sliced per request at P2->D1).

Needs the vLLM bed (``make vllm-bed``, or ``KVTRITON_VLLM_PYTHON``); exit status: pytest's. From
the repository root::

    .venv/bin/python bench/vllm_matrix.py                  # every module with a moved case
    .venv/bin/python bench/vllm_matrix.py -k "1-2"         # more pytest arguments
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["tests/engines/test_vllm_mixed_cache.py"]  # the modules with cases in the benchmark only


def main(argv: list[str]) -> int:
    env = {**os.environ, "KVTRITON_ENGINE_MATRIX": "full"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *MODULES, *argv], cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
