"""Which agent tests run with NIXL's progress thread (the library's default, ``kvtriton.transport.progress``).

Most modules here script the protocol step by step in one process ("the source progresses, then
the decode") and count on a message landing only when its receiver progresses, as it did before
the thread was on by default; with the thread, a message or a READ's completion arrives between
two scripted calls, and such a test's expectation (one fence per load, a pull handled within three
calls, a load still in flight when the decode sleeps) no longer describes a fixed order. Those run
with the thread off (``KVTRITON_NIXL_PROGRESS_THREAD=0``). The modules in :data:`THREAD_ON` run the
default: the multi-process clusters, the liveness and fault tests, the step loads the thread was
made for, and the modules written or adjusted for it; the real-engine tests (tests/engines) run
the default too. A test may still set the variable itself (monkeypatch), after this hook.
"""

from __future__ import annotations

import os

import pytest

from kvtriton.transport.progress import ENV

THREAD_ON = {
    "test_block_size_agent", "test_cluster", "test_decode_restart", "test_direct_slice", "test_faults",
    "test_forget", "test_liveness", "test_one_sided", "test_staging_whole", "test_step_loads",
    "test_transport_nixl", "test_xpyd",
}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before any fixture of the item (a module-scoped pair of agents included) builds an agent
    os.environ[ENV] = "1" if item.module.__name__.rsplit(".", 1)[-1] in THREAD_ON else "0"
