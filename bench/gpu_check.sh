#!/usr/bin/env bash
# GPU lane, one prepared script (< 5 minutes on one GPU): the `gpu`-marked tests, then a short
# sweep. Everything lands in bench/results/gpu/ (CSV + summary from the sweep, pytest log and
# JUnit XML, nvidia-smi). Exit status: non-zero if the tests or the sweep failed.
#   usage: bash bench/gpu_check.sh          (or: make gpu-check)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-bench/results/gpu}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to torch; nothing to do" >&2
    exit 2
fi
# The interpreter must be off on a GPU machine (kernels would be decorated for host memory).
unset TRITON_INTERPRET KVTRITON_IMPL
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
start=$(date +%s)

# 1. Tests: the whole kernel suite on CUDA (its device fixture carries the gpu marker), the
#    >2^31-element cache and the no-host-sync check. ~3 minutes at most, compile included.
timeout 200 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$OUT/pytest-gpu.xml" \
    2>&1 | tee "$OUT/pytest-gpu.txt"
tests=${PIPESTATUS[0]}

# 2. Short sweep (descriptor counts, repack, kernel GB/s; e2e when NIXL is installed).
timeout 90 "$PY" bench/sweep.py --quick --out "$OUT" 2>&1 | tee "$OUT/sweep.txt"
sweep=${PIPESTATUS[0]}

echo "gpu_check: tests exit $tests, sweep exit $sweep, $(( $(date +%s) - start )) s; results in $OUT" \
    | tee "$OUT/status.txt"
[ "$tests" -eq 0 ] && [ "$sweep" -eq 0 ]
