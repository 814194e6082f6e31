"""The planner is pure: importing it (and the torch-free region spec) loads no torch, Triton or NIXL.

Checked in a fresh interpreter, since this test process has torch loaded already (conftest)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_plan_loads_no_torch_triton_or_nixl():
    code = ("import sys, kvtriton.plan, kvtriton.spec; "
            "print(sorted(m for m in ('torch', 'triton', 'nixl') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_import_wire_loads_no_torch():
    """The wire protocol takes its spec names from the torch-free ``kvtriton.spec`` (not ``regions``)."""
    code = ("import sys, kvtriton.protocol.wire; "
            "print(sorted(m for m in ('torch', 'triton', 'nixl', 'kvtriton.regions') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
