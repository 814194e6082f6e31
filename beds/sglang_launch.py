"""``python -m beds.sglang_launch ARGS``: SGLang's ``python -m sglang.launch_server ARGS``
with the test bed's hooks (:mod:`.sglang_hooks`) installed in every process of the server.

Why a wrapper and not a plugin: SGLang spawns its scheduler processes (``mp`` start method
``spawn``), and a spawned child re-imports the parent's main module as ``__mp_main__`` before it
runs its target, so the install at the top of this module runs in each of them too, before SGLang
defines or makes a sender. This module must stay the main module for that (``runpy`` with
``alter_sys`` would make SGLang's module the one children import), so the ``__main__`` block
calls what ``sglang/launch_server.py``'s does. Without ``$KVTRITON_SGLANG_BED_DIR`` it installs
nothing and the server is SGLang's own.
"""

from __future__ import annotations

import os
import sys

from beds import sglang_hooks

sglang_hooks.install()


def main(argv: list[str]) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
