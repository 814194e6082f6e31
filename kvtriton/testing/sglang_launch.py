"""``python -m kvtriton.testing.sglang_launch ARGS``: SGLang's ``sglang.launch_server ARGS`` with the
test bed's hooks (:mod:`.sglang_hooks`) installed in every process of the server.

Why a wrapper and not a plugin: SGLang spawns its scheduler processes (``mp`` start method
``spawn``), and a spawned child re-imports the parent's main module as ``__mp_main__`` before it
runs its target, so the install at the top of this module runs in each of them too, before SGLang
defines or makes a sender. Without ``$KVTRITON_SGLANG_BED_DIR`` it installs nothing and the server
is SGLang's own.
"""

from __future__ import annotations

import runpy

from kvtriton.testing import sglang_hooks

sglang_hooks.install()

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
