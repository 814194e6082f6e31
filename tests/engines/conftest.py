"""Fixtures of the real-engine tests: the tiny GQA Llama (written once per session with the vLLM
bed's Python: engines only read it, and each write is an interpreter start and a torch import,
tens of seconds on a loaded 2-core host) and the prompts; a module that needs another model
defines its own ``model_dir``.

Every vLLM engine these tests start forks its TP workers (``beds.vllm_bed.WORKER_START``): vLLM's
CPU platform spawns them, and each imported vLLM again, ~20 s of a TP2 engine's start on two cores
(docs/operations.md, CI); vLLM forks them on GPUs, and what the tests check runs after the start.
``KVTRITON_BED_WORKER_START=spawn`` in the environment gives vLLM's own way back."""

import os
import random
import subprocess

import pytest
from helpers.vllm_bed_python import vllm_bed_python
from helpers.vllm_engines import LENGTHS

from beds import child_env
from beds.vllm_bed import WORKER_START

os.environ.setdefault(WORKER_START, "fork")  # engines inherit it (child_env)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([vllm_bed_python(), "-c", "import sys; from beds.vllm_bed import make_tiny_llama; "
                    "make_tiny_llama(sys.argv[1])", str(path)], check=True, timeout=300,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
    return path


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(512) for _ in range(n)] for n in LENGTHS]
