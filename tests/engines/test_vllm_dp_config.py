"""DP ranks through vLLM's own config classes, in the vLLM test bed's interpreter: here, not in
tests/unit, because tests/unit runs while the beds install (a half-built bed has no vLLM yet)."""

from __future__ import annotations

import json
import os
import subprocess


def test_dp_ranks_with_vllms_own_config_classes():
    """vLLM's ``VllmConfig``/``ParallelConfig`` (TP2, DP2) with vLLM's own DP suffixing, and the
    connector's scheduler side built on each: own engine id, own port range, and the params it
    would return name them."""
    from helpers.vllm_bed_python import ROOT, vllm_bed_python

    py = vllm_bed_python()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([py, str(ROOT / "tests" / "helpers" / "vllm_dp_config.py"), "5710"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == [["P_dp0", 5710, 5710], ["P_dp1", 5712, 5712]]
