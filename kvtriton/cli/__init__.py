"""The ``kvtriton`` command (console entry point ``kvtriton``, or ``python -m kvtriton``).

* ``kvtriton plan``: what kvtriton would do for a model and a TP pair, per decode rank
  (:mod:`.plan`; pure planning, no torch);
* ``kvtriton doctor``: what this host has for kvtriton, each item ok or missing and what to do
  (:mod:`.doctor`);
* ``kvtriton costmodel``: the cached cost model of this host, measured when asked
  (:mod:`kvtriton.costmodel`, also ``python -m kvtriton.costmodel``).

Each subcommand's module is imported only when it runs, so ``kvtriton plan`` never imports torch.
Exit status: 0 done, 1 a required part missing (doctor), 2 bad arguments or a pair the planner
refuses (the typed error on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# subcommand -> (module, help); each module has add_arguments(parser) and run(args) -> int
_COMMANDS = {
    "plan": (".plan", "explain the plan of a model and a TP pair, per decode rank"),
    "doctor": (".doctor", "check what this host has for kvtriton (NIXL, UCX, torch, Triton, CUDA, cost model)"),
    "costmodel": ("kvtriton.costmodel", "show this host's cost model (measured and cached when there is none)"),
}


def _module(name: str):
    path = _COMMANDS[name][0]
    return importlib.import_module(path, __name__) if path.startswith(".") else importlib.import_module(path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtriton", description="Hetero-TP KV-cache transfer: plans, host checks, "
                                 "cost model.")
    from .. import __version__

    ap.add_argument("--version", action="version", version=f"kvtriton {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="{" + ",".join(_COMMANDS) + "}", required=True)
    parsers = {name: sub.add_parser(name, help=help_, description=help_) for name, (_, help_) in _COMMANDS.items()}
    # only the chosen subcommand's module is imported (argparse needs its options to parse them)
    args_in = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in args_in if a in _COMMANDS), None)
    if chosen is not None:
        _module(chosen).add_arguments(parsers[chosen])
    args = ap.parse_args(args_in)
    # the command's output goes to args.stdout; anything else printed meanwhile goes to stderr, so
    # that --json output parses: NIXL's logger writes INFO lines to the sys.stdout current when nixl
    # is first imported, which is inside this block
    args.stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        return int(_module(args.command).run(args))
