"""``python bench/<name>.py`` runs ``python -m bench.<name>``: each benchmark imports its siblings
as ``bench.<sibling>``, which a script started by path cannot (its folder, not the checkout, is
first on ``sys.path``). The script imports this module (found beside it) before anything else
and is replaced by the package's module, with the same arguments and the same process id; the
checkout goes first on ``PYTHONPATH`` rather than on this process's ``sys.path``."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def run_as_module(script: str) -> None:
    """Replace this process with ``python -m bench.<stem of script>`` (never returns)."""
    path = Path(script).resolve()
    root = str(path.parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", f"bench.{path.stem}", *sys.argv[1:]], env)
