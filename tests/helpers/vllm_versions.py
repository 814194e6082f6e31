"""A check script run against every vLLM the bed holds (the bed's 0.32 and upstream 0.33 and 0.34,
unpacked beside it by ``scripts/setup_vllm_venv.sh``), the three at once.

Each run is an interpreter importing vLLM: tens of seconds of CPU on a 2-core host. Started side
by side when a module's first check asks for them, they share the cores instead of queueing, and
each test (one per version) waits for its own result."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .vllm_bed_python import ROOT, vllm_bed_python

VERSIONS = ("0.32", "0.33", "0.34")


def upstream_dir(version: str) -> Path:
    return Path(vllm_bed_python()).parent.parent / f"vllm{version.replace('.', '')}"


class VersionChecks:
    """``script`` (a path, run by the bed's Python) against each of :data:`VERSIONS`: upstream
    first on ``PYTHONPATH``, this checkout's kvtriton after it (where the bed's editable install
    is elsewhere). An upstream version that is not there is not run: its test skips outside CI
    (in CI the run fails on the missing import, never skips)."""

    def __init__(self, script: str | os.PathLike, folder: Path, timeout_s: float = 300.0):
        self.folder, self.timeout_s = folder, timeout_s
        self.runs: dict[str, subprocess.Popen] = {}
        for version in VERSIONS:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            if version != "0.32":
                up = upstream_dir(version)
                if not up.exists() and not os.environ.get("CI"):
                    continue
                env.update(PYTHONPATH=os.pathsep.join([str(up), str(ROOT), env.get("PYTHONPATH", "")]),
                           VLLM_TARGET_DEVICE="cpu")
            # output to files, not pipes: a run that logs more than a pipe holds must not stall
            with open(folder / f"{version}.out", "w") as out, open(folder / f"{version}.err", "w") as err:
                self.runs[version] = subprocess.Popen([vllm_bed_python(), str(script)], stdout=out, stderr=err,
                                                      text=True, env=env)

    def result(self, version: str) -> tuple[int, str, str]:
        """``(returncode, stdout, stderr)`` of ``version``'s run, once it ended."""
        proc = self.runs.get(version)
        if proc is None:
            pytest.skip(f"no upstream vLLM {version} next to the test bed")
        try:
            proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return (proc.returncode, (self.folder / f"{version}.out").read_text(),
                (self.folder / f"{version}.err").read_text())

    def close(self) -> None:
        for proc in self.runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
