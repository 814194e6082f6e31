"""kvtriton: hetero-TP KV-cache transfer between prefill and decode engines over NIXL."""

from .errors import (
    IncompatibleRemoteError,
    KVTritonError,
    LaunchError,
    PeerDisconnectedError,
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
from .agent import FreedRequest, RequestResult, TransferAgent
from .ops import pack, unpack
from .plan import (
    CostModel,
    Mode,
    Segment,
    StagedRead,
    TokenMap,
    TransferPlan,
    build_plan,
    compact_request,
    compact_tokens,
    direct_runs,
)
from .regions import Kind, Layout, Region, RegionSpec, classify_layer
from .topology import head_range, replicate_sources, split_sources

__version__ = "0.1.0"

__all__ = [
    "FreedRequest", "RequestResult", "TransferAgent", "pack", "unpack",
    "CostModel", "IncompatibleRemoteError", "KVTritonError", "Kind", "LaunchError", "Layout", "Mode",
    "PeerDisconnectedError", "PlanError", "ProtocolError", "Region", "RegionError", "RegionSpec",
    "RequestAbortedError", "RequestRejectedError", "Segment", "StagedRead", "StagingError", "TopologyError",
    "TokenMap", "TransferPlan", "TransferTimeoutError", "TransportError", "build_plan", "classify_layer",
    "compact_request", "compact_tokens", "direct_runs", "head_range", "replicate_sources", "split_sources",
]
