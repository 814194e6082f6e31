"""The CI engine beds: real vLLM and SGLang engines (and their stand-ins) the tests and benchmarks
drive. They live beside ``tests/`` and ``bench/``, not in the wheel: a user tests with
:mod:`kvtriton.testing` (oracles, the in-process pair, agent children), never with these.

* :mod:`.vllm_bed`, :mod:`.vllm_pair`, :mod:`.vllm_models`, :mod:`.vllm_hooks`, :mod:`.vllm_patches`,
  :mod:`.vllm_debug`:
  vLLM engine processes on tiny local models, the two-engine pair, the bed's observing hooks and
  the capability patches applied in the bed alone, its debugging aids.
* :mod:`.sglang_bed`, :mod:`.sglang_servers`, :mod:`.sglang_launch`, :mod:`.sglang_hooks`, and
  ``sglang_cpu_ops/`` (a stand-in ``sgl_kernel`` package): SGLang's classes and servers.

Every process a bed starts runs ``python -m beds.<module>`` in an engine's venv, where ``beds`` is
not installed: :func:`child_env` puts this checkout on the child's ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: beds/, tests/, bench/, kvtriton/


def child_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's environment) with the checkout first on ``PYTHONPATH``, so
    that a child started with another Python (an engine's venv) imports ``beds``."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [out.get("PYTHONPATH")])])
    return out
