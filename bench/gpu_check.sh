#!/usr/bin/env bash
# GPU lane: one prepared script for a CUDA machine, run with the python that is there as it is
# (the lent H200: torch + CUDA, Triton, pytest, hypothesis, msgpack, einops; no network, and no NIXL
# unless its bundle is carried: step 6).
# Steps, each under a timeout (and all together under GPU_CHECK_BUDGET seconds, default 480),
# each one's result printed as it ends:
#   1 versions   python, torch/CUDA, Triton and the test dependencies, nvidia-smi
#   2 install    this checkout, editable, with no index and no dependencies
#   3 ptx        both kernels compiled for sm_90 by this Triton: 16-byte global accesses
#   4 tests      the `gpu`-marked tests: kernels and launcher validation on CUDA, the >2^31-element
#                cache, the no-host-sync check
#   5 sweep      bench/sweep.py --quick --sections kernels; GB/s and pct_of_copy of pack and unpack
#   6 nixl       VRAM registration, then prefill and decode processes on this GPU over UCX cuda_ipc,
#                pull and push, byte-checked (the `nixl and gpu` tests), when NIXL is importable or
#                the trimmed bundle of scripts/nixl_bundle.py for this python is in $NIXL_BUNDLE
#                (default .nixl/: `make nixl-bundle` here, then carry .nixl); it is unpacked to a
#                temporary folder put on PYTHONPATH, nothing installed
# Without a CUDA device (a dry run, e.g. on CPU) it stops after step 3 with "no CUDA device" and
# exit status 2; otherwise it exits 0 when every step that ran passed, 1 when one did not.
# Output: $OUT when set (the device tool brings back what is written there), else
# bench/results/gpu/: gpu_check.log (everything), status.txt (one line per step), pytest-gpu.xml,
# sweep.csv and summary.md, pytest-nixl.xml.
#   usage: bash bench/gpu_check.sh     (or: make gpu-check; PY=/path/to/python to choose one)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
    PY=python3
    [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
OUT=${OUT:-bench/results/gpu}
NIXL_BUNDLE=${NIXL_BUNDLE:-.nixl}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
STATUS="$OUT/status.txt"
: > "$LOG"
: > "$STATUS"
# The kernels must be compiled, not interpreted, here (conftest still turns the interpreter on for
# pytest when torch sees no GPU); KVTRITON_IMPL would silently swap in the torch reference.
unset TRITON_INTERPRET KVTRITON_IMPL
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
START=$(date +%s)
DEADLINE=$(( START + ${GPU_CHECK_BUDGET:-480} ))
FAILED=0

say() { echo "gpu_check: $*" | tee -a "$LOG"; }  # to the terminal and the log
report() { echo "gpu_check: $*" | tee -a "$LOG" "$STATUS"; }  # the same, and status.txt

# step NAME MAX_SECONDS CMD...: run CMD under a timeout (capped by the time left), output to the
# terminal and the log, result to status.txt. Returns CMD's status (124: timed out).
step() {
    local name=$1 limit=$2 left t0 rc
    shift 2
    left=$(( DEADLINE - $(date +%s) ))
    (( limit > left )) && limit=$left
    if (( limit < 10 )); then
        report "[$name] not run: the ${GPU_CHECK_BUDGET:-480} s budget is spent"
        FAILED=1
        return 124
    fi
    echo "== [$name] $* (timeout ${limit} s)" | tee -a "$LOG"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    local verdict=ok
    (( rc == 124 || rc == 137 )) && verdict="TIMED OUT after ${limit} s"
    (( rc != 0 && rc != 124 && rc != 137 )) && verdict="FAILED (exit $rc)"
    report "[$name] $verdict, $(( $(date +%s) - t0 )) s"
    (( rc != 0 )) && FAILED=1
    return "$rc"
}

finish() {  # finish EXIT_STATUS MESSAGE
    report "$2 ($(( $(date +%s) - START )) s; results in $OUT)"
    exit "$1"
}

# 1. Versions (and whether torch sees a GPU).
step versions 60 "$PY" - <<'EOF'
import importlib, platform, sys
print(f"python {platform.python_version()} ({sys.executable}), {platform.machine()}")
for name in ("torch", "triton", "numpy", "msgpack", "einops", "pytest", "hypothesis", "setuptools", "nixl"):
    try:
        print(f"{name} {getattr(importlib.import_module(name), '__version__', '(no version)')}")
    except Exception as e:  # a missing optional package is information, not a failure
        print(f"{name} missing ({type(e).__name__})")
import torch
print(f"torch CUDA {torch.version.cuda}, device: "
      + (torch.cuda.get_device_name() if torch.cuda.is_available() else "none visible"))
EOF
command -v nvidia-smi > /dev/null && nvidia-smi >> "$LOG" 2>&1

# 2. Install the checkout: editable, nothing fetched (the machine has no network).
if ! step install 180 bash -c '"$0" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        && "$0" -c "import kvtriton, kvtriton.kernels.pack; print(\"kvtriton from\", kvtriton.__file__)"' "$PY"; then
    finish 1 "the install failed: nothing else can run"
fi

# 3. 16-byte accesses in the sm_90 PTX this Triton produces (no GPU needed).
step ptx 180 "$PY" scripts/ptx_check.py

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>> "$LOG"; then
    (( FAILED )) && finish 1 "no CUDA device, and a step above FAILED"
    finish 2 "no CUDA device visible to torch: versions, install and the PTX check done, GPU steps not run"
fi

# 4. The gpu-marked tests (those that also need NIXL run in step 6).
step tests 300 "$PY" -m pytest -m "gpu and not nixl" -q -rs -p no:cacheprovider --junitxml="$OUT/pytest-gpu.xml"

# 5. Kernel throughput against a device copy of the same bytes.
if step sweep 180 "$PY" bench/sweep.py --quick --sections kernels --out "$OUT"; then
    "$PY" - "$OUT/sweep.csv" <<'EOF' 2>&1 | tee -a "$LOG"
import csv, sys
# sweep.csv is long form: one row per (measurement, metric) with p20/p50/p80
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["section"] == "kernels" and r["provider"] == "kvtriton"]
got = {}
for r in rows:
    got.setdefault((r["case"], r["op"], r["note"]), {})[r["metric"]] = r["p50"]
