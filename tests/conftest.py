"""Test configuration.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs (Triton picks the
interpreter at decoration time), so it is set here, before kvtriton is imported anywhere.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Spinning OpenMP workers steal the second core from the peer process in multi-process tests.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def gen():
    """A seeded generator: every test gets fresh random data, reproducibly."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu)] if HAS_CUDA else ["cpu"])
def device(request):
    """The device tests run on, with the ``gpu`` marker on CUDA so that ``pytest -m gpu`` runs
    every test that takes it there (on a CPU machine the interpreter runs them)."""
    return request.param


@pytest.fixture
def engines():
    """``engines(...)`` makes a prefill/decode pair of agents over NIXL (helpers.engines.Engines: the
    two-engine harness kvtriton.testing.pair.EnginePair); every pair made is closed after the test."""
    from helpers.engines import Engines  # imported lazily: it needs NIXL, most tests do not

    made = []

    def make(*args, **kw):
        made.append(Engines(*args, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()
