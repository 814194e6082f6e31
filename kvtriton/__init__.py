"""kvtriton: hetero-TP KV-cache transfer between prefill and decode engines over NIXL.

Names are resolved lazily (PEP 562): ``import kvtriton.plan`` (pure numpy) must not pull in torch,
Triton or NIXL through this package's ``__init__``; ``from kvtriton import TransferAgent`` imports
the agent (and torch) only when asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from .errors import (
    IncompatibleRemoteError,
    IntegrityError,
    KVTritonError,
    LaunchError,
    PeerDisconnectedError,
    PeerRefusedError,
    PlanError,
    ProtocolError,
    RegionError,
    RequestAbortedError,
    RequestRejectedError,
    StagingError,
    TopologyError,
    TransferTimeoutError,
    TransportError,
)

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first access)
_LAZY = {
    **dict.fromkeys(["FreedRequest", "RequestResult", "TransferAgent"], ".agent"),
    **dict.fromkeys(["pack", "unpack"], ".ops"),
    # Mode and StagedRead: release 0.1's names (see kvtriton.plan), kept for one release
    **dict.fromkeys(["CostModel", "Mode", "Route", "Way", "Segment", "Payload", "StagedRead", "TokenMap",
                     "TransferPlan", "build_plan", "compact_request", "compact_tokens", "direct_runs",
                     "head_range", "replicate_sources", "split_sources"], ".plan"),
    **dict.fromkeys(["Kind", "Layout", "RegionSpec", "classify_layer"], ".spec"),
    "Region": ".regions",
}

__all__ = [
    "FreedRequest", "RequestResult", "TransferAgent", "pack", "unpack",
    "CostModel", "IncompatibleRemoteError", "KVTritonError", "Kind", "LaunchError", "Layout", "Mode",
    "PeerDisconnectedError", "PeerRefusedError", "PlanError", "ProtocolError", "Region", "RegionError", "RegionSpec",
    "RequestAbortedError", "RequestRejectedError", "Segment", "StagedRead", "StagingError", "TopologyError",
    "TokenMap", "TransferPlan", "TransferTimeoutError", "TransportError", "build_plan", "classify_layer",
    "compact_request", "compact_tokens", "direct_runs", "head_range", "replicate_sources", "split_sources",
    "Route", "Way", "Payload", "IntegrityError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # a submodule (kvtriton.ops, kvtriton.plan, ...): the eager __init__ used to import them all
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'kvtriton' has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
