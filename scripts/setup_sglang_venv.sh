#!/usr/bin/env bash
# Builds the SGLang test bed: a venv with sglang 0.5.23 (installed --no-deps) and the part of its
# requirements that runs on a CPU, on SGLang's own torch pin (2.14.1) with the torchvision that
# matches it (SGLang imports torchvision at module level; PyPI's torchvision beside another torch
# fails to load), NIXL in kvtriton's tested range, and kvtriton editable without dependencies.
# The CUDA-only kernels SGLang lists (flashinfer, sgl-kernel, deep-ep, cutlass, tilelang, ...) are
# left out: the CPU path (SGLANG_USE_CPU_ENGINE=1, torch_native attention) never imports them.
# Usage: setup_sglang_venv.sh VENV [KVTRITON_SRC]   (KVTRITON_SRC: the checkout installed editable)
set -euo pipefail
VENV=${1:-.venv-sglang}
SRC=${2:-.}
PYTHON=${PYTHON:-python3}
SGLANG=sglang==0.5.23
TORCH=torch==2.14.1
TORCHVISION=torchvision==0.29.1
CPU_INDEX=https://download.pytorch.org/whl/cpu

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q packaging
# the CPU wheels are a fraction of PyPI's CUDA build (which pulls ~4 GB of nvidia-* libraries);
# where that index cannot be reached, PyPI's build runs on a CPU too
if ! "$PY" -m pip install -q --timeout 15 --retries 0 --index-url "$CPU_INDEX" "$TORCH" "$TORCHVISION"; then
    echo "setup_sglang_venv: $CPU_INDEX unreachable, installing $TORCH from PyPI"
    "$PY" -m pip install -q "$TORCH" "$TORCHVISION"
fi
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"$PY" -m pip download -q --no-deps -d "$WHEELS" "$SGLANG"
WHL=$(ls "$WHEELS"/sglang-*.whl)
# sglang's requirements minus the torch family (installed above, pinned by the constraints) and the
# CUDA-only kernel packages, which are many GB and have no CPU use
"$PY" - "$WHL" > "$WHEELS/requirements.txt" <<'PYEOF'
import sys, zipfile
from packaging.requirements import Requirement
skip = {
    "torch", "torchaudio", "torchvision", "torchcodec", "torch-memory-saver",
    "cuda-python", "flash-attn-4", "flashinfer-python", "humming-kernels", "nvidia-cutlass-dsl",
    "nvidia-mathdx", "nvidia-ml-py", "nvshmem4py-cu13", "quack-kernels", "sgl-deep-ep",
    "sgl-deep-gemm", "sgl-flash-mla", "sglang-kernel", "tilelang", "apache-tvm-ffi", "kernels",
    "deepseek-recipe", "py-spy", "decord2", "av",
}
def norm(name):
    return name.lower().replace("_", "-")
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if norm(req.name) in skip:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        req.extras = set()
        print(req)
PYEOF
"$PY" -m pip freeze | grep -iE '^(torch|torchvision)==' > "$WHEELS/constraints.txt"
"$PY" -m pip install -q -r "$WHEELS/requirements.txt" -c "$WHEELS/constraints.txt"
"$PY" -m pip install -q --no-deps "$WHL"
"$PY" -m pip install -q "nixl>=1.5.1,<1.5.2" msgpack einops cryptography pytest -c "$WHEELS/constraints.txt"
# under the checkout's install lock: `make test` builds the beds side by side, and setuptools
# writes the checkout's kvtriton.egg-info for each editable install (no flock: unlocked)
LOCKED=()
command -v flock > /dev/null && LOCKED=(flock "${KVTRITON_INSTALL_LOCK:-/tmp/kvtriton-install.lock}")
"${LOCKED[@]}" "$PY" -m pip install -q --no-deps -e "$SRC"
"$PY" -c "import sglang, torch, torchvision, nixl, kvtriton; print('sglang', sglang.__version__, 'torch', torch.__version__)"
