"""Every ``>>>`` example in kvtriton's docstrings (and the engine beds') runs (here rather than with pytest's
``--doctest-modules`` so that conftest has set TRITON_INTERPRET before any kernel is decorated)."""

import doctest
import importlib
import pkgutil

import pytest

import beds
import kvtriton

MODULES = sorted(m.name for pkg in (kvtriton, beds) for m in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    try:
        module = importlib.import_module(name)
    except ImportError as e:  # an optional dependency (nixl) that this machine lacks
        pytest.skip(f"{name}: {e}")
    failed, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failed == 0, f"{failed} docstring example(s) of {name} failed (printed above)"
