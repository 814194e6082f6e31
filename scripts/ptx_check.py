"""Compile this checkout's pack and unpack kernels for sm_90 and check their global accesses are
16 bytes wide (the logic: :mod:`kvtriton.ptx_check`, which ``kvtriton doctor`` runs too).

Needs Triton only (no GPU, no torch, no installed kvtriton: the kernels and the check are imported
from this checkout), so it runs in the small Triton-only venv ``make test`` builds for the oldest
Triton we check, in the main venv, and on a GPU machine before anything is installed
(bench/gpu_check.sh).

Prints one line per kernel (``name: N x op, ...``) and exits 0 when every access is 16 bytes wide,
1 when not, 2 when this Triton has no CUDA backend able to compile.
usage: python scripts/ptx_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    sys.path.insert(0, str(ROOT))  # the checkout's kvtriton/ (its __init__ imports neither torch nor NIXL)
    from kvtriton import kernels
    from kvtriton.ptx_check import check

    status, lines = check(kernels)
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