for (case, op, note), m in got.items():
    print(f"  {case:<28} {op:<7} {m.get('gbps', ''):>9} GB/s  {m.get('pct_of_copy', ''):>6} % of copy  {note}")
EOF
fi

# 6. The agent over VRAM, when NIXL is there or its bundle for this python was carried.
PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
BUNDLE=
if ! "$PY" -c 'import nixl' 2> /dev/null; then
    BUNDLE=$(compgen -G "$NIXL_BUNDLE/nixl-*-$PYTAG-cu*.tar.xz" | head -n 1)
    if [ -n "$BUNDLE" ]; then
        NIXL_SITE=$(mktemp -d)
        # unpacked, not installed; libcudart (the UCX CUDA module needs it) from torch's CUDA wheels
        if step nixl-bundle 60 "$PY" - "$BUNDLE" "$NIXL_SITE" <<'EOF'; then
import glob, os, sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    tar.extractall(sys.argv[2], filter="data")
print(open(os.path.join(sys.argv[2], "BUNDLE.txt")).readline().strip())
libs = sorted({os.path.dirname(p) for d in sys.path if os.path.isdir(d)
               for p in glob.glob(os.path.join(d, "nvidia", "**", "libcudart.so.*"), recursive=True)})
print("libcudart from:", " ".join(libs) or "none found (the system's, if any)")
open(os.path.join(sys.argv[2], "ld_path"), "w").write(":".join(libs))
EOF
            export PYTHONPATH="$NIXL_SITE${PYTHONPATH:+:$PYTHONPATH}"
            LD_EXTRA=$(cat "$NIXL_SITE/ld_path")
            [ -n "$LD_EXTRA" ] && export LD_LIBRARY_PATH="$LD_EXTRA${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    else
        report "[nixl] skipped: NIXL is not importable and no bundle for $PYTAG is in $NIXL_BUNDLE/" \
            "(make nixl-bundle here, then carry $NIXL_BUNDLE)"
    fi
fi
if "$PY" -c 'import nixl' 2> /dev/null; then
    step nixl 240 "$PY" -m pytest -m "nixl and gpu" -q -rs -s -p no:cacheprovider \
        --junitxml="$OUT/pytest-nixl.xml" tests/agent/test_nixl_gpu.py tests/agent/test_agent_streams.py
elif [ -n "$BUNDLE" ]; then
    report "[nixl] FAILED: $BUNDLE is unpacked, but NIXL does not import from it:"
    "$PY" -c 'import nixl' 2>&1 | tail -n 5 | tee -a "$LOG"
    FAILED=1
fi

(( FAILED )) && finish 1 "a step FAILED (see status.txt)"
finish 0 "every step passed"
