# Two commands on a fresh machine:  make sweep   |   make test
# `setup` makes .venv once: torch first (pinned, so pip never swaps in a multi-GB CUDA build on a
# CPU machine; on Linux x86_64 with a GPU the same pin resolves to the CUDA wheel), then kvtriton
# with its nixl/test/bench extras (NIXL's wheels depend on torch, hence the order).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python

.PHONY: setup sweep test gpu-check clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[nixl,test,bench]"
	touch $@

sweep: setup
	$(PY) bench/sweep.py

test: setup
	$(PY) -m pytest -q

gpu-check: setup
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
